"""torchtitan's own ``ParallelDims.build_mesh``, unmodified, on hypergrid's groups.

With ``hypergrid.route_device_meshes()`` on, the installed torchtitan's real mesh code (0.3.0's
world mesh unflattened into five overlapping meshes, or 0.2.0's mesh and flattened dims) runs on
the fake backend as one rank of the world. Every 1-D mesh must hold the members torchtitan's
own build gives that rank, each distinct set of members (per backend) must be one communicator,
and each communicator one torch call; torchtitan's own build is counted beside it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from hypergrid import REGISTRY, grid_of, route_device_meshes
from hypergrid.runtime.torch_compat import process_group_count
from tests.harness import fake_world
from tests.test_mesh_routing import torch_group_calls
from tests.torchtitan_code import TorchtitanUnavailable, build_meshes, load_parallel_dims

warnings.filterwarnings("ignore", message="Slicing a flattened dim")

#: (name, world, parallelism): a llama3 70B-like dense job and a MoE job.
CONFIGS = [
    ("llama3-70b-like", 64, {"tp": 8, "pp": 4}),
    ("moe", 64, {"tp": 2, "pp": 2, "cp": 2, "ep": 4}),
    ("hsdp", 32, {"tp": 2, "dp_replicate": 2, "cp": 2}),
]


@pytest.fixture(scope="module")
def titan():
    try:
        return load_parallel_dims()
    except TorchtitanUnavailable as exc:
        pytest.skip(str(exc))


@contextlib.contextmanager
def routed(on: bool) -> Iterator[None]:
    route_device_meshes(on)
    try:
        yield
    finally:
        route_device_meshes(False)


def build(titan, rank: int, world: int, parallelism: dict, *, route: bool) -> dict:
    version, module = titan
    with fake_world(rank, world), routed(route), torch_group_calls() as calls:
        before = process_group_count()
        meshes = build_meshes(module, version, world, **parallelism)
        result = {
            "members": {name: list(dist.get_process_group_ranks(m.get_group())) for name, m in meshes.items()},
            "backends": {name: m.get_group().name() for name, m in meshes.items()},
            "communicators": process_group_count() - before,
            "calls": dict(calls),
            "registry": REGISTRY.count(),
        }
        if route:
            grid = grid_of(next(iter(meshes.values())))
            assert grid is not None
            grid.destroy()
    return result


@pytest.mark.parametrize("name,world,parallelism", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("rank", [0, 21])
def test_torchtitans_meshes_on_hypergrid(titan, name, world, parallelism, rank):
    theirs = build(titan, rank, world, parallelism, route=False)
    ours = build(titan, rank, world, parallelism, route=True)
    assert ours["members"] == theirs["members"]
    # one communicator per distinct member set and backend; the world's own is the default group
    distinct = {(tuple(m), ours["backends"][n]) for n, m in ours["members"].items() if len(m) < world}
    assert ours["communicators"] == len(distinct) == ours["registry"]
    assert ours["calls"]["new_group"] == len(distinct) and ours["calls"]["split_group"] == 0
    assert theirs["communicators"] >= ours["communicators"]


def test_torchtitan_03_builds_duplicates_that_hypergrid_does_not(titan):
    version, _ = titan
    if not version.startswith("0.3"):
        pytest.skip(f"torchtitan {version}: only 0.3 unflattens the world mesh into overlapping meshes")
    theirs = build(titan, 5, 64, {"tp": 8, "pp": 4}, route=False)
    ours = build(titan, 5, 64, {"tp": 8, "pp": 4}, route=True)
    # pp is in four meshes, tp in three: torch makes each anew, hypergrid once.
    assert theirs["communicators"] > ours["communicators"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1 << 20])
def test_torchtitan_on_a_million_ranks_makes_only_this_ranks_groups(titan, world):
    rank = world // 2 + 3
    ours = build(titan, rank, world, {"tp": 8, "pp": 16, "dp_replicate": 4}, route=True)
    distinct = {(tuple(m), ours["backends"][n]) for n, m in ours["members"].items() if len(m) < world}
    assert ours["calls"]["new_group"] == len(distinct) == ours["communicators"]
    assert all(rank in m for m in ours["members"].values())
