"""Agreement across ranks: a group's members check they asked for the same thing before waiting.

torch's group constructors block until every member arrives. A member that built a different grid,
asked for groups in another order, or died, leaves the others waiting for the full timeout with no
hint of who or why. hypergrid checks first, through the job's store.

What members compare is an :class:`Agreement`: typed facts about the grid (:class:`GridFacts`), the
request (:class:`RequestFacts`) and where the request stands in its owner's sequence
(:class:`Position`). Every rank issues requests in the same order, so a position names one
*creation round* alike on every member, and positions of one family are ordered: a member whose
last position is earlier is late (waited for), one whose last position is later, or who stands at
the same position with another request, has diverged (an error at once).

The store holds, per member set, one entry per member and one verdict, and per rank one *last
state*. Entries are overwritten by later rounds of the same members (a value names its round, so
a stale one is never read as this round's); a verdict is a key of its round, so that a follower
can block on it, and its leader deletes it when the same members meet again. The store does not
grow when a job destroys and re-creates its groups. The group's lowest rank, its *leader*, reads
the entries and posts the verdict; the others read only the verdict: O(group size) for the
leader, O(1) for the rest, nothing that grows with the world.

What an agreeing round costs, in store calls: a follower publishes (one ``multi_set``) and blocks
until its leader says yes (one ``wait``); the leader publishes, reads the entries (one
``multi_get``), says yes (one ``set``) and
drops the previous verdict (one ``delete_key``); the first time a member set meets, the leader
blocks until every member has published (one ``wait``) instead of polling. Two calls is the least any check can cost a
member that must know, before it enters torch's blocking constructor, that the others asked for
the same: one to say what it asked, one to learn that everyone else did.

Example::

    >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
    >>> request = RequestFacts(label="dp", view=None, private=False, backend=None, timeout_s=None,
    ...                        pg_options=None, mode="local")
    >>> agreement = Agreement(Position("grid:tp,dp", 0, 3), facts, request)
    >>> agreement.round_id
    'grid:tp,dp#0#3'
    >>> sorted(agreement.fields())[:3]
    ['grid.dim_names', 'grid.rank_offset', 'grid.shape']

In a job, every member of a group checks before creating it (``grid.create_pg`` does this for
you); with members ``[1, 3, 5, 7]``, on each of those four ranks::

    check_agreement("dp", members=[1, 3, 5, 7], agreement=agreement, timeout=timedelta(seconds=30))

:func:`check_agreement` shows, in one process, what a member that never arrives costs.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence

import torch.distributed as dist

from ._torch_compat import default_store
from .errors import GridMismatchError, GroupCreationError, GroupTimeoutError

__all__ = [
    "Position",
    "GridFacts",
    "ViewFacts",
    "RequestFacts",
    "Agreement",
    "VerdictKind",
    "check_agreement",
    "publish_position",
    "explain_creation_failure",
    "world_checkpoint",
    "agreement_possible",
    "describe_ranks",
    "members_fingerprint",
]

logger = logging.getLogger("hypergrid.agreement")

_PREFIX = "hypergrid/agree"
#: How long survivors of a failed creation wait for the other members to report their own failure
#: before naming those who did not as the ones that died or hung.
_FAILURE_GRACE_S = 2.0
#: How long a member blocks on the store (a follower on its leader's verdict, a leader on its
#: members' first entries) before it starts looking for trouble itself. An agreeing round rarely
#: takes this long; past it, the member polls and diagnoses the absent (and torch's store may log
#: one "timed out" line for the blocking call that ran out).
_SLICE_S = 3.0


# ---------------------------------------------------------------------- the typed payload
@dataclass(frozen=True)
class Position:
    """Where a request stands: the ``index``-th request of the ``generation``-th owner of ``family``.

    Every rank issues the requests of a family in the same order, so a position is alike on every
    member of a group; two positions of one family are ordered (:meth:`order`).

    Example::

        >>> Position("grid:tp,dp", 1, 0).order > Position("grid:tp,dp", 0, 7).order
        True
    """

    family: str
    generation: int
    index: int

    @property
    def order(self) -> tuple[int, int]:
        return (self.generation, self.index)

    def describe(self) -> str:
        return f"request #{self.index} of {self.family} (generation {self.generation})"


@dataclass(frozen=True)
class ViewFacts:
    """A registered view, as members compare it."""

    name: str
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    shared_dims: tuple[str, ...]


@dataclass(frozen=True)
class GridFacts:
    """What makes two ranks' grids the same grid.

    Example::

        >>> GridFacts.of([2, 2], ["tp", "dp"], 4).family
        'grid:tp,dp'
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    rank_offset: int
    views: tuple[ViewFacts, ...] = ()

    @classmethod
    def of(cls, shape: Sequence[int], dim_names: Sequence[str], rank_offset: int, views: Sequence[ViewFacts] = ()) -> "GridFacts":
        return cls(tuple(shape), tuple(dim_names), rank_offset, tuple(views))

    @property
    def family(self) -> str:
        """Grids with the same dim names issue comparable sequences (a new shape is a new generation)."""
        return "grid:" + ",".join(self.dim_names)


