"""Snapshots on the wire: broadcast to a group (:func:`share_snapshot`), sent point to point
(:func:`send_snapshots`, or left in flight: :func:`start_sending`, as partner copies travel), and
a restore plan carried out (:func:`relay`: whole snapshots, or blocks cut from them).

A snapshot travels as its header (layout, other values, RNG, objects, digests, regions;
:func:`packed`) and its one host buffer. Over NCCL the buffer travels through the device of the
rank; over gloo it stays in host memory.

Example, one rank alone (a group of one: the snapshot is its own)::

    >>> import torch, torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from hypergrid.training.state import Snapshot
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    >>> sent = Snapshot(3, tensors={("model", "w"): torch.ones(2)})
    >>> share_snapshot(sent, source=0, group=dist.group.WORLD).step
    3
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from .regions import Part, Region, RelayPlan, block_of
from .state import Path, Snapshot, buffer_for, view_of

__all__ = ["share_snapshot", "send_snapshots", "start_sending", "Sending", "relay", "collective_device", "packed", "unpacked",
           "wait_all"]


def share_snapshot(snapshot: Optional[Snapshot], *, source: int, group: dist.ProcessGroup) -> Snapshot:
    """``source``'s snapshot, on every rank of ``group`` (each calls it; ``snapshot`` is read on
    ``source`` only, the others may pass None).

    Raises:
        ValueError: ``source`` is not a rank of ``group``, or has no snapshot to send.
    """
    members = dist.get_process_group_ranks(group)
    if source not in members:
        raise ValueError(f"the snapshot's source, rank {source}, is not a rank of the group {members}")
    rank = dist.get_rank()
    if len(members) == 1:
        assert snapshot is not None
        return snapshot
    if rank == source and snapshot is None:
        raise ValueError(f"rank {source} is the source of a snapshot but has none to send")
    header: list[object] = [None, 0]
    if rank == source:
        assert snapshot is not None
        pickled, buffer = packed(snapshot)
        header = [pickled, buffer.numel()]
    dist.broadcast_object_list(header, src=source, group=group)
    device = collective_device(group)
    if rank == source:
        dist.broadcast(buffer.to(device), src=source, group=group)
        assert snapshot is not None
        return snapshot
    incoming = torch.empty(int(header[1]), dtype=torch.uint8, device=device)  # type: ignore[call-overload]
    dist.broadcast(incoming, src=source, group=group)
    return unpacked(header[0], incoming.cpu())  # type: ignore[arg-type]


def packed(snapshot: Snapshot) -> tuple[bytes, torch.Tensor]:
    """What travels with a snapshot's buffer (its layout, other values, RNG, objects, digests),
    pickled, and the buffer (the snapshot's own, or one packed now for a snapshot without one).

    Example::

        >>> import torch
        >>> header, buffer = packed(Snapshot(3, tensors={("model", "w"): torch.ones(2)}))
        >>> unpacked(header, buffer).tensors[("model", "w")].tolist()
        [1.0, 1.0]
    """
    buffer = snapshot.buffer
    tensors = snapshot.tensors
    if buffer is None:
        buffer, views = buffer_for(list(tensors.items()), None)
        for view, tensor in zip(views, tensors.values()):
            view.copy_(tensor)
        tensors = dict(zip(tensors, views))
    base = buffer.data_ptr()
    layout = [(path, tuple(t.shape), t.dtype, t.data_ptr() - base) for path, t in tensors.items()]
    sent = (snapshot.step, snapshot.rank, layout, snapshot.values, snapshot.rng, snapshot.objects, snapshot.digests,
            snapshot.regions, snapshot.coords)
    return pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL), buffer


def unpacked(header: bytes, buffer: torch.Tensor) -> Snapshot:
    """The snapshot :func:`packed` made ``header`` and ``buffer`` of (its tensors are views of the buffer)."""
    step, rank, layout, values, rng, objects, digests, regions, coords = pickle.loads(header)  # noqa: S301 - a rank's
    tensors: dict[Path, torch.Tensor] = {path: view_of(buffer, offset, shape, dtype)
                                         for path, shape, dtype, offset in layout}
    return Snapshot(step, tensors, values, rng, objects, digests=digests, rank=rank, regions=regions, coords=coords,
                    buffer=buffer)


def send_snapshots(sends: Sequence[tuple[int, Snapshot]], receives: Sequence[int], group: dist.ProcessGroup, *,
                   buffer: Optional[Callable[[int], torch.Tensor]] = None) -> dict[int, Snapshot]:
    """Send each ``(rank, snapshot)`` of ``sends`` to its rank and receive one snapshot from each
    rank of ``receives``, over ``group`` (global ranks): :func:`start_sending`, waited for.
    Returns the snapshots received, by the rank that sent each.

    Example, a rank with nothing to send or receive (it makes no call)::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> send_snapshots([], [], dist.group.WORLD)
        {}
        >>> dist.destroy_process_group()

    ``tests/test_partner.py`` sends them between gloo ranks.
    """
    return start_sending(sends, receives, group, buffer=buffer).wait()


class Sending:
    """Snapshots on their way (:func:`start_sending`): :meth:`wait` for all of them, or take the
    ones already received (:meth:`arrived`) where the sending was cut short by a failure (then
    keep this object until its group is gone: the backend may still write into its buffers)."""

    def __init__(self, works: list[Any], incoming: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 buffer: Optional[Callable[[int], torch.Tensor]], keep: list[torch.Tensor]) -> None:
        self._works, self._incoming = works, incoming
        self._buffer, self._keep = buffer, keep  # keep: what is sent, alive until it is gone

    def wait(self) -> dict[int, Snapshot]:
        """Every snapshot received, once all sent and received (raises where a peer failed)."""
        for work in self._works:
            work.wait()
        return {peer: self._unpack(peer) for peer in self._incoming}

    def arrived(self) -> dict[int, Snapshot]:
        """The snapshots received whole by now, without waiting for the others: where the backend
        says its operations completed (NCCL), and else (gloo tells nothing before a wait, which
        may block on a frozen peer) where the header arrived and the buffer matches every digest
        the header carries. A snapshot without digests is taken only on the backend's word."""
        done = [work.is_completed() for work in self._works]
        if done and all(done):
            try:
                return self.wait()
            except RuntimeError:  # completed with an error: judged one by one below
                pass
        received = {}
        for peer in self._incoming:
            try:
                snapshot = self._unpack(peer)
                if not snapshot.digests:
                    continue
                snapshot.verify(what=f"the snapshot in flight from rank {peer}")
            except Exception:  # noqa: BLE001 - a header or buffer not (yet) whole: not arrived
                continue
            received[peer] = snapshot
        return received

    def _unpack(self, peer: int) -> Snapshot:
        header_in, payload_in = self._incoming[peer]
        host = payload_in
        if payload_in.device.type != "cpu":
            host = (self._buffer(payload_in.numel()) if self._buffer is not None
                    else torch.empty(payload_in.numel(), dtype=torch.uint8))
            host.copy_(payload_in)
        return unpacked(header_in.cpu().numpy().tobytes(), host)


def start_sending(sends: Sequence[tuple[int, Snapshot]], receives: Sequence[int], group: dist.ProcessGroup, *,
                  buffer: Optional[Callable[[int], torch.Tensor]] = None) -> Sending:
    """Start sending each ``(rank, snapshot)`` of ``sends`` to its rank and receiving one snapshot
    from each rank of ``receives``, over ``group`` (global ranks), in two batches of
    point-to-point operations: the sizes (waited for here: a few bytes), then each snapshot's
    header and its one buffer (over NCCL through this rank's device), left in flight. Every rank
    named on either side calls it with the matching entries. ``buffer(nbytes)``: where a received
    buffer goes (default: a new one).

    Example, a rank with nothing to send or receive::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> start_sending([], [], dist.group.WORLD).arrived()
        {}
        >>> dist.destroy_process_group()
    """
    device = collective_device(group)
    outgoing = [(peer, *packed(snapshot)) for peer, snapshot in sends]
    sizes_out = [torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=device)
                 for _, header, payload in outgoing]
    sizes_in = {peer: torch.empty(2, dtype=torch.int64, device=device) for peer in receives}
    wait_all([dist.P2POp(dist.isend, size, peer, group) for size, (peer, _, _) in zip(sizes_out, outgoing)]
         + [dist.P2POp(dist.irecv, size, peer, group) for peer, size in sizes_in.items()])
    incoming: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for peer, size in sizes_in.items():
        header_len, payload_len = (int(v) for v in size.tolist())
        host = buffer(payload_len) if buffer is not None else torch.empty(payload_len, dtype=torch.uint8)
        incoming[peer] = (torch.empty(header_len, dtype=torch.uint8, device=device),
                          host if device.type == "cpu" else torch.empty(payload_len, dtype=torch.uint8, device=device))
    ops: list[dist.P2POp] = []
    keep: list[torch.Tensor] = []
    for peer, header, payload in outgoing:  # an empty buffer (values only) is not sent: both sides know its size
        sent = [torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)]
        sent += [payload.to(device)] if payload.numel() else []
        keep += sent
        ops += [dist.P2POp(dist.isend, tensor, peer, group) for tensor in sent]
    for peer, (header_in, payload_in) in incoming.items():
        ops += [dist.P2POp(dist.irecv, tensor, peer, group) for tensor in (header_in, payload_in) if tensor.numel()]
    works = list(dist.batch_isend_irecv(ops)) if ops else []
    return Sending(works, incoming, buffer, keep)


