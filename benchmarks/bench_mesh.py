"""One rank of a huge world: DeviceMeshes on hypergrid's groups vs torch's, side by side.

Each measurement runs in a fresh subprocess playing one rank on torch's fake backend, so every
side starts from the same empty world; imports and ``init_process_group`` are done before the
clock starts (torch's lazily imported ``torch._dynamo`` included, which torch 2.15 would otherwise
import at the first mesh slice, a second's work that a training job has done long before). Two
workloads:

``flatten``
    A 3-D mesh (dp, cp, tp) with tp 4 and cp 2, and two torchtitan-style flattened dims,
    ``dp_cp`` and ``cp_tp``. torch: ``init_device_mesh`` and ``mesh[...]._flatten(...)``.
    hypergrid: ``device_mesh(grid, flatten=...)``; and ``device_mesh(grid)`` followed by torch's
    own ``_flatten`` calls, which hypergrid serves.
``torchtitan``
    The installed torchtitan's real ``ParallelDims(...).build_mesh()`` (0.3: a world mesh
    unflattened into five overlapping meshes; 0.2: one mesh and its flattened dims) for a
    llama3 70B-like layout (tp 8, pp 4, the rest data parallel), as torch builds it and with
    ``hypergrid.route_device_meshes()`` on.

Printed per world: time, torch's group-constructor calls (``new_group``, ``split_group``) and
the groups this rank holds afterwards (those on torch's fake backend, which torchtitan uses for
degree-1 dims and which are not communicators, counted apart), and the ratio of times.

Run::

    python benchmarks/bench_mesh.py                      # 65,536 and 1,048,576 ranks
    python benchmarks/bench_mesh.py --worlds 65536 --repeat 1 --anchor-max-world 65536
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from progress import progress  # benchmarks/progress.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ("flatten", "torchtitan")
SIDES = {
    "flatten": ("torch", "hypergrid", "hypergrid+torch-flatten"),
    "torchtitan": ("torch", "hypergrid"),
}


def _count_calls() -> dict[str, int]:
    """Count torch's group constructors wherever they are called from, and the groups this rank
    got that were asked for with backend "fake" (torchtitan's dims of degree 1: no communicator)."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh_module

    counts = {"new_group": 0, "split_group": 0, "fake": 0}
    for module in (dist, dist.distributed_c10d, device_mesh_module):
        for name in ("new_group", "split_group"):
            original = getattr(module, name)

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                counts[_name] += 1
                pg = _original(*args, **kwargs)
                if kwargs.get("backend") == "fake" and pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
                    counts["fake"] += 1
                return pg

            setattr(module, name, counted)
    return counts


def _flatten_workload(side: str, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from hypergrid import HyperCommGrid, device_mesh

    shape, names = (world // 8, 2, 4), ("dp", "cp", "tp")
    if side == "torch":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        mesh["dp", "cp"]._flatten("dp_cp")
        mesh["cp", "tp"]._flatten("cp_tp")
        return mesh
    grid = HyperCommGrid(list(reversed(shape)), list(reversed(names)))
    if side == "hypergrid":
        return device_mesh(grid, device_type="cpu", flatten={"dp_cp": ["cp", "dp"], "cp_tp": ["tp", "cp"]})
    mesh = device_mesh(grid, device_type="cpu")
    mesh["dp", "cp"]._flatten("dp_cp")
    mesh["cp", "tp"]._flatten("cp_tp")
    return mesh


def _titan_workload(side: str, world: int, module: Any, version: str) -> Any:
    from hypergrid import route_device_meshes

    sys.path.insert(0, ROOT)
    from tests.torchtitan_code import build_meshes

    if side == "hypergrid":
        route_device_meshes()
    return build_meshes(module, version, world, tp=8, pp=4)


def _worker(workload: str, side: str, world: int, rank: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    # torch 2.15 imports torch._dynamo (and with it DTensor and FSDP, about a second) at a
    # mesh's first slice; a training job has imported them long before it builds meshes.
    import torch._dynamo  # noqa: F401
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # Imported before the clock, like torch's modules (hypergrid's top level imports lazily).
    import hypergrid.grid  # noqa: F401
    import hypergrid.mesh  # noqa: F401

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    titan: Any = None
    if workload == "torchtitan":
        sys.path.insert(0, ROOT)
        from tests.torchtitan_code import load_parallel_dims

        titan = load_parallel_dims()
    counts = _count_calls()
    before = set(dist.distributed_c10d._world.pg_map)
    start = time.perf_counter()
    if workload == "flatten":
        _flatten_workload(side, world)
    else:
        _titan_workload(side, world, titan[1], titan[0])
    elapsed = time.perf_counter() - start
    made = [pg for pg in dist.distributed_c10d._world.pg_map if pg not in before]
    print(json.dumps({
        "seconds": elapsed,
        "calls": counts,
        "groups": len(made),
        "fake_groups": counts["fake"],
        "torchtitan": None if titan is None else titan[0],
    }))


def _measure(workload: str, side: str, world: int, rank: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", workload, side, str(world), str(rank)],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{workload}/{side} at {world} ranks failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _torchtitan_available() -> str:
    """Why the torchtitan workload cannot run here, or ""."""
    sys.path.insert(0, ROOT)
    from tests.torchtitan_code import TorchtitanUnavailable, load_parallel_dims

    try:
        load_parallel_dims()
    except TorchtitanUnavailable as exc:
        return str(exc)
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="65536,1048576", help="comma-separated world sizes (multiples of 64)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {list(WORKLOADS)}")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side per world (median shown)")
    parser.add_argument("--anchor-max-world", type=int, default=1 << 20, help="largest world to run torch's side at")
    parser.add_argument("--worker", nargs=4, metavar=("WORKLOAD", "SIDE", "WORLD", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], args.worker[1], int(args.worker[2]), int(args.worker[3]))
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w % 64 for w in worlds):
        parser.error(f"world sizes must be multiples of 64 (tp 8 x pp 4 x dp 2 at least), got {worlds}")
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    import torch

    print(f"one rank on torch's fake backend, torch {torch.__version__}; median of {args.repeat}", flush=True)
    header = f"{'workload':<11} {'world':>9}  {'side':<24} {'time':>11}  {'new_group':>9}  {'split':>5}  {'groups':>6}  {'fake':>4}  {'vs torch':>8}"
    for workload in workloads:
        if workload == "torchtitan":
            reason = _torchtitan_available()
            if reason:
                print(f"torchtitan: skipped ({reason})", flush=True)
                continue
        print(header, flush=True)
        print("-" * len(header), flush=True)
        for world in worlds:
            rank = world // 2 + 3  # a rank in the middle: no group of it starts at rank 0
            rows: dict[str, dict] = {}
            for side in SIDES[workload]:
                if side == "torch" and world > args.anchor_max_world:
                    continue
                progress(f"{workload}, {world} ranks: {side} ...")
                runs = [_measure(workload, side, world, rank) for _ in range(max(1, args.repeat))]
                rows[side] = dict(runs[0], seconds=statistics.median(r["seconds"] for r in runs))
            progress("")
            for side, row in rows.items():
                ratio = f"{rows['torch']['seconds'] / row['seconds']:7.1f}x" if "torch" in rows and side != "torch" else f"{'-':>8}"
                label = side + (f" (torchtitan {row['torchtitan']})" if row["torchtitan"] and side == "torch" else "")
                print(f"{workload:<11} {world:>9}  {label:<24} {row['seconds'] * 1e3:8.1f} ms  {row['calls']['new_group']:>9}  "
                      f"{row['calls']['split_group']:>5}  {row['groups']:>6}  {row['fake_groups']:>4}  {ratio}", flush=True)
            if "torch" not in rows:
                print(f"{workload:<11} {world:>9}  {'torch':<24} {'skipped (--anchor-max-world)':>30}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