@dataclass(frozen=True)
class RequestFacts:
    """What one request asks torch for. ``pg_options`` only by type: contents do not cross processes."""

    label: str
    view: Optional[str]
    private: bool
    backend: Optional[str]
    timeout_s: Optional[float]
    pg_options: Optional[str]
    mode: str


@dataclass(frozen=True)
class Agreement:
    """Everything the members of one group must have asked for alike."""

    position: Position
    grid: GridFacts
    request: RequestFacts

    @property
    def round_id(self) -> str:
        """The creation round this request is, alike on every member and unlike any other round."""
        p = self.position
        return f"{p.family}#{p.generation}#{p.index}"

    def fields(self) -> dict[str, Any]:
        """Flat ``section.name`` -> JSON value, for comparing and for messages."""
        out: dict[str, Any] = {}
        for section, value in (("grid", asdict(self.grid)), ("request", asdict(self.request))):
            for name, item in value.items():
                out[f"{section}.{name}"] = json.loads(json.dumps(item, default=str))
        out["request.position"] = [self.position.family, self.position.generation, self.position.index]
        return out


class VerdictKind(str, enum.Enum):
    """What a leader tells its group."""

    OK = "ok"
    MISMATCH = "mismatch"
    TIMEOUT = "timeout"


class _LastState(str, enum.Enum):
    WAITING = "waiting"  # published its entry, waiting for the others
    FAILED = "failed"  # its creation of this round failed (the error says why)
    PASSED = "passed"  # issued this request without being a member of any of its groups


# ---------------------------------------------------------------------- small helpers
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

    Small groups are shown whole, larger ones summarised, with a digest deciding equality (an
    entry holding the whole list would cost the leader O(group size squared) bytes).

    Example::

        >>> members_fingerprint([3, 1, 2])
        '[1, 2, 3]'
        >>> members_fingerprint(range(1000))  # doctest: +ELLIPSIS
        '1000 ranks [0, 1, 2, 3, 4, 5, 6, 7, ..., 999] sha1:...'
    """
    ordered = sorted(members)
    if len(ordered) <= 16:
        return str(ordered)
    digest = hashlib.sha1(",".join(map(str, ordered)).encode()).hexdigest()[:16]
    return f"{describe_ranks(ordered)} sha1:{digest}"


def _members_digest(members: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, sorted(members))).encode()).hexdigest()[:20]


def agreement_possible() -> bool:
    """Whether this job has a store the members can meet in (not on the fake backend).

    Example::

        >>> agreement_possible()     # no process group
        False
    """
    if not dist.is_available() or not dist.is_initialized():
        return False
    if str(dist.get_backend()).lower() == "fake":
        return False  # one simulated rank: there is nobody to agree with
    return default_store() is not None


def _encode(value: Mapping[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _decode(raw: bytes) -> dict[str, Any]:
    return json.loads(raw.decode())


def _differences(payloads: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """field -> {value as JSON: ranks holding it}, for the fields on which not all ranks agree."""
    names = sorted(set().union(*[set(p) for p in payloads.values()]))
    out: dict[str, dict[str, list[int]]] = {}
    for name in names:
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
    return "\n  ".join(parts) or "no field differs"


def _one_line(message: str, limit: int = 400) -> str:
    text = "; ".join(part.strip() for part in message.splitlines() if part.strip()).replace(":;", ":")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------- one round
@dataclass
class _Round:
    """One member's view of one creation round, with the store keys it uses."""

    store: dist.Store
    label: str
    members: list[int]
    agreement: Agreement
    rank: int
    deadline: float
    fields: dict[str, Any] = field(init=False)
    digest: str = field(init=False)
    base: str = field(init=False)

    def __post_init__(self) -> None:
        self.fields = dict(self.agreement.fields(), **{"request.members": members_fingerprint(self.members)})
        self.digest = hashlib.sha1(_encode(self.fields).encode()).hexdigest()
        self.base = f"{_PREFIX}/{_members_digest(self.members)}"

    @property
    def round_id(self) -> str:
        return self.agreement.round_id

    @property
    def leader(self) -> int:
        return min(self.members)

    def entry_key(self, rank: int) -> str:
        return f"{self.base}/{rank}"

    @property
    def ok_key(self) -> str:
        """Set by the leader when the round's members agree; per round, so never stale."""
        return f"{self.base}/ok/{self.round_id}"

    @property
    def failed_key(self) -> str:
        """Set by the leader, holding the error, when the round cannot go on."""
        return f"{self.base}/failed/{self.round_id}"

    def last_state(self, state: _LastState, error: str = "", diverged: bool = False) -> str:
        p = self.agreement.position
        return _encode(
            {
                "state": state.value,
                "round": self.round_id,
                "position": [p.family, p.generation, p.index],
                "group": self.base,
                "fields": self.fields,
                "error": error,
                # Failed because ranks went different ways (not a timeout or torch error, after
                # which a rank may retry the same grid): it will not come back to this grid.
                "diverged": diverged,
            }
        )

    def where(self) -> str:
        return f"process group {self.label!r} (members {describe_ranks(self.members)})"


