"""Meshes built in O(ndims) hold exactly the state torch's own constructor gives them.

A root from ``device_mesh(grid)`` and every mesh torch derives from it, or from a root routed by
``route_device_meshes()`` (slices, ``_flatten``, ``_unflatten``, ``_concatenate``), skip torch's
O(world) constructor (``hypergrid.runtime.mesh_compat``). Here each such mesh is compared, attribute by
attribute, with the mesh torch's constructor builds from the same arguments, and with torch's own
``init_device_mesh`` meshes: equality, hash, coordinates, the mesh tensor, the groups' ranks, and
the rank map tuple shared with the root (the very object). One rank of a fake world at a time,
inside and outside the mesh, grids from rank 0 and beyond; then one rank of 1,048,576 shows that
no list of the world is built. Meshes not rooted at hypergrid stay torch's constructor's.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hypergrid import HyperCommGrid, device_mesh, route_device_meshes
from hypergrid.runtime import mesh_compat as compat
from tests.harness import fake_world

warnings.filterwarnings("ignore", message="Slicing a flattened dim")


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return ("value", fn())
    except Exception as exc:  # the outcome under comparison
        return ("error", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def _torch_twin(mesh: Any) -> Any:
    """The mesh torch's own constructor builds from the arguments torch derived ``mesh`` with."""
    twin = DeviceMesh.__new__(DeviceMesh)
    extra = {"preserve_rank_order": mesh._preserve_rank_order} if hasattr(mesh, "_preserve_rank_order") else {}
    compat._torch_init(twin, mesh.device_type, _layout=mesh._layout, _rank_map=mesh._rank_map,
                       mesh_dim_names=mesh.mesh_dim_names, _root_mesh=mesh._root_mesh, _init_backend=False, **extra)
    twin._dim_group_names = list(mesh._dim_group_names)
    return twin


def _assert_same_state(fast: Any, torch_built: Any) -> None:
    assert set(vars(fast)) == set(vars(torch_built))
    for name, value in vars(torch_built).items():
        mine = vars(fast)[name]
        if isinstance(value, torch.Tensor):
            assert torch.equal(mine, value) and mine.dtype == value.dtype, name
        else:
            assert mine == value, name
    assert fast == torch_built and hash(fast) == hash(torch_built)
    assert fast.get_coordinate() == torch_built.get_coordinate()
    assert _outcome(lambda: fast.mesh.tolist()) == _outcome(lambda: torch_built.mesh.tolist())


