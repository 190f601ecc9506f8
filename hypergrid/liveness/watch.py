"""A monitor's watch: the heartbeat counters it reads, and when a counter's silence means a loss.

A watcher (a node's delegate, for its node's ranks; a monitor alone, for its own rank) reads the
counters of the ranks those watch (:meth:`~hypergrid.liveness.ring.Ring.watched_from`), all in one
round trip, at each of its looks. A counter that made no beat for ``stale_beats`` intervals of the
watcher's own clock (no clocks are compared across hosts), counted from the look before the one
that saw its last beat and over ``stale_beats`` looks (a watcher that could not run meanwhile saw
nothing stand still), means that rank's node, or its monitor, is gone: the watcher publishes the
losses of one look in one entry, and watches the next rank too. Its silence is judged on what the
store answered (the counter stood still over the looks), not on how long the store took to answer.

Past a rank lost or departed, the watch walks on to the next one in the ring; the counters a look
walks to are read together too, one round trip per step of the longest walk (after a node's loss,
one more), never one per rank: a late store makes a look slower, not longer by the node's size.

Example, a watcher of rank 1 whose counter stands still (the reads given)::

    >>> from hypergrid.liveness.ring import Ring
    >>> watch, watched = Watch(me=0, interval_s=1.0, stale_beats=5), {}
    >>> ring = Ring.of(range(2), gpus_per_node=1)
    >>> [watch.look(lambda ranks: [7] * len(ranks), ring, [0], {}, watched, now=float(t)) for t in range(5)][-1]
    []
    >>> [(e.rank, e.by) for e in watch.look(lambda ranks: [7] * len(ranks), ring, [0], {}, watched, now=5.0)]
    [(1, 0)]
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..store.records import BoardEvent, EventKind
from .ring import Ring

__all__ = ["Watch", "Watched"]

#: One look's walk from one start: yields the rank whose counter it needs, is sent its value.
_Walk = Generator[int, int, None]


@dataclass
class Watched:
    """What a watcher saw of one counter."""

    value: int
    #: When the counter's last beat may have come at the earliest: the look before the one that
    #: first found ``value`` (the beat came between the two), or that first look where there was
    #: none before it.
    since: float
    #: When a look first found ``value``: the beat came at this moment at the latest.
    first_seen: float
    #: When the watcher last looked.
    last_look: float
    #: How many looks found the counter at ``value``: a watcher that did not run for a while (an
    #: overloaded host) has not seen the counter stand still, it has not looked.
    looks: int = 1


@dataclass(frozen=True)
class Watch:
    """The watch of rank ``me``'s monitor: its rule of silence (``stale_beats`` intervals of
    ``interval_s``), applied at each :meth:`look` to the counters it keeps in ``watched``."""

    me: int
    interval_s: float
    stale_beats: int

    def look(self, read: Callable[[Sequence[int]], Sequence[int]], ring: Ring, starts: Sequence[int],
             lost: Collection[int], watched: dict[int, Watched], now: float) -> list[BoardEvent]:
        """Read the counters that ``starts`` watch (``read``: the counters of some ranks, in one
        round trip), and those past the ones ``lost`` or departed, and judge them; the ranks found
        lost now, as events (not yet in ``lost``: the caller publishes them, then takes them in)."""
        firsts = sorted({r for start in starts for r in ring.watched_from(start)} - set(lost) - {self.me})
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

    def _walk(self, ring: Ring, start: int, lost: Collection[int], watched: dict[int, Watched], now: float,
              visited: set[int], found: list[BoardEvent]) -> _Walk:
        """The counters :meth:`Ring.watched_from` ``start``: its successor's, and past a lost or
        departed one the next one's too. Those found lost go to ``found``."""
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
                                             last_look=now)
            else:
                seen.looks += 1
                seen.last_look = now
                # Judged from the earliest moment the last beat may have come, so that a rank
                # silent for the bound is published by then (its silence is between the bound less
                # one interval and the bound), and the board's delivery has the interval after it.
                # The looks count the intervals (a watcher that stalled before it saw the last beat
                # has a ``since`` long past, but still needs its looks since); the clock only
                # guards against looks that came too fast. Half an interval of slack: two ticks' own
                # lateness differ, and a bound met to the microsecond would otherwise cost a whole
                # further interval half of the time.
                if seen.looks >= self.stale_beats and now - seen.since >= stale_after - self.interval_s / 2:
                    found.append(BoardEvent(EventKind.LOST, candidate, (
                        f"its heartbeat stopped: its last beat came {now - seen.first_seen:.1f}-{now - seen.since:.1f} "
                        f"s ago (the bound is {stale_after:g} s): its node, or its monitor, is gone"), by=me))
                    candidate = following
                    continue
            # Alive as far as seen: the rank after it is its watcher's, unless it is on this one's
            # node (only some nodes have its local index), where it would be watched from a node
            # lost with it.
            if not ring.run_goes_on(candidate, following, start):
                return
            candidate = following

    # ------------------------------------------------------------------ between delegates
    @staticmethod
    def state(watched: Mapping[int, Watched]) -> list[list[float]]:
        """What a delegate tells its followers of its watch: what it saw of each counter (times of
        the host's monotonic clock, which the node's monitors share)."""
        return [[rank, w.value, w.since, w.first_seen, w.last_look, w.looks] for rank, w in watched.items()]

    @staticmethod
    def take_over(watched: dict[int, Watched], told: Optional[Sequence[Sequence[float]]], ring: Ring) -> None:
        """Continue from what the node's last delegate saw (``told``, its :meth:`state`) of the
        counters this monitor now watches: a rank lost just before a delegate changed is published
        within the bound of its last beat still, not a bound after the change."""
        for rank, value, since, first_seen, last_look, looks in told or []:
            if int(rank) in ring and int(rank) not in watched:
                watched[int(rank)] = Watched(int(value), since=since, first_seen=first_seen, last_look=last_look,
                                             looks=int(looks))


def _advance(walk: _Walk, need: Optional[int], counters: dict[int, int]) -> Optional[int]:
    """Run ``walk`` on (sent the counter of ``need``, None at its start) while the counters it asks
    for are read already; the rank whose counter it needs next, or None where it ended."""
    try:
        asked = next(walk) if need is None else walk.send(counters.pop(need))
        while asked in counters:
            asked = walk.send(counters.pop(asked))
        return asked
    except StopIteration:
        return None
