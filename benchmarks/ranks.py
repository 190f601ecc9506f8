"""Gloo ranks for a benchmark: processes on this machine, each given a free port and a queue.

Shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, which puts this folder
on ``sys.path``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 1800.0) -> dict[int, Any]:
    """Run ``target(rank, port, out, *args)`` in ``world`` spawned processes (``port``: free, for
    ``MASTER_PORT``; each rank puts ``(rank, result)`` on ``out``); returns the results by rank."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, port, out, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    got = dict(out.get(timeout=timeout_s) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return got
