"""Agreement checks named by what members share: legal programs that no per-process count may knock out of step.

4-rank gloo jobs on loopback. Each scenario is a sequence that is legal but leaves ranks with
different histories (some sat outside a partial grid, one made groups of one rank alone, one failed
before its first request, the world was restarted in-process over a new store prefix), after which
identical requests must meet and succeed on every rank. Then concurrency (two threads creating two
grids in crossed orders; ``destroy()`` during a ``create_pg``), and the deadline of every error.

Every rank returns what happened to it; the tests assert on every rank. Time bounds, where there are
any, are the behaviour under test (an error within the job's timeout) and sit well above what was
measured (each test says what).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import job_store, run_gloo, timed_outcome

pytestmark = pytest.mark.gloo

WORLD = 4
# Not shorter than the store's answers can take with two suites side by side on two cores.
TIMEOUT = timedelta(seconds=10)


def _members_by_reduce(pg) -> list[int]:
    flags = torch.zeros(WORLD, dtype=torch.int64)
    flags[dist.get_rank()] = 1
    dist.all_reduce(flags, group=pg)
    return [r for r in range(WORLD) if flags[r]]


def _full_grid(rank: int) -> dict:
    """The grid every scenario ends with: its groups, checked by what they do."""
    from hypergrid import HyperCommGrid

    grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=timedelta(seconds=60))
    out = {}
    for dims in ("tp", "dp", ["tp", "dp"]):
        out[grid.layout.key(dims)] = _members_by_reduce(grid.create_pg(dims)) == grid.ranks(dims)
    grid.destroy()
    return out


ALL_OK = {"tp": True, "dp": True, "dp-tp": True}


# ---------------------------------------------------------------------------- histories that differ
def _partial_then_full(rank: int, world: int) -> dict:
    from hypergrid import HyperCommGrid

    # Ranks 2 and 3 are outside this grid and, in local mode, need not call it at all.
    partial = HyperCommGrid([2, 1], ["tp", "dp"], timeout=TIMEOUT)
    if rank < 2:
        assert _members_by_reduce(partial.create_pg("tp")) == [0, 1]
        partial.create_pg("dp")  # a group of one
    partial.destroy()
    return _full_grid(rank)


def test_ranks_that_sat_outside_a_partial_grid_meet_the_full_one():
    assert run_gloo(_partial_then_full, WORLD, timeout=180) == [ALL_OK] * WORLD


def _size_one_rebuilds(rank: int, world: int) -> dict:
    from hypergrid import HyperCommGrid

    if rank == 1:  # rank 1 alone builds grids whose every group holds only itself, twice
        for _ in range(2):
            alone = HyperCommGrid([1, 1], ["tp", "dp"], rank_offset=1, timeout=TIMEOUT)
            alone.create_pg("tp")
            alone.create_pg("dp")
            alone.destroy()
    return _full_grid(rank)


def test_a_rank_that_rebuilt_groups_of_one_alone_meets_the_others():
    assert run_gloo(_size_one_rebuilds, WORLD, timeout=180) == [ALL_OK] * WORLD


def _fails_alone_then_retries(rank: int, world: int) -> dict:
    from hypergrid import HyperCommGrid

    first = ("ok", "")
    try:
        if rank == 2:
            raise FileNotFoundError("a config file missing on this node only")  # before any request
        grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=TIMEOUT)
        for dims in ("tp", "dp", ["tp", "dp"]):
            grid.create_pg(dims)
    except Exception as exc:  # the failure under test
        first = (type(exc).__name__, str(exc))
    dist.barrier()  # every rank is out of its failed calls before the retry
    return {"first": first, "retry": _full_grid(rank)}


def test_after_one_rank_failed_alone_an_identical_retry_succeeds_on_every_rank():
    results = run_gloo(_fails_alone_then_retries, WORLD, timeout=240)
    assert results[2]["first"][0] == "FileNotFoundError"
    assert any(r["first"][0] != "ok" for i, r in enumerate(results) if i != 2), results  # the others noticed
    assert [r["retry"] for r in results] == [ALL_OK] * WORLD


def _megatron_fails_alone_then_retries(rank: int, world: int) -> dict:
    from megatron.core import parallel_state as ps

    import hypergrid.megatron as hm

    kwargs = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, distributed_timeout_minutes=0.1,
                  create_gloo_process_groups=False)
    first = ("ok", "")
    try:
        if rank == 2:
            raise ValueError("the user's embedding callback failed on this rank")
        hm.initialize_model_parallel(**kwargs)
    except Exception as exc:  # the failure under test
        first = (type(exc).__name__, str(exc)[:300])
        hm.destroy_model_parallel()
    dist.barrier()
    hm.initialize_model_parallel(**kwargs)
    # tp 2 x pp 2 on 4 ranks: tp groups {0, 1} and {2, 3}, pipeline groups {0, 2} and {1, 3}
    retry = (_members_by_reduce(ps.get_tensor_model_parallel_group()) == [rank - rank % 2, rank - rank % 2 + 1]
             and _members_by_reduce(ps.get_pipeline_model_parallel_group()) == [rank % 2, rank % 2 + 2])
    hm.destroy_model_parallel()
    return {"first": first, "retry": retry}


def test_megatron_after_one_rank_failed_alone_an_identical_retry_succeeds():
    pytest.importorskip("megatron.core")
    results = run_gloo(_megatron_fails_alone_then_retries, WORLD, timeout=300, pg_timeout_s=90.0)
    assert results[2]["first"][0] == "ValueError"
    assert all(r["first"][0] != "ok" for r in results), results  # nobody went on with a half-built state
    assert [r["retry"] for r in results] == [True] * WORLD


def _three_lives(rank: int, world: int) -> list:
    from hypergrid import HyperCommGrid

    base = job_store()
    outcomes = []
    for life in range(3):
        # An in-process restart: the old world torn down, a new one over a fresh store prefix.
        dist.destroy_process_group()
        # Every rank has left the old life before any forms the new world, as an in-process
        # restart wrapper makes sure: under load, gloo's connectFullMesh fails ("connection closed
        # by peer") when a rank connects while a peer is still in the previous life.
        if base.add(f"left{life}", 1) == world:
            base.set(f"all_left{life}", "1")
        base.wait([f"all_left{life}"], timedelta(seconds=60))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"life{life}/", base), rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            if life == 0 and rank == 3:
                raise RuntimeError("rank 3 fails before its first request in the first life")
            grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=TIMEOUT)
            for dims in ("tp", "dp", ["tp", "dp"]):
                grid.create_pg(dims)
            grid.destroy()
            outcomes.append("ok")
        except Exception as exc:  # the failure under test
            outcomes.append(type(exc).__name__)
    return outcomes


def test_three_in_process_lives_over_new_store_prefixes_after_a_failure_in_the_first():
    results = run_gloo(_three_lives, WORLD, timeout=240)
    assert results[3][0] == "RuntimeError"
    for rank, outcomes in enumerate(results):
        assert outcomes[1:] == ["ok", "ok"], (rank, outcomes)


# ---------------------------------------------------------------------------- threads
def _crossed_threads(rank: int, world: int, identical: bool) -> dict:
    from hypergrid import HyperCommGrid

    a = HyperCommGrid([2, 2], ["tp", "dp"], timeout=TIMEOUT)
    b = HyperCommGrid([2, 2], ["tp", "dp"], timeout=TIMEOUT)
    if not identical:
        b.register_view("flat", [4], ["all"])  # another grid over the same ranks
    outcome: dict = {}
    started = threading.Event()

    def create(name: str, grid) -> None:
        started.set()
        try:
            for dims in ("tp", "dp"):
                assert _members_by_reduce(grid.create_pg(dims)) == grid.ranks(dims)
            outcome[name] = "ok"
        except Exception as exc:  # the outcome under test
            outcome[name] = type(exc).__name__

    first, second = (("A", a), ("B", b)) if rank % 2 == 0 else (("B", b), ("A", a))
    threads = [threading.Thread(target=create, args=first)]
    threads[0].start()
    started.wait(10)
    time.sleep(0.5)  # the first thread holds this rank's creation; the second queues behind it
    threads.append(threading.Thread(target=create, args=second))
    threads[1].start()
    for thread in threads:
        thread.join(60)
    a.destroy()
    b.destroy()
    return outcome


def test_identical_grids_created_by_crossed_threads_both_succeed_everywhere():
    results = run_gloo(_crossed_threads, WORLD, True, timeout=180)
    assert results == [{"A": "ok", "B": "ok"}] * WORLD


def test_different_grids_created_by_crossed_threads_fail_alike_everywhere():
    results = run_gloo(_crossed_threads, WORLD, False, timeout=180)
    # Even ranks ask for A's tp where odd ranks ask for B's over the same members: every such check
    # fails for all its members with the same error, in both threads, on every rank.
    assert results == [{"A": "GridMismatchError", "B": "GridMismatchError"}] * WORLD, results


def _destroy_during_create(rank: int, world: int) -> dict:
    from hypergrid import REGISTRY, HyperCommGrid

    baseline = len(dist.distributed_c10d._world.pg_map)
    grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=timedelta(seconds=30))
    outcome: dict = {}
    if rank == 0:
        def create() -> None:
            try:
                outcome["create"] = ("returned", grid.create_pg("tp") is not None)
            except Exception as exc:  # the outcome under test
                outcome["create"] = (type(exc).__name__, "")

        thread = threading.Thread(target=create)
        thread.start()
        time.sleep(1.0)  # the creation waits for rank 1, which comes later
        grid.destroy()
        outcome["destroyed_while_creating"] = thread.is_alive()
        thread.join(60)
    else:
        if rank == 1:
            time.sleep(3.0)
        grid.create_pg("tp")
        grid.destroy()
    dist.barrier()
    outcome["registry"] = REGISTRY.count()
    outcome["pg_map_growth"] = len(dist.distributed_c10d._world.pg_map) - baseline
    return outcome


def test_destroy_during_a_creation_leaks_nothing():
    results = run_gloo(_destroy_during_create, WORLD, timeout=180)
    assert results[0]["destroyed_while_creating"], results[0]
    # Either the creation landed first and was destroyed with the grid, or it found the grid
    # destroyed: never a group of a destroyed grid handed out and never released.
    assert results[0]["create"][0] == "GridDestroyedError", results[0]
    for rank, result in enumerate(results):
        assert result["registry"] == 0 and result["pg_map_growth"] == 0, (rank, result)


# ---------------------------------------------------------------------------- deadlines
def _dead_decider(rank: int, world: int, timeout_s: float) -> tuple:
    import os

    from hypergrid import HyperCommGrid

    grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=timedelta(seconds=timeout_s))
    grid.create_pg("tp")
    if rank == 1:
        os._exit(17)  # the decider of dp's group {1, 3} dies before asking for it
    return timed_outcome(lambda: grid.create_pg("dp"))


def test_a_follower_whose_decider_died_learns_it_within_the_timeout():
    timeout_s = 10.0
    results = run_gloo(_dead_decider, WORLD, timeout_s, timeout=180, pg_timeout_s=60.0, expect_failure=True)
    assert results[1][0] == "dead"
    kind, message, seconds = results[3][1]
    assert kind == "GroupTimeoutError" and ("rank 1" in message or "[1]" in message), results[3]
    # Measured: 10.0 s, the timeout itself (not the timeout plus a grace of max(2 s, 10%), past the job's).
    assert seconds < timeout_s + 1.5, f"rank 3 learned after {seconds:.1f} s, the timeout is {timeout_s} s"
    assert results[0][1][0] == "ok" and results[2][1][0] == "ok", results


def _rank_dies_in_megatron(rank: int, world: int) -> tuple:
    import os

    import hypergrid.megatron as hm

    # Rank 3 dies once every rank's init_process_group has returned: in Megatron's set-up, not in
    # gloo's, where the peers still connecting to it would fail in torch before hypergrid is called.
    store = job_store()
    store.set(f"test/initialized/{rank}", "1")
    if rank == 3:
        store.wait([f"test/initialized/{r}" for r in range(world)])
        os._exit(17)
    return timed_outcome(lambda: hm.initialize_model_parallel(
        tensor_model_parallel_size=2, distributed_timeout_minutes=0.1, create_gloo_process_groups=False))


def test_every_did_not_finish_names_the_ranks():
    pytest.importorskip("megatron.core")
    results = run_gloo(_rank_dies_in_megatron, WORLD, timeout=180, pg_timeout_s=60.0, expect_failure=True)
    assert results[3][0] == "dead"
    for rank in range(3):
        kind, message, _ = results[rank][1]
        assert kind in ("GroupTimeoutError", "GridMismatchError"), (rank, results[rank])
        assert "ranks [3]" in message or "rank 3" in message, (rank, message)


def _frozen_store_host(rank: int, world: int) -> tuple:
    """The store agreement uses is hosted by rank 0 (as with init_method 'env://'); rank 0 freezes."""
    import os
    import signal
    import subprocess

    import hypergrid.runtime.environment as agreement
    from hypergrid import HyperCommGrid

    job_store = agreement.default_store()
    if rank == 0:
        hosted = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        job_store.set("checks/port", str(hosted.port))
    else:
        port = int(job_store.get("checks/port").decode())
        hosted = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    agreement.default_store = lambda: hosted
    grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=timedelta(seconds=6))
    grid.create_pg("tp")
    dist.barrier()
    if rank == 0:
        # Frozen (SIGSTOP) for 25 s, as a debugger or an overloaded node freezes it; woken by a child.
        subprocess.Popen(["sh", "-c", f"sleep 25; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        return ("woken", "", 0.0)
    time.sleep(0.5)
    # dp's group {1, 3} does not hold rank 0, and both its members are alive.
    return timed_outcome(lambda: grid.create_pg("dp"))


@pytest.mark.slow
def test_a_frozen_store_host_is_reported_as_such_within_the_timeout():
    results = run_gloo(_frozen_store_host, WORLD, timeout=180, pg_timeout_s=90.0, expect_failure=True)
    for rank in (1, 3):
        status, (kind, message, seconds) = results[rank]
        assert status == "ok" and kind == "GroupCreationError", results[rank]
        assert "did not answer" in message and "'dp'" in message, message
        assert "has likely exited" not in message and "leader" not in message, message  # no false cause
        # Measured: 6.0 s, the timeout; the store's host is named, not the decider or an exited host.
        assert seconds < 6.0 + 4.0, f"rank {rank} learned after {seconds:.1f} s, the timeout is 6 s"


def _store_keys_over_cycles(rank: int, world: int, cycles: int) -> list:
    """init/destroy cycles of a grid and of Megatron's state; hypergrid's keys in the store after each."""
    import hypergrid.megatron as hm
    from hypergrid import HyperCommGrid

    store = job_store()
    counts = []
    for _ in range(cycles):
        grid = HyperCommGrid([2, 2], ["tp", "dp"], timeout=timedelta(seconds=30))
        for dims in ("tp", "dp", ["tp", "dp"]):
            grid.create_pg(dims)
        grid.destroy()
        hm.initialize_model_parallel(tensor_model_parallel_size=2, distributed_timeout_minutes=0.5,
                                     create_gloo_process_groups=False)
        hm.destroy_model_parallel()
        dist.barrier()
        counts.append(sum(1 for key in store.list_keys() if "hypergrid/agree" in key))
        dist.barrier()
    return counts


def test_the_store_does_not_grow_with_init_and_destroy_cycles():
    pytest.importorskip("megatron.core")
    # Eight cycles: a key left behind by each would show in the last four as well as in sixteen.
    results = run_gloo(_store_keys_over_cycles, WORLD, 8, timeout=400)
    for rank, counts in enumerate(results):
        assert counts[0] > 0, counts
        # After the first cycles every key is one that later cycles overwrite or delete.
        assert counts[4:] == [counts[4]] * len(counts[4:]), (rank, counts)
