"""Agreement across ranks: a group's members check they asked for the same thing before waiting.

torch's group constructors block until every member arrives. A member that built a different grid,
asked for groups in another order, or died, leaves the others waiting for the full timeout with no
hint of who or why. hypergrid checks first, through the job's store.

**Rounds.** The members of a group meet in a *round*, named by what they share: their member set
and the round's *epoch*, a counter the store keeps for that member set. A member reads the epoch
when it arrives and publishes what it asks for (an :class:`Agreement`: typed facts of the grid,
the request and where the request stands in its grid's sequence); the group's lowest rank, its
*leader*, reads every member's entry, and either advances the epoch and then posts "ok", or posts
why not. The invariant that makes this right by construction:

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

**Diagnosis.** While waiting, a member looks at the absent members' *last states* (each rank's
latest: waiting in a round, failed in one, or passed a request without being in any of its
groups) and stops early only on evidence that cannot be stale: an absent member of the same
member set at a later epoch (it went past this round) or failed in this very round; one blocked
in another round that is still open (its epoch not advanced) at this same request of this grid
family with other members or facts, or one that itself waits for this rank (a wait-for cycle);
or, for ranks outside every group of a request, one that passed this same request with grid
facts that put it elsewhere. A rank merely busy elsewhere is late, and is waited for.

**Store.** Agreement talks to the job's store over a connection of its own (the store's
``clone()``), whose timeout it sets to what is left of the request's, so a store host that stops
answering is reported within the timeout as what it is. Per member set the store holds an epoch
counter, one entry per member (overwritten round after round) and at most a verdict or two, which
the next meeting deletes; per rank one last state. Nothing grows with create and destroy cycles.

What an agreeing round costs a follower: one ``add`` (read the epoch), one ``multi_set`` (entry
and last state) and one blocking ``get`` of the verdict. The leader: the ``add`` and the
``multi_set``, one blocking ``wait`` for the entries and one ``multi_get`` of them, two
``compare_set`` (advance the epoch, decide the verdict) and one ``delete_key`` (the previous
verdict).

Example::

    >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
    >>> request = RequestFacts(label="dp", view=None, private=False, backend=None, timeout_s=None,
    ...                        pg_options=None, mode="local")
    >>> agreement = Agreement(Position("grid:tp,dp", facts.digest, 3), facts, request)
    >>> sorted(agreement.fields())[:3]
    ['grid.dim_names', 'grid.rank_offset', 'grid.shape']
    >>> RoundId.of([1, 3, 5, 7], epoch=2).name
    '[1, 3, 5, 7]#2'

In a job, every member of a group checks before creating it (``grid.create_pg`` does this for
you); with members ``[1, 3, 5, 7]``, on each of those four ranks::

    round_id = check_agreement("dp", members=[1, 3, 5, 7], agreement=agreement, timeout=timedelta(seconds=30))
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field, fields as dataclass_fields
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Type, TypeVar

import torch.distributed as dist

from .torch_compat import default_store
from ..errors import GridMismatchError, GroupCreationError, GroupTimeoutError, StoreUnresponsiveError

__all__ = [
    "Position",
    "GridFacts",
    "ViewFacts",
    "RequestFacts",
    "Agreement",
    "RoundId",
    "VerdictKind",
    "check_agreement",
    "end_round",
    "publish_position",
    "explain_creation_failure",
    "world_checkpoint",
    "world_start",
    "within_step",
    "WorldRound",
    "agreement_possible",
    "describe_ranks",
    "members_fingerprint",
]

logger = logging.getLogger("hypergrid.runtime.agreement")

_PREFIX = "hypergrid/agree"
#: How long survivors of a failed creation wait for the other members to report their own failure
#: before naming those who did not as the ones that died or hung (only the message depends on it).
_FAILURE_GRACE_S = 2.0
#: How long a member blocks on the store (a follower on its leader's verdict, a leader on its
#: members' first entries) before it starts looking for trouble itself.
_SLICE_S = 3.0
#: The least a store call is given, so that a call made at the deadline still gets an answer.
_MIN_CALL_S = 0.05


# ---------------------------------------------------------------------- what members compare
@dataclass(frozen=True)
class Position:
    """Where a request stands: the ``index``-th request of a grid of ``family`` with facts ``grid``.

    Compared between members (two ranks asking for the same group at different places of their
    sequences have diverged) and used to tell a rank at this same request from one that is busy
    elsewhere. Not a round's name: a round is named by its members and their epoch.

    Example::

        >>> Position("grid:tp,dp", "0f1e", 2).describe()
        "request #2 of a grid with dims 'tp,dp'"
    """

    family: str
    grid: str
    index: int

    def describe(self) -> str:
        return f"request #{self.index} of a grid with dims {self.family.partition(':')[2]!r}"


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
        """Grids with the same dim names: their requests are compared by name and position."""
        return "grid:" + ",".join(self.dim_names)

    @property
    def digest(self) -> str:
        """A short name for these facts, alike on every rank that has them."""
        return hashlib.sha1(_encode(asdict(self)).encode()).hexdigest()[:12]


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

    def fields(self) -> dict[str, Any]:
        """Flat ``section.name`` -> JSON value, for comparing and for messages."""
        out: dict[str, Any] = {}
        for section, value in (("grid", asdict(self.grid)), ("request", asdict(self.request))):
            for name, item in value.items():
                out[f"{section}.{name}"] = json.loads(json.dumps(item, default=str))
        out["request.position"] = self.position.index
        return out


@dataclass(frozen=True)
class RoundId:
    """One round of a member set: the members (a digest, and their list for messages) and the
    epoch the store counts for them. Alike on every member of the round, unlike any other round.

    Example::

        >>> RoundId.of(range(100), epoch=0).name
        '100 ranks [0, 1, 2, 3, 4, 5, 6, 7, ..., 99]#0'
    """

    members: str
    shown: str
    epoch: int

    @classmethod
    def of(cls, members: Sequence[int], epoch: int) -> "RoundId":
        return cls(_members_digest(members), describe_ranks(sorted(members)), epoch)

    @property
    def name(self) -> str:
        return f"{self.shown}#{self.epoch}"

    @property
    def seed(self) -> str:
        """What names torch's group for this round (members' digest and epoch)."""
        return f"{self.members}#{self.epoch}"


class VerdictKind(str, enum.Enum):
    """What a round ended in."""

    OK = "ok"
    MISMATCH = "mismatch"
    TIMEOUT = "timeout"


class StateKind(str, enum.Enum):
    """What a rank was last doing in hypergrid's group creation."""

    WAITING = "waiting"  # published its entry for a round, waiting for the others
    FAILED = "failed"  # its round failed (the error says why)
    PASSED = "passed"  # issued a request without being a member of any of its groups


