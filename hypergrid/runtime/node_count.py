"""One batched write per node: the ranks of a node that each add themselves to a count of the
store (and append a line to a ledger first) hand their share to one of them, which writes the
node's in one ``append`` and one ``add``.

A recovery round's participants each arrive (their arrival appended, then counted) and each count
themselves at the end of the rebuild's step: three requests per participant, about 49,000 at
16,384 participants, more than the rest of the round together. Written once per node of 8, the
same writes cost the store five requests per node, and every participant still learns its
*place* (the count just after its own addition, as if its node's ranks had been added one by one),
by which it does what the first arrivals or the last one counted do.

The ranks elect a *writer* by a name, as for a node's read (:mod:`~hypergrid.runtime.node_read`):
the first to bind the counter's abstract Unix socket for its node. The others connect and send it
their line. The writer gathers them until every participant of its node has come
(:meth:`~hypergrid.runtime.node_read.Node.peers_in`) or :data:`GATHER_S` has passed, lets the
name go (a rank that comes later elects again: a batch of its own), and *includes* each rank it
read by telling it so. Then it appends the lines, adds their number and tells each rank its place
(two requests per node; a writer that included nobody writes as a rank alone).

A rank not told it is included (its writer ended, or closed its name before reading it) elects
again; one whose writer froze before including it writes alone: it shuts its socket for reading
first, after which Linux refuses the writer's word, so "included" was either read or never said.
A rank that was included and whose writer then ends or stays silent for :data:`QUIET_S` writes
alone too, and is counted twice if the writer resumes: harmless for a round's arrivals, which are
read by rank. A count that must never run ahead of its participants (a step's end, where the one
that brings it to their number ends the step for all: :attr:`Tally.exactly_once`) is *claimed*
before it is written, by a compare-and-set of a key named by the node and the writer's rank, and
the claim is deleted once the batch's ranks have hung up (three requests per node): an included
rank whose writer falls silent *voids* the claim the same way and writes alone only if its void
stands; if the claim stands, the writer counted it or will, and it goes on without its place
(``place`` None: the last one counted is the writer of its batch, :meth:`Counted.closes`). A
writer whose claim finds its batch voided writes alone (the void stays in the store, as does the
claim of a writer whose ranks did not hang up within a quarter of a second).

Example, two ranks of one node in this process (threads), each with its arrival::

    >>> import threading, time, uuid
    >>> import torch.distributed as dist
    >>> from hypergrid.runtime.store import StoreClient
    >>> base = dist.HashStore(); name = f"doc/{uuid.uuid4()}"
    >>> tally, node = Tally(f"{name}/count", f"{name}/here"), Node(0, 8)
    >>> places = {}
    >>> def arrive(rank):
    ...     store = StoreClient(time.monotonic() + 10, base=base)
    ...     places[rank] = count_in(store, tally, rank, f"rank {rank}\\n", node=node, peers=2).place
    >>> threads = [threading.Thread(target=arrive, args=(r,)) for r in (0, 1)]
    >>> for t in threads: t.start()
    >>> for t in threads: t.join()
    >>> sorted(places.values()), base.add(tally.counter, 0), sorted(base.get(tally.ledger).decode().split("\\n"))
    ([1, 2], 2, ['', 'rank 0', 'rank 1'])
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional

from . import node_read
from .node_read import Node, elect, frame, node_address, split_frame, take_follower
from .poll import readable

__all__ = ["Tally", "Counted", "count_in", "GATHER_S"]

logger = logging.getLogger(__name__)

#: How long a node's writer waits for the node's other participants before it writes those it has
#: (a late one writes in a batch of its own). A node's ranks learn of a failure from one event and
#: arrive within milliseconds of each other; one that comes later costs its node one batch more.
GATHER_S = 0.25
#: How often a rank that found the name held but could not be included tries again before it
#: writes alone (a name let go and taken in turn by ranks that each came just too late).
_ELECTIONS = 3
#: How long a writer waits, after it told its ranks their places, for them to hang up before it
#: deletes its claim (local sockets: microseconds where the ranks run; a step's closer ends the
#: step only after, so one rank frozen just then costs every participant this much, once).
_SETTLE_S = 0.25
_CLAIMED, _VOID = "counted", "void"
#: Frames: a rank's share (to its writer); included (the batch's claim key); its place; write alone.
_SHARE, _INCLUDED, _PLACE, _ALONE = b"c", b"i", b"p", b"a"


@dataclass(frozen=True)
class Tally:
    """A count every participant adds itself to: the ``counter`` key and, where each adds a line
    first, the ``ledger`` key the lines are appended to (the count never runs ahead of it).

    ``exactly_once``: the count must never run ahead of its participants (a step's end: the one
    that brings it to their number ends the step for all), so a batch is claimed before it is
    written and a rank whose writer fell silent voids the claim before it writes alone. False
    (a round's arrivals, whose readers take each line once, by its rank, and use the count only as
    a hint to read them): no claim; a rank whose writer fell silent after including it writes
    alone, and may be counted twice if that writer resumes."""

    counter: str
    ledger: Optional[str] = None
    exactly_once: bool = True


@dataclass(frozen=True)
class Counted:
    """Where a rank's addition landed: ``place``, the count just after it (None: its writer
    counted it and then froze or ended before saying where), ``batch_end``, the count just after
    its batch (None likewise), and whether this rank ``wrote`` its batch (alone, or for its node)."""

    place: Optional[int]
    batch_end: Optional[int]
    wrote: bool

    def closes(self, total: int) -> bool:
        """Whether this rank wrote the batch that brought the count to ``total``: exactly one
        participant's addition does (where the count is not voided for lack of a writer)."""
        return self.wrote and self.batch_end == total


