"""Recovery rounds that never get stuck: each is named by the job and counted in the store.

A 6-rank gloo job: a grid tp 2 x dp 2 on ranks 0-3, spares 4 and 5 (two ranks per node),
heartbeats every 0.5 s, a collective timeout of 4 s. Each scenario is one that used to leave the
job unable to recover:

- a round in which nobody is found failed (every rank calls ``recover`` at once): it ends, and a
  later real death is found and recovered; the spares go back to waiting, without spinning, and
  the job's release reaches them;
- the spare a plan uses dies as the verdict is written: the same call recovers onto the other;
- an attempt that fails past the recovery's deadline is a ``RecoveryError`` on every survivor,
  and a retry agrees afresh and recovers;
- a second job on the same ranks: its spares wait for it (the first job's release is not theirs)
  and replace a rank that dies;
- a job (of 2 ranks; of 4, spares 2 and 3) whose board holds entries of its earlier life: a recovery reads the board from
  where the last committed round's leader had read it, so its requests do not grow with them,
  and a loss after that round's verdict or commit is still seen by every participant of the next.

Plus the inputs that used to be accepted or fail deep inside, each a clear error naming the value.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hypergrid import HyperCommGrid, ResilientJob, recover
from hypergrid.recovery.settings import RecoverySettings
from tests.harness import fake_world, run_gloo

WORLD, SPARES = 6, [4, 5]
COLLECTIVE_S = 4.0
RECOVERY = timedelta(seconds=10)


def _job(world: int) -> Any:
    import hypergrid

    hypergrid.start_heartbeat(interval_s=0.5)
    grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=world)
    for dims in ("tp", "dp"):
        grid.create_pg(dims)
    return ResilientJob.of_grid(grid, spares=SPARES, timeout=RECOVERY, settings=RecoverySettings(gpus_per_node=2))


def _step(job: Any) -> None:
    for dims in ("tp", "dp"):
        dist.all_reduce(torch.ones(1), group=job.state.get_pg(dims))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spare(job: Any) -> dict:
    """A spare's life: wait, take part in rounds, and say how it ended and what its wait cost."""
    started, cpu = time.monotonic(), _cpu_s()
    job = job.wait_as_spare(timeout=timedelta(seconds=120))
    out = {"in_grid": job.in_grid, "waited_s": time.monotonic() - started, "cpu_s": _cpu_s() - cpu,
           "generation": job.generation}
    if job.in_grid:
        _step(job)
        out["ranks"] = list(job.layout.ranks)
        job.release_spares()
    return out


def _rank_3_dies(job: Any, rank: int, *, settle_s: float = 0.5, retry: bool = False) -> dict:
    """Rank 3 SIGKILLs itself; the others, a moment later (``settle_s``), find it in a step and
    recover (``retry``: once more after a ``RecoveryError``, as the docs' loop would), then step on
    the new groups and release the spares. What each ends on."""
    from hypergrid.errors import RecoveryError

    first = None
    try:
        if rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(settle_s)
        _step(job)
    except RuntimeError:
        try:
            job = recover(job)
        except RecoveryError as exc:
            if not retry:
                raise
            first = type(exc).__name__
            job = recover(job)
    _step(job)
    job.release_spares()
    out = {"ranks": list(job.layout.ranks), "plan": job.last.describe()}
    return dict(out, first=first) if retry else out


# ---------------------------------------------------------------------- nobody failed
def _nobody_then_a_death(rank: int, world: int) -> dict:
    job = _job(world)
    if not job.in_grid:
        return _spare(job)
    _step(job)
    job = recover(job, step=1)  # every grid rank at once, nobody failed
    repaired = (job.last, list(job.layout.ranks), job.generation, job.step)
    _step(job)
    try:
        if rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1.0)
        _step(job)
    except RuntimeError:
        job = recover(job, step=2)
    _step(job)
    time.sleep(2.0)  # the unused spare waits a while longer: what its wait costs is measured
    job.release_spares()
    return {"repaired": repaired, "ranks": list(job.layout.ranks), "plan": job.last.describe()}


