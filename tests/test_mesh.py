"""The DeviceMesh adapter in one process: pure helpers, argument checks, the torch feature
detection, and one rank of a large world on torch's fake backend."""

from __future__ import annotations

import warnings

import pytest
import torch

from hypergrid import REGISTRY, GridDestroyedError, GridLayout, HyperCommGrid
from hypergrid.errors import UnsupportedTorchError
from hypergrid.mesh import device_mesh, flattened_name, grid_from_device_mesh, grid_from_process_groups, mesh_tensor
from hypergrid.runtime import mesh_compat as compat
from hypergrid.runtime.torch_compat import TESTED_TORCH, process_group_count
from tests.harness import fake_world

warnings.filterwarnings("ignore", message="Slicing a flattened dim")


# ----------------------------------------------------------------------------- pure helpers
def test_mesh_tensor_is_reversed_shape_of_consecutive_ranks():
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    assert torch.equal(mesh_tensor(layout), torch.arange(24, dtype=torch.int).reshape(4, 3, 2))
    shifted = GridLayout((2, 3, 4), ("tp", "cp", "dp"), rank_offset=24)
    assert torch.equal(mesh_tensor(shifted), torch.arange(24, 48, dtype=torch.int).reshape(4, 3, 2))


def test_flattened_name_follows_torch_flatten_convention():
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    assert flattened_name(layout, ["cp", "dp"]) == "dp_cp"
    assert flattened_name(layout, ["dp", "tp", "cp"]) == "dp_cp_tp"


# ----------------------------------------------------------------------------- torch internals
def test_installed_torch_has_every_internal_used():
    """On every torch the project is tested on (2.13.0 and 2.15.0 in CI), each internal is present."""
    assert compat._detect() == ()
    compat.require_mesh_support()


def test_missing_internal_is_named_with_the_torch_version(monkeypatch):
    monkeypatch.setattr(compat, "_detect", lambda: ("DeviceMesh.from_group", "_MeshLayout.collapse"))
    with pytest.raises(UnsupportedTorchError) as info:
        compat.require_mesh_support()
    message = str(info.value)
    assert torch.__version__ in message and TESTED_TORCH in message
    assert "DeviceMesh.from_group" in message and "_MeshLayout.collapse" in message
    assert isinstance(info.value, RuntimeError)
    grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=4)
    with pytest.raises(UnsupportedTorchError):
        device_mesh(grid, device_type="cpu")


# ----------------------------------------------------------------------------- one rank of 64
def test_device_mesh_creates_missing_groups_through_the_registry():
    with fake_world(rank=21, world_size=64):
        grid = HyperCommGrid([4, 4, 4], ["tp", "cp", "dp"])
        before_pgs, before_registry = process_group_count(), REGISTRY.count()
        mesh = device_mesh(grid, device_type="cpu")
        assert process_group_count() - before_pgs == 3
        assert REGISTRY.count() - before_registry == 3
        assert mesh.mesh_dim_names == ("dp", "cp", "tp")
        assert torch.equal(mesh.mesh, torch.arange(64, dtype=torch.int).reshape(4, 4, 4))
        # rank 21 = tp 1 + 4 * (cp 1) + 16 * (dp 1)
        assert mesh.get_coordinate() == (1, 1, 1)
        assert [mesh.get_group(n) is grid.get_pg(n) for n in ("dp", "cp", "tp")] == [True] * 3
        assert device_mesh(grid, device_type="cpu") is mesh
        assert process_group_count() - before_pgs == 3


def test_flatten_argument_creates_and_names_flattened_dims():
    with fake_world(rank=5, world_size=16):
        grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
        mesh = device_mesh(grid, device_type="cpu", flatten=[["dp", "cp"]])
        dp_cp = grid.get_pg(["cp", "dp"])
        assert mesh["dp_cp"].get_group() is dp_cp
        count = process_group_count()
        assert mesh["dp", "cp"]._flatten().get_group() is dp_cp
        assert mesh.get_group("dp_cp") is dp_cp
        assert process_group_count() == count
        # A custom name for another combination; the default name is registered as well.
        device_mesh(grid, device_type="cpu", flatten={"model": ["tp", "cp"]})
        assert mesh["model"].get_group() is grid.get_pg(["tp", "cp"])
        assert mesh["cp", "tp"]._flatten().get_group() is grid.get_pg(["tp", "cp"])
        assert sorted(compat.flattened_meshes(mesh)) == ["cp_tp", "dp_cp", "model"]


