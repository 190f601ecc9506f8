"""Before a failure: what a recovery would rebuild, kind of group by kind of group.

:func:`hypergrid.layout.replan.plan_recovery` says how a grid is laid again once ranks fail:
spares take their positions, or the fewest whole replicas are dropped. Here a whole
:class:`~hypergrid.planning.plan.Plan` follows it (:func:`plan_after`: Megatron-Core's groups are
planned again from the same configuration over the recovered ranks; a free grid's kinds follow its
grid), and each kind of the plan before is compared with the same kind after
(:func:`compare_kinds`): how many of its groups are **kept** (the same members in the same order:
their communicators can stay), **rebuilt** (groups after that did not exist before) and
**dropped** (groups before that no longer exist). ``kept + rebuilt`` is the kind's count after,
``kept + dropped`` its count before.

How each kind's counts are found (:class:`Counted`), exactly in every case:

* ``failed_groups``: a replacement changes exactly the groups holding a failed rank, since every
  rule lays groups out by position (Megatron-Core's do; a rule of one's own must too) and only
  failed ranks' positions change hands; so the failed ranks' own groups are rebuilt and the others
  kept: O(failed ranks x group size), any world.
* ``replica_dim``: a shrink keeps, in the surviving replicas, every group of a kind made group by
  group from grid groups over dims that leave out the replica dim (the grid's own groups, chunks,
  levels, embedding stages, single ranks), and drops those of the dropped replicas; it rebuilds
  every group of a grid kind across the replica dim (each lost members). This holds for the grid,
  and for a view (Megatron's expert grid) where dropping the view's replicas holding the failed
  ranks leaves exactly the view after (its replicas line up with the grid's): O(1) per kind.
* ``every_group``: the other kinds of a shrink (chunks across the replica dim, joined groups, a
  view whose replicas do not line up) are compared group by group, every group of both plans, for
  worlds up to :data:`~hypergrid.planning.plan.MAX_LISTED_WORLD` ranks; ``not_computed`` beyond
  (the counts are None).
* ``whole_kind``: a kind only one of the plans has (Megatron's hybrid dp x cp sizes follow dp).

Example: tp 2 x pp 2 x dp 4 on 16 ranks, rank 5 lost, one spare (rank 16)::

    >>> from hypergrid.planning.plan import plan_megatron
    >>> report = recovery_of(plan_megatron(16, tp=2, pp=2), failed=[5], spares=[16], gpus_per_node=4)
    >>> tp = report.change("tp")
    >>> report.recovery.replaced, (tp.before, tp.kept, tp.rebuilt, tp.dropped), tp.counted.value
    (((5, 16),), (8, 7, 1, 1), 'failed_groups')
    >>> report.after.groups_of(16)["tp"], report.after.groups_of(16)["dp"]
    ([4, 16], [1, 3, 16, 7])
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

from ..errors import RecoveryRefused
from ..layout import GridLayout
from ..layout.kinds import Chunks, GridGroups, GroupKind, Levels, PipelineSubset, Singletons
from ..layout.rank_map import RankMap
from ..layout.replan import RecoveryKind, RecoveryPlan, plan_recovery, replica_of
from .plan import HEAD_MEMBERS, LISTED_MEMBERS, MAX_LISTED_WORLD, Anchor, Plan, plan_of_megatron

__all__ = [
    "Counted",
    "KindChange",
    "RankRole",
    "RecoveryReport",
    "compare_kinds",
    "plan_after",
    "recovery_of",
    "spare_ranks_after",
]


class Counted(str, enum.Enum):
    """How a kind's kept / rebuilt / dropped counts were found (see the module's docstring)."""

    FAILED_GROUPS = "failed_groups"
    REPLICA_DIM = "replica_dim"
    EVERY_GROUP = "every_group"
    WHOLE_KIND = "whole_kind"
    NOT_COMPUTED = "not_computed"


class RankRole(str, enum.Enum):
    """What a recovery does to one rank."""

    STAYS = "stays"  # in the grid before and after, at the same coordinates or a shrunk replica's
    FAILED = "failed"
    LEAVES = "leaves"  # alive, but its replica is dropped
    REPLACES = "replaces"  # a spare that takes a failed rank's position
    SPARE = "spare"  # a spare left unused
    OUTSIDE = "outside"  # none of these


@dataclass(frozen=True)
class KindChange:
    """One kind's groups before and after a recovery: counts, and how many are kept (same members,
    same order), rebuilt (new) and dropped (gone); None where not computed.

    Example::

        >>> KindChange("tp", None, 8, 8, 7, 1, 1, Counted.FAILED_GROUPS).as_dict()["counted"]
        'failed_groups'
    """

    name: str
    view: Optional[str]
    before: int
    after: int
    kept: Optional[int]
    rebuilt: Optional[int]
    dropped: Optional[int]
    counted: Counted

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (see docs/cli.md)."""
        return {**asdict(self), "counted": self.counted.value}


