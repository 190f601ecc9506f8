"""Megatron-Core's ``initialize_model_parallel`` / ``destroy_model_parallel``, built on hypergrid grids.

``initialize_model_parallel`` takes every keyword of the installed megatron-core's function, plans
the groups with :mod:`hypergrid.megatron.plan`, creates this rank's groups through one
:class:`~hypergrid.grid.HyperCommGrid` (the dense layout, with the expert layout as its
``"expert"`` view) and hypergrid's registry, and fills ``megatron.core.parallel_state`` so that
every getter there answers as after Megatron-Core's own call. What changes is the cost: a rank
creates only the groups it belongs to (Megatron-Core creates every group of the world on every
rank), and identical groups share one communicator unless ``share_groups=False``.
"""

from __future__ import annotations

import itertools
import logging
import os
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from .._torch_compat import UnsupportedTorchError, default_group_timeout, new_group_default_timeout
from ..grid import HyperCommGrid
from ..agreement import world_checkpoint
from ..groups import REGISTRY, GroupOptions, effective_timeout
from ..strategy import resolve_strategy
from .config import MEGATRON_KEYWORDS, MegatronConfig, ParallelConfigError
from .plan import ALIAS_GLOBALS, GroupSpec, MegatronPlan

__all__ = ["MegatronGrids", "initialize_model_parallel", "destroy_model_parallel", "active_grids"]

logger = logging.getLogger("hypergrid.megatron")

_owner_ids = itertools.count()
# Initializations this process made: alike on every rank, so it names the end-of-init checkpoint.
_checkpoints = itertools.count()

#: The state made by the last ``initialize_model_parallel`` not yet destroyed.
_ACTIVE: Optional["MegatronGrids"] = None

# parallel_state globals Megatron-Core's own destroy_model_parallel leaves set; ours clears them
# too, so that a later initialization cannot read a previous one's ranks.
_LEFT_BY_MEGATRON_DESTROY = (
    "_EMBEDDING_GLOBAL_RANKS",
    "_PIPELINE_GLOBAL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
    "_MODEL_PARALLEL_GLOBAL_RANKS",
    "_EXPERT_MODEL_PARALLEL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
)

# Globals whose groups Megatron-Core's destroy_model_parallel destroys itself (its gloo groups).
_DESTROYED_BY_MEGATRON = (
    "_DATA_PARALLEL_GROUP_GLOO",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
)

# Globals of groups that only some configurations create; None otherwise, as in Megatron-Core.
_OPTIONAL_GLOBALS = (
    "_DATA_PARALLEL_GROUP_WITH_CP_AG",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_DATA_PARALLEL_GROUP_GLOO",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
)

