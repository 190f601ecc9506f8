"""Re-planning a grid after ranks failed, with no process group (hypergrid.layout.replan).

Spares take failed ranks' positions (a whole node onto a whole node, local rank for local rank),
else the fewest whole replicas are dropped and the spares replace the failed ranks of the replicas
kept; every survivor keeps its global rank, and Megatron's groups inside surviving replicas keep
their members. Refusals say why; a value that is not a rank is a ValueError naming it.
"""

from __future__ import annotations

import pytest

from hypergrid.errors import RecoveryRefused
from hypergrid.layout import GridLayout
from hypergrid.layout.rank_map import RankMap
from hypergrid.layout.replan import RecoveryKind, plan_recovery, replica_of
from hypergrid.megatron.spec.plan import plan_model_parallel

# dp 4 x pp 2 x tp 2 on ranks 0-15 (tp fastest): replica dp=j holds ranks 2j, 2j+1, 8+2j, 9+2j.
TP_DP_PP = GridLayout((2, 4, 2), ("tp", "dp", "pp"))


def _nodes(group, gpus_per_node):
    return {rank // gpus_per_node for rank in group}


# ---------------------------------------------------------------------- replacement
def test_one_failed_rank_takes_the_first_spare_and_nothing_else_moves():
    plan = plan_recovery(TP_DP_PP, failed=[5], spares=[16, 17], gpus_per_node=4)
    assert plan.kind is RecoveryKind.REPLACE
    assert plan.replaced == ((5, 16),) and plan.spares_left == (17,) and plan.dropped == ()
    assert plan.new.shape == TP_DP_PP.shape and plan.new.dim_names == TP_DP_PP.dim_names
    assert list(plan.new.ranks) == [0, 1, 2, 3, 4, 16] + list(range(6, 16))
    for position in range(16):  # every other position keeps its rank, and every coordinate its position
        expected = 16 if position == 5 else position
        assert plan.new.rank_at(position) == expected
        assert plan.new.coords(expected) == TP_DP_PP.coords(position)
    assert plan.members == frozenset(range(16)) - {5} | {16}


def test_several_failed_ranks_take_spares_in_the_order_given():
    plan = plan_recovery(TP_DP_PP, failed=[9, 2], spares=[20, 18, 16], gpus_per_node=4)
    # Sorted failed ranks, spares in the order given (no spare shares a node with either).
    assert plan.replaced == ((2, 20), (9, 18)) and plan.spares_left == (16,)
    assert plan.new.rank_at(2) == 20 and plan.new.rank_at(9) == 18
    assert plan.describe() == "replace: rank 2 -> 20, rank 9 -> 18; 1 spares left"


def test_a_spare_on_the_failed_ranks_own_node_is_preferred():
    # 6 ranks of a node of 8: ranks 6 and 7 of node 0 are spares, as is 8 on node 1.
    layout = GridLayout((2, 3), ("tp", "dp"))
    plan = plan_recovery(layout, failed=[3], spares=[8, 7], gpus_per_node=8)
    assert plan.replaced == ((3, 7),) and plan.spares_left == (8,)


def test_a_whole_failed_node_goes_to_a_whole_spare_node_local_rank_for_local_rank():
    layout = GridLayout((4, 4), ("tp", "dp"))  # 16 ranks, nodes of 4: tp inside each node
    # A lone spare first in the list, then a whole spare node given out of order.
    plan = plan_recovery(layout, failed=[6, 4, 7, 5], spares=[21, 19, 17, 16, 18], gpus_per_node=4)
    assert plan.replaced == ((4, 16), (5, 17), (6, 18), (7, 19))
    assert all(old % 4 == new % 4 for old, new in plan.replaced)
    assert plan.spares_left == (21,)
    assert len(plan.new.rank_map.runs) == 3


def test_without_a_whole_spare_node_a_failed_node_takes_spares_one_by_one():
    layout = GridLayout((4, 4), ("tp", "dp"))
    plan = plan_recovery(layout, failed=[4, 5, 6, 7], spares=[18, 19, 20, 21], gpus_per_node=4)
    assert plan.replaced == ((4, 18), (5, 19), (6, 20), (7, 21))  # nodes 4 and 5, in order


def test_unused_spares_are_reported_and_a_spare_is_never_used_twice():
    plan = plan_recovery(TP_DP_PP, failed=[0, 15], spares=[16, 17, 18, 19, 20], gpus_per_node=8)
    used = [new for _, new in plan.replaced]
    assert len(set(used)) == 2 and set(used) | set(plan.spares_left) == {16, 17, 18, 19, 20}
    assert not set(used) & set(plan.spares_left)


# ---------------------------------------------------------------------- shrink
def test_a_shrink_drops_the_one_replica_holding_the_failed_ranks():
    plan = plan_recovery(TP_DP_PP, failed=[5, 13])  # both in replica dp=2
    assert plan.kind is RecoveryKind.SHRINK
    assert replica_of(TP_DP_PP, 5, "dp") == replica_of(TP_DP_PP, 13, "dp") == 2
    assert plan.new.shape == (2, 3, 2)
    assert plan.dropped == (4, 12)  # the replica's survivors leave the grid
    # Every survivor keeps its global rank: the new grid is the old one less that replica.
    assert set(plan.new.ranks) == set(range(16)) - {4, 5, 12, 13}
    assert sorted(plan.new.ranks) == sorted(plan.members)


def test_a_shrink_drops_the_fewest_replicas():
    plan = plan_recovery(TP_DP_PP, failed=[1, 5, 12])  # replicas 0, 2, 2
    assert plan.new.shape == (2, 2, 2)
    assert set(plan.new.ranks) == {2, 3, 6, 7, 10, 11, 14, 15}
    assert plan.dropped == (0, 4, 8, 9, 13)


def test_spares_that_cover_no_kept_replica_are_all_kept():
    # Replicas 0 and 3 each hold two failed ranks; one spare replaces neither's: both are dropped.
    plan = plan_recovery(TP_DP_PP, failed=[0, 1, 6, 7], spares=[16])
    assert plan.kind is RecoveryKind.SHRINK and plan.spares_left == (16,) and plan.replaced == ()
    assert plan.new.shape == (2, 2, 2) and plan.dropped_failed == (0, 1, 6, 7)


# ---------------------------------------------------------------------- mixed: drop some, replace the rest
def test_a_mixed_recovery_drops_one_replica_and_gives_the_spare_to_the_other():
    # The layout: tp 8 x pp 2 x dp 2 (Megatron's order tp-dp-pp), ranks 1 and 9 in dp 0 and 1.
    layout = GridLayout((8, 2, 2), ("tp", "dp", "pp"))
    plan = plan_recovery(layout, failed=[1, 9], spares=[32])
    assert plan.kind is RecoveryKind.SHRINK
    assert plan.replaced == ((1, 32),) and plan.spares_left == () and plan.dropped_failed == (9,)
    assert plan.new.shape == (8, 1, 2)  # replica 1 dropped (the last of two equal ones)
    assert plan.dropped == tuple(sorted(set(range(8, 16)) - {9}) + list(range(24, 32)))
    # The new grid: replica 0 with the spare in rank 1's position, every other rank where it was.
    assert list(plan.new.ranks) == [0, 32, *range(2, 8), *range(16, 24)]
    assert plan.members == frozenset(plan.new.ranks) and plan.new.size == 16
    assert plan.new.group_ranks("tp", 32) == [0, 32, 2, 3, 4, 5, 6, 7]
    assert plan.describe() == ("shrink: replicas holding ranks [9] dropped, shape [8, 2, 2] -> [8, 1, 2]; "
                               "15 surviving ranks leave the grid; replace: rank 1 -> 32; 0 spares left")


def test_a_mixed_recovery_drops_the_replicas_with_the_most_failed_ranks_first():
    # dp 4: replica 0 holds 1 failed rank (1), replica 2 holds 3 (4, 5, 12), replica 3 holds 1 (6).
    plan = plan_recovery(TP_DP_PP, failed=[1, 4, 5, 6, 12], spares=[16, 17])
    assert plan.dropped_failed == (4, 5, 12) and plan.new.shape == (2, 3, 2)
    assert dict(plan.replaced) == {1: 16, 6: 17} and plan.spares_left == ()
    assert set(plan.new.ranks) == (set(range(16)) - {1, 4, 5, 6, 12, 13}) | {16, 17}
    # Fewer spares: one more replica goes, the higher coordinate of the two holding one failed rank.
    fewer = plan_recovery(TP_DP_PP, failed=[1, 4, 5, 6, 12], spares=[16])
    assert fewer.dropped_failed == (4, 5, 6, 12) and fewer.replaced == ((1, 16),) and fewer.new.shape == (2, 2, 2)


@pytest.mark.parametrize("failed, spares", [([1, 9], [32]), ([1, 2, 9, 17], [32, 33]), ([0, 8, 16, 24], [32, 33, 34]),
                                            ([3, 11, 12], [32]), ([5, 13, 21, 29], [40, 41])])
def test_a_mixed_recovery_drops_the_fewest_replicas_possible(failed, spares):
    import itertools

    layout = GridLayout((4, 4, 2), ("tp", "dp", "pp"))  # dp 4, replicas of 8 ranks
    plan = plan_recovery(layout, failed=failed, spares=spares)
    by_replica = {}
    for r in failed:
        by_replica.setdefault(replica_of(layout, r, "dp"), []).append(r)
    fewest = next(n for n in range(len(by_replica) + 1) for drop in itertools.combinations(by_replica, n)
                  if sum(len(v) for k, v in by_replica.items() if k not in drop) <= len(spares))
    dropped = {replica_of(layout, r, "dp") for r in plan.dropped_failed}
    assert len(dropped) == fewest and plan.new.dim_size("dp") == 4 - fewest
    kept_failed = [r for r in failed if replica_of(layout, r, "dp") not in dropped]
    assert sorted(a for a, _ in plan.replaced) == sorted(kept_failed)
    assert set(plan.new.ranks) == ((set(range(32)) - set(failed) - set(plan.dropped))
                                   | {b for _, b in plan.replaced})


def test_a_mixed_recovery_keeps_a_whole_node_onto_a_spare_node():
    # 2 ranks a node; node 0 (ranks 0-1, replica 0) and ranks 8, 9, 24 (replica 2) fail; a spare
    # node, 33-34 (node 16 holds 32-33: 33 is its second rank).
    layout = GridLayout((4, 4, 2), ("tp", "dp", "pp"))
    plan = plan_recovery(layout, failed=[0, 1, 8, 9, 24], spares=[33, 34, 35], gpus_per_node=2)
    assert plan.dropped_failed == (8, 9, 24) and plan.replaced == ((0, 34), (1, 35)) and plan.spares_left == (33,)
    assert plan.new.group_ranks("tp", 34) == [34, 35, 2, 3]


@pytest.mark.parametrize("sizes, failed, spares", [
    (dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=2), [1, 9], [32]),
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), [3, 5, 7, 21], [32, 33]),
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
          expert_tensor_parallel_size=1), [6, 7, 16], [32]),
])
def test_megatrons_rebuild_over_a_mixed_plan_has_the_spares_in_the_replaced_positions(sizes, failed, spares):
    # What hypergrid/megatron/recovery.py rebuilds from: plan.new.size and plan.new.rank_map.
    world = 32
    before = plan_model_parallel(world, **sizes)
    recovery = plan_recovery(before.dense, failed=failed, spares=spares)
    assert recovery.kind is RecoveryKind.SHRINK and recovery.replaced
    after = plan_model_parallel(recovery.new.size, placement=recovery.new.rank_map, **sizes)
    assert after.dense == recovery.new
    swap = dict(recovery.replaced)
    gone = set(failed) | set(recovery.dropped)
    for name in before.names:
        kind = before.kind(name)
        if kind.view is None and kind.is_grid_groups and "dp" not in kind.dims:
            # Inside the kept replicas: the same groups, a spare in its failed rank's place.
            old = {tuple(swap.get(r, r) for r in g) for g in before.enumerate(name)
                   if not set(g) & (gone - set(swap))}
            assert {tuple(g) for g in after.enumerate(name)} == old, name


