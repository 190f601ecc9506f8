"""A process group's backend and timeout arguments, checked as torch reads them, before torch sees them.

Pure Python (the registered backend names are passed in), so the grid's options
(:class:`~hypergrid.runtime.registry.GroupOptions`) and the Megatron configuration check alike.

**Backends.** torch matches a backend name exactly, case aside (``"gloo "`` is not gloo: it warns
that the device capability of ``'gloo '`` is unknown, then fails with ``Unknown backend type``
when the first group is made), and splits the per-device form ``"cpu:gloo,cuda:nccl"`` on ``,``
and ``:`` only.

**Timeouts.** torch hands a group's timeout to its C++ backends as whole milliseconds
(``std::chrono::milliseconds``: a ``timedelta`` is truncated), and gloo turns those into
microseconds in a signed 64-bit count. So a timeout under one millisecond becomes 0 ms, which
expires at once, and a longer one than the count holds wraps around: gloo then refuses it with
``Invalid timeout`` when the group is created (``timedelta.max`` is such a timeout), after the
grid and its arguments looked fine. torch's ``_check_valid_timeout`` checks only the type. The
bound, measured on gloo: torch 2.13 takes up to ``(2**63 - 1) // 1000`` ms, torch 2.15 up to
``(2**63 - 2**38 - 1) // 1000`` ms (its count is rounded to 24 significant bits on the way, which
reaches ``2**63`` from ``2**63 - 2**38`` microseconds); the smaller holds for both.

Example::

    >>> from datetime import timedelta
    >>> check_timeout("timeout", timedelta(minutes=10))
    datetime.timedelta(seconds=600)
    >>> check_timeout("timeout", timedelta.max)   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: timeout must be at most 106751987 days, 23:39:36.868000 (9223371761976868 ms; ...), got 999999999 days, 23:59:59.999999
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Optional

__all__ = [
    "MIN_TIMEOUT",
    "MAX_TIMEOUT",
    "MAX_TIMEOUT_MS",
    "RESERVED_NAME_CHARACTERS",
    "as_int",
    "positive_int",
    "int_at_least",
    "check_timeout",
    "backend_names",
    "backend_parts",
    "backend_on",
    "validate_shape_and_names",
]

#: The longest timeout in whole milliseconds: its microseconds, rounded as torch 2.15 rounds them,
#: must fit gloo's int64.
MAX_TIMEOUT_MS = (2**63 - 2**38 - 1) // 1000
#: The longest timeout torch's gloo backend takes, about 292,471 years.
MAX_TIMEOUT = timedelta(milliseconds=MAX_TIMEOUT_MS)
#: The shortest: torch counts whole milliseconds, and 0 ms expires at once.
MIN_TIMEOUT = timedelta(milliseconds=1)


def check_timeout(name: str, value: timedelta) -> timedelta:
    """``value`` if torch can use it as a group's timeout; ValueError naming ``name`` otherwise.

    Example::

        >>> check_timeout("timeout", timedelta(microseconds=500))   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: timeout must be at least 1 ms (torch counts whole milliseconds: ...), got 0:00:00.000500
    """
    if value <= timedelta(0):
        raise ValueError(f"{name} must be positive, got {value}")
    if value < MIN_TIMEOUT:
        raise ValueError(f"{name} must be at least 1 ms (torch counts whole milliseconds: a shorter "
                         f"timeout is 0 ms and expires at once), got {value}")
    if value // MIN_TIMEOUT > MAX_TIMEOUT_MS:
        raise ValueError(f"{name} must be at most {MAX_TIMEOUT} ({MAX_TIMEOUT_MS} ms; gloo counts timeouts in "
                         f"64-bit microseconds and refuses longer ones as 'Invalid timeout'), got {value}")
    return value


def backend_names(backend: str, known: Sequence[str]) -> list[str]:
    """The backend names in ``backend``, lowercased, each one of ``known`` (torch's registered
    backends); ValueError naming ``backend`` and what was expected otherwise.

    ``backend`` is one name (``"nccl"``) or torch's per-device form (``"cpu:gloo,cuda:nccl"``).

    Example::

        >>> backend_names("cpu:gloo,cuda:NCCL", ["gloo", "nccl"])
        ['gloo', 'nccl']
        >>> backend_names("gloo ", ["gloo", "nccl"])   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: backend 'gloo ' holds whitespace, which torch does not strip; expected a backend torch knows, ...
    """
    known = list(known)
    expected = f"expected a backend torch knows, one of {known}, or the per-device form 'cpu:gloo,cuda:nccl'"
    if any(c.isspace() for c in backend):
        raise ValueError(f"backend {backend!r} holds whitespace, which torch does not strip; {expected}")
    parts = backend.lower().split(",")
    per_device = len(parts) > 1 or ":" in backend
    names: list[str] = []
    devices: list[str] = []
    for part in parts:
        device, _, name = part.rpartition(":") if per_device else ("", "", part)
        if per_device and (not device or ":" in device):
            raise ValueError(f"backend {backend!r}: {part!r} is not a device:backend pair; {expected}")
        if device in devices:
            raise ValueError(f"backend {backend!r} names device {device!r} twice; {expected}")
        if name not in known:
            raise ValueError(
                f"backend {backend!r}: {name!r} is not a backend torch knows; registered backends "
                f"are {known} (a device-specific form like 'cpu:gloo,cuda:nccl' is accepted too)"
            )
        names.append(name)
        devices.append(device)
    return names


#: Characters a dim name may not hold, because hypergrid's own keys are built with them (``dp-cp``,
#: ``expert:tp``, ``embd(pp)``, lists joined by ``,``), and a name holding one would read as a key.
RESERVED_NAME_CHARACTERS = "-:(),/"


def as_int(value: object, what: str) -> int:
    """``value`` as a Python int by :func:`operator.index` (numpy and torch integer scalars too).

    A bool is refused: a shape of ``[True, 2]`` is a bug, not a size of 1.

    Example::

        >>> import numpy as np
        >>> as_int(np.int64(4), "shape[0]")
        4
        >>> as_int(2.0, "shape[0]")
        Traceback (most recent call last):
        ...
        TypeError: shape[0] must be an int, got float 2.0
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def validate_shape_and_names(shape: object, dim_names: object) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Check a (shape, dim_names) pair and return them as tuples.

    Raises ``TypeError`` for values of the wrong type and ``ValueError`` for values of the right
    type that make no grid, naming the offending value in each case.

    Example::

        >>> validate_shape_and_names([2, 4], ["tp", "dp"])
        ((2, 4), ('tp', 'dp'))
        >>> validate_shape_and_names([2, 0], ["tp", "dp"])
        Traceback (most recent call last):
        ...
        ValueError: shape[1] (dim 'dp') must be a positive integer, got 0
    """
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"shape must be a list or tuple of ints, got {type(shape).__name__} {shape!r}")
    if isinstance(dim_names, (str, bytes)) or not isinstance(dim_names, Sequence):
        raise TypeError(
            f"dim_names must be a list or tuple of str, got {type(dim_names).__name__} {dim_names!r}"
        )
    if len(shape) == 0:
        raise ValueError("shape must have at least one dim, got an empty shape")
    if len(shape) != len(dim_names):
        raise ValueError(
            f"len(shape) {len(shape)} != len(dim_names) {len(dim_names)}: shape={list(shape)}, "
            f"dim_names={list(dim_names)}"
        )
    for i, name in enumerate(dim_names):
        if not isinstance(name, str):
            raise TypeError(f"dim_names[{i}] must be a str, got {type(name).__name__} {name!r}")
        if not name or not name.strip():
            raise ValueError(f"dim_names[{i}] must be a non-empty name, got {name!r}")
        reserved = sorted({c for c in name if c in RESERVED_NAME_CHARACTERS or c.isspace()})
        if reserved:
            raise ValueError(
                f"dim_names[{i}] {name!r} contains {''.join(reserved)!r}; dim names may not hold "
                f"{RESERVED_NAME_CHARACTERS!r} or spaces, which build hypergrid's group keys "
                f"(e.g. 'dp-cp', 'expert:tp'), so a key made from {name!r} would be ambiguous. "
                f"Use '_' instead."
            )
    seen: set[str] = set()
    for name in dim_names:
        if name in seen:
            raise ValueError(f"dim_names must be unique, {name!r} appears twice in {list(dim_names)}")
        seen.add(name)
    sizes = tuple(as_int(size, f"shape[{i}] (dim {dim_names[i]!r})") for i, size in enumerate(shape))
    for i, size in enumerate(sizes):
        if size <= 0:
            raise ValueError(f"shape[{i}] (dim {dim_names[i]!r}) must be a positive integer, got {size}")
    return sizes, tuple(dim_names)


def positive_int(what: str, value: object) -> int:
    """``value`` if it is a positive int (a bool is not); ValueError naming ``what`` otherwise.

    For values read from a config or given as sizes, where anything but a positive int is a
    mistake of value (the shape's own sizes go through :func:`as_int`, which takes numpy scalars).

    Example::

        >>> positive_int("gpus_per_node", 8)
        8
        >>> positive_int("nvlink_domain", 0)
        Traceback (most recent call last):
        ...
        ValueError: nvlink_domain must be a positive integer, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def int_at_least(value: object, what: str, minimum: int, error: Callable[[str], Exception] = ValueError) -> int:
    """``value`` as an int (:func:`as_int`) of at least ``minimum``; ``error`` naming ``what`` otherwise.

    Example::

        >>> int_at_least(0, "tensor_model_parallel_size", 1)
        Traceback (most recent call last):
        ...
        ValueError: tensor_model_parallel_size must be an integer >= 1, got 0
    """
    number = as_int(value, what)
    if number < minimum:
        raise error(f"{what} must be an integer >= {minimum}, got {number}")
    return number


def backend_parts(backend: str) -> list[tuple[str, str]]:
    """The (device, backend name) pairs of ``backend``, lowercased; device ``""`` for the one-name
    form. Lenient (whitespace around parts is dropped): for reading a backend torch has accepted;
    :func:`backend_names` checks one a user gives.

    Example::

        >>> backend_parts("cpu:gloo, cuda:NCCL"), backend_parts("nccl")
        ([('cpu', 'gloo'), ('cuda', 'nccl')], [('', 'nccl')])
    """
    text = str(backend).strip().lower()
    if ":" not in text:
        return [("", text)] if text else []
    parts = []
    for pair in text.split(","):
        device, _, name = pair.strip().partition(":")
        parts.append((device.strip(), name.strip()))
    return parts


def backend_on(device_type: str, backend: str) -> Optional[str]:
    """The backend name ``backend`` gives ``device_type``: ``"nccl"`` for ``"cpu:gloo,cuda:nccl"`` on
    ``"cuda"``; the name itself for the one-name form; None where it names none for that device.

    Example::

        >>> backend_on("cuda", "cpu:gloo,cuda:nccl"), backend_on("cuda", "gloo"), backend_on("xpu", "cpu:gloo")
        ('nccl', 'gloo', None)
    """
    for device, name in backend_parts(backend):
        if device in ("", device_type):
            return name or None
    return None
