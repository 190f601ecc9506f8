"""A job's recovery rounds: each decided once by its leader, heard by every participant.

A job's one record in the store (:class:`~hypergrid.store.records.JobState`) says which round is
open, the placement the latest committed round left, and who offers itself. With its heartbeat
running, a participant hears the verdict and the rebuild's end from the board, and its node's
delegate reads the record, arrives and ends the rebuild for the node's ranks together
(:mod:`hypergrid.liveness.calls`): four requests per node at any size, where each rank alone
would make four. The first arrivals contend for the lead; a follower whose leader is lost or
quiet takes it.

Example, in a one-rank gloo world over a ``TCPStore``: of the job ``[0, 1]``, rank 1 never comes
and its process ended (its monitor published it)::

    >>> import time
    >>> import torch.distributed as dist
    >>> from hypergrid.liveness.plane import control_plane
    >>> from hypergrid.store.records import Arrival, BoardEvent, EventKind
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> dist.init_process_group("gloo", store=server, rank=0, world_size=1)
    >>> plane = control_plane(); channel = JobChannel.of([0, 1], 0, plane.namespace)
    >>> board = board_view(channel, plane)
    >>> board.publish_event(BoardEvent(EventKind.LOST, 1, "its process ended", by=1))
    >>> rnd = RecoveryRound.open(channel, plane, time.monotonic() + 5)
    >>> verdict = rnd.agree([0, 1], Arrival(0, step=3), bound_s=30, board=board, settings=RecoverySettings())
    >>> verdict.failed, verdict.step, verdict.reasons[0]
    ((1,), 3, 'rank 1: its process ended before it arrived')
    >>> rnd.close(); RecoveryRound.open(channel, plane, time.monotonic() + 5).number
    1
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import ExcludedByRecovery, RecoveryError, StoreUnresponsiveError
from ..layout.describe import describe_ranks, one_line
from ..liveness.board import BoardView
from ..liveness.calls import NodeChannel
from ..liveness.plane import ControlPlane, control_plane
from ..runtime.world_step import world_checkpoint, world_start
from ..store import meeting
from ..store.client import StoreClient
from ..store.keys import JobChannel, RoundKeys
from ..store.records import Arrival, BoardEvent, EventKind, FailureVerdict, JobRecord, JobState, decode, encode
from .quorum import ABANDON_MARGIN_S, RoundView, decide
from .settings import RecoverySettings

__all__ = ["RecoveryRound", "open_channel", "board_view", "read_state", "wait_for_round", "release_spares", "offer"]

logger = logging.getLogger(__name__)

#: The first arrivals each wake the spares and contend for the lead, so one that dies on its way in is covered.
_CONTENDERS = 3
_UNKNOWN = -1
_STATE_TRIES = 64  # compare-and-set tries of a change of the job's record against other writers


def open_channel(origin: Sequence[int], *, timeout: timedelta) -> JobChannel:
    """The channel of a job whose ranks are ``origin``; all of them call it when the job is made (a
    rank that never comes fails it within ``timeout``).

    >>> open_channel([0, 1], timeout=timedelta(seconds=5))      # no process group: instance 0
    JobChannel(namespace='hypergrid/control', origin='fa5836450376bf4bf592', instance=0)
    """
    ranks = sorted(set(origin))
    plane = control_plane()
    if plane is None:
        return JobChannel.of(ranks, 0)
    step = world_start("a resilient job's start", timeout=timeout, ranks=ranks)
    world_checkpoint(step, None, timeout=timeout)
    return JobChannel.of(ranks, step.epoch if step is not None else 0, plane.namespace)


def board_view(channel: JobChannel, plane: ControlPlane, first: int = 0) -> BoardView:
    """``channel``'s board as this rank reads it, from entry ``first``, each look bounded by 5 s."""
    return BoardView(channel, lambda: plane.client(time.monotonic() + 5.0), first)


def read_state(channel: JobChannel, store: StoreClient, node: Optional[NodeChannel] = None) -> tuple[JobState, bytes]:
    """The job's record and its bytes as stored (what a change compares with), one request (``node``:
    one for the node's ranks that read it together)."""
    raw = store.get_if_set(channel.state) if node is None else node.read(store, channel.state)
    return (decode(JobState, raw), raw) if raw is not None else (JobState(), b"")


