"""What partner copies cost per step: the digests and the exchange, beside the step itself.

``--ranks`` gloo processes on this machine (default 2), each its own node (``gpus_per_node=1``),
so each sends its snapshot to the next and holds the one before it, as
``hypergrid.train(..., partner_copies=True)`` does after every ``snapshot_every`` steps. Each
rank's unique state is an MLP of ``--params`` million parameters with Adam (what an FSDP2 or ZeRO
rank's shard of a model ``--ranks`` times larger holds). Per rank, the median of ``--repeats``:

* ``step``: one training step (forward, backward, Adam's step) on this rank alone;
* ``snapshot``: :meth:`hypergrid.TrainingState.capture` into the buffer of an earlier snapshot;
* ``+digests``: the same with a CRC-32 of every tensor (what partner copies add to the snapshot);
* ``exchange``: :meth:`~hypergrid.training.partner.PartnerCopies.start` then ``finish``, every
  rank at once, nothing else running: its snapshot sent to its partner, its partner's received
  into a reused buffer;
* ``overlapped``: what the exchange adds to a step when it travels during the step, as
  ``hypergrid.train`` sends it: the exchange started, a step, the exchange finished, less the
  step alone;
* ``held``: the host memory of the copy a rank holds once the gate passed (its partner's latest).
* ``dcp save``: ``torch.distributed.checkpoint.save`` of the same state (``get_state_dict``'s
  model and optimizer) to local disk (``--folder``), each rank its own checkpoint (``no_dist``:
  the state is the rank's alone);
* ``restore``: :meth:`hypergrid.TrainingState.restore` from the copy received of the partner's
  snapshot (digests checked), what a rank taking a lost position does after a node loss;
* ``dcp load``: ``dcp.load`` of that rank's checkpoint then ``set_state_dict``, the same state
  brought back from disk instead.

Printed: the slowest rank's times and (digests + overlapped) / step, the cost per step at
``snapshot_every=1`` (divided by K at ``snapshot_every=K``), then dcp save / step, and the restore
beside the dcp load.

Run::

    python benchmarks/bench_partner.py                        # 2 ranks, 10M parameters each
    python benchmarks/bench_partner.py --ranks 4 --params 10 --repeats 5
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

import hypergrid
from hypergrid.training.partner import PartnerCopies, partner_map

BATCH = 32


def median_s(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()  # every rank starts together: the exchange waits for the slowest
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_main(rank: int, port: int, out: Any, world: int, millions: int, repeats: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    model = model_of(millions)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = hypergrid.TrainingState(model, optimizer)
    width = model[0].in_features
    x, y = torch.randn(BATCH, width), torch.randn(BATCH, width)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    step_s = median_s(step, repeats)
    held = [state.capture(0), state.capture(0)]

    def snapshot(digests: bool) -> None:
        state.recycle(held.pop(0))
        held.append(state.capture(0, digests=digests))

    snapshot_s = median_s(lambda: snapshot(False), repeats)
    digests_s = median_s(lambda: snapshot(True), repeats)
    copies = PartnerCopies(gpus_per_node=1)
    steps = iter(range(1, 10 * repeats))

    group = dist.new_group(list(range(world)))  # the copies' own communicator, as job.copy_group

    def exchange(during: Callable[[], None] = lambda: None) -> None:
        held[-1].step = next(steps)
        copies.start(held[-1], list(range(world)), group)
        during()
        copies.finish()
        copies.settle(held[-1].step)  # the gate passed: the older copy's buffer is reused by the next

    exchange_s = median_s(exchange, repeats)
    overlapped_s = median_s(lambda: exchange(step), repeats) - step_s
    held_bytes, snapshot_bytes = copies.nbytes, held[-1].nbytes
    del held[:-1]  # host memory for the checkpoint's buffers
    saves = iter(range(10 * repeats))

    def save() -> None:
        model_sd, optim_sd = get_state_dict(model, [optimizer])
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=f"{folder}/{rank}/{next(saves)}",
                 no_dist=True)

    save_s = median_s(save, repeats)
    source = next(r for r, holder in partner_map(list(range(world)), 1).items() if holder == rank)
    copy = next(c for c in copies.held() if (c.rank, c.step) == (source, held[-1].step))
    restore_s = median_s(lambda: state.restore(copy), repeats)

    def load() -> None:
        model_sd, optim_sd = get_state_dict(model, [optimizer])
        loaded = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(loaded, checkpoint_id=f"{folder}/{rank}/0", no_dist=True)
        set_state_dict(model, [optimizer], model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

    load_s = median_s(load, repeats)
    out.put((rank, {"params": sum(p.numel() for p in model.parameters()), "step_s": step_s,
                    "snapshot_s": snapshot_s, "digests_s": digests_s - snapshot_s, "exchange_s": exchange_s,
                    "overlapped_s": max(0.0, overlapped_s),
                    "held_bytes": held_bytes, "snapshot_bytes": snapshot_bytes, "save_s": save_s,
                    "restore_s": restore_s, "load_s": load_s}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--params", type=int, nargs="+", default=[10], help="millions of parameters per rank")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--folder", default=None, help="where the dcp checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.ranks} gloo ranks on {os.cpu_count()} CPUs, batch {BATCH}, Adam")
    print(f"{'params':>8} {'step':>8} {'snapshot':>9} {'+digests':>9} {'exchange':>9} {'overlapped':>10} "
          f"{'(d+o)/step':>10} "
          f"{'snapshot':>9} {'held':>9} {'dcp save':>9} {'save/step':>9} {'restore':>8} {'dcp load':>9}")
    for millions in args.params:
        with tempfile.TemporaryDirectory(dir=args.folder) as folder:
            got = run_ranks(rank_main, args.ranks, args.ranks, millions, args.repeats, folder)
        worst = {key: max(v[key] for v in got.values()) for key in got[0]}
        print(f"{got[0]['params'] / 1e6:>7.1f}M {worst['step_s']:>7.3f}s {worst['snapshot_s']:>8.3f}s "
              f"{worst['digests_s']:>8.3f}s {worst['exchange_s']:>8.3f}s {worst['overlapped_s']:>9.3f}s "
              f"{(worst['digests_s'] + worst['overlapped_s']) / worst['step_s']:>10.2f} "
              f"{worst['snapshot_bytes'] / 2**20:>5.0f} MiB {worst['held_bytes'] / 2**20:>5.0f} MiB "
              f"{worst['save_s']:>8.3f}s {worst['save_s'] / worst['step_s']:>9.2f} {worst['restore_s']:>7.3f}s "
              f"{worst['load_s']:>8.3f}s")


if __name__ == "__main__":
    main()
