"""Recovery where jobs really fail: timeouts as users leave them, ranks lost one after another.

An 8-rank gloo job: a grid tp 2 x dp 3 on ranks 0-5, spares 6 and 7 (two ranks per node), the
store hosted outside the ranks (as torchrun's agent hosts it). Every step is an all-reduce on
the tp group, then on the dp group, and the loop is the docs' (``except RuntimeError: recover``).
The collective timeout (``init_process_group(timeout=...)``) is longer than the recovery's, as
with the defaults: when rank 3 dies, its tp peer and its dp peers fail at once, but ranks 0 and 4
sit in a dp all-reduce with rank 2, which has left for the recovery, until that collective times
out. The recovery waits for them (their heartbeats run) instead of counting them failed.

Checked on every rank: one placement holding only live ranks, the new groups' sums, the groups
that did not change are the same objects, nobody healthy is counted out, and every survivor is
back within the collective timeout plus a few seconds of the kill.
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

from tests.harness import job_store, run_gloo, start_together

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

WORLD, SPARES = 8, [6, 7]
COLLECTIVE_S = 12.0  # init_process_group's timeout: longer than the recovery's, as with the defaults
RECOVERY = timedelta(seconds=8)
STEPS, KILL_STEP = 6, 2
#: Beyond the collective timeout, what a survivor may take to be back (a loaded 2-core machine).
SLACK_S = 10.0


def _step(grid: Any) -> None:
    for dims in ("tp", "dp"):
        value = torch.ones(1)
        dist.all_reduce(value, group=grid.get_pg(dims))


def _sums(grid: Any, rank: int) -> dict:
    """Each of the grid's groups, checked with two all-reduces: (members, sum of ones, sum of ranks)."""
    out = {}
    for dims in ("tp", "dp"):
        pg = grid.get_pg(dims)
        ones, ranks = torch.ones(1), torch.tensor([float(rank)])
        dist.all_reduce(ones, group=pg)
        dist.all_reduce(ranks, group=pg)
        out[dims] = (dist.get_process_group_ranks(pg), int(ones.item()), int(ranks.item()))
    return out


