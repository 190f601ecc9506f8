"""DeviceMesh adapter: torch ``DeviceMesh`` objects over the grid's own process groups.

DTensor, FSDP2, tensor-parallel styles and functional collectives take a
:class:`torch.distributed.device_mesh.DeviceMesh`; Megatron-style code takes process groups.
This module makes both worlds use one set of communicators:

* :func:`device_mesh` (``device_mesh(grid)``) builds a real DeviceMesh whose mesh tensor and
  dim names follow the grid (slowest dim first: the *reversed* ``dim_names``), whose dims use the
  grid's groups, and whose flattened dims (``mesh["dp_cp"]``) are the grid's multi-dim groups.
  It creates no process group of its own: a missing dim group is created through the grid, and
  so shared by every grid, view and adapter whose members coincide.
* :func:`grid_from_device_mesh` and :func:`grid_from_process_groups` go the other way: a grid
  that adopts groups which already exist (a mesh from ``init_device_mesh``, communicators made
  elsewhere) and creates none. hypergrid never destroys an adopted group.

Every group torch's own mesh operations would create on such a mesh (``_flatten``,
``_unflatten``) comes from the grid's registry too (:mod:`hypergrid.mesh.routing`). Every private
torch attribute used here is reached through :mod:`hypergrid.runtime.mesh_compat`.

Example, as rank 0 of an 8-rank job on torch's fake backend, which needs no other process::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from hypergrid import HyperCommGrid
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    >>> grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    >>> dp_cp = grid.create_pg(["cp", "dp"])
    >>> mesh = device_mesh(grid, device_type="cpu")  # no new group: the grid's own ones
    >>> mesh.mesh_dim_names, mesh.shape
    (('dp', 'cp', 'tp'), (2, 2, 2))
    >>> mesh.get_group("tp") is grid.get_pg("tp"), mesh["dp_cp"].get_group() is dp_cp
    (True, True)
    >>> grid.destroy()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import torch
import torch.distributed as dist

from ..errors import HypergridError
from ..layout import Dims, GridLayout
from ..layout.checks import backend_parts
from ..runtime import mesh_compat as compat
from ..runtime.options import GroupOptions
from ..runtime.registry import REGISTRY
from .routing import register_mesh_root

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..grid import HyperCommGrid

__all__ = [
    "device_mesh",
    "grid_from_device_mesh",
    "grid_from_process_groups",
    "mesh_tensor",
    "flattened_name",
]

logger = logging.getLogger(__name__)

#: A root mesh as its grid holds it: this rank's dim groups (mesh order), the mesh, and the grid
#: dims of each flattened dim registered on it, by name.
MeshEntry = tuple[tuple, Any, dict[str, tuple[str, ...]]]

#: What ``flatten=`` accepts: dims lists (named as torch's ``_flatten`` would) or name -> dims.
Flatten = Union[Sequence[Dims], Mapping[str, Dims], None]

# One root mesh per (grid, view, device type), so that every call hands out meshes that share a
# root and therefore its flattened dims, with the grid dims of each flattened dim hypergrid gave
# it (what a recovery refreshes them from); dropped with the grid.
_roots: weakref.WeakKeyDictionary[Any, dict[tuple, MeshEntry]] = weakref.WeakKeyDictionary()
_roots_lock = threading.Lock()


def mesh_tensor(layout: GridLayout) -> torch.Tensor:
    """The DeviceMesh tensor of a grid layout: its ranks, slowest dim first.

    Equal to the mesh ``init_device_mesh`` makes for the reversed shape when ``rank_offset`` is 0.

    Example::

        >>> mesh_tensor(GridLayout((2, 3, 4), ("tp", "cp", "dp"))).shape
        torch.Size([4, 3, 2])
        >>> mesh_tensor(GridLayout((2, 2), ("tp", "dp"), rank_offset=4)).tolist()
        [[4, 5], [6, 7]]
    """
    if layout.rank_map is not None:  # placed over other ranks: the mesh holds them in position order
        return torch.tensor(list(layout.ranks), dtype=torch.int).reshape(tuple(reversed(layout.shape)))
    start = layout.rank_offset
    return torch.arange(start, start + layout.size, dtype=torch.int).reshape(tuple(reversed(layout.shape)))


def flattened_name(layout: GridLayout, dims: Dims) -> str:
    """The name torch's ``_flatten()`` gives the mesh dims ``dims``: names in mesh order, "_"-joined.

    Example::

        >>> flattened_name(GridLayout((2, 3, 4), ("tp", "cp", "dp")), ["cp", "dp"])
        'dp_cp'
    """
    return "_".join(layout.order_dims(dims)[0])


def _default_device_type() -> str:
    # The device DTensor and FSDP2 would place shards on: the current accelerator if any.
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None:
            return current.type
    return "cpu"


def _check_device_type(device_type: Optional[str], backend: Optional[str]) -> str:
    """``device_type``, or the default one, checked against torch and the groups' ``backend``.

    ``backend`` is the groups' backend (the grid's, else the default group's; None when unknown),
    in torch's forms ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``.
    """
    if device_type is None:
        return _default_device_type()
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cuda' or 'cpu', got {type(device_type).__name__} {device_type!r}")
    if not device_type.isalpha():
        raise ValueError(
            f"device_type must be a device type without an index, such as 'cuda' or 'cpu', got {device_type!r}"
        )
    try:
        torch.device(device_type)
    except RuntimeError:
        raise ValueError(f"device_type {device_type!r} is not a device type torch knows (e.g. 'cuda', 'cpu', 'xpu')") from None
    if backend is not None:
        names = [name for _, name in backend_parts(backend)]
        capability = dist.Backend.backend_capability
        known = [name for name in names if name in capability]
        if known and not any(device_type in capability[name] for name in known):
            supported = sorted({device for name in known for device in capability[name]})
            raise ValueError(
                f"device_type {device_type!r} cannot be used with the grid's groups: their backend "
                f"{backend!r} supports {supported}"
            )
    return device_type


def _flatten_requests(layout: GridLayout, flatten: Flatten) -> list[tuple[str, list[str]]]:
    """``flatten=`` as (name, dims in mesh order) pairs, checked against the layout."""
    if flatten is None:
        return []
    items: list[tuple[Optional[str], Dims]]
    if isinstance(flatten, Mapping):
        items = list(flatten.items())
    elif isinstance(flatten, (list, tuple)):
        items = [(None, dims) for dims in flatten]
    else:
        raise TypeError(
            f"flatten must be a list of dims lists or a dict of name -> dims, got {type(flatten).__name__} {flatten!r}"
        )
    requests = []
    for name, dims in items:
        ordered, _ = layout.order_dims(dims)
        if len(ordered) < 2:
            raise ValueError(f"a flattened dim needs at least two dims of {list(layout.dim_names)}, got {dims!r}")
        if name is None:
            name = "_".join(ordered)
        elif not isinstance(name, str) or not name:
            raise TypeError(f"a flattened dim's name must be a non-empty str, got {name!r}")
        if name in layout.dim_names:
            raise ValueError(
                f"flattened dim name {name!r} (for {ordered}) is already a dim of the mesh "
                f"{list(reversed(layout.dim_names))}; give it another name with flatten={{'name': {ordered}}}"
            )
        requests.append((name, ordered))
    return requests


def _existing_multi_dim_groups(grid: HyperCommGrid, layout: GridLayout, view: Optional[str]) -> list[list[str]]:
    """Every multi-dim group over ``layout``'s dims that the grid has created, in mesh order."""
    names = list(reversed(layout.dim_names))
    found = []
    for count in range(2, len(names) + 1):
        for subset in itertools.combinations(names, count):
            try:
                grid.get_pg(list(subset), view=view)
            except KeyError:
                continue
            found.append(list(subset))
    return found


