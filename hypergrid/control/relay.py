"""One wait on the job's board per node: a node's monitors elect one that waits and relays.

Every entry of a job's board (an event, or the losses one watcher found at one look) must reach
every rank's monitor. Were each monitor to wait on the board itself, each entry would cost the
store a wake and two requests per rank: at 16,384 ranks eight entries are some 260,000 requests,
seconds of one store's time. Instead the monitors of one node (the same node index,
``rank // node_size``, on the same host) elect one of them, the *leader*, which keeps the node's
one wait on the board and hands each entry it reads to the others over a local socket: the
store's work per entry is the same for a node of 8 as for a rank. (The leader also watches for
its node, :mod:`hypergrid.control.monitor`; what it saw goes to its followers with its position.)

The election is a name (:func:`~hypergrid.runtime.node_read.elect`): the first monitor to bind the node's abstract Unix socket (Linux's
abstract namespace, one per host: nothing on disk to clean up, released when its holder ends)
leads; the others connect to it (a process of another user is neither followed nor accepted: the
name has no permissions). A follower whose leader goes (its rank ended, it left the job) reads
end-of-file, and elects again: one of the remaining monitors binds the name, the others connect
to it. Every relayed entry carries its board index, and a new follower is told the leader's
position first: a follower that missed entries (it joined after the leader read them, or between
two leaders) reads those from the store itself, so no entry is lost or seen twice. The leader
tells its position every interval too; a follower that heard nothing from it for the staleness
bound (a leader alive but stuck) stops counting on it and waits on the board itself, as it does
where abstract sockets do not exist (not Linux). A follower too far behind to take what the
leader sends (its socket full) is dropped, elects again, and catches up the same way.

Example, two monitors of one node in this process::

    >>> import uuid
    >>> address = node_address(f"doc-{uuid.uuid4()}", 0)
    >>> first, second = NodeRelay.join(address), NodeRelay.join(address)
    >>> first.leads, second.leads
    (True, False)
    >>> first.accept(position=3)                                   # the leader will read entry 3 next
    >>> first.send(3, '{"kind": "lost"}'); first.keep_alive(4, "what it watches")
    >>> second.receive()                                           # doctest: +NORMALIZE_WHITESPACE
    [Relayed(index=3, payload=None, state=''), Relayed(index=3, payload='{"kind": "lost"}', state=''),
     Relayed(index=4, payload=None, state='what it watches')]
    >>> first.close(); second.receive() is None                   # the leader left: elect again
    True
    >>> second.close(); third = NodeRelay.join(address); third.leads
    True
    >>> third.close()
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from typing import Optional

from ..runtime.node_read import elect, take_follower

__all__ = ["NodeRelay", "Relayed", "node_address"]

def node_address(board: str, node: int) -> bytes:
    """The abstract socket name of ``board``'s relay on node ``node`` (a digest: names are short).

    Example::

        >>> node_address("ns/job/ab/0", 3) == node_address("ns/job/ab/0", 3) != node_address("ns/job/ab/0", 4)
        True
    """
    digest = hashlib.sha256(f"{board}#{node}".encode()).hexdigest()[:40]
    return b"\0hypergrid-board-" + digest.encode()


@dataclass(frozen=True)
class Relayed:
    """What a follower hears: an entry of the board at ``index`` (``payload`` its encoding), or,
    with no payload, the leader's position: the index of the next entry the leader will read, and
    the leader's own ``state`` (one line, opaque to the relay; empty where it sent none)."""

    index: int
    payload: Optional[str]
    state: str = ""


class NodeRelay:
    """One monitor's end of its node's relay: the leader's listening socket and its followers'
    connections, or a follower's connection to the leader (see the module)."""

    def __init__(self, listener: Optional[socket.socket], upstream: Optional[socket.socket]) -> None:
        self.listener = listener
        self.upstream = upstream
        self.followers: dict[int, socket.socket] = {}
        self._inbox = b""

    @classmethod
    def join(cls, address: bytes) -> NodeRelay:
        """Lead the node's relay at ``address`` if nobody does, else follow whoever does.

        Returns a relay that leads with no listener where this system has no abstract sockets (the
        monitor then waits on the board itself, as a leader).
        """
        listener, upstream = elect(address)
        return cls(listener, upstream)

    @property
    def leads(self) -> bool:
        return self.upstream is None

    def readers(self) -> list[int]:
        """The descriptors to watch for reading: the listener and the followers (to see them go),
        or the connection to the leader."""
        if self.upstream is not None:
            return [self.upstream.fileno()]
        return ([self.listener.fileno()] if self.listener is not None else []) + list(self.followers)

    # ------------------------------------------------------------------ the leader's side
    def accept(self, position: int) -> None:
        """Take a new follower (the listener is readable) and tell it ``position``."""
        if self.listener is None:
            return
        try:
            conn = take_follower(self.listener)
        except BlockingIOError:
            return
        if conn is None:
            return
        self.followers[conn.fileno()] = conn
        self._send_to(conn, f"at {position}\n".encode())

    def send(self, index: int, payload: str) -> None:
        """Hand entry ``index`` to every follower."""
        line = f"ev {index} {payload}\n".encode()
        for conn in list(self.followers.values()):
            self._send_to(conn, line)

    def keep_alive(self, position: int, state: str = "") -> None:
        """Tell every follower the leader's position and ``state`` (one line; every interval: a
        follower that hears nothing for the staleness bound stops counting on this leader)."""
        if "\n" in state:
            raise ValueError(f"a relayed state is one line, got {state!r}")
        line = (f"at {position} {state}\n" if state else f"at {position}\n").encode()
        for conn in list(self.followers.values()):
            self._send_to(conn, line)

    def follower_ready(self, fd: int) -> None:
        """A follower's connection is readable: followers send nothing, so it went."""
        conn = self.followers.get(fd)
        if conn is None:
            return
        try:
            data = conn.recv(1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)

    def _send_to(self, conn: socket.socket, line: bytes) -> None:
        try:
            conn.sendall(line)
        except OSError:  # gone, or so far behind that its socket is full: it elects again and catches up
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self.followers.pop(conn.fileno(), None)
        conn.close()

    # ------------------------------------------------------------------ a follower's side
    def receive(self) -> Optional[list[Relayed]]:
        """What the leader sent (the connection is readable); None when the leader is gone."""
        if self.upstream is None:
            return []
        try:
            chunk = self.upstream.recv(65536)
        except BlockingIOError:
            return []
        except OSError:
            chunk = b""
        if not chunk:
            return None
        lines, _, self._inbox = (self._inbox + chunk).rpartition(b"\n")
        heard = []
        for line in lines.decode().split("\n") if lines else []:
            word, _, rest = line.partition(" ")
            if word == "at":
                position, _, state = rest.partition(" ")
                heard.append(Relayed(int(position), None, state))
            elif word == "ev":
                index, _, payload = rest.partition(" ")
                heard.append(Relayed(int(index), payload))
        return heard

    def close(self) -> None:
        for conn in list(self.followers.values()):
            conn.close()
        self.followers.clear()
        for sock in (self.listener, self.upstream):
            if sock is not None:
                sock.close()
        self.listener = self.upstream = None
