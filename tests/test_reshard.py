"""Shrink and grow with sharded state: the data-parallel size changes and every rank's shards are
re-laid from the surviving snapshots and partner copies, in host memory, as a
``torch.distributed.checkpoint`` load would re-lay them from disk.

On gloo, dp 4 on ranks 0-3 (nodes of 2, no spare, ``replica_dim="dp"``: a failure drops dp
coordinates), Adam, ``hypergrid.train(..., partner_copies=True)``; the state is either FSDP2 over
the grid's dp dim (each rank holds a quarter of every parameter and of its Adam moments) or a
replicated model with ZeroRedundancyOptimizer over the grid's dp group (each rank holds the Adam
state of its partition of the parameters):

- **Shrink.** Node 1 (ranks 2 and 3) SIGKILLed mid-step: dp 4 becomes dp 2 on ranks 0 and 1,
  whose new shards are cut from their own snapshots and the copies they held of ranks 2 and 3.
  Every loss after it equals that of a job started on dp 2 from the state a run with no failure
  had at that step, loaded by torch's own resharding (``dcp.load`` for FSDP2; ZeRO's
  ``load_state_dict`` of its consolidated state).
- **Grow.** Rank 3 frozen (SIGSTOP) past its progress timeout is counted out: dp 3 (uneven
  shards: 3, 3 and 2 rows, a bias of 4 as 2, 2 and 0), its state cut from the three survivors'
  and the copy rank 1 held of rank 3. It runs again, offers itself and is grown back: dp 4, cut
  from the dp-3 snapshots. From the growth on, every loss equals that of a job started on dp 4
  from the state the dp-3 job had there (saved by it, loaded by torch's resharding).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from tests.harness import job_store, run_gloo
from tests.test_training import _freezer

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

DIM, HIDDEN, BATCH, STEPS, KILL_STEP, GROW_AT = 4, 8, 3, 6, 3, 4
COLLECTIVE_S = 6.0


def _build(job: Any, zero: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer on the job's grid: FSDP2 over dp, or ZeRO (Adam) over dp's group."""
    import hypergrid

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, DIM))
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                              process_group=job.state.get_pg("dp"), lr=0.05, foreach=False)
    from torch.distributed.fsdp import fully_shard

    mesh = hypergrid.device_mesh(job.state, device_type="cpu")["dp"]
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)


def _save(job: Any, state: Any, folder: Path, zero: bool) -> None:
    """The whole job's state, by torch's own means, on every rank of the grid: dcp.save (FSDP2),
    or ZeRO's state consolidated on the grid's first rank and saved with the model's."""
    (model,), (optimizer,) = state.models, state.optimizers
    if zero:
        first = job.layout.ranks[0]
        folder.mkdir(parents=True, exist_ok=True)
        optimizer.consolidate_state_dict(to=first)
        if dist.get_rank() == first:
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, folder / "zero.pt")
        dist.barrier(group=job.world)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"), process_group=job.world)


def _load(job: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, zero: bool) -> None:
    if zero:
        saved = torch.load(folder / "zero.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])  # ZeRO takes its partition of the whole
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(folder / "dcp"), process_group=job.world)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])


