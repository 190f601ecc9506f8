"""Silence judged by a monitor: its own rank's interpreter that stopped ticking, its delegate that stopped speaking.

A rank's heartbeat thread ticks its monitor every interval (rarer where the timeout is long:
:func:`tick_every_s`), which needs the rank's GIL: a rank whose interpreter sent no tick for
``timeout_s`` (stopped, or stuck holding the GIL) is hung, and published once until it ticks again. A follower standing by publishes its delegate's rank once the
delegate said nothing for the staleness bound: the delegate's monitor is stopped. A delegate that
went while its rank's process still runs on the node was killed alone: its rank starts another
monitor, which is given the time a monitor may take to start (:func:`restarting_delegate`).

Example, a progress timeout of 30 s::

    >>> progress = RankProgress(timeout_s=30.0, last=0.0)
    >>> progress.hung(rank=3, now=29.0) is None, progress.hung(rank=3, now=31.0).reason[:36]
    (True, 'it made no progress for 31 s (the pr')
    >>> progress.hung(rank=3, now=40.0) is None               # published once
    True

Ticked every 6 s (a timeout of 3 minutes), it waits the 5 s its ticks may come later too::

    >>> slow = RankProgress(timeout_s=180.0, last=0.0, slack_s=tick_every_s(1.0, 180.0) - 1.0)
    >>> slow.hung(rank=3, now=182.0) is None, slow.hung(rank=3, now=185.0) is not None
    (True, True)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ..store.records import BoardEvent, EventKind

__all__ = ["RankProgress", "frozen_delegate", "rank_process", "restarting_delegate", "tick_every_s"]

#: A rank's interpreter ticks its monitor at least this many times per progress timeout.
TICKS_PER_TIMEOUT = 30


def tick_every_s(interval_s: float, timeout_s: float) -> float:
    """How often a rank's interpreter ticks its monitor: every interval, but no more often than 30 times
    per progress timeout (each tick wakes the rank's thread and its monitor: with the default 3 minutes,
    every 6 s rather than every second).

        >>> tick_every_s(1.0, 180.0), tick_every_s(0.25, 3.0)
        (6.0, 0.25)
    """
    return max(interval_s, timeout_s / TICKS_PER_TIMEOUT)


@dataclass
class RankProgress:
    """When the rank's interpreter last ticked (``last``), judged by ``timeout_s``; ``slack_s``: how much
    further apart than an interval its ticks come (:func:`tick_every_s`), waited for too, so that a rank
    whose interpreter stopped just before it would have ticked is judged after the timeout, not before."""

    timeout_s: float
    last: float
    published: bool = False
    slack_s: float = 0.0

    def tick(self, now: float) -> None:
        """The rank's interpreter ran."""
        self.last, self.published = now, False

    def hung(self, rank: int, now: float) -> Optional[BoardEvent]:
        """The rank's loss, the first time its silence reaches the timeout (None: not, or said already)."""
        quiet = now - self.last
        if quiet < self.timeout_s + self.slack_s or self.published:
            return None
        self.published = True
        return BoardEvent(EventKind.LOST, rank, (
            f"it made no progress for {quiet:.0f} s (the progress timeout is {self.timeout_s:g} s): its "
            f"interpreter is stopped, or stuck holding the GIL"), by=rank)


def frozen_delegate(told_rank: Any, ring: Container[int], lost: Container[int], quiet: int, bound_s: float,
                    by: int) -> tuple[BoardEvent, ...]:
    """The loss of the delegate ``told_rank`` (as it last told its node) of a ring's ``ring`` ranks, silent
    for ``quiet`` intervals (the bound: ``bound_s``), by the standby ``by``; none where it is not one to publish.

        >>> frozen_delegate(8, ring=range(16), lost=(), quiet=5, bound_s=5.0, by=9)[0].reason[:40]
        "its monitor, its node's delegate, said n"
        >>> frozen_delegate(8, ring=range(16), lost=(8,), quiet=5, bound_s=5.0, by=9)
        ()
    """
    if not isinstance(told_rank, int) or told_rank not in ring or told_rank in lost:
        return ()
    return (BoardEvent(EventKind.LOST, told_rank, (
        f"its monitor, its node's delegate, said nothing for {quiet} intervals (the bound is {bound_s:g} s): "
        f"its monitor is stopped"), by=by),)


@functools.cache  # asked at every keep-alive; neither the pid nor its namespace changes
def rank_process(pid: int) -> Optional[tuple[int, int]]:
    """What a delegate tells its node of its rank's process ``pid``: the pid and its pid namespace
    (a pid means the same process only within one); None where it cannot be said (no pid, no /proc).

        >>> rank_process(os.getpid())[0] == os.getpid(), rank_process(0)
        (True, None)
    """
    if pid <= 0:
        return None
    try:
        return pid, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def restarting_delegate(told: Mapping[str, Any]) -> Optional[int]:
    """The rank of the node's last delegate, as ``told``, where its process still runs here after its
    monitor went (killed alone: the rank's heartbeat starts another); None where it is gone, or cannot
    be seen from this process (another pid namespace: a container of its own on the node).

        >>> restarting_delegate({"me": 3, "process": rank_process(os.getpid())})
        3
        >>> restarting_delegate({"me": 3, "process": [2 ** 22 + 1, rank_process(os.getpid())[1]]}) is None
        True
    """
    me, process, here = told.get("me"), told.get("process"), rank_process(os.getpid())
    # ``process`` came as JSON (a list); only a pid in this process's own namespace can be looked up.
    if not isinstance(me, int) or not isinstance(process, (list, tuple)) or here is None or tuple(process[1:]) != here[1:]:
        return None
    try:
        with open(f"/proc/{int(process[0])}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError, ValueError):
        return None
    return me if state not in ("Z", "X") else None  # an ended process not yet reaped has ended
