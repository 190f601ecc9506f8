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

Printed per world: time, torch group constructors called, those of them every rank of the world
must join (a ``new_group`` without local synchronization, a ``split_group``, a group split off the
world's communicator), groups the rank holds afterwards, and the ratio of times.

``--bound``: the same on a world bound to a device whose communicators are split from the world's
(NCCL with ``device_id``, torch 2.15's ``nccl2``), simulated with the fake backend bound to a CPU
device where the installed torch binds it and then splits (torch 2.15); skipped, saying so, where
it does not. There hypergrid makes the changed groups ``fresh`` (among their members, kept from
splitting); every group Megatron-Core makes is split off the world's, which the lost ranks would
have to join (a real job would hang there; the fake backend only counts it).

A whole job of real processes (8 gloo ranks, one SIGKILLed), timed from the kill to every rank back
in a working placement beside a full restart of the job: benchmarks/bench_recovery_job.py.

Run::

    python benchmarks/bench_recovery.py                 # 65,536 and 1,048,576 ranks
    python benchmarks/bench_recovery.py --worlds 65536 --anchor-max-world 65536
    python benchmarks/bench_recovery.py --bound         # the same on a simulated bound NCCL world
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
    """Count torch's group constructors from now on, and (key ``world-wide``) those every rank of
    the world must join: a ``split_group``, a ``new_group`` without local synchronization, and one
    that torch would split off the bound world's communicator."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    counts = {"new_group": 0, "new_subgroups_by_enumeration": 0, "split_group": 0}
    world_wide = [0]
    for name in counts:
        original = getattr(dist, name)

        @functools.wraps(original)  # hypergrid reads new_group's parameters from its signature
        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            counts[_name] += 1
            world = c10d._get_default_group()
            bound = getattr(world, "bound_device_id", None) is not None
            lazy = getattr(kwargs.get("pg_options"), "lazy_init", False)
            if (_name != "new_group" or not kwargs.get("use_local_synchronization", False)
                    or (bound and not lazy and _splits_off(world))):
                world_wide[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    counts["world-wide"] = world_wide  # type: ignore[assignment]  # read at the end
    return counts


def _splits_off(world: Any) -> bool:
    """Whether torch would split a new group of the world's backend off ``world``'s communicator."""
    import inspect

    import torch.distributed as dist

    source = dist.distributed_c10d._get_split_source
    takes_backend = len(inspect.signature(source).parameters) >= 2
    return (source(world, dist.get_backend(world)) if takes_backend else source(world)) is not None


def _init_fake(rank: int, world: int, bound: bool) -> bool:
    """This process as ``rank`` of a fake world; ``bound``: bound to a CPU device, where torch binds
    the fake backend and then splits (False, nothing started, where it does not)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not bound:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        return True
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world,
                                device_id=torch.device("cpu", 0))
    except (ValueError, RuntimeError, TypeError):
        return False
    from hypergrid.runtime.modes import job_setup

    if not job_setup().splits:
        dist.destroy_process_group()
        return False
    return True


def _worker(side: str, grid: int, rank: int, bound: bool) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    world = grid + NODE
    kwargs = dict(SIZES, create_gloo_process_groups=False)
    if not _init_fake(rank, world if side == "hypergrid" else grid, bound):
        print(json.dumps({"skipped": "this torch does not bind the fake backend to a device and split there"}))
        return
    if bound and side == "megatron-core":
        # On a bound world torch has a rank outside a new group take part in its split (a no-color
        # split of the world's communicator, world-wide on NCCL); the fake backend has no such call:
        # a no-op stands in for it, and the count of world-wide calls says how many there were.
        fake = type(dist.distributed_c10d._get_default_group()._get_backend(dist.distributed_c10d._get_default_group().bound_device_id))
        if not hasattr(fake, "perform_nocolor_split"):
            fake.perform_nocolor_split = lambda self, device: None
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
    world_wide = counts.pop("world-wide")[0]  # type: ignore[index]
    print(json.dumps({"seconds": elapsed, "calls": sum(counts.values()), "world_wide": world_wide, "held": held,
                      "plan": plan}))


def _measure(side: str, grid: int, rank: int, bound: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", side, str(grid), str(rank)] + (["--bound"] if bound else []),
                         capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{side} at {grid} ranks failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="65536,1048576", help="comma-separated grid sizes (multiples of 128)")
    parser.add_argument("--anchor-max-world", type=int, default=65536, help="largest grid to run Megatron-Core's side at")
    parser.add_argument("--bound", action="store_true",
                        help="on a simulated world bound to a device whose communicators are split from the world's")
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "GRID", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], int(args.worker[1]), int(args.worker[2]), args.bound)
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w % 128 for w in worlds):
        parser.error(f"grid sizes must be multiples of 128 (tp 8 x cp 2 x pp 8), got {worlds}")
    import torch

    world = "a world bound to a device, new groups split off it" if args.bound else "an unbound world"
    print(f"one rank on torch's fake backend, torch {torch.__version__}, {world}; node 1 (ranks {LOST[0]}-{LOST[-1]}) "
          f"lost, a spare node takes its place; {SIZES}", flush=True)
    header = (f"{'grid':>9}  {'side':<34} {'time':>11}  {'torch calls':>11}  {'world-wide':>10}  {'groups held':>11}  "
              f"{'vs megatron-core':>16}")
    print(header, flush=True)
    print("-" * len(header), flush=True)
    for grid in worlds:
        rows = []
        anchor = None
        if grid <= args.anchor_max_world:
            progress(f"{grid} ranks: megatron-core ...")
            anchor = _measure("megatron-core", grid, 0, args.bound)
            rows.append(("megatron-core destroy + initialize", anchor))
        for label, rank in (("hypergrid, the spare taking rank 9", grid + 1), ("hypergrid, a rank far from it", grid // 2 + 3)):
            progress(f"{grid} ranks: {label} ...")
            rows.append((label, _measure("hypergrid", grid, rank, args.bound)))
        progress("")
        skipped = [row["skipped"] for _, row in rows if "skipped" in row]
        if skipped:
            print(f"{grid:>9}  skipped: {skipped[0]}", flush=True)
            continue
        for label, row in rows:
            ratio = f"{anchor['seconds'] / row['seconds']:15.1f}x" if anchor is not None and row is not anchor else f"{'-':>16}"
            print(f"{grid:>9}  {label:<34} {row['seconds'] * 1e3:8.1f} ms  {row['calls']:>11}  {row['world_wide']:>10}  "
                  f"{row['held']:>11}  {ratio}", flush=True)
        if anchor is None:
            print(f"{grid:>9}  {'megatron-core':<34} {'skipped (--anchor-max-world)':>30}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
