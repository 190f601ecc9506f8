"""Agreeing on who is gone: a job's recovery rounds, each decided once and read by every participant.

A resilient job (its grid's ranks and its spares) has a *channel* in the job's store, named by
what every rank of it shares: the job's first ranks (a digest) and the job's *instance*, which
all of them read together when the job is made (:func:`open_channel`, a world step over those
ranks), so a second job on the same ranks has a channel of its own. In it the store counts the
job's recovery *rounds*; round ``n`` is open until its participants close it, whatever it ended
in (a recovery committed, nobody found failed, an attempt that failed or was refused), so the
next recovery, a retry after an error and a spare's next wait always meet in a new round:

``round``
    the number of the round now open (or next); advanced once per round (compare-and-set).
``committed``
    the job as its latest committed round left it (:class:`~hypergrid.runtime.wire.JobRecord`):
    the store, not a rank's memory, says where the grid is, so a rank that missed an end reads it.
``released``
    set once the job lets its spares go.
``offers``
    ranks outside the job that offer themselves as spares, each with the generation of the
    committed record it offers itself to (:func:`offer`).
``<n>/here``, ``<n>/count``, ``<n>/wake``
    the arrivals (:class:`~hypergrid.runtime.wire.Arrival`), their count, and the key spares
    block on, set by every arrival (and by a release).
``<n>/verdict``
    the round's one :class:`~hypergrid.runtime.wire.FailureVerdict` (compare-and-set: the first
    proposal stands).
``<n>/end``
    how the attempt that followed ended (:class:`~hypergrid.runtime.wire.RoundEnd`), likewise once.

**Who is failed.** A participant waits until every rank of the job has arrived, or has a stopped
heartbeat (:mod:`hypergrid.runtime.liveness`). A rank whose heartbeat runs is never counted as
failed while it can still arrive: it may be blocked in a collective with a peer that left for
the recovery, and leaves it when that collective times out, so it is waited for up to
``bound_s`` (the job's longest collective timeout and a margin), then counted out as hung, with
that reason. A rank that arrived and then stopped beating (a launcher ending a node's workers
one after the other) is failed too; while any heartbeat has just gone quiet (for a few beats,
not yet stale) the proposal waits for it to settle, so a node lost over a second or two is one
verdict. A participant whose deadline passes before anything can be decided abandons the round:
every participant then raises :class:`~hypergrid.errors.RecoveryError` alike.

Example, in a one-rank gloo world whose store is a ``HashStore``: of the job ``[0, 1]``, rank 1
never comes and has no heartbeat, and is found failed once it counts as stale::

    >>> import time
    >>> import torch.distributed as dist
    >>> from hypergrid.runtime.wire import Arrival
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> channel = JobChannel.of([0, 1], 0)
    >>> rnd = RecoveryRound.open(channel, time.monotonic() + 5)
    >>> verdict = rnd.agree([0, 1], Arrival(0, step=3), bound_s=30, stale_after_s=0.3, settle_s=0.1)
    >>> verdict.failed, verdict.present, verdict.step, verdict.reasons[0]
    ((1,), (0,), 3, 'rank 1: its heartbeat stopped (died or frozen) before it arrived')
    >>> rnd.close(); current_round(channel)
    1
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import ExcludedByRecovery, RecoveryError, StoreUnresponsiveError
from ..layout.describe import describe_ranks, one_line
from .liveness import LivenessWatch
from .store import PREFIX, StoreClient, agreement_possible, end_round
from .wire import Arrival, FailureVerdict, JobRecord, RoundEnd, decode, encode, members_digest
from .world_step import world_checkpoint, world_start

__all__ = ["JobChannel", "RecoveryRound", "open_channel", "current_round", "read_record", "wait_for_round",
           "release_spares", "offer"]

logger = logging.getLogger(__name__)

#: How long a participant pauses between looks at the verdict, the arrivals and the heartbeats.
_POLL_S = 0.1
#: How long a waiting spare blocks on the store at a time (a release also wakes it at once).
_SPARE_SLICE_S = 30.0


@dataclass(frozen=True)
class JobChannel:
    """Where one job's rounds live in the store: its first ranks (a digest) and its instance.

    Example::

        >>> JobChannel.of([1, 0], 2).key("round") == JobChannel.of([0, 1], 2).key("round")
        True
    """

    origin: str
    instance: int

    @classmethod
    def of(cls, origin: Sequence[int], instance: int) -> JobChannel:
        return cls(members_digest(sorted(set(origin))), instance)

    def key(self, *parts: object) -> str:
        return "/".join([PREFIX, "job", self.origin, str(self.instance), *map(str, parts)])


def open_channel(origin: Sequence[int], *, timeout: timedelta) -> JobChannel:
    """The channel of a job whose ranks (grid and spares) are ``origin``: every one of them calls
    it when the job is made, and all read the same instance (a world step over them: a rank that
    never comes fails it on the others, naming it, within ``timeout``).

    Example::

        >>> open_channel([0, 1], timeout=timedelta(seconds=5))      # no process group: instance 0
        JobChannel(origin='fa5836450376bf4bf592', instance=0)
    """
    ranks = sorted(set(origin))
    if not agreement_possible():
        return JobChannel.of(ranks, 0)
    step = world_start("a resilient job's start", timeout=timeout, ranks=ranks)
    world_checkpoint(step, None, timeout=timeout)
    return JobChannel.of(ranks, step.epoch if step is not None else 0)


def current_round(channel: JobChannel, store: Optional[StoreClient] = None) -> int:
    """The number of the job's round now open (or next).

    Example: see the module's."""
    store = store or StoreClient(time.monotonic() + 30.0)
    return int(store.add(channel.key("round"), 0))


