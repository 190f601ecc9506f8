"""What :func:`~hypergrid.megatron.initialize_model_parallel` built, and which one is current.

A :class:`MegatronGrids` holds one initialization's grid, plan and this rank's groups by kind;
:func:`active_grids` is the current one (what ``parallel_state`` was filled from). The
initializer sets it, the ``ProcessGroupCollection`` adapter reads it: both import this module,
neither the other.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch.distributed as dist

from ..grid import HyperCommGrid
from ..runtime.registry import REGISTRY
from .spec.config import MegatronConfig
from .spec.plan import MegatronPlan

__all__ = ["MegatronGrids", "active_grids", "set_active"]

_owner_ids = itertools.count()

#: The state made by the last ``initialize_model_parallel`` not yet destroyed.
_ACTIVE: Optional[MegatronGrids] = None


class MegatronGrids:
    """What :func:`initialize_model_parallel` built: the grid, the plan and this rank's groups.

    ``grid`` is the dense :class:`~hypergrid.grid.HyperCommGrid` (dims from Megatron's ``order``
    without ``ep``) with the expert layout registered as its ``"expert"`` view; ``plan`` the
    :class:`~hypergrid.megatron.spec.plan.MegatronPlan` of every group. :meth:`group` and
    :meth:`ranks` answer by kind name (``"tp"``, ``"dp_cp"``, ``"expt_dp"``, ...).

    ``all_gather_groups`` holds the ``(dp_cp_ag, expt_dp_ag)`` pairs
    :func:`create_all_gather_groups` made, released with the rest.

    Example, as rank 5 of a 16-rank job on torch's fake backend, which needs no other process
    (``create_gloo_process_groups=False``: gloo groups need a real gloo world)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from hypergrid.megatron import active_grids, destroy_model_parallel, initialize_model_parallel
        >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
        >>> initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
        ...                           create_gloo_process_groups=False)
        >>> from megatron.core import parallel_state
        >>> grids = active_grids()
        >>> grids.grid.get_pg("tp") is parallel_state.get_tensor_model_parallel_group()
        True
        >>> grids.ranks("dp"), grids.grid.coords()
        ([5, 7], {'tp': 1, 'cp': 0, 'dp': 0, 'pp': 1})
        >>> destroy_model_parallel()
        >>> dist.destroy_process_group()
    """

    def __init__(self, plan: MegatronPlan, grid: HyperCommGrid, rank: int, share_groups: bool, strategy: str,
                 members: Optional[dict[str, Optional[list[int]]]] = None) -> None:
        self.plan = plan
        self.config: MegatronConfig = plan.config
        self.grid = grid
        self.rank = rank
        self.share_groups = share_groups
        self.strategy = strategy
        #: Who holds the derived groups (every kind that is not one of the grid's) in the registry.
        self.owner = ("hypergrid.megatron", next(_owner_ids))
        self._groups: dict[str, Optional[dist.ProcessGroup]] = {}
        # This rank's members per kind, as listed at start-up (others are computed when asked).
        self._members: dict[str, Optional[list[int]]] = dict(members or {})
        self._world_shared: set[str] = set()
        self.all_gather_groups: list[tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]] = []
        self._destroyed = False

    def __repr__(self) -> str:
        return f"MegatronGrids(rank={self.rank}, {self.plan!r}, share_groups={self.share_groups}, strategy={self.strategy!r})"

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """This rank's process group of kind ``name`` (aliases resolved); None where it is in none.

        Example, as rank 5 of a 16-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> from hypergrid.megatron import active_grids, destroy_model_parallel, initialize_model_parallel
            >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
            >>> initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
            ...                           create_gloo_process_groups=False)
            >>> grids = active_grids()
            >>> grids.group("intra_dp_cp") is grids.group("dp_cp")   # one optimizer instance
            True
            >>> destroy_model_parallel()
            >>> dist.destroy_process_group()
        """
        self.check_alive()
        resolved = self.plan.kind(name).name
        return self._groups[resolved]

    def ranks(self, name: str) -> Optional[list[int]]:
        """Global ranks of this rank's group of kind ``name``, in Megatron-Core's order (or None).

        Example, as rank 5 of a 16-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> from hypergrid.megatron import active_grids, destroy_model_parallel, initialize_model_parallel
            >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
            >>> initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
            ...                           create_gloo_process_groups=False)
            >>> active_grids().ranks("pp")
            [1, 5, 9, 13]
            >>> destroy_model_parallel()
            >>> dist.destroy_process_group()
        """
        resolved = self.plan.kind(name).name
        if resolved not in self._members:
            # Groups handed out as the default group were not listed at start-up (O(world)).
            self._members[resolved] = self.plan.rank_group(resolved, self.rank)
        return self._members[resolved]

    def record(self, name: str, pg: Optional[dist.ProcessGroup], *, world_shared: bool = False) -> None:
        """Keep ``pg`` as this rank's group of kind ``name`` (``world_shared``: it is the default
        group itself, handed out for a kind that spans the world)."""
        self.check_alive()
        self._groups[name] = pg
        if world_shared:
            self._world_shared.add(name)

    def groups(self) -> dict[str, Optional[dist.ProcessGroup]]:
        """Every kind's group for this rank, in creation order."""
        self.check_alive()
        return dict(self._groups)

    def distinct_groups(self) -> list[dist.ProcessGroup]:
        """The distinct communicators this rank got, in creation order (the default group excluded)."""
        seen: dict[int, dist.ProcessGroup] = {}
        world = dist.group.WORLD
        for pg in self._groups.values():
            if pg is not None and pg is not world and id(pg) not in seen:
                seen[id(pg)] = pg
        return list(seen.values())

    @property
    def num_process_groups(self) -> int:
        """How many communicators initialization created for this rank (the default group excluded)."""
        return len(self.distinct_groups())

    @property
    def world_shared(self) -> list[str]:
        """Kinds whose group spans the whole world and is the default group itself (sharing on)."""
        return sorted(self._world_shared)

    def release(self) -> None:
        """Let go of every group (the grid's and the derived ones); idempotent. Does not touch
        ``parallel_state``: use :func:`destroy_model_parallel` for that."""
        if self._destroyed:
            return
        self._destroyed = True
        self.grid.destroy()
        REGISTRY.release(self.owner)
        self._groups.clear()

    def check_alive(self) -> None:
        """Raise :class:`~hypergrid.errors.GridDestroyedError` once :meth:`release` has run."""
        if self._destroyed:
            from ..errors import GridDestroyedError

            raise GridDestroyedError(f"{self!r} was destroyed; call initialize_model_parallel again")


def active_grids() -> Optional[MegatronGrids]:
    """The :class:`MegatronGrids` of the current initialization, or None.

    Example::

        >>> active_grids() is None     # before initialize_model_parallel
        True
    """
    return _ACTIVE


def set_active(grids: Optional[MegatronGrids]) -> Optional[MegatronGrids]:
    """Make ``grids`` the current initialization's (None: no current one); returns the previous."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, grids
    return previous
