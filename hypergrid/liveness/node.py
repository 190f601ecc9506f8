"""What a node's delegate knows of its node's ranks: which of their monitors spoke lately.

Only the delegate beats for the node in the store; its node's other monitors say over the node's
socket, every interval, that they are alive (:meth:`~hypergrid.liveness.relay.NodeRelay.tell`).
A rank whose monitor said nothing for ``stale_beats`` of the delegate's looks and intervals (its
monitor stopped, or was killed and not started again) is lost, as its counter standing still was
when every monitor beat for itself; one never heard is given ``start_s`` more, the time a rank's
monitor may take to start. A rank that left cleanly says so, and is nobody's loss.

Example, a delegate (rank 0) of ranks 0-3 that hears rank 1 and rank 2 once, then rank 1 only::

    >>> ranks = NodeRanks(me=0, interval_s=1.0, stale_beats=5, start_s=60.0, now=0.0)
    >>> ranks.hear(1, now=0.0); ranks.hear(2, now=0.0); ranks.leave(3)
    >>> for second in range(1, 6):
    ...     ranks.hear(1, now=float(second))
    ...     found = ranks.silent([0, 1, 2, 3], now=float(second))
    >>> [(e.rank, e.by) for e in found]
    [(2, 0)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..store.records import BoardEvent, EventKind
from .progress import restarting_delegate

__all__ = ["NodeRanks"]


@dataclass
class _Heard:
    at: float
    looks: int = 0  # the delegate's looks since: a delegate that did not run heard nothing stand still


@dataclass
class NodeRanks:
    """The node's ranks as delegate ``me`` heard them, judged by ``stale_beats`` intervals of
    ``interval_s`` (``start_s`` more for one never heard since ``now``, the delegate's start)."""

    me: int
    interval_s: float
    stale_beats: int
    start_s: float
    now: float
    heard: dict[int, _Heard] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    looks: int = 0

    def hear(self, rank: int, now: float) -> None:
        """Rank ``rank``'s monitor spoke."""
        self.heard[rank] = _Heard(now)
        self.left.discard(rank)

    def leave(self, rank: int) -> None:
        """Rank ``rank``'s monitor left cleanly (its rank released the job, or ended and was published)."""
        self.heard.pop(rank, None)
        self.left.add(rank)

    def adopt(self, told: Mapping[str, Any], now: float) -> None:
        """Continue from what the node's last delegate ``told``: those it heard count as heard ``now``,
        but itself as never heard where its rank still runs (its monitor killed alone: the rank starts another).

            >>> ranks = NodeRanks(me=1, interval_s=1.0, stale_beats=5, start_s=60.0, now=0.0)
            >>> ranks.adopt({"heard": [0, 1, 2], "left": [3], "me": 0}, now=0.0); sorted(ranks.heard)
            [0, 2]
        """
        restarting = restarting_delegate(told)
        for rank in told.get("heard", ()):
            if rank not in self.heard and rank not in self.left and rank not in (self.me, restarting):
                self.heard[rank] = _Heard(now)
        self.left.update(told.get("left", ()))

    def told(self) -> dict[str, object]:
        """What a delegate tells its followers (one of them may take over): whom it heard, who left, itself."""
        return {"heard": sorted(set(self.heard) | {self.me}), "left": sorted(self.left), "me": self.me}

    def silent(self, ranks: Sequence[int], now: float) -> list[BoardEvent]:
        """One look at ``ranks`` (the node's, not lost): those silent past the bound, as losses."""
        self.looks += 1
        bound = self.stale_beats * self.interval_s
        found = []
        for rank in ranks:
            if rank == self.me or rank in self.left:
                continue
            heard = self.heard.get(rank)
            if heard is None:
                if self.looks >= self.stale_beats and now - self.now >= bound + self.start_s - self.interval_s / 2:
                    found.append(BoardEvent(EventKind.LOST, rank, (
                        f"its monitor never spoke to its node's delegate in {now - self.now:.1f} s (a monitor may take "
                        f"{self.start_s:g} s to start): its rank never started its monitor"), by=self.me))
                continue
            heard.looks += 1
            if heard.looks >= self.stale_beats and now - heard.at >= bound - self.interval_s / 2:
                found.append(BoardEvent(EventKind.LOST, rank, (
                    f"its monitor went silent on its node: the last word came {now - heard.at:.1f} s ago (the bound is "
                    f"{bound:g} s): its monitor is gone or stopped"), by=self.me))
        for event in found:
            self.heard.pop(event.rank, None)
            self.left.add(event.rank)  # published once: nobody's to publish again
        return found
