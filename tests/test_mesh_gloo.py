"""The DeviceMesh adapter in real multi-process gloo jobs.

Each job batches many checks (a gloo job takes seconds to start) and returns plain values; the
tests assert on them. Every job runs once per module through a fixture.
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from hypergrid import device_mesh, grid_from_device_mesh, grid_from_process_groups
from tests.harness import run_gloo

#: Every test here starts multi-process gloo jobs (tests/README.md).
pytestmark = pytest.mark.gloo

# Slicing a flattened dim from the root (mesh["dp_cp"]) is what the issue asks for; torch warns
# that it plans to deprecate it.
warnings.filterwarnings("ignore", message="Slicing a flattened dim")

# mesh-order (slowest first) shapes and names, 1-D to 4-D, on 8 ranks.
PARITY_CASES = [
    ((8,), ("dp",)),
    ((2, 4), ("dp", "tp")),
    ((2, 2, 2), ("dp", "cp", "tp")),
    ((2, 1, 2, 2), ("pp", "dp", "cp", "tp")),
]


def _ranks(pg) -> list[int]:
    return list(dist.get_process_group_ranks(pg))


def _quiet() -> None:
    warnings.filterwarnings("ignore", message="Slicing a flattened dim")
    warnings.filterwarnings("ignore", category=FutureWarning)


# ----------------------------------------------------------------------------- jobs
def _parity_job(rank: int, world_size: int) -> list[dict]:
    """Grid meshes against init_device_mesh, 1-D to 4-D; process-group counts around device_mesh."""
    _quiet()
    from torch.distributed.device_mesh import init_device_mesh

    from hypergrid import HyperCommGrid
    from hypergrid.runtime.torch_compat import process_group_count

    out = []
    for shape, names in PARITY_CASES:
        grid = HyperCommGrid(list(reversed(shape)), list(reversed(names)))
        for name in names:
            grid.create_pg(name)
        flat_dims = names[:2] if len(names) >= 2 else None
        if flat_dims:
            grid.create_pg(list(flat_dims))
        before = process_group_count()
        mesh = device_mesh(grid, device_type="cpu")
        again = device_mesh(grid, device_type="cpu")
        after = process_group_count()
        ref = init_device_mesh("cpu", shape, mesh_dim_names=names)
        rec = {
            "shape": shape,
            "before": before,
            "after": after,
            "same_object_again": again is mesh,
            "equal_to_ref": mesh == ref,
            "mesh": mesh.mesh.tolist(),
            "ref_mesh": ref.mesh.tolist(),
            "names": mesh.mesh_dim_names,
            "coordinate": mesh.get_coordinate(),
            "ref_coordinate": ref.get_coordinate(),
            "local_ranks": [mesh.get_local_rank(n) for n in names],
            "ref_local_ranks": [ref.get_local_rank(n) for n in names],
            "members": [_ranks(mesh.get_group(n)) for n in names],
            "ref_members": [_ranks(ref.get_group(n)) for n in names],
            "grid_groups": [mesh.get_group(n) is grid.get_pg(n) for n in names]
            + [mesh.get_group(i) is grid.get_pg(n) for i, n in enumerate(names)],
        }
        if flat_dims:
            flat_name = "_".join(flat_dims)
            c0 = process_group_count()
            flat = mesh[flat_dims]._flatten()
            sliced_flat = mesh[flat_name]
            rec["flat_name"] = flat.mesh_dim_names
            rec["flat_is_grid"] = flat.get_group() is grid.get_pg(list(flat_dims))
            rec["flat_slice_is_grid"] = sliced_flat.get_group() is grid.get_pg(list(flat_dims))
            rec["flat_by_name_is_grid"] = mesh.get_group(flat_name) is grid.get_pg(list(flat_dims))
            rec["flat_created"] = process_group_count() - c0
            rec["flat_members"] = _ranks(flat.get_group())
            rec["ref_flat_members"] = _ranks(ref[flat_dims]._flatten().get_group())
            # A 2-D slice, out of the grid's first and last mesh dims.
            pair = (names[0], names[-1])
            sub, ref_sub = mesh[pair], ref[pair]
            by_dims = device_mesh(grid, [names[-1], names[0]], device_type="cpu")
            rec["slice"] = (sub.mesh.tolist(), sub.mesh_dim_names, sub.get_coordinate())
            rec["ref_slice"] = (ref_sub.mesh.tolist(), ref_sub.mesh_dim_names, ref_sub.get_coordinate())
            rec["by_dims"] = (by_dims.mesh.tolist(), by_dims.mesh_dim_names)
            rec["slice_groups"] = [sub.get_group(n) is grid.get_pg(n) for n in pair]
            rec["slice_local"] = [sub.get_local_rank(n) for n in pair]
            rec["ref_slice_local"] = [ref_sub.get_local_rank(n) for n in pair]
        out.append(rec)
    return out


def _dtensor_job(rank: int, world_size: int) -> dict:
    """DTensor on 3-D and 2-D grid meshes; functional collectives three ways."""
    _quiet()
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from hypergrid import HyperCommGrid
    from hypergrid.runtime.torch_compat import process_group_count

    grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    mesh = device_mesh(grid, device_type="cpu", flatten=[["cp", "dp"]])
    mesh2 = device_mesh(grid, ["tp", "dp"], device_type="cpu")
    count = process_group_count()
    x = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    out: dict = {}

    d = distribute_tensor(x, mesh, [Shard(0), Replicate(), Shard(1)])
    out["local_shape"] = tuple(d.to_local().shape)
    out["full_3d"] = torch.equal(d.full_tensor(), x)
    r = d.redistribute(mesh, [Replicate(), Shard(0), Replicate()])
    out["redistributed_shape"] = tuple(r.to_local().shape)
    out["redistributed_full"] = torch.equal(r.full_tensor(), x)
    partial = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Partial(), Partial(), Replicate()])
    out["partial_sum"] = partial.redistribute(mesh, [Replicate()] * 3).to_local().tolist()

    d2 = distribute_tensor(x, mesh2, [Shard(1), Shard(0)])
    out["local_shape_2d"] = tuple(d2.to_local().shape)
    out["full_2d"] = torch.equal(d2.full_tensor(), x)
    r2 = d2.redistribute(mesh2, [Replicate(), Shard(1)])
    out["redistributed_2d"] = torch.equal(r2.full_tensor(), x)

    t = torch.tensor([float(rank)])
    out["funcol_mesh_dim"] = funcol.all_reduce(t, "sum", (mesh, 2)).item()
    out["funcol_pg"] = funcol.all_reduce(t, "sum", grid.get_pg("dp")).item()
    out["funcol_ranks"] = funcol.all_reduce(t, "sum", grid.ranks("cp")).item()
    out["funcol_flat"] = funcol.all_reduce(t, "sum", mesh["dp_cp"]).item()
    out["created_by_use"] = process_group_count() - count
    out["expect"] = {
        "tp": float(sum(grid.ranks("tp"))),
        "dp": float(sum(grid.ranks("dp"))),
        "cp": float(sum(grid.ranks("cp"))),
        "dp_cp": float(sum(grid.ranks(["cp", "dp"]))),
        "partial": float(sum(grid.ranks(["cp", "dp"]))),
    }
    return out


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _fsdp_job(rank: int, world_size: int) -> dict:
    """FSDP2 on a 1-D dp mesh and HSDP on a 2-D mesh, against a single-process reference."""
    _quiet()
    from torch.distributed.fsdp import fully_shard

    from hypergrid import HyperCommGrid
    from hypergrid.runtime.torch_compat import process_group_count

    torch.manual_seed(1)
    x = torch.randn(2 * world_size, 8)
    y = torch.randn(2 * world_size, 4)
    reference = _tiny_model()
    _train_step(reference, x, y)  # the whole batch in one process
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    mine = slice(2 * rank, 2 * rank + 2)
    out: dict = {}
    grids = {
        "fsdp": HyperCommGrid([world_size], ["dp"]),
        "hsdp": HyperCommGrid([2, world_size // 2], ["dp_shard", "dp_replicate"]),
    }
    for label, grid in grids.items():
        for name in grid.dim_names:
            grid.create_pg(name)
        before = process_group_count()
        mesh = device_mesh(grid, device_type="cpu")
        out[f"{label}_created"] = process_group_count() - before
        out[f"{label}_names"] = mesh.mesh_dim_names
        model = copy.deepcopy(_tiny_model())
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train_step(model, x[mine], y[mine])
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        out[f"{label}_max_diff"] = max((full[n] - expected[n]).abs().max().item() for n in expected)
        out[f"{label}_moved"] = max(
            (full[n] - p.detach()).abs().max().item() for n, p in _tiny_model().named_parameters()
        )
    return out


def _views_and_adoption_job(rank: int, world_size: int) -> dict:
    """torchtitan-style dense and sparse meshes of one world; adopting existing groups."""
    _quiet()
    from torch.distributed.device_mesh import init_device_mesh

    from hypergrid import REGISTRY, HyperCommGrid
    from hypergrid.runtime.torch_compat import process_group_count

    out: dict = {}
    # Dense (pp, dp_replicate, dp_shard, cp, tp) = (1, 2, 2, 1, 2); sparse (pp, dp_replicate,
    # efsdp, ep) = (1, 2, 2, 2): ep runs over tp's ranks and efsdp over dp_shard's.
    grid = HyperCommGrid([2, 1, 2, 2, 1], ["tp", "cp", "dp_shard", "dp_replicate", "pp"])
    grid.register_view("sparse", [2, 2, 2, 1], ["ep", "efsdp", "dp_replicate", "pp"], shared_dims=["dp_replicate", "pp"])
    c0, r0 = process_group_count(), REGISTRY.count()
    dense = device_mesh(grid, device_type="cpu", flatten={"dp": ["dp_replicate", "dp_shard"], "dp_shard_cp": ["dp_shard", "cp"]})
    c1 = process_group_count()
    sparse = device_mesh(grid, view="sparse", device_type="cpu")
    c2 = process_group_count()
    out["dense_names"], out["sparse_names"] = dense.mesh_dim_names, sparse.mesh_dim_names
    out["dense_created"], out["sparse_created"] = c1 - c0, c2 - c1
    out["registry_made"] = REGISTRY.count() - r0
    out["shared"] = {
        "ep_is_tp": sparse.get_group("ep") is dense.get_group("tp"),
        "efsdp_is_dp_shard": sparse.get_group("efsdp") is dense.get_group("dp_shard"),
        "dp_replicate": sparse.get_group("dp_replicate") is dense.get_group("dp_replicate"),
        "pp": sparse.get_group("pp") is dense.get_group("pp"),
        "dp_flat": dense["dp"].get_group() is grid.get_pg(["dp_replicate", "dp_shard"]),
        "dp_shard_cp_is_dp_shard": dense["dp_shard_cp"].get_group() is dense.get_group("dp_shard"),
    }
    ref_dense = init_device_mesh("cpu", (1, 2, 2, 1, 2), mesh_dim_names=dense.mesh_dim_names)
    ref_sparse = init_device_mesh("cpu", (1, 2, 2, 2), mesh_dim_names=sparse.mesh_dim_names)
    out["dense_equal"], out["sparse_equal"] = dense == ref_dense, sparse == ref_sparse
    out["sparse_members_equal"] = all(
        _ranks(sparse.get_group(n)) == _ranks(ref_sparse.get_group(n)) for n in sparse.mesh_dim_names
    )

    # Adoption from a DeviceMesh torch made, flattened dim included.
    ref = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    ref_flat = ref["dp", "cp"]._flatten()
    a0 = process_group_count()
    adopted = grid_from_device_mesh(ref)
    view_of_adopted = device_mesh(adopted, device_type="cpu")
    a1 = process_group_count()
    out["adopted_created"] = a1 - a0
    out["adopted_grid"] = (adopted.dim_names, adopted.shape, adopted.rank_offset)
    out["adopted_groups"] = [adopted.get_pg(n) is ref.get_group(n) for n in ("dp", "cp", "tp")]
    out["adopted_flat"] = adopted.get_pg(["cp", "dp"]) is ref_flat.get_group()
    out["adopted_mesh_equal"] = view_of_adopted == ref
    out["adopted_mesh_groups"] = [view_of_adopted.get_group(n) is ref.get_group(n) for n in ("dp", "cp", "tp")]
    out["adopted_mesh_flat"] = view_of_adopted["dp_cp"].get_group() is ref_flat.get_group()
    # A later grid with the same members shares the adopted groups instead of creating its own.
    later = HyperCommGrid([2, 4], ["tp", "rest"])
    out["later_tp_is_adopted"] = later.create_pg("tp") is ref.get_group("tp")
    out["later_created"] = process_group_count() - a1
    later.destroy()
    adopted.destroy()
    # Not destroyed: the groups belong to the mesh's owner and still work.
    t = torch.ones(1)
    dist.all_reduce(t, group=ref.get_group("tp"))
    out["after_destroy_allreduce"] = t.item()

    # Adoption from process groups given slowest first, TorchComm style.
    # (cp, tp) of the 3-D mesh is a 2 x 2 block of consecutive ranks: a grid from rank 0 or 4.
    from_groups = grid_from_process_groups([ref.get_group("cp"), ref.get_group("tp")], ["cp", "tp"])
    out["from_groups"] = (from_groups.dim_names, from_groups.shape, from_groups.rank_offset)
    out["from_groups_same"] = [from_groups.get_pg("cp") is ref.get_group("cp"), from_groups.get_pg("tp") is ref.get_group("tp")]
    out["from_groups_mesh"] = device_mesh(from_groups, device_type="cpu").mesh.tolist()
    try:
        grid_from_process_groups([ref.get_group("tp"), ref.get_group("dp")], ["a", "b"])
        out["bad_order"] = "no error"
    except ValueError as exc:
        out["bad_order"] = str(exc)
    try:
        grid_from_device_mesh(ref["dp", "tp"])
        out["non_contiguous"] = "no error"
    except ValueError as exc:
        out["non_contiguous"] = str(exc)

    # A grid on the upper half of the world: its mesh, members and outsiders.
    upper = HyperCommGrid([2, 2], ["tp", "dp"], rank_offset=4)
    um = device_mesh(upper, device_type="cpu")
    out["upper"] = (um.mesh.tolist(), um.get_coordinate())
    if rank >= 4:
        s = torch.tensor([float(rank)])
        dist.all_reduce(s, group=um.get_group("tp"))
        out["upper_tp_sum"] = (s.item(), float(sum(upper.ranks("tp"))))
    return out


def _megatron_job(rank: int, world_size: int) -> Optional[dict]:
    """Megatron's parallel_state (from hypergrid's adapter) and the grid's DeviceMesh share groups."""
    _quiet()
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return None
    import torch.distributed._functional_collectives as funcol

    from hypergrid.megatron import active_grids, destroy_model_parallel, initialize_model_parallel
    from hypergrid.runtime.torch_compat import process_group_count

    initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    grids = active_grids()
    before = process_group_count()
    mesh = device_mesh(grids.grid, device_type="cpu")
    out = {
        "names": mesh.mesh_dim_names,
        "created": process_group_count() - before,
        "shared": {
            "tp": mesh.get_group("tp") is ps.get_tensor_model_parallel_group(),
            "pp": mesh.get_group("pp") is ps.get_pipeline_model_parallel_group(),
            "dp": mesh.get_group("dp") is ps.get_data_parallel_group(),
            "cp": mesh.get_group("cp") is ps.get_context_parallel_group(),
            "dp_cp": mesh["dp_cp"].get_group() is ps.get_data_parallel_group(with_context_parallel=True),
            "pp_tp": mesh["pp", "tp"]._flatten().get_group() is ps.get_model_parallel_group(),
        },
    }
    t = torch.tensor([float(rank)])
    out["tp_sum"] = (
        funcol.all_reduce(t, "sum", (mesh, mesh.mesh_dim_names.index("tp"))).item(),
        float(sum(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()))),
    )
    out["created_by_use"] = process_group_count() - before
    destroy_model_parallel()
    return out


