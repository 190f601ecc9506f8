"""One blocking read of the store per node: the ranks of a node that wait for the same key elect
one of them to wait on the store, and it hands them the value over a local socket.

A recovery round ends with every participant reading one key (the round's verdict, the outcome of
its rebuild's step). Each such read is a blocking ``get``: two requests on the wire (torch's client
waits, then gets), so at 16,384 participants one key costs the store some 33,000 requests, about
0.7 s of its one thread. Read once per node of 8 instead, it costs an eighth of that, and the
participants hear it as soon as their node's reader does.

The election is a name (as for the board's relay, :mod:`hypergrid.control.relay`): the first
waiter of a node to bind the key's abstract Unix socket (Linux's abstract namespace, one per host:
nothing on disk, released when its holder closes it or ends) is the node's *reader*; the others
connect to it and block on that connection. The reader waits on the store a slice at a time and
tells its followers after each slice: the value, after which it closes (a waiter that comes later
binds the name and reads the store itself: the value is there by then), or that it is still
waiting, which it also tells them every :data:`TELL_EVERY_S` while its one blocking get is out
(so a long wait costs the store one get per node, not one per slice). A follower that reads end-of-file (its reader's process ended, or it stopped reading for
the node) elects again; one that hears nothing for :data:`QUIET_S` past its reader's due word (a
reader alive but stuck, a process holding the GIL) reads the store itself from then on. Where there are no abstract
sockets (not Linux) or the name's holder is another user's process, every waiter reads the store
itself. So a follower never waits longer than it would have on the store, and no value is lost.

No torch here: the board's relay, in the monitor's process, elects the same way (:func:`elect`).

Example, two waiters of one node in this process, the value set while they wait::

    >>> import threading, time, uuid
    >>> import torch.distributed as dist
    >>> from hypergrid.runtime.store import StoreClient
    >>> base = dist.HashStore(); store = StoreClient(time.monotonic() + 10, base=base)
    >>> key = f"doc/{uuid.uuid4()}/verdict"
    >>> reader, follower = NodeRead.of(key, node=0), NodeRead.of(key, node=0)
    >>> reader.reads, follower.reads
    (True, False)
    >>> threading.Timer(0.2, base.set, (key, "ranks 3 and 4")).start()
    >>> reader.read(store, key, 5.0)
    Read(value=b'ranks 3 and 4', covered=False)
    >>> follower.read(store, key, 5.0)
    Read(value=b'ranks 3 and 4', covered=True)
    >>> reader.close(); follower.close()
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import struct
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from .poll import readable

__all__ = ["Node", "NodeRead", "Read", "elect", "node_address", "frame", "split_frame", "same_user", "take_follower", "QUIET_S", "TELL_EVERY_S"]

#: How long a waiter keeps trying to bind or follow a name whose holder refuses it (it closes
#: the name, or has bound it and not listened yet) before it reads the store on its own.
_ELECT_S = 0.5
#: How long a connection to a name's holder may take (one that hangs is not a reader to follow).
_CONNECT_TIMEOUT_S = 1.0
#: How often a reader tells its followers that it still waits, while its one blocking get on the
#: store is out (words on a local socket: nothing for the store), and at the end of each slice.
TELL_EVERY_S = 2.0
#: How long past its reader's due word a follower waits for it before it reads the store itself:
#: longer than a store call may take to answer and still count as answering (the store client's
#: slack, 5 s), so that a reader on a slow store is not left for one that is stuck.
QUIET_S = 8.0
_VALUE, _STILL = b"v", b"s"
_HEADER = struct.Struct("!cI")


@dataclass(frozen=True)
class Node:
    """A rank's node for the waits and counts its ranks share: node ``index`` holds the ranks
    ``index * size`` to ``(index + 1) * size - 1`` (``size``: ranks per node).

    Example::

        >>> node = Node.of(13, 8)
        >>> node, node.peers_in(range(0, 16, 2)), node.holds(8), node.holds(16)
        (Node(index=1, size=8), 4, True, False)
    """

    index: int
    size: int

    @classmethod
    def of(cls, rank: int, size: int) -> Node:
        return cls(rank // size, size)

    def peers_in(self, ranks: Sequence[int]) -> int:
        """How many of ``ranks`` (ascending) are on this node: O(log len(ranks))."""
        low, high = self.index * self.size, (self.index + 1) * self.size
        return bisect_left(ranks, high) - bisect_left(ranks, low)

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` is on this node."""
        return rank // self.size == self.index


def same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of ``conn`` runs as this one's user (an abstract
    socket's name has no permissions: another user's process could hold it, or connect)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return bool(struct.unpack("3i", creds)[1] == os.getuid())