def _derived(mesh: Any) -> list[Any]:
    """Every kind of mesh torch derives from a root: slices, flattened dims, an unflattened dim,
    a concatenation; each on this rank, or the error torch raises building it here."""
    names = mesh.mesh_dim_names
    out = []
    for count in range(1, len(names)):
        for subset in itertools.combinations(names, count):
            out.append(_outcome(lambda subset=subset: mesh[subset]))
    for count in range(2, len(names) + 1):
        for subset in itertools.combinations(names, count):
            out.append(_outcome(lambda subset=subset: mesh[subset]._flatten()))
    out.append(_outcome(lambda: mesh._flatten("everything")))
    out.append(_outcome(lambda: mesh._unflatten(names[0], (2, mesh.size(0) // 2), ("outer", "inner"))))
    out.append(_outcome(lambda: DeviceMesh._concatenate([mesh[names[-1]], mesh[names[0]]])
                        if len(names) > 1 else mesh))
    return out


CASES = [  # (world, grid shape, rank_offset, ranks)
    (8, [2, 2, 2], 0, [0, 5]),
    (64, [4, 2, 8], 0, [0, 21, 63]),
    (96, [4, 2, 4], 32, [3, 32, 77, 95]),
    (48, [2, 4], 40, [0, 41, 47]),
    (16, [2, 1, 8], 0, [5, 14]),  # a dim of size 1, as torchtitan's unused dims
]


@pytest.mark.parametrize("world,shape,offset,ranks", CASES, ids=[f"w{c[0]}-off{c[2]}" for c in CASES])
def test_fast_meshes_hold_torch_constructor_state(world, shape, offset, ranks):
    for rank in ranks:
        with fake_world(rank=rank, world_size=world):
            grid = HyperCommGrid(shape, ["tp", "cp", "dp"][: len(shape)], rank_offset=offset)
            mesh = device_mesh(grid, device_type="cpu")
            inside = offset <= rank < offset + grid.size
            # The root: what from_group builds over the same groups, or torch's mesh off it.
            tensor = torch.arange(offset, offset + grid.size, dtype=torch.int).reshape(tuple(reversed(shape)))
            if inside:
                reference = DeviceMesh.from_group([mesh.get_group(i) for i in range(mesh.ndim)], "cpu", tensor,
                                                  mesh_dim_names=mesh.mesh_dim_names)
            else:
                reference = DeviceMesh("cpu", tensor, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)
                reference._dim_group_names = []
            _assert_same_state(mesh, reference)
            assert mesh.get_coordinate() == (tuple(reversed(grid.coords(rank).values())) if inside else None)
            outcomes = _derived(mesh)
            if not inside:
                # Off the mesh torch refuses to build some meshes; the same ones, with the same error.
                errors = [o if o[0] == "error" else "built" for o in _derived(reference)]
                assert [o if o[0] == "error" else "built" for o in outcomes] == errors
            for outcome in outcomes:
                if outcome[0] == "error":
                    assert not inside, outcome
                    continue
                derived = outcome[1]
                _assert_same_state(derived, _torch_twin(derived))
                assert derived._flatten_rank_map is mesh._flatten_rank_map
                assert derived._rank_map is mesh._rank_map
            grid.destroy()


@pytest.mark.parametrize("rank", [2, 9, 13])
def test_fast_meshes_equal_torch_meshes_with_the_same_groups(rank):
    """Against init_device_mesh itself: equal meshes, equal hashes, the same coordinates, mesh
    tensors and group members, slice by slice and flattened dim by flattened dim."""
    with fake_world(rank=rank, world_size=16):
        grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
        ours = device_mesh(grid, device_type="cpu")
        theirs = init_device_mesh("cpu", (4, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        pairs = [(ours, theirs)]
        for subset in (("dp",), ("cp", "tp"), ("dp", "tp")):
            pairs.append((ours[subset], theirs[subset]))
        for subset in (("dp", "cp"), ("cp", "tp")):
            pairs.append((ours[subset]._flatten(), theirs[subset]._flatten()))
        pairs.append((ours._unflatten("dp", (2, 2), ("dp_r", "dp_s")), theirs._unflatten("dp", (2, 2), ("dp_r", "dp_s"))))
        for mine, reference in pairs:
            assert mine == reference and hash(mine) == hash(reference)
            assert mine.get_coordinate() == reference.get_coordinate()
            assert torch.equal(mine.mesh, reference.mesh)
            assert set(vars(mine)) == set(vars(reference))
            for i in range(mine.ndim):
                assert dist.get_process_group_ranks(mine.get_group(i)) == dist.get_process_group_ranks(reference.get_group(i))
            assert mine._flatten_rank_map is ours._flatten_rank_map
        # torch's own meshes are its constructor's: each holds a tuple of its own.
        assert theirs["tp"]._flatten_rank_map is not theirs._flatten_rank_map
        grid.destroy()


def test_routed_roots_derive_meshes_in_place():
    with fake_world(rank=6, world_size=32):
        route_device_meshes()
        try:
            world = init_device_mesh("cpu", (32,), mesh_dim_names=("world",))
            dense = world._unflatten(0, (2, 4, 4), ("pp", "dp", "tp"))
            flat = dense["dp", "tp"]._flatten()
        finally:
            route_device_meshes(False)
        for mesh in (dense, dense["pp"], flat):
            assert mesh._flatten_rank_map is world._flatten_rank_map
            _assert_same_state(mesh, _torch_twin(mesh))
        assert flat.get_coordinate() == (6,) and dense.get_coordinate() == (0, 1, 2)


def test_a_torch_with_other_mesh_state_builds_every_mesh_itself(monkeypatch):
    """Feature detection: an attribute torch sets that this module does not know (or one it no
    longer sets) turns the fast path off; the meshes are then torch's constructor's, and equal."""
    monkeypatch.setattr(compat, "_TORCH_STATE", compat._TORCH_STATE | {"_a_new_field"})
    compat._torch_attributes.cache_clear()
    try:
        assert compat._torch_attributes() is None
        with fake_world(rank=3, world_size=8):
            grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
            mesh = device_mesh(grid, device_type="cpu")
            flat = mesh["dp", "cp"]._flatten()
            assert flat._flatten_rank_map is not mesh._flatten_rank_map
            assert flat == init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))["dp", "cp"]._flatten()
            assert flat.get_coordinate() == (1,)
            grid.destroy()
    finally:
        monkeypatch.undo()
        compat._torch_attributes.cache_clear()
    assert compat._torch_attributes() is not None


def test_a_million_ranks_build_no_list_of_the_world(monkeypatch):
    """One rank of 1,048,576: a mesh and two torch flattens make no Python list from a tensor
    larger than a group, never run torch's coordinate search, and share one tuple of ranks."""
    from torch.distributed._mesh_layout import _MeshLayout

    world = 1 << 20
    sizes: list[int] = []
    searches = {"coordinate": 0, "remap": 0}
    tolist = torch.Tensor.tolist
    remap = _MeshLayout.remap_to_tensor
    coordinate = DeviceMesh._compute_coordinate_on_dim

    def counted_tolist(self: torch.Tensor) -> Any:
        sizes.append(self.numel())
        return tolist(self)

    def counted_remap(self: Any, rank_map: torch.Tensor) -> torch.Tensor:
        searches["remap"] += 1
        return remap(self, rank_map)

    def counted_coordinate(self: Any) -> Any:
        searches["coordinate"] += 1
        return coordinate(self)

    compat._torch_attributes()  # the one-rank mesh torch builds once, to learn its state
    with fake_world(rank=world // 2 + 3, world_size=world):
        grid = HyperCommGrid([4, 2, world // 8], ["tp", "cp", "dp"])
        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
        monkeypatch.setattr(_MeshLayout, "remap_to_tensor", counted_remap)
        monkeypatch.setattr(DeviceMesh, "_compute_coordinate_on_dim", counted_coordinate)
        mesh = device_mesh(grid, device_type="cpu")
        dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
        cp_tp = mesh["cp", "tp"]._flatten("cp_tp")
        monkeypatch.undo()
        assert max(sizes, default=0) <= 8, sizes
        assert searches == {"coordinate": 0, "remap": 0}
        assert dp_cp._flatten_rank_map is mesh._flatten_rank_map is cp_tp._flatten_rank_map
        rank = world // 2 + 3
        assert mesh.get_coordinate() == (rank // 8, rank // 4 % 2, rank % 4)
        assert dp_cp.get_coordinate() == (rank // 4,) and cp_tp.get_coordinate() == (rank % 8,)
        assert dist.get_process_group_ranks(cp_tp.get_group()) == list(range(rank // 8 * 8, rank // 8 * 8 + 8))
        grid.destroy()
