"""A recovery as rounds: each participant arrives, agrees, attempts the plan, until a round commits.

Every participant computes the same plan from the verdict (:func:`plan_for`); the new placement's
ranks rebuild in a world step whose outcome is the round's end. A round that does not commit
leaves the state from before, and the next one starts, until the deadline.

Example, with no process group (the failed set given, as one simulated rank knows it)::

    >>> from hypergrid import HyperCommGrid, ResilientJob
    >>> from hypergrid.recovery.settings import RecoverySettings
    >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5],
    ...                            settings=RecoverySettings(gpus_per_node=2))
    >>> plan_for(job, FailureVerdict((3,), 0)).describe()
    'replace: rank 3 -> 4; 1 spares left'
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ..errors import ExcludedByRecovery, RecoveryError, RecoveryRefused, StoreUnresponsiveError
from ..layout import GridLayout
from ..layout.describe import describe_ranks, one_line
from ..layout.rank_map import RankMap
from ..layout.replan import RecoveryKind, RecoveryPlan, plan_growth, plan_recovery
from ..liveness.board import BoardView
from ..liveness.calls import NodeChannel
from ..liveness.config import JobSpec
from ..liveness.heartbeat import running_heartbeat
from ..liveness.plane import control_plane
from ..liveness.ring import as_runs
from ..runtime.registry import REGISTRY
from ..store import meeting
from ..store.client import StoreClient
from ..store.keys import Meeting
from ..store.meeting import Place
from ..store.records import Arrival, FailureVerdict, JobRecord, StepOutcome, decode, encode
from .abort import CollectiveWatch, recovering, take_aborted
from .rebuild import REBUILD_LABEL, build, let_go, reset_megatron_if, restore
from .recipes import GridRecipe, longest_collective
from .round import RecoveryRound, board_view

__all__ = ["RecoveryTimes", "run_rounds", "recover_known", "plan_for", "after", "synced", "attach", "detach"]

logger = logging.getLogger(__name__)


def recover_known(job: Any, lost: tuple[int, ...], timeout: timedelta) -> Any:
    """A recovery from a failed set every rank knows alike: no round, one attempt."""
    verdict = FailureVerdict(lost, -1)
    plan = plan_for(job, verdict)
    if plan.kind is RecoveryKind.REPAIR and not plan.failed:
        return dataclasses.replace(job, spares=plan.spares_left)
    deadline = time.monotonic() + timeout.total_seconds()
    state = build(job, plan, verdict, deadline, attempt=None, scope=None)
    let_go(job.state, keep=state)
    return after(job, plan, verdict, state, record(job, plan, verdict, None))


def run_rounds(job: Any, timeout: timedelta, step: Optional[int], reason: str) -> Any:
    """``job`` after rounds of its recovery until one commits; ``reason``: ``"recover"``, ``"grow"`` or
    ``"wait"`` (a spare)."""
    assert job.channel is not None
    plane = control_plane()
    assert plane is not None
    rank, settings = dist.get_rank(), job.settings
    beat = running_heartbeat()
    # The staleness bound and the board's delivery: by then a lost rank is on the board.
    bound = (longest_collective(job.collective_timeout).total_seconds() + settings.arrival_margin_s
             + ((beat.stale_beats + 1) * beat.interval_s if beat is not None else timeout.total_seconds()))
    entered = time.monotonic()
    deadline = entered + timeout.total_seconds() + bound
    first = True
    board: Optional[BoardView] = None
    with recovering():
        while True:
            rnd = RecoveryRound.open(job.channel, plane, max(deadline, time.monotonic() + bound), ahead=job.record,
                                     node=NodeChannel(beat))
            if board is None:
                # From the latest commit's entry (no job rank is lost before it); heard before this rank
                # arrives, so before the leader looks.
                board = board_view(job.channel, plane, rnd.record.board_from if rnd.record else 0)
                if beat is not None:
                    board.hear_from(beat)
            job = synced(job, rnd.record, rnd.number)
            offered = [r for r in rnd.offers if not job.counts_on(r)]
            if not job.counts_on(rank) and rank not in offered:
                why = [line for line in (rnd.record.gone if rnd.record else ()) if line.startswith(f"rank {rank}:")]
                raise ExcludedByRecovery(
                    f"hypergrid: rank {rank} is no longer a rank of the job: the survivors recovered without "
                    f"it ({why[-1] if why else 'it did not come'}; the grid is on "
                    f"{describe_ranks(list(job.layout.ranks))}, spares {describe_ranks(job.spares)}); "
                    f"ResilientJob.offer() offers it again")
            arrival = Arrival(rank, step, reason, tuple(take_aborted()), settings.describe())
            try:
                verdict = rnd.agree(job.domain, arrival, bound_s=bound, board=board, offers=offered, settings=settings)
                agreed = time.monotonic()
                if first:
                    deadline, first = time.monotonic() + timeout.total_seconds(), False
                # A round agreed late (after ranks left a failed attempt) gets what the first one got.
                attempt_deadline = max(deadline, time.monotonic() + min(timeout.total_seconds(), bound))
                rnd.store.deadline = attempt_deadline
                committed, state, message = attempt(job, rnd, verdict, attempt_deadline, board)
            except ExcludedByRecovery:
                raise  # the others go on in this round, and close it
            except BaseException:
                rnd.close()  # so that a retry, or a spare's next wait, meets in a round of its own
                raise
            if committed:
                return dataclasses.replace(state, times=RecoveryTimes(agreed - entered, time.monotonic() - agreed))
            rnd.close()
            logger.warning("rank %d: %s did not commit: %s", rank, rnd.name, message)
            if time.monotonic() >= deadline:
                # Those that went on into the next round wait there for this rank: they raise too.
                following = RecoveryRound(job.channel, plane, rnd.number + 1, plane.client(time.monotonic() + 5.0),
                                          rnd.state, rnd.raw_state)
                following.abandon(f"rank {rank} reached its deadline", board)
                following.close()
                raise RecoveryError(
                    f"hypergrid: the recovery did not commit a placement within its timeout "
                    f"({timeout.total_seconds():g} s after the survivors first agreed); the last attempt "
                    f"failed: {message}")


@dataclass(frozen=True)
class RecoveryTimes:
    """How long this rank's part of a recovery took: from arrival to the committing round's verdict
    (``agreed_s``, earlier rounds included), and from that verdict to the commit (``rebuilt_s``)."""

    agreed_s: float
    rebuilt_s: float


@dataclass
class _RebuildScope:
    """One round's rebuild as a :class:`~hypergrid.runtime.scope.RecoveryScope`: the job's board, and
    the round's commit once the rebuild's success stands."""

    board: BoardView
    rnd: RecoveryRound
    new_record: JobRecord
    fallback_s: float
    rank: int = field(default_factory=dist.get_rank)

    @property
    def hearing(self) -> bool:
        return self.board.hearing

    def lost_among(self, ranks: Collection[int]) -> list[int]:
        return self.board.lost_among(ranks)

    def on_loss(self, ranks: Collection[int], callback: Callable[[list[int]], None]) -> AbstractContextManager[None]:
        return self.board.on_loss(ranks, callback)

    def heard(self, key: str, seconds: float) -> Optional[bytes]:
        return self.board.heard(key, seconds)

    def publish(self, key: str, value: bytes) -> None:
        self.board.publish(key, value, self.rank)

    def arrive(self, store: StoreClient, at: Meeting, size: int) -> Place:
        return self.rnd.node.arrive(store, at, size, again=False)

    def succeeded(self, key: str) -> None:
        if key == self.rnd.keys.rebuild(REBUILD_LABEL).outcome:
            self.rnd.commit(self.new_record)


def attempt(job: Any, rnd: RecoveryRound, verdict: FailureVerdict, deadline: float,
            board: BoardView) -> tuple[bool, Any, str]:
    """One attempt at the round's plan: (committed, the new job where it did, why not where not)."""
    rank = dist.get_rank()
    plan = plan_for(job, verdict)  # RecoveryRefused: alike on every participant
    logger.info("rank %d: %s: %s", rank, rnd.name, plan.describe())
    new_record = record(job, plan, verdict, rnd.record)
    # A growth with no replica to add, nobody failed or aborted: nothing moves; its leader records it.
    if (plan.kind is RecoveryKind.REPAIR and verdict.grow and not verdict.recovering and not verdict.failed
            and not verdict.aborted_by):
        if rank == verdict.decided_by:
            rnd.commit(new_record)
        return True, after(job, plan, verdict, job.state, new_record), ""
    new_state: Any = None
    if plan.new.contains(rank):
        try:
            new_state = build(job, plan, verdict, deadline, attempt=rnd.keys.base,
                              scope=_RebuildScope(board, rnd, new_record, float(job.settings.outcome_fallback_s)))
        except RecoveryRefused:
            restore(job)
            raise
        except Exception as exc:
            restore(job)
            why = f"{type(exc).__name__}: {one_line(str(exc), 400)}"
            # It may have failed before the rebuild's world step could say so (the probe): tell those outside.
            _end_rebuild(rnd, board, StepOutcome(rank, why))
            return False, None, f"rank {rank}: {why}"
    else:
        reset_megatron_if(job.recipe)
        ended = _rebuild_outcome(rnd, board, job.settings.outcome_fallback_s)
        if ended.failed is not None or ended.lost or ended.timed_out is not None:
            restore(job)
            return False, None, _why_not(ended)
    if new_state is not job.state:
        let_go(job.state, keep=new_state)
    return True, after(job, plan, verdict, new_state, new_record), ""