def take_follower(listener: socket.socket) -> Optional[socket.socket]:
    """The next connection waiting on ``listener`` (non-blocking), if its process is this user's;
    None where it is not (closed). Raises ``BlockingIOError`` where none waits, and ``OSError``
    where the listener cannot accept."""
    conn, _ = listener.accept()
    try:
        if not same_user(conn):
            raise PermissionError("another user's process")
        conn.setblocking(False)  # a follower that does not take a frame at once is dropped
    except OSError:
        conn.close()
        return None
    return conn


def elect(address: bytes, backlog: int = 64) -> tuple[Optional[socket.socket], Optional[socket.socket]]:
    """Hold the abstract socket name ``address`` if nobody does, else connect to whoever does.

    Returns ``(listener, None)`` for the holder (listening, non-blocking), ``(None, connection)``
    for a follower (non-blocking), and ``(None, None)`` where this process is on its own: no
    abstract namespace here, a holder that does not take the connection, or another user's.

    Example::

        >>> import uuid
        >>> name = b"\\0hypergrid-doc-" + uuid.uuid4().hex.encode()
        >>> (held, _), (_, joined) = elect(name), elect(name)
        >>> held is not None, joined is not None
        (True, True)
        >>> joined.close(); held.close()
    """
    # A holder between its bind and its listen refuses a connection: try again for a moment
    # (a busy host may hold it there a while), backing off, rather than give up at once.
    give_up, pause = time.monotonic() + _ELECT_S, 0.001
    while True:
        try:
            held = _bind(address, backlog)
        except OSError:  # no abstract namespace here (or no descriptor left): on its own
            return None, None
        if held is not None:
            return held, None
        try:
            return None, _connect(address)
        except ConnectionRefusedError:  # the holder closed its name, or does not listen yet
            if time.monotonic() >= give_up:
                return None, None
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        except OSError:  # a holder that does not take the connection, or is another user's
            return None, None


def _bind(address: bytes, backlog: int) -> Optional[socket.socket]:
    """A listener holding ``address``; None where another holds it (raises where no name can be held)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address)
        listener.listen(backlog)
        listener.setblocking(False)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return listener


def _connect(address: bytes) -> socket.socket:
    """A connection to the holder of ``address``, of this user (raises OSError otherwise)."""
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.settimeout(_CONNECT_TIMEOUT_S)
        upstream.connect(address)
        if not same_user(upstream):
            raise PermissionError(f"the name {address!r} is held by another user's process")
        upstream.setblocking(False)
    except OSError:
        upstream.close()
        raise
    return upstream


def node_address(purpose: str, key: str, node: int) -> bytes:
    """The abstract socket name of node ``node``'s ``purpose`` (a read, a count) of ``key`` (a
    digest: names are short; the key names the world's control plane, so two jobs on one host
    never share a name).

    Example::

        >>> node_address("read", "ns/round/3/verdict", 0) != node_address("read", "ns/round/3/verdict", 1)
        True
        >>> node_address("read", "ns/k", 0) != node_address("count", "ns/k", 0)
        True
    """
    digest = hashlib.sha256(f"{key}#{node}".encode()).hexdigest()[:40]
    return f"\0hypergrid-{purpose}-{digest}".encode()


def read_address(key: str, node: int) -> bytes:
    """The abstract socket name of the node's read of ``key`` (:func:`node_address`)."""
    return node_address("read", key, node)


def frame(kind: bytes, body: bytes) -> bytes:
    """One frame of a node's local socket: its kind (one byte), its body's length, its body."""
    return _HEADER.pack(kind, len(body)) + body


def split_frame(inbox: bytes) -> Optional[tuple[bytes, bytes, bytes]]:
    """The first whole frame of ``inbox`` as (kind, body, the rest); None until one is whole.

    Example::

        >>> split_frame(frame(b"v", b"ranks 3 and 4") + b"\\0"), split_frame(frame(b"v", b"ranks")[:6])
        ((b'v', b'ranks 3 and 4', b'\\x00'), None)
    """
    if len(inbox) < _HEADER.size:
        return None
    kind, length = _HEADER.unpack_from(inbox)
    if len(inbox) < _HEADER.size + length:
        return None
    return kind, inbox[_HEADER.size:_HEADER.size + length], inbox[_HEADER.size + length:]


