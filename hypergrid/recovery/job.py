"""A job that survives the loss of ranks in-process: re-placed, with only the changed groups rebuilt.

After a failure every survivor calls :meth:`ResilientJob.recover` (spares wait in
:meth:`ResilientJob.wait_as_spare`), and the recovery runs in rounds until one commits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
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
from ..liveness.plane import ControlPlane, control_plane
from ..runtime.environment import agreement_possible
from ..runtime.modes import job_setup
from ..store.keys import JobChannel
from ..store.records import JobRecord
from .driver import RecoveryTimes, attach, detach, recover_known, run_rounds, synced
from .rebuild import job_grid, world_grid
from .recipes import DEFAULT_TIMEOUT, GridRecipe, MegatronRecipe, Recipe, longest_collective, rebuild_strategy
from .round import offer, open_channel, read_state, release_spares, wait_for_round
from .settings import RecoverySettings

__all__ = ["ResilientJob", "GridRecipe", "MegatronRecipe", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResilientJob:
    """What every rank of a job (the grid's and the spares) knows alike; ``state`` is this rank's grid
    or :class:`~hypergrid.megatron.MegatronGrids` (None outside the grid), ``step`` where every rank
    resumes after the latest recovery.

    ``layout`` is the grid's placement now: ``layout.ranks`` in position order, ``layout.coords(rank)``
    a rank's coordinates along ``layout.dim_names``. Key a rank's data, logs and files by its position
    or coordinates (which a rank taking its place inherits), not by its global rank. The job's own
    groups (:attr:`world`, :attr:`replica_group`, :attr:`copy_group`) wait :attr:`group_timeout`.

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
    origin: tuple[int, ...] = ()
    channel: Optional[JobChannel] = None
    record: Optional[JobRecord] = None  #: the job as its latest committed recovery left it
    next_round: int = 0  #: the first recovery round this rank has not taken part in
    step: Optional[int] = None
    timeout: timedelta = DEFAULT_TIMEOUT  #: :meth:`recover`'s default
    collective_timeout: Optional[timedelta] = None  #: the longest collective timeout: how long a live rank is waited for
    made_shape: tuple[int, ...] = ()  #: the shape the job was made with, what :meth:`grow` returns to
    settings: RecoverySettings = dataclasses.field(default_factory=RecoverySettings)
    #: How long this rank's part of the latest rounds-based recovery took (None: none yet).
    times: Optional[RecoveryTimes] = dataclasses.field(default=None, compare=False)
    _world: Optional[HyperCommGrid] = dataclasses.field(default=None, compare=False, repr=False)
    _replicas: Optional[HyperCommGrid] = dataclasses.field(default=None, compare=False, repr=False)
    _copies: Optional[HyperCommGrid] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.settings, RecoverySettings):
            raise TypeError(f"settings must be a RecoverySettings, got {type(self.settings).__name__} {self.settings!r}")
        if not self.origin:
            object.__setattr__(self, "origin", self.domain)
        if not self.made_shape:
            object.__setattr__(self, "made_shape", tuple(self.layout.shape))

    @classmethod
    def of_grid(cls, grid: HyperCommGrid, *, spares: Sequence[int] = (),
                timeout: timedelta = DEFAULT_TIMEOUT, settings: Optional[RecoverySettings] = None) -> ResilientJob:
        """A job whose groups are ``grid``'s ``create_pg`` calls so far, repeated by a recovery. Every
        rank of the job calls it, spares too; each starts its heartbeat if none runs.

        >>> grid = HyperCommGrid([2, 2], ["tp", "dp"], world_size=6)
        >>> ResilientJob.of_grid(grid, spares=[4, 5]).domain
        (0, 1, 2, 3, 4, 5)
        """
        if not isinstance(grid, HyperCommGrid):
            raise TypeError(f"grid must be a HyperCommGrid, got {type(grid).__name__} {grid!r}")
        timeout = _checked_timeout("timeout", timeout)
        # A grid planned for a smaller world is legal in a larger one: the spares are that world's.
        world = dist.get_world_size() if dist.is_initialized() else grid.world_size
        spare_ranks = _ranks_arg("spares", spares, world)
        inside = [s for s in spare_ranks if grid.layout.contains(s)]
        if inside:
            raise ValueError(f"spares must be ranks outside the grid, got {list(inside)} which the grid spans")
        recipe = dataclasses.replace(GridRecipe.of(grid), strategy=rebuild_strategy(grid.strategy))
        return cls._started(grid.layout, spare_ranks, recipe, grid, timeout, settings)

    @classmethod
    def of_megatron(cls, *, spares: Sequence[int] = (), ranks: Optional[Sequence[int]] = None,
                    timeout: timedelta = DEFAULT_TIMEOUT, share_groups: bool = True, strategy: Optional[str] = None,
                    check_agreement: bool = True, settings: Optional[RecoverySettings] = None,
                    **megatron_kwargs: Any) -> ResilientJob:
        """The job, with Megatron-Core's ``parallel_state`` initialized on every rank but ``spares``; every
        rank calls it. ``ranks``: the grid's positions' ranks, in order (default: all but the spares).
        ``timeout`` is the groups' collective timeout too unless ``distributed_timeout_minutes`` is given.
        Example, as rank 3 of a 10-rank job on torch's fake backend (ranks 8 and 9 are spares)::

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
            raise ValueError("strategy='enumerate' (Megatron-Core's call pattern) has every rank of the world make "
                             "every group, which a resilient job cannot do: its spares make none, and after a loss "
                             "the failed ranks cannot; use strategy=None (auto) or 'local'")
        megatron_kwargs.setdefault("distributed_timeout_minutes", timeout.total_seconds() / 60)
        if strategy is None and job_setup().splits:
            strategy = "fresh"  # its spares make no group, so none may be split off the world's
        config, layout, state, resolved = initialize_placed(spare_ranks, ranks=placed, share_groups=share_groups,
                                                            strategy=strategy, check_agreement=check_agreement,
                                                            megatron_kwargs=megatron_kwargs)
        recipe = MegatronRecipe(config, share_groups, resolved, check_agreement)
        return cls._started(layout, spare_ranks, recipe, state, timeout, settings)

    @classmethod
    def _started(cls, layout: GridLayout, spares: tuple[int, ...], recipe: Recipe, state: Any, timeout: timedelta,
                 settings: Optional[RecoverySettings]) -> ResilientJob:
        """The job, its heartbeat running, its channel open and its collective watch on."""
        job = cls(layout, spares, recipe, state, timeout=timeout,
                  collective_timeout=longest_collective(recipe.longest_timeout()),
                  settings=RecoverySettings() if settings is None else settings)
        if not agreement_possible() or not job.counts_on(dist.get_rank()):
            return job  # nobody to recover with, or this rank is not one of the job's
        if running_heartbeat() is None:
            start_heartbeat()  # one started before the job keeps its own settings
        job = dataclasses.replace(job, channel=open_channel(job.domain, timeout=timeout))
        attach(job, first_round=0)
        return job

    @property
    def domain(self) -> tuple[int, ...]:
        """Every rank the job counts on: the grid's and the spares, ascending."""
        return tuple(sorted(set(self.layout.ranks) | set(self.spares)))

    def counts_on(self, rank: int) -> bool:
        """Whether ``rank`` is a rank of the job (the grid's or a spare): O(log runs), not O(world).

        >>> ResilientJob.of_grid(HyperCommGrid([2], ["dp"], world_size=4), spares=[3]).counts_on(3)
        True
        """
        return self.layout.contains(rank) or rank in self.spares

    @property
    def world(self) -> Optional[dist.ProcessGroup]:
        """A group over the grid's ranks in the grid's order, for code that would use the default group
        (which counts spares and lost ranks); made on first use, by every rank of the grid alike, None
        outside the grid. Example, as
        rank 1 of a 6-rank job on torch's fake backend (ranks 4 and 5 spares)::

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
        layout = self.layout
        if (dist.is_initialized() and layout.rank_map is None and layout.rank_offset == 0
                and layout.size == dist.get_world_size()):
            return dist.group.WORLD  # the grid is the whole world in order: every rank is in it
        return self._own_group("_world", world_grid, "world", group_desc="HYPERGRID_JOB_WORLD")

    @property
    def replica_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's group along ``settings.replica_dim``: the peers that hold the same state. Made on
        first use, by every rank of the grid alike, None outside the grid; ValueError where ``replica_dim`` is not a dim of the grid.
        Example, as rank 1 of a 6-rank job on torch's fake backend (ranks 4 and 5 spares)::

            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=6)
            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"]), spares=[4, 5],
            ...                            settings=RecoverySettings(gpus_per_node=2))
            >>> dist.get_process_group_ranks(job.replica_group)
            [1, 3]
            >>> job.destroy(); dist.destroy_process_group()
        """
        if not dist.is_initialized() or not self.in_grid:
            return None
        dim = self.settings.replica_dim
        if dim not in self.layout.dim_names:
            raise ValueError(f"the job's replica_dim {dim!r} is not a dim of its grid {list(self.layout.dim_names)}; "
                             f"set RecoverySettings(replica_dim=...) to the dim along which state is replicated")
        return self._own_group("_replicas", job_grid, dim, group_desc="HYPERGRID_JOB_REPLICAS")

    @property
    def copy_group(self) -> Optional[dist.ProcessGroup]:
        """Like :attr:`world` but a communicator of its own, for partner copies: over NCCL it is another
        stream, so a copy in flight does not hold back the step's collectives. Made on first use,
        by every rank of the grid alike.
        Example, as rank 1 of a 6-rank job on torch's fake backend (ranks 4 and 5 spares)::

            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=6)
            >>> after = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"]), spares=[4, 5],
            ...                              settings=RecoverySettings(gpus_per_node=2)).recover(failed=[2, 3])
            >>> dist.get_process_group_ranks(after.copy_group), after.copy_group is after.world
            ([0, 1, 4, 5], False)
            >>> after.destroy(); dist.destroy_process_group()
        """
        return self._own_group("_copies", world_grid, "world", private=True, group_desc="HYPERGRID_JOB_COPIES")

    def _own_group(self, field: str, grid_of: Callable[[GridLayout], HyperCommGrid], dims: str,
                   **options: Any) -> Optional[dist.ProcessGroup]:
        """The group of the grid kept in ``field`` (made by ``grid_of`` on first use); None outside the grid."""
        if not dist.is_initialized() or not self.in_grid:
            return None
        grid = getattr(self, field)
        if grid is None:
            grid = grid_of(self.layout)
            object.__setattr__(self, field, grid)
        return grid.get_or_create_pg(dims, timeout=self.group_timeout, **options)

    @property
    def group_timeout(self) -> timedelta:
        """The collective timeout of the job's own groups (:attr:`world`, :attr:`replica_group` and
        :attr:`copy_group`): the longest of the groups the job makes (its grid's ``create_pg`` timeouts,
        Megatron's ``distributed_timeout_minutes``), not the default group's, which on gloo is 30 minutes
        unless set. A rank lost where nobody can abort (gloo) costs its peers at most this long in them.
        Example, as rank 0 of a 4-rank job on torch's fake backend::

            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
            >>> grid = HyperCommGrid([2, 2], ["tp", "dp"])
            >>> _ = grid.create_pg("tp", timeout=timedelta(seconds=20))
            >>> _ = grid.create_pg("dp", timeout=timedelta(seconds=20))
            >>> job = ResilientJob.of_grid(grid, settings=RecoverySettings(gpus_per_node=2))
            >>> job.group_timeout, dist.get_process_group_ranks(job.world)
            (datetime.timedelta(seconds=20), [0, 1, 2, 3])
            >>> grid.destroy(); dist.destroy_process_group()
        """
        return self.recipe.longest_timeout() or longest_collective(None)

    def let_go_job_groups(self) -> None:
        """Destroy the groups of :attr:`world`, :attr:`replica_group` and :attr:`copy_group`."""
        for grid in (self._world, self._replicas, self._copies):
            if grid is not None:
                grid.destroy()

    @property
    def generation(self) -> int:
        """How many recoveries of the job have committed."""
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
        """Where ``rank`` (default: this rank), placed by the latest recovery, copies its state from: the
        first replica peer that was there before (None: ``rank`` was there, or no peer was: load a checkpoint).
        Example, as rank 8 (a spare) of 10 on torch's fake backend: it takes rank 5's place and copies
        from rank 7, its data-parallel peer::

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
        """The ranks placed by the latest recovery: they hold no model state yet.

        >>> ResilientJob.of_grid(HyperCommGrid([2], ["dp"], world_size=2)).arrived()
        frozenset()
        """
        last = self.last
        if last is None:
            return frozenset()
        return frozenset({new for _, new in last.replaced} | set(last.joined))

    def recover(self, *, failed: Optional[Sequence[int]] = None, timeout: Optional[timedelta] = None,
                step: Optional[int] = None, gpus_per_node: Optional[int] = None,
                replica_dim: Optional[str] = None) -> ResilientJob:
        """The job after the failure that just happened, on every survivor (spares too); its state is
        None off the new placement. ``failed``: given where every rank knows them alike, else agreed
        through the store. ``step``: where this rank resumes; the job carries the least given.
        ``timeout``: default the job's, plus, in the first round, the longest collective timeout.

        Raises:
            RecoveryRefused: no placement fits (too few spares, no replica to drop); on every survivor.
            ExcludedByRecovery: this rank was found failed (it came too late, or hung).
            RecoveryError: the survivors did not commit a placement before the deadline; on every survivor.
        """
        timeout, step = self._call_args("recover", timeout, step, gpus_per_node, replica_dim)
        if failed is not None:
            world = dist.get_world_size() if dist.is_initialized() else max(self.domain) + 1
            lost = _ranks_arg("failed", failed, world)
            if not lost:
                raise ValueError("failed must name at least one rank of the job, got none")
            outside = [r for r in lost if not self.counts_on(r)]
            if outside:
                raise ValueError(f"failed ranks {outside} are not ranks of the job {describe_ranks(self.domain)}")
            return recover_known(self, lost, timeout)
        if not agreement_possible() or self.channel is None:
            raise RecoveryError("hypergrid: agreeing on failed ranks needs the job's store (a gloo or NCCL job made "
                                "with ResilientJob.of_grid or of_megatron, not the fake backend); pass failed= instead")
        return run_rounds(self, timeout, step, "recover")

    def grow(self, *, timeout: Optional[timedelta] = None, step: Optional[int] = None,
             gpus_per_node: Optional[int] = None, replica_dim: Optional[str] = None) -> ResilientJob:
        """Add replicas of waiting spares back along the replica dim, up to the size it was made with; every rank of
        the grid calls it at the same point, while the spares wait in :meth:`wait_as_spare`. Example,
        with no process group (nobody to grow with)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=4))
            >>> job.grow() is job
            True
        """
        timeout, step = self._call_args("grow", timeout, step, gpus_per_node, replica_dim)
        if not agreement_possible() or self.channel is None:
            return self
        return run_rounds(self, timeout, step, "grow")

    def wait_as_spare(self, *, timeout: timedelta = DEFAULT_TIMEOUT, recovery_timeout: Optional[timedelta] = None,
                      gpus_per_node: Optional[int] = None, replica_dim: Optional[str] = None) -> ResilientJob:
        """On a spare: take part in recoveries until this rank holds a position, ``timeout`` passes or
        the job releases its spares; the job. No CPU while it waits. Example, with no process group::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
            >>> job.wait_as_spare(timeout=timedelta(seconds=0.1)) is job
            True
        """
        timeout, recovery_timeout, plane = self._spare_args("wait_as_spare", timeout, recovery_timeout,
                                                            gpus_per_node, replica_dim)
        job = self
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
                logger.info("rank %d: a recovery this spare took part in failed; waiting on: %s", dist.get_rank(), exc)
        return job

    def offer(self, *, timeout: timedelta = DEFAULT_TIMEOUT, recovery_timeout: Optional[timedelta] = None,
              gpus_per_node: Optional[int] = None, replica_dim: Optional[str] = None) -> ResilientJob:
        """On a rank the job counted out (:class:`~hypergrid.errors.ExcludedByRecovery`), fit again:
        offer it as a spare and wait like one. Example, with no process group (nobody to offer to)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6))
            >>> job.offer(timeout=timedelta(seconds=0.1)) is job
            True
        """
        timeout, recovery_timeout, plane = self._spare_args("offer", timeout, recovery_timeout,
                                                            gpus_per_node, replica_dim)
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
                continue  # the job moved on before this offer was seen: offer again
            except (RecoveryError, RecoveryRefused) as exc:
                logger.info("rank %d: a recovery this rank offered itself to failed; offering again: %s",
                            dist.get_rank(), exc)
                continue
            left = timedelta(seconds=max(0.001, end - time.monotonic()))
            return job.wait_as_spare(timeout=left, recovery_timeout=recovery_timeout)
        return job.as_stored()

    def as_stored(self) -> ResilientJob:
        """This job as the store's latest committed record has it (without a store, as it is). Example,
        with no process group::

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
            self.destroy()  # groups of a placement that is gone
            stored = dataclasses.replace(stored, state=None)
        return stored

    def destroy(self) -> None:
        """Let go of the job's groups on this rank (its state's and its own). Idempotent. Example, as
        rank 0 of a 4-rank job on torch's fake backend::

            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"]))
            >>> job.destroy(); job.destroy()
            >>> dist.destroy_process_group()
        """
        self.let_go_job_groups()
        if self.channel is not None:
            detach()
        if isinstance(self.state, HyperCommGrid):
            self.state.destroy()
        elif self.state is not None:
            from ..megatron import destroy_model_parallel  # megatron-core is needed only here

            destroy_model_parallel()

    def release_spares(self) -> None:
        """On any rank once training is over: the spares in :meth:`wait_as_spare` return at once. Example,
        with no process group (nobody waits)::

            >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
            >>> job.release_spares()
        """
        plane = control_plane()
        if self.channel is not None and plane is not None:
            release_spares(self.channel, plane)
            detach()  # the job is over for this rank: its end is nobody's loss

    def _call_args(self, call: str, timeout: Optional[timedelta], step: Optional[int], gpus_per_node: Optional[int],
                   replica_dim: Optional[str]) -> tuple[timedelta, Optional[int]]:
        timeout = _checked_timeout("timeout", self.timeout if timeout is None else timeout)
        if step is not None:
            step = as_int(step, "step")
            if step < 0:
                raise ValueError(f"step must be >= 0, got {step}")
        self.settings.with_call(call, gpus_per_node=gpus_per_node, replica_dim=replica_dim)
        return timeout, step

    def _spare_args(self, call: str, timeout: timedelta, recovery_timeout: Optional[timedelta],
                    gpus_per_node: Optional[int], replica_dim: Optional[str]
                    ) -> tuple[timedelta, timedelta, Optional[ControlPlane]]:
        timeout = _checked_timeout("timeout", timeout)
        recovery_timeout = _checked_timeout("recovery_timeout", recovery_timeout or self.timeout)
        self.settings.with_call(call, gpus_per_node=gpus_per_node, replica_dim=replica_dim)
        return timeout, recovery_timeout, control_plane()


def _checked_timeout(name: str, value: object) -> timedelta:
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a datetime.timedelta, got {type(value).__name__} {value!r}")
    return check_timeout(name, value)


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