def plan_after(plan: Plan, recovery: RecoveryPlan) -> Plan:
    """``plan`` laid over the grid ``recovery`` leaves: Megatron-Core's groups planned again from
    the plan's configuration (world and dp shrunk by a shrink), another plan's kinds moved onto the
    recovered grid (and its views onto the same ranks, for a replacement).

    Example::

        >>> from hypergrid.planning.plan import plan_grid
        >>> plan = plan_grid([2, 4], ["tp", "dp"])
        >>> after = plan_after(plan, plan_recovery(plan.layout, failed=[3]))
        >>> after.layout.shape, after.groups_of(6)["dp"]
        ((2, 3), [0, 4, 6])

    Raises:
        RecoveryRefused: Megatron-Core refuses the shrunk sizes, or a shrink of torchtitan's meshes
            (torchtitan builds them anew from its degrees).
    """
    new = recovery.new
    placement = new.rank_map or RankMap.contiguous(new.rank_offset, new.size)
    if plan.megatron_config is not None:
        from ..megatron.spec.plan import MegatronPlan

        try:
            config = dataclasses.replace(plan.megatron_config, world_size=new.size)
        except ValueError as exc:
            raise RecoveryRefused(
                f"cannot recover from the loss of ranks {list(recovery.failed)}: the shrunk grid's {new.size} "
                f"ranks ({_dims_text(new)}) are sizes Megatron-Core refuses: {exc}") from None
        after = plan_of_megatron(MegatronPlan(config, placement))
        after.follows, after.anchor = plan.follows, plan.anchor
        return after
    if recovery.kind is RecoveryKind.SHRINK and (plan.views or plan.anchor is not Anchor.MEGATRON_CORE):
        # torchtitan builds its meshes anew from its degrees (a degree of 1 leaves a dim out):
        # moving its kinds onto fewer ranks would not be what it builds.
        raise RecoveryRefused(
            f"cannot recover from the loss of ranks {list(recovery.failed)} by dropping replicas: only "
            f"Megatron-Core's groups and a free grid's are planned again for fewer ranks, and this plan follows "
            f"{plan.anchor.value}'s meshes; give as many spares as failed ranks")
    views = {name: GridLayout(view.shape, view.dim_names, rank_map=placement) for name, view in plan.views.items()}
    kinds = [dataclasses.replace(kind, layout=new if kind.view is None else views[kind.view]) for kind in plan.kinds]
    removed = recovery.old.size - new.size
    return dataclasses.replace(plan, world_size=plan.world_size - removed, layout=new, kinds=kinds, views=views)