def count_in(store: Any, tally: Tally, rank: int, line: str = "", *, node: Optional[Node] = None,
             peers: int = 1) -> Counted:
    """Add ``rank`` to ``tally`` (``line`` appended to its ledger first, where it has one) over
    ``store`` (a :class:`~hypergrid.runtime.store.StoreClient`), in one batch with the other
    ``peers`` participants of its ``node`` (itself included) that come meanwhile; alone where
    ``node`` is None or it has no peers. See the module (its example)."""
    if node is not None and peers > 1:
        address = node_address("count", tally.counter, node.index)
        for _ in range(_ELECTIONS):
            listener, upstream = elect(address, backlog=max(64, 2 * peers))
            if listener is not None:
                return _write_for_node(store, tally, rank, line, listener, f"{tally.counter}/node/{node.index}/{rank}",
                                       peers)
            if upstream is None:
                break
            counted = _hand_over(store, tally, rank, line, upstream)
            if counted is not None:
                return counted
    return _write(store, tally, [line])


def _write(store: Any, tally: Tally, lines: list[str]) -> Counted:
    """Append ``lines`` and count them: the first line's place, the count after the last."""
    if tally.ledger is not None:
        store.append(tally.ledger, "".join(lines))
    end = int(store.add(tally.counter, len(lines)))
    return Counted(end - len(lines) + 1, end, True)


# ---------------------------------------------------------------------- the writer's side
@dataclass
class _Pending:
    conn: socket.socket
    inbox: bytes = b""


def _write_for_node(store: Any, tally: Tally, rank: int, line: str, listener: socket.socket, claim: str,
                    peers: int) -> Counted:
    """The writer: gather the node's shares, then write them with its own in one batch."""
    included = _gather(listener, claim, peers, min(GATHER_S, max(0.0, store.remaining())))
    try:
        if not included:  # nobody was told it is included, so nobody can void: no claim
            return _write(store, tally, [line])
        if not tally.exactly_once:
            return _write_and_place(store, tally, line, included)
        if store.compare_set(claim, "", _CLAIMED) != _CLAIMED.encode():  # a rank gave up on this writer
            for conn, _ in included:
                _tell(conn, _ALONE, "")
            return _write(store, tally, [line])
        counted = _write_and_place(store, tally, line, included)
        # Once every rank of the batch has hung up (it read its place, or ended its void), none
        # will look at the claim again: it goes, so that the store does not keep a key per node
        # per count. One that does not hang up in time (frozen) leaves it there.
        if _hung_up([conn for conn, _ in included], min(_SETTLE_S, max(0.0, store.remaining()))):
            try:
                store.delete_key(claim)
            except (RuntimeError, OSError) as exc:  # the count stands: its closer must still end the step
                logger.warning("hypergrid: the claim %s stays in the store: %s", claim, exc)
        return counted
    finally:
        for conn, _ in included:
            conn.close()


def _gather(listener: socket.socket, claim: str, peers: int, seconds: float) -> list[tuple[socket.socket, str]]:
    """The ranks that hand their share to this writer within ``seconds`` (until ``peers`` with
    it), with their connections and lines, each told it is included (with the ``claim``'s key)
    once the gathering is over, so that its wait for its place covers only the writer's store
    calls; the name is let go then, and a rank whose share was not read is hung up on (it elects
    again), as is one that can no longer be told (it gave up, and writes alone)."""
    gathered: list[tuple[socket.socket, str]] = []
    pending: dict[int, _Pending] = {}
    end = time.monotonic() + seconds
    try:
        while 1 + len(gathered) < peers:
            left = end - time.monotonic()
            if left <= 0:
                break
            ready = readable([listener.fileno(), *pending], left)
            if listener.fileno() in ready:
                _take_all(listener, pending)
            for fd in ready & pending.keys():
                share = _receive(pending[fd])
                if share is _NOTHING_YET:
                    continue
                conn = pending.pop(fd).conn
                if isinstance(share, str):
                    gathered.append((conn, share))
                else:
                    conn.close()
    finally:
        listener.close()
        for waiting in pending.values():
            waiting.conn.close()
    included = []
    for conn, share in gathered:
        if _tell(conn, _INCLUDED, claim):
            included.append((conn, share))
        else:
            conn.close()
    return included


