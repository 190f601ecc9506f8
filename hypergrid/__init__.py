"""hypergrid: one N-dimensional grid of named parallel dims, every process group derived from it.

Example::

    >>> from hypergrid import HyperCommGrid
    >>> grid = HyperCommGrid([2, 4], ["tp", "dp"], world_size=8)
    >>> grid.get_rank_enum("dp")
    [[0, 2, 4, 6], [1, 3, 5, 7]]

DeviceMeshes over a grid's own groups come from :func:`device_mesh` (:mod:`hypergrid.mesh`). The
Megatron-Core adapter lives in :mod:`hypergrid.megatron` and is imported only when used, so
``import hypergrid`` works without megatron-core installed.
"""

from __future__ import annotations

from ._lazy import lazy_attributes
from .errors import (
    GridDestroyedError,
    GridMismatchError,
    GridTooLargeError,
    GroupCreationError,
    GroupTimeoutError,
    HypergridError,
    ShapeTypeError,
    UnsupportedTorchError,
)
from .layout import GridLayout, Partition

# Names whose modules import torch.distributed, loaded on first use: planning a layout
# (``python -m hypergrid plan``) needs no torch and starts in a fraction of a second.
_LAZY = {
    "HyperCommGrid": "grid",
    "REGISTRY": "runtime.registry",
    "GroupRegistry": "runtime.registry",
    "device_mesh": "mesh",
    "grid_from_device_mesh": "mesh",
    "grid_from_process_groups": "mesh",
    "route_device_meshes": "mesh",
    "grid_of": "mesh",
    "refresh_meshes": "mesh",
    "refresh_fully_shard": "mesh",
    "ResilientJob": "recovery",
    "RecoverySettings": "recovery",
    "recover": "recovery",
    "grow": "recovery",
    "start_heartbeat": "recovery",
    "train": "training",
    "TrainingState": "training",
    "TrainingRun": "training",
    "RecoveryRecord": "training",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())


__version__ = "0.1.0"

__all__ = [
    "HyperCommGrid",
    "GridLayout",
    "Partition",
    "device_mesh",
    "grid_from_device_mesh",
    "grid_from_process_groups",
    "route_device_meshes",
    "grid_of",
    "refresh_meshes",
    "refresh_fully_shard",
    "ResilientJob",
    "RecoverySettings",
    "recover",
    "grow",
    "start_heartbeat",
    "train",
    "TrainingState",
    "TrainingRun",
    "RecoveryRecord",
    "GroupRegistry",
    "REGISTRY",
    "HypergridError",
    "GridTooLargeError",
    "ShapeTypeError",
    "GridDestroyedError",
    "GroupCreationError",
    "GroupTimeoutError",
    "GridMismatchError",
    "UnsupportedTorchError",
    "__version__",
]
