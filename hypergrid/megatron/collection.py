"""Megatron-Core's ``ProcessGroupCollection``, filled from hypergrid's groups.

Each field of the installed ``megatron.core.process_groups_config.ProcessGroupCollection`` maps
to one kind of the :class:`~hypergrid.megatron.spec.plan.MegatronPlan`; the values are the same
objects ``ProcessGroupCollection.use_mpu_process_groups()`` would read from ``parallel_state``
after :func:`~hypergrid.megatron.initialize_model_parallel`, taken from the grids instead. The
fields are whatever the installed version declares (0.19 adds the gtp_remat and all-gather
ones); a field hypergrid does not know is an error rather than a silent None.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional

from megatron.core.process_groups_config import ProcessGroupCollection

from ..errors import ParallelStateError
from .state import MegatronGrids, active_grids

__all__ = ["process_group_collection", "COLLECTION_FIELDS"]

#: ProcessGroupCollection field -> hypergrid plan kind (fields of every supported version).
COLLECTION_FIELDS = {
    "tp": "tp",
    "pp": "pp",
    "mp": "mp",
    "embd": "embd",
    "pos_embd": "pos_embd",
    "cp": "cp",
    "tp_cp": "tp_cp",
    "hcp": "hcp",
    "ep": "ep",
    "expt_tp": "expt_tp",
    "tp_ep": "tp_ep",
    "tp_ep_pp": "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat": "tp_ep_pp_egtp",
    "tp_dp_cp": "tp_dp_cp",
    "dp": "dp",
    "dp_cp": "dp_cp",
    "dp_cp_gtp_remat": "dp_cp_gtp",
    "dp_cp_ag": "dp_cp_ag",
    "gtp_remat": "gtp_remat",
    "expt_gtp_remat": "expt_gtp_remat",
    "expt_dp": "expt_dp",
    "expt_dp_gtp_remat": "expt_dp_gtp",
    "expt_dp_ag": "expt_dp_ag",
    "intra_dp_cp": "intra_dp_cp",
    "intra_expt_dp": "intra_expt_dp",
    "inter_dist_opt": "inter_expt_dp",
    "intra_dist_opt": "intra_dist_opt",
}

# Fields use_mpu_process_groups reads through get_data_parallel_group, which asserts that the
# group exists (the others pass check_initialized=False and give None): a rank outside the grids'
# span gets Megatron-Core's AssertionError for them.
_ASSERTED_FIELDS = ("dp", "dp_cp", "dp_cp_gtp_remat", "intra_dp_cp")

# The separate all-gather communicators: use_mpu_process_groups leaves them None; here they are
# the last pair hypergrid.megatron.create_all_gather_groups made, if any.
_ALL_GATHER_FIELDS = {"dp_cp_ag": 0, "expt_dp_ag": 1}


def process_group_collection(
    grids: Optional[MegatronGrids] = None, required_pgs: Optional[list[str]] = None
) -> ProcessGroupCollection:
    """A ``ProcessGroupCollection`` with every field (or those in ``required_pgs``) from the grids.

    ``grids`` defaults to the current :func:`~hypergrid.megatron.initialize_model_parallel`.
    Fields a rank has no group for hold None, as ``use_mpu_process_groups`` gives: ``embd`` off
    the embedding stages, ``hcp`` without hierarchical context parallelism, ``inter_dist_opt``
    with one distributed-optimizer instance.

    A model passes the collection's groups to its collectives, as in
    ``torch.distributed.all_reduce(t, group=pgs.tp)``.

    Example, as rank 5 of a 16-rank job on torch's fake backend, which needs no other process::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from hypergrid.megatron import initialize_model_parallel, destroy_model_parallel
        >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
        >>> initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
        ...                           create_gloo_process_groups=False)
        >>> pgs = process_group_collection()
        >>> dist.get_process_group_ranks(pgs.tp), pgs.tp is active_grids().group("tp")
        ([4, 5], True)
        >>> pgs.embd is None                             # rank 5 is neither first nor last stage
        True
        >>> destroy_model_parallel()
        >>> dist.destroy_process_group()

    Raises:
        ParallelStateError (a RuntimeError and AssertionError): nothing is initialized, or this
            rank is outside the grids' span and a data-parallel field is asked for (Megatron-Core
            asserts there too).
        RuntimeError: the installed megatron-core has a field this version of hypergrid does not know.
        ValueError: a name in ``required_pgs`` is not a field.
    """
    if grids is None:
        grids = active_grids()
        if grids is None:
            raise ParallelStateError(
                "no hypergrid model parallel state: call hypergrid.megatron.initialize_model_parallel() first"
            )
    known = [f.name for f in fields(ProcessGroupCollection)]
    unknown_to_us = [name for name in known if name not in COLLECTION_FIELDS]
    if unknown_to_us:
        raise RuntimeError(
            f"ProcessGroupCollection has field(s) {unknown_to_us} that hypergrid.megatron does not "
            f"fill; this megatron-core version is newer than the adapter (supported: 0.16.1 to 0.19.2)"
        )
    wanted = known if required_pgs is None else list(required_pgs)
    invalid = [name for name in wanted if name not in known]
    if invalid:
        raise ValueError(f"unknown ProcessGroupCollection field(s) {invalid}; fields are {known}")
    return ProcessGroupCollection(**{name: _value(grids, name) for name in wanted})


def _value(grids: MegatronGrids, field_name: str) -> Any:
    config = grids.config
    if field_name in _ALL_GATHER_FIELDS:
        return grids.all_gather_groups[-1][_ALL_GATHER_FIELDS[field_name]] if grids.all_gather_groups else None
    if field_name == "hcp":
        sizes = config.hierarchical_cp_sizes
        if not sizes or grids.group("hcp_0") is None:
            return None
        return [grids.group(f"hcp_{level}") for level in range(len(sizes))]
    if field_name == "inter_dist_opt" and config.num_distributed_optimizer_instances == 1:
        return None
    value = grids.group(COLLECTION_FIELDS[field_name])
    if value is None and field_name in _ASSERTED_FIELDS:
        raise ParallelStateError(
            f"rank {grids.rank} is in no {field_name!r} group: it is outside the ranks "
            f"[{config.rank_offset}, {config.rank_offset + config.grid_size}) the grids span"
        )
    return value