def _all_checks_job(rank: int, world_size: int) -> dict:
    """Every check in one job: starting 8 processes costs more than all the checks together."""
    # Views first: it counts the groups a fresh registry makes for two meshes.
    return {
        "views": _views_and_adoption_job(rank, world_size),
        "parity": _parity_job(rank, world_size),
        "dtensor": _dtensor_job(rank, world_size),
        "fsdp": _fsdp_job(rank, world_size),
        "megatron": _megatron_job(rank, world_size),
    }


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def results() -> list[dict]:
    # A limit against hangs only; the machine may be shared, so it is generous.
    return run_gloo(_all_checks_job, 8, timeout=600)


@pytest.fixture(scope="module")
def parity(results) -> list[list[dict]]:
    return [r["parity"] for r in results]


@pytest.fixture(scope="module")
def dtensor(results) -> list[dict]:
    return [r["dtensor"] for r in results]


@pytest.fixture(scope="module")
def fsdp(results) -> list[dict]:
    return [r["fsdp"] for r in results]


@pytest.fixture(scope="module")
def megatron(results) -> list[dict]:
    if results[0]["megatron"] is None:
        pytest.skip("megatron-core is not installed")
    return [r["megatron"] for r in results]


@pytest.fixture(scope="module")
def views(results) -> list[dict]:
    return [r["views"] for r in results]


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", range(len(PARITY_CASES)))
def test_mesh_and_groups_equal_init_device_mesh(parity, case):
    for rank, per_rank in enumerate(parity):
        rec = per_rank[case]
        assert rec["equal_to_ref"], (rank, rec)
        assert rec["mesh"] == rec["ref_mesh"]
        assert rec["names"] == PARITY_CASES[case][1]
        assert rec["coordinate"] == rec["ref_coordinate"]
        assert rec["local_ranks"] == rec["ref_local_ranks"]
        assert rec["members"] == rec["ref_members"]
        assert all(rec["grid_groups"]), rec["grid_groups"]
        assert rec["same_object_again"]


