"""On a device-bound NCCL default group every rank joins every split: hypergrid never makes a
member-only ``new_group`` there, and every rank makes the same world-wide calls, one per request.

No GPU here, so the job is simulated: this process plays one rank of a 64-rank world on torch's
fake backend whose default group is bound to a device, as ``init_process_group(...,
device_id=...)`` binds it. How much is simulated depends on what the installed torch accepts,
tried in this order and detected, never read from its version:

1. torch binds the fake backend to a CPU device and its own ``_get_split_source`` then reports a
   backend that splits (torch 2.15): nothing else is simulated; hypergrid's detection meets
   torch's real decision.
2. torch binds accelerators only (2.13 and 2.14 refuse ``device_id=cpu:0``): the default group's
   ``bound_device_id`` is set by hand. Where torch's own ``_get_split_source`` then reports a
   split source (2.14: its fake backend supports splitting), that is torch's decision, as in 1.
3. Where it still reports none (2.13: its fake backend does not split), ``_get_split_source`` is
   replaced by a stand-in that takes exactly the installed function's parameters (read from its
   signature, so a call torch would refuse is refused alike), reports a split source for the
   bound world's own backend only, as torch does, and returns the world's own backend on the
   bound device: a real c10d ``Backend``, which torch's C++ accepts wherever torch hands the
   source on (2.14 and 2.15 set ``_DistributedBackendOptions.split_from`` for every backend;
   the fake backend's creator ignores it).

torch's constructors are recorded; ``split_group`` itself needs an accelerator, so the recorder
makes the caller's group with the fake backend and returns None to non-members, as
``split_group`` does. Ranks 0, 31 and 63 are played in turn and their call sequences compared.

Real processes on a really bound, really splitting world are in ``test_split_gloo.py`` (torch
2.15 binds gloo to a CPU device).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hypergrid import HyperCommGrid, device_mesh
from hypergrid.runtime.modes import CreationMode, JobSetup, creation_mode, job_setup

WORLD = 64
RANKS = (0, 31, 63)
SHAPE, NAMES = [4, 2, 8], ["tp", "cp", "dp"]
REQUESTS: list[Any] = ["tp", "dp", ["cp", "dp"], ["tp", "cp"], "cp"]


class Recorder:
    """torch's group constructors, recorded; split_group simulated over the fake backend."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._new_group = dist.new_group
        self.how = ""  # how the world was bound and who decides that it splits (bound_splitting_world)

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


def _split_source(world: Any) -> Any:
    """What torch's ``_get_split_source`` (the installed one, or a stand-in) says of ``world``,
    called with the parameters it takes (torch 2.15 also takes the requested backend)."""
    source = dist.distributed_c10d._get_split_source
    takes_backend = len(inspect.signature(source).parameters) >= 2
    return source(world, "fake") if takes_backend else source(world)


