"""On a device-bound NCCL default group every rank joins every split: hypergrid never makes a
member-only ``new_group`` there, and every rank makes the same world-wide calls, one per request.

No GPU here, so the job is simulated: this process plays one rank of a 64-rank world on torch's
fake backend, the default group is bound to a device (``bound_device_id``, as
``init_process_group(..., device_id=...)`` does) and torch's own ``_get_split_source`` reports a
backend that splits, as NCCL's does. hypergrid's detection runs unchanged on top of that. torch's
constructors are recorded; ``split_group`` itself needs an accelerator, so the recorder makes the
caller's group with the fake backend and returns None to non-members, as ``split_group`` does.
Ranks 0, 31 and 63 are played in turn and their call sequences compared.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from hypergrid import HyperCommGrid, device_mesh
from hypergrid.strategy import CreationMode, JobKind, creation_mode, job_kind
from tests.harness import fake_world

WORLD = 64
RANKS = (0, 31, 63)
SHAPE, NAMES = [4, 2, 8], ["tp", "cp", "dp"]
REQUESTS: list[Any] = ["tp", "dp", ["cp", "dp"], ["tp", "cp"], "cp"]


class Recorder:
    """torch's group constructors, recorded; split_group simulated over the fake backend."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._new_group = dist.new_group

    def new_group(self, ranks=None, *args: Any, use_local_synchronization: bool = False, **kwargs: Any):
        self.calls.append(("new_group", {"ranks": ranks, "local": use_local_synchronization}))
        return self._new_group(ranks, *args, use_local_synchronization=use_local_synchronization, **kwargs)

    def new_subgroups_by_enumeration(self, *args: Any, **kwargs: Any):
        self.calls.append(("new_subgroups_by_enumeration", None))
        raise AssertionError("enumerate was not asked for")

    def split_group(self, parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None):
        assert split_ranks and len(split_ranks) == 1, f"each rank passes exactly its own split, got {split_ranks}"
        mine = sorted(split_ranks[0])
        self.calls.append(("split_group", {"desc": group_desc, "timeout": timeout, "mine": mine}))
        if dist.get_rank() not in mine:
            return None
        # What split_group hands a member: a group of exactly its split (name from torch's helper).
        return self._new_group(mine, timeout=timeout, use_local_synchronization=True, group_desc=group_desc)

    def world_wide(self) -> list[tuple[str, Any]]:
        """The calls every rank must make alike: the function and what is not rank-specific."""
        return [(fn, {k: v for k, v in (info or {}).items() if k != "mine"}) for fn, info in self.calls]