# ---------------------------------------------------------------------- what goes through the store
R = TypeVar("R")


@dataclass(frozen=True)
class Entry:
    """A member's entry in a round: the epoch it read, and what it asked for."""

    epoch: int
    digest: str
    fields: dict


@dataclass(frozen=True)
class LastState:
    """A rank's latest state. ``members``/``epoch``: its round (empty/-1 for PASSED)."""

    state: StateKind
    members: str
    shown: str
    epoch: int
    position: Position
    fields: dict
    error: str = ""
    # Failed because ranks went different ways (not a timeout or torch error, after which a rank
    # may retry the same request): it will not come back to this round.
    diverged: bool = False

    @property
    def label(self) -> Any:
        return self.fields.get("request.label")


@dataclass(frozen=True)
class Verdict:
    """How a round ended, when not in agreement: posted once by its leader."""

    kind: VerdictKind
    message: str


@dataclass(frozen=True)
class CheckpointVerdict:
    """How a world checkpoint ended: ``failed`` the rank that failed (None: every rank finished)."""

    failed: Optional[int]
    error: str = ""


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _write(record: Any) -> str:
    """The one serializer of the records above."""
    return _encode(asdict(record))


def _read(cls: Type[R], raw: bytes) -> R:
    data = json.loads(raw.decode())
    if cls is LastState:
        data["state"] = StateKind(data["state"])
        data["position"] = Position(**data["position"])
    elif cls is Verdict:
        data["kind"] = VerdictKind(data["kind"])
    known = {f.name for f in dataclass_fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in known})


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


def _differences(payloads: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[str, list[int]]]:
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


def _format_differences(diffs: Mapping[str, Mapping[str, list[int]]]) -> str:
    parts = []
    for name, by_value in diffs.items():
        held = "; ".join(f"ranks {describe_ranks(r)} have {_shorten(v)}" for v, r in by_value.items())
        parts.append(f"{name}: {held}")
    return "\n  ".join(parts) or "no field differs"


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(message: str, limit: int = 400) -> str:
    text = "; ".join(part.strip() for part in message.splitlines() if part.strip()).replace(":;", ":")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------- the store, with deadlines
