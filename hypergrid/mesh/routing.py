"""The groups torch's own DeviceMesh operations create, made through a grid's one door.

torch makes process groups for a mesh when a root mesh is built, and on every ``_flatten`` and
``_unflatten``, with an O(world) loop of ``new_group`` calls per dim (or one ``split_group`` on a
bound world) and no cache: torchtitan 0.3's meshes build pipeline parallelism's group four times.
On a mesh rooted at a hypergrid grid, each of those requests is served here instead: the dim's
ranks become a :class:`~hypergrid.layout.Partition` of the grid's span, and the group comes from
:meth:`HyperCommGrid.create_derived_pg <hypergrid.grid.HyperCommGrid.create_derived_pg>`, the
grid's door to the registry. So each rank makes only its own groups, with the strategy that fits
the job, after its members agree; and a group already made for the same ranks and options (by
the grid, a view, the Megatron adapter or an earlier mesh operation) is handed out again instead
of being made twice. A dim spanning the whole world is the default group, as in torch.

Which meshes are a grid's: every mesh derived from a root holds the root's rank map, the very
same tensor object, so the root's rank map names the grid. :func:`hypergrid.device_mesh` registers
the roots it builds; :func:`route_device_meshes` makes every root torch builds afterwards (by
``init_device_mesh``, or ``DeviceMesh(...)`` over consecutive ranks) a grid's as well, which is
how an unmodified torchtitan ``ParallelDims.build_mesh`` gets hypergrid's groups. Meshes of
neither kind are left to torch exactly as before.

Example, as rank 0 of a 16-rank job on torch's fake backend::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from hypergrid import HyperCommGrid, device_mesh
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    >>> grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
    >>> mesh = device_mesh(grid, device_type="cpu")
    >>> dp_cp = mesh["dp", "cp"]._flatten("dp_cp").get_group()   # torch's own flatten
    >>> grid.create_pg(["cp", "dp"]) is dp_cp                     # one communicator
    True
    >>> grid.destroy()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..layout import Partition
from ..runtime.mesh_compat import (
    MeshDimRequest,
    consecutive_first_rank,
    forget_rank_map,
    install_mesh_router,
    rank_map_of,
)
from ..runtime.modes import resolve_strategy
from ..runtime.options import GroupOptions, same_as_world
from ..runtime.torch_compat import default_group

if TYPE_CHECKING:
    from ..grid import HyperCommGrid

__all__ = ["MeshRouting", "route_device_meshes", "register_mesh_root", "rebind_mesh_root", "grid_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshRouting:
    """How roots torch builds are given to hypergrid while :func:`route_device_meshes` is on.

    Each such root gets a grid of its own ranks (one dim, ``"mesh"``) made with these settings:
    ``strategy`` and ``timeout`` as for :class:`~hypergrid.grid.HyperCommGrid` (None: the
    process-wide default strategy, the job's timeout), ``check_agreement`` likewise.
    """

    strategy: Optional[str] = None
    timeout: Optional[timedelta] = None
    check_agreement: bool = True


@dataclass
class _Root:
    """A root mesh's rank map, and the grid whose door serves every group of its meshes."""

    grid: HyperCommGrid
    rank_map: weakref.ReferenceType[torch.Tensor]


_roots: dict[int, _Root] = {}
_lock = threading.RLock()
_routing: Optional[MeshRouting] = None


def _forget(key: int) -> None:
    if _lock is None:  # the interpreter is tearing this module down; nothing to forget
        return
    with _lock:
        _roots.pop(key, None)


def _forgetting(key: int) -> Callable[[object], None]:
    """The callback that forgets root ``key`` once its rank map is collected."""
    return lambda _: _forget(key)


def register_mesh_root(mesh: Any, grid: HyperCommGrid) -> None:
    """Serve every group torch makes for ``mesh`` (a root) and the meshes derived from it
    through ``grid``'s door. :func:`hypergrid.device_mesh` calls it for the roots it builds.

    Example, as rank 1 of a 4-rank job on torch's fake backend: a root built over the grid's own
    groups, then flattened by torch::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from hypergrid import HyperCommGrid
        >>> from hypergrid.runtime.mesh_compat import mesh_from_groups
        >>> dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        >>> grid = HyperCommGrid([2, 2], ["tp", "dp"])
        >>> root = mesh_from_groups("cpu", (2, 2), ("dp", "tp"),
        ...                         [grid.create_pg("dp"), grid.create_pg("tp")])
        >>> register_mesh_root(root, grid)
        >>> grid_of(root) is grid, dist.get_process_group_ranks(root._flatten().get_group())
        (True, [0, 1, 2, 3])
        >>> grid.destroy()
        >>> dist.destroy_process_group()
    """
    install_mesh_router(_route)
    rank_map = rank_map_of(mesh)
    # The meshes torch derives from a root over consecutive ranks (any grid's) are then built in
    # O(ndims); O(1) for a root from hypergrid.device_mesh, which is known to be one.
    consecutive_first_rank(rank_map)
    key = id(rank_map)
    with _lock:
        known = _roots.get(key)
        if known is not None and known.rank_map() is rank_map:
            if known.grid is not grid:
                raise ValueError(f"{mesh} already belongs to {known.grid!r}, not {grid!r}")
            return
        _roots[key] = _Root(grid, weakref.ref(rank_map, _forgetting(key)))


def rebind_mesh_root(mesh: Any, grid: HyperCommGrid) -> None:
    """Serve ``mesh``'s root (already served by another grid) through ``grid`` from now on: a
    recovery's new grid takes over the meshes refreshed in place. Its rank map is looked at
    again, as the recovery may have written other ranks into it.

    Example, as rank 0 of a 4-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from hypergrid import HyperCommGrid, device_mesh
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        >>> old, new = HyperCommGrid([2, 2], ["tp", "dp"]), HyperCommGrid([2, 2], ["tp", "dp"])
        >>> mesh = device_mesh(old, device_type="cpu")
        >>> rebind_mesh_root(mesh, new)
        >>> grid_of(mesh) is new
        True
        >>> old.destroy(); new.destroy(); dist.destroy_process_group()
    """
    rank_map = rank_map_of(mesh)
    forget_rank_map(rank_map)
    consecutive_first_rank(rank_map)
    key = id(rank_map)
    with _lock:
        _roots[key] = _Root(grid, weakref.ref(rank_map, _forgetting(key)))


def grid_of(mesh: Any) -> Optional[HyperCommGrid]:
    """The grid whose door serves ``mesh``'s groups, or None for a mesh hypergrid does not serve.

    A mesh from :func:`hypergrid.device_mesh`, anything sliced, flattened or unflattened from it,
    and every root torch built while :func:`route_device_meshes` was on.

    Example::

        >>> grid_of("not a mesh") is None
        True
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        return None
    rank_map = rank_map_of(mesh)
    with _lock:
        root = _roots.get(id(rank_map))
        return root.grid if root is not None and root.rank_map() is rank_map else None


def route_device_meshes(
    enabled: bool = True,
    *,
    strategy: Optional[str] = None,
    timeout: Optional[timedelta] = None,
    check_agreement: bool = True,
) -> None:
    """Give every DeviceMesh torch builds from now on hypergrid's groups (``enabled=False``: stop).

    With it on, a root that torch builds over consecutive ranks (``init_device_mesh``, or a
    ``DeviceMesh`` of ``torch.arange``) gets a grid over its ranks, and every group torch would
    create for it and for the meshes derived from it (``_flatten``, ``_unflatten``) comes from
    hypergrid's registry: each rank creates only its own groups, members agree before they
    wait, and a group with the same ranks and options as one already made (by any mesh, grid or
    the Megatron adapter) is that group. Process-wide; every rank must switch it alike. Roots
    built while it is off, and roots over other rank orders, are left to torch. A torchtitan 0.3
    job needs this one line before ``parallel_dims.build_mesh()``.

    Example, as rank 0 of an 8-rank job on torch's fake backend: torchtitan's way of building
    meshes (unflattening a 1-D world mesh, twice, with dims in common)::

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from hypergrid import REGISTRY
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> route_device_meshes()
        >>> world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
        >>> dense = world._unflatten(0, (2, 2, 2), ("pp", "dp", "tp"))
        >>> sparse = world._unflatten(0, (2, 4), ("pp", "ep"))
        >>> sparse.get_group("pp") is dense.get_group("pp"), REGISTRY.count()   # pp made once
        (True, 4)
        >>> route_device_meshes(False)
        >>> grid_of(world).destroy()
        >>> dist.destroy_process_group()
    """
    global _routing
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
    settings = MeshRouting(resolve_strategy(strategy).value if strategy is not None else None, timeout, check_agreement)
    GroupOptions(timeout=timeout)  # checked here, not at the first mesh
    if not isinstance(check_agreement, bool):
        raise TypeError(f"check_agreement must be a bool, got {check_agreement!r}")
    with _lock:
        _routing = settings if enabled else None
    if enabled:
        install_mesh_router(_route)


# ---------------------------------------------------------------------------- serving torch's calls
def _route(rank_map: torch.Tensor, requests: tuple[MeshDimRequest, ...]) -> Optional[list[str]]:
    grid = _grid_for(rank_map)
    if grid is None:
        return None
    names = [_group_name(grid, request) for request in requests]
    served = [name for name in names if name is not None]
    if served and len(served) != len(names):
        raise AssertionError(f"rank {dist.get_rank()} is in some but not all groups of {requests}")
    return served


def _grid_for(rank_map: torch.Tensor) -> Optional[HyperCommGrid]:
    with _lock:
        root = _roots.get(id(rank_map))
        if root is not None and root.rank_map() is rank_map:
            return root.grid
        settings = _routing
    if settings is None:
        return None
    start = consecutive_first_rank(rank_map)
    if start is None:
        logger.info("a DeviceMesh over ranks that are not consecutive is left to torch")
        return None
    from ..grid import HyperCommGrid

    size = rank_map.numel()
    grid = HyperCommGrid([size], ["mesh"], rank_offset=start, world_size=dist.get_world_size(),
                         strategy=settings.strategy, timeout=settings.timeout,
                         check_agreement=settings.check_agreement)
    key = id(rank_map)
    with _lock:
        _roots[key] = _Root(grid, weakref.ref(rank_map, _forgetting(key)))
    logger.debug("DeviceMesh over ranks [%d, %d) routed through %r", start, start + size, grid)
    return grid


def _group_name(grid: HyperCommGrid, request: MeshDimRequest) -> Optional[str]:
    """This rank's group for one mesh dim, made through the grid's door; None off the mesh."""
    partition = Partition.of(grid.rank_offset, grid.size, request.modes)
    if not partition.contains(dist.get_rank()):
        # Off the mesh this rank has no group; under split it still takes part in the split.
        grid.create_derived_pg(request.name, partition=partition, **_options(grid, request))
        return None
    options = _options(grid, request)
    if partition.group_size == dist.get_world_size() and request.backend is None and request.pg_options is None:
        if same_as_world(GroupOptions(backend=options["backend"], timeout=options["timeout"])):
            return default_group().group_name  # as torch does for a dim spanning the world
    pg = grid.create_derived_pg(request.name, partition=partition, **options)
    return None if pg is None else pg.group_name


def _options(grid: HyperCommGrid, request: MeshDimRequest) -> dict[str, Any]:
    return {
        "backend": request.backend if request.backend is not None else grid.backend,
        "timeout": request.timeout if request.timeout is not None else grid.default_timeout,
        "pg_options": request.pg_options,
        "group_desc": request.group_desc,
    }
