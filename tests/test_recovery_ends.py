"""Every way a recovery ends leaves each rank with a true view of the job.

- The spare the verdict chose dies: as soon as the verdict is in, inside its group's creation (the
  others already in torch's connection set-up with it), or in the probe of the surviving groups.
  The survivors end on the other spare, in the same call of ``recover`` or in its retry; nobody is
  held in torch past the round's time (a group's creation inside a recovery is bounded by it),
  and a round that ended in an error is closed for everyone, so the retry meets in a new one.
  A 6-rank gloo job: tp 2 x dp 2 on ranks 0-3, spares 4 and 5, collective timeout 8 s, the
  recovery's 20 s; rank 3 is SIGKILLed at step 2.
- An offer that is never taken up: rank 3 frozen past its progress timeout is counted out, the
  others shrink and finish without growing; rank 3's ``offer`` and the waiting rank's
  ``wait_as_spare`` both return a job they are not in, as the store has it.
- A grid planned for 6 ranks in a world of 8 takes the world's ranks 6 and 7 as its spares.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import fake_world, job_store, run_gloo, start_together

COLLECTIVE_S = 8.0
RECOVERY = timedelta(seconds=20)
STEPS, KILL_STEP = 5, 2


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _doom_the_spare(where: str) -> None:
    """Make this rank (spare 4) die at ``where`` of the recovery that chose it."""
    import hypergrid.recovery.rebuild as rebuild
    import hypergrid.recovery.round as rounds
    import hypergrid.runtime.create as create

    if where == "verdict":
        agree = rounds.RecoveryRound.agree

        def agree_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            verdict = agree(self, *args, **kwargs)
            if 3 in verdict.failed:
                _die()  # the verdict is in the store: it chose this rank
            return verdict

        rounds.RecoveryRound.agree = agree_then_die
    elif where == "creation":
        new_group = create.dist.new_group

        def new_group_then_die(*args: Any, **kwargs: Any) -> Any:
            if 4 in kwargs.get("ranks", ()) and len(kwargs["ranks"]) > 1:
                _die()  # it agreed to the group; the others are in torch's set-up, waiting for it
            return new_group(*args, **kwargs)

        create.dist.new_group = new_group_then_die  # type: ignore[attr-defined]
    elif where == "probe":
        pooled = rebuild.broken_groups

        def probe_then_die(*args: Any, **kwargs: Any) -> Any:
            _die()
            return pooled(*args, **kwargs)

        rebuild.broken_groups = probe_then_die  # the probe of the groups that survived, pooled


def _spare_dies(rank: int, world: int, where: str) -> dict:
    import hypergrid
    from hypergrid import HyperCommGrid, RecoverySettings, ResilientJob
    from hypergrid.errors import RecoveryError

    hypergrid.start_heartbeat(interval_s=0.5)
    start_together(job_store())  # the groups' 8 s timeout is the scenario's, not the start's
    grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=world)
    for dims in ("tp", "dp"):
        grid.create_pg(dims)
    job = ResilientJob.of_grid(grid, spares=[4, 5], timeout=RECOVERY, settings=RecoverySettings(gpus_per_node=1))
    if rank == 4:
        _doom_the_spare(where)
    out: dict[str, Any] = {"errors": []}
    if not job.in_grid:
        job = job.wait_as_spare(timeout=timedelta(seconds=150))
        if not job.in_grid:
            return {"role": "unused spare", "ranks": list(job.layout.ranks)}
    step = job.step or 0
    while step < STEPS:
        try:
            if rank == 3 and step == KILL_STEP:
                _die()
            for dims in ("tp", "dp"):
                dist.all_reduce(torch.ones(1), group=job.state.get_pg(dims))
            step += 1
        except RuntimeError:
            started = time.monotonic()
            for _ in range(2):  # the docs' loop retries once
                try:
                    job = hypergrid.recover(job, step=step)
                    break
                except RecoveryError as exc:
                    out["errors"].append(f"{time.monotonic() - started:.1f} s: {exc}"[:300])
            out["plan"] = job.last.describe()
            out["seconds"] = time.monotonic() - started
            step = job.step if job.step is not None else step
    out.update(role="member", ranks=list(job.layout.ranks), sums=[
        int(_sum(job.state.get_pg(dims))) for dims in ("tp", "dp")])
    job.release_spares()
    return out


def _sum(pg: dist.ProcessGroup) -> float:
    value = torch.ones(1)
    dist.all_reduce(value, group=pg)
    return float(value.item())


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("where", ["verdict", "creation", "probe"])
def test_the_spare_chosen_dies_and_the_survivors_end_on_the_other_spare(where):
    results = run_gloo(_spare_dies, 6, where, timeout=240, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    assert results[3][0] == "dead" and results[4][0] == "dead", (results[3], results[4])
    for rank in (0, 1, 2, 5):
        status, value = results[rank]
        assert status == "ok" and value["role"] == "member", (rank, results)
        assert value["ranks"] == [0, 1, 2, 5] and value["sums"] == [2, 2], (rank, value)
        if rank != 5:
            assert value["plan"] == "replace: rank 3 -> 5; 0 spares left", (rank, value)
            assert len(value["errors"]) <= 1, (rank, value["errors"])  # the same call, or its retry
            # Never held until a long torch timeout: the recovery's time, the collective timeout once.
            assert value["seconds"] < RECOVERY.total_seconds() + 2 * COLLECTIVE_S + 10, (rank, value)


def _offer_not_taken(rank: int, world: int) -> dict:
    import hypergrid
    from hypergrid import HyperCommGrid, RecoverySettings, ResilientJob
    from hypergrid.errors import ExcludedByRecovery

    store = job_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    hypergrid.start_heartbeat(interval_s=0.5, progress_timeout_s=4.0)
    grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=world)
    for dims in ("tp", "dp"):
        grid.create_pg(dims)
    job = ResilientJob.of_grid(grid, timeout=RECOVERY, settings=RecoverySettings(gpus_per_node=2))
    if rank == 0:
        threading.Thread(target=_freeze, args=(job_store(), 3), daemon=True).start()
    step = 0
    while step < STEPS and job.in_grid:
        try:
            if rank == 3 and step == KILL_STEP:
                store.set("freeze", "")
                time.sleep(1.0)  # frozen in here
            for dims in ("tp", "dp"):
                dist.all_reduce(torch.ones(1), group=job.state.get_pg(dims))
            step += 1
        except RuntimeError:
            try:
                job = hypergrid.recover(job, step=step)
            except ExcludedByRecovery:
                back = job.offer(timeout=timedelta(seconds=120))
                return {"role": "offered", "in_grid": back.in_grid, "ranks": list(back.layout.ranks),
                        "state": back.state is not None, "generation": back.generation}
            step = job.step if job.step is not None else step
    if not job.in_grid:
        after = job.wait_as_spare(timeout=timedelta(seconds=120))
        return {"role": "waited", "in_grid": after.in_grid, "ranks": list(after.layout.ranks),
                "generation": after.generation}
    store.wait(["thawed"], timedelta(seconds=120))
    time.sleep(3.0)  # rank 3 has offered itself by now: nobody grows, the job ends
    job.release_spares()
    return {"role": "member", "ranks": list(job.layout.ranks)}


def _freeze(store: dist.TCPStore, victim: int) -> None:
    store.wait(["freeze"], timedelta(seconds=120))
    pid = int(store.get(f"pid/{victim}").decode())
    os.kill(pid, signal.SIGSTOP)
    time.sleep(12.0)
    os.kill(pid, signal.SIGCONT)
    store.set("thawed", "")


@pytest.mark.gloo
@pytest.mark.slow
def test_an_offer_never_taken_up_returns_the_job_as_the_store_has_it():
    results = run_gloo(_offer_not_taken, 4, timeout=240, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    assert results[0] == ("ok", {"role": "member", "ranks": [0, 1]}) and results[1] == results[0], results
    assert results[2] == ("ok", {"role": "waited", "in_grid": False, "ranks": [0, 1], "generation": 1}), results
    assert results[3] == ("ok", {"role": "offered", "in_grid": False, "ranks": [0, 1], "state": False,
                                 "generation": 1}), results


def test_a_grid_planned_for_fewer_ranks_than_the_world_takes_the_world_s_ranks_as_spares():
    from hypergrid import HyperCommGrid, ResilientJob

    with fake_world(rank=0, world_size=8):
        grid = HyperCommGrid([2, 3], ["tp", "dp"], world_size=6)
        job = ResilientJob.of_grid(grid, spares=[6, 7])
        assert job.domain == tuple(range(8)) and job.spares == (6, 7)
        with pytest.raises(ValueError, match=r"spares must be ranks of the world \[0, 8\), got \[8\]"):
            ResilientJob.of_grid(grid, spares=[8])
