"""Recovering in-process, piece by piece: re-placed grids and Megatron state on one simulated rank,
the survivors' agreement on who is gone, and the probe of groups that outlived a failure.

The whole loop (a rank SIGKILLed mid-step, training going on) is tests/test_recovery_training.py.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hypergrid import HyperCommGrid, ResilientJob, recover
from hypergrid.errors import RecoveryRefused
from hypergrid.recovery.settings import RecoverySettings
from hypergrid.runtime.registry import REGISTRY
from tests.harness import fake_world, run_gloo

SIZES = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False)


def _count_new_groups(monkeypatch) -> list:
    made: list = []
    original = dist.new_group

    @functools.wraps(original)  # keeps the signature hypergrid reads its features from
    def counting(*args, **kwargs):
        made.append(kwargs.get("ranks", args[0] if args else None))
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", counting)
    return made


@pytest.mark.parametrize("rank", [0, 4, 6, 8, 9])
def test_a_grid_job_keeps_unchanged_groups_and_makes_only_the_changed_ones(rank, monkeypatch):
    with fake_world(rank, 10):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        before = {dims: grid.create_pg(dims) for dims in ("tp", "dp", "pp")}
        job = ResilientJob.of_grid(grid, spares=[8, 9], settings=RecoverySettings(gpus_per_node=2))
        made = _count_new_groups(monkeypatch)
        after = job.recover(failed=[5])
        assert list(after.layout.ranks) == [0, 1, 2, 3, 4, 8, 6, 7] and after.spares == (9,)
        new = after.state
        for dims, old in before.items():
            members = new.ranks(dims, rank) if after.in_grid else None
            if members is None:
                assert new.get_pg(dims) is None
                continue
            changed = 8 in members
            assert (new.get_pg(dims) is old) is (not changed and old is not None), (dims, members)
            if changed:
                assert dist.get_process_group_ranks(new.get_pg(dims)) == members  # in position order
        assert len(made) == sum(1 for dims in before if after.in_grid and 8 in new.ranks(dims, rank))
        assert grid.is_current_rank_in_grid() is (rank < 8) and after.in_grid is (rank != 9)
        new.destroy()
        assert REGISTRY.count() == 0


def test_without_spares_the_replica_is_dropped_and_its_survivors_leave():
    with fake_world(0, 8):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        tp = grid.create_pg("tp")
        after = recover(ResilientJob.of_grid(grid), failed=[5])
        assert after.last.kind.value == "shrink" and list(after.layout.ranks) == [2, 3, 6, 7]
        assert not after.in_grid and after.spares == (0, 1, 4)
        assert after.state.get_pg("tp") is None and REGISTRY.holders_of(tp) == set()
        after.state.destroy()
    with fake_world(3, 8):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        tp = grid.create_pg("tp")
        after = recover(ResilientJob.of_grid(grid), failed=[5])
        assert after.in_grid and after.state.get_pg("tp") is tp and after.state.ranks("dp") == [3]
        after.state.destroy()


def test_a_grid_with_views_cannot_shrink_and_says_why():
    with fake_world(0, 8):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        grid.register_view("expert", [4, 2], ["ep", "pp"], shared_dims=["pp"])
        grid.create_pg("tp")
        with pytest.raises(RecoveryRefused, match="views \\['expert'\\] cannot shrink"):
            recover(ResilientJob.of_grid(grid), failed=[5])
        grid.destroy()


def test_a_refused_plan_is_refused_on_every_rank_alike():
    with fake_world(0, 4):
        grid = HyperCommGrid([2, 1, 2], ["tp", "dp", "pp"])
        with pytest.raises(RecoveryRefused, match="every one of the 1 replicas of 'dp' holds a failed rank"):
            recover(ResilientJob.of_grid(grid), failed=[3])
        grid.destroy()


def test_recovery_is_refused_where_torch_can_make_no_group_among_its_members(monkeypatch):
    """TorchComms making every new_group a split of the world's: no way to leave the dead rank out.
    (Recovery on a world bound to a device is tests/test_recovery_split.py.)"""
    import hypergrid.recovery.rebuild as rebuild
    from hypergrid.runtime.modes import JobSetup
    from hypergrid.runtime.torch_compat import TorchCommsSubgroups

    with fake_world(0, 10):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        job = ResilientJob.of_grid(grid, spares=[8, 9], settings=RecoverySettings(gpus_per_node=2))
        monkeypatch.setattr(rebuild, "job_setup", lambda: JobSetup("nccl", None, None, TorchCommsSubgroups.WORLD_SPLIT))
        with pytest.raises(RecoveryRefused, match="TorchComms .* makes every new_group a split"):
            job.recover(failed=[5])
        grid.destroy()


def _megatron_globals() -> dict:
    from megatron.core import parallel_state as ps

    names = ["_DATA_PARALLEL_GLOBAL_RANKS", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "_PIPELINE_GLOBAL_RANKS",
             "_EMBEDDING_GLOBAL_RANKS", "_MODEL_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP"]
    out = {name: getattr(ps, name) for name in names}
    out["getters"] = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
                      ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_next_rank(),
                      ps.get_data_parallel_world_size())
    return out


@pytest.mark.parametrize("rank", [1, 4, 7, 8])
def test_parallel_state_after_a_recovery_is_what_a_fresh_start_on_that_placement_gives(rank):
    pytest.importorskip("megatron.core")
    from hypergrid.megatron import destroy_model_parallel

    with fake_world(rank, 10):
        job = ResilientJob.of_megatron(spares=[8, 9], settings=RecoverySettings(gpus_per_node=2), **SIZES)
        after = job.recover(failed=[5])
        recovered = _megatron_globals() if after.in_grid else None
        destroy_model_parallel()
    with fake_world(rank, 10):
        fresh = ResilientJob.of_megatron(ranks=[0, 1, 2, 3, 4, 8, 6, 7], **SIZES)
        assert fresh.in_grid is after.in_grid
        if fresh.in_grid:
            assert _megatron_globals() == recovered
        destroy_model_parallel()
    if rank == 8:  # the spare in position 5: data-parallel rank 0 of [8, 7], as rank 5 was
        assert recovered["_DATA_PARALLEL_GLOBAL_RANKS"] == [8, 7] and recovered["getters"][1] == 0


# ---------------------------------------------------------------------- multi-process pieces
def _board(channel, plane, rank: int, world: int, nodes_of: int):
    """The job's board as this rank's recovery reads it: heard through its heartbeat's monitor
    (``nodes_of`` ranks per node, a delegate each), or looked at in the store (0)."""
    from hypergrid.liveness.heartbeat import start_heartbeat
    from hypergrid.liveness.monitor import JobSpec
    from hypergrid.liveness.ring import as_runs
    from hypergrid.recovery.round import board_view

    board = board_view(channel, plane)
    if nodes_of:
        beat = start_heartbeat(0.5, progress_timeout_s=60.0)
        beat.attach(JobSpec(channel, tuple(as_runs(range(world))), nodes_of))
        board.hear_from(beat)
    return board


def _agree(rank: int, world: int, nodes_of: int = 0) -> tuple:
    from hypergrid.errors import ExcludedByRecovery
    from hypergrid.liveness.plane import control_plane
    from hypergrid.recovery.round import RecoveryRound
    from hypergrid.store.keys import JobChannel
    from hypergrid.store.records import Arrival, BoardEvent, EventKind

    plane = control_plane()
    channel = JobChannel.of(range(world), 0, plane.namespace)
    board = _board(channel, plane, rank, world, nodes_of)
    time.sleep(1.0)  # every monitor has attached: none starts reading the board past the loss
    if rank == 2:  # its monitor would say so: its process ended (it still arrives, late, to learn it)
        board.publish_event(BoardEvent(EventKind.LOST, 2, "its process ended", by=2))
    if rank in (2, 3):
        time.sleep(6)  # rank 3 is alive, but does not come within the bound: it hangs
    rnd = RecoveryRound.open(channel, plane, time.monotonic() + 20)
    try:
        verdict = rnd.agree(range(world), Arrival(rank), bound_s=2.0, board=board, settings=RecoverySettings())
    except ExcludedByRecovery as exc:
        return ("excluded", str(exc))
    return ("failed", verdict.failed)


@pytest.mark.gloo
@pytest.mark.parametrize("nodes_of", [0, 2, 4], ids=["store-waits", "heard-nodes-of-2", "heard-one-node"])
def test_survivors_agree_on_who_is_gone_and_a_late_rank_learns_it_was_counted_out(nodes_of):
    # Heard: the verdict reaches the participants through their monitors (one wait on the board per node).
    results = run_gloo(_agree, 4, nodes_of, timeout=90)
    assert [r[:2] for r in results[:2]] == [("failed", (2, 3))] * 2, results
    for rank, why in ((2, "its process ended before it arrived"), (3, "it hangs")):
        assert results[rank][0] == "excluded" and "itself among them" in results[rank][1], results[rank]
        assert why in results[rank][1], results[rank]


def _contenders_die(rank: int, world: int, nodes_of: int = 0) -> tuple:
    from hypergrid.liveness.plane import control_plane
    from hypergrid.recovery.round import RecoveryRound
    from hypergrid.store import meeting
    from hypergrid.store.keys import JobChannel
    from hypergrid.store.records import Arrival, BoardEvent, EventKind, encode

    plane = control_plane()
    channel = JobChannel.of(range(world), 0, plane.namespace)
    board = _board(channel, plane, rank, world, nodes_of)
    time.sleep(1.0)
    rnd = RecoveryRound.open(channel, plane, time.monotonic() + 40)
    if rank < 3:  # the round's first three arrivals, each dying on its way in before it claims the lead
        meeting.arrive(rnd.store, rnd.keys.arrivals, world, encode(Arrival(rank)))
        board.publish_event(BoardEvent(EventKind.LOST, rank, "its process ended", by=rank))
        return ("died",)
    time.sleep(2.0)  # the others come after them: none of them is a contender
    settings = RecoverySettings(leader_quiet_s=1.0, outcome_fallback_s=1.0)
    verdict = rnd.agree(range(world), Arrival(rank), bound_s=30.0, board=board, settings=settings)
    return ("failed", verdict.failed, verdict.decided_by)


@pytest.mark.gloo
@pytest.mark.parametrize("nodes_of", [0, 6], ids=["store-waits", "heard-one-node"])
def test_a_round_whose_first_arrivals_died_before_leading_is_decided_by_one_that_takes_over(nodes_of):
    # Nobody said who leads: after the quiet time one of the others takes the lead. Each survivor
    # has the verdict that stands, decided by one of them (a leader quiet for the 1 s the test
    # allows, on a loaded host, may be taken over from again: the verdict is still the one standing).
    results = run_gloo(_contenders_die, 6, nodes_of, timeout=90)
    assert results[:3] == [("died",)] * 3, results
    deciders = {r[2] for r in results[3:]}
    assert [r[:2] for r in results[3:]] == [("failed", (0, 1, 2))] * 3 and len(deciders) == 1, results
    assert deciders.pop() in (3, 4, 5), results


def _leader_dies(rank: int, world: int, nodes_of: int, ahead: int) -> tuple:
    """Rank 0 leads the round and dies before it decides; its loss is on the board at once.
    ``ahead``: arrivals counted before the others come (2: none of them is among the first three,
    which know who leads; they learn it from the round's opening, heard)."""
    from hypergrid.liveness.plane import control_plane
    from hypergrid.recovery.round import RecoveryRound
    from hypergrid.store import meeting
    from hypergrid.store.keys import JobChannel
    from hypergrid.store.records import Arrival, BoardEvent, EventKind, encode

    plane = control_plane()
    channel = JobChannel.of(range(world), 0, plane.namespace)
    board = _board(channel, plane, rank, world, nodes_of)
    time.sleep(1.0)
    rnd = RecoveryRound.open(channel, plane, time.monotonic() + 40)
    if rank == 0:
        meeting.arrive(rnd.store, rnd.keys.arrivals, world, encode(Arrival(rank)))
        rnd.store.add(rnd.keys.arrivals.count, ahead)
        rnd.store.compare_set(rnd.keys.leader, "", "0")
        board.publish_event(BoardEvent(EventKind.ROUND, 0, "recover", number=rnd.number, by=0, value="0"))
        time.sleep(1.0)
        board.publish_event(BoardEvent(EventKind.LOST, 0, "its process ended", by=0))
        return ("died",)
    time.sleep(0.5)  # after the leader: none of the others leads
    # The quiet times outlast the round's deadline: only the loss heard can hand the lead on in time.
    rnd.store.deadline = time.monotonic() + 20.0
    settings = RecoverySettings(leader_quiet_s=60.0, outcome_fallback_s=60.0)
    verdict = rnd.agree(range(world), Arrival(rank), bound_s=60.0, board=board, settings=settings)
    return ("failed", verdict.failed, verdict.decided_by)


@pytest.mark.gloo
@pytest.mark.parametrize("ahead", [0, 2], ids=["first-arrivals", "later-arrivals"])
def test_a_leader_heard_lost_is_replaced_at_once_not_after_a_quiet_time(ahead):
    results = run_gloo(_leader_dies, 4, 2, ahead, timeout=90)
    assert results[0] == ("died",), results
    assert [r[:2] for r in results[1:]] == [("failed", (0,))] * 3, results
    assert len({r[2] for r in results[1:]}) == 1 and results[1][2] in (1, 2, 3), results


def _spares_released(rank: int, world: int) -> tuple:
    job = ResilientJob.of_grid(HyperCommGrid([2], ["dp"], world_size=world), spares=[2, 3])
    if job.in_grid:
        time.sleep(1.0)  # the spares are waiting by now (were they not, they would find the release at once)
        job.release_spares()
        return ("member",)
    # An hour: far past the test's own timeout, so only the release can end the wait.
    after = job.wait_as_spare(timeout=timedelta(hours=1))
    return ("spare", after is job, after.in_grid)


@pytest.mark.gloo
def test_spares_return_once_the_job_releases_them():
    results = run_gloo(_spares_released, 4, timeout=60)
    assert results == [("member",), ("member",), ("spare", True, False), ("spare", True, False)], results


def _broken(rank: int, world: int) -> list:
    from hypergrid.recovery.health import broken_groups

    pair = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    fine = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    if rank == 0:
        with pytest.raises(Exception):  # noqa: B017 - whichever gloo raises; rank 1 never joins: rank 0 times out, gloo closes the pair
            dist.all_reduce(dist_tensor(), group=pair)
    else:
        time.sleep(4)
    return sorted(broken_groups([pair, fine], participants=[0, 1], timeout=timedelta(seconds=30)))


def dist_tensor():
    import torch

    return torch.ones(1)


@pytest.mark.gloo
def test_a_group_one_member_found_broken_is_broken_for_every_member():
    results = run_gloo(_broken, 2, timeout=90, pg_timeout_s=30)
    assert results == [[(0, 1)], [(0, 1)]], results


@pytest.mark.parametrize("rank", [4, 8])
def test_a_device_mesh_of_the_recovered_grid_answers_for_the_new_placement(rank):
    from hypergrid import device_mesh

    with fake_world(rank, 10):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        for dims in ("tp", "dp", "pp"):
            grid.create_pg(dims)
        after = ResilientJob.of_grid(grid, spares=[8, 9], settings=RecoverySettings(gpus_per_node=2)).recover(failed=[5])
        mesh = device_mesh(after.state, device_type="cpu")
        assert mesh.mesh_dim_names == ("pp", "dp", "tp")
        assert mesh.get_group("tp") is after.state.get_pg("tp")
        assert dist.get_process_group_ranks(mesh.get_group("tp")) == [4, 8]
        assert mesh["pp"].mesh.tolist() == after.state.ranks("pp")
        after.state.destroy()


@pytest.mark.parametrize("rank", [2, 3])
def test_a_shrink_that_keeps_a_block_of_consecutive_ranks_stays_on_those_ranks(rank):
    """Dropping the first replica leaves ranks 2 and 3: a placement with no rank map of its own
    (rank_offset 2), which the rebuilt grid and Megatron state must keep, not move to ranks 0, 1."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state as ps

    from hypergrid.megatron import destroy_model_parallel

    with fake_world(rank, 4):
        grid = HyperCommGrid([2, 2], ["tp", "dp"])
        grid.create_pg("tp")
        after = recover(ResilientJob.of_grid(grid), failed=[0])
        assert (after.layout.rank_offset, after.state.ranks("tp")) == (2, [2, 3])
        assert dist.get_process_group_ranks(after.state.get_pg("tp")) == [2, 3]
        after.state.destroy()
    with fake_world(rank, 4):
        after = ResilientJob.of_megatron(tensor_model_parallel_size=2, create_gloo_process_groups=False).recover(failed=[0])
        assert dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()) == [2, 3]
        assert ps.get_tensor_model_parallel_rank() == rank - 2 and ps.get_data_parallel_world_size() == 1
        destroy_model_parallel()


def test_a_resilient_megatron_job_refuses_megatrons_enumerate_pattern():
    with fake_world(0, 10):
        with pytest.raises(ValueError, match="strategy='enumerate'.*spares make none"):
            ResilientJob.of_megatron(spares=[8, 9], strategy="enumerate", **SIZES)


def test_a_grid_made_in_megatrons_enumerate_pattern_is_rebuilt_among_members():
    with fake_world(4, 10):
        grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"], strategy="enumerate")
        grid.create_pg("dp")
        after = ResilientJob.of_grid(grid, spares=[8, 9], settings=RecoverySettings(gpus_per_node=2)).recover(failed=[5])
        assert after.state.strategy == "auto" and after.state.ranks("dp") == [4, 6]
        after.state.destroy()
