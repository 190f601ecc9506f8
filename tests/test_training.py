"""hypergrid.train on gloo ranks: a node lost mid-step, and the whole training state back.

A tensor-parallel MLP (a column- then a row-parallel linear, tp 2) trained with data parallel 2,
Adam, a StepLR scheduler, dropout drawn from torch's generator (seeded per tp rank, alike along
dp, as Megatron-Core seeds it) and a data sampler whose position advances each step. Ranks 0-3
hold the grid; node 1 (ranks 2 and 3, data-parallel replica 1) kills itself (SIGKILL) after its
forward in step ``KILL_STEP``.

- With a spare node (ranks 4 and 5), the spares take the lost positions and get model,
  optimizer, RNG, scheduler and sampler from their data-parallel peers: every step's loss, on
  every rank of the grid, is bit-equal to the same job run with no failure.
- With no spare, replica 1 is dropped and the job goes on at dp 1 from the step every rank
  holds: its losses are bit-equal to those of a job started from the same state (taken by a run
  with no failure) on the shrunk placement at that step.
- A second loss while the first is recovered: the spare that took a lost position dies as it
  takes it, before it has its state; the survivors recover again onto the next spare node, and
  the losses are still bit-equal to a run with no failure.
- A rank frozen (SIGSTOP) past its progress timeout is counted out; its replica is dropped, its
  peer waits as a spare, it offers itself once it runs again, and the grid grows back: from
  the growth on, the losses are bit-equal to those of a job started there from the state every
  position had.

Each of these runs twice: the model as it is (its gradients averaged over dp by the step), and in
torch's ``DistributedDataParallel`` over the grid's dp group, built in ``setup`` (DDP averages
them). With DDP the second loss runs with the default group's timeout at gloo's 30 minutes and the
grid's groups' at 6 s: the survivors wait for the spare that died in its ``setup`` in the job's
own groups no longer than the grid's groups' timeout.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from tests.harness import job_store, run_gloo
from tests.test_recovery_training import _FromTensorParallel, _ToTensorParallel

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

TP, DIM, HIDDEN, BATCH = 2, 4, 8, 3
STEPS, KILL_STEP = 6, 3
COLLECTIVE_S = 6.0


class ParallelMLP(torch.nn.Module):
    def __init__(self, tp_rank: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        w1 = torch.randn(DIM, HIDDEN, generator=gen) / DIM ** 0.5
        w2 = torch.randn(HIDDEN, DIM, generator=gen) / HIDDEN ** 0.5
        cols = HIDDEN // TP
        self.w1 = torch.nn.Parameter(w1[:, tp_rank * cols:(tp_rank + 1) * cols].clone())
        self.w2 = torch.nn.Parameter(w2[tp_rank * cols:(tp_rank + 1) * cols].clone())

    def forward(self, x: torch.Tensor, tp: Any) -> torch.Tensor:
        hidden = torch.relu(_ToTensorParallel.apply(x, tp) @ self.w1)
        hidden = torch.nn.functional.dropout(hidden, p=0.25, training=True)  # torch's generator
        return _FromTensorParallel.apply(hidden @ self.w2, tp)


class Sampler:
    """A data position: batch ``position`` of data-parallel rank ``dp_rank``, seeded by both."""

    def __init__(self) -> None:
        self.position = 0

    def batch(self, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * self.position + dp_rank)
        self.position += 1
        return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _setup(job: Any, ddp: bool = False) -> Any:
    """``ddp``: the model wrapped in torch's DistributedDataParallel over the grid's dp group."""
    import hypergrid

    grid = job.state
    tp_rank = grid.ranks("tp").index(dist.get_rank())
    torch.manual_seed(2024 + tp_rank)  # dropout alike along dp, as Megatron-Core seeds it
    model: torch.nn.Module = ParallelMLP(tp_rank)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=grid.get_pg("dp"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return hypergrid.TrainingState(model, optimizer, scheduler=scheduler, sampler=Sampler())


def average_gradients(model: torch.nn.Module, dp: Any) -> None:
    """Data parallel: each gradient averaged over the dp group."""
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad, group=dp)
        p.grad /= dist.get_world_size(dp)


def train_step(state: Any, tp: Any, dp: Any, dp_rank: int, *, die: bool = False) -> float:
    """One step of the MLP on the given groups; ``die``: SIGKILL this rank mid-step (after the
    forward, before the gradients' reduce)."""
    (model,), (optimizer,) = state.models, state.optimizers
    x, y = state.objects["sampler"].batch(dp_rank)
    loss = torch.nn.functional.mse_loss(model(x, tp), y)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):  # DDP averages them in its backward
        average_gradients(model, dp)
    optimizer.step()
    optimizer.zero_grad()
    state.objects["scheduler"].step()
    return loss.item()