def compare_kinds(before: Plan, after: Plan, recovery: RecoveryPlan, replica_dim: str = "dp") -> tuple[KindChange, ...]:
    """Each kind of ``before`` (then any kind only ``after`` has) compared with the same kind of
    ``after``, the plan :func:`plan_after` makes for ``recovery``. Cost: see the module's docstring.

    Example::

        >>> from hypergrid.planning.plan import plan_megatron
        >>> before = plan_megatron(16, tp=2, pp=2)
        >>> recovery = plan_recovery(before.layout, failed=[5])
        >>> changes = {c.name: c for c in compare_kinds(before, plan_after(before, recovery), recovery)}
        >>> changes["tp"].kept, changes["tp"].dropped, changes["dp"].rebuilt, changes["embd"].counted.value
        (6, 2, 4, 'replica_dim')
        >>> opt = changes["intra_dist_opt"]  # one group of every rank: rebuilt
        >>> opt.view, opt.kept, opt.rebuilt, opt.dropped, opt.counted.value
        ('expert', 0, 1, 1, 'every_group')
    """
    old_kinds = {kind.name: kind for kind in before.kinds}
    new_kinds = {kind.name: kind for kind in after.kinds}
    shrunk: dict[GridLayout, Optional[RecoveryPlan]] = {recovery.old: recovery}
    changes = []
    for name in list(old_kinds) + [n for n in new_kinds if n not in old_kinds]:
        old, new = old_kinds.get(name), new_kinds.get(name)
        if old is None or new is None:
            kind = old if old is not None else new
            assert kind is not None
            gone, made = (kind.count, 0) if new is None else (0, kind.count)
            changes.append(KindChange(name, kind.view, gone, made, 0, made, gone, Counted.WHOLE_KIND))
            continue
        counts = _counts(old, new, before, recovery, replica_dim, shrunk)
        changes.append(KindChange(name, old.view, old.count, new.count, *counts))
    return tuple(changes)


#: Rules that make a kind's groups one grid group at a time, by position: where the grid groups
#: are kept, so are theirs, in the same numbers per grid group.
_PER_GRID_GROUP = (GridGroups, PipelineSubset, Singletons, Chunks, Levels)


def _counts(old: GroupKind, new: GroupKind, before: Plan, recovery: RecoveryPlan, replica_dim: str,
            shrunk: dict[GridLayout, Optional[RecoveryPlan]]):
    """``(kept, rebuilt, dropped, counted)`` of one kind."""
    if recovery.kind is RecoveryKind.REPLACE:
        groups = _failed_groups(old, recovery.failed, before.world_size)
        if groups is not None:
            return old.count - len(groups), len(groups), len(groups), Counted.FAILED_GROUPS
    elif isinstance(old.derivation, _PER_GRID_GROUP) and old.derivation == new.derivation and old.dims == new.dims:
        if old.layout not in shrunk:  # a view: its own replicas holding the dropped failed ranks dropped
            try:
                planned = plan_recovery(old.layout, recovery.dropped_failed, replica_dim=replica_dim)
                shrunk[old.layout] = _with_replacements(planned, recovery.replaced)
            except ValueError:  # no such dim, or every replica holds a failed rank
                shrunk[old.layout] = None
        own = shrunk[old.layout]
        if own is not None and own.kind is RecoveryKind.SHRINK and own.new == new.layout:
            if replica_dim not in old.dims:
                # A mixed recovery also rebuilds the kept replicas' groups that held a replaced rank.
                swapped = _failed_groups(old, [a for a, _ in recovery.replaced], before.world_size)
                if swapped is not None:
                    replicas = own.old.dim_size(replica_dim)
                    dropped = old.count * (replicas - own.new.dim_size(replica_dim)) // replicas
                    return old.count - dropped - len(swapped), len(swapped), dropped + len(swapped), Counted.REPLICA_DIM
            elif old.is_grid_groups:
                return 0, new.count, old.count, Counted.REPLICA_DIM
    if before.world_size > MAX_LISTED_WORLD:
        return None, None, None, Counted.NOT_COMPUTED
    olds = {tuple(g) for g in old.enumerate() if g}
    news = {tuple(g) for g in new.enumerate() if g}
    kept = len(olds & news)
    return kept, len(news) - kept, len(olds) - kept, Counted.EVERY_GROUP


