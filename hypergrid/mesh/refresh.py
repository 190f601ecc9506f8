"""Meshes, and the FSDP2 modules built on them, carried over a recovery in place.

A recovery (:meth:`hypergrid.ResilientJob.recover`) hands each survivor a new grid: the groups
the loss did not touch are the same ProcessGroup objects, the others are made anew. The
DeviceMesh objects :func:`hypergrid.device_mesh` built over the old grid, every mesh sliced,
flattened or unflattened from them, and the DTensors and ``fully_shard`` modules that hold them,
still name the old groups. :func:`refresh_meshes` rewrites those meshes in place, so every object
that holds one runs on the new groups, and makes them the new grid's (``device_mesh(new_grid)``
returns the same objects); :func:`refresh_fully_shard` then derives what FSDP2 cached from its
meshes again. Nothing is wrapped again.

Only a recovery that keeps the grid's shape can be carried over in place: a spare took a lost
rank's position (``replace``). A recovery that changes the replica dim's size (``shrink``, or
``grow`` back) changes every mesh's shape, and with it every DTensor's and FSDP2 parameter's
sharding; :func:`refresh_meshes` refuses it (:class:`MeshShapeChangedError`, naming both
shapes), and the job builds its meshes and wraps its model again on the new grid.

What cannot be swapped, and is refused before anything changes:

* a mesh dim whose group the grid did not make (torch's own ``_flatten()`` / ``_unflatten()`` of
  a grid's mesh, made as a derived group that the recovery does not rebuild) and whose group the
  recovery destroyed: give it to ``device_mesh(..., flatten=...)`` before the job is made, so
  that the grid makes it and a recovery rebuilds it;
* a grid group created after :meth:`ResilientJob.of_grid <hypergrid.ResilientJob.of_grid>` (the
  job's recipe is the grid's groups when it was made): build the meshes before the job;
* an FSDP2 mesh hypergrid did not make: ``reshard_after_forward=<int>`` builds a mesh of its own
  with torch's own groups; use True or False.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..errors import HypergridError
from ..runtime import mesh_compat
from ..runtime import refresh_compat as compat
from .adapter import hand_over, mesh_tensor, meshes_of
from .routing import grid_of, rebind_mesh_root

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from ..grid import HyperCommGrid

__all__ = ["refresh_meshes", "refresh_fully_shard", "MeshShapeChangedError", "MeshRefreshError"]

logger = logging.getLogger(__name__)

# The latest refresh's old group names -> new groups, for refresh_fully_shard's cached groups.
_renamed: dict[str, dist.ProcessGroup] = {}


class MeshRefreshError(HypergridError):
    """A mesh or an FSDP2 module holds a group that a recovery cannot swap in place."""


class MeshShapeChangedError(MeshRefreshError, ValueError):
    """The recovery changed the grid's shape: its meshes cannot be carried over in place."""


