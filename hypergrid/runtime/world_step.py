"""Steps every rank of the world takes together, and where a failure on one rank reaches the rest.

Megatron's ``initialize_model_parallel`` is one such step: every rank starts it together
(:func:`world_start`, a barrier through the store, so its end is named alike on all ranks
whatever any of them did before), creates its groups, and ends it at a checkpoint
(:func:`world_checkpoint`) where a rank that failed posts its error and every other rank learns
of it instead of using half-made state. While a step runs, the rounds a thread waits in watch it
(:func:`within_step`): a round waiting for a member that failed the step ends with that failure.

Example, with no process group (nothing to meet through)::

    >>> world_start("initialize_model_parallel", timeout=timedelta(seconds=60)) is None
    True
"""

from __future__ import annotations

import contextlib
import hashlib
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
from .losses import WATCH_SLICE_S, loss_alarm, lost_among, waits_node, watching_now
from .node_count import Tally, count_in
from .node_read import NodeRead
from .store import PREFIX, StoreClient, agreement_possible, end_round
from .wire import CheckpointVerdict, decode, encode, members_digest

__all__ = ["WorldRound", "world_start", "world_checkpoint", "attempt_step", "start_step", "end_step", "within_step",
           "failed_step"]

logger = logging.getLogger(__name__)

#: How long the heartbeat's thread may take to say, for a wait, that a participant was lost.
_ALARM_S = 5.0


@dataclass(frozen=True)
class WorldRound:
    """A step every rank of the world (or of ``ranks``, the survivors of a recovery) takes
    together, named by its participants and their epoch, which every one read at its start
    (:func:`world_start`).

    Example::

        >>> WorldRound("initialize_model_parallel", 3).key("go")
        'hypergrid/agree/world/3/go'
        >>> WorldRound("recover", 0, (0, 1, 4, 8)).key("go").endswith("/0/go")
        True
    """

    label: str
    epoch: int
    #: The participants, ascending; empty: every rank of the world.
    ranks: tuple[int, ...] = ()
    #: Where the participants share the step's name already (a recovery's attempt, see
    #: :func:`world_start`), its digest, in place of the epoch: nobody reads an epoch or waits at a start.
    attempt: str = ""

    @property
    def base(self) -> str:
        """Where the participants' keys are (every step of the same participants: their epoch,
        their attempts), named by the participants. Made once per step: a digest of 16,384
        participants takes milliseconds, and a step names a dozen keys. (Not a
        ``functools.cached_property``: before Python 3.12 that holds one lock for every instance
        of the class, and a process's threads naming the keys of steps of their own queue on it.)"""
        made: Optional[str] = self.__dict__.get("_made_base")
        if made is None:
            made = _base(self.ranks)
            object.__setattr__(self, "_made_base", made)  # frozen, and not a field: eq and repr ignore it
        return made

    def key(self, name: str) -> str:
        if self.attempt:
            return f"{self.base}/attempt/{self.attempt}/{name}"
        return f"{self.base}/{self.epoch}/{name}"

    @property
    def size(self) -> int:
        return len(self.ranks) if self.ranks else dist.get_world_size()

    def missing(self, seen: set[int]) -> list[int]:
        """The participants not in ``seen``."""
        return [r for r in (self.ranks or range(dist.get_world_size())) if r not in seen]


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def _base(ranks: tuple[int, ...]) -> str:
    return f"{PREFIX}/world" if not ranks else f"{PREFIX}/world/{members_digest(ranks)}"


_steps = threading.local()


@contextlib.contextmanager
def within_step(step: Optional[WorldRound]) -> Iterator[None]:
    """Make the rounds this thread waits in watch ``step``: once it has failed on some rank (its
    checkpoint says so), a round waiting for a member that will never come ends with that failure
    instead of its timeout.

    Example::

        >>> with within_step(None):      # no step: rounds wait as they would
        ...     pass
    """
    previous = getattr(_steps, "current", None)
    _steps.current = step
    try:
        yield
    finally:
        _steps.current = previous


def failed_step(store: StoreClient) -> Optional[tuple[WorldRound, CheckpointVerdict]]:
    """The step this thread waits within and its verdict, if it has failed on some rank."""
    step = getattr(_steps, "current", None)
    if step is None or not store.check([step.key(_END.outcome)]):
        return None
    verdict = decode(CheckpointVerdict, store.get(step.key(_END.outcome)))
    return (step, verdict) if verdict.failed is not None else None