def _end_rebuild(rnd: RecoveryRound, board: BoardView, outcome: StepOutcome) -> None:
    """Make ``outcome`` the round's end unless one stands, and tell the job's ranks."""
    rebuild = rnd.keys.rebuild(REBUILD_LABEL)
    with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
        rnd.store.extend(2.0)
        encoded = encode(outcome).encode()
        if meeting.decide(rnd.store, rebuild, encoded) == encoded and board.hearing:
            board.publish(rebuild.outcome, encoded, dist.get_rank())


def _rebuild_outcome(rnd: RecoveryRound, board: BoardView, fallback_s: float) -> StepOutcome:
    """How the round's rebuild ended, for a participant outside the new placement: heard or read
    until the deadline, when this rank ends it unless an outcome stands."""
    rebuild = rnd.keys.rebuild(REBUILD_LABEL)
    raw = meeting.wait_outcome(rnd.store, rebuild, rnd.store.remaining(), board if board.hearing else None, fallback_s)
    if raw is None:
        _end_rebuild(rnd, board, StepOutcome(None, timed_out=dist.get_rank()))
        raw = rnd.store.get(rebuild.outcome)
    return decode(StepOutcome, raw)


def _why_not(ended: StepOutcome) -> str:
    if ended.failed is not None:
        return f"rank {ended.failed} failed to rebuild: {ended.error}"
    if ended.lost:
        return f"ranks {describe_ranks(list(ended.lost))} were lost while the new placement was rebuilt"
    return f"rank {ended.timed_out} reached its deadline before every rank of the new placement had rebuilt"


