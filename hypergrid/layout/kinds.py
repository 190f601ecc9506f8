"""Kinds of groups: what a layout's groups of one kind are, as pure rank lists.

A :class:`GroupKind` is one kind of group a job makes (``tp``, ``dp_cp``, Megatron's embedding
group, a distributed-optimizer instance, ...): its name, the layout and dims its groups come
from, and a :class:`Derivation` saying how they come from there. Most kinds are the layout's own
groups over their dims (:data:`GRID_GROUPS`); the others are cut from those groups by a rule of
their own, each rule a small frozen type here, answering the same three questions (a group's
size, the group holding one rank, every group) so that nothing above has to ask which rule it is.

Everything is pure integer work over :class:`~hypergrid.layout.GridLayout`: no torch.distributed.
The Megatron plan (:mod:`hypergrid.megatron.spec.plan`), the command line's report
(:mod:`hypergrid.planning.plan`), the pictures, the parity check and the demo all read the same kinds.

Example::

    >>> from hypergrid.layout import GridLayout
    >>> layout = GridLayout((2, 4), ("tp", "dp"))
    >>> dp = GroupKind("dp", layout, ("dp",))
    >>> dp.key, dp.count, dp.size, dp.members(3)
    ('dp', 2, 4, [1, 3, 5, 7])
    >>> halves = GroupKind("dp_half", layout, ("dp",), Chunks(2))
    >>> halves.key, halves.members(3), halves.enumerate()[:2]
    ('chunks of 2(dp)', [1, 3], [[0, 2], [4, 6]])
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from .grid_layout import GridLayout
from .partition import canonical_modes

__all__ = [
    "Derivation",
    "GridGroups",
    "GRID_GROUPS",
    "Chunks",
    "Levels",
    "Singletons",
    "Span",
    "PipelineSubset",
    "JoinedGroups",
    "BackendChoice",
    "Creation",
    "MegatronGlobal",
    "GroupKind",
    "Modes",
    "box_modes",
]


class Derivation:
    """How a kind's groups come from ``layout``'s groups over ``dims``.

    Subclasses answer :meth:`size`, :meth:`members` and :meth:`enumerate`; ``members`` is called
    only for ranks the layout contains, and costs O(size of the group).
    """

    def describe(self) -> str:
        """The rule in a few words, shown in keys (``"chunks of 2(dp)"``); empty for the layout's
        own groups."""
        return ""

    def size(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        """Ranks in each group; None where groups of the kind differ in size."""
        raise NotImplementedError

    def members(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[list[int]]:
        """The group holding ``rank`` (None: in none)."""
        raise NotImplementedError

    def enumerate(self, layout: GridLayout, dims: Sequence[str]) -> list[list[int]]:
        """Every group, in Megatron-Core's creation order."""
        raise NotImplementedError

    def num_groups(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        """How many groups, in O(ndims); None where only :meth:`enumerate` can tell."""
        return None

    def box(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[tuple[int, Modes]]:
        """``(lowest member, canonical modes)`` of ``rank``'s group in O(ndims), where the rule
        keeps groups boxes of the grid; None where only :meth:`members` can tell."""
        return None


@dataclass(frozen=True)
class GridGroups(Derivation):
    """The layout's own groups over ``dims``: what ``HyperCommGrid.create_pg(dims)`` makes.

    Example::

        >>> GridGroups().members(GridLayout((2, 2), ("tp", "dp")), ["tp"], 3)
        [2, 3]
    """

    def size(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return layout.group_size(list(dims))

    def members(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[list[int]]:
        return layout.group_ranks(list(dims), rank)

    def enumerate(self, layout: GridLayout, dims: Sequence[str]) -> list[list[int]]:
        return layout.enumerate(list(dims))

    def num_groups(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return layout.num_groups(list(dims))

    def box(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[tuple[int, Modes]]:
        low, modes = _grid_box(layout, dims, rank)
        return low, canonical_modes(modes)


#: The one :class:`GridGroups` value every plain kind shares.
GRID_GROUPS = GridGroups()


@dataclass(frozen=True)
class Chunks(Derivation):
    """Consecutive slices of ``chunk`` ranks of each grid group (distributed-optimizer instances,
    hybrid dp-cp groups).

    Example::

        >>> Chunks(2).enumerate(GridLayout((4,), ("dp",)), ["dp"])
        [[0, 1], [2, 3]]
    """

    chunk: int

    def size(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return self.chunk if layout.group_size(list(dims)) % self.chunk == 0 else None

    def members(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[list[int]]:
        base = layout.group_ranks(list(dims), rank)
        start = (base.index(rank) // self.chunk) * self.chunk
        return base[start:start + self.chunk]

    def enumerate(self, layout: GridLayout, dims: Sequence[str]) -> list[list[int]]:
        return [base[i:i + self.chunk] for base in layout.enumerate(list(dims)) for i in range(0, len(base), self.chunk)]

    def num_groups(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        size = layout.group_size(list(dims))
        return layout.num_groups(list(dims)) * -(-size // self.chunk)

    def describe(self) -> str:
        return f"chunks of {self.chunk}"


@dataclass(frozen=True)
class Levels(Derivation):
    """One level of a hierarchy inside each grid group: ``count`` members ``stride`` apart, in
    blocks of ``count * stride`` (hierarchical context parallelism, expert-dp levels).

    Example::

        >>> Levels(2, 2).enumerate(GridLayout((4,), ("cp",)), ["cp"])
        [[0, 2], [1, 3]]
    """

    count: int
    stride: int = 1

    def size(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return self.count

    def members(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[list[int]]:
        base = layout.group_ranks(list(dims), rank)
        return self._group(base, base.index(rank))

    def enumerate(self, layout: GridLayout, dims: Sequence[str]) -> list[list[int]]:
        block = self.count * self.stride
        return [
            self._group(base, start + offset)
            for base in layout.enumerate(list(dims))
            for start in range(0, len(base), block)
            for offset in range(self.stride)
        ]

    def _group(self, base: list[int], position: int) -> list[int]:
        block = self.count * self.stride
        start = (position // block) * block + position % self.stride
        return [base[start + j * self.stride] for j in range(self.count)]

    def num_groups(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return layout.num_groups(list(dims)) * (layout.group_size(list(dims)) // self.count)

    def describe(self) -> str:
        return f"level of {self.count} every {self.stride}"


@dataclass(frozen=True)
class Singletons(Derivation):
    """Every rank alone: an axis of one rank that Megatron-Core still makes groups for.

    Example::

        >>> Singletons().enumerate(GridLayout((2,), ("tp",)), [])
        [[0], [1]]
    """


    def size(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return 1

    def members(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[list[int]]:
        return [rank]

    def enumerate(self, layout: GridLayout, dims: Sequence[str]) -> list[list[int]]:
        return [[r] for r in layout.ranks]

    def num_groups(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return layout.size

    def box(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[tuple[int, Modes]]:
        return rank, ()

    def describe(self) -> str:
        return "each rank alone"


@dataclass(frozen=True)
class Span(Derivation):
    """One group of every rank the layout spans, in rank order.

    Example::

        >>> Span().members(GridLayout((2, 2), ("tp", "dp"), 4), [], 5)
        [4, 5, 6, 7]
    """


    def size(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return layout.size

    def members(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[list[int]]:
        return list(layout.ranks)

    def enumerate(self, layout: GridLayout, dims: Sequence[str]) -> list[list[int]]:
        return [list(layout.ranks)]

    def num_groups(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return 1

    def box(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[tuple[int, Modes]]:
        low, modes = _grid_box(layout, layout.dim_names, rank)
        return low, canonical_modes(modes)

    def describe(self) -> str:
        return "every rank"


@dataclass(frozen=True)
class PipelineSubset(Derivation):
    """The ranks ``select`` picks out of each grid group (Megatron's embedding groups: the first
    and last pipeline stage). A rank ``select`` leaves out is in no group of the kind.

    ``keyword`` names the option ``select`` came from, for errors; ``default_size`` is the size
    when ``select`` is Megatron-Core's own default for it (None: a user callback, sizes unknown).

    Example::

        >>> ends = PipelineSubset(lambda ranks: [ranks[0], ranks[-1]], "get_embedding_ranks", 2)
        >>> layout = GridLayout((2, 3), ("dp", "pp"))
        >>> ends.members(layout, ["pp"], 4), ends.members(layout, ["pp"], 2)
        ([0, 4], None)
    """

    select: Callable[[list[int]], list[int]]
    keyword: str
    default_size: Optional[int] = None

    def size(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        if self.default_size is None:
            return None
        return min(self.default_size, layout.group_size(list(dims)))

    def members(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[list[int]]:
        ranks = self.apply(layout.group_ranks(list(dims), rank))
        return ranks if rank in ranks else None

    def enumerate(self, layout: GridLayout, dims: Sequence[str]) -> list[list[int]]:
        return [self.apply(base) for base in layout.enumerate(list(dims))]

    def apply(self, group: list[int]) -> list[int]:
        """``select`` of one grid group, checked: distinct ranks of that group, at least one."""
        result = self.select(list(group))
        if isinstance(result, (str, bytes)) or not hasattr(result, "__iter__"):
            raise TypeError(f"{self.keyword} must return a list of ranks, got {type(result).__name__} {result!r}")
        ranks = list(result)
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int):
                raise TypeError(f"{self.keyword} must return ints, got {r!r} in {ranks} for pipeline group {group}")
        # An empty list would make torch build a group of the whole world; ranks outside the
        # group would make a rank's groups depend on other groups (not local).
        if not ranks or not set(ranks) <= set(group) or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"{self.keyword} must return distinct ranks of the pipeline group it is given, at least "
                f"one; for pipeline group {group} it returned {ranks}"
            )
        return ranks

    def num_groups(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return layout.num_groups(list(dims))

    def describe(self) -> str:
        return f"{self.keyword} of"


@dataclass(frozen=True)
class JoinedGroups(Derivation):
    """``join`` consecutive grid groups over ``dims`` made one, numbered by ``index_dim``, the
    only dim of the layout outside ``dims`` (Megatron's distributed-optimizer instance group:
    consecutive expert tp-ep-pp groups).

    Example::

        >>> layout = GridLayout((2, 4), ("tp", "dp"))
        >>> JoinedGroups(2, "dp").enumerate(layout, ["tp"])
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> JoinedGroups(2, "dp").members(layout, ["tp"], 5)
        [4, 5, 6, 7]
    """

    join: int
    index_dim: str

    def size(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return self.join * layout.group_size(list(dims))

    def members(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[list[int]]:
        first = (layout.coords(rank)[layout.dim_names.index(self.index_dim)] // self.join) * self.join
        return layout.consecutive_groups(list(dims), self.index_dim, first, self.join)

    def enumerate(self, layout: GridLayout, dims: Sequence[str]) -> list[list[int]]:
        groups = layout.enumerate(list(dims))
        # Concatenated in one pass: sum() of lists copies the growing group at each step, which
        # is quadratic in ``join`` (a minute for the one group of a million ranks).
        return [[r for group in groups[i:i + self.join] for r in group] for i in range(0, len(groups), self.join)]

    def num_groups(self, layout: GridLayout, dims: Sequence[str]) -> Optional[int]:
        return -(-layout.num_groups(list(dims)) // self.join)

    def box(self, layout: GridLayout, dims: Sequence[str], rank: int) -> Optional[tuple[int, Modes]]:
        # A box only where the index dim is the one other dim with more than one rank.
        others = [d for d in layout.dim_names if d not in dims and d != self.index_dim]
        if any(layout.dim_size(d) > 1 for d in others) or layout.dim_size(self.index_dim) % self.join:
            return None
        low, modes = _grid_box(layout, dims, rank)
        i = layout.dim_names.index(self.index_dim)
        modes.append((self.join, layout.strides[i]))
        low -= (layout.coords(rank)[i] % self.join) * layout.strides[i]
        return low, canonical_modes(modes)

    def describe(self) -> str:
        return f"{self.join} joined"


#: The (size, stride) modes of a set of ranks, lowest stride first, as ``Partition.modes``.
Modes = tuple[tuple[int, int], ...]


def box_modes(members: Sequence[int]) -> Optional[tuple[int, Modes]]:
    """``(lowest member, modes)`` when ``members`` is a box ``low + {sum c_i * s_i}``, else None.

    The modes are canonical (as in :class:`~hypergrid.layout.Partition`), so two boxes are the
    same set exactly when their results are equal. O(n log n).

    Example::

        >>> box_modes([9, 1, 5, 3, 7, 11]), box_modes([0, 1, 4, 5]), box_modes([0, 1, 3])
        ((1, ((6, 2),)), (0, ((2, 1), (2, 4))), None)
    """
    ranks = sorted(members)
    if not ranks or len(set(ranks)) != len(ranks):
        return None
    low = ranks[0]
    offsets = [r - low for r in ranks]
    modes: list[tuple[int, int]] = []
    while len(offsets) > 1:
        step = offsets[1]
        size = 1
        while size < len(offsets) and offsets[size] == size * step:
            size += 1
        if len(offsets) % size:
            return None
        outer = offsets[::size]
        if any(offsets[k * size + j] != outer[k] + j * step for k in range(len(outer)) for j in range(size)):
            return None
        modes.append((size, step))
        offsets = outer
    return low, canonical_modes(modes)


def _grid_box(layout: GridLayout, dims: Sequence[str], rank: int) -> tuple[int, list[tuple[int, int]]]:
    """The lowest member of ``rank``'s grid group over ``dims``, and the group's modes."""
    coords = layout.coords(rank)
    index = {name: i for i, name in enumerate(layout.dim_names)}
    modes = [(layout.shape[index[d]], layout.strides[index[d]]) for d in dims]
    return rank - sum(coords[index[d]] * layout.strides[index[d]] for d in dims), modes


class BackendChoice(enum.Enum):
    """Which backend a kind's groups ask torch for."""

    DEFAULT = "default"  # the default group's
    GLOO = "gloo"  # a gloo copy of a group, for CPU-side work
    PIPELINE = "pipeline"  # Megatron's pipeline_model_parallel_comm_backend
    # torch's fake backend: a placeholder group with no communicator, which torchtitan 0.3 asks
    # for the mesh dims it does not use (its backend_override)
    FAKE = "fake"


@dataclass(frozen=True)
class Creation:
    """How a kind's groups are asked of torch, beyond their members.

    ``group_desc`` is torch's description; ``nccl_name`` the key of the kind's NCCL options in
    Megatron's ``nccl_comm_cfgs`` (None: none); ``timeout`` whether the job's timeout is passed;
    ``private``: a communicator of its own even where an identical group exists (a second
    communicator over the same ranks, a SHARP target).
    """

    group_desc: Optional[str] = None
    nccl_name: Optional[str] = None
    backend: BackendChoice = BackendChoice.DEFAULT
    timeout: bool = True
    private: bool = False


@dataclass(frozen=True)
class MegatronGlobal:
    """The ``parallel_state`` global a kind fills: the group itself, or one entry of it.

    Example::

        >>> MegatronGlobal("_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", entry=1).label
        'HIERARCHICAL_CONTEXT_PARALLEL_GROUPS[1]'
    """

    #: The attribute of ``megatron.core.parallel_state``, leading underscore included.
    name: str
    #: None: the global is the group. Else the kind is this entry of a list (hierarchical
    #: levels) or, with ``in_dict``, of a dict keyed by group size (hybrid dp-cp groups).
    entry: Optional[int] = None
    in_dict: bool = False

    @property
    def label(self) -> str:
        """The name as reports show it: without the underscore, with the entry."""
        return self.name.lstrip("_") + ("" if self.entry is None else f"[{self.entry}]")


@dataclass(frozen=True)
class GroupKind:
    """One kind of group: the groups ``derivation`` makes of ``layout``'s groups over ``dims``.

    ``view`` is the name of the grid view ``layout`` is (None: the grid itself);
    ``megatron_global`` the ``parallel_state`` global the kind fills (None: none, or not a
    Megatron plan); ``creation`` how its groups are asked of torch.

    Example::

        >>> kind = GroupKind("tp", GridLayout((2, 4), ("tp", "dp")), ("tp",))
        >>> kind.key, kind.count, kind.size, kind.members(5), kind.is_grid_groups
        ('tp', 4, 2, [4, 5], True)
    """

    name: str
    layout: GridLayout
    dims: tuple[str, ...]
    derivation: Derivation = GRID_GROUPS
    view: Optional[str] = None
    megatron_global: Optional[MegatronGlobal] = None
    creation: Creation = Creation()

    @property
    def is_grid_groups(self) -> bool:
        """Whether the kind's groups are the layout's own (what ``create_pg(dims)`` makes)."""
        return isinstance(self.derivation, GridGroups)

    @property
    def key(self) -> str:
        """hypergrid's group key of ``dims`` (reversed ``dim_names`` order), with the rule that
        cuts derived kinds from it."""
        key = self.layout.key(list(self.dims)) if self.dims else "-"
        return key if self.is_grid_groups else f"{self.derivation.describe()}({key})"

    @property
    def count(self) -> int:
        """How many groups of this kind the layout has."""
        count = self.derivation.num_groups(self.layout, self.dims)
        return len(self.enumerate()) if count is None else count

    @property
    def size(self) -> Optional[int]:
        """Ranks in each group; None where groups of this kind differ in size."""
        return self.derivation.size(self.layout, self.dims)

    def members(self, rank: int) -> Optional[list[int]]:
        """The group of this kind holding global ``rank`` (None: in none); O(group size)."""
        if not self.layout.contains(rank):
            return None
        return self.derivation.members(self.layout, self.dims, rank)

    def box(self, rank: int) -> Optional[tuple[int, Modes]]:
        """``(lowest member, modes)`` of ``rank``'s group in O(ndims) where the kind is a grid's
        own groups, one span, single ranks or joined grid groups; None for other rules.

        Example::

            >>> GroupKind("dp", GridLayout((2, 4), ("tp", "dp")), ("dp",)).box(3)
            (1, ((4, 2),))
        """
        if not self.layout.contains(rank) or self.layout.rank_map is not None:
            return None  # a grid placed on other ranks makes groups that are boxes of positions only
        return self.derivation.box(self.layout, self.dims, rank)

    def enumerate(self) -> list[list[int]]:
        """Every group of this kind, in Megatron-Core's order; O(world size)."""
        return self.derivation.enumerate(self.layout, self.dims)