def read_record(channel: JobChannel, store: StoreClient) -> Optional[JobRecord]:
    """The job as its latest committed round left it (None: no round has committed yet)."""
    key = channel.key("committed")
    return decode(JobRecord, store.get(key)) if store.check([key]) else None


@dataclass
class RecoveryRound:
    """One participant's view of round ``number`` of a job, with the store calls bounded by a deadline."""

    channel: JobChannel
    number: int
    store: StoreClient
    #: The job as the latest committed round left it, read when the round was opened.
    record: Optional[JobRecord]
    #: The ranks that offer themselves to the job as it stands (see :func:`offer`), read when opened.
    offers: tuple[int, ...] = ()

    @classmethod
    def open(cls, channel: JobChannel, deadline: float) -> RecoveryRound:
        """This rank's view of the job's open round (nothing is written yet)."""
        store = StoreClient(deadline)
        try:
            number = current_round(channel, store)
            record = read_record(channel, store)
            return cls(channel, number, store, record, _offers(channel, store, record.generation if record else 0))
        except (dist.DistError, StoreUnresponsiveError) as exc:
            raise _store_failed("open a recovery round", exc) from exc

    def key(self, name: str) -> str:
        return self.channel.key(self.number, name)

    @property
    def name(self) -> str:
        return f"round {self.number} of the job"

    # ------------------------------------------------------------------ the wait
    def agree(self, domain: Sequence[int], arrival: Arrival, *, bound_s: float, stale_after_s: float,
              settle_s: float) -> FailureVerdict:
        """Arrive with ``arrival`` and return the round's verdict, as every participant reads it.

        ``domain``: every rank the job counts on (those that do not come are found failed);
        ranks outside it that arrive (ranks offering themselves) are among ``present``.
        ``bound_s``: how long a rank whose heartbeat runs is waited for; ``stale_after_s``: how
        long a stopped heartbeat means gone; ``settle_s``: how long a heartbeat may have been
        quiet and still count as running while the others settle. The store's deadline bounds
        the whole wait: past it, this rank abandons the round.

        Raises:
            ExcludedByRecovery: this rank is in the verdict's failed set (it came too late).
            RecoveryError: the round was abandoned, or the store stopped answering.
        """
        store, rank = self.store, arrival.rank
        ranks = sorted(set(domain))
        try:
            store.append(self.key("here"), encode(arrival) + "\n")
            store.add(self.key("count"), 1)
            store.set(self.key("wake"), "")
            watch = LivenessWatch(stale_after_s)
            started = time.monotonic()
            seen, arrivals = -1, {}
            others = [r for r in ranks if r != rank]
            while True:
                # A look, not a blocking get: a store get that runs out costs the client a
                # cancellation round trip (and a warning in its log) each time.
                if store.check([self.key("verdict")]):
                    verdict = decode(FailureVerdict, store.get(self.key("verdict")))
                    break
                count = int(store.add(self.key("count"), 0))
                if count != seen:
                    seen, arrivals = count, self._arrivals()
                silence = watch.silence(others, store)
                proposal = self._proposal(ranks, arrivals, silence, time.monotonic() - started, bound_s,
                                          stale_after_s, settle_s)
                if proposal is None:
                    time.sleep(_POLL_S)
                    continue
                store.compare_set(self.key("verdict"), "", encode(proposal))
                verdict = decode(FailureVerdict, store.get(self.key("verdict")))
                break
        except StoreUnresponsiveError as exc:
            if store.remaining() <= 0:
                self.abandon(f"rank {rank} reached its deadline before the participants agreed on who failed")
                return self._standing_or_raise(rank)
            raise _store_failed("agree on who failed", exc) from exc
        except dist.DistError as exc:
            raise _store_failed("agree on who failed", exc) from exc
        return _checked(verdict, rank, self.name)

    def _arrivals(self) -> dict[int, Arrival]:
        lines = self.store.get(self.key("here")).decode().splitlines()
        return {a.rank: a for a in (decode(Arrival, line) for line in lines if line)}

    def _proposal(self, ranks: list[int], arrivals: dict[int, Arrival], silence: dict[int, float], waited: float,
                  bound_s: float, stale_after_s: float, settle_s: float) -> Optional[FailureVerdict]:
        stale = {r for r, quiet in silence.items() if quiet >= stale_after_s}
        settling = {r for r, quiet in silence.items() if settle_s <= quiet < stale_after_s}
        absent = [r for r in ranks if r not in arrivals]
        live_absent = [r for r in absent if r not in stale]
        reasons = {r: "its heartbeat stopped (died or frozen) before it arrived" for r in absent if r in stale}
        reasons.update({r: "it arrived, then its heartbeat stopped (died or frozen)" for r in arrivals if r in stale})
        if live_absent or settling:
            if waited < bound_s:
                if self.store.remaining() <= 0.2:
                    return FailureVerdict((), self.number, abandoned=(
                        f"ranks {describe_ranks(live_absent or sorted(settling))} neither arrived nor stopped "
                        f"their heartbeat before the recovery's deadline"))
                return None
            reasons.update({r: f"its heartbeat runs, but it did not arrive within {bound_s:g} s (the job's "
                               f"longest collective timeout and a margin): it hangs" for r in live_absent})
        failed = tuple(sorted(reasons))
        present = {r: a for r, a in arrivals.items() if r not in reasons}
        steps = [a.step for a in present.values() if a.step is not None]
        aborted = sorted({tuple(g) for a in present.values() for g in a.aborted})
        return FailureVerdict(failed, self.number, tuple(f"rank {r}: {reasons[r]}" for r in failed),
                              tuple(sorted(present)), min(steps) if steps else None,
                              any(a.reason == "grow" for a in present.values()),
                              any(a.reason == "recover" for a in present.values()), tuple(aborted))

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
                if self.store.check([self.key("end")]):
                    return decode(RoundEnd, self.store.get(self.key("end")))
                time.sleep(min(_POLL_S, max(0.0, self.store.remaining())))
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
    key = channel.key("offers")
    if not store.check([key]):
        return ()
    lines = store.get(key).decode().split()
    return tuple(sorted({int(r) for r, g in (line.split(":") for line in lines) if int(g) == generation}))


