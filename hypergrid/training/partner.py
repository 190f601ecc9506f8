"""Partner copies: every rank's snapshot also held, in host memory, by a rank on another node.

With FSDP2 or ZeRO each data-parallel rank holds a shard nobody else holds, and a node lost takes
its shards along. With partner copies on (``hypergrid.train(..., partner_copies=True)``), each
rank sends its snapshot (one host buffer, and its digests) to its **partner**: the rank holding
the same local index on the next node, the nodes taken in the grid's position order and closed
in a ring (:func:`partner_map`). So the loss of any one node leaves a copy of every shard, and
where every node holds as many of the grid's ranks, each rank holds exactly one other rank's copy.

After a recovery, every rank of the grid reports which snapshots and copies it holds (one
object all-gather); each then derives the same :class:`RestorePlan` from the reports
(:func:`plan_restore`): for each rank that just took a position, a replica peer's own snapshot,
else the copy a surviving partner held of the rank whose position it took; the snapshots travel
point to point (:func:`send_snapshots`). Positions with neither are named in
:attr:`RestorePlan.lost`.

Example: ranks 0-5 on nodes of 2 (node 0: 0, 1; node 1: 2, 3; node 2: 4, 5)::

    >>> partner_map([0, 1, 2, 3, 4, 5], gpus_per_node=2)
    {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from .state import Snapshot
from .transfer import collective_device, packed, unpacked

__all__ = ["partner_map", "PartnerCopies", "RestorePlan", "Source", "plan_restore", "send_snapshots", "ancestors"]

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


def ancestors(rank: int, replacements: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """The ranks whose position ``rank`` holds now, latest first: ``replacements`` are the
    recoveries' (failed, spare) pairs, oldest first.

    Example: rank 4 took rank 2's place, then rank 6 took rank 4's::

        >>> ancestors(6, [[(2, 4), (3, 5)], [(4, 6)]])
        [4, 2]
    """
    chain, current = [], rank
    for pairs in reversed(replacements):
        before = {new: old for old, new in pairs}
        if current in before:
            current = before[current]
            chain.append(current)
    return chain


# ---------------------------------------------------------------------- sending snapshots point to point
def send_snapshots(sends: Sequence[tuple[int, Snapshot]], receives: Sequence[int], group: dist.ProcessGroup, *,
                   buffer: Optional[Callable[[int], torch.Tensor]] = None) -> dict[int, Snapshot]:
    """Send each ``(rank, snapshot)`` of ``sends`` to its rank and receive one snapshot from each
    rank of ``receives``, over ``group`` (global ranks), in two batches of point-to-point
    operations: the sizes, then each snapshot's header and its one buffer (over NCCL through this
    rank's device). Every rank named on either side calls it with the matching entries.
    ``buffer(nbytes)``: where a received buffer goes (default: a new one). Returns the snapshots
    received, by the rank that sent each.

    Example, a rank with nothing to send or receive (it makes no call)::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> send_snapshots([], [], dist.group.WORLD)
        {}
        >>> dist.destroy_process_group()

    ``tests/test_partner.py`` sends them between gloo ranks.
    """
    device = collective_device(group)
    outgoing = [(peer, *packed(snapshot)) for peer, snapshot in sends]
    sizes_out = [torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=device)
                 for _, header, payload in outgoing]
    sizes_in = {peer: torch.empty(2, dtype=torch.int64, device=device) for peer in receives}
    _run([dist.P2POp(dist.isend, size, peer, group) for size, (peer, _, _) in zip(sizes_out, outgoing)]
         + [dist.P2POp(dist.irecv, size, peer, group) for peer, size in sizes_in.items()])
    incoming: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for peer, size in sizes_in.items():
        header_len, payload_len = (int(v) for v in size.tolist())
        host = buffer(payload_len) if buffer is not None else torch.empty(payload_len, dtype=torch.uint8)
        incoming[peer] = (torch.empty(header_len, dtype=torch.uint8, device=device),
                          host if device.type == "cpu" else torch.empty(payload_len, dtype=torch.uint8, device=device))
    ops = []
    for peer, header, payload in outgoing:
        ops.append(dist.P2POp(dist.isend, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), peer, group))
        ops.append(dist.P2POp(dist.isend, payload.to(device), peer, group))
    for peer, (header_in, payload_in) in incoming.items():
        ops.append(dist.P2POp(dist.irecv, header_in, peer, group))
        ops.append(dist.P2POp(dist.irecv, payload_in, peer, group))
    _run(ops)
    received = {}
    for peer, (header_in, payload_in) in incoming.items():
        host = payload_in
        if device.type != "cpu":
            host = (buffer(payload_in.numel()) if buffer is not None
                    else torch.empty(payload_in.numel(), dtype=torch.uint8))
            host.copy_(payload_in)
        received[peer] = unpacked(header_in.cpu().numpy().tobytes(), host)
    return received


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# ---------------------------------------------------------------------- the copies a rank holds
class PartnerCopies:
    """The copies this rank holds of other ranks' snapshots, by the rank that sent each (at most
    the latest two steps of each: the one the commit gate passed and the one sent since), and the
    exchange that re-forms them at each snapshot on the job's placement.

    Example, with no process group (nothing is sent; copies are taken in by hand)::

        >>> import torch
        >>> copies = PartnerCopies(gpus_per_node=2)
        >>> copies.keep(2, Snapshot(4, {("model", "w"): torch.ones(2)}, rank=2))
        >>> copies.report(), copies.take(2, 4).step, copies.nbytes
        ([(2, 4)], 4, 8)
        >>> copies.settle(5); copies.report()
        []
    """

    def __init__(self, gpus_per_node: int) -> None:
        self.gpus_per_node = gpus_per_node
        self.copies: dict[int, list[Snapshot]] = {}
        self.exchange_s: list[float] = []  # each exchange's time on this rank, for the record
        self._free: list[torch.Tensor] = []  # buffers of copies let go, reused by the next ones
        self._one_node: Optional[tuple[int, ...]] = None  # the placement a warning was given for

    def exchange(self, snapshot: Snapshot, ranks: Sequence[int], group: Optional[dist.ProcessGroup]) -> None:
        """On every rank of the grid (``ranks``, position order; ``group`` over them): send
        ``snapshot`` to this rank's partner and keep the copies sent to it. Nothing on a grid
        of one node (logged once per placement)."""
        if group is None:
            return
        try:
            partners = partner_map(ranks, self.gpus_per_node)
        except ValueError as one_node:
            if self._one_node != tuple(ranks):
                self._one_node = tuple(ranks)
                logger.warning("rank %d: no partner copies on this placement: %s", dist.get_rank(), one_node)
            return
        start, rank = time.perf_counter(), dist.get_rank()
        sources = [source for source, holder in partners.items() if holder == rank and source != rank]
        got = send_snapshots([(partners[rank], snapshot)], sources, group, buffer=self._buffer)
        for source, copy in got.items():
            self.keep(source, copy)
        self.exchange_s.append(time.perf_counter() - start)

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

    def report(self) -> list[tuple[int, int]]:
        """(source rank, step) of every copy held."""
        return sorted((source, c.step) for source, held in self.copies.items() for c in held)

    def take(self, source: int, step: int) -> Snapshot:
        """The copy of ``source``'s snapshot of ``step``.

        Raises:
            KeyError: none is held.
        """
        for copy in self.copies.get(source, []):
            if copy.step == step:
                return copy
        raise KeyError(f"rank {dist.get_rank() if dist.is_initialized() else 0} holds no copy of rank {source}'s "
                       f"snapshot of step {step} (it holds {self.report()})")

    def clear(self) -> None:
        """Let every copy go (the job resumed from somewhere no copy is of)."""
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


# ---------------------------------------------------------------------- where each rank's state comes from
@dataclass(frozen=True)
class Source:
    """Where a rank that took a position gets its snapshot: from ``holder``, whose own snapshot
    it is (a replica peer; ``copy`` False) or who holds a copy of rank ``shard``'s (``copy`` True)."""

    holder: int
    shard: int
    copy: bool


