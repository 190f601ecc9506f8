"""One rank of tests/test_recovery_exit.py: a whole process, started as a user starts one, that
trains, loses a peer, recovers and then ends the way a finished job's ranks end.

``python -m tests.exit_worker --store HOST:PORT --rank R --world W --out DIR``

The grid is tp 2 x dp 2 on ranks 0-3, rank 4 is a spare. At the start of step ``FREEZE_STEP``,
rank 3 stops itself (SIGSTOP; the test lets it go again later), so the others' collectives with
it time out and they recover: rank 3 is counted out, spare 4 takes its place and the survivors
train on. When rank 3 runs again it calls the recovery too, learns it was counted out, and ends.
Every rank then ends as a finished job's would: a barrier on the job's world, the spares
released, the default group destroyed, and the interpreter's own exit (no ``os._exit``), which
is where threads still inside a store call used to abort the process.

It writes ``rank-R.json`` (its outcome) before it exits; the test reads the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import hypergrid
from hypergrid import HyperCommGrid, ResilientJob
from hypergrid.errors import ExcludedByRecovery
from hypergrid.recovery.settings import RecoverySettings

STEPS, FREEZE_STEP, FROZEN, SPARES = 5, 2, 3, [4]
COLLECTIVE = timedelta(seconds=4)


def _step(grid: HyperCommGrid) -> list[int]:
    sums = []
    for dims in ("tp", "dp"):
        value = torch.ones(1)
        dist.all_reduce(value, group=grid.get_pg(dims))
        sums.append(int(value.item()))
    return sums


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    host, port = args.store.rsplit(":", 1)
    rank = args.rank
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world, timeout=COLLECTIVE)
    hypergrid.start_heartbeat(interval_s=0.25, progress_timeout_s=3.0)  # frozen past it: counted out as hung
    grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=args.world)
    for dims in ("tp", "dp"):
        grid.create_pg(dims)
    job = ResilientJob.of_grid(grid, spares=SPARES, timeout=timedelta(seconds=30), settings=RecoverySettings(gpus_per_node=2))
    outcome: dict = {"rank": rank, "role": "grid" if job.in_grid else "spare", "steps": 0}
    if not job.in_grid:
        job = job.wait_as_spare(timeout=timedelta(seconds=90))
        outcome["joined"] = job.in_grid
    step = job.step or 0
    while job.in_grid and step < STEPS:
        try:
            if rank == FROZEN and step == FREEZE_STEP and not outcome.get("froze"):
                outcome["froze"] = True
                (args.out / "frozen").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT once it is counted out
            outcome["sums"] = _step(job.state)
            step += 1
            outcome["steps"] += 1
        except RuntimeError:
            try:
                job = hypergrid.recover(job, step=step)
            except ExcludedByRecovery as exc:
                outcome["excluded"] = str(exc)
                break
            outcome["recovered"] = job.last.describe() if job.last else None
            step = job.step if job.step is not None else step
    if job.in_grid and "excluded" not in outcome:  # a rank counted out holds the job from before
        dist.barrier(group=job.world)
    job.release_spares()
    outcome["placement"] = list(job.layout.ranks)
    dist.destroy_process_group()
    (args.out / f"rank-{rank}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
