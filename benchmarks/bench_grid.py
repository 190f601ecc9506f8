"""One rank of a huge world: create the 7 groups of a 4-D grid, hypergrid vs Megatron-Core.

Each measurement runs in a fresh subprocess playing one rank on torch's fake backend, so both
sides start from the same empty world. Megatron-Core's ``HyperCommGrid`` calls ``new_group`` for
every group of every request on every rank; hypergrid creates only this rank's groups. The
anchor is skipped where it would take minutes (``--anchor-max-world``).

Run::

    python benchmarks/bench_grid.py                  # 4,096 / 65,536 / 1,048,576 ranks
    python benchmarks/bench_grid.py --worlds 4096 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from progress import progress  # benchmarks/progress.py, beside this script

# (tp, cp, pp, dp) for each world; dp takes what is left.
SHAPES = {
    4096: (8, 2, 4, 64),
    65536: (8, 2, 8, 512),
    1048576: (8, 4, 16, 2048),
}
REQUESTS = [["tp"], ["cp"], ["pp"], ["dp"], ["tp", "cp"], ["cp", "dp"], ["tp", "pp"]]


def _worker(impl: str, world: int, rank: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    shape = list(SHAPES[world])
    names = ["tp", "cp", "pp", "dp"]
    if impl == "megatron":
        os.environ["WORLD_SIZE"] = str(world)
        from megatron.core.hyper_comm_grid import HyperCommGrid
    else:
        from hypergrid import HyperCommGrid
    grid = HyperCommGrid(shape, names)  # imports done: time only the group creation
    start = time.perf_counter()
    for dims in REQUESTS:
        grid.create_pg(dims)
    elapsed = time.perf_counter() - start
    sizes = [grid.get_pg(d).size() for d in REQUESTS]
    print(json.dumps({"seconds": elapsed, "sizes": sizes, "groups_on_rank": len(dist.distributed_c10d._world.pg_map)}))


def _measure(impl: str, world: int, rank: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", impl, str(world), str(rank)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{impl} at {world} ranks failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])




def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default=",".join(str(w) for w in SHAPES), help="comma-separated world sizes")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side per world (median shown)")
    parser.add_argument("--anchor-max-world", type=int, default=65536, help="largest world to run Megatron-Core at")
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "WORLD", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return 0

    worlds = [int(w) for w in args.worlds.split(",")]
    unknown = [w for w in worlds if w not in SHAPES]
    if unknown:
        parser.error(f"no grid shape for world sizes {unknown}; known: {sorted(SHAPES)}")
    print("7 groups of a 4-D grid (tp, cp, pp, dp, tp-cp, dp-cp, pp-tp) on one rank, fake backend", flush=True)
    header = f"{'world':>9}  {'shape (tp,cp,pp,dp)':>20}  {'hypergrid':>11}  {'megatron-core':>13}  {'ratio':>8}"
    print(header, flush=True)
    print("-" * len(header), flush=True)
    for world in worlds:
        rank = world // 2 + 3  # a rank in the middle: no group of it starts at rank 0
        progress(f"{world} ranks: hypergrid ...")
        ours = [_measure("hypergrid", world, rank) for _ in range(max(1, args.repeat))]
        ours_s = statistics.median(r["seconds"] for r in ours)
        if world <= args.anchor_max_world:
            progress(f"{world} ranks: megatron-core ...")
            theirs = [_measure("megatron", world, rank) for _ in range(max(1, args.repeat))]
            if theirs[0]["sizes"] != ours[0]["sizes"]:
                raise RuntimeError(f"group sizes differ at {world}: {theirs[0]['sizes']} vs {ours[0]['sizes']}")
            theirs_s = statistics.median(r["seconds"] for r in theirs)
            anchor, ratio = f"{theirs_s * 1e3:10.1f} ms", f"{theirs_s / ours_s:7.0f}x"
        else:
            anchor, ratio = f"{'skipped':>13}", f"{'-':>8}"
        progress("")
        print(
            f"{world:>9}  {str(SHAPES[world]):>20}  {ours_s * 1e3:8.2f} ms  {anchor}  {ratio}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