def _write_and_place(store: Any, tally: Tally, line: str, included: list[tuple[socket.socket, str]]) -> Counted:
    """Write this writer's line and its ranks' in one batch, and tell each rank its place."""
    counted = _write(store, tally, [line] + [share for _, share in included])
    assert counted.place is not None
    for offset, (conn, _) in enumerate(included, start=1):
        _tell(conn, _PLACE, f"{counted.place + offset},{counted.batch_end}")
    return counted


def _hung_up(conns: list[socket.socket], seconds: float) -> bool:
    """Whether every one of ``conns`` reads end-of-file (or is broken) within ``seconds``."""
    open_fds = {conn.fileno(): conn for conn in conns}
    end = time.monotonic() + seconds
    while open_fds:
        left = end - time.monotonic()
        ready = readable(open_fds, max(0.0, left)) if left > 0 else set()
        if not ready:
            return False
        for fd in ready:
            try:
                if open_fds[fd].recv(4096):
                    continue  # nothing more is due from it; read on to its end
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            del open_fds[fd]
    return True


def _take_all(listener: socket.socket, pending: dict[int, _Pending]) -> None:
    while True:
        try:
            conn = take_follower(listener)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # no descriptor left: those waiting elect again once the name is let go
            return
        if conn is not None:
            pending[conn.fileno()] = _Pending(conn)


def _receive(waiting: _Pending) -> object:
    """The share a rank sent (its line), :data:`_NOTHING_YET`, or None where it is gone or garbled."""
    try:
        chunk = waiting.conn.recv(65536)
    except (BlockingIOError, InterruptedError):
        return _NOTHING_YET
    except OSError:
        return None
    if not chunk:
        return None
    waiting.inbox += chunk
    whole = split_frame(waiting.inbox)
    if whole is None:
        return _NOTHING_YET
    kind, body, _ = whole
    return body.decode() if kind == _SHARE else None


def _tell(conn: socket.socket, kind: bytes, body: str) -> bool:
    try:
        conn.sendall(frame(kind, body.encode()))
    except OSError:  # gone (it closed: it was never included), or not taking frames
        return False
    return True


# ---------------------------------------------------------------------- a rank's side
def _hand_over(store: Any, tally: Tally, rank: int, line: str, upstream: socket.socket) -> Optional[Counted]:
    """Hand ``line`` to the node's writer: where it landed, or None where it was not included (elect again)."""
    claim: Optional[str] = None
    inbox = b""
    try:
        if not _tell(upstream, _SHARE, line):
            return None
        while True:
            # Included within the writer's gathering; placed within its store calls: both in due time
            # unless it froze (QUIET_S covers a slow store, as for a node's read).
            quiet = (GATHER_S if claim is None else 0.0) + node_read.QUIET_S
            frame, inbox = _next_frame(upstream, inbox, min(quiet, max(0.0, store.remaining())))
            if frame is _GONE_QUIET and claim is None:
                frame, inbox = _last_word(upstream, inbox)
            if frame is _GONE_QUIET or frame is _GONE_ENDED:
                if claim is None:
                    # Not included: a writer that ended let the name go (elect again); one that froze
                    # can include it no more (its word would fail), so it writes alone.
                    return None if frame is _GONE_ENDED else _write(store, tally, [line])
                return _void(store, tally, line, claim) if tally.exactly_once else _write(store, tally, [line])
            assert isinstance(frame, tuple)
            kind, body = frame
            if kind == _INCLUDED:
                claim = body
            elif kind == _PLACE:
                place, end = (int(part) for part in body.split(","))
                return Counted(place, end, False)
            else:  # the batch was voided: every rank of it writes alone
                return _write(store, tally, [line])
    finally:
        upstream.close()


def _last_word(conn: socket.socket, inbox: bytes) -> tuple[object, bytes]:
    """What a silent writer said before this rank stopped listening: from here on it cannot tell
    this rank anything (Linux refuses a send to a socket shut for reading, EPIPE), and what it told
    before is still queued. So "included" is either read here or was never said."""
    try:
        conn.shutdown(socket.SHUT_RD)
    except OSError:
        return _GONE_ENDED, inbox
    frame, inbox = _next_frame(conn, inbox, 0.0)
    return (_GONE_QUIET if frame is _GONE_ENDED else frame), inbox


def _void(store: Any, tally: Tally, line: str, claim: str) -> Counted:
    """This rank's writer included it and then fell silent: void its batch, or learn it was claimed."""
    if store.compare_set(claim, "", _VOID) == _VOID.encode():
        return _write(store, tally, [line])
    return Counted(None, None, False)  # claimed: the writer counted it, or will when it resumes


def _next_frame(conn: socket.socket, inbox: bytes, seconds: float) -> tuple[object, bytes]:
    end = time.monotonic() + seconds
    while True:
        whole = split_frame(inbox)
        if whole is not None:
            kind, body, rest = whole
            return (kind, body.decode()), rest
        if not readable([conn.fileno()], max(0.0, end - time.monotonic())):
            return _GONE_QUIET, inbox
        try:
            chunk = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            chunk = b""
        if not chunk:
            return _GONE_ENDED, inbox
        inbox += chunk


_NOTHING_YET, _GONE_QUIET, _GONE_ENDED = object(), object(), object()
