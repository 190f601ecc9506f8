"""HyperCommGrid on real gloo process groups: 4- and 8-rank jobs on loopback.

Each job starts fresh processes (several seconds on this machine), so each job batches many
checks; the functions run in the children are module-level and assert there, and a failing rank
fails the test with its traceback.

A group is verified by what it does, not only by what it says: an all-reduce over the group of
(rank, 1 << rank, 1) must give the sum of the expected members, their exact set as a bit mask and
their number, and ``dist.get_process_group_ranks`` must list the expected members.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from hypergrid import REGISTRY, GridDestroyedError, GridTooLargeError, HyperCommGrid
from tests.harness import run_gloo

#: Every test here starts multi-process gloo jobs (tests/README.md).
pytestmark = pytest.mark.gloo

#: Generous: this only bounds a hang, and start-up alone can take a minute on a loaded machine.
JOB_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------- helpers (children)
def all_subsets(names):
    return [list(c) for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]


def pg_map_size() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def verify_group(grid, dims, pg, rank, view=None):
    """`pg` is this rank's `dims` group of `grid` (None off the grid), checked by communicating."""
    layout = grid.views[view] if view else grid.layout
    if not layout.contains(rank):
        assert pg is None, f"rank {rank} is off the grid but got a group for {dims}: {pg}"
        return 0
    assert pg is not None, f"rank {rank} got no group for {dims}"
    expected = grid.ranks(dims, view=view)
    assert rank in expected
    assert dist.get_process_group_ranks(pg) == sorted(expected), (dims, dist.get_process_group_ranks(pg), expected)
    assert pg.size() == len(expected)
    assert dist.get_rank(pg) == sorted(expected).index(rank)
    t = torch.tensor([rank, 1 << rank, 1], dtype=torch.int64)
    dist.all_reduce(t, group=pg)
    mask = sum(1 << r for r in expected)
    assert t.tolist() == [sum(expected), mask, len(expected)], (dims, t.tolist(), expected)
    return 1


def create_and_verify_all(grid, rank, subsets, **kwargs):
    """Create every dims subset, verify each group, return {key: pg}."""
    made = {}
    checked = 0
    for dims in subsets:
        pg = grid.create_pg(dims, **kwargs)
        made[grid.layout.key(dims)] = pg
    for dims in subsets:
        pg = grid.get_pg(list(reversed(dims)))  # the key ignores the order given
        assert pg is made[grid.layout.key(dims)]
        checked += verify_group(grid, dims, pg, rank)
    return made, checked


