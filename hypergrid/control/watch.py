"""The collective watch: a rank's communicators aborted when its job's board says they must be.

A rank blocked in a collective with a peer that died waits, on NCCL, for NCCL's own timeout. The
watch gets the rank out instead: its monitor forwards every event of the job's board
(:mod:`hypergrid.control.heartbeat`), and on a rank of the job lost, or a recovery round opened
after a failure, the watch aborts every abortable communicator this rank holds
(:func:`~hypergrid.control.abort.abort_all`), unless this rank's own code is inside the recovery.
No store request is made for it: the node's one pending wait on the board (its monitors' relay
leader's) is all it costs.

Events that cannot concern the job as this rank holds it now are passed over: a loss of a rank
the job no longer counts on (recovered from already), a rank offering itself back, a round
opened to grow the job (its participants arrive at a step's end, blocked in nothing), and rounds
from before the job's latest recovery.

Example::

    >>> from hypergrid.control.keys import JobChannel
    >>> from hypergrid.runtime.wire import BoardEvent, EventKind
    >>> watch = CollectiveWatch(JobChannel.of([0, 1], 0), ranks=[0, 1], first_round=2, groups=list)
    >>> watch.concerns(BoardEvent(EventKind.LOST, 1, "its process ended"))
    True
    >>> watch.concerns(BoardEvent(EventKind.LOST, 7, "its process ended")), \\
    ...     watch.concerns(BoardEvent(EventKind.ROUND, 0, "recover", number=1))
    (False, False)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch.distributed as dist

from ..runtime.wire import BoardEvent, EventKind
from .abort import abort_all, in_recovery
from .keys import JobChannel

__all__ = ["CollectiveWatch"]

logger = logging.getLogger(__name__)


class CollectiveWatch:
    """Aborts this rank's communicators on the events of ``channel``'s board that concern the job
    over ``ranks`` as of round ``first_round``; ``groups()`` lists the communicators this rank holds."""

    def __init__(self, channel: JobChannel, *, ranks: Sequence[int], first_round: int,
                 groups: Callable[[], Sequence[dist.ProcessGroup]]) -> None:
        self.channel = channel
        self.ranks = frozenset(ranks)
        self.first_round = first_round
        self._groups = groups
        self.active = True
        # The groups aborted already, held so that their ids are not reused by new groups.
        self._done: dict[int, dist.ProcessGroup] = {}

    def concerns(self, event: BoardEvent) -> bool:
        """Whether ``event`` means this rank's collectives may be blocked on a peer that will not come."""
        if event.kind is EventKind.LOST:
            return event.rank in self.ranks
        if event.kind is EventKind.ROUND:
            return event.number >= self.first_round and event.reason == "recover"
        return False

    def __call__(self, event: BoardEvent) -> None:
        if not self.active or in_recovery() or not self.concerns(event):
            return
        targets = [pg for pg in self._groups() if id(pg) not in self._done]
        self._done.update((id(pg), pg) for pg in targets)
        count = abort_all(targets)
        if count:
            what = (f"rank {event.rank} was lost ({event.reason})" if event.kind is EventKind.LOST
                    else f"recovery round {event.number} of the job opened")
            logger.warning("rank %d: %s: aborted %d communicators to leave any collective in flight",
                           dist.get_rank() if dist.is_initialized() else -1, what, count)
