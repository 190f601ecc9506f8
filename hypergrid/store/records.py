"""The frozen records that cross processes through the job's store, and their one serializer.

:func:`encode` writes a record; :func:`decode` rebuilds it, nested records, enums and tuples
included, from the record's own type hints, so nothing elsewhere reads values by string keys.

Example::

    >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
    >>> request = RequestFacts(label="dp", view=None, private=False, backend=None, timeout_s=None,
    ...                        pg_options=None, mode="local")
    >>> agreement = Agreement(Position(facts.family, facts.digest, 3), facts, request)
    >>> sorted(agreement.fields())[:3]
    ['grid.dim_names', 'grid.placement', 'grid.rank_offset']
    >>> decode(Agreement, encode(agreement).encode()) == agreement
    True
    >>> CheckId.of([1, 3, 5, 7], epoch=2).name
    '[1, 3, 5, 7]#2'
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional, TypeVar, Union, get_args, get_origin, get_type_hints

from ..layout.describe import describe_ranks
from .keys import members_digest

__all__ = [
    "Position", "ViewFacts", "GridFacts", "RequestFacts", "Agreement", "CheckId", "CheckOutcome", "State", "Asked",
    "Entry", "LastState", "Verdict", "StepOutcome", "Arrival", "FailureVerdict", "JobRecord", "JobState",
    "EventKind", "BoardEvent", "encode", "decode", "encode_events", "decode_events",
]

R = TypeVar("R")


# ---------------------------------------------------------------------- what members compare
@dataclass(frozen=True)
class Position:
    """Where a request stands: the ``index``-th request of a grid of ``family`` with facts ``grid``
    (two ranks asking for the same group at different positions have diverged).

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
    #: The digest of the grid's rank map ("": the default placement from ``rank_offset``).
    placement: str = ""

    @classmethod
    def of(cls, shape: Sequence[int], dim_names: Sequence[str], rank_offset: int, views: Sequence[ViewFacts] = (),
           placement: str = "") -> GridFacts:
        return cls(tuple(shape), tuple(dim_names), rank_offset, tuple(views), placement)

    @property
    def family(self) -> str:
        """Grids with the same dim names: their requests are compared by name and position."""
        return "grid:" + ",".join(self.dim_names)

    @functools.cached_property
    def digest(self) -> str:
        """A short name for these facts, alike on every rank that has them."""
        return hashlib.sha1(_json(asdict(self)).encode()).hexdigest()[:12]


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
class CheckId:
    """One check of a member set: its members (a digest, and a list for messages) and its epoch.

    Example::

        >>> CheckId.of(range(100), epoch=0).name
        '100 ranks [0, 1, 2, 3, 4, 5, 6, 7, ..., 99]#0'
    """

    members: str
    shown: str
    epoch: int

    @classmethod
    def of(cls, members: Sequence[int], epoch: int) -> CheckId:
        return cls(members_digest(members), describe_ranks(sorted(members)), epoch)

    @property
    def name(self) -> str:
        return f"{self.shown}#{self.epoch}"

    @property
    def seed(self) -> str:
        """What names torch's group for this check."""
        return f"{self.members}#{self.epoch}"


class CheckOutcome(str, enum.Enum):
    """What a check ended in."""

    OK = "ok"
    MISMATCH = "mismatch"
    TIMEOUT = "timeout"


class State(str, enum.Enum):
    """What a rank was last doing in group creation (PASSED: a request with none of its groups)."""

    WAITING = "waiting"
    FAILED = "failed"
    PASSED = "passed"


# ---------------------------------------------------------------------- what goes through the store
@dataclass(frozen=True)
class Asked:
    """What one rank asked for, and the member list it computed (None: in no group of the request)."""

    agreement: Agreement
    members: Optional[str]

    def fields(self) -> dict[str, Any]:
        """Flat ``section.name`` -> value, the member list included, for comparing and messages."""
        return dict(self.agreement.fields(), **{"request.members": self.members})

    @property
    def label(self) -> str:
        return self.agreement.request.label


