"""Re-planning a grid after ranks failed: spares take their places, whole replicas are dropped, or both.

Pure integer arithmetic on a :class:`~hypergrid.layout.GridLayout` and its rank map: no process
group, so a recovery can be planned (and shown by ``hypergrid plan --fail``) before it happens,
and every survivor computes the same plan from the same failed set.

* **Replace.** With enough spares (ranks outside the grid), each failed rank's position is given
  to a spare, and nothing else moves. A whole failed node is replaced by a whole spare node, local
  rank for local rank, so that dims kept inside a node (``tp``, ``ep``) stay inside one.
* **Shrink.** Without enough spares, the fewest whole replicas (coordinates of ``replica_dim``,
  the data-parallel dim) are dropped: the replica dim shrinks (``dp`` 64 to 63) and every
  surviving rank keeps its global rank, so groups inside a surviving replica keep their members.
  Where the spares cover part of the loss, the shrink is **mixed**: the replicas holding the most
  failed ranks are dropped until the spares can replace the failed ranks of the replicas kept,
  and they do (``kind`` is still ``shrink``, with ``replaced`` not empty).
* **Refused**, with the reason (:class:`~hypergrid.errors.RecoveryRefused`), when neither fits:
  too few spares and no replica left to drop (a pipeline stage lost with ``dp`` 1, or more failed
  ranks in every replica than there are spares).

Example: dp 2 x pp 2 x tp 2 on ranks 0-7 (Megatron's order, tp fastest), rank 5 lost::

    >>> layout = GridLayout((2, 2, 2), ("tp", "dp", "pp"))
    >>> plan = plan_recovery(layout, failed=[5], spares=[8, 9], gpus_per_node=2)
    >>> plan.kind.value, plan.replaced, plan.new.group_ranks("tp", 8), plan.spares_left
    ('replace', ((5, 8),), [4, 8], (9,))
    >>> shrunk = plan_recovery(layout, failed=[5], gpus_per_node=2)
    >>> shrunk.kind.value, shrunk.new.shape, list(shrunk.new.ranks), shrunk.dropped
    ('shrink', (2, 1, 2), [2, 3, 6, 7], (0, 1, 4))

Ranks 1 and 6 lost (replicas 0 and 3 of dp 4) with one spare: replica 3 is dropped, the spare takes
rank 1's place::

    >>> mixed = plan_recovery(GridLayout((2, 4, 2), ("tp", "dp", "pp")), failed=[1, 6], spares=[16])
    >>> mixed.kind.value, mixed.replaced, mixed.dropped, mixed.new.shape
    ('shrink', ((1, 16),), (7, 14, 15), (2, 3, 2))
    >>> mixed.describe()
    'shrink: replicas holding ranks [6] dropped, shape [2, 4, 2] -> [2, 3, 2]; 3 surviving ranks leave the grid; replace: rank 1 -> 16; 0 spares left'
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import RecoveryRankError, RecoveryRefused
from .checks import positive_int
from .describe import describe_ranks
from .grid_layout import GridLayout
from .rank_map import RankMap

__all__ = ["RecoveryKind", "RecoveryPlan", "plan_recovery", "plan_growth", "replica_of"]


class RecoveryKind(str, enum.Enum):
    """How a recovery re-places the grid."""

    REPLACE = "replace"  # spares take the failed ranks' positions
    SHRINK = "shrink"  # replicas holding failed ranks are dropped (spares may replace the failed ranks of others)
    REPAIR = "repair"  # nobody was lost: the placement stays, broken communicators are made anew
    GROW = "grow"  # spares form replicas again, up to the size the job was made with


@dataclass(frozen=True)
class RecoveryPlan:
    """A grid before and after a recovery, and what happened to each rank.

    ``replaced``: (failed rank, spare) pairs; ``dropped``: surviving ranks whose replica was
    dropped (they leave the grid); ``joined``: spares that formed new replicas (a growth);
    ``spares_left``: spares not used, still outside the grid. A mixed recovery is a ``SHRINK``
    whose ``replaced`` is not empty: ``new`` is the grid without the dropped replicas, with the
    spares in the replaced ranks' positions.

    Example::

        >>> plan = plan_recovery(GridLayout((2, 4), ("tp", "dp")), failed=[3], spares=[8])
        >>> plan.describe()
        'replace: rank 3 -> 8; 0 spares left'
        >>> plan_recovery(GridLayout((2, 4), ("tp", "dp")), failed=[0, 1, 3], spares=[8]).dropped_failed
        (0, 1)
    """

    kind: RecoveryKind
    old: GridLayout
    new: GridLayout
    failed: tuple[int, ...]
    replaced: tuple[tuple[int, int], ...] = ()
    dropped: tuple[int, ...] = ()
    spares_left: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()

    @property
    def members(self) -> frozenset[int]:
        """The ranks of the grid after the recovery."""
        return frozenset(self.new.ranks)

    @property
    def dropped_failed(self) -> tuple[int, ...]:
        """The failed ranks whose replicas are dropped: those no spare replaces (none for a replacement)."""
        replaced = {old for old, _ in self.replaced}
        return tuple(r for r in self.failed if r not in replaced)

    def describe(self) -> str:
        """What the recovery does, in one line: the moves, the replicas dropped, or both."""
        if self.kind is RecoveryKind.REPAIR:
            return f"repair: nobody lost, placement kept; {len(self.spares_left)} spares left"
        if self.kind is RecoveryKind.GROW:
            return (f"grow: ranks {list(self.joined)} join, shape {list(self.old.shape)} -> {list(self.new.shape)}; "
                    f"{len(self.spares_left)} spares left")
        moves = ", ".join(f"rank {old} -> {new}" for old, new in self.replaced)
        if self.kind is RecoveryKind.REPLACE:
            return f"replace: {moves}; {len(self.spares_left)} spares left"
        text = (f"shrink: replicas holding ranks {list(self.dropped_failed)} dropped, shape {list(self.old.shape)} -> "
                f"{list(self.new.shape)}; {len(self.dropped)} surviving ranks leave the grid")
        return text + (f"; replace: {moves}; {len(self.spares_left)} spares left" if self.replaced else "")


def replica_of(layout: GridLayout, rank: int, replica_dim: str) -> int:
    """The coordinate of ``rank`` along ``replica_dim``: which replica it belongs to.

    Example::

        >>> replica_of(GridLayout((2, 2, 2), ("tp", "dp", "pp")), 5, "dp")
        0
    """
    return layout.coords(rank)[layout.dim_names.index(replica_dim)]


def plan_recovery(
    layout: GridLayout,
    failed: Iterable[int],
    spares: Sequence[int] = (),
    *,
    replica_dim: str = "dp",
    gpus_per_node: int = 8,
) -> RecoveryPlan:
    """The grid ``layout`` re-planned without the ``failed`` ranks: spares first, else a shrink
    (mixed with replacements where the spares cover part of the loss).

    ``spares`` are ranks outside the grid, in the order they may be used; a rank's node is
    ``rank // gpus_per_node``. With fewer spares than failed ranks, the fewest replicas of
    ``replica_dim`` are dropped for the spares to replace the failed ranks of the replicas kept:
    the replicas with the most failed ranks first (among as many, the highest coordinate first, so
    that replica 0 stays where it can). Cost: O(failed x log runs) for a replacement; for a
    shrink, O(runs of the new placement) plus the dropped replicas' ranks, never a list of the world.

    Example: a whole node (ranks 4-7 of 4 per node) lost, and a spare node 8-11::

        >>> layout = GridLayout((4, 2), ("tp", "dp"))
        >>> plan_recovery(layout, failed=[5, 6, 4, 7], spares=[8, 9, 10, 11], gpus_per_node=4).replaced
        ((4, 8), (5, 9), (6, 10), (7, 11))
        >>> plan_recovery(GridLayout((2, 1, 2), ("tp", "dp", "pp")), failed=[1])
        Traceback (most recent call last):
        ...
        hypergrid.errors.RecoveryRefused: cannot recover from the loss of ranks [1]: no spare is left (0 given, 1 needed), and every one of the 1 replicas of 'dp' holds a failed rank, so none can be dropped

    tp 8 x dp 2 x pp 2 (Megatron's order) with ranks 1 and 9 lost, one in each replica, and one
    spare: replica 1 is dropped and the spare takes rank 1's place::

        >>> tp_dp_pp = GridLayout((8, 2, 2), ("tp", "dp", "pp"))
        >>> mixed = plan_recovery(tp_dp_pp, failed=[1, 9], spares=[32])
        >>> mixed.kind.value, mixed.replaced, mixed.new.shape, mixed.new.group_ranks("tp", 32)[:3]
        ('shrink', ((1, 32),), (8, 1, 2), [0, 32, 2])
        >>> plan_recovery(tp_dp_pp, failed=[1], spares=[-1])
        Traceback (most recent call last):
        ...
        hypergrid.errors.RecoveryRankError: spares must be ranks (integers >= 0), got -1 in [-1]

    Raises:
        RecoveryRefused: neither replacement nor a shrink fits; the message says why.
        RecoveryRankError: a failed rank or a spare that is not a rank (negative, a bool, a float,
            not an integer): a ValueError (and a TypeError) naming the value.
        ValueError: a failed rank is not in the grid, or a spare is.
    """
    if not isinstance(layout, GridLayout):
        raise TypeError(f"layout must be a GridLayout, got {type(layout).__name__} {layout!r}")
    gpus_per_node = positive_int("gpus_per_node", gpus_per_node)
    lost = sorted(set(_ranks(failed, "failed")))
    if not lost:
        raise ValueError("failed must name at least one rank of the grid")
    outside = [r for r in lost if not layout.contains(r)]
    if outside:
        raise ValueError(f"failed ranks {outside} are not in the grid, which spans ranks {_span(layout)}")
    pool = _ranks(spares, "spares")
    inside = [r for r in pool if layout.contains(r)]
    if inside or len(set(pool)) != len(pool):
        raise ValueError(f"spares must be distinct ranks outside the grid, got {list(spares)}")
    pool = [r for r in pool if r not in lost]
    if len(pool) >= len(lost):
        return _replace(layout, lost, pool, gpus_per_node)
    return _shrink(layout, lost, pool, replica_dim, gpus_per_node)


def _ranks(values: object, what: str) -> list[int]:
    """``values`` as a list of ranks (ints >= 0); anything else a :class:`RecoveryRankError` naming it."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise RecoveryRankError(f"{what} must be a list of ranks, got {type(values).__name__} {values!r}")
    given = list(values)
    out = []
    for value in given:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise RecoveryRankError(f"{what} must be ranks (integers >= 0), got {type(value).__name__} {value!r} "
                                    f"in {describe_ranks(given)}")
        rank = operator.index(value)
        if rank < 0:
            raise RecoveryRankError(f"{what} must be ranks (integers >= 0), got {rank} in {describe_ranks(given)}")
        out.append(rank)
    return out


def _replace(layout: GridLayout, lost: list[int], pool: list[int], gpus_per_node: int) -> RecoveryPlan:
    substitutes: dict[int, int] = {}
    free = list(pool)
    # Whole failed nodes first, onto whole spare nodes: local rank i of the one on local rank i of
    # the other, so that groups inside a node stay inside one.
    nodes = _by_node(lost, gpus_per_node)
    spare_nodes = _by_node(free, gpus_per_node)
    for node, ranks in sorted(nodes.items()):
        in_grid = [r for r in range(node * gpus_per_node, (node + 1) * gpus_per_node) if layout.contains(r)]
        if ranks != in_grid:
            continue  # only part of the node failed
        fitting = next((n for n, s in sorted(spare_nodes.items()) if len(s) >= len(ranks)), None)
        if fitting is None:
            continue
        for old, new in zip(ranks, spare_nodes.pop(fitting)):
            substitutes[old] = new
            free.remove(new)
    # The rest one by one: a spare on the failed rank's own node if there is one, else the first.
    for old in lost:
        if old in substitutes:
            continue
        same_node = [r for r in free if r // gpus_per_node == old // gpus_per_node]
        new = same_node[0] if same_node else free[0]
        substitutes[old] = new
        free.remove(new)
    placement = (layout.rank_map or RankMap.contiguous(layout.rank_offset, layout.size)).replaced(substitutes)
    replaced = GridLayout(layout.shape, layout.dim_names, rank_map=placement)
    return RecoveryPlan(RecoveryKind.REPLACE, layout, replaced, tuple(lost), tuple(sorted(substitutes.items())),
                        spares_left=tuple(free))


def _replicas_to_drop(layout: GridLayout, lost: list[int], pool: list[int], replica_dim: str) -> list[int]:
    """The fewest replicas whose loss leaves no more failed ranks than spares: the ones holding the
    most failed ranks first (greedy is optimal here), the highest coordinate first among equals."""
    if replica_dim not in layout.dim_names:
        raise RecoveryRefused(
            f"cannot recover from the loss of ranks {lost}: {len(pool)} spares for {len(lost)} failed ranks, "
            f"and the grid has no replica dim {replica_dim!r} to drop replicas of (dims {list(layout.dim_names)})"
        )
    axis = layout.dim_names.index(replica_dim)
    replicas = layout.shape[axis]
    held: dict[int, int] = {}
    for r in lost:
        j = layout.coords(r)[axis]
        held[j] = held.get(j, 0) + 1
    gone, left = [], len(lost)
    for j in sorted(held, key=lambda j: (-held[j], -j)):
        if left <= len(pool):
            break
        gone.append(j)
        left -= held[j]
    if len(gone) < replicas:
        return sorted(gone)
    if not pool:
        raise RecoveryRefused(
            f"cannot recover from the loss of ranks {lost}: no spare is left ({len(pool)} given, "
            f"{len(lost)} needed), and every one of the {replicas} replicas of {replica_dim!r} holds a failed "
            f"rank, so none can be dropped"
        )
    raise RecoveryRefused(
        f"cannot recover from the loss of ranks {lost}: too few spares ({len(pool)} given, {len(lost)} needed), "
        f"and every one of the {replicas} replicas of {replica_dim!r} holds more failed ranks than the spares "
        f"can replace (the fewest: {min(held.values())}), so none can be kept"
    )


def _shrink(layout: GridLayout, lost: list[int], pool: list[int], replica_dim: str, gpus_per_node: int) -> RecoveryPlan:
    gone = _replicas_to_drop(layout, lost, pool, replica_dim)
    axis = layout.dim_names.index(replica_dim)
    replicas = layout.shape[axis]
    stride = layout.strides[axis]
    block = stride * replicas
    placement = layout.rank_map or RankMap.contiguous(layout.rank_offset, layout.size)
    # Positions come in blocks of every replica's slice (``stride`` positions each); within a
    # block, the kept replicas' slices, merged where consecutive, are the intervals kept.
    kept_runs = _index_runs([j for j in range(replicas) if j not in gone])
    kept = [(b + j * stride, n * stride) for b in range(0, layout.size, block) for j, n in kept_runs]
    lost_set = set(lost)
    dropped = [r for b in range(0, layout.size, block) for j in gone
               for r in placement.ranks_of(range(b + j * stride, b + (j + 1) * stride)) if r not in lost_set]
    shape = list(layout.shape)
    shape[axis] = replicas - len(gone)
    new = GridLayout(tuple(shape), layout.dim_names, rank_map=placement.restricted(kept))
    # The failed ranks of the replicas kept, if any, take spares in the grid without the dropped ones.
    gone_set = set(gone)
    kept_lost = [r for r in lost if layout.coords(r)[axis] not in gone_set]
    if not kept_lost:
        return RecoveryPlan(RecoveryKind.SHRINK, layout, new, tuple(lost), dropped=tuple(dropped),
                            spares_left=tuple(pool))
    swap = _replace(new, kept_lost, pool, gpus_per_node)
    return RecoveryPlan(RecoveryKind.SHRINK, layout, swap.new, tuple(lost), swap.replaced, tuple(dropped),
                        swap.spares_left)


def _index_runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as (first, count) runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(a, b) for a, b in runs]


def _by_node(ranks: Iterable[int], gpus_per_node: int) -> dict[int, list[int]]:
    nodes: dict[int, list[int]] = {}
    for r in sorted(ranks):
        nodes.setdefault(r // gpus_per_node, []).append(r)
    return nodes


def _span(layout: GridLayout) -> str:
    if layout.rank_map is None:
        return f"[{layout.rank_offset}, {layout.rank_offset + layout.size})"
    return f"placed by {layout.rank_map!r}"


def plan_growth(layout: GridLayout, replicas: int, spares: Sequence[int], *, replica_dim: str = "dp") -> RecoveryPlan:
    """``layout`` grown back towards ``replicas`` along ``replica_dim`` with whole replicas of
    ``spares`` (in the order given), as many as they fill; every position of the current replicas
    keeps its rank and coordinates, so groups inside them keep their members, and the new replicas
    come after them along ``replica_dim``. A plan of kind ``repair`` (nothing moves) where no whole
    replica can be added. O(size) (the grown placement is listed).

    Example: dp 2 shrank to dp 1 on ranks 2, 3, 6, 7 (tp 2 x dp x pp 2); ranks 0, 1, 4, 5 wait as
    spares again::

        >>> shrunk = plan_recovery(GridLayout((2, 2, 2), ("tp", "dp", "pp")), failed=[5], gpus_per_node=2).new
        >>> grown = plan_growth(shrunk, 2, spares=[0, 1, 4, 5, 9])
        >>> grown.kind.value, list(grown.new.ranks), grown.joined, grown.spares_left
        ('grow', [2, 3, 0, 1, 6, 7, 4, 5], (0, 1, 4, 5), (9,))

    Raises:
        ValueError: ``replica_dim`` is not a dim of ``layout``, or ``replicas`` is not a positive int.
    """
    if not isinstance(layout, GridLayout):
        raise TypeError(f"layout must be a GridLayout, got {type(layout).__name__} {layout!r}")
    if replica_dim not in layout.dim_names:
        raise ValueError(f"replica_dim {replica_dim!r} is not a dim of the grid {list(layout.dim_names)}")
    replicas = positive_int("replicas", replicas)
    pool = _ranks(spares, "spares")
    inside = [r for r in pool if layout.contains(r)]
    if inside or len(set(pool)) != len(pool):
        raise RecoveryRankError(f"spares must be distinct ranks outside the grid, got {describe_ranks(pool)}")
    axis = layout.dim_names.index(replica_dim)
    current = layout.shape[axis]
    replica_size = layout.size // current
    added = min(max(0, replicas - current), len(pool) // replica_size)
    if added == 0:
        return RecoveryPlan(RecoveryKind.REPAIR, layout, layout, (), spares_left=tuple(pool))
    shape = list(layout.shape)
    shape[axis] = current + added
    grown = GridLayout(tuple(shape), layout.dim_names)
    joining = iter(pool[: added * replica_size])
    ranks = []
    for position in range(grown.size):  # ``grown`` has no rank map: its ranks are its positions
        coords = grown.coords(position)
        old = sum(c * s for c, s in zip(coords, layout.strides))
        ranks.append(layout.rank_at(old) if coords[axis] < current else next(joining))
    new = GridLayout(grown.shape, grown.dim_names, rank_map=RankMap.of(ranks))
    joined = tuple(pool[: added * replica_size])
    return RecoveryPlan(RecoveryKind.GROW, layout, new, (), joined=joined, spares_left=tuple(pool[len(joined):]))

