"""What hypergrid.train's snapshots cost, beside a torch.distributed.checkpoint save to local disk.

For an MLP of about 10M and about 100M parameters with Adam, one process, on CPU (or a GPU with
``--device cuda``):

* ``step``: one training step (forward, backward, Adam's step), the median of ``--repeats``;
* ``snapshot``: :meth:`hypergrid.TrainingState.capture` of the same state (parameters, Adam's
  two moments and step, the RNG, a scheduler), into the buffers of an earlier snapshot, as
  ``hypergrid.train`` takes one after every ``snapshot_every`` steps; and the host memory the two
  snapshots a rank holds take;
* ``dcp save``: ``torch.distributed.checkpoint.save`` of ``get_state_dict``'s model and optimizer
  state to a fresh folder on local disk (the anchor: what a job that recovers by reading a
  checkpoint writes instead).

Printed per model: each time, and snapshot / step and dcp save / snapshot as ratios. The ratio to
the step is the cost per step at ``snapshot_every=1``; at ``snapshot_every=K`` it is divided by K.

Run::

    python benchmarks/bench_snapshot.py                   # 10M and 100M parameters
    python benchmarks/bench_snapshot.py --params 10 --repeats 5
    python benchmarks/bench_snapshot.py --device cuda --params 100 1000
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import hypergrid

BATCH = 32


def model_of(millions: int) -> torch.nn.Module:
    """Four square linear layers of about ``millions`` million parameters in all."""
    width = int((millions * 1_000_000 / 4) ** 0.5)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def median_s(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(millions: int, repeats: int, device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    model = model_of(millions).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
    state = hypergrid.TrainingState(model, optimizer, scheduler=scheduler)
    width = model[0].in_features
    x, y = torch.randn(BATCH, width, device=device), torch.randn(BATCH, width, device=device)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # Adam's moments exist from the first step on
    step_s = median_s(step, repeats)
    held = [state.capture(0), state.capture(0)]  # a rank holds two: the committed one and the next

    def snapshot() -> None:
        state.recycle(held.pop(0))
        held.append(state.capture(0))

    snapshot_s = median_s(snapshot, repeats)
    folder = Path(tempfile.mkdtemp(prefix="bench_snapshot_"))
    saves = iter(range(repeats))

    def save() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=folder / str(next(saves)))

    try:
        save_s = median_s(save, repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "step_s": step_s, "snapshot_s": snapshot_s, "save_s": save_s,
            "held_bytes": sum(s.nbytes for s in held)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, nargs="+", default=[10, 100], help="millions of parameters")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="where the model trains: cpu, or cuda (snapshots go to "
                        "pinned host memory)")
    args = parser.parse_args()
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, batch {BATCH}, Adam")
    print(f"{'params':>8} {'step':>9} {'snapshot':>9} {'dcp save':>9} {'snap/step':>9} {'save/snap':>9} "
          f"{'held (two)':>11}")
    for millions in args.params:
        got = measure(millions, args.repeats, device)
        print(f"{got['params'] / 1e6:>7.1f}M {got['step_s']:>8.3f}s {got['snapshot_s']:>8.3f}s "
              f"{got['save_s']:>8.3f}s {got['snapshot_s'] / got['step_s']:>9.2f} "
              f"{got['save_s'] / got['snapshot_s']:>9.1f} {got['held_bytes'] / 2**20:>8.0f} MiB")


if __name__ == "__main__":
    main()
