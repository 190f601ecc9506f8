"""A job that survives the loss of ranks in-process: re-placed, with only the changed groups rebuilt.

A :class:`ResilientJob` holds what every rank of a job (its grid's ranks and its spares) knows
alike: the current placement of the grid, the spares, and how to build the job's groups (a
Megatron-Core configuration, or a grid's ``create_pg`` calls). After a failure every surviving
rank calls :meth:`ResilientJob.recover` (spares wait in :meth:`ResilientJob.wait_as_spare`):

1. the survivors agree on one set of failed ranks through the store
   (:func:`~hypergrid.runtime.failures.agree_on_failures`);
2. each computes the same new placement (:func:`~hypergrid.layout.replan.plan_recovery`): spares
   take the failed ranks' positions, or the replicas holding them are dropped;
3. the ranks of the new placement build its groups through the registry, where every group whose
   members (in order) and options are unchanged is the existing communicator, and only changed
   groups are made, among their members; they meet at a checkpoint;
4. the old state lets go: the groups only it held (those with a failed rank) are destroyed, with
   no wait on a dead rank; ``parallel_state`` (for a Megatron job) answers for the new placement.

Example, as rank 0 of a 10-rank job on torch's fake backend (one simulated rank, so the failed
set is given instead of agreed): tp 2 x dp 2 x pp 2 on ranks 0-7, spares 8 and 9, rank 5 lost::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from hypergrid import HyperCommGrid
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=10)
    >>> grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    >>> tp, dp = grid.create_pg("tp"), grid.create_pg("dp")
    >>> job = ResilientJob.of_grid(grid, spares=[8, 9])
    >>> after = job.recover(failed=[5], gpus_per_node=2)
    >>> after.last.describe(), after.state.get_pg("tp") is tp, after.state.ranks("dp")
    ('replace: rank 5 -> 8; 1 spares left', True, [0, 2])
    >>> after.state.destroy(); dist.destroy_process_group()
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import torch.distributed as dist

from ..errors import RecoveryError, RecoveryRefused
from ..grid import HyperCommGrid, MadeGroup
from ..layout import GridLayout
from ..layout.describe import describe_ranks
from ..layout.replan import RecoveryKind, RecoveryPlan, plan_recovery
from ..runtime.failures import agree_on_failures, release_spares, wait_for_recovery
from ..runtime.health import broken_groups
from ..runtime.modes import job_setup
from ..runtime.registry import REGISTRY
from ..runtime.store import agreement_possible
from ..runtime.world_step import world_checkpoint, world_start

__all__ = ["ResilientJob", "GridRecipe", "MegatronRecipe"]

logger = logging.getLogger(__name__)

#: How long, by default, survivors wait for each other to agree and rebuild.
DEFAULT_TIMEOUT = timedelta(minutes=5)



@dataclass(frozen=True)
class GridRecipe:
    """How a grid job's groups are built: the grid's settings, views and ``create_pg`` calls."""

    dim_names: tuple[str, ...]
    backend: Optional[str]
    strategy: str
    timeout: Optional[timedelta]
    check_agreement: bool
    views: tuple[tuple[str, tuple[int, ...], tuple[str, ...], tuple[str, ...]], ...]
    made: tuple[MadeGroup, ...]

    @classmethod
    def of(cls, grid: HyperCommGrid) -> "GridRecipe":
        views = tuple((name, layout.shape, layout.dim_names, tuple(grid._views[name].shared))
                      for name, layout in grid.views.items())
        return cls(tuple(grid.dim_names), grid.backend, grid.strategy, grid.default_timeout,
                   grid.check_agreement, views, tuple(grid.made_groups()))


@dataclass(frozen=True)
class MegatronRecipe:
    """How a Megatron job's groups are built: its configuration (``world_size`` is the number of
    grid positions) and ``initialize_model_parallel``'s own choices."""

    config: Any  # hypergrid.megatron.spec.config.MegatronConfig (megatron-core imported on use)
    share_groups: bool
    strategy: str
    check_agreement: bool


Recipe = Union[GridRecipe, MegatronRecipe]


