"""One wait on the job's board per group of nodes: a group's reader hands each entry to the others.

Each node's delegate waiting on the board costs the store, per entry, a wake and two requests for
every node: at 131,072 ranks on nodes of 8, some 49,000 messages for each entry of a recovery
round. So nodes are grouped by index, :attr:`ReaderGroups.per` to a group, in jobs of more nodes
than that; the delegate of the group's lowest node in the job (its *reader*) keeps the group's one
wait on the board and hands each entry, over TCP, to the delegates of the group's other nodes,
which hand it to their nodes' monitors as before. The reader listens on the address through which
it reaches the store, and puts that address in the store for its group
(:meth:`~hypergrid.store.keys.JobChannel.board_reader`).

The fan-out only saves the store work; it never holds an entry back for long. Every relayed entry
carries its board index and a delegate that joins is told the reader's position first, so one
that missed entries reads them from the store (:mod:`.relay`'s rule). A delegate whose reader
cannot be reached, ends (its connection closes), drops it (too far behind), or says nothing for
:data:`QUIET_TICKS` intervals (frozen) waits on the board itself again, from where it had read.
A reader greets each delegate it takes with its group's key; a delegate tells nothing to, and
takes nothing from, a reader until it is greeted, and one greeted as another group's (a reader of
another job, listening on a port this group's reader once held) is not its reader.

A group's nodes' calls (:mod:`.calls`: a recovery round's record read, arrivals, counts) go the same
way: each delegate hands its node's batch to the reader, which makes the group's as one. A call
its reader went before answering is unknown to its rank (one it said it never made, refused), as
with a node's delegate; the delegate then makes its node's calls itself.

So do its nodes' beats: every interval each delegate asks its reader, in a line, to beat for its
node and read the counters its node watches; the reader beats and reads for all that asked with its
own, in one message, and answers each with its counters, at which its watch looks. A delegate
whose reader has not answered yet (a node's first beats), cannot be told, or has left its asks
unanswered for :data:`QUIET_TICKS` intervals (frozen, or its store late) beats for its node
itself meanwhile: a reader's stall never holds a node's counter still for the staleness bound.

Example, a group's reader and one of its delegates in this process::

    >>> groups = ReaderGroups(per=4)
    >>> nodes = [0, 4, 5, 6, 9]
    >>> groups.group(5), groups.reader(5, nodes), groups.reader(9, nodes), groups.reader(5, [4, 5])
    (1, 4, 9, None)
    >>> reader = GroupLink.lead("127.0.0.1", "ns/reader/1")
    >>> follower = GroupLink.follow(reader.address, "ns/reader/1", timeout_s=1.0)
    >>> reader.accept_waiting(position=7); reader.send(7, '{"kind": "lost"}')
    >>> follower.on_ready(follower.readers()[0], position=0)       # doctest: +NORMALIZE_WHITESPACE
    [Relayed(index=7, payload=None, state='ns/reader/1', answer=None),
     Relayed(index=7, payload='{"kind": "lost"}', state='', answer=None)]
    >>> reader.close(); follower.on_ready(follower.readers()[0], 0) is None  # it ended: read the board again
    True
    >>> follower.close()

A reader that greets a delegate as another group's (another job's, where this group's reader once
listened) is not its reader: the delegate hears nothing from it, and reads the board itself::

    >>> other = GroupLink.lead("127.0.0.1", "other-job/reader/1")
    >>> stray = GroupLink.follow(other.address, "ns/reader/1", timeout_s=1.0)
    >>> other.accept_waiting(position=3); other.send(3, '{"kind": "lost"}')
    >>> stray.on_ready(stray.readers()[0], position=0) is None, stray.ask_beat(5, [6], now=0.0, within_s=2.0)
    (True, False)
    >>> other.close(); stray.close()
"""

from __future__ import annotations

import bisect
import functools
import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from .calls import AnswerKind, Batch, CallKind, NodeAnswer, NodeCall, NodeCalls, make_batch
from .config import DEFAULT_NODES_PER_READER
from .link import StoreLink
from .relay import NodeRelay, Relayed
from .served import ServedJob

__all__ = ["ReaderGroups", "GroupLink", "AskedBeat", "QUIET_TICKS", "READER_LOOKS", "follow_reader", "lead_group"]
#: How many intervals, from its job's start, a delegate looks for its group's reader (one request
#: each) while it waits on the board itself: a reader attached after it listens a moment later.
READER_LOOKS = 5
#: How many intervals a group's delegate waits for a word from its reader before reading the board itself.
QUIET_TICKS = 2


