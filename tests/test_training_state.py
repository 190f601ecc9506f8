"""TrainingState and hypergrid.train in one process: what a snapshot holds and gives back, and the
errors bad input gets (each naming the value)."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hypergrid
from hypergrid.training import TrainingState, share_snapshot
from tests.harness import fake_world


def _state() -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return TrainingState(model, optimizer, scheduler=scheduler)


def _train_once(state: TrainingState) -> float:
    (model,), (optimizer,) = state.models, state.optimizers
    loss = model(torch.rand(2, 3)).pow(2).sum()  # torch's generator: the RNG is part of the state
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    state.objects["scheduler"].step()
    return loss.item()


def test_a_snapshot_gives_back_model_optimizer_rng_and_objects():
    state = _state()
    _train_once(state)
    snapshot = state.capture(step=1)
    python_draw = random.random()
    expected = [_train_once(state) for _ in range(3)]  # draws from torch's generator
    random.seed(99)
    torch.manual_seed(99)
    _train_once(state)
    state.restore(snapshot)
    assert random.random() == python_draw
    assert [_train_once(state) for _ in range(3)] == expected
    assert state.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)  # the scheduler's too


def test_a_rank_with_no_optimizer_state_yet_takes_a_peers_snapshot():
    trained = _state()
    _train_once(trained)
    snapshot = trained.capture(step=1)
    fresh = _state()  # Adam has no state before its first step
    fresh.restore(snapshot)
    a, b = trained.optimizers[0].state_dict(), fresh.optimizers[0].state_dict()
    for key, moments in a["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, b["state"][key][name]), (key, name)
    trained.restore(snapshot)  # the RNG too: both draw the same batch
    expected = _train_once(trained)
    fresh.restore(snapshot)
    assert _train_once(fresh) == expected


def test_snapshots_reuse_the_buffers_of_the_one_let_go():
    state = _state()
    first = state.capture(step=0)
    buffers = {path: t.data_ptr() for path, t in first.tensors.items()}
    state.recycle(first)
    second = state.capture(step=1)
    assert {path: t.data_ptr() for path, t in second.tensors.items()} == buffers
    assert second.nbytes == first.nbytes == sum(t.numel() * 4 for t in second.tensors.values())


def test_bad_state_is_refused_naming_the_value():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="model 0 must be a torch.nn.Module, got str"):
        TrainingState(["not a model"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="optimizer 0 holds 2 parameters that are not the model's"):
        TrainingState(model, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0))
    with pytest.raises(TypeError, match="optimizer 0 must be a torch.optim.Optimizer, got dict"):
        TrainingState(model, [{}])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="object 'sampler' \\(list\\) has no state_dict or load_state_dict"):
        TrainingState(model, sampler=[])
    with pytest.raises(TypeError, match="step must be an int, got float 1.5"):
        TrainingState(model).capture(step=1.5)  # type: ignore[arg-type]
    other = TrainingState(torch.nn.Linear(2, 3)).capture(step=0)
    with pytest.raises(ValueError, match="does not fit this rank's state at model/weight: \\[3, 2\\]"):
        TrainingState(model).restore(other)


def test_bad_arguments_to_train_are_refused_naming_the_value():
    with fake_world(0, 4):
        grid = hypergrid.HyperCommGrid([2, 2], ["tp", "dp"])
        job = hypergrid.ResilientJob.of_grid(grid)

        def setup(job):
            return TrainingState(torch.nn.Linear(1, 1))

        def step(job, state, step):
            return 0.0

        with pytest.raises(TypeError, match="job must be a hypergrid ResilientJob, got HyperCommGrid"):
            hypergrid.train(grid, setup, step, steps=1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="step must be callable, got int 3"):
            hypergrid.train(job, setup, 3, steps=1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="steps must be an int, got float 2.0"):
            hypergrid.train(job, setup, step, steps=2.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="snapshot_every must be at least 1, got 0"):
            hypergrid.train(job, setup, step, steps=2, snapshot_every=0)
        with pytest.raises(ValueError, match="grow_every \\(3\\) must be a multiple of snapshot_every \\(2\\)"):
            hypergrid.train(job, setup, step, steps=2, snapshot_every=2, grow_every=3)
        with pytest.raises(TypeError, match="wait_timeout must be a datetime.timedelta, got int"):
            hypergrid.train(job, setup, step, steps=2, wait_timeout=5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="setup must return a hypergrid TrainingState, got Linear"):
            hypergrid.train(job, lambda job: torch.nn.Linear(1, 1), step, steps=1)  # type: ignore[arg-type]
        job.destroy()


def test_a_model_on_a_mesh_outside_the_job_is_refused():
    from torch.distributed.tensor import Replicate, distribute_tensor

    with fake_world(0, 4):
        job = hypergrid.ResilientJob.of_grid(hypergrid.HyperCommGrid([2], ["dp"], world_size=4), spares=[2, 3])
        mesh = dist.device_mesh.init_device_mesh("cpu", (4,))  # over every rank, spares included
        model = torch.nn.Linear(2, 2)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))

        def step(job, state, step):
            return 0.0

        with pytest.raises(ValueError, match="parameter 'weight' lives on a DeviceMesh over ranks \\[2, 3\\] outside"):
            hypergrid.train(job, lambda job: TrainingState(model), step, steps=1, wait_timeout=timedelta(seconds=1))
        job.destroy()


def test_a_snapshot_shared_in_a_group_of_one_is_its_own():
    with fake_world(0, 1):
        snapshot = _state().capture(step=2)
        assert share_snapshot(snapshot, source=0, group=dist.group.WORLD) is snapshot
        with pytest.raises(ValueError, match="the snapshot's source, rank 3, is not a rank of the group \\[0\\]"):
            share_snapshot(snapshot, source=3, group=dist.group.WORLD)


def test_a_failing_step_where_nobody_can_agree_raises_what_recover_says():
    with fake_world(0, 1):
        job = hypergrid.ResilientJob.of_grid(hypergrid.HyperCommGrid([1], ["dp"]))

        def step(job, state, step):
            raise RuntimeError("shape mismatch in the user's step")

        # On the fake backend there is nobody to agree with: recover() says so, and that is raised.
        with pytest.raises(Exception, match="agreeing on failed ranks needs the job's store"):
            hypergrid.train(job, lambda job: TrainingState(torch.nn.Linear(1, 1)), step, steps=1)
        job.destroy()


@pytest.fixture
def gloo_alone(tmp_path):
    """A gloo world of this one process (DDP and ZeRO need a real backend)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_ddp_model_and_a_zero_optimizer_are_snapshotted_and_restored(gloo_alone):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(),
                                                        torch.nn.Linear(4, 1)))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    state = TrainingState(model, zero)

    def train_once() -> float:
        loss = model(torch.rand(2, 3)).pow(2).sum()
        loss.backward()
        zero.step()
        zero.zero_grad()
        return loss.item()

    train_once()
    snapshot = state.capture(step=1)  # no consolidate_state_dict: ZeRO's local optimizer is read
    assert sum(1 for path in snapshot.tensors if path[0] == "optimizer") == 3 * 4  # Adam: step and two moments
    expected = [train_once() for _ in range(3)]
    train_once()
    state.restore(snapshot)
    assert [train_once() for _ in range(3)] == expected