def expect_raises(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        for needle in needles:
            assert needle in str(exc), (needle, str(exc))
        return exc
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


# ---------------------------------------------------------------------------- job 1: one world, 3-D and 4-D grids
def job_grids_and_strategies(rank, world_size):
    checked = 0
    base_count, base_map = REGISTRY.count(), pg_map_size()

    # A 3-D grid: every subset of dims, each group verified.
    grid3 = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    assert grid3.is_current_rank_in_grid() and grid3.strategy == "auto"
    made3, n = create_and_verify_all(grid3, rank, all_subsets(["tp", "cp", "dp"]))
    checked += n
    # 7 keys, 7 distinct memberships on every rank -> 7 distinct groups
    assert len({id(pg) for pg in made3.values()}) == 7
    assert REGISTRY.count() == base_count + 7
    assert pg_map_size() == base_map + 7

    # Megatron's errors: re-creating a key (in any order) and getting a missing one.
    expect_raises(KeyError, lambda: grid3.create_pg(["dp", "cp"]), "dp-cp")
    expect_raises(KeyError, lambda: grid3.create_pg(["cp", "dp"]))
    grid_fresh = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    expect_raises(KeyError, lambda: grid_fresh.get_pg(["tp", "dp"]), "create_pg", "dp-tp")
    assert grid_fresh.get_or_create_pg(["tp", "dp"]) is made3["dp-tp"]  # shared by members
    assert grid_fresh.get_or_create_pg(["dp", "tp"]) is made3["dp-tp"]
    assert grid_fresh.get_pg(["dp", "tp"]) is grid_fresh.get_pg(["tp", "dp"])
    assert REGISTRY.count() == base_count + 7  # nothing new was created

    # A 4-D grid with a size-1 dim: keys with the same members share one communicator.
    grid4 = HyperCommGrid([2, 1, 2, 2], ["tp", "cp", "pp", "dp"])
    _, n = create_and_verify_all(grid4, rank, all_subsets(["tp", "cp", "pp", "dp"]))
    checked += n
    assert grid4.get_pg(["cp", "tp"]) is grid4.get_pg("tp")
    assert grid4.get_pg(["cp", "pp", "dp"]) is grid4.get_pg(["pp", "dp"])
    # grid4's (tp, pp, dp) are grid3's (tp, cp, dp) with the same strides: the same groups
    assert grid4.get_pg("pp") is made3["cp"] and grid4.get_pg(["tp", "dp"]) is made3["dp-tp"]
    assert REGISTRY.count() == base_count + 7 + 1  # only the singleton "cp" group is new
    assert grid4.get_pg("cp").size() == 1

    # strategy="split": gloo on CPU cannot split, so it falls back to "local" and shares.
    grid_split = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"], strategy="split")
    for dims in all_subsets(["tp", "cp", "dp"]):
        pg = grid_split.create_pg(dims)
        assert pg is grid3.get_pg(dims), dims
        checked += verify_group(grid_split, dims, pg, rank)

    # strategy="enumerate" (Megatron's call pattern): identical memberships.
    grid_enum = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"], strategy="enumerate")
    for dims in all_subsets(["tp", "cp", "dp"]):
        pg = grid_enum.create_pg(dims)
        assert dist.get_process_group_ranks(pg) == dist.get_process_group_ranks(grid3.get_pg(dims))
        checked += verify_group(grid_enum, dims, pg, rank)

    # Tear down: everything hypergrid made is gone, and only that.
    for grid in (grid3, grid_fresh, grid4, grid_enum, grid_split):
        grid.destroy()
    assert REGISTRY.count() == base_count
    assert pg_map_size() == base_map
    return checked


# ---------------------------------------------------------------------------- job 2: offsets, sharing, views, destroy
def job_offsets_sharing_views_destroy(rank, world_size):
    base_count, base_map = REGISTRY.count(), pg_map_size()

    # Two grids side by side: ranks 0-3 and 4-7. Every rank calls create_pg on both.
    low = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=0)
    high = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4)
    assert low.is_current_rank_in_grid() == (rank < 4)
    assert high.is_current_rank_in_grid() == (rank >= 4)
    for grid in (low, high):
        made, _ = create_and_verify_all(grid, rank, [["tp"], ["dp"], ["tp", "dp"]])
        for pg in made.values():
            assert (pg is None) == (not grid.is_current_rank_in_grid())
    assert REGISTRY.count() == base_count + 3
    low.destroy()
    high.destroy()
    assert REGISTRY.count() == base_count and pg_map_size() == base_map

    # The same side by side with Megatron's call pattern, twice over (create, destroy, again),
    # then a group spanning both halves: every rank must have made the same calls.
    for _ in range(2):
        low = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=0, strategy="enumerate")
        high = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4, strategy="enumerate")
        for grid in (low, high):
            pg = grid.create_pg("tp")
            verify_group(grid, ["tp"], pg, rank)
        low.destroy()
        high.destroy()
    whole = HyperCommGrid([2, 4], ["tp", "dp"], strategy="enumerate")
    verify_group(whole, ["dp"], whole.create_pg("dp"), rank)
    whole.destroy()
    assert REGISTRY.count() == base_count and pg_map_size() == base_map

    # Sharing across two grids over the same ranks.
    c = HyperCommGrid([2, 4], ["tp", "dp"])
    d = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    c_tp, c_dp = c.create_pg("tp"), c.create_pg("dp")
    d_tp, d_cp, d_cpdp, d_dp = d.create_pg("tp"), d.create_pg("cp"), d.create_pg(["dp", "cp"]), d.create_pg("dp")
    assert d_tp is c_tp and d_cpdp is c_dp
    assert len({id(x) for x in (c_tp, c_dp, d_cp, d_dp)}) == 4
    assert REGISTRY.count() == base_count + 4 and pg_map_size() == base_map + 4
    assert {owner for owner, _ in REGISTRY.holders_of(c_tp)} == {c._id, d._id}

    # private=True: a communicator of its own, with the same members.
    e = HyperCommGrid([2, 4], ["tp", "dp"])
    e_tp = e.create_pg("tp", private=True)
    assert e_tp is not c_tp
    assert dist.get_process_group_ranks(e_tp) == dist.get_process_group_ranks(c_tp)
    verify_group(e, ["tp"], e_tp, rank)
    assert REGISTRY.count() == base_count + 5
    # ... and a later shared request still gets the shared one, not the private one
    f = HyperCommGrid([2, 4], ["tp", "dp"])
    assert f.create_pg("tp") is c_tp

    # destroy releases only what the grid holds alone.
    d.destroy()  # d_cp and d_dp go; tp and cp-dp are still held by c (and f)
    assert REGISTRY.count() == base_count + 3 and pg_map_size() == base_map + 3
    verify_group(c, ["tp"], c_tp, rank)
    verify_group(c, ["dp"], c_dp, rank)
    d.destroy()  # idempotent
    assert REGISTRY.count() == base_count + 3
    expect_raises(GridDestroyedError, lambda: d.create_pg("tp"), "destroyed")
    expect_raises(GridDestroyedError, lambda: d.get_pg("tp"))
    expect_raises(RuntimeError, lambda: d.get_or_create_pg("cp"))
    expect_raises(GridDestroyedError, lambda: d.register_view("v", [8], ["all"]))
    assert d.get_rank_enum("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # planning still works
    e.destroy()
    assert REGISTRY.count() == base_count + 2
    c.destroy()
    assert REGISTRY.count() == base_count + 1  # f still holds tp
    verify_group(f, ["tp"], f.get_pg("tp"), rank)
    f.destroy()
    assert REGISTRY.count() == base_count and pg_map_size() == base_map

    # Views: an expert view (ep, dp) beside a dense grid (tp, cp, dp), dp shared.
    g = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    g.register_view("expert", [4, 2], ["ep", "dp"], shared_dims=["dp"])
    g.register_view("flat", [2, 4], ["etp", "edp"])
    ep = g.create_pg("ep", view="expert")
    verify_group(g, ["ep"], ep, rank, view="expert")
    # a view dim with the same members as a grid group is the same communicator
    assert g.create_pg(["tp", "cp"]) is ep
    etp = g.create_pg("etp", view="flat")
    assert g.create_pg("tp") is etp
    edp = g.create_pg("edp", view="flat")
    assert g.create_pg(["cp", "dp"]) is edp
    verify_group(g, ["edp"], edp, rank, view="flat")
    # a shared dim uses the grid's key: created through the view, found through the grid
    dp = g.create_pg("dp", view="expert")
    assert g.get_pg("dp") is dp and g.get_pg("dp", view="expert") is dp
    expect_raises(KeyError, lambda: g.create_pg("dp"))
    verify_group(g, ["dp"], dp, rank)
    # a mixed request lives under the view's own key
    ep_dp = g.create_pg(["dp", "ep"], view="expert")
    assert g.get_pg(["ep", "dp"], view="expert") is ep_dp
    assert ep_dp is g.create_pg(["tp", "cp", "dp"])  # the whole world either way
    expect_raises(KeyError, lambda: g.get_pg("ep", view="nope"), "nope")
    expect_raises(KeyError, lambda: g.create_pg("ep", view="expert"))
    g.destroy()
    assert REGISTRY.count() == base_count and pg_map_size() == base_map
    return True


def job_eight_ranks(rank, world_size):
    # One job for both parts: starting 8 processes is most of the cost on a small machine.
    return job_grids_and_strategies(rank, world_size), job_offsets_sharing_views_destroy(rank, world_size)


def test_eight_ranks_grids_strategies_keys_offsets_sharing_views_destroy():
    results = run_gloo(job_eight_ranks, 8, timeout=JOB_TIMEOUT_S)
    # every rank verified 7 + 15 + 7 + 7 groups of the first part by communicating
    assert results == [(36, True)] * 8


# ---------------------------------------------------------------------------- job 3: 4 ranks
def job_four_ranks(rank, world_size):
    names = ["tp", "cp", "pp", "dp"]
    local = HyperCommGrid([2, 1, 2, 1], names)
    _, checked = create_and_verify_all(local, rank, all_subsets(names), group_desc="LOCAL")
    enum = HyperCommGrid([2, 1, 2, 1], names, strategy="enumerate")
    split = HyperCommGrid([2, 1, 2, 1], names, strategy="split")
    for dims in all_subsets(names):
        ps = split.create_pg(dims)  # falls back to local on gloo, so it shares local's groups
        assert ps is local.get_pg(dims)
        checked += verify_group(split, dims, ps, rank)
    for dims in all_subsets(names):
        pe = enum.create_pg(dims)
        assert dist.get_process_group_ranks(pe) == dist.get_process_group_ranks(local.get_pg(dims))
        checked += verify_group(enum, dims, pe, rank)

    # Half-world grids: 2 ranks each, the others get None.
    for offset in (0, 2):
        half = HyperCommGrid([2], ["tp"], rank_offset=offset)
        pg = half.create_pg("tp")
        checked += verify_group(half, ["tp"], pg, rank)
        assert (pg is None) == (not offset <= rank < offset + 2)
        half.destroy()

    # The world size comes from WORLD_SIZE (4, set by the launcher), then torch.distributed, as
    # in Megatron-Core; a grid planned for a larger world is refused when it creates a group.
    assert local.world_size == 4
    planned = HyperCommGrid([2, 4], ["tp", "dp"], world_size=8)
    expect_raises(GridTooLargeError, lambda: planned.create_pg("tp"), "'tp'", "8", "4 ranks")
    err = expect_raises(GridTooLargeError, lambda: HyperCommGrid([2, 4], ["tp", "dp"]), "[2, 4]", "4")
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError)
    expect_raises(RuntimeError, lambda: HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=1), "1")
    for grid in (local, enum, split):
        grid.destroy()
    assert REGISTRY.count() == 0
    return checked


def test_four_ranks_strategies_and_world():
    assert run_gloo(job_four_ranks, 4, timeout=JOB_TIMEOUT_S) == [15 * 3 + 1] * 4
