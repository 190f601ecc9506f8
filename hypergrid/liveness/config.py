"""What a rank's monitor is started with, and the job it serves: plain values, shared with the rank.

Example::

    >>> from hypergrid.store.keys import JobChannel
    >>> spec = JobSpec(JobChannel("ns", "job", 0), ((0, 16),), gpus_per_node=8)
    >>> JobSpec.from_json(spec.to_json()) == spec, len(spec.digest)
    (True, 16)
    >>> MonitorConfig("127.0.0.1", 29500, "ns", rank=3).stale_beats
    5
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass

from ..store.keys import JobChannel

__all__ = ["MonitorConfig", "JobSpec", "DEFAULT_PROGRESS_TIMEOUT_S", "STALE_BEATS", "START_TIMEOUT_S",
           "DEFAULT_NODES_PER_READER"]

#: How long a rank's interpreter may make no progress before it counts as hung (minutes: pauses of seconds are routine).
DEFAULT_PROGRESS_TIMEOUT_S = 180.0
#: How many heartbeat intervals a counter may stand still before its rank counts as gone.
STALE_BEATS = 5
#: How many nodes share one wait on the job's board (:mod:`~hypergrid.liveness.fanout`; a job of no
#: more nodes has each node's delegate wait itself).
DEFAULT_NODES_PER_READER = 16
#: How long a new monitor may take to reach the store and say it is ready: a counter that never beat
#: is given this much more before its rank counts as gone.
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class MonitorConfig:
    """What a monitor needs: the store's address and namespace, its rank, its timing, and how long
    the store may take to connect or answer before the monitor gives it up."""

    host: str
    port: int
    namespace: str
    rank: int
    interval_s: float = 1.0
    stale_beats: int = STALE_BEATS
    progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S
    connect_timeout_s: float = 30.0
    parent_pid: int = 0
    #: Reach the store once at the start: where nobody has yet (the rank's own process reaches it otherwise).
    check_store: bool = False


@dataclass(frozen=True)
class JobSpec:
    """The job a monitor serves: its board's channel, its ranks as ``(first, count)`` runs, its
    ``gpus_per_node``, and how many nodes share one reader of its board."""

    channel: JobChannel
    runs: tuple[tuple[int, int], ...]
    gpus_per_node: int
    nodes_per_reader: int = DEFAULT_NODES_PER_READER

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @functools.cached_property
    def digest(self) -> str:
        """A short digest: a node's monitors compare theirs (one not told of a recovery watches an older ring)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        raw = json.loads(text)
        return cls(JobChannel(**raw["channel"]), tuple((int(a), int(b)) for a, b in raw["runs"]), int(raw["gpus_per_node"]),
                   int(raw.get("nodes_per_reader", DEFAULT_NODES_PER_READER)))
