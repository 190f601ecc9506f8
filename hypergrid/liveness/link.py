"""A monitor's connections to the job's store, which answers late now and then.

A loaded TCPStore can take seconds to answer, so a call waits for its answer on the same
connection for up to ``give_up_s``: a slow answer is no reason to leave, nor to ask again on a new
connection (torch's server takes new connections late under load, and more of them stall it
further). Only a connection that failed is made again, with its call.

Beats go out from a thread of their own (:meth:`StoreLink.start_beats`), and a watching monitor's
calls on a second connection, so a late read cannot hold a beat back and make the monitor look
silent; a follower's few calls take turns with its beats. Where one process hosts many monitors
(the benchmark, the tests' simulation), each beats at its tick on one connection.

Example, against a store of torch's::

    >>> import torch.distributed as dist
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> link = StoreLink(lambda s: WireStore.connect("127.0.0.1", server.port, timeout_s=s), give_up_s=5.0,
    ...                  beat_key="ns/beat/0", interval_s=1.0)
    >>> link.beat(); link.call(lambda store: store.add("ns/beat/0", 0)), link.beats.timeout_s
    (1, 5.0)
    >>> link.close()
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Optional, TypeVar

from ..store.tcpstore import StoreProtocolError, StoreTimeout, WireStore

__all__ = ["StoreLink", "STORE_ERRORS"]

#: What a store call can fail with: no answer in time, a connection closed or out of step.
STORE_ERRORS = (StoreTimeout, StoreProtocolError, OSError)

_T = TypeVar("_T")


class StoreLink:
    """A monitor's connections: ``beats`` (made at once), and ``own`` for a watching monitor's calls
    (:meth:`watching`), each made by ``connect`` (a timeout in), their calls waited for up to ``give_up_s``."""

    def __init__(self, connect: Callable[[float], WireStore], *, give_up_s: float, beat_key: str,
                 interval_s: float) -> None:
        self._connect = connect
        self.give_up_s = give_up_s
        self._beat_key, self._interval_s = beat_key, interval_s
        self.closed = False
        self.beats = self.connection(give_up_s)
        self.own: Optional[WireStore] = None
        self._turns = threading.Lock()  # the beats' connection, between the beats' thread and the calls
        self._beating: Optional[threading.Event] = None  # set to stop the beats' thread

    def connection(self, within_s: float) -> WireStore:
        """A new connection made within ``within_s``, whose calls wait up to ``give_up_s`` each."""
        made = self._connect(within_s)
        made.timeout_s = self.give_up_s
        return made

    def watching(self) -> None:
        """This monitor watches: its calls go on a connection apart from the beats' (where on a thread)."""
        if self.own is None and self._beating is not None:
            self.own = self.connection(self.give_up_s)

    @contextlib.contextmanager
    def _calls(self) -> Iterator[WireStore]:
        """The connection for a call: its own, or the beats', in turn with them."""
        if self.own is not None:
            yield self.own
            return
        with self._turns:
            yield self.beats

    def _remake(self, failed: WireStore, within_s: float) -> None:
        failed.close()
        if failed is self.own:
            self.own = self.connection(within_s)
        else:
            self.beats = self.connection(within_s)

    def call(self, call: Callable[[WireStore], _T], again: bool = True) -> Optional[_T]:
        """``call`` on the calls' connection, made again on a new one where it fails, within ``give_up_s``
        (raises past it). ``again=False``: a call not to be made twice (an ``add``) returns None instead."""
        give_up = time.monotonic() + self.give_up_s
        while True:
            with self._calls() as store:
                try:
                    return call(store)
                except StoreTimeout:  # the store did not answer for give_up_s: given up
                    raise
                except (StoreProtocolError, OSError):
                    if time.monotonic() >= give_up:
                        raise
                    self._remake(store, max(0.1, give_up - time.monotonic()))
                    if not again:
                        return None

    # ------------------------------------------------------------------ the beats
    @property
    def beating(self) -> bool:
        """Whether :meth:`start_beats`'s thread makes the beats (not each tick)."""
        return self._beating is not None

    def beat(self) -> None:
        """Add 1 to the rank's heartbeat counter (at each tick, or from the beats' thread)."""
        if self._beating is None:
            self.call(lambda store: store.add(self._beat_key, 1))
            return
        with self._turns:
            try:
                self.beats.add(self._beat_key, 1)
            except STORE_ERRORS:  # the next beat goes on a new connection
                if not self.closed:
                    with contextlib.suppress(OSError, StoreProtocolError):
                        self._remake(self.beats, self.give_up_s)

    def start_beats(self) -> None:
        """Beat every interval from a thread of this process's own."""
        if self._beating is not None:
            return
        stop = self._beating = threading.Event()

        def run() -> None:
            due = time.monotonic()
            while not stop.wait(max(0.0, due - time.monotonic())):
                self.beat()
                due = max(due + self._interval_s, time.monotonic())

        threading.Thread(target=run, name="hypergrid-monitor-beats", daemon=True).start()

    def stop_beats(self) -> None:
        if self._beating is not None:
            self._beating.set()

    def close(self) -> None:
        self.closed = True
        self.stop_beats()
        for conn in (self.beats, self.own):
            if conn is not None:
                conn.close()
