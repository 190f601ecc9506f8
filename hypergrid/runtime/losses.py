"""Waits that end when a rank they wait for is lost: the scope a recovery's rebuild runs in.

Inside a recovery, a rank that dies while the others wait for it (in a world step, a group's
agreement, the pooled probe of the groups that survived) must not be waited for until the
timeout. The recovery runs its rebuild inside :func:`watching` with a :class:`LossCheck`, the
job's board as this rank reads it (:class:`hypergrid.control.board.LossView`), and each of those
waits asks :func:`lost_among` once per slice: one store request, whatever the job's size.
Where the rank's heartbeat forwards the board's events to the check (a :class:`LossAlarm`), a
wait that can be ended by a write to the key it waits on blocks once instead, for no request per
slice: the alarm calls it back on a loss (:func:`loss_alarm`). Outside the scope nothing is
looked at, and the waits wait as they would.

Example::

    >>> class Board:
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
from typing import Optional, Protocol, runtime_checkable

from .node_read import Node

__all__ = ["LossCheck", "LossAlarm", "watching", "watching_now", "lost_among", "loss_alarm", "creation_timeout",
           "WATCH_SLICE_S"]

#: How long a wait inside :func:`watching` blocks on the store at a time before it looks whether
#: a rank it waits for is lost, in seconds: a loss ends the wait within about this long.
WATCH_SLICE_S = 0.5


class LossCheck(Protocol):
    """Says which of some ranks are lost (the job's board, read with one store request a look)."""

    def lost_among(self, ranks: Collection[int]) -> list[int]: ...


@runtime_checkable
class LossAlarm(Protocol):
    """A :class:`LossCheck` that hears the board's losses as they are published (the rank's monitor
    forwards them), and so can call a wait back instead of being asked once a slice."""

    def lost_among(self, ranks: Collection[int]) -> list[int]: ...

    @property
    def hearing(self) -> bool:
        """Whether losses reach it as they are published (else it can only be asked)."""

    def on_loss(self, ranks: Collection[int], callback: Callable[[list[int]], None]) -> AbstractContextManager[None]:
        """While the block runs, ``callback`` is called (on another thread) with those of ``ranks``
        heard lost: at once with those heard already, then with each new one."""


_scope = threading.local()


@contextlib.contextmanager
def watching(check: Optional[LossCheck], deadline: Optional[float] = None, node: Optional[Node] = None) -> Iterator[None]:
    """While the block runs, this thread's waits for other ranks end as soon as one they wait for
    is lost (``check``); None: they wait as they would. ``deadline`` (a monotonic time): the
    block's end, which bounds how long torch may take to make a group (:func:`creation_timeout`).
    ``node``: this rank's node, whose ranks count themselves at the end of a step in one batch
    and read its outcome once (:mod:`~hypergrid.runtime.node_count`,
    :mod:`~hypergrid.runtime.node_read`, :func:`waits_node`); None: each on its own."""
    previous = getattr(_scope, "check", None), getattr(_scope, "deadline", None), getattr(_scope, "node", None)
    _scope.check, _scope.deadline, _scope.node = check, deadline, node
    try:
        yield
    finally:
        _scope.check, _scope.deadline, _scope.node = previous


def creation_timeout(timeout: timedelta) -> timedelta:
    """How long torch may take to make a group whose collectives time out after ``timeout``: that,
    or what is left of the recovery's deadline inside :func:`watching`, whichever is shorter (a
    member that died after agreeing would hold the others in gloo's connection set-up, or NCCL's
    initialization, until then), and at least a second.

    Example::

        >>> creation_timeout(timedelta(seconds=30))          # outside a recovery: unchanged
        datetime.timedelta(seconds=30)
    """
    deadline: Optional[float] = getattr(_scope, "deadline", None)
    if deadline is None:
        return timeout
    return min(timeout, timedelta(seconds=max(1.0, deadline - time.monotonic())))


def waits_node() -> Optional[Node]:
    """The node whose ranks share this thread's waits, inside :func:`watching` (else None).

    Example::

        >>> with watching(None, node=Node.of(27, 8)):
        ...     waits_node()
        Node(index=3, size=8)
    """
    node: Optional[Node] = getattr(_scope, "node", None)
    return node


def watching_now() -> bool:
    """Whether this thread is inside :func:`watching` (with a check)."""
    return getattr(_scope, "check", None) is not None


def loss_alarm() -> Optional[LossAlarm]:
    """The scope's check where it hears losses as they are published (see :class:`LossAlarm`),
    else None: a wait then looks once a slice.

    Example::

        >>> loss_alarm() is None                     # outside a recovery
        True
    """
    check = getattr(_scope, "check", None)
    return check if isinstance(check, LossAlarm) and check.hearing else None


def lost_among(ranks: Collection[int]) -> list[int]:
    """Those of ``ranks`` that are lost, inside :func:`watching` (else none), ascending."""
    check: Optional[LossCheck] = getattr(_scope, "check", None)
    if check is None or not ranks:
        return []
    return sorted(check.lost_among(ranks))
