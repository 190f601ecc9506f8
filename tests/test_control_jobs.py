"""The control plane in real jobs of 8 and 16 ranks on a backend that aborts like NCCL.

The grid is tp 2 x dp on every rank but the last two (spares); every step is an all-reduce on tp,
then on dp; the collective timeout is a minute (a rank blocked with a lost peer gets out only by
an abort), the heartbeat beats every 0.5 s (a node is lost after 2.5 s of silence), and the
progress timeout is left at its default (3 minutes) unless a scenario sets it.

- One rank holds the GIL for 10 s in one C call (a long pickling does the same), nobody dies:
  its monitor beats on, so no communicator is aborted and no recovery round opens, on any rank;
  every rank trains to the end with right sums.
- A rank is SIGKILLed: its monitor publishes the loss at once, every survivor's collective with it
  is aborted out within two heartbeat intervals (and a slack for this 2-core machine), and the
  survivors are back on the spare after the rebuild.
- A rank is frozen (SIGSTOP) for 15 s, past a progress timeout of 6 s: its monitor, which is not
  frozen, publishes it as hung; the others are aborted out and recover without it, and the frozen
  rank, let go, learns it was counted out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import job_store, run_gloo

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

COLLECTIVE_S = 60.0
INTERVAL_S = 0.5
STEPS, EVENT_STEP = 6, 2
#: On top of two heartbeat intervals, for a survivor's abort to reach its collective: processes on
#: a 2-core machine with 16 ranks and their monitors (measured: 0.0 to 0.4 s after the kill).
SLACK_S = 3.0
#: The progress timeout of the frozen-rank scenario, and how long the rank is frozen.
PROGRESS_S, FROZEN_S = 6.0, 15.0


def _job(rank: int, world: int, scenario: str, victim: int, progress_s: float) -> dict:
    import hypergrid
    from hypergrid import HyperCommGrid, RecoverySettings, ResilientJob
    from hypergrid.errors import ExcludedByRecovery
    from hypergrid.liveness.heartbeat import running_heartbeat
    from hypergrid.liveness.plane import control_plane
    from hypergrid.recovery.abort import take_aborted
    from hypergrid.recovery.round import read_state
    from hypergrid.store.records import EventKind

    store = job_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    hypergrid.start_heartbeat(interval_s=INTERVAL_S, progress_timeout_s=progress_s)
    spares = [world - 2, world - 1]
    grid = HyperCommGrid([2, (world - 2) // 2], ["tp", "dp"], world_size=world)
    for dims in ("tp", "dp"):
        grid.create_pg(dims)
    job = ResilientJob.of_grid(grid, spares=spares, timeout=timedelta(seconds=60), settings=RecoverySettings(gpus_per_node=2))
    if scenario == "stop" and rank == 0:
        threading.Thread(target=_freezer, args=(job_store(), victim), daemon=True).start()  # a client of its own
    out: dict[str, Any] = {"failures": [], "steps": 0}
    # When this rank's monitor handed it the victim's loss: a late abort then says whether the
    # event came late or the abort did not end the collective at once.
    heartbeat = running_heartbeat()
    assert heartbeat is not None
    heartbeat.listen("test: the victim's loss heard", lambda event: out.setdefault("heard_at", time.time())
                     if event.kind is EventKind.LOST and event.rank == victim else None)
    if not job.in_grid:
        job = job.wait_as_spare(timeout=timedelta(seconds=150))
        if not job.in_grid:
            return {"role": "unused spare", "aborted": take_aborted()}
        out["joined"] = True
    step = job.step or 0
    while step < STEPS:
        try:
            if rank == victim and step == EVENT_STEP and not out.get("done"):
                out["done"] = True
                if scenario == "gil":
                    libc = ctypes.PyDLL(ctypes.util.find_library("c"))  # keeps the GIL through the call
                    store.set("held_at", repr(time.time()))
                    libc.usleep(10_000_000)
                elif scenario == "kill":
                    store.set("killed_at", repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                elif scenario == "stop":
                    store.set("freeze", "")
                    time.sleep(1.0)  # frozen in here
            for dims in ("tp", "dp"):
                dist.all_reduce(torch.ones(1), group=job.state.get_pg(dims))
            step += 1
            out["steps"] += 1
        except RuntimeError as error:
            out["failures"].append({"step": step, "at": time.time(), "error": str(error)[:200]})
            if scenario == "kill":
                out["killed_at"] = float(store.get("killed_at").decode())
            try:
                job = hypergrid.recover(job, step=step)
            except ExcludedByRecovery as exc:
                return {"role": "excluded", "why": str(exc)}
            out["back"] = time.time()
            out["plan"] = job.last.describe() if job.last else None
            if not job.in_grid:
                return {"role": "left", **out}
            step = job.step if job.step is not None else step
    if scenario == "stop" and rank == 0:
        store.wait(["thawed"], timedelta(seconds=120))  # the freezer lives in this process: it must finish
    plane = control_plane()
    out.update(role="member", ranks=list(job.layout.ranks), aborted=take_aborted(),
               rounds=read_state(job.channel, plane.client(time.monotonic() + 10))[0].round,
               sums=_sums(job.state, rank))
    job.release_spares()
    return out


def _freezer(store: dist.TCPStore, victim: int) -> None:
    store.wait(["freeze"], timedelta(seconds=120))
    pid = int(store.get(f"pid/{victim}").decode())
    os.kill(pid, signal.SIGSTOP)
    store.set("frozen_at", repr(time.time()))
    time.sleep(FROZEN_S)
    os.kill(pid, signal.SIGCONT)
    store.set("thawed", "")


def _sums(grid: Any, rank: int) -> dict:
    out = {}
    for dims in ("tp", "dp"):
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=grid.get_pg(dims))
        out[dims] = (dist.get_process_group_ranks(grid.get_pg(dims)), int(value.item()))
    return out


def _run(world: int, scenario: str, victim: int, progress_s: float = 180.0) -> list:
    return run_gloo(_job, world, scenario, victim, progress_s, timeout=300, pg_timeout_s=COLLECTIVE_S,
                    expect_failure=True, leave_at_once=True, backend="abortable")


def _members(results: list, placement: list[int]) -> dict:
    members = {}
    for rank, (status, value) in enumerate(results):
        if status == "ok" and value["role"] == "member":
            members[rank] = value
    assert sorted(members) == sorted(placement), (sorted(members), placement, results)
    for rank, value in members.items():
        assert value["ranks"] == placement, (rank, value)
        for dims, (ranks, total) in value["sums"].items():
            assert rank in ranks and total == sum(ranks), (rank, dims, value["sums"])
    return members


@pytest.mark.parametrize("world", [8, 16])
def test_a_rank_holding_the_gil_for_10_s_is_not_taken_for_lost(world):
    results = _run(world, "gil", victim=3)
    members = _members(results, list(range(world - 2)))
    for rank, value in members.items():
        assert value["failures"] == [] and value["aborted"] == [] and value["rounds"] == 0, (rank, value)
        assert value["steps"] == STEPS, (rank, value)
    for rank in (world - 2, world - 1):
        assert results[rank] == ("ok", {"role": "unused spare", "aborted": []}), results[rank]


@pytest.mark.parametrize("world", [8, 16])
def test_a_rank_killed_is_aborted_out_of_within_two_intervals_and_the_survivors_recover(world):
    results = _run(world, "kill", victim=3)
    placement = [0, 1, 2, world - 2, *range(4, world - 2)]
    members = _members(results, placement)
    assert results[3][0] == "dead", results[3]
    for rank, value in members.items():
        if rank == world - 2:
            assert value.get("joined") and value["failures"] == [], value
            continue
        assert value["plan"] == f"replace: rank 3 -> {world - 2}; 1 spares left", (rank, value)
        (failure,) = value["failures"]
        assert failure["step"] == EVENT_STEP, (rank, value)
        # Its monitor handed it the loss, published by the victim's monitor as the process ended.
        assert value["heard_at"] - value["killed_at"] < 2 * INTERVAL_S + SLACK_S, (rank, value)
        # Its collective ended (aborted: the collective timeout is a minute) soon after the kill
        # (when the victim wrote it, just before its SIGKILL), and it was back long before the
        # collective timeout would have let it out.
        assert failure["at"] - value["killed_at"] < 2 * INTERVAL_S + SLACK_S, (rank, value)
        assert value["back"] - value["killed_at"] < COLLECTIVE_S / 2, (rank, value)
    # The other spare stayed one, in no group, until the job released it.
    assert results[world - 1] == ("ok", {"role": "unused spare", "aborted": []}), results[world - 1]


@pytest.mark.parametrize("world", [8, 16])
def test_a_rank_frozen_past_its_progress_timeout_is_counted_out_as_hung(world):
    results = _run(world, "stop", victim=3, progress_s=PROGRESS_S)
    placement = [0, 1, 2, world - 2, *range(4, world - 2)]
    members = _members(results, placement)
    for rank, value in members.items():
        if rank == world - 2:
            assert value.get("joined") and value["failures"] == [], value
            continue
        # Aborted out of its step with the frozen rank (or the step after), and back on the spare.
        assert [f["step"] for f in value["failures"]] in ([EVENT_STEP], [EVENT_STEP + 1]), (rank, value)
        assert value["plan"] == f"replace: rank 3 -> {world - 2}; 1 spares left", (rank, value)
    status, value = results[3]
    assert status == "ok" and value["role"] == "excluded" and "made no progress" in value["why"], results[3]
    assert results[world - 1] == ("ok", {"role": "unused spare", "aborted": []}), results[world - 1]