def _change_state(channel: JobChannel, store: StoreClient, raw: bytes,
                  change: Callable[[JobState], Optional[JobState]]) -> JobState:
    """The record after ``change`` (None: leave it), by compare-and-set from ``raw``, the bytes last read."""
    current = False  # whether ``raw`` is known to be what the store holds
    for _ in range(_STATE_TRIES):
        state = decode(JobState, raw) if raw else JobState()
        changed = change(state)
        if changed is None:
            if current:
                return state
            _, raw = read_state(channel, store)
            current = True
            continue
        desired = encode(changed).encode()
        standing = bytes(store.compare_set(channel.state, raw, desired))
        if standing == desired:
            return changed
        raw, current = standing, True
    raise RecoveryError(f"hypergrid: the job's record in the store kept changing under {_STATE_TRIES} tries to change it")


@dataclass
class _Waiting:
    """One participant's state while it waits for a round's verdict."""

    rank: int
    members: Sequence[int]
    offered: Sequence[int]
    since: float
    leader_since: float
    leader: int = _UNKNOWN
    arrivals: dict[int, Arrival] = field(default_factory=dict)
    read_at: int = -1
    leader_beat: int = -1
    woke_spares: bool = False
    contends: bool = False  # among the first arrivals, which watch the leader's beat closely
    looked: bool = False  # leading, it has read the board once (then it hears it, where it can)
    short: bool = False  # the arrivals read were fewer than counted: one counted twice (its node's delegate
    # went before answering it, and it arrived again), so ``complete`` may stand before the last arrival


