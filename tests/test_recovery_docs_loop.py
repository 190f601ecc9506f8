"""The training loop of docs/recovery.md, as written there, through a failure and a growth.

The code block of docs/recovery.md that defines ``train`` is read from the docs and run in each
gloo rank, with the small Megatron-style model of tests/test_recovery_training.py (tensor
parallel 2, pipeline 2, data parallel 2) as ``model_step``:

- a rank is SIGKILLed in the middle of a step, a spare takes its place, learns from the job
  which step to resume from, copies its shard, and training goes on;
- with no spare, a rank is frozen (SIGSTOP) past its progress timeout, so the others count it
  out as hung: its replica is dropped and training goes on on the other; the replica's
  survivors wait as spares, the frozen rank, once it runs again, learns it is out and offers
  itself; a growth then puts the replica back, and training goes on at data parallel 2.

Each time, on every rank, the losses after the recovery (or the growth) are bit-equal to those of
a fresh job started on the new placement from the parameters every position had at that step.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests import test_recovery_training as model
from tests.harness import job_store, run_gloo

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

DOCS = Path(__file__).resolve().parents[1] / "docs" / "recovery.md"
STEPS = 7
COLLECTIVE_MIN = 0.1  # Megatron's distributed_timeout_minutes: 6 s, and the default group's timeout too
COLLECTIVE_S = COLLECTIVE_MIN * 60
SIZES = dict(tensor_model_parallel_size=model.TP, pipeline_model_parallel_size=model.PP,
             create_gloo_process_groups=False, distributed_timeout_minutes=COLLECTIVE_MIN,
             timeout=timedelta(seconds=20))


def docs_loop() -> dict:
    """The namespace the docs' code block that defines ``train`` leaves (read from the docs)."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    code = next(b for b in blocks if "def train(" in b)
    namespace: dict = {}
    exec(compile(code, str(DOCS), "exec"), namespace)
    return namespace


def test_the_docs_hold_the_loop():
    assert {"train", "take_shards", "wait_to_be_needed"} <= set(docs_loop())


def _run_docs_loop(rank: int, world: int, spares: list[int], kill: Optional[tuple], freeze: Optional[tuple],
                   grow_every: int) -> dict:
    """``kill``: (rank, step) SIGKILLed after its forward; ``freeze``: (rank, step, seconds) SIGSTOPped
    by rank 0 once it reaches that step."""
    import hypergrid

    hypergrid.start_heartbeat(interval_s=0.5, progress_timeout_s=4.0)  # frozen past it: hung
    store = job_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    if freeze is not None and rank == 0:
        def freezer() -> None:
            store.wait(["freeze"], timedelta(seconds=120))
            pid = int(store.get(f"pid/{freeze[0]}").decode())
            store.set("frozen_at", repr(time.time()))
            os.kill(pid, signal.SIGSTOP)
            time.sleep(freeze[2])
            os.kill(pid, signal.SIGCONT)

        threading.Thread(target=freezer, daemon=True).start()
    at: dict[int, list] = {}       # the parameters at the start of each step (the last attempt's)
    losses: dict[int, float] = {}

    def model_step(params: list[torch.Tensor], step: int) -> None:
        at[step] = [p.tolist() for p in params]
        on_forward = None
        if kill is not None and (rank, step) == kill:
            on_forward = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        if freeze is not None and (rank, step) == freeze[:2]:
            store.set("freeze", "")
            time.sleep(1.0)  # frozen in here, a step that the others cannot finish
        if freeze is not None and step == grow_every - 1 and rank != freeze[0]:
            # Before the growth: the frozen rank has run again, learnt it is out and offered itself.
            store.wait(["frozen_at"], timedelta(seconds=60))
            while time.time() < float(store.get("frozen_at").decode()) + freeze[2] + 3 * COLLECTIVE_S:
                time.sleep(0.2)
        loss = model._step(params, step, on_forward=on_forward)
        if loss is not None:
            losses[step] = loss

    train = docs_loop()["train"]
    # The first parameters of the rank's shard: ranks 0-7 hold tp 2 x dp 2 x pp 2 (tp fastest, pp
    # slowest, Megatron-Core's order); a spare holds nothing until it copies a peer's shard.
    grid = 8
    params = (model._initial_shard(rank // (grid // model.PP), rank % model.TP) if rank < grid and rank not in spares
              else [torch.zeros(model.DIM, model.HIDDEN // model.TP), torch.zeros(model.HIDDEN // model.TP, model.DIM)])
    job = train(model_step, params, STEPS, spares=spares, grow_every=grow_every, **SIZES)
    if not job.in_grid:
        return {"role": "outside"}
    return {"role": "member", "ranks": list(job.layout.ranks), "plans": [p.describe() for p in job.recoveries],
            "at": at, "losses": losses, "position": list(job.layout.ranks).index(rank)}


def _fresh(rank: int, world: int, ranks: list[int], start: int, states: dict) -> dict:
    import hypergrid

    job = hypergrid.ResilientJob.of_megatron(ranks=ranks, **SIZES)
    if not job.in_grid:
        return {}
    params = [torch.tensor(values) for values in states[list(job.layout.ranks).index(rank)]]
    losses = {}
    for step in range(start, STEPS):
        loss = model._step(params, step)
        if loss is not None:
            losses[step] = loss
    return {"losses": losses}


def _compare_with_a_fresh_run(results: list, world: int, start: int) -> dict:
    members = {r: v for r, (status, v) in enumerate(results) if status == "ok" and v["role"] == "member"}
    ranks = next(iter(members.values()))["ranks"]
    assert sorted(members) == sorted(ranks) and all(v["ranks"] == ranks for v in members.values()), results
    states = {v["position"]: v["at"][start] for v in members.values()}
    fresh = run_gloo(_fresh, world, ranks, start, states, timeout=240, pg_timeout_s=COLLECTIVE_S, leave_at_once=True)
    for rank, value in members.items():
        after = {s: loss for s, loss in value["losses"].items() if s >= start}
        assert after == fresh[rank]["losses"], (rank, after, fresh[rank]["losses"])
    assert any(v["losses"] for v in members.values())
    return members


def test_the_docs_loop_through_a_kill_with_a_spare():
    world = 10
    results = run_gloo(_run_docs_loop, world, [8, 9], (5, 3), None, 100, timeout=300, pg_timeout_s=COLLECTIVE_S,
                       expect_failure=True, leave_at_once=True)
    assert results[5][0] == "dead", results[5]
    members = _compare_with_a_fresh_run(results, world, start=3)
    assert next(iter(members.values()))["ranks"] == [0, 1, 2, 3, 4, 8, 6, 7]
    assert results[9] == ("ok", {"role": "outside"}), results[9]


def test_the_docs_loop_shrinks_without_a_spare_and_grows_back():
    world = 8
    results = run_gloo(_run_docs_loop, world, [], None, (5, 2, 10.0), 4, timeout=300, pg_timeout_s=COLLECTIVE_S,
                       expect_failure=True, leave_at_once=True)
    members = _compare_with_a_fresh_run(results, world, start=4)
    assert sorted(members) == list(range(8)), results
    plans = members[2]["plans"]
    assert plans[0].startswith("shrink: replicas holding ranks [5] dropped") and plans[-1].startswith("grow"), plans
    assert members[2]["ranks"] == [2, 3, 0, 1, 6, 7, 4, 5], members[2]["ranks"]
