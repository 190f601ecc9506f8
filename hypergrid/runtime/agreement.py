"""Agreement across ranks: a group's members check they asked for the same thing before waiting.

torch's group constructors block until every member arrives. A member that built a different grid,
asked for groups in another order, or died, leaves the others waiting for the full timeout with no
hint of who or why. hypergrid checks first, through the job's store.

**Rounds.** The members of a group meet in a *round*, named by what they share: their member set
and the round's *epoch*, a counter the store keeps for that member set. A member reads the epoch
when it arrives and publishes what it asks for (an :class:`Agreement`: typed facts of the grid,
the request and where the request stands in its grid's sequence), then counts itself in; the
group's lowest rank, its *leader*, reads every member's entry once the count says all came, and
either advances the epoch and then posts "ok", or posts why not. The invariant that makes this
right by construction:

    An epoch is advanced only once every member has read it (the leader saw all their entries),
    or once its round has failed for every member that reads its verdict; and it is advanced
    before its verdict is posted. So two members read the same epoch exactly when they are in the
    same round, and no member can read a finished round's epoch again.

Nothing a process counts by itself (grids built, requests made, attempts) names a round: whatever
a rank did before (failed alone, sat outside a partial grid, made groups of size one, lived
through a restart over a new store prefix), identical requests of the same members meet in the
same round. A member that leaves a failed round advances its epoch too (an atomic compare-and-set:
whoever comes first), so a retry, which the job starts once every rank is out of its failed
calls, begins a new round on every member alike.

**Verdicts.** One per round, posted once and read by every member, so the members of a round
share its outcome: every member gets the group, or every member gets the same error. A follower
whose leader stays silent gives up at the same deadline as the leader, naming the members that
never arrived.

**Diagnosis.** While waiting, a member looks, once a slice (see **Waits**), at the absent
members' *last states* (each rank's
latest: waiting in a round, failed in one, or passed a request without being in any of its
groups) and stops early only on evidence that cannot be stale: an absent member of the same
member set at a later epoch (it went past this round) or failed in this very round; one blocked
in another round that is still open (its epoch not advanced) at this same request of this grid
family with other members or facts, or one that itself waits for this rank (a wait-for cycle);
or, for ranks outside every group of a request, one that passed this same request with grid
facts that put it elsewhere. Inside a recovery (:func:`~hypergrid.runtime.losses.watching`)
it looks at the job's board too: an absent member that was lost, or a leader lost after it
arrived, will never come. A rank merely busy elsewhere is late, and is waited for.

**Waits.** Every wait is a blocking store call a *slice* at a time, with one look for trouble
between two slices, so that what a waiting member asks of the store per slice does not depend on
the group's size. Each member arrives with its entry (and last state) in one ``multi_set``, its
rank appended to the round's list of arrivals and one ``add`` to the round's count; the member
whose ``add`` completes the count sets the key its leader blocks on. The leader blocks on that
key, first for a quarter of a second, then for twice as long each time up to 3 s (0.5 s inside a
recovery); between two slices it reads the list of arrivals (one ``get``) and looks at the absent
members (the board: one request; their last states: at most 64 of them, one ``check`` and one
``multi_get`` where each has one). A follower blocks on its leader's verdict (one ``get`` a
slice, 3 s for the first, then as the leader's), and between two slices looks at the leader only:
whether it came (until it has), why not, and inside a recovery whether the board says it was lost.

**Store.** Agreement talks to the job's store over a connection of its own (the store's
``clone()``), whose timeout it sets to what is left of the request's, so a store host that stops
answering is reported within the timeout as what it is. Per member set the store holds an epoch
counter, one entry per member (overwritten round after round) and at most a verdict or two, which
the next meeting deletes; per round its list of arrivals, their count and the key the count's
last member sets, which the leader deletes when the round ends (a member that arrives in a failed
round after its leader ended it leaves two of them); per rank one last state. Nothing grows with
create and destroy cycles.

What an agreeing round costs a follower: one ``add`` (read the epoch), one ``multi_set`` (entry
and last state), one ``append`` and one ``add`` (arrive; the last member a ``set`` besides) and
one blocking ``get`` of the verdict. The leader: the same four to arrive, one blocking ``wait``
for the count, one ``check`` and one ``multi_get`` of the entries, two ``compare_set`` (advance
the epoch, decide the verdict) and four ``delete_key`` (the previous verdict, this round's keys
of arrival).

The records that cross the store are in :mod:`hypergrid.runtime.wire`, the bounded store calls
in :mod:`hypergrid.runtime.store`, the diagnosis of absent members in
:mod:`hypergrid.runtime.diagnosis` and the world steps (Megatron's initialization) in
:mod:`hypergrid.runtime.world_step`.

Example::

    >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
    >>> request = RequestFacts(label="dp", view=None, private=False, backend=None, timeout_s=None,
    ...                        pg_options=None, mode="local")
    >>> agreement = Agreement(Position("grid:tp,dp", facts.digest, 3), facts, request)
    >>> check_agreement("dp", [5], agreement, timeout=timedelta(seconds=1)) is None   # alone: nothing to check
    True

In a job, every member of a group checks before creating it (``grid.create_pg`` does this for
you); with members ``[1, 3, 5, 7]``, on each of those four ranks::

    round_id = check_agreement("dp", members=[1, 3, 5, 7], agreement=agreement, timeout=timedelta(seconds=30))
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import GridMismatchError, GroupCreationError, GroupTimeoutError, StoreUnresponsiveError
from ..layout.describe import describe_ranks, one_line
from .diagnosis import concurrency_hint, differences, entries_of, format_differences, judge_absent, last_states
from .losses import WATCH_SLICE_S, lost_among, watching_now
from .round import Round
from .store import StoreClient, agreement_possible, end_round, last_key, read_last
from .wire import (
    Agreement,
    Asked,
    Entry,
    GridFacts,  # noqa: F401 (the examples)
    LastState,
    Position,  # noqa: F401 (the examples)
    RequestFacts,  # noqa: F401 (the examples)
    RoundId,
    RoundOutcome,
    State,
    Verdict,
    decode,
    encode,
)

__all__ = ["check_agreement", "publish_position", "explain_creation_failure"]

logger = logging.getLogger(__name__)

#: How long survivors of a failed creation wait for the other members to report their own failure
#: before naming those who did not as the ones that died or hung (only the message depends on it).
_FAILURE_GRACE_S = 2.0
#: How long a follower first blocks on its leader's verdict before it starts looking for trouble
#: itself, and the longest slice of any wait outside a recovery (see :func:`_slices`).
_SLICE_S = 3.0
#: How long the leader first blocks on its members' arrival before it looks for who is absent.
_FIRST_LOOK_S = 0.25
#: What a member keeps of its timeout for the calls that close a round it gave up waiting on.
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
        >>> last = read_last(StoreClient(time.monotonic() + 5), 0)        # rank 0's last state
        >>> last.state.value, last.position.index, last.asked.agreement.grid.shape
        ('passed', 3, (2, 4))
        >>> dist.destroy_process_group()
    """
    if not agreement_possible():
        return
    state = LastState(State.PASSED, "", "", -1, Asked(agreement, None))
    with contextlib.suppress(dist.DistError, StoreUnresponsiveError):  # reported where someone waits
        StoreClient(time.monotonic() + _SLICE_S).set(last_key(dist.get_rank()), encode(state))


