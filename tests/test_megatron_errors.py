"""Invalid Megatron configurations: rejected as Megatron-Core rejects them, before any group exists,
with a message naming the sizes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

import hypergrid.megatron as hm  # noqa: E402
from hypergrid.groups import REGISTRY  # noqa: E402
from hypergrid.megatron import ParallelConfigError, plan_model_parallel  # noqa: E402
from tests.harness import fake_world  # noqa: E402

# (id, world size, keywords, fragments the message must contain)
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
]


@pytest.mark.parametrize("world,kwargs,fragments", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_configuration_rejected_like_megatron(world: int, kwargs: dict[str, Any], fragments: list[str]) -> None:
    # The pure plan rejects it, naming the sizes.
    with pytest.raises(ParallelConfigError) as planned:
        plan_model_parallel(world, **kwargs)
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


def test_zero_size_is_a_value_error_naming_it() -> None:
    # Megatron-Core fails with ZeroDivisionError here; hypergrid names the keyword.
    with pytest.raises(ParallelConfigError, match=r"tensor_model_parallel_size must be an integer >= 1, got 0"):
        plan_model_parallel(8, tensor_model_parallel_size=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tensor_model_parallel_size="2"), r"tensor_model_parallel_size must be an int, got str '2'"),
        (dict(use_sharp=1), r"use_sharp must be a bool"),
        (dict(tensor_parallel_size=2), r"unexpected keyword argument\(s\) \['tensor_parallel_size'\]"),
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
    with pytest.raises(RuntimeError, match="init_process_group"):
        hm.initialize_model_parallel()
    with fake_world(0, 4):
        try:
            hm.initialize_model_parallel(create_gloo_process_groups=False)
            count = REGISTRY.count()
            with pytest.raises(RuntimeError, match="already initialized"):
                hm.initialize_model_parallel(create_gloo_process_groups=False)
            assert REGISTRY.count() == count
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