def test_the_replica_dim_may_be_any_dim():
    layout = GridLayout((2, 3, 2), ("tp", "cp", "rep"))
    plan = plan_recovery(layout, failed=[7], replica_dim="rep")  # rep=1
    assert plan.new.shape == (2, 3, 1) and list(plan.new.ranks) == [0, 1, 2, 3, 4, 5]


def _same_groups_outside(before, after, gone):
    """Groups of ``before`` that hold no rank of ``gone``, as tuples."""
    return {tuple(g) for g in before if not set(g) & gone}


@pytest.mark.parametrize("sizes, failed", [
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), [5]),
    (dict(tensor_model_parallel_size=2, context_parallel_size=2), [3, 14]),
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
          expert_tensor_parallel_size=1), [6]),
    (dict(pipeline_model_parallel_size=4, num_distributed_optimizer_instances=2), [1, 2]),  # dp 8 -> 6
])
def test_megatron_groups_inside_surviving_replicas_keep_their_members(sizes, failed):
    world = 32
    before = plan_model_parallel(world, **sizes)
    recovery = plan_recovery(before.dense, failed=failed)
    assert recovery.kind is RecoveryKind.SHRINK
    after = plan_model_parallel(recovery.new.size, placement=recovery.new.rank_map, **sizes)
    assert after.dense == recovery.new
    gone = set(range(world)) - recovery.members
    assert gone == set(failed) | set(recovery.dropped)
    replica_dims = {"dp"}
    for name in before.names:
        kind = before.kind(name)
        old, new = before.enumerate(name), after.enumerate(name)
        assert all(set(g) <= recovery.members for g in new), name
        if kind.view is None and kind.is_grid_groups and not replica_dims & set(kind.dims):
            # Inside one replica: the groups of surviving replicas, member for member, in order.
            assert {tuple(g) for g in new} == _same_groups_outside(old, new, gone), name
        if name in ("dp", "dp_cp") and kind.is_grid_groups:
            # Across replicas: each shrinks to its surviving members, in the same order.
            assert sorted(new) == sorted([r for r in g if r not in gone] for g in old), name