# Set before initialization means a previous one was not destroyed.
_INITIALIZED_MARKERS = (
    "_DATA_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_PIPELINE_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_CONTEXT_PARALLEL_GROUP",
    "_EXPERT_MODEL_PARALLEL_GROUP",
    "_GLOBAL_MEMORY_BUFFER",
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


class MegatronGrids:
    """What :func:`initialize_model_parallel` built: the grid, the plan and this rank's groups.

    ``grid`` is the dense :class:`~hypergrid.grid.HyperCommGrid` (dims from Megatron's ``order``
    without ``ep``) with the expert layout registered as its ``"expert"`` view; ``plan`` the
    :class:`~hypergrid.megatron.plan.MegatronPlan` of every group. :meth:`group` and
    :meth:`ranks` answer by kind name (``"tp"``, ``"dp_cp"``, ``"expt_dp"``, ...).

    Example::

        >>> # grids = initialize_model_parallel(tensor_model_parallel_size=2)   # in a job
        >>> # grids.grid.get_pg("tp") is parallel_state.get_tensor_model_parallel_group()   # True
        >>> # grids.ranks("dp"), grids.grid.coords()
    """

    def __init__(self, plan: MegatronPlan, grid: HyperCommGrid, rank: int, share_groups: bool, strategy: str) -> None:
        self.plan = plan
        self.config: MegatronConfig = plan.config
        self.grid = grid
        self.rank = rank
        self.share_groups = share_groups
        self.strategy = strategy
        self._owner = ("hypergrid.megatron", next(_owner_ids))
        self._groups: dict[str, Optional[dist.ProcessGroup]] = {}
        self._members: dict[str, Optional[list[int]]] = {}
        self._world_shared: set[str] = set()
        self._destroyed = False

    def __repr__(self) -> str:
        return f"MegatronGrids(rank={self.rank}, {self.plan!r}, share_groups={self.share_groups}, strategy={self.strategy!r})"

    @property
    def expert_view(self) -> str:
        """Name of the expert layout's view on :attr:`grid`: ``"expert"``."""
        return "expert"

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """This rank's process group of kind ``name`` (aliases resolved); None where it is in none.

        Example::

            >>> # grids.group("intra_dp_cp") is grids.group("dp_cp")   # one optimizer instance
        """
        self._check_alive()
        resolved = self.plan.spec(name).name
        return self._groups[resolved]

    def ranks(self, name: str) -> Optional[list[int]]:
        """Global ranks of this rank's group of kind ``name``, in Megatron-Core's order (or None).

        Example::

            >>> # grids.ranks("pp")  ->  [1, 5, 9, 13]
        """
        resolved = self.plan.spec(name).name
        if resolved not in self._members:
            # Groups handed out as the default group were not listed at start-up (O(world)).
            self._members[resolved] = self.plan.rank_group(resolved, self.rank)
        return self._members[resolved]

    def groups(self) -> dict[str, Optional[dist.ProcessGroup]]:
        """Every kind's group for this rank, in creation order."""
        self._check_alive()
        return dict(self._groups)

    def distinct_groups(self) -> list[dist.ProcessGroup]:
        """The distinct communicators this rank got, in creation order (the default group excluded)."""
        seen: dict[int, dist.ProcessGroup] = {}
        world = dist.group.WORLD
        for pg in self._groups.values():
            if pg is not None and pg is not world and id(pg) not in seen:
                seen[id(pg)] = pg
        return list(seen.values())

    @property
    def num_process_groups(self) -> int:
        """How many communicators initialization created for this rank (the default group excluded)."""
        return len(self.distinct_groups())

    @property
    def world_shared(self) -> list[str]:
        """Kinds whose group spans the whole world and is the default group itself (sharing on)."""
        return sorted(self._world_shared)

    def process_group_collection(self, required_pgs: Optional[list[str]] = None) -> Any:
        """A ``ProcessGroupCollection`` filled from these groups (see :mod:`hypergrid.megatron.collection`)."""
        from .collection import process_group_collection

        return process_group_collection(self, required_pgs=required_pgs)

    def release(self) -> None:
        """Let go of every group (the grid's and the derived ones); idempotent. Does not touch
        ``parallel_state``: use :func:`destroy_model_parallel` for that."""
        if self._destroyed:
            return
        self._destroyed = True
        self.grid.destroy()
        REGISTRY.release(self._owner)
        self._groups.clear()

    def _check_alive(self) -> None:
        if self._destroyed:
            from ..errors import GridDestroyedError

            raise GridDestroyedError(f"{self!r} was destroyed; call initialize_model_parallel again")


def active_grids() -> Optional[MegatronGrids]:
    """The :class:`MegatronGrids` of the current initialization, or None.

    Example::

        >>> active_grids() is None     # before initialize_model_parallel
        True
    """
    return _ACTIVE


def initialize_model_parallel(
    *args: Any,
    share_groups: bool = True,
    strategy: Optional[str] = None,
    check_agreement: bool = True,
    **kwargs: Any,
) -> MegatronGrids:
    """Megatron-Core's ``initialize_model_parallel``, with groups made by hypergrid.

    Takes every argument of the installed megatron-core's function, positionally or by keyword,
    with the same meaning, defaults and validation (errors are raised before any group is made
    and name the sizes; see :class:`~hypergrid.megatron.config.ParallelConfigError`). Afterwards
    every ``megatron.core.parallel_state`` getter answers as after Megatron-Core's own call.

    hypergrid-only keywords:

    ``share_groups`` (default True)
        Groups with identical members, backend, timeout and options are one communicator: e.g.
        with ``tensor_model_parallel_size == expert_tensor_parallel_size`` the tensor and expert
        tensor groups, all size-1 groups of a rank, and a group spanning the whole world, which
        is the default group itself. Fewer communicators means less start-up time and less
        memory (each NCCL communicator holds buffers on every member GPU). The trade-off:
        collectives on two names that share a communicator are serialized on it, where separate
        communicators could overlap. Groups made to overlap (the all-gather group of
        ``create_all_gather_group``) and SHARP targets are never shared. ``False`` gives every
        Megatron group its own communicator, exactly as Megatron-Core does.
    ``strategy`` (default: the process-wide default, ``"auto"`` unless set)
        How the grid makes groups (see :mod:`hypergrid.strategy`): ``"auto"`` (``"split"`` on a
        device-bound NCCL default group, else ``"local"``), ``"local"`` (each rank creates only
        its own groups; start-up does not grow with the world size), ``"split"`` (every rank
        joins one ``split_group`` per request) or ``"enumerate"`` (Megatron-Core's call pattern,
        every rank takes part in every group).
    ``check_agreement``
        Passed to the grid: check that the members of each group asked for the same group.

    Returns a :class:`MegatronGrids` holding the grid and the groups.

    Example::

        >>> # from hypergrid.megatron import initialize_model_parallel     # was: megatron.core.parallel_state
        >>> # grids = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
        >>> #                                   expert_model_parallel_size=4, create_gloo_process_groups=False)
        >>> # parallel_state.get_tensor_model_parallel_world_size()   -> 2

    Raises:
        ParallelConfigError (a ValueError, RuntimeError and AssertionError): a configuration
            Megatron-Core rejects, named with its sizes.
        TypeError: unknown keywords or values of the wrong type.
        RuntimeError: torch.distributed not initialized, or parallel state already initialized.
    """
    global _ACTIVE
    if len(args) > len(MEGATRON_KEYWORDS):
        raise TypeError(f"initialize_model_parallel() takes at most {len(MEGATRON_KEYWORDS)} positional arguments, got {len(args)}")
    for name, value in zip(MEGATRON_KEYWORDS, args):
        if name in kwargs:
            raise TypeError(f"initialize_model_parallel() got multiple values for argument {name!r}")
        kwargs[name] = value
    if not isinstance(share_groups, bool):
        raise TypeError(f"share_groups must be a bool, got {share_groups!r}")
    strategy = resolve_strategy(strategy).value
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed: call torch.distributed.init_process_group() first"
        )
    config = MegatronConfig.from_megatron_kwargs(dist.get_world_size(), kwargs)
    _check_not_initialized()
    plan = MegatronPlan(config)
    rank = dist.get_rank()
    world = dist.get_world_size()
    try:
        timeout = timedelta(minutes=config.distributed_timeout_minutes)
    except OverflowError:
        raise ParallelConfigError(
            f"distributed_timeout_minutes={config.distributed_timeout_minutes} is longer than a "
            f"datetime.timedelta can hold ({timedelta.max.days * 24 * 60} minutes at most)"
        ) from None

    # Everything that can fail on the arguments happens here, before the first group: options,
    # the (user) embedding callbacks, and the ranks of this rank's groups.
    nccl_cfgs = _load_nccl_cfgs(config)
    options = {spec.name: _options(spec, config, nccl_cfgs, timeout) for spec in plan.specs}
    to_world = {
        spec.name
        for spec in plan.specs
        if share_groups and not spec.private and plan.group_size(spec.name) == world and _same_as_world(options[spec.name])
    }
    members = {spec.name: plan.rank_group(spec.name, rank) for spec in plan.specs if spec.name not in to_world}
    if config.pipeline_model_parallel_comm_backend == "ucc":
        _prepare_ucc()

    grid = HyperCommGrid(
        list(plan.dense.shape), list(plan.dense.dim_names), world_size=world, strategy=strategy,
        check_agreement=check_agreement,
    )
    shared = ["pp"] if plan.dense.dim_size("pp") > 1 else []
    grid.register_view("expert", list(plan.expert.shape), list(plan.expert.dim_names), shared_dims=shared)
    grids = MegatronGrids(plan, grid, rank, share_groups, strategy)
    grids._members.update(members)
    # NCCL applies SHARP to the first communicator made with NCCL_COLLNET_ENABLE=1 only.
    os.environ.pop("NCCL_COLLNET_ENABLE", None)
    checkpoint = f"megatron#{next(_checkpoints)}"
    checkpoint_timeout = effective_timeout(GroupOptions(timeout=timeout))
    try:
        _create_all(grids, options, to_world)
    except Exception as exc:
        grids.release()
        # Ranks that got through every group of their own would otherwise go on and hang in their
        # first collective with this rank: they learn of the failure here.
        world_checkpoint("initialize_model_parallel", checkpoint, exc, timeout=checkpoint_timeout)
        raise
    try:
        world_checkpoint("initialize_model_parallel", checkpoint, None, timeout=checkpoint_timeout)
    except Exception:
        grids.release()
        raise
    _fill_parallel_state(grids)
    ps._set_global_memory_buffer()
    _ACTIVE = grids
    logger.info(
        "rank %d: initialized %s with %d communicators (share_groups=%s, strategy=%s)",
        rank, plan, grids.num_process_groups, share_groups, strategy,
    )
    return grids


