"""A rank's training state, and its snapshots in host memory.

:class:`TrainingState` names what a training job must get back after a failure: its model(s)
and optimizer(s), read and written through torch's own
:mod:`torch.distributed.checkpoint.state_dict` (plain modules, DDP, FSDP2, tensor parallel), the
random number generators, and any object with ``state_dict``/``load_state_dict`` (an LR
scheduler, a data sampler). :meth:`TrainingState.capture` copies it into a :class:`Snapshot`
held in host memory (one buffer, pinned where the tensors live on a device, reused from one
snapshot to the next), with a CRC-32 digest of every tensor where asked; :meth:`TrainingState.restore`
checks those digests and puts a snapshot back, on this rank or on a rank that received it from a
peer (:mod:`hypergrid.training.transfer`) or from the partner that held a copy of it
(:mod:`hypergrid.training.partner`).

Example::

    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> state = TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> before = state.capture(step=0)
    >>> with torch.no_grad():
    ...     _ = model.weight.add_(1.0)
    >>> state.restore(before)
    >>> bool(torch.equal(model.weight, before.tensors[("model", "weight")]))
    True
"""

from __future__ import annotations

import copy
import random
import sys
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ..errors import SnapshotCorrupted
from .regions import Coords, Path, Placement, Region, region_of

__all__ = ["TrainingState", "Snapshot", "RngState"]

#: Where each tensor starts in a snapshot's buffer: a multiple of this many bytes, so that a
#: byte offset is a whole number of elements of any dtype (complex128's 16 bytes included).
ALIGN = 64


@dataclass(frozen=True)
class RngState:
    """The random number generators' states: torch's CPU generator, every device generator that
    was started, Python's and (where imported) NumPy's."""

    cpu: torch.Tensor
    devices: tuple[torch.Tensor, ...]
    python: Any
    numpy: Any = None

    @classmethod
    def capture(cls) -> RngState:
        devices = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else ()
        numpy = sys.modules.get("numpy")
        return cls(torch.get_rng_state(), devices, random.getstate(),
                   numpy.random.get_state() if numpy is not None else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.devices:
            torch.cuda.set_rng_state_all(list(self.devices))
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)


@dataclass
class Snapshot:
    """A rank's training state at the start of ``step``, in host memory: ``tensors`` (every
    tensor of the model's and the optimizers' state dicts, this rank's shard of a DTensor, by
    path), ``values`` (their other leaves: an optimizer's hyperparameters, a step count kept as
    a number), ``rng`` and ``objects`` (each user object's ``state_dict()``, copied).

    ``digests``: each tensor's CRC-32 when it was taken (empty where none was asked for);
    ``rank``: the rank whose state it is (None outside a process group); ``regions`` and
    ``coords``: which block of the job's state each tensor is and where the rank sat, where it
    was taken at a :class:`~hypergrid.training.regions.Placement` (what a restore onto another
    placement cuts it by); ``buffer``: the one host buffer (uint8) the tensors are views of, where
    :meth:`TrainingState.capture` made them so (sent to a partner as it is, with no packing)."""

    step: int
    tensors: dict[Path, torch.Tensor] = field(default_factory=dict)
    values: dict[Path, Any] = field(default_factory=dict)
    rng: Optional[RngState] = None
    objects: dict[str, Any] = field(default_factory=dict)
    digests: dict[Path, int] = field(default_factory=dict)
    rank: Optional[int] = None
    regions: dict[Path, Region] = field(default_factory=dict, repr=False)
    coords: Coords = ()
    buffer: Optional[torch.Tensor] = field(default=None, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save``) with a tensor of its own for each, as torch saves no storage
        viewed as more than one dtype; the one buffer is for host memory only."""
        state = dict(self.__dict__)
        state["tensors"] = {path: tensor.clone() for path, tensor in self.tensors.items()}
        state["buffer"] = None
        return state

    @property
    def nbytes(self) -> int:
        """The host memory its tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def verify(self, *, what: str = "the snapshot") -> None:
        """Check every tensor against its digest (nothing to check where none was taken).

        Example::

            >>> import torch
            >>> snapshot = TrainingState(torch.nn.Linear(2, 1)).capture(step=5, digests=True)
            >>> snapshot.verify()
            >>> snapshot.tensors[("model", "bias")].view(torch.uint8)[0] ^= 1   # one bit flipped
            >>> snapshot.verify(what="the copy held by rank 0")
            Traceback (most recent call last):
            ...
            hypergrid.errors.SnapshotCorrupted: hypergrid: the copy held by rank 0 (the state of rank None at step 5) does not match its digest at model/bias: ...

        Raises:
            SnapshotCorrupted: a tensor's bytes differ from its digest, or a tensor digested is
                missing; naming the rank, the step and the key.
        """
        for path, expected in self.digests.items():
            tensor = self.tensors.get(path)
            found = None if tensor is None else digest(tensor)
            if found != expected:
                key = "/".join(map(str, path))
                detail = "the tensor is missing" if found is None else f"CRC-32 {found:08x} where {expected:08x} was taken"
                raise SnapshotCorrupted(f"hypergrid: {what} (the state of rank {self.rank} at step {self.step}) does "
                                        f"not match its digest at {key}: {detail}; refused, nothing restored from it",
                                        rank=self.rank, step=self.step, key=key)


