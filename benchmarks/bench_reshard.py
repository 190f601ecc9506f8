"""A shrink with sharded state: re-laying FSDP2 shards from the survivors' snapshots and partner
copies in host memory, beside writing and reading them back with torch.distributed.checkpoint.

4 gloo ranks on this machine, nodes of 2: FSDP2 over dp 4 of a ``--params`` million parameter
MLP with Adam (one step taken, so the moments exist). Each rank takes its snapshot with digests
and regions (``TrainingState.capture(placement=...)``) and sends it to its partner on the other
node (``PartnerCopies``). Node 1 (ranks 2 and 3) is then taken as lost: ranks 0 and 1 build the
model again on dp 2 and

* ``relay``: report what they need and hold, derive the plan (``plan_relay``), check the digests
  of what they send from, exchange the blocks (``relay``) and restore: what ``hypergrid.train``
  does after the shrink, on the same public pieces;
* ``dcp load``: ``dcp.load`` of a checkpoint the dp-4 job wrote before (``dcp save``, to local
  disk in ``--folder``) into the dp-2 model, then ``set_state_dict``: DCP's own resharding.

Both give the same tensors (checked). Printed: each time (the slowest rank's, median of
``--repeats``), and relay / dcp load. The dcp load reads a checkpoint just written (page cache):
a best case for the disk.

Run::

    python benchmarks/bench_reshard.py                      # 10M parameters
    python benchmarks/bench_reshard.py --params 10 100 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_snapshot import model_of  # benchmarks/ is on the path when run as a script
from ranks import run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import hypergrid
from hypergrid.layout import GridLayout
from hypergrid.training.partner import PartnerCopies
from hypergrid.training.regions import Held, Placement, Wanted, plan_relay
from hypergrid.training.transfer import relay

BATCH, WORLD, KEPT = 32, 4, 2


def median_s(call: Callable[[], object], repeats: int, group: Any) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sharded(millions: int, mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = model_of(millions)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def rank_main(rank: int, port: int, out: Any, millions: int, repeats: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model, optimizer = sharded(millions, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)))
    width = model[0].in_features
    generator = torch.Generator().manual_seed(rank)
    torch.nn.functional.mse_loss(model(torch.randn(BATCH, width, generator=generator)),
                                 torch.randn(BATCH, width, generator=generator)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = Placement(GridLayout((WORLD,), ("dp",)), rank, replica_dim="dp")
    snapshot = hypergrid.TrainingState(model, optimizer).capture(1, digests=True, placement=before)
    copies = PartnerCopies(gpus_per_node=2)
    copies.start(snapshot, list(range(WORLD)), dist.group.WORLD)
    copies.finish()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    save_s = median_s(lambda: dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder), 1,
                      dist.group.WORLD)
    mesh = DeviceMesh("cpu", list(range(KEPT)), mesh_dim_names=("dp",))  # made on every rank, as torch asks
    result: dict[str, Any] = {"save_s": save_s}
    if rank < KEPT:
        kept = mesh.get_group()
        small, small_optimizer = sharded(millions, mesh)  # Adam's state is made by get_state_dict
        state = hypergrid.TrainingState(small, small_optimizer)
        after = Placement(GridLayout((KEPT,), ("dp",)), rank, replica_dim="dp")
        mine = {rank: snapshot, **{c.rank: c for c in copies.held() if c.rank is not None}}

        def relaid() -> None:
            wanted = Wanted(rank, after.coords, state.regions(after))
            held = [Held(rank, source, s.step, source != rank, s.coords, s.regions) for source, s in mine.items()]
            reports: list[Any] = [None] * KEPT
            dist.all_gather_object(reports, (wanted, held), group=kept)
            plan = plan_relay([w for w, _ in reports], [h for _, hs in reports for h in hs], 1, "dp")
            assert not plan.missing, plan.missing
            for source in {p.source for p in plan.parts if p.holder == rank}:
                mine[source].verify()
            state.restore(relay(plan, mine, wanted.regions, kept), verify=False)

        result["relay_s"] = median_s(relaid, repeats, kept)
        from_copies = state.capture(1)

        def loaded() -> None:
            small_sd, small_optim_sd = get_state_dict(small, small_optimizer)
            target = {"model": small_sd, "optim": small_optim_sd}
            dcp.load(target, checkpoint_id=folder, process_group=kept)
            set_state_dict(small, small_optimizer, model_state_dict=target["model"],
                           optim_state_dict=target["optim"])

        result["load_s"] = median_s(loaded, repeats, kept)
        from_disk = state.capture(1)
        result["equal"] = all(torch.equal(from_copies.tensors[path], tensor)
                              for path, tensor in from_disk.tensors.items())
        result["params"] = sum(p.numel() for p in small.parameters())
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, nargs="+", default=[10], help="millions of parameters in the model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default=None, help="where the dcp checkpoint goes (default: a temporary folder)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {WORLD} gloo ranks on {os.cpu_count()} CPUs, FSDP2 dp {WORLD} -> {KEPT}, Adam")
    print(f"{'params':>8} {'dcp save':>9} {'relay':>8} {'dcp load':>9} {'relay/load':>10} {'equal':>6}")
    for millions in args.params:
        with tempfile.TemporaryDirectory(dir=args.folder) as folder:
            got = run_ranks(rank_main, WORLD, millions, args.repeats, folder)
        kept = [got[r] for r in range(KEPT)]
        relay_s, load_s = max(v["relay_s"] for v in kept), max(v["load_s"] for v in kept)
        print(f"{kept[0]['params'] / 1e6:>7.1f}M {max(v['save_s'] for v in got.values()):>8.3f}s {relay_s:>7.3f}s "
              f"{load_s:>8.3f}s {relay_s / load_s:>10.2f} {str(all(v['equal'] for v in kept)):>6}")


if __name__ == "__main__":
    main()