def refresh_meshes(old_grid: HyperCommGrid, new_grid: HyperCommGrid) -> list[DeviceMesh]:
    """Carry every DeviceMesh built over ``old_grid`` over to ``new_grid`` in place; return them.

    For each root :func:`hypergrid.device_mesh` built over ``old_grid`` (one per view and device
    type), the root and every mesh derived from it (slices, flattened and unflattened dims,
    concatenations; the ones FSDP2 and DTensors hold among them) get the new grid's ranks, this
    rank's new coordinate and, per dim, the new grid's group; unchanged groups stay the same
    objects. The roots become ``new_grid``'s: ``device_mesh(new_grid, ...)`` returns the same
    objects, and torch's own mesh operations on them are served by ``new_grid``. Call it on every
    survivor right after the recovery, before the next collective on a mesh; a spare has no
    meshes of the old grid and calls :func:`hypergrid.device_mesh` on the new one. Local: no
    collective, no group made. Returns [] where ``old_grid`` has no meshes.

    Example, as rank 0 of a 6-rank job on torch's fake backend: ranks 2 and 3 (a node) are lost
    and the spares 4 and 5 take their places::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> import hypergrid
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=6)
        >>> grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
        >>> mesh = hypergrid.device_mesh(grid, device_type="cpu")   # before the job: its recipe
        >>> job = hypergrid.ResilientJob.of_grid(grid, spares=[4, 5],
        ...     settings=hypergrid.RecoverySettings(gpus_per_node=2, replica_dim="dp_replicate"))
        >>> after = job.recover(failed=[2, 3])
        >>> refreshed = refresh_meshes(grid, after.state)
        >>> mesh.mesh.tolist(), mesh.get_group("dp_replicate") is after.state.get_pg("dp_replicate")
        ([[0, 1], [4, 5]], True)
        >>> hypergrid.device_mesh(after.state, device_type="cpu") is mesh
        True
        >>> after.destroy(); dist.destroy_process_group()

    Raises:
        MeshShapeChangedError: the new grid's shape, dims or views differ (a shrink or a grow).
        MeshRefreshError: this rank is not in the new grid, or a mesh dim's group cannot be
            swapped (see the module's docstring); nothing was changed.
        UnsupportedTorchError: the installed torch's DeviceMesh keeps its state otherwise.
    """
    from ..grid import HyperCommGrid

    for name, grid in (("old_grid", old_grid), ("new_grid", new_grid)):
        if not isinstance(grid, HyperCommGrid):
            raise TypeError(f"{name} must be a HyperCommGrid, got {type(grid).__name__} {grid!r}")
    entries = meshes_of(old_grid)
    if not entries:
        return []
    _check_same_shape(old_grid, new_grid, {view for view, _ in entries})
    rank = dist.get_rank()
    if not new_grid.layout.contains(rank):
        raise MeshRefreshError(f"rank {rank} holds no position of the new grid {new_grid!r}: its meshes of "
                               f"{old_grid!r} cannot be carried over; let them go")
    # Everything is planned and checked first, so that a refusal changes nothing.
    plans = [_plan(new_grid, key, entry) for key, entry in entries.items()]
    renamed: dict[str, dist.ProcessGroup] = {}
    refreshed: list[Any] = []
    for key, entry, family, ranks, names in plans:
        compat.rewrite_meshes(family, ranks, names)
        groups = tuple(new_grid.get_pg(name, view=key[0]) for name in entry[1].mesh_dim_names)
        hand_over(new_grid, key, (groups, entry[1], dict(entry[2])))
        rebind_mesh_root(entry[1], new_grid)
        renamed.update(names)
        refreshed += family
    _renamed.clear()
    _renamed.update(renamed)
    logger.info("rank %d: %d meshes of %r now run on %r (%d groups swapped)", rank, len(refreshed), old_grid,
                new_grid, len(renamed))
    return refreshed


def _check_same_shape(old: HyperCommGrid, new: HyperCommGrid, views: set) -> None:
    for view in sorted(views, key=str):
        before = old.layout if view is None else old.views[view]
        after = new.layout if view is None else new.views.get(view) if view in new.views else None
        if after is None or tuple(before.shape) != tuple(after.shape) or tuple(before.dim_names) != tuple(after.dim_names):
            where = "" if view is None else f" (view {view!r})"
            shape_after = None if after is None else dict(zip(after.dim_names, after.shape))
            raise MeshShapeChangedError(
                f"the recovery changed the grid's shape{where} from {dict(zip(before.dim_names, before.shape))} "
                f"to {shape_after}: a DeviceMesh, and the DTensors and FSDP2 modules on it, keep their shape, "
                f"so they cannot be carried over in place; build them again with hypergrid.device_mesh on the "
                f"new grid (and fully_shard the model again)"
            )


def _plan(new_grid: HyperCommGrid, key: tuple, entry: Any) -> tuple[tuple, Any, list[Any], list[int], dict[str, Any]]:
    """One root's refresh, checked: its family, its new ranks, and old group name -> new group."""
    view = key[0]
    old_groups, root, flats = entry
    layout = new_grid.layout if view is None else new_grid.views[view]
    names: dict[str, dist.ProcessGroup] = {}
    wanted = [((dim,), pg) for dim, pg in zip(root.mesh_dim_names, old_groups)]
    for flat_name, dims in flats.items():
        old = compat.group_names(mesh_compat.flattened_meshes(root)[flat_name])
        wanted.append((dims, old[0] if old else None))
    for dims, old in wanted:
        old_name = old.group_name if isinstance(old, dist.ProcessGroup) else old
        if old_name is None:
            continue
        try:
            new = new_grid.get_pg(list(dims), view=view)
        except KeyError:
            raise MeshRefreshError(
                f"the new grid has no group over {list(dims)}: the mesh's group for them was made after the "
                f"job (ResilientJob.of_grid rebuilds the groups the grid had when it was made); build the "
                f"meshes with hypergrid.device_mesh before making the job"
            ) from None
        if new is not None and new.group_name != old_name:
            names[old_name] = new
    family = mesh_compat.mesh_family(root)
    lost = [(list(m.mesh_dim_names or ()), n) for m in family for n in compat.group_names(m)
            if n not in names and not compat.group_alive(n)]
    if lost:
        raise MeshRefreshError(
            f"meshes of the old grid use groups the recovery destroyed and the new grid did not make again: "
            f"{lost[:4]} (dims, group name); such a group comes from torch's own _flatten()/_unflatten() of a "
            f"grid's mesh: name it in device_mesh(..., flatten=...) before making the job, so that a "
            f"recovery rebuilds it"
        )
    ranks = [int(r) for r in mesh_tensor(layout).reshape(-1).tolist()]
    return key, entry, family, ranks, names


