"""Communicators per rank (hypergrid.planning.cost) against what Megatron-Core and hypergrid really create.

Each configuration is initialized on torch's fake backend as ranks first, middle and last; the
new process groups Megatron-Core's own ``initialize_model_parallel`` adds to torch's map are
counted (a rank gets a group only where it is a member), and hypergrid's adapter reports its own
communicators (``active_grids().num_process_groups``). The plan follows the installed
megatron-core, found by what its source defines (0.19's ``initialize_model_parallel`` takes
``gtp_remat_size`` and creates three more groups per rank than 0.16's), as ``hypergrid plan`` does.
"""

from __future__ import annotations

import itertools
import re
import warnings
from pathlib import Path

import pytest

from hypergrid.layout.kinds import box_modes
from hypergrid.megatron.spec.features import MEGATRON_CORE_0_16, MEGATRON_CORE_0_19, choose_megatron_core
from hypergrid.planning.cost import max_cost, rank_cost
from hypergrid.planning.megatron_args import parse_megatron_args, plan_from_megatron_args
from hypergrid.planning.plan import plan_grid, plan_megatron
from hypergrid.releases import ReleaseChoice

dist = pytest.importorskip("torch.distributed")
pytest.importorskip("megatron.core")

from tests.harness import fake_world  # noqa: E402

CONFIGS = [
    (16, dict(tp=2, pp=2, ep=2)),                          # MoE
    (64, dict(tp=2, pp=4, cp=2, ep=4, etp=1)),             # MoE, expert tp apart
    (1024, dict(tp=8, pp=4, ep=16, etp=1)),                # a 1,024-GPU MoE layout
    (32, dict(tp=4, pp=2)),                                # dense
    (8, dict()),                                           # all data parallel: groups of the world
]


def _megatron_kwargs(sizes: dict) -> dict:
    names = dict(tp="tensor_model_parallel_size", pp="pipeline_model_parallel_size", cp="context_parallel_size",
                 ep="expert_model_parallel_size", etp="expert_tensor_parallel_size", order="order",
                 virtual_pipeline_model_parallel_size="virtual_pipeline_model_parallel_size")
    return {names[k]: v for k, v in sizes.items()}


def _megatron_count(rank: int, world: int, sizes: dict) -> int:
    from megatron.core import parallel_state
    from torch.distributed.distributed_c10d import _world

    with warnings.catch_warnings(), fake_world(rank, world):
        warnings.simplefilter("ignore")
        before = len(_world.pg_map)
        try:
            parallel_state.initialize_model_parallel(create_gloo_process_groups=False, **_megatron_kwargs(sizes))
            return len(_world.pg_map) - before
        finally:
            parallel_state.destroy_model_parallel()


def _hypergrid_count(rank: int, world: int, sizes: dict) -> int:
    import hypergrid.megatron as hm

    with warnings.catch_warnings(), fake_world(rank, world):
        warnings.simplefilter("ignore")
        try:
            hm.initialize_model_parallel(create_gloo_process_groups=False, **_megatron_kwargs(sizes))
            return hm.active_grids().num_process_groups
        finally:
            hm.destroy_model_parallel()


def _installed_features():
    features, followed = choose_megatron_core()
    assert followed.chosen_by is ReleaseChoice.INSTALLED, followed
    return features


def test_the_installed_megatron_core_is_read_from_its_source_as_inspect_reads_it():
    from hypergrid.megatron import installed_features

    found = installed_features()  # inspect.signature of the imported function
    assert _installed_features().keywords == found.keywords and _installed_features().version == found.version


