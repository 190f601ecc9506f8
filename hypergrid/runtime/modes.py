"""How process groups get made: the strategies, the process-wide default, and the choice per job.

A *strategy* is what a user asks for; a *creation mode* is what actually runs for one request,
decided from how the job was started, which every rank of the world sees alike:

``auto`` (default)
    The right mode for the job. On a default group bound to a device whose backend splits
    (``init_process_group("nccl", device_id=...)``; torch 2.15's default ``nccl``, which is
    ``nccl2``, binds itself), torch builds every communicator of that backend by splitting the
    world's, which every rank of the world must join: ``split``. Likewise where TorchComms makes
    ``new_group`` a world-wide split (torch 2.13 with ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``).
    Otherwise (an unbound world, gloo, ``nccl-legacy`` without ``device_id``, a group of another
    backend than the bound one, TorchComms building subgroups among their members as in 2.15):
    ``local``. The table of which mode runs on which job, and why, is in docs/strategies.md.
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
``fresh``
    Only the members of a group make it, as a communicator of its own, even where the world
    splits: torch is kept from splitting it off the world's (by the request's ``lazy_init``
    option where torch honours it, else by leaving the default group unbound for the call), so no
    rank outside the group takes part. What a resilient job uses on a world that splits: its
    spares make no group, and after a loss the world's communicator holds a dead rank. A fresh
    communicator costs its members a full initialization (a split is cheaper); elsewhere it is
    ``local``. Refused where torch offers no way to keep the split off (TorchComms making every
    ``new_group`` a world-wide split).

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

from ..layout.checks import backend_on
from .torch_compat import TorchCommsSubgroups, bound_split_device, torchcomms_subgroups, world_backend_on

__all__ = [
    "Strategy",
    "CreationMode",
    "STRATEGY_ENV",
    "parse_strategy",
    "set_default_strategy",
    "default_strategy",
    "resolve_strategy",
    "JobSetup",
    "job_setup",
    "creation_mode",
]

logger = logging.getLogger(__name__)

#: The environment variable naming the process-wide default strategy.
STRATEGY_ENV = "HYPERGRID_STRATEGY"


class Strategy(str, enum.Enum):
    """What a user asks for (see the module docstring)."""

    AUTO = "auto"
    LOCAL = "local"
    SPLIT = "split"
    ENUMERATE = "enumerate"
    FRESH = "fresh"


class CreationMode(str, enum.Enum):
    """What runs for one request: every rank of the world computes the same one."""

    LOCAL = "local"
    SPLIT = "split"
    ENUMERATE = "enumerate"
    FRESH = "fresh"

    @property
    def members_only(self) -> bool:
        """Whether only the members of a group take part in making it.

        Example::

            >>> CreationMode.FRESH.members_only, CreationMode.SPLIT.members_only
            (True, False)
        """
        return self in (CreationMode.LOCAL, CreationMode.FRESH)


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
        ValueError: strategy must be one of ['auto', 'local', 'split', 'enumerate', 'fresh'], got 'fast'
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
class JobSetup:
    """How the job was started, as far as group creation cares; alike on every rank.

    ``backend``: the default group's backend name (lower case), None when not initialized.
    ``split_device``: the type of the device the default group is bound to when torch splits new
    communicators of its backend there (see :func:`~hypergrid.runtime.torch_compat.bound_split_device`),
    with ``split_backend`` the world's backend on that device. ``torchcomms``: how torch makes
    subgroups under TorchComms.

    Example::

        >>> nccl = JobSetup(backend="nccl", split_device="cuda", split_backend="nccl")
        >>> nccl.must_split(None), nccl.must_split("nccl"), nccl.must_split("gloo")
        (True, True, False)
        >>> nccl.must_split("cpu:gloo,cuda:nccl")      # its CUDA half is split from the world's
        True
        >>> JobSetup(backend="gloo").must_split(None)   # not bound: communicators are made afresh
        False
    """

    backend: Optional[str] = None
    split_device: Optional[str] = None
    split_backend: Optional[str] = None
    torchcomms: TorchCommsSubgroups = TorchCommsSubgroups.OFF

    @property
    def splits(self) -> bool:
        """Whether new communicators of the world's own backend are split from the world's."""
        return self.split_device is not None or self.torchcomms is TorchCommsSubgroups.WORLD_SPLIT

    def must_split(self, backend: Optional[str]) -> bool:
        """Whether a group of ``backend`` (None: the default group's) is made by a world-wide split.

        torch splits a new group from the world's communicator when the group's backend on the
        bound device is the world's backend there (torch 2.15's ``_get_split_source`` compares
        exactly this; on 2.13 only such groups use the split, other backends ignore it). Under
        TorchComms with world-wide ``new_group`` every group but a ``fake`` one of a real world splits.
        """
        if self.torchcomms is TorchCommsSubgroups.WORLD_SPLIT:
            return not (backend is not None and _backend_on("fake", backend) and self.backend != "fake")
        if self.torchcomms is TorchCommsSubgroups.MEMBERS_ONLY or self.split_device is None:
            return False
        requested = self.split_backend if backend is None else _backend_on(self.split_device, backend)
        return requested is not None and requested == self.split_backend


def _backend_on(device_type: str, backend: str) -> Optional[str]:
    """The backend ``backend`` gives ``device_type`` (for ``"fake"``: whether the request is a
    fake-backend one, for the TorchComms rule)."""
    if device_type == "fake":
        return "fake" if str(backend).strip().lower() == "fake" else None
    return backend_on(device_type, backend)


def job_setup() -> JobSetup:
    """The :class:`JobSetup` of this process's default group (nothing splits when uninitialized).

    Example::

        >>> job_setup()          # no process group
        JobSetup(backend=None, split_device=None, split_backend=None, torchcomms=<TorchCommsSubgroups.OFF: 'off'>)
    """
    if not dist.is_available() or not dist.is_initialized():
        return JobSetup()
    device = bound_split_device()
    return JobSetup(
        backend=str(dist.get_backend()).lower(),
        split_device=device,
        split_backend=None if device is None else world_backend_on(device),
        torchcomms=torchcomms_subgroups(),
    )


def creation_mode(strategy: Union[str, Strategy], backend: Optional[str] = None, job: Optional[JobSetup] = None) -> CreationMode:
    """The mode that creates a group of ``backend`` under ``strategy`` in this job.

    Example::

        >>> bound_nccl = JobSetup(backend="nccl", split_device="cuda", split_backend="nccl")
        >>> creation_mode("auto", job=bound_nccl)
        <CreationMode.SPLIT: 'split'>
        >>> creation_mode("auto", "gloo", job=bound_nccl)
        <CreationMode.LOCAL: 'local'>
        >>> creation_mode("split", job=JobSetup(backend="gloo"))
        <CreationMode.LOCAL: 'local'>
        >>> creation_mode("fresh", job=bound_nccl), creation_mode("fresh", job=JobSetup(backend="gloo"))
        (<CreationMode.FRESH: 'fresh'>, <CreationMode.LOCAL: 'local'>)
        >>> creation_mode("local", job=bound_nccl)
        Traceback (most recent call last):
        ...
        ValueError: strategy 'local' cannot create a 'nccl' group here: the default group is bound to a device ('cuda') whose 'nccl' backend splits (init_process_group(..., device_id=...), or a backend that binds itself such as torch 2.15's nccl2), so torch makes every new 'nccl' communicator by splitting the world's, which every rank of the world must join; a member-only new_group would wait for ranks that never come. Use strategy 'auto', 'split' or 'fresh'.
    """
    chosen = parse_strategy(strategy)
    job = job_setup() if job is None else job
    if chosen is Strategy.ENUMERATE:
        return CreationMode.ENUMERATE
    must_split = job.must_split(backend)
    if chosen is Strategy.FRESH and must_split:
        if job.torchcomms is TorchCommsSubgroups.WORLD_SPLIT:
            shown = backend if backend is not None else job.backend
            raise ValueError(
                f"strategy 'fresh' cannot create a {shown!r} group here: TorchComms is enabled "
                f"(TORCH_DISTRIBUTED_USE_TORCHCOMMS) and this torch makes every new_group a split_group of the "
                f"world's, which every rank of the world must join; there is no way to make a group among its "
                f"members only. Unset TORCH_DISTRIBUTED_USE_TORCHCOMMS, or use strategy 'auto' or 'split'."
            )
        return CreationMode.FRESH
    if chosen is Strategy.LOCAL and must_split:
        if job.torchcomms is TorchCommsSubgroups.WORLD_SPLIT:
            why = (
                "TorchComms is enabled (TORCH_DISTRIBUTED_USE_TORCHCOMMS) and this torch makes every "
                "new_group a split_group of the world's, which refuses use_local_synchronization"
            )
        else:
            why = (
                f"the default group is bound to a device ({job.split_device!r}) whose "
                f"{job.split_backend!r} backend splits (init_process_group(..., device_id=...), or a "
                f"backend that binds itself such as torch 2.15's nccl2), so torch makes every new "
                f"{job.split_backend!r} communicator by splitting the world's, which every rank of the "
                f"world must join; a member-only new_group would wait for ranks that never come"
            )
        shown = backend if backend is not None else job.backend
        raise ValueError(f"strategy 'local' cannot create a {shown!r} group here: {why}. Use strategy 'auto', 'split' or 'fresh'.")
    if chosen in (Strategy.AUTO, Strategy.SPLIT) and must_split:
        return CreationMode.SPLIT
    return CreationMode.LOCAL
