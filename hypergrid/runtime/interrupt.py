"""Getting a rank out of a collective it is blocked in, where the backend can abort a communicator.

When a rank dies, its peers' collectives with it do not fail at once on every backend: NCCL
waits until its own timeout (ten minutes by default), and a survivor that left for the recovery
leaves the ranks still in a collective with it waiting just as long. A recovery cannot wait that
long. On backends whose ``ProcessGroup.abort()`` ends the operations in flight (NCCL, torch
2.15's ``nccl2`` and ``nccl-lazy``, and any backend registered with
:func:`register_abortable_backend`), a :class:`CollectiveWatch` thread aborts this rank's
communicators as soon as a recovery round of its job opens, or a rank that shares a group with
it stops its heartbeat, while this rank's own code is not in the recovery: the blocked
collective raises, the rank's training loop calls the recovery, and the aborted communicators,
broken now for every member, are made anew (each rank says which it aborted when it arrives).

gloo cannot do this (measured on torch 2.13 and 2.15: ``abort()`` returns at once, and a blocked
all-reduce waits until its own timeout): there the recovery waits for a rank whose heartbeat
runs up to the job's longest collective timeout (:mod:`hypergrid.runtime.failures`).

Example::

    >>> register_abortable_backend("my_backend")
    >>> "my_backend" in abortable_backends() and "gloo" not in abortable_backends()
    True
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch.distributed as dist

from ..errors import StoreUnresponsiveError
from .failures import JobChannel, current_round
from .liveness import LivenessWatch
from .shutdown import register
from .store import StoreClient, agreement_possible

__all__ = ["register_abortable_backend", "abortable_backends", "can_abort", "abort_group", "CollectiveWatch",
           "recovering", "in_recovery", "take_aborted"]

logger = logging.getLogger(__name__)

#: torch's backends whose ``abort()`` ends the collectives in flight.
_ABORTING = {"nccl", "nccl2", "nccl-lazy", "nccl-legacy"}
_registered: set[str] = set()
_lock = threading.Lock()
_aborted: list[tuple[int, ...]] = []
#: Held by a watch through a whole pass of aborts, and by :func:`take_aborted`: a rank that a first
#: abort released into the recovery names every group of the pass, not those aborted by then.
_pass = threading.Lock()
_recovering = threading.Event()


def register_abortable_backend(name: str) -> None:
    """Declare that ``name``'s ``ProcessGroup.abort()`` ends the collectives in flight (a backend of
    your own, or a test backend), so that a recovery aborts its communicators to get a blocked
    rank out (see the module's docstring).

    Example::

        >>> register_abortable_backend("ucc_abortable")
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a backend's name (a non-empty str), got {name!r}")
    with _lock:
        _registered.add(name.lower())


def abortable_backends() -> frozenset[str]:
    """The backends whose communicators a recovery aborts.

    Example::

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
    """Abort ``pg`` (its operations in flight end with an error); its member list, or None where
    it cannot be aborted. Recorded for :func:`take_aborted`.

    Example::

        >>> abort_group.__name__
        'abort_group'
    """
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
    """The member lists of the groups this process aborted since the last call (and forget them).

    Example::

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

    Example::

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
    """Whether this process is inside a recovery (:func:`recovering`)."""
    return _recovering.is_set()


class CollectiveWatch:
    """A thread that aborts this rank's abortable communicators when its job needs it elsewhere.

    Every ``interval_s`` it looks (only while some group ``groups()`` lists can be aborted, and
    this process is not in a recovery) whether a recovery round of the job's ``channel`` has
    opened, and whether a rank of ``peers`` (the ranks this rank shares groups with, at most
    1,024 looked at) has a heartbeat stopped for ``stale_after_s``; if so, it aborts every
    abortable group ``groups()`` lists. One store connection of its own; stopped with
    :meth:`stop`.

    Example::

        >>> watch = CollectiveWatch(JobChannel.of([0, 1], 0), lambda: [], peers=[1], interval_s=0.05,
        ...                         stale_after_s=1.0)
        >>> watch.stop()
    """

    def __init__(self, channel: JobChannel, groups: Callable[[], Sequence[dist.ProcessGroup]], *,
                 peers: Sequence[int], interval_s: float, stale_after_s: float) -> None:
        self.channel = channel
        self._groups = groups
        self._peers = sorted(set(peers))[:1024]
        self._interval_s = interval_s
        self._watch = LivenessWatch(stale_after_s)
        self._stop = threading.Event()
        # The groups aborted already, held so that their ids are not reused by new groups.
        self._done: dict[int, dist.ProcessGroup] = {}
        self._thread = threading.Thread(target=self._run, name="hypergrid-collective-watch", daemon=True)
        self._thread.start()
        register("the collective watch", self.stop, self._thread.join)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            if in_recovery() or not agreement_possible():
                continue
            targets = [pg for pg in self._groups() if id(pg) not in self._done and can_abort(pg)]
            if not targets:
                continue
            try:
                reason = self._reason()
            except (dist.DistError, StoreUnresponsiveError, RuntimeError) as exc:
                logger.debug("collective watch: the store did not answer: %s", exc)
                continue
            if reason is None or in_recovery():
                continue
            logger.warning("rank %d: %s: aborting %d communicators to leave any collective in flight",
                           dist.get_rank(), reason, len(targets))
            with _pass:
                for pg in targets:
                    self._done[id(pg)] = pg
                    abort_group(pg)

    def _reason(self) -> Optional[str]:
        store = StoreClient(time.monotonic() + max(1.0, self._interval_s))
        number = current_round(self.channel, store)
        if store.check([self.channel.key(number, "here")]):
            return f"recovery round {number} of the job has opened"
        stale = self._watch.stale(self._peers, store)
        if stale:
            return f"ranks {sorted(stale)} it shares a group with stopped their heartbeat"
        return None