def check_agreement(label: str, members: Sequence[int], agreement: Agreement, *, timeout: timedelta) -> Optional[RoundId]:
    """Return once every member of ``members`` published the same ``agreement`` in one round.

    Returns the round (None for a group of one, or where there is no store to meet in), whose
    :attr:`RoundId.seed` names torch's group alike on every member. Raises
    :class:`~hypergrid.errors.GridMismatchError` naming the ranks and fields that differ, or
    :class:`~hypergrid.errors.GroupTimeoutError` naming the members that did not arrive within
    ``timeout``; the same error on every member of the round, the one that differs included. A
    store that stops answering raises :class:`~hypergrid.errors.GroupCreationError` naming the
    group, within the timeout.

    In a job, every member calls it before creating the group: with a grid of ``tp`` size 2,
    ranks 0 and 1 each call::

        check_agreement("tp", [0, 1], agreement, timeout=timedelta(seconds=10))

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
    store = StoreClient(started + timeout.total_seconds())
    where = f"process group {label!r} (members {describe_ranks(members)})"
    try:
        rnd = Round.opened(store, label, members, agreement)
        try:
            _arrive(rnd)
            if rnd.rank == rnd.leader:
                _lead(rnd, timeout)
            else:
                _follow(rnd, timeout)
        except (GridMismatchError, GroupTimeoutError) as exc:
            _leave_failed(rnd, exc)
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
    logger.debug("members of %s agree in round %s (%.1f ms)", label, rnd.round_id.name, (time.monotonic() - started) * 1e3)
    return rnd.round_id


def _arrive(rnd: Round) -> None:
    """Publish this member's entry, then count it in: the member whose arrival completes the
    count says so on the key its leader blocks on. Every arrival is in the round's list, by which
    the leader names the absent without reading every entry."""
    entry = encode(Entry(rnd.epoch, rnd.digest, rnd.asked))
    # One round trip: the entry the leader reads and the last state others diagnose by.
    rnd.store.multi_set([last_key(rnd.rank), rnd.entry_key(rnd.rank)], [encode(rnd.last_state(State.WAITING)), entry])
    rnd.store.append(rnd.arrivals_key, f"{rnd.rank},")
    if int(rnd.store.add(rnd.count_key, 1)) == len(rnd.members):
        rnd.store.set(rnd.complete_key, "")


def _leave_failed(rnd: Round, exc: BaseException) -> None:
    """Mark this rank failed in its round and end the round (whoever is first), before raising;
    the leader drops the round's keys of arrival too."""
    root = getattr(exc, "root_cause", None) or one_line(str(exc))
    with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
        rnd.store.set(last_key(rnd.rank), encode(rnd.last_state(State.FAILED, root, isinstance(exc, GridMismatchError))))
        end_round(rnd.store, rnd.epoch_key, rnd.epoch)
        if rnd.rank == rnd.leader:
            for key in rnd.arrival_keys():
                rnd.store.delete_key(key)