def _last_key(rank: int) -> str:
    return f"{_PREFIX}/last/{rank}"


def _read_last(store: dist.Store, rank: int) -> Optional[dict]:
    key = _last_key(rank)
    if not store.check([key]):
        return None
    return _decode(store.get(key))


def publish_position(agreement: Agreement) -> None:
    """Record that this rank issued ``agreement``'s request without being in any of its groups.

    A member waiting on this rank then sees it at this position with its own facts (say, another
    ``rank_offset``) and reports the difference at once instead of waiting for the timeout.

    The registry calls it on ranks outside every group of a request. Example, in a one-rank gloo
    world whose store is a ``HashStore``::

        >>> import json
        >>> import torch.distributed as dist
        >>> from hypergrid._torch_compat import default_store
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
        >>> request = RequestFacts(label="dp", view=None, private=False, backend=None, timeout_s=None,
        ...                        pg_options=None, mode="local")
        >>> publish_position(Agreement(Position("grid:tp,dp", 0, 3), facts, request))
        >>> last = json.loads(default_store().get("hypergrid/agree/last/0"))   # rank 0's last state
        >>> last["state"], last["round"], last["fields"]["grid.shape"]
        ('passed', 'grid:tp,dp#0#3', [2, 4])
        >>> dist.destroy_process_group()
    """
    if not agreement_possible():
        return
    store = default_store()
    assert store is not None
    p = agreement.position
    with contextlib.suppress(dist.DistError):  # a lost store is reported where someone waits on it
        store.set(
            _last_key(dist.get_rank()),
            _encode(
                {
                    "state": _LastState.PASSED.value,
                    "round": agreement.round_id,
                    "position": [p.family, p.generation, p.index],
                    "group": None,
                    "fields": dict(agreement.fields(), **{"request.members": None}),
                    "error": "",
                }
            ),
        )


