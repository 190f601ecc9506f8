"""A rank's training state, and its snapshots in host memory.

:class:`TrainingState` names what a training job must get back after a failure: its model(s)
and optimizer(s), read and written through torch's own
:mod:`torch.distributed.checkpoint.state_dict` (plain modules, DDP, FSDP2, tensor parallel), the
random number generators, and any object with ``state_dict``/``load_state_dict`` (an LR
scheduler, a data sampler). :meth:`TrainingState.capture` copies it into a :class:`Snapshot`
held in host memory (pinned where the tensors live on a device, its buffers reused from one
snapshot to the next); :meth:`TrainingState.restore` puts a snapshot back, on this rank or on a
rank that received it from a peer (:mod:`hypergrid.training.transfer`).

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["TrainingState", "Snapshot", "RngState"]

#: A leaf's place in a state dict: the keys and list indices that lead to it.
Path = tuple[Any, ...]


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
    a number), ``rng`` and ``objects`` (each user object's ``state_dict()``, copied)."""

    step: int
    tensors: dict[Path, torch.Tensor] = field(default_factory=dict)
    values: dict[Path, Any] = field(default_factory=dict)
    rng: Optional[RngState] = None
    objects: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The host memory its tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


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

    # ------------------------------------------------------------------ the live state
    def _live(self) -> tuple[dict[str, Any], Any]:
        if self.optimizers:
            return get_state_dict(self._module, list(self.optimizers))
        return get_state_dict(self._module, [])[0], {}

    def capture(self, step: int) -> Snapshot:
        """This rank's state at the start of ``step``, copied to host memory. The buffers of the
        snapshot handed back by :meth:`recycle` are written over rather than allocated again.

        Example::

            >>> import torch
            >>> TrainingState(torch.nn.Linear(3, 1)).capture(step=4).nbytes
            16
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
        reuse, self._spare = self._spare, None
        snapshot = Snapshot(step)
        model_sd, optim_sd = self._live()
        for root, tree in (("model", model_sd), ("optimizer", optim_sd)):
            for path, leaf in _leaves(tree, (root,)):
                if isinstance(leaf, torch.Tensor):
                    local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
                    snapshot.tensors[path] = _host_copy(local.detach(), reuse.tensors.get(path) if reuse else None)
                else:
                    snapshot.values[path] = copy.deepcopy(leaf)
        snapshot.rng = RngState.capture()
        snapshot.objects = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.objects.items()}
        return snapshot

    def recycle(self, snapshot: Snapshot) -> None:
        """``snapshot`` is no longer needed: the next :meth:`capture` writes into its buffers."""
        self._spare = snapshot

    def restore(self, snapshot: Snapshot) -> None:
        """Put ``snapshot`` back: the model's and optimizers' tensors copied into theirs (a
        DTensor's shard into its local tensor), their other values, the RNG states and every
        object's ``load_state_dict``; the model's gradients are dropped. An optimizer with no state yet gets its state made first
        (torch's ``get_state_dict`` does so), so a rank that has not trained takes a peer's.

        Raises:
            ValueError: the snapshot does not fit this state (another model, or other shapes),
                naming the first path that differs.
        """
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
                elif path in snapshot.values:
                    _assign(model_sd if root == "model" else optim_sd, path[1:], copy.deepcopy(snapshot.values[path]))
        if self.optimizers:
            set_state_dict(self._module, list(self.optimizers), model_state_dict=model_sd, optim_state_dict=optim_sd)
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


def _host_copy(tensor: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
    """``tensor`` copied to host memory, into ``into`` where it fits (pinned where ``tensor``
    lives on a device, so that the copy does not go through a staging buffer)."""
    if into is None or into.shape != tensor.shape or into.dtype != tensor.dtype:
        pinned = tensor.device.type == "cuda"
        into = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
    into.copy_(tensor)
    return into
