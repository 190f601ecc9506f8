"""Which block of the job's state each snapshot tensor is, and who sends which block where after
a recovery: torch.distributed.checkpoint's resharding rules, applied in host memory.

Every tensor of a rank's state dict is a block of a global tensor (a :class:`Region`): a
DTensor's local shard lies at the offsets its placements give it (the chunk that DCP saves), a
plain tensor is the whole of one. Which global tensor is named by the tensor's path in the state
dict (torch's ``get_state_dict`` keys parameters and optimizer state by fully qualified name)
and by its **context**: the rank's coordinates along the dims that tell its state apart, which
are all of the grid's dims but the replica dim (peers along it hold the same state) and the dims
the tensor's DeviceMesh spans (its shards along them are told apart by their offsets). So a
tensor-parallel rank's own weights differ along ``tp``, an FSDP2 shard along ``dp`` is placed by
its rows, and a ZeRO rank's optimizer state is found under the parameter's name on whichever
rank held its partition.

After a recovery, each rank of the new grid says which regions its state is made of
(:class:`Wanted`) and which snapshots it holds, its own and its partners' copies (:class:`Held`);
:func:`plan_relay` derives from those, alike on every rank, the latest step at which every block
can be found and which holder sends each (:class:`Part`). A same-shape replacement takes a lost
rank's regions whole from its copy or a replica peer; a shrink or a growth of the sharded dim
cuts the old shards into the new ones, as ``dcp.load`` would from a checkpoint of them.

Example: FSDP2-like rows of an 8 x 2 weight over dp 4, re-laid on dp 2 (no context)::

    >>> import torch
    >>> old = [Held(r, r, 3, False, (("dp", r),), {("w",): Region((), (8, 2), (2 * r, 0), (2, 2), torch.float32)})
    ...        for r in range(4)]
    >>> new = [Wanted(r, (("dp", r),), {("w",): Region((), (8, 2), (4 * r, 0), (4, 2), torch.float32)})
    ...        for r in range(2)]
    >>> plan = plan_relay(new, old, target=3, replica_dim="dp")
    >>> [(p.receiver, p.holder, p.offsets) for p in plan.parts]
    [(0, 0, (0, 0)), (0, 1, (2, 0)), (1, 2, (4, 0)), (1, 3, (6, 0))]
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..layout import GridLayout

__all__ = ["Region", "Placement", "Held", "Wanted", "Part", "RelayPlan", "plan_relay", "plan_whole", "region_of",
           "block_of", "table_of", "chunk"]

#: A leaf's place in a state dict: the keys and list indices that lead to it.
Path = tuple[Any, ...]
#: (dim, coordinate) pairs: where a rank sits, or the part of it that tells its state apart.
Coords = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Region:
    """A tensor of a rank's state as a block of a global tensor: the global tensor is the one of
    that path in ``context``, of ``global_shape``; the block starts at ``offsets`` and has
    ``shape`` (``dtype``: the tensor's, which every block of it must share). ``sharding``: how
    the block follows from the placement, each ``(tensor dim, grid dim)`` chunked along that grid
    dim as torch's ``Shard`` chunks it (``()``: the whole tensor; None: not told by the placement,
    as for a ``_StridedShard`` or a ZeRO partition)."""

    context: Coords
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharding: Optional[tuple[tuple[int, str], ...]] = None

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    def overlap(self, other: Region) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The block (global offsets, shape) both cover, None where they do not meet.

        Example::

            >>> a = Region((), (8,), (0,), (4,), torch.float32)
            >>> a.overlap(Region((), (8,), (2,), (4,), torch.float32)), a.overlap(Region((), (8,), (4,), (4,), torch.float32))
            (((2,), (2,)), None)
        """
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.shape, other.offsets, other.shape))
        if any(end <= start for start, end in zip(starts, ends)):
            return None
        return starts, tuple(end - start for start, end in zip(starts, ends))


