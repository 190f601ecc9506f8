"""The job's store as hypergrid calls it: a connection of its own, every call bounded by a deadline.

torch's store calls block for the connection's own timeout, whatever the caller has left, so
:class:`StoreClient` calls a clone of the store on a thread of its own and waits only until the
caller's deadline: a host that stops answering is reported in time as
:class:`~hypergrid.errors.StoreUnresponsiveError`, never as a peer that did not come.

Example, over a ``HashStore``::

    >>> import time
    >>> import torch.distributed as dist
    >>> store = StoreClient(time.monotonic() + 5, base=dist.HashStore())
    >>> store.add("count", 2), store.get_within("absent", 0.05) is None
    (2, True)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, TypeVar, cast

from ..errors import StoreUnresponsiveError
from .keys import last_state_key
from .records import LastState, decode
from .shutdown import register

__all__ = ["StoreClient", "read_if_set", "read_last", "read_lasts", "read_present", "advance_epoch", "is_network_error"]

R = TypeVar("R")

#: The least a store call is given, so that a call made at the deadline still gets an answer.
MIN_CALL_S = 0.05
#: How late a blocking call's answer may come before the store counts as not answering (a loaded host is late).
ANSWER_SLACK_S = 5.0
#: torch counts whole milliseconds and 0 ms is "no timeout": a get with 0.4 ms left would wait for ever.
_LEAST_STORE_TIMEOUT = timedelta(milliseconds=1)
#: Under this much time left, a get or a wait looks (is it set?) instead of blocking: a wait of a few
#: milliseconds can run out before a loaded store answers, and a key already set must still be read.
LOOK_INSTEAD_S = 0.01
#: What :meth:`StoreClient.get_if_set` expects a key to hold: no value the job stores begins with NUL.
_ABSENT = b"\x00hypergrid: not set"


def read_if_set(store: Any, key: str) -> Optional[bytes]:
    """``key``'s value in ``store`` (any client with a ``compare_set``: a :class:`StoreClient`, a
    ``WireStore``), or None where it is not set, in one request: a compare-and-set that never writes.

        >>> import torch.distributed as dist
        >>> base = dist.HashStore(); base.set("a", "1")
        >>> read_if_set(base, "a"), read_if_set(base, "b")
        (b'1', None)
    """
    value = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT else value


class _Connection:
    """A clone of the job's store and the thread that makes its calls."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._calls: queue.SimpleQueue[Optional[tuple[Callable[[Any], Any], list[Any], threading.Event]]] = (
            queue.SimpleQueue())
        thread = threading.Thread(target=self._serve, name="hypergrid-store", daemon=True)
        thread.start()
        # A call in flight must not come back into a finalizing interpreter (see store.shutdown).
        register("a store connection", lambda: self._calls.put(None), thread.join)

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            fn, box, done = call
            try:
                box.append((True, fn(self.store)))
            except BaseException as exc:
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[Any], R], seconds: float, meanwhile: Optional[Callable[[], None]] = None,
             every_s: float = 1.0) -> tuple[bool, Any]:
        """``(finished, (ok, value or exception))``; ``meanwhile`` runs every ``every_s`` while waiting."""
        box: list[Any] = []
        done = threading.Event()
        self._calls.put((fn, box, done))
        end = time.monotonic() + seconds
        while not done.wait(max(0.0, min(end - time.monotonic(), max(every_s, 0.01) if meanwhile else seconds))):
            if meanwhile is None or time.monotonic() >= end:
                # Woken early (a clock step before Python 3.11): the call may still be out.
                return (True, box[0]) if done.is_set() else (False, None)
            meanwhile()
        return True, box[0]


_connections = threading.local()


