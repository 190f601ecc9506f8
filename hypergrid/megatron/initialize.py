"""Megatron-Core's ``initialize_model_parallel`` / ``destroy_model_parallel``, built on hypergrid grids.

``initialize_model_parallel`` takes every keyword of the installed megatron-core's function (read
from its signature: :func:`installed_features`), plans the groups with
:mod:`hypergrid.megatron.spec.plan`, creates this rank's groups through one
:class:`~hypergrid.grid.HyperCommGrid` (the dense layout, with the expert layout as its
``"expert"`` view) and hypergrid's registry, and fills ``megatron.core.parallel_state`` so that
every getter there answers as after that version's own call. What changes is the cost: a rank
creates only the groups it belongs to (Megatron-Core creates every group of the world on every
rank), and identical groups share one communicator unless ``share_groups=False``.

Supported: megatron-core 0.16.1 (Python 3.11) to 0.19.2 (Python 3.12). What differs between them
(the gtp_remat groups of 0.19, its ``rank_offset``/``local_world_size``, 0.16's
``create_all_gather_group``) is decided from what the installed ``parallel_state`` defines, not
from its version number.
"""

from __future__ import annotations

import functools
import inspect
import logging
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..errors import ParallelStateError
from ..runtime.modes import resolve_strategy
from ..runtime.options import GroupOptions
from .build import build_state
from .spec.config import MEGATRON_KEYWORDS, MegatronConfig, ParallelConfigError
from .spec.features import MegatronFeatures
from .spec.plan import MegatronPlan
from .state import MegatronGrids, active_grids, set_active

# megatron-core's own function, kept from import time: the drop-in use of hypergrid is
# `parallel_state.initialize_model_parallel = hypergrid.megatron.initialize_model_parallel`, after
# which the module's attribute no longer tells what the installed version takes.
_MEGATRON_INITIALIZE = ps.initialize_model_parallel

__all__ = [
    "MegatronGrids",
    "initialize_model_parallel",
    "destroy_model_parallel",
    "create_all_gather_groups",
    "active_grids",
    "installed_features",
    "reset_parallel_state",
]

logger = logging.getLogger(__name__)


# Globals whose groups Megatron-Core's destroy_model_parallel destroys itself (its gloo groups).
_DESTROYED_BY_MEGATRON = (
    "_DATA_PARALLEL_GROUP_GLOO",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
)

# Set before initialization means a previous one was not destroyed.
_INITIALIZED_MARKERS = (
    "_DATA_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_PIPELINE_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_CONTEXT_PARALLEL_GROUP",
    "_EXPERT_MODEL_PARALLEL_GROUP",
    "_GTP_WEIGHT_REMAT_GROUP",
    "_GLOBAL_MEMORY_BUFFER",
)

def installed_features() -> MegatronFeatures:
    """The installed megatron-core's ``initialize_model_parallel`` keywords, read with :mod:`inspect`.

    Example::

        >>> features = installed_features()
        >>> features.keywords[:2]
        ('tensor_model_parallel_size', 'pipeline_model_parallel_size')
        >>> features.gtp_remat == ("gtp_remat_size" in features.keywords)
        True
    """
    parameters = inspect.signature(_MEGATRON_INITIALIZE).parameters.values()
    keywords = tuple(
        p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )
    return MegatronFeatures(_installed_version(), keywords)


def _installed_version() -> str:
    """The installed distribution's version, for messages. (megatron.core.__version__ can carry a
    suffix from the git checkout of the current directory, e.g. '0.19.2+f368578'.)"""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        import megatron.core

        return str(getattr(megatron.core, "__version__", "(version unknown)"))