def world_start(label: str, *, timeout: timedelta, ranks: Optional[Sequence[int]] = None,
                attempt: Optional[str] = None) -> Optional[WorldRound]:
    """Every rank of the world (or of ``ranks``) starts ``label`` together; returns the step's round.

    A barrier through the store (one ``add`` and one ``wait`` per rank): once it returns, every
    rank has read the step's epoch, so the step's end (:func:`world_checkpoint`) is named alike on
    all of them, whatever any rank did before. A rank that does not arrive within ``timeout``
    fails the start on every rank that did, naming it.

    ``attempt``: a name every one of ``ranks`` holds already and no other step of theirs will (a
    recovery round's, whose verdict made them the participants): the step is named by it and
    ``label``, and starts at once, with no barrier; a participant that never comes is found at the
    end. One step per label and attempt.

    Example::

        >>> world_start("initialize_model_parallel", timeout=timedelta(seconds=60)) is None   # no process group
        True
    """
    if not agreement_possible():
        return None
    members = tuple(sorted(set(ranks))) if ranks is not None else ()
    if attempt is not None:
        return attempt_step(label, members, attempt)
    return start_step(StoreClient(time.monotonic() + timeout.total_seconds()), dist.get_rank(), label, members,
                      timeout)


def attempt_step(label: str, members: tuple[int, ...], attempt: str) -> WorldRound:
    """The step ``label`` of ``members`` (ascending) in ``attempt``, a name they all hold already:
    what :func:`world_start` returns for them, with no request to the store.

    Example::

        >>> step = attempt_step("recover", (0, 1, 4), "hypergrid/control/ns/job/f00d/0/7")
        >>> step.key("go").split("/")[-3:-1] == ["attempt", step.attempt], len(step.attempt)
        (True, 16)
        >>> attempt_step("recover", (), "round 7")
        Traceback (most recent call last):
            ...
        ValueError: a step named by its attempt ('round 7') needs its participants, got none
    """
    if not members:
        raise ValueError(f"a step named by its attempt ({attempt!r}) needs its participants, got none")
    return WorldRound(label, 0, members, attempt=_digest(f"{attempt}/{label}"))


def start_step(store: StoreClient, rank: int, label: str, members: tuple[int, ...], timeout: timedelta) -> WorldRound:
    """:func:`world_start` for ``rank`` over ``store`` (a client of the job's store, bounded by
    the step's deadline), ``members`` ascending (empty: the world): the barrier itself, which a
    simulation of many ranks in one process runs for each of them
    (``benchmarks/bench_control_plane.py``).

    Example, the one member of a step over a ``HashStore``::

        >>> store = StoreClient(time.monotonic() + 5, base=dist.HashStore())
        >>> step = start_step(store, 0, "recover", (0,), timedelta(seconds=5))
        >>> step, end_step(store, 0, step, None, timedelta(seconds=5))
        (WorldRound(label='recover', epoch=0, ranks=(0,), attempt=''), None)
    """
    epoch_key = f"{_base(members)}/epoch"
    try:
        step = WorldRound(label, int(store.add(epoch_key, 0)), members)
        if store.add(step.key("start"), 1) == step.size:
            store.compare_set(step.key("ready"), "", encode(CheckpointVerdict(None)))
        outcome = _outcome(store, rank, step, _START)
        if outcome.timed_out is None:
            return step
        missing = _roll_call(store, rank, step, _START)
        end_round(store, epoch_key, step.epoch)
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


def world_checkpoint(step: Optional[WorldRound], error: Optional[BaseException], *, timeout: timedelta) -> None:
    """Every rank of the world reports how ``step`` ended for it; each learns if any failed.

    A rank that failed posts its error and returns (the caller re-raises its own); the others block
    until every rank arrived, or one posted a failure, which they raise as
    :class:`~hypergrid.errors.GridMismatchError` naming that rank and its error; a step not ended
    by every rank in time raises :class:`~hypergrid.errors.GroupTimeoutError` naming the ranks
    that did not, on every rank that did, as soon as the first of them reached its timeout (one
    outcome for all: none passes a step that another gave up on). The step's keys, and those of every earlier step, are deleted once every rank has
    ended it: the store does not grow with steps.

    Example::

        >>> world_checkpoint(None, None, timeout=timedelta(seconds=60))   # no process group: nothing to do
    """
    if step is None or not agreement_possible():
        return
    end_step(StoreClient(time.monotonic() + timeout.total_seconds()), dist.get_rank(), step, error, timeout)


