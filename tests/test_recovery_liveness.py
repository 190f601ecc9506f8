"""Ranks that are alive but do not come: a hung main thread, a process frozen for a while.

A 6-rank gloo job: a grid tp 2 x dp 2 on ranks 0-3, spares 4 and 5 (two ranks per node), every
step an all-reduce on tp then on dp, the docs' loop. The collective timeout is 4 s, the
heartbeat beats every 0.5 s (a node is lost after 2.5 s of silence, plus an interval to see it),
and a rank whose interpreter makes no progress for 4 s is hung (the progress timeout, minutes by
default). A rank that is alive but does not come is waited for up to 4 + 5 + 3 = 12 s (the job's
longest collective timeout, a margin and the staleness bound) before it is counted out as hung.

- A rank whose main thread sleeps (its interpreter runs: it ticks its monitor) is counted out
  after that bound, with the reason, on every survivor alike; when it wakes it learns it is out.
- A rank frozen by SIGSTOP for longer than the progress timeout is published as hung by its
  monitor (which is not frozen: it is a process of its own) and counted out; one frozen for less
  (while the others recover from another loss) is waited for and stays in the grid.
- In each case the next failure is still recovered (rounds never get stuck).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from tests.harness import job_store, run_gloo, start_together

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

WORLD, SPARES = 6, [4, 5]
COLLECTIVE_S = 4.0
PROGRESS_TIMEOUT_S = 4.0
RECOVERY = timedelta(seconds=10)
STEPS = 7


@dataclass(frozen=True)
class Scenario:
    #: (rank, step) -> what happens to it at the start of that step: "die" or "hang".
    events: dict = field(default_factory=dict)
    #: Freeze rank ``frozen`` with SIGSTOP for ``freeze_s`` once the key "freeze" is set.
    frozen: Optional[int] = None
    freeze_s: float = 0.0


def _freezer(store: dist.TCPStore, scenario: Scenario) -> None:
    store.wait(["freeze"], timedelta(seconds=120))
    pid = int(store.get(f"pid/{scenario.frozen}").decode())
    os.kill(pid, signal.SIGSTOP)
    time.sleep(scenario.freeze_s)
    os.kill(pid, signal.SIGCONT)


def _sums(grid: Any, rank: int) -> dict:
    out = {}
    for dims in ("tp", "dp"):
        ranks = torch.tensor([float(rank)])
        dist.all_reduce(ranks, group=grid.get_pg(dims))
        out[dims] = (dist.get_process_group_ranks(grid.get_pg(dims)), int(ranks.item()))
    return out


def _liveness_job(rank: int, world: int, scenario: Scenario) -> dict:
    import hypergrid
    from hypergrid import HyperCommGrid, RecoverySettings, ResilientJob
    from hypergrid.errors import ExcludedByRecovery

    store = job_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    hypergrid.start_heartbeat(interval_s=0.5, progress_timeout_s=PROGRESS_TIMEOUT_S)
    start_together(store)  # the groups' 4 s timeout is the scenario's, not the start's
    grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=world)
    for dims in ("tp", "dp"):
        grid.create_pg(dims)
    job = ResilientJob.of_grid(grid, spares=SPARES, timeout=RECOVERY, settings=RecoverySettings(gpus_per_node=2))
    if rank == 0 and scenario.frozen is not None:
        threading.Thread(target=_freezer, args=(store, scenario), daemon=True).start()
    plans: list[str] = []
    if not job.in_grid:
        job = job.wait_as_spare(timeout=timedelta(seconds=120))
        if not job.in_grid:
            return {"role": "unused spare"}
        plans.append(job.last.describe())
    step = job.step or 0
    while step < STEPS:
        try:
            event = scenario.events.get((rank, step))
            if event == "die":
                if scenario.frozen is not None:
                    store.set("freeze", "")
                os.kill(os.getpid(), signal.SIGKILL)
            if event == "hang":
                time.sleep(25)  # the heartbeat runs on; the main thread does not come
            for dims in ("tp", "dp"):
                current = dims
                dist.all_reduce(torch.ones(1), group=job.state.get_pg(dims))
            step += 1
        except RuntimeError as error:
            logging.getLogger(__name__).info("rank %d, step %d, %s %s: %s", rank, step, current,
                                             dist.get_process_group_ranks(job.state.get_pg(current)), error)
            try:
                job = hypergrid.recover(job, step=step)
            except ExcludedByRecovery as exc:
                return {"role": "excluded", "why": str(exc)}
            plans.append(job.last.describe())
            if not job.in_grid:
                return {"role": "left", "ranks": list(job.layout.ranks), "plans": plans}
            step = job.step
    out = {"role": "member", "ranks": list(job.layout.ranks), "plans": plans, "sums": _sums(job.state, rank)}
    job.release_spares()
    return out


def _run(scenario: Scenario) -> list:
    return run_gloo(_liveness_job, WORLD, scenario, timeout=240, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                    leave_at_once=True)


def _members(results: list, placement: list[int], plans: list[str]) -> None:
    """Every rank of ``placement`` finished as a member of it, after the recoveries ``plans`` (a
    spare that joined later saw only the later ones), and its groups sum right."""
    for rank in placement:
        status, value = results[rank]
        assert status == "ok" and value["role"] == "member", (rank, results[rank])
        assert value["ranks"] == placement, (rank, value)
        assert value["plans"] and value["plans"] == plans[-len(value["plans"]):], (rank, value["plans"])
        for dims, (ranks, total) in value["sums"].items():
            assert rank in ranks and total == sum(ranks), (rank, dims, value["sums"])


def test_a_hung_rank_is_counted_out_after_the_bound_and_the_next_failure_is_recovered():
    results = _run(Scenario(events={(3, 2): "hang", (1, 4): "die"}))
    _members(results, [0, 5, 2, 4], ["replace: rank 3 -> 4; 1 spares left", "replace: rank 1 -> 5; 0 spares left"])
    assert results[1][0] == "dead", results[1]
    status, value = results[3]
    assert status == "ok" and value["role"] == "excluded" and "hangs" in value["why"], results[3]


def test_a_rank_frozen_longer_than_the_progress_timeout_is_counted_out_and_the_next_failure_is_recovered():
    # Rank 2 dies and rank 3, its node-mate, is frozen for 8 s: the node is replaced by the spare
    # node; then rank 1 dies with no spare left, and its replica (ranks 0 and 1) is dropped.
    results = _run(Scenario(events={(2, 2): "die", (1, 4): "die"}, frozen=3, freeze_s=8.0))
    for rank in (4, 5):
        status, value = results[rank]
        assert status == "ok" and value["role"] == "member" and value["ranks"] == [4, 5], (rank, results)
        assert value["plans"][-1].startswith("shrink"), (rank, value["plans"])
    status, value = results[0]
    assert status == "ok" and value["role"] == "left", results
    assert value["plans"][0] == "replace: rank 2 -> 4, rank 3 -> 5; 0 spares left", value
    assert results[1][0] == "dead" and results[2][0] == "dead", results
    status, value = results[3]
    assert status == "ok" and value["role"] == "excluded" and "made no progress" in value["why"], results[3]


def test_a_rank_frozen_for_less_than_the_progress_timeout_is_waited_for_and_the_next_failure_is_recovered():
    # Rank 1 dies and rank 3 is frozen for 2 s meanwhile (its monitor beats on; its interpreter
    # is quiet, not long enough to be hung): it stays in the grid; then rank 2 dies and the last
    # spare takes it.
    results = _run(Scenario(events={(1, 2): "die", (2, 4): "die"}, frozen=3, freeze_s=2.0))
    _members(results, [0, 4, 5, 3], ["replace: rank 1 -> 4; 1 spares left", "replace: rank 2 -> 5; 0 spares left"])
