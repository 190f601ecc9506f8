"""A node's ranks' store requests made as one: its delegate reads and counts in for all of them.

In a recovery round every participant reads the job's record, counts itself in among the round's
arrivals and, once rebuilt, at the rebuild's end. Made by every rank, that is four requests per
rank to the job's one store thread. The ranks of a node make them at about the same moment (a
loss reaches them together), and their monitors already elect one delegate per node: each rank
hands its call to its monitor (:class:`NodeCall`), a follower hands it on to the delegate over the
node's socket, and the delegate makes its node's calls of the same kind and key as one: one read
for all, one append of all the arrivals' lines and one ``add`` of their count. A batch goes once
every monitor of the node has asked, or :data:`BATCH_WINDOW_S` after the first asked. In a job
whose nodes read the board in groups (:mod:`.fanout`) a delegate hands its node's batch on to its
group's reader in turn, which makes its group's nodes' batches as one by the same rule (every
delegate connected to it has handed one on, or the window passed): a round then costs the store a
few requests per group of nodes.

What the store holds is what the ranks would have written one by one (the same lines, the same
count; the places are the count's values in the batch's order), so the round's rule reads it as
before. A call the node cannot make (no delegate, its socket full) is *refused* and the rank makes
it itself; one whose delegate went before answering is *unknown*: it may have reached the store.
An arrival unknown is made again (a rank counted twice is one arrival to a leader that reads the
arrivals by rank); a count at a step's end is not (a lost count fails the step on every rank, where
a double one could end it early).

Example, a node's two calls to count in at a meeting of three, and a read, over a ``HashStore``::

    >>> import time
    >>> import torch.distributed as dist
    >>> from hypergrid.store.client import StoreClient
    >>> from hypergrid.store.keys import Meeting
    >>> store = StoreClient(time.monotonic() + 5, base=dist.HashStore())
    >>> calls = NodeCalls()
    >>> answers = []
    >>> for rank in (8, 9):
    ...     calls.take(NodeCall.arrival(rank, Meeting("m"), 3, f"rank {rank}"), answers.append, now=0.0)
    >>> calls.due(members=3, now=0.1)                        # a third monitor of the node has not asked
    []
    >>> [batch] = calls.due(members=2, now=0.1)
    >>> for (call, reply), answer in zip(batch, answer_batch(store, [call for call, _ in batch])):
    ...     reply(answer)
    >>> [(a.rank, a.number, a.completes) for a in answers], store.get("m/lines")
    ([(8, 1, False), (9, 2, False)], b'rank 8\\nrank 9\\n')
    >>> answer_batch(store, [NodeCall.read(8, "m/count")])[0].value
    '2'
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol, cast

from ..store import meeting
from ..store.client import read_if_set
from ..store.keys import Meeting
from ..store.records import decode, encode
from .link import STORE_ERRORS, StoreLink
from .relay import NodeRelay, Relayed, Role

__all__ = ["BATCH_WINDOW_S", "CallKind", "AnswerKind", "NodeCall", "NodeAnswer", "NodeCalls", "NodeChannel", "NodeSpeaker",
           "answer_batch", "make_batch"]

#: How long a node's delegate holds its node's first call for the others (each rank's loss is heard
#: within milliseconds of the others' on a node; a rank that comes later makes a batch of its own).
BATCH_WINDOW_S = 0.2

#: How long a rank waits for its node's answer at most (a store that answers late holds its delegate).
CALL_TIMEOUT_S = 15.0


class CallKind(str, enum.Enum):
    """What a rank asks its node to make."""

    READ = "read"  # a key's value (None where it is not set)
    ARRIVE = "arrive"  # counted in at a meeting, its line appended first


class AnswerKind(str, enum.Enum):
    """How a call ended."""

    DONE = "done"
    REFUSED = "refused"  # it never reached the store: the rank makes it itself
    UNKNOWN = "unknown"  # the delegate went before answering: it may have reached the store


@dataclass(frozen=True)
class NodeCall:
    """One rank's call, numbered ``ident`` by it: read ``key``, or arrive at the meeting ``key``
    among ``size`` with ``line`` (``awaited``: the last arrival sets the meeting's ``complete``)."""

    ident: int
    rank: int
    kind: CallKind
    key: str
    size: int = 0
    line: Optional[str] = None
    awaited: bool = False

    @classmethod
    def read(cls, rank: int, key: str, ident: int = 0) -> NodeCall:
        return cls(ident, rank, CallKind.READ, key)

    @classmethod
    def arrival(cls, rank: int, at: Meeting, size: int, line: Optional[str] = None, *, awaited: bool = False,
                ident: int = 0) -> NodeCall:
        return cls(ident, rank, CallKind.ARRIVE, at.base, size, line, awaited)

    @property
    def batch(self) -> tuple[CallKind, str, int, bool]:
        """What the calls made as one have alike."""
        return self.kind, self.key, self.size, self.awaited


@dataclass(frozen=True)
class NodeAnswer:
    """The answer to call ``ident`` of ``rank``: a read's ``value`` (text; None: not set), an
    arrival's place (``number``, ``completes``)."""

    ident: int
    rank: int
    kind: AnswerKind = AnswerKind.DONE
    value: Optional[str] = None
    number: int = 0
    completes: bool = False

    @classmethod
    def to(cls, call: NodeCall, kind: AnswerKind) -> NodeAnswer:
        return cls(call.ident, call.rank, kind)

    @property
    def place(self) -> meeting.Place:
        return meeting.Place(self.number, self.completes)


def answer_batch(store: Any, calls: Sequence[NodeCall]) -> list[NodeAnswer]:
    """Make ``calls`` (one batch: :attr:`NodeCall.batch` alike) on ``store`` (a ``WireStore`` or a
    :class:`~hypergrid.store.client.StoreClient`): a read is one request for all, an arrival two."""
    first = calls[0]
    if any(call.batch != first.batch for call in calls):
        raise ValueError(f"a batch's calls are alike, got {[call.batch for call in calls]}")
    if first.kind is CallKind.READ:
        raw = read_if_set(store, first.key)
        value = None if raw is None else raw.decode()
        return [replace(NodeAnswer.to(call, AnswerKind.DONE), value=value) for call in calls]
    places = meeting.arrive_together(store, Meeting(first.key), first.size, [call.line for call in calls],
                                     awaited=first.awaited)
    return [replace(NodeAnswer.to(call, AnswerKind.DONE), number=place.number, completes=place.completes)
            for call, place in zip(calls, places)]


Reply = Callable[[NodeAnswer], None]
#: Calls made as one, each with where its answer goes.
Batch = list[tuple[NodeCall, Reply]]


def make_batch(batch: Batch, link: StoreLink) -> None:
    """Make ``batch`` on ``link`` as one (:func:`answer_batch`) and answer each of its calls; an
    arrival is not made twice: one whose answer was lost with the connection is unknown."""
    calls = [call for call, _ in batch]
    try:
        answers = link.call(functools.partial(answer_batch, calls=calls), again=calls[0].kind is CallKind.READ)
    except STORE_ERRORS:
        answers = None
    if answers is None:
        answers = [NodeAnswer.to(call, AnswerKind.UNKNOWN) for call in calls]
    for (_, reply), answer in zip(batch, answers):
        reply(answer)


@dataclass
class _Held:
    """A batch held since ``since``, and who asked in it."""

    since: float
    batch: Batch = field(default_factory=list)
    sources: set[int] = field(default_factory=set)


class NodeCalls:
    """A delegate's calls waiting to be made, by batch, and a follower's handed on, by number.

    Example, a follower's call whose delegate went before answering::

        >>> calls, heard = NodeCalls(), []
        >>> calls.handed_on(NodeCall.read(9, "k", ident=4), heard.append)
        >>> calls.lose_handed_on(); [(a.ident, a.kind.value) for a in heard]
        [(4, 'unknown')]
    """

    def __init__(self, window_s: float = BATCH_WINDOW_S) -> None:
        self.window_s = window_s
        self._waiting: dict[tuple[CallKind, str, int, bool], _Held] = {}
        self._handed_on: dict[tuple[int, int], Reply] = {}

    # ------------------------------------------------------------------ a delegate's
    def take(self, call: NodeCall, reply: Reply, *, now: float, source: Optional[int] = None) -> None:
        """Hold ``call`` (its answer to go to ``reply``) for its batch; ``source``: who asked (by
        default its rank; a group's reader counts its group's delegates)."""
        held = self._waiting.setdefault(call.batch, _Held(now))
        held.batch.append((call, reply))
        held.sources.add(call.rank if source is None else source)

    def due_at(self) -> Optional[float]:
        """When the oldest batch is due at the latest (None: none waits)."""
        return min((held.since + self.window_s for held in self._waiting.values()), default=None)

    def due(self, *, members: int, now: float) -> list[Batch]:
        """The batches to make now, taken out: those every one of ``members`` sources (the node's
        ranks) asked in, and those held :attr:`window_s`."""
        ready = [key for key, held in self._waiting.items()
                 if len(held.sources) >= members or now - held.since >= self.window_s]
        return [self._waiting.pop(key).batch for key in ready]

    def refuse_all(self) -> None:
        """Answer every call held as refused (this monitor no longer speaks for the node)."""
        waiting, self._waiting = self._waiting, {}
        for held in waiting.values():
            for call, reply in held.batch:
                reply(NodeAnswer.to(call, AnswerKind.REFUSED))

    def make_due(self, relay: Optional[NodeRelay], link: StoreLink, *, now: float,
                 upstream: Optional[Callable[[Batch], bool]] = None) -> None:
        """Make the batches due, each as one, on ``link`` (this monitor is its node's delegate on
        ``relay``), and answer every call of them; none is made by a monitor that is not (refused).
        ``upstream`` takes a batch due to make it with other nodes' (its group's reader), and says
        whether it did; those it does not take are made here."""
        if relay is None or relay.role is not Role.DELEGATE:
            self.refuse_all()
            return
        for batch in self.due(members=len(relay.followers) + 1, now=now):
            if upstream is None or not upstream(batch):
                make_batch(batch, link)

    # ------------------------------------------------------------------ a follower's
    def from_follower(self, text: str, relay: NodeRelay, fd: int, *, now: float) -> None:
        """A follower at ``fd`` of this delegate's ``relay`` handed on its rank's call (``text``, encoded)."""
        self.ask(decode(NodeCall, text), lambda answer: relay.answer(fd, encode(answer)), relay, now=now)

    def ask(self, call: NodeCall, reply: Reply, relay: Optional[NodeRelay], *, now: float) -> None:
        """A rank of the node asks for ``call``: held for its batch (``relay``'s delegate), handed on
        (a follower), or refused (alone, or its delegate's socket full)."""
        if relay is not None and relay.role is Role.DELEGATE:
            self.take(call, reply, now=now)
        elif relay is not None and relay.role is Role.FOLLOWER and relay.tell("call " + encode(call)):
            self.handed_on(call, reply)
        else:
            reply(NodeAnswer.to(call, AnswerKind.REFUSED))

    def handed_on(self, call: NodeCall, reply: Reply) -> None:
        """``call`` went to the delegate; its answer goes to ``reply``."""
        self._handed_on[(call.rank, call.ident)] = reply

    def answered(self, answer: NodeAnswer) -> None:
        """The delegate's answer to a call handed on (one not known, or answered already, is dropped)."""
        reply = self._handed_on.pop((answer.rank, answer.ident), None)
        if reply is not None:
            reply(answer)

    def answers_taken(self, heard: Optional[list[Relayed]]) -> Optional[list[Relayed]]:
        """What a follower heard from its delegate (None: it went), less the answers to calls handed on,
        each passed to its rank."""
        for item in heard or ():
            if item.answer is not None:
                self.answered(decode(NodeAnswer, item.answer))
        return None if heard is None else [item for item in heard if item.answer is None]

    def lose_handed_on(self) -> None:
        """The delegate went: every call handed on and not answered is unknown."""
        handed, self._handed_on = self._handed_on, {}
        for (rank, ident), reply in handed.items():
            reply(NodeAnswer(ident, rank, AnswerKind.UNKNOWN))



class NodeSpeaker(Protocol):
    """What carries a rank's calls to its node: the rank's heartbeat (its monitor process)."""

    @property
    def running(self) -> bool:
        """Whether it can carry a call now."""

    def call(self, call: NodeCall, timeout_s: float) -> NodeAnswer:
        """``call``'s answer (:attr:`AnswerKind.UNKNOWN` where none came within ``timeout_s``)."""


class NodeChannel:
    """This rank's reads and arrivals, made through its node by ``heartbeat`` (the rank's
    :class:`~hypergrid.liveness.heartbeat.Heartbeat`), or by the rank on ``store`` itself (None, or
    a call its node refused).

    Example, with no heartbeat (every call the rank's own)::

        >>> import time
        >>> import torch.distributed as dist
        >>> from hypergrid.store.client import StoreClient
        >>> store = StoreClient(time.monotonic() + 5, base=dist.HashStore())
        >>> node = NodeChannel()
        >>> node.arrive(store, Meeting("m"), 2, "rank 0"), node.read(store, "m/lines"), node.read(store, "x")
        (Place(number=1, completes=False), b'rank 0\\n', None)
    """

    def __init__(self, heartbeat: Optional[NodeSpeaker] = None) -> None:
        self.heartbeat = heartbeat

    def _ask(self, store: Any, call: NodeCall) -> NodeAnswer:
        if self.heartbeat is None or not self.heartbeat.running:
            return NodeAnswer.to(call, AnswerKind.REFUSED)
        return self.heartbeat.call(call, max(0.0, min(CALL_TIMEOUT_S, store.remaining())))

    def read(self, store: Any, key: str) -> Optional[bytes]:
        """``key``'s value (None: not set), read once for the node's ranks that read it together."""
        answer = self._ask(store, NodeCall.read(-1, key))
        if answer.kind is AnswerKind.DONE:
            return None if answer.value is None else answer.value.encode()
        return cast(Optional[bytes], store.get_if_set(key))

    def arrive(self, store: Any, at: Meeting, size: int, line: Optional[str] = None, *, awaited: bool = False,
               again: bool = True) -> meeting.Place:
        """:func:`~hypergrid.store.meeting.arrive`, counted with the node's ranks that arrive together.
        ``again``: whether an arrival whose fate is unknown (its delegate went) is made again, at the
        risk of a double count; if not, it counts as made (place 0)."""
        answer = self._ask(store, NodeCall.arrival(-1, at, size, line, awaited=awaited))
        if answer.kind is AnswerKind.DONE:
            return answer.place
        if answer.kind is AnswerKind.UNKNOWN and not again:
            return meeting.Place(0, False)
        return meeting.arrive(store, at, size, line, awaited=awaited)