@dataclass
class RecoveryRound:
    """One participant's view of round ``number`` of a job; ``state`` and ``raw_state``: the job's
    record as read at the opening, and its bytes."""

    channel: JobChannel
    plane: ControlPlane
    number: int
    store: StoreClient
    state: JobState
    raw_state: bytes = b""
    node: NodeChannel = field(default_factory=NodeChannel)

    @classmethod
    def open(cls, channel: JobChannel, plane: ControlPlane, deadline: float, store: Optional[StoreClient] = None,
             ahead: Optional[JobRecord] = None, node: Optional[NodeChannel] = None) -> RecoveryRound:
        """This rank's view of the job's open round: one request (``node``: the rank's node, which reads
        and arrives for its ranks together). ``ahead``: this rank's record, written where the store's is
        older (the closer of the round that committed it ended first)."""
        store, node = store or plane.client(deadline), node or NodeChannel()
        with _store_answering("open a recovery round"):
            state, raw = read_state(channel, store, node)
            if ahead is not None and ahead.generation > state.generation:
                logger.warning("hypergrid: the job's record in the store is behind this rank's (generation %d, not "
                               "%d): the round that committed it is closed now", state.generation, ahead.generation)
                state = _change_state(channel, store, raw, lambda s: _committed(s, s.round, ahead))
                state, raw = read_state(channel, store)
            return cls(channel, plane, state.round, store, state, raw, node)

    @property
    def keys(self) -> RoundKeys:
        return self.channel.round(self.number)

    @property
    def record(self) -> Optional[JobRecord]:
        """The job as the latest committed round left it (None: none has committed)."""
        return self.state.committed

    @property
    def offers(self) -> tuple[int, ...]:
        """The ranks that offer themselves to the job as it stands (see :func:`offer`)."""
        return self.state.offered(self.state.generation)

    @property
    def name(self) -> str:
        return f"round {self.number} of the job"

    def agree(self, domain: Sequence[int], arrival: Arrival, *, bound_s: float, board: BoardView,
              settings: RecoverySettings, offers: Sequence[int] = ()) -> FailureVerdict:
        """Arrive with ``arrival`` and return the round's verdict, as every participant reads it.
        ``offers``: ranks outside ``domain`` that offered themselves; ``bound_s``: how long a live but
        absent rank is waited for. Raises ExcludedByRecovery where this rank is in the failed set,
        RecoveryError where the round was abandoned or the store stopped answering."""
        store, rank, now = self.store, arrival.rank, time.monotonic()
        waiting = _Waiting(rank, domain, offers, now, now)
        try:
            place = self.node.arrive(store, self.keys.arrivals, len(domain) + len(offers), encode(arrival), awaited=True)
            if place.number <= _CONTENDERS:
                store.set(self.keys.wake, "")
                waiting.woke_spares, waiting.contends = True, True
                waiting.leader = int(store.compare_set(self.keys.leader, "", str(rank)))
            if place.number == 1:  # the round is open: communicators are aborted, and who leads is known
                board.publish_event(BoardEvent(EventKind.ROUND, rank, arrival.reason, number=self.number, by=rank,
                                               value=str(waiting.leader)), store)
            verdict = None
            while verdict is None:
                verdict = (self._lead(waiting, board, bound_s, settings) if waiting.leader == rank
                           else self._follow(waiting, board, settings))
        except StoreUnresponsiveError as exc:
            if store.remaining() > 0:
                raise _store_failed("agree on who failed", exc) from exc
            self.abandon(f"rank {rank} reached its deadline before the participants agreed on who failed", board)
            with _store_answering("read the round's verdict"):
                verdict = decode(FailureVerdict, self.store.get(self.keys.verdict))
        except dist.DistError as exc:
            raise _store_failed("agree on who failed", exc) from exc
        return _checked(verdict, rank, self.name)

    def _standing(self, board: Optional[BoardView] = None) -> Optional[FailureVerdict]:
        """The verdict if one stands: heard from ``board`` where given, else read (checked first:
        followers without a heartbeat block on the key, and a peek would wake them)."""
        key = self.keys.verdict
        if board is not None:
            raw = board.heard(key, 0.0)
        else:
            raw = self.store.get(key) if self.store.check([key]) else None
        return decode(FailureVerdict, raw) if raw is not None else None

    def _lead(self, waiting: _Waiting, board: BoardView, bound_s: float,
              settings: RecoverySettings) -> Optional[FailureVerdict]:
        """One look of the leader: the verdict once it can be decided (None: look again)."""
        store, hearing = self.store, board.hearing
        standing = self._standing(board if hearing else None)
        if standing is not None:  # a participant that gave up at its deadline decided already
            return standing
        if not waiting.woke_spares:  # it took over from a first arrival that may have died before
            store.set(self.keys.wake, "")
            waiting.woke_spares = True
        store.add(self.keys.leader_beat, 1)
        domain = sorted(set(waiting.members))  # the leader's alone: a follower never needs it sorted
        offers = sorted(set(waiting.offered) - set(domain))
        size = len(domain) + len(offers)
        closing = store.remaining() <= ABANDON_MARGIN_S + settings.leader_look_s
        # Read first: a loss published before this rank began to hear is on the board only.
        lost = board.lost if hearing and waiting.looked else board.refresh(store)
        waiting.looked = True
        missing = sum(1 for r in lost if _among(domain, r) or _among(offers, r))
        waited = time.monotonic() - waiting.since
        if hearing and not missing and waited < bound_s and not closing and not waiting.short:
            complete = store.wait([self.keys.arrivals.complete], min(max(settings.leader_look_s, 1.0),
                                                                      max(0.0, bound_s - waited)))
            count = size if complete else -1
        else:
            count = int(store.add(self.keys.arrivals.count, 0))
        if count != waiting.read_at and (count >= size - missing or waited >= bound_s or closing):
            # The whole list only when it may decide: it grows with the round.
            arrivals = (decode(Arrival, line) for line in meeting.lines(store, self.keys.arrivals))
            waiting.arrivals, waiting.read_at = {a.rank: a for a in arrivals}, count
            waiting.short = len(waiting.arrivals) < count
            if hearing:
                lost = board.refresh(store)  # how far it read: the next recovery reads on from there
        proposal = decide(RoundView(self.number, domain, waiting.arrivals, lost, waited, offers,
                                    board_read=board.seen), bound_s=bound_s, remaining_s=store.remaining())
        if proposal is None:
            if not hearing or missing or waiting.short:
                time.sleep(settings.leader_look_s)
            return None
        return self._propose(dataclasses.replace(proposal, decided_by=waiting.rank), board)

    def _propose(self, proposal: FailureVerdict, board: BoardView) -> FailureVerdict:
        """The standing verdict, ``proposal`` unless one stood; its proposer tells the board."""
        encoded = encode(proposal).encode()
        standing = bytes(self.store.compare_set(self.keys.verdict, "", encoded))
        if standing == encoded:
            board.publish(self.keys.verdict, standing, proposal.decided_by)
        return decode(FailureVerdict, standing)

    def _follow(self, waiting: _Waiting, board: BoardView, settings: RecoverySettings) -> Optional[FailureVerdict]:
        """One wait of a follower: the verdict, or None after taking over from a leader lost or quiet
        (for ``leader_quiet_s``; ``outcome_fallback_s`` for those not among the first arrivals)."""
        store = self.store
        quiet = settings.leader_quiet_s if waiting.contends else max(settings.leader_quiet_s, settings.outcome_fallback_s)
        slice_s = min(quiet, store.remaining())
        heard_lost: list[int] = []
        if board.hearing:
            heard_leader = board.round_leader(self.number) if waiting.leader == _UNKNOWN else None
            if heard_leader is not None:  # rank 0 may lead: not a truth test
                waiting.leader = heard_leader
            watched = [waiting.leader] if waiting.leader != _UNKNOWN else []
            raw, heard_lost = board.wait_heard(self.keys.verdict, slice_s, watched)
        else:
            raw = store.get_within(self.keys.verdict, slice_s)
        if raw is not None:
            return decode(FailureVerdict, raw)
        if not heard_lost:
            if store.remaining() <= 0:
                raise StoreUnresponsiveError("the recovery's deadline passed before a verdict")
            if waiting.leader == _UNKNOWN:  # the round's opening was not heard: who leads, if anyone
                waiting.leader = int(store.get_if_set(self.keys.leader) or _UNKNOWN)
        if heard_lost or (waiting.leader != _UNKNOWN and waiting.leader in board.known_lost()):
            self._take_over(waiting, f"the leader of {self.name} (rank {waiting.leader}) was lost")
            return None
        standing = self._standing() if board.hearing else None  # decided, and its telling lost
        if standing is not None:
            return standing
        beat, now = int(store.add(self.keys.leader_beat, 0)), time.monotonic()
        if beat != waiting.leader_beat:
            waiting.leader_beat, waiting.leader_since = beat, now
        elif now - waiting.leader_since >= quiet:
            self._take_over(waiting, f"nobody decides {self.name}" if waiting.leader == _UNKNOWN else
                            f"the leader of {self.name} (rank {waiting.leader}) stopped deciding")
        return None

    def _take_over(self, waiting: _Waiting, why: str) -> None:
        """Try to lead in place of the leader (none: the first arrivals died before saying so)."""
        expected = "" if waiting.leader == _UNKNOWN else str(waiting.leader)
        taken = int(self.store.compare_set(self.keys.leader, expected, str(waiting.rank)))
        if taken == waiting.rank:
            logger.warning("rank %d: %s; rank %d decides now", waiting.rank, why, waiting.rank)
        waiting.leader, waiting.leader_since = taken, time.monotonic()

    def abandon(self, message: str, board: Optional[BoardView] = None) -> None:
        """End this round's wait for every participant with an error (this rank gives up)."""
        with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
            self.store.extend(2.0)
            proposal = FailureVerdict((), self.number, abandoned=message, decided_by=dist.get_rank())
            if board is not None:
                self._propose(proposal, board)
            else:
                self.store.compare_set(self.keys.verdict, "", encode(proposal))

    def commit(self, record: JobRecord) -> None:
        """Record the job this round left and close the round, in one compare-and-set."""
        with _store_answering("record the recovered job"):
            self.store.extend(2.0)
            self.state = _change_state(self.channel, self.store, self.raw_state,
                                       lambda s: _committed(s, self.number, record))

    def close(self) -> None:
        """Advance the job's round past this one (idempotent: whoever comes first)."""
        with contextlib.suppress(dist.DistError, StoreUnresponsiveError, RecoveryError):
            self.store.extend(2.0)
            _change_state(self.channel, self.store, self.raw_state,
                          lambda s: dataclasses.replace(s, round=self.number + 1) if s.round == self.number else None)


