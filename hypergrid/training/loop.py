"""Training that survives the loss of ranks, in one call: :func:`train`.

The user gives the job, a ``setup`` that builds a rank's :class:`TrainingState` (model,
optimizers, scheduler, data sampler) on the job's groups, and a ``step`` that trains one step;
:func:`train` runs the steps on every rank, spares included, and owns everything a failure
asks for:

- **Snapshots and a commit gate.** After every ``snapshot_every`` steps the ranks of the grid
  meet (one all-reduce of one number over :attr:`ResilientJob.world`), then each copies its state
  to host memory. A rank takes a snapshot only after every rank took the one before, so no rank
  is ever a snapshot ahead of another, and each holds the two that a recovery may roll back to:
  the one every rank took and its latest.
- **A failure.** A step (or a gate) that raises because a peer is gone makes every survivor call
  :func:`~hypergrid.recovery.recover` with the step of its latest snapshot; the job carries the
  least, and every rank rolls back to it: from its own snapshot, or, on a rank that just took a
  position, from a surviving peer of its replica group; where the grid's shape changed, every
  rank's shards cut from the old ones (:mod:`hypergrid.training.regions`).
- **Outside the grid.** A spare waits until a recovery gives it a position, a rank whose replica
  was dropped waits as a spare, and a rank counted out (it hung) offers itself again; each
  calls ``setup`` when it takes a position, and gets its state from a peer.
- **Growing back.** Every ``grow_every`` steps the grid takes back dropped replicas from the
  ranks waiting (:func:`~hypergrid.recovery.grow`).
- **Records.** Each recovery is timed in parts on every rank (:class:`RecoveryRecord`), logged
  in one line, kept on the run and handed to ``on_recovery``.
- **Partner copies** (``partner_copies=True``, for state no replica peer holds: FSDP2 or ZeRO
  shards). Each snapshot is taken with a digest of every tensor and sent to the rank's partner on
  another node (:mod:`hypergrid.training.partner`) over :attr:`ResilientJob.copy_group`, in
  flight while the next steps run and waited for before the next gate; after a recovery the
  copies serve the blocks of the ranks lost, checked against their digests before anything is
  restored. Where no copy survived (a rank lost with
  its partner), ``loader(job, state)`` is called on every rank of the grid and the job resumes
  from the step it returns; without one, :class:`~hypergrid.errors.RecoveryRefused` names the
  positions lost, on every rank.

A failure is an exception of torch's (a ``RuntimeError``: gloo's and NCCL's errors are); one
that comes back at the same step ``retries`` times with nobody lost is the user's and is raised.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ..errors import ExcludedByRecovery, RecoveryError, RecoveryRefused
from ..grid import HyperCommGrid
from ..layout import GridLayout
from ..mesh import MeshShapeChangedError, refresh_fully_shard, refresh_meshes
from ..recovery import ResilientJob, grow, recover
from .partner import PartnerCopies, partner_map
from .records import RecoveryRecord
from .regions import Held, Placement, RelayPlan, Wanted
from .restore import GroupExchange, first_corrupted, gathered, plan_from_reports, plan_own_part
from .routes import Routes
from .state import Snapshot, TrainingState
from .transfer import collective_device, relay
from .wrapped import OnGroup, ddp_without_init_sync, on_groups, warm_up

__all__ = ["train", "TrainingRun", "Setup", "Step", "Loader"]

logger = logging.getLogger(__name__)

#: Builds this rank's state on the job's groups, when it takes a position (at the start, or later).
Setup = Callable[[ResilientJob], TrainingState]
#: Trains one step: ``step(job, state, step_number)``; what it returns is kept as the step's loss.
Step = Callable[[ResilientJob, TrainingState, int], Any]
#: Loads a checkpoint into this rank's state where no copy survived: ``loader(job, state)``, on
#: every rank of the grid; returns the step the checkpoint is of (alike on every rank).
Loader = Callable[[ResilientJob, TrainingState], int]


@dataclass
class TrainingRun:
    """What :func:`train` leaves on a rank: the job (``job.in_grid`` False on a rank that ended
    outside the grid), its state (None there), the steps done, each step's loss as ``step``
    returned it (the last attempt's, on the ranks that ran it) and the recoveries' records."""

    job: ResilientJob
    state: Optional[TrainingState]
    step: int
    losses: dict[int, Any] = field(default_factory=dict)
    records: list[RecoveryRecord] = field(default_factory=list)


def train(job: ResilientJob, setup: Setup, step: Step, *, steps: int, first_step: int = 0, snapshot_every: int = 1,
          grow_every: Optional[int] = None, wait_timeout: timedelta = timedelta(hours=24),
          on_recovery: Optional[Callable[[RecoveryRecord], None]] = None, retries: int = 3,
          partner_copies: bool = False, loader: Optional[Loader] = None) -> TrainingRun:
    """Train from ``first_step`` (where ``setup`` loaded a checkpoint, say) up to ``steps`` on
    every rank of ``job`` (spares too), through failures.

    ``partner_copies``: each snapshot, with its digests, also held by the rank's partner on the
    next node (for state that no replica peer holds, such as FSDP2's or ZeRO's shards; set
    ``RecoverySettings.replica_dim`` to the dim along which state is replicated, or to a name
    the grid does not have where none is). ``loader(job, state) -> step``: called on every rank
    of the grid where a position's state survived nowhere (it and its copy lost together, or a
    copy that failed its digest); the job resumes from the step it returns. A loader, or a
    checkpoint saved inside ``step``, uses ``job.world`` as its process group (the default group
    counts the spares and the lost ranks too).

    ``setup`` runs on a rank as it takes a position (at the start, or a spare later), and again on
    a rank whose state cannot be carried onto the new groups: DeviceMeshes on a grid that changed
    shape, a DDP model whose group changed, a ZeRO optimizer whose group changed size. There, a
    ``DistributedDataParallel`` it makes skips its start's collectives (the snapshot is restored
    into it next), so nobody who does not run ``setup`` has to join them. Draws from torch's
    generator (dropout) must be alike along the replica dim: seed by the other coordinates, never
    by the global rank. When training ends, the spares are released: their ``train`` returns with
    ``run.job.in_grid`` False.

    Example, as the one rank of a job with nobody to lose (a rank of a real job calls the same)::

        >>> import torch, torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> import hypergrid
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        >>> job = hypergrid.ResilientJob.of_grid(hypergrid.HyperCommGrid([1], ["dp"]))
        >>> def setup(job):
        ...     model = torch.nn.Linear(2, 1)
        ...     return TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> def one_step(job, state, step):
        ...     (model,), (optimizer,) = state.models, state.optimizers
        ...     loss = model(torch.ones(1, 2)).pow(2).sum()
        ...     loss.backward(); optimizer.step(); optimizer.zero_grad()
        ...     return loss.item()
        >>> run = train(job, setup, one_step, steps=3)
        >>> run.step, len(run.losses), run.records
        (3, 3, [])
        >>> job.destroy(); dist.destroy_process_group()

    Raises:
        TypeError: a job that is not a :class:`ResilientJob`, a ``setup`` or ``step`` that is not
            callable, a count that is not an int, a ``setup`` that returns no TrainingState.
        ValueError: a count out of range, a ``grow_every`` that is not a multiple of
            ``snapshot_every``, a model whose parameters are on ranks outside the job's grid,
            ``partner_copies`` on a grid of one node.
        RecoveryRefused, RecoveryError: from the recovery (no placement fits; none committed;
            a position's state survived nowhere and no ``loader`` was given).
        SnapshotCorrupted: a snapshot or copy to restore failed its digest and no ``loader`` was
            given (on every rank, naming the rank, step and key).
    """
    if not isinstance(job, ResilientJob):
        raise TypeError(f"job must be a hypergrid ResilientJob, got {type(job).__name__}")
    for name, value in (("setup", setup), ("step", step)):
        if not callable(value):
            raise TypeError(f"{name} must be callable, got {type(value).__name__} {value!r}")
    for name, count, least in (("steps", steps, 0), ("first_step", first_step, 0), ("snapshot_every", snapshot_every, 1),
                               ("retries", retries, 0), ("grow_every", grow_every, 1)):
        if count is None and name == "grow_every":
            continue
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"{name} must be an int, got {type(count).__name__} {count!r}")
        if count < least:
            raise ValueError(f"{name} must be at least {least}, got {count}")
    if grow_every is not None and grow_every % snapshot_every:
        raise ValueError(f"grow_every ({grow_every}) must be a multiple of snapshot_every ({snapshot_every}): "
                         f"the grid grows at a step every rank holds a snapshot of")
    if not isinstance(wait_timeout, timedelta):
        raise TypeError(f"wait_timeout must be a datetime.timedelta, got {type(wait_timeout).__name__}")
    if not isinstance(partner_copies, bool):
        raise TypeError(f"partner_copies must be a bool, got {type(partner_copies).__name__} {partner_copies!r}")
    if loader is not None and not callable(loader):
        raise TypeError(f"loader must be callable (job, state) -> step, got {type(loader).__name__} {loader!r}")
    if partner_copies:
        partner_map(job.layout.ranks, job.settings.gpus_per_node)  # a grid of one node is refused here
    trainer = _Trainer(job, setup, step, steps, snapshot_every, grow_every, wait_timeout, on_recovery, retries)
    trainer.partners = PartnerCopies(job.settings.gpus_per_node) if partner_copies else None
    trainer.loader = loader
    trainer.step = first_step
    return trainer.run()


@dataclass
class _Restoring:
    """A recovery between the job it left and the first step after it."""

    kind: str
    plan: str
    target: int
    failed_step: Optional[int]
    seen_at: float
    seen: float  # time.monotonic() then
    agreed_s: Optional[float]
    rebuilt_s: Optional[float]
    rollback: bool = True  # False: a growth at a committed step, where the survivors' state is current
    rebuilt: bool = False  # this rank's state was built again by setup (it holds nothing yet)
    restored_s: Optional[float] = None
    placed_before: Optional[GridLayout] = None  # where the snapshots restored from were taken
    plan_bytes: Optional[int] = None  # what this rank received to plan its own part
    plan_peers: Optional[int] = None


class _Trainer:
    def __init__(self, job: ResilientJob, setup: Setup, step_fn: Step, steps: int, every: int,
                 grow_every: Optional[int], wait_timeout: timedelta,
                 on_recovery: Optional[Callable[[RecoveryRecord], None]], retries: int) -> None:
        self.job, self.setup, self.step_fn = job, setup, step_fn
        self.steps, self.every, self.grow_every = steps, every, grow_every
        self.wait_timeout, self.on_recovery, self.retries = wait_timeout, on_recovery, retries
        self.state: Optional[TrainingState] = None
        self.step = 0
        self.result = TrainingRun(job, None, 0)
        self.committed: Optional[Snapshot] = None  # this rank's latest snapshot
        self.previous: Optional[Snapshot] = None  # the one before: every rank holds it, and its copies
        self.restoring: Optional[_Restoring] = None
        self.recorded: Optional[_Restoring] = None  # restored, its first step not done
        self.fruitless = 0  # recoveries in a row that found nobody lost
        self._restored_at = 0.0
        self.partners: Optional[PartnerCopies] = None
        self.loader: Optional[Loader] = None
        self.on_groups: list[OnGroup] = []  # the ZeRO optimizers and DDP models made over the grid's groups

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainingRun:
        if self.job.in_grid:
            self._take_position(self.job)
            assert self.state is not None
            self.committed = self.state.capture(self.step, digests=self.partners is not None,
                                                placement=self._placement())
            if self.partners is not None:
                self.partners.start(self.committed, self.job.layout.ranks, self.job.copy_group)
        else:
            self._wait_outside(self.job.wait_as_spare, failed_step=None)
        while self.job.in_grid and self.step < self.steps:
            try:
                if self.restoring is not None:
                    self._restore()
                elif self._growth_due():
                    self._grow()
                assert self.state is not None
                self.result.losses[self.step] = self.step_fn(self.job, self.state, self.step)
                self.step += 1
                if self.step % self.every == 0 or self.step == self.steps:
                    self._checkpoint()
                self.fruitless = 0
                self._close_record()
            except (ExcludedByRecovery, RecoveryError):
                raise
            except RuntimeError as failure:
                self._recover(failure)
        self._close_record()
        if self.job.in_grid:
            if self.partners is not None:
                self.partners.finish()  # the last copies sent: no rank leaves with a send in flight
            world = self.job.world
            if world is not None:
                dist.barrier(group=world)  # every rank of the grid is done before the spares go
            self.job.release_spares()
        self.result.job, self.result.state, self.result.step = self.job, self.state, self.step
        return self.result

    def _take_position(self, job: ResilientJob, *, mid_job: bool = False) -> None:
        """Build this rank's state on ``job``'s groups (at the start, or ``mid_job``: taking a position,
        or on a new shape; a snapshot is restored into it next, so its DDP skips its start's collectives)."""
        with ddp_without_init_sync() if mid_job else contextlib.nullcontext():
            state = self.setup(job)
        if not isinstance(state, TrainingState):
            raise TypeError(f"setup must return a hypergrid TrainingState, got {type(state).__name__}")
        _check_on_job(state, job)
        self.state = state
        self.on_groups = on_groups(state, job.state)

    def _checkpoint(self) -> None:
        """The gate, then this step's snapshot. The ranks of the grid meet (one all-reduce of one
        number) once each holds the partner copies of its latest snapshot: so every rank holds
        that snapshot and its copies, and the one before can go. This step's snapshot is then
        taken into its buffer, and its copies travel while the next steps run."""
        state, partners, world = self.state, self.partners, self.job.world
        assert state is not None
        if partners is not None:
            partners.finish()
        if world is not None:
            dist.all_reduce(torch.zeros(1, device=collective_device(world)), group=world)
        if partners is not None and self.committed is not None:
            partners.settle(self.committed.step)
        if self.previous is not None:
            state.recycle(self.previous)
        self.previous = self.committed
        self.committed = state.capture(self.step, digests=partners is not None, placement=self._placement())
        if partners is not None:
            partners.start(self.committed, self.job.layout.ranks, self.job.copy_group)

    def _latest(self) -> Optional[int]:
        """The step of this rank's latest snapshot: the least over the survivors is one they all
        hold (None: it holds none, having just taken a position; the others' steps decide)."""
        return self.committed.step if self.committed is not None else None

    def _growth_due(self) -> bool:
        return (self.grow_every is not None and self.step % self.grow_every == 0 and self.step > 0
                and self.committed is not None and self.committed.step == self.step and self.recorded is None)

    # ------------------------------------------------------------------ failures
    def _recover(self, failure: RuntimeError) -> None:
        seen_at, seen, failed_step = time.time(), time.monotonic(), self.step
        logger.warning("rank %d: step %d failed (%s); recovering", dist.get_rank(), failed_step,
                       str(failure).splitlines()[0][:200] if str(failure) else type(failure).__name__)
        before = self.job
        if self.partners is not None:
            self.partners.salvage()  # the copies in flight that arrived whole count; the rest are gone
        try:
            job = recover(before, step=self._latest())
        except ExcludedByRecovery as excluded:
            logger.warning("rank %d: %s", dist.get_rank(), excluded)
            self._wait_outside(before.offer, failed_step=failed_step)
            return
        if job.recoveries == before.recoveries and job.layout == before.layout:
            self.fruitless += 1
            if self.fruitless > self.retries:
                raise failure  # nobody was lost: the step itself fails
        self.job = job
        if not job.in_grid:  # its replica was dropped: a spare from now on
            self.state = None
            self._wait_outside(job.wait_as_spare, failed_step=failed_step)
            return
        rebuilt = self._carry_over(before, job)
        times = job.times
        last = job.last
        self.restoring = _Restoring(
            kind=last.kind.value if last is not None else "repair",
            plan=last.describe() if last is not None and job.recoveries != before.recoveries else "nobody lost",
            target=job.step if job.step is not None else self._latest() or 0, failed_step=failed_step,
            seen_at=seen_at, seen=seen, agreed_s=times.agreed_s if times else None,
            rebuilt_s=times.rebuilt_s if times else None, rebuilt=rebuilt,
            placed_before=last.old if last is not None and job.recoveries != before.recoveries else job.layout)

    def _carry_over(self, before: ResilientJob, job: ResilientJob) -> bool:
        """This rank's state onto ``job``'s groups: its DeviceMeshes and FSDP2 modules refreshed in
        place where the grid kept its shape; where it did not (a replica dropped or grown back),
        built again by ``setup`` (the snapshot is restored into it next), as it is where a DDP
        model's group changed or a ZeRO optimizer's changed size; a ZeRO optimizer otherwise is pointed
        at the new grid's group of the same dims. Returns whether the state was built again."""
        old, new = before.state, job.state
        if not isinstance(old, HyperCommGrid) or not isinstance(new, HyperCommGrid) or old is new:
            return False  # a Megatron job: parallel_state is filled anew, and is read each step
        try:
            refreshed = refresh_meshes(old, new)
        except MeshShapeChangedError as changed:
            logger.info("rank %d: building the state again on the new grid: %s", dist.get_rank(), changed)
            self._take_position(job, mid_job=True)
            return True
        if refreshed:
            assert self.state is not None
            for model in self.state.models:
                refresh_fully_shard(model)
        groups = [new.get_pg(made.dims, view=made.view) for made in self.on_groups]
        if any(made.made_again_on(group) for made, group in zip(self.on_groups, groups)):
            self._take_position(job, mid_job=True)
            return True
        for made, group in zip(self.on_groups, groups):  # ZeRO broadcasts its shards over its own group
            if isinstance(zero := made.user, ZeroRedundancyOptimizer):
                zero.process_group, zero.rank, zero.global_rank = group, dist.get_rank(group), dist.get_rank()
        return False

    def _wait_outside(self, wait: Callable[..., ResilientJob], *, failed_step: Optional[int]) -> None:
        """Wait outside the grid (as a spare, or offering this rank again) until given a position."""
        self.state, self.committed, self.previous = None, None, None
        if self.partners is not None:
            self.partners.clear()  # copies of a placement this rank has left
        warm_up()
        job = wait(timeout=self.wait_timeout)
        self.job = job
        if not job.in_grid:
            return
        seen_at, seen = time.time(), time.monotonic()
        self._take_position(job, mid_job=True)
        last = job.last
        self.restoring = _Restoring(
            kind="joined", plan=last.describe() if last is not None else "joined",
            target=job.step if job.step is not None else 0, failed_step=failed_step, seen_at=seen_at, seen=seen,
            agreed_s=None, rebuilt_s=job.times.rebuilt_s if job.times else None, rebuilt=True,
            placed_before=last.old if last is not None else None)

    def _grow(self) -> None:
        seen_at, seen = time.time(), time.monotonic()
        if self.partners is not None:
            self.partners.finish()  # this step's copies, for the plan that re-lays the state
        grown = grow(self.job, step=self.step)
        if grown.layout == self.job.layout:
            self.job = grown
            return
        before, self.job = self.job, grown
        rebuilt = self._carry_over(before, grown)
        last = grown.last
        self.restoring = _Restoring(
            kind="grow", plan=last.describe() if last is not None else "grow", target=self.step, failed_step=None,
            seen_at=seen_at, seen=seen, agreed_s=grown.times.agreed_s if grown.times else None,
            rebuilt_s=grown.times.rebuilt_s if grown.times else None, rollback=False, rebuilt=rebuilt,
            placed_before=last.old if last is not None else before.layout)
        self._restore()

    def _restore(self) -> None:
        """Every rank of the grid at the recovery's step. Each plans only its own part
        (:func:`~hypergrid.training.restore.plan_own_part`: whom it asks for each block of its live
        state and who asks it, from the placements before and after, the partner ring and the
        blocks' sharding; fixed-size all-reduces for the step and the flags); where some rank
        cannot, every rank plans from every rank's report (:meth:`_plan_from_reports`), which also
        names what is missing or corrupted. Snapshots and blocks travel point to point
        (:func:`~hypergrid.training.transfer.relay`)."""
        restoring, job, state = self.restoring, self.job, self.state
        assert restoring is not None and state is not None
        rank, world = dist.get_rank(), job.world
        placement = self._placement()
        mine: dict[tuple[int, int], Snapshot] = {(s.rank if s.rank is not None else rank, s.step): s
                                                 for s in (self.previous, self.committed) if s is not None}
        for copy in self.partners.held() if self.partners is not None else ():
            mine[(copy.rank if copy.rank is not None else -1, copy.step)] = copy
        wanted = state.regions(placement)
        done = None
        if world is not None and restoring.placed_before is not None:
            routes = Routes(restoring.placed_before, job.layout, job.settings.replica_dim,
                            job.settings.gpus_per_node if self.partners is not None else None)
            done = plan_own_part(routes, wanted, mine, restoring.target, GroupExchange(world))
        if done is not None:
            plan, ours, moved = done.plan, done.held, done.moved
            restoring.plan_bytes, restoring.plan_peers = done.traffic.bytes_in, len(done.traffic.peers)
        else:
            reported = self._plan_from_reports(Wanted(rank, placement.coords, wanted), mine)
            if reported is None:
                return
            plan, ours, moved = reported
        own = relay(plan, ours, wanted, world) if world is not None else ours[rank]
        untouched = own is ours.get(rank) and not restoring.rebuilt
        if restoring.rollback or not untouched or own.step != self.step:
            state.restore(own, verify=False)
        for other in (self.previous, self.committed):  # their buffers serve the next snapshot
            if other is not None and other is not own:
                state.recycle(other)
        if not untouched:  # what it restored, as its own snapshot at its new placement
            own = state.capture(plan.step, digests=self.partners is not None, placement=placement)
        self.committed, self.previous, self.step = own, None, plan.step
        restoring.target = plan.step
        if self.partners is not None and moved:  # copies of the new placement before its first step
            self.partners.start(own, job.layout.ranks, job.copy_group)
        self._restored()

    def _plan_from_reports(self, wanted: Wanted, mine: dict[tuple[int, int], Snapshot]
                           ) -> Optional[tuple[RelayPlan, dict[int, Snapshot], bool]]:
        """The plan from every rank's report, where some rank could not derive its own part: the
        plan, the snapshots of its step this rank holds, and whether anything moves; None where
        the job went on from a loader's checkpoint instead (or raises: nothing to resume from)."""
        restoring, job, rank, world = self.restoring, self.job, dist.get_rank(), self.job.world
        assert restoring is not None
        held = [Held(rank, source, step, source != rank, s.coords, s.regions) for (source, step), s in mine.items()]
        plan, everyone = plan_from_reports(wanted, held, restoring.target, job.settings.replica_dim, world)
        if plan.missing:
            self._load_or_refuse(self._describe_missing(plan, everyone))
            return None
        ours = {source: s for (source, step), s in mine.items() if step == plan.step}
        found = [p for p in gathered(first_corrupted(plan, ours, rank), world) if p is not None]
        if found:  # every rank learns of any, and acts alike
            if self.loader is None:
                job.release_spares()
                raise found[0]
            logger.error("rank %d: %s", rank, found[0])
            self._load_or_refuse(str(found[0]))
            return None
        return plan, ours, plan.moves

    def _restored(self) -> None:
        restoring = self.restoring
        assert restoring is not None
        restoring.restored_s = time.monotonic() - restoring.seen - (restoring.agreed_s or 0) - (restoring.rebuilt_s or 0)
        self.recorded, self.restoring = restoring, None
        self._restored_at = time.monotonic()

    def _placement(self) -> Placement:
        return Placement(self.job.layout, dist.get_rank(), self.job.settings.replica_dim)

    def _describe_missing(self, plan: RelayPlan, held: list[Held]) -> str:
        """What no snapshot or copy kept, for a person: the positions of the placement before
        whose state of the plan's step nobody holds (with who held their copies), or else the
        blocks missing."""
        last = self.job.last
        before = last.old if last is not None else self.job.layout
        kept = {h.source for h in held if h.step == plan.step}
        lost = [(position, r) for position, r in enumerate(before.ranks) if r not in kept]
        if not lost:
            return f"no snapshot of step {plan.step} holds all the state the new placement needs: " + "; ".join(
                plan.missing[:4])
        if self.partners is None:
            return (f"no rank holds the state of step {plan.step} of " + ", ".join(
                f"position {position} (rank {r})" for position, r in lost)
                + ": it was lost with every replica peer (give train(partner_copies=True) to keep copies)")
        holders = self._old_partners(self.job)
        return f"no copy of the state of step {plan.step} survived for " + ", ".join(
            f"position {position} (rank {r}, its copy held by rank {holders.get(r, 'none')})" for position, r in lost
        ) + ": each was lost with its partner"

    def _old_partners(self, job: ResilientJob) -> dict[int, int]:
        """Who held each rank's copy on the placement before the latest recovery (for messages)."""
        last = job.last
        try:
            return partner_map(last.old.ranks, job.settings.gpus_per_node) if last is not None else {}
        except ValueError:
            return {}

    def _load_or_refuse(self, reason: str) -> None:
        """On every rank of the grid alike: the user's loader, or RecoveryRefused naming what was lost."""
        job, state, restoring = self.job, self.state, self.restoring
        assert state is not None and restoring is not None
        if self.loader is None:
            job.release_spares()  # the job ends here: no spare should wait for it
            raise RecoveryRefused(f"hypergrid: {reason}; give train(loader=...) to resume from a checkpoint")
        logger.warning("rank %d: %s; resuming from the loader's checkpoint", dist.get_rank(), reason)
        step = self.loader(job, state)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"loader must return the step its checkpoint is of (an int >= 0), got {step!r}")
        steps = gathered(step, job.world)
        if len(set(steps)) > 1:
            raise RecoveryError(f"hypergrid: the loader returned different steps on the grid's ranks: {steps}")
        self.committed = state.capture(step, digests=self.partners is not None, placement=self._placement())
        self.previous, self.step, restoring.target = None, step, step
        if self.partners is not None:  # copies of what was loaded, before the first step from it
            self.partners.clear()
            self.partners.start(self.committed, job.layout.ranks, job.copy_group)
        self._restored()

    def _close_record(self) -> None:
        """The recovery restored before this step is recorded, with its first step's time."""
        done = self.recorded
        if done is None:
            return
        self.recorded = None
        first_step = time.monotonic() - self._restored_at if self.step > done.target else None
        record = RecoveryRecord(kind=done.kind, plan=done.plan, rank=dist.get_rank(), failed_step=done.failed_step,
                                resumed_step=done.target, seen_at=done.seen_at, agreed_s=done.agreed_s,
                                rebuilt_s=done.rebuilt_s, restored_s=max(0.0, done.restored_s or 0.0),
                                first_step_s=first_step, plan_bytes=done.plan_bytes, plan_peers=done.plan_peers)
        self.result.records.append(record)
        logger.info("%s", record.describe())
        if self.on_recovery is not None:
            self.on_recovery(record)


def _check_on_job(state: TrainingState, job: ResilientJob) -> None:
    """A model's DTensor parameters live on meshes over the job's grid."""
    ranks = set(job.layout.ranks)
    for index, model in enumerate(state.models):
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                outside = sorted(set(param.device_mesh.mesh.flatten().tolist()) - ranks)
                if outside:
                    raise ValueError(f"model {index}'s parameter {name!r} lives on a DeviceMesh over ranks {outside} "
                                     f"outside the job's grid {sorted(ranks)}: build the model on the job's groups "
                                     f"(hypergrid.device_mesh(job.state, ...))")
