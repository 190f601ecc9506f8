"""Agreeing on who is gone: a job's recovery rounds, each decided once and read by every participant.

A resilient job (its grid's ranks and its spares) has a *channel* in the control plane
(:class:`~hypergrid.control.keys.JobChannel`), named by what every rank of it shares: the job's
first ranks (a digest) and the job's *instance*, which all of them read together when the job is
made (:func:`open_channel`, a world step over those ranks), so a second job on the same ranks has
a channel of its own. In it the store counts the job's recovery *rounds*; round ``n`` is open
until its participants close it, whatever it ended in (a recovery committed, nobody found failed,
an attempt that failed or was refused), so the next recovery, a retry after an error and a
spare's next wait always meet in a new round:

``round``
    the number of the round now open (or next); advanced once per round (compare-and-set).
``committed``
    the job as its latest committed round left it (:class:`~hypergrid.runtime.wire.JobRecord`):
    the store, not a rank's memory, says where the grid is, so a rank that missed an end reads it;
    and where on the job's board the next recovery starts reading (``board_from``).
``released``
    set once the job lets its spares go.
``offers``
    ranks outside the job that offer themselves as spares, each with the generation of the
    committed record it offers itself to (:func:`offer`).
``<n>/here``, ``<n>/count``, ``<n>/wake``
    the arrivals (:class:`~hypergrid.runtime.wire.Arrival`), their count, and the key spares
    block on, set by the round's first arrivals and by each leader (and by a release).
``<n>/leader``, ``<n>/leader_beat``
    the participant that decides the round (the first to arrive; another takes its place when
    its beat stands still), and the counter it advances as it works. Only the first three
    arrivals and a participant about to take over ask who leads: any other arrival costs two
    requests (two per node, where a node's participants arrive in one batch), and its verdict
    one blocking ``get`` (two on the wire: torch's client waits, then gets; once per node).
``<n>/verdict``
    the round's one :class:`~hypergrid.runtime.wire.FailureVerdict` (compare-and-set: the first
    proposal stands).
``<n>/end``
    how the attempt that followed ended (:class:`~hypergrid.runtime.wire.RoundEnd`), likewise once.

**Who is failed** is decided by the leader alone (:func:`hypergrid.control.verdict.decide`), from
the arrivals and the job's board of losses (:class:`~hypergrid.control.board.LossView`); the
others block on the verdict's key, one slice at a time, and look at the leader's beat between
slices. So a participant's store work per slice is the same at 8 ranks and at 16,384, and the
leader reads the arrivals only when they may be complete. The verdict says how many entries of
the board the leader had read (``board_read``), and the round that commits records it in
``committed``: the next recovery reads the board from there (every rank the job still counts on
that was lost since is in a later entry), not from the board's first entry, so its first look
costs the same however many entries the job's earlier recoveries left.

Example, in a one-rank gloo world over a ``TCPStore``: of the job ``[0, 1]``, rank 1 never comes
and its process ended (its monitor published it)::

    >>> import time
    >>> import torch.distributed as dist
    >>> from hypergrid.control.board import LossView, publish
    >>> from hypergrid.control.plane import control_plane
    >>> from hypergrid.runtime.wire import Arrival, BoardEvent, EventKind
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> dist.init_process_group("gloo", store=server, rank=0, world_size=1)
    >>> plane = control_plane(); channel = JobChannel.of([0, 1], 0, plane.namespace)
    >>> publish(channel, plane, BoardEvent(EventKind.LOST, 1, "its process ended", by=1))
    >>> rnd = RecoveryRound.open(channel, plane, time.monotonic() + 5)
    >>> verdict = rnd.agree([0, 1], Arrival(0, step=3), bound_s=30, board=LossView(channel, plane))
    >>> verdict.failed, verdict.step, verdict.reasons[0]
    ((1,), 3, 'rank 1: its process ended before it arrived')
    >>> rnd.close(); current_round(channel, plane)
    1
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import logging
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Optional

import torch.distributed as dist

from ..errors import ExcludedByRecovery, RecoveryError, StoreUnresponsiveError
from ..layout.describe import describe_ranks, one_line
from ..runtime.node_count import Tally, count_in
from ..runtime.node_read import Node, NodeRead
from ..runtime.store import StoreClient, end_round
from ..runtime.wire import Arrival, BoardEvent, EventKind, FailureVerdict, JobRecord, RoundEnd, decode, encode
from ..runtime.world_step import world_checkpoint, world_start
from .board import LossView, publish
from .keys import JobChannel
from .plane import ControlPlane, control_plane
from .verdict import ABANDON_MARGIN_S, RoundView, decide

__all__ = ["RecoveryRound", "open_channel", "current_round", "read_record", "wait_for_round", "release_spares",
           "offer"]

logger = logging.getLogger(__name__)

#: How long the leader pauses between looks at the arrivals and the board.
_POLL_S = 0.1
#: How long a participant that is not the leader blocks on the verdict at a time.
_FOLLOW_SLICE_S = 2.0
#: How long the leader's beat may stand still before another participant decides in its place.
_LEADER_QUIET_S = 4.0
#: The first arrivals each wake the spares and try to lead (one that died on its way in is
#: covered by the next at once, not after the leader's quiet time); the others do not know who
#: leads until they have to take over.
_CONTENDERS = 3
_UNKNOWN = -1
#: How long a waiting spare blocks on the store at a time (a release also wakes it at once).
_SPARE_SLICE_S = 30.0


def open_channel(origin: Sequence[int], *, timeout: timedelta) -> JobChannel:
    """The channel of a job whose ranks (grid and spares) are ``origin``: every one of them calls
    it when the job is made, and all read the same instance (a world step over them: a rank that
    never comes fails it on the others, naming it, within ``timeout``).

    Example::

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


