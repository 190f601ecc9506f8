"""A recovery as rounds: each participant arrives, agrees, attempts the plan, until a round commits.

Every participant of a job's recovery (the survivors of its grid, its spares, ranks offering
themselves) runs :func:`run_rounds`. Round after round (:mod:`hypergrid.control.rounds`) it
arrives, reads the round's one verdict, computes the same plan from it (:func:`plan_for`: spares
replace the failed ranks or the replicas holding them are dropped, nobody lost is a repair, and a
round a grid member started with :meth:`~hypergrid.recovery.ResilientJob.grow` adds replicas),
and the ranks of the new placement build it (:mod:`hypergrid.recovery.rebuild`). The round's end
is recorded once: committed, every participant goes on with the job after it (:func:`after`);
not, the next round starts from the state from before, with the failed set as it is then, until
the deadline. A rank that missed an end reads the job from the store's record (:func:`synced`).

How long a round waits: a rank that is alive (not lost on the job's board) may be blocked in a
collective with a peer that left, until that collective's timeout; so it is waited for up to
the job's longest collective timeout, :data:`ARRIVAL_MARGIN_S` and the staleness bound, before it
is counted out as hung. That wait comes on top of the recovery's timeout, in the first round only.

Example, with no process group (the failed set given, as one simulated rank knows it)::

    >>> from hypergrid import HyperCommGrid, ResilientJob
    >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=6), spares=[4, 5])
    >>> plan_for(job, FailureVerdict((3,), 0), 2, "dp").describe()
    'replace: rank 3 -> 4; 1 spares left'
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ..control.abort import recovering, take_aborted
from ..control.board import LossView
from ..control.heartbeat import running_heartbeat
from ..control.keys import JobChannel
from ..control.monitor import JobSpec
from ..control.plane import ControlPlane, control_plane
from ..control.ring import as_runs
from ..control.rounds import RecoveryRound, current_round
from ..control.watch import CollectiveWatch
from ..errors import ExcludedByRecovery, RecoveryError, RecoveryRefused
from ..layout import GridLayout
from ..layout.describe import describe_ranks, one_line
from ..layout.rank_map import RankMap
from ..layout.replan import RecoveryKind, RecoveryPlan, plan_growth, plan_recovery
from ..runtime.node_read import Node
from ..runtime.registry import REGISTRY
from ..runtime.wire import Arrival, FailureVerdict, JobRecord, RoundEnd
from .rebuild import build, let_go, reset_megatron_if, restore
from .recipes import GridRecipe, longest_collective

__all__ = ["run_rounds", "recover_known", "plan_for", "after", "synced", "attach", "detach", "staleness_bound",
           "losses_since", "ARRIVAL_MARGIN_S"]

logger = logging.getLogger(__name__)

#: Beyond the job's longest collective timeout, how long a rank that is alive may take to reach a
#: round (it leaves its collective at that timeout, then calls the recovery).
ARRIVAL_MARGIN_S = 5.0


def staleness_bound(default_s: float) -> float:
    """How long after a node is lost every rank has heard of its ranks' loss at the latest: the
    staleness bound of this rank's heartbeat (by then they are on the job's board) and one
    interval (the board's delivery; ``default_s`` where no heartbeat runs).

    Example::

        >>> staleness_bound(30.0)          # no heartbeat runs here
        30.0
    """
    beat = running_heartbeat()
    return (beat.stale_beats + 1) * beat.interval_s if beat is not None else default_s


def recover_known(job: Any, lost: tuple[int, ...], timeout: timedelta, gpus_per_node: int,
                  replica_dim: str) -> Any:
    """A recovery from a failed set every rank knows alike: no round, one attempt."""
    verdict = FailureVerdict(lost, -1)  # nobody offers itself in a recovery every rank knows of
    plan = plan_for(job, verdict, gpus_per_node, replica_dim)
    if plan.kind is RecoveryKind.REPAIR and not plan.failed:
        return dataclasses.replace(job, spares=plan.spares_left)
    deadline = time.monotonic() + timeout.total_seconds()
    state = build(job, plan, verdict, deadline, scope=None)
    let_go(job.state, keep=state)
    return after(job, plan, verdict, state)


def run_rounds(job: Any, timeout: timedelta, step: Optional[int], reason: str, *, gpus_per_node: int,
               replica_dim: str) -> Any:
    """``job`` after rounds of its recovery until one commits, on this participant (see the module).

    ``reason``: why this rank comes (``"recover"``, ``"grow"`` or ``"wait"``, a spare).
    """
    assert job.channel is not None
    plane = control_plane()
    assert plane is not None
    rank = dist.get_rank()
    bound = (longest_collective(job.collective_timeout).total_seconds() + ARRIVAL_MARGIN_S
             + staleness_bound(timeout.total_seconds()))
    # A round may wait for ranks blocked in a collective (or still leaving a failed attempt) up to
    # the bound: on top of the recovery's timeout, which counts from the first agreement.
    deadline = time.monotonic() + timeout.total_seconds() + bound
    first = True
    board: Optional[LossView] = None
    with recovering():
        while True:
            rnd = RecoveryRound.open(job.channel, plane, max(deadline, time.monotonic() + bound))
            if board is None:
                board = losses_since(job.channel, plane, rnd.record)
                beat = running_heartbeat()
                if beat is not None:
                    # Before this rank arrives, so before the leader's look: every loss is in the
                    # verdict, or heard by the waits of the rebuild (which then block once each).
                    board.hear_from(beat)
            job = synced(job, rnd.record)
            offered = [r for r in rnd.offers if not job.counts_on(r)]
            if not job.counts_on(rank) and rank not in offered:
                why = [line for line in (rnd.record.gone if rnd.record else ()) if line.startswith(f"rank {rank}:")]
                raise ExcludedByRecovery(
                    f"hypergrid: rank {rank} is no longer a rank of the job: the survivors recovered without "
                    f"it ({why[-1] if why else 'it did not come'}; the grid is on "
                    f"{describe_ranks(list(job.layout.ranks))}, spares {describe_ranks(job.spares)}); "
                    f"ResilientJob.offer() offers it again")
            arrival = Arrival(rank, step, reason, tuple(take_aborted()))
            try:
                verdict = rnd.agree(job.domain, arrival, bound_s=bound, board=board, offers=offered,
                                    node=Node.of(rank, gpus_per_node))
                if first:
                    deadline, first = time.monotonic() + timeout.total_seconds(), False
                # Each attempt has the recovery's timeout at least to what is left of it; a round
                # agreed late (after ranks left a failed attempt) gets what the first one got.
                attempt_deadline = max(deadline, time.monotonic() + min(timeout.total_seconds(), bound))
                rnd.store.deadline = attempt_deadline
                end, state = attempt(job, rnd, verdict, gpus_per_node, replica_dim, attempt_deadline, board)
            except ExcludedByRecovery:
                raise  # the others go on in this round, and close it
            except BaseException:
                # Abandoned, or an error on the way: the round is over for everyone, so that the
                # next call (a retry, a spare's next wait) meets in a round of its own.
                rnd.close()
                raise
            rnd.close()
            if end.committed:
                return state
            if end.refused:
                raise RecoveryRefused(end.message)
            logger.warning("rank %d: %s did not commit: %s", rank, rnd.name, end.message)
            if time.monotonic() >= deadline:
                abandon(job.channel, plane, rnd.number + 1, f"rank {rank} reached its deadline")
                raise RecoveryError(
                    f"hypergrid: the recovery did not commit a placement within its timeout "
                    f"({timeout.total_seconds():g} s after the survivors first agreed); the last attempt "
                    f"failed: {end.message}")


def losses_since(channel: JobChannel, plane: ControlPlane, committed: Optional[JobRecord]) -> LossView:
    """The job's board as a recovery reads it: from the entry the latest committed round recorded
    (``committed.board_from``; the first entry where none committed), which every participant reads
    from the store alike, not from a count of its own. Before that entry no rank the job counts on
    is lost: the round that committed counted out every rank lost there, and a rank that offers
    itself since says so later. A loss after the round's leader last looked (a member that died as
    the round committed, or since) is at or after it, and is read. So the first look costs the
    same whatever the board's history, on the leader and in every wait of the rebuild.

    Example::

        >>> channel, plane = JobChannel("ns", "f00d", 0), ControlPlane("ns", store=None, address=None)
        >>> record = JobRecord(3, (2,), ("dp",), ((0, 0, 2),), (), board_from=412)
        >>> losses_since(channel, plane, record).seen, losses_since(channel, plane, None).seen
        (412, 0)
    """
    return LossView(channel, plane, first=committed.board_from if committed is not None else 0)


def attempt(job: Any, rnd: RecoveryRound, verdict: FailureVerdict, gpus_per_node: int, replica_dim: str,
            deadline: float, board: LossView) -> tuple[RoundEnd, Any]:
    """One attempt at the round's plan: (how it ended, the new job where it committed)."""
    rank = dist.get_rank()
    try:
        plan = plan_for(job, verdict, gpus_per_node, replica_dim)
    except RecoveryRefused as exc:
        return rnd.end(RoundEnd(False, str(exc), refused=True)), None
    logger.info("rank %d: %s: %s", rank, rnd.name, plan.describe())
    # A growth that found no replica to add, where nobody failed or came after a failure: nothing
    # is broken and nothing moves, so nothing is rebuilt.
    quiet = (plan.kind is RecoveryKind.REPAIR and verdict.grow and not verdict.recovering and not verdict.failed
             and not verdict.aborted_by)
    members = set(plan.new.ranks)
    new_state: Any = None
    if quiet:
        new_state = job.state  # a growth that found no replica to add: nothing to rebuild
    elif rank in members:
        try:
            new_state = build(job, plan, verdict, deadline, scope=f"{rnd.channel.key(rnd.number)}", board=board,
                              node=Node.of(rank, gpus_per_node))
        except RecoveryRefused as exc:
            restore(job)
            return rnd.end(RoundEnd(False, str(exc), refused=True)), None
        except Exception as exc:  # the round failed: the next one starts from the state from before
            restore(job)
            return rnd.end(RoundEnd(False, f"rank {rank}: {type(exc).__name__}: {one_line(str(exc), 400)}")), None
    new_record = record(job, plan, verdict, rnd.record)
    if rank in members or quiet:
        end = rnd.end(RoundEnd(True, job=new_record))
        if end.committed:
            rnd.commit(new_record)
        elif new_state is not job.state:
            let_go(new_state, keep=job.state)
            restore(job)
    else:
        reset_megatron_if(job.recipe)
        end = rnd.wait_end()
        if not end.committed:
            restore(job)
    if not end.committed:
        return end, None
    if new_state is not job.state:
        let_go(job.state, keep=new_state)
    return end, after(job, plan, verdict, new_state, end.job)