def _with_replacements(shrink: RecoveryPlan, replaced: Sequence[tuple[int, int]]) -> Optional[RecoveryPlan]:
    """``shrink`` with the spares of ``replaced`` in their failed ranks' positions (where those are
    in its grid after: a view's replicas that line up with the grid's); None where not."""
    if not replaced:
        return shrink
    placement = shrink.new.rank_map or RankMap.contiguous(shrink.new.rank_offset, shrink.new.size)
    if any(placement.position(old) is None for old, _ in replaced):
        return None
    new = GridLayout(shrink.new.shape, shrink.new.dim_names, rank_map=placement.replaced(dict(replaced)))
    return dataclasses.replace(shrink, new=new, replaced=tuple(replaced))


def _failed_groups(kind: GroupKind, failed: Iterable[int], world_size: int) -> Optional[set]:
    """The distinct groups of ``kind`` holding a failed rank (each known by its box where the kind
    has one, O(ndims), else by its members); None where listing them is too costly."""
    found: set = set()
    for rank in failed:
        box = kind.box(rank)
        if box is not None:
            found.add(box)
            continue
        if world_size > MAX_LISTED_WORLD and (kind.size is None or kind.size > LISTED_MEMBERS):
            return None
        members = kind.members(rank)
        if members is not None:
            found.add(tuple(members))
    return found


