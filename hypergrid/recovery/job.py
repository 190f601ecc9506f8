"""A job that survives the loss of ranks in-process: re-placed, with only the changed groups rebuilt.

A :class:`ResilientJob` holds what every rank of a job (its grid's ranks and its spares) knows
alike: the current placement of the grid, the spares, how to build the job's groups (a
Megatron-Core configuration, or a grid's ``create_pg`` calls) and the job's channel in the store.
After a failure every surviving rank calls :meth:`ResilientJob.recover` (spares wait in
:meth:`ResilientJob.wait_as_spare`), and the recovery runs in *rounds*
(:mod:`hypergrid.runtime.failures`) until one commits:

1. every rank of the job arrives, or is found failed: its heartbeat stopped, or it ran but the
   rank did not arrive within the job's longest collective timeout and a margin (it hangs);
2. each participant computes the same new placement (:func:`~hypergrid.layout.replan.plan_recovery`):
   spares take the failed ranks' positions, or the replicas holding them are dropped; a round
   in which nobody failed keeps the placement (a repair), and one started by :meth:`grow` adds
   replicas of spares back (:func:`~hypergrid.layout.replan.plan_growth`);
3. the ranks of the new placement probe the communicators that outlived the failure, then build
   the placement's groups through the registry, where every group whose members (in order) and
   options are unchanged and that still works is the existing communicator; they meet at a
   checkpoint, and the round's end is recorded once for every participant;
4. committed: the old state lets go (only the groups nobody holds any more are destroyed) and
   ``parallel_state`` (a Megatron job) answers for the new placement. Not committed (a rank died
   while the groups were made, say): the state from before stays current, and the next round
   starts with the larger failed set, until the deadline.

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

from ..errors import ExcludedByRecovery, RecoveryError, RecoveryRefused
from ..grid import HyperCommGrid, MadeGroup
from ..layout import GridLayout
from ..layout.checks import as_int, check_timeout
from ..layout.describe import describe_ranks, one_line
from ..layout.rank_map import RankMap
from ..layout.replan import RecoveryKind, RecoveryPlan, plan_growth, plan_recovery
from ..runtime.failures import JobChannel, RecoveryRound, offer, open_channel, release_spares, wait_for_round
from ..runtime.health import broken_groups
from ..runtime.interrupt import CollectiveWatch, abort_group, can_abort, recovering, take_aborted
from ..runtime.liveness import running_heartbeat, stale_after_default, start_heartbeat, watching_members
from ..runtime.modes import job_setup
from ..runtime.options import GroupOptions, effective_timeout
from ..runtime.registry import REGISTRY
from ..runtime.store import StoreClient, agreement_possible
from ..runtime.torch_compat import default_group_timeout
from ..runtime.wire import Arrival, FailureVerdict, JobRecord, RoundEnd
from ..runtime.world_step import world_checkpoint, world_start

__all__ = ["ResilientJob", "GridRecipe", "MegatronRecipe", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

#: How long, by default, survivors wait for each other to agree and rebuild.
DEFAULT_TIMEOUT = timedelta(minutes=5)
#: Beyond the job's longest collective timeout, how long a rank whose heartbeat runs may take to
#: reach a round (it leaves its collective at that timeout, then calls the recovery).
ARRIVAL_MARGIN_S = 5.0
#: The heartbeat interval a job starts with where none runs yet.
DEFAULT_HEARTBEAT_S = 1.0
#: A heartbeat quiet for this many intervals (not yet stale) is waited for to settle before a verdict.
SETTLE_BEATS = 2


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

    def longest_timeout(self) -> Optional[timedelta]:
        """The longest collective timeout among the groups it makes (None: no group)."""
        timeouts = [effective_timeout(made.options) for made in self.made]
        return max(timeouts) if timeouts else None


@dataclass(frozen=True)
class MegatronRecipe:
    """How a Megatron job's groups are built: its configuration (``world_size`` is the number of
    grid positions) and ``initialize_model_parallel``'s own choices."""

    config: Any  # hypergrid.megatron.spec.config.MegatronConfig (megatron-core imported on use)
    share_groups: bool
    strategy: str
    check_agreement: bool

    def longest_timeout(self) -> Optional[timedelta]:
        return timedelta(minutes=self.config.distributed_timeout_minutes)