class _Connection:
    """Agreement's own connection to the job's store (a clone), with a thread that makes its calls.

    A store call blocks in torch until its host answers, for as long as the connection's original
    timeout, whatever is asked later; a call made on this thread is waited for only until the
    caller's deadline. A connection whose call ran out is dropped (the call finishes, or fails, on
    its own later), and the next use opens a new one.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self._calls: "queue.SimpleQueue[tuple[Callable[[], Any], list, threading.Event]]" = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="hypergrid-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, box, done = self._calls.get()
            try:
                box.append((True, fn(self.store)))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[Any], R], seconds: float) -> tuple[bool, Any]:
        """``(finished, value or exception)``: not finished when ``seconds`` ran out first."""
        box: list = []
        done = threading.Event()
        self._calls.put((fn, box, done))
        if not done.wait(seconds):
            return False, None
        return True, box[0]


_connections = threading.local()


class _Store:
    """The job's store as agreement uses it: its own connection, each call bounded by a deadline.

    A call that does not come back in time is the store not answering (its host stopped, or
    overloaded): :class:`~hypergrid.errors.StoreUnresponsiveError`, raised within the deadline. A
    ``wait`` that runs out is not: the keys are simply not there yet (False).
    """

    def __init__(self, deadline: float) -> None:
        base = default_store()
        assert base is not None  # agreement_possible() checked it
        self.deadline = deadline
        self._base = base
        self._connection = self._open(base)

    def _open(self, base: Any) -> Optional[_Connection]:
        cached = getattr(_connections, "by_store", None)
        if cached is not None and cached[0] is base:
            return cached[1]
        connection = _Connection(base)  # cloning may block on a frozen host too: on its thread
        finished, result = connection.call(lambda store: store.clone(), max(_MIN_CALL_S, self.remaining()))
        if not finished:
            raise StoreUnresponsiveError(f"the job's store did not answer a new connection within {self.remaining():.1f} s")
        ok, clone = result
        if ok:
            connection.store = clone  # its thread now calls the clone
        _connections.by_store = (base, connection if ok else None)
        # A store that cannot clone (a custom one): calls go to it directly.
        return connection if ok else None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _call(self, what: str, fn: Callable[[Any], R], seconds: Optional[float] = None) -> R:
        if self._connection is None:
            return fn(self._base)
        budget = max(_MIN_CALL_S, self.remaining() if seconds is None else seconds)
        finished, result = self._connection.call(fn, budget)
        if not finished:
            _connections.by_store = None  # this connection is stuck: the next use opens another
            raise StoreUnresponsiveError(f"the job's store did not answer a {what} within {budget:.1f} s")
        ok, value = result
        if not ok:
            raise value
        return value

    def get(self, key: str) -> bytes:
        return self._call("get", lambda store: store.get(key))

    def get_within(self, key: str, seconds: float) -> Optional[bytes]:
        """``key``'s value once it is set, waiting at most ``seconds``; None if it is not set by then.
        One store call (a wait and a get would be two)."""
        seconds = min(seconds, self.remaining())
        if seconds <= 0:
            return None

        def getting(store: Any) -> Optional[bytes]:
            store.set_timeout(timedelta(seconds=seconds))  # how long the store waits for the key
            try:
                return store.get(key)
            except dist.DistNetworkError:
                raise
            except RuntimeError:  # not set in time
                return None

        return self._call("get", getting, seconds + 1.0)

    def set(self, key: str, value: str) -> None:
        self._call("set", lambda store: store.set(key, value))

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._call("multi_set", lambda store: store.multi_set(keys, values))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", lambda store: store.multi_get(keys))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", lambda store: store.check(keys))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", lambda store: store.add(key, amount))

    def append(self, key: str, value: str) -> None:
        self._call("append", lambda store: store.append(key, value))

    def delete_key(self, key: str) -> None:
        self._call("delete", lambda store: store.delete_key(key))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", lambda store: store.compare_set(key, expected, desired))

    def wait(self, keys: list[str], seconds: float) -> bool:
        """Block until every key is set, for at most ``seconds``: one store call either way."""
        seconds = min(seconds, self.remaining())
        if seconds <= 0:
            return False

        def waiting(store: Any) -> bool:
            try:
                store.wait(keys, timedelta(seconds=seconds))
            except dist.DistNetworkError:
                raise
            except RuntimeError:  # ran out (DistStoreError; a FileStore raises a plain RuntimeError)
                return False
            return True

        # A wait that runs out is normal; one that does not come back at all is the store.
        return self._call("wait", waiting, seconds + 1.0)


# ---------------------------------------------------------------------- one round
def _base(members_digest: str) -> str:
    return f"{_PREFIX}/{members_digest}"


def _last_key(rank: int) -> str:
    return f"{_PREFIX}/last/{rank}"


@dataclass
class _Round:
    """One member's view of one round, with the store keys it uses."""

    store: _Store
    label: str
    members: list[int]
    agreement: Agreement
    rank: int
    round_id: RoundId
    fields: dict[str, Any] = field(init=False)
    digest: str = field(init=False)
    base: str = field(init=False)

    def __post_init__(self) -> None:
        self.fields = dict(self.agreement.fields(), **{"request.members": members_fingerprint(self.members)})
        self.digest = hashlib.sha1(_encode(self.fields).encode()).hexdigest()
        self.base = _base(self.round_id.members)

    @classmethod
    def opened(cls, store: _Store, label: str, members: list[int], agreement: Agreement) -> "_Round":
        """This rank's round of ``members``: the epoch is read, and the rank is in it from now on."""
        epoch = int(store.add(f"{_base(_members_digest(members))}/epoch", 0))
        return cls(store, label, members, agreement, dist.get_rank(), RoundId.of(members, epoch))

    @property
    def epoch(self) -> int:
        return self.round_id.epoch

    @property
    def leader(self) -> int:
        return min(self.members)

    @property
    def epoch_key(self) -> str:
        return f"{self.base}/epoch"

    @property
    def verdict_key(self) -> str:
        return f"{self.base}/verdict/{self.epoch}"

    def entry_key(self, rank: int) -> str:
        return f"{self.base}/entry/{rank}"

    def state(self, kind: StateKind, error: str = "", diverged: bool = False) -> str:
        return _write(LastState(kind, self.round_id.members, self.round_id.shown, self.epoch,
                                self.agreement.position, self.fields, error, diverged))

    def where(self) -> str:
        return f"process group {self.label!r} (members {describe_ranks(self.members)})"