def end_step(store: StoreClient, rank: int, step: WorldRound, error: Optional[BaseException],
             timeout: timedelta) -> None:
    """:func:`world_checkpoint` for ``rank`` over ``store``, as :func:`start_step` is
    :func:`world_start` (its example ends a step so)."""
    world = step.size
    go = step.key(_END.outcome)
    try:
        if error is not None:
            failed = CheckpointVerdict(rank, one_line(f"{type(error).__name__}: {error}", 1200))
            store.compare_set(go, "", encode(failed))  # the first failure stands
            _end_epoch(store, step)
            return
        # A node's participants count themselves in one batch (as they read the outcome once),
        # where the step is named by its recovery's attempt (see _outcome).
        node = waits_node() if step.attempt else None
        counted = count_in(store, Tally(step.key(_END.count)), rank, node=node,
                           peers=node.peers_in(step.ranks) if node is not None else 1)
        if counted.closes(world):
            _end_epoch(store, step)
            store.compare_set(go, "", encode(CheckpointVerdict(None)))
            if step.attempt:
                _drop_old_attempts(store, step)
            else:
                _drop_old_steps(store, step)
        verdict = _outcome(store, rank, step, _END)
        if verdict.timed_out is not None:
            missing = _roll_call(store, rank, step, _END)
            _end_epoch(store, step)
            raise GroupTimeoutError(
                f"hypergrid: {step.label}: only {world - len(missing)} of {world} ranks finished it within "
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
    if verdict.failed is not None:
        raise GridMismatchError(
            f"hypergrid: {step.label} failed on rank {verdict.failed}, so it cannot be used on this rank "
            f"either: {verdict.error}",
            root_cause=verdict.error,
        )


@dataclass(frozen=True)
class _Meeting:
    """Where a step's participants meet (its start or its end), by the names of its keys: each
    participant adds itself to the ``count``; the last one counted, or the first to learn that the
    meeting cannot complete, sets the ``outcome`` every participant reads; only where that says
    a participant's timeout passed does each one present put its name on the ``roll``."""

    count: str
    outcome: str
    roll: str

    @property
    def names(self) -> tuple[str, ...]:
        """Every key the meeting may write (what a later step deletes)."""
        return (self.count, self.outcome, self.roll)


_START = _Meeting("start", "ready", "started")
_END = _Meeting("arrived", "go", "who")

#: How long past its deadline a participant waits for the others present to answer the roll call.
_ROLL_CALL_S = 2.0
_ROLL_POLL_S = 0.05


def _outcome(store: StoreClient, rank: int, step: WorldRound, meeting: _Meeting) -> CheckpointVerdict:
    """The outcome of ``meeting`` once it is set, which every participant reads alike.

    Nothing but the outcome's one key is read while waiting (a blocking get: two requests on the
    wire), however long the wait, at any size. The key is set by the last participant counted, by
    one that failed, and otherwise by the first participant that learns the meeting will not
    complete, with what it learned, the first writer winning (compare-and-set):

    - its deadline passed: ``timed_out`` (each participant present then names the missing ones,
      :func:`_roll_call`);
    - inside a recovery's scope (:func:`~hypergrid.runtime.losses.watching`), a participant was
      lost: waiting longer would be waiting for a rank the recovery's next round counts out.
      Where the scope hears losses as they are published (the rank's heartbeat forwards the
      board, :func:`~hypergrid.runtime.losses.loss_alarm`) the get blocks once and the heartbeat's
      thread sets the key (:func:`_set_lost`); else the wait looks at the board once a slice
      (:func:`~hypergrid.runtime.losses.lost_among`).

    Raises :class:`~hypergrid.errors.GroupTimeoutError` where participants were lost.
    """
    key = step.key(meeting.outcome)
    participants = step.ranks or range(dist.get_world_size())
    # A node's participants read the outcome once: its reader blocks once, as a participant on
    # its own that hears losses does, and tells its followers meanwhile that it still waits. Only a step named by its
    # recovery's attempt is shared so: its key names the world's control plane, where a step named
    # by its epoch is named alike in two jobs of the same ranks on one host.
    alarm, node = loss_alarm(), (waits_node() if step.attempt else None)
    raw = None
    with contextlib.ExitStack() as scope, NodeRead.of(key, node.index if node is not None else None) as shared:
        if alarm is not None:
            scope.enter_context(alarm.on_loss(participants, lambda lost: _set_lost(step, key, lost)))
        while raw is None and store.remaining() > 0:
            slice_s = store.remaining()
            if alarm is None and watching_now():
                slice_s = min(WATCH_SLICE_S, slice_s)
            read = shared.read(store, key, slice_s)
            raw = read.value
            lost = [] if alarm is not None or read.covered or raw is not None or store.remaining() <= 0 \
                else lost_among(participants)
            if lost:
                raw = store.compare_set(key, "", encode(CheckpointVerdict(None, lost=tuple(lost))))
    if raw is None:
        store.extend(_ROLL_CALL_S)
        raw = store.compare_set(key, "", encode(CheckpointVerdict(None, timed_out=rank)))
    outcome = decode(CheckpointVerdict, raw)
    if outcome.lost:
        raise GroupTimeoutError(_lost_message(step, list(outcome.lost)))
    return outcome


def _roll_call(store: StoreClient, rank: int, step: WorldRound, meeting: _Meeting) -> list[int]:
    """The participants missing from ``meeting``, which a participant's timeout ended: each one
    present puts its name on the roll, and reads it until it holds as many names as the meeting
    counted (those that came after the timeout too), or for :data:`_ROLL_CALL_S` at most (one
    present but slow to answer would be named missing then). Only a meeting that failed so costs
    more than its count and its outcome's get: a list of every participant's name, written by
    every one, is kept off the way of one that succeeds."""
    store.extend(_ROLL_CALL_S)
    roll = step.key(meeting.roll)
    store.append(roll, f"{rank},")
    counted = int(store.add(step.key(meeting.count), 0))
    while True:
        named = {int(r) for r in store.get(roll).decode().split(",") if r}
        if len(named) >= counted or store.remaining() <= 0:
            return step.missing(named)
        time.sleep(_ROLL_POLL_S)


def _end_epoch(store: StoreClient, step: WorldRound) -> None:
    """Advance the participants' epoch past ``step`` (a step named by its attempt has none)."""
    if not step.attempt:
        end_round(store, f"{step.base}/epoch", step.epoch)


def _lost_message(step: WorldRound, lost: list[int]) -> str:
    return (f"hypergrid: {step.label}: ranks {describe_ranks(lost)} were lost (the job's board says so) while "
            f"the others waited for them; the others stop waiting")


def _set_lost(step: WorldRound, key: str, lost: list[int]) -> None:
    """A loss heard while waiting for the step's outcome at ``key`` (on the heartbeat's thread,
    over its own connection): the outcome says so, unless it is set already (the step's own
    outcome, or another participant's alarm: the first stands)."""
    store = StoreClient(time.monotonic() + _ALARM_S)
    try:
        store.compare_set(key, "", encode(CheckpointVerdict(None, lost=tuple(lost))))
    except (dist.DistError, StoreUnresponsiveError) as exc:
        logger.warning("hypergrid: %s: could not say that ranks %s were lost: %s", step.label,
                       describe_ranks(lost), exc)


def _drop_old_attempts(store: StoreClient, step: WorldRound) -> None:
    """Delete the keys of the earlier step of these participants that was named by its attempt:
    all of them have ended this one, so that one too; this one's are deleted by the next."""
    listed = f"{step.base}/attempts"
    earlier = (store.get_if_set(listed) or b"").decode()
    if earlier and earlier != step.attempt:
        for name in _END.names:
            store.delete_key(f"{step.base}/attempt/{earlier}/{name}")
    store.set(listed, step.attempt)


def _drop_old_steps(store: StoreClient, step: WorldRound) -> None:
    """Delete the keys of every earlier step of these participants: all have ended this one."""
    cleaned_key = f"{step.base}/cleaned"
    first = int(store.add(cleaned_key, 0))
    for old in range(first, step.epoch):
        for name in _START.names + _END.names:
            store.delete_key(f"{step.base}/{old}/{name}")
    if step.epoch > first:
        store.add(cleaned_key, step.epoch - first)