def _bind_fake_world(rank: int) -> bool:
    """Start this rank's fake world bound to a CPU device, where torch allows it and its own
    decision then says the world splits; False (nothing started) where it does not."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD,
                                device_id=torch.device("cpu", 0))
    except (ValueError, RuntimeError, TypeError):
        return False
    if _split_source(dist.distributed_c10d._get_default_group()) is None:
        dist.destroy_process_group()
        return False
    return True


def _split_source_stand_in(world: Any) -> Callable[..., Any]:
    """torch's ``_get_split_source`` for a bound fake world, with the installed one's parameters.

    The source it reports is ``world``'s own backend on its bound device, a real c10d
    ``Backend``: torch hands the source to its C++ backend options (2.14 and 2.15 set
    ``_DistributedBackendOptions.split_from`` for every backend), which refuse anything else."""
    signature = inspect.signature(dist.distributed_c10d._get_split_source)
    splitter = world._get_backend(world.bound_device_id)  # stands for the world's NCCL backend

    def split_source(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)  # refuses what torch's own would refuse
        pg, *requested = call.arguments.values()
        if getattr(pg, "bound_device_id", None) is None:
            return None
        if requested and requested[0] is not None and str(requested[0]).lower() not in ("fake", "undefined"):
            return None  # another backend than the world's is made afresh, as torch 2.15 decides
        return splitter

    split_source.__signature__ = signature  # type: ignore[attr-defined]  # what inspect reports
    return split_source


@contextlib.contextmanager
def bound_splitting_world(rank: int, monkeypatch: pytest.MonkeyPatch, *, stand_in: bool = False) -> Iterator[Recorder]:
    """Be ``rank`` of a simulated ``init_process_group("nccl", device_id=...)`` job; the
    recorder's ``how`` says which of the module docstring's three ways bound it (``stand_in``:
    the third, whatever torch accepts)."""
    from hypergrid.runtime.registry import REGISTRY

    with monkeypatch.context() as patch:
        how = "bound by torch (device_id=cpu:0); torch's split decision"
        if stand_in or not _bind_fake_world(rank):
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
            world = dist.distributed_c10d._get_default_group()
            world.bound_device_id = torch.device("cuda", rank % 8)
            how = "bound by hand; torch's split decision"
            if stand_in or _split_source(world) is None:
                patch.setattr(dist.distributed_c10d, "_get_split_source", _split_source_stand_in(world))
                how = "bound by hand; a stand-in's split decision"
        recorder = Recorder()
        recorder.how = how
        for name in ("new_group", "new_subgroups_by_enumeration", "split_group"):
            patch.setattr(dist, name, getattr(recorder, name))
        try:
            yield recorder
        finally:
            dist.distributed_c10d._get_default_group().bound_device_id = None
            dist.destroy_process_group()
            REGISTRY.reset()


def play(scenario: Callable[[int], Any], monkeypatch: pytest.MonkeyPatch, *,
         stand_in: bool = False) -> dict[int, tuple[Recorder, Any]]:
    out = {}
    for rank in RANKS:
        with bound_splitting_world(rank, monkeypatch, stand_in=stand_in) as recorder:
            out[rank] = (recorder, scenario(rank))
    return out


def members(pg) -> list[int] | None:
    return None if pg is None else dist.get_process_group_ranks(pg)


def assert_world_wide(played: dict[int, tuple[Recorder, Any]], requests: int) -> None:
    sequences = {rank: recorder.world_wide() for rank, (recorder, _) in played.items()}
    how = played[RANKS[0]][0].how
    for rank, seq in sequences.items():
        assert all(fn == "split_group" for fn, _ in seq), (rank, how, seq)
        assert len(seq) == requests, f"rank {rank} ({how}): {len(seq)} world-wide calls for {requests} requests"
    first = sequences[RANKS[0]]
    assert all(seq == first for seq in sequences.values()), sequences


def test_the_simulated_job_is_seen_as_one_that_must_split(monkeypatch):
    with bound_splitting_world(5, monkeypatch) as recorder:
        kind = job_setup()
        assert kind.splits and kind.backend == "fake" and kind.split_backend == "fake", (recorder.how, kind)
        assert kind.split_device in ("cpu", "cuda")
        assert creation_mode("auto") is CreationMode.SPLIT
        assert creation_mode("auto", "gloo") is CreationMode.LOCAL  # gloo never touches NCCL
        with pytest.raises(ValueError, match="member-only new_group would wait for ranks that never come"):
            creation_mode("local")


def assert_groups_as_planned(played: dict[int, tuple[Recorder, Any]]) -> None:
    for rank, (_, (made, expected)) in played.items():
        assert made == expected, rank


@pytest.mark.parametrize("stand_in", [False, True], ids=["as-torch-allows", "stand-in"])
def test_grid_groups_are_split_by_every_rank_once_per_request(stand_in, monkeypatch):
    """Also with the stand-in on every torch: where torch hands the split source to its C++
    backend options (2.14, 2.15), the stand-in's must be one they accept."""

    def scenario(rank):
        grid = HyperCommGrid(SHAPE, NAMES)
        made = {grid.layout.key(d): members(grid.create_pg(d)) for d in REQUESTS}
        expected = {grid.layout.key(d): grid.ranks(d, rank) for d in REQUESTS}
        grid.destroy()
        return made, expected

    played = play(scenario, monkeypatch, stand_in=stand_in)
    if stand_in:
        assert all("stand-in" in recorder.how for recorder, _ in played.values())
    assert_world_wide(played, len(REQUESTS))
    assert_groups_as_planned(played)