@dataclass(frozen=True)
class ResilientJob:
    """What every rank of a job knows alike: where the grid's positions are (``layout``), which
    ranks wait as ``spares``, how to build the groups (``recipe``), this rank's built ``state``
    (a :class:`~hypergrid.grid.HyperCommGrid` or :class:`~hypergrid.megatron.MegatronGrids`; None
    on a rank outside the grid), and the recoveries so far.

    Example::

        >>> job = ResilientJob(GridLayout((2, 2), ("tp", "dp")), (4,), GridRecipe(("tp", "dp"), None, "auto",
        ...                    None, True, (), ()), None)
        >>> job.domain
        (0, 1, 2, 3, 4)
    """

    layout: GridLayout
    spares: tuple[int, ...]
    recipe: Recipe
    state: Any
    recoveries: tuple[RecoveryPlan, ...] = ()
    #: The job's ranks (grid and spares) before any recovery: what names it to its spares.
    origin: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.origin:
            object.__setattr__(self, "origin", self.domain)

    # ------------------------------------------------------------------ making one
    @classmethod
    def of_grid(cls, grid: HyperCommGrid, *, spares: Sequence[int] = ()) -> "ResilientJob":
        """A job whose groups are ``grid``'s ``create_pg`` calls (made before or after this call;
        a recovery repeats those made by then, in order). Every rank, spares included, builds the
        same grid and makes the same calls (a rank outside the grid gets None from each).

        Example::

            >>> grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=6)
            >>> ResilientJob.of_grid(grid, spares=[4, 5]).domain
            (0, 1, 2, 3, 4, 5)
        """
        spare_ranks = tuple(sorted(set(spares)))
        inside = [s for s in spare_ranks if grid.layout.contains(s)]
        if inside:
            raise ValueError(f"spares must be ranks outside the grid, got {list(inside)} which the grid spans")
        return cls(grid.layout, spare_ranks, GridRecipe.of(grid), grid)

    @classmethod
    def of_megatron(
        cls,
        *,
        spares: Sequence[int] = (),
        ranks: Optional[Sequence[int]] = None,
        share_groups: bool = True,
        strategy: Optional[str] = None,
        check_agreement: bool = True,
        **megatron_kwargs: Any,
    ) -> "ResilientJob":
        """Initialize Megatron-Core's ``parallel_state`` on every rank but ``spares``, as
        :func:`hypergrid.megatron.initialize_model_parallel` would on a world of those ranks, and
        return the job. Call it on every rank; on a spare it builds nothing (state None) and the
        spare goes on to :meth:`wait_as_spare`. ``ranks`` places the grid's positions on those
        ranks, in order (the placement of an earlier recovery, to start again from a checkpoint);
        by default every rank but the spares, ascending.

        Example, as rank 3 of a 10-rank job on torch's fake backend (ranks 8 and 9 are spares)::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> from megatron.core import parallel_state
            >>> from hypergrid.megatron import destroy_model_parallel
            >>> dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=10)
            >>> job = ResilientJob.of_megatron(spares=[8, 9], tensor_model_parallel_size=2,
            ...                                pipeline_model_parallel_size=2, create_gloo_process_groups=False)
            >>> parallel_state.get_data_parallel_world_size(), job.state.ranks("dp"), job.domain[-2:]
            (2, [1, 3], (8, 9))
            >>> destroy_model_parallel(); dist.destroy_process_group()
        """
        from ..megatron.recovery import initialize_placed  # megatron-core is needed only here

        spare_ranks = tuple(sorted(set(int(s) for s in spares)))
        config, layout, state, resolved = initialize_placed(
            spare_ranks, ranks=ranks, share_groups=share_groups, strategy=strategy, check_agreement=check_agreement,
            megatron_kwargs=megatron_kwargs,
        )
        recipe = MegatronRecipe(config, share_groups, resolved, check_agreement)
        return cls(layout, spare_ranks, recipe, state)

    # ------------------------------------------------------------------ facts
    @property
    def domain(self) -> tuple[int, ...]:
        """Every rank the job counts on: the grid's and the spares, ascending."""
        return tuple(sorted(set(self.layout.ranks) | set(self.spares)))

    @property
    def in_grid(self) -> bool:
        """Whether this rank holds a position of the grid."""
        return self.layout.contains(dist.get_rank())

    @property
    def last(self) -> Optional[RecoveryPlan]:
        """The latest recovery (None: none yet)."""
        return self.recoveries[-1] if self.recoveries else None

    def state_source(self, rank: Optional[int] = None, replica_dim: str = "dp") -> Optional[int]:
        """Where ``rank`` (default: this rank) copies its replica's state from after the latest
        recovery: the first rank of its ``replica_dim`` group that did not just arrive (a surviving
        data-parallel peer holding the same shard); None where ``rank`` did not just arrive, or no
        peer survived (then the state must come from a checkpoint).

        Example, as rank 8 (a spare) of a 10-rank job on torch's fake backend: it takes rank 5's
        place, and copies its shard from rank 7, its data-parallel peer::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=8, world_size=10)
            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"]), spares=[8, 9])
            >>> after = job.recover(failed=[5], gpus_per_node=2)
            >>> after.in_grid, after.state_source(), after.state.ranks("dp")
            (True, 7, [8, 7])
            >>> after.state.destroy(); dist.destroy_process_group()
        """
        rank = dist.get_rank() if rank is None else rank
        if self.last is None:
            return None
        arrived = {new for _, new in self.last.replaced}
        if rank not in arrived:
            return None
        group = self.layout.group_ranks([replica_dim], rank) if replica_dim in self.layout.dim_names else [rank]
        return next((r for r in group if r not in arrived), None)

    # ------------------------------------------------------------------ recovering
    def recover(
        self,
        *,
        failed: Optional[Sequence[int]] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        gpus_per_node: int = 8,
        replica_dim: str = "dp",
    ) -> "ResilientJob":
        """The job after the failure that just happened, on every surviving rank (spares too).

        ``failed``: the failed ranks where they are known alike on every rank (a test, one rank
        of a simulated world); by default the survivors agree on them through the store, from
        who arrives and whose heartbeat stopped (:func:`hypergrid.start_heartbeat`). Returns the
        new job: on the ranks of the new placement its state is built (``parallel_state`` filled
        for a Megatron job); elsewhere (a dropped replica, an unused spare) it is None.

        Raises:
            RecoveryRefused: no placement fits (too few spares, no replica to drop); on every survivor.
            ExcludedByRecovery: this rank was found failed (it came too late).
            RecoveryError: the survivors did not finish together (another rank failed during the
                recovery, or the store stopped answering); on every survivor, within ``timeout``.
        """
        deadline = _Deadline(time.monotonic() + timeout.total_seconds())
        if failed is None:
            lost = agree_on_failures(self.domain, timeout=timeout).failed
        else:
            lost = tuple(sorted({int(r) for r in failed}))
        gone = [r for r in lost if self.layout.contains(r)]
        spares = tuple(s for s in self.spares if s not in lost)
        if not gone:  # nobody of the grid is lost (a spare, or nobody): nothing to rebuild
            return dataclasses.replace(self, spares=spares)
        plan = plan_recovery(self.layout, gone, spares, replica_dim=replica_dim, gpus_per_node=gpus_per_node)
        logger.info("rank %d: %s", dist.get_rank(), plan.describe())
        state = _rebuild(self, plan, deadline)
        left = tuple(sorted(set(plan.spares_left) | set(plan.dropped)))
        return ResilientJob(plan.new, left, self.recipe, state, self.recoveries + (plan,), self.origin)

    def wait_as_spare(self, *, timeout: timedelta = DEFAULT_TIMEOUT, recovery_timeout: timedelta = DEFAULT_TIMEOUT,
                      gpus_per_node: int = 8, replica_dim: str = "dp") -> "ResilientJob":
        """On a spare: wait until a recovery needs this rank, take part in it, and return the job
        once this rank holds a position (or unchanged, still outside, after ``timeout`` with no
        recovery). Recoveries that use other spares are taken part in too, and waited on after.

        Example, with no process group (nobody to recover with)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
            >>> job.wait_as_spare(timeout=timedelta(seconds=0.1)) is job
            True
        """
        job = self
        if not agreement_possible():
            return job  # nobody to recover with: a simulated rank, or no process group
        while not job.in_grid:
            if not wait_for_recovery(job.domain, timeout=timeout, origin=job.origin):
                return job
            job = job.recover(timeout=recovery_timeout, gpus_per_node=gpus_per_node, replica_dim=replica_dim)
        return job

    def release_spares(self) -> None:
        """On any rank of the job once training is over (or given up): the spares waiting in
        :meth:`wait_as_spare` return, still outside the grid, within half a second instead of at
        their timeout.

        Example, with no process group (nobody waits)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
            >>> job.release_spares()
        """
        release_spares(self.origin)


