"""Meshes and FSDP2 modules carried over a recovery in place, one rank on torch's fake backend.

Each test is one survivor of a job whose node (a whole replica) is lost: the recovery is run with
``failed=`` (every rank knows the loss alike), so no other process is needed. The multi-process
job, trained through a SIGKILL, is tests/test_mesh_refresh_gloo.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import hypergrid
from hypergrid.mesh import MeshRefreshError, MeshShapeChangedError, grid_of, refresh_fully_shard, refresh_meshes
from hypergrid.runtime import mesh_compat
from tests.harness import fake_world

warnings.filterwarnings("ignore", message="Slicing a flattened dim")

SETTINGS = dict(gpus_per_node=2, replica_dim="dp_replicate")


def _job(grid: hypergrid.HyperCommGrid, spares: list[int], gpus_per_node: int = 2) -> hypergrid.ResilientJob:
    settings = hypergrid.RecoverySettings(gpus_per_node=gpus_per_node, replica_dim="dp_replicate")
    return hypergrid.ResilientJob.of_grid(grid, spares=spares, settings=settings)


def test_a_replace_rewrites_the_root_its_slices_and_its_flattened_dim_in_place():
    with fake_world(rank=1, world_size=6):
        grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
        mesh = hypergrid.device_mesh(grid, device_type="cpu", flatten=[["dp_shard", "dp_replicate"]])
        replicate, shard, flat = mesh["dp_replicate"], mesh["dp_shard"], mesh["dp_replicate_dp_shard"]
        again = mesh["dp_replicate"]  # an equal slice, another object: both must be found
        shard_pg = grid.get_pg("dp_shard")
        coordinate = mesh.get_coordinate()
        job = _job(grid, [4, 5])
        after = job.recover(failed=[2, 3])
        new = after.state

        refreshed = refresh_meshes(grid, new)

        assert refreshed[0] is mesh and {id(m) for m in (replicate, shard, flat, again)} <= {id(m) for m in refreshed}
        assert mesh.mesh.tolist() == [[0, 1], [4, 5]] and mesh.get_coordinate() == coordinate == (0, 1)
        for sliced in (replicate, again):
            assert sliced.mesh.tolist() == [1, 5] and sliced.get_group() is new.get_pg("dp_replicate")
        assert shard.get_group() is shard_pg is new.get_pg("dp_shard")  # unchanged: the same object
        assert flat.mesh.tolist() == [0, 1, 4, 5] and flat.get_group() is new.get_pg(["dp_shard", "dp_replicate"])
        assert mesh.get_group("dp_replicate") is new.get_pg("dp_replicate")
        assert dist.get_process_group_ranks(mesh.get_group("dp_replicate")) == [1, 5]
        # The meshes are the new grid's now.
        assert hypergrid.device_mesh(new, device_type="cpu") is mesh and grid_of(mesh) is new
        assert hypergrid.device_mesh(new, ["dp_replicate"], device_type="cpu").get_group() is new.get_pg("dp_replicate")
        assert mesh["dp_replicate", "dp_shard"]._flatten().get_group() is new.get_pg(["dp_shard", "dp_replicate"])
        # Hash and equality follow the new ranks, as a mesh torch builds over them.
        from torch.distributed.device_mesh import DeviceMesh

        built = DeviceMesh.from_group([new.get_pg("dp_replicate"), new.get_pg("dp_shard")], "cpu",
                                      torch.tensor([[0, 1], [4, 5]]), mesh_dim_names=("dp_replicate", "dp_shard"))
        assert mesh == built and hash(mesh) == hash(built)
        # A slice made after the refresh has the new ranks too.
        assert mesh["dp_replicate"].mesh.tolist() == [1, 5]
        after.destroy()


def test_a_grid_without_meshes_has_nothing_to_refresh():
    with fake_world(rank=0, world_size=6):
        grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
        grid.create_pg("dp_shard")
        after = _job(grid, [4, 5]).recover(failed=[2, 3])
        assert refresh_meshes(grid, after.state) == []
        with pytest.raises(TypeError, match="new_grid must be a HyperCommGrid"):
            refresh_meshes(grid, "grid")  # type: ignore[arg-type]
        after.destroy()


def test_a_shrink_changes_the_shape_and_is_refused_naming_both_shapes():
    with fake_world(rank=0, world_size=4):
        grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
        mesh = hypergrid.device_mesh(grid, device_type="cpu")
        after = _job(grid, []).recover(failed=[2, 3])
        assert after.last.kind.value == "shrink"
        with pytest.raises(MeshShapeChangedError, match=r"'dp_replicate': 2\}.* to \{'dp_shard': 2, 'dp_replicate': 1\}"):
            refresh_meshes(grid, after.state)
        assert mesh.mesh.tolist() == [[0, 1], [2, 3]]  # nothing changed
        after.destroy()


def test_a_mesh_built_after_the_job_has_no_group_in_the_new_grid_and_is_refused():
    with fake_world(rank=0, world_size=6):
        grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
        job = _job(grid, [4, 5])
        mesh = hypergrid.device_mesh(grid, device_type="cpu")  # its groups are not in the job's recipe
        after = job.recover(failed=[2, 3])
        with pytest.raises(MeshRefreshError, match="before making the job"):
            refresh_meshes(grid, after.state)
        assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
        after.destroy()


def test_every_derived_mesh_joins_its_roots_family():
    with fake_world(rank=0, world_size=4):
        grid = hypergrid.HyperCommGrid([2, 2], ["tp", "dp"])
        mesh = hypergrid.device_mesh(grid, device_type="cpu")
        derived = [mesh["dp"], mesh["tp"], mesh["dp", "tp"]._flatten("all")]
        family = mesh_compat.mesh_family(mesh)
        assert family[0] is mesh and all(any(m is d for m in family) for d in derived)
        grid.destroy()


# ----------------------------------------------------------------------------- FSDP2
def _hsdp_model(mesh, **kwargs):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fully_shard(model[0], mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def test_fully_shard_modules_take_the_new_groups_without_being_wrapped_again():
    from torch.distributed.fsdp import fully_shard

    with fake_world(rank=1, world_size=6):
        grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
        mesh = hypergrid.device_mesh(grid, device_type="cpu")
        model = _hsdp_model(mesh)
        shard_pg = grid.get_pg("dp_shard")
        after = _job(grid, [4, 5]).recover(failed=[2, 3])
        new = after.state
        refresh_meshes(grid, new)

        assert {id(m) for m in refresh_fully_shard(model)} == {id(model), id(model[0])}
        refresh_fully_shard(model)  # again: nothing more to swap
        for sub in (model, model[0]):
            for group in fully_shard.state(sub)._fsdp_param_groups:
                for info in {id(i): i for i in [group.mesh_info, group.post_forward_mesh_info,
                                                *(p.mesh_info for p in group.fsdp_params)]}.values():
                    assert info.mesh is mesh
                    assert info.replicate_process_group is new.get_pg("dp_replicate")
                    assert info.shard_process_group is shard_pg
                    assert (info.replicate_mesh_rank, info.shard_mesh_rank) == (0, 1)
                    assert (info.replicate_mesh_size, info.shard_mesh_size) == (2, 2)
        for param in model.parameters():
            assert param.device_mesh is mesh
            assert dist.get_process_group_ranks(param.device_mesh.get_group("dp_replicate")) == [1, 5]
        after.destroy()


def test_fully_shard_before_the_meshes_are_refreshed_is_refused():
    with fake_world(rank=1, world_size=6):
        grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
        model = _hsdp_model(hypergrid.device_mesh(grid, device_type="cpu"))
        after = _job(grid, [4, 5]).recover(failed=[2, 3])
        with pytest.raises(MeshRefreshError, match="refresh_meshes"):
            refresh_fully_shard(model)
        after.destroy()


def test_a_post_forward_mesh_of_torchs_own_cannot_be_swapped_and_is_refused():
    # reshard_after_forward=2 on a shard dim of 4: torch builds a mesh of its own, with its own groups.
    from torch.distributed.fsdp import fully_shard

    with fake_world(rank=1, world_size=12):
        grid = hypergrid.HyperCommGrid([4, 2], ["dp_shard", "dp_replicate"])
        mesh = hypergrid.device_mesh(grid, device_type="cpu")
        model = _hsdp_model(mesh, reshard_after_forward=2)
        after = _job(grid, [8, 9, 10, 11], gpus_per_node=4).recover(failed=[4, 5, 6, 7])
        refresh_meshes(grid, after.state)
        info = fully_shard.state(model)._fsdp_param_groups[0].mesh_info
        before = info.replicate_process_group
        with pytest.raises(MeshRefreshError, match="reshard_after_forward"):
            refresh_fully_shard(model)
        assert info.replicate_process_group is before  # nothing changed
        after.destroy()
