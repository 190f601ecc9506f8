"""How a resilient job's groups are built again after a recovery: a grid's calls or Megatron's config.

Each recipe knows its groups' longest collective timeout, which bounds how long a recovery waits
for a live rank.

>>> from hypergrid import HyperCommGrid
>>> recipe = GridRecipe.of(HyperCommGrid([2, 2], ["tp", "dp"], world_size=4))
>>> recipe.dim_names, recipe.made, recipe.longest_timeout() is None
(('tp', 'dp'), (), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import torch.distributed as dist

from ..grid import HyperCommGrid, MadeGroup
from ..runtime.options import effective_timeout
from ..runtime.torch_compat import default_group_timeout

__all__ = ["GridRecipe", "MegatronRecipe", "Recipe", "rebuild_strategy", "longest_collective", "DEFAULT_TIMEOUT"]

#: How long, by default, survivors wait for each other to agree and rebuild.
DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class GridRecipe:
    """How a grid job's groups are built: the grid's settings, views and ``create_pg`` calls, repeated in order."""

    dim_names: tuple[str, ...]
    backend: Optional[str]
    strategy: str
    timeout: Optional[timedelta]
    check_agreement: bool
    views: tuple[tuple[str, tuple[int, ...], tuple[str, ...], tuple[str, ...]], ...]
    made: tuple[MadeGroup, ...]

    @classmethod
    def of(cls, grid: HyperCommGrid) -> GridRecipe:
        views = tuple((name, layout.shape, layout.dim_names, tuple(grid._views[name].shared))
                      for name, layout in grid.views.items())
        return cls(tuple(grid.dim_names), grid.backend, grid.strategy, grid.default_timeout,
                   grid.check_agreement, views, tuple(grid.made_groups()))

    def longest_timeout(self) -> Optional[timedelta]:
        """The longest collective timeout among the groups it makes (None: no group)."""
        return max((effective_timeout(made.options) for made in self.made), default=None)


@dataclass(frozen=True)
class MegatronRecipe:
    """How a Megatron job's groups are built: its configuration (``world_size``: the grid's positions)
    and ``initialize_model_parallel``'s own choices."""

    config: Any  # hypergrid.megatron.spec.config.MegatronConfig (megatron-core imported on use)
    share_groups: bool
    strategy: str
    check_agreement: bool

    def longest_timeout(self) -> Optional[timedelta]:
        return timedelta(minutes=self.config.distributed_timeout_minutes)


Recipe = Union[GridRecipe, MegatronRecipe]


def rebuild_strategy(strategy: str) -> str:
    """The creation strategy a recovery rebuilds with: ``enumerate`` (every rank makes every group)
    cannot work once ranks are lost.

    >>> rebuild_strategy("enumerate"), rebuild_strategy("local")
    ('auto', 'local')
    """
    return "auto" if strategy == "enumerate" else strategy


def longest_collective(timeout: Optional[timedelta]) -> timedelta:
    """The longest a collective of the job may wait: ``timeout`` or the default group's, whichever is
    longer (:data:`DEFAULT_TIMEOUT` where neither is known).

    >>> longest_collective(timedelta(seconds=30))     # no process group
    datetime.timedelta(seconds=30)
    """
    known = (t for t in (timeout, default_group_timeout() if dist.is_initialized() else None) if t is not None)
    return max(known, default=DEFAULT_TIMEOUT)
