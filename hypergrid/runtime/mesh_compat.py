"""Every use of torch's private DeviceMesh internals, in one place, feature-detected.

hypergrid builds ``DeviceMesh`` objects over process groups it holds, and makes the groups that
torch's own mesh operations would create come from its registry. torch offers one public door
for the first, :meth:`DeviceMesh.from_group`, and hypergrid goes through it for a mesh's own
dims. The rest has no public door and needs torch's private names:

* a mesh on a rank outside it (a grid with ``rank_offset`` > 0), which torch builds with
  ``DeviceMesh(..., _init_backend=False)`` and an empty ``_dim_group_names``;
* a *flattened* dim over an existing group: a 1-D mesh with the collapsed ``_layout`` of the
  dims it spans, recorded in the root mesh's ``_flatten_mapping`` (where ``mesh["dp_cp"]``,
  ``_flatten()`` and DTensor look) and ``_pg_registry`` (where compiled code resolves groups);
* the groups torch itself creates for a mesh: every one is made in
  ``DeviceMesh._init_process_groups`` (a root's construction, ``_flatten``, ``_unflatten``; a
  slice, ``_concatenate`` and ``from_group`` make none). :func:`install_mesh_router` wraps that
  one function so that a router sees each request as typed :class:`MeshDimRequest` values and
  may serve it; the router declines (returns None) for meshes it does not own, and torch goes on
  as it would have;
* the cost of a mesh: torch's constructor is O(world) for every mesh (a tuple of the whole rank
  map, and the coordinate found by searching it), a slice or a flattened dim included. A root
  hypergrid builds holds consecutive ranks, so it is built with the very state torch computes
  but arithmetically, and ``DeviceMesh.__init__`` is wrapped once so that every mesh derived from
  such a root (or from a root :func:`consecutive_first_rank` has seen) shares the root's rank map
  tuple and computes its coordinate in O(ndims). Every other mesh is torch's constructor's.

Every attribute is checked once, before first use (:func:`require_mesh_support`), and a missing
one raises :class:`~hypergrid.errors.UnsupportedTorchError` naming it and the installed torch,
instead of failing somewhere deep in torch. Tested on torch 2.13.0 and 2.15.0.

Example, as rank 0 of an 8-rank job on torch's fake backend::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    >>> dp = dist.new_group([0, 4], use_local_synchronization=True)
    >>> tp = dist.new_group([0, 1, 2, 3], use_local_synchronization=True)
    >>> root = mesh_from_groups("cpu", (2, 4), ("dp", "tp"), [dp, tp])
    >>> root.get_group("tp") is tp
    True
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import UnsupportedTorchError
from .torch_compat import TESTED_TORCH

__all__ = [
    "MeshDimRequest",
    "MeshRouter",
    "require_mesh_support",
    "mesh_from_groups",
    "flatten_onto",
    "consecutive_first_rank",
    "flattened_meshes",
    "root_mesh",
    "rank_map_of",
    "install_mesh_router",
    "track_mesh_family",
    "mesh_family",
    "forget_rank_map",
]

logger = logging.getLogger(__name__)

# DeviceMesh.__init__ keywords hypergrid passes (all private in torch).
_INIT_KEYWORDS = ("_init_backend", "_layout", "_rank_map", "_root_mesh")
# Instance attributes hypergrid reads or writes on a DeviceMesh.
_INSTANCE_ATTRIBUTES = ("_dim_group_names", "_flatten_mapping", "_pg_registry", "_layout", "_rank_map")
# The parameters of DeviceMesh._init_process_groups the router reads (torch 2.15 adds more).
_ROUTED_PARAMETERS = ("layout", "rank_map", "mesh_dim_names", "backend_override")
# The instance attributes torch's constructor sets on a mesh built without groups (torch 2.15
# adds "_preserve_rank_order"); a torch that sets any other set gets its own constructor.
_TORCH_STATE = frozenset({"_device_type", "_layout", "_rank_map", "_mesh_dim_names", "_root_mesh",
                          "_flatten_rank_map", "_thread_id", "_flatten_mapping", "_pg_registry", "_rank",
                          "_coordinate_on_dim", "_hash"})
_OPTIONAL_STATE = "_preserve_rank_order"


def _unsupported(missing: Sequence[str]) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"hypergrid's DeviceMesh adapter needs DeviceMesh internals that the installed torch "
        f"{torch.__version__} lacks: {', '.join(missing)} (tested on torch {TESTED_TORCH})"
    )


@functools.lru_cache(maxsize=1)
def _detect() -> tuple[str, ...]:
    """The names of the needed internals that the installed torch does not have."""
    missing: list[str] = []
    if not dist.is_available():
        return ("torch.distributed",)
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return ("torch.distributed.device_mesh.DeviceMesh",)
    try:
        from torch.distributed._mesh_layout import _MeshLayout
    except ImportError:
        missing.append("torch.distributed._mesh_layout._MeshLayout")
    else:
        if not callable(getattr(_MeshLayout, "collapse", None)):
            missing.append("_MeshLayout.collapse")
        try:
            list(_MeshLayout.from_sizes_strides((2,), (1,))[0].sizes_and_strides)
        except (AttributeError, TypeError):
            missing.append("_FlatLayout.sizes_and_strides")
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(DeviceMesh.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    missing += [f"DeviceMesh.__init__({name}=)" for name in _INIT_KEYWORDS if name not in params]
    for name in ("from_group", "_get_root_mesh", "_flatten"):
        if not callable(getattr(DeviceMesh, name, None)):
            missing.append(f"DeviceMesh.{name}")
    creator = DeviceMesh.__dict__.get("_init_process_groups")
    if not isinstance(creator, staticmethod):
        missing.append("DeviceMesh._init_process_groups (a staticmethod)")
    else:
        names = list(inspect.signature(creator.__func__).parameters)
        if tuple(names[: len(_ROUTED_PARAMETERS)]) != _ROUTED_PARAMETERS:
            missing.append(f"DeviceMesh._init_process_groups{_ROUTED_PARAMETERS} (it takes {tuple(names)})")
    if not hasattr(getattr(dist.distributed_c10d, "_world", None), "pg_map"):
        missing.append("distributed_c10d._world.pg_map")
    return tuple(missing)


def require_mesh_support() -> None:
    """Raise :class:`~hypergrid.errors.UnsupportedTorchError` unless this torch has every
    DeviceMesh internal hypergrid uses.

    Example::

        >>> require_mesh_support()   # returns None where everything is present
    """
    missing = _detect()
    if missing:
        raise _unsupported(missing)


def _check_instance(mesh: Any) -> None:
    # Instance attributes only exist once a mesh is built, so they are checked on the first one.
    missing = [f"DeviceMesh.{name}" for name in _INSTANCE_ATTRIBUTES if not hasattr(mesh, name)]
    if missing:
        raise _unsupported(missing)


# ---------------------------------------------------------------------------- meshes over groups
def mesh_from_groups(
    device_type: str,
    shape: Sequence[int],
    mesh_dim_names: tuple[str, ...],
    groups: Optional[Sequence[dist.ProcessGroup]],
    *,
    first_rank: int = 0,
    ranks: Optional[Sequence[int]] = None,
) -> Any:
    """A root DeviceMesh over consecutive ranks from ``first_rank`` in row-major order, of
    ``shape``, whose dim ``i`` uses ``groups[i]``; creates no group. ``ranks``: the mesh's ranks in
    row-major order where they are not consecutive (a grid placed over other ranks after a
    recovery); torch's own constructor builds that mesh.

    The mesh is the one ``DeviceMesh.from_group(groups, device_type, mesh, mesh_dim_names=...)``
    gives for that mesh tensor, built in O(ndims) but for the tuple of its ranks torch keeps;
    meshes sliced, flattened or unflattened from it are built in O(ndims) too. ``groups`` None:
    this rank is outside the mesh; it gets the mesh torch gives such a rank (no groups,
    ``get_coordinate()`` None).

    Example, as rank 0 of an 8-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from torch.distributed.device_mesh import DeviceMesh
        >>> from hypergrid.runtime.torch_compat import process_group_count
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> dp = dist.new_group([0, 4], use_local_synchronization=True)
        >>> tp = dist.new_group([0, 1, 2, 3], use_local_synchronization=True)
        >>> before = process_group_count()
        >>> dm = mesh_from_groups("cpu", (2, 4), ("dp", "tp"), [dp, tp])
        >>> dm.mesh_dim_names, dm.get_group("tp") is tp, process_group_count() == before
        (('dp', 'tp'), True, True)
        >>> dm == DeviceMesh.from_group([dp, tp], "cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp"))
        True
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    shape = tuple(int(size) for size in shape)
    size = math.prod(shape)
    consecutive = ranks is None
    rank_map = torch.arange(first_rank, first_rank + size, dtype=torch.int) if ranks is None else torch.tensor(
        list(ranks), dtype=torch.int)
    result = DeviceMesh.__new__(DeviceMesh)
    layout = _MeshLayout.from_sizes_strides(shape)  # a contiguous tensor's strides
    # Anything else from_group refuses, with its own error.
    fits = consecutive and (groups is None or (0 < len(groups) == len(shape) and mesh_dim_names is not None))
    built = fits and _build(result, device_type, layout, rank_map, first_rank, mesh_dim_names)
    if not built:
        tensor = rank_map.reshape(shape)
        if groups is None:
            result = DeviceMesh(device_type, tensor, mesh_dim_names=mesh_dim_names, _init_backend=False)
        else:
            # from_group is public; its list form takes any number of dims, one group each.
            result = DeviceMesh.from_group(list(groups), device_type, tensor, mesh_dim_names=mesh_dim_names)
        rank_map = result._rank_map
    if consecutive:
        _record(rank_map, first_rank)
    if groups is None:
        # torch's own meshes leave this empty on ranks outside them; it is set, not read, here.
        result._dim_group_names = []
    elif built:
        # What from_group adds to the mesh it builds.
        result._dim_group_names = [pg.group_name for pg in groups]
        for pg in groups:
            result._pg_registry[pg.group_name] = pg
    _check_instance(result)
    return result


