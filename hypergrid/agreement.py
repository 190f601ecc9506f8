"""Agreement across ranks: a group's members check they asked for the same thing before waiting.

torch's group constructors block until every member arrives. A member that built a different grid,
asked for groups in another order, or died, leaves the others waiting for the full timeout (30
minutes by default) with no hint of who or why. hypergrid checks first, through the job's store:

* every member publishes what it asked for (grid shape, names, offset, views, the request and its
  position in the grid's sequence) under the group's name;
* the group's lowest rank, its *leader*, waits for all members' entries, compares them and posts
  a verdict; the others wait only for the verdict. The leader's cost is O(group size), everyone
  else's O(1): nothing grows with the world size.
* every rank also keeps its *last state* (waiting on which request, done, failed) in the store.
  A rank waiting on a member looks at that member's last state now and then: a member that
  failed, or waits on a different request of the same grid, will never arrive, so the wait ends
  at once with an error naming the member and the fields that differ, instead of at the timeout.

Example (inside a job; ``grid.create_pg`` does this for you)::

    >>> # check_agreement("tp", members=[0, 1], fields={"grid.shape": [2, 4]},
    >>> #                 namespace="hypergrid/agree/abc", timeout=timedelta(seconds=30))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from datetime import timedelta
from typing import Any, Mapping, Optional, Sequence

import torch.distributed as dist

from ._torch_compat import default_store
from .errors import GridMismatchError, GroupCreationError, GroupTimeoutError

__all__ = ["check_agreement", "agreement_possible", "describe_ranks", "members_fingerprint"]

logger = logging.getLogger("hypergrid.agreement")

_PREFIX = "hypergrid/agree"
# Fields that say "the same grid": a member whose last state matches these but not the rest has
# diverged from us rather than being merely behind.
_GRID_IDENTITY = ("grid.dim_names", "grid.rank_offset")
_VERDICT_OK = "ok"


def describe_ranks(ranks: Sequence[int], limit: int = 16) -> str:
    """A rank list short enough for an error message.

    Example::

        >>> describe_ranks([0, 1, 2])
        '[0, 1, 2]'
        >>> describe_ranks(list(range(100)))
        '100 ranks [0, 1, 2, 3, 4, 5, 6, 7, ..., 99]'
    """
    ranks = list(ranks)
    if len(ranks) <= limit:
        return str(ranks)
    head = ", ".join(str(r) for r in ranks[: limit // 2])
    return f"{len(ranks)} ranks [{head}, ..., {ranks[-1]}]"


def members_fingerprint(members: Sequence[int]) -> str:
    """What members publish about a group's member list: short, whatever the group's size.

    Each member's entry is read by the group's leader, so an entry holding the whole list would
    cost the leader O(group size squared) bytes; a digest keeps it O(group size). Small groups
    are shown whole, larger ones summarised, with the digest deciding equality.

    Example::

        >>> members_fingerprint([3, 1, 2])
        '[1, 2, 3]'
        >>> members_fingerprint(range(1000))[:50]
        '1000 ranks [0, 1, 2, 3, 4, 5, 6, 7, ..., 999] sha1:'
    """
    ordered = sorted(members)
    if len(ordered) <= 16:
        return str(ordered)
    digest = hashlib.sha1(",".join(map(str, ordered)).encode()).hexdigest()[:16]
    return f"{describe_ranks(ordered)} sha1:{digest}"


def agreement_possible() -> bool:
    """Whether this job has a store the members can meet in (not on the fake backend)."""
    if not dist.is_initialized():
        return False
    if str(dist.get_backend()).lower() == "fake":
        return False  # one simulated rank: there is nobody to agree with
    return default_store() is not None


def _encode(value: Mapping[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _decode(raw: bytes) -> dict[str, Any]:
    return json.loads(raw.decode())


def _differences(mine: Mapping[str, Any], payloads: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """field -> {value as JSON: ranks holding it}, for the fields on which not all ranks agree."""
    fields = sorted(set(mine).union(*[set(p) for p in payloads.values()]))
    out: dict[str, dict[str, list[int]]] = {}
    for name in fields:
        by_value: dict[str, list[int]] = {}
        for rank, payload in sorted(payloads.items()):
            by_value.setdefault(json.dumps(payload.get(name), default=str), []).append(rank)
        if len(by_value) > 1:
            out[name] = by_value
    return out


def _format_differences(diffs: Mapping[str, Mapping[str, list[int]]]) -> str:
    parts = []
    for name, by_value in diffs.items():
        held = "; ".join(f"ranks {describe_ranks(r)} have {v}" for v, r in by_value.items())
        parts.append(f"{name}: {held}")
    return "\n  ".join(parts)


class _Waiter:
    """Polls the store for keys with a growing pause, diagnosing absent ranks now and then."""

    def __init__(self, store: dist.Store, deadline: float) -> None:
        self.store = store
        self.deadline = deadline

    def wait(self, keys: list[str], on_absent: "callable") -> bool:
        pause = 0.005
        next_diagnosis = time.monotonic() + 0.25
        while True:
            if self.store.check(keys):
                return True
            now = time.monotonic()
            if now >= self.deadline:
                return False
            if now >= next_diagnosis:
                on_absent()
                next_diagnosis = now + 0.5
            time.sleep(min(pause, max(0.0, self.deadline - now)))
            pause = min(pause * 2, 0.1)


def check_agreement(
    label: str,
    members: Sequence[int],
    fields: Mapping[str, Any],
    *,
    namespace: str,
    timeout: timedelta,
) -> None:
    """Return once every member of ``members`` published the same ``fields`` under ``namespace``.

    ``namespace`` must be the same on every member and unique to this creation (hypergrid uses the
    name it gives the group). Raises :class:`~hypergrid.errors.GridMismatchError` naming the ranks
    and fields that differ, or :class:`~hypergrid.errors.GroupTimeoutError` naming the members
    that did not arrive within ``timeout``; either on every member that is still alive. A store
    that stops answering (its host exited) raises :class:`~hypergrid.errors.GroupCreationError`
    naming the group.

    Example::

        >>> # in each of ranks 0..3, before creating their tp group:
        >>> # check_agreement("tp", [0, 1], {"grid.shape": [2, 2]}, namespace="ns/1",
        >>> #                 timeout=timedelta(seconds=10))
    """
    members = list(members)
    if len(members) <= 1 or not agreement_possible():
        return
    store = default_store()
    assert store is not None  # agreement_possible() checked it
    rank = dist.get_rank()
    leader = min(members)
    payload = dict(fields, **{"request.members": members_fingerprint(members)})
    base = f"{_PREFIX}/{namespace}"
    started = time.monotonic()
    deadline = started + timeout.total_seconds()
    try:
        _set_last(store, rank, "waiting", base, payload)
        try:
            store.set(f"{base}/{rank}", _encode(payload))
            if rank == leader:
                _lead(store, label, members, payload, base, deadline)
            else:
                _follow(store, label, members, payload, base, leader, deadline, timeout)
        except (GridMismatchError, GroupTimeoutError) as exc:
            # Others who wait on this rank report the original cause, not a chain of "failed earlier".
            root = getattr(exc, "root_cause", None) or _one_line(str(exc))
            with contextlib.suppress(dist.DistError):  # the error at hand says more than a lost store
                _set_last(store, rank, "failed", base, payload, error=root)
            raise
        _set_last(store, rank, "done", base, payload)
        # Agreed: nobody reads this member's entry again (the leader has compared them all), so
        # the store does not keep one entry per member per group for the rest of the job.
        # Tidying up must not fail a creation the members already agreed on: a store without
        # delete_key (NotImplementedError) or one that just went away (a RuntimeError) is let be.
        with contextlib.suppress(RuntimeError, NotImplementedError):
            store.delete_key(f"{base}/{rank}")
    except dist.DistError as exc:
        raise GroupCreationError(
            f"hypergrid: process group {label!r} (members {describe_ranks(members)}): the job's store "
            f"stopped answering while the members were checking that they agree "
            f"({type(exc).__name__}: {_one_line(str(exc), 200)}). The process hosting the store (rank 0 "
            f"with init_method 'env://' or 'tcp://', or the launcher's agent) has likely exited: "
            f"look at its error first."
        ) from exc
    logger.debug("members of %s agree (%.1f ms)", label, (time.monotonic() - started) * 1e3)


def _lead(
    store: dist.Store, label: str, members: list[int], payload: dict, base: str, deadline: float
) -> None:
    keys = [f"{base}/{r}" for r in members]
    waiter = _Waiter(store, deadline)

    def absent() -> list[int]:
        return [r for r, key in zip(members, keys) if not store.check([key])]

    def diagnose() -> None:
        _fail_fast_if_diverged(store, label, members, payload, absent(), base)

    try:
        if not waiter.wait(keys, diagnose):
            missing = absent()
            message = (
                f"hypergrid: process group {label!r} (members {describe_ranks(members)}): ranks "
                f"{describe_ranks(missing)} did not arrive within the timeout; "
                f"{_last_states(store, missing, payload)}"
            )
            store.set(f"{base}/verdict", message)
            raise GroupTimeoutError(message)
        payloads = {r: _decode(raw) for r, raw in zip(members, store.multi_get(keys))}
        diffs = _differences(payload, payloads)
        if diffs:
            message = (
                f"hypergrid: ranks disagree on process group {label!r} (members "
                f"{describe_ranks(members)}), so it was not created:\n  {_format_differences(diffs)}"
            )
            store.set(f"{base}/verdict", message)
            raise GridMismatchError(message)
    except (GridMismatchError, GroupTimeoutError) as exc:
        # Tell the members now rather than letting them find out at their own timeout.
        if not store.check([f"{base}/verdict"]):
            store.set(f"{base}/verdict", str(exc))
        raise
    store.set(f"{base}/verdict", _VERDICT_OK)


def _follow(
    store: dist.Store,
    label: str,
    members: list[int],
    payload: dict,
    base: str,
    leader: int,
    deadline: float,
    timeout: timedelta,
) -> None:
    # The leader reports absent members at the deadline; give it a moment past that to say so.
    grace = max(2.0, 0.1 * timeout.total_seconds())
    waiter = _Waiter(store, deadline + grace)
    verdict_key = f"{base}/verdict"

    def diagnose() -> None:
        if not store.check([f"{base}/{leader}"]):
            _fail_fast_if_diverged(store, label, members, payload, [leader], base)

    if not waiter.wait([verdict_key], diagnose):
        raise GroupTimeoutError(
            f"hypergrid: process group {label!r} (members {describe_ranks(members)}): its leader, "
            f"rank {leader}, did not answer within the timeout; {_last_states(store, [leader], payload)}"
        )
    verdict = store.get(verdict_key).decode()
    if verdict == _VERDICT_OK:
        return
    if "did not arrive" in verdict:
        raise GroupTimeoutError(verdict)
    raise GridMismatchError(verdict)


def _one_line(message: str, limit: int = 400) -> str:
    text = "; ".join(part.strip() for part in message.splitlines() if part.strip()).replace(":;", ":")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _set_last(store: dist.Store, rank: int, state: str, base: str, payload: dict, error: str = "") -> None:
    store.set(
        f"{_PREFIX}/last/{rank}",
        _encode({"state": state, "namespace": base, "error": error, "fields": payload}),
    )


def _read_last(store: dist.Store, rank: int) -> Optional[dict]:
    key = f"{_PREFIX}/last/{rank}"
    if not store.check([key]):
        return None
    return _decode(store.get(key))


def _last_states(store: dist.Store, ranks: list[int], payload: dict) -> str:
    """What the given ranks were last doing, for a timeout message."""
    notes = []
    for r in ranks[:8]:
        last = _read_last(store, r)
        if last is None:
            notes.append(f"rank {r} never reached a hypergrid group creation")
            continue
        fields = last["fields"]
        diffs = _differences(payload, {0: payload, 1: fields})
        differing = ", ".join(sorted(diffs)) or "nothing"
        notes.append(
            f"rank {r} was last {last['state']} on {fields.get('request.key')!r} "
            f"(request #{fields.get('request.index')}; differs from this rank's request in: {differing})"
            + (f": {last['error']}" if last.get("error") else "")
        )
    if len(ranks) > 8:
        notes.append(f"and {len(ranks) - 8} more")
    return "; ".join(notes)


def _fail_fast_if_diverged(
    store: dist.Store, label: str, members: list[int], payload: dict, absent: list[int], base: str
) -> None:
    """Raise now if an absent member can never arrive: it failed, or went another way."""
    for r in absent[:64]:  # a bounded look: diagnosing must not cost O(group size) each poll
        last = _read_last(store, r)
        if last is None or last["namespace"] == base:
            continue
        theirs = last["fields"]
        same_grid = all(theirs.get(f) == payload.get(f) for f in _GRID_IDENTITY)
        if last["state"] == "failed":
            reason = f"it failed earlier (root cause: {last['error']})"
        elif not same_grid:
            continue  # busy with another grid: may simply be behind
        elif theirs.get("grid.shape") != payload.get("grid.shape") or theirs.get("grid.views") != payload.get("grid.views"):
            reason = "it built a different grid"
        elif last["state"] == "waiting" and theirs.get("request.index") == payload.get("request.index"):
            reason = "it is waiting on a different request at the same position"
        elif (theirs.get("request.index") or 0) > (payload.get("request.index") or 0):
            reason = "it has gone past this request without making it"
        else:
            continue  # an earlier request of the same grid: behind, not diverged
        diffs = _differences(payload, {dist.get_rank(): payload, r: theirs})
        error = GridMismatchError(
            f"hypergrid: process group {label!r} (members {describe_ranks(members)}) cannot be "
            f"created: rank {r} will not join, {reason}; its last request was "
            f"{theirs.get('request.key')!r} (#{theirs.get('request.index')}):\n  "
            f"{_format_differences(diffs) or 'no field differs'}"
        )
        error.root_cause = last["error"] if last["state"] == "failed" else _one_line(str(error))  # type: ignore[attr-defined]
        raise error