@contextlib.contextmanager
def bound_splitting_world(rank: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    """Be ``rank`` of a simulated ``init_process_group("nccl", device_id=...)`` job."""
    with fake_world(rank, WORLD):
        world = dist.distributed_c10d._get_default_group()
        world.bound_device_id = torch.device("cuda", rank % 8)
        splitter = object()  # stands for the world's NCCL backend

        def split_source(pg):
            return splitter if getattr(pg, "bound_device_id", None) is not None else None

        recorder = Recorder()
        with monkeypatch.context() as patch:
            patch.setattr(dist.distributed_c10d, "_get_split_source", split_source)
            for name in ("new_group", "new_subgroups_by_enumeration", "split_group"):
                patch.setattr(dist, name, getattr(recorder, name))
            try:
                yield recorder
            finally:
                world.bound_device_id = None


def play(scenario: Callable[[int], Any], monkeypatch: pytest.MonkeyPatch) -> dict[int, tuple[Recorder, Any]]:
    out = {}
    for rank in RANKS:
        with bound_splitting_world(rank, monkeypatch) as recorder:
            out[rank] = (recorder, scenario(rank))
    return out


def members(pg) -> list[int] | None:
    return None if pg is None else dist.get_process_group_ranks(pg)


def assert_world_wide(played: dict[int, tuple[Recorder, Any]], requests: int) -> None:
    sequences = {rank: recorder.world_wide() for rank, (recorder, _) in played.items()}
    for rank, seq in sequences.items():
        assert all(fn == "split_group" for fn, _ in seq), (rank, seq)
        assert len(seq) == requests, f"rank {rank}: {len(seq)} world-wide calls for {requests} requests"
    first = sequences[RANKS[0]]
    assert all(seq == first for seq in sequences.values()), sequences


def test_the_simulated_job_is_seen_as_one_that_must_split(monkeypatch):
    with bound_splitting_world(5, monkeypatch):
        kind = job_kind()
        assert kind == JobKind(splits=True, torchcomms=False, backend="fake")
        assert creation_mode("auto") is CreationMode.SPLIT
        assert creation_mode("auto", "gloo") is CreationMode.LOCAL  # gloo never touches NCCL
        with pytest.raises(ValueError, match="member-only new_group would wait forever"):
            creation_mode("local")


def assert_groups_as_planned(played: dict[int, tuple[Recorder, Any]]) -> None:
    for rank, (_, (made, expected)) in played.items():
        assert made == expected, rank


def test_grid_groups_are_split_by_every_rank_once_per_request(monkeypatch):
    def scenario(rank):
        grid = HyperCommGrid(SHAPE, NAMES)
        made = {grid.layout.key(d): members(grid.create_pg(d)) for d in REQUESTS}
        expected = {grid.layout.key(d): grid.ranks(d, rank) for d in REQUESTS}
        grid.destroy()
        return made, expected

    played = play(scenario, monkeypatch)
    assert_world_wide(played, len(REQUESTS))
    assert_groups_as_planned(played)


def test_explicit_local_on_a_splitting_world_is_refused_before_any_call(monkeypatch):
    with bound_splitting_world(3, monkeypatch) as recorder:
        grid = HyperCommGrid(SHAPE, NAMES, strategy="local")
        with pytest.raises(ValueError, match="Use strategy 'auto' or 'split'"):
            grid.create_pg("tp")
        assert recorder.calls == []


def test_ranks_outside_a_partial_grid_still_join_each_split(monkeypatch):
    # A grid over ranks 32..63: ranks 0 and 31 are in none of its groups but must take part.
    def scenario(rank):
        grid = HyperCommGrid([4, 8], ["tp", "dp"], rank_offset=32)
        made = [members(grid.create_pg(d)) for d in ("tp", "dp")]
        grid.destroy()
        return made

    played = play(scenario, monkeypatch)
    assert_world_wide(played, 2)
    assert played[0][1] == played[31][1] == [None, None]
    assert played[63][1] == [[60, 61, 62, 63], [35, 39, 43, 47, 51, 55, 59, 63]]


def test_views_and_shared_groups_are_split_alike(monkeypatch):
    def scenario(rank):
        grid = HyperCommGrid([2, 4, 8], ["tp", "pp", "dp"])
        grid.register_view("expert", [2, 4, 2, 4], ["etp", "pp", "ep", "edp"], shared_dims=["pp"])
        made = [members(grid.create_pg("tp")), members(grid.create_pg("ep", view="expert")),
                members(grid.create_pg("edp", view="expert"))]
        # "pp" of the view is the grid's pp: one request, one split.
        made.append(members(grid.create_pg("pp")))
        assert grid.get_pg("pp", view="expert") is grid.get_pg("pp")
        expected = [grid.ranks("tp", rank), grid.ranks("ep", rank, view="expert"),
                    grid.ranks("edp", rank, view="expert"), grid.ranks("pp", rank)]
        grid.destroy()
        return made, expected

    played = play(scenario, monkeypatch)
    assert_world_wide(played, 4)
    assert_groups_as_planned(played)


def test_device_mesh_over_a_splitting_world(monkeypatch):
    def scenario(rank):
        grid = HyperCommGrid(SHAPE, NAMES)
        mesh = device_mesh(grid, device_type="cpu")
        made = {name: members(mesh.get_group(name)) for name in mesh.mesh_dim_names}
        expected = {name: grid.ranks(name, rank) for name in mesh.mesh_dim_names}
        grid.destroy()
        return made, expected

    played = play(scenario, monkeypatch)
    assert_world_wide(played, len(NAMES))
    assert_groups_as_planned(played)


def test_initialize_model_parallel_splits_every_group_on_every_rank(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state as ps

    import hypergrid.megatron as hm

    kwargs = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, context_parallel_size=2,
                  expert_model_parallel_size=4, expert_tensor_parallel_size=1, create_gloo_process_groups=False)

    def scenario(rank):
        hm.initialize_model_parallel(**kwargs)
        try:
            plan = hm.active_grids().plan
            got = {
                "tp": members(ps.get_tensor_model_parallel_group()),
                "pp": members(ps.get_pipeline_model_parallel_group()),
                "embd": members(ps.get_embedding_group(check_initialized=False)),
                "ep": members(ps.get_expert_model_parallel_group()),
                "dp_cp": members(ps.get_data_parallel_group(with_context_parallel=True)),
            }
            expected = {name: plan.rank_group(name, rank) for name in got}
            return got, expected
        finally:
            hm.destroy_model_parallel()

    played = play(scenario, monkeypatch)
    sequences = {rank: recorder.world_wide() for rank, (recorder, _) in played.items()}
    first = sequences[RANKS[0]]
    assert first and all(fn == "split_group" for fn, _ in first), first
    assert all(seq == first for seq in sequences.values()), "ranks made different world-wide calls"
    for rank, (_, (got, expected)) in played.items():
        # A rank outside every embedding group gets None from split_group, as from Megatron-Core.
        assert got == expected, rank
