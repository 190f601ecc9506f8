"""hypergrid.train with torch's DistributedDataParallel, built in ``setup`` over the grid's dp group.

The job of tests/test_training.py (a tensor-parallel MLP, tp 2 x dp 2, Adam, StepLR, dropout, a
sampler; node 1 SIGKILLed after its forward in step ``KILL_STEP``) with its model wrapped in
``DistributedDataParallel(model, process_group=grid.get_pg("dp"))``: DDP averages the gradients.

- A spare node takes node 1's place: the spares build their DDP in ``setup`` with no collective the
  survivors would have to join, the survivors' DDP is pointed at the new dp group; every loss is
  bit-equal to the same job run with no failure.
- No spare: dp shrinks to 1, and the survivors' DDP goes on over the one-rank group, bit-equal to a
  job started on the shrunk grid from the same state.
- A second loss: the spare taking the position dies in its ``setup``; the next spare node takes it.
  The grid's groups have a 6 s timeout and the default group 30 minutes (gloo's default): the
  survivors wait for the dead spare in the job's own groups (``job.world``) no longer than the
  grid's groups' timeout, so the job is back long before the default group's would end.
"""

from __future__ import annotations

import functools

import pytest

from tests.harness import run_gloo
from tests.test_training import COLLECTIVE_S, KILL_STEP, STEPS, _by_position, _train

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

DDP = functools.partial(_train, ddp=True)


def _from_kill_to_first_steps(members: dict[int, dict]) -> str:
    """For the test's output: seconds from the kill to each rank's first step after each recovery."""
    killed = next(v["killed_at"] for v in members.values() if v["killed_at"] is not None)
    return ", ".join(f"rank {rank}: " + "/".join(f"{t - killed:.2f}" for t in v["stepped_at"])
                     for rank, v in sorted(members.items()))


def test_ddp_through_a_node_loss_with_a_spare_node_trains_on_bit_equal(tmp_path):
    reference = run_gloo(DDP, 6, [0, 1, 2, 3], [4, 5], None, None, None, str(tmp_path), timeout=240,
                         pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    results = run_gloo(DDP, 6, [0, 1, 2, 3], [4, 5], ([2, 3], KILL_STEP), None, None, str(tmp_path), timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    assert results[2][0] == "dead" and results[3][0] == "dead", results[2:4]
    expected = _by_position(reference)
    members = {rank: v for rank, (status, v) in enumerate(results) if status == "ok" and v["in_grid"]}
    assert sorted(members) == [0, 1, 4, 5], results
    for rank, value in members.items():
        assert value["wrapped"] == ["DistributedDataParallel"], (rank, value["wrapped"])
        assert value["ranks"] == [0, 1, 4, 5], (rank, value)
        ((kind, plan, failed_step, resumed, line),) = value["records"]
        assert kind == ("joined" if rank >= 4 else "replace") and resumed == KILL_STEP, (rank, line)
        want = expected[value["position"]]["losses"]
        steps = range(KILL_STEP, STEPS) if rank >= 4 else range(STEPS)
        assert {s: value["losses"][s] for s in steps} == {s: want[s] for s in steps}, (rank, value["losses"], want)
    print(f"\nDDP, node 1 lost, a spare node: from the kill to each rank's first step (s): "
          f"{_from_kill_to_first_steps(members)}")


def test_ddp_through_a_node_loss_with_no_spare_shrinks_and_trains_as_a_job_started_there(tmp_path):
    run_gloo(DDP, 4, [0, 1, 2, 3], [], None, None, KILL_STEP, str(tmp_path), timeout=240,
             pg_timeout_s=COLLECTIVE_S, leave_at_once=True)  # the state at KILL_STEP, of a run with no failure
    results = run_gloo(DDP, 4, [0, 1, 2, 3], [], ([2, 3], KILL_STEP), None, None, str(tmp_path), timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    assert results[2][0] == "dead" and results[3][0] == "dead", results[2:4]
    fresh = run_gloo(DDP, 2, [0, 1], [], None, KILL_STEP, None, str(tmp_path), timeout=240,
                     pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    members = {}
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok" and value["ranks"] == [0, 1], results[rank]
        ((kind, plan, failed_step, resumed, line),) = value["records"]
        assert kind == "shrink" and resumed == KILL_STEP and failed_step == KILL_STEP, line
        after = {s: loss for s, loss in value["losses"].items() if s >= KILL_STEP}
        assert after == {s: fresh[rank]["losses"][s] for s in range(KILL_STEP, STEPS)}, (rank, after, fresh[rank])
        members[rank] = value
    print(f"\nDDP, node 1 lost, no spare (dp 2 -> 1): from the kill to each rank's first step (s): "
          f"{_from_kill_to_first_steps(members)}")


def test_ddp_through_a_second_loss_a_spare_dead_in_setup_costs_the_grids_timeout_not_the_default_groups(tmp_path):
    reference = run_gloo(DDP, 4, [0, 1, 2, 3], [], None, None, None, str(tmp_path), timeout=240,
                         pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    # The default group's timeout is gloo's default; the grid's groups (and so the job's own) 6 s.
    results = run_gloo(functools.partial(DDP, kill_on_joining=4, group_timeout_s=COLLECTIVE_S), 8, [0, 1, 2, 3],
                       [4, 5, 6, 7], ([2, 3], KILL_STEP), None, None, str(tmp_path), timeout=300, pg_timeout_s=1800.0,
                       expect_failure=True, leave_at_once=True)
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
    print(f"\nDDP, node 1 lost, then the spare taking rank 2's place (grid's groups: a {COLLECTIVE_S:g} s "
          f"timeout, the default group's 1800 s): from the kill to each rank's first step (s): "
          f"{_from_kill_to_first_steps(members)}")