Recipe = Union[GridRecipe, MegatronRecipe]


@dataclass(frozen=True)
class ResilientJob:
    """What every rank of a job knows alike: where the grid's positions are (``layout``), which
    ranks wait as ``spares``, how to build the groups (``recipe``), this rank's built ``state``
    (a :class:`~hypergrid.grid.HyperCommGrid` or :class:`~hypergrid.megatron.MegatronGrids`; None
    on a rank outside the grid), the recoveries so far, and where its rounds live (``channel``).

    ``step``: the training step every rank resumes from after the latest recovery (the least a
    survivor passed to :meth:`recover`; None where none said). ``timeout``: the default of
    :meth:`recover`'s. ``collective_timeout``: the longest timeout of the job's collectives, which
    bounds how long a recovery waits for a rank whose heartbeat runs.

    Example::

        >>> job = ResilientJob(GridLayout((2, 2), ("tp", "dp")), (4,), GridRecipe(("tp", "dp"), None, "auto",
        ...                    None, True, (), ()), None)
        >>> job.domain, job.made_shape
        ((0, 1, 2, 3, 4), (2, 2))
    """

    layout: GridLayout
    spares: tuple[int, ...]
    recipe: Recipe
    state: Any
    recoveries: tuple[RecoveryPlan, ...] = ()
    #: The job's ranks (grid and spares) when it was made: what names it in the store.
    origin: tuple[int, ...] = ()
    channel: Optional[JobChannel] = None
    generation: int = 0
    step: Optional[int] = None
    timeout: timedelta = DEFAULT_TIMEOUT
    collective_timeout: Optional[timedelta] = None
    #: The number of replicas along each dim when the job was made (what :meth:`grow` returns to).
    made_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.origin:
            object.__setattr__(self, "origin", self.domain)
        if not self.made_shape:
            object.__setattr__(self, "made_shape", tuple(self.layout.shape))

    # ------------------------------------------------------------------ making one
    @classmethod
    def of_grid(cls, grid: HyperCommGrid, *, spares: Sequence[int] = (),
                timeout: timedelta = DEFAULT_TIMEOUT) -> "ResilientJob":
        """A job whose groups are ``grid``'s ``create_pg`` calls (those made before this call; a
        recovery repeats them, in order). Call it on every rank of the job, spares included,
        with the same grid and calls (a rank outside the grid gets None from each); the ranks
        meet in the store once, to name the job, and each starts its heartbeat if none runs.
        ``timeout``: how long :meth:`recover` takes by default.

        Example::

            >>> grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=6)
            >>> ResilientJob.of_grid(grid, spares=[4, 5]).domain
            (0, 1, 2, 3, 4, 5)
        """
        if not isinstance(grid, HyperCommGrid):
            raise TypeError(f"grid must be a HyperCommGrid, got {type(grid).__name__} {grid!r}")
        timeout = _checked_timeout("timeout", timeout)
        spare_ranks = _ranks_arg("spares", spares, grid.world_size)
        inside = [s for s in spare_ranks if grid.layout.contains(s)]
        if inside:
            raise ValueError(f"spares must be ranks outside the grid, got {list(inside)} which the grid spans")
        recipe = GridRecipe.of(grid)
        job = cls(grid.layout, spare_ranks, recipe, grid, timeout=timeout,
                  collective_timeout=_longest(recipe.longest_timeout()))
        return job._started()

    @classmethod
    def of_megatron(
        cls,
        *,
        spares: Sequence[int] = (),
        ranks: Optional[Sequence[int]] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
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

        ``timeout``: how long :meth:`recover` takes by default, and, unless
        ``distributed_timeout_minutes`` is given, the groups' collective timeout too (instead of
        Megatron-Core's 30 minutes, which a recovery on gloo would have to wait out for a rank
        blocked in a collective).

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
            >>> job.collective_timeout
            datetime.timedelta(seconds=300)
            >>> destroy_model_parallel(); dist.destroy_process_group()
        """
        from ..megatron.recovery import initialize_placed  # megatron-core is needed only here

        if not dist.is_initialized():
            raise RuntimeError("ResilientJob.of_megatron needs torch.distributed: call init_process_group() first")
        timeout = _checked_timeout("timeout", timeout)
        world = dist.get_world_size()
        spare_ranks = _ranks_arg("spares", spares, world)
        placed = None if ranks is None else _ranks_arg("ranks", ranks, world, keep_order=True)
        megatron_kwargs.setdefault("distributed_timeout_minutes", timeout.total_seconds() / 60)
        config, layout, state, resolved = initialize_placed(
            spare_ranks, ranks=placed, share_groups=share_groups, strategy=strategy, check_agreement=check_agreement,
            megatron_kwargs=megatron_kwargs,
        )
        recipe = MegatronRecipe(config, share_groups, resolved, check_agreement)
        job = cls(layout, spare_ranks, recipe, state, timeout=timeout,
                  collective_timeout=_longest(recipe.longest_timeout()))
        return job._started()

    def _started(self) -> "ResilientJob":
        """The job with its heartbeat running, its channel opened and its collective watch started."""
        if not agreement_possible():
            return self
        if running_heartbeat() is None:
            start_heartbeat(DEFAULT_HEARTBEAT_S)
        job = dataclasses.replace(self, channel=open_channel(self.domain, timeout=self.timeout))
        _watch_collectives(job)
        return job

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
        arrived = self.arrived()
        if rank not in arrived:
            return None
        group = self.layout.group_ranks([replica_dim], rank) if replica_dim in self.layout.dim_names else [rank]
        return next((r for r in group if r not in arrived), None)

    def arrived(self) -> frozenset[int]:
        """The ranks that took a position in the latest recovery (a spare in a failed rank's
        place, or a rank of a replica grown back): they hold no model state yet.

        Example::

            >>> ResilientJob.of_grid(HyperCommGrid([2], ["dp"], world_size=2)).arrived()
            frozenset()
        """
        last = self.last
        if last is None:
            return frozenset()
        return frozenset({new for _, new in last.replaced} | set(last.joined))

    # ------------------------------------------------------------------ recovering
    def recover(
        self,
        *,
        failed: Optional[Sequence[int]] = None,
        timeout: Optional[timedelta] = None,
        step: Optional[int] = None,
        gpus_per_node: int = 8,
        replica_dim: str = "dp",
    ) -> "ResilientJob":
        """The job after the failure that just happened, on every surviving rank (spares too).

        ``failed``: the failed ranks where they are known alike on every rank (a test, one rank
        of a simulated world); by default the survivors agree on them through the store, from
        who arrives and whose heartbeat stopped. ``step``: the training step this rank resumes
        from; the job returned carries the least any participant gave (``job.step``), so a spare
        that joins knows it too. ``timeout``: by default the job's; the wait for ranks that may
        be blocked in a collective (up to the job's longest collective timeout) comes on top of
        it, in the first round only.

        Returns the new job: on the ranks of the new placement its state is built
        (``parallel_state`` filled for a Megatron job); elsewhere (a dropped replica, an unused
        spare) it is None.

        Raises:
            RecoveryRefused: no placement fits (too few spares, no replica to drop); on every survivor.
            ExcludedByRecovery: this rank was found failed (it came too late, or hung).
            RecoveryError: the survivors did not commit a placement before the deadline (the
                store stopped answering, or ranks kept failing); on every survivor.
        """
        timeout = _checked_timeout("timeout", self.timeout if timeout is None else timeout)
        step = None if step is None else _nonnegative("step", step)
        if failed is not None:
            return self._recover_known(self._failed_arg(failed), timeout, gpus_per_node, replica_dim)
        if not agreement_possible() or self.channel is None:
            raise RecoveryError("hypergrid: agreeing on failed ranks needs the job's store (a gloo or NCCL job made "
                                "with ResilientJob.of_grid or of_megatron, not the fake backend); pass failed= instead")
        return self._rounds(timeout, step, "recover", gpus_per_node=gpus_per_node, replica_dim=replica_dim)

    def grow(self, *, timeout: Optional[timedelta] = None, step: Optional[int] = None, gpus_per_node: int = 8,
             replica_dim: str = "dp") -> "ResilientJob":
        """Add replicas of waiting spares back along ``replica_dim``, up to the size the job was
        made with, after a shrink: one call on every rank of the grid, at the same point (say,
        every few hundred steps); the spares take part from :meth:`wait_as_spare`. Unchanged
        communicators are kept, ``parallel_state`` is filled for the grown placement, and a
        rank that just joined copies its state from ``job.state_source()``. Where no whole
        replica can be added, the job comes back unchanged (nothing is rebuilt).

        Example, with no process group (nobody to grow with)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=4))
            >>> job.grow() is job
            True
        """
        timeout = _checked_timeout("timeout", self.timeout if timeout is None else timeout)
        step = None if step is None else _nonnegative("step", step)
        if not agreement_possible() or self.channel is None:
            return self
        return self._rounds(timeout, step, "grow", gpus_per_node=gpus_per_node, replica_dim=replica_dim)

    def wait_as_spare(self, *, timeout: timedelta = DEFAULT_TIMEOUT, recovery_timeout: Optional[timedelta] = None,
                      gpus_per_node: int = 8, replica_dim: str = "dp") -> "ResilientJob":
        """On a spare: wait until a recovery (or a growth) needs this rank, take part in it, and
        return the job once this rank holds a position (or unchanged, still outside, after
        ``timeout`` with no recovery, or once the job releases its spares). Rounds that use other
        spares are taken part in too, and waited on after. The wait blocks on the store: no CPU.

        Example, with no process group (nobody to recover with)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
            >>> job.wait_as_spare(timeout=timedelta(seconds=0.1)) is job
            True
        """
        timeout = _checked_timeout("timeout", timeout)
        recovery_timeout = _checked_timeout("recovery_timeout", recovery_timeout or self.timeout)
        job = self
        if not agreement_possible() or job.channel is None:
            return job  # nobody to recover with: a simulated rank, or no process group
        while not job.in_grid:
            if not wait_for_round(job.channel, timeout=timeout):
                return job
            job = job._rounds(recovery_timeout, None, "wait", gpus_per_node=gpus_per_node, replica_dim=replica_dim)
        return job

    def offer(self, *, timeout: timedelta = DEFAULT_TIMEOUT, recovery_timeout: Optional[timedelta] = None,
              gpus_per_node: int = 8, replica_dim: str = "dp") -> "ResilientJob":
        """On a rank the job counted out (it raised :class:`~hypergrid.errors.ExcludedByRecovery`:
        it hung, or froze, and is fit again): offer it to the job as a spare and wait like one
        (:meth:`wait_as_spare`); the next round takes it in (a :meth:`grow` uses it). Returns the
        job once this rank holds a position, or still outside after ``timeout``.

        Example, with no process group (nobody to offer to)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6))
            >>> job.offer(timeout=timedelta(seconds=0.1)) is job
            True
        """
        timeout = _checked_timeout("timeout", timeout)
        recovery_timeout = _checked_timeout("recovery_timeout", recovery_timeout or self.timeout)
        if not agreement_possible() or self.channel is None:
            return self
        rank, end = dist.get_rank(), time.monotonic() + timeout.total_seconds()
        job = self
        while time.monotonic() < end:
            offer(job.channel, rank)  # type: ignore[arg-type]
            if not wait_for_round(job.channel, timeout=timedelta(seconds=end - time.monotonic())):  # type: ignore[arg-type]
                return job
            try:
                job = job._rounds(recovery_timeout, None, "wait", gpus_per_node=gpus_per_node,
                                  replica_dim=replica_dim)
            except ExcludedByRecovery:
                continue  # the job moved on before this offer was seen: offer again, to the job as it is
            left = timedelta(seconds=max(0.001, end - time.monotonic()))
            return job.wait_as_spare(timeout=left, recovery_timeout=recovery_timeout, gpus_per_node=gpus_per_node,
                                     replica_dim=replica_dim)
        return job

    def release_spares(self) -> None:
        """On any rank of the job once training is over (or given up): the spares waiting in
        :meth:`wait_as_spare` return at once, still outside the grid. A later job on the same ranks
        is named apart, and its spares wait as they should.

        Example, with no process group (nobody waits)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
            >>> job.release_spares()
        """
        if self.channel is not None:
            release_spares(self.channel)

    # ------------------------------------------------------------------ inputs
    def _failed_arg(self, failed: Sequence[int]) -> tuple[int, ...]:
        world = dist.get_world_size() if dist.is_initialized() else max(self.domain) + 1
        lost = _ranks_arg("failed", failed, world)
        if not lost:
            raise ValueError("failed must name at least one rank of the job, got none")
        outside = [r for r in lost if r not in set(self.domain)]
        if outside:
            raise ValueError(f"failed ranks {outside} are not ranks of the job {describe_ranks(self.domain)}")
        return lost

    # ------------------------------------------------------------------ the rounds
    def _recover_known(self, lost: tuple[int, ...], timeout: timedelta, gpus_per_node: int,
                       replica_dim: str) -> "ResilientJob":
        """A recovery from a failed set every rank knows alike: no round, one attempt."""
        verdict = FailureVerdict(lost, -1, present=tuple(r for r in self.domain if r not in lost))
        plan = self._plan(verdict, gpus_per_node, replica_dim)
        if plan.kind is RecoveryKind.REPAIR and not plan.failed:
            return dataclasses.replace(self, spares=plan.spares_left)
        deadline = time.monotonic() + timeout.total_seconds()
        state = self._build(plan, verdict, deadline, scope=None)
        self._let_go(self.state, keep=state)
        return self._after(plan, verdict, state)

    def _rounds(self, timeout: timedelta, step: Optional[int], reason: str, *, gpus_per_node: int,
                replica_dim: str) -> "ResilientJob":
        assert self.channel is not None
        rank = dist.get_rank()
        stale_after = stale_after_default(timeout.total_seconds())
        beat = running_heartbeat()
        settle = SETTLE_BEATS * beat.interval_s if beat is not None else stale_after / 2
        bound = _longest(self.collective_timeout).total_seconds() + ARRIVAL_MARGIN_S + stale_after
        # The first round may wait for ranks blocked in a collective: on top of the recovery's timeout.
        deadline = time.monotonic() + timeout.total_seconds() + bound
        job, first = self, True
        with recovering():
            while True:
                rnd = RecoveryRound.open(job.channel, deadline)  # type: ignore[arg-type]
                job = job._synced(rnd.record)
                offered = [r for r in rnd.offers if r not in set(job.domain)]
                if rank not in job.domain and rank not in offered:
                    why = [line for line in (rnd.record.gone if rnd.record else ()) if line.startswith(f"rank {rank}:")]
                    raise ExcludedByRecovery(
                        f"hypergrid: rank {rank} is no longer a rank of the job: the survivors recovered without "
                        f"it ({why[-1] if why else 'it did not come'}; the grid is on "
                        f"{describe_ranks(list(job.layout.ranks))}, spares {describe_ranks(job.spares)}); "
                        f"ResilientJob.offer() offers it again")
                arrival = Arrival(rank, step, reason, tuple(take_aborted()))
                verdict = rnd.agree(sorted(set(job.domain) | set(offered)), arrival, bound_s=bound,
                                    stale_after_s=stale_after, settle_s=settle)
                if first:
                    deadline, first = time.monotonic() + timeout.total_seconds(), False
                    rnd.store.deadline = deadline
                end, state = job._attempt(rnd, verdict, gpus_per_node, replica_dim, deadline)
                rnd.close()
                if end.committed:
                    return state
                if end.refused:
                    raise RecoveryRefused(end.message)
                logger.warning("rank %d: %s did not commit: %s", rank, rnd.name, end.message)
                if time.monotonic() >= deadline:
                    _abandon(job.channel, rnd.number + 1, f"rank {rank} reached its deadline")  # type: ignore[arg-type]
                    raise RecoveryError(
                        f"hypergrid: the recovery did not commit a placement within its timeout "
                        f"({timeout.total_seconds():g} s after the survivors first agreed); the last attempt "
                        f"failed: {end.message}")

    def _attempt(self, rnd: RecoveryRound, verdict: FailureVerdict, gpus_per_node: int, replica_dim: str,
                 deadline: float) -> tuple[RoundEnd, Any]:
        """One attempt at the round's plan: (how it ended, the new job where it committed)."""
        rank = dist.get_rank()
        try:
            plan = self._plan(verdict, gpus_per_node, replica_dim)
        except RecoveryRefused as exc:
            return rnd.end(RoundEnd(False, str(exc), refused=True)), None
        logger.info("rank %d: %s: %s", rank, rnd.name, plan.describe())
        # A growth that found no replica to add, where nobody failed or came after a failure: nothing
        # is broken and nothing moves, so nothing is rebuilt.
        quiet = (plan.kind is RecoveryKind.REPAIR and verdict.grow and not verdict.recovering and not verdict.failed
                 and not verdict.aborted)
        members = set(plan.new.ranks)
        new_state: Any = None
        if quiet:
            new_state = self.state  # a growth that found no replica to add: nothing to rebuild
        elif rank in members:
            try:
                new_state = self._build(plan, verdict, deadline, scope=f"{rnd.channel.key(rnd.number)}")
            except RecoveryRefused as exc:
                self._restore()
                return rnd.end(RoundEnd(False, str(exc), refused=True)), None
            except Exception as exc:  # the round failed: the next one starts from the state from before
                self._restore()
                return rnd.end(RoundEnd(False, f"rank {rank}: {type(exc).__name__}: {one_line(str(exc), 400)}")), None
        record = self._record(plan, verdict, rnd.record)
        if rank in members or quiet:
            end = rnd.end(RoundEnd(True, job=record))
            if end.committed:
                rnd.commit(record)
            elif new_state is not self.state:
                self._let_go(new_state, keep=self.state)
                self._restore()
        else:
            _megatron_reset_if(self.recipe)
            end = rnd.wait_end()
            if not end.committed:
                self._restore()
        if not end.committed:
            return end, None
        if new_state is not self.state:
            self._let_go(self.state, keep=new_state)
        return end, self._after(plan, verdict, new_state, end.job)

    def _plan(self, verdict: FailureVerdict, gpus_per_node: int, replica_dim: str) -> RecoveryPlan:
        """The placement after ``verdict``, alike on every participant."""
        failed = set(verdict.failed)
        lost = [r for r in verdict.failed if self.layout.contains(r)]
        offered = [r for r in verdict.present if r not in set(self.domain)]
        spares = [s for s in self.spares if s not in failed] + offered
        if lost:
            plan = plan_recovery(self.layout, lost, spares, replica_dim=replica_dim, gpus_per_node=gpus_per_node)
        else:
            plan = RecoveryPlan(RecoveryKind.REPAIR, self.layout, self.layout, (), spares_left=tuple(spares))
        if not verdict.grow or replica_dim not in self.layout.dim_names:
            return plan
        axis = self.layout.dim_names.index(replica_dim)
        pool = sorted(set(plan.spares_left) | set(plan.dropped))
        grown = plan_growth(plan.new, self.made_shape[axis], pool, replica_dim=replica_dim)
        if grown.kind is not RecoveryKind.GROW:
            return plan
        if isinstance(self.recipe, GridRecipe) and self.recipe.views:
            return plan  # how a view's dims grow is not known here, as for a shrink
        return RecoveryPlan(RecoveryKind.GROW, self.layout, grown.new, plan.failed, plan.replaced,
                            tuple(r for r in plan.dropped if r not in set(grown.joined)),
                            tuple(r for r in grown.spares_left if r not in set(plan.dropped)), grown.joined)

    def _build(self, plan: RecoveryPlan, verdict: FailureVerdict, deadline: float, scope: Optional[str]) -> Any:
        """This rank's state over ``plan.new``, built with the other ranks of the new placement;
        the state from before is still held (and, for a Megatron job, no longer current)."""
        if job_setup().splits:
            raise RecoveryRefused(
                "cannot rebuild groups in-process on a default group bound to a device whose backend splits "
                "(NCCL with device_id): every new communicator is split from the world's, which the lost ranks "
                "would have to join; start the default group without device_id to recover in-process"
            )
        members = sorted(plan.new.ranks)
        with watching_members(stale_after_default(_left(deadline).total_seconds())):
            if dist.get_rank() in members:
                _evict_broken(members, verdict.aborted, _left(deadline), scope)
            if isinstance(self.recipe, MegatronRecipe):
                from ..megatron.recovery import rebuild_megatron  # megatron-core is needed only here

                recipe = self.recipe
                return rebuild_megatron(recipe.config, plan, members, dist.get_rank(),
                                        share_groups=recipe.share_groups, strategy=recipe.strategy,
                                        check_agreement=recipe.check_agreement, step_timeout=_left(deadline))
            return _rebuild_grid(self.recipe, plan, members, dist.get_rank(), _left(deadline))

    def _restore(self) -> None:
        """After an attempt that did not commit: the state from before is current again."""
        if isinstance(self.recipe, MegatronRecipe):
            from ..megatron.recovery import activate_megatron

            activate_megatron(self.state)

    def _let_go(self, state: Any, *, keep: Any) -> None:
        """Let go of ``state`` (groups that ``keep`` holds too stay)."""
        if state is None or state is keep:
            return
        if isinstance(state, HyperCommGrid):
            state.destroy()
        else:
            state.release()

    def _record(self, plan: RecoveryPlan, verdict: FailureVerdict, before: Optional[JobRecord]) -> JobRecord:
        spares = tuple(sorted(set(plan.spares_left) | set(plan.dropped)))
        runs = (plan.new.rank_map or RankMap.contiguous(plan.new.rank_offset, plan.new.size)).runs
        gone = (before.gone if before is not None else ()) + verdict.reasons
        return JobRecord(self.generation + 1, tuple(plan.new.shape), tuple(plan.new.dim_names), runs, spares,
                         verdict.step, gone)

    def _after(self, plan: RecoveryPlan, verdict: FailureVerdict, state: Any,
               record: Optional[JobRecord] = None) -> "ResilientJob":
        spares = record.spares if record is not None else tuple(sorted(set(plan.spares_left) | set(plan.dropped)))
        recoveries = self.recoveries if plan.kind is RecoveryKind.REPAIR else self.recoveries + (plan,)
        job = dataclasses.replace(self, layout=plan.new, spares=spares, state=state, recoveries=recoveries,
                                  generation=self.generation + 1, step=verdict.step)
        if job.channel is not None:
            _watch_collectives(job)
        return job

    def _synced(self, record: Optional[JobRecord]) -> "ResilientJob":
        """This job as the store's latest committed record says it is (where this rank missed an end)."""
        if record is None or record.generation <= self.generation:
            return self
        layout = GridLayout(record.shape, record.dim_names, rank_map=RankMap(record.runs))
        logger.warning("rank %d: the job moved on without this rank's knowledge: now on %s", dist.get_rank(),
                       describe_ranks(list(layout.ranks)))
        return dataclasses.replace(self, layout=layout, spares=record.spares, generation=record.generation,
                                   step=record.step)


