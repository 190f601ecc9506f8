"""Shared helpers for tests: real gloo jobs on loopback and one rank of a fake world.

``run_gloo(fn, world_size)`` starts ``world_size`` fresh processes, each with a gloo default group
over a store that the calling process hosts on a free loopback port, calls ``fn(rank, world_size, *args)`` in each and returns their results
in rank order. Every wait has a timeout: a job that does not finish in ``timeout`` seconds is
killed, process group and all, and the test fails naming the ranks still running. ``fn`` must be
a module-level function (it is pickled by name into the children). Inside a rank,
``job_store()`` is a connection of its own to that store.

The processes are forked from multiprocessing's fork server, a process of their own that has
imported torch, hypergrid and (where installed) megatron-core once: each rank starts with nothing
else's state and with the calling process's environment, as spawned ones do, without spending
seconds importing them again.

``fake_world(rank, world_size)`` makes this process one rank of a world of any size on torch's
fake backend, for tests of per-rank behaviour at scales no machine here could run.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch.distributed as dist
import torch.multiprocessing as mp

#: Default limit for one whole gloo job (start-up included).
JOB_TIMEOUT_S = 120.0

#: Test backends a job may run on, by name: the module that registers each with torch.
BACKEND_MODULES = {"abortable": "tests.abortable_backend"}

#: The pytest item running now (set by tests/conftest.py), so that run_gloo can check its marker.
CURRENT_TEST: Any = None

#: What the fork server imports once for every rank it forks: a rank of a CUDA build of torch
#: spends about 1.5 s importing torch, and 3.5 s importing megatron-core, which most jobs use. A
#: module that is not installed is left out (the fork server skips what it cannot import).
PRELOADED = ("torch", "torch.distributed", "hypergrid.grid", "hypergrid.megatron", "megatron.core.parallel_state",
             "tests.harness")


@functools.lru_cache(maxsize=1)
def _context() -> Any:
    """multiprocessing's fork-server context, its preloads set before it first starts."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def job_store(timeout_s: float = 60.0) -> dist.TCPStore:
    """From inside a rank of :func:`run_gloo`: a new client of the job's store."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def start_together(store: dist.TCPStore, name: str = "started", timeout_s: float = 120.0) -> None:
    """From inside a rank of :func:`run_gloo`: wait until every rank got here. A job whose groups
    time out after seconds (the scenario) must not count its own ranks' uneven start against
    them: on a loaded machine one rank's monitor start or store connection can take longer."""
    world = int(os.environ["WORLD_SIZE"])
    if store.add(f"{name}/count", 1) == world:
        store.set(f"{name}/go", "")
    store.wait([f"{name}/go"], datetime.timedelta(seconds=timeout_s))


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: mp.Queue,
    pg_timeout_s: float,
    env: dict[str, str],
    init_kwargs: dict[str, Any],
    leave_at_once: bool = False,
    backend: str = "gloo",
) -> None:
    # The calling process's environment now, as a spawned rank would have it, not the fork server's.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        if backend in BACKEND_MODULES:
            importlib.import_module(BACKEND_MODULES[backend])  # registers it with torch
        # Every rank reaches init_process_group before any starts its timeout: on a loaded machine
        # the ranks' imports end seconds apart, and a job whose timeout is a scenario's few seconds
        # (a gloo world connects within it) must not fail on its own start.
        start_together(store, name="harness/ready")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                **init_kwargs)
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException as exc:  # reported to the parent, which fails the test with it
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if leave_at_once:
            # After a failure the survivors' groups may hold dead peers, and tearing them down can
            # block: the result is sent, the process leaves (as a crashed job's survivors would).
            results.close()
            results.join_thread()
            os._exit(0)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = JOB_TIMEOUT_S,
    pg_timeout_s: float = 60.0,
    expect_failure: bool = False,
    env: Optional[dict[str, str]] = None,
    init_kwargs: Optional[dict[str, Any]] = None,
    leave_at_once: bool = False,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    With ``expect_failure=True`` a rank's exception is not a test failure: the result list holds
    ``("error", message)`` for such ranks and ``("ok", value)`` for the others, and a rank that
    ended without a word (killed) holds ``("dead", exitcode)``.

    ``init_kwargs`` go to each rank's ``init_process_group`` (e.g. ``device_id=``); ``backend`` is its
    backend (gloo, or a test backend of :data:`BACKEND_MODULES`).
    ``leave_at_once``: each rank exits as soon as its result is sent, without tearing down its
    process groups (for jobs where ranks died, whose groups may block in their teardown).

    Under pytest the calling test must be marked ``gloo`` (see tests/conftest.py).
    """
    if CURRENT_TEST is not None and CURRENT_TEST.get_closest_marker("gloo") is None:
        raise AssertionError(
            f"{CURRENT_TEST.nodeid} starts a gloo job: mark it @pytest.mark.gloo (tests/README.md)"
        )
    ctx = _context()
    results = ctx.Queue()
    # The job's store lives in this process, as torchrun's agent hosts it, not in rank 0: a rank
    # that fails fast and exits must not take the store from ranks still reporting their errors.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    port = store.port
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, fn, args, results, pg_timeout_s, {**os.environ, **(env or {})},
                  dict(init_kwargs or {}), leave_at_once, backend),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(outcome) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
                outcome[rank] = (ok, value)
            except queue.Empty:
                # Done when every rank that has not reported is gone: survivors of a dead peer may
                # hang in their own clean-up after reporting, which is not what is tested.
                silent = [procs[r] for r in range(world_size) if r not in outcome]
                if all(not p.is_alive() for p in silent) and results.empty():
                    break
    finally:
        for proc in procs:
            proc.join(timeout=max(0.0, min(5.0, (deadline - datetime.datetime.now()).total_seconds())))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    if expect_failure:
        out = []
        for rank in range(world_size):
            if rank in outcome:
                ok, value = outcome[rank]
                out.append(("ok", value) if ok else ("error", value))
            else:
                out.append(("dead", procs[rank].exitcode))
        return out
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout}s (killed)")
    failures = {r: v for r, (ok, v) in outcome.items() if not ok}
    if failures:
        first = min(failures)
        raise AssertionError(f"ranks {sorted(failures)} failed; rank {first}:\n{failures[first]}")
    return [outcome[r][1] for r in range(world_size)]


def timed_outcome(fn: Callable[[], Any]) -> tuple[str, str, float]:
    """Run ``fn()`` in a job; ``("ok", "", seconds)`` or ``(exception type, message, seconds)``.

    What a rank returns to the test when the test is about how (and how soon) it failed.
    """
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # the test inspects the type and message
        return (type(exc).__name__, str(exc), time.monotonic() - start)
    return ("ok", "", time.monotonic() - start)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Be ``rank`` of a ``world_size``-rank world on torch's fake backend for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process with no default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        from hypergrid.runtime.registry import REGISTRY

        dist.destroy_process_group()
        REGISTRY.reset()