@dataclass(frozen=True)
class Entry:
    """A member's entry in a check: the epoch it read, what it asked for, and that request's digest."""

    epoch: int
    digest: str
    asked: Asked


@dataclass(frozen=True)
class LastState:
    """A rank's latest state. ``members``/``shown``/``epoch``: its check (empty and -1 for PASSED)."""

    state: State
    members: str
    shown: str
    epoch: int
    asked: Asked
    error: str = ""
    # Failed because ranks diverged (not a timeout or torch error): it will not retry this check.
    diverged: bool = False

    @property
    def position(self) -> Position:
        return self.asked.agreement.position

    @property
    def label(self) -> str:
        return self.asked.label


@dataclass(frozen=True)
class Verdict:
    """How a check ended, posted once and acted on by every member."""

    outcome: CheckOutcome
    message: str


@dataclass(frozen=True)
class StepOutcome:
    """How a world step's start or end came out: ``failed`` the rank that failed it, with its error;
    ``lost`` the participants heard lost meanwhile; ``timed_out`` the participant whose timeout
    passed first. None of them: every participant got there.

    Example::

        >>> decode(StepOutcome, encode(StepOutcome(None, timed_out=2)))
        StepOutcome(failed=None, error='', lost=(), timed_out=2)
    """

    failed: Optional[int]
    error: str = ""
    lost: tuple[int, ...] = ()
    timed_out: Optional[int] = None


@dataclass(frozen=True)
class Arrival:
    """What a rank brings to a recovery round: the step it can resume from, why it came
    (``"recover"``, ``"grow"`` or ``"wait"``), the member lists of the communicators it aborted
    (broken for every member), and its recovery settings' digest (the leader refuses a round whose
    ranks disagree on them).

    Example::

        >>> decode(Arrival, encode(Arrival(4, step=7, aborted=((4, 5),))))
        Arrival(rank=4, step=7, reason='recover', aborted=((4, 5),), settings='')
    """

    rank: int
    step: Optional[int] = None
    reason: str = "recover"
    aborted: tuple[tuple[int, ...], ...] = ()
    settings: str = ""


@dataclass(frozen=True)
class FailureVerdict:
    """How one recovery round ended its wait: the failed ranks (one reason line each), the ranks
    that ``offered`` themselves, the least step any participant can resume from, and the ranks
    that aborted their communicators (``aborted_by``, ``(first, count)`` runs). ``abandoned``
    non-empty: the recovery ends in an error on every participant. ``board_read``: how many board
    entries the leader had read when it decided (every job rank lost in them is failed). Sized by failures and offers, never by the job.

    Example::

        >>> verdict = FailureVerdict((3,), 0, reasons=("rank 3: its process ended",), aborted_by=((0, 3),))
        >>> decode(FailureVerdict, encode(verdict)) == verdict
        True
    """

    failed: tuple[int, ...]
    round: int
    reasons: tuple[str, ...] = ()
    offered: tuple[int, ...] = ()
    step: Optional[int] = None
    grow: bool = False
    recovering: bool = False
    aborted_by: tuple[tuple[int, int], ...] = ()
    abandoned: str = ""
    board_read: int = 0
    decided_by: int = -1


@dataclass(frozen=True)
class JobRecord:
    """A job's placement as its latest committed round left it: shape, rank map runs, spares and
    resume step. ``gone``: why each lost rank was counted out, for a rank that learns late.
    ``board_from``: the board entry the next recovery reads from (the committing round's
    ``board_read``; no rank this record counts on is lost in the entries before it), so reading the board never costs more as earlier recoveries pile entries up.

    Example::

        >>> record = JobRecord(1, (2, 2), ("tp", "dp"), ((0, 0, 2), (2, 5, 2)), (4,), 12)
        >>> decode(JobRecord, encode(record)) == record
        True
    """

    generation: int
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    runs: tuple[tuple[int, int, int], ...]
    spares: tuple[int, ...]
    step: Optional[int] = None
    gone: tuple[str, ...] = ()
    board_from: int = 0