def test_explicit_local_on_a_splitting_world_is_refused_before_any_call(monkeypatch):
    with bound_splitting_world(3, monkeypatch) as recorder:
        grid = HyperCommGrid(SHAPE, NAMES, strategy="local")
        with pytest.raises(ValueError, match="Use strategy 'auto', 'split' or 'fresh'"):
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


@pytest.mark.parametrize("backend", [None, "fake", "gloo", "nccl", "cpu:fake", "cpu:gloo", "cpu:gloo,cuda:fake",
                                     "cuda:nccl,cpu:fake", "FAKE"])
def test_which_backends_split_is_what_torch_decides(backend, monkeypatch):
    """Where torch's ``_get_split_source`` takes the requested backend, it is the judge: for each
    backend a group may ask for, hypergrid's rule must say "split" exactly when torch does."""
    source = dist.distributed_c10d._get_split_source
    if len(inspect.signature(source).parameters) < 2:
        pytest.skip(f"torch {torch.__version__}'s _get_split_source takes no requested backend; "
                    f"its members split only for the bound backend, the rule's premise (see modes.JobSetup.must_split)")
    with bound_splitting_world(7, monkeypatch):
        assert dist.distributed_c10d._get_split_source is source, "torch's own decision, not a stand-in"
        world = dist.distributed_c10d._get_default_group()
        torch_splits = dist.distributed_c10d._get_split_source(world, backend or dist.get_backend()) is not None
        assert job_setup().must_split(backend) is torch_splits


def test_torchcomms_subgroups_follow_what_torch_has(monkeypatch):
    from hypergrid.runtime.torch_compat import TorchCommsSubgroups, torchcomms_subgroups

    c10d = dist.distributed_c10d
    assert torchcomms_subgroups() is TorchCommsSubgroups.OFF  # not enabled here
    monkeypatch.setattr(c10d, "_use_torchcomms_enabled", lambda: True, raising=False)
    # A torch whose new_group delegates to split_group under TorchComms has the helper that does it.
    monkeypatch.setattr(c10d, "_new_group_via_split_group", lambda *a, **k: None, raising=False)
    assert torchcomms_subgroups() is TorchCommsSubgroups.WORLD_SPLIT
    monkeypatch.delattr(c10d, "_new_group_via_split_group")
    assert torchcomms_subgroups() is TorchCommsSubgroups.MEMBERS_ONLY


def test_torchcomms_decides_the_mode_as_its_subgroups_are_made():
    from hypergrid.runtime.torch_compat import TorchCommsSubgroups

    world_split = JobSetup(backend="nccl", torchcomms=TorchCommsSubgroups.WORLD_SPLIT)
    assert creation_mode("auto", job=world_split) is CreationMode.SPLIT
    assert creation_mode("auto", "gloo", job=world_split) is CreationMode.SPLIT  # every backend splits there
    assert creation_mode("auto", "fake", job=world_split) is CreationMode.LOCAL  # torch routes fake groups around it
    with pytest.raises(ValueError, match="refuses use_local_synchronization"):
        creation_mode("local", job=world_split)
    # torch 2.15: TorchComms builds subgroups among their members, even on a bound world.
    members_only = JobSetup(backend="nccl", split_device="cuda", split_backend="nccl",
                           torchcomms=TorchCommsSubgroups.MEMBERS_ONLY)
    assert creation_mode("auto", job=members_only) is CreationMode.LOCAL
    assert creation_mode("local", job=members_only) is CreationMode.LOCAL