def _job(rank: int, world: int, folder: str, zero: bool, *, kill: bool = False, freeze: Optional[float] = None,
         save_at: tuple[int, ...] = (), start: Optional[int] = None) -> dict:
    """dp ``world`` (4, or the size a reference job starts on) on ranks 0..world-1, nodes of 2, no
    spare. ``kill``: node 1 SIGKILLed after step KILL_STEP's forward; ``freeze``: rank 3 SIGSTOPped
    that many seconds in step 2, the grid grown back at GROW_AT; ``save_at``: the state at the
    start of those steps saved by torch (after the step before it, where the grid grows then);
    ``start``: a reference job started at that step from what was saved."""
    import hypergrid

    warnings.filterwarnings("ignore")
    hypergrid.start_heartbeat(interval_s=0.5, progress_timeout_s=4.0)  # frozen past it: hung
    store = job_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    if freeze is not None and rank == 0:
        threading.Thread(target=_freezer, args=(store, (3, 2, freeze)), daemon=True).start()
    grid = hypergrid.HyperCommGrid([world], ["dp"])
    if zero:
        grid.create_pg("dp")
    else:
        hypergrid.device_mesh(grid, device_type="cpu")
    job = hypergrid.ResilientJob.of_grid(grid, timeout=timedelta(seconds=30),
                                         settings=hypergrid.RecoverySettings(gpus_per_node=2, replica_dim="dp"))
    saved: list[int] = []

    def setup(job: Any) -> Any:
        model, optimizer = _build(job, zero)
        if start is not None and not saved:
            _load(job, model, optimizer, Path(folder) / str(start), zero)
            saved.append(-start)  # loaded once, at the start
        return hypergrid.TrainingState(model, optimizer)

    def step(job: Any, state: Any, step: int) -> float:
        if freeze is not None and step == 2 and rank == 3:
            store.set("freeze", "")
            time.sleep(1.0)  # frozen in here, in a step the others cannot finish
        if freeze is not None and step == GROW_AT - 1 and rank != 3:
            # Before the growth: the frozen rank has run again, learnt it is out and offered itself.
            store.wait(["frozen_at"], timedelta(seconds=60))
            while time.time() < float(store.get("frozen_at").decode()) + freeze + 3 * COLLECTIVE_S:
                time.sleep(0.2)
        if step in save_at and freeze is None:
            _save(job, state, Path(folder) / str(step), zero)
            saved.append(step)
        position = list(job.layout.ranks).index(dist.get_rank())
        (model,), (optimizer,) = state.models, state.optimizers
        generator = torch.Generator().manual_seed(1000 * step + position)
        x, y = torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, DIM, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if kill and rank in (2, 3) and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: before the gradients are reduced
        loss.backward()
        if zero:
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, group=job.state.get_pg("dp"))
                p.grad /= job.layout.size
        optimizer.step()
        if step + 1 in save_at and freeze is not None:
            _save(job, state, Path(folder) / str(step + 1), zero)  # the state the growth starts from
            saved.append(step + 1)
        return loss.item()

    run = hypergrid.train(job, setup, step, steps=STEPS, first_step=start or 0, partner_copies=start is None,
                          grow_every=GROW_AT if freeze is not None else None)
    if not run.job.in_grid:
        return {"in_grid": False}
    return {"in_grid": True, "ranks": list(run.job.layout.ranks), "losses": run.losses, "saved": saved,
            "position": list(run.job.layout.ranks).index(rank), "kinds": [r.kind for r in run.records],
            "resumed": [r.resumed_step for r in run.records],
            "records": [r.describe() for r in run.records]}


def _by_position(results: list) -> dict[int, dict]:
    return {v["position"]: v for v in results if v["in_grid"]}


@pytest.mark.parametrize("zero", [False, True], ids=["fsdp2", "zero"])
def test_a_node_lost_with_no_spare_re_lays_the_shards_on_the_smaller_dp(tmp_path, zero):
    # The state every rank had at the start of the steps the job may resume from, with no failure:
    # the kill comes while the copies of KILL_STEP's snapshot travel, so KILL_STEP or the one before.
    run_gloo(functools.partial(_job, save_at=(KILL_STEP - 1, KILL_STEP)), 4, str(tmp_path), zero, timeout=240,
             pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    results = run_gloo(functools.partial(_job, kill=True), 4, str(tmp_path), zero, timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    assert results[2][0] == "dead" and results[3][0] == "dead", results
    (resumed,) = results[0][1]["resumed"]
    assert resumed in (KILL_STEP - 1, KILL_STEP), results[0]
    fresh = _by_position(run_gloo(functools.partial(_job, start=resumed), 2, str(tmp_path), zero, timeout=240,
                                  pg_timeout_s=COLLECTIVE_S, leave_at_once=True))
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok" and value["ranks"] == [0, 1] and value["kinds"] == ["shrink"], (rank, results[rank])
        assert value["resumed"] == [resumed], (rank, value)
        after = {s: loss for s, loss in value["losses"].items() if s >= resumed}
        want = {s: fresh[value["position"]]["losses"][s] for s in range(resumed, STEPS)}
        assert after == want, (rank, after, want)
    print("shrink:", *(results[r][1]["records"][0] for r in (0, 1)), sep="\n  ")


@pytest.mark.parametrize("zero", [False, True], ids=["fsdp2", "zero"])
def test_a_rank_counted_out_and_grown_back_re_lays_the_shards_each_time(tmp_path, zero):
    results = run_gloo(functools.partial(_job, freeze=10.0, save_at=(GROW_AT,)), 4, str(tmp_path), zero, timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    members = {rank: v for rank, (status, v) in enumerate(results) if status == "ok" and v["in_grid"]}
    assert sorted(members) == [0, 1, 2, 3], results
    for rank, value in members.items():
        assert value["ranks"] == [0, 1, 2, 3], (rank, value)
        assert value["kinds"] == (["joined"] if rank == 3 else ["shrink", "grow"]), (rank, value["records"])
    assert all(members[r]["saved"] == [GROW_AT] for r in (0, 1, 2)), members
    fresh = _by_position(run_gloo(functools.partial(_job, start=GROW_AT), 4, str(tmp_path), zero, timeout=240,
                                  pg_timeout_s=COLLECTIVE_S, leave_at_once=True))
    for rank, value in members.items():
        after = {s: loss for s, loss in value["losses"].items() if s >= GROW_AT}
        want = {s: fresh[value["position"]]["losses"][s] for s in range(GROW_AT, STEPS)}
        assert after == want, (rank, after, want)
    print("counted out, grown back:", *(members[r]["records"] for r in range(4)), sep="\n  ")
