"""A TCP proxy in front of a store that can hold what its clients send: a store that answers late.

Every connection made to the proxy's port is forwarded to the store's, bytes both ways; what a
client sends is held :attr:`StoreProxy.hold_s` seconds before the store gets it (in order, each
chunk from when it came: a delay line, as a loaded or briefly stalled store is to its clients),
and what the store answers goes back at once. ``hold_s`` may change at any moment; it applies to
what comes from then on. One thread does it all, with no blocking call (a client that reads
nothing for a while holds up nobody else).

It can also stall the whole store, as torch's server stalls when a reverse lookup of a new
client's address goes unanswered on the thread that answers everyone: :meth:`StoreProxy.stall`
holds every request for a while, and with :attr:`StoreProxy.stall_every` set every that-many-th new
connection does (``accepted`` counts them).

Example, in front of a TCPStore of torch's::

    >>> import time
    >>> import torch.distributed as dist
    >>> from hypergrid.store.tcpstore import WireStore
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> proxy = StoreProxy(server.port)
    >>> client = WireStore.connect("127.0.0.1", proxy.port, timeout_s=5)
    >>> proxy.hold_s = 0.3
    >>> start = time.monotonic(); client.add("k", 1), time.monotonic() - start >= 0.3
    (1, True)
    >>> proxy.hold_s = 0.0; client.add("k", 1)
    2
    >>> client.close(); proxy.close()
"""

from __future__ import annotations

import heapq
import itertools
import selectors
import socket
import threading
import time
from typing import Optional

__all__ = ["StoreProxy"]


class _Pipe:
    """One client's connection and the store's for it; what each side has yet to take."""

    def __init__(self, client: socket.socket, store: socket.socket) -> None:
        self.client, self.store = client, store
        self.to_store = b""  # released by the delay line, not yet taken by the store
        self.to_client = b""
        self.last_due = 0.0  # when the last chunk held goes: the next one goes after it
        self.closed = False


class StoreProxy:
    """Forwards connections on :attr:`port` to ``127.0.0.1:target_port``, holding what clients send
    :attr:`hold_s` seconds."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.hold_s = 0.0
        #: Every this-many-th new connection stalls the store for ``stall_s`` (0: none does).
        self.stall_every = 0
        self.stall_s = 5.0
        #: How many connections the proxy took in, and when the store answers again after a stall.
        self.accepted = 0
        self._stalled_until = 0.0
        #: Bytes the clients sent, and the store answered, through the proxy so far.
        self.sent = self.answered = 0
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._held: list[tuple[float, int, _Pipe, bytes]] = []  # (due, order, pipe, data)
        self._order = itertools.count()
        self._pipes: set[_Pipe] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-proxy", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            while self._held and self._held[0][0] <= now and now >= self._stalled_until:
                _, _, pipe, data = heapq.heappop(self._held)
                if not pipe.closed:
                    pipe.to_store += data
                    self._flush(pipe, pipe.store)
            wait = min(0.05, max(0.0, self._held[0][0] - now, self._stalled_until - now)) if self._held else 0.05
            for key, events in self._selector.select(wait):
                if key.data is None:
                    self._accept()
                    continue
                pipe, side = key.data
                if events & selectors.EVENT_READ:
                    self._read(pipe, side)
                if events & selectors.EVENT_WRITE and not pipe.closed:
                    self._flush(pipe, side)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            store = socket.create_connection(self.target, timeout=5.0)
        except OSError:
            client.close()
            return
        for sock in (client, store):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe = _Pipe(client, store)
        self._pipes.add(pipe)
        self.accepted += 1
        if self.stall_every and self.accepted % self.stall_every == 0:
            self.stall(self.stall_s)
        self._selector.register(client, selectors.EVENT_READ, (pipe, client))
        self._selector.register(store, selectors.EVENT_READ, (pipe, store))

    def _read(self, pipe: _Pipe, side: socket.socket) -> None:
        try:
            data = side.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(pipe)
            return
        if side is pipe.client:
            self.sent += len(data)
            due = max(time.monotonic() + self.hold_s, pipe.last_due, self._stalled_until)
            pipe.last_due = due
            heapq.heappush(self._held, (due, next(self._order), pipe, data))
        else:
            self.answered += len(data)
            pipe.to_client += data
            self._flush(pipe, pipe.client)

    def _flush(self, pipe: _Pipe, side: socket.socket) -> None:
        """Send what ``side`` has yet to take, as much as it takes now; watch it for writing while
        some is left."""
        attr = "to_client" if side is pipe.client else "to_store"
        data = getattr(pipe, attr)
        try:
            sent = side.send(data) if data else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(pipe)
            return
        setattr(pipe, attr, data[sent:])
        self._selector.modify(side, selectors.EVENT_READ | (selectors.EVENT_WRITE if data[sent:] else 0),
                              (pipe, side))

    def _close(self, pipe: _Pipe) -> None:
        if pipe.closed:
            return
        pipe.closed = True
        self._pipes.discard(pipe)
        for sock in (pipe.client, pipe.store):
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()

    def stall(self, seconds: float) -> None:
        """Hold every request, whoever sent it and whenever, until ``seconds`` from now."""
        self._stalled_until = max(self._stalled_until, time.monotonic() + seconds)  # the loop holds what is due

    # ------------------------------------------------------------------ the end
    @property
    def connections(self) -> int:
        """How many client connections are open through the proxy."""
        return len(self._pipes)

    def close(self, timeout_s: Optional[float] = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        for pipe in list(self._pipes):
            self._close(pipe)
        self._selector.close()
        self._listener.close()