def _one_step(job: Any, state: Any, step: int, *, kill: Optional[tuple[list[int], int]] = None) -> float:
    grid = job.state
    die = kill is not None and dist.get_rank() in kill[0] and step == kill[1]
    return train_step(state, grid.get_pg("tp"), grid.get_pg("dp"), grid.ranks("dp").index(dist.get_rank()), die=die)


def _train_on(rank: int, world: int, ranks: list[int], spares: list[int], kill: Optional[tuple[list[int], int]],
           start: Optional[int], save_at: Optional[int], folder: str, *, kill_on_joining: Optional[int] = None,
           freeze: Optional[tuple[int, int, float]] = None, grow_every: Optional[int] = None, ddp: bool = False,
           group_timeout_s: Optional[float] = None) -> dict:
    """``kill``: (ranks, step) SIGKILLed mid-step; ``kill_on_joining``: a spare SIGKILLed as it takes a
    position; ``freeze``: (rank, step, seconds) SIGSTOPped mid-step, then let run again; ``ddp``: the
    model in DistributedDataParallel over dp; ``group_timeout_s``: the grid's groups' timeout (else the
    default group's)."""
    import hypergrid

    hypergrid.start_heartbeat(interval_s=0.5, progress_timeout_s=4.0)  # frozen past it: hung
    store = job_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    if freeze is not None and rank == 0:
        threading.Thread(target=_freezer, args=(store, freeze), daemon=True).start()
    grid = hypergrid.HyperCommGrid([TP, len(ranks) // TP], ["tp", "dp"])
    timeout = {} if group_timeout_s is None else {"timeout": timedelta(seconds=group_timeout_s)}
    grid.create_pg("tp", **timeout)
    grid.create_pg("dp", **timeout)
    job = hypergrid.ResilientJob.of_grid(grid, spares=spares, timeout=timedelta(seconds=30),
                                         settings=hypergrid.RecoverySettings(gpus_per_node=2, replica_dim="dp"))
    def setup(job: Any) -> Any:
        if dist.get_rank() == kill_on_joining:
            os.kill(os.getpid(), signal.SIGKILL)
        state = _setup(job, ddp)
        if start is not None:  # a job started on this placement from a saved state
            position = list(job.layout.ranks).index(dist.get_rank())
            state.restore(torch.load(Path(folder) / f"{position}.pt", weights_only=False))
        return state

    saved: list[int] = []

    def one_step(job: Any, state: Any, step: int) -> float:
        if freeze is not None and (rank, step) == freeze[:2]:
            store.set("freeze", "")
            time.sleep(1.0)  # frozen in here, in a step the others cannot finish
        if freeze is not None and grow_every is not None and step == grow_every - 1 and rank != freeze[0]:
            # Before the growth: the frozen rank has run again, learnt it is out and offered itself.
            store.wait(["frozen_at"], timedelta(seconds=60))
            while time.time() < float(store.get("frozen_at").decode()) + freeze[2] + 3 * COLLECTIVE_S:
                time.sleep(0.2)
        if kill is not None and rank == kill[0][0] and step == kill[1]:
            store.set("killed_at", repr(time.time()))  # a moment before it dies, after its forward
        if save_at is not None and step == save_at:
            position = list(job.layout.ranks).index(dist.get_rank())
            torch.save(state.capture(step), Path(folder) / f"{position}.pt")
            saved.append(step)
        return _one_step(job, state, step, kill=kill)

    records: list[Any] = []
    run = hypergrid.train(job, setup, one_step, steps=STEPS, first_step=start or 0, on_recovery=records.append,
                          grow_every=grow_every)
    if not run.job.in_grid:
        return {"in_grid": False}
    return {"in_grid": True, "ranks": list(run.job.layout.ranks), "losses": run.losses,
            "position": list(run.job.layout.ranks).index(rank),
            "records": [(r.kind, r.plan, r.failed_step, r.resumed_step, r.describe()) for r in records],
            "saved": saved, "wrapped": [type(m).__name__ for m in run.state.models],
            # When the first rank killed died (seconds since the epoch) and, for each recovery, when this
            # rank's first step after it was done: the time from a kill to every rank's first step.
            "killed_at": float(store.get("killed_at").decode()) if store.check(["killed_at"]) else None,
            "stepped_at": [r.seen_at + r.total_s for r in records]}


def _freezer(store: Any, freeze: tuple[int, int, float]) -> None:
    store.wait(["freeze"], timedelta(seconds=120))
    pid = int(store.get(f"pid/{freeze[0]}").decode())
    store.set("frozen_at", repr(time.time()))
    os.kill(pid, signal.SIGSTOP)
    time.sleep(freeze[2])
    os.kill(pid, signal.SIGCONT)


def _by_position(results: list) -> dict[int, dict]:
    """A run with no failure (each rank's value, not a status and a value), by grid position."""
    return {v["position"]: v for v in results if v["in_grid"]}


WRAPS = pytest.mark.parametrize("ddp", [False, True], ids=["plain", "ddp"])


def _from_kill_to_first_steps(members: dict[int, dict]) -> str:
    """For the test's output: seconds from the kill to each rank's first step after each recovery."""
    killed = next(v["killed_at"] for v in members.values() if v["killed_at"] is not None)
    return ", ".join(f"rank {rank}: " + "/".join(f"{t - killed:.2f}" for t in v["stepped_at"])
                     for rank, v in sorted(members.items()))


@WRAPS
def test_a_node_lost_mid_step_with_a_spare_node_trains_on_bit_equal(tmp_path, ddp):
    train_job = functools.partial(_train_on, ddp=ddp)
    reference = run_gloo(train_job, 6, [0, 1, 2, 3], [4, 5], None, None, None, str(tmp_path), timeout=240,
                         pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    results = run_gloo(train_job, 6, [0, 1, 2, 3], [4, 5], ([2, 3], KILL_STEP), None, None, str(tmp_path), timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    assert results[2][0] == "dead" and results[3][0] == "dead", results[2:4]
    expected = _by_position(reference)
    members = {rank: v for rank, (status, v) in enumerate(results) if status == "ok" and v["in_grid"]}
    assert sorted(members) == [0, 1, 4, 5], results
    for rank, value in members.items():
        assert value["ranks"] == [0, 1, 4, 5], (rank, value)
        ((kind, plan, failed_step, resumed, line),) = value["records"]
        assert resumed == KILL_STEP, (rank, line)
        assert failed_step == (None if rank >= 4 else KILL_STEP), (rank, line)
        assert plan == "replace: rank 2 -> 4, rank 3 -> 5; 0 spares left", (rank, plan)
        assert kind == ("joined" if rank >= 4 else "replace"), (rank, kind)
        losses = value["losses"]
        want = expected[value["position"]]["losses"]
        steps = range(KILL_STEP, STEPS) if rank >= 4 else range(STEPS)
        assert {s: losses[s] for s in steps} == {s: want[s] for s in steps}, (rank, losses, want)
        assert value["wrapped"] == ["DistributedDataParallel" if ddp else "ParallelMLP"], value["wrapped"]
    print(f"\n{'DDP' if ddp else 'plain'}, node 1 lost, a spare node: from the kill to each rank's first step "
          f"(s): {_from_kill_to_first_steps(members)}")


@WRAPS
def test_a_node_lost_with_no_spare_shrinks_and_trains_as_a_job_started_there(tmp_path, ddp):
    train_job = functools.partial(_train_on, ddp=ddp)
    # The state every position holds at the step the job resumes from, taken by a run with no failure.
    run_gloo(train_job, 4, [0, 1, 2, 3], [], None, None, KILL_STEP, str(tmp_path), timeout=240,
             pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    results = run_gloo(train_job, 4, [0, 1, 2, 3], [], ([2, 3], KILL_STEP), None, None, str(tmp_path), timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    assert results[2][0] == "dead" and results[3][0] == "dead", results[2:4]
    fresh = run_gloo(train_job, 2, [0, 1], [], None, KILL_STEP, None, str(tmp_path), timeout=240,
                     pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok" and value["ranks"] == [0, 1], results[rank]
        ((kind, plan, failed_step, resumed, line),) = value["records"]
        assert kind == "shrink" and resumed == KILL_STEP and failed_step == KILL_STEP, line
        assert plan.startswith("shrink: replicas holding ranks [2, 3] dropped"), plan
        after = {s: loss for s, loss in value["losses"].items() if s >= KILL_STEP}
        assert after == {s: fresh[rank]["losses"][s] for s in range(KILL_STEP, STEPS)}, (rank, after, fresh[rank])
    print(f"\n{'DDP' if ddp else 'plain'}, node 1 lost, no spare (dp 2 -> 1): from the kill to each rank's first "
          f"step (s): {_from_kill_to_first_steps({r: results[r][1] for r in (0, 1)})}")


@pytest.mark.parametrize("ddp, default_timeout_s", [(False, COLLECTIVE_S), (True, 1800.0)],
                         ids=["plain", "ddp-default-group-30-min"])
def test_a_second_loss_while_the_first_is_recovered_goes_to_the_next_spare_node(tmp_path, ddp, default_timeout_s):
    # With DDP, the default group's timeout is gloo's default and the grid's groups' 6 s: the survivors
    # wait for the spare that died in its setup in the job's own groups (job.world) no longer than
    # the grid's groups' timeout.
    train_job = functools.partial(_train_on, ddp=ddp)
    reference = run_gloo(train_job, 4, [0, 1, 2, 3], [], None, None, None, str(tmp_path), timeout=240,
                         pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    results = run_gloo(functools.partial(train_job, kill_on_joining=4, group_timeout_s=COLLECTIVE_S), 8, [0, 1, 2, 3],
                       [4, 5, 6, 7], ([2, 3], KILL_STEP), None, None, str(tmp_path), timeout=300,
                       pg_timeout_s=default_timeout_s, expect_failure=True, leave_at_once=True)
    assert [results[r][0] for r in (2, 3, 4)] == ["dead"] * 3, results
    expected = _by_position(reference)
    members = {rank: v for rank, (status, v) in enumerate(results) if status == "ok" and v["in_grid"]}
    assert sorted(members) == [0, 1, 5, 6], results
    for rank, value in members.items():
        assert value["ranks"] == [0, 1, 6, 5], (rank, value)
        assert value["records"][-1][3] == KILL_STEP, (rank, value["records"])
        steps = range(KILL_STEP, STEPS) if rank >= 4 else range(STEPS)
        want = expected[value["position"]]["losses"]
        assert {s: value["losses"][s] for s in steps} == {s: want[s] for s in steps}, (rank, value["losses"], want)
    print(f"\n{'DDP' if ddp else 'plain'}, node 1 lost, then the spare taking rank 2's place (grid's groups: a "
          f"{COLLECTIVE_S:g} s timeout, the default group's {default_timeout_s:g} s): from the kill to each rank's "
          f"first step (s): {_from_kill_to_first_steps(members)}")


@WRAPS
def test_a_rank_frozen_is_counted_out_offers_itself_and_is_grown_back(tmp_path, ddp):
    train_job = functools.partial(_train_on, ddp=ddp)
    grow_at = 4
    results = run_gloo(functools.partial(train_job, freeze=(3, 2, 10.0), grow_every=grow_at), 4, [0, 1, 2, 3], [],
                       None, None, grow_at, str(tmp_path), timeout=300, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    members = {rank: v for rank, (status, v) in enumerate(results) if status == "ok" and v["in_grid"]}
    assert sorted(members) == [0, 1, 2, 3], results
    kinds = {rank: [r[0] for r in v["records"]] for rank, v in members.items()}
    assert kinds[0] == ["shrink", "grow"] and kinds[1] == ["shrink", "grow"], kinds
    assert kinds[2] == ["joined"] and kinds[3] == ["joined"], kinds
    assert all(v["saved"] == [grow_at] for v in members.values()), members
    fresh = _by_position(run_gloo(train_job, 4, [0, 1, 2, 3], [], None, grow_at, None, str(tmp_path), timeout=240,
                                  pg_timeout_s=COLLECTIVE_S, leave_at_once=True))
    for rank, value in members.items():
        after = {s: loss for s, loss in value["losses"].items() if s >= grow_at}
        want = {s: fresh[value["position"]]["losses"][s] for s in range(grow_at, STEPS)}
        assert after == want, (rank, after, want)


def mesh_job(shape: list[int], dims: list[str]) -> Any:
    """A job on ranks 0-3 whose grid's DeviceMesh is made before the job (so that its groups are
    the job's to rebuild), ranks 4 and 5 spares, nodes of 2, replicas along ``dp_replicate``."""
    import hypergrid

    grid = hypergrid.HyperCommGrid(shape, dims)
    hypergrid.device_mesh(grid, device_type="cpu")
    return hypergrid.ResilientJob.of_grid(grid, spares=[4, 5], timeout=timedelta(seconds=30),
                                          settings=hypergrid.RecoverySettings(gpus_per_node=2,
                                                                              replica_dim="dp_replicate"))


def _hsdp(rank: int, world: int, kill: bool) -> dict:
    """FSDP2 as HSDP over hypergrid's dp_replicate x dp_shard mesh (tests/test_mesh_refresh_gloo.py's
    model): node 1 holds replica 1 whole; its ranks SIGKILL themselves after step 2's forward."""
    import warnings

    import hypergrid
    from tests import test_mesh_refresh_gloo as hsdp

    warnings.filterwarnings("ignore")
    hypergrid.start_heartbeat(interval_s=0.5)
    job = mesh_job([2, 2], ["dp_shard", "dp_replicate"])
    wrapped: list[int] = []

    def setup(job: Any) -> Any:
        model, optimizer = hsdp._model(hypergrid.device_mesh(job.state, device_type="cpu"))
        wrapped.append(id(model))
        return hypergrid.TrainingState(model, optimizer)

    def step(job: Any, state: Any, step: int) -> float:
        position = list(job.layout.ranks).index(dist.get_rank())
        die = kill and dist.get_rank() in (2, 3) and step == hsdp.KILL_STEP
        return hsdp._step(state.models[0], state.optimizers[0], step, position,
                          on_forward=(lambda: os.kill(os.getpid(), signal.SIGKILL)) if die else None)

    run = hypergrid.train(job, setup, step, steps=hsdp.STEPS)
    if not run.job.in_grid:
        return {"in_grid": False}
    return {"in_grid": True, "ranks": list(run.job.layout.ranks), "losses": run.losses, "wrapped": len(wrapped),
            "position": list(run.job.layout.ranks).index(rank), "records": [r.kind for r in run.records]}


def _node_1_lost_with_a_spare_node(job: Any, kill_step: int, steps: int) -> dict[int, dict]:
    """``job(rank, world, kill)`` on 6 ranks (4 in the grid, node 2 the spares) with no failure, then
    with node 1 SIGKILLed mid-step ``kill_step``: on every rank of the grid after, the spares in
    node 1's place, one record each, and every step's loss bit-equal to the run with no failure.
    Returns the values of the ranks of the grid."""
    reference = _by_position(run_gloo(job, 6, False, timeout=240, pg_timeout_s=COLLECTIVE_S, leave_at_once=True))
    results = run_gloo(job, 6, True, timeout=300, pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    assert results[2][0] == "dead" and results[3][0] == "dead", results
    for rank in (0, 1, 4, 5):
        status, value = results[rank]
        assert status == "ok" and value["ranks"] == [0, 1, 4, 5], (rank, results[rank])
        assert value["records"] == (["joined"] if rank >= 4 else ["replace"]), (rank, value)
        done = range(kill_step, steps) if rank >= 4 else range(steps)
        want = reference[value["position"]]["losses"]
        assert {s: value["losses"][s] for s in done} == {s: want[s] for s in done}, (rank, value["losses"], want)
    return {rank: results[rank][1] for rank in (0, 1, 4, 5)}


def test_hsdp_through_a_node_loss_with_a_spare_node_wraps_nothing_again():
    from tests import test_mesh_refresh_gloo as hsdp

    members = _node_1_lost_with_a_spare_node(_hsdp, hsdp.KILL_STEP, hsdp.STEPS)
    assert all(value["wrapped"] == 1 for value in members.values()), members  # refreshed in place


def _failing(rank: int, world: int) -> dict:
    import hypergrid

    hypergrid.start_heartbeat(interval_s=0.5)
    grid = hypergrid.HyperCommGrid([2], ["dp"])
    grid.create_pg("dp")
    job = hypergrid.ResilientJob.of_grid(grid, timeout=timedelta(seconds=30))
    calls: list[int] = []

    def step(job: Any, state: Any, step: int) -> float:
        calls.append(step)
        if step == 1:
            raise RuntimeError("the user's own bug, on every rank")
        return 0.0

    try:
        hypergrid.train(job, lambda job: hypergrid.TrainingState(torch.nn.Linear(1, 1)), step, steps=3, retries=1)
    except RuntimeError as exc:
        return {"raised": str(exc), "calls": calls}
    return {"raised": None, "calls": calls}


def test_a_step_that_fails_with_nobody_lost_is_raised_after_its_retries():
    results = run_gloo(_failing, 2, timeout=240, pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    for value in results:
        assert value == {"raised": "the user's own bug, on every rank", "calls": [0, 1, 1]}, results  # one retry


def _megatron(rank: int, world: int, kill: bool) -> dict:
    """The same model and kill on Megatron-Core's parallel_state (ResilientJob.of_megatron)."""
    import warnings

    from megatron.core import parallel_state as ps

    import hypergrid

    warnings.filterwarnings("ignore")
    hypergrid.start_heartbeat(interval_s=0.5)
    job = hypergrid.ResilientJob.of_megatron(spares=[4, 5], tensor_model_parallel_size=TP,
                                             create_gloo_process_groups=False, distributed_timeout_minutes=0.1,
                                             timeout=timedelta(seconds=30),
                                             settings=hypergrid.RecoverySettings(gpus_per_node=2))

    def setup(job: Any) -> Any:
        torch.manual_seed(2024 + ps.get_tensor_model_parallel_rank())
        model = ParallelMLP(ps.get_tensor_model_parallel_rank())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return hypergrid.TrainingState(model, optimizer, scheduler=scheduler, sampler=Sampler())

    def step(job: Any, state: Any, step: int) -> float:  # parallel_state's groups, read each step
        return train_step(state, ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                          ps.get_data_parallel_rank(), die=kill and dist.get_rank() in (2, 3) and step == KILL_STEP)

    run = hypergrid.train(job, setup, step, steps=STEPS)
    if not run.job.in_grid:
        return {"in_grid": False}
    return {"in_grid": True, "ranks": list(run.job.layout.ranks), "losses": run.losses,
            "position": list(run.job.layout.ranks).index(rank), "records": [r.kind for r in run.records]}


def test_megatron_parallel_state_through_a_node_loss_with_a_spare_node():
    _node_1_lost_with_a_spare_node(_megatron, KILL_STEP, STEPS)
