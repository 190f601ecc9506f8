"""A job that survives the loss of ranks in-process: re-placed, with only the changed groups rebuilt.

A :class:`ResilientJob` holds what every rank of a job (its grid's ranks and its spares) knows
alike: the current placement of the grid, the spares, how to build the job's groups (a
Megatron-Core configuration, or a grid's ``create_pg`` calls) and the job's channel in the store.
After a failure every surviving rank calls :meth:`ResilientJob.recover` (spares wait in
:meth:`ResilientJob.wait_as_spare`), and the recovery runs in *rounds*
(:mod:`hypergrid.recovery.round`) until one commits:

1. every rank of the job arrives, or is found failed: the job's board says it was lost (its
   process ended, its node stopped beating, or it made no progress for the progress timeout), or
   it is alive but did not arrive within the job's longest collective timeout and a margin (it hangs);
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
    >>> job = ResilientJob.of_grid(grid, spares=[8, 9], settings=RecoverySettings(gpus_per_node=2))
    >>> after = job.recover(failed=[5])
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
from typing import Any, Optional

import torch.distributed as dist

from ..errors import ExcludedByRecovery, RecoveryError, RecoveryRefused, StoreUnresponsiveError
from ..grid import HyperCommGrid
from ..layout import GridLayout
from ..layout.checks import as_int, check_timeout
from ..layout.describe import describe_ranks
from ..layout.replan import RecoveryPlan
from ..liveness.heartbeat import running_heartbeat, start_heartbeat
from ..liveness.plane import control_plane
from ..runtime.environment import agreement_possible
from ..runtime.modes import job_setup
from ..store.keys import JobChannel
from ..store.records import JobRecord
from .driver import attach, detach, recover_known, run_rounds, synced
from .rebuild import world_grid
from .recipes import DEFAULT_TIMEOUT, GridRecipe, MegatronRecipe, Recipe, longest_collective, rebuild_strategy
from .round import offer, open_channel, read_state, release_spares, wait_for_round
from .settings import RecoverySettings

__all__ = ["ResilientJob", "GridRecipe", "MegatronRecipe", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

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
    #: The job as its latest committed recovery left it (None: none has committed).
    record: Optional[JobRecord] = None
    #: The first recovery round this rank has not taken part in (or learnt the end of).
    next_round: int = 0
    step: Optional[int] = None
    timeout: timedelta = DEFAULT_TIMEOUT
    collective_timeout: Optional[timedelta] = None
    #: The number of replicas along each dim when the job was made (what :meth:`grow` returns to).
    made_shape: tuple[int, ...] = ()
    #: How it recovers (node size, replica dim, heartbeat, timings), alike on every rank.
    settings: RecoverySettings = dataclasses.field(default_factory=RecoverySettings)
    #: The grid whose one group is :attr:`world` for this placement, made when first asked for.
    _world: Optional[HyperCommGrid] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.settings, RecoverySettings):
            raise TypeError(f"settings must be a RecoverySettings, got {type(self.settings).__name__} {self.settings!r}")
        if not self.origin:
            object.__setattr__(self, "origin", self.domain)
        if not self.made_shape:
            object.__setattr__(self, "made_shape", tuple(self.layout.shape))

    # ------------------------------------------------------------------ making one
    @classmethod
    def of_grid(cls, grid: HyperCommGrid, *, spares: Sequence[int] = (),
                timeout: timedelta = DEFAULT_TIMEOUT, settings: Optional[RecoverySettings] = None) -> ResilientJob:
        """A job whose groups are ``grid``'s ``create_pg`` calls (those made before this call; a
        recovery repeats them, in order). Call it on every rank of the job, spares included,
        with the same grid and calls (a rank outside the grid gets None from each); the ranks
        meet in the store once, to name the job, and each starts its heartbeat if none runs.
        ``timeout``: how long :meth:`recover` takes by default. ``settings``: how it recovers
        (:class:`~hypergrid.recovery.RecoverySettings`: ranks per node, by default torchrun's
        ``LOCAL_WORLD_SIZE``, else 8; the replica dim; the heartbeat; the timings), alike on every rank.

        Example::

            >>> grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=6)
            >>> ResilientJob.of_grid(grid, spares=[4, 5]).domain
            (0, 1, 2, 3, 4, 5)
        """
        if not isinstance(grid, HyperCommGrid):
            raise TypeError(f"grid must be a HyperCommGrid, got {type(grid).__name__} {grid!r}")
        timeout = _checked_timeout("timeout", timeout)
        # A grid planned for a smaller world is legal in a larger one (its groups are checked
        # against the world that runs): the spares are ranks of that world.
        world = dist.get_world_size() if dist.is_initialized() else grid.world_size
        spare_ranks = _ranks_arg("spares", spares, world)
        inside = [s for s in spare_ranks if grid.layout.contains(s)]
        if inside:
            raise ValueError(f"spares must be ranks outside the grid, got {list(inside)} which the grid spans")
        # A rebuild makes groups among their members: Megatron-Core's pattern of every rank making
        # every group (enumerate) cannot be kept once ranks are lost.
        recipe = dataclasses.replace(GridRecipe.of(grid), strategy=rebuild_strategy(grid.strategy))
        job = cls(grid.layout, spare_ranks, recipe, grid, timeout=timeout,
                  collective_timeout=longest_collective(recipe.longest_timeout()), settings=_settings(settings))
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
        settings: Optional[RecoverySettings] = None,
        **megatron_kwargs: Any,
    ) -> ResilientJob:
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
        if strategy == "enumerate":
            raise ValueError(
                "strategy='enumerate' (Megatron-Core's call pattern) has every rank of the world make every group, "
                "which a resilient job cannot do: its spares make none, and after a loss the failed ranks cannot; "
                "use strategy=None (auto) or 'local'"
            )
        megatron_kwargs.setdefault("distributed_timeout_minutes", timeout.total_seconds() / 60)
        if strategy is None and job_setup().splits:
            strategy = "fresh"  # its spares make no group, so none may be split off the world's
        config, layout, state, resolved = initialize_placed(
            spare_ranks, ranks=placed, share_groups=share_groups, strategy=strategy, check_agreement=check_agreement,
            megatron_kwargs=megatron_kwargs,
        )
        recipe = MegatronRecipe(config, share_groups, resolved, check_agreement)
        job = cls(layout, spare_ranks, recipe, state, timeout=timeout,
                  collective_timeout=longest_collective(recipe.longest_timeout()), settings=_settings(settings))
        return job._started()

    def _started(self) -> ResilientJob:
        """The job with its world group made, its heartbeat running, its channel opened and its
        collective watch started."""
        if not agreement_possible() or not self.counts_on(dist.get_rank()):
            return self  # nobody to recover with, or this rank is not one of the job's
        if running_heartbeat() is None:
            start_heartbeat()  # with its defaults: one started before the job keeps its own
        job = dataclasses.replace(self, channel=open_channel(self.domain, timeout=self.timeout))
        attach(job, first_round=0)
        return job

    # ------------------------------------------------------------------ facts
    @property
    def domain(self) -> tuple[int, ...]:
        """Every rank the job counts on: the grid's and the spares, ascending."""
        return tuple(sorted(set(self.layout.ranks) | set(self.spares)))

    def counts_on(self, rank: int) -> bool:
        """Whether ``rank`` is a rank of the job (the grid's or a spare): O(log runs), not O(world).

        Example::

            >>> ResilientJob.of_grid(HyperCommGrid([2], ["dp"], world_size=4), spares=[3]).counts_on(3)
            True
        """
        return self.layout.contains(rank) or rank in self.spares

    @property
    def world(self) -> Optional[dist.ProcessGroup]:
        """A process group over every rank of the grid, to use where code would use the default
        group (a barrier, an all-reduce of a logged value): the default group counts the spares,
        which take part in nothing, and after a recovery the ranks that were lost. Made with the
        job's placement once, when it is first asked for (on every rank of the grid: among them only,
        spares and lost ranks take no part); its group ranks follow the grid's positions. None on a
        rank outside the grid.

        Example, as rank 1 of a 6-rank job on torch's fake backend (ranks 4 and 5 spares)::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=6)
            >>> grid = HyperCommGrid([2, 2], ["tp", "dp"])
            >>> job = ResilientJob.of_grid(grid, spares=[4, 5], settings=RecoverySettings(gpus_per_node=2))
            >>> dist.get_process_group_ranks(job.world)
            [0, 1, 2, 3]
            >>> after = job.recover(failed=[3])
            >>> dist.get_process_group_ranks(after.world)
            [0, 1, 2, 4]
            >>> after.destroy(); dist.destroy_process_group()
        """
        if not dist.is_initialized() or not self.in_grid:
            return None
        layout = self.layout
        if layout.rank_map is None and layout.rank_offset == 0 and layout.size == dist.get_world_size():
            return dist.group.WORLD
        world = self._world
        if world is None:
            world = world_grid(layout)
            object.__setattr__(self, "_world", world)
        try:
            return world.get_pg("world")
        except KeyError:
            return world.create_pg("world", group_desc="HYPERGRID_JOB_WORLD")

    @property
    def generation(self) -> int:
        """How many recoveries of the job have committed (its record's generation)."""
        return self.record.generation if self.record is not None else 0

    @property
    def in_grid(self) -> bool:
        """Whether this rank holds a position of the grid."""
        return self.layout.contains(dist.get_rank())

    @property
    def last(self) -> Optional[RecoveryPlan]:
        """The latest recovery (None: none yet)."""
        return self.recoveries[-1] if self.recoveries else None

    def state_source(self, rank: Optional[int] = None) -> Optional[int]:
        """Where ``rank`` (default: this rank) copies its replica's state from after the latest
        recovery: the first rank of its replica dim's group (the settings') that did not just arrive (a surviving
        data-parallel peer holding the same shard); None where ``rank`` did not just arrive, or no
        peer survived (then the state must come from a checkpoint).

        Example, as rank 8 (a spare) of a 10-rank job on torch's fake backend: it takes rank 5's
        place, and copies its shard from rank 7, its data-parallel peer::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=8, world_size=10)
            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"]), spares=[8, 9],
            ...                            settings=RecoverySettings(gpus_per_node=2))
            >>> after = job.recover(failed=[5])
            >>> after.in_grid, after.state_source(), after.state.ranks("dp")
            (True, 7, [8, 7])
            >>> after.state.destroy(); dist.destroy_process_group()
        """
        rank = dist.get_rank() if rank is None else rank
        arrived = self.arrived()
        if rank not in arrived:
            return None
        replica_dim = self.settings.replica_dim
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
        gpus_per_node: Optional[int] = None,
        replica_dim: Optional[str] = None,
    ) -> ResilientJob:
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
        self.settings.with_call("recover", gpus_per_node=gpus_per_node, replica_dim=replica_dim)
        if failed is not None:
            return recover_known(self, self._failed_arg(failed), timeout)
        if not agreement_possible() or self.channel is None:
            raise RecoveryError("hypergrid: agreeing on failed ranks needs the job's store (a gloo or NCCL job made "
                                "with ResilientJob.of_grid or of_megatron, not the fake backend); pass failed= instead")
        return run_rounds(self, timeout, step, "recover")

    def grow(self, *, timeout: Optional[timedelta] = None, step: Optional[int] = None,
             gpus_per_node: Optional[int] = None, replica_dim: Optional[str] = None) -> ResilientJob:
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
        self.settings.with_call("grow", gpus_per_node=gpus_per_node, replica_dim=replica_dim)
        if not agreement_possible() or self.channel is None:
            return self
        return run_rounds(self, timeout, step, "grow")

    def wait_as_spare(self, *, timeout: timedelta = DEFAULT_TIMEOUT, recovery_timeout: Optional[timedelta] = None,
                      gpus_per_node: Optional[int] = None, replica_dim: Optional[str] = None) -> ResilientJob:
        """On a spare: wait until a recovery (or a growth) needs this rank, take part in it, and
        return the job once this rank holds a position (or unchanged, still outside, after
        ``timeout`` with no recovery, or once the job releases its spares). Rounds that use other
        spares are taken part in too, and waited on after; a recovery that fails (the survivors
        get its error, and retry) is waited on after too. The wait blocks on the store: no CPU.

        Example, with no process group (nobody to recover with)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
            >>> job.wait_as_spare(timeout=timedelta(seconds=0.1)) is job
            True
        """
        timeout = _checked_timeout("timeout", timeout)
        recovery_timeout = _checked_timeout("recovery_timeout", recovery_timeout or self.timeout)
        self.settings.with_call("wait_as_spare", gpus_per_node=gpus_per_node, replica_dim=replica_dim)
        job = self
        plane = control_plane()
        if plane is None or job.channel is None:
            return job  # nobody to recover with: a simulated rank, or no process group
        end = time.monotonic() + timeout.total_seconds()
        while not job.in_grid:
            left = end - time.monotonic()
            if left <= 0 or not wait_for_round(job.channel, plane, timeout=timedelta(seconds=left),
                                                  slice_s=job.settings.spare_slice_s, first=job.next_round):
                return job.as_stored()
            try:
                job = run_rounds(job, recovery_timeout, None, "wait")
            except (RecoveryError, RecoveryRefused) as exc:
                # The survivors failed this recovery too, and retry (or give up, and release the
                # spares): this rank waits on, as it was.
                logger.info("rank %d: a recovery this spare took part in failed; waiting on: %s", dist.get_rank(), exc)
        return job

    def offer(self, *, timeout: timedelta = DEFAULT_TIMEOUT, recovery_timeout: Optional[timedelta] = None,
              gpus_per_node: Optional[int] = None, replica_dim: Optional[str] = None) -> ResilientJob:
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
        self.settings.with_call("offer", gpus_per_node=gpus_per_node, replica_dim=replica_dim)
        plane = control_plane()
        if plane is None or self.channel is None:
            return self
        rank, end = dist.get_rank(), time.monotonic() + timeout.total_seconds()
        job, channel = self, self.channel
        while time.monotonic() < end:
            offer(channel, plane, rank)
            if not wait_for_round(channel, plane, timeout=timedelta(seconds=end - time.monotonic()),
                                  slice_s=self.settings.spare_slice_s, first=job.next_round):
                return job.as_stored()
            try:
                job = run_rounds(job, recovery_timeout, None, "wait")
            except ExcludedByRecovery:
                continue  # the job moved on before this offer was seen: offer again, to the job as it is
            except (RecoveryError, RecoveryRefused) as exc:
                logger.info("rank %d: a recovery this rank offered itself to failed; offering again: %s",
                            dist.get_rank(), exc)
                continue
            left = timedelta(seconds=max(0.001, end - time.monotonic()))
            return job.wait_as_spare(timeout=left, recovery_timeout=recovery_timeout)
        return job.as_stored()

    def as_stored(self) -> ResilientJob:
        """This job as the store's latest committed record has it (placement, spares, generation),
        for a rank that comes back from outside the grid: what it held may be from before it was
        counted out. Without a store (or a record), the job as it is.

        Example, with no process group::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=4))
            >>> job.as_stored() is job
            True
        """
        plane = control_plane()
        if plane is None or self.channel is None:
            return self
        try:
            state, _ = read_state(self.channel, plane.client(time.monotonic() + 30.0))
        except (dist.DistError, StoreUnresponsiveError) as exc:
            raise RecoveryError(f"hypergrid: could not read the job's committed record: the job's store did not "
                                f"answer ({exc})") from exc
        stored = synced(self, state.committed, state.round)
        if stored is not self and self.state is not None and not stored.in_grid:
            # It held groups of a placement that is gone (it was counted out): they go too.
            self.destroy()
            stored = dataclasses.replace(stored, state=None)
        return stored

    def destroy(self) -> None:
        """Let go of the job's groups on this rank: its state's (a grid's, or Megatron-Core's
        ``parallel_state``) and its :attr:`world` group. Idempotent.

        Example, as rank 0 of a 4-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"]))
            >>> job.destroy(); job.destroy()
            >>> dist.destroy_process_group()
        """
        if self._world is not None:
            self._world.destroy()
        if self.channel is not None:
            detach()
        if isinstance(self.state, HyperCommGrid):
            self.state.destroy()
        elif self.state is not None:
            from ..megatron import destroy_model_parallel  # megatron-core is needed only here

            destroy_model_parallel()

    def release_spares(self) -> None:
        """On any rank of the job once training is over (or given up): the spares waiting in
        :meth:`wait_as_spare` return at once, still outside the grid. A later job on the same ranks
        is named apart, and its spares wait as they should.

        Example, with no process group (nobody waits)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
            >>> job.release_spares()
        """
        plane = control_plane()
        if self.channel is not None and plane is not None:
            release_spares(self.channel, plane)
            detach()  # the job is over for this rank: its end is nobody's loss

    # ------------------------------------------------------------------ inputs
    def _failed_arg(self, failed: Sequence[int]) -> tuple[int, ...]:
        world = dist.get_world_size() if dist.is_initialized() else max(self.domain) + 1
        lost = _ranks_arg("failed", failed, world)
        if not lost:
            raise ValueError("failed must name at least one rank of the job, got none")
        outside = [r for r in lost if not self.counts_on(r)]
        if outside:
            raise ValueError(f"failed ranks {outside} are not ranks of the job {describe_ranks(self.domain)}")
        return lost

# ---------------------------------------------------------------------- helpers
def _settings(settings: Optional[RecoverySettings]) -> RecoverySettings:
    if settings is not None and not isinstance(settings, RecoverySettings):
        raise TypeError(f"settings must be a RecoverySettings, got {type(settings).__name__} {settings!r}")
    return settings or RecoverySettings()


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
    ranks = [as_int(v, f"a rank in {name}") for v in values]
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"{name} must be ranks of the world [0, {world}), got {bad}")
    if len(set(ranks)) != len(ranks) and keep_order:
        raise ValueError(f"{name} must be distinct ranks, got {ranks}")
    return tuple(ranks) if keep_order else tuple(sorted(set(ranks)))
