"""Re-initialisation with late ranks, the job's own timeout, and the rank that differs told early.

4-rank gloo jobs on loopback, the store hosted by the launcher (as torchrun does). Every rank
returns what happened to it and when. The time bounds are the behaviour under test (an error
reported instead of a wait for a longer timeout, or a hang), and far above the times measured
here (given by each test): they catch a wait for the wrong timeout, not a slow machine.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_gloo, timed_outcome

#: Every test here starts multi-process gloo jobs (tests/README.md).
pytestmark = pytest.mark.gloo

CYCLES = 20


def _all_reduce_ok(pg) -> bool:
    value = torch.ones(1)
    dist.all_reduce(value, group=pg)
    return int(value.item()) == pg.size()


def _job_grid_cycles_with_late_ranks(rank: int, world_size: int, seed: int) -> list:
    """Grid, view and groups; destroy; again, with every rank late by a random 0-1.5 s each cycle."""
    from hypergrid import HyperCommGrid

    delays = random.Random(seed * 1000 + rank)
    outcomes = []
    for cycle in range(CYCLES):
        time.sleep(delays.uniform(0.0, 1.5) if cycle % 2 else delays.uniform(0.0, 0.2))
        # Alternate the shape under the same dim names: a new grid, not a stale round.
        shape = [2, 2] if cycle % 2 == 0 else [4, 1]
        grid = HyperCommGrid(shape, ["tp", "dp"])
        grid.register_view("flat", [4], ["all"])
        ok = all(_all_reduce_ok(pg) for pg in (grid.create_pg("tp"), grid.create_pg("dp"), grid.create_pg("all", view="flat")))
        grid.destroy()
        outcomes.append(ok)
    return outcomes


def test_grids_and_views_re_created_20_times_with_late_ranks_succeed_on_every_rank() -> None:
    results = run_gloo(_job_grid_cycles_with_late_ranks, 4, 7, timeout=400)
    assert results == [[True] * CYCLES] * 4


def _job_megatron_cycles_with_late_ranks(rank: int, world_size: int, seed: int) -> list:
    from megatron.core import parallel_state as ps

    import hypergrid.megatron as hm

    delays = random.Random(seed * 1000 + rank)
    outcomes = []
    for cycle in range(CYCLES // 2):
        time.sleep(delays.uniform(0.0, 1.5))
        tp = 2 if cycle % 2 == 0 else 1
        hm.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2)
        outcomes.append(
            ps.get_tensor_model_parallel_world_size() == tp
            and _all_reduce_ok(ps.get_data_parallel_group())
            and _all_reduce_ok(ps.get_pipeline_model_parallel_group())
        )
        hm.destroy_model_parallel()
    return outcomes


def test_megatron_state_re_initialised_with_late_ranks_succeeds_on_every_rank() -> None:
    pytest.importorskip("megatron.core")
    results = run_gloo(_job_megatron_cycles_with_late_ranks, 4, 11, timeout=400)
    assert results == [[True] * (CYCLES // 2)] * 4


def _job_dead_rank_with_the_jobs_timeout(rank: int, world_size: int) -> tuple:
    import os

    from hypergrid import HyperCommGrid

    # No timeout given to the grid: the job's (init_process_group(timeout=...), 6 s here) rules.
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    grid.create_pg("tp")
    if rank == 3:
        os._exit(17)  # never asks for the next group
    return timed_outcome(lambda: grid.create_pg("dp"))


def test_a_dead_rank_is_named_on_every_survivor_within_the_jobs_timeout() -> None:
    results = run_gloo(_job_dead_rank_with_the_jobs_timeout, 4, timeout=180, pg_timeout_s=6.0, expect_failure=True)
    assert results[3][0] == "dead"
    # Rank 1 shares its dp group with rank 3; ranks 0 and 2 form the other dp group and succeed.
    kind, message, seconds = results[1][1]
    assert kind in ("GroupTimeoutError", "GroupCreationError"), results[1]
    assert "3" in message and "'dp'" in message, message
    # Measured: 6.0 s. Without the job's timeout it would be torch's default, 30 minutes.
    assert seconds < 6.0 + 60.0, f"reported after {seconds:.1f} s, the job's timeout is 6 s"
    assert results[0][1][0] == "ok" and results[2][1][0] == "ok", results


def _job_differing_request(rank: int, world_size: int) -> tuple:
    from hypergrid import HyperCommGrid

    grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=timedelta(seconds=120))
    return timed_outcome(lambda: grid.create_pg("dp" if rank == 3 else "tp"))


def test_the_rank_whose_request_differs_learns_it_as_soon_as_the_others() -> None:
    results = run_gloo(_job_differing_request, 4, timeout=240, expect_failure=True)
    outcomes = [r[1] for r in results]
    # The timeout is 120 s: everyone, rank 3 included, must know long before it (measured: 3.3 s).
    for rank, (kind, _message, seconds) in enumerate(outcomes):
        if rank in (2, 3):  # rank 3 asked for dp, whose group {1, 3} holds rank 1; tp's {2, 3}
            assert kind == "GridMismatchError", (rank, outcomes[rank])
        assert seconds < 60.0, f"rank {rank} learned after {seconds:.1f} s: {outcomes[rank]}"
    assert "'dp'" in outcomes[3][1] or "'tp'" in outcomes[3][1], outcomes[3]


def _job_differing_offset(rank: int, world_size: int) -> tuple:
    from hypergrid import HyperCommGrid

    offset = 2 if rank == 2 else 0
    grid = HyperCommGrid([2], ["tp"], rank_offset=offset, timeout=timedelta(seconds=120))
    return timed_outcome(lambda: grid.create_pg("tp"))


def test_a_rank_with_another_rank_offset_fails_with_the_others_not_silently() -> None:
    results = run_gloo(_job_differing_offset, 4, timeout=240, expect_failure=True)
    outcomes = [r[1] for r in results]
    # Ranks 0, 1 and 3 asked for grid [0, 1], rank 2 for grid [2, 3]: rank 2's group {2, 3} holds
    # rank 3, which asked for another grid (it is outside its own and gets None). Rank 2 must be
    # told, naming the offset, instead of waiting for rank 3 until the timeout (120 s; measured: 3.3 s).
    kind, message, _ = outcomes[2]
    assert kind == "GridMismatchError" and "rank_offset" in message, outcomes[2]
    for rank in (0, 1, 2):
        assert outcomes[rank][2] < 60.0, f"rank {rank}: {outcomes[rank]}"


def _job_store_host_dies(rank: int, world_size: int) -> tuple:
    """The store the agreement uses is hosted by rank 0 (as with init_method 'env://'); rank 0 dies."""
    import os

    import hypergrid.runtime.environment as agreement
    from hypergrid import HyperCommGrid

    job_store = agreement.default_store()
    if rank == 0:
        hosted = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        job_store.set("reliability/port", str(hosted.port))
    else:
        port = int(job_store.get("reliability/port").decode())
        hosted = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=30))
    agreement.default_store = lambda: hosted
    grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=timedelta(seconds=30))
    grid.create_pg("tp")
    dist.barrier()
    if rank == 0:
        os._exit(17)  # takes the store with it
    time.sleep(1.0)
    return timed_outcome(lambda: grid.create_pg("dp"))


def test_a_lost_store_host_is_reported_on_every_survivor() -> None:
    results = run_gloo(_job_store_host_dies, 4, timeout=120, expect_failure=True)
    assert results[0][0] == "dead", results[0]
    for rank in (1, 2, 3):
        status, (kind, message, seconds) = results[rank]
        assert status == "ok" and kind == "GroupCreationError", results[rank]
        assert "store stopped answering" in message and "'dp'" in message, message
        # before the grid's 30 s timeout (measured: 0.02 s)
        assert seconds < 30.0, f"rank {rank} learned after {seconds:.1f} s"


def _job_dies_inside_torch(rank: int, world_size: int) -> tuple:
    """Rank 3 dies inside torch's new_group for dp, after the members agreed."""
    import os

    from hypergrid import HyperCommGrid

    grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=timedelta(seconds=8))
    grid.create_pg("tp")
    if rank == 3:
        real_new_group = dist.new_group

        def dying_new_group(*args, **kwargs):
            os._exit(17)

        dist.new_group = dying_new_group
    try:
        return timed_outcome(lambda: grid.create_pg("dp"))
    finally:
        if rank == 3:
            dist.new_group = real_new_group


def test_a_rank_dying_inside_torchs_creation_is_named_by_its_group() -> None:
    # The job's start-up gets 30 s (a loaded machine); the grid's groups 8 s.
    results = run_gloo(_job_dies_inside_torch, 4, timeout=180, pg_timeout_s=30.0, expect_failure=True)
    assert results[3][0] == "dead", results[3]
    # dp groups are {0, 2} and {1, 3}: rank 1 waited inside torch for rank 3.
    status, (kind, message, seconds) = results[1]
    assert status == "ok" and kind == "GroupCreationError", results[1]
    assert "'dp'" in message and "ranks [3] never reported back" in message, message
    assert seconds < 8.0 + 60.0, f"rank 1 learned after {seconds:.1f} s"  # measured: 11 s
    assert results[0][1][0] == "ok" and results[2][1][0] == "ok", results
