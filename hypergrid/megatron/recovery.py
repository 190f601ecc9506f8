"""Megatron-Core's ``parallel_state`` over a placement of ranks: with spares, and after a recovery.

A rebuild keeps every communicator whose members and options did not change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..errors import RecoveryRefused
from ..layout import GridLayout
from ..layout.rank_map import RankMap
from ..layout.replan import RecoveryPlan
from ..runtime.modes import resolve_strategy
from .build import _fill_parallel_state, build_state
from .initialize import _check_not_initialized, installed_features, reset_parallel_state
from .spec.config import MegatronConfig, ParallelConfigError
from .spec.plan import MegatronPlan
from .state import MegatronGrids, set_active

__all__ = ["initialize_placed", "rebuild_megatron", "activate_megatron"]


def initialize_placed(spares: Sequence[int], *, ranks: Optional[Sequence[int]] = None, share_groups: bool,
                      strategy: Optional[str], check_agreement: bool, megatron_kwargs: dict[str, Any],
                      ) -> tuple[MegatronConfig, GridLayout, Optional[MegatronGrids], str]:
    """``initialize_model_parallel(**megatron_kwargs)`` on the world's ranks but ``spares``, or on
    ``ranks`` (the grid's positions' ranks, in order). Returns the configuration (``world_size``: the
    grid's ranks), the dense layout over its placement, this rank's state (None on a spare) and the
    strategy resolved. Example, as rank 1 of a 6-rank job on torch's fake backend, ranks 4 and 5 spares::

        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=6)
        >>> config, layout, grids, _ = initialize_placed([4, 5], share_groups=True, strategy=None,
        ...     check_agreement=True, megatron_kwargs=dict(tensor_model_parallel_size=2,
        ...                                                create_gloo_process_groups=False))
        >>> config.world_size, list(layout.ranks), ps.get_tensor_model_parallel_rank()
        (4, [0, 1, 2, 3], 1)
        >>> from hypergrid.megatron import destroy_model_parallel
        >>> destroy_model_parallel(); dist.destroy_process_group()
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize_placed needs torch.distributed: call init_process_group() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    outside = [s for s in [*spares, *(ranks or ())] if not 0 <= s < world]
    if outside:
        raise ValueError(f"spares and ranks must be ranks of the world [0, {world}), got {list(outside)}")
    members = [r for r in range(world) if r not in set(spares)] if ranks is None else list(ranks)
    if set(members) & set(spares):
        raise ValueError(f"a rank cannot be both a spare and in the grid: {sorted(set(members) & set(spares))}")
    config = MegatronConfig.from_megatron_kwargs(len(members), dict(megatron_kwargs), installed_features())
    _check_not_initialized()
    placement = RankMap.of(members)
    plan = MegatronPlan(config, None if placement.is_contiguous and placement.first_rank == 0 else placement)
    resolved = resolve_strategy(strategy).value
    grids = None
    if rank in members:
        grids = _made_current(build_state(plan, rank=rank, share_groups=share_groups, strategy=resolved,
                                          check_agreement=check_agreement, timeout=_timeout(config),
                                          participants=None if len(members) == world else members))
    return config, plan.dense, grids, resolved


def rebuild_megatron(config: MegatronConfig, recovery: RecoveryPlan, members: Sequence[int], rank: int, *,
                     share_groups: bool, strategy: str, check_agreement: bool, step_timeout: Optional[timedelta] = None,
                     attempt: Optional[str] = None, label: str = "recover") -> Optional[MegatronGrids]:
    """``parallel_state`` for ``recovery.new``, built by its ``members``; None on other ranks.

    The caller holds the old state meanwhile, so unchanged groups are found in the registry, and
    lets it go on commit or makes it current again (:func:`activate_megatron`). ``step_timeout``: the
    members' wait for each other (default: the configuration's); ``attempt``: the round's keys, naming
    the world step ``label``. Raises RecoveryRefused where Megatron-Core's sizes do not fit the ranks.
    """
    try:
        new_config = dataclasses.replace(config, world_size=recovery.new.size, rank_offset=0, local_world_size=None)
    except ParallelConfigError as exc:
        raise RecoveryRefused(
            f"cannot recover to {recovery.new.size} ranks ({recovery.describe()}): Megatron-Core's sizes do not "
            f"fit them: {exc}"
        ) from None
    new = recovery.new
    # A contiguous placement from rank_offset needs an explicit map, or the plan would put it on ranks 0..
    plan = MegatronPlan(new_config, new.rank_map or RankMap.contiguous(new.rank_offset, new.size)
                        if new.rank_offset else new.rank_map)
    reset_parallel_state()
    if rank not in members:
        return None
    return _made_current(build_state(plan, rank=rank, share_groups=share_groups, strategy=strategy,
                                     check_agreement=check_agreement, timeout=_timeout(new_config),
                                     participants=members, label=label, step_timeout=step_timeout, attempt=attempt))


def activate_megatron(grids: Optional[MegatronGrids]) -> None:
    """Make ``grids`` (still held) what ``parallel_state`` answers for again, or leave it empty for
    None: an attempt that did not commit goes back to the state it had.

    Example, as rank 1 of a 4-rank job on torch's fake backend::

        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        >>> _, _, grids, _ = initialize_placed([], share_groups=True, strategy=None, check_agreement=True,
        ...     megatron_kwargs=dict(tensor_model_parallel_size=2, create_gloo_process_groups=False))
        >>> _ = reset_parallel_state(); ps.model_parallel_is_initialized()
        False
        >>> activate_megatron(grids); ps.get_tensor_model_parallel_rank()
        1
        >>> from hypergrid.megatron import destroy_model_parallel
        >>> destroy_model_parallel(); dist.destroy_process_group()
    """
    reset_parallel_state()
    if grids is None:
        return
    grids.check_alive()
    _fill_parallel_state(grids)
    _made_current(grids)


def _made_current(grids: MegatronGrids) -> MegatronGrids:
    """``grids``, now what ``parallel_state`` answers for (with a global memory buffer of its own)."""
    ps._set_global_memory_buffer()
    set_active(grids)
    return grids


def _timeout(config: MegatronConfig) -> timedelta:
    return timedelta(minutes=config.distributed_timeout_minutes)