def _decide(rnd: Round, proposed: Verdict, root_cause: Optional[str] = None) -> None:
    """Make ``proposed`` the round's one verdict unless another was decided first, and act on the
    verdict that stands: return for "ok", raise its error otherwise. Every member acts on the same
    verdict, so a round ends alike for all its members."""
    raw = rnd.store.compare_set(rnd.verdict_key, "", encode(proposed))
    standing = decode(Verdict, raw)
    _act_on(standing, root_cause if standing == proposed else None)


def _act_on(verdict: Verdict, root_cause: Optional[str] = None) -> None:
    if verdict.outcome is RoundOutcome.OK:
        return
    error = GroupTimeoutError if verdict.outcome is RoundOutcome.TIMEOUT else GridMismatchError
    raise error(verdict.message, root_cause=root_cause)


def _poll(deadline: float, ready: Callable[[], bool], diagnose: Callable[[], None]) -> bool:
    """Call ``ready`` with a growing pause until it is True or ``deadline`` passes; diagnose now and then."""
    pause = 0.002
    next_diagnosis = time.monotonic() + 0.25
    while True:
        if ready():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if now >= next_diagnosis:
            diagnose()
            next_diagnosis = now + 0.5
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(pause * 2, 0.1)


def _waiting_until(rnd: Round, timeout: timedelta) -> float:
    """When to stop waiting: the deadline less the time the closing calls need (naming who is
    missing, deciding the verdict), so that the error itself arrives within the timeout."""
    return rnd.store.deadline - min(_CLOSING_S, 0.05 * timeout.total_seconds())


def _timeout_message(rnd: Round, missing: list[int], timeout: timedelta) -> str:
    return (
        f"hypergrid: {rnd.where()}: ranks {describe_ranks(missing)} did not arrive within the timeout "
        f"({timeout.total_seconds():g} s); {last_states(rnd, missing)}"
    )


