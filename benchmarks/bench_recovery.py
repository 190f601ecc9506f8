"""One rank of a huge world after a node is lost: hypergrid's in-process recovery vs Megatron-Core's
destroy + initialize_model_parallel for the new layout, side by side.

Each measurement runs in a fresh subprocess playing one rank on torch's fake backend (so the
failed ranks are given, not agreed on: a simulated world has nobody to agree with). The job is a
Megatron-Core layout (tp 8, cp 2, pp 8, the rest data parallel) on every rank but one spare node
of 8 ranks; node 1 (ranks 8-15) is lost.

* ``hypergrid``: ``ResilientJob.of_megatron(spares=...)``, then, timed, ``job.recover(failed=...)``:
  the spare node takes node 1's positions, ``parallel_state`` is filled for the new placement,
  and only the groups that held a lost rank are made again. Measured on two ranks: one whose
  groups touch the lost node (rank 9's tensor-parallel peer would be, here the spare that takes
  rank 9's place is measured) and one far from it.
* ``megatron-core``: ``destroy_model_parallel()`` and ``initialize_model_parallel`` for a world of
  the grid's size: every group of the world again on every rank (it has no placement; the cost
  does not depend on which ranks hold the positions).

Printed per world: time, torch group constructors called, groups the rank holds afterwards, and
the ratio of times.

A whole job of real processes (8 gloo ranks, one SIGKILLed), timed from the kill to every rank back
in a working placement beside a full restart of the job: benchmarks/bench_recovery_job.py.

Run::

    python benchmarks/bench_recovery.py                 # 65,536 and 1,048,576 ranks
    python benchmarks/bench_recovery.py --worlds 65536 --anchor-max-world 65536
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from typing import Any

from progress import progress  # benchmarks/progress.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE = 8
SIZES = dict(tensor_model_parallel_size=8, context_parallel_size=2, pipeline_model_parallel_size=8)
LOST = list(range(NODE, 2 * NODE))  # node 1


def _count_calls() -> dict[str, int]:
    import torch.distributed as dist

    counts = {"new_group": 0, "new_subgroups_by_enumeration": 0, "split_group": 0}
    for name in counts:
        original = getattr(dist, name)

        @functools.wraps(original)  # hypergrid reads new_group's parameters from its signature
        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def _worker(side: str, grid: int, rank: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = grid + NODE
    kwargs = dict(SIZES, create_gloo_process_groups=False)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world if side == "hypergrid" else grid)
    from megatron.core import parallel_state as ps

    import hypergrid
    import hypergrid.megatron.recovery  # noqa: F401  (imported before the clock)

    if side == "hypergrid":
        job = hypergrid.ResilientJob.of_megatron(spares=range(grid, world), **kwargs)
        counts = _count_calls()
        start = time.perf_counter()
        job = job.recover(failed=LOST)
        elapsed = time.perf_counter() - start
        held = len(job.state.distinct_groups()) if job.state is not None else 0
        plan = job.last.describe()
    else:
        ps.initialize_model_parallel(**kwargs)
        counts = _count_calls()
        start = time.perf_counter()
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(**kwargs)
        elapsed = time.perf_counter() - start
        held = len([pg for pg in dist.distributed_c10d._world.pg_map if pg is not dist.group.WORLD])
        plan = ""
    print(json.dumps({"seconds": elapsed, "calls": sum(counts.values()), "held": held, "plan": plan}))


def _measure(side: str, grid: int, rank: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", side, str(grid), str(rank)],
                         capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{side} at {grid} ranks failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="65536,1048576", help="comma-separated grid sizes (multiples of 128)")
    parser.add_argument("--anchor-max-world", type=int, default=65536, help="largest grid to run Megatron-Core's side at")
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "GRID", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w % 128 for w in worlds):
        parser.error(f"grid sizes must be multiples of 128 (tp 8 x cp 2 x pp 8), got {worlds}")
    import torch

    print(f"one rank on torch's fake backend, torch {torch.__version__}; node 1 (ranks {LOST[0]}-{LOST[-1]}) lost, "
          f"a spare node takes its place; {SIZES}", flush=True)
    header = f"{'grid':>9}  {'side':<34} {'time':>11}  {'torch calls':>11}  {'groups held':>11}  {'vs megatron-core':>16}"
    print(header, flush=True)
    print("-" * len(header), flush=True)
    for grid in worlds:
        rows = []
        anchor = None
        if grid <= args.anchor_max_world:
            progress(f"{grid} ranks: megatron-core ...")
            anchor = _measure("megatron-core", grid, 0)
            rows.append(("megatron-core destroy + initialize", anchor))
        for label, rank in (("hypergrid, the spare taking rank 9", grid + 1), ("hypergrid, a rank far from it", grid // 2 + 3)):
            progress(f"{grid} ranks: {label} ...")
            rows.append((label, _measure("hypergrid", grid, rank)))
        progress("")
        for label, row in rows:
            ratio = f"{anchor['seconds'] / row['seconds']:15.1f}x" if anchor is not None and row is not anchor else f"{'-':>16}"
            print(f"{grid:>9}  {label:<34} {row['seconds'] * 1e3:8.1f} ms  {row['calls']:>11}  {row['held']:>11}  {ratio}",
                  flush=True)
        if anchor is None:
            print(f"{grid:>9}  {'megatron-core':<34} {'skipped (--anchor-max-world)':>30}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