def publish_position(agreement: Agreement) -> None:
    """Record that this rank issued ``agreement``'s request without being in any of its groups.

    A member waiting on this rank then sees it at this request with its own facts (say, another
    ``rank_offset``) and reports the difference at once instead of waiting for the timeout.

    The registry calls it on ranks outside every group of a request. Example, in a one-rank gloo
    world whose store is a ``HashStore``::

        >>> import json
        >>> import torch.distributed as dist
        >>> from hypergrid.runtime.torch_compat import default_store
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
        >>> request = RequestFacts(label="dp", view=None, private=False, backend=None, timeout_s=None,
        ...                        pg_options=None, mode="local")
        >>> publish_position(Agreement(Position(facts.family, facts.digest, 3), facts, request))
        >>> last = json.loads(default_store().get("hypergrid/agree/last/0"))   # rank 0's last state
        >>> last["state"], last["position"]["index"], last["fields"]["grid.shape"]
        ('passed', 3, [2, 4])
        >>> dist.destroy_process_group()
    """
    if not agreement_possible():
        return
    state = LastState(StateKind.PASSED, "", "", -1, agreement.position,
                      dict(agreement.fields(), **{"request.members": None}))
    with contextlib.suppress(dist.DistError, StoreUnresponsiveError):  # reported where someone waits
        _Store(time.monotonic() + _SLICE_S).set(_last_key(dist.get_rank()), _write(state))


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
    store = _Store(started + timeout.total_seconds())
    where = f"process group {label!r} (members {describe_ranks(members)})"
    try:
        rnd = _Round.opened(store, label, members, agreement)
        try:
            entry = _write(Entry(rnd.epoch, rnd.digest, rnd.fields))
            # One round trip: the entry the leader reads and the last state others diagnose by.
            store.multi_set([_last_key(rnd.rank), rnd.entry_key(rnd.rank)], [rnd.state(StateKind.WAITING), entry])
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
            f"that they agree ({type(exc).__name__}: {_one_line(str(exc), 200)}). The process hosting "
            f"the store (rank 0 with init_method 'env://' or 'tcp://', or the launcher's agent) has "
            f"likely exited: look at its error first."
        ) from exc
    logger.debug("members of %s agree in round %s (%.1f ms)", label, rnd.round_id.name, (time.monotonic() - started) * 1e3)
    return rnd.round_id


def end_round(store: Any, epoch_key: str, epoch: int) -> None:
    """Advance ``epoch_key`` from ``epoch`` to the next, once: idempotent, whoever calls first wins."""
    store.compare_set(epoch_key, str(epoch), str(epoch + 1))


def _leave_failed(rnd: _Round, exc: BaseException) -> None:
    """Mark this rank failed in its round and end the round (whoever is first), before raising."""
    root = getattr(exc, "root_cause", None) or _one_line(str(exc))
    with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
        rnd.store.set(_last_key(rnd.rank), rnd.state(StateKind.FAILED, root, isinstance(exc, GridMismatchError)))
        end_round(rnd.store, rnd.epoch_key, rnd.epoch)


def _decide(rnd: _Round, proposed: Verdict, root_cause: Optional[str] = None) -> None:
    """Make ``proposed`` the round's one verdict unless another was decided first, and act on the
    verdict that stands: return for "ok", raise its error otherwise. Every member acts on the same
    verdict, so a round ends alike for all its members."""
    raw = rnd.store.compare_set(rnd.verdict_key, "", _write(proposed))
    standing = _read(Verdict, raw)
    _act_on(standing, root_cause if standing == proposed else None)


