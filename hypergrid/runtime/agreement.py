"""Agreement across ranks: a group's members check they asked for the same thing before waiting.

torch's group constructors block until every member arrives; a member that built another grid,
asked in another order, or died leaves the others waiting for the full timeout with no hint of
who or why. So the members first meet in a *check* in the job's store, named by what they share:
their member set and an *epoch* the store counts for it. The lowest member, the *decider*, reads
every entry and decides the check's verdict (a follower decides a timeout where its decider is
silent); every member acts on the verdict that stands. The invariant:

    An epoch is advanced only once every member has read it, or once its check has failed for
    every member that reads its verdict, and before its verdict is posted. So two members read
    the same epoch exactly when they are in the same check.

While waiting, a member looks at the absent members' last states (:mod:`.diagnosis`) and stops
early only on evidence that cannot be stale. The protocol, its waits and what it costs the store
are in docs/architecture.md ("Agreement").

Example::

    >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
    >>> request = RequestFacts(label="dp", view=None, private=False, backend=None, timeout_s=None,
    ...                        pg_options=None, mode="local")
    >>> agreement = Agreement(Position("grid:tp,dp", facts.digest, 3), facts, request)
    >>> check_agreement("dp", [5], agreement, timeout=timedelta(seconds=1)) is None   # alone: nothing to check
    True
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import GridMismatchError, GroupCreationError, GroupTimeoutError, StoreUnresponsiveError
from ..layout.describe import describe_ranks, one_line
from ..store import meeting
from ..store.client import advance_epoch, read_last
from ..store.keys import last_state_key
from ..store.records import (
    Agreement,
    Asked,
    CheckId,
    CheckOutcome,
    Entry,
    GridFacts,  # noqa: F401 (the examples)
    LastState,
    Position,  # noqa: F401 (the examples)
    RequestFacts,  # noqa: F401 (the examples)
    State,
    Verdict,
    decode,
    encode,
)
from .check import Check
from .diagnosis import concurrency_hint, differences, entries_of, format_differences, judge_absent, last_states
from .environment import agreement_possible, job_store
from .scope import WATCH_SLICE_S, lost_among, watching_now

__all__ = ["check_agreement", "publish_position", "explain_creation_failure"]

logger = logging.getLogger(__name__)

#: How long survivors of a failed creation wait for the other members to report their own failure
#: before naming those who did not as the ones that died or hung (only the message depends on it).
_FAILURE_GRACE_S = 2.0
#: How long a follower first blocks on its decider's verdict before it starts looking for trouble
#: itself, and the longest slice of any wait outside a recovery (see :func:`_slices`).
_SLICE_S = 3.0
#: How long the decider first blocks on its members' arrival before it looks for who is absent.
_FIRST_LOOK_S = 0.25
#: What a member keeps of its timeout for the calls that close a check it gave up waiting on.
_CLOSING_S = 0.5


def publish_position(agreement: Agreement) -> None:
    """Record that this rank issued ``agreement``'s request without being in any of its groups.

    A member waiting on this rank then sees it at this request with its own facts (say, another
    ``rank_offset``) and reports the difference at once instead of waiting for the timeout.

    The registry calls it on ranks outside every group of a request. Example, in a one-rank gloo
    world whose store is a ``HashStore``::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
        >>> request = RequestFacts(label="dp", view=None, private=False, backend=None, timeout_s=None,
        ...                        pg_options=None, mode="local")
        >>> publish_position(Agreement(Position(facts.family, facts.digest, 3), facts, request))
        >>> last = read_last(job_store(time.monotonic() + 5), 0)        # rank 0's last state
        >>> last.state.value, last.position.index, last.asked.agreement.grid.shape
        ('passed', 3, (2, 4))
        >>> dist.destroy_process_group()
    """
    if not agreement_possible():
        return
    state = LastState(State.PASSED, "", "", -1, Asked(agreement, None))
    with contextlib.suppress(dist.DistError, StoreUnresponsiveError):  # reported where someone waits
        job_store(time.monotonic() + _SLICE_S).set(last_state_key(dist.get_rank()), encode(state))


def check_agreement(label: str, members: Sequence[int], agreement: Agreement, *, timeout: timedelta) -> Optional[CheckId]:
    """Return once every member of ``members`` published the same ``agreement`` in one check.

    Returns the check (None for a group of one, or where there is no store to meet in), whose
    :attr:`CheckId.seed` names torch's group alike on every member. Raises
    :class:`~hypergrid.errors.GridMismatchError` naming the ranks and fields that differ, or
    :class:`~hypergrid.errors.GroupTimeoutError` naming the members that did not arrive within
    ``timeout``; the same error on every member of the check, the one that differs included. A
    store that stops answering raises :class:`~hypergrid.errors.GroupCreationError` naming the
    group, within the timeout.

    Example, in a one-rank gloo world whose store is a ``HashStore``: a group of rank 0 alone
    has nothing to check, and one with rank 1, which never comes, times out naming it::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
        >>> request = RequestFacts(label="tp", view=None, private=False, backend=None, timeout_s=None,
        ...                        pg_options=None, mode="local")
        >>> agreement = Agreement(Position(facts.family, facts.digest, 0), facts, request)
        >>> check_agreement("tp", [0], agreement, timeout=timedelta(seconds=10)) is None
        True
        >>> check_agreement("tp", [0, 1], agreement, timeout=timedelta(seconds=0.2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        hypergrid.errors.GroupTimeoutError: hypergrid: process group 'tp' (members [0, 1]): ranks [1] did not arrive within the timeout (0.2 s); rank 1 never reached a hypergrid group creation
        >>> dist.destroy_process_group()
    """
    members = sorted(members)
    if len(members) <= 1 or not agreement_possible():
        return None
    started = time.monotonic()
    store = job_store(started + timeout.total_seconds())
    where = f"process group {label!r} (members {describe_ranks(members)})"
    try:
        check = Check.opened(store, label, members, agreement)
        try:
            _arrive(check)
            if check.rank == check.decider:
                _lead(check, timeout)
            else:
                _follow(check, timeout)
        except (GridMismatchError, GroupTimeoutError) as exc:
            _leave_failed(check, exc)
            raise
    except StoreUnresponsiveError as exc:
        raise GroupCreationError(
            f"hypergrid: {where}: {exc}, while the members were checking that they agree. The process "
            f"hosting the store (rank 0 with init_method 'env://' or 'tcp://', or the launcher's agent) "
            f"may be stopped, overloaded or unreachable; nothing is known of the other members."
        ) from exc
    except dist.DistError as exc:
        raise GroupCreationError(
            f"hypergrid: {where}: the job's store stopped answering while the members were checking "
            f"that they agree ({type(exc).__name__}: {one_line(str(exc), 200)}). The process hosting "
            f"the store (rank 0 with init_method 'env://' or 'tcp://', or the launcher's agent) has "
            f"likely exited: look at its error first."
        ) from exc
    logger.debug("members of %s agree in check %s (%.1f ms)", label, check.check_id.name, (time.monotonic() - started) * 1e3)
    return check.check_id


def _arrive(check: Check) -> None:
    """Publish this member's entry and last state in one round trip, then count it in."""
    entry = encode(Entry(check.epoch, check.digest, check.asked))
    check.store.multi_set([last_state_key(check.rank), check.keys.entry(check.rank)],
                          [encode(check.last_state(State.WAITING)), entry])
    meeting.arrive(check.store, check.meeting, len(check.members), str(check.rank), awaited=True)


def _leave_failed(check: Check, exc: BaseException) -> None:
    """Mark this rank failed and end the check (whoever is first) before raising."""
    root = getattr(exc, "root_cause", None) or one_line(str(exc))
    with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
        check.store.set(last_state_key(check.rank), encode(check.last_state(State.FAILED, root, isinstance(exc, GridMismatchError))))
        advance_epoch(check.store, check.keys.epoch, check.epoch)
        if check.rank == check.decider:
            meeting.forget(check.store, check.meeting, keep_outcome=True)


def _decide(check: Check, proposed: Verdict, root_cause: Optional[str] = None) -> None:
    """Make ``proposed`` the check's one verdict unless another came first; act on the one that stands."""
    standing = decode(Verdict, check.store.compare_set(check.meeting.outcome, "", encode(proposed)))
    _act_on(standing, root_cause if standing == proposed else None)


def _act_on(verdict: Verdict, root_cause: Optional[str] = None) -> None:
    if verdict.outcome is CheckOutcome.OK:
        return
    error = GroupTimeoutError if verdict.outcome is CheckOutcome.TIMEOUT else GridMismatchError
    raise error(verdict.message, root_cause=root_cause)


def _waiting_until(check: Check, timeout: timedelta) -> float:
    """The deadline less what the closing calls need, so the error itself arrives within the timeout."""
    return check.store.deadline - min(_CLOSING_S, 0.05 * timeout.total_seconds())


def _timeout_message(check: Check, missing: list[int], timeout: timedelta) -> str:
    return (
        f"hypergrid: {check.where()}: ranks {describe_ranks(missing)} did not arrive within the timeout "
        f"({timeout.total_seconds():g} s); {last_states(check, missing)}"
    )


def _slices(first: float) -> Iterator[float]:
    """How long each blocking call of a wait lasts: doubling from ``first`` up to :data:`_SLICE_S`
    (:data:`~hypergrid.runtime.scope.WATCH_SLICE_S` inside a recovery, so a lost member ends it soon).

    Example::

        >>> from itertools import islice
        >>> list(islice(_slices(0.25), 7))
        [0.25, 0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    """
    length = first
    while True:
        yield length
        length = min(2 * length, WATCH_SLICE_S if watching_now() else _SLICE_S)


def _arrived(check: Check) -> set[int]:
    """The members in the check's list of arrivals, read by the decider, whose own arrival made it."""
    return {int(r) for r in check.store.get(check.meeting.lines).decode().split()}


def _lead(check: Check, timeout: timedelta) -> None:
    try:
        entries = _await_members(check, timeout)
        if len({e.digest for e in entries.values()}) > 1:
            diffs = differences({r: e.asked.fields() for r, e in entries.items()})
            raise GridMismatchError(
                f"hypergrid: ranks disagree on {check.where()}, so it was not created:\n  {format_differences(diffs)}"
                + concurrency_hint(diffs)
            )
    except (GroupTimeoutError, GridMismatchError) as exc:
        outcome = CheckOutcome.TIMEOUT if isinstance(exc, GroupTimeoutError) else CheckOutcome.MISMATCH
        _decide(check, Verdict(outcome, str(exc)), exc.root_cause)
    # Advance before saying yes, so no member can read this epoch again for its next request.
    advance_epoch(check.store, check.keys.epoch, check.epoch)
    _decide(check, Verdict(CheckOutcome.OK, ""))
    _drop_old_keys(check)


def _await_members(check: Check, timeout: timedelta) -> dict[int, Entry]:
    """Every member's entry, once all have arrived (the decider's wait); between two slices it
    looks at the absent once (:func:`~hypergrid.runtime.diagnosis.judge_absent`)."""
    until = _waiting_until(check, timeout)
    slices = _slices(_FIRST_LOOK_S)
    counted = False  # once counted, the complete key is set and a wait returns at once: sleep instead
    while True:
        seconds = min(next(slices), until - time.monotonic())
        if counted:
            # Counted but a member missing: one left an earlier call in this check and came again.
            time.sleep(max(0.0, seconds))
            arrived = _arrived(check)
            complete = set(check.members) <= arrived
        else:
            counted = complete = check.store.wait([check.meeting.complete], seconds)
            if not complete:
                arrived = _arrived(check)
        if complete:
            entries = entries_of(check, check.members)
            if len(entries) == len(check.members):
                return entries
            arrived = set(entries)
        absent = [r for r in check.members if r not in arrived]
        if time.monotonic() >= until:
            raise GroupTimeoutError(_timeout_message(check, absent, timeout))
        judge_absent(check, absent)


def _drop_old_keys(check: Check) -> None:
    """Delete the previous check's verdict (every member is past it) and this check's arrival keys."""
    if check.epoch > 0:
        check.store.delete_key(check.keys.meeting(check.epoch - 1).outcome)
    meeting.forget(check.store, check.meeting, keep_outcome=True)


def _follow(check: Check, timeout: timedelta) -> None:
    # A decider that died or went another way decides nothing: between slices the follower looks
    # at it alone, and at the deadline proposes a timeout itself unless a verdict stands.
    until = _waiting_until(check, timeout)
    leader_came = False
    message: Optional[str] = None  # the timeout this follower proposes
    try:
        for length in _slices(_SLICE_S):
            raw = check.store.get_within(check.meeting.outcome, min(length, until - time.monotonic()))
            if raw is not None:
                _act_on(decode(Verdict, raw))
                return
            if time.monotonic() >= until:
                break
            leader_came = leader_came or check.decider in entries_of(check, [check.decider])
            if not leader_came:
                judge_absent(check, [check.decider])
            elif lost_among([check.decider]):
                message = (
                    f"hypergrid: {check.where()} cannot be created: its decider, rank {check.decider}, was lost "
                    f"(the job's board says so) after it arrived, before it decided; the others stop waiting for it")
                break
    except GridMismatchError as exc:
        _decide(check, Verdict(CheckOutcome.MISMATCH, str(exc)), exc.root_cause)
        return
    if message is None:
        # The decider may have deleted the list of arrivals by now: read it only if it is there.
        present = {int(r) for r in meeting.lines(check.store, check.meeting)}
        missing = [r for r in check.members if r not in present]
        message = _timeout_message(check, missing, timeout) if missing else (
            f"hypergrid: {check.where()}: every member arrived, but its decider, rank {check.decider}, did not "
            f"answer within the timeout ({timeout.total_seconds():g} s); {last_states(check, [check.decider])}")
    _decide(check, Verdict(CheckOutcome.TIMEOUT, message))


def explain_creation_failure(label: str, members: Sequence[int], agreement: Optional[Agreement],
                             check_id: Optional[CheckId]) -> str:
    """After torch failed to create an agreed group: marks this rank failed in the check, waits
    briefly for the others to mark theirs, and names those that did not (they died or hang inside
    torch); empty when nothing can be said.

    Example::

        >>> explain_creation_failure("tp", [0, 1], None, None)   # no agreement, nothing to say
        ''
    """
    if agreement is None or check_id is None or len(members) <= 1 or not agreement_possible():
        return ""
    store = job_store(time.monotonic() + _FAILURE_GRACE_S)
    check = Check(store, label, sorted(members), agreement, dist.get_rank(), check_id)
    pause = 0.002  # between two looks, doubling up to 0.1 s
    try:
        store.set(last_state_key(check.rank), encode(check.last_state(State.FAILED, "torch failed to create the group")))
        while True:
            silent = []
            for r in check.members[:64]:
                last = read_last(store, r)
                if last is None or (last.members, last.epoch, last.state) != (check_id.members, check_id.epoch, State.FAILED):
                    silent.append(r)
            if not silent:
                return ""
            now = time.monotonic()
            if now >= store.deadline:
                break
            time.sleep(min(pause, store.deadline - now))
            pause = min(pause * 2, 0.1)
    except (dist.DistError, StoreUnresponsiveError):
        return (
            "the job's store stopped answering too: the process hosting it (rank 0 with 'env://' or "
            "'tcp://', or the launcher's agent) has likely exited or stopped"
        )
    return f"ranks {describe_ranks(silent)} never reported back from this creation (died, or hang inside torch)"
