"""Differential tests: every ``parallel_state`` getter after hypergrid's initialize_model_parallel
answers as after Megatron-Core's own, on the same rank of the same fake world.

For each configuration and several ranks, this process plays that rank of a world of the given
size on torch's fake backend, runs Megatron-Core's ``initialize_model_parallel`` and records
what every getter answers (groups by their members), tears down, runs hypergrid's, records
again, and requires zero differences. ``ProcessGroupCollection.use_mpu_process_groups()`` after
Megatron-Core is compared with :func:`hypergrid.megatron.process_group_collection` the same way.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

import hypergrid.megatron as hm  # noqa: E402
from hypergrid.megatron.config import MegatronConfig  # noqa: E402
from tests.harness import fake_world  # noqa: E402


def _ranks(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(value))
    if isinstance(value, list):
        return [_ranks(v) for v in value]
    if isinstance(value, dict):
        return {k: _ranks(v) for k, v in sorted(value.items())}
    return value


def _call(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", _ranks(fn()))
    except AssertionError:
        return ("raises", "AssertionError")
    except (KeyError, TypeError, AttributeError) as exc:
        return ("raises", type(exc).__name__)


def snapshot(ps: Any, vp_size: int | None, hybrid_sizes: list[int]) -> dict[str, Any]:
    """Every getter's answer, keyed by the call that produced it."""
    out: dict[str, Any] = {}

    def rec(key: str, fn: Callable[[], Any]) -> None:
        out[key] = _call(fn)

    for name in (
        "get_model_parallel_group",
        "get_tensor_model_parallel_group",
        "get_pipeline_model_parallel_group",
        "get_context_parallel_group",
        "get_context_parallel_global_ranks",
        "get_hierarchical_context_parallel_groups",
        "get_embedding_group",
        "get_position_embedding_group",
        "get_tensor_and_context_parallel_group",
        "get_expert_model_parallel_group",
        "get_expert_tensor_parallel_group",
        "get_expert_tensor_and_model_parallel_group",
        "get_expert_tensor_model_pipeline_parallel_group",
        "get_intra_distributed_optimizer_instance_group",
        "get_inter_distributed_optimizer_instance_group",
    ):
        rec(name, getattr(ps, name))
        rec(name + "(check_initialized=False)", lambda n=name: getattr(ps, n)(check_initialized=False))
    for with_cp in (False, True):
        for partial in (False, True):
            rec(f"dp_group(cp={with_cp},partial={partial})",
                lambda a=with_cp, b=partial: ps.get_data_parallel_group(with_context_parallel=a, partial_data_parallel=b))
            rec(f"dp_group_gloo(cp={with_cp},partial={partial})",
                lambda a=with_cp, b=partial: ps.get_data_parallel_group_gloo(with_context_parallel=a, partial_data_parallel=b))
            rec(f"dp_world_size(cp={with_cp},partial={partial})",
                lambda a=with_cp, b=partial: ps.get_data_parallel_world_size(with_context_parallel=a, partial_data_parallel=b))
            rec(f"dp_rank(cp={with_cp},partial={partial})",
                lambda a=with_cp, b=partial: ps.get_data_parallel_rank(with_context_parallel=a, partial_data_parallel=b))
            rec(f"amax(cp={with_cp},tp_only={partial})",
                lambda a=with_cp, b=partial: ps.get_amax_reduction_group(with_context_parallel=a, tp_only_amax_red=b))
        rec(f"dp_group(cp={with_cp},ag)", lambda a=with_cp: ps.get_data_parallel_group(with_context_parallel=a, independent_all_gather=True))
        rec(f"tp_dp_group(cp={with_cp})", lambda a=with_cp: ps.get_tensor_and_data_parallel_group(with_context_parallel=a))
        rec(f"dp_src_rank(cp={with_cp})", lambda a=with_cp: ps.get_data_parallel_src_rank(with_context_parallel=a))
    for partial in (False, True):
        rec(f"expert_dp_group(partial={partial})", lambda b=partial: ps.get_expert_data_parallel_group(partial_expert_data_parallel=b))
        rec(f"expert_dp_group_gloo(partial={partial})", lambda b=partial: ps.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=b))
        rec(f"expert_dp_rank(partial={partial})", lambda b=partial: ps.get_expert_data_parallel_rank(partial_expert_data_parallel=b))
        rec(f"expert_dp_world_size(partial={partial})", lambda b=partial: ps.get_expert_data_parallel_world_size(partial_expert_data_parallel=b))
    for size in hybrid_sizes:
        rec(f"hybrid(group_size={size})", lambda s=size: ps.get_hybrid_data_context_parallel_groups(group_size=s))
    for name in (
        "has_separate_all_gather_group",
        "is_initialized",
        "model_parallel_is_initialized",
        "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_rank",
        "get_pipeline_model_parallel_world_size",
        "get_pipeline_model_parallel_rank",
        "get_context_parallel_world_size",
        "get_context_parallel_rank",
        "get_tensor_and_context_parallel_world_size",
        "get_tensor_and_context_parallel_rank",
        "get_virtual_pipeline_model_parallel_rank",
        "get_virtual_pipeline_model_parallel_world_size",
        "get_tensor_model_parallel_src_rank",
        "get_model_parallel_src_rank",
        "get_pipeline_model_parallel_first_rank",
        "get_pipeline_model_parallel_last_rank",
        "get_pipeline_model_parallel_next_rank",
        "get_pipeline_model_parallel_prev_rank",
        "is_pipeline_first_stage",
        "is_pipeline_last_stage",
        "is_rank_in_embedding_group",
        "is_rank_in_position_embedding_group",
        "get_expert_model_parallel_src_rank",
        "get_expert_model_parallel_world_size",
        "get_expert_model_parallel_rank",
        "get_expert_tensor_parallel_world_size",
        "get_expert_tensor_parallel_rank",
        "get_expert_tensor_and_model_parallel_world_size",
        "get_expert_tensor_and_model_parallel_rank",
        "get_all_ranks",
    ):
        rec(name, getattr(ps, name))
    if vp_size is not None:
        for stage in range(vp_size):
            rec(f"first_stage(vp={stage})", lambda s=stage: ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=s))
            rec(f"last_stage(vp={stage})", lambda s=stage: ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=s))
            rec(f"in_embedding(vp={stage})", lambda s=stage: ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=s))
    rec("global_memory_buffer", lambda: type(ps.get_global_memory_buffer()).__name__)
    for name in (
        "_PIPELINE_GLOBAL_RANKS",
        "_DATA_PARALLEL_GLOBAL_RANKS",
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
        "_MODEL_PARALLEL_GLOBAL_RANKS",
        "_CONTEXT_PARALLEL_GLOBAL_RANKS",
        "_EXPERT_MODEL_PARALLEL_RANKS",
        "_EMBEDDING_GLOBAL_RANKS",
        "_POSITION_EMBEDDING_GLOBAL_RANKS",
    ):
        rec(name, lambda n=name: getattr(ps, n))
    # Distinct memberships of every communicator this rank got (sharing merges equal ones).
    rec("process_group_members", lambda: sorted({_ranks(g) for g in ps._global_process_group_list[1:]}))
    return out


