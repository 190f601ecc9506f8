"""A job's board of events as a rank's own code reads and writes it (its monitor has its own way).

Every loss of the job is published on the board (:class:`~hypergrid.control.keys.JobChannel`:
``event/<k>`` holds entry ``k``, one event or the losses one watcher found at one look, filled
with ``compare_set`` in the first free slot, so that no slot is ever left empty below a filled
one; ``events`` counts them after, as a place to start from), by whoever saw it: the lost
rank's own monitor (its process ended, or made no progress for the progress timeout) or the
monitor watching it (its heartbeat stopped); rarely
twice (two watchers of one rank for a while: a recovery one of them was not told of), which
readers take as once. A recovery round's first arrival publishes the round's opening; a rank
counted out publishes that it offers itself back.

:class:`LossView` is what a rank's waits inside a recovery look at: which ranks are lost, for one
store request per look (whether the next slot is filled), the entries themselves read only when
one was. Where the rank's heartbeat forwards the board's events to it (:meth:`LossView.hear_from`),
the view also *hears* each loss as it is published, and calls back the waits that asked
(:meth:`LossView.on_loss`): such a wait blocks on its key once, for no request per slice, and is
ended by a write to that key. A recovery's view starts at the entry its job's committed record names, not at the
first (:func:`hypergrid.recovery.rounds.losses_since` says why no loss it must know of is
before it): its first look costs the same however many entries the board holds.

Example, in a one-rank gloo world over a ``TCPStore``::

    >>> import torch.distributed as dist
    >>> from hypergrid.control.plane import control_plane
    >>> from hypergrid.runtime.wire import BoardEvent, EventKind
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> dist.init_process_group("gloo", store=server, rank=0, world_size=1)
    >>> plane = control_plane(); channel = JobChannel.of([0, 1, 2], 0, plane.namespace)
    >>> view = LossView(channel, plane)
    >>> view.lost_among([1, 2])
    []
    >>> publish(channel, plane, BoardEvent(EventKind.LOST, 2, "its process ended", by=2))
    >>> view.lost_among([1, 2]), view.lost
    ([2], {2: 'its process ended'})
    >>> publish(channel, plane, BoardEvent(EventKind.BACK, 2, by=2)); view.lost_among([1, 2])
    []
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any, Optional

import torch.distributed as dist

from ..errors import StoreUnresponsiveError
from ..runtime.store import StoreClient
from ..runtime.wire import BoardEvent, EventKind, decode_events, encode
from .keys import JobChannel, put_entry
from .plane import ControlPlane

__all__ = ["LossView", "publish", "LOOK_S"]

#: How long one look at the board may take before it counts as unanswered.
LOOK_S = 5.0


def publish(channel: JobChannel, plane: ControlPlane, event: BoardEvent, store: Optional[StoreClient] = None) -> None:
    """Put ``event`` on ``channel``'s board as a monitor does (:func:`~hypergrid.control.keys.put_entry`),
    in the first free slot from the count: four store requests, two more for each slot found taken."""
    store = store or plane.client(time.monotonic() + LOOK_S)
    put_entry(store, channel, encode(event).encode(), store.add(channel.events(), 0))


class LossView:
    """The ranks lost on ``channel``'s board from entry ``first`` on, with why (a BACK event undoes
    an earlier loss); ``seen``: the next entry it reads."""

    def __init__(self, channel: JobChannel, plane: ControlPlane, first: int = 0) -> None:
        self.channel = channel
        self.plane = plane
        self.seen = first
        self.lost: dict[int, str] = {}
        #: The ranks heard lost since :meth:`hear_from`, less those heard offering themselves back
        #: since (the heartbeat forwards the board's entries in order).
        self.heard: set[int] = set()
        self._hearing = False
        self._alarms: list[tuple[frozenset[int], Callable[[list[int]], None]]] = []
        self._lock = threading.Lock()

    @property
    def hearing(self) -> bool:
        """Whether the board's events reach this view as they are published (:meth:`hear_from`)."""
        return self._hearing

    def hear_from(self, source: Any, name: str = "recovery's board") -> None:
        """Hear every event ``source`` (the rank's :class:`~hypergrid.control.heartbeat.Heartbeat`)
        hands its listeners, as listener ``name``: from then on :meth:`on_loss` calls waits back."""
        source.listen(name, self.hear)
        self._hearing = True

    def hear(self, event: BoardEvent) -> None:
        """Take one event of the board as it was published (called on the heartbeat's thread)."""
        if event.kind is EventKind.BACK:
            with self._lock:
                self.heard.discard(event.rank)
            return
        if event.kind is not EventKind.LOST:
            return
        with self._lock:
            if event.rank in self.heard:
                return
            self.heard.add(event.rank)
            alarms = [callback for ranks, callback in self._alarms if event.rank in ranks]
        for callback in alarms:
            callback([event.rank])

    def known_lost(self) -> set[int]:
        """The ranks this view holds lost without asking the store: read at its last look, or heard."""
        with self._lock:
            return set(self.lost) | self.heard

    @contextlib.contextmanager
    def on_loss(self, ranks: Collection[int], callback: Callable[[list[int]], None]) -> Iterator[None]:
        """While the block runs, call ``callback`` with those of ``ranks`` heard lost: at once with
        any heard already, then (on the heartbeat's thread) with each one heard.

        Example::

            >>> view = LossView(JobChannel("ns", "f00d", 0), ControlPlane("ns", store=None, address=None))
            >>> view.hear(BoardEvent(EventKind.LOST, 5, "its process ended"))
            >>> heard = []
            >>> with view.on_loss([4, 5, 6], heard.append):
            ...     view.hear(BoardEvent(EventKind.LOST, 6, "its heartbeat stopped"))
            ...     view.hear(BoardEvent(EventKind.LOST, 9, "its heartbeat stopped"))
            >>> view.hear(BoardEvent(EventKind.LOST, 4, "its process ended")); heard
            [[5], [6]]
        """
        members = frozenset(ranks)
        entry = (members, callback)
        with self._lock:
            self._alarms.append(entry)
            already = sorted(self.heard & members)
        try:
            if already:
                callback(already)
            yield
        finally:
            with self._lock:
                self._alarms.remove(entry)

    def refresh(self, store: Optional[StoreClient] = None) -> dict[int, str]:
        """Read what was published since the last look: one request when nothing was (whether
        the next slot is filled; not the count, which lags a publisher that ended between its
        slot and its count)."""
        store = store or self.plane.client(time.monotonic() + LOOK_S)
        while store.check([self.channel.event(self.seen)]):
            events = decode_events(store.get(self.channel.event(self.seen)))
            self.seen += 1
            for event in events:
                if event.kind is EventKind.LOST:
                    self.lost[event.rank] = event.reason
                elif event.kind is EventKind.BACK:
                    self.lost.pop(event.rank, None)
        return self.lost

    def lost_among(self, ranks: Collection[int]) -> list[int]:
        """Those of ``ranks`` lost on the board (one look; none where the store does not answer)."""
        try:
            lost = self.refresh()
        except (dist.DistError, StoreUnresponsiveError):
            return []
        return sorted(r for r in lost if r in ranks)
