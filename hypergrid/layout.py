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
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

__all__ = [
    "Dims",
    "GridLayout",
    "Partition",
    "KEY_SEPARATOR",
    "MAX_ENUMERATED_RANKS",
    "RESERVED_NAME_CHARACTERS",
    "as_int",
    "validate_shape_and_names",
]

#: What callers may pass as a dims request, one name or a list/tuple of names.
Dims = Union[str, Sequence[str]]

#: Joins dim names into a group key; it may therefore not appear inside a dim name.
KEY_SEPARATOR = "-"


#: Characters a dim name may not hold, because hypergrid's own keys are built with them (``dp-cp``,
#: ``expert:tp``, ``embd(pp)``, lists joined by ``,``), and a name holding one would read as a key.
RESERVED_NAME_CHARACTERS = "-:(),/"

#: The largest grid whose every group :meth:`GridLayout.enumerate` lists; beyond it the lists alone
#: take gigabytes (about 36 bytes a rank). One rank's group, :meth:`GridLayout.group_ranks`, has no limit.
MAX_ENUMERATED_RANKS = 1 << 26


def as_int(value: object, what: str) -> int:
    """``value`` as a Python int by :func:`operator.index` (numpy and torch integer scalars too).

    A bool is refused: a shape of ``[True, 2]`` is a bug, not a size of 1.

    Example::

        >>> import numpy as np
        >>> as_int(np.int64(4), "shape[0]")
        4
        >>> as_int(2.0, "shape[0]")
        Traceback (most recent call last):
        ...
        TypeError: shape[0] must be an int, got float 2.0
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def validate_shape_and_names(shape: object, dim_names: object) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Check a (shape, dim_names) pair and return them as tuples.

    Raises ``TypeError`` for values of the wrong type and ``ValueError`` for values of the right
    type that make no grid, naming the offending value in each case.

    Example::

        >>> validate_shape_and_names([2, 4], ["tp", "dp"])
        ((2, 4), ('tp', 'dp'))
        >>> validate_shape_and_names([2, 0], ["tp", "dp"])
        Traceback (most recent call last):
        ...
        ValueError: shape[1] (dim 'dp') must be a positive integer, got 0
    """
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"shape must be a list or tuple of ints, got {type(shape).__name__} {shape!r}")
    if isinstance(dim_names, (str, bytes)) or not isinstance(dim_names, Sequence):
        raise TypeError(
            f"dim_names must be a list or tuple of str, got {type(dim_names).__name__} {dim_names!r}"
        )
    if len(shape) == 0:
        raise ValueError("shape must have at least one dim, got an empty shape")
    if len(shape) != len(dim_names):
        raise ValueError(
            f"len(shape) {len(shape)} != len(dim_names) {len(dim_names)}: shape={list(shape)}, "
            f"dim_names={list(dim_names)}"
        )
    for i, name in enumerate(dim_names):
        if not isinstance(name, str):
            raise TypeError(f"dim_names[{i}] must be a str, got {type(name).__name__} {name!r}")
        if not name or not name.strip():
            raise ValueError(f"dim_names[{i}] must be a non-empty name, got {name!r}")
        reserved = sorted({c for c in name if c in RESERVED_NAME_CHARACTERS or c.isspace()})
        if reserved:
            raise ValueError(
                f"dim_names[{i}] {name!r} contains {''.join(reserved)!r}; dim names may not hold "
                f"{RESERVED_NAME_CHARACTERS!r} or spaces, which build hypergrid's group keys "
                f"(e.g. 'dp-cp', 'expert:tp'), so a key made from {name!r} would be ambiguous. "
                f"Use '_' instead."
            )
    seen: set[str] = set()
    for name in dim_names:
        if name in seen:
            raise ValueError(f"dim_names must be unique, {name!r} appears twice in {list(dim_names)}")
        seen.add(name)
    sizes = tuple(as_int(size, f"shape[{i}] (dim {dim_names[i]!r})") for i, size in enumerate(shape))
    for i, size in enumerate(sizes):
        if size <= 0:
            raise ValueError(f"shape[{i}] (dim {dim_names[i]!r}) must be a positive integer, got {size}")
    return sizes, tuple(dim_names)


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

    @classmethod
    def of(cls, rank_offset: int, span: int, modes: Sequence[tuple[int, int]]) -> "Partition":
        """The partition of ``span`` ranks from ``rank_offset`` made by ``modes`` (any order, any
        size-1 modes), checked to split the span into equal, disjoint groups. O(number of modes).

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
        return cls(offset, total, canonical)

    @property
    def group_size(self) -> int:
        return math.prod(size for size, _ in self.modes)

    @property
    def num_groups(self) -> int:
        """How many groups the span splits into."""
        return self.span // self.group_size

    def contains(self, rank: int) -> bool:
        """Whether global ``rank`` lies in the span."""
        return self.rank_offset <= as_int(rank, "rank") < self.rank_offset + self.span

    def group_ranks(self, rank: int) -> list[int]:
        """The group holding global ``rank``, ascending. O(group size).

        Example::

            >>> GridLayout((2, 3, 4), ("tp", "cp", "dp")).partition(["dp"]).group_ranks(7)
            [1, 7, 13, 19]
        """
        if not self.contains(rank):
            raise ValueError(
                f"rank {rank} is outside the span [{self.rank_offset}, {self.rank_offset + self.span}) "
                f"of this partition"
            )
        local = rank - self.rank_offset
        base = self.rank_offset + local
        for size, stride in self.modes:
            base -= ((local // stride) % size) * stride
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
        """Every group, by its lowest rank, each ascending. O(span).

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
        for rank in range(self.rank_offset, self.rank_offset + self.span):
            if rank not in seen:
                group = self.group_ranks(rank)
                seen.update(group)
                groups.append(group)
        return groups


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


