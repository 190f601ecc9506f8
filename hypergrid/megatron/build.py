"""Building ``parallel_state`` from a plan: this rank's groups, through one grid, and the globals.

:func:`build_state` is what :func:`~hypergrid.megatron.initialize_model_parallel` does once its
arguments are checked, and what a recovery does for the re-placed plan: every kind's group is
made through the grid (or found: a group whose members and options are unchanged is the
registry's existing one), the participants meet at a checkpoint so that none goes on with half
a state, and ``megatron.core.parallel_state`` is filled as Megatron-Core's own function would
fill it for that plan.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..errors import ParallelConfigError, UnsupportedTorchError
from ..grid import HyperCommGrid
from ..layout.kinds import BackendChoice, GroupKind
from ..runtime.options import GroupOptions, effective_timeout, same_as_world
from ..runtime.world_step import within_step, world_checkpoint, world_start
from .spec.config import MegatronConfig
from .spec.plan import ALIAS_GLOBALS, MegatronPlan
from .state import MegatronGrids

__all__ = ["build_state"]

logger = logging.getLogger(__name__)

# Globals of groups that only some configurations (or versions) create; None otherwise, as in
# Megatron-Core. Set only where the installed parallel_state has them.
_OPTIONAL_GLOBALS = (
    "_DATA_PARALLEL_GROUP_WITH_CP_AG",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "_DATA_PARALLEL_GROUP_GLOO",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
)

_UCC_ENV_DEFAULTS = {
    "TORCH_UCC_BLOCKING_WAIT": "none",
    "UCC_EC_CUDA_STREAM_TASK_MODE": "driver",
    "UCX_TLS": "ib,cuda_copy",
}
_UCC_ENV_FORCED = {
    "NSYS_UCP_COMM_PARAMS": "1",
    "UCX_RNDV_THRESH": "0",
    "UCX_NET_DEVICES": "all",
    "UCC_CL_BASIC_TLS": "^sharp,nccl",
}



def build_state(
    plan: MegatronPlan,
    *,
    rank: int,
    share_groups: bool,
    strategy: str,
    check_agreement: bool,
    timeout: timedelta,
    participants: Optional[Sequence[int]] = None,
    label: str = "initialize_model_parallel",
    step_timeout: Optional[timedelta] = None,
    attempt: Optional[str] = None,
) -> MegatronGrids:
    """This rank's groups of ``plan``, made through one grid, and ``parallel_state`` filled.

    ``participants``: the ranks that build it together (None: the whole world, as
    ``initialize_model_parallel``); they start together and meet at a checkpoint at the end, so a
    failure on one reaches the others (within ``step_timeout``, by default ``timeout``, the
    groups' own); ``attempt``: a name they all hold already (a recovery round's), which names
    that step instead, with no start (:func:`~hypergrid.runtime.world_step.world_start`). On
    failure everything made is released and the error raised. Used by :func:`~hypergrid.megatron.initialize_model_parallel` and by a recovery.

    Example: a plan laid over other ranks (rank 9, a spare, holds position 5), as rank 9 of a
    10-rank job on torch's fake backend. A group's ranks keep their positions' order, so rank 9
    is data-parallel rank 0, as position 5 was::

        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from megatron.core import parallel_state
        >>> from hypergrid.layout.rank_map import RankMap
        >>> from hypergrid.megatron import installed_features
        >>> from hypergrid.megatron.spec.plan import plan_model_parallel
        >>> dist.init_process_group("fake", store=FakeStore(), rank=9, world_size=10)
        >>> plan = plan_model_parallel(8, features=installed_features(), tensor_model_parallel_size=2,
        ...                            pipeline_model_parallel_size=2, create_gloo_process_groups=False,
        ...                            placement=RankMap.of([0, 1, 2, 3, 4, 9, 6, 7]))
        >>> grids = build_state(plan, rank=9, share_groups=True, strategy="auto", check_agreement=True,
        ...                     timeout=timedelta(minutes=10))
        >>> grids.ranks("tp"), grids.ranks("dp"), parallel_state.get_data_parallel_rank()
        ([4, 9], [9, 7], 0)
        >>> grids.release(); parallel_state.destroy_model_parallel(); dist.destroy_process_group()
    """
    config = plan.config
    world = dist.get_world_size()
    # Everything that can fail on the arguments happens here, before the first group: options,
    # the (user) embedding callbacks, and the ranks of this rank's groups.
    if plan.sharp is not None and not torch.cuda.is_available():
        # Megatron-Core fails here only after its data-parallel groups exist, inside torch.cuda.
        raise ParallelConfigError(
            "use_sharp=True needs a CUDA device on this rank (SHARP is NCCL's CollNet, enabled by a "
            "barrier on the rank's GPU), but torch.cuda.is_available() is False: pass use_sharp=False"
        )
    nccl_cfgs = _load_nccl_cfgs(config)
    options = {kind.name: _options(kind, config, nccl_cfgs, timeout) for kind in plan.kinds}
    to_world = {
        kind.name
        for kind in plan.kinds
        if share_groups and not kind.creation.private and kind.size == world and same_as_world(options[kind.name])
    }
    members = {kind.name: plan.rank_group(kind.name, rank) for kind in plan.kinds if kind.name not in to_world}
    if config.pipeline_model_parallel_comm_backend == "ucc":
        _prepare_ucc()

    grid = HyperCommGrid(
        list(plan.dense.shape), list(plan.dense.dim_names), rank_offset=config.rank_offset, world_size=world,
        strategy=strategy, check_agreement=check_agreement, rank_map=plan.placement,
    )
    grid.register_view("expert", list(plan.expert.shape), list(plan.expert.dim_names),
                       shared_dims=plan.expert_shared_dims)
    grids = MegatronGrids(plan, grid, rank, share_groups, strategy, members)
    # NCCL applies SHARP to the first communicator made with NCCL_COLLNET_ENABLE=1 only.
    os.environ.pop("NCCL_COLLNET_ENABLE", None)
    checkpoint_timeout = step_timeout or effective_timeout(GroupOptions(timeout=timeout))
    # Every rank starts together, so the end's checkpoint is named alike on all of them whatever
    # any rank did before (an earlier attempt that failed on some ranks only, say); a recovery's
    # participants share its round's name already, and start at once.
    step = world_start(label, timeout=checkpoint_timeout, ranks=participants, attempt=attempt)
    try:
        with within_step(step):  # a failure elsewhere ends this rank's waits too
            _create_all(grids, options, to_world)
        _fill_parallel_state(grids)
    except Exception as exc:
        grids.release()
        # Ranks that got through every group of their own would otherwise go on and hang in their
        # first collective with this rank: they learn of the failure here.
        world_checkpoint(step, exc, timeout=checkpoint_timeout)
        raise
    try:
        world_checkpoint(step, None, timeout=checkpoint_timeout)
    except Exception:
        grids.release()
        raise
    return grids


def _load_nccl_cfgs(config: MegatronConfig) -> dict[str, dict]:
    cfgs: dict[str, dict] = {}
    if config.nccl_communicator_config_path is not None:
        try:
            import yaml
        except ImportError:
            raise RuntimeError(
                "nccl_communicator_config_path needs the yaml package (pip install pyyaml), which "
                "is not installed"
            ) from None
        path = config.nccl_communicator_config_path
        try:
            with open(path) as stream:
                cfgs = yaml.safe_load(stream) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(
                f"nccl_communicator_config_path must name a readable YAML file of per-group NCCL "
                f"options, got {path!r}: {exc}"
            ) from exc
        if not isinstance(cfgs, dict):
            raise ValueError(
                f"nccl_communicator_config_path {path!r} must hold a mapping of group name to NCCL "
                f"options, got a {type(cfgs).__name__}"
            )
    for name in config.high_priority_stream_groups or []:
        cfgs.setdefault(name, {})["is_high_priority_stream"] = True
    if cfgs and not dist.is_nccl_available():
        # Megatron-Core builds ProcessGroupNCCL.Options from these, which a torch without NCCL
        # does not have (it fails there with an AttributeError deep inside).
        given = "nccl_communicator_config_path" if config.nccl_communicator_config_path else "high_priority_stream_groups"
        raise UnsupportedTorchError(
            f"{given} configures NCCL communicators, but this torch ({torch.__version__}) was built "
            f"without NCCL; drop {given} or use a CUDA build of torch"
        )
    return cfgs


def _options(kind: GroupKind, config: MegatronConfig, nccl_cfgs: dict, timeout: timedelta) -> GroupOptions:
    creation = kind.creation
    pg_options = ps.get_nccl_options(creation.nccl_name, nccl_cfgs) if creation.nccl_name and nccl_cfgs else None
    backend = {
        BackendChoice.DEFAULT: None,
        BackendChoice.GLOO: "gloo",
        BackendChoice.PIPELINE: config.pipeline_model_parallel_comm_backend,
    }[creation.backend]
    return GroupOptions(
        backend=backend,
        timeout=timeout if creation.timeout else None,
        pg_options=pg_options,
        group_desc=creation.group_desc,
    )


def _prepare_ucc() -> None:
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError(
            "pipeline_model_parallel_comm_backend='ucc' needs CUDA_DEVICE_MAX_CONNECTIONS > 1 to "
            "overlap UCC communication, got CUDA_DEVICE_MAX_CONNECTIONS=1"
        )
    for key, value in _UCC_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.update(_UCC_ENV_FORCED)


def _create_all(grids: MegatronGrids, options: dict[str, GroupOptions], to_world: set[str]) -> None:
    plan, sharp = grids.plan, grids.plan.sharp
    created: set[tuple[Optional[str], str]] = set()  # (view, grid key) made by create_pg already
    for kind in plan.kinds:
        if sharp is not None and kind.name == sharp.enable_before:
            os.environ["NCCL_COLLNET_ENABLE"] = "1"
        grids.record(kind.name, _create_kind(grids, kind, options[kind.name], to_world, created),
                     world_shared=kind.name in to_world)
        if sharp is not None and kind.name == sharp.barrier_after:
            _sharp_barrier(grids.groups()[sharp.barrier_on], grids.rank)


def _create_kind(
    grids: MegatronGrids,
    kind: GroupKind,
    opts: GroupOptions,
    to_world: set[str],
    created: set[tuple[Optional[str], str]],
) -> Optional[dist.ProcessGroup]:
    """This rank's group of ``kind``: the default group, a grid group, or a derived one."""
    if kind.name in to_world:
        return dist.group.WORLD
    private = not grids.share_groups or kind.creation.private
    made = (kind.view, kind.key)
    if kind.is_grid_groups and made not in created:
        created.add(made)
        return grids.grid.create_pg(
            list(kind.dims), view=kind.view, private=private, backend=opts.backend,
            timeout=opts.timeout, pg_options=opts.pg_options, group_desc=opts.group_desc,
        )
    # Derived by a rule of its own (embedding, optimizer instances, hierarchical CP) or a second
    # communicator over dims already made (gloo, all-gather): the same door as the grid's groups,
    # so members check they agree and the strategy holds.
    return grids.grid.create_derived_pg(
        kind.name, grids.ranks(kind.name), groups=kind.enumerate, owner=grids.owner, private=private,
        backend=opts.backend, timeout=opts.timeout, pg_options=opts.pg_options, group_desc=opts.group_desc,
    )


