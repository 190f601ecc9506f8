"""While members wait: why an absent member can never arrive, and what the others were doing.

A member that waits looks at the absent members' last states and stops early only on evidence
that cannot be stale (see :mod:`hypergrid.runtime.agreement`); the messages it raises and the
timeout messages name the ranks, what they were last doing, and the fields on which their
requests differ.

Example::

    >>> diffs = differences({0: {"grid.shape": [2, 2]}, 3: {"grid.shape": [4, 1]}})
    >>> format_differences(diffs)
    'grid.shape: ranks [0] have [2, 2]; ranks [3] have [4, 1]'
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any, Optional

import torch.distributed as dist

from ..errors import GridMismatchError, GroupTimeoutError, StoreUnresponsiveError
from ..layout.describe import describe_ranks, shorten
from ..store.client import StoreClient, read_last, read_lasts, read_present
from ..store.keys import MemberSetKeys
from ..store.records import CheckOutcome, Entry, LastState, State, Verdict, decode, encode
from .check import Check
from .scope import lost_among
from .world_step import failed_step

__all__ = ["differences", "format_differences", "concurrency_hint", "judge_absent", "last_states", "entries_of"]

#: How far and how wide a search for a wait-for cycle looks: bounded, because it runs while waiting.
_CYCLE_DEPTH, _CYCLE_BREADTH = 4, 8


def differences(payloads: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """field -> {value as JSON: ranks holding it}, for the fields on which not all ranks agree;
    what was asked (``request.*``) first, then the grid's facts."""
    names = sorted(set().union(*[set(p) for p in payloads.values()]), key=lambda n: (not n.startswith("request."), n))
    out: dict[str, dict[str, list[int]]] = {}
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, payload in sorted(payloads.items()):
            # sort_keys: a value read back from the store has its keys sorted, a live one not.
            by_value.setdefault(json.dumps(payload.get(name), default=str, sort_keys=True), []).append(rank)
        if len(by_value) > 1:
            out[name] = by_value
    return out


def format_differences(diffs: Mapping[str, Mapping[str, list[int]]]) -> str:
    parts = []
    for name, by_value in diffs.items():
        held = "; ".join(f"ranks {describe_ranks(r)} have {shorten(v)}" for v, r in by_value.items())
        parts.append(f"{name}: {held}")
    return "\n  ".join(parts) or "no field differs"


def _fields_differing(diffs: Mapping[str, Mapping[str, list[int]]], mine: int, theirs: int) -> str:
    """The fields two ranks differ on, each grid fact with both values: a request that differs is
    often only a rank being elsewhere, a grid that differs is the fault itself.

    Example::

        >>> _fields_differing({"grid.shape": {"[2, 2]": [0], "[4, 1]": [3]}, "request.label": {}}, 0, 3)
        'grid.shape (this rank [2, 2], rank 3 [4, 1]), request.label'
    """
    def value_of(by_value: Mapping[str, list[int]], rank: int) -> str:
        return next((shorten(v, 60) for v, ranks in by_value.items() if rank in ranks), "?")

    parts = [
        f"{name} (this rank {value_of(by_value, mine)}, rank {theirs} {value_of(by_value, theirs)})"
        if name.startswith("grid.") else name
        for name, by_value in sorted(diffs.items())
    ]
    return ", ".join(parts) or "nothing"


def concurrency_hint(diffs: Mapping[str, Any]) -> str:
    """A hint for differences in the grid's facts: two grids made at once, in threads."""
    if {"grid.shape", "grid.dim_names", "grid.rank_offset", "grid.views"} & set(diffs):
        return (
            "\n  (if these are two grids created at the same time, in threads, create them in the "
            "same order on every rank)"
        )
    return ""