def digest(tensor: torch.Tensor) -> int:
    """The CRC-32 of a host tensor's bytes: any flipped byte (any error burst of up to 32 bits)
    changes it, at about the speed of a copy (zlib releases the GIL while it runs).

    Example::

        >>> import torch
        >>> digest(torch.zeros(4)) == digest(torch.zeros(4)), digest(torch.zeros(4)) == digest(torch.ones(4))
        (True, False)
    """
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


class TrainingState:
    """What a rank must get back after a failure: ``model`` (a module, or several, as pipeline
    chunks), ``optimizer`` (none, one, or several over the model's parameters) and ``objects``
    (named objects with ``state_dict``/``load_state_dict``: an LR scheduler, a data sampler).

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        >>> TrainingState(model, optimizer, scheduler=scheduler).objects.keys()
        dict_keys(['scheduler'])
        >>> TrainingState(model, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0))
        Traceback (most recent call last):
        ...
        ValueError: optimizer 0 holds 2 parameters that are not the model's (shapes [2, 2], [2]); ...

    A ``torch.distributed.optim.ZeroRedundancyOptimizer`` is read and written through its local
    optimizer (``zero.optim``, over this rank's partition of the parameters): its snapshot holds
    this rank's shard of the optimizer state and no rank calls ZeRO's ``consolidate_state_dict``
    (a collective); a restore copies the local optimizer's hyperparameters back to ZeRO's groups.

    Raises:
        TypeError: a model that is not a ``torch.nn.Module``, an optimizer that is not a
            ``torch.optim.Optimizer``, an object without ``state_dict``/``load_state_dict``.
        ValueError: an optimizer over parameters that are not the model's.
    """

    def __init__(self, model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
                 optimizer: Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]] = None,
                 **objects: Any) -> None:
        models = [model] if isinstance(model, torch.nn.Module) else list(_sequence("model", model))
        for index, module in enumerate(models):
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"model {index} must be a torch.nn.Module, got {type(module).__name__}")
        if not models:
            raise ValueError("model must be a torch.nn.Module or a non-empty sequence of them, got an empty one")
        optimizers = [] if optimizer is None else (
            [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(_sequence("optimizer", optimizer)))
        ids = {id(p) for module in models for p in module.parameters()}
        for index, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizer {index} must be a torch.optim.Optimizer, got {type(opt).__name__}")
            strangers = [p for g in opt.param_groups for p in g["params"] if id(p) not in ids]
            if strangers:
                shapes = ", ".join(str(list(p.shape)) for p in strangers[:4])
                raise ValueError(f"optimizer {index} holds {len(strangers)} parameters that are not the model's "
                                 f"(shapes {shapes}); an optimizer must be over the parameters of the model "
                                 f"given with it (after any wrapping: fully_shard, DDP)")
        for name, obj in objects.items():
            missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
            if missing:
                raise TypeError(f"object {name!r} ({type(obj).__name__}) has no {' or '.join(missing)}: "
                                f"each object of a TrainingState is saved and restored through them")
        self.models = tuple(models)
        self.optimizers = tuple(optimizers)
        self.objects: dict[str, Any] = dict(objects)
        # One module over the chunks, as torch's state_dict functions take one.
        self._module = models[0] if len(models) == 1 else torch.nn.ModuleList(models)
        self._spare: Optional[Snapshot] = None  # an older snapshot whose buffers the next one reuses
        self._regions: tuple[Optional[Placement], dict[Path, Region]] = (None, {})  # by placement, reused

    # ------------------------------------------------------------------ the live state
    def _local(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose state dicts this rank holds: a ZeRO optimizer's local one."""
        return [o.optim if isinstance(o, ZeroRedundancyOptimizer) else o for o in self.optimizers]

    def _live(self) -> tuple[dict[str, Any], Any]:
        if self.optimizers:
            return get_state_dict(self._module, self._local())
        return get_state_dict(self._module, [])[0], {}

    def capture(self, step: int, *, digests: bool = False, placement: Optional[Placement] = None) -> Snapshot:
        """This rank's state at the start of ``step``, copied to host memory, into one buffer. The
        buffer of the snapshot handed back by :meth:`recycle` is written over rather than
        allocated again. ``digests``: take each tensor's CRC-32 too (:meth:`Snapshot.verify`);
        ``placement``: record each tensor's region there (:meth:`regions`).

        Example::

            >>> import torch
            >>> TrainingState(torch.nn.Linear(3, 1)).capture(step=4).nbytes
            16
            >>> len(TrainingState(torch.nn.Linear(3, 1)).capture(step=4, digests=True).digests)
            2
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
        reuse, self._spare = self._spare, None
        snapshot = Snapshot(step, rank=dist.get_rank() if dist.is_initialized() else None)
        model_sd, optim_sd = self._live()
        live: list[tuple[Path, torch.Tensor]] = []
        for root, tree in (("model", model_sd), ("optimizer", optim_sd)):
            for path, leaf in _leaves(tree, (root,)):
                if isinstance(leaf, torch.Tensor):
                    live.append((path, leaf))
                else:
                    snapshot.values[path] = copy.deepcopy(leaf)
        data = [(path, (leaf.to_local() if isinstance(leaf, DTensor) else leaf).detach()) for path, leaf in live]
        snapshot.buffer, views = buffer_for(data, reuse)
        for (path, local), view in zip(data, views):
            view.copy_(local)
            snapshot.tensors[path] = view
        if digests:
            snapshot.digests = {path: digest(view) for path, view in snapshot.tensors.items()}
        snapshot.rng = RngState.capture()
        snapshot.objects = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.objects.items()}
        if placement is not None:
            snapshot.regions, snapshot.coords = self._regions_of(live, placement), placement.coords
        return snapshot

    def regions(self, placement: Placement) -> dict[Path, Region]:
        """The region of every tensor of this rank's live state at ``placement``: which block of
        which of the job's global tensors it is (what a restore onto it must be given).

        Example::

            >>> import torch
            >>> from hypergrid.layout import GridLayout
            >>> place = Placement(GridLayout((2,), ("dp",)), rank=1, replica_dim="dp")
            >>> TrainingState(torch.nn.Linear(3, 1)).regions(place)[("model", "weight")].shape
            (1, 3)
        """
        model_sd, optim_sd = self._live()
        return self._regions_of([(path, leaf) for root, tree in (("model", model_sd), ("optimizer", optim_sd))
                                 for path, leaf in _leaves(tree, (root,)) if isinstance(leaf, torch.Tensor)], placement)

    def _regions_of(self, live: Sequence[tuple[Path, torch.Tensor]], placement: Placement) -> dict[Path, Region]:
        known, cache = self._regions
        if known != placement:
            cache = {}
            self._regions = (placement, cache)
        contexts: dict[int, Coords] = {}
        found = {}
        for path, tensor in live:
            region = cache.get(path)
            if region is None or region.dtype != tensor.dtype or (
                    not isinstance(tensor, DTensor) and region.shape != tuple(tensor.shape)):
                region = cache[path] = region_of(tensor, placement, contexts)
                if path[0] == "optimizer" and any(isinstance(o, ZeroRedundancyOptimizer) for o in self.optimizers):
                    region = cache[path] = replace(region, sharding=None)  # which rank's partition: not placed
            found[path] = region
        return found

    def recycle(self, snapshot: Snapshot) -> None:
        """``snapshot`` is no longer needed: the next :meth:`capture` writes into its buffers."""
        self._spare = snapshot

    def restore(self, snapshot: Snapshot, *, verify: bool = True) -> None:
        """Put ``snapshot`` back: the model's and optimizers' tensors copied into theirs (a
        DTensor's shard into its local tensor), their other values, the RNG states and every
        object's ``load_state_dict``; the model's gradients are dropped. An optimizer with no state yet gets its state made first
        (torch's ``get_state_dict`` does so), so a rank that has not trained takes a peer's.

        Raises:
            ValueError: the snapshot does not fit this state (another model, or other shapes),
                naming the first path that differs.
            SnapshotCorrupted: a tensor no longer matches the digest taken with it (checked
                before anything is written; ``verify=False``: where the caller just checked it).
        """
        if verify:
            snapshot.verify()
        model_sd, optim_sd = self._live()
        for root, tree in (("model", model_sd), ("optimizer", optim_sd)):
            for path, leaf in _leaves(tree, (root,)):
                if isinstance(leaf, torch.Tensor):
                    saved = snapshot.tensors.get(path)
                    local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
                    if saved is None or saved.shape != local.shape or saved.dtype != local.dtype:
                        found = "nothing" if saved is None else f"{list(saved.shape)} {saved.dtype}"
                        raise ValueError(f"the snapshot of step {snapshot.step} does not fit this rank's state at "
                                         f"{'/'.join(map(str, path))}: {found} where {list(local.shape)} "
                                         f"{local.dtype} is expected")
                    with torch.no_grad():
                        local.copy_(saved, non_blocking=False)
                elif path in snapshot.values and path[-1] != "params":  # which parameters: the live state's
                    _assign(model_sd if root == "model" else optim_sd, path[1:], copy.deepcopy(snapshot.values[path]))
        if self.optimizers:
            set_state_dict(self._module, self._local(), model_state_dict=model_sd, optim_state_dict=optim_sd)
            for zero in self.optimizers:  # ZeRO's own groups take the restored lr (its step copies them down)
                if isinstance(zero, ZeroRedundancyOptimizer):
                    for whole, local in zip(zero.param_groups, zero.optim.param_groups):
                        whole.update({key: value for key, value in local.items() if key != "params"})
        else:
            set_state_dict(self._module, [], model_state_dict=model_sd, optim_state_dict={})
        # A step that failed may have left gradients behind; a snapshot is taken where there are none.
        for module in self.models:
            module.zero_grad(set_to_none=True)
        if snapshot.rng is not None:
            snapshot.rng.restore()
        for name, obj in self.objects.items():
            if name not in snapshot.objects:
                raise ValueError(f"the snapshot of step {snapshot.step} holds no object {name!r}; "
                                 f"it holds {sorted(snapshot.objects)}")
            obj.load_state_dict(copy.deepcopy(snapshot.objects[name]))


def _sequence(name: str, value: Any) -> Sequence[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be one object or a list of them, got {type(value).__name__}")
    return value


def _leaves(tree: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    """Every leaf of a state dict (nested dicts and lists), with its path."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(tree, (list, tuple)) and not (tree and all(isinstance(x, (int, float, str)) for x in tree)):
        for index, value in enumerate(tree):
            yield from _leaves(value, (*path, index))
    else:
        yield path, tree


def _assign(tree: Any, path: Path, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def buffer_for(live: list[tuple[Path, torch.Tensor]], reuse: Optional[Snapshot]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One host buffer for ``live``'s tensors and a view of it for each (``reuse``'s where its
    layout is the same): pinned where a tensor lives on a device, so that the copy does not go
    through a staging buffer; one buffer, so that a partner is sent it with no packing."""
    if reuse is not None and reuse.buffer is not None and [
            (p, t.shape, t.dtype) for p, t in reuse.tensors.items()] == [(p, t.shape, t.dtype) for p, t in live]:
        return reuse.buffer, list(reuse.tensors.values())
    offsets, end = [], 0
    for _, tensor in live:
        offsets.append(end)
        end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    pinned = any(t.device.type == "cuda" for _, t in live)
    buffer = torch.empty(end, dtype=torch.uint8, device="cpu", pin_memory=pinned)
    return buffer, [view_of(buffer, offset, tensor.shape, tensor.dtype) for offset, (_, tensor) in zip(offsets, live)]


def view_of(buffer: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` at byte ``offset`` of a uint8 ``buffer``."""
    count = 1
    for size in shape:
        count *= size
    return buffer[offset:offset + count * dtype.itemsize].view(dtype).view(tuple(shape))
