"""A recovery attempt's state: what one rank builds over the new placement, and what it lets go.

Broken communicators are evicted first, so that building through the registry reuses only
unchanged groups that still work. The state from before is held until the round commits.

>>> let_go(None, keep=None)     # nothing held: nothing to let go
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Set as AbstractSet
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ..errors import RecoveryError, RecoveryRefused
from ..grid import HyperCommGrid
from ..layout import GridLayout
from ..layout.describe import describe_ranks
from ..layout.replan import RecoveryKind, RecoveryPlan
from ..liveness.ring import from_runs
from ..runtime.modes import job_setup
from ..runtime.registry import REGISTRY
from ..runtime.scope import RecoveryScope, watching
from ..runtime.torch_compat import TorchCommsSubgroups, Unsplit, unsplit_mechanism
from ..runtime.world_step import world_checkpoint, world_start
from ..store.records import FailureVerdict
from .abort import abort_group, can_abort
from .health import broken_groups
from .recipes import GridRecipe, MegatronRecipe, Recipe

#: The label of a recovery's rebuild, a world step named by its round: its outcome is the round's end.
REBUILD_LABEL = "recover"

__all__ = ["REBUILD_LABEL", "build", "restore", "let_go", "evict_broken", "rebuild_grid", "reset_megatron_if", "left",
           "recovery_strategy", "world_grid", "job_grid"]


def build(job: Any, plan: RecoveryPlan, verdict: FailureVerdict, deadline: float, *, attempt: Optional[str],
          scope: Optional[RecoveryScope]) -> Any:
    """This rank's state over ``plan.new``, built with the other ranks of the new placement.
    ``attempt``: the round's keys, naming the probe and the world step (None: no round); ``scope``:
    the board whose losses end the rebuild's waits. Raises RecoveryRefused where no group can be made
    among its members only (:func:`recovery_strategy`) or Megatron-Core's sizes do not fit."""
    strategy = recovery_strategy(job.recipe.strategy)
    members = sorted(plan.new.ranks)
    with watching(scope, deadline if scope is not None else None):
        if dist.get_rank() in members:
            evict_broken(members, frozenset(from_runs(verdict.aborted_by)), left(deadline), attempt,
                         job.settings.probe_s)
        if isinstance(job.recipe, MegatronRecipe):
            from ..megatron.recovery import rebuild_megatron  # megatron-core is needed only here

            recipe = job.recipe
            return rebuild_megatron(recipe.config, plan, members, dist.get_rank(), share_groups=recipe.share_groups,
                                    strategy=strategy, check_agreement=recipe.check_agreement,
                                    step_timeout=left(deadline), attempt=attempt, label=REBUILD_LABEL)
        return rebuild_grid(dataclasses.replace(job.recipe, strategy=strategy), plan, members, dist.get_rank(),
                            left(deadline), attempt=attempt)


def recovery_strategy(strategy: str) -> str:
    """The strategy a recovery makes groups with: ``fresh`` where new groups are split from the
    world's communicator (a split would need the lost ranks), else the job's own. Raises
    RecoveryRefused where the world splits and this torch cannot make a group among its members only.

    >>> recovery_strategy("auto")          # no process group: nothing splits
    'auto'
    """
    setup = job_setup()
    if not setup.splits:
        return strategy
    why = None
    if setup.torchcomms is TorchCommsSubgroups.WORLD_SPLIT:
        why = "TorchComms (TORCH_DISTRIBUTED_USE_TORCHCOMMS) makes every new_group a split of the world's"
    elif unsplit_mechanism(None, setup.split_backend) is Unsplit.NONE:
        why = "this torch reads no lazy_init option and its ProcessGroup.bound_device_id cannot be set"
    if why is not None:
        raise RecoveryRefused(
            f"cannot rebuild groups in-process here: the default group is bound to a device and every new "
            f"communicator is split from the world's, which the lost ranks would have to join, and {why}; "
            f"start the default group without device_id (or unset TORCH_DISTRIBUTED_USE_TORCHCOMMS)"
        )
    return "fresh"


def world_grid(layout: GridLayout) -> HyperCommGrid:
    """A grid of one dim, ``world``, over ``layout``'s ranks in order, whose one group (made among
    its members only) stands in for the default group (:attr:`ResilientJob.world`).

    >>> world_grid(GridLayout((2, 2), ("tp", "dp"), rank_offset=4)).ranks("world", rank=5)
    [4, 5, 6, 7]
    """
    return job_grid(dataclasses.replace(layout, shape=(layout.size,), dim_names=("world",)))