def current_round(channel: JobChannel, plane: ControlPlane, store: Optional[StoreClient] = None) -> int:
    """The number of the job's round now open (or next).

    Example: see the module's."""
    store = store or plane.client(time.monotonic() + 30.0)
    return int(store.add(channel.key("round"), 0))


def read_record(channel: JobChannel, store: StoreClient) -> Optional[JobRecord]:
    """The job as its latest committed round left it (None: no round has committed yet)."""
    raw = store.get_if_set(channel.key("committed"))
    return decode(JobRecord, raw) if raw is not None else None


@dataclass
class _Waiting:
    """One participant's state while it waits for a round's verdict.

    The job's ranks are kept as the caller gave them and sorted only by a participant that
    leads: a follower of a round of 16,384 holds no set of 16,384 ranks of its own."""

    rank: int
    members: Sequence[int]
    offered: Sequence[int]
    since: float
    arrivals: dict[int, Arrival] = field(default_factory=dict)
    read_at: int = -1
    leader_beat: int = -1
    leader_since: float = 0.0
    woke_spares: bool = False
    #: This rank's node (None: it arrives and reads the verdict on its own) and its share of the node's read.
    node: Optional[Node] = None
    shared: Optional[NodeRead] = None

    def __post_init__(self) -> None:
        self.leader_since = self.since

    @cached_property
    def domain(self) -> list[int]:
        return sorted(set(self.members))

    @cached_property
    def offers(self) -> list[int]:
        return sorted(set(self.offered) - set(self.domain))

    @cached_property
    def ranks(self) -> set[int]:
        return set(self.members) | set(self.offered)


