"""A partition of a span of consecutive ranks into equal groups, as (size, stride) modes.

Two requests that make the same groups (a grid's dims, a view's, a DeviceMesh's flattened or
unflattened dims) have equal partitions, so the registry can share their communicator by value.

Example::

    >>> part = Partition.of(0, 16, [(2, 2), (2, 8)])
    >>> part.group_ranks(10), part.num_groups
    ([0, 2, 8, 10], 4)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from .checks import as_int
from .rank_map import RankMap

__all__ = ["MAX_ENUMERATED_RANKS", "Partition", "canonical_modes"]

#: The largest grid whose every group :meth:`GridLayout.enumerate` lists; beyond it the lists alone
#: take gigabytes (about 36 bytes a rank). One rank's group, :meth:`GridLayout.group_ranks`, has no limit.
MAX_ENUMERATED_RANKS = 1 << 26


@dataclass(frozen=True)
class Partition:
    """The way one dims request splits a span of ranks into groups, in canonical form.

    Two requests produce exactly the same set of groups if and only if their partitions are
    equal, whatever grid, view, DeviceMesh or dim names they came from. ``modes`` holds the
    (size, stride) pairs of the grouped dims after dropping size-1 dims and merging contiguous
    ones, sorted by stride; ``rank_offset`` and ``span`` bound the ranks that take part. A group
    is every rank reached from its lowest one by steps of ``stride``, fewer than ``size`` of them
    per mode: the ranks ``[0, 1, 4, 5]`` of ``modes ((2, 1), (2, 4))``.

    Example::

        >>> from hypergrid.layout import GridLayout
        >>> a = GridLayout((2, 2, 4), ("tp", "cp", "dp")).partition(["tp", "cp"])
        >>> b = GridLayout((4, 4), ("tp", "dp")).partition(["tp"])
        >>> a == b
        True
        >>> p = Partition.of(0, 16, [(2, 1), (2, 8)])   # e.g. a DeviceMesh's flattened dims
        >>> p.group_ranks(9), p.num_groups
        ([0, 1, 8, 9], 4)
    """

    rank_offset: int
    span: int
    modes: tuple[tuple[int, int], ...]
    #: Where the positions sit among global ranks (see :class:`~hypergrid.layout.rank_map.RankMap`);
    #: None: position ``p`` is rank ``rank_offset + p``. The modes step over positions.
    rank_map: Optional[RankMap] = None

    def __post_init__(self) -> None:
        if self.rank_map is not None:
            if not isinstance(self.rank_map, RankMap):
                raise TypeError(f"rank_map must be a RankMap or None, got {type(self.rank_map).__name__}")
            if self.rank_map.size != self.span:
                raise ValueError(f"rank_map covers {self.rank_map.size} positions, the span has {self.span}")
            if self.rank_map.is_contiguous:  # the default placement: one value, one form
                object.__setattr__(self, "rank_offset", self.rank_map.first_rank)
                object.__setattr__(self, "rank_map", None)
            else:
                object.__setattr__(self, "rank_offset", self.rank_map.first_rank)

    def __repr__(self) -> str:
        placed = "" if self.rank_map is None else f", rank_map={self.rank_map!r}"
        return f"Partition(rank_offset={self.rank_offset}, span={self.span}, modes={self.modes}{placed})"

    @classmethod
    def of(cls, rank_offset: int, span: int, modes: Sequence[tuple[int, int]],
           rank_map: Optional[RankMap] = None) -> Partition:
        """The partition of ``span`` ranks from ``rank_offset`` made by ``modes`` (any order, any
        size-1 modes), checked to split the span into equal, disjoint groups. O(number of modes).
        With ``rank_map``, the modes step over positions and the groups are their ranks.

        Example::

            >>> Partition.of(4, 8, [(1, 2), (2, 4), (2, 1)])
            Partition(rank_offset=4, span=8, modes=((2, 1), (2, 4)))
            >>> Partition.of(0, 8, [(2, 3)])
            Traceback (most recent call last):
            ...
            ValueError: modes ((2, 3),) (size, stride) do not split a span of 8 ranks into equal groups: the span is not a multiple of 6
        """
        offset = as_int(rank_offset, "rank_offset")
        total = as_int(span, "span")
        if offset < 0 or total <= 0:
            raise ValueError(f"a partition needs rank_offset >= 0 and span > 0, got {offset} and {total}")
        checked = []
        for mode in modes:
            size, stride = (as_int(v, "a mode's size and stride") for v in mode)
            if size <= 0 or stride <= 0:
                raise ValueError(f"a mode's size and stride must be positive, got (size, stride) {(size, stride)}")
            checked.append((size, stride))
        canonical = canonical_modes(checked)
        # Digits of a rank's position are read as (position // stride) % size; that names one
        # group per rank, alike from every member, exactly when each stride is a multiple of the
        # reach of the modes below it and the span a multiple of the whole reach.
        reach = 1
        for size, stride in canonical:
            if stride % reach:
                raise ValueError(
                    f"modes {canonical} (size, stride) do not split a span of {total} ranks into equal "
                    f"groups: stride {stride} is not a multiple of {reach}, the reach of the modes below it"
                )
            reach = size * stride
        if total % reach:
            raise ValueError(
                f"modes {canonical} (size, stride) do not split a span of {total} ranks into equal "
                f"groups: the span is not a multiple of {reach}"
            )
        return cls(offset, total, canonical, rank_map)

    @property
    def group_size(self) -> int:
        return math.prod(size for size, _ in self.modes)

    @property
    def num_groups(self) -> int:
        """How many groups the span splits into."""
        return self.span // self.group_size

    def contains(self, rank: int) -> bool:
        """Whether global ``rank`` is one of the span's."""
        return self._position(as_int(rank, "rank")) is not None

    def _position(self, rank: int) -> Optional[int]:
        if self.rank_map is not None:
            return self.rank_map.position(rank)
        local = rank - self.rank_offset
        return local if 0 <= local < self.span else None

    def group_ranks(self, rank: int) -> list[int]:
        """The group holding global ``rank``, in position order (ascending for the default
        placement). O(group size).

        Example::

            >>> from hypergrid.layout import GridLayout
            >>> GridLayout((2, 3, 4), ("tp", "cp", "dp")).partition(["dp"]).group_ranks(7)
            [1, 7, 13, 19]
        """
        position = self._position(as_int(rank, "rank"))
        if position is None:
            raise ValueError(
                f"rank {rank} is outside the span [{self.rank_offset}, {self.rank_offset + self.span}) "
                f"of this partition" if self.rank_map is None else
                f"rank {rank} is not one of this partition's ranks (placed by {self.rank_map!r})"
            )
        if self.rank_map is None:
            # The offset rides on the first position: one pass, not a second over the group.
            return self._group_positions(position, shift=self.rank_offset)
        return self.rank_map.ranks_of(self._group_positions(position))

    def _group_positions(self, position: int, shift: int = 0) -> list[int]:
        base = position + shift
        for size, stride in self.modes:
            base -= ((position // stride) % size) * stride
        if len(self.modes) == 1:
            size, stride = self.modes[0]
            return list(range(base, base + size * stride, stride))
        # Each mode's steps are multiples of the reach of the modes below it (checked in of()),
        # so stepping the widest mode outermost lists the group in ascending order.
        members = [base]
        for size, stride in self.modes:
            members = [m + step for step in range(0, size * stride, stride) for m in members]
        return members

    def enumerate(self) -> list[list[int]]:
        """Every group, by its first position, each in position order. O(span).

        Example::

            >>> Partition.of(0, 8, [(2, 4)]).enumerate()
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        """
        if self.span > MAX_ENUMERATED_RANKS:
            raise ValueError(
                f"enumerating every group of a {self.span:,}-rank span would hold {self.span:,} ranks in "
                f"Python lists; the limit is {MAX_ENUMERATED_RANKS:,} ranks. Ask for one rank's group "
                f"(group_ranks), which costs O(group size)."
            )
        seen: set[int] = set()
        groups = []
        for position in range(self.span):
            if position not in seen:
                group = self._group_positions(position)
                seen.update(group)
                groups.append(group)
        if self.rank_map is None:
            return [[self.rank_offset + p for p in group] for group in groups]
        return [self.rank_map.ranks_of(group) for group in groups]


def canonical_modes(modes: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The one way to write a set of (size, stride) modes: size-1 modes dropped, sorted by
    stride, contiguous ones merged, so that equal results mean the same ranks.

    Example::

        >>> canonical_modes([(4, 2), (1, 8), (2, 1)])
        ((8, 1),)
    """
    merged: list[tuple[int, int]] = []
    for size, stride in sorted((m for m in modes if m[0] > 1), key=lambda m: m[1]):
        if merged and merged[-1][0] * merged[-1][1] == stride:
            prev_size, prev_stride = merged.pop()
            merged.append((prev_size * size, prev_stride))
        else:
            merged.append((size, stride))
    return tuple(merged)