def _slices(first: float) -> Iterator[float]:
    """How long each blocking call of a wait lasts: ``first``, then twice the last, up to
    :data:`_SLICE_S`, or inside a recovery's scope (:func:`~hypergrid.runtime.losses.watching`)
    up to :data:`~hypergrid.runtime.losses.WATCH_SLICE_S`, so that a lost member ends the wait
    within about that long. Between two, a member looks for trouble once.

    Example::

        >>> from itertools import islice
        >>> list(islice(_slices(0.25), 7))
        [0.25, 0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    """
    length = first
    while True:
        yield length
        length = min(2 * length, _slice_cap())


def _slice_cap() -> float:
    return WATCH_SLICE_S if watching_now() else _SLICE_S


def _arrived(rnd: Round, known: bool = True) -> set[int]:
    """The members in the round's list of arrivals: one ``get`` (and a ``check`` first where the
    list may be gone: ``known`` False, for a follower, whose leader deletes it once it decided)."""
    if not known and not rnd.store.check([rnd.arrivals_key]):
        return set()
    return {int(r) for r in rnd.store.get(rnd.arrivals_key).decode().split(",") if r}


def _lead(rnd: Round, timeout: timedelta) -> None:
    try:
        entries = _await_members(rnd, timeout)
        if len({e.digest for e in entries.values()}) > 1:
            diffs = differences({r: e.asked.fields() for r, e in entries.items()})
            raise GridMismatchError(
                f"hypergrid: ranks disagree on {rnd.where()}, so it was not created:\n  {format_differences(diffs)}"
                + concurrency_hint(diffs)
            )
    except GroupTimeoutError as exc:
        _decide(rnd, Verdict(RoundOutcome.TIMEOUT, str(exc)), exc.root_cause)
    except GridMismatchError as exc:
        _decide(rnd, Verdict(RoundOutcome.MISMATCH, str(exc)), exc.root_cause)
    # Every member has read this epoch: advance it, then say yes, so that no member can read it
    # again for its next request; then drop the keys that no member reads any more.
    end_round(rnd.store, rnd.epoch_key, rnd.epoch)
    _decide(rnd, Verdict(RoundOutcome.OK, ""))
    _drop_old_keys(rnd)


def _await_members(rnd: Round, timeout: timedelta) -> dict[int, Entry]:
    """Every member's entry in this round, once all have arrived; the leader's wait.

    A slice is one blocking ``wait`` on the key the last arrival sets; between two, the leader
    reads the list of arrivals (one ``get``) and looks at the absent members once
    (:func:`~hypergrid.runtime.diagnosis.judge_absent`: the job's board inside a recovery, their
    last states). The entries themselves are read once, when the count says every member came.
    Raises :class:`~hypergrid.errors.GroupTimeoutError` naming the absent at the deadline, or
    what the diagnosis raises."""
    until = _waiting_until(rnd, timeout)
    slices = _slices(_FIRST_LOOK_S)
    counted = False  # the count reached the members' number: its key is set, a wait returns at once
    while True:
        seconds = min(next(slices), until - time.monotonic())
        arrived: Optional[set[int]] = None
        if not counted:
            counted = complete = rnd.store.wait([rnd.complete_key], seconds)
        else:
            # Counted, but a member is missing: one was counted twice (it left an earlier call in
            # this round without closing it, and came again). The list says who came.
            time.sleep(max(0.0, seconds))
            arrived = _arrived(rnd)
            complete = set(rnd.members) <= arrived
        if complete:
            entries = entries_of(rnd, rnd.members)
            if len(entries) == len(rnd.members):
                return entries
            arrived = set(entries)
        if arrived is None:
            arrived = _arrived(rnd)
        absent = [r for r in rnd.members if r not in arrived]
        if time.monotonic() >= until:
            raise GroupTimeoutError(_timeout_message(rnd, absent, timeout))
        judge_absent(rnd, absent)


