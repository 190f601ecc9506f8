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
one was. A recovery's view starts at the entry its job's committed record names, not at the
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

import time
from collections.abc import Collection
from typing import Optional

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
