"""Store operations per rank: hypergrid beside Megatron-Core, in a real 8-rank gloo job.

Every rank's default group is built over a counting wrapper around the job's TCPStore, so each
operation torch and hypergrid make on the store is counted, per rank, with the share of
hypergrid's agreement check (keys under ``hypergrid/agree``) beside torch's own. Two workloads,
each run by both sides in fresh jobs:

* ``grid``: a 3-D grid (tp 2, cp 2, dp 2) and 5 of its groups, hypergrid's ``HyperCommGrid``
  against Megatron-Core's;
* ``megatron``: a full ``initialize_model_parallel`` (tp 2, pp 2, ep 2, no gloo groups).

Run::

    python benchmarks/bench_store.py            # prints a table; --json for the raw counts
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import warnings
from collections import Counter
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 8
GRID_SHAPE, GRID_NAMES = [2, 2, 2], ["tp", "cp", "dp"]
GRID_REQUESTS: list[Any] = ["tp", "dp", ["cp", "dp"], ["tp", "cp"], ["tp", "cp", "dp"]]
MEGATRON = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                create_gloo_process_groups=False)
AGREEMENT_PREFIX = "hypergrid/agree"


class CountingStore(dist.Store):
    """Forwards every call to ``inner`` and counts it, split by whether the key is hypergrid's agreement's."""

    def __init__(self, inner: dist.Store, counts: Counter | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.counts: Counter = Counter() if counts is None else counts

    def clone(self):
        """Another connection (hypergrid's agreement uses its own), counted with this one."""
        return CountingStore(self.inner.clone(), self.counts)

    def _note(self, op: str, keys: Any) -> None:
        keys = [keys] if isinstance(keys, str) else list(keys)
        who = "agreement" if any(AGREEMENT_PREFIX in k for k in keys) else "torch"
        self.counts[(who, op)] += 1

    def set(self, key, value):
        self._note("set", key)
        return self.inner.set(key, value)

    def get(self, key):
        self._note("get", key)
        return self.inner.get(key)

    def add(self, key, value):
        self._note("add", key)
        return self.inner.add(key, value)

    def check(self, keys):
        self._note("check", keys)
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._note("wait", keys)
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def multi_get(self, keys):
        self._note("multi_get", keys)
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self._note("multi_set", keys)
        if any(AGREEMENT_PREFIX + "/last/" in k for k in keys):
            self.counts[("rounds", "joined")] += 1  # a member's one publish of an agreement round
        return self.inner.multi_set(keys, values)

    def compare_set(self, key, expected, desired):
        self._note("compare_set", key)
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        self._note("delete_key", key)
        return self.inner.delete_key(key)

    def append(self, key, value):
        self._note("append", key)
        return self.inner.append(key, value)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def _rank(rank: int, port: int, workload: str, side: str, results: mp.Queue) -> None:
    warnings.filterwarnings("ignore")
    timeout = datetime.timedelta(seconds=120)
    tcp = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
    store = CountingStore(tcp)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    store.counts.clear()  # count only the workload, not the default group's own set-up
    if workload == "grid":
        if side == "megatron":
            from megatron.core.hyper_comm_grid import HyperCommGrid
        else:
            from hypergrid import HyperCommGrid
        grid = HyperCommGrid(GRID_SHAPE, GRID_NAMES)
        for dims in GRID_REQUESTS:
            grid.create_pg(dims)
        requests = len(GRID_REQUESTS)
    else:
        if side == "megatron":
            from megatron.core.parallel_state import initialize_model_parallel
        else:
            from hypergrid.megatron import initialize_model_parallel
        initialize_model_parallel(**MEGATRON)
        requests = 0
    results.put((rank, {f"{who}/{op}": n for (who, op), n in store.counts.items()}, requests))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(workload: str, side: str) -> list[dict[str, int]]:
    """Per rank, ``{"torch/set": n, "agreement/multi_set": m, ...}`` for one workload and side."""
    port = _free_port()
    host = dist.TCPStore("127.0.0.1", port, WORLD, is_master=True, timeout=datetime.timedelta(seconds=120),
                         wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, workload, side, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, int]] = {}
    for _ in range(WORLD):
        rank, counts, _requests = results.get(timeout=300)
        out[rank] = counts
    for p in procs:
        p.join(timeout=60)
    del host
    return [out[r] for r in range(WORLD)]


def _per_round(per_rank: list[dict[str, int]]) -> str:
    """Agreement calls per member per group: each rank's agreement calls over the rounds it joined."""
    ratios = [
        sum(n for k, n in counts.items() if k.startswith("agreement/")) / counts["rounds/joined"]
        for counts in per_rank
        if counts.get("rounds/joined")
    ]
    return f"{statistics.mean(ratios):.2f} [{max(ratios):.2f}]" if ratios else "-"


def _totals(per_rank: list[dict[str, int]], who: str) -> list[int]:
    return [sum(n for k, n in counts.items() if k.startswith(who + "/")) for counts in per_rank]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the raw per-rank counts as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("HYPERGRID_STRATEGY", "auto")
    raw: dict[str, Any] = {}
    print(f"store operations per rank, {WORLD}-rank gloo job (median over ranks; max in brackets)")
    print(
        f"{'workload':<10} {'side':<14} {'torch':>10} {'agreement':>12} {'total':>10}  agreement share"
        "  agreement calls per member per group (mean [max])"
    )
    for workload in ("grid", "megatron"):
        for side in ("megatron", "hypergrid"):
            per_rank = run(workload, side)
            raw[f"{workload}/{side}"] = per_rank
            torch_ops, agree_ops = _totals(per_rank, "torch"), _totals(per_rank, "agreement")
            total = [a + b for a, b in zip(torch_ops, agree_ops)]
            share = sum(agree_ops) / max(1, sum(total))
            label = "Megatron-Core" if side == "megatron" else "hypergrid"
            print(
                f"{workload:<10} {label:<14} {statistics.median(torch_ops):>6.0f} [{max(torch_ops)}] "
                f"{statistics.median(agree_ops):>7.0f} [{max(agree_ops)}] {statistics.median(total):>6.0f} "
                f"[{max(total)}]  {share:>15.0%}  {_per_round(per_rank)}"
            )
    if args.json:
        print(json.dumps(raw, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