def entries_of(check: Check, ranks: list[int]) -> dict[int, Entry]:
    """The entries of ``ranks`` in this check; a rank without one (or with an older one) is absent.

    One ``check`` and one ``multi_get`` once every rank has published at least once; before that,
    a ``check`` per rank, for at most 64 of them."""
    raws = read_present(check.store, [check.keys.entry(r) for r in ranks])
    entries = {r: decode(Entry, raws[check.keys.entry(r)]) for r in ranks if check.keys.entry(r) in raws}
    return {r: e for r, e in entries.items() if e.epoch == check.epoch}


def judge_absent(check: Check, absent: list[int]) -> None:
    """Raise now if an absent member can never arrive; otherwise it is late, and waited for."""
    if lost := lost_among(absent):
        raise GroupTimeoutError(
            f"hypergrid: {check.where()} cannot be created: ranks {describe_ranks(lost)} were lost (the job's board "
            f"says so) while the others waited for them"
        )
    failed = failed_step(check.store) if absent else None
    if failed is not None:
        step, verdict = failed
        raise GridMismatchError(
            f"hypergrid: {check.where()} cannot be created: {step.label} has failed on rank {verdict.failed}, "
            f"so ranks {describe_ranks(absent)} will not come: {verdict.error}",
            root_cause=verdict.error,
        )
    # A bounded look, read at once: diagnosing must not cost O(group size) each slice.
    lasts = read_lasts(check.store, [r for r in absent[:64] if r != check.rank])
    for r, last in lasts.items():
        reason, cycle = _cannot_arrive(check, last, r)
        if reason is None:
            continue
        # In a wait-for cycle the rank that differs may be further along it than ``r``: compare the
        # requests of every rank in it, so that the field at fault is named whoever finds the cycle.
        compared = {rank: state.asked.fields() for rank, state in cycle}
        compared.update({check.rank: check.asked.fields(), r: last.asked.fields()})
        diffs = differences(compared)
        message = (
            f"hypergrid: {check.where()} cannot be created: rank {r} will not join, {reason}; its last "
            f"request was {last.label!r} ({last.position.describe()}):\n  {format_differences(diffs)}"
            + (f"\n  root cause on rank {r}: {last.error}" if last.error else "")
        )
        # A wait-for cycle is a deadlock none of its checks can leave: every one of them fails now,
        # with this one verdict, instead of each at its own timeout (or one of them only).
        for _, state in cycle:
            with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
                check.store.compare_set(MemberSetKeys.named(state.members).meeting(state.epoch).outcome, "",
                                        encode(Verdict(CheckOutcome.MISMATCH, message)))
        raise GridMismatchError(message, root_cause=last.error or None)


def _cannot_arrive(check: Check, last: LastState, holder: int) -> tuple[Optional[str], list[tuple[int, LastState]]]:
    """Why rank ``holder``, whose last state is ``last``, will never arrive in this check (None when
    it may be late), and the checks of a wait-for cycle it found, each with the rank waiting in it."""
    mine = check.agreement.position
    # The same request: the same place in the sequence of a grid with the same facts (what it asks
    # for there, and over whom, is what may differ). Grids that differ are told apart by the
    # checks they wait in, not by their places, which another grid of the same dims may share.
    same_request = last.position == mine
    if last.members == check.check_id.members:
        if last.epoch > check.epoch:
            return f"it has gone past this check of these members (it is at check {last.epoch}, this is {check.epoch})", []
        if last.epoch == check.epoch and last.state is State.FAILED:
            return "its part in this very check failed", []
        return None, []  # an earlier check of these members: late
    if same_request:
        # A rank asks for one thing at one place of one grid: this place of a grid with these facts
        # it has already asked for, over other members or for something else, however long ago.
        if last.state is State.PASSED:
            return "at this same request it is in none of the groups", []
        return f"at this same request it {'waits' if last.state is State.WAITING else 'was'} in a group of other members", []
    if last.state is State.PASSED:
        # Outside every group of its request, by its own grid of the same dims at the same place.
        if (last.position.family, last.position.index) == (mine.family, mine.index):
            return "at this same request it is in none of the groups, by its own grid", []
        return None, []
    if last.state is not State.WAITING or not _is_open(check.store, last):
        return None, []  # it has left that check: busy elsewhere since, and may be late
    chain, checks = _wait_chain(check, holder, last)
    if chain and all(_is_open(check.store, state) for _, state in checks):
        return (f"it waits in a check of other members ({last.shown}, request {last.label!r}), and "
                f"{chain}: these creations wait for each other"), checks + [(check.rank, check.last_state(State.WAITING))]
    return None, []