@pytest.mark.parametrize("case", range(len(PARITY_CASES)))
def test_device_mesh_creates_no_process_group(parity, case):
    for per_rank in parity:
        rec = per_rank[case]
        assert rec["before"] == rec["after"], rec
        assert rec["before"] > 1  # the default group and the grid's own groups were counted


@pytest.mark.parametrize("case", [1, 2, 3])
def test_flattened_dims_and_slices_use_grid_groups(parity, case):
    for per_rank in parity:
        rec = per_rank[case]
        assert rec["flat_name"] == ("_".join(PARITY_CASES[case][1][:2]),)
        assert rec["flat_is_grid"] and rec["flat_slice_is_grid"] and rec["flat_by_name_is_grid"]
        assert rec["flat_created"] == 0
        assert rec["flat_members"] == rec["ref_flat_members"]
        assert rec["slice"] == rec["ref_slice"]
        assert rec["by_dims"] == rec["slice"][:2]
        assert all(rec["slice_groups"])
        assert rec["slice_local"] == rec["ref_slice_local"]


def test_dtensor_on_grid_meshes(dtensor):
    for rec in dtensor:
        assert rec["local_shape"] == (4, 4)
        assert rec["full_3d"] and rec["redistributed_full"]
        assert rec["redistributed_shape"] == (4, 8)
        assert rec["partial_sum"] == [rec["expect"]["partial"]] * 2
        assert rec["local_shape_2d"] == (4, 4)
        assert rec["full_2d"] and rec["redistributed_2d"]