def offer(channel: JobChannel, rank: int) -> int:
    """Offer ``rank`` (outside the job: counted out earlier, now fit again) to the job as it stands:
    the next round that commits waits for it and takes it as a spare. An offer holds for the job
    as its latest committed round left it; returns that round's generation (0: none committed).

    Example::

        >>> offer(JobChannel.of([0, 1], 0), 3)      # no process group: nothing to offer to
        0
    """
    if not agreement_possible():
        return 0
    store = StoreClient(time.monotonic() + 30.0)
    try:
        record = read_record(channel, store)
        generation = record.generation if record is not None else 0
        store.append(channel.key("offers"), f"{rank}:{generation}\n")
        return generation
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise _store_failed("offer this rank", exc) from exc


def wait_for_round(channel: JobChannel, *, timeout: timedelta) -> bool:
    """Block (a spare, outside the grid) until a recovery round of the job opens (True), or the job
    releases its spares (:func:`release_spares`) or ``timeout`` passes (False). One blocking store
    wait at a time: a waiting spare costs the store a call every half a minute, and no CPU.

    Example::

        >>> wait_for_round(JobChannel.of([0, 1], 0), timeout=timedelta(seconds=0.1))   # no process group
        False
    """
    if not agreement_possible():
        return False
    end = time.monotonic() + timeout.total_seconds()
    store = StoreClient(end + 5.0)
    try:
        while True:
            wake = channel.key(current_round(channel, store), "wake")
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


def release_spares(channel: JobChannel) -> None:
    """Tell the spares of the job that wait in :func:`wait_for_round` that the job is over: they
    return (False) at once. Any rank may call it, any number of times; a later job on the same
    ranks has a channel of its own, which this does not touch.

    Example::

        >>> release_spares(JobChannel.of([0, 1], 0))   # no process group: nobody waits
    """
    if not agreement_possible():
        return
    store = StoreClient(time.monotonic() + 30.0)
    try:
        store.set(channel.key("released"), "1")
        store.set(channel.key(current_round(channel, store), "wake"), "")
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise _store_failed("release the spares", exc) from exc