@dataclass(frozen=True)
class _Deadline:
    """The one deadline of a recovery: each phase gets what is left of it, not a timeout of its own."""

    at: float

    def left(self) -> timedelta:
        return timedelta(seconds=max(1.0, self.at - time.monotonic()))


def _rebuild(job: ResilientJob, plan: RecoveryPlan, deadline: _Deadline) -> Any:
    """This rank's state over ``plan.new``, built with the other ranks of the new placement."""
    rank = dist.get_rank()
    members = sorted(plan.new.ranks)
    if job_setup().splits:
        raise RecoveryRefused(
            "cannot rebuild groups in-process on a default group bound to a device whose backend splits "
            "(NCCL with device_id): every new communicator is split from the world's, which the lost ranks "
            "would have to join; start the default group without device_id to recover in-process"
        )
    if rank in members:
        _evict_broken(members, deadline.left())
    if isinstance(job.recipe, MegatronRecipe):
        from ..megatron.recovery import rebuild_megatron  # megatron-core is needed only here

        recipe = job.recipe
        return rebuild_megatron(recipe.config, job.state, plan, members, rank, share_groups=recipe.share_groups,
                                strategy=recipe.strategy, check_agreement=recipe.check_agreement,
                                step_timeout=deadline.left())
    return _rebuild_grid(job, plan, members, rank, deadline.left())


