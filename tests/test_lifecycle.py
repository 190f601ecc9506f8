"""Lifecycle: destroy is idempotent, a destroyed grid refuses use, and repeated init/destroy
cycles leave no process group, registry entry or memory behind.

Run with ``-s`` to see the counts and memory figures the cycle tests measure.
"""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from hypergrid import GridDestroyedError, HyperCommGrid
from hypergrid.runtime.registry import REGISTRY

from .harness import fake_world, run_gloo

#: The seven groups a Megatron-style job makes from one grid.
SEVEN = ["tp", "cp", "dp", "pp", ["cp", "dp"], ["tp", "pp"], ["tp", "cp", "dp"]]
SHAPE, NAMES = [2, 2, 4, 2], ["tp", "cp", "dp", "pp"]


def _torch_tables() -> dict[str, int]:
    """Sizes of torch's per-process group tables (0s when no default group exists)."""
    world = dist.distributed_c10d._world
    return {
        "pg_map": len(world.pg_map),
        "pg_names": len(world.pg_names),
        "pg_group_ranks": len(world.pg_group_ranks),
        "pg_backend_config": len(world.pg_backend_config),
        "tags_to_pg": sum(len(v) for v in world.tags_to_pg.values()),
        "tags_to_pg keys": len(world.tags_to_pg),
        "pg_to_tag": len(world.pg_to_tag),
    }


def _traced() -> int:
    """All traced memory but what this file's lines allocate (the samples a cycle test keeps)."""
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, __file__)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def _traced_at(pattern: str, all_frames: bool) -> int:
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, pattern, all_frames=all_frames)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def _traced_by_hypergrid() -> int:
    """Traced memory allocated at a line of hypergrid's own code (the innermost frame)."""
    return _traced_at("*/hypergrid/*", all_frames=False)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------- destroy semantics
def test_destroy_is_idempotent_and_releases_groups():
    with fake_world(rank=5, world_size=32):
        base_torch, base_registry = _torch_tables(), REGISTRY.count()
        grid = HyperCommGrid(SHAPE, NAMES)
        for dims in SEVEN:
            grid.create_pg(dims)
        assert REGISTRY.count() - base_registry == len(SEVEN)
        assert _torch_tables()["pg_map"] - base_torch["pg_map"] == len(SEVEN)
        grid.destroy()
        after_first = (_torch_tables(), REGISTRY.count())
        grid.destroy()
        grid.destroy()
        assert (_torch_tables(), REGISTRY.count()) == after_first == (base_torch, base_registry)


def test_destroyed_grid_refuses_group_use_but_still_answers_enumerations():
    with fake_world(rank=5, world_size=32):
        grid = HyperCommGrid(SHAPE, NAMES)
        grid.create_pg("dp")
        grid.register_view("expert", [4, 2, 4], ["ep", "x", "pp"])
        grid.destroy()
        calls = {
            "create_pg": lambda: grid.create_pg("tp"),
            "create_pg(existing)": lambda: grid.create_pg("dp"),
            "get_pg": lambda: grid.get_pg("dp"),
            "get_or_create_pg": lambda: grid.get_or_create_pg("tp"),
            "create_pg(view=)": lambda: grid.create_pg("ep", view="expert"),
            "register_view": lambda: grid.register_view("other", [32], ["all"]),
        }
        for name, call in calls.items():
            with pytest.raises(GridDestroyedError) as info:
                call()
            assert isinstance(info.value, RuntimeError), name
            assert "destroyed" in str(info.value) and "HyperCommGrid(" in str(info.value), name
        # Pure rank algebra needs no group and keeps working.
        assert grid.get_rank_enum("tp")[0] == [0, 1]
        assert grid.ranks("dp", rank=5) == [1, 5, 9, 13]
        assert grid.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}
        assert "destroyed" in repr(grid)


def test_group_of_a_destroyed_grid_is_unregistered_from_torch():
    # torch does not stop a collective on a ProcessGroup object after destroy_process_group(pg)
    # (over gloo it still runs; see docs/errors.md), but the group is gone from torch's tables,
    # so every torch helper that looks a group up refuses it.
    with fake_world(rank=5, world_size=32):
        grid = HyperCommGrid(SHAPE, NAMES)
        pg = grid.create_pg(["cp", "dp"])
        assert dist.get_process_group_ranks(pg) == [1, 3, 5, 7, 9, 11, 13, 15]
        grid.destroy()
        assert pg not in dist.distributed_c10d._world.pg_map
        with pytest.raises((ValueError, KeyError)):
            dist.get_process_group_ranks(pg)
        with pytest.raises(ValueError, match="not registered"):
            dist.get_rank(pg)


