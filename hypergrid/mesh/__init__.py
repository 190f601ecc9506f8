"""The DeviceMesh adapter: torch ``DeviceMesh`` objects over a grid's own process groups.

:func:`device_mesh` builds a mesh whose dims are the grid's groups; :func:`route_device_meshes`
makes every group torch's own mesh operations create (``_flatten``, ``_unflatten``, a routed
``init_device_mesh``) come from hypergrid's registry; :func:`grid_from_device_mesh` and
:func:`grid_from_process_groups` go the other way, adopting groups made elsewhere;
:func:`refresh_meshes` and :func:`refresh_fully_shard` carry meshes, and the FSDP2 modules on
them, over a recovery in place.

Example::

    >>> from hypergrid.layout import GridLayout
    >>> flattened_name(GridLayout((2, 4), ("tp", "dp")), ["tp", "dp"])   # torch's name for the flattened dims
    'dp_tp'
"""

from __future__ import annotations

from .adapter import device_mesh, flattened_name, grid_from_device_mesh, grid_from_process_groups, mesh_tensor
from .refresh import MeshRefreshError, MeshShapeChangedError, refresh_fully_shard, refresh_meshes
from .routing import MeshRouting, grid_of, register_mesh_root, route_device_meshes

__all__ = [
    "device_mesh",
    "grid_from_device_mesh",
    "grid_from_process_groups",
    "mesh_tensor",
    "flattened_name",
    "MeshRouting",
    "route_device_meshes",
    "register_mesh_root",
    "grid_of",
    "refresh_meshes",
    "refresh_fully_shard",
    "MeshRefreshError",
    "MeshShapeChangedError",
]
