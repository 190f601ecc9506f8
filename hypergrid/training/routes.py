"""Who serves whom in a restore, derived by each rank for its own part, from what all ranks share.

After a recovery a rank's live state is made of blocks (:class:`~hypergrid.training.regions.Region`)
that snapshots taken on the placement before hold. Which old positions held a block follows from
the two placements and the block's sharding (torch's ``Shard`` rule: ``n`` rows over ``m`` ranks
in chunks of ``ceil(n / m)``, the last ones shorter or empty), so a rank needs no other rank's
report to know where its blocks are, and a keeper of a snapshot (the rank itself, or the holder of
its partner copy) needs none to know who will ask it:

- :meth:`Routes.needs`, on a receiver: each block of its state, the old positions that held it
  (the one along the replica dim it sits at, then the next one), and whether it holds that
  block itself (it sat at one of them).
- :meth:`Routes.owed`, on a keeper: the receivers that will ask it, and about which sources, from
  the regions of the snapshots it keeps, by the same rule seen from the other side.

Both sides derive the same pairs, so the exchange that follows is point to point among them, and
its size is set by a rank's state, not by the world's. A block whose sharding the rule does not
describe (``Region.sharding`` None: a ``_StridedShard``, a ZeRO partition) raises
:class:`NotDerivable`; the restore then plans from every rank's report instead.

Example: tp 2 x dp 4 on nodes of 2 (a node is one dp coordinate), node 1 (ranks 2 and 3) replaced
by ranks 8 and 9; rank 8 holds nothing, and the copy of rank 2's state is on rank 4::

    >>> import torch
    >>> from hypergrid.layout.rank_map import RankMap
    >>> old = GridLayout((2, 4), ("tp", "dp"))
    >>> new = GridLayout((2, 4), ("tp", "dp"), rank_map=RankMap.of([0, 1, 8, 9, 4, 5, 6, 7]))
    >>> routes = Routes(old, new, replica_dim="none", gpus_per_node=2)
    >>> weight = Region((("tp", 0), ("dp", 1)), (4,), (0,), (4,), torch.float32, sharding=())
    >>> [(n.path, n.sources, n.own) for n in routes.needs(8, {("w",): weight})]
    [(('w',), (2,), False)]
    >>> routes.keepers(2), routes.kept_by(4)
    ([4], [2])
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..layout import GridLayout
from .regions import Path, Region, chunk

__all__ = ["Routes", "Need", "NotDerivable", "block_at"]


class NotDerivable(Exception):
    """A block whose holders the placements and sharding do not tell (the restore then plans from
    every rank's report)."""


def block_at(region: Region, layout: GridLayout, coords: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The block (global offsets, shape) the tensor of ``region`` has at ``coords`` of ``layout``, by
    its sharding (each ``(tensor dim, grid dim)`` chunked along that grid dim).

    Example: 10 rows over dp 4, the rank at dp 3::

        >>> import torch
        >>> rows = Region((), (10, 2), (0, 0), (3, 2), torch.float32, sharding=((0, "dp"),))
        >>> block_at(rows, GridLayout((4,), ("dp",)), {"dp": 3})
        ((9, 0), (1, 2))
    """
    assert region.sharding is not None
    offsets, shape = [0] * len(region.global_shape), list(region.global_shape)
    for tensor_dim, grid_dim in region.sharding:
        start, size = chunk(shape[tensor_dim], layout.dim_size(grid_dim), coords[grid_dim])
        offsets[tensor_dim] += start
        shape[tensor_dim] = size
    return tuple(offsets), tuple(shape)


def _chunks_met(region: Region, layout: GridLayout) -> Iterator[tuple[tuple[str, int], ...]]:
    """The chunks of ``layout`` that the block of ``region`` meets: for each of its sharded grid
    dims, (dim, chunk index) of every chunk along it whose rows meet the block's."""
    ranges = []
    for tensor_dim, grid_dim in region.sharding or ():
        rows, parts = region.global_shape[tensor_dim], layout.dim_size(grid_dim)
        full = -(-rows // parts)
        start, size = region.offsets[tensor_dim], region.shape[tensor_dim]
        met = range(start // full, min(parts, (start + size - 1) // full + 1)) if size > 0 and full else range(0)
        ranges.append([(grid_dim, index) for index in met])
    return itertools.product(*ranges)


@dataclass(frozen=True)
class Need:
    """A block of a receiver's state: the global block (``offsets``, ``shape``) of ``path`` that
    the old positions of ``sources`` (their ranks then, in the order to ask) held; ``own``: the
    receiver was one of them (it holds the block in its own snapshot)."""

    path: Path
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    sources: tuple[int, ...]
    own: bool


@dataclass(frozen=True)
class Routes:
    """The placement a restore leaves (``old``: where the snapshots were taken) and the one it
    restores onto (``new``), the replica dim, and the node size of the partner copies' ring
    (None: no partner copies). Every method is arithmetic on these, alike on every rank."""

    old: GridLayout
    new: GridLayout
    replica_dim: str
    gpus_per_node: Optional[int] = None

    # ------------------------------------------------------------------ the partner ring
    @functools.cached_property
    def _ring(self) -> Optional[_Ring]:
        """The old placement's nodes in the order their first rank appears (None without partner
        copies, or on one node)."""
        if self.gpus_per_node is None:
            return None
        runs = (self.old.rank_map.runs if self.old.rank_map is not None
                else ((0, self.old.rank_offset, self.old.size),))
        ring = _Ring(runs, self.gpus_per_node)
        return ring if ring.count > 1 else None

    def partner(self, rank: int) -> Optional[int]:
        """The rank that holds old ``rank``'s copy, as :func:`~hypergrid.training.partner.partner_map`
        places it (None without partner copies)."""
        ring = self._ring
        if ring is None or not self.old.contains(rank):
            return None
        at, local = ring.index(rank)
        following = ring.members((at + 1) % ring.count)
        return following[local % len(following)]

    def kept_by(self, rank: int) -> list[int]:
        """The old ranks whose copies ``rank`` holds."""
        ring = self._ring
        if ring is None or not self.old.contains(rank):
            return []
        at, local = ring.index(rank)
        count = len(ring.members(at))
        return [source for i, source in enumerate(ring.members((at - 1) % ring.count)) if i % count == local]

    def keepers(self, source: int) -> list[int]:
        """The ranks of the new grid that may hold old ``source``'s snapshot: itself, its partner."""
        return [r for r in (source, self.partner(source)) if r is not None and self.new.contains(r)]

    # ------------------------------------------------------------------ the receiver's side
    def needs(self, rank: int, wanted: Mapping[Path, Region]) -> list[Need]:
        """Each block of the live state ``wanted`` of ``rank`` (on the new placement), with the old
        ranks whose snapshots held it.

        Raises:
            NotDerivable: a region whose sharding is not known, or whose context is not a place
                of the old grid.
        """
        mine = dict(zip(self.new.dim_names, self.new.coords(rank)))
        found: list[Need] = []
        for path, region in wanted.items():
            if region.volume == 0:
                continue
            context = self._context(region)
            assert context is not None  # the old grid's: raises where it does not have it
            free = self._free(context, region)
            for combo in _chunks_met(region, self.old):
                at = {**context, **dict(combo)}
                held = block_at(region, self.old, {**at, **{f: 0 for f in free}})
                block = _meet(region.offsets, region.shape, *held)
                if block is None:
                    continue
                sources = self._sources(at, free, mine)
                found.append(Need(path, *block, sources, rank in sources))
        return found

    def template_sources(self, rank: int) -> tuple[int, ...]:
        """The old ranks whose snapshots' other values, RNG and objects ``rank`` may take: its own
        where it was in the old grid, else the position it took, then its next replica peer."""
        if self.old.contains(rank):
            return (rank,)
        coords = dict(zip(self.new.dim_names, self.new.coords(rank)))
        free = [self.replica_dim] if self.replica_dim in coords else []
        fixed = {d: v for d, v in coords.items() if d not in free}
        if any(v >= self.old.dim_size(d) for d, v in fixed.items()):
            raise NotDerivable(f"rank {rank} sits at {coords}, outside the old grid {self.old.shape}")
        return self._sources(fixed, free, coords)

    def asks(self, rank: int, needs: Sequence[Need]) -> list[int]:
        """The keepers ``rank`` hears from: of every source of a block it does not hold itself, and
        of its template's sources where it was not in the old grid."""
        sources = {s for need in needs if not need.own for s in need.sources}
        if not self.old.contains(rank):
            sources |= set(self.template_sources(rank))
        return sorted({k for s in sources for k in self.keepers(s)} - {rank})

    # ------------------------------------------------------------------ the keeper's side
    def kept(self, rank: int) -> list[int]:
        """The old ranks whose snapshots ``rank`` keeps: its own (where it was in the old grid), and
        those whose partner copies it holds."""
        return ([rank] if self.old.contains(rank) else []) + self.kept_by(rank)

    def owed(self, rank: int, regions: Mapping[int, Mapping[Path, Region]]) -> dict[int, list[int]]:
        """The receivers that will ask ``rank`` (a keeper), each with the sources it keeps that they
        will ask about: for every old source ``rank`` keeps (``regions``: that source's regions, from
        any snapshot of it), the new ranks whose blocks it held and who did not hold them themselves,
        and the new ranks that take their template from it.

        Raises:
            NotDerivable: a source it keeps and holds no snapshot of, or a region whose sharding is
                not known.
        """
        owed: dict[int, set[int]] = {}
        for source in self.kept(rank):
            if source not in regions:
                raise NotDerivable(f"rank {rank} keeps rank {source}'s snapshot by the placement, but holds none")
            for receiver in self._receivers_of(source, regions[source]):
                if receiver != rank:
                    owed.setdefault(receiver, set()).add(source)
        return {receiver: sorted(sources) for receiver, sources in sorted(owed.items())}

    def _receivers_of(self, source: int, regions: Mapping[Path, Region]) -> Iterator[int]:
        coords = dict(zip(self.old.dim_names, self.old.coords(source)))
        for region in regions.values():
            if region.volume == 0:
                continue
            context = self._context(region, self.new)
            if context is None:
                continue  # a place the new grid does not have
            free = self._free(context, region)
            held_at = {**context, **{grid_dim: coords[grid_dim] for _, grid_dim in region.sharding or ()}}
            for combo in _chunks_met(region, self.new):
                for spot in self._spots(coords, free):
                    at = {**context, **dict(combo), **spot}
                    sources = self._sources(held_at, free, at)
                    if source not in sources:
                        continue
                    receiver = self.new.rank_of([at[d] for d in self.new.dim_names])
                    if receiver not in sources:
                        yield receiver
        free = [self.replica_dim] if self.replica_dim in coords else []
        fixed = {d: v for d, v in coords.items() if d not in free}
        if all(v < self.new.dim_size(d) for d, v in fixed.items()):
            for spot in self._spots(coords, free):
                at = {**fixed, **spot}
                receiver = self.new.rank_of(at)
                if not self.old.contains(receiver) and source in self._sources(fixed, free, at):
                    yield receiver

    # ------------------------------------------------------------------ shared rules
    def _context(self, region: Region, layout: Optional[GridLayout] = None) -> Optional[dict[str, int]]:
        """The region's context as coordinates; where ``layout`` is None, the old grid must have
        them (else NotDerivable), else None where ``layout`` does not."""
        if region.sharding is None:
            raise NotDerivable(f"a block of shape {region.shape} of a tensor of {region.global_shape} is sharded "
                               f"in a way the placement does not tell")
        context = dict(region.context)
        check = layout or self.old
        for dim, value in context.items():
            if dim not in check.dim_names or value >= check.dim_size(dim):
                if layout is not None:
                    return None
                raise NotDerivable(f"context {region.context} is not a place of the old grid {self.old.shape}")
        return context

    def _free(self, context: Mapping[str, int], region: Region) -> list[str]:
        """The dims along which the region's block is alike: neither its context nor sharded."""
        sharded = {grid_dim for _, grid_dim in region.sharding or ()}
        return [d for d in self.old.dim_names if d not in context and d not in sharded]

    def _sources(self, at: Mapping[str, int], free: Sequence[str], mine: Mapping[str, int]) -> tuple[int, ...]:
        """The old ranks at ``at`` whose free coordinates are the receiver's (``mine``, wrapped
        round the old size), then the next along the first free dim that has a next."""
        old = self.old
        key = (tuple(at.get(d, -1) for d in old.dim_names), tuple(free), tuple(mine[f] for f in free))
        found = self._memo.get(key)
        if found is None:
            first = {f: mine[f] % old.dim_size(f) for f in free}
            spots = [first]
            bumped = next((f for f in free if old.dim_size(f) > 1), None)
            if bumped is not None:
                spots.append({**first, bumped: (first[bumped] + 1) % old.dim_size(bumped)})
            merged = [{**at, **spot} for spot in spots]
            found = self._memo[key] = tuple(old.rank_of([m[d] for d in old.dim_names]) for m in merged)
        return found

    @functools.cached_property
    def _memo(self) -> dict[tuple[Any, ...], tuple[int, ...]]:
        """:meth:`_sources` by its arguments: the blocks of one place share them."""
        return {}

    def _spots(self, coords: Mapping[str, int], free: Sequence[str]) -> Iterator[dict[str, int]]:
        """The receivers' free coordinates (on the new grid) whose :meth:`_sources` may name the old
        source at ``coords``: those wrapping onto it, and those whose next one it is."""
        bumped = next((f for f in free if self.old.dim_size(f) > 1), None)
        seen: set[tuple[int, ...]] = set()
        for back in (0, 1) if bumped is not None else (0,):
            choices = []
            for f in free:
                size, target = self.old.dim_size(f), coords[f]
                if f == bumped and back:
                    target = (target - 1) % size
                choices.append(range(target, self.new.dim_size(f), size))
            for values in itertools.product(*choices):
                if values not in seen:
                    seen.add(values)
                    yield dict(zip(free, values))


class _Ring:
    """Nodes (``rank // per_node``) in the order their first rank appears in ``runs`` (a placement's
    (first position, first rank, length) runs), each with its ranks in position order. Where every
    run is whole nodes (the placements recoveries make), a node is found by arithmetic on the runs;
    else the nodes are listed once (O(ranks))."""

    def __init__(self, runs: Sequence[tuple[int, int, int]], per_node: int) -> None:
        self.per_node = per_node
        self.aligned = all(first % per_node == 0 and length % per_node == 0 for _, first, length in runs)
        if self.aligned:
            self.runs = list(runs)
            self.starts = list(itertools.accumulate([0] + [length // per_node for _, _, length in runs]))
            self.by_rank = sorted((first, index) for index, (_, first, _) in enumerate(runs))
            self.count = self.starts[-1]
            return
        self.nodes: list[list[int]] = []
        self.where: dict[int, tuple[int, int]] = {}
        known: dict[int, int] = {}
        for _, first, length in runs:
            for rank in range(first, first + length):
                node = known.setdefault(rank // per_node, len(self.nodes))
                if node == len(self.nodes):
                    self.nodes.append([])
                self.where[rank] = (node, len(self.nodes[node]))
                self.nodes[node].append(rank)
        self.count = len(self.nodes)

    def index(self, rank: int) -> tuple[int, int]:
        """(``rank``'s node's place in the ring, ``rank``'s index among the node's ranks)."""
        if not self.aligned:
            return self.where[rank]
        _, run = self.by_rank[bisect.bisect_right(self.by_rank, (rank, len(self.runs))) - 1]
        return self.starts[run] + (rank - self.runs[run][1]) // self.per_node, rank % self.per_node

    def members(self, at: int) -> Sequence[int]:
        """The ranks of the node at place ``at`` of the ring, in position order."""
        if not self.aligned:
            return self.nodes[at]
        run = bisect.bisect_right(self.starts, at) - 1
        first = self.runs[run][1] + (at - self.starts[run]) * self.per_node
        return range(first, first + self.per_node)


def _meet(offsets: Sequence[int], shape: Sequence[int], other_offsets: Sequence[int],
          other_shape: Sequence[int]) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    starts = tuple(max(a, b) for a, b in zip(offsets, other_offsets))
    ends = tuple(min(a + n, b + m) for a, n, b, m in zip(offsets, shape, other_offsets, other_shape))
    if any(end <= start for start, end in zip(starts, ends)):
        return None
    return starts, tuple(end - start for start, end in zip(starts, ends))
