"""Partner copies: every rank's snapshot also held, in host memory, by a rank on another node.

With FSDP2 or ZeRO each data-parallel rank holds a shard nobody else holds, and a node lost takes
its shards along. With partner copies on (``hypergrid.train(..., partner_copies=True)``), each
rank sends its snapshot (one host buffer, and its digests) to its **partner**: the rank holding
the same local index on the next node, the nodes taken in the grid's position order and closed
in a ring (:func:`partner_map`). So the loss of any one node leaves a copy of every shard, and
where every node holds as many of the grid's ranks, each rank holds exactly one other rank's copy.

A copy says which blocks of the job's state it holds (its regions), so after a recovery it
serves whoever needs them (:mod:`hypergrid.training.regions`): the rank that took the lost one's
place, or, where the data-parallel size changed, every rank whose new shard overlaps it.

Example: ranks 0-5 on nodes of 2 (node 0: 0, 1; node 1: 2, 3; node 2: 4, 5)::

    >>> partner_map([0, 1, 2, 3, 4, 5], gpus_per_node=2)
    {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from .state import Snapshot
from .transfer import Sending, start_sending

__all__ = ["partner_map", "PartnerCopies"]

logger = logging.getLogger(__name__)


def partner_map(ranks: Sequence[int], gpus_per_node: int) -> dict[int, int]:
    """Each rank of ``ranks`` (a grid's, in position order) -> the rank that holds its copy: the
    one with the same local index on the next node, nodes (``rank // gpus_per_node``) taken in the
    order their first rank appears and closed in a ring. Where the next node holds fewer of the
    grid's ranks, the index wraps round it (a rank may then hold more than one copy).

    Example::

        >>> partner_map([4, 5, 2, 3], gpus_per_node=2)     # node 2 first, as the grid orders it
        {4: 2, 5: 3, 2: 4, 3: 5}
        >>> partner_map([0, 1, 2], gpus_per_node=2)
        {0: 2, 1: 2, 2: 0}
        >>> partner_map([0, 1, 2, 3], gpus_per_node=4)
        Traceback (most recent call last):
        ...
        ValueError: partner copies need the grid on at least 2 nodes, so that a node lost leaves a copy of its ranks' state: the grid's 4 ranks [0, 1, 2, 3] are all on node 0 (gpus_per_node=4)

    Raises:
        ValueError: the ranks are all on one node (a copy there would go with it).
    """
    nodes: dict[int, list[int]] = {}
    for rank in ranks:
        nodes.setdefault(rank // gpus_per_node, []).append(rank)
    if len(nodes) < 2:
        raise ValueError(f"partner copies need the grid on at least 2 nodes, so that a node lost leaves a copy of its "
                         f"ranks' state: the grid's {len(ranks)} ranks {list(ranks)} are all on node "
                         f"{next(iter(nodes), 0)} (gpus_per_node={gpus_per_node})")
    order = list(nodes.values())
    partners: dict[int, int] = {}
    for index, members in enumerate(order):
        following = order[(index + 1) % len(order)]
        for local, rank in enumerate(members):
            partners[rank] = following[local % len(following)]
    return partners


# ---------------------------------------------------------------------- the copies a rank holds
class PartnerCopies:
    """The copies this rank holds of other ranks' snapshots, by the rank that sent each (at most
    the latest two steps of each), and the exchange that sends them at each snapshot on the job's
    placement: started after the snapshot, in flight while the next steps run, finished before
    the commit gate of the next snapshot.

    Example, with no process group (nothing is sent; copies are taken in by hand)::

        >>> import torch
        >>> copies = PartnerCopies(gpus_per_node=2)
        >>> copies.keep(2, Snapshot(4, {("model", "w"): torch.ones(2)}, rank=2))
        >>> [(c.rank, c.step) for c in copies.held()], copies.nbytes
        ([(2, 4)], 8)
        >>> copies.settle(5); copies.held()
        []
    """

    def __init__(self, gpus_per_node: int) -> None:
        self.gpus_per_node = gpus_per_node
        self.copies: dict[int, list[Snapshot]] = {}
        self._free: list[torch.Tensor] = []  # buffers of copies let go, reused by the next ones
        self._one_node: Optional[tuple[int, ...]] = None  # the placement a warning was given for
        self._sending: Optional[Sending] = None  # the exchange in flight
        self._abandoned: list[Sending] = []  # cut short by a failure: alive until their group is gone

    def start(self, snapshot: Snapshot, ranks: Sequence[int], group: Optional[dist.ProcessGroup]) -> None:
        """On every rank of the grid (``ranks``, position order; ``group`` over them): start
        sending ``snapshot`` to this rank's partner and receiving the copies sent to it, left in
        flight while training goes on (:meth:`finish` keeps them). Nothing on a grid of one node
        (logged once per placement)."""
        self.finish()
        if group is None:
            return
        try:
            partners = partner_map(ranks, self.gpus_per_node)
        except ValueError as one_node:
            if self._one_node != tuple(ranks):
                self._one_node = tuple(ranks)
                logger.warning("rank %d: no partner copies on this placement: %s", dist.get_rank(), one_node)
            return
        rank = dist.get_rank()
        sources = [source for source, holder in partners.items() if holder == rank and source != rank]
        self._sending = start_sending([(partners[rank], snapshot)], sources, group, buffer=self._buffer)

    def finish(self) -> None:
        """Wait for the copies in flight and keep them (raises where a peer failed on the way)."""
        sending, self._sending = self._sending, None
        self._abandoned.clear()  # a gate or a restore on a new group since: the old ones are gone
        if sending is None:
            return
        for source, copy in sending.wait().items():
            self.keep(source, copy)

    def salvage(self) -> None:
        """After a failure: keep the copies in flight that arrived whole, let the others go."""
        sending, self._sending = self._sending, None
        if sending is not None:
            self._abandoned.append(sending)
            for source, copy in sending.arrived().items():
                self.keep(source, copy)

    def keep(self, source: int, copy: Snapshot) -> None:
        """Hold ``copy`` of ``source``'s snapshot (beside the one before it, if any)."""
        held = [c for c in self.copies.get(source, []) if c.step != copy.step] + [copy]
        for dropped in held[:-2]:
            self._let_go(dropped)
        self.copies[source] = held[-2:]

    def settle(self, step: int) -> None:
        """Every rank holds its snapshot of ``step`` (the gate passed): copies of older steps go."""
        for source in list(self.copies):
            kept = [c for c in self.copies[source] if c.step >= step]
            for dropped in self.copies[source]:
                if dropped.step < step:
                    self._let_go(dropped)
            if kept:
                self.copies[source] = kept
            else:
                del self.copies[source]

    def held(self) -> list[Snapshot]:
        """Every copy held, each naming its source (``rank``) and ``step``."""
        return [copy for source in sorted(self.copies) for copy in self.copies[source]]

    def clear(self) -> None:
        """Let every copy go, and any in flight (the job resumed from somewhere no copy is of)."""
        if self._sending is not None:
            self._abandoned.append(self._sending)
        self._sending = None
        for held in self.copies.values():
            for copy in held:
                self._let_go(copy)
        self.copies.clear()

    @property
    def nbytes(self) -> int:
        """The host memory the copies hold."""
        return sum(c.buffer.numel() if c.buffer is not None else c.nbytes for held in self.copies.values() for c in held)

    def _let_go(self, copy: Snapshot) -> None:
        if copy.buffer is not None and len(self._free) < 2:
            self._free.append(copy.buffer)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        for index, free in enumerate(self._free):
            if free.numel() == nbytes:
                return self._free.pop(index)
        return torch.empty(nbytes, dtype=torch.uint8)
