"""In-process recovery of a training job: a rank is SIGKILLed mid-step and training goes on.

A small model with Megatron-style parallelism (tensor parallel: a column- then a row-parallel
linear per stage; two pipeline stages; data parallel with averaged gradients) is trained on
``parallel_state``'s groups from :meth:`hypergrid.recovery.ResilientJob.of_megatron`, on gloo
over loopback. One rank kills itself (SIGKILL) after its forward of step ``KILL_STEP``; every
survivor catches the failed collective, calls :func:`hypergrid.recover`, rolls back to the
step's start (an in-memory snapshot), and a rank that just arrived copies its shard from a
surviving data-parallel peer. Then training goes on.

Checked on every rank: the recovery's outcome (a spare took the place, or the replica was
dropped); and the losses after the recovery are bit-equal to those of a fresh job started on the
recovered placement from the same state (the parameters every position had at the step's start).
A second kill during the recovery (in the middle of planning it) is recovered by the same call: a
new round with both ranks failed.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_gloo

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

TP, PP = 2, 2
DIM, HIDDEN, BATCH = 4, 8, 3
STEPS, KILL_STEP = 6, 3
LR = 0.1
PG_TIMEOUT_S = 10.0  # collectives with a dead peer's survivors time out within this
RECOVERY = timedelta(seconds=45)
SIZES = dict(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP, create_gloo_process_groups=False,
             distributed_timeout_minutes=0.2)


# ---------------------------------------------------------------------- the model
class _ToTensorParallel(torch.autograd.Function):
    """Column-parallel input: identity forward, gradients summed over the tp group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _FromTensorParallel(torch.autograd.Function):
    """Row-parallel output: partial sums added over the tp group forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


def _initial_shard(stage: int, tp_rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + stage)
    w1 = torch.randn(DIM, HIDDEN, generator=gen) / DIM ** 0.5
    w2 = torch.randn(HIDDEN, DIM, generator=gen) / HIDDEN ** 0.5
    cols = HIDDEN // TP
    return [w1[:, tp_rank * cols:(tp_rank + 1) * cols].clone(), w2[tp_rank * cols:(tp_rank + 1) * cols].clone()]


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)


def _step(params: list[torch.Tensor], step: int, on_forward: Any = None) -> Optional[float]:
    """One training step on parallel_state's groups; the dp-averaged loss on the last stage."""
    from megatron.core import parallel_state as ps

    # Point-to-point on the pipeline group, as Megatron-Core's p2p communication does: the default
    # group still holds a dead rank after a recovery, and gloo closes its connections on an error.
    tp_group, dp_group, pp_group = (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                                    ps.get_pipeline_model_parallel_group())
    stage, last = ps.get_pipeline_model_parallel_rank(), ps.is_pipeline_last_stage()
    x, target = _batch(step, ps.get_data_parallel_rank())
    leaves = [p.detach().requires_grad_() for p in params]
    if stage == 0:
        inp = x
    else:
        inp = torch.empty(BATCH, DIM)
        dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank(), group=pp_group)
        inp.requires_grad_()
    hidden = torch.relu(_ToTensorParallel.apply(inp, tp_group) @ leaves[0])
    out = _FromTensorParallel.apply(hidden @ leaves[1], tp_group)
    if on_forward is not None:
        on_forward()
    loss_value = None
    if last:
        loss = ((out - target) ** 2).mean()
        loss.backward()
        dist.send(inp.grad, dst=ps.get_pipeline_model_parallel_prev_rank(), group=pp_group)
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=dp_group)
        loss_value = reported.item() / ps.get_data_parallel_world_size()
    else:
        dist.send(out.detach(), dst=ps.get_pipeline_model_parallel_next_rank(), group=pp_group)
        grad = torch.empty(BATCH, DIM)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank(), group=pp_group)
        out.backward(grad)
    for p, leaf in zip(params, leaves):
        g = leaf.grad.clone()
        dist.all_reduce(g, group=dp_group)
        p -= LR * g / ps.get_data_parallel_world_size()
    return loss_value


def _position(job: Any, rank: int) -> int:
    return list(job.layout.ranks).index(rank)