# ---------------------------------------------------------------------- helpers
def _evict_broken(members: list[int], aborted: Sequence[tuple[int, ...]], timeout: timedelta,
                  scope: Optional[str]) -> None:
    """Stop sharing the groups of living members that the failure broke (or that a member
    aborted), so that they are made anew."""
    alive = set(members)
    candidates = [pg for pg in REGISTRY.groups() if set(dist.get_process_group_ranks(pg)) <= alive]
    broken = broken_groups(candidates, participants=members, timeout=timeout, scope=scope, known=aborted)
    for pg in candidates:
        if tuple(dist.get_process_group_ranks(pg)) in broken:
            if can_abort(pg):
                abort_group(pg)  # a probe left in flight would hold the communicator's stream
            REGISTRY.evict(pg)


def _rebuild_grid(recipe: Recipe, plan: RecoveryPlan, members: list[int], rank: int, timeout: timedelta) -> Any:
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
    step = world_start("recover", timeout=timeout, ranks=members) if rank in members else None
    try:
        for made in recipe.made:
            # The same calls in the same order: an unchanged group is the registry's existing one.
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


def _megatron_reset_if(recipe: Recipe) -> None:
    """A rank leaving a Megatron job's grid answers for no placement while the others build one."""
    if isinstance(recipe, MegatronRecipe):
        from ..megatron.initialize import reset_parallel_state

        reset_parallel_state()