@dataclass(frozen=True)
class ReaderGroups:
    """Nodes grouped by index, ``per`` to a group; a group's reader is its lowest node in the job."""

    per: int = DEFAULT_NODES_PER_READER

    def __post_init__(self) -> None:
        if self.per < 1:
            raise ValueError(f"nodes per board reader must be a positive number, got {self.per}")

    def group(self, node: int) -> int:
        return node // self.per

    def reader(self, node: int, nodes: Sequence[int]) -> Optional[int]:
        """The reader of ``node``'s group among the job's ``nodes`` (ascending); None where every
        delegate waits on the board itself (a job of no more than :attr:`per` nodes)."""
        if len(nodes) <= self.per:
            return None
        first = self.group(node) * self.per
        at = bisect.bisect_left(nodes, first)
        return nodes[at] if at < len(nodes) and nodes[at] < first + self.per else None


@dataclass(frozen=True)
class AskedBeat:
    """A delegate's ask at its group's reader: its connection, its node, the nodes whose counters it
    reads, and whether its node is beaten at this beat (it asked since the last)."""

    fd: int
    node: int
    reads: tuple[int, ...]
    beat: bool


@dataclass
class _Ask:
    """A delegate's last ask at its reader: on which connection, for which node, what to read, and
    how many of the reader's beats came since."""

    conn: Optional[socket.socket]
    node: int
    reads: tuple[int, ...]
    beats_since: int = 0


