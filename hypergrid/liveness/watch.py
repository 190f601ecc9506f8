"""A node's watch: the heartbeat counters of the nodes it watches, and when a counter's silence means a loss.

A node's delegate (or a monitor serving its node alone) reads at each look, in one round trip,
the counters of the nodes its node watches in the ring of the job's nodes
(:meth:`~hypergrid.liveness.ring.Ring.watched_from`). A counter that stood still over ``stale_beats``
looks and intervals of the watcher's own clock (no clocks are compared across hosts) means its
node is gone (every monitor on it); looks closer together than :data:`COUNTED_APART` of an
interval count as one. A counter that never moved (0: nobody beat for it yet) is
given ``start_s`` more, the time a rank's monitor may take to start: ranks start their monitors
seconds apart on a loaded host, and a watcher that looks first must not count the late ones out.
Silence is judged on what the store answered, not on how long it took. Past a node lost or
departed, the watch walks on to the next one; the counters walked to are read together, one round
trip per hop of the longest walk, never one per node.

Example, node 0 watching node 1, whose counter stands still (the reads given)::

    >>> from hypergrid.liveness.ring import Ring
    >>> watch, watched = Watch(me=0, interval_s=1.0, stale_beats=5), {}
    >>> ring = Ring.of(range(2), gpus_per_node=1)
    >>> [watch.look(lambda ranks: [7] * len(ranks), ring, [0], {}, watched, now=float(t)) for t in range(5)][-1]
    []
    >>> [(e.rank, e.by) for e in watch.look(lambda ranks: [7] * len(ranks), ring, [0], {}, watched, now=5.0)]
    [(1, 0)]

Looks that come in a burst (answers queued behind a store that stalled) count once: three
intervals looked at are not five::

    >>> watch, watched = Watch(me=0, interval_s=1.0, stale_beats=5), {}
    >>> [watch.look(lambda ranks: [7] * len(ranks), ring, [0], {}, watched, now=t) for t in (0.0, 2.0, 2.1, 2.2, 2.3)][-1]
    []
    >>> watch.look(lambda ranks: [7] * len(ranks), ring, [0], {}, watched, now=4.6), watched[1].looks
    ([], 3)

A counter still at 0 (never beaten) is lost only past the start bound as well::

    >>> watch, watched = Watch(me=0, interval_s=1.0, stale_beats=5, start_s=60.0), {}
    >>> [watch.look(lambda ranks: [0] * len(ranks), ring, [0], {}, watched, now=float(t)) for t in range(65)][-1]
    []
    >>> [e.reason for e in watch.look(lambda ranks: [0] * len(ranks), ring, [0], {}, watched, now=65.0)]
    ["its node never beat in the 65.0 s this watcher looked (a monitor may take 60 s to start, and a counter that stands still 5 s is lost): its node's ranks never started their monitors, or its node is gone"]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..store.records import BoardEvent, EventKind
from .ring import Ring

__all__ = ["Watch", "Watched", "COUNTED_APART"]

#: How far apart, in intervals, two looks at the same value must come to count as two.
COUNTED_APART = 0.75

#: One look's walk from one start: yields the rank whose counter it needs, is sent its value.
_Walk = Generator[int, int, None]


@dataclass
class Watched:
    """What a watcher saw of one counter."""

    value: int
    #: The earliest its last beat may have come: the look before the one that first found ``value``,
    #: or that first look where there was none before it.
    since: float
    #: When a look first found ``value``: the latest its last beat may have come.
    first_seen: float
    last_look: float
    #: How many looks found ``value``: a watcher that did not run (an overloaded host) saw nothing stand still.
    looks: int = 1
    #: When the last look counted in ``looks`` came (looks closer together count once).
    counted_at: float = -math.inf


@dataclass(frozen=True)
class Watch:
    """Rank ``me``'s rule of silence (``stale_beats`` intervals of ``interval_s``; ``start_s`` more for a
    counter that never beat), applied at each :meth:`look`."""

    me: int
    interval_s: float
    stale_beats: int
    start_s: float = 0.0

    def look(self, read: Callable[[Sequence[int]], Sequence[int]], ring: Ring, starts: Sequence[int],
             lost: Collection[int], watched: dict[int, Watched], now: float) -> list[BoardEvent]:
        """Read (``read``: one round trip) and judge the counters ``starts`` watch, walking past those
        ``lost`` or departed; the ranks found lost now, as events (the caller adds them to ``lost``)."""
        firsts = self.firsts(ring, starts, lost)
        counters = dict(zip(firsts, read(firsts))) if firsts else {}
        visited: set[int] = set()
        found: list[BoardEvent] = []
        parked: list[tuple[_Walk, int]] = []
        for start in starts:
            walk = self._walk(ring, start, lost, watched, now, visited, found)
            need = _advance(walk, None, counters)
            if need is not None:
                parked.append((walk, need))
        while parked:  # the counters the walks went on to: one round trip for all of them
            needs = [need for _, need in parked]
            counters.update(zip(needs, read(needs)))
            parked = [(walk, after) for walk, need in parked if (after := _advance(walk, need, counters)) is not None]
        for rank in [r for r in watched if r not in visited]:
            del watched[rank]
        return found

    def firsts(self, ring: Ring, starts: Sequence[int], lost: Collection[int]) -> list[int]:
        """The counters a :meth:`look` from ``starts`` reads first (those it walks on to come after).

        Example::

            >>> from hypergrid.liveness.ring import Ring
            >>> ring = Ring.of(range(4), gpus_per_node=1)
            >>> watch = Watch(me=0, interval_s=1.0, stale_beats=5)
            >>> watch.firsts(ring, [0], lost=[]) == ring.watched_from(0), watch.firsts(ring, [0], ring.watched_from(0))
            (True, [])
        """
        return sorted({r for start in starts for r in ring.watched_from(start)} - set(lost) - {self.me})

    def _walk(self, ring: Ring, start: int, lost: Collection[int], watched: dict[int, Watched], now: float,
              visited: set[int], found: list[BoardEvent]) -> _Walk:
        """Walk the counters ``start`` watches, past lost or departed ones; losses go to ``found``."""
        me, stale_after = self.me, self.stale_beats * self.interval_s
        candidate = ring.successor(start)
        while candidate not in (me, start) and candidate not in visited:
            visited.add(candidate)
            following = ring.successor(candidate)
            if candidate in lost:
                candidate = following
                continue
            value = yield candidate
            seen = watched.get(candidate)
            if value < 0:  # it left cleanly: nobody's loss
                candidate = following
                continue
            if seen is None or seen.value != value:
                watched[candidate] = Watched(value, since=now if seen is None else seen.last_look, first_seen=now,
                                             last_look=now, counted_at=now)
            else:
                # The looks count intervals: a watcher's counters may come from its own reads and from
                # its group's reader's answers, several at once after a late store, and a burst of
                # them is no more evidence than one look.
                if now - seen.counted_at >= self.interval_s * COUNTED_APART:
                    seen.looks += 1
                    seen.counted_at = now
                seen.last_look = now
                # From the earliest the last beat may have come, so a rank is published within the bound.
                # The looks count the intervals; the clock only guards against looks that came too fast,
                # with half an interval of slack (else a bound met to the microsecond costs an interval).
                # A counter at 0 never beat: its monitor may still be starting, so its bound is longer.
                bound = stale_after if value > 0 else stale_after + self.start_s
                if seen.looks >= self.stale_beats and now - seen.since >= bound - self.interval_s / 2:
                    found.append(BoardEvent(EventKind.LOST, candidate, self._reason(seen, now), by=me))
                    candidate = following
                    continue
            # Alive: the next rank has a watcher of its own, unless on this one's node (lost with it).
            if not ring.run_goes_on(candidate, following, start):
                return
            candidate = following

    def _reason(self, seen: Watched, now: float) -> str:
        stale_after = self.stale_beats * self.interval_s
        if seen.value == 0:
            return (f"its node never beat in the {now - seen.since:.1f} s this watcher looked (a monitor may take "
                    f"{self.start_s:g} s to start, and a counter that stands still {stale_after:g} s is lost): its "
                    f"node's ranks never started their monitors, or its node is gone")
        return (f"its node's heartbeat stopped: its last beat came {now - seen.first_seen:.1f}-{now - seen.since:.1f} s "
                f"ago (the bound is {stale_after:g} s): its node is gone, or every monitor on it")

    # ------------------------------------------------------------------ between delegates
    @staticmethod
    def state(watched: Mapping[int, Watched]) -> list[list[float]]:
        """What a delegate tells its followers of its watch (times of the host's monotonic clock)."""
        return [[rank, w.value, w.since, w.first_seen, w.last_look, w.looks] for rank, w in watched.items()]

    @staticmethod
    def take_over(watched: dict[int, Watched], told: Optional[Sequence[Sequence[float]]], ring: Ring) -> None:
        """Continue from what the node's last delegate saw (``told``, its :meth:`state`): a rank lost
        just before a change of delegate is still published within the bound."""
        for rank, value, since, first_seen, last_look, looks in told or []:
            if int(rank) in ring and int(rank) not in watched:
                watched[int(rank)] = Watched(int(value), since=since, first_seen=first_seen, last_look=last_look,
                                             looks=int(looks), counted_at=last_look)


def _advance(walk: _Walk, need: Optional[int], counters: dict[int, int]) -> Optional[int]:
    """Run ``walk`` on while the counters it asks for are read; the rank it needs next, or None at its end."""
    try:
        asked = next(walk) if need is None else walk.send(counters.pop(need))
        while asked in counters:
            asked = walk.send(counters.pop(asked))
        return asked
    except StopIteration:
        return None