def _is_open(store: StoreClient, state: LastState) -> bool:
    """Whether ``state``'s check is still open: no verdict, and its epoch has not moved past it."""
    keys = MemberSetKeys.named(state.members)
    return int(store.add(keys.epoch, 0)) == state.epoch and not store.check([keys.meeting(state.epoch).outcome])


def _wait_chain(check: Check, holder: int, state: LastState,
                depth: int = _CYCLE_DEPTH) -> tuple[str, list[tuple[int, LastState]]]:
    """How the open check that rank ``holder`` waits in (its last state ``state``) waits, through
    other open checks, for this rank, which waits in its own check: a cycle that no member can
    leave. Returns its description and its checks, each with the rank waiting in it (``("", [])``
    when none is found within the bounds).

    A check waits for a member that is not in it (its entry is not of that check's epoch); that
    member, if it waits in an open check of its own, passes the wait on. A rank is in one check
    at a time (creations are serialised per process), so a chain of open checks is current."""
    members = _shown_members(state)
    if check.rank in members and not _in_check(check.store, state, check.rank):
        return f"that check needs rank {check.rank}", [(holder, state)]
    if depth <= 1:
        return "", []
    for other in [m for m in members if m != check.rank][:_CYCLE_BREADTH]:
        if _in_check(check.store, state, other):
            continue
        nxt = read_last(check.store, other)
        if nxt is None or nxt.state is not State.WAITING or (nxt.members, nxt.epoch) == (state.members, state.epoch):
            continue
        if not _is_open(check.store, nxt):
            continue
        rest, checks = _wait_chain(check, other, nxt, depth - 1)
        if rest:
            return (f"that check needs rank {other}, which waits in a check of members {nxt.shown}, and {rest}",
                    [(holder, state)] + checks)
    return "", []


def _shown_members(state: LastState) -> list[int]:
    """The members of ``state``'s check, where its summary lists them whole (groups of up to 16)."""
    if not state.shown.startswith("["):
        return []  # a larger group is shown summarised: not followed
    return [int(x) for x in state.shown.strip("[]").split(",") if x.strip()]


def _in_check(store: StoreClient, state: LastState, rank: int) -> bool:
    """Whether ``rank`` has published its entry in ``state``'s check."""
    key = MemberSetKeys.named(state.members).entry(rank)
    return bool(store.check([key])) and decode(Entry, store.get(key)).epoch == state.epoch


def last_states(check: Check, ranks: list[int]) -> str:
    """What the given ranks were last doing, for a timeout message."""
    notes = []
    for r in ranks[:8]:
        try:
            last = read_last(check.store, r)
        except (dist.DistError, StoreUnresponsiveError):
            notes.append("the store did not answer when asked what they were last doing")
            break
        if last is None:
            notes.append(f"rank {r} never reached a hypergrid group creation")
            continue
        diffs = differences({check.rank: check.asked.fields(), r: last.asked.fields()})
        where = f"check {last.epoch} of members {last.shown}" if last.members else "in none of its groups"
        notes.append(
            f"rank {r} was last {last.state.value} on {last.label!r} ({last.position.describe()}, {where}; "
            f"differs from this rank's request in: {_fields_differing(diffs, check.rank, r)})"
            + (f": {last.error}" if last.error else "")
        )
    if len(ranks) > 8:
        notes.append(f"and {len(ranks) - 8} more")
    return "; ".join(notes)
