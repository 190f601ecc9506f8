"""torch's private state that a recovery rewrites in place: a DeviceMesh's ranks and groups, and
what FSDP2 (``fully_shard``) caches from its mesh. Feature-detected, never by version.

What a ``DeviceMesh`` holds, on torch 2.13 and 2.15 alike (both keep a mesh as a ``_layout`` over
a flat ``_rank_map`` tensor, which every mesh derived from a root shares):

* ``_rank_map``: the root's ranks, one tensor object shared by the root and every slice,
  flattened and unflattened mesh; rewritten in place here, so that every mesh sees the new ranks;
* ``_flatten_rank_map``: the same ranks as a tuple, per mesh, for hashing and equality;
* ``_dim_group_names``: the names of this rank's group per dim, per mesh; ``get_group`` and the
  functional collectives resolve a group by this name;
* ``_pg_registry`` (the root's): name -> ProcessGroup, where ``get_group`` looks first;
* ``_coordinate_on_dim``: this rank's coordinate, computed by torch's own
  ``_compute_coordinate_on_dim`` from the new ranks; and ``_hash``, reset (torch computes it again).

``_layout`` (the shape and strides), the dim names and ``_rank`` do not change in place: a
recovery that changes the mesh's shape cannot be written into it (:mod:`hypergrid.mesh.refresh`
refuses it).

FSDP2 keeps, per parameter group and per parameter, a mesh info (``FSDPMeshInfo``,
``HSDPMeshInfo``, ``DDPMeshInfo``) with the mesh and what its ``__post_init__`` derived from it:
``shard_process_group``, ``shard_mesh_size``, ``shard_mesh_rank`` and the same for replicate;
:func:`rederive_mesh_info` runs that ``__post_init__`` again on the refreshed mesh, keeping an
opted-in ``reduce_scatter_process_group``. Its communication objects may hold a group
(``ProcessGroupAlloc*``'s ``_group``), found by :func:`fsdp_group_holders`. Its parameters'
DTensors, ``_sharding_spec`` and sliced ``_shard_mesh`` hold the mesh objects themselves, which
are refreshed in place. An FSDP module whose iteration failed half-way is reset with torch's own
``FSDPModule.reset_iter_state``, and the failed backward's gradients are dropped from the
unsharded parameters where torch 2.13's reset leaves them (``_unsharded_param.grad``,
``unsharded_accumulated_grad``; 2.15 drops them itself).

Example::

    >>> group_alive("no such group")
    False
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import UnsupportedTorchError
from .torch_compat import TESTED_TORCH

__all__ = ["require_refresh_support", "group_names", "group_alive", "rewrite_meshes", "fsdp_states",
           "fsdp_mesh_infos", "fsdp_group_holders", "rederive_mesh_info", "reset_iteration"]

logger = logging.getLogger(__name__)

#: What a mesh must hold to be rewritten in place.
_MESH_STATE = ("_rank_map", "_flatten_rank_map", "_dim_group_names", "_pg_registry", "_coordinate_on_dim")
#: The mesh-info attributes FSDP2's __post_init__ derives, besides those a user sets.
_OPT_IN_GROUPS = ("reduce_scatter_process_group",)


def _unsupported(what: str, missing: Sequence[str]) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"refreshing {what} in place needs internals the installed torch {torch.__version__} lacks: "
        f"{', '.join(missing)} (tested on torch {TESTED_TORCH})"
    )


def require_refresh_support(mesh: Any) -> None:
    """Raise :class:`~hypergrid.errors.UnsupportedTorchError` unless ``mesh`` holds what
    :func:`rewrite_meshes` rewrites. A mesh on a rank outside it has no ``_dim_group_names`` list
    worth the name; it is checked like any other."""
    missing = [name for name in _MESH_STATE if name not in vars(mesh)]
    if not callable(getattr(mesh, "_compute_coordinate_on_dim", None)):
        missing.append("DeviceMesh._compute_coordinate_on_dim")
    if missing:
        raise _unsupported("a DeviceMesh", missing)


def group_names(mesh: Any) -> list[str]:
    """The names of ``mesh``'s groups on this rank, one per dim ([] off the mesh)."""
    return list(vars(mesh).get("_dim_group_names", []))


def group_alive(name: str) -> bool:
    """Whether c10d still knows a group called ``name`` (False once it was destroyed)."""
    # c10d's own table of live groups, which destroy_process_group empties of a group.
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if names is None:
        raise _unsupported("a DeviceMesh", ["distributed_c10d._world.pg_names"])
    return name in names.values()


