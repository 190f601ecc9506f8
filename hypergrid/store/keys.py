"""Every key hypergrid writes to a job's store, and every local socket name, built in one place.

``hypergrid/agree/...`` lives in the default group's store; ``hypergrid/control/<token>/...`` in
the root store, which monitor processes reach by address.

Example::

    >>> channel = JobChannel("hypergrid/control/ab12", "f00d", 0)
    >>> channel.board_count(), channel.board_slot(3), channel.round(2).verdict
    ('hypergrid/control/ab12/job/f00d/0/events', 'hypergrid/control/ab12/job/f00d/0/event/3', \
'hypergrid/control/ab12/job/f00d/0/2/verdict')
    >>> node_beat_key("hypergrid/control/ab12", 7, 8)
    'hypergrid/control/ab12/node/8/7'
    >>> MemberSetKeys.of([3, 1]).meeting(4).outcome
    'hypergrid/agree/1f02f98cf775a9e0ce92/4/outcome'
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AGREE_ROOT", "CONTROL_ROOT", "NAMESPACE_TOKEN", "DEPARTED", "members_digest", "Meeting", "MemberSetKeys",
    "last_state_key", "WorldStepKeys", "health_meeting", "health_epoch", "health_attempt", "node_beat_key", "RoundKeys",
    "JobChannel", "socket_name",
]

AGREE_ROOT = "hypergrid/agree"
CONTROL_ROOT = "hypergrid/control"
#: In the default group's store: the control plane's token, which every rank reads back.
NAMESPACE_TOKEN = f"{CONTROL_ROOT}/namespace"
#: Added once to a heartbeat counter by a rank that leaves cleanly: any negative value means "left".
DEPARTED = -(1 << 40)


def members_digest(members: Sequence[int]) -> str:
    """A member set's name in the store, alike whatever the order given.

    Example::

        >>> members_digest([3, 1]) == members_digest([1, 3])
        True
    """
    return _sorted_members_digest(tuple(sorted(members)))


@functools.lru_cache(maxsize=32)
def _sorted_members_digest(members: tuple[int, ...]) -> str:
    # Cached: a job names the same few member sets over and over, and 16,384 ranks take 4 ms to spell.
    return hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:20]


class _Key:
    """A key named as its attribute: ``holder.name`` is ``holder.base/name``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, holder: Any, owner: Any = None) -> str:
        return self.name if holder is None else f"{holder.base}/{self.name}"


@dataclass(frozen=True)
class Meeting:
    """The keys of one meeting below ``base`` (:mod:`hypergrid.store.meeting`).

    Example::

        >>> Meeting("m").names
        ('m/lines', 'm/count', 'm/complete', 'm/outcome', 'm/roll')
    """

    base: str
    lines = _Key()
    count = _Key()
    complete = _Key()
    outcome = _Key()
    roll = _Key()

    @property
    def names(self) -> tuple[str, ...]:
        """Every key the meeting may write (what a later one deletes)."""
        return (self.lines, self.count, self.complete, self.outcome, self.roll)


@dataclass(frozen=True)
class MemberSetKeys:
    """A member set's keys for group creation: its epoch counter, each member's entry, each epoch's meeting."""

    base: str
    epoch = _Key()

    @classmethod
    def of(cls, members: Sequence[int]) -> MemberSetKeys:
        return cls.named(members_digest(members))

    @classmethod
    def named(cls, digest: str) -> MemberSetKeys:
        return cls(f"{AGREE_ROOT}/{digest}")

    def entry(self, rank: int) -> str:
        return f"{self.base}/entry/{rank}"

    def meeting(self, epoch: int) -> Meeting:
        return Meeting(f"{self.base}/{epoch}")


def last_state_key(rank: int) -> str:
    """Where ``rank``'s last state in group creation lives."""
    return f"{AGREE_ROOT}/last/{rank}"


