"""Rank algebra of an N-dimensional grid: pure integers, no torch, no process groups.

Everything here answers "which global ranks?" questions about a grid of named dims laid over a
contiguous span of ranks ``[rank_offset, rank_offset + size)``. The conventions are
Megatron-Core's:

* ``dim_names`` is Megatron's ``order`` string: the *first* name varies fastest over global
  ranks, so ``rank = rank_offset + sum(coord[i] * stride[i])`` with
  ``stride[i] = shape[0] * ... * shape[i - 1]``.
* A group key lists dims in the order of the *reversed* ``dim_names`` joined by ``"-"``; with
  ``["tp", "cp", "dp"]`` both ``["tp", "dp"]`` and ``["dp", "tp"]`` have the key ``"dp-tp"``.
* An enumeration of dims ``[d1, ..., dk]`` lists one group per combination of the other dims
  (the last of the other dims in reversed order varies fastest across groups), and inside a
  group ``dk`` varies fastest. This is what ``einops.rearrange`` produces in Megatron-Core's
  ``HyperCommGrid._gen_rank_enum`` and what ``RankGenerator.get_ranks`` returns.

Example::

    >>> layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    >>> layout.coords(7)
    (1, 0, 1)
    >>> layout.group_ranks(["dp"], rank=7)
    [1, 7, 13, 19]
    >>> layout.enumerate(["tp", "cp"])[1]
    [6, 7, 8, 9, 10, 11]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from .checks import as_int, validate_shape_and_names
from .partition import MAX_ENUMERATED_RANKS, Partition, canonical_modes
from .rank_map import RankMap

__all__ = ["Dims", "GridLayout", "KEY_SEPARATOR"]

#: What callers may pass as a dims request, one name or a list/tuple of names.
Dims = Union[str, Sequence[str]]

#: Joins dim names into a group key; it may therefore not appear inside a dim name.
KEY_SEPARATOR = "-"




@dataclass(frozen=True)
class GridLayout:
    """An N-dimensional grid of named dims over ``size`` consecutive ranks from ``rank_offset``,
    or over any ranks: ``rank_map`` puts each position (the rank a coordinate has in the default
    placement, less ``rank_offset``) on a global rank of its own.

    A frozen value: comparing, hashing and sharing it across threads is safe. All methods are
    pure integer arithmetic; the cost of each is stated in its docstring. A rank map that is
    contiguous is the default placement, and is stored as ``rank_offset`` alone; otherwise
    ``rank_offset`` is the rank of position 0.

    Example::

        >>> layout = GridLayout((2, 3, 4, 5), ("tp", "cp", "pp", "dp"))
        >>> layout.size, layout.strides
        (120, (1, 2, 6, 24))
        >>> layout.key(["dp", "tp"])
        'dp-tp'
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    rank_offset: int = 0
    rank_map: Optional[RankMap] = None
    # Derived in __post_init__, not part of the value (equality and hashing use the four above).
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape, names = validate_shape_and_names(self.shape, self.dim_names)
        offset = as_int(self.rank_offset, "rank_offset")
        if offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {offset}")
        if self.rank_map is not None:
            if not isinstance(self.rank_map, RankMap):
                raise TypeError(f"rank_map must be a RankMap or None, got {type(self.rank_map).__name__} {self.rank_map!r}")
            if self.rank_map.size != math.prod(shape):
                raise ValueError(f"rank_map places {self.rank_map.size} positions, but shape {list(shape)} has "
                                 f"{math.prod(shape)}")
            if offset not in (0, self.rank_map.first_rank):
                raise ValueError(f"rank_offset {offset} contradicts rank_map, whose position 0 is rank "
                                 f"{self.rank_map.first_rank}; give one or the other")
            offset = self.rank_map.first_rank
            if self.rank_map.is_contiguous:
                object.__setattr__(self, "rank_map", None)
        # Normalise lists to tuples and numpy ints to ints so that equal grids hash equal.
        object.__setattr__(self, "rank_offset", offset)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dim_names", names)
        strides = []
        stride = 1
        for size in shape:
            strides.append(stride)
            stride *= size
        object.__setattr__(self, "_strides", tuple(strides))
        object.__setattr__(self, "_index", {name: i for i, name in enumerate(names)})

    def __repr__(self) -> str:
        placed = "" if self.rank_map is None else f", rank_map={self.rank_map!r}"
        return f"GridLayout(shape={self.shape}, dim_names={self.dim_names}, rank_offset={self.rank_offset}{placed})"

    # ---------------------------------------------------------------- basic facts
    @property
    def size(self) -> int:
        """Number of ranks the grid spans, the product of ``shape``."""
        return self._strides[-1] * self.shape[-1]

    @property
    def strides(self) -> tuple[int, ...]:
        """Distance in global ranks between neighbours along each dim (1 for the first dim)."""
        return self._strides

    @property
    def ranks(self) -> Sequence[int]:
        """The global ranks the grid spans, in position order (a range for the default placement)."""
        if self.rank_map is None:
            return range(self.rank_offset, self.rank_offset + self.size)
        return list(self.rank_map)

    @property
    def last_rank(self) -> int:
        """The highest global rank the grid uses."""
        return self.rank_offset + self.size - 1 if self.rank_map is None else self.rank_map.last_rank

    def rank_at(self, position: int) -> int:
        """The global rank at ``position`` (``rank_offset + position`` unless a rank map says otherwise)."""
        return self.rank_offset + position if self.rank_map is None else self.rank_map.rank(position)

    def _ranks_at(self, positions: Sequence[int]) -> list[int]:
        if self.rank_map is None:
            base = self.rank_offset
            return [base + p for p in positions]
        return self.rank_map.ranks_of(positions)

    def dim_size(self, name: str) -> int:
        """Size of one dim, by name. ``GridLayout((2, 4), ("tp", "dp")).dim_size("dp") == 4``."""
        return self.shape[self._dim_index(name)]

    def contains(self, rank: int) -> bool:
        """Whether global ``rank`` is one of the grid's."""
        return self._position(as_int(rank, "rank")) is not None

    def position_key(self, rank: int) -> tuple[int, int]:
        """A sort key that lists the grid's ranks in position order (ranks outside it last).

        Example::

            >>> from hypergrid.layout.rank_map import RankMap
            >>> placed = GridLayout((4,), ("dp",), rank_map=RankMap.of([9, 1, 2, 3]))
            >>> sorted([1, 9, 3], key=placed.position_key)
            [9, 1, 3]
        """
        position = self._position(as_int(rank, "rank"))
        return (0, position) if position is not None else (1, rank)

    def _position(self, rank: int) -> Optional[int]:
        if self.rank_map is not None:
            return self.rank_map.position(rank)
        local = rank - self.rank_offset
        return local if 0 <= local < self.size else None

    def _dim_index(self, name: object) -> int:
        if not isinstance(name, str):
            raise TypeError(f"a dim name must be a str, got {type(name).__name__} {name!r}")
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(
                f"unknown dim {name!r}; this grid has dims {list(self.dim_names)}"
            ) from None

    # ---------------------------------------------------------------- dims and keys
    def _dim_list(self, dims: object) -> list[str]:
        """A dims request as a list of known, distinct names (order kept)."""
        if isinstance(dims, str):
            names = [dims]
        elif isinstance(dims, (list, tuple)):
            names = list(dims)
        else:
            raise TypeError(
                f"dims must be a dim name or a list of dim names, got {type(dims).__name__} {dims!r}"
            )
        if not names:
            raise ValueError(f"dims must name at least one dim of {list(self.dim_names)}, got {dims!r}")
        seen: set[str] = set()
        for name in names:
            self._dim_index(name)
            if name in seen:
                raise ValueError(f"dim {name!r} appears more than once in {names}")
            seen.add(name)
        return names

    def order_dims(self, dims: Dims) -> tuple[list[str], str]:
        """Dims sorted by the reversed ``dim_names``, and the group key they make.

        Matches Megatron-Core's ``HyperCommGrid._order_dims``.

        Example::

            >>> GridLayout((2, 3, 4), ("tp", "cp", "dp")).order_dims(["tp", "dp"])
            (['dp', 'tp'], 'dp-tp')
        """
        names = self._dim_list(dims)
        ordered = sorted(names, key=lambda n: -self._index[n])
        return ordered, KEY_SEPARATOR.join(ordered)

    def key(self, dims: Dims) -> str:
        """The canonical group key of ``dims``: ``order_dims(dims)[1]``."""
        return self.order_dims(dims)[1]

    # ---------------------------------------------------------------- one rank
    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of global ``rank``, one per dim in ``dim_names`` order. O(ndims).

        Example::

            >>> GridLayout((2, 3), ("tp", "dp"), rank_offset=10).coords(13)
            (1, 1)
        """
        local = self._local(rank)
        return tuple((local // stride) % size for size, stride in zip(self.shape, self.strides))

    def rank_of(self, coords: Sequence[int] | dict[str, int]) -> int:
        """Global rank at ``coords`` (a sequence in ``dim_names`` order or a name->index dict).

        Example::

            >>> GridLayout((2, 3), ("tp", "dp")).rank_of({"tp": 1, "dp": 2})
            5
        """
        if isinstance(coords, dict):
            unknown = [name for name in coords if name not in self._index]
            if unknown or len(coords) != len(self.dim_names):
                raise ValueError(
                    f"coords must give exactly the dims {list(self.dim_names)}, got {list(coords)}"
                )
            values = [coords[name] for name in self.dim_names]
        elif isinstance(coords, (list, tuple)):
            values = list(coords)
            if len(values) != len(self.shape):
                raise ValueError(
                    f"coords must have {len(self.shape)} entries (one per dim of "
                    f"{list(self.dim_names)}), got {len(values)}: {values}"
                )
        else:
            raise TypeError(f"coords must be a list, tuple or dict, got {type(coords).__name__} {coords!r}")
        position = 0
        for name, size, stride, value in zip(self.dim_names, self.shape, self.strides, values):
            value = as_int(value, f"coordinate of dim {name!r}")
            if not 0 <= value < size:
                raise ValueError(f"coordinate of dim {name!r} must be in [0, {size}), got {value}")
            position += value * stride
        return self.rank_at(position)

    def _local(self, rank: object) -> int:
        """The position of global ``rank``; a ValueError naming the grid's ranks if it has none."""
        rank = as_int(rank, "rank")
        position = self._position(rank)
        if position is None:
            raise ValueError(
                f"rank {rank} is outside the grid, which spans ranks "
                f"[{self.rank_offset}, {self.rank_offset + self.size})" if self.rank_map is None else
                f"rank {rank} is not one of the grid's ranks (placed by {self.rank_map!r})"
            )
        return position

    def _check_enumerable(self) -> None:
        if self.size > MAX_ENUMERATED_RANKS:
            raise ValueError(
                f"enumerating every group of a {self.size:,}-rank grid would hold {self.size:,} ranks "
                f"in Python lists (about {self.size * 36 / 2**30:,.0f} GiB); the limit is "
                f"{MAX_ENUMERATED_RANKS:,} ranks. Ask for one rank's group instead "
                f"(HyperCommGrid.ranks(dims, rank) / GridLayout.group_ranks), which costs O(group size)."
            )

    def _offsets(self, dims: Sequence[str]) -> list[int]:
        # Rank offsets of every combination of `dims`, the first slowest and the last fastest:
        # an outer sum built one dim at a time, so its cost is the number of combinations.
        offsets = [0]
        for name in dims:
            i = self._index[name]
            stride = self.strides[i]
            steps = range(0, self.shape[i] * stride, stride)
            offsets = [base + step for base in offsets for step in steps]
        return offsets

    def group_ranks(self, dims: Dims, rank: int) -> list[int]:
        """The members of the ``dims`` group that holds global ``rank``, in enumeration order.

        Equal to the row of ``enumerate(dims)`` that contains ``rank``, computed in
        O(group size) without enumerating the other groups.

        Example::

            >>> GridLayout((2, 3, 4), ("tp", "cp", "dp")).group_ranks(["cp", "tp"], rank=7)
            [6, 7, 8, 9, 10, 11]
        """
        ordered, _ = self.order_dims(dims)
        local = self._local(rank)
        base = local
        for name in ordered:
            i = self._index[name]
            base -= ((local // self.strides[i]) % self.shape[i]) * self.strides[i]
        return self._ranks_at([base + offset for offset in self._offsets(ordered)])

    def consecutive_groups(self, dims: Dims, along: str, start: int, count: int) -> list[int]:
        """The members of ``count`` consecutive ``dims`` groups along the dim ``along`` from index
        ``start`` (every other dim at 0), concatenated, each in enumeration order. One pass over
        the members, however many groups: a group's offsets are computed once and shifted.

        Example::

            >>> GridLayout((2, 4), ("tp", "dp")).consecutive_groups(["tp"], "dp", 2, 2)
            [4, 5, 6, 7]
        """
        ordered, _ = self.order_dims(dims)
        i = self._index[along]
        if not 0 <= start <= start + count <= self.shape[i]:
            raise ValueError(f"groups {start} to {start + count - 1} along {along!r} are outside its size {self.shape[i]}")
        stride = self.strides[i]
        offsets = self._offsets(ordered)
        return self._ranks_at([k * stride + offset for k in range(start, start + count) for offset in offsets])

    def group_index(self, dims: Dims, rank: int) -> int:
        """Index of ``rank``'s group in ``enumerate(dims)``. O(ndims).

        Example::

            >>> GridLayout((2, 3, 4), ("tp", "cp", "dp")).group_index(["dp"], rank=7)
            1
        """
        ordered, _ = self.order_dims(dims)
        coords = self.coords(rank)
        # Across groups the remaining dims count like ranks do: the first dim fastest.
        rest = [i for i in range(len(self.shape)) if self.dim_names[i] not in ordered]
        index = 0
        multiplier = 1
        for i in rest:
            index += coords[i] * multiplier
            multiplier *= self.shape[i]
        return index

    def num_groups(self, dims: Dims) -> int:
        """How many groups ``enumerate(dims)`` has: ``size // group size``."""
        return self.size // self.group_size(dims)

    def group_size(self, dims: Dims) -> int:
        """Number of ranks in each ``dims`` group: the product of their sizes."""
        return math.prod(self.shape[self._index[n]] for n in self._dim_list(dims))

    # ---------------------------------------------------------------- all groups
    def gen_rank_enum(self, dims: Sequence[str]) -> list[list[int]]:
        """Every group of ``dims``, with ``dims`` taken in the order given (last fastest).

        The semantics of Megatron-Core's ``HyperCommGrid._gen_rank_enum``: it does not reorder
        ``dims``; callers normally pass ``order_dims(dims)[0]``. O(size).

        Example::

            >>> GridLayout((2, 2, 2), ("a", "b", "c")).gen_rank_enum(["a", "b"])
            [[0, 2, 1, 3], [4, 6, 5, 7]]
        """
        names = self._dim_list(dims)
        self._check_enumerable()
        rest = [n for n in reversed(self.dim_names) if n not in names]
        inner = self._offsets(names)
        outer = self._offsets(rest)
        if self.rank_map is None:
            start = self.rank_offset
            return [[start + o + i for i in inner] for o in outer]
        return [self.rank_map.ranks_of([o + i for i in inner]) for o in outer]

    def enumerate(self, dims: Dims) -> list[list[int]]:
        """Every group of ``dims`` in Megatron order: ``get_rank_enum`` / ``RankGenerator``. O(size).

        Example::

            >>> GridLayout((2, 3, 4), ("tp", "cp", "dp")).enumerate("tp")[:3]
            [[0, 1], [2, 3], [4, 5]]
        """
        ordered, _ = self.order_dims(dims)
        return self.gen_rank_enum(ordered)

    def partition(self, dims: Dims) -> Partition:
        """The canonical :class:`Partition` of the span made by ``dims``. O(ndims).

        Equal partitions mean identical groups, so it serves as a cheap, world-size-independent
        identity for "this set of groups" that every rank computes alike.
        """
        names = set(self._dim_list(dims))
        modes = [(self.shape[i], self.strides[i]) for i, name in enumerate(self.dim_names) if name in names]
        return Partition(self.rank_offset, self.size, canonical_modes(modes), self.rank_map)

    # ---------------------------------------------------------------- views
    def check_view(self, view: GridLayout, shared_dims: Sequence[str] = (), name: str = "view") -> None:
        """Check that ``view`` (registered as ``name``) is another factorization of the same ranks.

        ``shared_dims`` are dims the view claims to have in common with this grid: each must
        exist in both and make the same groups in both, alone and all together (what
        Megatron-Core's ``register_view`` compares, enumeration against enumeration, and with its
        wording). Compared by :class:`Partition` in O(ndims), so a dim of size 1 is shared
        whatever its stride; a difference names both enumerations' first groups and the dim's
        (size, stride) on each side.

        Example::

            >>> dense = GridLayout((2, 2, 4), ("tp", "cp", "dp"))
            >>> dense.check_view(GridLayout((4, 4), ("ep", "dp")), shared_dims=["dp"])
            >>> dense.check_view(GridLayout((4, 4), ("dp", "ep")), shared_dims=["dp"], name="expert")
            Traceback (most recent call last):
            ...
            ValueError: Shared dim 'dp' has different membership across views: base enumeration [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]] != view 'expert' enumeration [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]; (size, stride) (4, 1) in the view but (4, 4) in the grid
        """
        if not isinstance(view, GridLayout):
            raise TypeError(f"view must be a GridLayout, got {type(view).__name__} {view!r}")
        if view.rank_offset != self.rank_offset or view.size != self.size or view.rank_map != self.rank_map:
            raise ValueError(
                f"a view must span the grid's ranks [{self.rank_offset}, "
                f"{self.rank_offset + self.size}); shape {list(view.shape)} with rank_offset "
                f"{view.rank_offset} spans [{view.rank_offset}, {view.rank_offset + view.size})"
            )
        for dim in shared_dims:
            if not isinstance(dim, str):
                raise TypeError(f"a shared dim must be a str, got {type(dim).__name__} {dim!r}")
            if dim not in self._index:
                raise ValueError(f"Shared dim {dim!r} of view {name!r} is not in the base view {list(self.dim_names)}")
            if dim not in view._index:
                raise ValueError(f"Shared dim {dim!r} of view {name!r} is not in the view's dim_names {list(view.dim_names)}")
            if self.partition([dim]) != view.partition([dim]):
                mine = (self.dim_size(dim), self.strides[self._index[dim]])
                theirs = (view.dim_size(dim), view.strides[view._index[dim]])
                raise ValueError(
                    f"Shared dim {dim!r} has different membership across views: base enumeration "
                    f"{self.first_groups([dim])} != view {name!r} enumeration {view.first_groups([dim])}; "
                    f"(size, stride) {theirs} in the view but {mine} in the grid"
                )
        if len(shared_dims) > 1 and self.partition(shared_dims) != view.partition(shared_dims):
            raise ValueError(
                f"Shared dims {list(shared_dims)!r} have different membership across views: base enumeration "
                f"{self.first_groups(shared_dims)} != view {name!r} enumeration {view.first_groups(shared_dims)}"
            )

    def first_groups(self, dims: Dims, shown: int = 4) -> str:
        """The first ``shown`` groups of the ``dims`` enumeration, computed one by one, and how
        many more there are: O(shown x group size), whatever the grid's size.

        Example::

            >>> GridLayout((2, 8), ("tp", "dp")).first_groups(["tp"], shown=2)
            '[[0, 1], [2, 3]] and 6 more'
        """
        groups = [self.group_ranks(dims, self.rank_offset)]
        while len(groups) < min(shown, self.num_groups(dims)):
            # The next group starts at the smallest rank not yet in one (enumerations are sorted).
            taken = {r for g in groups for r in g}
            start = next(r for r in self.ranks if r not in taken)
            groups.append(self.group_ranks(dims, start))
        more = self.num_groups(dims) - len(groups)
        return f"{groups}{f' and {more} more' if more > 0 else ''}"