def _act_on(verdict: Verdict, root_cause: Optional[str] = None) -> None:
    if verdict.kind is VerdictKind.OK:
        return
    error = GroupTimeoutError if verdict.kind is VerdictKind.TIMEOUT else GridMismatchError
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


def _entries(rnd: _Round, ranks: list[int]) -> dict[int, Entry]:
    """The entries of ``ranks`` in this round; a rank without one (or with an older one) is absent.

    One ``check`` and one ``multi_get`` once every rank has published at least once; before that,
    a ``check`` per rank, for at most 64 of them."""
    keys = [rnd.entry_key(r) for r in ranks]
    if rnd.store.check(keys):
        raws = dict(zip(ranks, rnd.store.multi_get(keys)))
    else:
        present = [(r, key) for r, key in zip(ranks[:64], keys) if rnd.store.check([key])]
        raws = dict(zip([r for r, _ in present], rnd.store.multi_get([k for _, k in present]))) if present else {}
    entries = {r: _read(Entry, raw) for r, raw in raws.items()}
    return {r: e for r, e in entries.items() if e.epoch == rnd.epoch}


def _timeout_message(rnd: _Round, missing: list[int], timeout: timedelta) -> str:
    return (
        f"hypergrid: {rnd.where()}: ranks {describe_ranks(missing)} did not arrive within the timeout "
        f"({timeout.total_seconds():g} s); {_last_states(rnd, missing)}"
    )


def _lead(rnd: _Round, timeout: timedelta) -> None:
    keys = [rnd.entry_key(r) for r in rnd.members]
    entries: dict[int, Entry] = {}
    published = [False]  # every member has published at least once: its key exists

    def arrived() -> bool:
        # Cheap until every member has published once: one check of all keys.
        entries.clear()
        if not published[0] and not rnd.store.check(keys):
            return False
        published[0] = True
        raws = rnd.store.multi_get(keys)
        for r, raw in zip(rnd.members, raws):
            entry = _read(Entry, raw)
            if entry.epoch == rnd.epoch:
                entries[r] = entry
        return len(entries) == len(rnd.members)

    def absent() -> list[int]:
        return [r for r in rnd.members if r not in (entries or _entries(rnd, rnd.members))]

    try:
        # The first meeting of these members blocks until every entry exists instead of polling.
        published[0] = rnd.store.wait(keys, _SLICE_S)
        if not _poll(rnd.store.deadline, arrived, lambda: _judge_absent(rnd, absent())):
            raise GroupTimeoutError(_timeout_message(rnd, absent(), timeout))
        if len({e.digest for e in entries.values()}) > 1:
            diffs = _differences({r: e.fields for r, e in entries.items()})
            raise GridMismatchError(
                f"hypergrid: ranks disagree on {rnd.where()}, so it was not created:\n  {_format_differences(diffs)}"
                + _concurrency_hint(diffs)
            )
    except GroupTimeoutError as exc:
        _decide(rnd, Verdict(VerdictKind.TIMEOUT, str(exc)), exc.root_cause)
    except GridMismatchError as exc:
        _decide(rnd, Verdict(VerdictKind.MISMATCH, str(exc)), exc.root_cause)
    # Every member has read this epoch: advance it, then say yes, so that no member can read it
    # again for its next request; then drop the verdicts of earlier rounds, which all have left.
    end_round(rnd.store, rnd.epoch_key, rnd.epoch)
    _decide(rnd, Verdict(VerdictKind.OK, ""))
    _drop_old_verdicts(rnd)


def _concurrency_hint(diffs: Mapping[str, Any]) -> str:
    if {"grid.shape", "grid.dim_names", "grid.rank_offset", "grid.views"} & set(diffs):
        return (
            "\n  (if these are two grids created at the same time, in threads, create them in the "
            "same order on every rank)"
        )
    return ""


def _drop_old_verdicts(rnd: _Round) -> None:
    """Delete the previous round's verdict: every member has published in this round, so every
    member is past that one. (A verdict of a round before a failed one stays, one key a failure.)"""
    if rnd.epoch > 0:
        rnd.store.delete_key(f"{rnd.base}/verdict/{rnd.epoch - 1}")