# ---------------------------------------------------------------------- refusals and errors
def test_a_lost_pipeline_stage_with_dp_1_is_refused_with_the_reason():
    layout = GridLayout((2, 1, 2), ("tp", "dp", "pp"))
    with pytest.raises(RecoveryRefused, match=r"loss of ranks \[2\]: no spare is left \(0 given, 1 needed\), and "
                                              r"every one of the 1 replicas of 'dp' holds a failed rank"):
        plan_recovery(layout, failed=[2])


def test_a_failed_rank_in_every_replica_is_refused():
    with pytest.raises(RecoveryRefused, match="every one of the 4 replicas of 'dp' holds a failed rank"):
        plan_recovery(TP_DP_PP, failed=[0, 2, 4, 6])
    # With one spare, three replicas go and the spare replaces the fourth's failed rank.
    plan = plan_recovery(TP_DP_PP, failed=[0, 2, 4, 6], spares=[16])
    assert plan.new.shape == (2, 1, 2) and plan.replaced == ((0, 16),)


def test_more_failed_ranks_in_every_replica_than_spares_is_refused_saying_so():
    with pytest.raises(RecoveryRefused, match=r"too few spares \(1 given, 4 needed\), and every one of the 2 "
                                              r"replicas of 'dp' holds more failed ranks than the spares can "
                                              r"replace \(the fewest: 2\), so none can be kept"):
        plan_recovery(GridLayout((2, 2, 2), ("tp", "dp", "pp")), failed=[0, 1, 2, 3], spares=[8])


