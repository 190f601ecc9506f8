"""One member's view of one round: its identity, what it asked for, and the keys it uses.

A round is named by what its members share: their member set (a digest of the sorted ranks) and
the round's epoch, which the store counts per member set and each member reads as it arrives
(:meth:`Round.opened`). See :mod:`hypergrid.runtime.agreement` for the protocol and its invariant.

Example, in a one-rank gloo world whose store is a ``HashStore``::

    >>> import time
    >>> import torch.distributed as dist
    >>> from hypergrid.runtime.wire import GridFacts, Position, RequestFacts
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> facts = GridFacts.of([2], ["tp"], 0)
    >>> asked = Agreement(Position(facts.family, facts.digest, 0), facts,
    ...                   RequestFacts("tp", None, False, None, None, None, "local"))
    >>> rnd = Round.opened(StoreClient(time.monotonic() + 5), "tp", [0, 1], asked)
    >>> rnd.round_id.name, rnd.leader, rnd.verdict_key.endswith("/verdict/0")
    ('[0, 1]#0', 0, True)
    >>> [key.rsplit("/", 2)[-2] for key in rnd.arrival_keys()]
    ['here', 'count', 'complete']
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch.distributed as dist

from ..layout.describe import describe_ranks, members_fingerprint
from .store import StoreClient, member_set_key
from .wire import Agreement, Asked, LastState, RoundId, State, encode, members_digest

__all__ = ["Round"]


@dataclass
class Round:
    """One member's view of one round, with the store keys it uses."""

    store: StoreClient
    label: str
    members: list[int]
    agreement: Agreement
    rank: int
    round_id: RoundId
    asked: Asked = field(init=False)
    digest: str = field(init=False)
    base: str = field(init=False)

    def __post_init__(self) -> None:
        self.asked = Asked(self.agreement, members_fingerprint(self.members))
        self.digest = hashlib.sha1(encode(self.asked).encode()).hexdigest()
        self.base = member_set_key(self.round_id.members)

    @classmethod
    def opened(cls, store: StoreClient, label: str, members: list[int], agreement: Agreement) -> Round:
        """This rank's round of ``members``: the epoch is read, and the rank is in it from now on."""
        epoch = int(store.add(f"{member_set_key(members_digest(members))}/epoch", 0))
        return cls(store, label, members, agreement, dist.get_rank(), RoundId.of(members, epoch))

    @property
    def epoch(self) -> int:
        return self.round_id.epoch

    @property
    def leader(self) -> int:
        return min(self.members)

    @property
    def epoch_key(self) -> str:
        return f"{self.base}/epoch"

    @property
    def verdict_key(self) -> str:
        return f"{self.base}/verdict/{self.epoch}"

    def entry_key(self, rank: int) -> str:
        return f"{self.base}/entry/{rank}"

    @property
    def arrivals_key(self) -> str:
        """The round's list of the members that have published their entry ("r," each)."""
        return f"{self.base}/here/{self.epoch}"

    @property
    def count_key(self) -> str:
        """The round's count of arrivals, which each member adds 1 to once its entry is published."""
        return f"{self.base}/count/{self.epoch}"

    @property
    def complete_key(self) -> str:
        """Set by the member whose arrival made the count reach the number of members; the leader
        blocks on it."""
        return f"{self.base}/complete/{self.epoch}"

    def arrival_keys(self) -> list[str]:
        """This round's keys of arrival, which its leader deletes once it is done with them."""
        return [self.arrivals_key, self.count_key, self.complete_key]

    def last_state(self, state: State, error: str = "", diverged: bool = False) -> LastState:
        """This rank's state in this round, as others read it."""
        return LastState(state, self.round_id.members, self.round_id.shown, self.epoch, self.asked, error, diverged)

    def where(self) -> str:
        return f"process group {self.label!r} (members {describe_ranks(self.members)})"
