"""torch's own DeviceMesh operations on hypergrid's meshes make their groups through the grid's door.

One rank of a fake world at a time. On a mesh from ``device_mesh(grid)``, and on every root torch
builds while ``route_device_meshes()`` is on, torch's ``_flatten`` (named or not), ``_unflatten``
and the meshes derived from those must: make no process group outside hypergrid's registry; give
every rank exactly the members torch's own implementation gives it (checked against plain torch
on the same world); hand the same group object to every request for the same ranks and options
(``grid.create_pg`` of the same dims after a flatten included); and make at most one torch call
per new group, none at all for a group that exists.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.device_mesh as torch_mesh

from hypergrid import REGISTRY, HyperCommGrid, device_mesh, grid_of, route_device_meshes
from hypergrid.runtime.torch_compat import process_group_count
from tests.harness import fake_world

warnings.filterwarnings("ignore", message="Slicing a flattened dim")


@contextlib.contextmanager
def torch_group_calls() -> Iterator[dict[str, int]]:
    """Count torch's group constructors, wherever they are called from (hypergrid's registry
    calls them through ``torch.distributed``, DeviceMesh through its own module's names)."""
    counts = {"new_group": 0, "split_group": 0, "new_subgroups_by_enumeration": 0}
    modules = [dist, dist.distributed_c10d, torch_mesh]
    saved = []
    for module in modules:
        for name in counts:
            original = getattr(module, name, None)
            if original is None or getattr(original, "_counted", False):
                continue

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                counts[_name] += 1
                return _original(*args, **kwargs)

            counted._counted = True  # type: ignore[attr-defined]
            saved.append((module, name, original))
            setattr(module, name, counted)
    try:
        yield counts
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@pytest.fixture(autouse=True)
def _routing_off_after() -> Iterator[None]:
    yield
    route_device_meshes(False)


def members(pg) -> list[int]:
    return list(dist.get_process_group_ranks(pg))


def torch_reference(rank: int, world: int, build) -> dict[str, list[int]]:
    """What plain torch gives ``rank`` for every 1-D mesh ``build`` returns, by name."""
    with fake_world(rank, world):
        return {name: members(mesh.get_group()) for name, mesh in build().items()}


# ---------------------------------------------------------------------------- flatten
@pytest.mark.parametrize("rank", [0, 5, 10, 15])
def test_torch_flatten_on_a_grid_mesh_is_the_grids_group(rank):
    with fake_world(rank, 16):
        grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
        mesh = device_mesh(grid, device_type="cpu")
        groups, pgs = REGISTRY.count(), process_group_count()
        with torch_group_calls() as calls:
            dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
            cp_tp = mesh["cp", "tp"]._flatten()  # unnamed: torch names it "cp_tp"
            again = mesh["dp", "cp"]._flatten("dp_cp")
        assert calls == {"new_group": 2, "split_group": 0, "new_subgroups_by_enumeration": 0}
        assert REGISTRY.count() - groups == 2 == process_group_count() - pgs
        assert again is dp_cp and mesh["cp_tp"] == cp_tp and mesh["cp_tp"].get_group() is cp_tp.get_group()
        with torch_group_calls() as calls:
            assert grid.create_pg(["cp", "dp"]) is dp_cp.get_group()
            assert grid.create_pg(["tp", "cp"]) is cp_tp.get_group()
        assert sum(calls.values()) == 0 and process_group_count() - pgs == 2
        assert members(dp_cp.get_group()) == grid.ranks(["cp", "dp"], rank)
        assert dp_cp.get_coordinate() == (grid.ranks(["cp", "dp"], rank).index(rank),)
        grid.destroy()


def test_flattening_dims_a_grid_has_made_creates_nothing():
    with fake_world(6, 16):
        grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
        made = grid.create_pg(["cp", "dp"])
        mesh = device_mesh(grid, device_type="cpu")
        pgs = process_group_count()
        with torch_group_calls() as calls:
            assert mesh["dp", "cp"]._flatten().get_group() is made
        assert sum(calls.values()) == 0 and process_group_count() == pgs
        grid.destroy()


# ---------------------------------------------------------------------------- unflatten
def _unflatten_build(mesh: Any) -> dict[str, Any]:
    """torchtitan-style: split dp into (dp_replicate, dp_shard), then flatten shard with cp."""
    dense = mesh._unflatten("dp", (2, 2), ("dp_replicate", "dp_shard"))
    out = {name: dense[name] for name in dense.mesh_dim_names}
    out["fsdp"] = dense["dp_shard", "cp"]._flatten("fsdp")
    out["all"] = dense._flatten("all")
    return out


