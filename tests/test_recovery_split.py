"""Recovery on a world whose communicator new groups are split from: nothing may need a lost rank.

On a default group bound to a device (``init_process_group("nccl", device_id=...)``, torch 2.15's
default ``nccl``, which is ``nccl2``), torch makes a new NCCL communicator by splitting the world's,
which every rank of the world must join, the lost ones too. A recovery there makes each changed
group as a communicator of its own among its members (strategy ``fresh``): torch is kept from
splitting it, by the group's ``lazy_init`` option where torch reads one (2.15) or by leaving the
default group unbound for the call (2.13, 2.14).

No GPU here: the world is simulated as in tests/test_split_strategy.py (a fake backend bound to a
device, torch's own split decision where it makes one). Every group constructor is recorded, and
for each ``new_group`` whether torch would split it off the world's at that moment (the world
bound, a split source, no ``lazy_init``): such a call, a ``split_group`` or a ``new_group``
without local synchronization would need every rank of the world, so none may happen in a
recovery. Checked on several ranks of a small world (a kept rank, one whose groups change, the
spare that takes the place, an unused spare), for a replacement and a shrink, a grid job and a
Megatron job, and on one rank of 65,536 and 1,048,576: the new groups' members in position
order, the unchanged groups kept (the same objects), and no world-wide call on any rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from hypergrid import HyperCommGrid, ResilientJob
from hypergrid.recovery.settings import RecoverySettings
from hypergrid.runtime.modes import CreationMode, creation_mode, job_setup
from hypergrid.runtime.torch_compat import Unsplit, unsplit_mechanism
from tests import test_split_strategy as split_world


class Watch:
    """What a rank asked torch for since :meth:`clear`: every constructor call, and for each
    ``new_group`` whether torch would split it off the world's communicator then."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.off_world: list[list[int]] = []
        self._new_group = recorder.new_group

    def new_group(self, ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        world = dist.distributed_c10d._get_default_group()
        lazy = getattr(kwargs.get("pg_options"), "lazy_init", False)
        if getattr(world, "bound_device_id", None) is not None and not lazy and split_world._split_source(world):
            self.off_world.append(list(ranks or ()))
        return self._new_group(ranks, *args, **kwargs)

    def clear(self) -> None:
        self.recorder.calls.clear()
        self.off_world.clear()

    def needing_the_world(self) -> list:
        """The calls since :meth:`clear` that every rank of the world would have to join."""
        world_wide = [c for c in self.recorder.calls if c[0] != "new_group" or not c[1]["local"]]
        return world_wide + [("split off the world's", ranks) for ranks in self.off_world]

    def groups_made(self) -> int:
        return sum(1 for fn, _ in self.recorder.calls if fn == "new_group")


@contextlib.contextmanager
def splitting_world(rank: int, world: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[Watch]:
    """Be ``rank`` of a ``world``-rank simulated world bound to a device, whose new groups split."""
    with monkeypatch.context() as patch:
        patch.setattr(split_world, "WORLD", world)
        with split_world.bound_splitting_world(rank, patch) as recorder, monkeypatch.context() as watching:
            watch = Watch(recorder)

            # torch's signature shown through (hypergrid reads sort_ranks from it); undone before
            # the recorder's own patch is, so that torch's new_group is back afterwards
            @functools.wraps(dist.distributed_c10d.new_group)
            def new_group(*args: Any, **kwargs: Any) -> Any:
                return watch.new_group(*args, **kwargs)

            watching.setattr(dist, "new_group", new_group)
            assert job_setup().splits, recorder.how
            yield watch


def _grid_job(spares: list[int], **options: Any) -> tuple[Any, dict]:
    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    before = {dims: grid.create_pg(dims, **options) for dims in ("tp", "dp", "pp")}
    return ResilientJob.of_grid(grid, spares=spares, settings=RecoverySettings(gpus_per_node=2)), before


def _check_recovered(job: Any, after: Any, before: dict, watch: Watch, rank: int) -> None:
    assert watch.needing_the_world() == [], (rank, watch.recorder.how, watch.needing_the_world())
    if not after.in_grid:
        return
    for dims, old in before.items():
        members = after.layout.group_ranks([dims], rank)
        pg = after.state.get_pg(dims)
        assert dist.get_process_group_ranks(pg) == members, (rank, dims)  # in position order
        unchanged = old is not None and members == job.layout.group_ranks([dims], rank)
        assert (pg is old) is unchanged, (rank, dims, members)
    # The group standing in for the default one, made when first asked for, among its members too.
    assert dist.get_process_group_ranks(after.world) == list(after.layout.ranks)
    assert watch.needing_the_world() == [], (rank, watch.needing_the_world())


@pytest.mark.parametrize("rank", [0, 4, 6, 8, 9])
def test_a_replacement_on_a_world_that_splits_makes_no_call_that_needs_a_lost_rank(rank, monkeypatch):
    with splitting_world(rank, 10, monkeypatch) as watch:
        job, before = _grid_job(spares=[8, 9])
        watch.clear()
        after = job.recover(failed=[5])
        assert list(after.layout.ranks) == [0, 1, 2, 3, 4, 8, 6, 7]
        # The changed groups, made among their members: rank 5's tp peer (rank 4) makes its tp
        # group again, the spare its three; the others nothing.
        changed = {0: 0, 4: 1, 6: 0, 8: 3, 9: 0}[rank]
        assert watch.groups_made() == changed, (rank, watch.recorder.calls)
        _check_recovered(job, after, before, watch, rank)
        after.state.destroy()


@pytest.mark.parametrize("rank", [0, 3, 5, 7])
def test_a_shrink_on_a_world_that_splits_makes_no_call_that_needs_a_lost_rank(rank, monkeypatch):
    with splitting_world(rank, 8, monkeypatch) as watch:
        job, before = _grid_job(spares=[])
        watch.clear()
        after = job.recover(failed=[5])
        assert list(after.layout.ranks) == [2, 3, 6, 7] and after.in_grid is (rank in (2, 3, 6, 7))
        _check_recovered(job, after, before, watch, rank)
        after.state.destroy()


def test_lazy_init_keeps_torch_from_splitting_where_it_reads_it(monkeypatch):
    """Where torch's group creation reads a ``lazy_init`` option (2.15) and has NCCL's options, a
    fresh NCCL group is given options with it set for the call, and the world stays bound; else the
    world is left unbound for the call. (The fake backend takes no NCCL options, so the mechanism
    is checked here, not through a group.)"""
    from hypergrid.runtime.torch_compat import _honours_lazy_init, unsplit

    options_type = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    with splitting_world(4, 10, monkeypatch):
        world = dist.distributed_c10d._get_default_group()
        bound = world.bound_device_id
        expected = Unsplit.LAZY_INIT if options_type is not None and _honours_lazy_init() else Unsplit.UNBOUND
        assert unsplit_mechanism(None, "nccl") is expected
        with unsplit(None, "nccl") as options:
            if expected is Unsplit.LAZY_INIT:
                assert options.lazy_init is True and world.bound_device_id == bound
            else:
                assert options is None and world.bound_device_id is None
        assert world.bound_device_id == bound
        if options_type is not None and hasattr(options_type(), "lazy_init"):
            given = options_type()
            with unsplit(given, "nccl") as options:
                assert options is given and given.lazy_init is (expected is Unsplit.LAZY_INIT)
            assert given.lazy_init is False  # the caller's options as they were


@pytest.mark.parametrize("rank", [1, 5, 8])
def test_a_megatron_job_with_spares_on_a_world_that_splits_makes_its_groups_among_members(rank, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state as ps

    from hypergrid.megatron import destroy_model_parallel

    sizes = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False)
    with splitting_world(rank, 10, monkeypatch) as watch:
        job = ResilientJob.of_megatron(spares=[8, 9], settings=RecoverySettings(gpus_per_node=2), **sizes)
        # The spares make no group, so none may be split off the world's, from the start.
        assert watch.needing_the_world() == [], watch.needing_the_world()
        tp = ps.get_tensor_model_parallel_group() if job.in_grid else None
        watch.clear()
        after = job.recover(failed=[4])
        assert watch.needing_the_world() == [], watch.needing_the_world()
        assert list(after.layout.ranks) == [0, 1, 2, 3, 8, 5, 6, 7]
        if rank == 1:
            assert ps.get_tensor_model_parallel_group() is tp
        if after.in_grid:
            assert dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()) == after.layout.group_ranks(["tp"], rank)
        destroy_model_parallel()


@pytest.mark.parametrize("world", [65_536, 1_048_576])
def test_one_rank_of_a_huge_world_that_splits_recovers_with_no_world_wide_call(world, monkeypatch):
    """tp 8 x cp 2 x pp 8, the rest data parallel, on all but a spare node of 8; node 1 is lost.
    Rank 0 keeps its tp and pp groups and makes its cp group (with node 1's first rank) again; the
    spare node's rank makes its tp group over the spare node."""
    node, grid_size = 8, world - 8
    spares = list(range(grid_size, world))
    for rank in (0, spares[1]):
        with splitting_world(rank, world, monkeypatch) as watch:
            grid = HyperCommGrid([8, 2, grid_size // 128, 8], ["tp", "cp", "dp", "pp"])
            before = {dims: grid.create_pg(dims) for dims in ("tp", "cp", "pp")}
            job = ResilientJob.of_grid(grid, spares=spares, settings=RecoverySettings(gpus_per_node=node))
            watch.clear()
            after = job.recover(failed=list(range(node, 2 * node)))
            assert watch.needing_the_world() == [], watch.needing_the_world()
            assert after.last.describe().startswith("replace: rank 8 -> " + str(grid_size))
            if rank == 0:
                assert after.state.get_pg("tp") is before["tp"] and after.state.get_pg("pp") is before["pp"]
                assert dist.get_process_group_ranks(after.state.get_pg("cp")) == [0, grid_size]
            else:
                assert dist.get_process_group_ranks(after.state.get_pg("tp")) == list(range(grid_size, world))
            after.state.destroy()


@pytest.mark.parametrize("backend", ["nccl", "nccl2", "nccl-lazy", "nccl-legacy"])
def test_fresh_is_what_a_splitting_nccl_world_of_any_name_uses(backend):
    from hypergrid.runtime.modes import JobSetup

    bound = JobSetup(backend=backend, split_device="cuda", split_backend=backend)
    assert creation_mode("fresh", job=bound) is CreationMode.FRESH
    assert creation_mode("fresh", "gloo", job=bound) is CreationMode.LOCAL  # gloo never splits off NCCL
    assert creation_mode("fresh", job=JobSetup(backend=backend)) is CreationMode.LOCAL  # unbound: nothing splits