@dataclass(frozen=True)
class RecoveryReport:
    """A plan, the recovery of its grid from ``failed`` ranks with ``spares``, the plan after, and
    each kind's :class:`KindChange`. Made by :func:`recovery_of`.

    Example::

        >>> from hypergrid.planning.plan import plan_grid
        >>> report = recovery_of(plan_grid([2, 4], ["tp", "dp"]), failed=[3])
        >>> report.role(2), report.role(3), report.role(6)
        (<RankRole.LEAVES: 'leaves'>, <RankRole.FAILED: 'failed'>, <RankRole.STAYS: 'stays'>)
    """

    recovery: RecoveryPlan
    before: Plan
    after: Plan
    spares: tuple[int, ...]
    replica_dim: str
    changes: tuple[KindChange, ...]

    def change(self, name: str) -> KindChange:
        """The :class:`KindChange` of the kind called ``name``."""
        found = [change for change in self.changes if change.name == name]
        if not found:
            raise ValueError(f"unknown group kind {name!r}; this recovery compares {[c.name for c in self.changes]}")
        return found[0]

    def role(self, rank: int) -> RankRole:
        """What the recovery does to ``rank``."""
        r = self.recovery
        if rank in r.failed:
            return RankRole.FAILED
        if rank in self.spares:
            return RankRole.SPARE if rank in r.spares_left else RankRole.REPLACES
        if r.kind is RecoveryKind.SHRINK and rank in r.dropped:
            return RankRole.LEAVES
        return RankRole.STAYS if self.recovery.old.contains(rank) else RankRole.OUTSIDE

    @property
    def dropped_replicas(self) -> list[int]:
        """The coordinates along the replica dim that a shrink drops (none for a replacement): those
        of the failed ranks no spare replaces."""
        if self.recovery.kind is not RecoveryKind.SHRINK:
            return []
        return sorted({replica_of(self.recovery.old, rank, self.replica_dim) for rank in self.recovery.dropped_failed})

    @property
    def warnings(self) -> list[str]:
        """What the recovery changes that a Megatron job must change with it: a shrink of dp and
        the global batch size, which Megatron-Core's microbatch calculator wants divisible by the
        micro-batch size x dp (checked where the plan came from a launch line that gives it).

        Example::

            >>> from hypergrid.planning.megatron_args import plan_from_megatron_args
            >>> plan = plan_from_megatron_args("--global-batch-size 1024 --micro-batch-size 1", world_size=128)
            >>> recovery_of(plan, failed=[5]).warnings
            ['dp 128 -> 127: --global-batch-size 1024 is not divisible by --micro-batch-size 1 x dp 127 = 127, which Megatron-Core asserts: give spares to keep dp (--spares), or a global batch size divisible by 127']
        """
        before, after = self.before.megatron, self.after.megatron
        if self.recovery.kind is not RecoveryKind.SHRINK or before is None or after is None or before.dp == after.dp:
            return []
        step = f"dp {before.dp} -> {after.dp}"
        batch, micro = self.before.global_batch_size, self.before.micro_batch_size or 1
        if batch is None:
            return [f"{step}: a global batch size must be divisible by the micro-batch size x dp (Megatron-Core "
                    f"asserts it), so one chosen for dp {before.dp} no longer fits unless it is a multiple of "
                    f"{after.dp} too: give spares to keep dp (--spares), or a global batch size for dp {after.dp}"]
        if batch % (micro * after.dp) == 0:
            return []
        return [f"{step}: --global-batch-size {batch} is not divisible by --micro-batch-size {micro} x dp "
                f"{after.dp} = {micro * after.dp}, which Megatron-Core asserts: give spares to keep dp (--spares), "
                f"or a global batch size divisible by {micro * after.dp}"]

    def rank_change(self, rank: int) -> dict[str, Any]:
        """``rank``'s role, coordinates and, per kind, its group before and after (as
        :meth:`Plan.rank_groups <hypergrid.planning.plan.Plan.rank_groups>` gives them: a list of
        members, or a group over :data:`~hypergrid.planning.plan.LISTED_MEMBERS` ranks as its size,
        first members and last) and what became of it: ``kept``, ``rebuilt``, ``left`` (in a group
        before only), ``joined`` (after only), None (in none), or ``not_compared`` (groups too large
        to list whose outlines agree, of a kind partly kept). O(group size) per kind.

        Example::

            >>> from hypergrid.planning.plan import plan_grid
            >>> change = recovery_of(plan_grid([2, 4], ["tp", "dp"]), failed=[3], spares=[8]).rank_change(8)
            >>> change["role"], change["replaces"], change["groups"]["tp"]
            ('replaces', 3, {'before': None, 'after': [2, 8], 'change': 'joined'})
        """
        sides = []
        for plan in (self.before, self.after):
            inside = plan.layout.contains(rank)
            sides.append((plan.rank_groups(rank) if inside else {}, plan.coords(rank) if inside else None))
        (old_groups, old_coords), (new_groups, new_coords) = sides
        groups = {}
        for change in self.changes:
            old, new = old_groups.get(change.name), new_groups.get(change.name)
            groups[change.name] = {"before": old, "after": new, "change": _rank_group_change(old, new, change)}
        replaces = next((old for old, spare in self.recovery.replaced if spare == rank), None)
        return {"rank": rank, "role": self.role(rank).value, "replaces": replaces,
                "coords_before": old_coords, "coords_after": new_coords, "groups": groups}

    def as_dict(self, gpus_per_node: int, rank: Optional[int] = None) -> dict[str, Any]:
        """What ``plan --fail`` prints as JSON (docs/cli.md): the plan's grid and sizes, the
        recovery, each kind's change, and with ``rank`` that rank's groups before and after."""
        r, before = self.recovery, self.before
        new = r.new
        runs = new.rank_map.runs if new.rank_map is not None else ((0, new.rank_offset, new.size),)
        out: dict[str, Any] = {
            "world_size": before.world_size,
            "gpus_per_node": gpus_per_node,
            "grid": {"shape": list(before.layout.shape), "dim_names": list(before.layout.dim_names),
                     "rank_offset": before.layout.rank_offset},
            "views": {name: {"shape": list(view.shape), "dim_names": list(view.dim_names)}
                      for name, view in before.views.items()},
            "megatron": None if before.megatron is None else asdict(before.megatron),
            "follows": None if before.follows is None else before.follows.as_dict(),
            "recovery": {
                "kind": r.kind.value,
                "failed": list(r.failed),
                "spares": list(self.spares),
                "replica_dim": self.replica_dim,
                "replaced": [list(pair) for pair in r.replaced],
                "spares_left": list(r.spares_left),
                "dropped_replicas": self.dropped_replicas,
                "leaving": list(r.dropped),
                "grid_after": {"shape": list(new.shape), "dim_names": list(new.dim_names), "size": new.size,
                               "rank_runs": [[rank, length] for _, rank, length in runs]},
                "kinds": [change.as_dict() for change in self.changes],
                "warnings": self.warnings,
            },
        }
        if rank is not None:
            out["rank"] = {**self.rank_change(rank), "node": rank // gpus_per_node,
                           "local_rank": rank % gpus_per_node}
        return out


