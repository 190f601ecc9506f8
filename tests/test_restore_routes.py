"""Each rank's own part of a restore, derived from the placements alone, agrees with every other
rank's (no process group: every rank of a world is played in this process).

- The partner ring that :class:`Routes` derives rank by rank is the one ``partner_map`` lists.
- Whom a receiver asks (:meth:`Routes.asks`) is exactly who derives that it will be asked
  (:meth:`Routes.owed`): an exchange where one side waits for a word the other never sends would hang.
- The whole restore, every rank's :class:`OwnPart` talking through an in-process exchange, rebuilds
  every rank's new blocks from the old ones, element for element, for a replacement, a shrink and a
  growth, of FSDP2-like row shards, replicated tensors and HSDP-like shards, uneven and empty ones.
- What one rank receives to plan does not grow with the world (the benchmark measures it at 131,072).
"""

from __future__ import annotations

import itertools
import pickle
import random
from typing import Any

import pytest
import torch

from hypergrid.layout import GridLayout
from hypergrid.layout.rank_map import RankMap
from hypergrid.training.partner import partner_map
from hypergrid.training.regions import Region, block_of, chunk
from hypergrid.training.restore import OwnPart, Traffic, plan_own_part
from hypergrid.training.routes import NotDerivable, Routes
from hypergrid.training.state import Snapshot

ROWS = [1, 3, 7, 16, 17, 40]  # uneven, and fewer rows than ranks (empty shards)


def _regions(layout: GridLayout, rank: int, replica: str, kind: str) -> dict[tuple[Any, ...], Region]:
    """A rank's state: tensors row-sharded along ``dp`` (``fsdp``), whole (``replicated``), or sharded
    along ``shard`` and alike along ``dp`` (``hsdp``)."""
    coords = dict(zip(layout.dim_names, layout.coords(rank)))
    along = {"fsdp": "dp", "hsdp": "shard"}.get(kind)
    found = {}
    for i, rows in enumerate(ROWS):
        sharded = along is not None and i % 2 == 0
        context = tuple((d, v) for d, v in coords.items() if d != replica and not (sharded and d == along))
        if sharded:
            start, size = chunk(rows, layout.dim_size(along), coords[along])
            found[("t", i)] = Region(context, (rows, 3), (start, 0), (size, 3), torch.float64, sharding=((0, along),))
        else:
            found[("t", i)] = Region(context, (rows, 3), (0, 0), (rows, 3), torch.float64, sharding=())
    return found


def _values(region: Region) -> torch.Tensor:
    """The global tensor a region is a block of: each element names its context and place."""
    seed = hash(region.context) % 1000
    whole = torch.arange(region.global_shape[0] * 3, dtype=torch.float64).reshape(region.global_shape) + 1000 * seed
    return whole.narrow(0, region.offsets[0], region.shape[0]).clone()