def _evict_broken(members: list[int], timeout: timedelta) -> None:
    """Stop sharing the groups of living members that the failure broke, so they are made anew."""
    alive = set(members)
    candidates = [pg for pg in REGISTRY.groups() if set(dist.get_process_group_ranks(pg)) <= alive]
    broken = broken_groups(candidates, participants=members, timeout=timeout)
    for pg in candidates:
        if tuple(dist.get_process_group_ranks(pg)) in broken:
            REGISTRY.evict(pg)


def _rebuild_grid(job: ResilientJob, plan: RecoveryPlan, members: list[int], rank: int, timeout: timedelta) -> Any:
    recipe = job.recipe
    assert isinstance(recipe, GridRecipe)
    if plan.kind is RecoveryKind.SHRINK and recipe.views:
        raise RecoveryRefused(
            f"a grid with views {[v[0] for v in recipe.views]} cannot shrink its replicas: how each view's "
            f"dims shrink is not known here (a Megatron job re-plans its expert layout); give spares"
        )
    new = HyperCommGrid(list(plan.new.shape), list(plan.new.dim_names), backend=recipe.backend,
                        world_size=dist.get_world_size(), strategy=recipe.strategy, timeout=recipe.timeout,
                        check_agreement=recipe.check_agreement, rank_map=plan.new.rank_map)
    for name, shape, dims, shared in recipe.views:
        new.register_view(name, list(shape), list(dims), list(shared) or None)
    inside = rank in members
    step_timeout = timeout
    step = world_start("recover", timeout=step_timeout, ranks=members) if inside else None
    try:
        for made in recipe.made:
            # The same calls in the same order: an unchanged group is the registry's existing one.
            new.create_pg(list(made.dims), view=made.view, private=made.private, backend=made.options.backend,
                          timeout=made.options.timeout, pg_options=made.options.pg_options,
                          group_desc=made.options.group_desc)
    except Exception as exc:
        new.destroy()
        world_checkpoint(step, exc, timeout=step_timeout)
        raise RecoveryError(f"hypergrid: rank {rank}: rebuilding the grid on ranks {describe_ranks(members)} "
                            f"failed: {type(exc).__name__}: {exc}") from exc
    try:
        world_checkpoint(step, None, timeout=step_timeout)
    except Exception as exc:
        new.destroy()
        raise RecoveryError(f"hypergrid: rank {rank}: the recovery did not finish on every rank of "
                            f"{describe_ranks(members)}: {exc}") from exc
    if isinstance(job.state, HyperCommGrid):
        job.state.destroy()  # only the groups nobody holds any more (those with a failed rank) go
    return new
