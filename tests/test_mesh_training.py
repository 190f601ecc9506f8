"""Training on hypergrid's DeviceMesh is bit for bit training on torch's.

A 4-rank gloo job trains a small MLP for 5 steps with tensor parallelism on ``mesh["tp"]``
(column-wise then row-wise linear layers) and FSDP2 on ``mesh["dp"]``, twice: on the mesh
``init_device_mesh`` makes, and on ``hypergrid.device_mesh(grid)``. The same seed, data and
optimizer; every step's loss and every final parameter (gathered whole) must be equal to the
bit on every rank, and the two runs must have communicated over the same ranks. Once more with
``route_device_meshes()`` on, where ``init_device_mesh`` itself gets hypergrid's groups.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_gloo

pytestmark = pytest.mark.gloo

STEPS = 5
WORLD = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _train(mesh, rank: int) -> dict:
    """TP over mesh["tp"], FSDP2 over mesh["dp"], STEPS steps; losses and full parameters."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    dp_rank = mesh.get_local_rank("dp")
    generator = torch.Generator().manual_seed(100 + dp_rank)  # each dp rank its own batch
    x = torch.randn(4, 8, generator=generator)
    y = torch.randn(4, 8, generator=generator)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    params = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    groups = {name: list(dist.get_process_group_ranks(mesh.get_group(name))) for name in mesh.mesh_dim_names}
    return {"losses": torch.stack(losses), "params": params, "groups": groups}


def _job(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    from hypergrid import HyperCommGrid, device_mesh, grid_of, route_device_meshes

    torch_run = _train(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), rank)
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    grid_run = _train(device_mesh(grid, device_type="cpu"), rank)
    route_device_meshes()
    routed_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    routed_run = _train(routed_mesh, rank)
    route_device_meshes(False)
    served = grid_of(routed_mesh) is not None
    out = {}
    for label, run in (("grid", grid_run), ("routed", routed_run)):
        out[label] = {
            "losses_equal": torch.equal(run["losses"], torch_run["losses"]),
            "params_equal": all(torch.equal(run["params"][n], p) for n, p in torch_run["params"].items()),
            "groups_equal": run["groups"] == torch_run["groups"],
        }
    out["losses"] = torch_run["losses"].tolist()
    out["routed_served_by_hypergrid"] = served
    grid.destroy()
    return out


def test_tp_and_fsdp2_training_is_bit_equal_on_hypergrids_mesh():
    results = run_gloo(_job, WORLD, timeout=300)
    for rank, result in enumerate(results):
        assert result["grid"] == {"losses_equal": True, "params_equal": True, "groups_equal": True}, rank
        assert result["routed"] == {"losses_equal": True, "params_equal": True, "groups_equal": True}, rank
        assert result["routed_served_by_hypergrid"], rank
        # the model learned something: not a run that did nothing, equally
        assert result["losses"][-1] < result["losses"][0], (rank, result["losses"])