@dataclass(frozen=True)
class JobState:
    """A resilient job's one record in the store: the open (or next) ``round``, the committed
    placement (None: none yet) and the ``(rank, generation)`` offers. The committing round writes
    it once, advancing ``round`` with it.

    Example::

        >>> state = JobState(3, None, offers=((9, 1),))
        >>> decode(JobState, encode(state)) == state, state.offered(1), state.offered(2)
        (True, (9,), ())
    """

    round: int = 0
    committed: Optional[JobRecord] = None
    offers: tuple[tuple[int, int], ...] = ()

    @property
    def generation(self) -> int:
        return self.committed.generation if self.committed is not None else 0

    def offered(self, generation: int) -> tuple[int, ...]:
        """The ranks that offer themselves to the record of ``generation``, ascending."""
        return tuple(sorted({rank for rank, offered_to in self.offers if offered_to == generation}))


class EventKind(str, enum.Enum):
    """What a job's board says: a rank was lost or is back, a recovery round opened, or a meeting's
    outcome was decided (which the ranks hear from the board instead of reading the store)."""

    LOST = "lost"
    BACK = "back"
    ROUND = "round"
    DECIDED = "decided"


@dataclass(frozen=True)
class BoardEvent:
    """One event of a job's board: ``rank`` lost (with ``reason``) or back, round ``number`` opened,
    or the outcome at ``key`` decided as ``value`` (``rank``: who decided). ``by``: its publisher.

    Example::

        >>> event = BoardEvent(EventKind.LOST, 5, "its process ended", by=5)
        >>> decode(BoardEvent, encode(event)) == event
        True
    """

    kind: EventKind
    rank: int
    reason: str = ""
    number: int = -1
    by: int = -1
    key: str = ""
    value: str = ""


# ---------------------------------------------------------------------- the one serializer
def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def encode(record: Any) -> str:
    """A record as the text the store holds (sorted keys: equal records, equal texts).

    Example::

        >>> encode(Verdict(CheckOutcome.OK, ""))
        '{"message": "", "outcome": "ok"}'
    """
    return _json(asdict(record))


def decode(cls: type[R], raw: Union[bytes, str]) -> R:
    """The record of type ``cls`` that :func:`encode` wrote as ``raw``.

    Example::

        >>> decode(Verdict, b'{"message": "", "outcome": "ok"}')
        Verdict(outcome=<CheckOutcome.OK: 'ok'>, message='')
    """
    record: R = _build(cls, json.loads(raw.decode() if isinstance(raw, bytes) else raw))
    return record


def encode_events(events: Sequence[BoardEvent]) -> str:
    """The text of one board entry: one event as its record, several published together as a list.

    Example::

        >>> lost = [BoardEvent(EventKind.LOST, r, "stale", by=0) for r in (8, 9)]
        >>> decode_events(encode_events(lost)) == lost, decode_events(encode_events(lost[:1])) == lost[:1]
        (True, True)
    """
    if not events:
        raise ValueError("a board entry holds one event or more, got none")
    return encode(events[0]) if len(events) == 1 else _json([asdict(event) for event in events])


def decode_events(raw: Union[bytes, str]) -> list[BoardEvent]:
    """The events of one entry of a job's board, as :func:`encode_events` wrote it."""
    value = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return [_build(BoardEvent, item) for item in value] if isinstance(value, list) else [_build(BoardEvent, value)]


def _build(kind: Any, value: Any) -> Any:
    """``value`` (decoded JSON) as an instance of the type ``kind``, recursively."""
    if value is None or kind is Any:
        return value
    origin = get_origin(kind)
    if origin is Union:
        options = [arg for arg in get_args(kind) if arg is not type(None)]
        return _build(options[0], value) if len(options) == 1 else value
    if origin is tuple:
        args = get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], item) for item in value)
        return tuple(_build(arg, item) for arg, item in zip(args, value))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = _hints(kind)
        return kind(**{f.name: _build(hints[f.name], value[f.name])
                       for f in dataclasses.fields(kind) if f.init and f.name in value})
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(value)
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)