def test_no_replica_dim_is_refused_naming_the_dims():
    with pytest.raises(RecoveryRefused, match=r"no replica dim 'dp' to drop replicas of \(dims \['tp', 'cp'\]\)"):
        plan_recovery(GridLayout((2, 4), ("tp", "cp")), failed=[1])
    assert isinstance(RecoveryRefused("x"), ValueError)  # the command line prints it as a bad input


@pytest.mark.parametrize("failed, spares, words", [
    ([16], [], r"failed ranks \[16\] are not in the grid, which spans ranks \[0, 16\)"),
    ([], [], "at least one rank"),
    ([3], [7], "spares must be distinct ranks outside the grid, got \\[7\\]"),
    ([3], [16, 16], "spares must be distinct ranks outside the grid, got \\[16, 16\\]"),
])
def test_bad_input_is_refused_naming_the_value(failed, spares, words):
    with pytest.raises(ValueError, match=words) as info:
        plan_recovery(TP_DP_PP, failed=failed, spares=spares)
    assert not isinstance(info.value, RecoveryRefused)


@pytest.mark.parametrize("failed, spares, words", [
    ([3], [-1], r"spares must be ranks \(integers >= 0\), got -1 in \[-1\]"),
    ([3], [16, -2], r"spares must be ranks \(integers >= 0\), got -2 in \[16, -2\]"),
    ([3], [True], r"spares must be ranks \(integers >= 0\), got bool True in \[True\]"),
    ([3], [16.0], r"spares must be ranks \(integers >= 0\), got float 16.0 in \[16.0\]"),
    ([3], ["16"], r"spares must be ranks \(integers >= 0\), got str '16' in \['16'\]"),
    ([3], 16, r"spares must be a list of ranks, got int 16"),
    ([-3], [], r"failed must be ranks \(integers >= 0\), got -3 in \[-3\]"),
    ([1.0], [], r"failed must be ranks \(integers >= 0\), got float 1.0 in \[1.0\]"),
    ([False], [], r"failed must be ranks \(integers >= 0\), got bool False in \[False\]"),
    ("3", [], r"failed must be a list of ranks, got str '3'"),
])
def test_a_value_that_is_not_a_rank_is_a_value_error_naming_it(failed, spares, words):
    import numpy as np

    from hypergrid.errors import RecoveryRankError

    with pytest.raises(ValueError, match=words) as info:
        plan_recovery(TP_DP_PP, failed=failed, spares=spares)
    assert isinstance(info.value, RecoveryRankError) and isinstance(info.value, TypeError)
    assert plan_recovery(TP_DP_PP, failed=[np.int64(3)], spares=[np.int32(16)]).replaced == ((3, 16),)