class GroupLink:
    """A delegate's end of its group's fan-out: the reader's listener and the delegates it hands
    entries to, or a delegate's connection to its reader (a :class:`~.relay.NodeRelay` over TCP)."""

    def __init__(self, relay: NodeRelay, address: str = "", group_key: str = "") -> None:
        self.relay = relay
        #: Where a reader listens, as it puts it in the store (empty for a delegate that follows one).
        self.address = address
        #: Which job's group this link is for (the key its reader's address is under): a reader greets
        #: each delegate it takes with it, and a delegate trusts nothing from one that greets it with
        #: another (a reader of another job, listening where this group's reader once did).
        self.group_key = group_key
        #: A following delegate's: whether its reader has greeted it as its group's (until then it tells
        #: it nothing, and reads the board, beats and makes its calls itself).
        self.greeted = False
        #: A following delegate's intervals since its reader last said anything.
        self.quiet = 0
        #: A reader's: its group's nodes' calls held for one batch; a following delegate's: its
        #: node's calls handed on to the reader, by number.
        self.calls = NodeCalls()
        #: A reader's: what its delegates asked, by descriptor.
        self.beats: dict[int, _Ask] = {}
        #: A following delegate's: the counters its reader read with its node's last beat, not yet looked at.
        self.beaten: Optional[dict[int, int]] = None
        #: A following delegate's: since when it has asked for a beat with no answer from its reader.
        self.unanswered_since: Optional[float] = None
        #: A following delegate's: whether its reader has answered a beat yet (until then it beats itself too).
        self.answered = False

    @classmethod
    def lead(cls, host: str, group_key: str) -> GroupLink:
        """Listen, as the reader of the group whose address is put under ``group_key``, on ``host`` (the
        interface its store connection uses)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(256)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        return cls(NodeRelay(listener, None, same_user_only=False, greeting=group_key),
                   json.dumps([host, listener.getsockname()[1]]), group_key)

    @classmethod
    def follow(cls, address: str, group_key: str, timeout_s: float) -> GroupLink:
        """Connect to the reader of the group whose address is under ``group_key``, at ``address`` (as
        :meth:`lead` put it); raises OSError where it cannot."""
        try:
            host, port = json.loads(address)
        except (ValueError, TypeError) as exc:
            raise OSError(f"a board reader's address is [host, port], got {address!r}") from exc
        conn = socket.create_connection((str(host), int(port)), timeout=timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setblocking(False)
        return cls(NodeRelay(None, conn, same_user_only=False), group_key=group_key)

    @property
    def leads(self) -> bool:
        return self.relay.listener is not None

    def readers(self) -> list[int]:
        return self.relay.readers()

    def accept_waiting(self, position: int) -> None:
        """A reader takes the delegates waiting to join, telling each its ``position``."""
        with self.relay.lock:
            while self.relay.accept(position=position):
                pass

    def on_ready(self, fd: int, position: int, *, now: float = 0.0) -> Optional[list[Relayed]]:
        """One of :meth:`readers` is readable: a reader takes a delegate that joins, or the batch one
        hands on (held for the group's batch from ``now``), or notes one that went, and returns []; a
        follower gets what its reader sent (the answers to its calls passed on), None where the
        reader is gone (the calls it did not answer are unknown)."""
        if not self.leads:
            heard = self.relay.receive()
            # The first line a reader sends names its group: another's (a port reused by a reader of
            # another job) is not this group's reader, whose entries and counters are not ours.
            if heard and not self.greeted:
                first = heard[0]
                self.greeted = first.payload is None and first.answer is None and first.state == self.group_key
            if heard is None or (heard and not self.greeted):
                self.calls.lose_handed_on()
                return None
            self.quiet = 0
            for item in heard:
                word, _, counters = (item.answer or "").partition(" ")
                if word == _BEATEN:
                    self.beaten, self.unanswered_since, self.answered = _counters_of(counters), None, True
                    continue
                for answer in _answers_of(item.answer or "[]"):
                    self.calls.answered(answer)
            return [item for item in heard if item.answer is None]
        listener = self.relay.listener
        if listener is not None and fd == listener.fileno():
            self.accept_waiting(position)
            return []
        for line in self.relay.follower_ready(fd):
            word, _, rest = line.partition(" ")
            if word == "calls":
                calls = _calls_of(rest)
                reply = _Answers(functools.partial(self.relay.answer, fd), len(calls))
                for call in calls:
                    self.calls.take(call, reply, now=now, source=fd)
            elif word == "beat":
                node, *reads = map(int, rest.split())
                self.beats[fd] = _Ask(self.relay.followers.get(fd), node, tuple(reads))
        return []

    def ask_beat(self, node: int, reads: Sequence[int], *, now: float, within_s: float) -> bool:
        """A following delegate asks its reader to beat for ``node`` and read the counters of ``reads``
        with the group's next beat (the answer comes to :meth:`on_ready`, as :attr:`beaten`). Whether
        it may count on that: False where the reader could not be told, has not answered one yet (a
        node's first beats are its own: it may end before the group's next), or has left its asks
        unanswered for ``within_s`` (frozen, or its store late): the delegate beats itself meanwhile."""
        if self.leads or not self.greeted or not self.relay.tell("beat " + " ".join(map(str, (node, *reads)))):
            return False
        if self.unanswered_since is None:
            self.unanswered_since = now
        return self.answered and now - self.unanswered_since < within_s

    def take_beats(self) -> list[AskedBeat]:
        """A reader's, at its beat: what its delegates still connected asked, to make with its own. A
        node is beaten only where its delegate asked since the reader's last beat (it was alive since);
        its counters are read and answered at each beat for :data:`QUIET_TICKS` after its last ask, so
        its watch looks once an interval however its ticks fall against the reader's."""
        asked = []
        for fd, ask in list(self.beats.items()):
            # The same connection, not just the same descriptor: one that went may leave its number
            # to a delegate of another node, which has not asked for its node yet.
            if self.relay.followers.get(fd) is not ask.conn or ask.beats_since > QUIET_TICKS:
                del self.beats[fd]
                continue
            asked.append(AskedBeat(fd, ask.node, ask.reads, beat=ask.beats_since == 0))
            ask.beats_since += 1
        return asked

    def answer_beat(self, fd: int, counters: dict[int, int]) -> None:
        """A reader tells the delegate at ``fd`` its beat was made, and the counters it asked to read."""
        self.relay.answer(fd, " ".join([_BEATEN, *(f"{node}:{value}" for node, value in counters.items())]))

    def take_beaten(self) -> Optional[dict[int, int]]:
        """A following delegate's: the counters its reader last answered with, once (None: none since)."""
        beaten, self.beaten = self.beaten, None
        return beaten

    def take_calls(self, batch: Batch, *, now: float) -> bool:
        """A node's batch of calls, due at its delegate: the reader holds it for its group's batch, a
        following delegate hands it to its reader in one message; False where it cannot be (the
        reader's socket full): the delegate makes it itself."""
        if self.leads:
            for call, reply in batch:
                self.calls.take(call, reply, now=now, source=-1)
            return True
        if not self.greeted or not self.relay.tell("calls " + _calls_line([call for call, _ in batch])):
            return False
        for call, reply in batch:
            self.calls.handed_on(call, reply)
        return True

    def make_due(self, link: StoreLink, *, now: float) -> None:
        """A reader makes its group's batches due (every connected delegate and its own node asked, or
        held :data:`~.calls.BATCH_WINDOW_S`), each as one request for all, on ``link``."""
        if self.leads:
            for batch in self.calls.due(members=len(self.relay.followers) + 1, now=now):
                make_batch(batch, link)

    def send(self, index: int, payload: str) -> None:
        """A reader hands entry ``index`` to its group's delegates."""
        if self.leads:
            self.relay.send(index, payload)

    def keep_alive(self, position: int) -> None:
        """A reader tells its group's delegates its position (every interval: they know it is alive)."""
        if self.leads:
            self.accept_waiting(position)
            self.relay.keep_alive(position)

    def tick(self) -> bool:
        """A following delegate's interval: whether its reader has been quiet too long (read the board itself)."""
        if self.leads:
            return False
        self.quiet += 1
        return self.quiet > QUIET_TICKS

    def close(self) -> None:
        """Stop: a reader's calls held are refused (never made: each rank makes its own), a following
        delegate's handed on and not answered are unknown (its reader may have made them)."""
        self.calls.refuse_all()
        self.calls.lose_handed_on()
        self.relay.close()


# A node's batch crosses the group's link as one line each way (its calls alike but for their rank,
# number and line; the answers in a list), not a record per call: a reader takes 16 nodes' at once.
def _calls_line(calls: Sequence[NodeCall]) -> str:
    kind, key, size, awaited = calls[0].batch
    return json.dumps([kind.value, key, size, awaited, [[call.rank, call.ident, call.line] for call in calls]])


def _calls_of(text: str) -> list[NodeCall]:
    kind, key, size, awaited, calls = json.loads(text)
    return [NodeCall(ident, rank, CallKind(kind), key, size, line, awaited) for rank, ident, line in calls]


#: How a reader's answer to a beat begins (the counters follow as ``node:value``; a batch's answers are a list).
_BEATEN = "beaten"


def _counters_of(text: str) -> dict[int, int]:
    return {int(node): int(value) for node, _, value in (pair.partition(":") for pair in text.split())}


def _answers_of(text: str) -> list[NodeAnswer]:
    return [NodeAnswer(ident, rank, AnswerKind(kind), value, number, completes)
            for ident, rank, kind, value, number, completes in json.loads(text)]


class _Answers:
    """Where a reader answers one delegate's batch: once all its calls are answered, in one line."""

    def __init__(self, send: Callable[[str], None], count: int) -> None:
        self.send, self.count = send, count
        self.answers: list[NodeAnswer] = []

    def __call__(self, answer: NodeAnswer) -> None:
        self.answers.append(answer)
        if len(self.answers) == self.count:
            self.send(json.dumps([[a.ident, a.rank, a.kind.value, a.value, a.number, a.completes]
                                  for a in self.answers]))


def _reader_key(job: ServedJob, node: int) -> str:
    return job.spec.channel.board_reader(ReaderGroups(job.spec.nodes_per_reader).group(node))


def follow_reader(link: StoreLink, job: ServedJob, node: int, shunned: set[str]) -> Optional[GroupLink]:
    """The connection to the reader of ``node``'s group, for its delegate (one request: where it
    listens); None where the node reads for itself: its group's reader, none listening yet, or one
    in ``shunned`` (it failed this delegate before: those it cannot reach are added)."""
    reader = ReaderGroups(job.spec.nodes_per_reader).reader(node, job.nodes.ranks)
    if reader is None or reader == node:
        return None
    key = _reader_key(job, node)
    # A compare_set expecting what no address is: the address, or that value back where none is set.
    held = link.call(lambda store: store.compare_set(key, b"-", b"-"))
    address = held.decode() if held not in (None, b"-") else ""
    if not address or address in shunned:
        return None
    try:
        group = GroupLink.follow(address, key, timeout_s=1.0)
    except OSError:
        shunned.add(address)
        return None
    group.address = address
    return group


def lead_group(link: StoreLink, job: ServedJob, node: int, host: str) -> Optional[GroupLink]:
    """For the delegate of its group's reader node: a listener on ``host`` for the group's other
    delegates, its address put in the store; None for any other node, or where it cannot listen."""
    if ReaderGroups(job.spec.nodes_per_reader).reader(node, job.nodes.ranks) != node:
        return None
    try:
        group = GroupLink.lead(host, _reader_key(job, node))
    except OSError:
        return None  # the others find nobody there, and each waits on the board itself
    try:
        link.call(lambda store: store.set(_reader_key(job, node), group.address.encode()))
    except BaseException:
        group.close()
        raise
    return group
