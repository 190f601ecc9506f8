"""Where a layout's positions sit among the world's ranks: a map from positions to global ranks.

A grid is laid over ``size`` positions (its coordinates, in Megatron-Core's order); by default
position ``p`` is global rank ``rank_offset + p``. After a failure the same layout may be laid
over other ranks: a spare takes a failed rank's position, or the ranks of a dropped replica are
skipped. A :class:`RankMap` holds such a placement as runs of consecutive ranks, so a map of a
million positions with a replaced node is three runs, and both directions (a position's rank, a
rank's position) cost O(log runs).

Example::

    >>> placement = RankMap.of([0, 1, 2, 3, 8, 9, 6, 7])    # ranks 4 and 5 replaced by 8 and 9
    >>> placement.runs
    ((0, 0, 4), (4, 8, 2), (6, 6, 2))
    >>> placement.rank(5), placement.position(9), placement.position(4)
    (9, 5, None)
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .checks import as_int

__all__ = ["RankMap"]


@dataclass(frozen=True)
class RankMap:
    """Positions ``0 .. size-1`` to distinct global ranks, as runs ``(first position, first rank,
    length)`` sorted by position and covering every position once.

    Example::

        >>> RankMap.contiguous(4, 8).runs, RankMap.contiguous(4, 8).is_contiguous
        (((0, 4, 8),), True)
    """

    runs: tuple[tuple[int, int, int], ...]

    def __post_init__(self) -> None:
        position = 0
        for first, rank, length in self.runs:
            if first != position or length <= 0 or rank < 0:
                raise ValueError(f"rank map runs must cover positions 0.. in order with positive lengths and "
                                 f"ranks >= 0, got {self.runs}")
            position += length
        by_rank = sorted((rank, length) for _, rank, length in self.runs)
        for (rank, length), (nxt, _) in zip(by_rank, by_rank[1:]):
            if rank + length > nxt:
                raise ValueError(f"rank map maps two positions to rank {nxt}: {self.runs}")

    @classmethod
    def contiguous(cls, first_rank: int, size: int) -> RankMap:
        """Positions ``0 .. size-1`` on ranks ``first_rank .. first_rank + size - 1``."""
        return cls(((0, first_rank, size),))

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankMap:
        """The map that puts position ``i`` on ``ranks[i]``, compressed into runs. O(len(ranks)).

        Example::

            >>> RankMap.of([5, 6, 7]).runs
            ((0, 5, 3),)
            >>> RankMap.of([1, 1])
            Traceback (most recent call last):
            ...
            ValueError: rank map maps two positions to rank 1: ((0, 1, 1), (1, 1, 1))
        """
        runs: list[list[int]] = []
        for position, rank in enumerate(ranks):
            rank = as_int(rank, f"ranks[{position}]")
            if runs and rank == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([position, rank, 1])
        if not runs:
            raise ValueError("a rank map needs at least one position")
        return cls(tuple((a, b, c) for a, b, c in runs))

    @property
    def size(self) -> int:
        first, _, length = self.runs[-1]
        return first + length

    @property
    def is_contiguous(self) -> bool:
        """Whether the positions sit on consecutive ranks in order (the default placement)."""
        return len(self.runs) == 1

    @property
    def last_rank(self) -> int:
        """The highest rank the map uses."""
        return max(rank + length - 1 for _, rank, length in self.runs)

    @property
    def first_rank(self) -> int:
        """The rank of position 0."""
        return self.runs[0][1]

    @functools.cached_property
    def _positions(self) -> tuple[int, ...]:
        return tuple(first for first, _, _ in self.runs)

    @functools.cached_property
    def _by_rank(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(sorted((rank, first, length) for first, rank, length in self.runs))

    @functools.cached_property
    def _rank_starts(self) -> tuple[int, ...]:
        return tuple(rank for rank, _, _ in self._by_rank)

    def rank(self, position: int) -> int:
        """The global rank at ``position``. O(log runs)."""
        if not 0 <= position < self.size:
            raise ValueError(f"position {position} is outside the map's {self.size} positions")
        first, rank, _ = self.runs[bisect.bisect_right(self._positions, position) - 1]
        return rank + position - first

    def position(self, rank: int) -> int | None:
        """The position on global rank ``rank`` (None: the map does not use it). O(log runs)."""
        i = bisect.bisect_right(self._rank_starts, rank) - 1
        if i < 0:
            return None
        start, first, length = self._by_rank[i]
        return first + rank - start if rank < start + length else None

    def ranks_of(self, positions: Sequence[int]) -> list[int]:
        """The global ranks of ``positions``, in order. Ascending positions (a group's) are mapped
        run by run, with no search per position.

        Example::

            >>> RankMap.of([0, 1, 8, 9, 4, 5]).ranks_of([1, 2, 5])
            [1, 8, 5]
        """
        if self.is_contiguous:
            base = self.first_rank
            return [base + p for p in positions]
        if not all(map(operator.lt, positions, positions[1:])):
            # A large share of the map (a group of a million ranks): one table, then lookups; the
            # table costs at most 8 times the answer.
            if len(positions) * 8 >= self.size and 0 <= min(positions) and max(positions) < self.size:
                table: list[int] = []
                for _, rank, length in self.runs:
                    table += range(rank, rank + length)
                return [table[p] for p in positions]
            return [self.rank(p) for p in positions]  # a few: one search each (and rank() names a bad one)
        out: list[int] = []
        i = 0
        for first, rank, length in self.runs:
            j = bisect.bisect_left(positions, first + length, i)
            if j > i:
                shift = rank - first
                out += [p + shift for p in positions[i:j]]
                i = j
            if i == len(positions):
                break
        if i != len(positions):
            raise ValueError(f"positions {list(positions[i:i + 3])}... are outside the map's {self.size} positions")
        return out

    def in_position_order(self, ranks: Iterable[int]) -> list[int]:
        """``ranks`` ordered by their positions (ranks the map does not use last, ascending): one
        sort and a search per run, not per rank.

        Example::

            >>> RankMap.of([0, 1, 9, 3]).in_position_order([3, 9, 12, 0])
            [0, 9, 3, 12]
        """
        ordered = sorted(ranks)
        pieces: list[tuple[int, list[int]]] = []
        used = 0
        for start, first, length in self._by_rank:
            lo = bisect.bisect_left(ordered, start)
            hi = bisect.bisect_left(ordered, start + length, lo)
            if hi > lo:
                pieces.append((first + ordered[lo] - start, ordered[lo:hi]))
                used += hi - lo
        out = [r for _, piece in sorted(pieces) for r in piece]
        if used < len(ordered):
            mapped = set(out)
            out += [r for r in ordered if r not in mapped]
        return out

    def __iter__(self) -> Iterator[int]:
        """Every position's rank, in position order."""
        for _, rank, length in self.runs:
            yield from range(rank, rank + length)

    def __len__(self) -> int:
        return self.size

    def replaced(self, substitutes: Mapping[int, int]) -> RankMap:
        """This map with the positions of some ranks given to others: ``{old rank: new rank}``.

        Example::

            >>> RankMap.contiguous(0, 8).replaced({4: 8, 5: 9}).runs
            ((0, 0, 4), (4, 8, 2), (6, 6, 2))
        """
        moved: dict[int, int] = {}
        for old, new in substitutes.items():
            position = self.position(old)
            if position is None:
                raise ValueError(f"rank {old} is not in the map, so it cannot be replaced")
            moved[position] = as_int(new, "a substitute rank")
        # Cut the runs around the moved positions: O(runs + moved), never a list of every position.
        pieces: list[tuple[int, int, int]] = []
        cuts = sorted(moved)
        c = 0
        for first, rank, length in self.runs:
            start, end = first, first + length
            while c < len(cuts) and cuts[c] < end:
                cut = cuts[c]
                if cut > start:
                    pieces.append((start, rank + start - first, cut - start))
                pieces.append((cut, moved[cut], 1))
                start = cut + 1
                c += 1
            if start < end:
                pieces.append((start, rank + start - first, end - start))
        return RankMap(_merged(pieces))

    def restricted(self, intervals: Iterable[tuple[int, int]]) -> RankMap:
        """The map of new positions ``0, 1, ...`` onto the ranks of these ``(first position,
        length)`` intervals of this map, taken in order. O(intervals + runs they touch).

        Example: keep positions 0-1 and 4-7 of a map that moved 4-5 onto 8-9::

            >>> RankMap.of([0, 1, 2, 3, 8, 9, 6, 7]).restricted([(0, 2), (4, 4)]).runs
            ((0, 0, 2), (2, 8, 2), (4, 6, 2))
        """
        runs: list[list[int]] = []
        position = 0
        for start, length in intervals:
            end = start + length
            i = bisect.bisect_right(self._positions, start) - 1
            while start < end:
                first, rank, size = self.runs[i]
                take = min(end, first + size) - start
                piece_rank = rank + start - first
                if runs and runs[-1][1] + runs[-1][2] == piece_rank:
                    runs[-1][2] += take
                else:
                    runs.append([position, piece_rank, take])
                position += take
                start += take
                i += 1
        return RankMap(tuple((a, b, c) for a, b, c in runs))

    @functools.cached_property
    def digest(self) -> str:
        """A short name for this placement, alike on every rank that has it."""
        return hashlib.sha1(repr(self.runs).encode()).hexdigest()[:12]


def _merged(pieces: Iterable[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Runs in position order, neighbours that continue each other joined."""
    runs: list[list[int]] = []
    for first, rank, length in pieces:
        if runs and runs[-1][1] + runs[-1][2] == rank:
            runs[-1][2] += length
        else:
            runs.append([first, rank, length])
    return tuple((a, b, c) for a, b, c in runs)