@pytest.mark.parametrize("rank", [0, 3, 9, 14])
def test_unflatten_and_derived_meshes_give_torchs_members(rank):
    def plain():
        return _unflatten_build(torch_mesh.init_device_mesh("cpu", (4, 2, 2), mesh_dim_names=("dp", "cp", "tp")))

    expected = torch_reference(rank, 16, plain)
    with fake_world(rank, 16):
        grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
        mesh = device_mesh(grid, device_type="cpu")
        pgs = process_group_count()
        with torch_group_calls() as calls:
            got = {name: members(m.get_group()) for name, m in _unflatten_build(mesh).items()}
        assert got == expected
        # New groups: dp_replicate, dp_shard, fsdp (cp and tp are the grid's; "all" is the world).
        assert calls["new_group"] == 3 == process_group_count() - pgs
        assert calls["split_group"] == calls["new_subgroups_by_enumeration"] == 0
        grid.destroy()


def test_a_rank_outside_a_partial_grid_gets_no_group_from_torchs_operations():
    with fake_world(2, 16):
        grid = HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=8)
        mesh = device_mesh(grid, device_type="cpu")
        pgs = process_group_count()
        flat = mesh._flatten("all")
        split = mesh._unflatten("dp", (2, 2), ("a", "b"))
        assert flat.get_coordinate() is None and split.get_coordinate() is None
        assert flat._dim_group_names == [] and process_group_count() == pgs
        grid.destroy()


# ---------------------------------------------------------------------------- torch's own roots
def _titan_like(world: int) -> dict[str, Any]:
    """torchtitan 0.3's way: unflatten a 1-D world mesh into overlapping meshes."""
    root = torch_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    loading = root._unflatten(0, (2, world // 8, 2, 2), ("pp", "batch", "cp", "tp"))
    dense = root._unflatten(0, (2, 2, world // 16, 2, 2), ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    spmd = root._unflatten(0, (2, world // 8, 2, 2), ("pp", "dp", "cp", "tp"))
    sparse = root._unflatten(0, (2, 2, world // 8, 2), ("pp", "dp_replicate", "efsdp", "ep"))
    out = {f"loading.{n}": loading[n] for n in loading.mesh_dim_names}
    out.update({f"dense.{n}": dense[n] for n in dense.mesh_dim_names})
    out.update({f"spmd.{n}": spmd[n] for n in spmd.mesh_dim_names})
    out.update({f"sparse.{n}": sparse[n] for n in sparse.mesh_dim_names})
    out["loss"] = loading["batch", "cp"]._flatten("loss_mesh")
    return out


@pytest.mark.parametrize("rank", [0, 21, 63])
def test_routed_torch_meshes_make_each_distinct_group_once(rank):
    expected = torch_reference(rank, 64, lambda: _titan_like(64))
    with fake_world(rank, 64):
        before = process_group_count()
        with torch_group_calls() as plain_calls:
            _titan_like(64)
        torch_made = process_group_count() - before
    with fake_world(rank, 64):
        route_device_meshes()
        before = process_group_count()
        with torch_group_calls() as calls:
            meshes = _titan_like(64)
        got = {name: members(mesh.get_group()) for name, mesh in meshes.items()}
        made = process_group_count() - before
        distinct = {tuple(m) for m in got.values() if len(m) < 64}
        assert got == expected
        assert made == len(distinct) == calls["new_group"] == REGISTRY.count()
        assert grid_of(meshes["dense.pp"]) is grid_of(meshes["loss"]) is not None
        grid_of(meshes["loss"]).destroy()
    # torch makes pp four times, tp three times, ...; and loops over every group of every dim.
    assert torch_made > made and plain_calls["new_group"] > 8 * calls["new_group"]


def test_routing_leaves_meshes_over_other_rank_orders_to_torch():
    with fake_world(1, 8):
        route_device_meshes()
        permuted = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]])
        before = REGISTRY.count()
        mesh = torch_mesh.DeviceMesh("cpu", permuted, mesh_dim_names=("dp", "tp"))
        assert REGISTRY.count() == before and grid_of(mesh) is None
        assert members(mesh.get_group("tp")) == [1, 3, 5, 7]


def test_routing_off_leaves_torch_as_it_was():
    with fake_world(0, 8):
        before = REGISTRY.count()
        mesh = torch_mesh.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        assert REGISTRY.count() == before and grid_of(mesh) is None


def test_route_device_meshes_checks_its_arguments():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        route_device_meshes("yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy must be one of"):
        route_device_meshes(strategy="fast")
    with pytest.raises(TypeError, match="timeout"):
        route_device_meshes(timeout=5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- at scale
@pytest.mark.slow
@pytest.mark.parametrize("world", [65536, 1 << 20])
def test_one_rank_of_a_huge_world_makes_only_its_own_groups(world):
    """torchtitan 0.3's meshes, routed: one torch call per group this rank is in, nothing else."""
    rank = world // 2 + 3
    with fake_world(rank, world):
        route_device_meshes()
        with torch_group_calls() as calls:
            meshes = _titan_like(world)
        got = {name: members(mesh.get_group()) for name, mesh in meshes.items()}
        distinct = {tuple(m) for m in got.values() if len(m) < world}
        assert calls == {"new_group": len(distinct), "split_group": 0, "new_subgroups_by_enumeration": 0}
        assert all(rank in m for m in got.values())
        grid_of(meshes["loss"]).destroy()