def test_destroy_keeps_groups_another_grid_still_holds():
    with fake_world(rank=5, world_size=32):
        a = HyperCommGrid(SHAPE, NAMES)
        b = HyperCommGrid([4, 4, 2], ["tp_cp", "dp", "pp"])  # tp_cp groups == a's ["tp", "cp"] groups
        shared = a.create_pg(["tp", "cp"])
        assert b.create_pg("tp_cp") is shared
        own = a.create_pg("dp")
        a.destroy()
        assert b.get_pg("tp_cp") is shared
        assert dist.get_process_group_ranks(shared) == [4, 5, 6, 7]
        assert own not in dist.distributed_c10d._world.pg_map
        b.destroy()
        assert shared not in dist.distributed_c10d._world.pg_map
        assert REGISTRY.count() == 0


# ----------------------------------------------------------------------------- many cycles
# A leak shows as memory that grows with every cycle; a warm-up (torch's first-use caches, lazy
# imports, interned strings, the fake backend's and gloo's own tables) grows for a while and
# levels off. So the cycle tests run WARM_UP cycles first, then sample the memory every few
# cycles and bound its growth per cycle: the least-squares slope through the samples, in bytes
# per cycle. No absolute budget: however much a warm-up takes, it is not counted.

#: Cycles run before measuring.
WARM_UP = 10


def _slope(samples: list[tuple[int, int]]) -> float:
    """Bytes gained per cycle: the least-squares slope through ``(cycle, bytes)`` samples."""
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in samples) / sum((x - mean_x) ** 2 for x, _ in samples)


def _sample_cycles(cycle, cycles: int, every: int, measures: dict) -> dict[str, list[tuple[int, int]]]:
    """Run ``cycle(i)`` WARM_UP times, then ``cycles`` times, sampling each of ``measures`` (after a
    garbage collection) before the first measured cycle and after every ``every``-th:
    ``{name: [(cycle, value), ...]}``."""
    for i in range(WARM_UP):
        cycle(i)
    samples: dict[str, list[tuple[int, int]]] = {name: [] for name in measures}
    for i in range(cycles + 1):
        if i % every == 0:
            gc.collect()
            for name, measure in measures.items():
                samples[name].append((i, measure()))
        if i < cycles:
            cycle(WARM_UP + i)
    return samples


#: What hypergrid's own lines may gain per cycle once warm, in bytes: less than one object (the
#: smallest, an int, takes 28). A leak of one small object per group would be hundreds per cycle
#: (7 groups each); every grid kept alive after destroy(), 1.4-2.1 kB (measured).
OWN_GROWTH_LIMIT = 16


def _world_cycle(i: int) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=i % 32, world_size=32)
    try:
        grid = HyperCommGrid(SHAPE, NAMES)
        for dims in SEVEN:
            grid.create_pg(dims, group_desc="cycle")
        assert REGISTRY.count() == len(SEVEN)
        grid.destroy()
    finally:
        dist.destroy_process_group()


def test_init_destroy_cycles_fake_backend_leave_nothing_behind():
    """init_process_group, a grid and its 7 groups, destroy all: 10 warm-up cycles, then 50.

    After every sampled cycle torch's tables and the registry are empty, and what hypergrid's
    own lines allocate does not grow from cycle to cycle. Memory torch allocates is printed, not
    bounded: torch's init_process_group keeps ~0.5 kB per call (it chains sys.excepthook),
    whoever calls it.
    """
    assert not dist.is_initialized()
    tracemalloc.start(1)  # the innermost frame: enough to tell hypergrid's own lines
    try:
        samples = _sample_cycles(_world_cycle, cycles=50, every=10, measures={
            "tables": _torch_tables, "registry": REGISTRY.count,
            "own": _traced_by_hypergrid, "total": _traced,
        })
    finally:
        tracemalloc.stop()
    own, total = _slope(samples["own"]), _slope(samples["total"])
    print(f"\n[fake, {WARM_UP} + 50 init/grid/7 groups/destroy cycles] allocated at hypergrid's lines "
          f"{samples['own'][0][1]} -> {samples['own'][-1][1]} bytes ({own:+.1f} per cycle); all traced memory "
          f"{samples['total'][0][1]} -> {samples['total'][-1][1]} bytes ({total:+.1f} per cycle)")
    empty = dict.fromkeys(_torch_tables(), 0)
    assert all(tables == empty for _, tables in samples["tables"]), samples["tables"]
    assert all(count == 0 for _, count in samples["registry"]), samples["registry"]
    assert own < OWN_GROWTH_LIMIT, samples["own"]