def job_grid(layout: GridLayout) -> HyperCommGrid:
    """A grid over ``layout``'s ranks and dims for the job's own groups beside the user's (made among
    their members only, ``strategy="fresh"``).

    >>> job_grid(GridLayout((2, 2), ("tp", "dp"))).ranks("dp", rank=1)
    [1, 3]
    """
    world = dist.get_world_size() if dist.is_initialized() else layout.rank_offset + layout.size
    return HyperCommGrid(list(layout.shape), list(layout.dim_names), rank_offset=layout.rank_offset,
                         rank_map=layout.rank_map, world_size=world, strategy="fresh")


def restore(job: Any) -> None:
    """After an attempt that did not commit: ``job``'s state from before is current again."""
    if isinstance(job.recipe, MegatronRecipe):
        from ..megatron.recovery import activate_megatron

        activate_megatron(job.state)


def let_go(state: Any, *, keep: Any) -> None:
    """Let go of ``state`` (groups that ``keep`` holds too stay)."""
    if state is None or state is keep:
        return
    if isinstance(state, HyperCommGrid):
        state.destroy()
    else:
        state.release()


def evict_broken(members: list[int], aborted_by: AbstractSet[int], timeout: timedelta, attempt: Optional[str],
                 probe_s: float = 10.0) -> None:
    """Stop sharing the groups of living members that the failure broke or a member aborted."""
    alive = set(members)
    candidates = [pg for pg in REGISTRY.groups() if set(dist.get_process_group_ranks(pg)) <= alive]
    aborted = [tuple(dist.get_process_group_ranks(pg)) for pg in candidates
               if can_abort(pg) and not aborted_by.isdisjoint(dist.get_process_group_ranks(pg))]
    broken = broken_groups(candidates, participants=members, timeout=timeout, attempt=attempt, known=aborted,
                           probe_s=probe_s)
    for pg in candidates:
        if tuple(dist.get_process_group_ranks(pg)) in broken:
            abort_group(pg)  # where it can be: a probe left in flight would hold the communicator's stream
            REGISTRY.evict(pg)


def rebuild_grid(recipe: Recipe, plan: RecoveryPlan, members: list[int], rank: int, timeout: timedelta,
                 attempt: Optional[str] = None) -> Any:
    """This rank's grid of ``recipe`` on ``plan.new``, made by ``members`` in one world step."""
    assert isinstance(recipe, GridRecipe)
    if plan.kind is RecoveryKind.SHRINK and recipe.views:
        raise RecoveryRefused(
            f"a grid with views {[v[0] for v in recipe.views]} cannot shrink its replicas: how each view's "
            f"dims shrink is not known here (a Megatron job re-plans its expert layout); give spares"
        )
    new = HyperCommGrid(list(plan.new.shape), list(plan.new.dim_names), backend=recipe.backend,
                        rank_offset=plan.new.rank_offset, world_size=dist.get_world_size(), strategy=recipe.strategy,
                        timeout=recipe.timeout, check_agreement=recipe.check_agreement, rank_map=plan.new.rank_map)
    for name, shape, dims, shared in recipe.views:
        new.register_view(name, list(shape), list(dims), list(shared) or None)
    step = world_start(REBUILD_LABEL, timeout=timeout, ranks=members, attempt=attempt) if rank in members else None
    try:
        for made in recipe.made:
            new.create_pg(list(made.dims), view=made.view, private=made.private, backend=made.options.backend,
                          timeout=made.options.timeout, pg_options=made.options.pg_options,
                          group_desc=made.options.group_desc)
    except Exception as exc:
        new.destroy()
        world_checkpoint(step, exc, timeout=timeout)
        raise RecoveryError(f"hypergrid: rank {rank}: rebuilding the grid on ranks {describe_ranks(members)} "
                            f"failed: {type(exc).__name__}: {exc}") from exc
    try:
        world_checkpoint(step, None, timeout=timeout)
    except Exception as exc:
        new.destroy()
        raise RecoveryError(f"hypergrid: rank {rank}: the recovery did not finish on every rank of "
                            f"{describe_ranks(members)}: {exc}") from exc
    return new


def reset_megatron_if(recipe: Recipe) -> None:
    """A rank leaving a Megatron job's grid answers for no placement while the others build one."""
    if isinstance(recipe, MegatronRecipe):
        from ..megatron.initialize import reset_parallel_state

        reset_parallel_state()


def left(deadline: float) -> timedelta:
    """What is left of ``deadline`` (a monotonic time), at least a second.

    >>> left(time.monotonic() - 5)
    datetime.timedelta(seconds=1)
    """
    return timedelta(seconds=max(1.0, deadline - time.monotonic()))