def device_mesh(
    grid: HyperCommGrid,
    dims: Optional[Dims] = None,
    *,
    view: Optional[str] = None,
    device_type: Optional[str] = None,
    flatten: Flatten = None,
) -> DeviceMesh:
    """A DeviceMesh over the grid (or its view ``view``) that uses the grid's process groups.

    The root mesh has one dim per grid dim, slowest first (``mesh_dim_names`` is the reversed
    ``dim_names``), and its mesh tensor holds the grid's ranks, so for a grid at rank 0 it equals
    ``init_device_mesh(device_type, reversed shape, mesh_dim_names=reversed names)``. Each dim's
    group is ``grid.get_or_create_pg(dim, view=view)``: created through the registry if missing
    (and then shared with every grid and view with the same members), never by torch.

    ``dims`` selects some dims: the result is the root mesh sliced to them, in mesh order
    whatever order they are given in (as group keys ignore order), like ``root["dp", "tp"]``.

    Multi-dim groups become flattened dims of the root: every one the grid has already created
    over the mesh's dims, plus those in ``flatten`` (created if missing). Each is named as
    torch's ``_flatten()`` names it (mesh-order names joined by "_", e.g. ``"dp_cp"`` for grid dims
    ``["cp", "dp"]``) unless ``flatten`` is a dict of name -> dims. ``root["dp_cp"]`` and
    ``root["dp", "cp"]._flatten()`` return that mesh, over the grid's group.

    Repeated calls for the same grid, view and device type return meshes with the same root.
    Call it on every rank of the job, in the same order, as for ``create_pg``. A rank outside a
    grid with ``rank_offset`` > 0 gets the mesh torch gives a rank outside a mesh: no groups
    and ``get_coordinate()`` None.

    Example, as rank 0 of an 8-rank job on torch's fake backend (on GPUs,
    ``device_type="cuda"``)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from hypergrid import HyperCommGrid
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
        >>> mesh = device_mesh(grid, flatten=[["cp", "dp"]], device_type="cpu")
        >>> mesh.mesh_dim_names
        ('dp', 'cp', 'tp')
        >>> mesh["dp_cp"].get_group() is grid.get_pg(["cp", "dp"])
        True
        >>> device_mesh(grid, ["tp", "dp"], device_type="cpu").mesh_dim_names
        ('dp', 'tp')
        >>> grid.destroy()
        >>> dist.destroy_process_group()

    Raises:
        ValueError / TypeError: unknown dims, a bad ``device_type`` or ``flatten``.
        KeyError: an unknown ``view``.
        UnsupportedTorchError: the installed torch lacks a DeviceMesh internal this needs.
    """
    from ..grid import HyperCommGrid

    if not isinstance(grid, HyperCommGrid):
        raise TypeError(f"grid must be a hypergrid HyperCommGrid, got {type(grid).__name__} {grid!r}")
    compat.require_mesh_support()
    backend = grid.backend if grid.backend is not None else (dist.get_backend() if dist.is_initialized() else None)
    device = _check_device_type(device_type, backend)
    # The grid's own check of view= (O(ndims)), so both say the same about an unknown view.
    grid.coords(grid.rank_offset, view=view)
    layout = grid.layout if view is None else grid.views[view]
    requests = _flatten_requests(layout, flatten)
    names = tuple(reversed(layout.dim_names))
    # Checked before any group is made, so a bad request leaves the grid as it was.
    selected = names if dims is None else tuple(layout.order_dims(dims)[0])
    # Every rank asks, members or not: a collective strategy needs all ranks in each creation.
    groups = [grid.get_or_create_pg(name, view=view) for name in names]
    for _, flat_dims in requests:
        grid.get_or_create_pg(flat_dims, view=view)
    root = _root_for(grid, layout, view, device, names, groups)
    member = all(pg is not None for pg in groups)
    flats = _roots[grid][(view, device)][2]
    for name, flat_dims in requests:
        if _register(root, grid, view, name, flat_dims, member, explicit=True):
            flats[name] = tuple(flat_dims)
    # Under torch's default name too, so that mesh[dims]._flatten() finds the grid's group
    # instead of creating one.
    for flat_dims in _existing_multi_dim_groups(grid, layout, view):
        name = "_".join(flat_dims)
        if name in names:
            logger.debug("not registering %s as a flattened dim: the mesh has a dim named %r", flat_dims, name)
            continue
        if _register(root, grid, view, name, flat_dims, member, explicit=False):
            flats[name] = tuple(flat_dims)
    return root if selected == names else root[selected]