def _placements(kind: str, tp: int, dp: int, per_node: int, dims: tuple[str, str] = ("tp", "dp")
                ) -> tuple[GridLayout, GridLayout]:
    """The placement before and after node 1 is lost: a spare node takes its place, dp drops the
    coordinates it held, or (``grow``) the shrunk grid takes the spare node back."""
    n = tp * dp
    old = GridLayout((tp, dp), dims)
    lost = set(range(per_node, 2 * per_node))
    spares = [n + i for i in range(per_node)]
    survivors = [r for r in range(n) if r not in lost]
    shrunk = GridLayout((tp, dp - per_node // tp), dims, rank_map=RankMap.of(survivors))
    if kind == "replace":
        placed = list(range(n))
        placed[per_node:2 * per_node] = spares
        return old, GridLayout((tp, dp), dims, rank_map=RankMap.of(placed))
    if kind == "shrink":
        return old, shrunk
    return shrunk, GridLayout((tp, dp), dims, rank_map=RankMap.of(survivors + spares))


class _World:
    """Every rank's part, talking through memory: an all-reduce is the most over all ranks."""

    def __init__(self, routes: Routes, replica: str, kind: str, lose_copy_of: tuple[int, ...] = ()) -> None:
        self.routes = routes
        old, new = routes.old, routes.new
        self.snapshots: dict[int, dict[tuple[int, int], Snapshot]] = {}
        for rank in new.ranks:
            held = {}
            for source in routes.kept(rank):
                if source != rank and source in lose_copy_of:
                    continue
                regions = _regions(old, source, replica, kind)
                tensors = {path: _values(region) for path, region in regions.items()}
                coords = tuple(zip(old.dim_names, old.coords(source)))
                for step in (4, 5):
                    held[(source, step)] = Snapshot(step, dict(tensors), rank=source, regions=regions, coords=coords)
            self.snapshots[rank] = held
        self.wanted = {rank: _regions(new, rank, replica, kind) for rank in new.ranks}


def _restore_all(world: _World, target: int = 5) -> dict[int, Any]:
    """Run plan_own_part on every rank at once (threads of one loop, each phase in turn)."""
    import threading

    ranks = list(world.routes.new.ranks)
    barrier = threading.Barrier(len(ranks))
    mailbox: dict[tuple[int, int, int], Any] = {}
    reduced: dict[int, list[list[int]]] = {}
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    class Exchange:
        def __init__(self, rank: int) -> None:
            self.rank, self.traffic, self.rounds, self.swaps = rank, Traffic(), 0, 0

        def agreed_max(self, values: list[int]) -> list[int]:
            index = self.rounds
            self.rounds += 1
            reduced.setdefault(index, []).append(values)
            barrier.wait(timeout=30)
            out = [max(v[i] for v in reduced[index]) for i in range(len(values))]
            barrier.wait(timeout=30)
            self.traffic.bytes_in += 8 * len(values)
            return out

        def swap(self, sends: dict[int, Any], receives: list[int]) -> dict[int, Any]:
            index = self.swaps
            self.swaps += 1
            for peer, value in sends.items():
                mailbox[(index, self.rank, peer)] = pickle.dumps(value)
            barrier.wait(timeout=30)
            got = {}
            for peer in receives:
                data = mailbox[(index, peer, self.rank)]  # KeyError: a word waited for and never sent
                self.traffic.bytes_in += 8 + len(data)
                got[peer] = pickle.loads(data)
            barrier.wait(timeout=30)
            return got

    def run(rank: int) -> None:
        try:
            results[rank] = plan_own_part(world.routes, world.wanted[rank], world.snapshots[rank], target,
                                          Exchange(rank), rank=rank)
        except BaseException as failure:  # noqa: BLE001 - reported below
            errors.append(failure)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def _rebuilt(world: _World, results: dict[int, Any], rank: int) -> dict[tuple[Any, ...], torch.Tensor]:
    """The blocks ``rank`` would receive, cut from the holders' snapshots as relay cuts them."""
    done = results[rank]
    out = {path: torch.full(region.shape, float("nan"), dtype=torch.float64)
           for path, region in world.wanted[rank].items()}
    for part in done.plan.parts:
        if part.receiver != rank:
            continue
        holder_plan = results[part.holder].plan
        assert part in holder_plan.parts, f"rank {part.holder} was not asked for {part}"
        source = world.snapshots[part.holder][(part.source, done.plan.step)]
        block = block_of(source.tensors[part.path], source.regions[part.path], part.offsets, part.shape)
        block_of(out[part.path], world.wanted[rank][part.path], part.offsets, part.shape).copy_(block)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_partner_ring_is_partner_maps_rank_by_rank(seed):
    rng = random.Random(seed)
    per_node = rng.choice([2, 4, 8])
    nodes = rng.randint(2, 9)
    ranks = list(range(nodes * per_node))
    if seed % 2:  # whole nodes in a shuffled order (the placements recoveries make)
        order = list(range(nodes))
        rng.shuffle(order)
        ranks = [n * per_node + i for n in order for i in range(per_node)]
    else:  # any order: some nodes split, or short
        rng.shuffle(ranks)
        ranks = ranks[: len(ranks) - rng.randint(0, per_node - 1)]
    layout = GridLayout((len(ranks),), ("dp",), rank_map=RankMap.of(ranks))
    routes = Routes(layout, layout, "dp", per_node)
    expected = partner_map(ranks, per_node)
    assert {r: routes.partner(r) for r in ranks} == expected
    for holder in ranks:
        assert sorted(routes.kept_by(holder)) == sorted(s for s, h in expected.items() if h == holder and s != holder)


CASES = [(kind, tp, dp, per_node, replica, state)
         for kind in ("replace", "shrink", "grow")
         for tp, dp, per_node in ((2, 4, 2), (2, 8, 4), (1, 6, 2), (4, 4, 4))
         for replica, state in (("dp", "fsdp"), ("dp", "replicated"), ("none", "fsdp"), ("none", "replicated"))
         if not (kind != "replace" and replica == "none")]


@pytest.mark.parametrize("kind,tp,dp,per_node,replica,state", CASES)
def test_whom_a_rank_asks_is_who_knows_it_will_be_asked(kind, tp, dp, per_node, replica, state):
    old, new = _placements(kind, tp, dp, per_node)
    routes = Routes(old, new, replica, per_node)
    asked = {r: set(routes.asks(r, routes.needs(r, _regions(new, r, replica, state)))) for r in new.ranks}
    told: dict[int, set[int]] = {}
    for keeper in new.ranks:
        kept = {s: _regions(old, s, replica, state) for s in routes.kept(keeper)}
        for receiver in routes.owed(keeper, kept):
            told.setdefault(receiver, set()).add(keeper)
    assert asked == {r: told.get(r, set()) for r in new.ranks}


@pytest.mark.parametrize("kind,tp,dp,per_node,replica,state",
                         [c for c in CASES if c[1:4] in ((2, 4, 2), (2, 8, 4), (1, 6, 2))])
def test_every_rank_rebuilds_its_new_blocks_from_the_old_ones(kind, tp, dp, per_node, replica, state):
    old, new = _placements(kind, tp, dp, per_node)
    world = _World(Routes(old, new, replica, per_node), replica, state)
    results = _restore_all(world)
    for rank in new.ranks:
        assert results[rank] is not None and results[rank].plan.step == 5
        got = _rebuilt(world, results, rank)
        for path, region in world.wanted[rank].items():
            assert torch.equal(got[path], _values(region)), (rank, path)
    assert {r.moved for r in results.values()} == {kind != "shrink" or state != "replicated"}


@pytest.mark.parametrize("copies", [True, False])
def test_hsdp_shards_come_from_the_lost_ranks_copy_or_else_the_next_replica(copies):
    """shard x dp (replicas) on nodes of 2: node 1 (a whole shard group, dp 1) replaced by a spare
    node; its shards come from the copies of its ranks, or without copies from the replicas at dp 2."""
    old, new = _placements("replace", 2, 4, 2, dims=("shard", "dp"))
    world = _World(Routes(old, new, "dp", 2 if copies else None), "dp", "hsdp")
    results = _restore_all(world)
    for rank in new.ranks:
        got = _rebuilt(world, results, rank)
        assert all(torch.equal(got[p], _values(r)) for p, r in world.wanted[rank].items())
    took = [(p.holder, p.source) for p in results[8].plan.parts if p.receiver == 8]
    assert set(took) == ({(4, 2)} if copies else {(4, 4)}), took


def test_a_step_one_rank_cannot_be_served_at_rolls_everyone_back_to_the_one_before():
    old, new = _placements("replace", 2, 4, 2)
    world = _World(Routes(old, new, "none", 2), "none", "fsdp")
    for (source, step) in list(world.snapshots[4]):
        if source == 2 and step == 5:
            del world.snapshots[4][(source, step)]  # the copy of step 5 never arrived
    results = _restore_all(world)
    assert {r.plan.step for r in results.values()} == {4}


def test_where_nobody_holds_a_lost_rank_every_rank_falls_back_to_the_reports_alike():
    old, new = _placements("replace", 2, 4, 2)
    world = _World(Routes(old, new, "none", 2), "none", "fsdp", lose_copy_of=(2, 3))
    assert set(_restore_all(world).values()) == {None}


def test_a_sharding_the_placement_does_not_tell_is_not_derived():
    old, new = _placements("replace", 2, 4, 2)
    routes = Routes(old, new, "dp", 2)
    strided = {("t",): Region((("tp", 0),), (8, 3), (0, 0), (2, 3), torch.float32, sharding=None)}
    with pytest.raises(NotDerivable, match="sharded in a way"):
        routes.needs(8, strided)


def test_what_a_rank_receives_to_plan_does_not_grow_with_the_world():
    sizes = {}
    for dp in (8, 64):
        old, new = _placements("replace", 2, dp, 2)
        world = _World(Routes(old, new, "none", 2), "none", "fsdp")
        results = _restore_all(world)
        sizes[dp] = max(r.traffic.bytes_in for r in results.values())
    assert sizes[64] == sizes[8], sizes


def test_an_own_part_names_every_block_it_takes_once():
    old, new = _placements("shrink", 2, 8, 4)
    routes = Routes(old, new, "dp", 4)
    for rank in new.ranks:
        needs = routes.needs(rank, _regions(new, rank, "dp", "fsdp"))
        keys = [(n.path, n.offsets) for n in needs]
        assert len(keys) == len(set(keys))
        for a, b in itertools.combinations(needs, 2):
            if a.path == b.path:
                assert a.offsets != b.offsets
    assert OwnPart  # the class the docs name


def test_a_dtensors_sharding_is_read_from_its_placements_and_checked_against_its_chunk():
    """On one rank of a fake world of 8 (tp 2 x dp 4, rank 5 at tp 1, dp 2): rows over dp and
    columns over tp are told by the placement; a strided shard is not."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hypergrid
    from hypergrid.training.regions import Placement, region_of

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        grid = hypergrid.HyperCommGrid([2, 4], ["tp", "dp"])
        mesh = hypergrid.device_mesh(grid, device_type="cpu")  # dims (dp, tp)
        place = Placement(grid.layout, 5, "dp")

        def region(placements):
            return region_of(distribute_tensor(torch.zeros(10, 6), mesh, placements), place)

        rows = region([Shard(0), Replicate()])
        assert rows.sharding == ((0, "dp"),) and (rows.offsets, rows.shape) == ((6, 0), (3, 6))
        both = region([Shard(0), Shard(1)])
        assert both.sharding == ((0, "dp"), (1, "tp")) and (both.offsets, both.shape) == ((6, 3), (3, 3))
        assert region([Replicate(), Replicate()]).sharding == ()
        assert region([Shard(0), Shard(0)]).sharding is None  # two mesh dims over one tensor dim
    finally:
        dist.destroy_process_group()


def test_the_restore_benchmark_plans_one_ranks_part_at_any_size_with_what_it_receives_flat(capsys):
    """benchmarks/bench_restore.py at 64 and 8,192 ranks (20 + 20 tensors a rank): every kind planned,
    and what the worst rank received grows by less than 3x (the figures are in docs/recovery.md)."""
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    try:
        import bench_restore
    finally:
        sys.path.pop(0)
    bench_restore.main(["--ranks", "64", "8192", "--tensors", "20", "--json"])
    rows = {(r["ranks"], r["kind"]): r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {(n, k) for n in (64, 8192) for k in ("replace", "shrink", "grow")}
    for kind in ("replace", "shrink", "grow"):
        small, large = rows[(64, kind)], rows[(8192, kind)]
        assert 0 < large["bytes_in"] < 3 * small["bytes_in"], (kind, small, large)
        assert large["peers"] <= 32, large


def test_a_survivor_whose_live_tensors_are_not_its_snapshots_makes_every_rank_fall_back_alike():
    """Its keepers would derive from the snapshot's tensors, it from its live ones: an exchange where
    one side waits for a word the other never sends. So nobody plans its own part."""
    old, new = _placements("replace", 2, 4, 2)
    world = _World(Routes(old, new, "none", 2), "none", "fsdp")
    world.wanted[5] = {**world.wanted[5], ("extra",): Region((("tp", 1), ("dp", 2)), (2,), (0,), (2,), torch.float64,
                                                            sharding=())}
    assert set(_restore_all(world).values()) == {None}
