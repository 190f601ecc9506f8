"""One rank of a huge world: Megatron-Core's full initialize_model_parallel vs hypergrid's.

Each measurement runs in a fresh subprocess playing one rank on torch's fake backend, so every
side starts from the same empty world with its imports done. Megatron-Core creates every group
of the world on every rank; hypergrid creates only this rank's groups. Megatron-Core is skipped
where it would take minutes (``--anchor-max-world``). Both run with the same MoE configuration
(tp, pp, cp, ep, expert tp) and ``create_gloo_process_groups=False`` (the fake backend has no
gloo). Beside the times, the number of communicators each leaves on the rank is counted:
hypergrid with group sharing on (default) and off, and Megatron-Core's.

Run::

    python benchmarks/bench_megatron.py                       # 4,096 / 65,536 / 1,048,576 ranks
    python benchmarks/bench_megatron.py --worlds 4096 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from progress import progress  # benchmarks/progress.py, beside this script

# Megatron keywords per world: tensor, pipeline, context, expert and expert-tensor parallel.
CONFIGS = {
    4096: dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, context_parallel_size=2,
               expert_model_parallel_size=8, expert_tensor_parallel_size=1),
    65536: dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, context_parallel_size=2,
                expert_model_parallel_size=8, expert_tensor_parallel_size=1),
    1048576: dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=16, context_parallel_size=4,
                  expert_model_parallel_size=8, expert_tensor_parallel_size=1),
}


def _worker(impl: str, world: int, rank: int, repeat: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    import hypergrid.megatron as hm
    from hypergrid.megatron import initialize as _loaded  # noqa: F401  (imports outside the timing)

    kwargs = dict(CONFIGS[world], create_gloo_process_groups=False)
    times = []
    groups = None
    for _ in range(repeat if impl != "megatron" else 1):
        start = time.perf_counter()
        if impl == "megatron":
            ps.initialize_model_parallel(**kwargs)
        else:
            hm.initialize_model_parallel(share_groups=(impl == "hypergrid"), **kwargs)
        times.append(time.perf_counter() - start)
        grids = hm.active_grids()
        if impl == "megatron":
            groups = len(ps._global_process_group_list) - 1
        else:
            groups = grids.num_process_groups
            world_shared = grids.world_shared
        check = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_next_rank())
        hm.destroy_model_parallel()
    out = {"times": times, "groups": groups, "check": check}
    if impl != "megatron":
        out["world_shared"] = world_shared
    print(json.dumps(out))


def _measure(impl: str, world: int, rank: int, repeat: int, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", impl, str(world), str(rank), str(repeat)],
        capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} at {world} ranks failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=sorted(CONFIGS))
    parser.add_argument("--rank", type=int, default=None, help="rank to play (default: the middle one)")
    parser.add_argument("--repeat", type=int, default=5, help="hypergrid runs per process (first is cold)")
    parser.add_argument("--anchor-max-world", type=int, default=65536,
                        help="skip Megatron-Core above this world size (it takes minutes)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    unknown = [w for w in args.worlds if w not in CONFIGS]
    if unknown:
        parser.error(f"no configuration for world size(s) {unknown}; known: {sorted(CONFIGS)}")

    header = (f"{'ranks':>9} {'megatron s':>11} {'hypergrid s (cold/best)':>24} {'speed-up best/cold':>18} "
              f"{'groups: megatron':>17} {'hg shared':>10} {'hg private':>11}  {'hg private s':>12}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = f"megatron-core {version('megatron-core')}"
    except PackageNotFoundError:
        installed = "megatron-core (version unknown)"
    print(f"Megatron-Core initialize_model_parallel vs hypergrid.megatron, one rank on the fake backend "
          f"({installed}, Python {sys.version.split()[0]})")
    print(header)
    for world in args.worlds:
        rank = world // 2 + 3 if args.rank is None else args.rank
        progress(f"{world} ranks: hypergrid ...")
        shared = _measure("hypergrid", world, rank, args.repeat, args.timeout)
        private = _measure("hypergrid-private", world, rank, args.repeat, args.timeout)
        anchor = None
        if world <= args.anchor_max_world:
            progress(f"{world} ranks: megatron-core ...")
            anchor = _measure("megatron", world, rank, 1, args.timeout)
            if anchor["check"] != shared["check"]:
                raise RuntimeError(f"getters disagree at {world} ranks: megatron {anchor['check']} vs {shared['check']}")
        progress("")
        cold, best = shared["times"][0], min(shared["times"])
        mega = anchor["times"][0] if anchor else None
        ratio = f"{mega / best:.0f}x / {mega / cold:.0f}x" if mega else "skipped"
        print(
            f"{world:>9} {f'{mega:.3f}' if mega else 'skipped':>11} {f'{cold * 1e3:.1f} / {best * 1e3:.1f} ms':>24} "
            f"{ratio:>18} {(anchor['groups'] if anchor else '-')!s:>17} {shared['groups']:>10} "
            f"{private['groups']:>11}  {min(private['times']) * 1e3:>9.1f} ms"
        )
        if shared["world_shared"]:
            print(f"{'':>9} whole-world groups handed out as the default group (sharing on): {', '.join(shared['world_shared'])}")
    print("speed-up: Megatron-Core's time / hypergrid's best and first (cold) run, sharing on; groups: communicators on the rank after init")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