def _root_for(
    grid: HyperCommGrid,
    layout: GridLayout,
    view: Optional[str],
    device: str,
    names: tuple[str, ...],
    groups: list[Optional[dist.ProcessGroup]],
) -> DeviceMesh:
    key = (view, device)
    with _roots_lock:
        cached = _roots.setdefault(grid, {}).get(key)
        # The same group objects: the same mesh. A grid can only lose groups by destroy(), and
        # then get_or_create_pg above has already refused.
        if cached is not None and len(cached[0]) == len(groups) and all(a is b for a, b in zip(cached[0], groups)):
            return cast("DeviceMesh", cached[1])
        member = all(pg is not None for pg in groups)
        if not member and any(pg is not None for pg in groups):
            raise HypergridError(
                f"rank {dist.get_rank()} is in some but not all dim groups of {grid!r} "
                f"(view {view!r}): {dict(zip(names, groups))}; a grid's ranks are in all or none"
            )
        made = cast(list[dist.ProcessGroup], groups) if member else None  # member: no None among them
        root = compat.mesh_from_groups(device, tuple(reversed(layout.shape)), names, made,
                                       first_rank=layout.rank_offset,
                                       ranks=None if layout.rank_map is None else list(layout.ranks))
        register_mesh_root(root, grid)
        compat.track_mesh_family(root)  # a recovery refreshes the root and all derived from it
        _roots[grid][key] = (tuple(groups), root, {})
        logger.debug("built DeviceMesh %s over the groups of %r (view %r)", root, grid, view)
        return root