def _rank_group_change(old: Any, new: Any, change: KindChange) -> Optional[str]:
    if old is None or new is None:
        return None if old is new else "left" if new is None else "joined"
    if isinstance(old, list) and isinstance(new, list):
        return "kept" if old == new else "rebuilt"
    # A group over LISTED_MEMBERS ranks comes as its size, first members and last (None where not
    # listed): groups whose outlines differ differ.
    if any(a is not None and b is not None and a != b for a, b in zip(_outline(old), _outline(new))):
        return "rebuilt"
    # Every group of the kind kept (or none): so is this one, since a rank is in one group of a kind.
    return "kept" if change.rebuilt == 0 else "rebuilt" if change.kept == 0 else "not_compared"


def _outline(group: Any) -> tuple:
    if isinstance(group, list):
        return len(group), group[:HEAD_MEMBERS], group[-1]
    return group["size"], group["head"], group["last"]


def recovery_of(plan: Plan, failed: Iterable[int], spares: Sequence[int] = (), *, replica_dim: str = "dp",
                gpus_per_node: int = 8) -> RecoveryReport:
    """What a failure of ``failed`` would do to ``plan``, with ``spares`` (ranks outside the grid,
    in the order they may be used): :func:`~hypergrid.layout.replan.plan_recovery` of its grid,
    :func:`plan_after` and :func:`compare_kinds`. A Megatron plan's replicas are along ``dp``.

    Example::

        >>> from hypergrid.planning.plan import plan_megatron
        >>> report = recovery_of(plan_megatron(16, tp=2, pp=2), failed=[5])
        >>> report.recovery.kind.value, report.dropped_replicas, report.after.megatron.dp
        ('shrink', [2], 3)
        >>> recovery_of(plan_megatron(16, tp=2, pp=2), failed=[5], replica_dim="pp")
        Traceback (most recent call last):
        ...
        ValueError: replica_dim 'pp': a Megatron plan's replicas are along 'dp'; expected 'dp'

    Raises:
        RecoveryRefused: no recovery fits; the message says why.
        ValueError: a failed rank outside the grid, a spare inside it, a replica dim the plan lacks.
    """
    if plan.megatron_config is not None and replica_dim != "dp":
        raise ValueError(f"replica_dim {replica_dim!r}: a Megatron plan's replicas are along 'dp'; expected 'dp'")
    spares = tuple(spares)
    recovery = plan_recovery(plan.layout, failed, spares, replica_dim=replica_dim, gpus_per_node=gpus_per_node)
    after = plan_after(plan, recovery)
    return RecoveryReport(recovery, plan, after, spares, replica_dim, compare_kinds(plan, after, recovery, replica_dim))


def _dims_text(layout: GridLayout) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(layout.dim_names, layout.shape))


def spare_ranks_after(layout: GridLayout, count: int) -> list[int]:
    """The ``count`` ranks numbered right after the grid's highest: ``plan --spares N``'s spares.

    Example::

        >>> spare_ranks_after(GridLayout((2, 4), ("tp", "dp")), 2)
        [8, 9]
    """
    runs = layout.rank_map.runs if layout.rank_map is not None else ((0, layout.rank_offset, layout.size),)
    last = max(rank + length - 1 for _, rank, length in runs)
    return list(range(last + 1, last + 1 + count))