def destroy_model_parallel() -> None:
    """Tear down ``parallel_state`` and release hypergrid's groups; safe to call at any time.

    Calls Megatron-Core's own ``destroy_model_parallel`` for its globals (after taking out the
    groups hypergrid owns, so that no shared group is destroyed behind the registry's back),
    clears the globals Megatron-Core's version leaves set, and releases the grid and the derived
    groups through the registry: a group is destroyed when nothing else holds it. Initializing
    again afterwards works. Also cleans up after Megatron-Core's own initialization.

    Example::

        >>> destroy_model_parallel()      # nothing initialized: does nothing harmful
        >>> active_grids() is None
        True
    """
    global _ACTIVE
    grids, _ACTIVE = _ACTIVE, None
    if grids is not None:
        for name in _DESTROYED_BY_MEGATRON:
            if hasattr(ps, name):
                setattr(ps, name, None)
    ps.destroy_model_parallel()
    for name in _LEFT_BY_MEGATRON_DESTROY:
        if hasattr(ps, name):
            setattr(ps, name, None)
    ps._HYBRID_DP_CP_GROUPS = {}
    if grids is not None:
        grids.release()


# ---------------------------------------------------------------------- helpers
def _check_not_initialized() -> None:
    set_already = [name for name in _INITIALIZED_MARKERS if getattr(ps, name, None) is not None]
    if set_already or _ACTIVE is not None:
        raise RuntimeError(
            f"model parallel state is already initialized ({', '.join(set_already) or 'hypergrid grids'} "
            f"set); call hypergrid.megatron.destroy_model_parallel() first"
        )


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
        with open(config.nccl_communicator_config_path, "r") as stream:
            cfgs = yaml.safe_load(stream) or {}
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