def refresh_fully_shard(module: nn.Module) -> list[nn.Module]:
    """Make every ``fully_shard`` module under ``module`` run on its refreshed meshes; return them.

    Call it after :func:`refresh_meshes`, on the survivors. For each FSDP2 state: an iteration
    the failure interrupted is ended (torch's ``reset_iter_state`` on the root: in-flight
    collectives waited on, parameters resharded, the failed iteration's gradients discarded),
    each mesh info derives its shard and replicate groups, sizes and ranks again from its mesh
    (a ``reduce_scatter_process_group`` set by ``set_separate_reduce_scatter_group`` is swapped
    for its successor where the grid made it anew), and a communication object holding a group
    gets that group's successor. The parameters' DTensors and sharding specs hold the meshes
    themselves, already refreshed. Local: no collective. The optimizer and the sharded
    parameters stay as they are: rolling them back is the caller's.

    Example, as rank 0 of a 6-rank job on torch's fake backend: HSDP over dp_replicate x dp_shard,
    a node lost and replaced by spares::

        >>> import torch, torch.distributed as dist
        >>> from torch.distributed.fsdp import fully_shard
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> import hypergrid
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=6)
        >>> grid = hypergrid.HyperCommGrid([2, 2], ["dp_shard", "dp_replicate"])
        >>> model = fully_shard(torch.nn.Linear(4, 4), mesh=hypergrid.device_mesh(grid, device_type="cpu"))
        >>> job = hypergrid.ResilientJob.of_grid(grid, spares=[4, 5],
        ...     settings=hypergrid.RecoverySettings(gpus_per_node=2, replica_dim="dp_replicate"))
        >>> after = job.recover(failed=[2, 3])
        >>> _ = refresh_meshes(grid, after.state)
        >>> refresh_fully_shard(model) == [model]
        True
        >>> info = fully_shard.state(model)._fsdp_param_groups[0].mesh_info
        >>> info.replicate_process_group is after.state.get_pg("dp_replicate")
        True
        >>> after.destroy(); dist.destroy_process_group()

    Raises:
        MeshRefreshError: an FSDP2 state holds a mesh hypergrid does not serve, or a group that is
            gone and has no successor; nothing was changed.
        UnsupportedTorchError: the installed torch's FSDP2 keeps its state otherwise.
    """
    states = compat.fsdp_states(module)
    infos: dict[int, Any] = {}
    for sub, state in states:
        for info in compat.fsdp_mesh_infos(state):
            infos.setdefault(id(info), (sub, info))
    for sub, info in infos.values():
        _check_info(sub, info)
    holders = [(sub, obj, name) for sub, state in states for obj, name in compat.fsdp_group_holders(state)]
    for sub, obj, name in holders:
        _successor(sub, getattr(obj, name))
    for sub, state in states:
        compat.reset_iteration(sub, state)
    for _, info in infos.values():
        compat.rederive_mesh_info(info, _renamed)
    for sub, obj, name in holders:
        setattr(obj, name, _successor(sub, getattr(obj, name)))
    logger.info("rank %d: %d fully_shard modules (%d mesh infos) refreshed", dist.get_rank(), len(states), len(infos))
    return [sub for sub, _ in states]


def _check_info(module: Any, info: Any) -> None:
    mesh = info.mesh
    if grid_of(mesh) is None:
        raise MeshRefreshError(
            f"an FSDP2 state of {type(module).__name__} holds {mesh}, which hypergrid did not make "
            f"(reshard_after_forward=<int> builds a mesh of its own, with torch's groups): its groups cannot be "
            f"swapped; use reshard_after_forward=True or False, or fully_shard the model again"
        )
    dead = [n for n in compat.group_names(mesh) if not compat.group_alive(n)]
    if dead:
        raise MeshRefreshError(f"an FSDP2 state of {type(module).__name__} holds {mesh}, whose groups {dead} are "
                               f"gone: call hypergrid.refresh_meshes(old_grid, new_grid) first")
    for group in compat.mesh_info_groups(info).values():
        _successor(module, group)


def _successor(module: Any, pg: dist.ProcessGroup) -> dist.ProcessGroup:
    """``pg``'s successor after the latest refresh: itself where it is alive and not replaced."""
    new = _renamed.get(pg.group_name)
    if new is not None:
        return new
    if not compat.group_alive(pg.group_name):
        raise MeshRefreshError(f"an FSDP2 state of {type(module).__name__} holds group {pg.group_name!r}, which "
                               f"is gone and was not made again by the recovery; it cannot be swapped")
    return pg
