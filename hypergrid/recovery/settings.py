"""A resilient job's settings, set once: ``gpus_per_node``, the replica dim and the recovery's timings.

Every rank must plan a recovery alike, so the settings are one frozen value carried in every
arrival and compared by the round's leader: ranks whose settings differ end the round with an error.

>>> settings = RecoverySettings(gpus_per_node=4)
>>> settings.gpus_per_node, settings.replica_dim, settings.leader_quiet_s
(4, 'dp', 4.0)
>>> RecoverySettings(gpus_per_node=0)
Traceback (most recent call last):
    ...
ValueError: gpus_per_node must be a positive number of ranks, got 0
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..layout.checks import as_int
from ..liveness.config import DEFAULT_NODES_PER_READER

__all__ = ["RecoverySettings", "DEFAULT_GPUS_PER_NODE"]

#: ``gpus_per_node`` where neither the job nor torchrun's LOCAL_WORLD_SIZE says.
DEFAULT_GPUS_PER_NODE = 8


def _launcher_node_size() -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else DEFAULT_GPUS_PER_NODE


@dataclass(frozen=True)
class RecoverySettings:
    """How a resilient job recovers; the same on every rank of it. ``gpus_per_node`` defaults to
    torchrun's ``LOCAL_WORLD_SIZE``, else 8; timings are in seconds."""

    gpus_per_node: int = field(default_factory=_launcher_node_size)  #: ranks per node: a lost node's go to a spare node
    replica_dim: str = "dp"  #: the dim whose replicas are dropped when spares run out, and grown back
    leader_look_s: float = 0.1  #: how often the round's leader looks
    leader_quiet_s: float = 4.0  #: how long the leader's beat may stand still before another takes over
    arrival_margin_s: float = 5.0  #: how long past the longest collective timeout a live rank may take to arrive
    outcome_fallback_s: float = 30.0  #: how long a wait that hears the board goes without reading the store
    spare_slice_s: float = 30.0  #: how long a spare blocks at a time
    probe_s: float = 10.0  #: how long one probe of a group may take
    #: how many nodes share one wait on the job's board and one batch of a round's calls (jobs of more nodes)
    nodes_per_reader: int = DEFAULT_NODES_PER_READER

    def __post_init__(self) -> None:
        number = as_int(self.gpus_per_node, "gpus_per_node")
        if number < 1:
            raise ValueError(f"gpus_per_node must be a positive number of ranks, got {number}")
        object.__setattr__(self, "gpus_per_node", number)
        readers = as_int(self.nodes_per_reader, "nodes_per_reader")
        if readers < 1:
            raise ValueError(f"nodes_per_reader must be a positive number of nodes, got {readers}")
        object.__setattr__(self, "nodes_per_reader", readers)
        if not isinstance(self.replica_dim, str) or not self.replica_dim:
            raise TypeError(f"replica_dim must be a dim's name (a non-empty str), got {self.replica_dim!r}")
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.name.endswith("_s") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                             or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{item.name} must be a positive number of seconds, got {value!r}")

    def describe(self) -> str:
        """The settings in one line, what an arrival carries.

        >>> RecoverySettings(gpus_per_node=2, replica_dim="pp").describe()[:40]
        'gpus_per_node=2 replica_dim=pp leader_lo'
        """
        return " ".join(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
                        for name, value in dataclasses.asdict(self).items())

    def with_call(self, call: str, **given: Any) -> RecoverySettings:
        """These settings, where ``given`` (a call's arguments, None where not given) agrees with them.

        >>> RecoverySettings(gpus_per_node=4).with_call("recover", gpus_per_node=None, replica_dim="dp").gpus_per_node
        4
        >>> RecoverySettings(gpus_per_node=4).with_call("recover", gpus_per_node=8)
        Traceback (most recent call last):
            ...
        ValueError: recover(gpus_per_node=8) differs from the job's settings (gpus_per_node=4): set it once, on the job (ResilientJob.of_grid / of_megatron, settings=RecoverySettings(...))
        """
        for name, value in given.items():
            if value is not None and value != getattr(self, name):
                raise ValueError(
                    f"{call}({name}={value!r}) differs from the job's settings ({name}={getattr(self, name)!r}): set it "
                    f"once, on the job (ResilientJob.of_grid / of_megatron, settings=RecoverySettings(...))")
        return self
