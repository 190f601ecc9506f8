"""One rank's part of a restore at the job sizes hypergrid is for, through the library's own code.

``hypergrid.train`` plans a restore on every rank for that rank's own part
(``hypergrid.training.restore.plan_own_part``): it derives whom it asks and who will ask it from the
placements, hears which steps its keepers hold, agrees on the step (fixed-size all-reduces), and
trades requests with its peers. Here one rank runs exactly that function; its ``exchange`` is
simulated: an all-reduce returns the rank's own values (every simulated rank holds the step), and
what a peer would send is made by running that peer's part (``OwnPart``) over its own synthesized
state. Only the measured rank's own work is timed (the peers' simulated parts are not).

The job: tp 8 x dp N/8 on nodes of 8 (a node is one dp coordinate), FSDP2 rows over dp
(``--tensors`` tensors a rank, their rows 1-3 per dp rank and uneven, plus as many replicated
ones), partner copies on, ``replica_dim="dp"``, two snapshots a rank. Node 1 (ranks 8-15) is lost:

* ``replace``: a spare node (ranks N..N+7) takes its positions;
* ``shrink``: dp shrinks by that node;
* ``grow``: the shrunk job grows back by the spare node.

For each, three ranks are measured: one that took a lost position (in a shrink, the rank now at the
lost dp coordinate; in a growth, a rank of the node that joined), the holder of a lost rank's copy,
and one far from the loss. Printed: the worst of the three for ``plan_s`` (its part, in seconds),
``bytes_in`` (what it received to plan: answers, requests, all-reduces; state blocks not counted)
and ``peers``. ``--anchor-max-ranks``: up to that size, the same restore planned as hypergrid
planned it before (every rank's report gathered, ``plan_from_reports``' planning on the whole world,
its reports' pickled size as what every rank received), side by side, as a ratio.

Run::

    python benchmarks/bench_restore.py --ranks 1024 16384 131072 --tp 8 --tensors 300
    python benchmarks/bench_restore.py --ranks 64 256 --tensors 100 --anchor-max-ranks 256 --json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from hypergrid.layout import GridLayout  # noqa: E402
from hypergrid.layout.rank_map import RankMap  # noqa: E402
from hypergrid.training.regions import Held, Region, Wanted, chunk, plan_relay, plan_whole, table_of  # noqa: E402
from hypergrid.training.restore import OwnPart, Traffic, plan_own_part  # noqa: E402
from hypergrid.training.routes import Routes  # noqa: E402
from hypergrid.training.state import Snapshot  # noqa: E402

NODE = 8
STEP = 10  # the step every rank resumes from; each also holds the one before


class Model:
    """The state of every rank: ``tensors`` FSDP2 row-sharded tensors and as many replicated ones."""

    def __init__(self, dp: int, tensors: int) -> None:
        self.rows = [dp * (1 + i % 3) + (i * 37) % 61 for i in range(tensors)]

    def regions(self, layout: GridLayout, rank: int) -> dict[tuple[Any, ...], Region]:
        coords = dict(zip(layout.dim_names, layout.coords(rank)))
        context = (("tp", coords["tp"]),)
        dp = layout.dim_size("dp")
        found = {}
        for i, rows in enumerate(self.rows):
            start, size = chunk(rows, dp, coords["dp"])
            found[("model", f"layer{i}.weight")] = Region(context, (rows, 64), (start, 0), (size, 64),
                                                          torch.float32, sharding=((0, "dp"),))
            found[("model", f"layer{i}.norm")] = Region(context, (64,), (0,), (64,), torch.float32, sharding=())
        return found


class World:
    """Every simulated rank's part, made on first use: its live state on the new placement, the
    snapshots it holds (its own and the copies the partner ring gives it, of two steps)."""

    def __init__(self, routes: Routes, model: Model) -> None:
        self.routes, self.model = routes, model
        self._parts: dict[int, OwnPart] = {}
        self._requests: dict[int, Any] = {}

    def held(self, rank: int) -> dict[tuple[int, int], Snapshot]:
        old = self.routes.old
        found = {}
        for source in self.routes.kept(rank):
            coords = tuple(zip(old.dim_names, old.coords(source)))
            regions = self.model.regions(old, source)
            for step in (STEP - 1, STEP):
                found[(source, step)] = Snapshot(step, {}, rank=source, regions=regions, coords=coords)
        return found

    def wanted(self, rank: int) -> dict[tuple[Any, ...], Region]:
        return self.model.regions(self.routes.new, rank)

    def part(self, rank: int) -> OwnPart:
        if rank not in self._parts:
            self._parts[rank] = OwnPart(self.routes, rank, self.wanted(rank), self.held(rank))
        return self._parts[rank]

    def requests(self, rank: int) -> Any:
        if rank not in self._requests:
            part = self.part(rank)
            answers = {k: self.part(k).answers()[rank] for k in part.heard_from}
            self._requests[rank] = part.choose(STEP, answers)[2]
        return self._requests[rank]


class Simulated:
    """The measured rank's exchange: all-reduces of its own values, and the messages its peers'
    simulated parts send it (their making timed apart, in ``simulated_s``)."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank, self.traffic = world, rank, Traffic()
        self.calls, self.simulated_s = 0, 0.0

    def agreed_max(self, values: list[int]) -> list[int]:
        self.traffic.bytes_in += 8 * len(values)
        return list(values)

    def swap(self, sends: Mapping[int, Any], receives: Sequence[int]) -> dict[int, Any]:
        for value in sends.values():  # this rank's own work: what it sends, pickled
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        start = time.perf_counter()
        if self.calls == 0:
            got = {peer: self.world.part(peer).answers()[self.rank] for peer in receives}
        else:
            got = {peer: self.world.requests(peer)[self.rank] for peer in receives}
        self.calls += 1
        self.simulated_s += time.perf_counter() - start
        self.traffic.bytes_in += sum(8 + len(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)) for v in got.values())
        return got