def relay(plan: RelayPlan, held: Mapping[int, Snapshot], wanted: Mapping[Path, Region],
          group: dist.ProcessGroup) -> Snapshot:
    """Carry out ``plan`` on this rank (every rank of ``group`` calls it, each with a plan that
    holds at least its own part: the blocks and template it receives, and those it sends): send
    the blocks it holds to the ranks that need them, one snapshot per receiver, and build its own
    state (``wanted``: its live state's regions) from the blocks it receives and holds. ``held``:
    the snapshots of ``plan.step`` this rank holds, by their source rank. Returns this rank's
    snapshot of ``plan.step``: its own, untouched, where every block of it was its own.

    Example, one rank holding the whole of its state::

        >>> import torch, torch.distributed as dist
        >>> from hypergrid.training.regions import Part
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> region = Region((), (2,), (0,), (2,), torch.float32)
        >>> own = Snapshot(3, {("w",): torch.ones(2)}, rank=0, regions={("w",): region})
        >>> plan = RelayPlan(3, (Part(0, ("w",), 0, 0, (0,), (2,)),), {0: (0, 0)})
        >>> relay(plan, {0: own}, {("w",): region}, dist.group.WORLD) is own
        True
        >>> dist.destroy_process_group()
    """
    rank = dist.get_rank()
    if plan.whole:  # each rank's state is the whole of one snapshot: sent as it is
        sends = [(receiver, held[source]) for receiver, (holder, source) in sorted(plan.templates.items())
                 if holder == rank and receiver != rank]
        holder, origin = plan.templates[rank]
        got = send_snapshots(sends, [holder] if holder != rank else [], group)
        return held[origin] if holder == rank else got[holder]
    outgoing: dict[int, Snapshot] = {}
    mine: list[Part] = []
    for part in plan.parts:
        if part.holder == rank and part.receiver != rank:
            source = held[part.source]
            block = block_of(source.tensors[part.path], source.regions[part.path], part.offsets, part.shape)
            outgoing.setdefault(part.receiver, Snapshot(plan.step, rank=part.source)).tensors[_key(part)] = block
        elif part.receiver == rank:
            mine.append(part)
    for receiver, (holder, source_rank) in plan.templates.items():
        if holder == rank and receiver != rank:
            sent, source = outgoing.setdefault(receiver, Snapshot(plan.step, rank=source_rank)), held[source_rank]
            sent.values, sent.rng, sent.objects = source.values, source.rng, source.objects
    template = plan.templates[rank]
    senders = sorted({part.holder for part in mine if part.holder != rank} | ({template[0]} - {rank}))
    got = send_snapshots(sorted(outgoing.items(), key=lambda item: item[0]), senders, group)
    own = held.get(rank)
    if own is not None and template == (rank, rank) and len(mine) == len(wanted) and all(
            (part.holder, part.source) == (rank, rank) and own.regions.get(part.path) == wanted[part.path]
            for part in mine):
        return own
    built = Snapshot(plan.step, rank=rank)
    built.tensors = {path: torch.empty(region.shape, dtype=region.dtype) for path, region in wanted.items()}
    for part in mine:
        if part.holder == rank:
            source = held[part.source]
            block = block_of(source.tensors[part.path], source.regions[part.path], part.offsets, part.shape)
        else:
            block = got[part.holder].tensors[_key(part)]
        block_of(built.tensors[part.path], wanted[part.path], part.offsets, part.shape).copy_(block)
    model = held[template[1]] if template[0] == rank else got[template[0]]
    built.values, built.rng, built.objects = model.values, model.rng, model.objects
    return built


def _key(part: Part) -> tuple[Any, ...]:
    """A block's name in the snapshot that carries it, alike on its holder and its receiver (each
    may hold only its own part of the plan)."""
    return (part.source, part.offsets, *part.path)


def wait_all(ops: list[dist.P2POp]) -> None:
    """Run ``ops`` (point-to-point operations) as one batch and wait for every one."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a collective of ``group`` takes its tensors: NCCL's on this rank's device.

    Example::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        >>> collective_device(dist.group.WORLD)
        device(type='cpu')
        >>> dist.destroy_process_group()
    """
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
