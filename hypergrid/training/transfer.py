"""A snapshot sent from one rank of a group to the others: how a rank that just took a position
gets the state of that position from a surviving peer that holds it (replicated state).

The source sends the snapshot's layout (paths, shapes, dtypes) and its other values in one
object broadcast, then its tensors packed into one flat buffer per dtype, so a snapshot of any
number of tensors costs a handful of collectives. Over NCCL the buffers travel through the
device of the rank; over gloo they stay in host memory.

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

from collections import defaultdict
from typing import Any, Optional

import torch
import torch.distributed as dist

from .state import Path, RngState, Snapshot

__all__ = ["share_snapshot", "collective_device"]


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
    header: list[object] = [None]
    if rank == source:
        assert snapshot is not None
        layout = [(path, tuple(t.shape), t.dtype) for path, t in snapshot.tensors.items()]
        header = [(snapshot.step, layout, snapshot.values, snapshot.rng, snapshot.objects)]
    dist.broadcast_object_list(header, src=source, group=group)
    sent: tuple[int, list[tuple[Path, tuple[int, ...], torch.dtype]], dict[Path, Any], Optional[RngState],
                dict[str, Any]] = header[0]  # type: ignore[assignment]
    step, layout, values, rng, objects = sent
    device = collective_device(group)
    by_dtype: dict[torch.dtype, list[tuple[Path, tuple[int, ...]]]] = defaultdict(list)
    for path, shape, dtype in layout:
        by_dtype[dtype].append((path, shape))
    tensors: dict[Path, torch.Tensor] = {}
    for dtype, entries in by_dtype.items():  # in the order the source listed them: alike everywhere
        sizes = [_numel(shape) for _, shape in entries]
        if rank == source:
            assert snapshot is not None
            flat = torch.cat([snapshot.tensors[path].reshape(-1) for path, _ in entries]).to(device)
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=source, group=group)
        if rank == source:
            continue
        host = flat.cpu()
        for (path, shape), piece in zip(entries, torch.split(host, sizes)):
            tensors[path] = piece.view(shape)
    if rank == source:
        assert snapshot is not None
        return snapshot
    return Snapshot(step, tensors, values, rng, objects)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


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