def layouts(ranks: int, tp: int, kind: str) -> tuple[GridLayout, GridLayout, list[tuple[str, int]]]:
    """The placement before and after, and the ranks to measure (role, rank)."""
    dp = ranks // tp
    full = GridLayout((tp, dp), ("tp", "dp"))
    lost = range(NODE, 2 * NODE)
    spares = [ranks + i for i in range(NODE)]
    survivors = [r for r in range(ranks) if r not in lost]
    shrunk = GridLayout((tp, dp - 1), ("tp", "dp"), rank_map=RankMap.of(survivors))
    copy_of_lost = 2 * NODE + 1  # node 2 holds node 1's copies
    far = ranks // 2 + 3
    if kind == "replace":
        placed = list(range(ranks))
        placed[NODE:2 * NODE] = spares
        new = GridLayout((tp, dp), ("tp", "dp"), rank_map=RankMap.of(placed))
        return full, new, [("took a lost position", spares[1]), ("holds a lost copy", copy_of_lost), ("far", far)]
    if kind == "shrink":
        return full, shrunk, [("at the lost coordinate", copy_of_lost), ("its neighbour", 1), ("far", far)]
    grown = GridLayout((tp, dp), ("tp", "dp"), rank_map=RankMap.of(survivors + spares))
    return shrunk, grown, [("joined", spares[1]), ("holds the copy it takes", 1), ("far", far)]


def measure(ranks: int, tp: int, tensors: int, kind: str) -> dict[str, Any]:
    old, new, roles = layouts(ranks, tp, kind)
    model = Model(ranks // tp, tensors)
    world = World(Routes(old, new, "dp", NODE), model)
    rows = []
    for role, rank in roles:
        routes = Routes(old, new, "dp", NODE)  # its own: the partner ring is built in its time
        wanted, held = world.wanted(rank), world.held(rank)
        exchange = Simulated(world, rank)
        start = time.perf_counter()
        done = plan_own_part(routes, wanted, held, STEP, exchange, rank=rank)
        spent = time.perf_counter() - start - exchange.simulated_s
        assert done is not None, f"rank {rank} could not plan its own part"
        rows.append(dict(role=role, rank=rank, plan_s=round(spent, 4), bytes_in=exchange.traffic.bytes_in,
                         peers=len(exchange.traffic.peers), parts=len(done.plan.parts)))
    worst = dict(ranks=ranks, kind=kind, tensors=2 * tensors, plan_s=max(r["plan_s"] for r in rows),
                 bytes_in=max(r["bytes_in"] for r in rows), peers=max(r["peers"] for r in rows), measured=rows)
    return worst


def anchor(ranks: int, tp: int, tensors: int, kind: str) -> dict[str, Any]:
    """The same restore planned from every rank's report, on one rank, as train planned it before:
    the tables' names first, then, where a shape changed, every region of every rank."""
    old, new, _ = layouts(ranks, tp, kind)
    world = World(Routes(old, new, "dp", NODE), Model(ranks // tp, tensors))
    reports = []
    for rank in new.ranks:
        held = [Held(rank, source, step, source != rank, s.coords, s.regions)
                for (source, step), s in world.held(rank).items()]
        reports.append((Wanted(rank, tuple(zip(new.dim_names, new.coords(rank))), world.wanted(rank)), held))
    # Each rank names its own tables (in parallel, in a real job): not counted in the planning.
    named = [(w.__class__(w.rank, w.coords, {}, table_of(w.regions)),
              [h.__class__(h.holder, h.source, h.step, h.copy, h.coords, {}, table_of(h.regions)) for h in hs])
             for w, hs in reports]
    size = len(pickle.dumps(named))
    start = time.perf_counter()
    plan = plan_whole([w for w, _ in named], [h for _, hs in named for h in hs], STEP)
    if plan is None:
        size += len(pickle.dumps(reports))
        plan = plan_relay([w for w, _ in reports], [h for _, hs in reports for h in hs], STEP, "dp")
    return dict(anchor_plan_s=round(time.perf_counter() - start, 3), anchor_bytes_in=size)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384, 131072])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=300, help="FSDP2 tensors a rank (as many replicated ones)")
    parser.add_argument("--kinds", nargs="+", default=["replace", "shrink", "grow"])
    parser.add_argument("--anchor-max-ranks", type=int, default=0,
                        help="plan from every rank's report too, up to this many ranks")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    args = parser.parse_args(argv)
    results = []
    for ranks in args.ranks:
        if ranks % (args.tp * NODE) and ranks % args.tp:
            parser.error(f"--ranks {ranks} must be a multiple of --tp {args.tp}")
        for kind in args.kinds:
            row = measure(ranks, args.tp, args.tensors, kind)
            if ranks <= args.anchor_max_ranks:
                row.update(anchor(ranks, args.tp, args.tensors, kind))
                row["ratio"] = round(row["anchor_plan_s"] / max(row["plan_s"], 1e-6), 1)
            results.append(row)
            if not args.json:
                extra = (f"   from every rank's report: {row['anchor_plan_s']:.3f} s, {row['anchor_bytes_in']:,} B "
                         f"({row['ratio']}x)" if "ratio" in row else "")
                print(f"{ranks:>8} ranks {kind:<8} plan {row['plan_s']:.4f} s  received {row['bytes_in']:>9,} B  "
                      f"peers {row['peers']:>3}{extra}", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
