"""Who watches whom: a ring over a job's ranks in which every rank's watcher is on another node,
and, where the job has more than a few nodes, on a node far from it.

Each rank's *successor* is watched on its behalf (by its node's delegate, or its own monitor
alone), one heartbeat per rank and interval. The ring visits local
index 0 of every node, then local 1 of every node, and so on, so that a node lost whole, monitors
and all, has each of its ranks watched from a node still there. The nodes are visited with the
job's two halves interleaved (with ``h = ceil(K / 2)`` of ``K`` nodes: the first, the ``h``-th, the
second, ...): consecutive nodes (a rack, a switch) fail together, and this way a run of up to
``h - 1`` of them is still seen within one staleness bound. Where only some nodes have a local
index, a watcher also reads the ranks after its successor on the successor's node
(:meth:`Ring.watched_from`). Ranks are kept as sorted arrays, so a monitor stays small at a
million ranks.

Example, ranks 0-7 on nodes of 4 (two nodes), and ranks 0-11 on nodes of 2 (six nodes, visited
as 0, 3, 1, 4, 2, 5)::

    >>> ring = Ring.of(range(8), gpus_per_node=4)
    >>> [ring.successor(r) for r in range(8)]
    [4, 5, 6, 7, 1, 2, 3, 0]
    >>> ring.order()
    [0, 4, 1, 5, 2, 6, 3, 7]
    >>> Ring.of(range(12), gpus_per_node=2).order()
    [0, 6, 2, 8, 4, 10, 1, 7, 3, 9, 5, 11]
    >>> Ring.of([0, 1, 2, 3, 8, 9], gpus_per_node=4).successor(1)     # node 2 has no local 1
    9
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

__all__ = ["Ring", "as_runs", "from_runs"]


def as_runs(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """``ranks`` as ``(first, count)`` runs of consecutive ranks, ascending.

    Example::

        >>> as_runs([5, 0, 1, 2, 7, 6])
        [(0, 3), (5, 3)]
    """
    runs: list[tuple[int, int]] = []
    for rank in sorted(set(ranks)):
        if runs and runs[-1][0] + runs[-1][1] == rank:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((rank, 1))
    return runs


def from_runs(runs: Iterable[Sequence[int]]) -> Iterator[int]:
    """The ranks of ``(first, count)`` runs.

    Example::

        >>> list(from_runs([(0, 3), (5, 2)]))
        [0, 1, 2, 5, 6]
    """
    for first, count in runs:
        yield from range(first, first + count)


@dataclass(frozen=True)
class Ring:
    """The watching ring over ``ranks`` (sorted, distinct) with nodes of ``gpus_per_node`` ranks;
    ``nodes``: the nodes that hold any, ascending (made by :meth:`of`)."""

    ranks: array
    gpus_per_node: int
    nodes: array

    @classmethod
    def of(cls, ranks: Iterable[int], gpus_per_node: int) -> Ring:
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive number of ranks, got {gpus_per_node}")
        ordered = array("q", sorted(set(ranks)))
        return cls(ordered, gpus_per_node, array("q", sorted({rank // gpus_per_node for rank in ordered})))

    def __len__(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        i = bisect.bisect_left(self.ranks, rank)
        return i < len(self.ranks) and self.ranks[i] == rank

    # -------------------------------------------------------------- the order of the nodes
    def _position(self, node: int) -> int:
        """``node``'s place in the ring's order: the i-th node of the first half at 2i, of the second at 2i + 1."""
        index, half = bisect.bisect_left(self.nodes, node), (len(self.nodes) + 1) // 2
        return 2 * index if index < half else 2 * (index - half) + 1

    def _node_at(self, position: int) -> int:
        half = (len(self.nodes) + 1) // 2
        return self.nodes[position // 2 if position % 2 == 0 else half + position // 2]

    def _first_with(self, local: int, from_position: int) -> Optional[int]:
        """The rank of local index ``local`` on the first node from ``from_position`` on that has one."""
        for position in range(from_position, len(self.nodes)):
            candidate = self._node_at(position) * self.gpus_per_node + local
            if candidate in self:
                return candidate
        return None

    def successor(self, rank: int) -> int:
        """The rank ``rank`` watches: the next one in (local index, node's position) order, cyclically."""
        if len(self.ranks) == 0:
            raise ValueError("an empty ring has no successors")
        if rank not in self:
            raise ValueError(f"rank {rank} is not in the ring (its {len(self.ranks)} ranks run from "
                             f"{self.ranks[0]} to {self.ranks[-1]})")
        size = self.gpus_per_node
        local, position = rank % size, self._position(rank // size)
        found = self._first_with(local, position + 1)
        if found is not None:
            return found
        for step in range(1, size + 1):
            found = self._first_with((local + step) % size, 0)
            if found is not None:
                return found
        raise AssertionError("unreachable: a non-empty ring has a rank of some local index")

    def watched_from(self, rank: int) -> list[int]:
        """The ranks ``rank``'s watcher reads: its successor, and those after it on the successor's
        node where that is not ``rank``'s own. Only the successor where every node has every local index.

        Example, node 1 with local indices 2 and 3 alone::

            >>> ring = Ring.of([0, 1, 4, 5, 6, 7], gpus_per_node=4)
            >>> ring.order(), ring.watched_from(1), ring.watched_from(5)
            ([0, 4, 1, 5, 6, 7], [5, 6, 7], [6])
            >>> Ring.of(range(8), gpus_per_node=8).watched_from(3)      # one node: its successor only
            [4]
        """
        run = [self.successor(rank)]
        following = self.successor(run[-1])
        while following not in (rank, run[0]) and self.run_goes_on(run[-1], following, rank):
            run.append(following)
            following = self.successor(following)
        return run

    def run_goes_on(self, read: int, following: int, watcher: int) -> bool:
        """Whether ``watcher``, having read ``read``, reads ``following`` too (:meth:`watched_from`).

        Example::

            >>> ring = Ring.of([0, 1, 4, 5, 6, 7], gpus_per_node=4)
            >>> ring.run_goes_on(5, 6, watcher=1), ring.run_goes_on(5, 6, watcher=4)
            (True, False)
        """
        node = read // self.gpus_per_node
        return following // self.gpus_per_node == node != watcher // self.gpus_per_node

    def on_node(self, node: int) -> list[int]:
        """The ranks of the ring on node ``node``.

        Example::

            >>> Ring.of([0, 1, 3, 4, 6], gpus_per_node=4).on_node(0)
            [0, 1, 3]
        """
        low = bisect.bisect_left(self.ranks, node * self.gpus_per_node)
        high = bisect.bisect_left(self.ranks, (node + 1) * self.gpus_per_node)
        return list(self.ranks[low:high])

    def order(self) -> list[int]:
        """Every rank, in ring order from the least (for people and tests: O(ranks))."""
        return sorted(self.ranks, key=lambda r: (r % self.gpus_per_node, self._position(r // self.gpus_per_node)))