@dataclass(frozen=True)
class Placement:
    """Where a rank sits in a job's grid, for naming its regions' context.

    Example: rank 5 of tp 2 x dp 4, its weights sharded (FSDP2) over the dp mesh [1, 3, 5, 7]::

        >>> place = Placement(GridLayout((2, 4), ("tp", "dp")), rank=5, replica_dim="dp")
        >>> place.coords, place.context([1, 3, 5, 7]), place.context(None)
        ((('tp', 1), ('dp', 2)), (('tp', 1),), (('tp', 1),))
    """

    layout: GridLayout
    rank: int
    replica_dim: str

    @property
    def coords(self) -> Coords:
        return tuple(zip(self.layout.dim_names, self.layout.coords(self.rank)))

    def context(self, mesh_ranks: Optional[Sequence[int]]) -> Coords:
        """The coordinates that tell apart the global tensor a tensor of this rank is a block of:
        all but the replica dim's and those of the dims ``mesh_ranks`` (a DTensor's mesh) span."""
        mine = self.layout.coords(self.rank)
        spanned: set[int] = set()
        for rank in mesh_ranks or ():
            if rank != self.rank and self.layout.contains(rank):
                spanned |= {i for i, (a, b) in enumerate(zip(self.layout.coords(rank), mine)) if a != b}
        return tuple((name, mine[i]) for i, name in enumerate(self.layout.dim_names)
                     if name != self.replica_dim and i not in spanned)


def region_of(tensor: torch.Tensor, placement: Placement, contexts: Optional[dict[int, Coords]] = None) -> Region:
    """The region of a live state-dict tensor on a rank at ``placement``: a DTensor's local chunk
    (as DCP saves it), or the whole of a plain tensor. ``contexts``: a cache by DeviceMesh.

    Example::

        >>> place = Placement(GridLayout((2,), ("dp",)), rank=0, replica_dim="dp")
        >>> region_of(torch.zeros(3, 2), place)
        Region(context=(), global_shape=(3, 2), offsets=(0, 0), shape=(3, 2), dtype=torch.float32, sharding=())
    """
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        context = contexts.get(id(mesh)) if contexts is not None else None
        if context is None:
            context = placement.context(mesh.mesh.flatten().tolist())
            if contexts is not None:
                contexts[id(mesh)] = context
        chunk = tensor.__create_chunk_list__()[0]
        found = Region(context, tuple(tensor.shape), tuple(chunk.offsets), tuple(chunk.sizes), tensor.dtype)
        return replace(found, sharding=_sharding_of(tensor, found, placement))
    shape = tuple(tensor.shape)
    return Region(placement.context(None), shape, (0,) * len(shape), shape, tensor.dtype, sharding=())


def _sharding_of(tensor: DTensor, region: Region, placement: Placement) -> Optional[tuple[tuple[int, str], ...]]:
    """Each ``Shard`` placement of ``tensor`` as (tensor dim, the grid dim its mesh dim runs
    along), where every mesh dim it shards over runs along one whole grid dim in order and the
    chunks that makes are the tensor's own (checked against ``region``); else None."""
    mesh = tensor.device_mesh
    me = mesh.get_coordinate()
    if me is None:
        return None
    layout, found = placement.layout, []
    for mesh_dim, kind in enumerate(tensor.placements):
        if isinstance(kind, Replicate):
            continue
        if type(kind) is not Shard:  # _StridedShard, Partial: not a plain chunk of the placement
            return None
        line = mesh.mesh[tuple(me[:mesh_dim]) + (slice(None),) + tuple(me[mesh_dim + 1:])].tolist()
        along = _grid_dim_along(layout, line)
        if along is None:
            return None
        found.append((kind.dim % tensor.dim(), along))
    if len({tensor_dim for tensor_dim, _ in found}) != len(found):
        return None  # two mesh dims over one tensor dim
    coords = dict(zip(layout.dim_names, layout.coords(placement.rank)))
    offsets, shape = [0] * len(region.global_shape), list(region.global_shape)
    for tensor_dim, grid_dim in found:
        offsets[tensor_dim], shape[tensor_dim] = chunk(shape[tensor_dim], layout.dim_size(grid_dim), coords[grid_dim])
    if (tuple(offsets), tuple(shape)) != (region.offsets, region.shape) and region.volume:
        return None
    return tuple(found)