def _register(
    root: DeviceMesh,
    grid: HyperCommGrid,
    view: Optional[str],
    name: str,
    dims: list[str],
    member: bool,
    *,
    explicit: bool,
) -> bool:
    """Make the grid's group over ``dims`` the root's flattened dim ``name``; whether it is."""
    pg = grid.get_pg(dims, view=view) if member else None
    try:
        flat = compat.flatten_onto(root, name, tuple(dims), pg)
    except ValueError as exc:
        if explicit:
            raise
        logger.warning("group %s is not a flattened dim of the mesh: %s", dims, exc)
        return False
    if pg is not None and flat.get_group() is not pg:
        # torch made this flattened dim before the grid had the group (an earlier _flatten());
        # keep torch's, which callers may already hold, and say so.
        message = (
            f"flattened dim {name!r} of the mesh already had its own process group; it does not "
            f"use the grid's group for {dims}"
        )
        if explicit:
            raise HypergridError(message)
        logger.warning(message)
        return False
    return True


def meshes_of(grid: HyperCommGrid) -> dict[tuple, MeshEntry]:
    """The root meshes :func:`device_mesh` built over ``grid``, by (view, device type) (a copy)."""
    with _roots_lock:
        return dict(_roots.get(grid, {}))


def hand_over(grid: HyperCommGrid, key: tuple, entry: MeshEntry) -> None:
    """Make ``entry``'s root the mesh :func:`device_mesh` returns for ``grid`` under ``key``
    (a recovery's new grid takes the meshes of the old one)."""
    with _roots_lock:
        _roots.setdefault(grid, {})[key] = entry


# ---------------------------------------------------------------------------- adoption
def _adopt_into(grid: HyperCommGrid, adopted: list[tuple[list[str], dist.ProcessGroup]]) -> None:
    """Make each (dims, pg) the grid's group for dims without creating anything."""
    token = ("hypergrid.mesh.adopt", id(grid))
    options = GroupOptions(backend=grid.backend)
    try:
        for dims, pg in adopted:
            REGISTRY.adopt(token, pg, options=options, label=grid.layout.key(dims))
            # The registry now answers these members with pg, so create_pg finds it.
            got = grid.create_pg(dims)
            if got is not pg:
                raise HypergridError(
                    f"adopting {pg} as group {grid.layout.key(dims)!r} of {grid!r} returned another "
                    f"group {got}; the registry did not share by members"
                )
    finally:
        # The grid holds what it adopted now; the adoption's own hold goes (adopted groups are
        # never destroyed by hypergrid, so this only drops bookkeeping).
        REGISTRY.release(token)


