"""Ending a rank's collectives in flight, where the backend can abort a communicator.

A collective with a dead rank waits for its own timeout (NCCL's is ten minutes). Where
``ProcessGroup.abort()`` ends it (NCCL and registered backends, not gloo), a :class:`CollectiveWatch`
aborts this rank's communicators once the board says a rank was lost or a recovery opened, so the
blocked collective raises and the training loop recovers.

>>> register_abortable_backend("my_backend")
>>> "my_backend" in abortable_backends() and "gloo" not in abortable_backends()
True
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch.distributed as dist

from ..store.keys import JobChannel
from ..store.records import BoardEvent, EventKind

__all__ = ["register_abortable_backend", "abortable_backends", "can_abort", "abort_group", "abort_all",
           "recovering", "in_recovery", "take_aborted", "CollectiveWatch"]

logger = logging.getLogger(__name__)

_ABORTING = {"nccl", "nccl2", "nccl-lazy", "nccl-legacy"}
_registered: set[str] = set()
_lock = threading.Lock()
_aborted: list[tuple[int, ...]] = []
#: Held through a pass of aborts and by take_aborted: a rank released by the pass's first abort sees every group of it.
_pass = threading.Lock()
_recovering = threading.Event()


def register_abortable_backend(name: str) -> None:
    """Declare that ``name``'s ``ProcessGroup.abort()`` ends the collectives in flight."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a backend's name (a non-empty str), got {name!r}")
    with _lock:
        _registered.add(name.lower())


def abortable_backends() -> frozenset[str]:
    """The backends whose communicators a recovery aborts.

    >>> "nccl2" in abortable_backends()
    True
    """
    with _lock:
        return frozenset(_ABORTING | _registered)


def can_abort(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg``'s backend ends a blocked collective when aborted.

    Example, in a one-rank gloo world whose store is a ``HashStore``::

        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> can_abort(dist.group.WORLD)
        False
        >>> dist.destroy_process_group()
    """
    try:
        backend = str(dist.get_backend(pg)).lower()
    except Exception:  # a group torch no longer knows (destroyed)
        return False
    names = abortable_backends()
    return hasattr(pg, "abort") and (backend in names or any(part.split(":")[-1] in names for part in backend.split(",")))


def abort_group(pg: dist.ProcessGroup) -> Optional[tuple[int, ...]]:
    """Abort ``pg`` and record it for :func:`take_aborted`; its member list, or None where it cannot be aborted."""
    if not can_abort(pg):
        return None
    members = tuple(dist.get_process_group_ranks(pg))
    try:
        pg.abort()
    except Exception as exc:  # already aborted, or torch refuses: it is broken either way
        logger.info("aborting the group of ranks %s: %s", list(members), exc)
    with _lock:
        _aborted.append(members)
    return members


def take_aborted() -> list[tuple[int, ...]]:
    """The member lists of the groups aborted since the last call, then forgotten.

    >>> take_aborted()
    []
    """
    with _pass, _lock:
        out = sorted(set(_aborted))
        _aborted.clear()
    return out


@contextlib.contextmanager
def recovering() -> Iterator[None]:
    """Mark this process as inside a recovery for the block: the watch aborts nothing meanwhile.

    >>> with recovering():
    ...     in_recovery()
    True
    """
    _recovering.set()
    try:
        yield
    finally:
        _recovering.clear()


def in_recovery() -> bool:
    """Whether this process is inside :func:`recovering`."""
    return _recovering.is_set()


def abort_all(groups: Sequence[dist.ProcessGroup]) -> int:
    """Abort those of ``groups`` that can be, in one pass :func:`take_aborted` waits for; how many.

    >>> abort_all([])
    0
    """
    with _pass:
        return sum(abort_group(pg) is not None for pg in groups)


class CollectiveWatch:
    """Aborts this rank's communicators (``groups()``) on the board events of ``channel`` that
    concern the job over ``ranks`` as of round ``first_round``."""

    def __init__(self, channel: JobChannel, *, ranks: Sequence[int], first_round: int,
                 groups: Callable[[], Sequence[dist.ProcessGroup]]) -> None:
        self.channel = channel
        self.ranks = frozenset(ranks)
        self.first_round = first_round
        self._groups = groups
        self.active = True
        self._done: dict[int, dist.ProcessGroup] = {}  # groups aborted, held so that their ids are not reused

    def concerns(self, event: BoardEvent) -> bool:
        """Whether ``event`` means this rank's collectives may be blocked on a peer that will not come."""
        if event.kind is EventKind.LOST:
            return event.rank in self.ranks
        if event.kind is EventKind.ROUND:
            return event.number >= self.first_round and event.reason == "recover"
        return False

    def __call__(self, event: BoardEvent) -> None:
        if not self.active or in_recovery() or not self.concerns(event):
            return
        targets = [pg for pg in self._groups() if id(pg) not in self._done]
        self._done.update((id(pg), pg) for pg in targets)
        count = abort_all(targets)
        if count:
            what = (f"rank {event.rank} was lost ({event.reason})" if event.kind is EventKind.LOST
                    else f"recovery round {event.number} of the job opened")
            logger.warning("rank %d: %s: aborted %d communicators to leave any collective in flight",
                           dist.get_rank() if dist.is_initialized() else -1, what, count)