def plan_for(job: Any, verdict: FailureVerdict) -> RecoveryPlan:
    """The placement after ``verdict``, alike on every participant: spares replace the failed ranks or
    their replicas are dropped, nobody failed is a repair, and a growth adds replicas."""
    gpus_per_node, replica_dim = job.settings.gpus_per_node, job.settings.replica_dim
    failed = set(verdict.failed)
    lost = [r for r in verdict.failed if job.layout.contains(r)]
    offered = [r for r in verdict.offered if not job.counts_on(r)]
    spares = [s for s in job.spares if s not in failed] + offered
    if lost:
        plan = plan_recovery(job.layout, lost, spares, replica_dim=replica_dim, gpus_per_node=gpus_per_node)
    else:
        plan = RecoveryPlan(RecoveryKind.REPAIR, job.layout, job.layout, (), spares_left=tuple(spares))
    if not verdict.grow or replica_dim not in job.layout.dim_names:
        return plan
    axis = job.layout.dim_names.index(replica_dim)
    pool = sorted(set(plan.spares_left) | set(plan.dropped))
    grown = plan_growth(plan.new, job.made_shape[axis], pool, replica_dim=replica_dim)
    if grown.kind is not RecoveryKind.GROW:
        return plan
    if isinstance(job.recipe, GridRecipe) and job.recipe.views:
        return plan  # how a view's dims grow is not known here, as for a shrink
    return RecoveryPlan(RecoveryKind.GROW, job.layout, grown.new, plan.failed, plan.replaced,
                        tuple(r for r in plan.dropped if r not in set(grown.joined)),
                        tuple(r for r in grown.spares_left if r not in set(plan.dropped)), grown.joined)


