"""The plan of a restore, made by each rank for its own part (:func:`plan_own_part`), or, where the
placement does not tell where a block is, from every rank's report (:func:`plan_from_reports`).

Each rank's part (:class:`OwnPart`) follows from what all ranks share (:class:`~hypergrid.training.routes.Routes`:
the placements before and after, the replica dim, the partner ring) and from what only its peers
know: which snapshots and copies they hold. The exchange is point to point among the ranks that
trade blocks, in two rounds:

1. **Answers.** Each keeper tells each receiver that will ask it (:meth:`Routes.owed`) which steps
   it holds of the sources it asks about.
2. **Requests.** Once the step is agreed (an all-reduce of one number, until every rank can be
   served at it), each receiver tells each keeper it heard from which blocks it takes from it,
   and whose values, RNG and objects.

Every world-wide collective is of a fixed size: whether anyone cannot derive its part, the step,
and whether a digest failed or anything moves. So what a rank receives to plan grows with its
state and its peers, never with the world.

Example: the plan of one rank alone, which holds its own snapshot of step 3::

    >>> import torch, torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from hypergrid.layout import GridLayout
    >>> from hypergrid.training.state import Snapshot
    >>> from hypergrid.training.routes import Routes
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    >>> layout = GridLayout((1,), ("dp",))
    >>> region = Region((), (2,), (0,), (2,), torch.float32, sharding=())
    >>> own = Snapshot(3, {("w",): torch.ones(2)}, rank=0, regions={("w",): region}, coords=(("dp", 0),))
    >>> done = plan_own_part(Routes(layout, layout, "dp"), {("w",): region}, {(0, 3): own}, 3,
    ...                      GroupExchange(dist.group.WORLD))
    >>> [(p.holder, p.source) for p in done.plan.parts], done.moved
    ([(0, 0)], False)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol, TypeVar

import torch
import torch.distributed as dist

from ..errors import SnapshotCorrupted
from .regions import Coords, Held, Part, Path, Region, RelayPlan, Wanted, plan_relay, plan_whole, table_of
from .routes import Need, NotDerivable, Routes
from .transfer import collective_device, wait_all

__all__ = ["OwnPart", "Answer", "Request", "OwnPlan", "Traffic", "Exchange", "GroupExchange", "plan_own_part", "plan_from_reports",
           "first_corrupted"]

logger = logging.getLogger(__name__)


class Kept(Protocol):
    """What a restore reads of a snapshot it holds: its regions and where its source sat."""

    regions: Mapping[Path, Region]
    coords: Coords


@dataclass(frozen=True)
class Answer:
    """A keeper's word to a receiver: the ``steps`` it holds of ``source``'s snapshot."""

    source: int
    steps: tuple[int, ...]


@dataclass(frozen=True)
class Request:
    """A receiver's word to a keeper: the blocks it takes from it, and the source whose other
    values, RNG and objects it takes from it (None: from someone else)."""

    parts: tuple[Part, ...] = ()
    template: Optional[int] = None


@dataclass
class Traffic:
    """What a rank received to plan its restore (state blocks not counted): ``bytes_in``, and the
    ``peers`` it exchanged with."""

    bytes_in: int = 0
    peers: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class OwnPlan:
    """A rank's part of the restore: the ``plan`` (its own receives and sends), the snapshots of
    the plan's step it holds by source (``held``), whether any rank's state moves, and the
    traffic it took."""

    plan: RelayPlan
    held: Mapping[int, Any]
    moved: bool
    traffic: Traffic


class OwnPart:
    """One rank's part of a restore, from the shared placements (``routes``), its live state's
    regions (``wanted``) and the snapshots it holds (``held``, by (source, step)).

    Example: rank 8 took rank 2's place (tp 2 x dp 4, nodes of 2); rank 4 holds rank 2's copy of step 3::

        >>> import torch
        >>> from hypergrid.layout import GridLayout
        >>> from hypergrid.layout.rank_map import RankMap
        >>> old = GridLayout((2, 4), ("tp", "dp"))
        >>> new = GridLayout((2, 4), ("tp", "dp"), rank_map=RankMap.of([0, 1, 8, 9, 4, 5, 6, 7]))
        >>> routes = Routes(old, new, replica_dim="none", gpus_per_node=2)
        >>> def w(dp): return {("w",): Region((("tp", 0), ("dp", dp)), (4,), (0,), (4,), torch.float32, sharding=())}
        >>> spare = OwnPart(routes, 8, w(1), {})
        >>> keeper = OwnPart(routes, 4, w(2), {(4, 3): Held(4, 4, 3, False, (("tp", 0), ("dp", 2)), w(2)),
        ...                                    (2, 3): Held(4, 2, 3, True, (("tp", 0), ("dp", 1)), w(1))})
        >>> spare.heard_from, keeper.answers()
        ([4], {8: (Answer(source=2, steps=(3,)),)})
        >>> parts, template, requests = spare.choose(3, {4: keeper.answers()[8]})
        >>> [(p.holder, p.source) for p in parts], template, list(requests)
        ([(4, 2)], (4, 2), [4])
        >>> keeper.plan(3, [], (4, 4), {8: requests[4]}).templates
        {4: (4, 4), 8: (4, 2)}
    """

    def __init__(self, routes: Routes, rank: int, wanted: Mapping[Path, Region],
                 held: Mapping[tuple[int, int], Kept]) -> None:
        self.routes, self.rank, self.wanted = routes, rank, wanted
        old = routes.old
        # Only snapshots taken on the old placement count: a source's own coordinates there.
        self.held = {key: kept for key, kept in held.items()
                     if old.contains(key[0]) and tuple(kept.coords) == _coords(old, key[0])}
        if old.contains(rank):
            own = [kept for (source, _), kept in sorted(self.held.items()) if source == rank]
            if not own:
                raise NotDerivable(f"rank {rank} holds no snapshot of its place {_coords(old, rank)} in the old grid")
            if set(own[-1].regions) != set(wanted):  # its keepers derive from the snapshot's tensors
                strange = sorted(set(own[-1].regions) ^ set(wanted), key=repr)[:3]
                raise NotDerivable(f"rank {rank}'s live state and its snapshot hold different tensors ({strange})")
        self.needs: list[Need] = routes.needs(rank, wanted)
        self.template_sources = routes.template_sources(rank)
        self.heard_from = routes.asks(rank, self.needs)
        kept: dict[int, Mapping[Path, Region]] = {}
        for (source, _), snapshot in sorted(self.held.items()):
            kept[source] = snapshot.regions  # the latest step's, sorted last
        self.owed = routes.owed(rank, kept)

    def answers(self) -> dict[int, tuple[Answer, ...]]:
        """What this rank tells each receiver that asks it: the steps it holds of each source."""
        return {receiver: tuple(Answer(source, self._steps(source)) for source in sources)
                for receiver, sources in self.owed.items()}

    def steps_served(self, answers: Mapping[int, Sequence[Answer]]) -> set[int]:
        """The steps at which every block and the template this rank needs are held by someone it
        heard from or by itself."""
        held: dict[int, set[int]] = {}
        for source, step in self.held:
            held.setdefault(source, set()).add(step)
        for said in answers.values():
            for answer in said:
                held.setdefault(answer.source, set()).update(answer.steps)
        served: Optional[set[int]] = None
        for sources in [n.sources if not n.own else (self.rank,) for n in self.needs] + [self.template_sources]:
            steps = set().union(*(held.get(s, set()) for s in sources))
            served = steps if served is None else served & steps
        return served or set()

    def choose(self, step: int, answers: Mapping[int, Sequence[Answer]]
               ) -> tuple[list[Part], tuple[int, int], dict[int, Request]]:
        """At ``step``: the parts this rank receives (itself first, then a source's own snapshot
        before its copy), the (holder, source) of its template, and its request to each keeper it
        heard from (empty where it takes nothing from it)."""
        holds = {(keeper, a.source) for keeper, said in answers.items() for a in said if step in a.steps}
        holds |= {(self.rank, source) for source, at in self.held if at == step}

        def holder(sources: Sequence[int]) -> tuple[int, int]:
            mine = [s for s in sources if (self.rank, s) in holds]
            if mine:
                return self.rank, mine[0]
            for source in sources:
                for keeper in self.routes.keepers(source):
                    if (keeper, source) in holds:
                        return keeper, source
            raise NotDerivable(f"rank {self.rank}: nobody it heard from holds step {step} of {list(sources)}")

        parts = [Part(self.rank, n.path, *(holder((self.rank,) if n.own else n.sources)), n.offsets, n.shape)
                 for n in self.needs]
        template = holder(self.template_sources)
        requests = {keeper: Request(tuple(p for p in parts if p.holder == keeper),
                                    template[1] if template[0] == keeper else None) for keeper in self.heard_from}
        return parts, template, requests

    def plan(self, step: int, parts: Sequence[Part], template: tuple[int, int],
             requests: Mapping[int, Request]) -> RelayPlan:
        """This rank's :class:`RelayPlan`: what it receives, and what the receivers asked of it."""
        sent = [p for request in requests.values() for p in request.parts]
        templates = {self.rank: template}
        templates.update({receiver: (self.rank, r.template) for receiver, r in requests.items()
                          if r.template is not None})
        return RelayPlan(step, tuple(parts) + tuple(sent), templates)

    def _steps(self, source: int) -> tuple[int, ...]:
        return tuple(sorted(step for s, step in self.held if s == source))


