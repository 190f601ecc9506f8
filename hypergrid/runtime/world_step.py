"""World steps: what every rank of the world (or of a recovery's new placement) does together,
and where a failure on one rank reaches the rest.

Megatron's ``initialize_model_parallel`` is one: the ranks start it together (:func:`world_start`)
and end it at a checkpoint (:func:`world_checkpoint`) where a rank that failed tells the others,
who would otherwise use half-made state. A recovery's rebuild is a step named by its round.

Example, with no process group (nothing to meet through)::

    >>> world_start("initialize_model_parallel", timeout=timedelta(seconds=60)) is None
    True
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import GridMismatchError, GroupCreationError, GroupTimeoutError, StoreUnresponsiveError
from ..layout.describe import describe_ranks, one_line
from ..store import meeting
from ..store.client import StoreClient, advance_epoch
from ..store.keys import Meeting, WorldStepKeys
from ..store.records import StepOutcome, decode, encode
from .environment import agreement_possible, job_store
from .scope import WATCH_SLICE_S, RecoveryScope, current_scope

__all__ = ["WorldStep", "world_start", "world_checkpoint", "within_step", "failed_step"]

logger = logging.getLogger(__name__)

#: How long the heartbeat's thread may take to decide, for a wait, that a participant was lost.
_ALARM_S = 5.0


@dataclass(frozen=True)
class WorldStep:
    """A step every rank of the world (or of ``ranks``) takes together, named by its participants
    and the epoch all read at its start, or by the ``attempt`` they all hold (a round's keys).

    Example::

        >>> WorldStep("initialize_model_parallel", 3).end.outcome
        'hypergrid/agree/world/3/end/outcome'
        >>> WorldStep("recover", 0, (0, 1, 4, 8), attempt="ns/job/f00d/0/7").end.outcome
        'ns/job/f00d/0/7/step/recover/outcome'
    """

    label: str
    epoch: int
    #: The participants, ascending; empty: every rank of the world.
    ranks: tuple[int, ...] = ()
    attempt: str = ""

    @property
    def keys(self) -> WorldStepKeys:
        return WorldStepKeys.of(self.ranks)

    @property
    def start(self) -> Meeting:
        return self.keys.start(self.epoch)

    @property
    def end(self) -> Meeting:
        return WorldStepKeys.attempt_end(self.attempt, self.label) if self.attempt else self.keys.end(self.epoch)

    @property
    def size(self) -> int:
        return len(self.ranks) if self.ranks else dist.get_world_size()

    def participants(self) -> Sequence[int]:
        return self.ranks or range(dist.get_world_size())


_steps = threading.local()


@contextlib.contextmanager
def within_step(step: Optional[WorldStep]) -> Iterator[None]:
    """Make the agreement checks this thread waits in watch ``step``: once it failed on some rank, a
    check waiting for a member that will never come ends with that failure, not its timeout.

    Example::

        >>> with within_step(None):      # no step: checks wait as they would
        ...     pass
    """
    previous = getattr(_steps, "current", None)
    _steps.current = step
    try:
        yield
    finally:
        _steps.current = previous


def failed_step(store: StoreClient) -> Optional[tuple[WorldStep, StepOutcome]]:
    """The step this thread waits within and its outcome, if it has failed on some rank."""
    step: Optional[WorldStep] = getattr(_steps, "current", None)
    if step is None or not store.check([step.end.outcome]):
        return None
    outcome = decode(StepOutcome, store.get(step.end.outcome))
    return (step, outcome) if outcome.failed is not None else None


def world_start(label: str, *, timeout: timedelta, ranks: Optional[Sequence[int]] = None,
                attempt: Optional[str] = None) -> Optional[WorldStep]:
    """Every rank of the world (or of ``ranks``) starts ``label`` together; returns the world step.

    After the start all have read the world step's epoch, so its end is named alike on all; a rank
    that does not arrive within ``timeout`` fails the start on every rank that did, naming it.
    ``attempt``: a name all of ``ranks`` hold and no other world step of theirs will (a round's
    keys): the world step starts at once, with no meeting.

    Example::

        >>> world_start("initialize_model_parallel", timeout=timedelta(seconds=60)) is None   # no process group
        True
    """
    if not agreement_possible():
        return None
    members = tuple(sorted(set(ranks))) if ranks is not None else ()
    if attempt is not None:
        if not members:
            raise ValueError(f"a step named by its attempt ({attempt!r}) needs its participants, got none")
        return WorldStep(label, 0, members, attempt=attempt)
    store = job_store(time.monotonic() + timeout.total_seconds())
    try:
        step = WorldStep(label, int(store.add(WorldStepKeys.of(members).epoch, 0)), members)
        if meeting.arrive(store, step.start, step.size).completes:
            meeting.decide(store, step.start, encode(StepOutcome(None)))
        outcome = _outcome(store, step, step.start)
        if outcome.timed_out is None:
            return step
        missing = meeting.roll_call(store, step.start, dist.get_rank(), step.participants())
        advance_epoch(store, step.keys.epoch, step.epoch)
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise GroupCreationError(
            f"hypergrid: {label}: the job's store stopped answering at the start ({type(exc).__name__}: "
            f"{one_line(str(exc), 200)}); the process hosting it has likely exited or stopped"
        ) from exc
    raise GroupTimeoutError(
        f"hypergrid: {label}: ranks {describe_ranks(missing)} did not start it within the timeout "
        f"({timeout}): they are elsewhere, hang, or died"
        if missing else f"hypergrid: {label}: not every rank started it within the timeout ({timeout})"
    )


def world_checkpoint(step: Optional[WorldStep], error: Optional[BaseException], *, timeout: timedelta) -> None:
    """Every participant reports how ``step`` ended for it; each learns if any failed.

    A rank that failed decides the outcome with its error and returns (the caller raises its own);
    the others raise :class:`~hypergrid.errors.GridMismatchError` naming it, or
    :class:`~hypergrid.errors.GroupTimeoutError` naming those that did not end it in time.

    Example::

        >>> world_checkpoint(None, None, timeout=timedelta(seconds=60))   # no process group: nothing to do
    """
    if step is None or not agreement_possible():
        return
    store = job_store(time.monotonic() + timeout.total_seconds())
    end, rank, scope = step.end, dist.get_rank(), current_scope()
    try:
        if error is not None:
            _decide(store, step, StepOutcome(rank, one_line(f"{type(error).__name__}: {error}", 1200)), scope, end)
            _end_epoch(store, step)
            return
        place = scope.arrive(store, end, step.size) if step.attempt and scope is not None else None
        if (place or meeting.arrive(store, end, step.size)).completes:
            _end_epoch(store, step)
            if step.attempt and scope is not None:
                # Committed before anyone hears of it: a rank opening the next round finds the record past this one.
                success = encode(StepOutcome(None)).encode()
                if meeting.decide(store, end, success) == success:
                    scope.succeeded(end.outcome)
                    if scope.hearing:
                        scope.publish(end.outcome, success)
            else:
                _decide(store, step, StepOutcome(None), scope, end)
                _drop_old_steps(store, step)
        outcome = _outcome(store, step, end)
        if outcome.timed_out is not None:
            missing = meeting.roll_call(store, end, rank, step.participants())
            _end_epoch(store, step)
            raise GroupTimeoutError(
                f"hypergrid: {step.label}: only {step.size - len(missing)} of {step.size} ranks finished it within "
                f"the timeout ({timeout}); ranks {describe_ranks(missing)} did not: they are still at it, "
                f"hang, or died"
            )
    except (dist.DistError, StoreUnresponsiveError) as exc:
        if error is not None:
            return  # the caller's own error says more
        raise GroupCreationError(
            f"hypergrid: {step.label}: the job's store stopped answering at the end ({type(exc).__name__}: "
            f"{one_line(str(exc), 200)}); the process hosting it has likely exited or stopped"
        ) from exc
    if outcome.failed is not None:
        raise GridMismatchError(
            f"hypergrid: {step.label} failed on rank {outcome.failed}, so it cannot be used on this rank "
            f"either: {outcome.error}",
            root_cause=outcome.error,
        )


def _decide(store: StoreClient, step: WorldStep, proposal: StepOutcome, scope: Optional[RecoveryScope],
            at: Meeting) -> bytes:
    """The standing outcome at ``at`` (the world step's start or end); at the end of a world step
    named by its round, the rank whose proposal stands tells the board."""
    encoded = encode(proposal).encode()
    standing = meeting.decide(store, at, encoded)
    if standing == encoded and at == step.end and step.attempt and scope is not None and scope.hearing:
        scope.publish(at.outcome, standing)
    return standing


def _outcome(store: StoreClient, step: WorldStep, at: Meeting) -> StepOutcome:
    """The outcome at ``at`` (the world step's start or end), decided by whoever learns it first: the last
    participant counted, one that failed, one whose deadline passed, or, inside a recovery, a loss.
    Raises :class:`~hypergrid.errors.GroupTimeoutError` where participants were lost."""
    scope = current_scope()
    participants = step.participants()
    hearing = scope if scope is not None and scope.hearing else None
    raw = None
    with contextlib.ExitStack() as alarm:
        if hearing is not None:
            alarm.enter_context(hearing.on_loss(participants, lambda lost: _decide_lost(step, at, lost, hearing)))
        while raw is None and store.remaining() > 0:
            slice_s = store.remaining() if hearing is not None or scope is None else min(WATCH_SLICE_S, store.remaining())
            raw = meeting.wait_outcome(store, at, slice_s, hearing if step.attempt else None,
                                       hearing.fallback_s if hearing is not None else 0.0)
            lost = scope.lost_among(participants) if raw is None and scope is not None and hearing is None else []
            if lost and store.remaining() > 0:
                raw = _decide(store, step, StepOutcome(None, lost=tuple(sorted(lost))), scope, at)
    if raw is None:
        store.extend(meeting.ROLL_CALL_S)
        raw = _decide(store, step, StepOutcome(None, timed_out=dist.get_rank()), scope, at)
    outcome = decode(StepOutcome, raw)
    if outcome.lost:
        raise GroupTimeoutError(
            f"hypergrid: {step.label}: ranks {describe_ranks(list(outcome.lost))} were lost (the job's board says "
            f"so) while the others waited for them; the others stop waiting")
    return outcome


def _decide_lost(step: WorldStep, at: Meeting, lost: list[int], scope: RecoveryScope) -> None:
    """On the heartbeat's thread: a loss heard while waiting decides the outcome, unless one stands."""
    try:
        _decide(job_store(time.monotonic() + _ALARM_S), step, StepOutcome(None, lost=tuple(lost)), scope, at)
    except (dist.DistError, StoreUnresponsiveError) as exc:
        logger.warning("hypergrid: %s: could not say that ranks %s were lost: %s", step.label,
                       describe_ranks(lost), exc)


def _end_epoch(store: StoreClient, step: WorldStep) -> None:
    """Advance the participants' epoch past ``step`` (a step named by its attempt has none)."""
    if not step.attempt:
        advance_epoch(store, step.keys.epoch, step.epoch)


def _drop_old_steps(store: StoreClient, step: WorldStep) -> None:
    """Delete the keys of every earlier step of these participants: all have ended this one."""
    keys = step.keys
    first = int(store.add(keys.cleaned, 0))
    for old in range(first, step.epoch):
        meeting.forget(store, keys.start(old))
        meeting.forget(store, keys.end(old))
    if step.epoch > first:
        store.add(keys.cleaned, step.epoch - first)