def _abandon(channel: JobChannel, number: int, why: str) -> None:
    """Give up round ``number`` for everyone who waits in it (they raise too), and close it, so that
    a retry after this error meets in a round of its own."""
    rnd = RecoveryRound(channel, number, StoreClient(time.monotonic() + 5.0), None)
    rnd.abandon(why)
    rnd.close()


_watch: Optional[CollectiveWatch] = None


def _watch_collectives(job: ResilientJob) -> None:
    """(Re)start the watch that aborts this rank's abortable communicators when the job needs it."""
    global _watch
    if _watch is not None:
        _watch.stop()
    beat = running_heartbeat()
    if job.channel is None or beat is None:
        _watch = None
        return
    rank = dist.get_rank()
    peers = [r for r in job.domain if r != rank]
    _watch = CollectiveWatch(job.channel, REGISTRY.groups, peers=peers, interval_s=beat.interval_s,
                             stale_after_s=stale_after_default(job.timeout.total_seconds()))


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(1.0, deadline - time.monotonic()))


def _longest(timeout: Optional[timedelta]) -> timedelta:
    """``timeout`` or the default group's, whichever is longer (the longest a collective of the job may wait)."""
    candidates = [t for t in (timeout, default_group_timeout() if dist.is_initialized() else None) if t is not None]
    return max(candidates) if candidates else DEFAULT_TIMEOUT


def _checked_timeout(name: str, value: object) -> timedelta:
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a datetime.timedelta, got {type(value).__name__} {value!r}")
    return check_timeout(name, value)


def _nonnegative(name: str, value: object) -> int:
    number = as_int(value, name)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}")
    return number


def _ranks_arg(name: str, values: object, world: int, *, keep_order: bool = False) -> tuple[int, ...]:
    """``values`` as distinct ranks of a world of ``world`` (sorted unless ``keep_order``)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) and not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ranks, got {type(values).__name__} {values!r}")
    ranks = [as_int(v, f"a rank in {name}") for v in values]  # type: ignore[union-attr]
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"{name} must be ranks of the world [0, {world}), got {bad}")
    if len(set(ranks)) != len(ranks) and keep_order:
        raise ValueError(f"{name} must be distinct ranks, got {ranks}")
    return tuple(ranks) if keep_order else tuple(sorted(set(ranks)))
