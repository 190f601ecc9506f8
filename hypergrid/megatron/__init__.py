"""Megatron-Core adapter: ``parallel_state`` and ``ProcessGroupCollection`` from one hypergrid grid.

Switching is one import::

    # from megatron.core.parallel_state import initialize_model_parallel, destroy_model_parallel
    from hypergrid.megatron import initialize_model_parallel, destroy_model_parallel

The pure planning part (:func:`plan_model_parallel`, :class:`MegatronPlan`,
:class:`MegatronConfig`) needs neither megatron-core nor a process group and is imported eagerly;
the parts that create groups import megatron-core on first use. Supported: megatron-core 0.16.1
(Python 3.11) to 0.19.2 (Python 3.12); what the installed one offers is read from its
``parallel_state`` (:func:`installed_features`; :func:`read_installed_features` reads the same from
its source without importing it), and ``initialize_model_parallel`` takes exactly its keywords.

Example::

    >>> from hypergrid.megatron import plan_model_parallel
    >>> plan_model_parallel(8, tensor_model_parallel_size=2).rank_group("dp", 3)
    [1, 3, 5, 7]
"""

from __future__ import annotations

from .._lazy import lazy_attributes
from ..errors import ParallelStateError
from .spec.config import MEGATRON_KEYWORDS, MegatronConfig, ParallelConfigError
from .spec.features import (
    COMMON_FEATURES,
    MEGATRON_CORE_0_16,
    MEGATRON_CORE_0_19,
    SUPPORTED_PROFILES,
    MegatronFeatures,
    choose_megatron_core,
    read_installed_features,
)
from .spec.plan import MegatronPlan, plan_model_parallel

__all__ = [
    "initialize_model_parallel",
    "destroy_model_parallel",
    "create_all_gather_groups",
    "process_group_collection",
    "active_grids",
    "installed_features",
    "read_installed_features",
    "choose_megatron_core",
    "MegatronGrids",
    "plan_model_parallel",
    "MegatronPlan",
    "MegatronConfig",
    "MegatronFeatures",
    "MEGATRON_CORE_0_16",
    "MEGATRON_CORE_0_19",
    "COMMON_FEATURES",
    "SUPPORTED_PROFILES",
    "ParallelConfigError",
    "ParallelStateError",
    "MEGATRON_KEYWORDS",
]

# Names served by submodules that import megatron-core, loaded on first access.
_LAZY = {
    "initialize_model_parallel": "initialize",
    "destroy_model_parallel": "initialize",
    "create_all_gather_groups": "initialize",
    "active_grids": "state",
    "installed_features": "initialize",
    "MegatronGrids": "state",
    "process_group_collection": "collection",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
