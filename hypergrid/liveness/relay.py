"""One wait on the job's board per node: a node's monitors elect a delegate that waits and relays.

Were each monitor to wait on the board itself, every entry would cost the store a wake and two
requests per rank (some 260,000 requests for eight entries at 16,384 ranks). So the monitors of
one node elect a *delegate* by binding the node's abstract Unix socket name (:func:`elect`: no file
to clean up, released when its holder ends; another user's process is neither followed nor
accepted). The delegate keeps the node's one wait on the board and hands each entry to the
others over that socket.

Every relayed entry carries its board index and a new follower is told the delegate's position
first, so a follower that missed entries reads them from the store itself: none is lost or seen
twice. A follower whose delegate goes reads end-of-file and elects again; one that hears nothing
for the staleness bound (a stuck delegate), or has no abstract sockets (not Linux), waits on the
board itself; one too far behind (its socket full) is dropped and catches up the same way.
Followers speak too, a line at a time (:meth:`NodeRelay.tell`): that they are alive, what they
would publish, that they leave; the delegate reads them (:meth:`NodeRelay.follower_ready`).

Example, two monitors of one node in this process::

    >>> import uuid
    >>> address = socket_name("relay", f"doc-{uuid.uuid4()}", 0)
    >>> first, second = NodeRelay.join(address), NodeRelay.join(address)
    >>> first.delegates, second.delegates
    (True, False)
    >>> first.accept(position=3)                                   # the delegate will read entry 3 next
    True
    >>> first.send(3, '{"kind": "lost"}'); first.keep_alive(4, "what it watches")
    >>> second.receive()                                           # doctest: +NORMALIZE_WHITESPACE
    [Relayed(index=3, payload=None, state='', answer=None),
     Relayed(index=3, payload='{"kind": "lost"}', state='', answer=None),
     Relayed(index=4, payload=None, state='what it watches', answer=None)]
    >>> second.tell("alive 1")                                     # followers speak too
    True
    >>> first.follower_ready(next(iter(first.followers)))
    ['alive 1']
    >>> first.close(); second.receive() is None                   # the delegate left: elect again
    True
    >>> second.close(); third = NodeRelay.join(address); third.delegates
    True
    >>> third.close()
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ..store.keys import socket_name
from .poll import read_lines

__all__ = ["NodeNames", "NodeRelay", "Relayed", "Role", "elect", "hold", "socket_name"]

#: How long a monitor keeps trying a name whose holder refuses it (closing, or bound and not yet listening).
_ELECT_S = 0.5
#: How long a connection to a name's holder may take.
_CONNECT_TIMEOUT_S = 1.0


def elect(address: bytes, backlog: int = 64) -> tuple[Optional[socket.socket], Optional[socket.socket]]:
    """Hold the abstract socket name ``address`` if nobody does, else connect to whoever does.

    Returns ``(listener, None)`` for the holder, ``(None, connection)`` for a follower (both
    non-blocking), and ``(None, None)`` where this process is on its own.

    Example::

        >>> import uuid
        >>> name = b"\\0hypergrid-doc-" + uuid.uuid4().hex.encode()
        >>> (held, _), (_, joined) = elect(name), elect(name)
        >>> held is not None, joined is not None
        (True, True)
        >>> joined.close(); held.close()
    """
    # A holder between its bind and its listen refuses a connection: back off and try again a moment.
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


def hold(address: bytes) -> Optional[socket.socket]:
    """Hold the abstract socket name ``address`` as a host-wide lock (bound, not listening), released
    when its holder closes it or ends: the socket, or None where another process holds it. Raises
    OSError where no name can be held (no abstract namespace).

    Example::

        >>> import uuid
        >>> name = b"\\0hypergrid-doc-" + uuid.uuid4().hex.encode()
        >>> held = hold(name); held is not None, hold(name)
        (True, None)
        >>> held.close(); again = hold(name); again is not None
        True
        >>> again.close()
    """
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(address)
    except OSError as exc:
        lock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return lock


def _same_user(conn: socket.socket) -> bool:
    """Whether the peer of ``conn`` runs as this user (an abstract socket's name has no permissions)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return bool(struct.unpack("3i", creds)[1] == os.getuid())


def _bind(address: bytes, backlog: int) -> Optional[socket.socket]:
    """A listener holding ``address``; None where another holds it (raises where no name can be held)."""
    listener = hold(address)
    if listener is not None:
        try:
            listener.listen(backlog)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
    return listener


def _connect(address: bytes) -> socket.socket:
    """A connection to the holder of ``address``, of this user (raises OSError otherwise)."""
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.settimeout(_CONNECT_TIMEOUT_S)
        upstream.connect(address)
        if not _same_user(upstream):
            raise PermissionError(f"the name {address!r} is held by another user's process")
        upstream.setblocking(False)
    except OSError:
        upstream.close()
        raise
    return upstream


class Role(enum.Enum):
    """What a monitor is to its node, from its end of the node's relay."""

    #: It holds the node's name: it beats, watches and waits on the board for the node, and hears its monitors.
    DELEGATE = "delegate"
    #: It hears the node's delegate over the node's socket, and speaks to it.
    FOLLOWER = "follower"
    #: On its own: its delegate stayed quiet past the bound (it looks for it again), or no name can be held here.
    ALONE = "alone"


@dataclass
class NodeNames:
    """The names a node's monitors meet by on their host, for one board: the relay's (its delegate
    holds it) and the watch's, which ``standby`` holds where this monitor is the follower standing by.

    Example::

        >>> import uuid
        >>> names, other = NodeNames(f"doc-{uuid.uuid4()}", 0), None
        >>> names.stand_by(), names.held_by_another()          # it holds the watch's: nobody else does
        (True, False)
        >>> other = NodeNames(names.board, 0); other.stand_by(), other.held_by_another()
        (False, True)
        >>> names.release(); other.stand_by()
        True
        >>> other.release()
    """

    board: str
    node: int
    standby: Optional[socket.socket] = None

    @property
    def relay(self) -> bytes:
        return socket_name("relay", self.board, self.node)

    def stand_by(self) -> bool:
        """Hold the watch's name if nobody does; whether this monitor stands by (True too where no name
        can be held: each on its own)."""
        if self.standby is None:
            try:
                self.standby = hold(socket_name("watch", self.board, self.node))
            except OSError:
                return True
        return self.standby is not None

    def held_by_another(self) -> bool:
        """Whether another monitor holds the relay's name or the watch's (False where no name can be held)."""
        for kind in ("relay",) if self.standby is not None else ("relay", "watch"):
            try:
                held = hold(socket_name(kind, self.board, self.node))
            except OSError:
                return False
            if held is None:
                return True
            held.close()
        return False

    def release(self) -> None:
        """Stand by no longer."""
        if self.standby is not None:
            self.standby.close()
            self.standby = None


@dataclass(frozen=True)
class Relayed:
    """What a follower hears: the board's entry ``index`` (``payload`` its encoding), or, with no
    payload, the delegate's position (the next entry it reads) and its opaque one-line ``state``, or
    the ``answer`` to a call."""

    index: int
    payload: Optional[str]
    state: str = ""
    answer: Optional[str] = None  # else: the answer to a call this follower handed on (:mod:`.calls`)


def _position_line(position: int, state: str) -> bytes:
    """The line that tells a follower the delegate's position, and its ``state`` where it has one."""
    return (f"at {position} {state}\n" if state else f"at {position}\n").encode()


class NodeRelay:
    """One monitor's end of its node's relay: the delegate's listener and followers, or a follower's
    upstream. A delegate's keep-alive may come from a thread of its own: the followers are kept under a lock."""

    def __init__(self, listener: Optional[socket.socket], upstream: Optional[socket.socket],
                 same_user_only: bool = True, greeting: str = "") -> None:
        self.listener = listener
        self.upstream = upstream
        #: Take only followers run by this user (a node's Unix socket); a TCP relay between hosts cannot tell.
        self.same_user_only = same_user_only
        #: The delegate's one word told each follower it takes, as the state of its first line: who it is.
        self.greeting = greeting
        self.followers: dict[int, socket.socket] = {}
        self._inbox = b""
        self._said: dict[int, bytes] = {}  # what each follower sent, short of a whole line
        self._lock = threading.RLock()

    @classmethod
    def join(cls, address: bytes) -> NodeRelay:
        """Be the node's delegate at ``address`` if nobody is, else follow whoever is (with no abstract
        sockets: a delegate with no listener, alone)."""
        listener, upstream = elect(address)
        return cls(listener, upstream)

    @property
    def lock(self) -> threading.RLock:
        """Held while followers are taken and told the delegate's position: a delegate that learns its
        position holds it too, so that no follower is taken between the two and told a stale one."""
        return self._lock

    @property
    def delegates(self) -> bool:
        return self.upstream is None

    @property
    def role(self) -> Role:
        """What this end makes its monitor: :attr:`Role.ALONE` holds no name and follows nobody."""
        if self.upstream is not None:
            return Role.FOLLOWER
        return Role.DELEGATE if self.listener is not None else Role.ALONE

    def readers(self) -> list[int]:
        """The descriptors to watch: the listener and the followers (their lines, their end), or the upstream."""
        if self.upstream is not None:
            return [self.upstream.fileno()]
        with self._lock:
            return ([self.listener.fileno()] if self.listener is not None else []) + list(self.followers)

    # ------------------------------------------------------------------ the delegate's side
    def accept(self, position: int) -> bool:
        """Take a new follower and tell it ``position``; whether one was waiting (taken, or refused)."""
        if self.listener is None:
            return False
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError, OSError):
            return False
        try:
            if self.same_user_only and not _same_user(conn):
                raise PermissionError("another user's process")
            if conn.family != socket.AF_UNIX:  # an entry is one small line: sent at once, not held for an ACK
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)  # a follower that does not take a line at once is dropped
        except OSError:
            conn.close()
            return True
        with self._lock:
            self.followers[conn.fileno()] = conn
            self._send_to(conn, _position_line(position, self.greeting))
        return True

    def send(self, index: int, payload: str) -> None:
        """Hand entry ``index`` to every follower, those waiting to be taken first (else each would
        read it from the store, one by one, after a newly elected delegate)."""
        while self.accept(position=index):
            pass
        line = f"ev {index} {payload}\n".encode()
        with self._lock:
            for conn in list(self.followers.values()):
                self._send_to(conn, line)

    def keep_alive(self, position: int, state: str = "") -> None:
        """Tell every follower the delegate's position and one-line ``state`` (every interval)."""
        if "\n" in state:
            raise ValueError(f"a relayed state is one line, got {state!r}")
        line = _position_line(position, state)
        with self._lock:
            for conn in list(self.followers.values()):
                self._send_to(conn, line)

    def answer(self, fd: int, answer: str) -> None:
        """Send the follower at ``fd`` the one-line ``answer`` to a call it handed on (gone: nothing)."""
        with self._lock:
            conn = self.followers.get(fd)
            if conn is not None:
                self._send_to(conn, f"ans {answer}\n".encode())

    def follower_ready(self, fd: int) -> list[str]:
        """A follower's connection is readable: the whole lines it sent (none where it went, or has
        not ended a line yet)."""
        with self._lock:
            conn = self.followers.get(fd)
            if conn is None:
                return []
            try:
                lines, rest = read_lines(fd, self._said.get(fd, b""))
            except OSError:
                lines, rest = None, b""
            if lines is None:
                self._drop(conn)
                return []
            self._said[fd] = rest
            return lines

    def _send_to(self, conn: socket.socket, line: bytes) -> None:
        try:
            conn.sendall(line)
        except OSError:  # gone, or so far behind that its socket is full: it elects again and catches up
            # Shut, not closed: the keep-alive thread sends too, and a descriptor closed under the
            # loop that selects on it could be reused for another socket meanwhile. The loop reads
            # the end (follower_ready) and closes it there.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            fd = conn.fileno()
            self.followers.pop(fd, None)
            self._said.pop(fd, None)
            conn.close()

    # ------------------------------------------------------------------ a follower's side
    def tell(self, line: str) -> bool:
        """Send the delegate one line (never blocking); False where it could not be sent (the delegate
        went, or has read nothing for so long that its socket is full)."""
        if self.upstream is None:
            return False
        try:
            self.upstream.send((line + "\n").encode(), socket.MSG_DONTWAIT)
        except OSError:
            return False
        return True

    def receive(self) -> Optional[list[Relayed]]:
        """What the delegate sent (the connection is readable); None when the delegate is gone."""
        if self.upstream is None:
            return []
        try:
            lines, self._inbox = read_lines(self.upstream.fileno(), self._inbox)
        except OSError:  # a connection reset: gone too
            lines = None
        if lines is None:
            return None
        heard = []
        for line in lines:
            word, _, rest = line.partition(" ")
            if word == "at":
                position, _, state = rest.partition(" ")
                heard.append(Relayed(int(position), None, state))
            elif word == "ev":
                index, _, payload = rest.partition(" ")
                heard.append(Relayed(int(index), payload))
            elif word == "ans":
                heard.append(Relayed(-1, None, answer=rest))
        return heard

    def close(self) -> None:
        with self._lock:
            for conn in list(self.followers.values()):
                conn.close()
            self.followers.clear()
            self._said.clear()
            for sock in (self.listener, self.upstream):
                if sock is not None:
                    sock.close()
            self.listener = self.upstream = None
