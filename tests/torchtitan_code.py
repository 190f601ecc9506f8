"""torchtitan's own ``ParallelDims``, loaded without torchtitan's training stack.

torchtitan's package import pulls in its config system, datasets, tokenizers and the rest; its
``distributed/parallel_dims.py`` needs only a logger, the device type and (0.3) ``spmd_types`` and
a config type used in annotations. :func:`load_parallel_dims` runs that file alone, with those
few names stubbed (the library's loader, which ``check --torchtitan`` uses), so the tests and
``benchmarks/bench_mesh.py`` run torchtitan's real mesh code on the fake backend. Used by both;
nothing here is torchtitan's code.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from hypergrid.app import torchtitan_parity as parity

TorchtitanUnavailable = parity.TorchtitanUnavailable


def installed_torchtitan() -> str:
    """The installed torchtitan's version; raises :class:`TorchtitanUnavailable` without one."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise TorchtitanUnavailable("torchtitan is not installed") from None


def load_parallel_dims(device_type: str = "cpu") -> tuple[str, Any]:
    """``(version, module)``: the installed torchtitan's parallel_dims.py, run with stubs
    (:func:`hypergrid.app.torchtitan_parity.load_parallel_dims`, which ``check --torchtitan`` runs)."""
    version, _, module = parity.load_parallel_dims(device_type)
    return version, module


def degrees(version: str, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, dp_replicate: int = 1,
            dp_shard: int = -1) -> dict[str, int]:
    """ParallelDims' keyword arguments in the installed version's spelling (0.2 also has etp)."""
    out = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp, "ep": ep}
    if version.startswith("0.2."):
        out["etp"] = 1
    return out


def build_meshes(module: Any, version: str, world: int, **parallelism: int) -> dict[str, Any]:
    """Run the loaded torchtitan's ``ParallelDims(...).build_mesh()``; its 1-D meshes by name.

    0.3 keeps them in ``_single_axis_meshes`` (the fake-backend ones included); 0.2 has the
    world mesh's dims and the dims it flattened on it.
    """
    dims = module.ParallelDims(**degrees(version, **parallelism), world_size=world)
    world_mesh = dims.build_mesh()
    if hasattr(dims, "_single_axis_meshes") and dims._single_axis_meshes:
        return dict(dims._single_axis_meshes)
    meshes = {name: world_mesh[name] for name in world_mesh.mesh_dim_names}
    meshes.update(world_mesh._get_root_mesh()._flatten_mapping)
    return meshes