class Exchange(Protocol):
    """How a rank's part of a restore talks to the others: a fixed-size all-reduce (the most of
    each value), and a point-to-point swap of small objects; each counts what it received
    (``traffic``). :class:`GroupExchange` speaks over a process group; a benchmark may simulate
    the others."""

    traffic: Traffic

    def agreed_max(self, values: list[int]) -> list[int]: ...

    def swap(self, sends: Mapping[int, Any], receives: Sequence[int]) -> dict[int, Any]: ...


class GroupExchange:
    """:class:`Exchange` over ``group`` (global ranks): all-reduces, and pickled objects point to point."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.traffic = group, Traffic()

    def agreed_max(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64, device=collective_device(self.group))
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        self.traffic.bytes_in += tensor.numel() * tensor.element_size()
        return [int(v) for v in tensor.tolist()]

    def swap(self, sends: Mapping[int, Any], receives: Sequence[int]) -> dict[int, Any]:
        """Send each value of ``sends`` to its rank and receive one from each rank of ``receives``:
        the sizes, then the pickled bytes."""
        group, device = self.group, collective_device(self.group)
        out = {peer: pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) for peer, value in sends.items()}
        sizes_out = {peer: torch.tensor([len(data)], dtype=torch.int64, device=device) for peer, data in out.items()}
        sizes_in = {peer: torch.zeros(1, dtype=torch.int64, device=device) for peer in receives}
        wait_all([dist.P2POp(dist.isend, size, peer, group) for peer, size in sizes_out.items()]
              + [dist.P2POp(dist.irecv, size, peer, group) for peer, size in sizes_in.items()])
        incoming = {peer: torch.empty(int(size.item()), dtype=torch.uint8, device=device)
                    for peer, size in sizes_in.items()}
        outgoing = {peer: torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) for peer, data in out.items()}
        wait_all([dist.P2POp(dist.isend, data, peer, group) for peer, data in outgoing.items()]
              + [dist.P2POp(dist.irecv, data, peer, group) for peer, data in incoming.items()])
        self.traffic.bytes_in += sum(8 + data.numel() for data in incoming.values())
        return {peer: pickle.loads(data.cpu().numpy().tobytes()) for peer, data in incoming.items()}  # noqa: S301


def plan_own_part(routes: Routes, wanted: Mapping[Path, Region], held: Mapping[tuple[int, int], Any], target: int,
                  exchange: Exchange, rank: Optional[int] = None) -> Optional[OwnPlan]:
    """This rank's part of the restore at the latest step at most ``target`` that serves every rank
    (every rank of the job's grid calls it, each with its ``exchange``). None, alike on every rank, where some rank cannot derive
    its part, no step serves every rank, or a snapshot to send from failed its digest: then the
    plan is made from every rank's report (:func:`plan_from_reports`), which says what is missing
    or corrupted."""
    rank = dist.get_rank() if rank is None else rank
    traffic = exchange.traffic
    try:
        part: Optional[OwnPart] = OwnPart(routes, rank, wanted, held)
    except NotDerivable as why:
        logger.info("rank %d: the restore is planned from every rank's report: %s", rank, why)
        part = None
    if exchange.agreed_max([int(part is None)])[0]:
        return None
    assert part is not None
    traffic.peers = set(part.heard_from) | set(part.owed)
    answers = exchange.swap(part.answers(), part.heard_from)
    served = part.steps_served(answers)
    step = target
    while exchange.agreed_max([int(step not in served)])[0]:  # some rank cannot be served at it
        step = exchange.agreed_max([max((s for s in served if s < step), default=-1)])[0]
        if step < 0:
            return None
    try:
        parts, template, requests = part.choose(step, answers)
        failed = None
    except NotDerivable as why:
        failed, parts, template, requests = why, [], (rank, rank), {k: Request() for k in part.heard_from}
    plan = part.plan(step, parts, template, exchange.swap(requests, sorted(part.owed)))
    ours = {source: s for (source, at), s in part.held.items() if at == step}
    problem = failed or _unheld(plan, ours, rank) or first_corrupted(plan, ours, rank)
    flags = exchange.agreed_max([int(problem is not None), int(plan.moves)])
    if flags[0]:
        if problem is not None:
            logger.info("rank %d: the restore is planned from every rank's report: %s", rank, problem)
        return None
    return OwnPlan(plan, ours, bool(flags[1]), traffic)


def first_corrupted(plan: RelayPlan, held: Mapping[int, Any], rank: int) -> Optional[SnapshotCorrupted]:
    """The first snapshot this rank sends or takes from in ``plan`` (``held``: by source) that fails
    its digest, None where all pass."""
    used = sorted({p.source for p in plan.parts if p.holder == rank}
                  | {source for holder, source in plan.templates.values() if holder == rank})
    for source in used:
        what = (f"rank {rank}'s own snapshot" if source == rank
                else f"the copy of rank {source}'s snapshot held by rank {rank}")
        try:
            held[source].verify(what=what)
        except SnapshotCorrupted as corrupted:
            return corrupted
    return None


def _unheld(plan: RelayPlan, held: Mapping[int, Any], rank: int) -> Optional[NotDerivable]:
    """A block asked of this rank that the snapshot it names does not hold (the receiver's rule
    and the snapshot disagree)."""
    for part in plan.parts:
        if part.holder != rank:
            continue
        if part.source not in held:
            return NotDerivable(f"rank {rank} was asked for rank {part.source}'s snapshot of step {plan.step}, "
                                f"which it does not hold")
        region = held[part.source].regions.get(part.path) if part.source in held else None
        if region is None or region.overlap(replace(region, offsets=part.offsets, shape=part.shape)) != (
                part.offsets, part.shape):
            return NotDerivable(f"rank {rank} was asked for {part.path} at {part.offsets} of rank {part.source}'s "
                                f"snapshot, which does not hold it")
    for holder, source in plan.templates.values():
        if holder == rank and source not in held:
            return NotDerivable(f"rank {rank} was asked for rank {source}'s snapshot of step {plan.step}, "
                                f"which it does not hold")
    return None


def plan_from_reports(wanted: Wanted, held: Sequence[Held], target: int, replica_dim: str,
                      group: Optional[dist.ProcessGroup]) -> tuple[RelayPlan, list[Held]]:
    """The plan from every rank's report (each rank of ``group`` calls it): first by the tables'
    names alone (:func:`~hypergrid.training.regions.plan_whole`: where every rank's state is the
    whole of a snapshot held at ``target``), else region by region
    (:func:`~hypergrid.training.regions.plan_relay`). Returns the plan and every rank's holdings
    (for a message where something is missing)."""
    named = gathered((_by_table(wanted), [_by_table(h) for h in held]), group)
    everyone = [h for _, hs in named for h in hs]
    plan = plan_whole([w for w, _ in named], everyone, target)
    if plan is None or plan.step != target:
        reports = gathered((wanted, held), group)
        everyone = [h for _, hs in reports for h in hs]
        plan = plan_relay([w for w, _ in reports], everyone, target, replica_dim)
    return plan, everyone


_Report = TypeVar("_Report", Held, Wanted)


def _by_table(report: _Report) -> _Report:
    """``report`` with its regions left out and named by their table: 16 bytes, not one line a tensor."""
    return replace(report, regions={}, table=table_of(report.regions))


def gathered(value: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """``value`` from every rank of ``group`` (just this rank's where there is no other)."""
    if group is None or dist.get_world_size(group) == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _coords(layout: Any, rank: int) -> Coords:
    return tuple(zip(layout.dim_names, layout.coords(rank)))