def _group_ranks(pg: dist.ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(pg))


def _dims_of_group(layout: GridLayout, members: list[int], rank: int, preferred: str) -> Optional[list[str]]:
    """The dims (mesh order) whose group holding ``rank`` has exactly ``members``, if any.

    Dims that differ only by size-1 dims have the same members; the one named ``preferred``
    (torch's default flattened name) wins, else the fewest dims.
    """
    target = sorted(members)
    names = list(reversed(layout.dim_names))
    matches = []
    for count in range(2, len(names) + 1):
        for subset in itertools.combinations(names, count):
            if math.prod(layout.dim_size(n) for n in subset) != len(target):
                continue
            if sorted(layout.group_ranks(list(subset), rank)) == target:
                matches.append(list(subset))
    for match in matches:
        if "_".join(match) == preferred:
            return match
    return matches[0] if matches else None


def grid_from_device_mesh(mesh: DeviceMesh, *, backend: Optional[str] = None, grid_type: Optional[type] = None) -> HyperCommGrid:
    """A grid over ``mesh``'s ranks that adopts its groups instead of creating any.

    The grid's ``dim_names`` are ``mesh.mesh_dim_names`` reversed (the first mesh dim is the
    slowest, the first grid dim the fastest), its shape likewise, and ``rank_offset`` the mesh's
    first rank; the mesh tensor must therefore hold consecutive ranks in row-major order (what
    ``init_device_mesh`` makes). Each mesh dim's group becomes the grid's group of that dim, and
    each flattened dim of the mesh's root the grid's group of the dims it spans. They are held
    like the grid's own groups and shared with any later request for the same members, but
    hypergrid never destroys them: they belong to whoever made the mesh.

    Example, as rank 0 of an 8-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        >>> grid = grid_from_device_mesh(mesh)
        >>> grid.dim_names, grid.shape
        (['tp', 'dp'], [4, 2])
        >>> grid.get_pg("tp") is mesh.get_group("tp")
        True
        >>> grid.destroy()                          # the mesh's groups stay alive
        >>> dist.destroy_process_group()

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: the mesh has no dim names, or its ranks are not consecutive row-major.
    """
    compat.require_mesh_support()
    from torch.distributed.device_mesh import DeviceMesh

    from ..grid import HyperCommGrid

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__} {mesh!r}")
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"{mesh} has no mesh_dim_names; a grid needs a name for every dim")
    tensor = mesh.mesh
    shape = tuple(tensor.shape)
    start = int(tensor.reshape(-1)[0])
    expected = torch.arange(start, start + tensor.numel(), dtype=tensor.dtype).reshape(shape)
    if not torch.equal(tensor.cpu(), expected):
        shown = tensor.tolist() if tensor.numel() <= 64 else f"a {list(shape)} mesh from rank {start}"
        raise ValueError(
            f"a grid spans consecutive ranks in row-major order, but the mesh {names} holds "
            f"{shown}; expected {expected.tolist() if tensor.numel() <= 64 else 'consecutive ranks'}"
        )
    cls = grid_type or HyperCommGrid
    grid = cls(list(reversed(shape)), list(reversed(names)), rank_offset=start, backend=backend)
    adopted: list[tuple[list[str], dist.ProcessGroup]] = []
    if mesh.get_coordinate() is not None:
        rank = dist.get_rank()
        adopted = [([name], mesh.get_group(i)) for i, name in enumerate(names)]
        for flat_name, flat in compat.flattened_meshes(mesh).items():
            if flat.get_coordinate() is None:
                continue
            pg = flat.get_group()
            dims = _dims_of_group(grid.layout, _group_ranks(pg), rank, flat_name)
            if dims is None:
                logger.debug("flattened dim %r spans dims outside %s; not adopted", flat_name, names)
                continue
            adopted.append((dims, pg))
    else:
        # Off the mesh this rank has no groups; its grid answers None, as Megatron-Core's does.
        for name in names:
            grid.create_pg(name)
    _adopt_into(grid, adopted)
    logger.debug("grid %r adopted %d groups from %s", grid, len(adopted), mesh)
    return grid


