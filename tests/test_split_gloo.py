"""A really bound, really splitting world in real processes: gloo started with a CPU device.

torch 2.15 accepts ``init_process_group("gloo", device_id=torch.device("cpu", 0))``; the default
group is then bound, gloo splits, and torch's own ``_get_split_source`` says every new gloo
group is split from the world's, as it says for NCCL started with ``device_id=cuda:N``. Nothing
is simulated here: 4 processes, torch's real decision, real ``split_group`` calls and real
collectives over the groups they return. hypergrid must see the world as one that splits, make
each group by one ``split_group`` per request on every rank (members or not), never a
member-only ``new_group``, and hand every rank the planned group.

Where torch refuses a CPU ``device_id`` (2.13 and 2.14 bind accelerators only) these tests skip, saying
so; the simulated bound world of ``test_split_strategy.py`` covers those torches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 4
BIND = {"device_id": torch.device("cpu", 0)}


def _cpu_bound_gloo_splits() -> str:
    """Why this torch cannot run these tests, or "" when it can (checked in a one-rank world)."""
    from hypergrid.runtime.torch_compat import bound_split_device

    if dist.is_initialized():
        return "a process group is already initialized in the test process"
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, **BIND)
    except (ValueError, RuntimeError, TypeError) as exc:
        return f"torch {torch.__version__} refuses a CPU device_id for gloo ({exc})"
    try:
        device = bound_split_device()
    finally:
        dist.destroy_process_group()
    if device != "cpu":
        return f"torch {torch.__version__} binds gloo to the CPU but does not split there"
    return ""


@pytest.fixture(scope="module", autouse=True)
def _needs_a_splitting_cpu_world() -> None:
    reason = _cpu_bound_gloo_splits()
    if reason:
        pytest.skip(reason)


# ---------------------------------------------------------------------------- in the children
@contextlib.contextmanager
def recorded_calls() -> Iterator[list[tuple[str, Any]]]:
    """torch's group constructors, recorded and passed through to torch."""
    calls: list[tuple[str, Any]] = []
    originals = {name: getattr(dist, name) for name in ("new_group", "split_group", "new_subgroups_by_enumeration")}

    def wrap(name: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            local = kwargs.get("use_local_synchronization", False)
            calls.append((name, {"local": local} if name == "new_group" else {}))
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def members_by_reduce(pg: Any) -> list[int]:
    """Who is in ``pg``, as an all-reduce over it tells (not as the group says)."""
    flags = torch.zeros(WORLD, dtype=torch.int64)
    flags[dist.get_rank()] = 1
    dist.all_reduce(flags, group=pg)
    return [r for r in range(WORLD) if flags[r]]


def grid_job(rank: int, world: int) -> dict:
    from hypergrid import HyperCommGrid
    from hypergrid.runtime.modes import CreationMode, creation_mode, job_setup

    kind = job_setup()
    with recorded_calls() as calls:
        grid = HyperCommGrid([2, 2], ["tp", "dp"])
        made = {}
        for dims in ("tp", "dp", ["tp", "dp"]):
            pg = grid.create_pg(dims)
            made[grid.layout.key(dims)] = (members_by_reduce(pg), grid.ranks(dims))
        partial = HyperCommGrid([2], ["tp"], rank_offset=2)
        off_grid = partial.create_pg("tp")
        partial_members = None if off_grid is None else members_by_reduce(off_grid)
        grid.destroy()
        partial.destroy()
    return {
        "split_device": kind.split_device,
        "auto": creation_mode("auto").value,
        "calls": calls,
        "made": made,
        "partial": partial_members,
        "mode_is_split": creation_mode("auto") is CreationMode.SPLIT,
    }


def megatron_and_mesh_job(rank: int, world: int) -> dict:
    from megatron.core import parallel_state as ps

    import hypergrid.megatron as hm
    from hypergrid import HyperCommGrid, device_mesh

    with recorded_calls() as calls:
        hm.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                     create_gloo_process_groups=False)
        plan = hm.active_grids().plan
        got = {
            "tp": members_by_reduce(ps.get_tensor_model_parallel_group()),
            "pp": members_by_reduce(ps.get_pipeline_model_parallel_group()),
            "dp": members_by_reduce(ps.get_data_parallel_group()),
        }
        expected = {name: plan.rank_group(name, rank) for name in got}
        hm.destroy_model_parallel()
        grid = HyperCommGrid([2, 2], ["tp", "dp"])
        mesh = device_mesh(grid, device_type="cpu")
        mesh_groups = {name: members_by_reduce(mesh.get_group(name)) for name in mesh.mesh_dim_names}
        mesh_expected = {name: grid.ranks(name) for name in mesh.mesh_dim_names}
        grid.destroy()
    return {"calls": calls, "got": got, "expected": expected, "mesh": mesh_groups, "mesh_expected": mesh_expected}


# ---------------------------------------------------------------------------- tests
def test_a_grid_on_a_cpu_bound_gloo_world_is_split_by_every_rank():
    results = run_gloo(grid_job, WORLD, init_kwargs=BIND)
    for rank, result in enumerate(results):
        assert result["split_device"] == "cpu" and result["auto"] == "split", rank
        # one split per request on every rank, members or not; never a member-only new_group
        assert result["calls"] == [("split_group", {})] * 4, (rank, result["calls"])
        for key, (by_reduce, planned) in result["made"].items():
            assert by_reduce == sorted(planned), (rank, key)
        assert result["partial"] == (None if rank < 2 else [2, 3]), rank


def test_megatron_adapter_and_device_mesh_on_a_cpu_bound_gloo_world():
    pytest.importorskip("megatron.core")
    results = run_gloo(megatron_and_mesh_job, WORLD, init_kwargs=BIND)
    sequences = [r["calls"] for r in results]
    assert sequences[0] and all(fn == "split_group" for fn, _ in sequences[0]), sequences[0]
    assert all(seq == sequences[0] for seq in sequences), "ranks made different world-wide calls"
    for rank, result in enumerate(results):
        assert result["got"] == result["expected"], rank
        assert result["mesh"] == {k: sorted(v) for k, v in result["mesh_expected"].items()}, rank