def _die(store: dist.TCPStore) -> None:
    store.set("killed_at", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _field_job(rank: int, world: int, victim: int, during: Optional[int]) -> dict:
    import hypergrid
    from hypergrid import HyperCommGrid, RecoverySettings, ResilientJob

    store = job_store()
    hypergrid.start_heartbeat(interval_s=0.5)
    start_together(store)  # the job's 8 s start is the scenario's bound, not the machine's
    grid = HyperCommGrid([2, 3], ["tp", "dp"], world_size=world)
    for dims in ("tp", "dp"):
        grid.create_pg(dims)
    before = {dims: grid.get_pg(dims) for dims in ("tp", "dp")}
    job = ResilientJob.of_grid(grid, spares=SPARES, timeout=RECOVERY, settings=RecoverySettings(gpus_per_node=2))
    if during is not None and rank == during:
        from hypergrid.recovery import round as rounds
        from hypergrid.store import meeting
        from hypergrid.store.records import Arrival, encode

        def arrive_and_die(self: Any, domain: Any, arrival: Any, **kwargs: Any) -> Any:
            meeting.arrive(self.store, self.keys.arrivals, len(domain), encode(Arrival(rank)))  # then its node went
            _die(store)

        rounds.RecoveryRound.agree = arrive_and_die
    if not job.in_grid:
        job = job.wait_as_spare(timeout=timedelta(seconds=90))
        if not job.in_grid:
            return {"role": "unused spare"}
        return _report(job, rank, store, kept=None)
    step = 0
    while step < STEPS:
        try:
            if rank == victim and step == KILL_STEP:
                _die(store)
            _step(job.state)
            step += 1
        except RuntimeError:  # a peer is gone: the docs' loop
            job = hypergrid.recover(job, step=step)
            break
    kept = {dims: job.state.get_pg(dims) is before[dims] for dims in ("tp", "dp")} if job.in_grid else None
    return _report(job, rank, store, kept)


def _report(job: Any, rank: int, store: dist.TCPStore, kept: Optional[dict]) -> dict:
    back = time.time() - float(store.get("killed_at").decode())
    out = {"role": "member" if job.in_grid else "left", "ranks": list(job.layout.ranks), "plan": job.last.describe(),
           "back_s": back, "kept": kept, "step": job.step}
    if job.in_grid:
        out["sums"] = _sums(job.state, rank)
    job.release_spares()
    return out


def _run(victim: int, during: Optional[int] = None, backend: str = "gloo", collective_s: float = COLLECTIVE_S) -> list:
    return run_gloo(_field_job, WORLD, victim, during, timeout=240, pg_timeout_s=collective_s,
                    expect_failure=True, leave_at_once=True, backend=backend)


def _check(results: list, dead: set, placement: list[int], plan: str, within_s: float = COLLECTIVE_S + SLACK_S) -> None:
    for rank in dead:
        assert results[rank][0] == "dead", (rank, results[rank])
    members = {}
    for rank, (status, value) in enumerate(results):
        if rank in dead:
            continue
        assert status == "ok", (rank, value)
        if value["role"] == "unused spare":
            assert rank in SPARES and rank not in placement, (rank, value)
            continue
        assert value["ranks"] == placement and value["plan"] == plan, (rank, value)
        assert value["back_s"] < within_s, (rank, value["back_s"])
        members[rank] = value
    assert sorted(members) == sorted(placement), (sorted(members), placement)
    for rank, value in members.items():
        for dims, (ranks, ones, total) in value["sums"].items():
            assert rank in ranks and ones == len(ranks) and total == sum(ranks), (rank, dims, value["sums"])
    print("seconds from the kill to back in the grid:", {r: round(v["back_s"], 1) for r, v in members.items()})


def test_rank_3_killed_with_the_collective_timeout_longer_than_the_recoverys():
    results = _run(victim=3)
    _check(results, {3}, [0, 1, 2, 6, 4, 5], "replace: rank 3 -> 6; 1 spares left")
    # Ranks 0, 1, 4 and 5 keep their tp groups (no member changed, and they still work).
    for rank in (0, 1, 4, 5):
        assert results[rank][1]["kept"]["tp"], (rank, results[rank][1]["kept"])
    assert results[2][1]["kept"]["tp"] is False and results[1][1]["kept"]["dp"] is False


def test_rank_0_killed_its_node_mate_and_dp_peers_recover_onto_a_spare():
    results = _run(victim=0)
    _check(results, {0}, [6, 1, 2, 3, 4, 5], "replace: rank 0 -> 6; 1 spares left")
    for rank in (2, 3, 4, 5):
        assert results[rank][1]["kept"]["tp"], (rank, results[rank][1]["kept"])


def test_rank_1_dies_during_the_recovery_from_rank_3_and_both_are_replaced():
    results = _run(victim=3, during=1)
    _check(results, {1, 3}, [0, 6, 2, 7, 4, 5], "replace: rank 1 -> 6, rank 3 -> 7; 0 spares left")
    for rank in (4, 5):
        assert results[rank][1]["kept"]["tp"], (rank, results[rank][1]["kept"])


def test_on_a_backend_that_aborts_like_nccl_blocked_ranks_are_out_within_seconds():
    """The same loss with a collective timeout of a minute, on a test backend whose abort() ends the
    operations in flight (as NCCL's does): the ranks blocked in a collective with a peer that left
    are aborted out of it as soon as the recovery opens, so nobody waits for the timeout."""
    results = _run(victim=3, backend="abortable", collective_s=60.0)
    _check(results, {3}, [0, 1, 2, 6, 4, 5], "replace: rank 3 -> 6; 1 spares left", within_s=SLACK_S)