def _flat_coordinate(axis: Any, position: int) -> int:
    """Where ``position`` (an index into the rank map) sits along one axis of a layout. O(modes).

    torch reads an axis lexicographically: its first (size, stride) pair varies slowest.
    """
    index = 0
    for size, stride in axis.sizes_and_strides:
        index = index * size + (position // stride) % size
    return index


def flatten_onto(root: Any, name: str, dims: Sequence[str], pg: Optional[dist.ProcessGroup]) -> Any:
    """Make ``pg`` the group of the flattened dim ``name`` (over ``dims``) of the root mesh.

    Afterwards ``root[name]``, ``root[dims]._flatten(name)`` and DTensor's search for a flattened
    mesh by layout all find this mesh, exactly as if torch's ``_flatten`` had made it, but over
    ``pg`` instead of a new group. Returns the flattened mesh. Idempotent for the same ``name``
    and ``dims``. On a root from :func:`mesh_from_groups` it costs O(dims), as every derived mesh.

    Example, as rank 0 of an 8-rank job on torch's fake backend: the flattened ``dp_tp`` dim of
    a 2 x 4 mesh, over a group made beforehand (in hypergrid, the grid's ``["tp", "dp"]`` group)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> dp = dist.new_group([0, 4], use_local_synchronization=True)
        >>> tp = dist.new_group([0, 1, 2, 3], use_local_synchronization=True)
        >>> dp_tp = dist.new_group(list(range(8)), use_local_synchronization=True)
        >>> root = mesh_from_groups("cpu", (2, 4), ("dp", "tp"), [dp, tp])
        >>> flat = flatten_onto(root, "dp_tp", ("dp", "tp"), dp_tp)
        >>> flat.mesh_dim_names, root["dp_tp"].get_group() is dp_tp, flat.get_coordinate()
        (('dp_tp',), True, (0,))
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    names = list(root.mesh_dim_names)
    # Slicing would build a mesh; the flattened layout needs only the axes.
    axes = [root._layout[names.index(dim)] for dim in dims]
    layout = _MeshLayout([_MeshLayout(axes).collapse()])
    existing = root._flatten_mapping.get(name)
    if existing is not None:
        if existing._layout != layout:
            raise ValueError(
                f"flattened dim {name!r} already exists on this mesh over other ranks; "
                f"choose another name for the flattening of {list(dims)}"
            )
        return existing
    # torch's own _create_flatten_mesh call, but without groups (they exist).
    extra = {"preserve_rank_order": root._preserve_rank_order} if _OPTIONAL_STATE in vars(root) else {}
    flat = DeviceMesh(root.device_type, _layout=layout, _rank_map=root._rank_map, mesh_dim_names=(name,),
                      _root_mesh=root, _init_backend=False, **extra)
    if pg is None:
        flat._dim_group_names = []
    else:
        flat._dim_group_names = [pg.group_name]
        root._pg_registry[pg.group_name] = pg
    root._flatten_mapping[name] = flat
    return flat


def flattened_meshes(mesh: Any) -> dict[str, Any]:
    """The flattened dims registered on ``mesh``'s root, by name (a copy).

    Example, as rank 0 of an 8-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> groups = [dist.new_group(r, use_local_synchronization=True) for r in ([0, 4], [0, 1, 2, 3])]
        >>> dm = mesh_from_groups("cpu", (2, 4), ("dp", "tp"), groups)
        >>> flattened_meshes(dm)
        {}
        >>> flat = flatten_onto(dm, "dp_tp", ("dp", "tp"), dist.new_group(list(range(8))))
        >>> list(flattened_meshes(dm["tp"]))            # found from a slice too
        ['dp_tp']
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    return dict(root_mesh(mesh)._flatten_mapping)


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced, flattened or unflattened from (itself for a root).

    Example, as rank 0 of an 8-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> groups = [dist.new_group(r, use_local_synchronization=True) for r in ([0, 4], [0, 1, 2, 3])]
        >>> dm = mesh_from_groups("cpu", (2, 4), ("dp", "tp"), groups)
        >>> root_mesh(dm["tp"]) is dm, root_mesh(dm) is dm
        (True, True)
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    return mesh._get_root_mesh()


def rank_map_of(mesh: Any) -> torch.Tensor:
    """The rank map tensor ``mesh`` and every mesh derived from its root share.

    A root's meshes (slices, flattened and unflattened dims) hold the very same tensor object, so
    it names the root in :func:`install_mesh_router`'s calls.

    Example, as rank 0 of an 8-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> groups = [dist.new_group(r, use_local_synchronization=True) for r in ([0, 4], [0, 1, 2, 3])]
        >>> dm = mesh_from_groups("cpu", (2, 4), ("dp", "tp"), groups)
        >>> rank_map_of(dm["tp"]) is rank_map_of(dm), rank_map_of(dm).tolist()
        (True, [0, 1, 2, 3, 4, 5, 6, 7])
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    rank_map: torch.Tensor = root_mesh(mesh)._rank_map
    return rank_map


# ---------------------------------------------------------------------------- torch's own creation
@dataclass(frozen=True)
class MeshDimRequest:
    """One mesh dim torch is about to make groups for, as hypergrid reads it.

    ``modes`` are the dim's (size, stride) pairs over positions of the root's rank map (its
    groups: every position reached from a group's first by those steps); ``backend`` and
    ``pg_options`` are the dim's ``backend_override`` (None: the default), and ``timeout`` the
    one torch passes with them (the options' own, else None).

    Example::

        >>> MeshDimRequest("dp_cp", ((2, 2), (2, 4)), None, None, None).group_desc
        'mesh_dp_cp'
    """

    name: str
    modes: tuple[tuple[int, int], ...]
    backend: Optional[str]
    pg_options: Any
    timeout: Optional[timedelta]

    @property
    def group_desc(self) -> str:
        """The description torch gives such a group (``mesh_<dim name>``)."""
        return f"mesh_{self.name}"


#: ``router(rank_map, requests)``: the names of this rank's groups for ``requests``, one per dim
#: ([] on a rank outside the mesh), or None to let torch make them as it would.
MeshRouter = Callable[[torch.Tensor, tuple[MeshDimRequest, ...]], Optional[list[str]]]

_router: Optional[MeshRouter] = None
_torch_creator: Optional[Callable[..., Any]] = None
_install_lock = threading.Lock()


def install_mesh_router(router: Optional[MeshRouter]) -> None:
    """Make ``router`` see, and serve if it will, every group torch's DeviceMesh creates.

    torch's ``DeviceMesh._init_process_groups`` is wrapped once, process-wide: each call is
    offered to the router as typed requests; a router that returns None leaves the call to torch
    exactly as before. ``router`` None removes the router (the wrapper then always defers).

    Example, as rank 0 of a 4-rank job on torch's fake backend: a router that serves nothing
    changes nothing::

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        >>> seen = []
        >>> install_mesh_router(lambda rank_map, requests: seen.append(requests) or None)
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> [(r.name, r.modes) for r in seen[0]]
        [('dp', ((2, 2),)), ('tp', ((2, 1),))]
        >>> install_mesh_router(None)
        >>> dist.destroy_process_group()
    """
    global _router, _torch_creator
    require_mesh_support()
    from torch.distributed.device_mesh import DeviceMesh

    with _install_lock:
        _router = router
        if _torch_creator is not None:
            return
        creator = DeviceMesh.__dict__["_init_process_groups"].__func__
        signature = inspect.signature(creator)

        def init_process_groups(*args: Any, **kwargs: Any) -> Any:
            active = _router
            if active is not None:
                call = signature.bind(*args, **kwargs)
                call.apply_defaults()
                named = call.arguments
                requests = _requests(named["layout"], named["mesh_dim_names"], named["backend_override"])
                served = active(named["rank_map"], requests)
                if served is not None:
                    return served
            return creator(*args, **kwargs)

        init_process_groups.__wrapped__ = creator  # type: ignore[attr-defined]
        DeviceMesh._init_process_groups = staticmethod(init_process_groups)  # type: ignore[method-assign]
        _torch_creator = creator


def _requests(layout: Any, names: Optional[Sequence[str]], overrides: Sequence[Any]) -> tuple[MeshDimRequest, ...]:
    requests = []
    for index, axis in enumerate(layout):
        backend, pg_options = overrides[index] if overrides else (None, None)
        requests.append(MeshDimRequest(
            name=names[index] if names else f"dim_{index}",
            modes=tuple((int(size), int(stride)) for size, stride in axis.sizes_and_strides),
            backend=backend,
            pg_options=pg_options,
            # torch hands a backend its options' own timeout, or the new group's would override it.
            timeout=getattr(pg_options, "_timeout", None) if pg_options is not None else None,
        ))
    return tuple(requests)


# ---------------------------------------------------------------------------- meshes in O(ndims)
# Rank maps known to hold consecutive ascending ranks: id -> (the tensor, its first rank).
_spans: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int]] = {}
_torch_init: Optional[Callable[..., Any]] = None
# Set by torch's constructor after its process groups, in this order.
_LATE_STATE = ("_rank", "_coordinate_on_dim", "_hash")


def consecutive_first_rank(rank_map: torch.Tensor) -> Optional[int]:
    """The first rank of ``rank_map`` when it holds consecutive ascending ranks, else None.

    A rank map found so (or built so by :func:`mesh_from_groups`) is remembered, and every mesh
    torch derives from a root over it (slices, ``_flatten``, ``_unflatten``, ``_concatenate``) is
    then built in O(ndims) with the state torch's constructor would give it. O(1) for a rank map
    seen before, else one comparison in torch's kernels.

    Example::

        >>> consecutive_first_rank(torch.arange(4, 8, dtype=torch.int)), consecutive_first_rank(torch.tensor([0, 2]))
        (4, None)
    """
    require_mesh_support()
    known = _first_rank(rank_map)
    if known is not None:
        return known
    flat = rank_map.reshape(-1)
    if flat.numel() == 0:
        return None
    first = int(flat[0])
    if not torch.equal(flat.cpu(), torch.arange(first, first + flat.numel(), dtype=flat.dtype)):
        return None
    _record(rank_map, first)
    return first


def _first_rank(rank_map: Any) -> Optional[int]:
    entry = _spans.get(id(rank_map))
    return entry[1] if entry is not None and entry[0]() is rank_map else None


def _forget_span(key: int) -> None:
    _spans.pop(key, None)


def _record(rank_map: torch.Tensor, first: int) -> None:
    _install_fast_init()
    key = id(rank_map)
    def forget(_: object) -> None:
        _forget_span(key)

    _spans[key] = (weakref.ref(rank_map, forget), first)


@functools.lru_cache(maxsize=1)
def _torch_attributes() -> Optional[frozenset[str]]:
    """The attributes torch's constructor sets on a mesh without groups, found on a one-rank mesh
    it builds, where they are those :func:`_build` sets; else None (torch builds every mesh)."""
    from torch.distributed import device_mesh as module
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout

    DeviceMesh = module.DeviceMesh
    needed = [callable(getattr(torch._C, "_log_api_usage_once", None)),
              callable(getattr(module, "_resolve_process_group", None)),
              callable(getattr(DeviceMesh, "_setup_world_group_and_device", None)),
              callable(getattr(_FlatLayout, "complement", None)), callable(getattr(_MeshLayout, "cosize", None))]
    probe = DeviceMesh.__new__(DeviceMesh)
    try:
        # _rank given and one rank: no process group is needed, none is made.
        (_torch_init or DeviceMesh.__init__)(probe, "cpu", _layout=_MeshLayout.from_sizes_strides((1,)),
                                             _rank_map=torch.zeros(1, dtype=torch.int), _init_backend=False, _rank=0)
    except Exception as exc:  # any failure: torch keeps building meshes itself
        logger.debug("DeviceMesh's constructor could not be probed (%s); torch builds every mesh", exc)
        return None
    found = frozenset(vars(probe))
    optional = _OPTIONAL_STATE in found
    # torch passes the rank order to its group creation where its meshes have one.
    creates = "preserve_rank_order" in inspect.signature(DeviceMesh._init_process_groups).parameters
    if not all(needed) or found != _TORCH_STATE | ({_OPTIONAL_STATE} if optional else set()) or creates != optional:
        logger.debug("DeviceMesh holds %s here; torch builds every mesh", sorted(found))
        return None
    return found


def _placement(layout: Any, size: int, position: Optional[int]) -> Optional[tuple[Optional[tuple[int, ...]]]]:
    """``(coordinate,)`` of rank map index ``position`` (None: not in the map) on a mesh of
    ``layout`` over a rank map of ``size``, as torch's search of the mesh tensor finds it. None
    where that is not plain arithmetic: torch's rows of the rank map would not tile it exactly,
    or torch raises (a rank outside a mesh that is one of several rows).
    """
    flat = layout.collapse()
    rows = flat.complement(size)
    # Mesh and rows together must be a mixed radix over [0, size): each position once.
    modes = sorted((stride, extent) for extent, stride in [*flat.sizes_and_strides, *rows.sizes_and_strides]
                   if extent != 1)
    covered = 1
    for stride, extent in modes:
        if stride != covered:
            return None
        covered *= extent
    if covered != size:
        return None
    if position is None:
        return (None,) if rows.numel() == 1 else None
    return (tuple(_flat_coordinate(axis, position) for axis in layout),)


def _build(mesh: Any, device_type: str, layout: Any, rank_map: torch.Tensor, first: int,
           names: Optional[Sequence[str]], root: Any = None, preserve: bool = False,
           ranks: Optional[tuple[int, ...]] = None, init_backend: bool = False, overrides: Any = None) -> bool:
    """Give ``mesh`` the state torch's constructor gives it for these arguments, in O(ndims) but
    for ``ranks`` (the rank map as a tuple; None: a root's, from its first rank). False, with
    nothing done, where this module cannot vouch for torch's outcome: torch builds it then."""
    attributes = _torch_attributes()
    if attributes is None or device_type == "xla" or not dist.is_initialized():
        return False
    if overrides is None:
        overrides = ((None, None),) * len(layout)
    elif len(overrides) != len(layout):
        return False
    size = rank_map.numel()
    rank = dist.get_rank()
    try:
        # torch's own checks, but for the O(world) one that holds here by construction.
        valid = (rank_map.ndim == 1 and rank_map.is_contiguous() and layout.collapse().check_orthogonal()
                 and size >= layout.cosize())
        placed = _placement(layout, size, rank - first if first <= rank < first + size else None) if valid else None
    except Exception:  # torch raises its own error
        placed = None
    state = {"_device_type": device_type, "_layout": layout, "_rank_map": rank_map,
             "_mesh_dim_names": tuple(names) if names else None, "_root_mesh": root}
    if _OPTIONAL_STATE in attributes:
        state[_OPTIONAL_STATE] = preserve
    state.update(_flatten_rank_map=ranks, _thread_id=None, _flatten_mapping={}, _pg_registry={})
    if placed is None or set(state).union(_LATE_STATE) != attributes:
        return False
    if ranks is None:
        state["_flatten_rank_map"] = tuple(range(first, first + size))
    torch._C._log_api_usage_once("torch.distributed.device_mesh.DeviceMesh.__init__")
    vars(mesh).update(state)
    if init_backend:
        from torch.distributed import device_mesh as module

        mesh._setup_world_group_and_device()
        order = (preserve,) if _OPTIONAL_STATE in attributes else ()
        mesh._dim_group_names = mesh._init_process_groups(layout, rank_map, mesh._mesh_dim_names, overrides, *order)
        registry = (root if root is not None else mesh)._pg_registry
        for name in mesh._dim_group_names:
            pg = module._resolve_process_group(name)
            if pg is not None:
                registry[name] = pg
    if dist.get_backend() == "threaded":
        mesh._thread_id = threading.get_ident()
    mesh._rank = rank
    mesh._coordinate_on_dim = placed[0]
    mesh._hash = None
    return True


def _derive(mesh: Any, arguments: dict[str, Any]) -> bool:
    """Build, as :func:`_build`, a mesh torch derives from a root over a consecutive rank map."""
    from torch.distributed.device_mesh import DeviceMesh

    root, rank_map, layout = arguments.get("_root_mesh"), arguments.get("_rank_map"), arguments.get("_layout")
    if not isinstance(root, DeviceMesh) or layout is None or arguments.get("mesh") is not None:
        return False
    state = vars(root)
    first = _first_rank(rank_map) if rank_map is not None and state.get("_rank_map") is rank_map else None
    ranks = state.get("_flatten_rank_map")
    if first is None or rank_map is None or ranks is None or arguments.get("_rank") is not None:
        return False
    return _build(mesh, arguments["device_type"], layout, rank_map, first, arguments.get("mesh_dim_names"), root,
                  arguments.get("preserve_rank_order", False), ranks, arguments.get("_init_backend", True),
                  arguments.get("backend_override"))


def _compiling() -> bool:
    # Under torch.compile torch traces its own constructor; this module stays out of the way.
    check = getattr(torch.compiler, "is_compiling", None)
    return bool(check()) if check is not None else False


def _install_fast_init() -> None:
    """Wrap ``DeviceMesh.__init__`` once, process-wide: a mesh derived from a recorded root is
    built by :func:`_derive`; every other call, and any the wrapper declines, goes to torch."""
    global _torch_init
    from torch.distributed.device_mesh import DeviceMesh

    with _install_lock:
        if _torch_init is not None:
            return
        original = DeviceMesh.__dict__["__init__"]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            # torch passes _root_mesh only when it derives a mesh; a subclass keeps torch's path.
            root = kwargs.get("_root_mesh")
            if root is not None and type(self) is DeviceMesh and not _compiling():
                try:
                    call = signature.bind(self, *args, **kwargs)
                except TypeError:  # torch raises its own error
                    call = None
                if call is not None:
                    call.apply_defaults()
                    if _derive(self, call.arguments):
                        _join_family(self, root)
                        return
            original(self, *args, **kwargs)
            if root is not None:
                _join_family(self, root)

        DeviceMesh.__init__ = __init__  # type: ignore[method-assign]
        _torch_init = original


# ---------------------------------------------------------------------------- a root's family
# Every mesh derived from a tracked root, by the id of the rank map they share: (the rank map,
# its meshes by id). A recovery refreshes them all in place (hypergrid.mesh.refresh), including
# the slices torch builds anew on every mesh["dim"] and that only their callers hold. By id, not
# in a WeakSet: two slices of the same dims are equal meshes, and both must be found.
_Family = dict[int, weakref.ReferenceType[Any]]
_families: dict[int, tuple[weakref.ReferenceType[torch.Tensor], _Family]] = {}


def track_mesh_family(root: Any) -> None:
    """Remember ``root`` and every mesh torch derives from it from now on (slices, flattened,
    unflattened and concatenated meshes), for :func:`mesh_family`. Idempotent.

    Example, as rank 0 of a 4-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        >>> groups = [dist.new_group(r, use_local_synchronization=True) for r in ([0, 2], [0, 1])]
        >>> root = mesh_from_groups("cpu", (2, 2), ("dp", "tp"), groups)
        >>> track_mesh_family(root)
        >>> tp = root["tp"]
        >>> mesh_family(root)[0] is root, any(m is tp for m in mesh_family(root))
        (True, True)
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    _install_fast_init()
    rank_map = root_mesh(root)._rank_map
    key = id(rank_map)
    with _install_lock:
        known = _families.get(key)
        if known is None or known[0]() is not rank_map:
            def forget(_: object) -> None:
                _families.pop(key, None)

            known = (weakref.ref(rank_map, forget), {})
            _families[key] = known
    _add(known[1], root)


def _add(family: _Family, mesh: Any) -> None:
    key = id(mesh)

    def forget(_: object) -> None:
        family.pop(key, None)

    family[key] = weakref.ref(mesh, forget)


def _join_family(mesh: Any, root: Any) -> None:
    rank_map = vars(mesh).get("_rank_map")
    known = _families.get(id(rank_map))
    if known is not None and known[0]() is rank_map:
        _add(known[1], mesh)


def mesh_family(mesh: Any) -> list[Any]:
    """``mesh``'s root first, then every live mesh derived from it since
    :func:`track_mesh_family` (just the root where it is not tracked). See track_mesh_family."""
    require_mesh_support()
    root = root_mesh(mesh)
    known = _families.get(id(root._rank_map))
    if known is None or known[0]() is not root._rank_map:
        return [root]
    alive = [ref() for ref in list(known[1].values())]
    return [root] + [m for m in alive if m is not None and m is not root]


def forget_rank_map(rank_map: torch.Tensor) -> None:
    """Stop treating ``rank_map`` as consecutive ranks (a recovery has just written other ranks
    into it); :func:`consecutive_first_rank` looks again when next asked.

    Example::

        >>> forget_rank_map(torch.arange(4))      # one never seen: nothing to forget
    """
    _forget_span(id(rank_map))