def chunk(rows: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of chunk ``index`` of ``rows`` split over ``parts`` as torch's ``Shard`` splits
    them: ``ceil(rows / parts)`` each, the last ones shorter or empty (an empty one at ``rows``).

    Example::

        >>> [chunk(10, 4, i) for i in range(4)], chunk(3, 4, 3)
        ([(0, 3), (3, 3), (6, 3), (9, 1)], (3, 0))
    """
    full = -(-rows // parts)
    start = full * index
    if start >= rows:
        return rows, 0
    return start, min(rows, start + full) - start


def _grid_dim_along(layout: GridLayout, line: Sequence[int]) -> Optional[str]:
    """The one grid dim that ``line`` (a mesh dim's ranks through this rank) runs along, from 0 to
    its size in order; None where it runs along none or several."""
    if not all(layout.contains(rank) for rank in line):
        return None
    coords = [layout.coords(rank) for rank in line]
    varying = [i for i in range(len(layout.shape)) if len({c[i] for c in coords}) > 1]
    if len(varying) != 1 or layout.shape[varying[0]] != len(line):
        return None
    i = varying[0]
    return layout.dim_names[i] if [c[i] for c in coords] == list(range(len(line))) else None


def block_of(tensor: torch.Tensor, region: Region, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The view of ``tensor`` (the local data of ``region``) over the global block at ``offsets``.

    Example::

        >>> block_of(torch.arange(8), Region((), (16,), (8,), (8,), torch.int64), (10,), (3,)).tolist()
        [2, 3, 4]
    """
    view = tensor
    for dim, (start, size) in enumerate(zip(offsets, shape)):
        view = view.narrow(dim, start - region.offsets[dim], size)
    return view


def table_of(regions: Mapping[Path, Region]) -> str:
    """A name for a whole table of regions, alike on every rank that has the same one: ranks
    whose tables match trade whole snapshots, with no region reported (:func:`plan_whole`).

    Example::

        >>> one = {("w",): Region((), (2,), (0,), (2,), torch.float32)}
        >>> table_of(one) == table_of(dict(one)), table_of(one) == table_of({})
        (True, False)
    """
    return hashlib.blake2b(repr(tuple(regions.items())).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Held:
    """A snapshot a rank holds: ``source``'s state at ``step``, the source's own or a ``copy``;
    ``coords``: where the source sat when it was taken; ``regions``: its tensors' (empty where
    only its ``table`` is reported)."""

    holder: int
    source: int
    step: int
    copy: bool
    coords: Coords
    regions: Mapping[Path, Region]
    table: str = ""


@dataclass(frozen=True)
class Wanted:
    """A rank of the new grid: where it sits, and the regions its live state is made of (empty
    where only their ``table`` is reported)."""

    rank: int
    coords: Coords
    regions: Mapping[Path, Region]
    table: str = ""


@dataclass(frozen=True)
class Part:
    """One block sent: ``holder`` copies the global block (``offsets``, ``shape``) of ``path``
    from the snapshot of ``source`` it holds, into ``receiver``'s state."""

    receiver: int
    path: Path
    holder: int
    source: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class RelayPlan:
    """What every rank derives alike: the ``step`` the job resumes from, every block's
    :class:`Part`, and each receiver's ``templates`` entry: the (holder, source) of the snapshot
    whose other values, RNG states and objects it takes; ``whole``: each receiver takes that
    snapshot whole instead (no parts). ``missing``: what no snapshot of that step holds (then the
    job cannot resume from it)."""

    step: int
    parts: tuple[Part, ...] = ()
    templates: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    whole: bool = False

    @property
    def moves(self) -> bool:
        """Whether any block or template of the plan goes from one rank to another."""
        return any(p.holder != p.receiver for p in self.parts) or any(
            holder != receiver for receiver, (holder, _) in self.templates.items())


def plan_whole(wanted: Sequence[Wanted], held: Sequence[Held], target: int) -> Optional[RelayPlan]:
    """The plan where every rank's state is the whole of a snapshot someone holds (its table
    matches; no shape changed), from the tables alone: the latest such step at most ``target``,
    each receiver taking its own, else the snapshot of the position it took (same coords), else a
    rank's own before a copy, from the lowest rank. None where no step serves every rank.

    Example: rank 4 took rank 2's place; rank 0 holds rank 2's copy, rank 6 (a replica of rank
    2's) its own::

        >>> held = [Held(0, 0, 3, False, (("dp", 0),), {}, "a"), Held(0, 2, 3, True, (("dp", 2),), {}, "c"),
        ...         Held(6, 6, 3, False, (("dp", 2),), {}, "c")]
        >>> plan = plan_whole([Wanted(0, (("dp", 0),), {}, "a"), Wanted(4, (("dp", 2),), {}, "c")], held, 3)
        >>> plan.templates, plan.whole
        ({0: (0, 0), 4: (6, 6)}, True)
        >>> plan_whole([Wanted(4, (("dp", 1),), {}, "b")], held, 3) is None
        True
    """
    for step in sorted({h.step for h in held if h.step <= target}, reverse=True):
        chosen: dict[int, tuple[int, int]] = {}
        for want in wanted:
            alike = [h for h in held if h.step == step and h.table == want.table]
            own = [h for h in held if h.step == step and (h.holder, h.source) == (want.rank, want.rank)]
            if not alike or (own and own[0].table != want.table):  # its own state changed shape: re-laid
                break
            h = min(alike, key=lambda h: ((h.holder, h.source) != (want.rank, want.rank), h.coords != want.coords,
                                          h.copy, h.holder, h.source))
            chosen[want.rank] = (h.holder, h.source)
        else:
            return RelayPlan(step, templates=chosen, whole=True)
    return None


def plan_relay(wanted: Sequence[Wanted], held: Sequence[Held], target: int, replica_dim: str) -> RelayPlan:
    """The latest step, at most ``target``, at which every block every rank of ``wanted`` needs is
    held by someone, and who sends each; where no step serves, the plan of ``target`` with what is
    missing. A block comes from the receiver itself where it holds it, else from a rank's own
    snapshot before a copy, else from the lowest rank holding it. A receiver's values, RNG and
    objects come from its own snapshot, else from that of the position it took (same coords),
    else from a peer along the replica dim.

    Example: ranks 4 and 5 took the places of 2 and 3 (lost; no replica peers), whose copies
    ranks 0 and 1 hold::

        >>> import torch
        >>> def regions(r):
        ...     return {("w",): Region((("dp", r),), (2,), (0,), (2,), torch.float32)}
        >>> held = [Held(0, 0, 3, False, (("dp", 0),), regions(0)), Held(0, 2, 3, True, (("dp", 2),), regions(2)),
        ...         Held(1, 1, 3, False, (("dp", 1),), regions(1)), Held(1, 3, 3, True, (("dp", 3),), regions(3))]
        >>> wanted = [Wanted(r, (("dp", p),), regions(p)) for p, r in enumerate([0, 1, 4, 5])]
        >>> plan = plan_relay(wanted, held, 3, replica_dim="none")
        >>> [(p.receiver, p.holder, p.source) for p in plan.parts], plan.templates[4]
        ([(0, 0, 0), (1, 1, 1), (4, 0, 2), (5, 1, 3)], (0, 2))
        >>> plan_relay(wanted, held[:3], 3, replica_dim="none").missing
        ("rank 5: w in context (('dp', 3),), 2 of 2 elements held by nobody", "rank 5: no snapshot of step 3 of a position like (('dp', 3),)")
    """
    steps = sorted({h.step for h in held if h.step <= target} | {target}, reverse=True)
    first: Optional[RelayPlan] = None
    for step in steps:
        plan = _plan_at(step, wanted, [h for h in held if h.step == step], replica_dim)
        if not plan.missing:
            return plan
        first = first or plan
    assert first is not None
    return first


def _plan_at(step: int, wanted: Sequence[Wanted], held: Sequence[Held], replica_dim: str) -> RelayPlan:
    pieces: dict[tuple[Any, ...], dict[tuple[tuple[int, ...], tuple[int, ...]], list[Held]]] = {}
    for h in held:
        for path, region in h.regions.items():
            key = (path, region.context, region.global_shape, region.dtype)
            pieces.setdefault(key, {}).setdefault((region.offsets, region.shape), []).append(h)
    parts: list[Part] = []
    missing: list[str] = []
    templates: dict[int, tuple[int, int]] = {}
    for want in wanted:
        for path, need in want.regions.items():
            covered = 0
            found = pieces.get((path, need.context, need.global_shape, need.dtype), {})
            for (offsets, shape), holders in sorted(found.items()):
                block = need.overlap(Region(need.context, need.global_shape, offsets, shape, need.dtype))
                if block is None:
                    continue
                h = min(holders, key=lambda h: (h.holder != want.rank, h.copy, h.holder, h.source))
                parts.append(Part(want.rank, path, h.holder, h.source, *block))
                covered += math.prod(block[1])
            if covered != need.volume:
                missing.append(f"rank {want.rank}: {'/'.join(map(str, path))} in context {need.context}, "
                               f"{need.volume - covered} of {need.volume} elements held by nobody")
        alike = [h for h in held if (h.holder, h.source) == (want.rank, want.rank)
                 or _without(h.coords, replica_dim) == _without(want.coords, replica_dim)]
        if alike:
            chosen = min(alike, key=lambda h: ((h.holder, h.source) != (want.rank, want.rank), h.coords != want.coords,
                                               h.copy, h.holder, h.source))
            templates[want.rank] = (chosen.holder, chosen.source)
        else:
            missing.append(f"rank {want.rank}: no snapshot of step {step} of a position like {want.coords}")
    return RelayPlan(step, tuple(parts), templates, tuple(missing))


def _without(coords: Coords, dim: str) -> Coords:
    return tuple(pair for pair in coords if pair[0] != dim)