def collection_snapshot(pgc: Any) -> dict[str, Any]:
    """A ``ProcessGroupCollection``'s fields by members."""
    from dataclasses import fields

    return {f.name: _ranks(getattr(pgc, f.name, "unset")) for f in fields(pgc)}


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences between two snapshots (empty: identical)."""
    diffs = []
    for key in sorted(set(expected) | set(actual)):
        if expected.get(key, "<missing>") != actual.get(key, "<missing>"):
            diffs.append(f"{key}: megatron={expected.get(key, '<missing>')!r} hypergrid={actual.get(key, '<missing>')!r}")
    return diffs


# (id, world size, Megatron-Core keywords). Gloo groups cannot exist on the fake backend, so
# every run passes create_gloo_process_groups=False (the real-process tests cover gloo).
CONFIGS: list[tuple[str, int, dict[str, Any]]] = [
    ("world1", 1, {}),
    ("dp-only", 6, {}),
    ("tp2-pp2", 8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ("tp2-pp4-vp3", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=3)),
    ("tp3-pp2-npot", 12, dict(tensor_model_parallel_size=3, pipeline_model_parallel_size=2)),
    ("tp-all", 4, dict(tensor_model_parallel_size=4)),
    ("pp-all", 5, dict(pipeline_model_parallel_size=5)),
    ("cp2-tp2-pp2-ep2", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2)),
    ("hcp-2x2", 16, dict(tensor_model_parallel_size=2, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])),
    ("hcp-3x2-npot", 24, dict(context_parallel_size=6, hierarchical_context_parallel_sizes=[3, 2], pipeline_model_parallel_size=2)),
    ("ep4-etp1", 16, dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)),
    ("ep2-etp4", 32, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=4)),
    ("distopt2", 24, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, expert_model_parallel_size=2, expert_tensor_parallel_size=1, num_distributed_optimizer_instances=2)),
    ("distopt4-cp", 32, dict(context_parallel_size=2, expert_model_parallel_size=2, num_distributed_optimizer_instances=4)),
    ("hybrid-cp", 32, dict(tensor_model_parallel_size=2, context_parallel_size=2, hybrid_context_parallel=True)),
    ("hybrid-cp-npot", 20, dict(context_parallel_size=2, hybrid_context_parallel=True)),
    ("allgather", 16, dict(tensor_model_parallel_size=2, context_parallel_size=2, create_all_gather_group=True)),
    ("order-tp-pp-dp", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, order="tp-pp-dp")),
    ("order-tp-cp-ep-pp-dp", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2, order="tp-cp-ep-pp-dp")),
    ("order-pp-dp-tp", 24, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, order="pp-dp-tp")),
    ("order-dp-cp-tp-ep-pp", 32, dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2, order="dp-cp-tp-ep-pp")),
    ("order-ep-tp-dp-pp", 32, dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1, pipeline_model_parallel_size=2, order="ep-tp-dp-pp")),
    ("order-upper", 8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="TP-CP-EP-DP-PP")),
    ("embedding-callbacks", 16, dict(pipeline_model_parallel_size=4, get_embedding_ranks=lambda r: [r[-1]], get_position_embedding_ranks=lambda r: r[:2])),
    ("timeout-vp", 8, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, distributed_timeout_minutes=5)),
    ("big-4096", 4096, dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, context_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=2)),
    ("big-3072-npot", 3072, dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=3, context_parallel_size=2, expert_model_parallel_size=8, expert_tensor_parallel_size=1, hierarchical_context_parallel_sizes=[2, 1])),
    ("big-6144-distopt", 6144, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=6, expert_model_parallel_size=4, num_distributed_optimizer_instances=4, virtual_pipeline_model_parallel_size=2)),
]


def ranks_to_check(world: int, seed: str) -> list[int]:
    """First, last and a few others: stage boundaries and interior ranks alike."""
    rng = random.Random(f"{seed}-{world}")
    chosen = {0, world - 1, world // 2, rng.randrange(world), rng.randrange(world)}
    return sorted(chosen)


def _hybrid_sizes(world: int, kwargs: dict[str, Any]) -> list[int]:
    cfg = MegatronConfig(world_size=world, **kwargs)
    if not cfg.hybrid_context_parallel:
        return []
    return list(cfg.hybrid_group_sizes) + [cfg.data_parallel_size * cfg.cp]


def _world_ranks(world: int) -> tuple[int, ...]:
    return tuple(range(world))


def _group_list(world: int) -> list[tuple[int, ...]]:
    # ps._global_process_group_list in order; None stands for the default group.
    return [_world_ranks(world) if g is None else _ranks(g) for g in ps._global_process_group_list]


def compare_rank(world: int, rank: int, kwargs: dict[str, Any], variants: list[dict[str, Any]]) -> list[str]:
    """Differences between Megatron-Core and each hypergrid variant on one rank (empty: none)."""
    vp = kwargs.get("virtual_pipeline_model_parallel_size")
    hybrid = _hybrid_sizes(world, kwargs)
    diffs: list[str] = []
    with fake_world(rank, world):
        try:
            ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
            expected = snapshot(ps, vp, hybrid)
            expected["collection"] = collection_snapshot(ProcessGroupCollection.use_mpu_process_groups())
            megatron_list = _group_list(world)
        finally:
            hm.destroy_model_parallel()
        expected["process_group_members"] = sorted(set(megatron_list))
        for variant in variants:
            try:
                grids = hm.initialize_model_parallel(create_gloo_process_groups=False, **variant, **kwargs)
                actual = snapshot(ps, vp, hybrid)
                actual["collection"] = collection_snapshot(hm.process_group_collection())
                actual["process_group_members"] = sorted(set(_group_list(world)))
                if not grids.share_groups and _group_list(world) != megatron_list:
                    diffs.append(f"rank {rank} {variant}: communicator list {_group_list(world)} != Megatron's {megatron_list}")
            finally:
                hm.destroy_model_parallel()
            diffs += [f"rank {rank} {variant}: {d}" for d in differences(expected, actual)]
    return diffs


@pytest.mark.parametrize("world,kwargs", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_every_getter_matches_megatron(world: int, kwargs: dict[str, Any]) -> None:
    diffs: list[str] = []
    for rank in ranks_to_check(world, "getters"):
        diffs += compare_rank(world, rank, kwargs, [{"share_groups": True}, {"share_groups": False}])
    assert diffs == [], "\n".join(diffs[:40])


SMALL_FOR_STRATEGIES = [c for c in CONFIGS if c[1] <= 32 and c[0] in (
    "tp2-pp2", "cp2-tp2-pp2-ep2", "hcp-2x2", "distopt2", "hybrid-cp", "allgather", "embedding-callbacks")]


@pytest.mark.parametrize("world,kwargs", [c[1:] for c in SMALL_FOR_STRATEGIES], ids=[c[0] for c in SMALL_FOR_STRATEGIES])
def test_enumerate_and_split_strategies_match_megatron(world: int, kwargs: dict[str, Any]) -> None:
    diffs: list[str] = []
    for rank in ranks_to_check(world, "strategies")[:3]:
        diffs += compare_rank(world, rank, kwargs, [
            {"strategy": "enumerate"}, {"strategy": "enumerate", "share_groups": False}, {"strategy": "split"},
        ])
    assert diffs == [], "\n".join(diffs[:40])


def test_snapshot_detects_a_difference() -> None:
    # The comparison must be able to fail: a wrong pipeline neighbour is reported.
    with fake_world(3, 8):
        try:
            hm.initialize_model_parallel(create_gloo_process_groups=False, pipeline_model_parallel_size=4)
            good = snapshot(ps, None, [])
            ps._PIPELINE_GLOBAL_RANKS = list(reversed(ps._PIPELINE_GLOBAL_RANKS))
            bad = snapshot(ps, None, [])
        finally:
            hm.destroy_model_parallel()
    found = differences(good, bad)
    assert any("next_rank" in d for d in found) and any("_PIPELINE_GLOBAL_RANKS" in d for d in found)