def test_a_rank_failed_twice_counts_once_and_non_grids_are_refused():
    assert plan_recovery(TP_DP_PP, failed=[5, 5], spares=[16]).replaced == ((5, 16),)
    with pytest.raises(TypeError, match="layout must be a GridLayout"):
        plan_recovery((2, 4), failed=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpus_per_node"):
        plan_recovery(TP_DP_PP, failed=[1], gpus_per_node=0)


# ---------------------------------------------------------------------- a placed grid, again
def test_a_placed_grid_is_re_planned_again_after_a_second_failure():
    first = plan_recovery(TP_DP_PP, failed=[5], spares=[16, 17], gpus_per_node=4)
    # The spare that took rank 5's place fails in turn: the other spare takes the same position.
    second = plan_recovery(first.new, failed=[16], spares=list(first.spares_left), gpus_per_node=4)
    assert second.replaced == ((16, 17),) and second.new.rank_at(5) == 17
    assert second.new.rank_map.runs == ((0, 0, 5), (5, 17, 1), (6, 6, 10))
    # Rank 5 left the grid with the first recovery: it cannot fail again.
    with pytest.raises(ValueError, match=r"failed ranks \[5\] are not in the grid, which spans ranks placed by RankMap"):
        plan_recovery(first.new, failed=[5])
    # Then no spare is left: the replica of the spare's position (dp=2) is dropped.
    third = plan_recovery(second.new, failed=[17], gpus_per_node=4)
    assert third.kind is RecoveryKind.SHRINK and third.new.shape == (2, 3, 2)
    assert set(third.new.ranks) == set(range(16)) - {4, 5, 12, 13} and third.dropped == (4, 12, 13)
    # The survivors' Megatron groups follow the placement.
    after = plan_model_parallel(12, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                placement=third.new.rank_map)
    assert after.rank_group("dp", 6) == [0, 2, 6] and after.rank_group("tp", 6) == [6, 7]


def test_a_shrink_of_a_placed_grid_keeps_the_spares_in_their_positions():
    first = plan_recovery(TP_DP_PP, failed=[3], spares=[16], gpus_per_node=4)
    shrunk = plan_recovery(first.new, failed=[8], gpus_per_node=4)  # replica 0 (ranks 0, 1, 8, 9)
    assert list(shrunk.new.ranks) == [2, 16, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]
    assert shrunk.dropped == (0, 1, 9)


# ---------------------------------------------------------------------- node locality
def test_after_a_whole_node_replacement_every_tp_group_stays_inside_a_node():
    layout = GridLayout((4, 2, 2), ("tp", "dp", "pp"))  # tp 4 = one node of 4
    plan = plan_recovery(layout, failed=[8, 9, 10, 11], spares=[16, 17, 18, 19], gpus_per_node=4)
    groups = plan.new.enumerate("tp")
    assert [16, 17, 18, 19] in groups
    assert all(len(_nodes(g, 4)) == 1 for g in groups)


def test_a_single_rank_replacement_off_node_makes_its_tp_group_cross_nodes():
    # What docs/recovery says: the spare is on another node, so its tp group spans two nodes.
    layout = GridLayout((4, 2, 2), ("tp", "dp", "pp"))
    plan = plan_recovery(layout, failed=[9], spares=[16, 17, 18, 19], gpus_per_node=4)
    group = plan.new.group_ranks("tp", 16)
    assert group == [8, 16, 10, 11] and _nodes(group, 4) == {2, 4}
    crossing = [g for g in plan.new.enumerate("tp") if len(_nodes(g, 4)) > 1]
    assert crossing == [group]  # only that one


# ---------------------------------------------------------------------- a million ranks
def _no_world_lists(monkeypatch, limit=4096):
    """Fail the test if anything lists a rank map of more than ``limit`` positions."""
    original_of, original_iter = RankMap.of.__func__, RankMap.__iter__

    def of(cls, ranks):
        ranks = list(ranks)
        assert len(ranks) <= limit, f"RankMap.of called with {len(ranks)} ranks"
        return original_of(cls, ranks)

    def iterate(self):
        assert self.size <= limit, f"a rank map of {self.size} positions was listed"
        return original_iter(self)

    monkeypatch.setattr(RankMap, "of", classmethod(of))
    monkeypatch.setattr(RankMap, "__iter__", iterate)


def test_a_million_rank_layout_is_re_planned_without_listing_the_world(monkeypatch):
    world = 1 << 20
    layout = GridLayout((8, 2, world // 64, 4), ("tp", "cp", "dp", "pp"))
    _no_world_lists(monkeypatch)
    node = list(range(4096, 4104))
    replaced = plan_recovery(layout, failed=node, spares=list(range(world, world + 8)), gpus_per_node=8)
    assert replaced.replaced == tuple(zip(node, range(world, world + 8)))
    assert replaced.new.rank_map.runs == ((0, 0, 4096), (4096, world, 8), (4104, 4104, world - 4104))
    assert replaced.new.group_ranks("tp", world + 3) == list(range(world, world + 8))
    # A second failure on the placed grid, no spare left: one replica of 64 ranks goes.
    shrunk = plan_recovery(replaced.new, failed=[world + 2, 77], gpus_per_node=8)
    assert shrunk.new.shape == (8, 2, world // 64 - 2, 4)
    assert len(shrunk.dropped) == 2 * 64 - 2 and len(shrunk.new.rank_map.runs) <= 16
    assert shrunk.new.size == world - 128
    assert not shrunk.new.contains(77) and shrunk.new.contains(world - 1)
    # The Megatron plan over it answers one rank's groups without listing the world either.
    after = plan_model_parallel(shrunk.new.size, tensor_model_parallel_size=8, context_parallel_size=2,
                                pipeline_model_parallel_size=4, placement=shrunk.new.rank_map)
    assert after.rank_group("tp", world - 1) == list(range(world - 8, world))


# ---------------------------------------------------------------------- a whole plan: what is rebuilt
def _brute_force(before, after):
    """Per kind, (kept, rebuilt, dropped) by comparing every group of both plans."""
    old = {k.name: {tuple(g) for g in k.enumerate() if g} for k in before.kinds}
    new = {k.name: {tuple(g) for g in k.enumerate() if g} for k in after.kinds}
    return {name: (len(old.get(name, set()) & new.get(name, set())),
                   len(new.get(name, set()) - old.get(name, set())),
                   len(old.get(name, set()) - new.get(name, set()))) for name in set(old) | set(new)}


MEGATRON_LAYOUTS = [
    dict(world_size=32, tp=2, pp=2),
    dict(world_size=64, tp=2, pp=2, cp=2, ep=4, etp=1),
    dict(world_size=64, tp=4, ep=8, etp=1),  # expert tp-ep groups span two dense replicas
    dict(world_size=32, pp=4, num_distributed_optimizer_instances=2),
    dict(world_size=32, tp=2, cp=2, hierarchical_context_parallel_sizes=[2, 1]),
    dict(world_size=64, tp=2, cp=2, hybrid_context_parallel=True),
]


@pytest.mark.parametrize("sizes", MEGATRON_LAYOUTS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("failed, spares", [([5], [64, 65]), ([8, 9, 10, 11, 12, 13, 14, 15], list(range(64, 72))),
                                            ([5], []), ([3, 29], [70]), ([1, 2, 9, 17, 18], [64, 65])])
def test_every_kinds_counts_are_what_comparing_every_group_gives(sizes, failed, spares):
    from hypergrid.planning.plan import plan_megatron
    from hypergrid.planning.recovery import Counted, recovery_of

    sizes = dict(sizes)
    plan = plan_megatron(sizes.pop("world_size"), **sizes)
    try:
        report = recovery_of(plan, failed=failed, spares=spares, gpus_per_node=8)
    except RecoveryRefused as exc:
        # Only where Megatron-Core refuses the shrunk sizes (dp 2 * cp 2 -> 1 * 2 with 2 optimizer
        # instances would be fine; 7 replicas of ep 8 are not), and it says so.
        assert "sizes Megatron-Core refuses" in str(exc), exc
        return
    truth = _brute_force(report.before, report.after)
    assert {c.name for c in report.changes} == set(truth)
    for change in report.changes:
        assert (change.kept, change.rebuilt, change.dropped) == truth[change.name], change
        assert change.kept + change.rebuilt == change.after and change.kept + change.dropped == change.before
    counted = {c.counted for c in report.changes}
    assert Counted.NOT_COMPUTED not in counted
    if report.recovery.kind is RecoveryKind.REPLACE:
        assert counted == {Counted.FAILED_GROUPS}
    else:
        assert Counted.REPLICA_DIM in counted


def test_the_expert_views_kinds_are_counted_by_the_replica_dim_where_its_replicas_line_up(monkeypatch):
    from hypergrid.planning.plan import plan_megatron
    from hypergrid.planning.recovery import Counted, recovery_of

    # Expert tp x ep = 4 ranks = dense tp x cp: one dense replica is one expert replica.
    lined_up = recovery_of(plan_megatron(64, tp=2, cp=2, pp=2, ep=4, etp=1), failed=[5])
    counted = {c.name: c.counted for c in lined_up.changes}
    assert counted["ep"] is counted["expt_dp"] is counted["embd"] is counted["hcp_0" if "hcp_0" in counted else "tp"]
    assert counted["ep"] is Counted.REPLICA_DIM and counted["intra_dist_opt"] is Counted.EVERY_GROUP
    # Expert tp x ep = 8 ranks spans two dense replicas of 4 (ranks 4-7 and 8-11 go): compared group
    # by group. ep groups 0-7 and 8-15 become one of 0-3 and 12-15; the later ones are kept.
    across = recovery_of(plan_megatron(64, tp=4, ep=8, etp=1), failed=[5, 9])
    counted = {c.name: c.counted for c in across.changes}
    assert counted["ep"] is Counted.EVERY_GROUP and counted["tp"] is Counted.REPLICA_DIM
    ep = across.change("ep")
    assert (ep.kept, ep.rebuilt, ep.dropped) == (6, 1, 2)
    assert across.after.groups_of(0)["ep"] == [0, 1, 2, 3, 12, 13, 14, 15]


def test_the_plan_after_is_megatrons_plan_over_the_recovered_ranks():
    from hypergrid.megatron.spec.features import MEGATRON_CORE_0_19
    from hypergrid.planning.plan import plan_megatron
    from hypergrid.planning.recovery import plan_after

    plan = plan_megatron(32, tp=2, pp=2, ep=2, etp=1, features=MEGATRON_CORE_0_19,
                         num_distributed_optimizer_instances=2)
    recovery = plan_recovery(plan.layout, failed=[5, 6])  # dp 8 -> 6
    after = plan_after(plan, recovery)
    expected = plan_model_parallel(24, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                   expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                                   num_distributed_optimizer_instances=2,
                                   create_gloo_process_groups=False, features=MEGATRON_CORE_0_19,
                                   placement=recovery.new.rank_map)
    assert [k.name for k in after.kinds] == expected.names and after.kinds[0].name == "gtp_remat"
    assert {k.name: k.enumerate() for k in after.kinds} == expected.groups
    assert after.megatron.dp == 6 and after.megatron_config.num_distributed_optimizer_instances == 2
    assert after.layout == recovery.new and after.views["expert"] == expected.expert


def test_a_second_failure_is_planned_from_the_plan_after_the_first():
    from hypergrid.planning.plan import plan_megatron
    from hypergrid.planning.recovery import recovery_of

    first = recovery_of(plan_megatron(16, tp=2, pp=2), failed=[5], spares=[16], gpus_per_node=4)
    second = recovery_of(first.after, failed=[16, 0], gpus_per_node=4)  # no spare: replicas 0 and 2
    assert second.recovery.kind is RecoveryKind.SHRINK and second.after.megatron.dp == 2
    assert set(second.after.layout.ranks) == {2, 3, 6, 7, 10, 11, 14, 15}
    truth = _brute_force(second.before, second.after)
    assert {c.name: (c.kept, c.rebuilt, c.dropped) for c in second.changes} == truth
    assert second.change("tp").kept == 4 and second.change("dp").rebuilt == 4


def test_a_free_grid_and_a_torchtitan_plan_follow_their_grid():
    from pathlib import Path

    from hypergrid.planning.plan import plan_grid
    from hypergrid.planning.recovery import recovery_of
    from hypergrid.planning.torchtitan import plan_torchtitan

    grid = recovery_of(plan_grid([2, 2, 4], ["tp", "cp", "rep"], groups=[["cp", "rep"]]), failed=[6],
                       replica_dim="rep")
    assert grid.after.layout.shape == (2, 2, 3) and grid.change("cp-rep").rebuilt == 2
    assert {c.name: (c.kept, c.rebuilt, c.dropped) for c in grid.changes} == _brute_force(grid.before, grid.after)
    config = Path(__file__).resolve().parent.parent / "docs" / "examples" / "llama3_70b.toml"
    titan = plan_torchtitan(config, 32, "0.2")
    replaced = recovery_of(titan, failed=[13], spares=[32])
    truth = _brute_force(replaced.before, replaced.after)
    assert {c.name: (c.kept, c.rebuilt, c.dropped) for c in replaced.changes} == truth
    assert all(13 not in k.members(32) for k in replaced.after.kinds)
    with pytest.raises(RecoveryRefused, match=r"loss of ranks \[13\] by dropping replicas: only Megatron-Core's "
                                              r"groups and a free grid's .* this plan follows torchtitan's meshes"):
        recovery_of(titan, failed=[13], replica_dim="dp_replicate")


def test_megatrons_refusal_of_the_shrunk_sizes_is_a_refusal_with_the_reason():
    from hypergrid.planning.plan import plan_megatron
    from hypergrid.planning.recovery import recovery_of

    with pytest.raises(RecoveryRefused, match=r"loss of ranks \[5\]: the shrunk grid's 56 ranks \(tp=1 x cp=1 x "
                                              r"dp=7 x pp=8\) are sizes Megatron-Core refuses: .*expert"):
        recovery_of(plan_megatron(64, pp=8, ep=8), failed=[5])
    with pytest.raises(ValueError, match="replica_dim 'pp': a Megatron plan's replicas are along 'dp'"):
        recovery_of(plan_megatron(16, pp=2), failed=[5], replica_dim="pp")


def test_one_ranks_groups_before_and_after():
    from hypergrid.planning.plan import plan_megatron
    from hypergrid.planning.recovery import recovery_of

    report = recovery_of(plan_megatron(16, tp=2, pp=2), failed=[5], spares=[16, 17], gpus_per_node=4)
    spare = report.rank_change(16)
    assert spare["role"] == "replaces" and spare["replaces"] == 5 and spare["coords_before"] is None
    assert spare["groups"]["tp"] == {"before": None, "after": [4, 16], "change": "joined"}
    failed = report.rank_change(5)
    assert failed["role"] == "failed" and failed["groups"]["tp"]["change"] == "left"
    neighbour = report.rank_change(4)
    assert neighbour["coords_before"] == neighbour["coords_after"]
    assert neighbour["groups"]["tp"] == {"before": [4, 5], "after": [4, 16], "change": "rebuilt"}
    assert neighbour["groups"]["pp"]["change"] == "kept" and neighbour["groups"]["pos_embd"]["change"] == "kept"
    assert report.rank_change(17)["role"] == "spare" and report.rank_change(2)["groups"]["embd"]["change"] == "kept"
    shrunk = recovery_of(plan_megatron(16, tp=2, pp=2), failed=[5], gpus_per_node=4)
    assert shrunk.rank_change(4)["role"] == "leaves" and shrunk.rank_change(4)["coords_after"] is None
    moved = shrunk.rank_change(6)  # dp 3 -> 2 in the shrunk grid
    assert moved["coords_before"]["dp"] == 3 and moved["coords_after"]["dp"] == 2
    assert moved["groups"]["dp"] == {"before": [0, 2, 4, 6], "after": [0, 2, 6], "change": "rebuilt"}
    assert moved["groups"]["tp"]["change"] == "kept"


def _no_enumeration(monkeypatch):
    from hypergrid.layout.kinds import GroupKind

    def refuse(self):
        raise AssertionError(f"{self.name}: every group was listed")

    monkeypatch.setattr(GroupKind, "enumerate", refuse)


def test_a_million_rank_replacement_is_counted_from_the_failed_ranks_groups(monkeypatch):
    from hypergrid.planning.plan import plan_megatron
    from hypergrid.planning.recovery import Counted, recovery_of

    world = 1 << 20
    plan = plan_megatron(world, tp=8, pp=4, cp=2, ep=8, etp=1)
    _no_enumeration(monkeypatch)
    _no_world_lists(monkeypatch)
    node = list(range(8 * 1000, 8 * 1001))
    report = recovery_of(plan, failed=node, spares=list(range(world, world + 8)))
    assert {c.counted for c in report.changes} == {Counted.FAILED_GROUPS}
    tp = report.change("tp")
    assert (tp.kept, tp.rebuilt, tp.dropped) == (tp.before - 1, 1, 1)
    assert report.change("dp").rebuilt == 8 and report.change("cp").rebuilt == 8
    assert report.rank_change(world + 3)["groups"]["tp"]["after"] == list(range(world, world + 8))


def test_beyond_the_listing_limit_a_shrink_counts_grid_kinds_and_says_the_rest_are_not_computed(monkeypatch):
    from hypergrid.planning.plan import MAX_LISTED_WORLD, plan_megatron
    from hypergrid.planning.recovery import Counted, recovery_of

    world = 2 * MAX_LISTED_WORLD
    plan = plan_megatron(world, tp=8, pp=4)
    _no_enumeration(monkeypatch)
    report = recovery_of(plan, failed=[5])
    by_name = {c.name: c for c in report.changes}
    # The dropped replica holds one tp group per pipeline stage; every dp group loses a member.
    assert by_name["tp"].counted is Counted.REPLICA_DIM and by_name["tp"].dropped == 4
    assert by_name["tp"].kept == world // 8 - 4 and by_name["dp"].rebuilt == by_name["dp"].dropped == 32
    assert by_name["embd"].counted is by_name["expt_dp"].counted is Counted.REPLICA_DIM
    assert by_name["embd"].dropped == 8 and by_name["expt_dp"].rebuilt == 32
    # One group of every rank, joined from the expert tp-ep-pp groups: not listed at this size.
    assert by_name["intra_dist_opt"].counted is Counted.NOT_COMPUTED and by_name["intra_dist_opt"].kept is None
