"""Which ranks are alive: each rank's heartbeat in the job's store, and a watch that reads them.

A rank that runs :func:`start_heartbeat` advances a counter of its own in the store every
``interval_s`` seconds, from a thread with its own store connection, so a rank blocked inside a
collective (waiting for a peer that died) still beats. A :class:`LivenessWatch` reads the
counters of the ranks it is asked about and calls a rank *stale* once its counter has not moved
for ``stale_after_s`` seconds of the watcher's own clock: no clocks are compared across machines,
only counters that every rank reads alike from the store.

On the fake backend (one simulated rank) there is no store to beat in, and nothing happens.

Example, in a one-rank gloo world whose store is a ``HashStore``::

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> beat = start_heartbeat(interval_s=0.05)
    >>> watch = LivenessWatch(stale_after_s=0.5)
    >>> watch.stale([0, 1])            # rank 1 never beat; not stale until 0.5 s have passed
    set()
    >>> import time; time.sleep(0.6)
    >>> watch.stale([0, 1])
    {1}
    >>> beat.stop(); dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

import torch.distributed as dist

from .shutdown import register
from .store import PREFIX, StoreClient, agreement_possible
from .torch_compat import default_store

__all__ = ["Heartbeat", "start_heartbeat", "running_heartbeat", "LivenessWatch", "heartbeat_key", "watching_members",
           "dead_among", "watching", "stale_after_default", "STALE_BEATS"]

#: How long a heartbeat may stand still before its rank counts as gone, in heartbeat intervals.
STALE_BEATS = 5

logger = logging.getLogger(__name__)


def heartbeat_key(rank: int) -> str:
    """Where ``rank``'s heartbeat counter lives."""
    return f"{PREFIX}/alive/{rank}"


class Heartbeat:
    """This rank's heartbeat: a daemon thread advancing its counter every ``interval_s`` seconds."""

    def __init__(self, store: Any, rank: int, interval_s: float) -> None:
        self.interval_s = interval_s
        self.rank = rank
        self._store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hypergrid-heartbeat-{rank}", daemon=True)
        self._thread.start()
        register("the heartbeat", self.stop, self._thread.join)

    def _run(self) -> None:
        key = heartbeat_key(self.rank)
        while not self._stop.is_set():
            try:
                self._store.add(key, 1)
            except Exception as exc:  # the store is gone: nobody is left to read a heartbeat
                logger.debug("rank %d stops beating: %s", self.rank, exc)
                return
            self._stop.wait(self.interval_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        """Stop beating (others will find this rank stale)."""
        self._stop.set()


_current: Optional[Heartbeat] = None
_lock = threading.Lock()


def start_heartbeat(interval_s: float = 1.0) -> Optional[Heartbeat]:
    """Start (or keep) this rank's heartbeat; call it on every rank, spares included, once
    ``init_process_group`` has run. Returns it (None where there is no store to beat in).

    Example::

        >>> start_heartbeat() is None       # no process group
        True
    """
    global _current
    if not isinstance(interval_s, (int, float)) or isinstance(interval_s, bool) or not interval_s > 0:
        raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    if not agreement_possible():
        return None
    with _lock:
        rank = dist.get_rank()
        if _current is not None and _current.running and _current.rank == rank:
            return _current
        base = default_store()
        store = base.clone() if base is not None and hasattr(base, "clone") else base  # its own connection: never waits behind others
        _current = Heartbeat(store, rank, float(interval_s))
        return _current


def running_heartbeat() -> Optional[Heartbeat]:
    """This rank's heartbeat if it runs, else None.

    Example::

        >>> running_heartbeat() is None
        True
    """
    beat = _current
    return beat if beat is not None and beat.running else None


class LivenessWatch:
    """Reads heartbeats and says which ranks have stopped: counters that did not move for
    ``stale_after_s`` seconds of this watcher's clock (a rank that never beat counts from the
    watch's first look).

    Example::

        >>> LivenessWatch(stale_after_s=5.0).stale([0, 1])     # no process group: nobody to read
        set()
    """

    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        # rank -> (last counter seen, when it was first seen at that value)
        self._seen: dict[int, tuple[int, float]] = {}

    def silence(self, ranks: Iterable[int], store: Optional[StoreClient] = None) -> dict[int, float]:
        """How long, in seconds of this watcher's clock, each of ``ranks``'s heartbeat has stood
        still (0.0: it moved since the last look): one or two store calls for all of them, over
        ``store`` (default: a connection allowed a few seconds)."""
        ranks = list(ranks)
        if not ranks or not agreement_possible():
            return {}
        store = store or StoreClient(time.monotonic() + 5.0)
        keys = [heartbeat_key(r) for r in ranks]
        if store.check(keys):
            values = [int(raw) for raw in store.multi_get(keys)]
        else:
            values = [int(store.get(key)) if store.check([key]) else -1 for key in keys]
        now = time.monotonic()
        out = {}
        for rank, value in zip(ranks, values):
            last = self._seen.get(rank)
            if last is None or last[0] != value:
                self._seen[rank] = (value, now)
                out[rank] = 0.0
            else:
                out[rank] = now - last[1]
        return out

    def stale(self, ranks: Iterable[int], store: Optional[StoreClient] = None) -> set[int]:
        """Those of ``ranks`` whose heartbeat has stopped (see :meth:`silence`)."""
        return {r for r, silent in self.silence(ranks, store).items() if silent >= self.stale_after_s}


_watches = threading.local()


@contextlib.contextmanager
def watching_members(stale_after_s: Optional[float]) -> Iterator[None]:
    """While the block runs, the waits of this thread for other ranks (a group's agreement, a
    world step's start and end, the pooled probe) end as soon as a rank they wait for has a
    stopped heartbeat, instead of at their timeout (:func:`dead_among`). A recovery wraps its
    rebuild in it: a rank that dies while the groups are made fails the attempt at once, and the
    survivors start a new round without it. ``None``: the block waits as it would.

    Example::

        >>> with watching_members(2.5):
        ...     dead_among([1, 2])          # no process group: nobody found dead
        []
    """
    previous = getattr(_watches, "current", None)
    _watches.current = LivenessWatch(stale_after_s) if stale_after_s is not None else None
    try:
        yield
    finally:
        _watches.current = previous


def watching() -> bool:
    """Whether this thread is inside :func:`watching_members` (with a watch).

    Example::

        >>> watching()
        False
    """
    return getattr(_watches, "current", None) is not None


def dead_among(ranks: Sequence[int], store: Optional[StoreClient] = None) -> list[int]:
    """Those of ``ranks`` whose heartbeat has stopped, where this thread is inside
    :func:`watching_members` (else none: the caller waits as it would). At most 1,024 ranks are
    looked at per call, so that a wait for a huge group does not cost O(group size) per look.

    Example::

        >>> dead_among([3])
        []
    """
    watch = getattr(_watches, "current", None)
    if watch is None or not ranks or not agreement_possible():
        return []
    others = [r for r in ranks if r != dist.get_rank()][:1024]
    return sorted(watch.stale(others, store))


def stale_after_default(timeout_s: float) -> float:
    """How long a heartbeat must stand still before its rank counts as gone: five intervals of
    this rank's running heartbeat, or ``timeout_s`` where none runs.

    Example::

        >>> stale_after_default(30.0)       # no heartbeat runs here
        30.0
    """
    beat = running_heartbeat()
    return STALE_BEATS * beat.interval_s if beat is not None else timeout_s