def grid_from_process_groups(
    groups: Sequence[dist.ProcessGroup],
    mesh_dim_names: Sequence[str],
    *,
    backend: Optional[str] = None,
    grid_type: Optional[type] = None,
) -> HyperCommGrid:
    """A grid whose dims are existing process groups, given slowest first as for a DeviceMesh.

    ``groups[i]`` is this rank's group along mesh dim ``mesh_dim_names[i]`` (the order of
    ``DeviceMesh.from_group`` and of TorchComm's ``init_device_mesh``). The grid's shape follows
    from the group sizes and its ``rank_offset`` from this rank's place in each group; every
    group must then hold exactly the ranks the grid expects, in order, or a ValueError names the
    dim, its ranks and the expected ones. No group is created and hypergrid never destroys
    these. Every rank of the grid must call it with its own groups.

    Example, as rank 0 of an 8-rank job on torch's fake backend, with groups made elsewhere::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> dp_pg = dist.new_group([0, 4], use_local_synchronization=True)
        >>> tp_pg = dist.new_group([0, 1, 2, 3], use_local_synchronization=True)
        >>> grid = grid_from_process_groups([dp_pg, tp_pg], ["dp", "tp"])
        >>> grid.dim_names, grid.shape
        (['tp', 'dp'], [4, 2])
        >>> device_mesh(grid, device_type="cpu").get_group("dp") is dp_pg
        True
        >>> grid.destroy()
        >>> dist.destroy_process_group()

    Raises:
        TypeError: a group is not a ProcessGroup (None: this rank is not in it).
        ValueError: names and groups differ in number, or the groups make no grid.
    """
    compat.require_mesh_support()
    from ..grid import HyperCommGrid

    if isinstance(mesh_dim_names, str) or not isinstance(mesh_dim_names, Sequence):
        raise TypeError(f"mesh_dim_names must be a list of str, got {type(mesh_dim_names).__name__} {mesh_dim_names!r}")
    if isinstance(groups, dist.ProcessGroup) or not isinstance(groups, Sequence):
        raise TypeError(f"groups must be a list of ProcessGroup, got {type(groups).__name__} {groups!r}")
    names = list(mesh_dim_names)
    if len(groups) != len(names) or not names:
        raise ValueError(
            f"need one group per dim name: got {len(groups)} groups for mesh_dim_names {names}"
        )
    for name, pg in zip(names, groups):
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(
                f"group of dim {name!r} must be a ProcessGroup this rank belongs to, got "
                f"{type(pg).__name__} {pg!r}; every rank of the grid passes its own groups"
            )
    rank = dist.get_rank()
    members = [_group_ranks(pg) for pg in groups]
    sizes = [len(m) for m in members]
    offset = rank
    for i, (name, ranks) in enumerate(zip(names, members)):
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of the group of dim {name!r}: {ranks}")
        offset -= ranks.index(rank) * math.prod(sizes[i + 1 :])
    if offset < 0:
        raise ValueError(
            f"the groups {dict(zip(names, members))} make no grid of consecutive ranks: rank {rank}'s "
            f"places in them put the grid's first rank at {offset}; each group must hold the ranks "
            f"of one dim, slowest dim first"
        )
    cls = grid_type or HyperCommGrid
    try:
        grid = cls(list(reversed(sizes)), list(reversed(names)), rank_offset=offset, backend=backend)
    except ValueError as exc:
        raise ValueError(
            f"the groups {dict(zip(names, members))} make no grid of consecutive ranks from rank "
            f"{offset} (this rank's place in them): {exc}"
        ) from exc
    for name, ranks in zip(names, members):
        want = grid.ranks(name)
        if ranks != want:
            raise ValueError(
                f"the group of dim {name!r} holds ranks {ranks}, but a grid of dims {names} "
                f"(slowest first) with sizes {sizes} from rank {offset} needs {want} there"
            )
    _adopt_into(grid, [([name], pg) for name, pg in zip(names, groups)])
    return grid
