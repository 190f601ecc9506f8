"""One worker of tests/test_recovery_torchrun.py, started by torchrun as a user's training script.

``python -m torch.distributed.run ... -m tests.torchrun_worker --store HOST:PORT --out DIR ...``

It connects its default group to the job's store, which a process outside the nodes hosts
(``python -m hypergrid store``), not to torchrun's ``MASTER_ADDR:MASTER_PORT`` (a store inside
node 0's agent). The grid is tp 2 x dp 2 on ranks 0-3 (nodes 0 and 1), ranks 4 and 5 (node 2)
are spares. Each step adds to a weight what two all-reduces give, on tp then on dp; the loop is
``hypergrid.train``'s: the weight is the model, what each step added a user object, both
rolled back to the step every rank holds, and a rank that just arrived takes them from a
surviving data-parallel peer. ``--victim`` SIGKILLs itself at
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


class Weight(torch.nn.Module):
    """The job's one weight: what every step adds to it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64), requires_grad=False)


class Added:
    """What each step added, by step: a user object hypergrid.train rolls back with the rest."""

    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def state_dict(self) -> dict:
        return {"values": dict(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state["values"])


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
    def setup(job: ResilientJob) -> hypergrid.TrainingState:
        return hypergrid.TrainingState(Weight(), added=Added())

    def one_step(job: ResilientJob, state: hypergrid.TrainingState, step: int) -> float:
        if rank == a.victim and step == a.kill_step:
            _write(a.out / "killed.json", {"rank": rank, "step": step, "time": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        value = _step(job.state, step)
        (model,) = state.models
        with torch.no_grad():
            model.weight += value
        state.objects["added"].values[step] = value
        return value

    run = hypergrid.train(job, setup, one_step, steps=a.steps, wait_timeout=timedelta(seconds=a.spare_wait))
    job = run.job
    if not job.in_grid:
        role = "unused spare" if not run.records else "left"
        _write(a.out / f"rank-{rank}.json", {"rank": rank, "role": role, "ranks": list(job.layout.ranks)})
        return 0
    assert run.state is not None
    (model,) = run.state.models
    added = run.state.objects["added"].values
    weight = model.weight
    joined = [r for r in run.records if r.kind == "joined"]
    joined_at = joined[0].resumed_step if joined else None
    failures = [{"step": r.failed_step, "time": r.seen_at, "resumed": r.resumed_step,
                 "recovered": r.seen_at + (r.agreed_s or 0.0) + (r.rebuilt_s or 0.0), "record": r.describe()}
                for r in run.records if r.failed_step is not None]
    step = run.step
    outcome = {
        "rank": rank, "role": "member", "ranks": list(job.layout.ranks), "spares": list(job.spares),
        "plan": job.last.describe() if job.last else None, "weight": float(weight.item()),
        "records": [r.describe() for r in run.records],
        "added": {str(k): v for k, v in sorted(added.items())}, "joined_at": joined_at, "failures": failures,
        "sums": _sums(job.state, rank), "step": step, "deciders": deciders,
    }
    _write(a.out / f"rank-{rank}.json", outcome)
    dist.destroy_process_group()
    _write(a.out / f"exited-{rank}.json", {"rank": rank, "time": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