def _options(spec: GroupSpec, config: MegatronConfig, nccl_cfgs: dict, timeout: timedelta) -> GroupOptions:
    pg_options = ps.get_nccl_options(spec.nccl_name, nccl_cfgs) if spec.nccl_name and nccl_cfgs else None
    backend = config.pipeline_model_parallel_comm_backend if spec.backend == "pp" else spec.backend
    return GroupOptions(
        backend=backend,
        timeout=timeout if spec.timeout else None,
        pg_options=pg_options,
        group_desc=spec.group_desc,
    )


def _same_as_world(options: GroupOptions) -> bool:
    """Whether a group of every rank with these options is interchangeable with the default group."""
    if options.pg_options is not None:
        return False
    backend = str(dist.get_backend()).lower()
    if options.backend is not None and str(options.backend).lower() != backend:
        return False
    world_timeout = default_group_timeout()
    if world_timeout is None:
        # A backend without timeouts (e.g. torch's fake backend): nothing to differ in.
        return True
    wanted = options.timeout if options.timeout is not None else new_group_default_timeout(backend)
    return wanted == world_timeout


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
    plan, grid, rank = grids.plan, grids.grid, grids.rank
    sharp = plan.config.sharp_group
    created: set[tuple[str, str]] = set()  # (layout, grid key) made by create_pg already
    world = dist.group.WORLD
    for index, spec in enumerate(plan.specs):
        if sharp == "dp" and spec.name == "dp_cp":
            os.environ["NCCL_COLLNET_ENABLE"] = "1"
        if sharp == "dp_replica" and spec.name == "intra_expt_dp":
            os.environ["NCCL_COLLNET_ENABLE"] = "1"
        private = not grids.share_groups or spec.private
        opts = options[spec.name]
        if spec.name in to_world:
            pg: Optional[dist.ProcessGroup] = world
            grids._world_shared.add(spec.name)
        elif spec.derive is None and (spec.layout, plan.layout(spec.layout).key(list(spec.dims))) not in created:
            created.add((spec.layout, plan.layout(spec.layout).key(list(spec.dims))))
            view = None if spec.layout == "dense" else "expert"
            pg = grid.create_pg(
                list(spec.dims), view=view, private=private, backend=opts.backend,
                timeout=opts.timeout, pg_options=opts.pg_options, group_desc=opts.group_desc,
            )
        else:
            # Derived by a rule of its own (embedding, optimizer instances, hierarchical CP) or a
            # second communicator over dims already made (gloo, all-gather): the same door as the
            # grid's groups, so members check they agree and the strategy holds.
            pg = grid.create_derived_pg(
                spec.name, grids._members[spec.name], groups=_enumerator(plan, spec.name),
                owner=grids._owner, private=private, backend=opts.backend, timeout=opts.timeout,
                pg_options=opts.pg_options, group_desc=opts.group_desc,
            )
        grids._groups[spec.name] = pg
        following = plan.specs[index + 1].name if index + 1 < len(plan.specs) else None
        if sharp == "dp" and spec.name.startswith(("dp_cp", "intra_dp_cp")) and not (
            following or ""
        ).startswith(("dp_cp", "intra_dp_cp")):
            _sharp_barrier(grids._groups["dp_cp"], rank)
        if sharp == "dp_replica" and spec.name.startswith("inter_expt_dp") and not (following or "").startswith(
            "inter_expt_dp"
        ):
            _sharp_barrier(grids._groups["inter_expt_dp"], rank)