@dataclass(frozen=True)
class GridLayout:
    """An N-dimensional grid of named dims over ``size`` consecutive ranks from ``rank_offset``.

    A frozen value: comparing, hashing and sharing it across threads is safe. All methods are
    pure integer arithmetic; the cost of each is stated in its docstring.

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
    # Derived in __post_init__, not part of the value (equality and hashing use the three above).
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape, names = validate_shape_and_names(self.shape, self.dim_names)
        offset = as_int(self.rank_offset, "rank_offset")
        if offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {offset}")
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
    def ranks(self) -> range:
        """The global ranks the grid spans."""
        return range(self.rank_offset, self.rank_offset + self.size)

    def dim_size(self, name: str) -> int:
        """Size of one dim, by name. ``GridLayout((2, 4), ("tp", "dp")).dim_size("dp") == 4``."""
        return self.shape[self._dim_index(name)]

    def contains(self, rank: int) -> bool:
        """Whether global ``rank`` lies inside the grid's span."""
        rank = as_int(rank, "rank")
        return self.rank_offset <= rank < self.rank_offset + self.size

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
        rank = self.rank_offset
        for name, size, stride, value in zip(self.dim_names, self.shape, self.strides, values):
            value = as_int(value, f"coordinate of dim {name!r}")
            if not 0 <= value < size:
                raise ValueError(f"coordinate of dim {name!r} must be in [0, {size}), got {value}")
            rank += value * stride
        return rank

    def _local(self, rank: object) -> int:
        rank = as_int(rank, "rank")
        if not self.contains(rank):
            raise ValueError(
                f"rank {rank} is outside the grid, which spans ranks "
                f"[{self.rank_offset}, {self.rank_offset + self.size})"
            )
        return rank - self.rank_offset

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
        base = self.rank_offset + local
        for name in ordered:
            i = self._index[name]
            base -= ((local // self.strides[i]) % self.shape[i]) * self.strides[i]
        return [base + offset for offset in self._offsets(ordered)]

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
        start = self.rank_offset
        return [[start + o + i for i in inner] for o in outer]

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
        return Partition(self.rank_offset, self.size, canonical_modes(modes))

    # ---------------------------------------------------------------- views
    def check_view(self, view: "GridLayout", shared_dims: Sequence[str] = ()) -> None:
        """Check that ``view`` is another factorization of the same span of ranks.

        ``shared_dims`` are dims the view claims to have in common with this grid: each must
        exist in both and make the same groups in both, alone and all together (what
        Megatron-Core's ``register_view`` compares, enumeration against enumeration). Compared
        by :class:`Partition` in O(ndims), so a dim of size 1 is shared whatever its stride.

        Example::

            >>> dense = GridLayout((2, 2, 4), ("tp", "cp", "dp"))
            >>> dense.check_view(GridLayout((4, 4), ("ep", "dp")), shared_dims=["dp"])
            >>> dense.check_view(GridLayout((4, 4), ("dp", "ep")), shared_dims=["dp"])
            Traceback (most recent call last):
            ...
            ValueError: shared dim 'dp' has different membership across views: (size, stride) (4, 1) in the view but (4, 4) in the grid; a shared dim must make the same groups in both
        """
        if not isinstance(view, GridLayout):
            raise TypeError(f"view must be a GridLayout, got {type(view).__name__} {view!r}")
        if view.rank_offset != self.rank_offset or view.size != self.size:
            raise ValueError(
                f"a view must span the grid's ranks [{self.rank_offset}, "
                f"{self.rank_offset + self.size}); shape {list(view.shape)} with rank_offset "
                f"{view.rank_offset} spans [{view.rank_offset}, {view.rank_offset + view.size})"
            )
        for name in shared_dims:
            if not isinstance(name, str):
                raise TypeError(f"a shared dim must be a str, got {type(name).__name__} {name!r}")
            if name not in self._index or name not in view._index:
                raise ValueError(
                    f"shared dim {name!r} must be a dim of both the grid {list(self.dim_names)} "
                    f"and the view {list(view.dim_names)}"
                )
            if self.partition([name]) != view.partition([name]):
                mine = (self.dim_size(name), self.strides[self._index[name]])
                theirs = (view.dim_size(name), view.strides[view._index[name]])
                raise ValueError(
                    f"shared dim {name!r} has different membership across views: (size, stride) "
                    f"{theirs} in the view but {mine} in the grid; a shared dim must make the same "
                    f"groups in both"
                )
        if len(shared_dims) > 1 and self.partition(shared_dims) != view.partition(shared_dims):
            raise ValueError(
                f"shared dims {list(shared_dims)} have different membership across views: "
                f"together they make groups {view.partition(shared_dims)} in the view but "
                f"{self.partition(shared_dims)} in the grid"
            )