def test_grid_cycles_in_one_fake_world_leave_nothing_behind():
    """A grid, its 7 groups, a view and a view group, destroy; alternating strategies, one world:
    10 warm-up cycles, then 50. Torch's tables hold the default group only after every sampled
    cycle, the registry nothing, and hypergrid's own allocations do not grow. Torch's warm-up
    (its fake backend and Backend name lookups, some tens of kB over the first ~200 groups,
    whoever calls them) is printed, not bounded."""
    with fake_world(rank=13, world_size=32):
        def cycle(i: int) -> None:
            grid = HyperCommGrid(SHAPE, NAMES, strategy="enumerate" if i % 2 else "local")
            for dims in SEVEN:
                grid.create_pg(dims)
            grid.register_view("expert", [4, 4, 2], ["ep", "edp", "pp"], shared_dims=["pp"])
            grid.create_pg("ep", view="expert")
            grid.destroy()

        tracemalloc.start(1)
        try:
            samples = _sample_cycles(cycle, cycles=50, every=10, measures={
                "tables": _torch_tables, "registry": REGISTRY.count, "own": _traced_by_hypergrid, "total": _traced,
            })
        finally:
            tracemalloc.stop()
        own, total = _slope(samples["own"]), _slope(samples["total"])
        print(f"\n[fake, {WARM_UP} + 50 grid cycles in one world] allocated at hypergrid's lines "
              f"{samples['own'][0][1]} -> {samples['own'][-1][1]} bytes ({own:+.1f} per cycle); all traced memory, "
              f"torch's included, {samples['total'][0][1]} -> {samples['total'][-1][1]} bytes ({total:+.1f} per cycle)")
        first = samples["tables"][0][1]
        assert first["pg_map"] == 1  # the default group only
        assert all(tables == first for _, tables in samples["tables"]), samples["tables"]
        assert all(count == 0 for _, count in samples["registry"]), samples["registry"]
        assert not REGISTRY._entries and not REGISTRY._shared
        assert own < OWN_GROWTH_LIMIT, samples["own"]


#: What all traced memory of a gloo rank may gain per cycle once warm, torch's included, in
#: bytes. Measured here: 280-450 per cycle over cycles 10-30, falling as torch warms up (~150
#: after 50 cycles); with every grid kept alive after destroy(), ~1.9 kB per cycle.
GLOO_GROWTH_LIMIT = 1024


def _gloo_cycles(rank: int, world_size: int, cycles: int) -> dict:
    def cycle(i: int) -> None:
        grid = HyperCommGrid([2, 2], ["tp", "dp"])
        groups = [grid.create_pg(d) for d in ("tp", "dp", ["tp", "dp"])]
        # Use them, so that each communicator is really connected before it is destroyed.
        t = torch.ones(1)
        for pg in groups:
            dist.all_reduce(t, group=pg)
        grid.destroy()

    tracemalloc.start()
    try:
        samples = _sample_cycles(cycle, cycles=cycles, every=1, measures={
            "pg_map": lambda: _torch_tables()["pg_map"], "registry": REGISTRY.count, "traced": _traced, "rss": _rss,
        })
    finally:
        tracemalloc.stop()
    return samples


@pytest.mark.gloo
def test_grid_cycles_over_gloo_leave_nothing_behind():
    """A grid and 3 gloo groups, each used by an all_reduce, destroyed: 10 warm-up cycles, then 20.

    After every cycle torch holds the default group only and the registry nothing; all traced
    memory, torch's included, grows by less than GLOO_GROWTH_LIMIT per cycle once warm.
    """
    results = run_gloo(_gloo_cycles, 4, 20, timeout=240)
    for rank, samples in enumerate(results):
        traced, rss = samples["traced"], samples["rss"]
        growth = _slope(traced)
        print(f"\n[gloo rank {rank}, {WARM_UP} + 20 grid cycles of 3 groups] traced {traced[0][1]} -> {traced[-1][1]} bytes "
              f"({growth:+.0f} per cycle); RSS {rss[0][1] >> 10} -> {rss[-1][1] >> 10} KiB ({_slope(rss) / 1024:+.1f} KiB per cycle)")
        assert all(value == 1 for _, value in samples["pg_map"]), samples["pg_map"]
        assert all(value == 0 for _, value in samples["registry"]), samples["registry"]
        assert growth < GLOO_GROWTH_LIMIT, (rank, traced)