@pytest.mark.gloo
@pytest.mark.slow
def test_a_round_where_nobody_failed_ends_and_a_later_death_is_recovered():
    results = run_gloo(_nobody_then_a_death, WORLD, timeout=150, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    assert results[3][0] == "dead", results[3]
    for rank in (0, 1, 2):
        status, value = results[rank]
        assert status == "ok" and value["repaired"] == (None, [0, 1, 2, 3], 1, 1), (rank, results[rank])
        assert value["ranks"] == [0, 1, 2, 4] and value["plan"] == "replace: rank 3 -> 4; 1 spares left", value
    assert results[4] == ("ok", results[4][1]) and results[4][1]["ranks"] == [0, 1, 2, 4], results[4]
    spare = results[5][1]
    assert results[5][0] == "ok" and spare["in_grid"] is False and spare["generation"] == 2, results[5]
    # It waited through two rounds and a release; it used to spin at a full core in such a wait.
    assert spare["cpu_s"] < 0.5 * spare["waited_s"], spare


# ---------------------------------------------------------------------- a spare dies as it is used
def _spare_dies_when_used(rank: int, world: int) -> dict:
    job = _job(world)
    if rank == 4:
        from hypergrid.recovery import driver as rounds

        original = rounds.attempt

        def dying(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)  # the verdict is written; the plan puts this spare in
            return original(*args, **kwargs)

        rounds.attempt = dying
    if not job.in_grid:
        return _spare(job)
    return _rank_3_dies(job, rank)


@pytest.mark.gloo
@pytest.mark.slow
def test_the_spare_a_plan_uses_dies_and_the_same_call_recovers_onto_the_other():
    results = run_gloo(_spare_dies_when_used, WORLD, timeout=150, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    assert results[3][0] == "dead" and results[4][0] == "dead", (results[3], results[4])
    for rank in (0, 1, 2):
        status, value = results[rank]
        assert status == "ok" and value == {"ranks": [0, 1, 2, 5], "plan": "replace: rank 3 -> 5; 0 spares left"}, \
            (rank, results[rank])
    assert results[5][0] == "ok" and results[5][1]["ranks"] == [0, 1, 2, 5], results[5]


# ---------------------------------------------------------------------- an error, then a retry
def _fail_then_retry(rank: int, world: int) -> dict:
    job = _job(world)
    if rank == 1:
        from hypergrid.recovery import driver as rounds

        original, calls = rounds.build, []

        def slow(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:
                time.sleep(RECOVERY.total_seconds() + 4)  # alive, but past the recovery's deadline
            return original(*args, **kwargs)

        rounds.build = slow
    if not job.in_grid:
        return _spare(job)
    return _rank_3_dies(job, rank, retry=True)


@pytest.mark.gloo
@pytest.mark.slow
def test_an_attempt_past_the_deadline_is_a_recovery_error_everywhere_and_a_retry_agrees_afresh():
    results = run_gloo(_fail_then_retry, WORLD, timeout=180, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    assert results[3][0] == "dead", results[3]
    for rank in (0, 1, 2):
        status, value = results[rank]
        assert status == "ok" and value == {"first": "RecoveryError", "ranks": [0, 1, 2, 4],
                                            "plan": "replace: rank 3 -> 4; 1 spares left"}, (rank, results[rank])
    assert results[4][0] == "ok" and results[4][1]["ranks"] == [0, 1, 2, 4], results[4]


# ---------------------------------------------------------------------- a second job on the same ranks
def _two_jobs(rank: int, world: int) -> dict:
    first = _job(world)
    if first.in_grid:
        first.release_spares()
    else:
        assert first.wait_as_spare(timeout=timedelta(seconds=60)).in_grid is False
    second = _job(world)  # the same ranks, the same grid: a job of its own
    assert second.channel != first.channel
    if not second.in_grid:
        return _spare(second)
    # The spares are waiting by the time rank 3 is missed: the first job's release must not end their wait.
    return _rank_3_dies(second, rank, settle_s=2.0)


@pytest.mark.gloo
@pytest.mark.slow
def test_a_second_job_on_the_same_ranks_has_spares_of_its_own():
    results = run_gloo(_two_jobs, WORLD, timeout=150, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    for rank in (0, 1, 2):
        status, value = results[rank]
        assert status == "ok" and value == {"ranks": [0, 1, 2, 4], "plan": "replace: rank 3 -> 4; 1 spares left"}, \
            (rank, results[rank])
    assert results[4][0] == "ok" and results[4][1]["ranks"] == [0, 1, 2, 4], results[4]
    assert results[5][0] == "ok" and results[5][1]["in_grid"] is False and results[5][1]["waited_s"] > 1.5, results[5]


# ---------------------------------------------------------------------- the board's history
class BoardRequests:
    """This process's store requests on ``channel``'s board (its entries and its count), counted by
    wrapping :class:`~hypergrid.store.client.StoreClient`'s calls, through which a rank reads and
    writes the board (its monitor, a process of its own, is not counted)."""

    CALLS = ("get", "get_within", "check", "wait", "set", "add", "compare_set")

    def __init__(self, channel: Any) -> None:
        from hypergrid.store.client import StoreClient

        self.prefix = channel.board_count()[:-1]  # ".../event": the entries ("event/<k>") and the count ("events")
        self.count = 0
        for name in self.CALLS:
            setattr(StoreClient, name, self._counted(getattr(StoreClient, name)))

    def _counted(self, original: Any) -> Any:
        def counted(client: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
            first = key[0] if isinstance(key, list) else key
            self.count += first.startswith(self.prefix)
            return original(client, key, *args, **kwargs)

        return counted


def _job_on(world: int, *, grid: list[int], spares: list[int]) -> Any:
    """A job whose grid is dp over ``grid``, heartbeats every 0.5 s."""
    import hypergrid

    hypergrid.start_heartbeat(interval_s=0.5)
    made = HyperCommGrid(grid, ["dp"], world_size=world)
    made.create_pg("dp")
    return ResilientJob.of_grid(made, spares=spares, timeout=RECOVERY, settings=RecoverySettings(gpus_per_node=2))


def _earlier_losses(job: Any, ranks: range) -> None:
    """Publish the losses of ``ranks`` on the job's board, one entry each, as monitors did in the
    job's earlier life (ranks the job no longer counts on)."""
    from hypergrid.liveness.plane import control_plane
    from hypergrid.recovery.round import board_view
    from hypergrid.store.records import BoardEvent, EventKind

    board = board_view(job.channel, control_plane())
    for r in ranks:
        board.publish_event(BoardEvent(EventKind.LOST, r, "its process ended", by=r))


EARLIER = 200


def _board_requests_per_recovery(rank: int, world: int) -> list[int]:
    """Three recoveries of a 2-rank job in which nobody failed (each commits): before the second,
    :data:`EARLIER` losses are published. Rank 1 leaves each rebuild's probe of the groups 1.5 s
    late, so that rank 0's next wait (a world step of the rebuild) outlasts its slices and looks at
    the board too. The board requests this rank made in each recovery."""
    from hypergrid.recovery import rebuild

    job = _job_on(world, grid=[2], spares=[])
    if rank == 1:
        original = rebuild.broken_groups

        def late(*args: Any, **kwargs: Any) -> Any:
            found = original(*args, **kwargs)
            time.sleep(1.5)
            return found

        rebuild.broken_groups = late
    requests, counts = BoardRequests(job.channel), []
    for n in range(3):
        if n == 1 and rank == 0:
            _earlier_losses(job, range(100, 100 + EARLIER))  # after the last commit: the next recovery reads them
        before = requests.count
        job = recover(job, step=n)
        counts.append(requests.count - before)
    job.release_spares()
    return counts


@pytest.mark.gloo
@pytest.mark.slow
def test_a_recovery_reads_the_board_from_the_last_commit_not_from_its_first_entry():
    results = run_gloo(_board_requests_per_recovery, 2, timeout=120, pg_timeout_s=COLLECTIVE_S)
    empty, published, after = (sum(rank[n] for rank in results) for n in range(3))
    # The losses published since the last commit are read (two requests each, by the leader and
    # by the other rank's wait, each its own view).
    assert published >= 2 * EARLIER, results
    # The next recovery reads on from where the committed round's leader had read: the board's
    # earlier entries cost nothing (read from the first entry, they cost some 400 requests on each
    # rank that looked). A few looks more or less: the waits' slices vary.
    assert after <= empty + 16 and after < EARLIER // 4, results


def _lost_since_the_last_commit(rank: int, world: int) -> dict:
    """A 4-rank job, grid on ranks 0 and 1, spares 2 and 3, with 5 losses of its earlier life on its
    board. A recovery in which nobody failed commits, while spare 3 dies once it has the verdict;
    then rank 1 dies. Rank 0 recovers once both losses are on the board: each participant's view
    of the board in that round, and its verdict."""
    from hypergrid.liveness.plane import control_plane
    from hypergrid.recovery import driver as rounds
    from hypergrid.recovery import round as control_rounds
    from hypergrid.recovery.round import board_view

    job = _job_on(world, grid=[2], spares=[2, 3])
    if rank == 0:
        _earlier_losses(job, range(100, 105))
    seen: list[dict] = []
    agree = control_rounds.RecoveryRound.agree

    def watched(rnd: Any, domain: Any, arrival: Any, *, bound_s: float, board: Any, **kwargs: Any) -> Any:
        start = board.seen
        verdict = agree(rnd, domain, arrival, bound_s=bound_s, board=board, **kwargs)
        seen.append({"round": rnd.number, "start": start, "lost": sorted(board.refresh()),
                     "failed": verdict.failed, "reasons": verdict.reasons})
        return verdict

    control_rounds.RecoveryRound.agree = watched
    if rank == 3:
        original = rounds.attempt

        def dying(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)  # it has the verdict; the others commit without it
            return original(*args, **kwargs)

        rounds.attempt = dying
    if not job.in_grid:
        job = job.wait_as_spare(timeout=timedelta(seconds=90))
        return {"seen": seen, "ranks": list(job.layout.ranks)}
    job = recover(job, step=1)  # nobody failed: it commits
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    board, until = board_view(job.channel, control_plane()), time.monotonic() + 60
    while board.lost_among([1, 3]) != [1, 3] and time.monotonic() < until:
        time.sleep(0.1)
    job = recover(job, step=2)
    job.release_spares()
    return {"seen": seen, "ranks": list(job.layout.ranks), "plan": job.last.describe()}


@pytest.mark.gloo
@pytest.mark.slow
def test_losses_after_the_last_round_s_verdict_are_seen_by_every_participant_of_the_next_round():
    results = run_gloo(_lost_since_the_last_commit, 4, timeout=150, pg_timeout_s=COLLECTIVE_S,
                       expect_failure=True, leave_at_once=True)
    assert results[1][0] == "dead" and results[3][0] == "dead", (results[1], results[3])
    assert results[0][0] == "ok" and results[0][1]["plan"] == "replace: rank 1 -> 2; 0 spares left", results[0]
    for rank in (0, 2):
        status, value = results[rank]
        assert status == "ok" and value["ranks"] == [0, 2], (rank, results[rank])
        first, second = value["seen"][0], value["seen"][-1]
        assert first["failed"] == () and second["round"] == first["round"] + 1, (rank, value["seen"])
        # Its view of the round started past the job's earlier entries, and still holds both
        # losses: spare 3's (after the last verdict) and rank 1's (after the last commit).
        assert second["start"] >= 5 and {1, 3} <= set(second["lost"]), (rank, second)
        assert second["failed"] == (1, 3) and second["reasons"] == (
            "rank 1: its process ended before it arrived", "rank 3: its process ended before it arrived"), (rank, second)


# ---------------------------------------------------------------------- inputs
def _grid_job(world: int = 10) -> ResilientJob:
    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    grid.create_pg("tp")
    return ResilientJob.of_grid(grid, spares=[8, 9], settings=RecoverySettings(gpus_per_node=2))


@pytest.mark.parametrize("failed, error, words", [
    ([99], ValueError, "failed must be ranks of the world [0, 10), got [99]"),
    ([-1], ValueError, "got [-1]"),
    ([], ValueError, "failed must name at least one rank of the job"),
    ([True], TypeError, "a rank in failed must be an int, got bool True"),
    ([5.7], TypeError, "got float 5.7"),
    (["5"], TypeError, "got str '5'"),
    (5, TypeError, "failed must be a sequence of ranks, got int 5"),
])
def test_a_failed_set_that_is_not_ranks_of_the_job_is_refused_naming_it(failed, error, words):
    with fake_world(0, 10):
        job = _grid_job()
        with pytest.raises(error) as caught:
            job.recover(failed=failed)
        assert words in str(caught.value)
        job.state.destroy()


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(timeout=30), TypeError, "timeout must be a datetime.timedelta, got int 30"),
    (dict(timeout=timedelta(0)), ValueError, "timeout must be positive, got 0:00:00"),
    (dict(step=-1), ValueError, "step must be >= 0, got -1"),
    (dict(step=1.5), TypeError, "step must be an int, got float 1.5"),
])
def test_a_bad_timeout_or_step_is_refused_naming_it(kwargs, error, words):
    with fake_world(0, 10):
        job = _grid_job()
        with pytest.raises(error, match=words.replace("(", "\\(").replace(")", "\\)")):
            job.recover(failed=[5], **kwargs)
        job.state.destroy()


@pytest.mark.parametrize("spares, error, words", [
    ([99], ValueError, "spares must be ranks of the world [0, 10), got [99]"),
    ([-1], ValueError, "got [-1]"),
    (8, TypeError, "spares must be a sequence of ranks, got int 8"),
    ([3], ValueError, "spares must be ranks outside the grid, got [3]"),
])
def test_spares_that_are_not_ranks_outside_the_grid_are_refused_naming_them(spares, error, words):
    with fake_world(0, 10):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        with pytest.raises(error) as caught:
            ResilientJob.of_grid(grid, spares=spares)
        assert words in str(caught.value)
        grid.destroy()


def test_recover_takes_a_job_and_says_so():
    with pytest.raises(TypeError, match="job must be a ResilientJob.*got str"):
        recover("job")


def test_a_megatron_job_gives_its_groups_the_jobs_timeout_unless_told_otherwise():
    pytest.importorskip("megatron.core")
    from hypergrid.megatron import destroy_model_parallel

    sizes = dict(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    with fake_world(0, 4):
        job = ResilientJob.of_megatron(timeout=timedelta(seconds=90), **sizes)
        assert job.collective_timeout == timedelta(seconds=90) and job.timeout == timedelta(seconds=90)
        assert job.recipe.config.distributed_timeout_minutes == 1.5
        destroy_model_parallel()
    with fake_world(0, 4):
        job = ResilientJob.of_megatron(distributed_timeout_minutes=30, **sizes)
        assert job.collective_timeout == timedelta(minutes=30)
        destroy_model_parallel()
