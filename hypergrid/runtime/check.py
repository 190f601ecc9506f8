"""One member's view of one agreement check: who meets, what it asked for, and where they meet.

A group's members check that they asked for the same thing in a *check*, named by what they
share: their member set (a digest of the sorted ranks) and the check's epoch, which the store
counts per member set and each member reads as it arrives (:meth:`Check.opened`). The check is a
meeting of the members (:mod:`hypergrid.store.meeting`) at the member set's keys for that epoch.
See :mod:`hypergrid.runtime.agreement` for the protocol and its invariant.

Example, in a one-rank gloo world whose store is a ``HashStore``::

    >>> import time
    >>> import torch.distributed as dist
    >>> from hypergrid.runtime.environment import job_store
    >>> from hypergrid.store.records import GridFacts, Position, RequestFacts
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> facts = GridFacts.of([2], ["tp"], 0)
    >>> asked = Agreement(Position(facts.family, facts.digest, 0), facts,
    ...                   RequestFacts("tp", None, False, None, None, None, "local"))
    >>> check = Check.opened(job_store(time.monotonic() + 5), "tp", [0, 1], asked)
    >>> check.check_id.name, check.decider, check.meeting.outcome.endswith("/0/outcome")
    ('[0, 1]#0', 0, True)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch.distributed as dist

from ..layout.describe import describe_ranks, members_fingerprint
from ..store.client import StoreClient
from ..store.keys import Meeting, MemberSetKeys
from ..store.records import Agreement, Asked, CheckId, LastState, State, encode

__all__ = ["Check"]


@dataclass
class Check:
    """One member's view of one check, with the store keys it uses."""

    store: StoreClient
    label: str
    members: list[int]
    agreement: Agreement
    rank: int
    check_id: CheckId
    asked: Asked = field(init=False)
    digest: str = field(init=False)
    keys: MemberSetKeys = field(init=False)

    def __post_init__(self) -> None:
        self.asked = Asked(self.agreement, members_fingerprint(self.members))
        self.digest = hashlib.sha1(encode(self.asked).encode()).hexdigest()
        self.keys = MemberSetKeys.named(self.check_id.members)

    @classmethod
    def opened(cls, store: StoreClient, label: str, members: list[int], agreement: Agreement) -> Check:
        """This rank's check of ``members``: the epoch is read, and the rank is in it from now on."""
        epoch = int(store.add(MemberSetKeys.of(members).epoch, 0))
        return cls(store, label, members, agreement, dist.get_rank(), CheckId.of(members, epoch))

    @property
    def epoch(self) -> int:
        return self.check_id.epoch

    @property
    def decider(self) -> int:
        """The member that reads every entry and decides the outcome: the lowest."""
        return min(self.members)

    @property
    def meeting(self) -> Meeting:
        return self.keys.meeting(self.epoch)

    def last_state(self, state: State, error: str = "", diverged: bool = False) -> LastState:
        """This rank's state in this check, as others read it."""
        return LastState(state, self.check_id.members, self.check_id.shown, self.epoch, self.asked, error, diverged)

    def where(self) -> str:
        return f"process group {self.label!r} (members {describe_ranks(self.members)})"
