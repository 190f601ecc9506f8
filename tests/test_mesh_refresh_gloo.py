"""HSDP training through the loss of a node, on meshes refreshed in place: no module wrapped again.

A 6-rank gloo job: ranks 0-3 train a small MLP with FSDP2 as HSDP (``fully_shard(model,
mesh=mesh2d)``, ``mesh2d`` = ``hypergrid.device_mesh(grid)`` over the grid's dp_replicate x
dp_shard, 2 x 2) and Adam; ranks 4 and 5 are spares. A node is two ranks (``gpus_per_node=2``),
and the grid puts dp_shard fastest, so each node holds one dp_shard group, that is one whole
replica: losing a node loses one copy of every shard, and the other replica still holds them.

Ranks 2 and 3 (node 1) SIGKILL themselves after the forward of step ``KILL_STEP``. The survivors
(0 and 1) fail in the backward's all-reduce over dp_replicate, call :func:`hypergrid.recover`,
carry their meshes and their FSDP2 modules over to the new grid in place
(:func:`hypergrid.refresh_meshes`, :func:`hypergrid.refresh_fully_shard`), and roll their shards
and Adam's state back to the step's start from an in-memory copy. The spares come back from
``wait_as_spare`` holding positions 2 and 3, build the model with ``fully_shard`` on the new
grid's mesh, and take their shards and Adam's state from their replicate peer
(``job.state_source()``). Training goes on; every rank's loss at every step must be bit-equal
to that of the same position in the same job run with no failure.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_gloo

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

WORLD, SPARES, VICTIMS = 6, [4, 5], (2, 3)
STEPS, KILL_STEP = 5, 2
DIM, HIDDEN, BATCH = 4, 8, 3
PG_TIMEOUT_S = 10.0
RECOVERY = timedelta(seconds=60)


def _model(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, DIM))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)


def _batch(step: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + position)
    return torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, DIM, generator=generator)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's training state as local tensors, in one order on every rank: each shard, its
    Adam moments and step (created as Adam creates them, where the step has not run yet)."""
    tensors = []
    for p in model.parameters():
        state = optimizer.state[p]
        if not state:
            state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        tensors += [p.to_local(), state["exp_avg"].to_local(), state["exp_avg_sq"].to_local(), state["step"]]
    return tensors


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, position: int,
          on_forward: Any = None) -> float:
    x, y = _batch(step, position)
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if on_forward is not None:
        on_forward()
    loss.backward()
    optimizer.step()
    return loss.item()


def _copy_from_replicate_peer(job: Any, mesh: Any, tensors: list[torch.Tensor]) -> None:
    """Each replicate group's ranks that just arrived take the state of one that was there."""
    group = mesh.get_group("dp_replicate")
    members = dist.get_process_group_ranks(group)
    arrived = job.arrived()
    if not arrived & set(members):
        return
    source = next(r for r in members if r not in arrived)
    assert job.state_source() in (None, source), (job.state_source(), source)
    with torch.no_grad():  # into the parameters' shards, in place
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=group)


def _job(rank: int, world: int, kill: bool) -> dict:
    warnings.filterwarnings("ignore")
    import hypergrid

    hypergrid.start_heartbeat(interval_s=0.5)
    grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
    mesh = hypergrid.device_mesh(grid, device_type="cpu")  # before the job: its groups are the job's recipe
    job = hypergrid.ResilientJob.of_grid(grid, spares=SPARES, settings=hypergrid.RecoverySettings(
        gpus_per_node=2, replica_dim="dp_replicate"))
    losses: dict[int, float] = {}
    if not job.in_grid:
        job = job.wait_as_spare(timeout=timedelta(hours=1), recovery_timeout=RECOVERY)
        if not job.in_grid:
            return {"role": "unused spare"}
        mesh = hypergrid.device_mesh(job.state, device_type="cpu")
        model, optimizer = _model(mesh)
        _copy_from_replicate_peer(job, mesh, _state(model, optimizer))
        step = job.step
        role = "arrived"
    else:
        model, optimizer = _model(mesh)
        step, role = 0, "no failure"
    position = list(job.layout.ranks).index(rank)
    while step < STEPS:
        snapshot = [t.detach().clone() for t in _state(model, optimizer)]
        die = kill and rank in VICTIMS and step == KILL_STEP
        try:
            losses[step] = _step(model, optimizer, step, position,
                                 on_forward=(lambda: os.kill(os.getpid(), signal.SIGKILL)) if die else None)
            step += 1
        except Exception as exc:  # a peer is gone: recover in-process
            failed_at = time.monotonic()
            old = job.state
            job = hypergrid.recover(job, timeout=RECOVERY, step=step)
            # The same mesh and module objects, on the new groups: nothing wrapped again.
            refreshed = hypergrid.refresh_meshes(old, job.state)
            hypergrid.refresh_fully_shard(model)
            assert hypergrid.device_mesh(job.state, device_type="cpu") is mesh and refreshed[0] is mesh
            with torch.no_grad():  # the step that failed starts again from its beginning
                for tensor, saved in zip(_state(model, optimizer), snapshot):
                    tensor.copy_(saved)
            _copy_from_replicate_peer(job, mesh, _state(model, optimizer))
            role = f"survivor ({type(exc).__name__})"
            losses["recovery_s"] = time.monotonic() - failed_at  # type: ignore[index]
    job.release_spares()
    groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in mesh.mesh_dim_names}
    return {"role": role, "position": position, "losses": losses, "ranks": list(job.layout.ranks),
            "groups": groups, "mesh": mesh.mesh.tolist()}


def test_hsdp_goes_on_after_a_node_loss_on_meshes_refreshed_in_place():
    reference = run_gloo(_job, WORLD, False, timeout=240, pg_timeout_s=PG_TIMEOUT_S, leave_at_once=True)
    by_position = {r["position"]: r["losses"] for r in reference[:4]}
    assert all(r["role"] == "no failure" for r in reference[:4]), reference
    assert reference[4] == reference[5] == {"role": "unused spare"}

    results = run_gloo(_job, WORLD, True, timeout=400, pg_timeout_s=PG_TIMEOUT_S, expect_failure=True,
                       leave_at_once=True)
    for victim in VICTIMS:
        assert results[victim][0] == "dead", results[victim]
    for rank, position in ((0, 0), (1, 1), (4, 2), (5, 3)):
        outcome = results[rank]
        assert outcome[0] == "ok", (rank, outcome)
        result = outcome[1]
        assert result["ranks"] == [0, 1, 4, 5] and result["position"] == position, (rank, result)
        assert result["mesh"] == [[0, 1], [4, 5]], (rank, result)
        assert result["groups"]["dp_replicate"] == sorted({rank, [0, 1, 4, 5][(position + 2) % 4]}), (rank, result)
        losses = {s: v for s, v in result["losses"].items() if isinstance(s, int)}
        first = 0 if rank < 4 else KILL_STEP
        assert sorted(losses) == list(range(first, STEPS)), (rank, losses)
        for step, loss in losses.items():
            assert loss == by_position[position][step], (rank, step, loss, by_position[position][step])
    assert results[0][1]["role"].startswith("survivor") and results[4][1]["role"] == "arrived"
    print("recovery seconds:", {r: round(results[r][1]["losses"]["recovery_s"], 2) for r in (0, 1)})