def _follow(rnd: _Round, timeout: timedelta) -> None:
    # The fast path is one blocking call: a round ends with its leader deciding its verdict. A
    # leader that died or went another way decides nothing, so after a while (the slice) the
    # follower looks at the leader's last state, as the leader looks at its members'; at the
    # deadline it proposes a timeout itself, naming the absent members, unless a verdict stands.
    raw = rnd.store.get_within(rnd.verdict_key, _SLICE_S)
    if raw is not None:
        _act_on(_read(Verdict, raw))
        return

    def diagnose() -> None:
        if rnd.leader not in _entries(rnd, [rnd.leader]):
            _judge_absent(rnd, [rnd.leader])

    try:
        decided = _poll(rnd.store.deadline, lambda: rnd.store.check([rnd.verdict_key]), diagnose)
    except GridMismatchError as exc:
        _decide(rnd, Verdict(VerdictKind.MISMATCH, str(exc)), exc.root_cause)
        return
    if decided:
        _act_on(_read(Verdict, rnd.store.get(rnd.verdict_key)))
        return
    present = _entries(rnd, rnd.members)
    missing = [r for r in rnd.members if r not in present]
    if missing:
        message = _timeout_message(rnd, missing, timeout)
    else:
        message = (
            f"hypergrid: {rnd.where()}: every member arrived, but its leader, rank {rnd.leader}, did not "
            f"answer within the timeout ({timeout.total_seconds():g} s); {_last_states(rnd, [rnd.leader])}"
        )
    _decide(rnd, Verdict(VerdictKind.TIMEOUT, message))


def _judge_absent(rnd: _Round, absent: list[int]) -> None:
    """Raise now if an absent member can never arrive; otherwise it is late, and waited for."""
    failed = _failed_step(rnd.store) if absent else None
    if failed is not None:
        step, verdict = failed
        raise GridMismatchError(
            f"hypergrid: {rnd.where()} cannot be created: {step.label} has failed on rank {verdict.failed}, "
            f"so ranks {describe_ranks(absent)} will not come: {verdict.error}",
            root_cause=verdict.error,
        )
    for r in absent[:64]:  # a bounded look: diagnosing must not cost O(group size) each poll
        if r == rnd.rank:
            continue
        last = _read_last(rnd.store, r)
        if last is None:
            continue
        reason, cycle = _cannot_arrive(rnd, last)
        if reason is None:
            continue
        diffs = _differences({rnd.rank: rnd.fields, r: last.fields})
        message = (
            f"hypergrid: {rnd.where()} cannot be created: rank {r} will not join, {reason}; its last "
            f"request was {last.label!r} ({last.position.describe()}):\n  {_format_differences(diffs)}"
            + (f"\n  root cause on rank {r}: {last.error}" if last.error else "")
        )
        # A wait-for cycle is a deadlock none of its rounds can leave: every one of them fails now,
        # with this one verdict, instead of each at its own timeout (or one of them only).
        for state in cycle:
            with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
                rnd.store.compare_set(f"{_base(state.members)}/verdict/{state.epoch}", "",
                                      _write(Verdict(VerdictKind.MISMATCH, message)))
        raise GridMismatchError(message, root_cause=last.error or None)


def _cannot_arrive(rnd: _Round, last: LastState) -> tuple[Optional[str], list[LastState]]:
    """Why a rank whose last state is ``last`` will never arrive in this round (None when it may be
    late), and the other rounds of a wait-for cycle it found."""
    mine = rnd.agreement.position
    # The same request: the same place in the sequence of a grid with the same facts (what it asks
    # for there, and over whom, is what may differ). Grids that differ are told apart by the
    # rounds they wait in, not by their places, which another grid of the same dims may share.
    same_request = last.position == mine
    if last.members == rnd.round_id.members:
        if last.epoch > rnd.epoch:
            return f"it has gone past this round of these members (it is at round {last.epoch}, this is {rnd.epoch})", []
        if last.epoch == rnd.epoch and last.state is StateKind.FAILED:
            return "its part in this very round failed", []
        return None, []  # an earlier round of these members: late
    if same_request:
        # A rank asks for one thing at one place of one grid: this place of a grid with these facts
        # it has already asked for, over other members or for something else, however long ago.
        if last.state is StateKind.PASSED:
            return "at this same request it is in none of the groups", []
        return f"at this same request it {'waits' if last.state is StateKind.WAITING else 'was'} in a group of other members", []
    if last.state is StateKind.PASSED:
        # Outside every group of its request, by its own grid of the same dims at the same place.
        if (last.position.family, last.position.index) == (mine.family, mine.index):
            return "at this same request it is in none of the groups, by its own grid", []
        return None, []
    if last.state is not StateKind.WAITING or not _is_open(rnd.store, last):
        return None, []  # it has left that round: busy elsewhere since, and may be late
    chain, rounds = _wait_chain(rnd, last)
    if chain and all(_is_open(rnd.store, state) for state in rounds):
        return (f"it waits in a round of other members ({last.shown}, request {last.label!r}), and "
                f"{chain}: these creations wait for each other"), rounds + [_my_state(rnd)]
    return None, []


