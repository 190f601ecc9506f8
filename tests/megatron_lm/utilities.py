"""hypergrid's stand-in for the ``Utils`` class Megatron-LM's unit tests import, on gloo and CPU.

Megatron-LM's tests do ``from tests.unit_tests.test_utilities import Utils`` and call
``Utils.rank``, ``Utils.world_size``, ``Utils.initialize_distributed()``,
``Utils.initialize_model_parallel(tp, pp, vpp, **kwargs)`` and ``Utils.destroy_model_parallel()``.
Megatron-LM's own class starts NCCL on one GPU per rank; this one, written here, gives the same
calls on gloo over loopback, for the ranks :mod:`tests.megatron_lm.launch` starts (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as torchrun sets them).
:func:`tests.megatron_lm.checkout.build_tree` writes it as ``tests/unit_tests/test_utilities.py``
beside Megatron-LM's test files, so that their import finds it.

Every call into Megatron-Core goes through ``parallel_state``'s module attributes, looked up at
call time: the conftest's ``[hypergrid]`` run replaces ``initialize_model_parallel`` and
``destroy_model_parallel`` there, and the tests then run on hypergrid's.

Example (inside a rank)::

    >>> # Utils.initialize_model_parallel(2, 2); ...; Utils.destroy_model_parallel()
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

#: A collective that waits longer than this fails the test instead of hanging the job.
TIMEOUT = timedelta(minutes=2)


def _parallel_state() -> Any:
    import megatron.core.parallel_state as parallel_state

    return parallel_state


class Utils:
    """This rank and the world, as the launcher started them, and model parallelism on them."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    #: Whether model parallelism may be set up (``destroy_model_parallel`` then tears it down).
    inited = False

    @staticmethod
    def initialize_distributed() -> None:
        """Join the job's gloo world (once per process; later calls only mark it usable)."""
        if not dist.is_initialized():
            address = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = os.environ["MASTER_PORT"]
            dist.init_process_group(
                backend="gloo", init_method=f"tcp://{address}:{port}",
                rank=Utils.rank, world_size=Utils.world_size, timeout=TIMEOUT,
            )
            dist.barrier()
        Utils.inited = True

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        """Whatever a previous test left is torn down first; then ``parallel_state``'s own call."""
        parallel_state = _parallel_state()
        parallel_state.destroy_model_parallel()
        Utils.initialize_distributed()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel() -> None:
        """Every rank arrives, then ``parallel_state`` forgets its groups; a no-op when not set up.

        A barrier that fails (a rank gone after a failed test) leaves the state as it is and only
        marks it down, so that one failure does not cascade into the tests after it.
        """
        if not Utils.inited:
            return
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier()
        except Exception:  # noqa: BLE001 - reported by the test that broke the world
            Utils.inited = False
            return
        _parallel_state().destroy_model_parallel()
        Utils.inited = False