def _drop_old_keys(rnd: Round) -> None:
    """Delete the previous round's verdict: every member has published in this round, so every
    member is past that one (a verdict of a round before a failed one stays, one key a failure);
    and this round's keys of arrival, which every member has written and nobody reads again."""
    if rnd.epoch > 0:
        rnd.store.delete_key(f"{rnd.base}/verdict/{rnd.epoch - 1}")
    for key in rnd.arrival_keys():
        rnd.store.delete_key(key)


def _follow(rnd: Round, timeout: timedelta) -> None:
    # A slice is one blocking call: a round ends with its leader deciding its verdict. A leader
    # that died or went another way decides nothing, so after the first slice the follower looks
    # at the leader once a slice, as the leader looks at its absent members: whether it came
    # (until it has), why it cannot come, or, inside a recovery, whether the job's board says it
    # was lost. At the deadline it proposes a timeout itself, naming the absent members, unless a
    # verdict stands.
    until = _waiting_until(rnd, timeout)
    slices = _slices(_SLICE_S)
    leader_came = leader_lost = False
    try:
        while True:
            raw = rnd.store.get_within(rnd.verdict_key, min(next(slices), until - time.monotonic()))
            if raw is not None:
                _act_on(decode(Verdict, raw))
                return
            if time.monotonic() >= until:
                break
            leader_came = leader_came or rnd.leader in entries_of(rnd, [rnd.leader])
            if not leader_came:
                judge_absent(rnd, [rnd.leader])
            elif lost_among([rnd.leader]):
                leader_lost = True
                break
    except GridMismatchError as exc:
        _decide(rnd, Verdict(RoundOutcome.MISMATCH, str(exc)), exc.root_cause)
        return
    if leader_lost:
        _decide(rnd, Verdict(RoundOutcome.TIMEOUT, (
            f"hypergrid: {rnd.where()} cannot be created: its leader, rank {rnd.leader}, was lost (the job's "
            f"board says so) after it arrived, before it decided; the others stop waiting for it")))
        return
    present = _arrived(rnd, known=False)
    missing = [r for r in rnd.members if r not in present]
    if missing:
        message = _timeout_message(rnd, missing, timeout)
    else:
        message = (
            f"hypergrid: {rnd.where()}: every member arrived, but its leader, rank {rnd.leader}, did not "
            f"answer within the timeout ({timeout.total_seconds():g} s); {last_states(rnd, [rnd.leader])}"
        )
    _decide(rnd, Verdict(RoundOutcome.TIMEOUT, message))


def explain_creation_failure(label: str, members: Sequence[int], agreement: Optional[Agreement],
                             round_id: Optional[RoundId]) -> str:
    """After torch failed to create an agreed group: which members never finished, if any can tell.

    Marks this rank failed in the round, waits briefly for the other members to mark theirs, and
    names those that did not (they died or hang inside torch). Empty when nothing can be said.

    Example::

        >>> explain_creation_failure("tp", [0, 1], None, None)   # no agreement, nothing to say
        ''
    """
    if agreement is None or round_id is None or len(members) <= 1 or not agreement_possible():
        return ""
    store = StoreClient(time.monotonic() + _FAILURE_GRACE_S)
    rnd = Round(store, label, sorted(members), agreement, dist.get_rank(), round_id)
    try:
        store.set(last_key(rnd.rank), encode(rnd.last_state(State.FAILED, "torch failed to create the group")))
        silent: list[int] = []

        def everyone_reported() -> bool:
            silent.clear()
            for r in rnd.members[:64]:
                last = read_last(store, r)
                if last is None or (last.members, last.epoch, last.state) != (round_id.members, round_id.epoch, State.FAILED):
                    silent.append(r)
            return not silent

        if _poll(store.deadline, everyone_reported, lambda: None):
            return ""
    except (dist.DistError, StoreUnresponsiveError):
        return (
            "the job's store stopped answering too: the process hosting it (rank 0 with 'env://' or "
            "'tcp://', or the launcher's agent) has likely exited or stopped"
        )
    return f"ranks {describe_ranks(silent)} never reported back from this creation (died, or hang inside torch)"
