"""Recovery in-process: after ranks are lost, re-place the grid on survivors or spares and rebuild
only the groups that changed. Every rank builds a :class:`ResilientJob`; when a collective fails,
every survivor calls :func:`recover` (see docs/recovery.md for a training loop).

Example, with no process group: nothing to recover with, so a spare's wait returns at once::

    >>> from hypergrid import HyperCommGrid
    >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=5), spares=[4])
    >>> job.domain, job.wait_as_spare() is job
    ((0, 1, 2, 3, 4), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Optional

from ..layout.replan import RecoveryKind, RecoveryPlan, plan_growth, plan_recovery
from ..liveness.heartbeat import start_heartbeat
from .abort import register_abortable_backend
from .job import GridRecipe, MegatronRecipe, ResilientJob
from .settings import RecoverySettings

__all__ = ["ResilientJob", "RecoverySettings", "GridRecipe", "MegatronRecipe", "RecoveryKind", "RecoveryPlan",
           "plan_recovery", "plan_growth", "recover", "grow", "register_abortable_backend", "start_heartbeat"]


def recover(job: ResilientJob, *, failed: Optional[Sequence[int]] = None, timeout: Optional[timedelta] = None,
            step: Optional[int] = None, gpus_per_node: Optional[int] = None,
            replica_dim: Optional[str] = None) -> ResilientJob:
    """The job after a failure, on every survivor (:meth:`ResilientJob.recover`). Example, as rank 0
    of 4 on torch's fake backend: rank 3 is lost and there is no spare, so its dp replica is dropped::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from hypergrid import HyperCommGrid
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        >>> grid = HyperCommGrid([2, 2], ["tp", "dp"]); tp = grid.create_pg("tp")
        >>> after = recover(ResilientJob.of_grid(grid), failed=[3])
        >>> after.last.kind.value, list(after.layout.ranks), after.state.get_pg("tp") is tp
        ('shrink', [0, 1], True)
        >>> after.state.destroy(); dist.destroy_process_group()
    """
    return _job(job).recover(failed=failed, timeout=timeout, step=step, gpus_per_node=gpus_per_node,
                             replica_dim=replica_dim)


def grow(job: ResilientJob, *, timeout: Optional[timedelta] = None, step: Optional[int] = None,
         gpus_per_node: Optional[int] = None, replica_dim: Optional[str] = None) -> ResilientJob:
    """The job grown back towards the size it was made with (:meth:`ResilientJob.grow`). Example, with no process
    group (nobody to grow with)::

        >>> from hypergrid import HyperCommGrid
        >>> job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"], world_size=4))
        >>> grow(job) is job
        True
    """
    return _job(job).grow(timeout=timeout, step=step, gpus_per_node=gpus_per_node, replica_dim=replica_dim)


def _job(job: object) -> ResilientJob:
    if not isinstance(job, ResilientJob):
        raise TypeError(f"job must be a ResilientJob (ResilientJob.of_grid or of_megatron), got {type(job).__name__}")
    return job
