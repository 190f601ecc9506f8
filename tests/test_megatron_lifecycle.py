"""Initialize, share, destroy, initialize again: parallel_state and hypergrid's registry stay consistent."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

import hypergrid.megatron as hm
from hypergrid import HyperCommGrid
from hypergrid.runtime.registry import REGISTRY
from tests.harness import fake_world

#: megatron.core.parallel_state, set by the fixture below when the first test here runs (importing
#: megatron-core takes seconds, which collecting the suite should not spend).
ps: Any = None


@pytest.fixture(scope="module", autouse=True)
def megatron_core() -> None:
    """Every test here skips without megatron-core."""
    global ps
    ps = pytest.importorskip("megatron.core.parallel_state")

KWARGS = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
              create_gloo_process_groups=False)


def _alive(pg: dist.ProcessGroup) -> bool:
    return pg in dist.distributed_c10d._world.pg_map


def test_destroy_keeps_groups_other_grids_hold_and_never_the_world() -> None:
    with fake_world(5, 16):
        user = HyperCommGrid([2, 8], ["tp", "rest"])
        user_tp = user.create_pg("tp", timeout=__import__("datetime").timedelta(minutes=30))
        try:
            assert hm.initialize_model_parallel(**KWARGS) is None
            grids = hm.active_grids()
            tp = ps.get_tensor_model_parallel_group()
            # Same members and options: the user's group is reused, not duplicated.
            assert tp is user_tp and grids.grid.get_pg("tp") is tp
            assert ps.get_expert_tensor_parallel_group() is tp
            # One optimizer instance: its group spans the world and is the default group.
            assert ps.get_intra_distributed_optimizer_instance_group() is dist.group.WORLD
            assert grids.world_shared == ["intra_dist_opt"]
            groups = grids.distinct_groups()
        finally:
            hm.destroy_model_parallel()
        assert dist.is_initialized() and _alive(dist.group.WORLD)
        assert _alive(user_tp), "a group another grid holds was destroyed"
        assert not any(_alive(pg) for pg in groups if pg is not user_tp)
        assert ps._TENSOR_MODEL_PARALLEL_GROUP is None and ps._PIPELINE_GLOBAL_RANKS is None
        assert ps._EMBEDDING_GLOBAL_RANKS is None and hm.active_grids() is None
        assert REGISTRY.count() == 1
        # And again.
        try:
            hm.initialize_model_parallel(**KWARGS)
            again = hm.active_grids()
            assert ps.get_tensor_model_parallel_group() is user_tp
            assert ps.get_pipeline_model_parallel_next_rank() == 13
            assert hm.active_grids() is again
        finally:
            hm.destroy_model_parallel()
        user.destroy()
        assert REGISTRY.count() == 0 and not _alive(user_tp)


def test_private_groups_match_megatron_count_and_shared_ones_are_fewer() -> None:
    with fake_world(6, 32):
        try:
            ps.initialize_model_parallel(**KWARGS)
            megatron_count = len(ps._global_process_group_list) - 1
        finally:
            hm.destroy_model_parallel()
        try:
            hm.initialize_model_parallel(share_groups=False, **KWARGS)
            private = hm.active_grids().num_process_groups
        finally:
            hm.destroy_model_parallel()
        try:
            hm.initialize_model_parallel(**KWARGS)
            grids = hm.active_grids()
            shared = grids.num_process_groups
            assert len(set(map(id, grids.distinct_groups()))) == shared
        finally:
            hm.destroy_model_parallel()
    assert private == megatron_count
    assert shared < private


def test_all_gather_group_is_never_shared() -> None:
    if not hm.installed_features().all_gather_keyword:
        pytest.skip(f"megatron-core {hm.installed_features().version} has no create_all_gather_group keyword")
    with fake_world(1, 8):
        try:
            hm.initialize_model_parallel(create_all_gather_group=True, **KWARGS)
            ag = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
            dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
            assert ag is not dp_cp
            assert dist.get_process_group_ranks(ag) == dist.get_process_group_ranks(dp_cp)
        finally:
            hm.destroy_model_parallel()


def test_grids_expose_the_layouts() -> None:
    with fake_world(9, 16):
        try:
            hm.initialize_model_parallel(**KWARGS)
            grids = hm.active_grids()
            assert grids.grid.dim_names == ["tp", "cp", "dp", "pp"]
            assert grids.grid.coords() == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
            assert grids.grid.views["expert"].dim_names == ("tp", "ep", "dp", "pp")
            assert grids.ranks("ep") == [9, 11]
            assert grids.grid.get_pg("ep", view="expert") is ps.get_expert_model_parallel_group()
            assert grids.grid.get_pg("pp", view="expert") is ps.get_pipeline_model_parallel_group()
            pgs = hm.process_group_collection(grids, ["tp", "pp"])
            # Only the fields asked for are set (megatron-core 0.19's class answers None for the rest).
            assert pgs.tp is ps.get_tensor_model_parallel_group() and "dp" not in vars(pgs)
        finally:
            hm.destroy_model_parallel()
        with pytest.raises(Exception, match="destroyed"):
            grids.group("tp")
