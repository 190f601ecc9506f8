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
  as it would have.

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
    >>> root = mesh_from_groups("cpu", torch.arange(8).reshape(2, 4), ("dp", "tp"), [dp, tp])
    >>> root.get_group("tp") is tp
    True
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

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
    "flattened_meshes",
    "root_mesh",
    "rank_map_of",
    "install_mesh_router",
]

logger = logging.getLogger(__name__)

# DeviceMesh.__init__ keywords hypergrid passes (all private in torch).
_INIT_KEYWORDS = ("_init_backend", "_layout", "_rank_map", "_root_mesh")
# Instance attributes hypergrid reads or writes on a DeviceMesh.
_INSTANCE_ATTRIBUTES = ("_dim_group_names", "_flatten_mapping", "_pg_registry", "_layout", "_rank_map")
# The parameters of DeviceMesh._init_process_groups the router reads (torch 2.15 adds more).
_ROUTED_PARAMETERS = ("layout", "rank_map", "mesh_dim_names", "backend_override")
# A DeviceMesh's state that does not depend on its layout (shared by a root and its flattened
# dims), and the state that does; a mesh with any other attribute is built by torch's constructor.
_SHARED_STATE = frozenset({"_device_type", "_rank_map", "_flatten_rank_map", "_rank", "_thread_id",
                           "_preserve_rank_order"})
_LAYOUT_STATE = frozenset({"_layout", "_mesh_dim_names", "_root_mesh", "_flatten_mapping", "_pg_registry",
                           "_dim_group_names", "_coordinate_on_dim", "_hash"})


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
    mesh: torch.Tensor,
    mesh_dim_names: tuple[str, ...],
    groups: Optional[Sequence[dist.ProcessGroup]],
) -> Any:
    """A root DeviceMesh over ``mesh`` whose dim ``i`` uses ``groups[i]``; creates no group.

    ``groups`` None: this rank is outside ``mesh``; it gets the mesh torch gives such a rank
    (no groups, ``get_coordinate()`` None).

    Example, as rank 0 of an 8-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from hypergrid.runtime.torch_compat import process_group_count
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> dp = dist.new_group([0, 4], use_local_synchronization=True)
        >>> tp = dist.new_group([0, 1, 2, 3], use_local_synchronization=True)
        >>> before = process_group_count()
        >>> dm = mesh_from_groups("cpu", torch.arange(8).reshape(2, 4), ("dp", "tp"), [dp, tp])
        >>> dm.mesh_dim_names, dm.get_group("tp") is tp, process_group_count() == before
        (('dp', 'tp'), True, True)
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    from torch.distributed.device_mesh import DeviceMesh

    if groups is None:
        result = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=False)
        # torch's own meshes leave this empty on ranks outside them; it is set, not read, here.
        result._dim_group_names = []
        _check_instance(result)
        return result
    # from_group is public; its list form takes any number of dims, one group each.
    result = DeviceMesh.from_group(list(groups), device_type, mesh, mesh_dim_names=mesh_dim_names)
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


def _flat_position(axis: Any, coordinate: int) -> int:
    """The position (index into the rank map) that ``coordinate`` along ``axis`` adds. O(modes)."""
    position = 0
    for size, stride in reversed(list(axis.sizes_and_strides)):
        position += (coordinate % size) * stride
        coordinate //= size
    return position


def flatten_onto(root: Any, name: str, dims: Sequence[str], pg: Optional[dist.ProcessGroup]) -> Any:
    """Make ``pg`` the group of the flattened dim ``name`` (over ``dims``) of the root mesh.

    Afterwards ``root[name]``, ``root[dims]._flatten(name)`` and DTensor's search for a flattened
    mesh by layout all find this mesh, exactly as if torch's ``_flatten`` had made it, but over
    ``pg`` instead of a new group. Returns the flattened mesh. Idempotent for the same ``name``
    and ``dims``.

    The mesh shares the root's layout-independent state (its rank map and the tuple torch keeps
    of it, which costs O(world) to build anew) and computes its own coordinate in O(dims), so a
    flattened dim of a million-rank mesh costs microseconds; a torch whose meshes hold state this
    module does not know is served by torch's own constructor instead.

    Example, as rank 0 of an 8-rank job on torch's fake backend: the flattened ``dp_tp`` dim of
    a 2 x 4 mesh, over a group made beforehand (in hypergrid, the grid's ``["tp", "dp"]`` group)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> dp = dist.new_group([0, 4], use_local_synchronization=True)
        >>> tp = dist.new_group([0, 1, 2, 3], use_local_synchronization=True)
        >>> dp_tp = dist.new_group(list(range(8)), use_local_synchronization=True)
        >>> root = mesh_from_groups("cpu", torch.arange(8).reshape(2, 4), ("dp", "tp"), [dp, tp])
        >>> flat = flatten_onto(root, "dp_tp", ("dp", "tp"), dp_tp)
        >>> flat.mesh_dim_names, root["dp_tp"].get_group() is dp_tp, flat.get_coordinate()
        (('dp_tp',), True, (0,))
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    names = list(root.mesh_dim_names)
    # Slicing would build a mesh (O(world) in torch); the flattened layout needs only the axes.
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
    state = vars(root)
    if set(state) <= _SHARED_STATE | _LAYOUT_STATE:
        flat = DeviceMesh.__new__(DeviceMesh)
        vars(flat).update({key: value for key, value in state.items() if key in _SHARED_STATE})
        flat._layout = layout
        flat._mesh_dim_names = (name,)
        flat._root_mesh = root
        flat._flatten_mapping = {}
        flat._pg_registry = {}
        flat._hash = None
        coordinate = root.get_coordinate()
        if coordinate is None:
            flat._coordinate_on_dim = None
        else:
            position = sum(_flat_position(axis, c) for axis, c in zip(root._layout, coordinate))
            flat._coordinate_on_dim = (_flat_coordinate(layout[0], position),)
    else:
        logger.debug("DeviceMesh holds state %s unknown here; building the flattened mesh with torch",
                     sorted(set(state) - _SHARED_STATE - _LAYOUT_STATE))
        flat = DeviceMesh(root.device_type, _layout=layout, _rank_map=root._rank_map, mesh_dim_names=(name,),
                          _root_mesh=root, _init_backend=False)
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
        >>> dm = mesh_from_groups("cpu", torch.arange(8).reshape(2, 4), ("dp", "tp"), groups)
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
        >>> dm = mesh_from_groups("cpu", torch.arange(8).reshape(2, 4), ("dp", "tp"), groups)
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
        >>> dm = mesh_from_groups("cpu", torch.arange(8).reshape(2, 4), ("dp", "tp"), groups)
        >>> rank_map_of(dm["tp"]) is rank_map_of(dm), rank_map_of(dm).tolist()
        (True, [0, 1, 2, 3, 4, 5, 6, 7])
        >>> dist.destroy_process_group()
    """
    require_mesh_support()
    return root_mesh(mesh)._rank_map


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
        DeviceMesh._init_process_groups = staticmethod(init_process_groups)
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