def plan_for(job: Any, verdict: FailureVerdict, gpus_per_node: int, replica_dim: str) -> RecoveryPlan:
    """The placement after ``verdict``, alike on every participant."""
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
    """The store's record of ``job`` after ``plan`` (``before``: the record it follows), with where
    the next recovery reads the board from: as far as the leader had read it for ``verdict``."""
    spares = tuple(sorted(set(plan.spares_left) | set(plan.dropped)))
    runs = (plan.new.rank_map or RankMap.contiguous(plan.new.rank_offset, plan.new.size)).runs
    gone = (before.gone if before is not None else ()) + verdict.reasons
    return JobRecord(job.generation + 1, tuple(plan.new.shape), tuple(plan.new.dim_names), runs, spares,
                     verdict.step, gone, board_from=verdict.board_read)


def after(job: Any, plan: RecoveryPlan, verdict: FailureVerdict, state: Any,
          committed: Optional[JobRecord] = None) -> Any:
    """``job`` after ``plan`` committed, with this rank's new ``state``."""
    spares = committed.spares if committed is not None else tuple(sorted(set(plan.spares_left) | set(plan.dropped)))
    recoveries = job.recoveries if plan.kind is RecoveryKind.REPAIR else job.recoveries + (plan,)
    if job._world is not None and plan.new != job.layout:
        job._world.destroy()  # the old placement's world group: the new one is made when asked for
    world = job._world if plan.new == job.layout else None
    job = dataclasses.replace(job, layout=plan.new, spares=spares, state=state, recoveries=recoveries,
                              generation=job.generation + 1, step=verdict.step, _world=world)
    if job.channel is not None:
        attach(job)
    return job


