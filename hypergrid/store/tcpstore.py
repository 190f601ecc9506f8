"""A client of torch's TCPStore that needs no torch: the monitor process's connection to the store.

A rank's monitor process would pay 200-500 MB of memory to import torch (12 MB bare), so it
speaks the few messages it needs exactly as torch's client frames them (one query byte, lengths
and numbers as little-endian 64-bit integers, every key behind a ``/``), for both of torch's
servers. A store that does not echo the opening ping is refused at once, naming its address.
``tests/test_control_plane.py`` checks these messages against the installed torch.

Example, against a server of torch's (here started by torch in this process)::

    >>> from datetime import timedelta
    >>> import torch.distributed as dist
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> wire = WireStore.connect("127.0.0.1", server.port, timeout_s=5.0)
    >>> wire.add("count", 2), wire.add("count", 0), server.get("count")
    (2, 2, b'2')
    >>> server.set("name", "x"); wire.get("name"), wire.check(["name", "absent"])
    (b'x', False)
    >>> wire.requests, wire.bytes_sent > 0
    (6, True)
    >>> wire.close()
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Optional

__all__ = ["WireStore", "StoreProtocolError", "StoreTimeout"]

_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT = 0, 1, 2, 3, 4, 5, 6
_DELETE_KEY, _APPEND, _MULTI_GET, _CANCEL_WAIT, _PING = 8, 9, 10, 12, 13
_MAGIC = 0x3C85F7CE
_STOP_WAITING, _WAIT_CANCELED = 0, 1
#: How long one ping waits for its echo before another is sent on the same connection. torch's
#: servers resolve a new client's name on the thread that answers everyone, so a slow resolver holds
#: the store for 5 s: a sooner ping would only queue behind it, and a new connection would queue
#: another lookup behind it (many clients doing so at once keep the store stalled).
_PING_TRY_S = 10.0
_READY = 0


class StoreProtocolError(RuntimeError):
    """The store answered something torch's own client would not have accepted either."""


class StoreTimeout(TimeoutError):
    """The store did not answer within the connection's timeout."""


