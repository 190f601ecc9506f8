"""A 16-rank job (8 nodes of 2, tp 2 x dp 8, FSDP2 over dp, partner copies) through a node's loss,
each rank planning only its own part of the restore, on gloo:

- **A spare node takes node 1's place.** Ranks 16 and 17 wait as spares; node 1 (ranks 2 and 3)
  is SIGKILLed mid-step. Every loss from the step the job resumed at equals that of the same job
  run with no failure, position by position.
- **dp shrinks to 7.** With no spare, the same loss re-lays every rank's shards on dp 7. Every loss
  after it equals that of a job started on dp 7 from the state the job with no failure had at that
  step, loaded by ``dcp.load``.
- **What a rank received to plan** (``RecoveryRecord.plan_bytes``: answers, requests, all-reduces)
  grows by at most 1 KB from the same job at 8 ranks (tp 2 x dp 4), on every rank.
"""

from __future__ import annotations

import functools
import os
import signal
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from tests.harness import job_store, run_gloo

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

TP, NODE, DIM, HIDDEN, BATCH, STEPS, KILL_STEP = 2, 2, 4, 12, 3, 6, 3
COLLECTIVE_S = 8.0


def _build(job: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2 over dp (12 rows over dp 8 or 7: uneven shards, empty ones for the bias of 4)."""
    from torch.distributed.fsdp import fully_shard

    import hypergrid

    torch.manual_seed(1000 + job.layout.coords(dist.get_rank())[0])  # each tp coordinate its own model
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, DIM))
    mesh = hypergrid.device_mesh(job.state, device_type="cpu")["dp"]
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _job(rank: int, world: int, dp: int, folder: str, *, spares: int = 0, kill: bool = False,
         save_at: tuple[int, ...] = (), start: Optional[int] = None) -> dict:
    """tp 2 x dp ``dp`` on the first ranks, ``spares`` more waiting; ``kill``: node 1 SIGKILLed in
    step KILL_STEP's backward; ``save_at``: the state at the start of those steps saved by
    ``dcp.save`` (one folder per tp coordinate); ``start``: a job started at that step from it."""
    import hypergrid

    warnings.filterwarnings("ignore")
    hypergrid.start_heartbeat(interval_s=0.5, progress_timeout_s=8.0)
    job_store().set(f"pid/{rank}", str(os.getpid()))
    grid = hypergrid.HyperCommGrid([TP, dp], ["tp", "dp"])
    hypergrid.device_mesh(grid, device_type="cpu")
    job = hypergrid.ResilientJob.of_grid(grid, spares=list(range(TP * dp, TP * dp + spares)),
                                         timeout=timedelta(seconds=60),
                                         settings=hypergrid.RecoverySettings(gpus_per_node=NODE, replica_dim="dp"))

    def setup(job: Any) -> Any:
        model, optimizer = _build(job)
        if start is not None and not job.recoveries:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_state_dict

            tp = job.layout.coords(dist.get_rank())[0]
            loaded = _state_dicts(model, optimizer)
            dcp.load(loaded, checkpoint_id=str(Path(folder) / f"{start}-tp{tp}"),
                     process_group=job.state.get_pg("dp"))
            set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        return hypergrid.TrainingState(model, optimizer)

    def step(job: Any, state: Any, step: int) -> float:
        (model,), (optimizer,) = state.models, state.optimizers
        if step in save_at:
            import torch.distributed.checkpoint as dcp

            tp = job.layout.coords(dist.get_rank())[0]
            dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(Path(folder) / f"{step}-tp{tp}"),
                     process_group=job.state.get_pg("dp"))
        tp, dp_at = job.layout.coords(dist.get_rank())
        generator = torch.Generator().manual_seed(1000 * step + 10 * tp + dp_at)
        x, y = torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, DIM, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if kill and rank in (2, 3) and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)  # before the gradients are reduced
        loss.backward()
        optimizer.step()
        return loss.item()

    run = hypergrid.train(job, setup, step, steps=STEPS, first_step=start or 0, partner_copies=start is None)
    if not run.job.in_grid:
        return {"in_grid": False}
    return {"in_grid": True, "coords": tuple(run.job.layout.coords(rank)), "losses": run.losses,
            "kinds": [r.kind for r in run.records], "resumed": [r.resumed_step for r in run.records],
            "plan_bytes": [r.plan_bytes for r in run.records], "records": [r.describe() for r in run.records]}


def _run(dp: int, folder: Path, **kwargs: Any) -> list[Any]:
    world = TP * dp + kwargs.get("spares", 0)
    failing = kwargs.get("kill", False)
    return run_gloo(functools.partial(_job, **kwargs), world, dp, str(folder), timeout=420,
                    pg_timeout_s=COLLECTIVE_S, expect_failure=failing, leave_at_once=True)


def _members(results: list[Any]) -> dict[tuple[int, int], dict]:
    """The ranks that ended in the grid, by their coordinates."""
    found = {}
    for status, value in results:
        if status == "ok" and value["in_grid"]:
            found[value["coords"]] = value
    return found


@pytest.fixture(scope="module")
def unfailed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[tuple[int, int], dict]]:
    """The 16-rank job with no failure, saving its state at the steps a loss may resume from."""
    folder = tmp_path_factory.mktemp("restore_scale")
    results = [("ok", v) for v in _run(8, folder, save_at=(KILL_STEP - 1, KILL_STEP))]
    return folder, _members(results)


def _plan_bytes(results: list[Any]) -> int:
    sizes = [value["plan_bytes"][0] for status, value in results if status == "ok" and value["in_grid"]]
    assert sizes and None not in sizes, sizes  # every rank planned its own part
    return max(sizes)


def test_a_spare_node_takes_a_lost_nodes_place_bit_equal_planning_its_own_part(unfailed, tmp_path):
    _, reference = unfailed
    results = _run(8, tmp_path, spares=2, kill=True)
    assert [results[r][0] for r in (2, 3)] == ["dead", "dead"], results
    members = _members(results)
    assert len(members) == 16, results
    for coords, value in members.items():
        assert value["kinds"] in (["replace"], ["joined"]), (coords, value["records"])
        (resumed,) = value["resumed"]
        assert resumed in (KILL_STEP - 1, KILL_STEP)
        after = {s: loss for s, loss in value["losses"].items() if s >= resumed}
        assert after == {s: reference[coords]["losses"][s] for s in range(resumed, STEPS)}, coords
    small = _run(4, tmp_path / "small", spares=2, kill=True)
    print(f"plan bytes, the most a rank received: 8 ranks {_plan_bytes(small)}, 16 ranks {_plan_bytes(results)}")
    assert _plan_bytes(results) <= _plan_bytes(small) + 1024


def test_a_lost_node_without_a_spare_re_lays_dp_8_on_7_as_dcp_load_would(unfailed):
    folder, _ = unfailed
    results = _run(8, folder / "shrink", kill=True)
    members = _members(results)
    assert sorted(members) == sorted((tp, dp) for dp in range(7) for tp in range(TP)), results
    (resumed,) = {value["resumed"][0] for value in members.values()}
    assert resumed in (KILL_STEP - 1, KILL_STEP)
    fresh = _members([("ok", v) for v in _run(7, folder, start=resumed)])
    for coords, value in members.items():
        assert value["kinds"] == ["shrink"], (coords, value["records"])
        after = {s: loss for s, loss in value["losses"].items() if s >= resumed}
        assert after == {s: fresh[coords]["losses"][s] for s in range(resumed, STEPS)}, coords
    small = _run(4, folder / "small", kill=True)
    print(f"plan bytes, the most a rank received: 8 ranks {_plan_bytes(small)}, 16 ranks {_plan_bytes(results)}")
    assert _plan_bytes(results) <= _plan_bytes(small) + 1024