def synced(job: Any, committed: Optional[JobRecord]) -> Any:
    """This job as the store's latest committed record says it is (where this rank missed an end)."""
    if committed is None or committed.generation <= job.generation:
        return job
    layout = GridLayout(committed.shape, committed.dim_names, rank_map=RankMap(committed.runs))
    logger.warning("rank %d: the job moved on without this rank's knowledge: now on %s", dist.get_rank(),
                   describe_ranks(list(layout.ranks)))
    if job._world is not None:
        job._world.destroy()
    return dataclasses.replace(job, layout=layout, spares=committed.spares, generation=committed.generation,
                               step=committed.step, _world=None)


_collective_watch: Optional[CollectiveWatch] = None


def attach(job: Any) -> None:
    """Serve ``job`` on this rank's control plane: its monitor watches in the job's ring and
    forwards its board's events, and the collective watch aborts on those that concern it."""
    global _collective_watch
    if _collective_watch is not None:
        _collective_watch.active = False
    beat, plane = running_heartbeat(), control_plane()
    if job.channel is None or beat is None or plane is None:
        _collective_watch = None
        return
    beat.attach(JobSpec(job.channel, tuple(as_runs(job.domain)), job.gpus_per_node))
    _collective_watch = CollectiveWatch(job.channel, ranks=job.domain, first_round=current_round(job.channel, plane),
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


def abandon(channel: JobChannel, plane: ControlPlane, number: int, why: str) -> None:
    """Give up round ``number`` for everyone who waits in it (they raise too), and close it, so that
    a retry after this error meets in a round of its own."""
    rnd = RecoveryRound(channel, plane, number, plane.client(time.monotonic() + 5.0), None)
    rnd.abandon(why)
    rnd.close()