def _bind_arguments(features: MegatronFeatures, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Positional arguments named by the installed signature's order, merged into ``kwargs``."""
    if len(args) > len(features.keywords):
        raise TypeError(
            f"initialize_model_parallel() of megatron-core {features.version} takes at most "
            f"{len(features.keywords)} positional arguments, got {len(args)}"
        )
    bound = dict(kwargs)
    for name, value in zip(features.keywords, args):
        if name in bound:
            raise TypeError(f"initialize_model_parallel() got multiple values for argument {name!r}")
        bound[name] = value
    return bound


def initialize_model_parallel(
    *args: Any,
    share_groups: bool = True,
    strategy: Optional[str] = None,
    check_agreement: bool = True,
    **kwargs: Any,
) -> None:
    """Megatron-Core's ``initialize_model_parallel``, with groups made by hypergrid.

    Takes exactly the arguments of the installed megatron-core's function, positionally (in its
    signature's order) or by keyword, with the same meaning, defaults and validation (errors are
    raised before any group is made and name the sizes; see
    :class:`~hypergrid.errors.ParallelConfigError`). A keyword the installed version
    does not have is a ``TypeError`` naming it and the version. Afterwards every
    ``megatron.core.parallel_state`` getter answers as after that version's own call. Returns
    None, as Megatron-Core does; :func:`active_grids` gives the :class:`MegatronGrids` built.

    hypergrid-only keywords:

    ``share_groups`` (default True)
        Groups with identical members, backend, timeout and options are one communicator: e.g.
        with ``tensor_model_parallel_size == expert_tensor_parallel_size`` the tensor and expert
        tensor groups, all size-1 groups of a rank, and a group spanning the whole world, which
        is the default group itself. Fewer communicators means less start-up time and less
        memory (each NCCL communicator holds buffers on every member GPU). The trade-off:
        collectives on two names that share a communicator are serialized on it, where separate
        communicators could overlap. Groups made to overlap (the all-gather groups) and SHARP
        targets are never shared. ``False`` gives every Megatron group its own communicator,
        exactly as Megatron-Core does.
    ``strategy`` (default: the process-wide default, ``"auto"`` unless set)
        How the grid makes groups (see :mod:`hypergrid.runtime.modes`): ``"auto"`` (``"split"`` on a
        device-bound NCCL default group, else ``"local"``), ``"local"`` (each rank creates only
        its own groups; start-up does not grow with the world size), ``"split"`` (every rank
        joins one ``split_group`` per request) or ``"enumerate"`` (Megatron-Core's call pattern,
        every rank takes part in every group).
    ``check_agreement``
        Passed to the grid: check that the members of each group asked for the same group.

    Example::

        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from megatron.core import parallel_state
        >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)  # rank 5 of 16
        >>> initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
        ...                           create_gloo_process_groups=False)
        >>> parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_next_rank()
        (2, 9)
        >>> active_grids().ranks("dp")
        [5, 7]
        >>> destroy_model_parallel(); dist.destroy_process_group()

    Raises:
        ParallelConfigError (a ValueError, RuntimeError and AssertionError): a configuration
            the installed megatron-core rejects, named with its sizes.
        TypeError: keywords the installed version does not have, values of the wrong type.
        ParallelStateError (a RuntimeError and AssertionError): torch.distributed not
            initialized, or parallel state already initialized.
    """
    features = installed_features()
    kwargs = _bind_arguments(features, args, kwargs)
    if not isinstance(share_groups, bool):
        raise TypeError(f"share_groups must be a bool, got {share_groups!r}")
    strategy = resolve_strategy(strategy).value
    if not dist.is_initialized():
        raise ParallelStateError(
            "initialize_model_parallel needs torch.distributed: call torch.distributed.init_process_group() first"
        )
    _warn_unknown_keywords(features)
    config = MegatronConfig.from_megatron_kwargs(dist.get_world_size(), kwargs, features)
    _check_not_initialized()
    plan = MegatronPlan(config)
    rank = dist.get_rank()
    try:
        timeout = timedelta(minutes=config.distributed_timeout_minutes)
    except OverflowError:
        raise ParallelConfigError(
            f"distributed_timeout_minutes={config.distributed_timeout_minutes} is longer than a "
            f"datetime.timedelta can hold ({timedelta.max.days * 24 * 60} minutes at most)"
        ) from None

    grids = build_state(plan, rank=rank, share_groups=share_groups, strategy=strategy,
                        check_agreement=check_agreement, timeout=timeout)
    ps._set_global_memory_buffer()
    set_active(grids)
    logger.info(
        "rank %d: initialized %s with %d communicators (share_groups=%s, strategy=%s, megatron-core %s)",
        rank, plan, grids.num_process_groups, share_groups, strategy, features.version,
    )


def destroy_model_parallel() -> None:
    """Tear down ``parallel_state`` and release hypergrid's groups; safe to call at any time.

    Calls Megatron-Core's own ``destroy_model_parallel`` for its globals (after taking out the
    groups hypergrid owns, so that no shared group is destroyed behind the registry's back),
    clears the globals Megatron-Core's version leaves set (rank lists and group lists, whichever
    the installed version has), and releases the grid, the derived groups and the all-gather
    groups through the registry: a group is destroyed when nothing else holds it. Initializing
    again afterwards works. Also cleans up after Megatron-Core's own initialization.

    Example::

        >>> destroy_model_parallel()      # nothing initialized: does nothing harmful
        >>> active_grids() is None
        True
    """
    grids = reset_parallel_state()
    if grids is not None:
        grids.release()


def reset_parallel_state() -> Optional[MegatronGrids]:
    """Empty ``parallel_state`` and forget the current initialization, destroying no group; returns
    what was current (None: nothing), whose groups its caller releases (or keeps, as a recovery
    does while it builds the next state over the same communicators).

    Example::

        >>> reset_parallel_state() is None      # nothing initialized
        True
    """
    grids = set_active(None)
    if grids is not None:
        for name in _DESTROYED_BY_MEGATRON:
            if hasattr(ps, name):
                setattr(ps, name, None)
    ps.destroy_model_parallel()
    _clear_left_state()
    return grids


def create_all_gather_groups(
    for_expert_parallelism: bool = False,
    timeout: Optional[timedelta] = None,
    nccl_comm_cfgs: Optional[dict] = None,
) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """Megatron-Core 0.19's ``parallel_state.create_all_gather_groups``, through hypergrid.

    Returns ``(dp_cp_ag, expt_dp_ag)``: a new communicator over this rank's data-parallel group
    with context parallelism, and, with ``for_expert_parallelism=True`` and more than one expert
    rank, one over its expert data-parallel group (else None). Each is a communicator of its own,
    never shared with the group it mirrors or with anything else, whatever ``share_groups`` was:
    its point is to run parameter all-gathers while the reduce-scatters run on the other one.
    ``timeout`` (None: torch's default) and ``nccl_comm_cfgs`` (the ``dp_cp`` / ``ep_dp``
    entries, as Megatron-Core reads them) go to torch. The groups are released by
    :func:`destroy_model_parallel`. Works with either supported megatron-core; megatron-core's
    own function also works after hypergrid's initialization.

    Members are those of the groups initialization made (``order``, ``rank_offset`` and
    ``gtp_remat`` included), where megatron-core 0.19.2's function recomputes them for the
    default order ``tp-cp-ep-dp-pp`` from rank 0; the two agree for that order.

    Example::

        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from megatron.core import parallel_state
        >>> dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)  # rank 3 of 8
        >>> initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
        ...                           create_gloo_process_groups=False)
        >>> dp_cp_ag, expt_dp_ag = create_all_gather_groups(for_expert_parallelism=True)
        >>> dist.get_process_group_ranks(dp_cp_ag), dist.get_process_group_ranks(expt_dp_ag)
        ([1, 3, 5, 7], [3, 7])
        >>> dp_cp_ag is parallel_state.get_data_parallel_group(with_context_parallel=True)
        False
        >>> destroy_model_parallel(); dist.destroy_process_group()

    Raises:
        ParallelStateError (a RuntimeError): nothing is initialized.
        TypeError: an argument of the wrong type.
    """
    grids = active_grids()
    if grids is None or not ps.is_initialized():
        raise ParallelStateError(
            "create_all_gather_groups() requires parallel state to be initialized: call "
            "hypergrid.megatron.initialize_model_parallel() first"
        )
    if not isinstance(for_expert_parallelism, bool):
        raise TypeError(f"for_expert_parallelism must be a bool, got {for_expert_parallelism!r}")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__} {timeout!r}")
    if nccl_comm_cfgs is not None and not isinstance(nccl_comm_cfgs, dict):
        raise TypeError(f"nccl_comm_cfgs must be a dict or None, got {type(nccl_comm_cfgs).__name__} {nccl_comm_cfgs!r}")
    grids.check_alive()
    cfgs = nccl_comm_cfgs or {}
    index = len(grids.all_gather_groups)
    wanted: list[tuple[str, str, tuple[str, ...], str, str]] = [
        ("dp_cp", "dense", ("dp", "cp"), "dp_cp", "DATA_PARALLEL_GROUP_WITH_CP_AG")]
    if for_expert_parallelism and grids.config.ep > 1:
        wanted.append(("expt_dp", "expert", ("dp",), "ep_dp", "EXPERT_DATA_PARALLEL_GROUP_AG"))
    made: list[Optional[dist.ProcessGroup]] = []
    for kind, layout, dims, nccl_name, group_desc in wanted:
        options = GroupOptions(
            timeout=timeout,
            pg_options=ps.get_nccl_options(nccl_name, cfgs) if cfgs else None,
            group_desc=group_desc,
        )
        grid_layout = grids.plan.layout(layout)
        members = grid_layout.group_ranks(list(dims), grids.rank) if grid_layout.contains(grids.rank) else None
        pg = grids.grid.create_derived_pg(
            f"{kind}_ag#{index}", members, groups=functools.partial(grid_layout.enumerate, list(dims)),
            owner=grids.owner, private=True, timeout=options.timeout, pg_options=options.pg_options,
            group_desc=options.group_desc,
        )
        made.append(pg)
        if pg is not None:
            # update_pg_timeout walks this list, as it does for Megatron-Core's own groups.
            ps._global_process_group_list.append(pg)
    pair = (made[0], made[1] if len(made) > 1 else None)
    grids.all_gather_groups.append(pair)
    return pair


