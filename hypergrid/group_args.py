"""A process group's backend and timeout arguments, checked as torch reads them, before torch sees them.

Pure Python (the registered backend names are passed in), so the grid's options
(:class:`~hypergrid.groups.GroupOptions`) and the Megatron configuration check alike.

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

from collections.abc import Sequence
from datetime import timedelta

__all__ = ["MIN_TIMEOUT", "MAX_TIMEOUT", "MAX_TIMEOUT_MS", "check_timeout", "backend_names"]

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
