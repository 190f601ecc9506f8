"""What made the groups in a run of torch's DeviceMesh tests: torch's mesh code, or hypergrid.

Installed by :mod:`tests.torch_upstream.plugin` in both runs. It counts the groups torch's
``device_mesh`` module asks its own ``new_group`` / ``split_group`` for (hypergrid calls
``torch.distributed``'s, not the mesh module's names, so these are the groups made behind the
grid), and at the end of every test that started its ranks' process group (``with_comms``)
each rank appends one line to the file named by ``HYPERGRID_MESH_WITNESS``: the test, the rank,
that count and how many groups hypergrid's registry holds. Without the variable it does nothing.

Example::

    >>> # install(DTensorTestBase)   # in each rank, before its first mesh
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch.distributed as dist
import torch.distributed.device_mesh as mesh_module

#: Environment variable: the file each rank appends its lines to.
WITNESS_FILE = "HYPERGRID_MESH_WITNESS"

_torch_calls = 0


def _counted(original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        global _torch_calls
        _torch_calls += 1
        return original(*args, **kwargs)

    return call


def install(test_base: type) -> None:
    """Count torch's mesh-made groups, and report them at each ``test_base.destroy_pg``."""
    path = os.environ.get(WITNESS_FILE)
    if not path:
        return
    for name in ("new_group", "split_group"):
        if hasattr(mesh_module, name):
            setattr(mesh_module, name, _counted(getattr(mesh_module, name)))
    destroy = test_base.destroy_pg

    def destroy_pg(self: Any, *args: Any, **kwargs: Any) -> None:
        # The control run never imports hypergrid: its registry is then empty by definition.
        hypergrid = sys.modules.get("hypergrid")
        line = {"test": f"{type(self).__name__}::{self._testMethodName}", "rank": dist.get_rank(),
                "torch_mesh_groups": _torch_calls,
                "hypergrid_groups": hypergrid.REGISTRY.count() if hypergrid is not None else 0}
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
        destroy(self, *args, **kwargs)

    test_base.destroy_pg = destroy_pg
