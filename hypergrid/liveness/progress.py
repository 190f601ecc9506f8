"""Silence judged by a monitor: its own rank's interpreter that stopped ticking, its delegate that stopped speaking.

A rank's heartbeat thread ticks its monitor every interval, which needs the rank's GIL: a rank
whose interpreter sent no tick for ``timeout_s`` (stopped, or stuck holding the GIL) is hung, and
published once until it ticks again. A follower standing by publishes its delegate's rank once the
delegate said nothing for the staleness bound: the delegate's monitor is stopped.

Example, a progress timeout of 30 s::

    >>> progress = RankProgress(timeout_s=30.0, last=0.0)
    >>> progress.hung(rank=3, now=29.0) is None, progress.hung(rank=3, now=31.0).reason[:36]
    (True, 'it made no progress for 31 s (the pr')
    >>> progress.hung(rank=3, now=40.0) is None               # published once
    True
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Optional

from ..store.records import BoardEvent, EventKind

__all__ = ["RankProgress", "frozen_delegate"]


@dataclass
class RankProgress:
    """When the rank's interpreter last ticked (``last``), judged by ``timeout_s``."""

    timeout_s: float
    last: float
    published: bool = False

    def tick(self, now: float) -> None:
        """The rank's interpreter ran."""
        self.last, self.published = now, False

    def hung(self, rank: int, now: float) -> Optional[BoardEvent]:
        """The rank's loss, the first time its silence reaches the timeout (None: not, or said already)."""
        quiet = now - self.last
        if quiet < self.timeout_s or self.published:
            return None
        self.published = True
        return BoardEvent(EventKind.LOST, rank, (
            f"it made no progress for {quiet:.0f} s (the progress timeout is {self.timeout_s:g} s): its "
            f"interpreter is stopped, or stuck holding the GIL"), by=rank)


def frozen_delegate(told_rank: Any, ring: Container[int], lost: Container[int], quiet: int, bound_s: float,
                    by: int) -> Optional[BoardEvent]:
    """The loss of the delegate ``told_rank`` (as it last told its node) of a ring's ``ring`` ranks, silent
    for ``quiet`` intervals (the bound: ``bound_s``), by the standby ``by``; None where it is not one to publish.

        >>> frozen_delegate(8, ring=range(16), lost=(), quiet=5, bound_s=5.0, by=9).reason[:40]
        "its monitor, its node's delegate, said n"
    """
    if not isinstance(told_rank, int) or told_rank not in ring or told_rank in lost:
        return None
    return BoardEvent(EventKind.LOST, told_rank, (
        f"its monitor, its node's delegate, said nothing for {quiet} intervals (the bound is {bound_s:g} s): "
        f"its monitor is stopped"), by=by)
