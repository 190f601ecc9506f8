"""The wrappers of a rank's state that hold one of the grid's groups (ZeRO, DDP), and how they
follow a recovery: which are built again by ``setup`` on the new grid, which are pointed at its
group of the same dims, and how a DDP made mid-job skips the collectives of its start.

Example, a rank's state with nothing made over the grid's groups::

    >>> import torch
    >>> from hypergrid.training.state import TrainingState
    >>> on_groups(TrainingState(torch.nn.Linear(2, 2)), grid=None)
    []
    >>> made = DistributedDataParallel.__init__
    >>> with ddp_without_init_sync():                 # for a rank taking a position: init_sync=False
    ...     DistributedDataParallel.__init__ is made
    False
    >>> DistributedDataParallel.__init__ is made      # and torch's own again after
    True
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ..grid import HyperCommGrid
from .state import TrainingState

__all__ = ["OnGroup", "on_groups", "ddp_without_init_sync", "warm_up"]


@dataclass(frozen=True)
class OnGroup:
    """A ZeRO optimizer or a DDP model of the state, made over the grid's group of ``dims`` (in ``view``)."""

    user: Union[ZeroRedundancyOptimizer, DistributedDataParallel]
    dims: tuple[str, ...]
    view: Optional[str]

    def made_again_on(self, group: Optional[dist.ProcessGroup]) -> bool:
        """Whether the state is built again for ``group``, the new grid's group of these dims: a ZeRO
        whose group changed size (its partition follows the size), a DDP whose group changed at all.
        DDP is wrapped anew by ``setup`` (its options and buckets the user's, no collective at its
        start) on every rank of the changed group alike: re-pointing its reducer in place
        (``_update_process_group``) after a backward cut short by the failure gave gradients that
        differ from a run with no failure."""
        if isinstance(self.user, ZeroRedundancyOptimizer):
            return dist.get_world_size(group) != self.user.world_size
        return self.user.process_group is not group


def on_groups(state: TrainingState, grid: Any) -> list[OnGroup]:
    """Each ZeRO optimizer and DDP model of ``state`` made over one of ``grid``'s groups, with that
    group's dims and view: after a recovery, the new grid's group of those dims is found by them
    (:meth:`OnGroup.made_again_on`)."""
    if not isinstance(grid, HyperCommGrid):
        return []
    users: list[Union[ZeroRedundancyOptimizer, DistributedDataParallel]] = [
        o for o in state.optimizers if isinstance(o, ZeroRedundancyOptimizer)]
    users += [m for m in state.models if isinstance(m, DistributedDataParallel)]
    made_groups = grid.made_groups()
    found = []
    for user in users:
        found += [OnGroup(user, m.dims, m.view) for m in made_groups
                  if grid.get_pg(m.dims, view=m.view) is user.process_group][:1]
    return found


@contextlib.contextmanager
def ddp_without_init_sync() -> Iterator[None]:
    """DDP made in here skips the collectives of its start (a check of every member's parameter
    shapes, a broadcast of the first member's parameters over its group): a rank that takes a
    position makes its DDP while the other members, who do not run ``setup`` again, never join
    them, and the snapshot restored right after gives what the broadcast would have."""
    made = DistributedDataParallel.__init__
    signature = inspect.signature(made)
    if "init_sync" not in signature.parameters:
        yield
        return

    def without_init_sync(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["init_sync"] = False
        made(*bound.args, **bound.kwargs)

    DistributedDataParallel.__init__ = without_init_sync  # type: ignore[method-assign]
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = made  # type: ignore[method-assign]


def warm_up() -> None:
    """What a rank outside the grid can do before it is given a position: the imports that a first
    optimizer step makes lazily (``torch._dynamo``: seconds of CPU), so that a recovery onto it does
    not wait for them."""
    importlib.import_module("torch._dynamo")
