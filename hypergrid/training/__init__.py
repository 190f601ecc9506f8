"""Training through failures in one call: :func:`train` runs a user's steps on every rank of a
:class:`~hypergrid.recovery.ResilientJob`, spares included, and brings the whole training state
(:class:`TrainingState`: model, optimizers, RNG, scheduler, data position) back on every rank
after a recovery, from host-memory snapshots and a surviving replica peer.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> TrainingState(model, torch.optim.Adam(model.parameters())).capture(step=0).step
    0
"""

from __future__ import annotations

from .loop import Loader, Setup, Step, TrainingRun, train
from .partner import PartnerCopies, partner_map
from .records import RecoveryRecord
from .state import RngState, Snapshot, TrainingState
from .transfer import share_snapshot

__all__ = ["train", "TrainingRun", "TrainingState", "Snapshot", "RngState", "RecoveryRecord", "Setup", "Step",
           "share_snapshot", "Loader", "PartnerCopies", "partner_map"]