def test_subset_of_dims_is_a_slice_in_mesh_order():
    with fake_world(rank=6, world_size=8):
        grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
        sub = device_mesh(grid, ["tp", "dp"], device_type="cpu")
        assert sub.mesh_dim_names == ("dp", "tp")
        assert sub.mesh.tolist() == [[2, 3], [6, 7]]
        assert compat.root_mesh(sub) is device_mesh(grid, device_type="cpu")
        assert device_mesh(grid, ["dp", "cp", "tp"], device_type="cpu") is compat.root_mesh(sub)


def test_rank_outside_an_offset_grid_gets_a_mesh_without_groups():
    with fake_world(rank=2, world_size=16):
        grid = HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=8)
        mesh = device_mesh(grid, device_type="cpu")
        assert mesh.mesh.tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
        assert mesh.get_coordinate() is None
    with fake_world(rank=11, world_size=16):
        grid = HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=8)
        mesh = device_mesh(grid, device_type="cpu")
        assert mesh.get_coordinate() == (1, 1)
        assert mesh.get_group("dp") is grid.get_pg("dp")


def test_views_are_meshes_of_their_own_sharing_groups():
    with fake_world(rank=3, world_size=8):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp_shard", "dp_replicate"])
        grid.register_view("moe", [2, 2, 2], ["ep", "efsdp", "dp_replicate"], shared_dims=["dp_replicate"])
        dense = device_mesh(grid, device_type="cpu")
        count = process_group_count()
        sparse = device_mesh(grid, view="moe", device_type="cpu")
        assert sparse.mesh_dim_names == ("dp_replicate", "efsdp", "ep")
        assert process_group_count() == count
        assert sparse.get_group("ep") is dense.get_group("tp")
        assert sparse is not dense and compat.root_mesh(sparse) is sparse


def test_adopting_a_torch_mesh_on_one_rank():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(rank=6, world_size=8):
        ref = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        count = process_group_count()
        grid = grid_from_device_mesh(ref)
        assert (grid.dim_names, grid.shape, grid.rank_offset) == (["tp", "dp"], [4, 2], 0)
        assert grid.get_pg("tp") is ref.get_group("tp") and grid.get_pg("dp") is ref.get_group("dp")
        assert device_mesh(grid, device_type="cpu") == ref
        assert process_group_count() == count
        grid.destroy()
        assert process_group_count() == count  # adopted groups are not destroyed


# ----------------------------------------------------------------------------- bad arguments
def test_bad_arguments_name_the_value():
    with fake_world(rank=0, world_size=8):
        grid = HyperCommGrid([2, 4], ["tp", "dp"])
        with pytest.raises(ValueError, match="'cuda:0'"):
            device_mesh(grid, device_type="cuda:0")
        with pytest.raises(TypeError, match="device_type"):
            device_mesh(grid, device_type=3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="at least two dims"):
            device_mesh(grid, device_type="cpu", flatten=[["dp"]])
        with pytest.raises(ValueError, match="'tp'"):
            device_mesh(grid, device_type="cpu", flatten={"tp": ["tp", "dp"]})
        with pytest.raises(TypeError, match="flatten"):
            device_mesh(grid, device_type="cpu", flatten="dp")  # type: ignore[arg-type]
        with pytest.raises(KeyError, match="nope"):
            device_mesh(grid, view="nope", device_type="cpu")
        with pytest.raises(ValueError, match="'pp'"):
            device_mesh(grid, ["pp"], device_type="cpu")
        with pytest.raises(KeyError):
            grid.get_pg("dp")  # nothing was created by the refused calls
        device_mesh(grid, device_type="cpu")
        with pytest.raises(TypeError, match="DeviceMesh"):
            grid_from_device_mesh(grid)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ProcessGroup"):
            grid_from_process_groups([None], ["dp"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="one group per dim name"):
            grid_from_process_groups([grid.get_pg("dp")], ["dp", "tp"])
        grid.destroy()
        with pytest.raises(GridDestroyedError):
            device_mesh(grid, device_type="cpu")