@dataclass(frozen=True)
class Read:
    """What one slice of a :class:`NodeRead` found: the ``value`` (None: not set yet), and whether
    the slice was ``covered`` by the node's reader (it looked at the store for this waiter, and
    does whatever else a slice asks of a waiter, such as looking at a leader's beat, for the node;
    False: this waiter looked itself, or heard nothing, and does those itself). A reader's word
    while its get is out (slices longer than :data:`TELL_EVERY_S`) says only that it waits: a
    caller whose slices carry other duties uses slices no longer than that."""

    value: Optional[bytes]
    covered: bool


class NodeRead:
    """One waiter's share of its node's read of one key (see the module)."""

    def __init__(self, address: Optional[bytes]) -> None:
        self.listener, self.upstream = elect(address) if address is not None else (None, None)
        self.address = address
        self.followers: list[socket.socket] = []
        self._inbox = b""

    @classmethod
    def of(cls, key: str, node: Optional[int]) -> NodeRead:
        """The waiter of node ``node`` for ``key`` (None: this rank reads the store on its own)."""
        return cls(read_address(key, node) if node is not None else None)

    @property
    def reads(self) -> bool:
        """Whether this waiter reads the store (its node's reader, or on its own)."""
        return self.upstream is None

    def read(self, store: Any, key: str, slice_s: float) -> Read:
        """One slice of the wait for ``key`` over ``store`` (a :class:`~hypergrid.runtime.store.StoreClient`):
        at most ``slice_s`` on the store for the reader, one blocking get however long, while it
        tells its followers every :data:`TELL_EVERY_S` that it still waits; for a follower, until
        its reader's word (due within ``slice_s`` or :data:`TELL_EVERY_S`, whichever is shorter,
        and waited for :data:`QUIET_S` more at most), never past the store's deadline."""
        if self.upstream is None:
            # Words meanwhile only where the slice outlasts TELL_EVERY_S (its end tells them anyway).
            still = ((lambda: self._tell(None)) if slice_s > TELL_EVERY_S and (self.listener is not None or self.followers)
                     else None)
            value = store.get_within(key, slice_s, meanwhile=still, every_s=TELL_EVERY_S)
            self._tell(value)
            return Read(value, False)
        heard = self._hear(min(min(slice_s, TELL_EVERY_S) + QUIET_S, max(0.0, store.remaining())))
        if heard is _GONE:  # the reader ended or stopped reading for the node: elect again
            self._follow_anew()
            return Read(None, True)
        if heard is _QUIET:  # a reader alive but stuck: read the store itself from now on
            self._drop_upstream()
            return Read(None, False)
        return Read(heard if isinstance(heard, bytes) else None, True)

    # ------------------------------------------------------------------ the reader's side
    def _tell(self, value: Optional[bytes]) -> None:
        """Take the followers that connected meanwhile and tell every one the slice's outcome; once
        the value is read, the node's read is over: the name is let go."""
        while self.listener is not None:
            try:
                conn = take_follower(self.listener)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # no descriptor left, say: take no one more (those waiting elect again)
                self.listener.close()
                self.listener = None
                break
            if conn is not None:
                self.followers.append(conn)
        said = frame(_STILL, b"") if value is None else frame(_VALUE, value)
        for conn in list(self.followers):
            try:
                conn.sendall(said)
            except OSError:  # gone: it elects again and reads as it can
                conn.close()
                self.followers.remove(conn)
        if value is not None:
            self.close()

    # ------------------------------------------------------------------ a follower's side
    def _hear(self, seconds: float) -> object:
        """The value, :data:`_STILL_WAITING`, :data:`_GONE` or :data:`_QUIET` (nothing for ``seconds``)."""
        assert self.upstream is not None
        end = time.monotonic() + seconds
        while True:
            frame = self._frame()
            if frame is not None:
                return frame
            left = end - time.monotonic()
            if left <= 0:
                return _QUIET
            if not readable([self.upstream.fileno()], left):
                return _QUIET
            try:
                chunk = self.upstream.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if not chunk:
                return _GONE
            self._inbox += chunk

    def _frame(self) -> object:
        whole = split_frame(self._inbox)
        if whole is None:
            return None
        kind, body, self._inbox = whole
        return bytes(body) if kind == _VALUE else _STILL_WAITING

    def _follow_anew(self) -> None:
        self._drop_upstream()
        self.listener, self.upstream = elect(self.address) if self.address is not None else (None, None)

    def _drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
        self.upstream, self._inbox = None, b""

    def close(self) -> None:
        """Let the node's name go (a reader's followers read end-of-file and elect again)."""
        for conn in self.followers:
            conn.close()
        self.followers.clear()
        if self.listener is not None:
            self.listener.close()
        self._drop_upstream()
        self.listener = None

    def __enter__(self) -> NodeRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_STILL_WAITING, _GONE, _QUIET = object(), object(), object()