def check_agreement(label: str, members: Sequence[int], agreement: Agreement, *, timeout: timedelta) -> None:
    """Return once every member of ``members`` published the same ``agreement`` for this round.

    Raises :class:`~hypergrid.errors.GridMismatchError` naming the ranks and fields that differ,
    or :class:`~hypergrid.errors.GroupTimeoutError` naming the members that did not arrive within
    ``timeout``; either on every member still alive, the one that differs included. A store that
    stops answering raises :class:`~hypergrid.errors.GroupCreationError` naming the group.

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
        >>> agreement = Agreement(Position("grid:tp,dp", 0, 0), facts, request)
        >>> check_agreement("tp", [0], agreement, timeout=timedelta(seconds=10))
        >>> check_agreement("tp", [0, 1], agreement, timeout=timedelta(seconds=0.2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        hypergrid.errors.GroupTimeoutError: hypergrid: process group 'tp' (members [0, 1]): ranks [1] did not arrive within the timeout; rank 1 never reached a hypergrid group creation
        >>> dist.destroy_process_group()
    """
    members = sorted(members)
    if len(members) <= 1 or not agreement_possible():
        return
    store = default_store()
    assert store is not None  # agreement_possible() checked it
    started = time.monotonic()
    rnd = _Round(store, label, members, agreement, dist.get_rank(), started + timeout.total_seconds())
    try:
        try:
            entry = _encode({"round": rnd.round_id, "digest": rnd.digest, "fields": rnd.fields})
            # One round trip: the entry the leader reads and the last state others diagnose by.
            store.multi_set([_last_key(rnd.rank), rnd.entry_key(rnd.rank)], [rnd.last_state(_LastState.WAITING), entry])
            if rnd.rank == rnd.leader:
                _lead(rnd)
            else:
                _follow(rnd, timeout)
        except (GridMismatchError, GroupTimeoutError) as exc:
            root = getattr(exc, "root_cause", None) or _one_line(str(exc))
            with contextlib.suppress(dist.DistError):  # the error at hand says more than a lost store
                diverged = isinstance(exc, GridMismatchError)
                store.set(_last_key(rnd.rank), rnd.last_state(_LastState.FAILED, root, diverged))
            raise
    except dist.DistError as exc:
        raise GroupCreationError(
            f"hypergrid: {rnd.where()}: the job's store stopped answering while the members were "
            f"checking that they agree ({type(exc).__name__}: {_one_line(str(exc), 200)}). The process "
            f"hosting the store (rank 0 with init_method 'env://' or 'tcp://', or the launcher's "
            f"agent) has likely exited: look at its error first."
        ) from exc
    logger.debug("members of %s agree (%.1f ms)", label, (time.monotonic() - started) * 1e3)


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


#: The verdict key this process's leaders last posted, per member set: deleted once the same members
#: meet again (by then every member is past it), so verdicts do not pile up in the store.
_POSTED_VERDICTS: dict[str, str] = {}
_POSTED_LOCK = threading.Lock()


def _post(rnd: _Round, kind: VerdictKind, message: str = "") -> None:
    if kind is VerdictKind.OK:
        rnd.store.set(rnd.ok_key, "")
        key = rnd.ok_key
    else:
        rnd.store.set(rnd.failed_key, _encode({"round": rnd.round_id, "kind": kind.value, "message": message}))
        key = rnd.failed_key
    with _POSTED_LOCK:
        previous = _POSTED_VERDICTS.get(rnd.base)
        _POSTED_VERDICTS[rnd.base] = key
    if previous is not None and previous != key:
        rnd.store.delete_key(previous)


def _lead(rnd: _Round) -> None:
    keys = [rnd.entry_key(r) for r in rnd.members]
    entries: dict[int, dict] = {}
    all_published = [False]

    def arrived() -> bool:
        # Entries are overwritten round after round and never deleted: once each member has
        # published at least once, reading them is one call, and only this round's count.
        if not all_published[0]:
            if not rnd.store.check(keys):
                return False
            all_published[0] = True
        entries.clear()
        for r, raw in zip(rnd.members, rnd.store.multi_get(keys)):
            entries[r] = _decode(raw)
        return all(e["round"] == rnd.round_id for e in entries.values())

    def absent() -> list[int]:
        present = {r for r, e in entries.items() if e.get("round") == rnd.round_id}
        if len(entries) < len(rnd.members):
            present |= {r for r, key in zip(rnd.members, keys) if r not in entries and rnd.store.check([key])}
        return [r for r in rnd.members if r not in present]

    try:
        with _POSTED_LOCK:
            first_meeting = rnd.base not in _POSTED_VERDICTS
        if first_meeting:
            # No earlier round's entries to tell apart: block until every member has published.
            remaining = rnd.deadline - time.monotonic()
            all_published[0] = _wait_for(rnd.store, keys, min(_SLICE_S, remaining))
        if not _poll(rnd.deadline, arrived, lambda: _judge_absent(rnd, absent())):
            missing = absent()
            raise GroupTimeoutError(
                f"hypergrid: {rnd.where()}: ranks {describe_ranks(missing)} did not arrive within the "
                f"timeout; {_last_states(rnd, missing)}"
            )
        if len({e["digest"] for e in entries.values()}) > 1:
            diffs = _differences({r: e["fields"] for r, e in entries.items()})
            raise GridMismatchError(
                f"hypergrid: ranks disagree on {rnd.where()}, so it was not created:\n  {_format_differences(diffs)}"
            )
    except GroupTimeoutError as exc:
        _post(rnd, VerdictKind.TIMEOUT, str(exc))
        raise
    except GridMismatchError as exc:
        _post(rnd, VerdictKind.MISMATCH, str(exc))
        raise
    _post(rnd, VerdictKind.OK)