def _my_state(rnd: _Round) -> LastState:
    return _read(LastState, rnd.state(StateKind.WAITING).encode())


def _is_open(store: _Store, state: LastState) -> bool:
    """Whether ``state``'s round is still open: no verdict, and its epoch has not moved past it."""
    base = _base(state.members)
    return int(store.add(f"{base}/epoch", 0)) == state.epoch and not store.check([f"{base}/verdict/{state.epoch}"])


#: How far and how wide a search for a wait-for cycle looks: bounded, because it runs while waiting.
_CYCLE_DEPTH, _CYCLE_BREADTH = 4, 8


def _wait_chain(rnd: _Round, state: LastState, depth: int = _CYCLE_DEPTH) -> tuple[str, list[LastState]]:
    """How ``state``'s open round waits, through other open rounds, for this rank, which waits in
    its own round: a cycle that no member can leave. Returns its description and its rounds
    (``("", [])`` when none is found within the bounds).

    A round waits for a member that is not in it (its entry is not of that round's epoch); that
    member, if it waits in an open round of its own, passes the wait on. A rank is in one round
    at a time (creations are serialised per process), so a chain of open rounds is current."""
    members = _shown_members(state)
    if rnd.rank in members and not _in_round(rnd.store, state, rnd.rank):
        return f"that round needs rank {rnd.rank}", [state]
    if depth <= 1:
        return "", []
    for other in [m for m in members if m != rnd.rank][:_CYCLE_BREADTH]:
        if _in_round(rnd.store, state, other):
            continue
        nxt = _read_last(rnd.store, other)
        if nxt is None or nxt.state is not StateKind.WAITING or (nxt.members, nxt.epoch) == (state.members, state.epoch):
            continue
        if not _is_open(rnd.store, nxt):
            continue
        rest, rounds = _wait_chain(rnd, nxt, depth - 1)
        if rest:
            return f"that round needs rank {other}, which waits in a round of members {nxt.shown}, and {rest}", [state] + rounds
    return "", []


def _shown_members(state: LastState) -> list[int]:
    """The members of ``state``'s round, where its summary lists them whole (groups of up to 16)."""
    text = state.shown
    if not text.startswith("["):
        return []  # a larger group is shown summarised: not followed
    return [int(x) for x in text.strip("[]").split(",") if x.strip()]


def _in_round(store: _Store, state: LastState, rank: int) -> bool:
    """Whether ``rank`` has published its entry in ``state``'s round."""
    key = f"{_base(state.members)}/entry/{rank}"
    return bool(store.check([key])) and _read(Entry, store.get(key)).epoch == state.epoch


def _read_last(store: _Store, rank: int) -> Optional[LastState]:
    key = _last_key(rank)
    if not store.check([key]):
        return None
    return _read(LastState, store.get(key))


def _last_states(rnd: _Round, ranks: list[int]) -> str:
    """What the given ranks were last doing, for a timeout message."""
    notes = []
    for r in ranks[:8]:
        try:
            last = _read_last(rnd.store, r)
        except (dist.DistError, StoreUnresponsiveError):
            notes.append("the store did not answer when asked what they were last doing")
            break
        if last is None:
            notes.append(f"rank {r} never reached a hypergrid group creation")
            continue
        diffs = _differences({rnd.rank: rnd.fields, r: last.fields})
        where = f"round {last.epoch} of members {last.shown}" if last.members else "in none of its groups"
        notes.append(
            f"rank {r} was last {last.state.value} on {last.label!r} ({last.position.describe()}, {where}; "
            f"differs from this rank's request in: {', '.join(sorted(diffs)) or 'nothing'})"
            + (f": {last.error}" if last.error else "")
        )
    if len(ranks) > 8:
        notes.append(f"and {len(ranks) - 8} more")
    return "; ".join(notes)


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
    store = _Store(time.monotonic() + _FAILURE_GRACE_S)
    rnd = _Round(store, label, sorted(members), agreement, dist.get_rank(), round_id)
    try:
        store.set(_last_key(rnd.rank), rnd.state(StateKind.FAILED, "torch failed to create the group"))
        silent: list[int] = []

        def everyone_reported() -> bool:
            silent.clear()
            for r in rnd.members[:64]:
                last = _read_last(store, r)
                if last is None or (last.members, last.epoch, last.state) != (round_id.members, round_id.epoch, StateKind.FAILED):
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


# ---------------------------------------------------------------------- the whole world
@dataclass(frozen=True)
class WorldRound:
    """A step every rank of the world takes together (Megatron's ``initialize_model_parallel``),
    named by the world's epoch, which every rank read at its start (:func:`world_start`)."""

    label: str
    epoch: int

    def key(self, name: str) -> str:
        return f"{_PREFIX}/world/{self.epoch}/{name}"