@dataclass
class RecoveryRound:
    """One participant's view of round ``number`` of a job, with the store calls bounded by a deadline."""

    channel: JobChannel
    plane: ControlPlane
    number: int
    store: StoreClient
    #: The job as the latest committed round left it, read when the round was opened.
    record: Optional[JobRecord]
    #: The ranks that offer themselves to the job as it stands (see :func:`offer`), read when opened.
    offers: tuple[int, ...] = ()

    @classmethod
    def open(cls, channel: JobChannel, plane: ControlPlane, deadline: float,
             store: Optional[StoreClient] = None) -> RecoveryRound:
        """This rank's view of the job's open round (nothing is written yet), over ``store``
        (default: a client of the plane's, bounded by ``deadline``). Three requests: the round's
        number, the committed record and the offers, each read without a wait."""
        store = store or plane.client(deadline)
        try:
            number = current_round(channel, plane, store)
            record = read_record(channel, store)
            return cls(channel, plane, number, store, record,
                       _offers(channel, store, record.generation if record else 0))
        except (dist.DistError, StoreUnresponsiveError) as exc:
            raise _store_failed("open a recovery round", exc) from exc

    def key(self, name: str) -> str:
        return self.channel.key(self.number, name)

    @property
    def name(self) -> str:
        return f"round {self.number} of the job"

    # ------------------------------------------------------------------ the wait
    def agree(self, domain: Sequence[int], arrival: Arrival, *, bound_s: float, board: LossView,
              offers: Sequence[int] = (), node: Optional[Node] = None) -> FailureVerdict:
        """Arrive with ``arrival`` and return the round's verdict, as every participant reads it.

        ``domain``: every rank the job counts on (those that do not come are found failed);
        ``offers``: ranks outside it that offered themselves, waited for alike and taken as spares
        if they come. ``bound_s``: how long a rank that is alive but absent is waited for; the
        store's deadline bounds the whole wait: past it, this rank abandons the round. ``node``:
        this rank's node; the participants of a node arrive in one batch
        (:mod:`~hypergrid.runtime.node_count`: ``domain`` and ``offers`` ascending, to count a
        node's participants in O(log N)) and read the verdict from the store once
        (:mod:`~hypergrid.runtime.node_read`). None: this rank arrives and reads on its own.

        Raises:
            ExcludedByRecovery: this rank is in the verdict's failed set (it came too late).
            RecoveryError: the round was abandoned, or the store stopped answering.
        """
        store, rank = self.store, arrival.rank
        waiting = _Waiting(rank, domain, offers, time.monotonic(), node=node)
        try:
            peers = _node_peers(node, domain, offers, board.known_lost()) if node is not None else 1
            # Arrivals are read by rank and counted only as a hint to read them: one may count twice.
            place = count_in(store, Tally(self.key("count"), self.key("here"), exactly_once=False), rank,
                             encode(arrival) + "\n", node=node, peers=peers).place
            leader = _UNKNOWN
            if place == 1:
                publish(self.channel, self.plane, BoardEvent(EventKind.ROUND, rank, arrival.reason,
                                                             number=self.number, by=rank), store)
            if place is not None and place <= _CONTENDERS:
                store.set(self.key("wake"), "")
                waiting.woke_spares = True
                leader = int(store.compare_set(self.key("leader"), "", str(rank)))
            while True:
                if leader == rank:
                    decided = self._lead(waiting, board, bound_s)
                else:
                    decided, leader = self._follow(waiting, leader)
                if decided is not None:
                    verdict = decided
                    break
        except StoreUnresponsiveError as exc:
            if store.remaining() <= 0:
                self.abandon(f"rank {rank} reached its deadline before the participants agreed on who failed")
                return self._standing_or_raise(rank)
            raise _store_failed("agree on who failed", exc) from exc
        except dist.DistError as exc:
            raise _store_failed("agree on who failed", exc) from exc
        finally:
            if waiting.shared is not None:
                waiting.shared.close()
        return _checked(verdict, rank, self.name)

    def _standing(self) -> Optional[FailureVerdict]:
        key = self.key("verdict")  # followers wait on it: a peek would wake them (StoreClient.get_if_set)
        return decode(FailureVerdict, self.store.get(key)) if self.store.check([key]) else None

    def _lead(self, waiting: _Waiting, board: LossView, bound_s: float) -> Optional[FailureVerdict]:
        """One look of the leader: the verdict once it can be decided (None: look again)."""
        store = self.store
        standing = self._standing()  # a participant that gave up at its deadline decided already
        if standing is not None:
            return standing
        if not waiting.woke_spares:  # it took over from a first arrival that may have died before
            store.set(self.key("wake"), "")
            waiting.woke_spares = True
        store.add(self.key("leader_beat"), 1)
        count = int(store.add(self.key("count"), 0))
        lost = board.refresh(store)
        waited = time.monotonic() - waiting.since
        expected = len(waiting.domain) + len(waiting.offers) - sum(1 for r in lost if r in waiting.ranks)
        if count != waiting.read_at and (count >= expected or waited >= bound_s
                                         or store.remaining() <= ABANDON_MARGIN_S + _POLL_S):
            waiting.arrivals, waiting.read_at = self._arrivals(), count  # the whole list: only when it may do
        proposal = decide(RoundView(self.number, waiting.domain, waiting.arrivals, lost, waited, waiting.offers,
                                    board_read=board.seen), bound_s=bound_s, remaining_s=store.remaining())
        if proposal is None:
            time.sleep(_POLL_S)
            return None
        store.compare_set(self.key("verdict"), "", encode(proposal))
        return decode(FailureVerdict, store.get(self.key("verdict")))

    def _follow(self, waiting: _Waiting, leader: int) -> tuple[Optional[FailureVerdict], int]:
        """One slice of a participant that is not the leader: (the verdict or None, the leader now:
        this rank, where it took over from a leader whose beat stood still)."""
        store = self.store
        if waiting.shared is None:
            waiting.shared = NodeRead.of(self.key("verdict"), waiting.node.index if waiting.node else None)
        # One blocking get per node, not a wait and then a get per participant: at 16,384
        # participants each request saved is 16,384 fewer for the store to serve in the round.
        read = waiting.shared.read(store, self.key("verdict"), _FOLLOW_SLICE_S)  # it stops at the deadline itself
        if read.value is not None:
            return decode(FailureVerdict, read.value), leader
        if store.remaining() <= 0:
            raise StoreUnresponsiveError("the recovery's deadline passed before a verdict")
        if read.covered:  # the node's reader looks at the leader's beat, and takes over, for the node
            return None, leader
        beat, now = int(store.add(self.key("leader_beat"), 0)), time.monotonic()
        if beat != waiting.leader_beat:
            waiting.leader_beat, waiting.leader_since = beat, now
            return None, leader
        if now - waiting.leader_since < _LEADER_QUIET_S:
            return None, leader
        if leader == _UNKNOWN:  # who leads (nobody, where the first arrival died before it said so)
            leader = int(store.compare_set(self.key("leader"), "", str(waiting.rank)))
            if leader == waiting.rank:
                waiting.shared.close()  # it decides now: its node's followers elect another reader
                logger.warning("rank %d: nobody decides %s; rank %d does now", waiting.rank, self.name, leader)
                waiting.leader_since = now
                return None, leader
        taken = int(store.compare_set(self.key("leader"), str(leader), str(waiting.rank)))
        if taken == waiting.rank:
            waiting.shared.close()
        logger.warning("rank %d: the leader of %s (rank %d) stopped deciding; rank %d decides now",
                       waiting.rank, self.name, leader, taken)
        waiting.leader_since = now
        return None, taken

    def _arrivals(self) -> dict[int, Arrival]:
        lines = self.store.get(self.key("here")).decode().splitlines()
        return {a.rank: a for a in (decode(Arrival, line) for line in lines if line)}

    def abandon(self, message: str) -> None:
        """End this round's wait for every participant with an error (this rank gives up)."""
        with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
            self.store.extend(2.0)
            self.store.compare_set(self.key("verdict"), "", encode(FailureVerdict((), self.number, abandoned=message)))

    def _standing_or_raise(self, rank: int) -> FailureVerdict:
        try:
            return _checked(decode(FailureVerdict, self.store.get(self.key("verdict"))), rank, self.name)
        except (dist.DistError, StoreUnresponsiveError) as exc:
            raise _store_failed("read the round's verdict", exc) from exc

    # ------------------------------------------------------------------ the end
    def end(self, outcome: RoundEnd) -> RoundEnd:
        """Make ``outcome`` how this round's attempt ended, unless another end stands; the standing one."""
        try:
            self.store.extend(2.0)
            return decode(RoundEnd, self.store.compare_set(self.key("end"), "", encode(outcome)))
        except (dist.DistError, StoreUnresponsiveError) as exc:
            raise _store_failed("record how the recovery ended", exc) from exc

    def wait_end(self) -> RoundEnd:
        """How the attempt ended, for a participant that builds nothing (an unused spare, a rank
        whose replica was dropped): until the deadline, then this rank ends it as failed."""
        try:
            while True:
                end = self.store.get_within(self.key("end"), _FOLLOW_SLICE_S)
                if end is not None:
                    return decode(RoundEnd, end)
                if self.store.remaining() <= 0:
                    return self.end(RoundEnd(False, "the ranks of the new placement did not finish before the "
                                                    "recovery's deadline"))
        except (dist.DistError, StoreUnresponsiveError) as exc:
            raise _store_failed("learn how the recovery ended", exc) from exc

    def commit(self, record: JobRecord) -> None:
        """Record the job this round left (every member of the new placement writes the same)."""
        try:
            self.store.extend(2.0)
            self.store.set(self.channel.key("committed"), encode(record))
        except (dist.DistError, StoreUnresponsiveError) as exc:
            raise _store_failed("record the recovered job", exc) from exc

    def close(self) -> None:
        """Advance the job's round past this one (idempotent: whoever comes first)."""
        with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
            self.store.extend(2.0)
            end_round(self.store, self.channel.key("round"), self.number)