def test_functional_collectives_three_ways(dtensor):
    for rec in dtensor:
        assert rec["funcol_mesh_dim"] == rec["expect"]["tp"]
        assert rec["funcol_pg"] == rec["expect"]["dp"]
        assert rec["funcol_ranks"] == rec["expect"]["cp"]
        assert rec["funcol_flat"] == rec["expect"]["dp_cp"]
        # Neither DTensor nor the collectives needed a group the grid did not already have.
        assert rec["created_by_use"] == 0


@pytest.mark.parametrize("label", ["fsdp", "hsdp"])
def test_fsdp2_step_matches_single_process(fsdp, label):
    names = {"fsdp": ("dp",), "hsdp": ("dp_replicate", "dp_shard")}[label]
    for rec in fsdp:
        assert rec[f"{label}_names"] == names
        assert rec[f"{label}_created"] == 0
        assert rec[f"{label}_moved"] > 1e-3  # the step changed the weights
        assert rec[f"{label}_max_diff"] < 1e-5, rec


def test_dense_and_sparse_views_share_groups(views):
    for rec in views:
        assert rec["dense_names"] == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert rec["sparse_names"] == ("pp", "dp_replicate", "efsdp", "ep")
        assert all(rec["shared"].values()), rec["shared"]
        assert rec["sparse_created"] == 0
        assert rec["dense_equal"] and rec["sparse_equal"] and rec["sparse_members_equal"]
        # Distinct member sets on a rank of this world: {r}, tp, dp_shard, dp_replicate, and
        # dp_replicate x dp_shard; nothing else was made for two meshes and two flattened dims.
        assert rec["dense_created"] == rec["registry_made"] == 5