def _copy_from_peer(job: Any, params: list[torch.Tensor]) -> None:
    """Every rank of each data-parallel group takes its first surviving member's parameters (a
    rank that just arrived has none of its own; the others already hold the same)."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    members = dist.get_process_group_ranks(group)
    arrived = {new for _, new in job.last.replaced} if job.last else set()
    source = next(r for r in members if r not in arrived)
    assert job.state_source() in (None, source)
    for p in params:
        dist.broadcast(p, src=source, group=group)


# ---------------------------------------------------------------------- the jobs
def _train_through_a_failure(rank: int, world: int, spares: list[int], victim: int, second_victim: Optional[int],
                             nodes_per_reader: int = 16) -> dict:
    from megatron.core import parallel_state as ps

    import hypergrid

    hypergrid.start_heartbeat(interval_s=0.5)
    settings = hypergrid.RecoverySettings(gpus_per_node=2, nodes_per_reader=nodes_per_reader)
    job = hypergrid.ResilientJob.of_megatron(spares=spares, settings=settings, **SIZES)
    params: list[torch.Tensor] = []
    if job.in_grid:
        params = _initial_shard(ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    else:
        # Longer than the whole test may run: an unused spare returns because the job released it.
        job = job.wait_as_spare(timeout=timedelta(hours=1), recovery_timeout=RECOVERY)
        if not job.in_grid:
            return {"role": "unused spare"}
        params = [torch.zeros(DIM, HIDDEN // TP), torch.zeros(HIDDEN // TP, DIM)]
        _copy_from_peer(job, params)
        return _train_on(job, params, KILL_STEP, rank, recovered_at=time.monotonic())
    if second_victim is not None and rank == second_victim:
        import hypergrid.recovery.driver as recovery_job

        original = recovery_job.plan_recovery

        def dying(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)  # a second loss, in the middle of the recovery
            return original(*args, **kwargs)

        recovery_job.plan_recovery = dying
    losses: dict[int, float] = {}
    step = 0
    while step < STEPS:
        snapshot = [p.clone() for p in params]
        kill = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if rank == victim and step == KILL_STEP else None
        try:
            loss = _step(params, step, on_forward=kill)
            if loss is not None:
                losses[step] = loss
            step += 1
        except Exception as exc:  # a peer is gone: recover in-process
            failed_at = time.monotonic()
            try:
                job = hypergrid.recover(job, timeout=RECOVERY)
            except Exception as error:
                job.release_spares()  # the job gives up: spares still waiting need not wait on
                return {"role": "survivor", "recovery_error": type(error).__name__, "message": str(error)[:300],
                        "seconds": time.monotonic() - failed_at, "first_error": type(exc).__name__}
            for p, saved in zip(params, snapshot):
                p.copy_(saved)  # the step that failed starts again from its beginning
            if not job.in_grid:
                return {"role": "left", "plan": job.last.describe(), "losses": losses}
            _copy_from_peer(job, params)
            out = _train_on(job, params, step, rank, recovered_at=failed_at)
            out["before"] = losses
            return out
    return {"role": "no failure", "losses": losses}


def _train_on(job: Any, params: list[torch.Tensor], start: int, rank: int, recovered_at: float) -> dict:
    """Train the remaining steps; report the placement, the state it started from and the losses."""
    # Plain lists: a tensor would travel by a file descriptor of a process that may be gone.
    state = {"position": _position(job, rank), "params": [p.tolist() for p in params]}
    seconds = time.monotonic() - recovered_at
    losses = {}
    for step in range(start, STEPS):
        loss = _step(params, step)
        if loss is not None:
            losses[step] = loss
    job.release_spares()  # training is over: a spare still waiting returns now, not at its timeout
    return {"role": "member", "ranks": list(job.layout.ranks), "plan": job.last.describe(), "start": state,
            "after": losses, "recovery_seconds": seconds, "kind": job.last.kind.value}


def _fresh(rank: int, world: int, ranks: list[int], start: int, states: dict) -> dict:
    """A job started on ``ranks`` (a recovered placement) from the parameters each position had."""
    import hypergrid

    job = hypergrid.ResilientJob.of_megatron(ranks=ranks, settings=hypergrid.RecoverySettings(gpus_per_node=2), **SIZES)
    if not job.in_grid:
        return {}
    params = [torch.tensor(values) for values in states[_position(job, rank)]]
    losses = {}
    for step in range(start, STEPS):
        loss = _step(params, step)
        if loss is not None:
            losses[step] = loss
    return {"after": losses}


def _check_against_a_fresh_run(results: list, world: int) -> list[dict]:
    members = [r[1] for r in results if r[0] == "ok" and r[1].get("role") == "member"]
    assert members, results
    ranks = members[0]["ranks"]
    assert all(m["ranks"] == ranks for m in members), [m["ranks"] for m in members]
    states = {m["start"]["position"]: m["start"]["params"] for m in members}
    assert sorted(states) == list(range(len(ranks)))
    fresh = run_gloo(_fresh, world, ranks, KILL_STEP, states, timeout=240, pg_timeout_s=PG_TIMEOUT_S, leave_at_once=True)
    for rank, result in enumerate(results):
        if result[0] == "ok" and result[1].get("role") == "member":
            assert result[1]["after"] == fresh[rank]["after"], (rank, result[1]["after"], fresh[rank]["after"])
    assert any(m["after"] for m in members)  # some rank is a last stage and reported losses
    return members


@pytest.mark.parametrize("nodes_per_reader", [16, 2], ids=["each node alone", "nodes read and call in groups of 2"])
def test_a_spare_takes_the_killed_ranks_place_and_training_goes_on(nodes_per_reader):
    # In groups of 2 (5 nodes of 2: groups {0, 1}, {2, 3}, {4}) the victim's node reads the board
    # and makes the round's calls for node 3 too: the round goes on through its new delegate, or
    # node 3's own where it was the victim's monitor.
    world, spares, victim = 10, [8, 9], 5
    results = run_gloo(_train_through_a_failure, world, spares, victim, None, nodes_per_reader, timeout=400,
                       pg_timeout_s=PG_TIMEOUT_S, expect_failure=True, leave_at_once=True)
    assert results[victim][0] == "dead", results[victim]
    members = _check_against_a_fresh_run(results, world)
    assert members[0]["ranks"] == [0, 1, 2, 3, 4, 8, 6, 7] and members[0]["kind"] == "replace"
    for rank in (0, 1, 2, 3, 4, 6, 7, 8):
        assert results[rank] == ("ok", results[rank][1]) and results[rank][1]["role"] == "member", (rank, results[rank])
        assert results[rank][1]["plan"] == "replace: rank 5 -> 8; 1 spares left"
    assert results[9] == ("ok", {"role": "unused spare"})
    print("recovery seconds per rank:", {r: round(results[r][1]["recovery_seconds"], 1) for r in (0, 1, 2, 3, 4, 6, 7)})


def test_without_spares_the_replica_is_dropped_and_training_goes_on():
    world, victim = 8, 5
    results = run_gloo(_train_through_a_failure, world, [], victim, None, timeout=400,
                       pg_timeout_s=PG_TIMEOUT_S, expect_failure=True, leave_at_once=True)
    assert results[victim][0] == "dead", results[victim]
    members = _check_against_a_fresh_run(results, world)
    assert members[0]["ranks"] == [2, 3, 6, 7] and members[0]["kind"] == "shrink"
    for rank in (0, 1, 4):  # rank 5's replica: alive, but out of the grid
        assert results[rank][0] == "ok" and results[rank][1]["role"] == "left", (rank, results[rank])
    for rank in (2, 3, 6, 7):
        assert results[rank][1]["role"] == "member", (rank, results[rank])


def test_a_second_kill_during_the_recovery_is_recovered_in_the_same_call():
    """Rank 4 dies while the survivors recover from rank 5's death: the round that finds it
    does not commit, and the next one replaces both (a node lost rank by rank)."""
    world, spares, victim, second = 10, [8, 9], 5, 4
    results = run_gloo(_train_through_a_failure, world, spares, victim, second, timeout=400,
                       pg_timeout_s=PG_TIMEOUT_S, expect_failure=True, leave_at_once=True)
    assert results[victim][0] == "dead" and results[second][0] == "dead", (results[victim], results[second])
    members = _check_against_a_fresh_run(results, world)
    assert members[0]["ranks"] == [0, 1, 2, 3, 8, 9, 6, 7], members[0]["ranks"]
    for rank in (0, 1, 2, 3, 6, 7, 8, 9):
        outcome = results[rank]
        assert outcome[0] == "ok" and outcome[1]["role"] == "member", (rank, outcome)
        assert outcome[1]["plan"] == "replace: rank 4 -> 8, rank 5 -> 9; 0 spares left", (rank, outcome)
    print("recovery seconds per rank:", {r: round(results[r][1]["recovery_seconds"], 1) for r in (0, 1, 2, 3, 6, 7)})
