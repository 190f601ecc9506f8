"""The training loop of docs/recovery.md, as written there, through a node's loss.

The code block of docs/recovery.md that defines ``setup``, ``step`` and ``main`` is read from the
docs and run in each gloo rank, with the tensor-parallel MLP of tests/test_training.py (dropout
drawn from torch's generator) as the user's ``build_model`` and random tensors as its
``dataset``; the docs' own code wraps the model in DDP, seeds the generator and samples the data.
Ranks 0-3 hold tp 2 x dp 2, ranks 4 and 5 are a spare node; node 1 (ranks 2 and 3) is SIGKILLed
after its forward in step 3. On every rank of the grid, every step's loss is bit-equal to that of
the same job run with no failure.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import test_training as model
from tests.harness import run_gloo

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

DOCS = Path(__file__).resolve().parents[1] / "docs" / "recovery.md"
STEPS, KILL_STEP = 6, 3


class _DiesInItsForward(model.ParallelMLP):
    """The MLP, whose rank SIGKILLs itself after the forward of step ``die_at`` (None: never)."""

    def __init__(self, tp_rank: int, die_at: Any) -> None:
        super().__init__(tp_rank)
        self.die_at, self.forwards = die_at, 0

    def forward(self, x: torch.Tensor, tp: Any) -> torch.Tensor:
        out = super().forward(x, tp)
        if self.forwards == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.forwards += 1
        return out


def docs_loop(kill: bool) -> dict:
    """The namespace the docs' code block that defines ``main`` leaves, read from the docs, with
    the user's pieces it names."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    code = next(b for b in blocks if "def main(" in b and "def setup(" in b)

    def build_model(grid: Any) -> torch.nn.Module:
        die_at = KILL_STEP if kill and dist.get_rank() in (2, 3) else None
        return _DiesInItsForward(grid.ranks("tp").index(dist.get_rank()), die_at)

    def dataset() -> torch.utils.data.Dataset:
        gen = torch.Generator().manual_seed(5)
        return torch.utils.data.TensorDataset(torch.randn(48, model.DIM, generator=gen),
                                              torch.randn(48, model.DIM, generator=gen))

    namespace: dict = {"build_model": build_model, "dataset": dataset}
    exec(compile(code, str(DOCS), "exec"), namespace)
    return namespace


def test_the_docs_hold_the_loop():
    assert {"setup", "step", "main"} <= set(docs_loop(kill=False))


def _run_docs_loop(rank: int, world: int, kill: bool) -> dict:
    import hypergrid

    hypergrid.start_heartbeat(interval_s=0.5)
    run = docs_loop(kill)["main"](spares=[4, 5], steps=STEPS)
    if not run.job.in_grid:
        return {"in_grid": False}
    return {"in_grid": True, "ranks": list(run.job.layout.ranks), "losses": run.losses,
            "position": list(run.job.layout.ranks).index(rank), "records": [r.describe() for r in run.records]}


def test_the_docs_loop_through_a_node_lost_with_a_spare_node():
    reference = run_gloo(_run_docs_loop, 6, False, timeout=240, pg_timeout_s=model.COLLECTIVE_S, leave_at_once=True)
    results = run_gloo(_run_docs_loop, 6, True, timeout=300, pg_timeout_s=model.COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    assert results[2][0] == "dead" and results[3][0] == "dead", results
    expected = {v["position"]: v["losses"] for v in reference if v["in_grid"]}
    for rank in (0, 1, 4, 5):
        status, value = results[rank]
        assert status == "ok" and value["ranks"] == [0, 1, 4, 5], (rank, results[rank])
        assert len(value["records"]) == 1 and "resumed at step 3" in value["records"][0], value["records"]
        steps = range(KILL_STEP, STEPS) if rank >= 4 else range(STEPS)
        want = expected[value["position"]]
        assert {s: value["losses"][s] for s in steps} == {s: want[s] for s in steps}, (rank, value["losses"], want)
