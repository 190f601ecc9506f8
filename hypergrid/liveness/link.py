"""A monitor's connection to the job's store, which answers late now and then.

A loaded TCPStore can take seconds to answer, so a call waits for its answer on the same
connection for up to ``give_up_s``: a slow answer is no reason to leave, nor to ask again on a new
connection (torch's server takes new connections late under load, and more of them stall it
further: it names each new client by a reverse lookup on the thread that answers everyone). Only
a connection that failed is made again, with its call.

The connection is made at the first call, not before: only a node's delegate (and the one
follower standing by to replace it) talks to the store, so a job of ``N`` ranks on nodes of ``G``
opens about ``2 N / G`` connections, not ``N``. A monitor makes its calls one after another, its
node's beat first, with the reads of the nodes it watches in the same message
(:meth:`StoreLink.beat`: one wake-up of the store's thread per node and interval).

Example, against a store of torch's::

    >>> import torch.distributed as dist
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> link = StoreLink(lambda s: WireStore.connect("127.0.0.1", server.port, timeout_s=s), give_up_s=5.0)
    >>> link.connected
    False
    >>> link.beat("ns/node/8/0"), link.beat("ns/node/8/0", reads=["ns/node/8/1"]), link.connected
    ([1], [2, 0], True)
    >>> link.beat("ns/node/8/0", reads=["ns/node/8/1"], also=["ns/node/8/2"])  # for another node too
    [3, 0, 1]
    >>> link.call(lambda store: store.add("ns/node/8/0", 0)), link.store.timeout_s
    (3, 5.0)
    >>> link.close()
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional, TypeVar

from ..store.keys import DEPARTED
from ..store.tcpstore import StoreProtocolError, StoreTimeout, WireStore

__all__ = ["StoreLink", "STORE_ERRORS"]

#: What a store call can fail with: no answer in time, a connection closed or out of step.
STORE_ERRORS = (StoreTimeout, StoreProtocolError, OSError)

_T = TypeVar("_T")


class StoreLink:
    """A monitor's one connection for its calls, made by ``connect`` (a timeout in) at the first call
    (or :meth:`open`), each call waited for up to ``give_up_s``."""

    def __init__(self, connect: Callable[[float], WireStore], *, give_up_s: float) -> None:
        self._connect = connect
        self.give_up_s = give_up_s
        self.store: Optional[WireStore] = None
        self.closed = False
        self._opening: Optional[threading.Thread] = None

    @property
    def connected(self) -> bool:
        return self.store is not None

    def connection(self, within_s: float) -> WireStore:
        """A new connection made within ``within_s``, whose calls wait up to ``give_up_s`` each."""
        made = self._connect(within_s)
        made.timeout_s = self.give_up_s
        return made

    def open(self, within_s: Optional[float] = None) -> WireStore:
        """The calls' connection, made now where there is none (raises OSError or StoreProtocolError)."""
        if self.store is None:
            self.store = self.connection(self.give_up_s if within_s is None else within_s)
        return self.store

    def open_soon(self) -> None:
        """Make the connection on a thread of its own (a follower standing by: its loop must not wait
        on a store that answers late, or it would fall silent to its node); a failed one is tried
        again at the next call."""
        if self.store is not None or (self._opening is not None and self._opening.is_alive()):
            return

        def run() -> None:
            try:
                made = self.connection(self.give_up_s)
            except STORE_ERRORS:
                return
            if self.store is None and not self.closed:
                self.store = made
            else:
                made.close()

        self._opening = threading.Thread(target=run, name="hypergrid-monitor-connect", daemon=True)
        self._opening.start()

    def call(self, call: Callable[[WireStore], _T], again: bool = True) -> Optional[_T]:
        """``call`` on the connection, made again on a new one where it fails, within ``give_up_s``
        (raises past it). ``again=False``: a call not to be made twice (an ``add``) returns None instead."""
        give_up = time.monotonic() + self.give_up_s
        if self._opening is not None:  # a connection on its way: this one, not another
            self._opening.join(max(0.0, give_up - time.monotonic()))
            self._opening = None
        while True:
            store = self.open(max(0.1, give_up - time.monotonic()))
            try:
                return call(store)
            except StoreTimeout:  # the store did not answer for give_up_s: given up
                raise
            except (StoreProtocolError, OSError):
                store.close()
                self.store = None
                if time.monotonic() >= give_up:
                    raise
                if not again:
                    return None

    def beat(self, key: str, reads: Sequence[str] = (), also: Sequence[str] = ()) -> list[int]:
        """Add 1 to the heartbeat counter at ``key`` and read the counters at ``reads``, in one message:
        the beat's value, then theirs. ``also``: more counters beaten in the same message (a group's
        reader beats for the delegates that asked it), their values last. A counter marked departed
        (its node's last monitor left) beats again from 1: a monitor serves the node once more."""
        changes = [(key, 1), *((read, 0) for read in reads), *((other, 1) for other in also)]
        values = self.call(lambda store: store.adds(changes))
        assert values is not None
        beaten = [0, *range(1 + len(reads), len(changes))]
        for at in (at for at in beaten if values[at] <= 0):
            again = self.call(functools.partial(_add, key=changes[at][0], amount=-DEPARTED))
            assert again is not None
            values[at] = again
        return values

    def drop(self) -> None:
        """Close the calls' connection, if one is made (a follower again needs none): the next call makes another."""
        if self.store is not None:
            self.store.close()
            self.store = None

    def close(self) -> None:
        self.closed = True
        self.drop()


def _add(store: WireStore, key: str, amount: int) -> int:
    return store.add(key, amount)