def _follow(rnd: _Round, timeout: timedelta) -> None:
    # The fast path is one blocking call: an agreeing round ends with the leader setting this
    # round's "ok" key, which nothing else sets. A failed round sets the "failed" key instead, and
    # a leader that died or went another way sets neither, so after a while (the slice) the
    # follower looks for a failure and at the leader's last state, as the leader does for its
    # members.
    if _wait_for(rnd.store, [rnd.ok_key], min(_SLICE_S, rnd.deadline - time.monotonic())):
        return
    # The leader reports absent members at the deadline; give it a moment past that to say so.
    deadline = rnd.deadline + max(2.0, 0.1 * timeout.total_seconds())
    verdict: dict[str, Any] = {}

    def posted() -> bool:
        if rnd.store.check([rnd.ok_key]):
            verdict["kind"] = VerdictKind.OK.value
            return True
        if rnd.store.check([rnd.failed_key]):
            verdict.update(_decode(rnd.store.get(rnd.failed_key)))
            return True
        return False

    def diagnose() -> None:
        last = _read_last(rnd.store, rnd.leader)
        if last is None or last["round"] != rnd.round_id or last["group"] != rnd.base:
            _judge_absent(rnd, [rnd.leader])

    if not _poll(deadline, posted, diagnose):
        raise GroupTimeoutError(
            f"hypergrid: {rnd.where()}: its leader, rank {rnd.leader}, did not answer within the "
            f"timeout; {_last_states(rnd, [rnd.leader])}"
        )
    kind = VerdictKind(verdict["kind"])
    if kind is VerdictKind.TIMEOUT:
        raise GroupTimeoutError(verdict["message"])
    if kind is VerdictKind.MISMATCH:
        raise GridMismatchError(verdict["message"])


def _wait_for(store: dist.Store, keys: list[str], seconds: float) -> bool:
    """Block until every key of ``keys`` is set, for at most ``seconds``: one store call either way."""
    if seconds <= 0:
        return False
    try:
        store.wait(keys, timedelta(seconds=seconds))
    except dist.DistNetworkError:
        raise  # the store is gone: the caller names it
    except RuntimeError:  # ran out (DistStoreError; a FileStore raises a plain RuntimeError)
        return False
    return True


def _judge_absent(rnd: _Round, absent: list[int]) -> None:
    """Raise now if an absent member can never arrive: it failed this round, or went another way.

    A member whose last position is earlier than this round's is late and is waited for.
    """
    mine = rnd.agreement.position
    for r in absent[:64]:  # a bounded look: diagnosing must not cost O(group size) each poll
        last = _read_last(rnd.store, r)
        if last is None:
            continue
        family, generation, index = last["position"]
        theirs = (generation, index)
        if last["round"] == rnd.round_id:
            if last["state"] == _LastState.FAILED.value:
                reason = "its creation of this group failed"
            elif last["group"] != rnd.base:
                reason = (
                    "at this same request it waits on a group of other members"
                    if last["state"] == _LastState.WAITING.value
                    else "at this same request it is in none of the groups, by its own grid"
                )
            else:
                continue  # here, arriving
        elif family != mine.family:
            continue  # busy with another family of requests: may simply be behind
        elif theirs > mine.order:
            reason = f"it has gone past this request (it is at request #{index}, generation {generation})"
        elif last["state"] == _LastState.FAILED.value and last.get("diverged") and generation == mine.generation:
            reason = f"it stopped at an earlier request of this grid because ranks went different ways"
        else:
            continue  # an earlier request: late, not diverged
        diffs = _differences({rnd.rank: rnd.fields, r: last["fields"]})
        error = GridMismatchError(
            f"hypergrid: {rnd.where()} cannot be created: rank {r} will not join, {reason}; its last "
            f"request was {last['fields'].get('request.label')!r} ({Position(family, generation, index).describe()}):\n  "
            f"{_format_differences(diffs)}"
            + (f"\n  root cause on rank {r}: {last['error']}" if last.get("error") else "")
        )
        error.root_cause = last["error"] or _one_line(str(error))  # type: ignore[attr-defined]
        raise error