_WORLD_EPOCH = f"{_PREFIX}/world/epoch"
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


def _failed_step(store: _Store) -> Optional[tuple[WorldRound, CheckpointVerdict]]:
    step = getattr(_steps, "current", None)
    if step is None or not store.check([step.key("go")]):
        return None
    verdict = _read(CheckpointVerdict, store.get(step.key("go")))
    return (step, verdict) if verdict.failed is not None else None


def world_start(label: str, *, timeout: timedelta) -> Optional[WorldRound]:
    """Every rank of the world starts ``label`` together; returns the step's round.

    A barrier through the store (one ``add`` and one ``wait`` per rank): once it returns, every
    rank has read the step's epoch, so the step's end (:func:`world_checkpoint`) is named alike on
    all of them, whatever any rank did before. A rank that does not arrive within ``timeout``
    fails the start on every rank that did, naming it.

    Example::

        >>> world_start("initialize_model_parallel", timeout=timedelta(seconds=60)) is None   # no process group
        True
    """
    if not agreement_possible():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _Store(time.monotonic() + timeout.total_seconds())
    try:
        step = WorldRound(label, int(store.add(_WORLD_EPOCH, 0)))
        store.append(step.key("started"), f"{rank},")
        if store.add(step.key("start"), 1) == world:
            store.set(step.key("ready"), "")
        if store.wait([step.key("ready")], store.remaining()):
            return step
        missing = _not_in(store, step.key("started"), world)
        end_round(store, _WORLD_EPOCH, step.epoch)
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise GroupCreationError(
            f"hypergrid: {label}: the job's store stopped answering at the start ({type(exc).__name__}: "
            f"{_one_line(str(exc), 200)}); the process hosting it has likely exited or stopped"
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
    that did not. The step's keys, and those of every earlier step, are deleted once every rank has
    ended it: the store does not grow with steps.

    Example::

        >>> world_checkpoint(None, None, timeout=timedelta(seconds=60))   # no process group: nothing to do
    """
    if step is None or not agreement_possible():
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _Store(time.monotonic() + timeout.total_seconds())
    go = step.key("go")
    try:
        if error is not None:
            failed = CheckpointVerdict(rank, _one_line(f"{type(error).__name__}: {error}", 1200))
            store.compare_set(go, "", _write(failed))  # the first failure stands
            end_round(store, _WORLD_EPOCH, step.epoch)
            return
        store.append(step.key("who"), f"{rank},")
        if store.add(step.key("arrived"), 1) == world:
            end_round(store, _WORLD_EPOCH, step.epoch)
            store.compare_set(go, "", _write(CheckpointVerdict(None)))
            _drop_old_steps(store, step.epoch)
        if not store.wait([go], store.remaining()):
            missing = _not_in(store, step.key("who"), world)
            end_round(store, _WORLD_EPOCH, step.epoch)
            raise GroupTimeoutError(
                f"hypergrid: {step.label}: only {world - len(missing)} of {world} ranks finished it within "
                f"the timeout ({timeout}); ranks {describe_ranks(missing)} did not: they are still at it, "
                f"hang, or died"
            )
        verdict = _read(CheckpointVerdict, store.get(go))
    except (dist.DistError, StoreUnresponsiveError) as exc:
        if error is not None:
            return  # the caller's own error says more
        raise GroupCreationError(
            f"hypergrid: {step.label}: the job's store stopped answering at the end ({type(exc).__name__}: "
            f"{_one_line(str(exc), 200)}); the process hosting it has likely exited or stopped"
        ) from exc
    if verdict.failed is not None:
        raise GridMismatchError(
            f"hypergrid: {step.label} failed on rank {verdict.failed}, so it cannot be used on this rank "
            f"either: {verdict.error}",
            root_cause=verdict.error,
        )


def _not_in(store: _Store, key: str, world: int) -> list[int]:
    """The ranks of the world missing from the comma-separated list at ``key``."""
    store.deadline = max(store.deadline, time.monotonic() + 1.0)  # one more answer, to name them
    seen = {int(r) for r in store.get(key).decode().split(",") if r} if store.check([key]) else set()
    return [r for r in range(world) if r not in seen]


def _drop_old_steps(store: _Store, epoch: int) -> None:
    """Delete the keys of every earlier step: all ranks have ended this one."""
    cleaned_key = f"{_PREFIX}/world/cleaned"
    first = int(store.add(cleaned_key, 0))
    for old in range(first, epoch):
        for name in ("start", "started", "ready", "arrived", "who", "go"):
            store.delete_key(f"{_PREFIX}/world/{old}/{name}")
    if epoch > first:
        store.add(cleaned_key, epoch - first)
