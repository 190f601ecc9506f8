"""What a monitor knows of the job it serves: its spec, the rings of its ranks and of its nodes, how
far it read the job's board, whom it knows lost, and what it saw of the nodes it watches.

Example, a job of ranks 0-15 on nodes of 8, node 1 lost whole::

    >>> from hypergrid.store.keys import JobChannel
    >>> job = ServedJob.of(JobSpec(JobChannel("ns", "job", 0), ((0, 16),), gpus_per_node=8), next_event=0)
    >>> job.nodes.order(), job.ring.on_node(1)
    ([0, 1], [8, 9, 10, 11, 12, 13, 14, 15])
    >>> job.lost.update({rank: "its node's heartbeat stopped" for rank in range(8, 16)}); job.lost_nodes()
    {1}
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from .config import JobSpec
from .ring import Ring, from_runs
from .watch import Watched

__all__ = ["ServedJob"]


@dataclass
class ServedJob:
    """The job a monitor serves, as it stands for that monitor (its spec is what the rank attached)."""

    spec: JobSpec
    ring: Ring
    #: The ring of the job's nodes: a node's delegate reads the counters of the nodes its node watches.
    nodes: Ring
    #: The next entry of the board to take in (-1: not known yet; a follower learns it from its delegate).
    next_event: int
    lost: dict[int, str] = field(default_factory=dict)
    #: What this monitor saw of the counters of the nodes it watches, by node.
    watched: dict[int, Watched] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: JobSpec, next_event: int, lost: Optional[dict[int, str]] = None) -> ServedJob:
        """``spec``'s job, its board read up to ``next_event``, with the losses ``lost`` known already."""
        ring, nodes = _rings(tuple((int(first), int(count)) for first, count in spec.runs), spec.gpus_per_node)
        return cls(spec, ring, nodes, next_event, dict(lost or {}))

    def lost_nodes(self) -> set[int]:
        """The nodes all of whose ranks in the job are lost (a watch walks past them)."""
        size = self.spec.gpus_per_node
        counted = Counter(rank // size for rank in self.lost if rank in self.ring)
        return {node for node, count in counted.items() if count >= len(self.ring.on_node(node))}


@functools.lru_cache(maxsize=8)
def _rings(runs: tuple[tuple[int, int], ...], gpus_per_node: int) -> tuple[Ring, Ring]:
    """The rings of a job's ranks and of its nodes, made once per job in a process: a ring is a value
    (frozen, never changed), and a process hosting many monitors (a benchmark's) would otherwise hold
    a megabyte per monitor at 131,072 ranks."""
    ring = Ring.of(from_runs(runs), gpus_per_node)
    return ring, Ring.of(ring.nodes, 1)