def _among(ranks: Sequence[int], rank: int) -> bool:
    """Whether ``rank`` is in ``ranks`` (ascending): O(log N)."""
    at = bisect_left(ranks, rank)
    return at < len(ranks) and ranks[at] == rank


def _committed(state: JobState, number: int, record: JobRecord) -> Optional[JobState]:
    """``state`` with round ``number`` committing ``record`` and closed (None: it is past that)."""
    if state.round > number or state.generation >= record.generation:
        return None
    return JobState(number + 1, record, tuple(o for o in state.offers if o[1] >= record.generation))


def _checked(verdict: FailureVerdict, rank: int, name: str) -> FailureVerdict:
    if verdict.abandoned:
        raise RecoveryError(f"hypergrid: the recovery ended in {name} without a placement: {verdict.abandoned}")
    if rank in verdict.failed:
        why = next((r for r in verdict.reasons if r.startswith(f"rank {rank}:")), f"rank {rank}")
        raise ExcludedByRecovery(
            f"hypergrid: rank {rank} was counted out by the other ranks in {name} ({why}); ranks "
            f"{describe_ranks(verdict.failed)} failed, itself among them: it is out of the grid"
        )
    logger.info("rank %d: in %s the participants agree that ranks %s failed", rank, name, list(verdict.failed))
    return verdict