def test_grid_adopts_a_device_mesh(views):
    for rec in views:
        assert rec["adopted_created"] == 0
        assert rec["adopted_grid"] == (["tp", "cp", "dp"], [2, 2, 2], 0)
        assert all(rec["adopted_groups"]) and rec["adopted_flat"]
        assert rec["adopted_mesh_equal"] and all(rec["adopted_mesh_groups"]) and rec["adopted_mesh_flat"]
        assert rec["later_tp_is_adopted"] and rec["later_created"] == 0
        assert rec["after_destroy_allreduce"] == 2.0


def test_grid_adopts_process_groups(views):
    for rank, rec in enumerate(views):
        start = 0 if rank < 4 else 4
        assert rec["from_groups"] == (["tp", "cp"], [2, 2], start)
        assert rec["from_groups_mesh"] == [[start, start + 1], [start + 2, start + 3]]
        assert all(rec["from_groups_same"])
        # Depending on the rank, the misplaced groups show as a bad first rank or bad members.
        assert ("holds ranks" in rec["bad_order"] and "needs" in rec["bad_order"]) or (
            "make no grid" in rec["bad_order"]
        ), rec["bad_order"]
        assert "consecutive ranks" in rec["non_contiguous"]


def test_grid_with_rank_offset(views):
    for rank, rec in enumerate(views):
        mesh, coordinate = rec["upper"]
        assert mesh == [[4, 5], [6, 7]]
        if rank < 4:
            assert coordinate is None
        else:
            assert coordinate == ((rank - 4) // 2, rank % 2)
            got, want = rec["upper_tp_sum"]
            assert got == want


def test_megatron_groups_and_device_mesh_share_communicators(megatron):
    for rec in megatron:
        assert rec["names"] == ("pp", "dp", "cp", "tp")
        assert all(rec["shared"].values()), rec["shared"]
        assert rec["created"] == 0 and rec["created_by_use"] == 0
        got, want = rec["tp_sum"]
        assert got == want
