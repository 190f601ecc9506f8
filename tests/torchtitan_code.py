"""torchtitan's own ``ParallelDims``, loaded without torchtitan's training stack.

torchtitan's package import pulls in its config system, datasets, tokenizers and the rest; its
``distributed/parallel_dims.py`` needs only a logger, the device type and (0.3) ``spmd_types`` and
a config type used in annotations. :func:`load_parallel_dims` runs that file alone, with those
few names stubbed, so the tests and ``benchmarks/bench_mesh.py`` run torchtitan's real mesh code
on the fake backend. Used by both; nothing here is torchtitan's code.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

#: The package modules parallel_dims.py imports from torchtitan itself, stubbed.
_STUBS = ("torchtitan", "torchtitan.tools", "torchtitan.tools.logging", "torchtitan.tools.utils",
          "torchtitan.config", "torchtitan.config.configs")


class TorchtitanUnavailable(Exception):
    """Why torchtitan's ParallelDims cannot be loaded here (the message is the reason)."""


def installed_torchtitan() -> str:
    """The installed torchtitan's version; raises :class:`TorchtitanUnavailable` without one."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise TorchtitanUnavailable("torchtitan is not installed") from None


def load_parallel_dims(device_type: str = "cpu") -> tuple[str, Any]:
    """``(version, module)``: the installed torchtitan's parallel_dims.py, run with stubs.

    Restores ``sys.modules`` afterwards, so later real imports of torchtitan are not affected.
    """
    version = installed_torchtitan()
    source = Path(str(importlib.metadata.distribution("torchtitan").locate_file("torchtitan/distributed/parallel_dims.py")))
    if not source.is_file():
        raise TorchtitanUnavailable(f"torchtitan {version} has no {source}")
    stubs = {name: types.ModuleType(name) for name in _STUBS}
    stubs["torchtitan.tools.logging"].logger = logging.getLogger("torchtitan")  # type: ignore[attr-defined]
    stubs["torchtitan.tools.utils"].device_type = device_type  # type: ignore[attr-defined]
    stubs["torchtitan.config.configs"].ParallelismConfig = object  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in _STUBS}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(f"_torchtitan_{version.replace('.', '_')}_parallel_dims", source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while they are built
        try:
            spec.loader.exec_module(module)
        except ImportError as exc:
            raise TorchtitanUnavailable(f"torchtitan {version}'s parallel_dims.py needs {exc.name}: {exc}") from exc
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
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