@dataclass(frozen=True)
class RestorePlan:
    """What every rank of the grid derives alike from the reports: the ``step`` the job resumes
    from, each arriving rank's :class:`Source`, and the positions no snapshot or copy of that step
    survived for, as (position, rank now, shard's rank before) triples."""

    step: int
    sources: dict[int, Source] = field(default_factory=dict)
    lost: tuple[tuple[int, int, int], ...] = ()


#: What a rank reports after a recovery: the steps of its own snapshots, and the (source rank,
#: step) of each copy it holds.
Report = tuple[Sequence[int], Sequence[tuple[int, int]]]


def plan_restore(ranks: Sequence[int], arrived: frozenset[int], replicas: Callable[[int], Sequence[int]],
                 chains: Mapping[int, Sequence[int]], reports: Mapping[int, Report], target: int) -> RestorePlan:
    """The latest step, at most ``target``, that every rank that was there holds and that every
    rank that arrived can get (a replica peer's snapshot, else a copy of a rank whose position it
    took, in ``chains``' order); where no step serves every rank, ``target``, with what is lost.

    Example: dp 4 on ranks 0-3, nodes of 2; node 1 (ranks 2, 3) replaced by ranks 4, 5; ranks 0
    and 1 hold copies of 2 and 3 (their partners); no replica peers::

        >>> reports = {0: ([3], [(2, 3)]), 1: ([3], [(3, 3)]), 4: ([], []), 5: ([], [])}
        >>> plan = plan_restore([0, 1, 4, 5], frozenset({4, 5}), lambda r: [r], {4: [2], 5: [3]}, reports, 3)
        >>> plan.step, plan.sources[4], plan.lost
        (3, Source(holder=0, shard=2, copy=True), ())
        >>> plan_restore([0, 1, 4, 5], frozenset({4, 5}), lambda r: [r], {4: [2], 5: [3]},
        ...              {**reports, 1: ([3], [])}, 3).lost
        ((3, 5, 3),)
    """
    there = [r for r in ranks if r not in arrived]
    held = {r: set(reports.get(r, ((), ()))[0]) for r in there}
    copies = {r: set(reports.get(r, ((), ()))[1]) for r in there}
    common = set.intersection(*held.values()) if held else {target}
    steps = sorted({s for s in common if s <= target} | {target}, reverse=True)
    first: Optional[RestorePlan] = None
    for step in steps:
        sources: dict[int, Source] = {}
        lost = []
        for position, rank in enumerate(ranks):
            if rank not in arrived:
                continue
            peer = next((p for p in replicas(rank) if p in held and step in held[p]), None)
            if peer is not None:
                sources[rank] = Source(peer, peer, False)
                continue
            found = next(((h, shard) for shard in chains.get(rank, ()) for h in there if (shard, step) in copies[h]),
                         None)
            if found is not None:
                sources[rank] = Source(found[0], found[1], True)
            else:
                chain = chains.get(rank, ())
                lost.append((position, rank, chain[0] if chain else rank))
        plan = RestorePlan(step, sources, tuple(lost))
        if not lost and all(step in held[r] for r in there):
            return plan
        first = first or plan
    assert first is not None
    return first


def describe_lost(plan: RestorePlan, holders: Mapping[int, int]) -> str:
    """The positions whose state no copy kept, for a person: ``holders`` maps a shard's rank to
    the rank that held its copy (its partner before the failure).

    Example::

        >>> describe_lost(RestorePlan(3, lost=((2, 4, 2), (3, 5, 3))), {2: 0, 3: 1})
        'position 2 (rank 2, its copy held by rank 0), position 3 (rank 3, its copy held by rank 1)'
    """
    return ", ".join(f"position {position} (rank {shard}, its copy held by rank "
                     f"{holders[shard] if shard in holders else 'none'})" for position, _, shard in plan.lost)


def exchange_summary(copies: PartnerCopies) -> dict[str, Any]:
    """The copies' cost on this rank so far: exchanges, their mean seconds, the bytes held.

    Example::

        >>> exchange_summary(PartnerCopies(gpus_per_node=2))
        {'exchanges': 0, 'mean_s': 0.0, 'held_bytes': 0}
    """
    times = copies.exchange_s
    return {"exchanges": len(times), "mean_s": sum(times) / len(times) if times else 0.0, "held_bytes": copies.nbytes}