@pytest.mark.parametrize("world,sizes", CONFIGS)
def test_counts_equal_what_megatron_core_and_hypergrid_create(world, sizes):
    plan = plan_megatron(world, features=_installed_features(), **sizes)
    for rank in (0, world // 2 + 1, world - 1):
        cost = rank_cost(plan, rank)
        assert cost.megatron == _megatron_count(rank, world, sizes), (rank, sizes)
        assert cost.hypergrid == _hypergrid_count(rank, world, sizes), (rank, sizes)
        assert cost.megatron_gloo == cost.hypergrid_gloo == 0


def test_gloo_copies_are_counted_apart_and_cost_no_gpu_memory():
    plan = plan_megatron(16, tp=2, pp=2, create_gloo_process_groups=True)
    cost = rank_cost(plan, 3, comm_memory_mb=100)
    assert cost.megatron_gloo > 0 and cost.hypergrid_gloo > 0
    assert cost.megatron_memory_mb == (cost.megatron - cost.megatron_gloo) * 100
    assert cost.memory_mb == (cost.hypergrid - cost.hypergrid_gloo) * 100


@pytest.mark.parametrize("world,sizes", [(256, dict(tp=2, pp=8, ep=4)), (512, dict(tp=4, pp=4, cp=2, ep=8, etp=2)),
                                         (96, dict(tp=2, pp=3, ep=2))])
def test_the_sampled_maximum_finds_the_exact_one(world, sizes):
    plan = plan_megatron(world, **sizes)
    exact = max_cost(plan)
    sampled = max_cost(plan, exact_limit=0, sample=16)
    assert exact.method == "every rank" and sampled.method.startswith("sample") and not sampled.exact
    assert (sampled.hypergrid, sampled.megatron) == (exact.hypergrid, exact.megatron)


def test_grid_only_plans_are_every_rank_alike():
    plan = plan_grid([4, 3, 8], ["tp", "cp", "dp"], groups=[["tp", "cp"], ["cp", "dp"]])
    alike = max_cost(plan, exact_limit=0)
    assert alike.method == "every rank alike" and alike.exact
    assert alike.hypergrid == max_cost(plan).hypergrid


def test_identities_without_members_agree_with_members():
    # Two kinds share a communicator exactly when their groups have the same members.
    plan = plan_megatron(128, tp=2, pp=4, ep=4, etp=1, num_distributed_optimizer_instances=2)
    for rank in (0, 37, 127):
        groups = {}
        for kind in plan.kinds:
            members = kind.members(rank)
            if members is not None:
                groups.setdefault((tuple(sorted(members)), kind.creation.backend, kind.creation.timeout), kind.name)
        expected = len({key for key in groups if len(key[0]) != 128})
        assert rank_cost(plan, rank).hypergrid == expected, rank


def test_box_modes_recognises_exactly_the_boxes():
    for members in itertools.chain.from_iterable(itertools.combinations(range(9), n) for n in range(1, 6)):
        found = box_modes(members)
        if found is None:
            continue
        low, modes = found
        rebuilt = {low}
        for size, stride in modes:
            rebuilt = {r + c * stride for r in rebuilt for c in range(size)}
        assert rebuilt == set(members), (members, found)
    assert box_modes([0, 2, 4, 1, 3, 5]) == (0, ((6, 1),))


@pytest.mark.parametrize("world,sizes", [(256, dict(tp=2, pp=4, cp=2, ep=4, etp=1)), (96, dict(tp=2, pp=3, ep=2))])
def test_one_ranks_groups_equal_the_full_enumerations(world, sizes):
    plan = plan_megatron(world, **sizes)
    for kind in plan.kinds:
        holding = {r: g for g in kind.enumerate() for r in g}
        for rank in range(world):
            heads = plan.group_heads(rank, 5)[kind.name]
            assert kind.members(rank) == holding.get(rank), (kind.name, rank)
            if rank in holding:
                assert heads == {"size": len(holding[rank]), "head": holding[rank][:5], "last": holding[rank][-1]}
            else:
                assert heads is None


def test_a_large_world_is_summarised_not_refused():
    plan = plan_megatron(1 << 24, tp=8, pp=16, cp=2, ep=64)
    summaries = {s.name: s for s in plan.summaries(8, nvlink_domain=72)}
    assert summaries["tp"].placement == "node" and summaries["tp"].count == (1 << 24) // 8
    assert not summaries["dp"].exact and summaries["dp"].intra_node_groups is None
    assert summaries["ep"].placement == "across"
    assert rank_cost(plan, 12_345_678).megatron == 15


def test_the_documented_moe_launch_line_costs_what_megatron_core_creates():
    # docs/cli.md's Megatron-LM launch line for a 1,024-GPU MoE job, read as the CLI reads it.
    page = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    line = re.search(r'--world-size 1024 --megatron-args "(.*?)"', page, re.S).group(1).replace("\\\n", " ")
    launch = parse_megatron_args(line)
    plan = plan_from_megatron_args(launch, world_size=1024, features=_installed_features())
    sizes = {k: v for k, v in launch.megatron_kwargs().items()}
    assert sizes["virtual_pipeline_model_parallel_size"] == 4 and sizes["cp"] == 2 and sizes["ep"] == 16
    for rank in (0, 517, 1000, 1023):
        cost = rank_cost(plan, rank)
        assert cost.megatron == _megatron_count(rank, 1024, sizes), rank
        assert cost.hypergrid == _hypergrid_count(rank, 1024, sizes), rank
    # What the docs' two tables show, for each release: the installed one's is the one checked above.
    shown = {}
    for features in (MEGATRON_CORE_0_16, MEGATRON_CORE_0_19):
        worst = max_cost(plan_from_megatron_args(launch, world_size=1024, features=features))
        shown[features.version] = (worst.megatron, worst.hypergrid)
    assert shown == {"0.16.1": (17, 14), "0.19.2": (20, 14)}
    assert shown[_installed_features().version] == (max_cost(plan).megatron, max_cost(plan).hypergrid)


@pytest.mark.parametrize("world,sizes", CONFIGS)
def test_megatron_core_0_19_makes_three_groups_a_rank_more_than_0_16(world, sizes):
    # The generalized tensor-parallel (gtp_remat) groups 0.19 creates at their default size of one
    # rank, dense and expert, and the tp-ep-pp group over gtp_remat, which repeats tp-ep-pp there.
    old, new = (plan_megatron(world, features=f, **sizes) for f in (MEGATRON_CORE_0_16, MEGATRON_CORE_0_19))
    assert [k.name for k in new.kinds if k.name not in {k.name for k in old.kinds}] == [
        "gtp_remat", "expt_gtp_remat", "tp_ep_pp_egtp"]
    for rank in (0, world - 1):
        before, after = rank_cost(old, rank), rank_cost(new, rank)
        assert after.megatron == before.megatron + 3 and after.hypergrid == before.hypergrid
        assert new.kind("gtp_remat").members(rank) == [rank] == new.kind("expt_gtp_remat").members(rank)
        assert new.kind("tp_ep_pp_egtp").members(rank) == new.kind("tp_ep_pp").members(rank)
