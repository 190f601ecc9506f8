"""Invalid Megatron configurations: rejected as Megatron-Core rejects them, before any group exists,
with a message naming the sizes."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

import hypergrid.megatron as hm
from hypergrid.megatron import (
    MEGATRON_CORE_0_16,
    SUPPORTED_PROFILES,
    ParallelConfigError,
    ParallelStateError,
    plan_model_parallel,
)
from hypergrid.runtime.registry import REGISTRY
from tests.harness import fake_world

# Set by the fixture below when the first test here runs: importing megatron-core takes seconds,
# which collecting the suite should not spend.
ps: Any = None  # megatron.core.parallel_state
INSTALLED: Any = None  # hypergrid.megatron.installed_features()


@pytest.fixture(scope="module", autouse=True)
def megatron_core() -> None:
    """Every test here skips without megatron-core."""
    global ps, INSTALLED
    ps = pytest.importorskip("megatron.core.parallel_state")
    INSTALLED = hm.installed_features()

# (id, world size, keywords, fragments the message must contain). Entries using a keyword the
# installed version lacks are skipped; ONLY_WITH marks entries invalid only where a feature exists.
INVALID: list[tuple[str, int, dict[str, Any], list[str]]] = [
    ("world-not-divisible", 12, dict(tensor_model_parallel_size=8), ["world_size (12)", "= 8"]),
    ("vp-without-pp", 8, dict(virtual_pipeline_model_parallel_size=2), ["virtual_pipeline_model_parallel_size=2", "got 1"]),
    ("expert-not-divisible", 8, dict(tensor_model_parallel_size=2, expert_model_parallel_size=3), ["world_size (8)", "expert_model_parallel_size (3)", "= 6"]),
    ("edp-differs-pp-not-last", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2, order="tp-cp-ep-pp-dp"), ["expert data-parallel size (4)", "data-parallel size (2)"]),
    ("cp-not-in-order", 16, dict(context_parallel_size=2, order="tp-dp-pp"), ["size of cp is 2", "'tp-dp-pp'"]),
    ("ep-not-in-order", 16, dict(expert_model_parallel_size=2, order="tp-cp-dp-pp"), ["size of ep is 2", "'tp-cp-dp-pp'"]),
    ("unknown-order-token", 8, dict(order="tp-xp-dp-pp"), ["'xp'", "'tp-xp-dp-pp'"]),
    ("pipelines-differ", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1, order="tp-pp-ep-dp"), ["pipeline groups differ", "ranks 2 apart", "ranks 1 apart"]),
    ("distopt-dp", 16, dict(num_distributed_optimizer_instances=3), ["= 16", "num_distributed_optimizer_instances (3)"]),
    ("distopt-expert-dp", 16, dict(tensor_model_parallel_size=4, expert_model_parallel_size=8, expert_tensor_parallel_size=1, num_distributed_optimizer_instances=4), ["expert data-parallel size (2", "num_distributed_optimizer_instances (4)"]),
    ("hybrid-odd", 6, dict(tensor_model_parallel_size=2, hybrid_context_parallel=True), ["even", "data_parallel_size (3)"]),
    ("hierarchical-product", 16, dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3]), ["[2, 3]", "is 6", "context_parallel_size is 4"]),
    ("pp-backend", 8, dict(pipeline_model_parallel_comm_backend="mpi"), ["'mpi'", "'ucc'"]),
    ("sharp-group-without-sharp", 8, dict(sharp_enabled_group="dp"), ["sharp_enabled_group='dp'", "use_sharp=True"]),
    ("sharp-group-unknown", 8, dict(use_sharp=True, sharp_enabled_group="tp"), ["'tp'", "'dp_replica'"]),
    ("sharp-replica-one-instance", 8, dict(use_sharp=True, sharp_enabled_group="dp_replica"), ["num_distributed_optimizer_instances > 1", "got 1"]),
    # megatron-core 0.19
    ("gtp-with-distopt", 16, dict(gtp_remat_size=2, num_distributed_optimizer_instances=2), ["gtp_remat_size=2", "num_distributed_optimizer_instances=2", "expected num_distributed_optimizer_instances=1"]),
    ("egtp-with-distopt", 16, dict(expert_gtp_remat_size=2, expert_model_parallel_size=2, num_distributed_optimizer_instances=2), ["expert_gtp_remat_size=2", "num_distributed_optimizer_instances=2"]),
    ("gtp-not-divisible", 12, dict(tensor_model_parallel_size=2, gtp_remat_size=4), ["world_size (12)", "gtp_remat_size (4)", "= 8"]),
    ("egtp-not-divisible", 12, dict(expert_model_parallel_size=2, expert_gtp_remat_size=4), ["world_size (12)", "expert_gtp_remat_size (4)", "= 8"]),
    ("offset-beyond-world", 16, dict(rank_offset=12, local_world_size=8), ["[12, 20)", "world of 16 ranks"]),
    ("offset-without-local-size", 16, dict(rank_offset=4), ["[4, 20)", "rank_offset + local_world_size <= 16"]),
    ("local-world-not-divisible", 16, dict(tensor_model_parallel_size=4, local_world_size=6), ["world_size (6)", "= 4"]),
    ("order-without-tp", 16, dict(order="cp-ep-dp-pp"), ["'cp-ep-dp-pp'", "does not place 'tp'"]),
]
#: Entries that are valid configurations on a version without the feature named.
ONLY_WITH = {"order-without-tp": "gtp_remat_size"}


@pytest.mark.parametrize("name,world,kwargs,fragments", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_configuration_rejected_like_megatron(name: str, world: int, kwargs: dict[str, Any], fragments: list[str]) -> None:
    missing = sorted(set(kwargs) - set(INSTALLED.keywords))
    if name in ONLY_WITH and not INSTALLED.accepts(ONLY_WITH[name]):
        missing.append(ONLY_WITH[name])
    if missing:
        pytest.skip(f"megatron-core {INSTALLED.version} has no {missing}")
    # The pure plan rejects it, naming the sizes.
    with pytest.raises(ParallelConfigError) as planned:
        plan_model_parallel(world, features=INSTALLED, **kwargs)
    for fragment in fragments:
        assert fragment in str(planned.value), f"{fragment!r} missing from: {planned.value}"
    assert isinstance(planned.value, ValueError)
    with fake_world(0, world):
        # Megatron-Core rejects the same configuration...
        try:
            with pytest.raises(Exception) as megatron_error:
                ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        finally:
            hm.destroy_model_parallel()
        # ...with a type our error also is, so existing except clauses keep working.
        assert isinstance(planned.value, type(megatron_error.value)), (type(megatron_error.value), megatron_error.value)
        groups_before = len(dist.distributed_c10d._world.pg_map)
        with pytest.raises(ParallelConfigError):
            hm.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        # Nothing was created and nothing is initialized.
        assert len(dist.distributed_c10d._world.pg_map) == groups_before
        assert REGISTRY.count() == 0
        assert ps._DATA_PARALLEL_GROUP is None and ps._GLOBAL_MEMORY_BUFFER is None
        assert hm.active_grids() is None


def test_sharp_without_a_cuda_device_is_refused_before_any_group_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Megatron-Core makes its groups, then fails inside torch.cuda (a RuntimeError on a CUDA build
    # without a driver, an AssertionError on a CPU build); ours is both, and comes first.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with fake_world(0, 8):
        groups_before = len(dist.distributed_c10d._world.pg_map)
        with pytest.raises(ParallelConfigError) as refused:
            hm.initialize_model_parallel(create_gloo_process_groups=False, use_sharp=True)
        assert "use_sharp=True" in str(refused.value) and "torch.cuda.is_available() is False" in str(refused.value)
        assert isinstance(refused.value, RuntimeError) and isinstance(refused.value, AssertionError)
        assert len(dist.distributed_c10d._world.pg_map) == groups_before
        assert REGISTRY.count() == 0 and hm.active_grids() is None


def test_zero_size_is_a_value_error_naming_it() -> None:
    # Megatron-Core fails with ZeroDivisionError here; hypergrid names the keyword.
    with pytest.raises(ParallelConfigError, match=r"tensor_model_parallel_size must be an integer >= 1, got 0"):
        plan_model_parallel(8, tensor_model_parallel_size=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tensor_model_parallel_size="2"), r"tensor_model_parallel_size must be an int, got str '2'"),
        (dict(use_sharp=1), r"use_sharp must be a bool"),
        (dict(tensor_parallel_size=2), r"got keyword argument\(s\) \['tensor_parallel_size'\] that megatron-core"),
        (dict(get_embedding_ranks=[0, 1]), r"get_embedding_ranks must be callable"),
        (dict(hierarchical_context_parallel_sizes="22", context_parallel_size=1), r"hierarchical_context_parallel_sizes must be a list"),
    ],
)
def test_wrong_types_are_type_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        plan_model_parallel(8, **kwargs)


def test_bad_embedding_callback_raises_before_any_group() -> None:
    with fake_world(3, 8):
        before = len(dist.distributed_c10d._world.pg_map)
        with pytest.raises(ValueError, match=r"pipeline group \[3, 7\] it returned \[0\]"):
            hm.initialize_model_parallel(
                pipeline_model_parallel_size=2, create_gloo_process_groups=False, get_embedding_ranks=lambda ranks: [0]
            )
        assert len(dist.distributed_c10d._world.pg_map) == before
        assert REGISTRY.count() == 0 and hm.active_grids() is None


def test_positional_arguments_follow_megatron_signature() -> None:
    with fake_world(5, 8):
        try:
            hm.initialize_model_parallel(2, 2, create_gloo_process_groups=False)
            assert ps.get_tensor_model_parallel_world_size() == 2
            assert ps.get_pipeline_model_parallel_world_size() == 2
            with pytest.raises(TypeError, match="multiple values for argument 'tensor_model_parallel_size'"):
                hm.initialize_model_parallel(2, tensor_model_parallel_size=2)
        finally:
            hm.destroy_model_parallel()


def test_double_initialization_and_uninitialized_torch() -> None:
    # Megatron-Core asserts in both cases: ours is an AssertionError too (and a RuntimeError).
    with pytest.raises(ParallelStateError, match="init_process_group") as uninitialized:
        hm.initialize_model_parallel()
    assert isinstance(uninitialized.value, (AssertionError, RuntimeError))
    with fake_world(0, 4):
        try:
            hm.initialize_model_parallel(create_gloo_process_groups=False)
            count = REGISTRY.count()
            with pytest.raises(AssertionError, match="already initialized") as again:
                hm.initialize_model_parallel(create_gloo_process_groups=False)
            assert isinstance(again.value, RuntimeError)
            assert REGISTRY.count() == count
            # Megatron-Core's own second call is an AssertionError as well.
            with pytest.raises(AssertionError):
                ps.initialize_model_parallel(create_gloo_process_groups=False)
        finally:
            hm.destroy_model_parallel()
        # After Megatron-Core's own initialization, too.
        try:
            ps.initialize_model_parallel(create_gloo_process_groups=False)
            with pytest.raises(RuntimeError, match="_DATA_PARALLEL_GROUP"):
                hm.initialize_model_parallel(create_gloo_process_groups=False)
        finally:
            hm.destroy_model_parallel()


def test_hypergrid_keywords_are_checked() -> None:
    with fake_world(0, 4):
        with pytest.raises(ValueError, match="strategy must be one of"):
            hm.initialize_model_parallel(strategy="fast")
        with pytest.raises(TypeError, match="share_groups must be a bool"):
            hm.initialize_model_parallel(share_groups="yes")


#: Keywords some supported megatron-core has and another lacks, and one of none: the candidates
#: for a keyword the installed version lacks (known without importing it).
VERSION_KEYWORDS = sorted(
    {k for p in SUPPORTED_PROFILES for k in p.keywords} - set.intersection(*(set(p.keywords) for p in SUPPORTED_PROFILES))
) + ["tensor_parallel_size"]


def foreign_keywords() -> list[str]:
    """Keywords of a supported megatron-core other than the installed one, and one of none."""
    return sorted({k for p in SUPPORTED_PROFILES for k in p.keywords} - set(INSTALLED.keywords)) + ["tensor_parallel_size"]


def test_every_keyword_the_installed_version_lacks_is_tried() -> None:
    assert set(foreign_keywords()) <= set(VERSION_KEYWORDS), sorted(set(foreign_keywords()) - set(VERSION_KEYWORDS))


@pytest.mark.parametrize("keyword", VERSION_KEYWORDS)
def test_keyword_the_installed_version_lacks_is_a_type_error_naming_it_and_the_version(keyword: str) -> None:
    if keyword not in foreign_keywords():
        pytest.skip(f"megatron-core {INSTALLED.version} has {keyword!r}")
    with fake_world(0, 8):
        # Megatron-Core's own function has no such parameter...
        with pytest.raises(TypeError, match=keyword):
            ps.initialize_model_parallel(create_gloo_process_groups=False, **{keyword: 1})
        # ...and hypergrid's says so, naming the keyword and the installed version, before any group.
        before = len(dist.distributed_c10d._world.pg_map)
        with pytest.raises(TypeError) as refused:
            hm.initialize_model_parallel(create_gloo_process_groups=False, **{keyword: 1})
        assert repr(keyword) in str(refused.value) and f"megatron-core {INSTALLED.version}" in str(refused.value)
        assert len(dist.distributed_c10d._world.pg_map) == before and hm.active_grids() is None


def test_installed_keywords_match_megatron_signature_and_defaults() -> None:
    import inspect

    signature = inspect.signature(ps.initialize_model_parallel)
    assert INSTALLED.keywords == tuple(signature.parameters)
    # Every keyword of the installed version is one hypergrid knows, with Megatron-Core's default.
    from dataclasses import fields

    from hypergrid.megatron import MEGATRON_KEYWORDS, MegatronConfig

    ours = {f.name: f.default for f in fields(MegatronConfig)}
    for name, param in signature.parameters.items():
        assert name in MEGATRON_KEYWORDS, f"megatron-core {INSTALLED.version} keyword {name!r} unknown to hypergrid"
        assert ours[name] == param.default, (name, ours[name], param.default)
    # The profile of the installed release, used to plan without megatron-core, is truthful.
    profile = [p for p in SUPPORTED_PROFILES if p.version == INSTALLED.version]
    if profile:
        assert profile[0].keywords == INSTALLED.keywords


def test_drop_in_replacement_keeps_the_installed_keywords(monkeypatch) -> None:
    # The drop-in use: Megatron's module attribute replaced by hypergrid's function. What the
    # installed version takes must still come from megatron-core's own signature.
    monkeypatch.setattr(ps, "initialize_model_parallel", hm.initialize_model_parallel)
    assert hm.installed_features().keywords == INSTALLED.keywords
    assert "strategy" not in hm.installed_features().keywords


def test_pure_plan_refuses_keywords_of_another_version() -> None:
    with pytest.raises(TypeError, match=r"\['gtp_remat_size'\] that megatron-core 0.16.1 does not have"):
        plan_model_parallel(8, features=MEGATRON_CORE_0_16, gtp_remat_size=2)
    # The default plans the groups every supported version makes, so neither version's extras.
    with pytest.raises(TypeError, match="create_all_gather_group"):
        plan_model_parallel(8, create_all_gather_group=True)