def _enumerator(plan: MegatronPlan, name: str) -> Callable[[], list[list[int]]]:
    """Every group of kind ``name``, computed only if the ``enumerate`` strategy asks (O(world))."""
    return lambda: plan.enumerate(name)


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
    g = grids._groups

    def member_list(name: str) -> Optional[list[int]]:
        return grids.ranks(name)

    values: dict[str, Any] = {}
    for spec in plan.specs:
        # Hierarchical and hybrid kinds fill a list and a dict below; the inter-level gloo group
        # has no global (Megatron-Core makes it but no getter returns it).
        if spec.megatron_global and not spec.name.startswith(("hcp_", "hybrid_dp_cp_")):
            values[spec.megatron_global] = g[spec.name]
    # Kinds that are the same group as another when there is one optimizer instance.
    for alias, target in plan.aliases.items():
        values[ALIAS_GLOBALS[alias]] = g[target]
    for glob in _OPTIONAL_GLOBALS:
        values.setdefault(glob, None)
    values["_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"] = (
        [g[f"hcp_{level}"] for level in range(len(config.hierarchical_cp_sizes))]
        if config.hierarchical_cp_sizes else None
    )
    values["_HYBRID_DP_CP_GROUPS"] = {size: g[f"hybrid_dp_cp_{size}"] for size in config.hybrid_group_sizes}
    # Rank lists the getters read.
    values["_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP"] = member_list("dp_cp")
    values["_DATA_PARALLEL_GLOBAL_RANKS"] = member_list("dp")
    values["_CONTEXT_PARALLEL_GLOBAL_RANKS"] = member_list("cp")
    values["_MODEL_PARALLEL_GLOBAL_RANKS"] = member_list("mp")
    values["_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS"] = member_list("tp")
    values["_PIPELINE_GLOBAL_RANKS"] = member_list("pp")
    values["_EMBEDDING_GLOBAL_RANKS"] = member_list("embd")
    values["_POSITION_EMBEDDING_GLOBAL_RANKS"] = member_list("pos_embd")
    values["_EXPERT_MODEL_PARALLEL_RANKS"] = member_list("ep")
    if config.virtual_pipeline_model_parallel_size is not None:
        values["_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK"] = 0
        values["_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"] = config.virtual_pipeline_model_parallel_size
    # update_pg_timeout walks this list; None stands for the default group.
    values["_global_process_group_list"] = [None] + grids.distinct_groups()
    for name, value in values.items():
        if not hasattr(ps, name):
            raise RuntimeError(
                f"megatron.core.parallel_state has no {name}; this megatron-core version is not one "
                f"hypergrid.megatron supports (built against 0.16)"
            )
        setattr(ps, name, value)
