"""A snapshot sent from one rank of a group to the others: how a rank that just took a position
gets the state of that position from a surviving peer that holds it (replicated state).

A snapshot travels as its header (layout, other values, RNG, objects, digests; :func:`packed`)
and its one host buffer: here one object broadcast and one broadcast of the buffer, point to point
in :mod:`hypergrid.training.partner`. Over NCCL the buffer travels through the device of the
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
from typing import Optional

import torch
import torch.distributed as dist

from .state import Path, Snapshot, buffer_for, view_of

__all__ = ["share_snapshot", "collective_device", "packed", "unpacked"]


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
    sent = (snapshot.step, snapshot.rank, layout, snapshot.values, snapshot.rng, snapshot.objects, snapshot.digests)
    return pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL), buffer


def unpacked(header: bytes, buffer: torch.Tensor) -> Snapshot:
    """The snapshot :func:`packed` made ``header`` and ``buffer`` of (its tensors are views of the buffer)."""
    step, rank, layout, values, rng, objects, digests = pickle.loads(header)  # noqa: S301 - from a rank of the job
    tensors: dict[Path, torch.Tensor] = {path: view_of(buffer, offset, shape, dtype)
                                         for path, shape, dtype, offset in layout}
    return Snapshot(step, tensors, values, rng, objects, digests=digests, rank=rank, buffer=buffer)


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