class StoreClient:
    """The job's store over this thread's own connection, each call bounded by ``deadline``: one that
    does not come back in time raises :class:`~hypergrid.errors.StoreUnresponsiveError`."""

    def __init__(self, deadline: float, *, base: Any) -> None:
        self.deadline = deadline
        self._base = base
        self._connection = self._open(base)

    def _open(self, base: Any) -> Optional[_Connection]:
        cache: dict[int, tuple[Any, Optional[_Connection]]] = getattr(_connections, "by_store", None) or {}
        _connections.by_store = cache
        cached = cache.get(id(base))
        if cached is not None and cached[0] is base:
            return cached[1]
        connection = _Connection(base)  # cloning may block on a frozen host too: on its thread
        finished, result = connection.call(lambda store: store.clone(), max(MIN_CALL_S, self.remaining()))
        if not finished:
            raise StoreUnresponsiveError(f"the job's store did not answer a new connection within {self.remaining():.1f} s")
        ok, clone = result
        if ok:
            connection.store = clone
        # A store that cannot clone (a custom one) is called directly.
        cache[id(base)] = (base, connection if ok else None)
        return connection if ok else None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _drop_connection(self) -> None:
        """Forget this thread's connection (its call is still out)."""
        getattr(_connections, "by_store", {}).pop(id(self._base), None)

    def extend(self, seconds: float) -> None:
        """Allow at least ``seconds`` more from now (one more answer, to name who is missing)."""
        self.deadline = max(self.deadline, time.monotonic() + seconds)

    def _call(self, what: str, fn: Callable[[Any], R], seconds: Optional[float] = None,
              meanwhile: Optional[Callable[[], None]] = None, every_s: float = 1.0) -> R:
        if self._connection is None:
            return fn(self._base)  # a store that cannot clone: nothing runs meanwhile
        budget = max(MIN_CALL_S, self.remaining() if seconds is None else seconds)
        try:
            finished, result = self._connection.call(fn, budget, meanwhile, every_s)
        except BaseException:
            self._drop_connection()  # ``meanwhile`` raised with the call still out
            raise
        if not finished:
            self._drop_connection()
            raise StoreUnresponsiveError(f"the job's store did not answer a {what} within {budget:.1f} s")
        ok, value = result
        if not ok:
            raise value
        return cast(R, value)

    def get(self, key: str) -> bytes:
        return cast(bytes, self._call("get", lambda store: store.get(key)))

    def get_if_set(self, key: str) -> Optional[bytes]:
        """``key``'s value, or None where it is not set, in one request (a compare-and-set that never
        writes). Only for a key nobody waits on: torch's libuv server wakes every waiter on it.

        Example, over a ``HashStore``::

            >>> import torch.distributed as dist
            >>> base = dist.HashStore(); base.set("a", "1")
            >>> store = StoreClient(time.monotonic() + 5, base=base)
            >>> store.get_if_set("a"), store.get_if_set("b"), base.check(["b"])
            (b'1', None, False)
        """
        return read_if_set(self, key)

    def get_within(self, key: str, seconds: float, *, meanwhile: Optional[Callable[[], None]] = None,
                   every_s: float = 1.0) -> Optional[bytes]:
        """``key``'s value once set, waiting at most ``seconds`` (None: not by then), in one call.
        ``meanwhile`` runs every ``every_s`` on this thread; it must be quick and not call this client.

        Example, over a ``HashStore``, the key set 0.25 s into the wait::

            >>> import torch.distributed as dist
            >>> base = dist.HashStore(); ticks = []
            >>> threading.Timer(0.25, base.set, ("late", "1")).start()
            >>> StoreClient(time.monotonic() + 5, base=base).get_within(
            ...     "late", 5.0, meanwhile=lambda: ticks.append(1), every_s=0.1), len(ticks) >= 1
            (b'1', True)
        """
        seconds = min(seconds, self.remaining())
        if seconds <= 0:
            return None

        def getting(store: Any) -> Optional[bytes]:
            if seconds < LOOK_INSTEAD_S:
                return cast(bytes, store.get(key)) if store.check([key]) else None
            previous = store.timeout
            store.set_timeout(_store_timeout(seconds))
            try:
                return cast(bytes, store.get(key))
            except RuntimeError as exc:
                if is_network_error(exc):
                    raise
                return None  # not set in time
            finally:
                store.set_timeout(previous)

        return self._call("get", getting, seconds + ANSWER_SLACK_S, meanwhile, every_s)

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", lambda store: store.set(key, value))

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._call("multi_set", lambda store: store.multi_set(keys, values))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return cast(list[bytes], self._call("multi_get", lambda store: store.multi_get(keys)))

    def check(self, keys: list[str]) -> bool:
        return cast(bool, self._call("check", lambda store: store.check(keys)))

    def add(self, key: str, amount: int) -> int:
        return cast(int, self._call("add", lambda store: store.add(key, amount)))

    def append(self, key: str, value: str | bytes) -> None:
        self._call("append", lambda store: store.append(key, value))

    def delete_key(self, key: str) -> None:
        self._call("delete", lambda store: store.delete_key(key))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return cast(bytes, self._call("compare_set", lambda store: store.compare_set(key, expected, desired)))

    def wait(self, keys: list[str], seconds: float) -> bool:
        """Block until every key is set, for at most ``seconds`` (False: they were not)."""
        seconds = min(seconds, self.remaining())
        if seconds <= 0:
            return False

        def waiting(store: Any) -> bool:
            if seconds < LOOK_INSTEAD_S:
                return bool(store.check(keys))
            try:
                store.wait(keys, _store_timeout(seconds))
            except RuntimeError as exc:
                if is_network_error(exc):
                    raise
                return False  # ran out (DistStoreError; a FileStore raises a plain RuntimeError)
            return True

        # A wait that runs out is normal; one that does not come back at all is the store.
        return self._call("wait", waiting, seconds + ANSWER_SLACK_S)