def _last_states(rnd: _Round, ranks: list[int]) -> str:
    """What the given ranks were last doing, for a timeout message."""
    notes = []
    for r in ranks[:8]:
        last = _read_last(rnd.store, r)
        if last is None:
            notes.append(f"rank {r} never reached a hypergrid group creation")
            continue
        family, generation, index = last["position"]
        diffs = _differences({rnd.rank: rnd.fields, r: last["fields"]})
        notes.append(
            f"rank {r} was last {last['state']} on {last['fields'].get('request.label')!r} "
            f"({Position(family, generation, index).describe()}; differs from this rank's request in: "
            f"{', '.join(sorted(diffs)) or 'nothing'})"
            + (f": {last['error']}" if last.get("error") else "")
        )
    if len(ranks) > 8:
        notes.append(f"and {len(ranks) - 8} more")
    return "; ".join(notes)


def explain_creation_failure(label: str, members: Sequence[int], agreement: Optional[Agreement]) -> str:
    """After torch failed to create an agreed group: which members never finished, if any can tell.

    Marks this rank's round as failed, waits briefly for the other members to mark theirs, and
    names those that did not (they died or hang inside torch). Empty when nothing can be said.

    Example::

        >>> explain_creation_failure("tp", [0, 1], None)   # no agreement, nothing to say
        ''
    """
    if agreement is None or len(members) <= 1 or not agreement_possible():
        return ""
    store = default_store()
    assert store is not None
    rnd = _Round(store, label, sorted(members), agreement, dist.get_rank(), time.monotonic() + _FAILURE_GRACE_S)
    try:
        store.set(_last_key(rnd.rank), rnd.last_state(_LastState.FAILED, "torch failed to create the group"))
        silent: list[int] = []

        def everyone_reported() -> bool:
            silent.clear()
            for r in rnd.members[:64]:
                last = _read_last(store, r)
                if last is None or last["round"] != rnd.round_id or last["state"] != _LastState.FAILED.value:
                    silent.append(r)
            return not silent

        if _poll(rnd.deadline, everyone_reported, lambda: None):
            return ""
    except dist.DistError:
        return (
            "the job's store stopped answering too: the process hosting it (rank 0 with 'env://' or "
            "'tcp://', or the launcher's agent) has likely exited"
        )
    return f"ranks {describe_ranks(silent)} never reported back from this creation (died, or hang inside torch)"


def world_checkpoint(label: str, round_id: str, error: Optional[BaseException], *, timeout: timedelta) -> None:
    """Every rank of the world reports how ``label`` ended for it; each learns if any failed.

    For steps that span many groups (Megatron's ``initialize_model_parallel``): a rank that
    failed posts its error and returns (the caller re-raises its own); the others block until
    every rank arrived, or one posted a failure, which they raise as
    :class:`~hypergrid.errors.GridMismatchError` naming that rank and its error. Each rank makes
    one ``add`` and one blocking ``wait`` on the store: no polling, whatever the world size.
    ``round_id`` must be alike on every rank and unlike any earlier checkpoint.

    Example::

        >>> world_checkpoint("initialize_model_parallel", "megatron#0", None, timeout=timedelta(seconds=60))
    """
    if not agreement_possible():
        return
    store = default_store()
    assert store is not None
    rank, world = dist.get_rank(), dist.get_world_size()
    base = f"{_PREFIX}/world/{round_id}"
    try:
        if error is not None:
            store.set(f"{base}/go", _encode({"failed": rank, "error": _one_line(f"{type(error).__name__}: {error}")}))
            return
        if store.add(f"{base}/arrived", 1) == world:
            store.set(f"{base}/go", _encode({"failed": None}))
        try:
            store.wait([f"{base}/go"], timeout)
        except dist.DistStoreError:
            arrived = store.add(f"{base}/arrived", 0)
            raise GroupTimeoutError(
                f"hypergrid: {label}: only {arrived} of {world} ranks finished it within the timeout "
                f"({timeout}); the others are still at it, hang, or died"
            ) from None
        verdict = _decode(store.get(f"{base}/go"))
    except dist.DistError as exc:
        if error is not None:
            return  # the caller's own error says more
        raise GroupCreationError(
            f"hypergrid: {label}: the job's store stopped answering at the end ({type(exc).__name__}: "
            f"{_one_line(str(exc), 200)}); the process hosting it has likely exited"
        ) from exc
    if verdict["failed"] is not None:
        raise GridMismatchError(
            f"hypergrid: {label} failed on rank {verdict['failed']}, so it cannot be used on this rank "
            f"either: {verdict['error']}"
        )