class _WrongEcho(StoreProtocolError):
    """A ping answered with what was not pinged: not a TCPStore."""


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class WireStore:
    """One connection to a TCPStore server; every call waits for its answer up to :attr:`timeout_s`.
    ``requests``, ``bytes_sent`` and ``bytes_received`` count what crossed it."""

    def __init__(self, sock: socket.socket, address: tuple[str, int], timeout_s: float) -> None:
        self.address = address
        self._sock = sock
        #: How long each call waits for its answer (a wait given its own time excepted).
        self.timeout_s = timeout_s
        self.requests = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._waiting = False

    @classmethod
    def connect(cls, host: str, port: int, *, timeout_s: float, call_timeout_s: Optional[float] = None) -> WireStore:
        """Open a connection within ``timeout_s`` and check that the store answers as torch's
        TCPStore does. Its calls then wait up to ``call_timeout_s`` each (default: ``timeout_s``).

        Raises:
            OSError: nothing accepts connections at ``host:port`` within ``timeout_s``.
            StoreProtocolError: something answers, but not as a TCPStore.
        """
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            attempt += 1
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            store = cls(sock, (host, port), max(0.05, min(deadline - time.monotonic(), _PING_TRY_S)))
            try:
                # Two messages, as torch's client sends them: a host may read both at once and leave
                # the ping unread until more comes (the next ping).
                store._send(struct.pack("<BI", _VALIDATE, _MAGIC))
                store._ping(deadline, (os.getpid() * 7919 + 1000 * attempt) & 0xFFFFFFFF)
            except _WrongEcho as exc:
                store.close()
                raise StoreProtocolError(f"the store at {host}:{port} {exc}: it does not speak torch's TCPStore "
                                         f"protocol") from None
            except (StoreTimeout, StoreProtocolError, OSError) as exc:
                store.close()
                if time.monotonic() + 0.05 < deadline:  # closed on it: a new connection
                    time.sleep(min(0.05 * attempt, max(0.0, deadline - time.monotonic())))
                    continue
                raise StoreProtocolError(f"the store at {host}:{port} did not answer a TCPStore's ping within "
                                         f"{timeout_s:g} s ({attempt} connections): {exc}") from exc
            store.timeout_s = timeout_s if call_timeout_s is None else call_timeout_s
            store.requests = 1
            return store

    def _ping(self, deadline: float, first: int) -> None:
        """Ping (nonces from ``first``) until the store echoes one, before ``deadline``: each
        :data:`_PING_TRY_S` without an echo, another ping on this connection. Echoes come in order,
        so those of the pings sent after the one echoed are read too: none is left for a call."""
        sent: list[int] = []
        while True:
            sent.append((first + len(sent)) & 0xFFFFFFFF)
            self._send(struct.pack("<BI", _PING, sent[-1]))
            self.timeout_s = max(0.05, min(deadline - time.monotonic(), _PING_TRY_S))
            try:
                echoed = struct.unpack("<I", self._recv(4))[0]
            except StoreTimeout:
                if time.monotonic() + 0.05 < deadline:
                    continue
                raise
            if echoed not in sent:
                raise _WrongEcho(f"answered a ping with {echoed}, not one of {sent}")
            for later in sent[sent.index(echoed) + 1:]:
                self.timeout_s = max(_PING_TRY_S, deadline - time.monotonic())  # the store answers: they come
                echoed = struct.unpack("<I", self._recv(4))[0]
                if echoed != later:
                    raise _WrongEcho(f"answered a ping with {echoed}, not {later}")
            return

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def local_host(self) -> str:
        """This end's address: the interface through which the store's host is reached."""
        return str(self._sock.getsockname()[0])

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def _send(self, data: bytes) -> None:
        self._sock.settimeout(self.timeout_s)
        try:
            self._sock.sendall(data)
        except TimeoutError as exc:
            raise StoreTimeout(f"the store at {self._where()} took more than {self.timeout_s:g} s to take a "
                               f"request") from exc
        self.requests += 1
        self.bytes_sent += len(data)

    def _recv(self, size: int) -> bytes:
        self._sock.settimeout(self.timeout_s)
        chunks, got = [], 0
        while got < size:
            try:
                chunk = self._sock.recv(size - got)
            except TimeoutError as exc:
                raise StoreTimeout(f"the store at {self._where()} did not answer within {self.timeout_s:g} s") from exc
            if not chunk:
                raise StoreProtocolError(f"the store at {self._where()} closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        self.bytes_received += size
        return b"".join(chunks)

    def _recv_bytes(self) -> bytes:
        (size,) = struct.unpack("<Q", self._recv(8))
        return self._recv(size) if size else b""

    def _where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    @staticmethod
    def _key(key: str) -> bytes:
        return _string(("/" + key).encode())

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key`` (made at 0); its new value. ``add(key, 0)`` reads it."""
        self._send(bytes([_ADD]) + self._key(key) + struct.pack("<q", amount))
        return int(struct.unpack("<q", self._recv(8))[0])

    def add_many(self, keys: Sequence[str], amount: int) -> list[int]:
        """:meth:`add` ``amount`` to each of ``keys`` in one round trip (one request each)."""
        return self.adds([(key, amount) for key in keys])

    def adds(self, changes: Sequence[tuple[str, int]]) -> list[int]:
        """:meth:`add` each ``(key, amount)`` of ``changes``, in one message and one round trip (one
        request each, which the server reads at one wake-up); their new values."""
        if not changes:
            return []
        self._send(b"".join(bytes([_ADD]) + self._key(key) + struct.pack("<q", amount) for key, amount in changes))
        self.requests += len(changes) - 1
        return [int(struct.unpack("<q", self._recv(8))[0]) for _ in changes]

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` (no answer comes back)."""
        self._send(bytes([_SET]) + self._key(key) + _string(value))

    def append(self, key: str, value: bytes) -> None:
        """Append ``value`` to ``key``'s value (made empty)."""
        self._send(bytes([_APPEND]) + self._key(key) + _string(value))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it was there."""
        self._send(bytes([_DELETE_KEY]) + self._key(key))
        return bool(struct.unpack("<q", self._recv(8))[0] == 1)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is absent and ``expected`` is
        empty); the value it holds afterwards."""
        self._send(bytes([_COMPARE_SET]) + self._key(key) + _string(expected) + _string(desired))
        return self._recv_bytes()

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set."""
        self._send(bytes([_CHECK]) + struct.pack("<Q", len(keys)) + b"".join(self._key(k) for k in keys))
        return self._recv(1)[0] == _READY

    def get(self, key: str, *, within_s: Optional[float] = None) -> bytes:
        """``key``'s value, waiting until it is set (up to ``within_s``, else the connection's timeout).

        Raises:
            StoreTimeout: ``key`` was not set in time.
        """
        seconds = self.timeout_s if within_s is None else within_s
        if not self.wait([key], seconds):
            raise StoreTimeout(f"{key!r} was not set within {seconds:g} s")
        self._send(bytes([_GET]) + self._key(key))
        return self._recv_bytes()

    def read(self, key: str) -> bytes:
        """The value of ``key``, known to be set, in one request where :meth:`get` makes two. For an
        unset key torch's servers answer empty (libuv) or drop the connection (classic)."""
        self._send(bytes([_GET]) + self._key(key))
        return self._recv_bytes()

    def read_then_wait(self, key: str, keys: Sequence[str]) -> bytes:
        """:meth:`read` ``key`` (known to be set) and :meth:`start_wait` on ``keys``, in one message: the
        store takes both at one wake-up (a board's reader, from each entry to the next)."""
        if self._waiting:
            raise StoreProtocolError("a wait is already pending on this connection")
        self._send(bytes([_GET]) + self._key(key)
                   + bytes([_WAIT]) + struct.pack("<Q", len(keys)) + b"".join(self._key(k) for k in keys))
        self.requests += 1
        self._waiting = True
        return self._recv_bytes()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting (up to the timeout) until all are set."""
        if not self.wait(keys, self.timeout_s):
            raise StoreTimeout(f"{len(keys)} keys were not all set within {self.timeout_s:g} s")
        self._send(bytes([_MULTI_GET]) + struct.pack("<Q", len(keys)) + b"".join(self._key(k) for k in keys))
        return [self._recv_bytes() for _ in keys]

    def wait(self, keys: Sequence[str], seconds: float) -> bool:
        """Block until every key is set (True), or ``seconds`` pass (False)."""
        self.start_wait(keys)
        self._sock.settimeout(max(seconds, 0.001))
        try:
            answer = self._sock.recv(1)
        except TimeoutError:
            self.cancel_wait()
            return False
        return self._waited(answer)

    def start_wait(self, keys: Sequence[str]) -> None:
        """Ask the store to answer once every key is set, and return at once: :meth:`finish_wait`
        reads the answer once :meth:`fileno` is readable. A pending wait costs the store nothing."""
        if self._waiting:
            raise StoreProtocolError("a wait is already pending on this connection")
        self._send(bytes([_WAIT]) + struct.pack("<Q", len(keys)) + b"".join(self._key(k) for k in keys))
        self._waiting = True

    @property
    def waiting(self) -> bool:
        return self._waiting

    def finish_wait(self) -> bool:
        """Read the pending wait's answer (the connection is readable): True, the keys are set."""
        return self._waited(self._recv(1))

    def cancel_wait(self) -> None:
        """Withdraw the pending wait (reading its answer too if the keys were set meanwhile)."""
        if not self._waiting:
            return
        self._send(bytes([_CANCEL_WAIT]))
        answer = self._recv(1)[0]
        if answer == _STOP_WAITING:
            answer = self._recv(1)[0]
        self._waiting = False
        if answer != _WAIT_CANCELED:
            raise StoreProtocolError(f"the store answered a cancelled wait with {answer}")

    def _waited(self, answer: Optional[bytes]) -> bool:
        if not answer:
            raise StoreProtocolError(f"the store at {self._where()} closed the connection")
        self.bytes_received += 1
        self._waiting = False
        if answer[0] != _STOP_WAITING:
            raise StoreProtocolError(f"the store answered a wait with {answer[0]}")
        return True