def rewrite_meshes(family: Sequence[Any], ranks: Sequence[int], renamed: Mapping[str, dist.ProcessGroup]) -> None:
    """Give every mesh of ``family`` (a root first, then meshes derived from it) the root's new
    ``ranks`` (row-major, as many as before) and, per dim, the group ``renamed`` maps its old
    group's name to (names not in it are kept). Checks everything before it changes anything.

    Raises:
        UnsupportedTorchError: a mesh lacks state this rewrites.
        ValueError: ``ranks`` is not as long as the root's rank map.
    """
    root = family[0]
    for mesh in family:
        require_refresh_support(mesh)
    rank_map: torch.Tensor = root._rank_map
    if rank_map.numel() != len(ranks):
        raise ValueError(f"the mesh holds {rank_map.numel()} ranks, the new placement {len(ranks)}: "
                         f"a mesh cannot change its shape in place")
    # In place: every mesh derived from the root holds this very tensor.
    rank_map.copy_(torch.tensor(list(ranks), dtype=rank_map.dtype))
    flat = tuple(int(r) for r in ranks)
    registry = root._pg_registry
    for old, pg in renamed.items():
        registry.pop(old, None)
        registry[pg.group_name] = pg
    for mesh in family:
        state = vars(mesh)
        state["_flatten_rank_map"] = flat
        state["_dim_group_names"] = [renamed[n].group_name if n in renamed else n for n in state["_dim_group_names"]]
        if "_hash" in state:
            state["_hash"] = None  # equality reads the ranks: the hash must be computed again
        if mesh is not root:
            for old, pg in renamed.items():  # a mesh's own registry, where torch filled one
                if mesh._pg_registry.pop(old, None) is not None:
                    mesh._pg_registry[pg.group_name] = pg
        state["_coordinate_on_dim"] = mesh._compute_coordinate_on_dim()
    logger.debug("rewrote %d meshes onto ranks %s (%d groups renamed)", len(family), flat, len(renamed))


# ---------------------------------------------------------------------------- FSDP2
def _fsdp_module_type() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def fsdp_states(module: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """Every ``fully_shard`` module under ``module`` (itself included) with its FSDP state.

    Raises:
        UnsupportedTorchError: this torch's FSDP2 keeps its state elsewhere.
    """
    fsdp_type = _fsdp_module_type()
    if fsdp_type is None:
        return []
    from torch.distributed.fsdp import fully_shard

    getter = getattr(fully_shard, "state", None)
    if not callable(getter):
        raise _unsupported("FSDP2 modules", ["fully_shard.state"])
    found = []
    for sub in module.modules():
        if isinstance(sub, fsdp_type):
            state = getter(sub)
            if "_fsdp_param_groups" not in vars(state):
                raise _unsupported("FSDP2 modules", ["FSDPState._fsdp_param_groups"])
            found.append((sub, state))
    return found


def _param_groups(state: Any) -> list[Any]:
    groups = vars(state).get("_fsdp_param_groups")
    return list(groups) if groups else []


def fsdp_mesh_infos(state: Any) -> list[Any]:
    """The distinct mesh infos one FSDP state's parameter groups and parameters hold."""
    infos: dict[int, Any] = {}
    for group in _param_groups(state):
        holders = [group, *getattr(group, "fsdp_params", [])]
        for holder in holders:
            for name in ("mesh_info", "post_forward_mesh_info"):
                info = getattr(holder, name, None)
                if info is not None:
                    infos.setdefault(id(info), info)
    return list(infos.values())


def fsdp_group_holders(state: Any) -> list[tuple[Any, str]]:
    """(object, attribute) pairs of one FSDP state's communication objects that hold a
    ProcessGroup (torch's ``ProcessGroupAlloc*`` keep the group they allocate from)."""
    holders = []
    for group in _param_groups(state):
        for value in vars(group).values():
            for name, held in getattr(value, "__dict__", {}).items():
                if isinstance(held, dist.ProcessGroup):
                    holders.append((value, name))
    return holders


def mesh_info_groups(info: Any) -> dict[str, dist.ProcessGroup]:
    """The process groups a mesh info holds, by attribute."""
    return {name: value for name, value in vars(info).items() if isinstance(value, dist.ProcessGroup)}


def rederive_mesh_info(info: Any, renamed: Mapping[str, dist.ProcessGroup]) -> None:
    """Derive ``info``'s groups, sizes and ranks again from its (refreshed) mesh, as torch's own
    ``__post_init__`` does; a group the user opted into (``reduce_scatter_process_group``) is
    kept, or swapped for its ``renamed`` successor."""
    kept = {name: vars(info).get(name) for name in _OPT_IN_GROUPS}
    post_init = getattr(type(info), "__post_init__", None)
    if not callable(post_init):
        raise _unsupported("an FSDP2 mesh info", [f"{type(info).__name__}.__post_init__"])
    post_init(info)
    for name, pg in kept.items():
        if pg is not None:
            setattr(info, name, renamed.get(pg.group_name, pg))


def reset_iteration(module: torch.nn.Module, state: Any) -> bool:
    """End ``module``'s interrupted iteration with torch's ``reset_iter_state`` where ``module``
    is a root that has run (its collectives were waited on, its parameters resharded, its
    per-iteration trackers cleared); False where there was nothing to reset."""
    reset = getattr(module, "reset_iter_state", None)
    if not callable(reset) or vars(state).get("_is_root") is not True:
        return False
    reset()
    # torch 2.13's reset leaves the failed backward's gradients on the unsharded parameters (and
    # its accumulated copy), which the next backward would add to; 2.15's clears them. Cleared
    # here wherever they are, so that the step run again computes what it computed the first time.
    for _, sub_state in fsdp_states(module):
        for group in _param_groups(sub_state):
            for fsdp_param in getattr(group, "fsdp_params", []):
                fields = vars(fsdp_param)
                if fields.get("unsharded_accumulated_grad") is not None:
                    fields["unsharded_accumulated_grad"] = None
                for leaf in (fields.get("_unsharded_param"), fields.get("sharded_param")):
                    if leaf is not None:
                        leaf.grad = None
    return True