def _node_peers(node: Node, domain: Sequence[int], offers: Sequence[int], lost: set[int]) -> int:
    """How many participants of a round may come from ``node``: its ranks among ``domain`` and
    ``offers`` (each ascending), less those known lost (its writer does not wait for them).

    Example: node 1 of nodes of 4 holds ranks 4-7 of the job, rank 6 is lost (and rank 2, on
    node 0), and the offer (rank 9) is on node 2::

        >>> _node_peers(Node(1, 4), range(8), [9], {6, 2})
        3
    """
    gone = sum(1 for r in lost if node.holds(r) and (_among(domain, r) or _among(offers, r)))
    return node.peers_in(domain) + node.peers_in(offers) - gone


def _among(ranks: Sequence[int], rank: int) -> bool:
    at = bisect_left(ranks, rank)
    return at < len(ranks) and ranks[at] == rank


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


def _offers(channel: JobChannel, store: StoreClient, generation: int) -> tuple[int, ...]:
    raw = store.get_if_set(channel.key("offers"))
    if raw is None:
        return ()
    lines = raw.decode().split()
    return tuple(sorted({int(r) for r, g in (line.split(":") for line in lines) if int(g) == generation}))


def offer(channel: JobChannel, plane: ControlPlane, rank: int) -> int:
    """Offer ``rank`` (outside the job: counted out earlier, now fit again) to the job as it stands:
    the next round that commits waits for it and takes it as a spare, and the job's board says it
    is back (it was lost). An offer holds for the job as its latest committed round left it;
    returns that round's generation (0: none committed).

    Example: see ``ResilientJob.offer``.
    """
    store = plane.client(time.monotonic() + 30.0)
    try:
        record = read_record(channel, store)
        generation = record.generation if record is not None else 0
        publish(channel, plane, BoardEvent(EventKind.BACK, rank, "it offers itself again", by=rank), store)
        store.append(channel.key("offers"), f"{rank}:{generation}\n")
        return generation
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise _store_failed("offer this rank", exc) from exc


