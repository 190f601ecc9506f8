"""One worker of tests/test_recovery_torchrun.py, started by torchrun as a user's training script.

``python -m torch.distributed.run ... -m tests.torchrun_worker --store HOST:PORT --out DIR ...``

It connects its default group to the job's store, which a process outside the nodes hosts
(``python -m hypergrid store``), not to torchrun's ``MASTER_ADDR:MASTER_PORT`` (a store inside
node 0's agent). The grid is tp 2 x dp 2 on ranks 0-3 (nodes 0 and 1), ranks 4 and 5 (node 2)
are spares. Each step adds to a weight what two all-reduces give, on tp then on dp; the loop is
the docs' (``except RuntimeError: recover``, roll back to the step's start, a rank that just
arrived takes the weight from a surviving data-parallel peer). ``--victim`` SIGKILLs itself at
the start of step ``--kill-step``; its agent then ends its node's other worker.

Files written in ``--out``, each whole (written aside, then renamed): ``started-R.json`` once
rank R holds its place or waits as a spare (its node, local rank, agent's pid, own pid),
``killed.json`` by the victim just before it dies, ``rank-R.json`` with rank R's outcome at the
end, and ``exited-R.json`` after its process group is destroyed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import hypergrid
import hypergrid.recovery.round as rounds
from hypergrid import HyperCommGrid, ResilientJob
from hypergrid.recovery.settings import RecoverySettings

DIMS = ("tp", "dp")
SHAPE = [2, 2]
SPARES = [4, 5]
GPUS_PER_NODE = 2

logger = logging.getLogger("tests.torchrun_worker")


def _write(path: Path, value: Any) -> None:
    aside = path.with_name(path.name + ".tmp")
    aside.write_text(json.dumps(value))
    os.replace(aside, path)


def _step(grid: HyperCommGrid, step: int) -> float:
    """What one step adds to the weight: (tp rank + 1) * (step + 1), summed over tp, then over dp."""
    tp, dp = grid.get_pg("tp"), grid.get_pg("dp")
    value = torch.tensor([float((dist.get_rank(tp) + 1) * (step + 1))], dtype=torch.float64)
    dist.all_reduce(value, group=tp)
    dist.all_reduce(value, group=dp)
    return float(value.item())


def _sums(grid: HyperCommGrid, rank: int) -> dict:
    """Each of the grid's groups, checked with two all-reduces: (members, sum of ones, sum of ranks)."""
    out = {}
    for dims in DIMS:
        pg = grid.get_pg(dims)
        ones, ranks = torch.ones(1), torch.tensor([float(rank)])
        dist.all_reduce(ones, group=pg)
        dist.all_reduce(ranks, group=pg)
        out[dims] = [dist.get_process_group_ranks(pg), int(ones.item()), int(ranks.item())]
    return out


def _resync(job: ResilientJob, weight: torch.Tensor) -> int:
    """After a recovery, on every rank of the new placement: the weight from the first rank of
    this rank's dp group that did not just arrive; the step the job resumes from."""
    dp = job.state.get_pg("dp")
    arrived = job.arrived()
    source = next(r for r in dist.get_process_group_ranks(dp) if r not in arrived)
    dist.broadcast(weight, src=source, group=dp)
    return int(job.step or 0)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True, help="HOST:PORT of the job's store")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--kill-step", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--collective-timeout", type=float, default=12.0)
    p.add_argument("--recovery-timeout", type=float, default=10.0)
    p.add_argument("--spare-wait", type=float, default=120.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank {os.environ.get('RANK')} %(name)s: %(message)s")
    logging.getLogger("hypergrid").setLevel(logging.INFO)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = a.store.rsplit(":", 1)
    timeout = timedelta(seconds=a.collective_timeout)
    # The job's store: the one outside the nodes, which outlives any of them.
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    hypergrid.start_heartbeat(interval_s=0.5)
    grid = HyperCommGrid(SHAPE, list(DIMS), world_size=world)
    for dims in DIMS:
        grid.create_pg(dims)
    job = ResilientJob.of_grid(grid, spares=SPARES, timeout=timedelta(seconds=a.recovery_timeout),
                               settings=RecoverySettings(gpus_per_node=GPUS_PER_NODE))
    _write(a.out / f"started-{rank}.json", {
        "rank": rank, "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
        "agent": os.getppid(), "pid": os.getpid(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    })

    # Which rank decided each round this rank took part in (the lost node's other worker may have
    # arrived first and led it, before its agent ended it).
    deciders: list[int] = []
    agree = rounds.RecoveryRound.agree

    def noted(self: Any, *args: Any, **kwargs: Any) -> Any:
        verdict = agree(self, *args, **kwargs)
        deciders.append(verdict.decided_by)
        return verdict

    rounds.RecoveryRound.agree = noted  # type: ignore[method-assign]
    weight = torch.zeros(1, dtype=torch.float64)
    added: dict[int, float] = {}  # step -> what it added, as last computed
    failures = []
    if job.in_grid:
        step = 0
    else:
        job = job.wait_as_spare(timeout=timedelta(seconds=a.spare_wait))
        if not job.in_grid:
            _write(a.out / f"rank-{rank}.json", {"rank": rank, "role": "unused spare"})
            return 0
        step = _resync(job, weight)
    joined_at = None if rank not in job.arrived() else step
    while step < a.steps:
        saved = weight.clone()
        try:
            if rank == a.victim and step == a.kill_step:
                _write(a.out / "killed.json", {"rank": rank, "step": step, "time": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)
            added[step] = _step(job.state, step)
            weight += added[step]
            step += 1
        except RuntimeError as exc:  # a peer is gone: the docs' loop
            failures.append({"step": step, "error": str(exc).splitlines()[0][:300], "time": time.time()})
            logger.info("step %d failed (%s); recovering", step, failures[-1]["error"])
            job = hypergrid.recover(job, step=step)
            failures[-1]["recovered"] = time.time()
            if not job.in_grid:
                _write(a.out / f"rank-{rank}.json", {"rank": rank, "role": "left", "ranks": list(job.layout.ranks)})
                return 0
            weight.copy_(saved)
            step = _resync(job, weight)
    outcome = {
        "rank": rank, "role": "member", "ranks": list(job.layout.ranks), "spares": list(job.spares),
        "plan": job.last.describe() if job.last else None, "weight": float(weight.item()),
        "added": {str(k): v for k, v in sorted(added.items())}, "joined_at": joined_at, "failures": failures,
        "sums": _sums(job.state, rank), "step": step, "deciders": deciders,
    }
    job.release_spares()
    _write(a.out / f"rank-{rank}.json", outcome)
    dist.destroy_process_group()
    _write(a.out / f"exited-{rank}.json", {"rank": rank, "time": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