@dataclass(frozen=True)
class WorldStepKeys:
    """The world steps of one set of participants (empty: the whole world): their epoch counter,
    ``cleaned`` (the first epoch whose keys may remain) and each world step's start and end meetings.
    A world step named by an attempt (a recovery round) has only an end, under that name.

    Example::

        >>> steps = WorldStepKeys.of(())
        >>> steps.epoch, steps.end(3).outcome
        ('hypergrid/agree/world/epoch', 'hypergrid/agree/world/3/end/outcome')
        >>> WorldStepKeys.attempt_end("ns/job/f00d/0/7", "recover").outcome
        'ns/job/f00d/0/7/step/recover/outcome'
    """

    base: str
    epoch = _Key()
    cleaned = _Key()

    @classmethod
    def of(cls, ranks: Sequence[int]) -> WorldStepKeys:
        return cls(f"{AGREE_ROOT}/world" if not ranks else f"{AGREE_ROOT}/world/{members_digest(ranks)}")

    def start(self, epoch: int) -> Meeting:
        return Meeting(f"{self.base}/{epoch}/start")

    def end(self, epoch: int) -> Meeting:
        return Meeting(f"{self.base}/{epoch}/end")

    @staticmethod
    def attempt_end(attempt: str, label: str) -> Meeting:
        return Meeting(f"{attempt}/step/{label}")


def health_meeting(attempt: str) -> Meeting:
    """Where ranks pool which surviving groups still work, in ``attempt`` (a round or :func:`health_attempt`)."""
    return Meeting(f"{attempt}/health")


def health_epoch(participants: Sequence[int]) -> str:
    """The counter of a set of participants' health probes outside a recovery round."""
    return f"{AGREE_ROOT}/health/{members_digest(participants)}/epoch"


def health_attempt(participants: Sequence[int], epoch: int) -> str:
    """The name of a set of participants' health probe number ``epoch`` outside a recovery round."""
    return f"{AGREE_ROOT}/health/{members_digest(participants)}/{epoch}"


def node_beat_key(namespace: str, node: int, gpus_per_node: int) -> str:
    """Where the heartbeat counter of node ``node`` (ranks ``node * gpus_per_node`` on) lives: its
    delegate beats it for all of the node's ranks.

    Example::

        >>> node_beat_key("hypergrid/control/ab12", 3, 8)
        'hypergrid/control/ab12/node/8/3'
    """
    return f"{namespace}/node/{gpus_per_node}/{node}"


@dataclass(frozen=True)
class RoundKeys:
    """One recovery round's keys: its leader and the leader's beat, the key spares block on, its
    verdict, and its arrivals' meeting."""

    base: str
    leader = _Key()
    leader_beat = _Key()
    wake = _Key()
    verdict = _Key()

    @property
    def arrivals(self) -> Meeting:
        return Meeting(f"{self.base}/arrivals")

    def rebuild(self, label: str) -> Meeting:
        """The end of the round's rebuild (a world step named by the round): the round's end."""
        return WorldStepKeys.attempt_end(self.base, label)


@dataclass(frozen=True)
class JobChannel:
    """Where one resilient job's board and rounds live, named by its first ranks (``origin``, a
    digest) and ``instance``; ``state`` holds its one record, ``released`` is set once it lets its
    spares go.

    Example::

        >>> JobChannel.of([1, 0], 2).state == JobChannel.of([0, 1], 2).state
        True
    """

    namespace: str
    origin: str
    instance: int
    state = _Key()
    released = _Key()

    @classmethod
    def of(cls, origin: Sequence[int], instance: int, namespace: str = CONTROL_ROOT) -> JobChannel:
        return cls(namespace, members_digest(sorted(set(origin))), instance)

    @property
    def base(self) -> str:
        return f"{self.namespace}/job/{self.origin}/{self.instance}"

    def round(self, number: int) -> RoundKeys:
        return RoundKeys(f"{self.base}/{number}")

    def board_count(self) -> str:
        """The board's counter: how many entries were published."""
        return f"{self.base}/events"

    def board_slot(self, index: int) -> str:
        """The board's entry number ``index`` (written once)."""
        return f"{self.base}/event/{index}"

    def board_reader(self, group: int) -> str:
        """Where the reader of the board for nodes' group ``group`` says it listens (:mod:`hypergrid.liveness.fanout`)."""
        return f"{self.base}/reader/{group}"


def socket_name(purpose: str, *parts: object) -> bytes:
    """A Linux abstract socket name for ``purpose`` on one host, from a digest of ``parts`` (which
    name the world's control plane, so two jobs never share one).

    Example::

        >>> socket_name("relay", "ns/job/ab/0/events", 3) != socket_name("relay", "ns/job/ab/0/events", 4)
        True
        >>> socket_name("relay", "x").startswith(b"\\0hypergrid-relay-")
        True
    """
    digest = hashlib.sha256("#".join(map(str, parts)).encode()).hexdigest()[:40]
    return f"\0hypergrid-{purpose}-{digest}".encode()