# ---------------------------------------------------------------------- helpers
def _warn_unknown_keywords(features: MegatronFeatures) -> None:
    unknown = [k for k in features.keywords if k not in MEGATRON_KEYWORDS]
    if unknown:
        logger.warning(
            "megatron-core %s's initialize_model_parallel has keyword(s) %s that hypergrid.megatron "
            "does not know; passing them is refused, and parallel_state may hold groups hypergrid "
            "does not make", features.version, unknown,
        )


def _clear_left_state() -> None:
    """Empty every ``parallel_state`` global that Megatron-Core's destroy leaves holding groups or
    rank lists (which ones depends on the version), so that a later initialization cannot read a
    previous one's ranks."""
    for name, value in list(vars(ps).items()):
        if not (name.startswith("_") and name[1:2].isupper()):
            continue
        if isinstance(value, dict) and value:
            setattr(ps, name, {})
        elif isinstance(value, (list, tuple, dist.ProcessGroup)):
            setattr(ps, name, None)


def _check_not_initialized() -> None:
    set_already = [name for name in _INITIALIZED_MARKERS if getattr(ps, name, None) is not None]
    if set_already or active_grids() is not None:
        raise ParallelStateError(
            f"model parallel state is already initialized ({', '.join(set_already) or 'hypergrid grids'} "
            f"set); call hypergrid.megatron.destroy_model_parallel() first"
        )