def _store_failed(what: str, exc: BaseException) -> RecoveryError:
    return RecoveryError(f"hypergrid: could not {what}: the job's store did not answer "
                         f"({type(exc).__name__}: {one_line(str(exc), 200)})")


@contextlib.contextmanager
def _store_answering(what: str) -> Iterator[None]:
    """Raise :func:`_store_failed` for ``what`` where the store does not answer in the block."""
    try:
        yield
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise _store_failed(what, exc) from exc


def offer(channel: JobChannel, plane: ControlPlane, rank: int) -> int:
    """Offer ``rank`` (counted out earlier, fit again) to the job: the next round that commits waits
    for it and takes it as a spare. Returns the current generation (0: none committed)."""
    store = plane.client(time.monotonic() + 30.0)
    with _store_answering("offer this rank"):
        board_view(channel, plane).publish_event(BoardEvent(EventKind.BACK, rank, "it offers itself again", by=rank),
                                                 store)
        _, raw = read_state(channel, store)
        state = _change_state(channel, store, raw, lambda s: dataclasses.replace(
            s, offers=s.offers + ((rank, s.generation),)))
        return state.generation


def wait_for_round(channel: JobChannel, plane: ControlPlane, *, timeout: timedelta, slice_s: float = 30.0,
                   first: int = 0) -> bool:
    """Block (a spare) until a round numbered ``first`` or later opens (True), or the job releases
    its spares or ``timeout`` passes (False): a blocking store wait of ``slice_s`` at a time, no CPU."""
    end = time.monotonic() + timeout.total_seconds()
    store = plane.client(end + 5.0)
    with _store_answering("wait for a recovery"):
        while True:
            state, _ = read_state(channel, store)
            left = end - time.monotonic()
            if left <= 0:
                return False
            store.extend(min(slice_s, left) + 5.0)
            woken = store.wait([channel.round(max(state.round, first)).wake], min(slice_s, left))
            if store.check([channel.released]):
                return False
            if woken:
                return True


def release_spares(channel: JobChannel, plane: ControlPlane) -> None:
    """Tell the spares in :func:`wait_for_round` that the job is over (they return False at once);
    any rank may call it, any number of times."""
    store = plane.client(time.monotonic() + 30.0)
    with _store_answering("release the spares"):
        store.set(channel.released, "1")
        state, _ = read_state(channel, store)
        store.set(channel.round(state.round).wake, "")
