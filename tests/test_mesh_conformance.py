"""DeviceMesh behaves the same on hypergrid's groups as on torch's: a differential check.

torch's own ``test/distributed/test_device_mesh.py`` runs on hypergrid's groups in
``tests/test_torch_device_mesh.py``; this file asks the same kinds of questions of both
implementations side by side, over more meshes: in one 8-rank gloo job, each mesh is built by
``init_device_mesh`` (torch), by ``hypergrid.device_mesh(grid)`` and by ``init_device_mesh`` with
``route_device_meshes()`` on, and every operation of the DeviceMesh surface is run on all three:
the mesh tensor, names, shape, sizes, coordinates and local ranks; every group's ranks; every
slice; every flattening (named and not) and a slice of the flattened dim from the root; every
unflattening of a dim into two; ``_concatenate`` of slices; ``from_group`` over the groups;
equality and hashing against torch's mesh; the errors of bad slices and names; and what flows
through the groups: DTensor sharding, redistribution and functional collectives per dim. Each
outcome (a value, or the type and message of an exception) must be equal to torch's, on every rank.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_gloo

pytestmark = pytest.mark.gloo

WORLD = 8
#: mesh-order shapes and names (slowest dim first), 1-D to 3-D.
MESHES = [((8,), ("dp",)), ((2, 4), ("dp", "tp")), ((2, 2, 2), ("pp", "dp", "tp"))]


def _outcome(fn: Callable[[], Any]) -> Any:
    """What ``fn`` gives: its value, or the exception's type and first line."""
    try:
        return ("value", fn())
    except Exception as exc:  # the outcome under comparison
        return ("error", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def _ranks(pg: Any) -> list[int]:
    return list(dist.get_process_group_ranks(pg))


def _describe(mesh: Any) -> dict:
    names = mesh.mesh_dim_names
    out = {
        "mesh": mesh.mesh.tolist(),
        "names": names,
        "shape": tuple(mesh.shape),
        "ndim": mesh.ndim,
        "size": mesh.size(),
        "coordinate": mesh.get_coordinate(),
        "rank": mesh.get_rank(),
        "groups": [_ranks(pg) for pg in mesh.get_all_groups()],
    }
    for i, name in enumerate(names or ()):
        out[f"size[{name}]"] = mesh.size(i)
        out[f"local_rank[{name}]"] = mesh.get_local_rank(name)
        out[f"group[{name}]"] = _ranks(mesh.get_group(name))
    return out


def _dtensor_checks(mesh: Any) -> dict:
    """What flows through each dim's group: sharding, gathering, reducing."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    torch.manual_seed(0)
    full = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4)
    for i, name in enumerate(mesh.mesh_dim_names):
        placements = [Replicate()] * mesh.ndim
        placements[i] = Shard(0)
        tensor = distribute_tensor(full, mesh, placements)
        out[f"local[{name}]"] = tensor.to_local().tolist()
        out[f"full[{name}]"] = torch.equal(tensor.full_tensor(), full)
        out[f"replicated[{name}]"] = tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local().sum().item()
        mine = torch.tensor([float(dist.get_rank())])
        out[f"all_reduce[{name}]"] = funcol.all_reduce(mine, "sum", (mesh, i)).item()
        out[f"all_gather[{name}]"] = funcol.all_gather_tensor(mine, 0, (mesh, i)).tolist()
    return out


def _operations(root: Any, reference: Any) -> dict:
    """Every check on one root mesh; keys name the operation."""
    names = root.mesh_dim_names
    out: dict = {"root": _describe(root)}
    out["equal_to_torch"] = _outcome(lambda: root == reference)
    out["hash_equal_to_torch"] = _outcome(lambda: hash(root) == hash(reference))
    out["dtensor"] = _outcome(lambda: _dtensor_checks(root))
    for count in range(1, len(names) + 1):
        for dims in itertools.combinations(names, count):
            out[f"slice{dims}"] = _outcome(lambda dims=dims: _describe(root[dims]))
            if count >= 2:
                flat = "_".join(dims)
                out[f"flatten{dims}"] = _outcome(lambda dims=dims: _describe(root[dims]._flatten()))
                out[f"flatten{dims} named"] = _outcome(lambda dims=dims: _describe(root[dims]._flatten(f"f_{'_'.join(dims)}")))
                out[f"root[{flat}]"] = _outcome(lambda flat=flat: _describe(root[flat]))
    for name in names:
        size = root.size(names.index(name))
        if size >= 4:
            out[f"unflatten[{name}]"] = _outcome(
                lambda name=name, size=size: _describe(root._unflatten(name, (2, size // 2), (f"{name}0", f"{name}1")))
            )
    if len(names) >= 2:
        out["concatenate"] = _outcome(lambda: _describe(type(root)._concatenate([root[names[0]], root[names[-1]]])))
        out["from_group"] = _outcome(
            lambda: _describe(type(root).from_group([root.get_group(n) for n in names], "cpu", root.mesh, mesh_dim_names=names))
        )
    out["bad slice name"] = _outcome(lambda: root["nope"])
    out["bad slice order"] = _outcome(lambda: root[tuple(reversed(names))]) if len(names) > 1 else None
    out["flatten onto a dim name"] = _outcome(lambda: root[names]._flatten(names[0])) if len(names) > 1 else None
    out["unflatten bad sizes"] = _outcome(lambda: root._unflatten(names[0], (3, 5), ("a", "b")))
    return out


def _job(rank: int, world: int) -> list[dict]:
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    from hypergrid import HyperCommGrid, device_mesh, grid_of, route_device_meshes

    results = []
    for shape, names in MESHES:
        theirs = init_device_mesh("cpu", shape, mesh_dim_names=names)
        grid = HyperCommGrid(list(reversed(shape)), list(reversed(names)))
        ours = device_mesh(grid, device_type="cpu")
        route_device_meshes()
        routed = init_device_mesh("cpu", shape, mesh_dim_names=names)
        route_device_meshes(False)
        results.append({
            "torch": _operations(theirs, theirs),
            "grid": _operations(ours, theirs),
            "routed": _operations(routed, theirs),
            "routed_served": grid_of(routed) is not None,
        })
        grid.destroy()
        grid_of(routed).destroy()
    return results


def test_device_mesh_operations_give_torchs_outcomes_on_hypergrids_groups():
    results = run_gloo(_job, WORLD, timeout=400)
    checks = 0
    for rank, per_mesh in enumerate(results):
        for (shape, _), result in zip(MESHES, per_mesh):
            assert result["routed_served"], (rank, shape)
            for label in ("grid", "routed"):
                differing = sorted(k for k in result["torch"] if result[label][k] != result["torch"][k])
                assert not differing, (rank, shape, label, {k: (result[label][k], result["torch"][k]) for k in differing})
                checks += len(result["torch"])
            # the operations did run, and some of them are errors torch raises, equally
            assert result["torch"]["dtensor"][0] == "value", result["torch"]["dtensor"]
            assert result["torch"]["bad slice name"][0] == "error"
    assert checks >= WORLD * 2 * 40, checks