def wait_for_round(channel: JobChannel, plane: ControlPlane, *, timeout: timedelta) -> bool:
    """Block (a spare, outside the grid) until a recovery round of the job opens (True), or the job
    releases its spares (:func:`release_spares`) or ``timeout`` passes (False). One blocking store
    wait at a time: a waiting spare costs the store a call every half a minute, and no CPU.

    Example: see ``ResilientJob.wait_as_spare``.
    """
    end = time.monotonic() + timeout.total_seconds()
    store = plane.client(end + 5.0)
    try:
        while True:
            wake = channel.key(current_round(channel, plane, store), "wake")
            left = end - time.monotonic()
            if left <= 0:
                return False
            store.extend(min(_SPARE_SLICE_S, left) + 5.0)
            woken = store.wait([wake], min(_SPARE_SLICE_S, left))
            if store.check([channel.key("released")]):
                return False
            if woken:
                return True
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise _store_failed("wait for a recovery", exc) from exc


def release_spares(channel: JobChannel, plane: ControlPlane) -> None:
    """Tell the spares of the job that wait in :func:`wait_for_round` that the job is over: they
    return (False) at once. Any rank may call it, any number of times; a later job on the same
    ranks has a channel of its own, which this does not touch.

    Example: see ``ResilientJob.release_spares``.
    """
    store = plane.client(time.monotonic() + 30.0)
    try:
        store.set(channel.key("released"), "1")
        store.set(channel.key(current_round(channel, plane, store), "wake"), "")
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise _store_failed("release the spares", exc) from exc