def record(job: Any, plan: RecoveryPlan, verdict: FailureVerdict, before: Optional[JobRecord]) -> JobRecord:
    """The store's record of ``job`` after ``plan`` (``before``: the record it follows); the next
    recovery reads the board from where the leader had read it for ``verdict``."""
    spares = tuple(sorted(set(plan.spares_left) | set(plan.dropped)))
    runs = (plan.new.rank_map or RankMap.contiguous(plan.new.rank_offset, plan.new.size)).runs
    gone = (before.gone if before is not None else ()) + verdict.reasons
    return JobRecord(job.generation + 1, tuple(plan.new.shape), tuple(plan.new.dim_names), runs, spares,
                     verdict.step, gone, board_from=verdict.board_read)


def after(job: Any, plan: RecoveryPlan, verdict: FailureVerdict, state: Any, committed: JobRecord) -> Any:
    """``job`` after ``plan`` committed as ``committed``, with this rank's new ``state``."""
    recoveries = job.recoveries if plan.kind is RecoveryKind.REPAIR else job.recoveries + (plan,)
    moved = plan.new != job.layout
    if moved:
        job.let_go_job_groups()  # the old placement's: the new one's are made when asked for
    elif job._copies is not None:
        job._copies.destroy()  # a copy cut short by the failure may still be posted on it: made anew
    job = dataclasses.replace(job, layout=plan.new, spares=committed.spares, state=state, recoveries=recoveries,
                              record=committed, step=verdict.step, next_round=verdict.round + 1,
                              _world=None if moved else job._world, _replicas=None if moved else job._replicas,
                              _copies=None)
    if job.channel is not None:
        attach(job, first_round=verdict.round + 1)
    return job


def synced(job: Any, committed: Optional[JobRecord], next_round: int = 0) -> Any:
    """This job as the store's latest committed record says (where this rank missed an end), taking
    part in rounds from ``next_round`` on."""
    if next_round > job.next_round:
        job = dataclasses.replace(job, next_round=next_round)
    if committed is None or committed.generation <= job.generation:
        return job
    layout = GridLayout(committed.shape, committed.dim_names, rank_map=RankMap(committed.runs))
    logger.warning("rank %d: the job moved on without this rank's knowledge: now on %s", dist.get_rank(),
                   describe_ranks(list(layout.ranks)))
    job.let_go_job_groups()
    return dataclasses.replace(job, layout=layout, spares=committed.spares, record=committed, step=committed.step,
                               _world=None, _replicas=None, _copies=None)


_collective_watch: Optional[CollectiveWatch] = None


def attach(job: Any, first_round: int) -> None:
    """Serve ``job`` on this rank's control plane: its monitor watches the job's ring, and the
    collective watch aborts on board events of rounds from ``first_round`` on."""
    global _collective_watch
    if _collective_watch is not None:
        _collective_watch.active = False
    beat, plane = running_heartbeat(), control_plane()
    if job.channel is None or beat is None or plane is None:
        _collective_watch = None
        return
    beat.attach(JobSpec(job.channel, tuple(as_runs(job.domain)), job.settings.gpus_per_node,
                        job.settings.nodes_per_reader))
    # The grid's ranks only: a spare is in no communicator, and one released that exits at once
    # must not abort the collectives of members still at work.
    _collective_watch = CollectiveWatch(job.channel, ranks=job.layout.ranks, first_round=first_round,
                                        groups=REGISTRY.groups)
    beat.listen("collective watch", _collective_watch)


def detach() -> None:
    """This rank no longer serves its job: its end is nobody's loss, and no event aborts anything."""
    global _collective_watch
    if _collective_watch is not None:
        _collective_watch.active = False
        _collective_watch = None
    beat = running_heartbeat()
    if beat is not None:
        beat.release()