def _store_timeout(seconds: float) -> timedelta:
    """``seconds`` as a timeout for torch's store, at least 1 ms.

    Example::

        >>> _store_timeout(0.0004), _store_timeout(2.5)
        (datetime.timedelta(microseconds=1000), datetime.timedelta(seconds=2, microseconds=500000))
    """
    return max(timedelta(seconds=seconds), _LEAST_STORE_TIMEOUT)


def read_last(store: StoreClient, rank: int) -> Optional[LastState]:
    """``rank``'s last state (None: it never reached a hypergrid group creation)."""
    key = last_state_key(rank)
    return decode(LastState, store.get(key)) if store.check([key]) else None


def read_present(store: StoreClient, keys: list[str], limit: int = 64) -> dict[str, bytes]:
    """The values of those of ``keys`` that exist (where some are missing, only the first ``limit``).

    Example, over a ``HashStore``::

        >>> import torch.distributed as dist
        >>> base = dist.HashStore(); base.set("a", "1")
        >>> read_present(StoreClient(time.monotonic() + 5, base=base), ["a", "b"])
        {'a': b'1'}
    """
    if not keys:
        return {}
    if store.check(keys):
        return dict(zip(keys, store.multi_get(keys)))
    found = [key for key in keys[:limit] if store.check([key])] if len(keys) > 1 else []
    return dict(zip(found, store.multi_get(found))) if found else {}


def read_lasts(store: StoreClient, ranks: list[int]) -> dict[int, LastState]:
    """The last states of those of ``ranks`` that have one, read as :func:`read_present` reads."""
    raws = read_present(store, [last_state_key(r) for r in ranks], limit=len(ranks))
    return {r: decode(LastState, raws[last_state_key(r)]) for r in ranks if last_state_key(r) in raws}


def advance_epoch(store: StoreClient, epoch_key: str, epoch: int) -> None:
    """Advance ``epoch_key`` from ``epoch`` to the next, once, whoever calls first."""
    store.compare_set(epoch_key, str(epoch), str(epoch + 1))


def is_network_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's ``DistNetworkError`` (the connection broke), known by class name.

    Example::

        >>> class DistNetworkError(RuntimeError): ...
        >>> is_network_error(DistNetworkError("reset")), is_network_error(RuntimeError("timeout"))
        (True, False)
    """
    return any(cls.__name__ == "DistNetworkError" for cls in type(exc).__mro__)