def _sharp_barrier(group: Optional[dist.ProcessGroup], rank: int) -> None:
    # Communicators are created lazily: a collective makes NCCL build this one now, while
    # NCCL_COLLNET_ENABLE=1 is set, and no other afterwards.
    if group is not None:
        if rank == 0:
            logger.info("enabling SHARP on %s; the network switch limits how many groups can use it", group)
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    os.environ.pop("NCCL_COLLNET_ENABLE", None)


def _fill_parallel_state(grids: MegatronGrids) -> None:
    plan, config = grids.plan, grids.config
    g = grids.groups()
    # Megatron-Core assigns a global only `if rank in ranks`: a rank outside the grids' span
    # (rank_offset / local_world_size) keeps None everywhere, and empty hierarchical/hybrid sets.
    inside = plan.dense.contains(grids.rank)

    # Hierarchical levels fill a list, hybrid sizes a dict: empty unless this rank has them.
    values: dict[str, Any] = {"_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None, "_HYBRID_DP_CP_GROUPS": {}}
    entries: dict[str, dict[int, Optional[dist.ProcessGroup]]] = {}
    for kind in plan.kinds:
        glob = kind.megatron_global
        if glob is None:
            continue  # made, but no getter returns it (the inter-level expert gloo group)
        if glob.entry is None:
            values[glob.name] = g[kind.name]
        elif inside:
            entries.setdefault(glob.name, {})[glob.entry] = g[kind.name]
            values[glob.name] = (
                dict(entries[glob.name]) if glob.in_dict else [entries[glob.name][i] for i in sorted(entries[glob.name])]
            )
    # Kinds that are the same group as another (one optimizer instance, gtp_remat of size 1).
    for alias, target in plan.aliases.items():
        values[ALIAS_GLOBALS[alias]] = g[target]
    # Rank lists the getters read.
    rank_lists = {
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
        "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
        "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
        "_PIPELINE_GLOBAL_RANKS": "pp",
        "_EMBEDDING_GLOBAL_RANKS": "embd",
        "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
        "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    }
    if plan.features.gtp_remat:
        rank_lists["_GTP_WEIGHT_REMAT_GLOBAL_RANKS"] = "gtp_remat"
    if plan.features.expert_gtp_remat:
        rank_lists["_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS"] = "expt_gtp_remat"
    for name, kind_name in rank_lists.items():
        values[name] = grids.ranks(kind_name)
    if config.virtual_pipeline_model_parallel_size is not None:
        values["_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK"] = 0
        values["_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"] = config.virtual_pipeline_model_parallel_size
    # update_pg_timeout walks this list; None stands for the default group.
    values["_global_process_group_list"] = [None] + grids.distinct_groups()
    missing = sorted(name for name in values if not hasattr(ps, name))
    if missing:
        # The plan follows the installed signature; globals it lacks mean a version whose
        # keywords and state disagree with every version hypergrid was built against.
        raise RuntimeError(
            f"megatron.core.parallel_state of megatron-core {plan.features.version} has no {missing}, "
            f"which its initialize_model_parallel keywords imply; hypergrid.megatron supports "
            f"megatron-core 0.16.1 to 0.19.2"
        )
    # Groups this configuration (or version) does not make: None, where the version has them.
    for name in _OPTIONAL_GLOBALS:
        if hasattr(ps, name):
            values.setdefault(name, None)
    for name, value in values.items():
        setattr(ps, name, value)
