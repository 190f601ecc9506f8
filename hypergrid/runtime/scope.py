"""The scope a recovery's rebuild runs in: waits that end when a rank they wait for is lost, and
outcomes heard from the job's board instead of read from the store.

Inside :func:`watching`, a wait for other ranks (a world step, an agreement check, the health
probe) asks :func:`lost_among` once a slice, one store request; where the scope hears the board
(:attr:`RecoveryScope.hearing`), it blocks once instead, is called back on a loss, and hears
outcomes through the board at no request. Outside, waits wait as they would.

Example::

    >>> class Board:
    ...     hearing = False
    ...     def lost_among(self, ranks):
    ...         return [r for r in ranks if r == 3]
    >>> lost_among([1, 3])
    []
    >>> with watching(Board()):
    ...     watching_now(), lost_among([1, 3])
    (True, [3])
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Optional, Protocol

from ..store.client import StoreClient
from ..store.keys import Meeting
from ..store.meeting import Place

__all__ = ["RecoveryScope", "watching", "watching_now", "lost_among", "creation_timeout", "WATCH_SLICE_S"]

#: How long a wait inside :func:`watching` that does not hear losses blocks on the store before it
#: looks for one, in seconds.
WATCH_SLICE_S = 0.5


class RecoveryScope(Protocol):
    """The job's board as a recovery's waits use it (:class:`~hypergrid.liveness.board.BoardView`)."""

    @property
    def hearing(self) -> bool:
        """Whether the board's events reach it as they are published."""

    def lost_among(self, ranks: Collection[int]) -> list[int]:
        """Those of ``ranks`` lost on the board (one look)."""

    def on_loss(self, ranks: Collection[int], callback: Callable[[list[int]], None]) -> AbstractContextManager[None]:
        """While the block runs, ``callback`` is called (on another thread) with those of ``ranks``
        heard lost, those heard already first."""

    @property
    def fallback_s(self) -> float:
        """How long a wait that hears the board goes without a look at the store."""

    def heard(self, key: str, seconds: float) -> Optional[bytes]:
        """The outcome decided at ``key``, once heard from the board, waiting at most ``seconds``."""

    def publish(self, key: str, value: bytes) -> None:
        """Tell every rank of the job, through the board, that the outcome at ``key`` is ``value``."""

    def arrive(self, store: StoreClient, at: Meeting, size: int) -> Place:
        """Count this rank in at ``at`` among ``size``, with its node's ranks that arrive together (a
        count whose fate is unknown is not made again: it fails the meeting, where a double one could
        end it early)."""

    def succeeded(self, key: str) -> None:
        """Called, before telling the others, by the participant whose decision that the step
        ending at ``key`` succeeded stands: the recovery's commit, written once."""


_scope = threading.local()


@contextlib.contextmanager
def watching(scope: Optional[RecoveryScope], deadline: Optional[float] = None) -> Iterator[None]:
    """While the block runs, this thread's waits for other ranks end once one they wait for is lost
    (``scope``; None: they wait as they would). ``deadline``: the block's end, a monotonic time,
    which bounds how long torch may take to make a group (:func:`creation_timeout`)."""
    previous = getattr(_scope, "scope", None), getattr(_scope, "deadline", None)
    _scope.scope, _scope.deadline = scope, deadline
    try:
        yield
    finally:
        _scope.scope, _scope.deadline = previous


def current_scope() -> Optional[RecoveryScope]:
    """The scope this thread's waits run in, inside :func:`watching` (else None)."""
    scope: Optional[RecoveryScope] = getattr(_scope, "scope", None)
    return scope


def creation_timeout(timeout: timedelta) -> timedelta:
    """How long torch may take to make a group whose collectives time out after ``timeout``: that,
    or what is left of the deadline inside :func:`watching` (at least a second), whichever is shorter.

    Example::

        >>> creation_timeout(timedelta(seconds=30))          # outside a recovery: unchanged
        datetime.timedelta(seconds=30)
    """
    deadline: Optional[float] = getattr(_scope, "deadline", None)
    if deadline is None:
        return timeout
    return min(timeout, timedelta(seconds=max(1.0, deadline - time.monotonic())))


def watching_now() -> bool:
    """Whether this thread is inside :func:`watching` (with a scope)."""
    return current_scope() is not None


def lost_among(ranks: Collection[int]) -> list[int]:
    """Those of ``ranks`` that are lost, inside :func:`watching` (else none), ascending."""
    scope = current_scope()
    if scope is None or not ranks:
        return []
    return sorted(scope.lost_among(ranks))
