"""How process groups get made: the strategies, the process-wide default, and the choice per job.

A *strategy* is what a user asks for; a *creation mode* is what actually runs for one request,
decided from how the job was started, which every rank of the world sees alike:

``auto`` (default)
    The right mode for the job. On a default group bound to a device whose backend splits
    (``init_process_group("nccl", device_id=...)``), or with TorchComms enabled
    (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``), torch builds every communicator of that backend by
    splitting the world's, which every rank of the world must join: ``split``. Otherwise (lazy
    NCCL, gloo): ``local``.
``local``
    Only the members of a group call ``new_group(..., use_local_synchronization=True)``. A rank's
    cost is its own groups, whatever the world size. Refused where the world must split: a
    member-only ``new_group`` there waits forever for ranks that never join.
``split``
    Every rank of the world calls ``split_group`` once per request, passing its own group.
    Where the world cannot split, falls back to ``local`` (alike on every rank).
``enumerate``
    Megatron-Core's exact call pattern: every rank calls ``new_subgroups_by_enumeration`` with
    every group of the request. O(world) per rank; for tests that patch torch's constructors.

The process-wide default is ``auto``; :func:`set_default_strategy` or the environment variable
``HYPERGRID_STRATEGY`` change it for grids and adapters that are not given a strategy.

Example::

    >>> parse_strategy("local")
    <Strategy.LOCAL: 'local'>
    >>> default_strategy()                    # nothing set
    <Strategy.AUTO: 'auto'>
    >>> set_default_strategy("enumerate"); default_strategy()
    <Strategy.ENUMERATE: 'enumerate'>
    >>> set_default_strategy(None)            # back to the environment / auto
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch.distributed as dist

from ._torch_compat import torchcomms_enabled, world_split_source

__all__ = [
    "Strategy",
    "CreationMode",
    "STRATEGY_ENV",
    "parse_strategy",
    "set_default_strategy",
    "default_strategy",
    "resolve_strategy",
    "JobKind",
    "job_kind",
    "creation_mode",
]

logger = logging.getLogger("hypergrid.strategy")

#: The environment variable naming the process-wide default strategy.
STRATEGY_ENV = "HYPERGRID_STRATEGY"


class Strategy(str, enum.Enum):
    """What a user asks for (see the module docstring)."""

    AUTO = "auto"
    LOCAL = "local"
    SPLIT = "split"
    ENUMERATE = "enumerate"


class CreationMode(str, enum.Enum):
    """What runs for one request: every rank of the world computes the same one."""

    LOCAL = "local"
    SPLIT = "split"
    ENUMERATE = "enumerate"


_NAMES = [s.value for s in Strategy]
_process_default: Optional[Strategy] = None


def parse_strategy(value: Union[str, Strategy]) -> Strategy:
    """``value`` as a :class:`Strategy`; a clear error for anything else.

    Example::

        >>> parse_strategy("split")
        <Strategy.SPLIT: 'split'>
        >>> parse_strategy("fast")
        Traceback (most recent call last):
        ...
        ValueError: strategy must be one of ['auto', 'local', 'split', 'enumerate'], got 'fast'
    """
    if isinstance(value, Strategy):
        return value
    if not isinstance(value, str):
        raise TypeError(f"strategy must be a str, one of {_NAMES}, got {type(value).__name__} {value!r}")
    try:
        return Strategy(value)
    except ValueError:
        raise ValueError(f"strategy must be one of {_NAMES}, got {value!r}") from None


def set_default_strategy(strategy: Union[str, Strategy, None]) -> None:
    """Set the strategy of every grid and adapter made afterwards without one (None: unset).

    Takes precedence over ``HYPERGRID_STRATEGY``. Every rank must set the same.

    Example::

        >>> set_default_strategy("enumerate")   # e.g. for tests that patch torch's constructors
        >>> set_default_strategy(None)
    """
    global _process_default
    _process_default = None if strategy is None else parse_strategy(strategy)


def default_strategy() -> Strategy:
    """The process-wide default: :func:`set_default_strategy`, else ``HYPERGRID_STRATEGY``, else auto.

    Example::

        >>> default_strategy()
        <Strategy.AUTO: 'auto'>
    """
    if _process_default is not None:
        return _process_default
    raw = os.environ.get(STRATEGY_ENV)
    if raw is None or raw == "":
        return Strategy.AUTO
    try:
        return parse_strategy(raw.strip().lower())
    except ValueError:
        raise ValueError(
            f"the environment variable {STRATEGY_ENV} is set to {raw!r}, which is not a strategy; "
            f"expected one of {_NAMES} (or unset it)"
        ) from None


def resolve_strategy(strategy: Union[str, Strategy, None]) -> Strategy:
    """``strategy`` parsed, or the process-wide default when it is None.

    Example::

        >>> resolve_strategy(None), resolve_strategy("local")
        (<Strategy.AUTO: 'auto'>, <Strategy.LOCAL: 'local'>)
    """
    return default_strategy() if strategy is None else parse_strategy(strategy)


@dataclass(frozen=True)
class JobKind:
    """How the job was started, as far as group creation cares; alike on every rank.

    ``splits``: the default group is bound to a device whose backend builds new communicators by
    splitting the world's (NCCL with ``device_id``), so groups of that backend must be split by
    every rank. ``torchcomms``: TorchComms is enabled; every group, of any backend, is split.
    ``backend``: the default group's backend name (lower case), None when not initialized.

    Example::

        >>> JobKind(splits=False, torchcomms=False, backend="gloo").must_split("gloo")
        False
        >>> JobKind(splits=True, torchcomms=False, backend="nccl").must_split(None)
        True
        >>> JobKind(splits=True, torchcomms=False, backend="nccl").must_split("gloo")   # gloo never touches NCCL
        False
    """

    splits: bool
    torchcomms: bool
    backend: Optional[str]

    def must_split(self, backend: Optional[str]) -> bool:
        """Whether a group of ``backend`` (None: the default group's) must be made by a world-wide split."""
        if self.torchcomms:
            return True
        if not self.splits:
            return False
        return backend is None or str(backend).lower() == self.backend


def job_kind() -> JobKind:
    """The :class:`JobKind` of this process's default group (not split-capable when uninitialized).

    Example::

        >>> job_kind()          # no process group
        JobKind(splits=False, torchcomms=False, backend=None)
    """
    if not dist.is_available() or not dist.is_initialized():
        return JobKind(splits=False, torchcomms=False, backend=None)
    backend = str(dist.get_backend()).lower()
    return JobKind(splits=world_split_source() is not None, torchcomms=torchcomms_enabled(), backend=backend)


def creation_mode(strategy: Union[str, Strategy], backend: Optional[str] = None, job: Optional[JobKind] = None) -> CreationMode:
    """The mode that creates a group of ``backend`` under ``strategy`` in this job.

    Example::

        >>> creation_mode("auto", job=JobKind(splits=True, torchcomms=False, backend="nccl"))
        <CreationMode.SPLIT: 'split'>
        >>> creation_mode("auto", "gloo", job=JobKind(splits=True, torchcomms=False, backend="nccl"))
        <CreationMode.LOCAL: 'local'>
        >>> creation_mode("split", job=JobKind(splits=False, torchcomms=False, backend="gloo"))
        <CreationMode.LOCAL: 'local'>
        >>> creation_mode("local", job=JobKind(splits=True, torchcomms=False, backend="nccl"))
        Traceback (most recent call last):
        ...
        ValueError: strategy 'local' cannot create a 'nccl' group here: the default group is bound to a device whose backend splits (init_process_group(..., device_id=...)), so torch makes every new communicator by splitting the world's, which every rank must join; a member-only new_group would wait forever. Use strategy 'auto' or 'split'.
    """
    chosen = parse_strategy(strategy)
    job = job_kind() if job is None else job
    if chosen is Strategy.ENUMERATE:
        return CreationMode.ENUMERATE
    must_split = job.must_split(backend)
    if chosen is Strategy.LOCAL and must_split:
        why = (
            "TorchComms is enabled (TORCH_DISTRIBUTED_USE_TORCHCOMMS), which makes every group by "
            "split_group and refuses use_local_synchronization"
            if job.torchcomms
            else "the default group is bound to a device whose backend splits "
            "(init_process_group(..., device_id=...)), so torch makes every new communicator by "
            "splitting the world's, which every rank must join; a member-only new_group would wait forever"
        )
        shown = backend if backend is not None else job.backend
        raise ValueError(f"strategy 'local' cannot create a {shown!r} group here: {why}. Use strategy 'auto' or 'split'.")
    if chosen in (Strategy.AUTO, Strategy.SPLIT) and must_split:
        return CreationMode.SPLIT
    return CreationMode.LOCAL
