"""A monitor's connections to the job's store, which answers late now and then.

A loaded or briefly stalled TCPStore answers in seconds, not milliseconds, and how long a
connection took to open says nothing of how long its calls may take. So each call of a monitor
waits a try's time (:attr:`StoreLink.try_s`, half the staleness bound) and, where the store did
not answer by then (or the connection failed), is made again on a new connection, until the
store has had ``give_up_s`` (30 s by default); only then does the monitor give the store up. A
slow answer is never a reason to leave.

And the monitor's beats go on a connection of their own, from a thread of their own (in the
monitor process, :meth:`StoreLink.start_beats`): a read or a publication that the store answers
late holds no beat back, so a late store cannot make a monitor look silent to its watcher. Where
one process hosts many monitors (the control-plane benchmark, the tests' simulation), each beats
at its tick instead, before its reads, on the same connection.

Example, against a store of torch's::

    >>> import torch.distributed as dist
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> link = StoreLink(lambda s: WireStore.connect("127.0.0.1", server.port, timeout_s=s), give_up_s=5.0,
    ...                  try_s=2.5, beat_key="ns/beat/0", interval_s=1.0, beats_apart=False)
    >>> link.beat(); link.call(lambda store: store.add("ns/beat/0", 0)), link.store.timeout_s
    (1, 2.5)
    >>> link.close()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Optional, TypeVar

from ..store.tcpstore import StoreProtocolError, StoreTimeout, WireStore

__all__ = ["StoreLink", "STORE_ERRORS"]

#: What a store call can fail with: no answer in time, a connection closed or out of step.
STORE_ERRORS = (StoreTimeout, StoreProtocolError, OSError)

_T = TypeVar("_T")


class StoreLink:
    """A monitor's connections: ``store`` for its reads and publications, ``beats`` for its beats
    (the same one unless ``beats_apart``), each made by ``connect`` (a timeout in, a connection
    out), their calls tried for ``try_s`` at a time and given up after ``give_up_s``."""

    def __init__(self, connect: Callable[[float], WireStore], *, give_up_s: float, try_s: float, beat_key: str,
                 interval_s: float, beats_apart: bool) -> None:
        self._connect = connect
        self.give_up_s, self.try_s = give_up_s, try_s
        self._beat_key, self._interval_s = beat_key, interval_s
        self.closed = False
        self.store = self.connection(give_up_s)
        self.beats = self.connection(give_up_s) if beats_apart else self.store
        self._beating: Optional[threading.Event] = None  # set to stop the beats' thread

    def connection(self, within_s: float) -> WireStore:
        """A new connection made within ``within_s``, whose calls wait a try's time: how long it
        took to open is not how long they may take."""
        made = self._connect(within_s)
        made.timeout_s = self.try_s
        return made

    def call(self, call: Callable[[WireStore], _T], again: bool = True) -> Optional[_T]:
        """``call`` on the store's connection; where the store does not answer in a try's time (or
        the connection fails), on a new connection, again until ``give_up_s`` have passed, and
        then raise. ``again=False``: a call that must not be made twice (an ``add`` to the board's
        count) is not made again: None."""
        give_up = time.monotonic() + self.give_up_s
        while True:
            try:
                return call(self.store)
            except STORE_ERRORS:
                if time.monotonic() >= give_up:
                    raise
                shared = self.beats is self.store
                self.store.close()
                self.store = self.connection(max(0.1, give_up - time.monotonic()))
                if shared:
                    self.beats = self.store
                if not again:
                    return None

    # ------------------------------------------------------------------ the beats
    @property
    def beating(self) -> bool:
        """Whether the beats are made by :meth:`start_beats`'s thread (not at each tick)."""
        return self._beating is not None

    def beat(self) -> None:
        """Add 1 to the rank's heartbeat counter."""
        if self.beats is self.store:
            self.call(lambda store: store.add(self._beat_key, 1))
            return
        try:
            self.beats.add(self._beat_key, 1)
        except STORE_ERRORS:  # the next beat goes on a new connection
            if self.closed:
                return
            self.beats.close()
            try:
                self.beats = self.connection(self.try_s)
            except (OSError, StoreProtocolError):
                pass

    def start_beats(self) -> None:
        """Beat every interval from a thread of this process's own, on the beats' own connection."""
        if self.beats is self.store or self._beating is not None:
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
        self.store.close()
        if self.beats is not self.store:
            self.beats.close()
