"""Every key of the recovery's control plane, named in one place.

The control plane lives in the job's root store (under torch's ``PrefixStore`` layers, where the
monitor processes reach it by address) below one *namespace* per world, which the world's ranks
agree on when they first need it (:mod:`hypergrid.control.plane`). Below it:

``beat/<rank>``
    the rank's heartbeat counter: its monitor adds 1 every interval; a large negative number
    added once means the rank left cleanly (:data:`DEPARTED`).
``job/<origin>/<instance>/...``
    one resilient job (:class:`JobChannel`): its board of events (:meth:`JobChannel.event`), its
    recovery rounds and its committed record.

Example::

    >>> channel = JobChannel("hypergrid/control/ab12", "f00d", 0)
    >>> channel.events(), channel.event(3), channel.key(2, "verdict")
    ('hypergrid/control/ab12/job/f00d/0/events', 'hypergrid/control/ab12/job/f00d/0/event/3', \
'hypergrid/control/ab12/job/f00d/0/2/verdict')
    >>> beat_key("hypergrid/control/ab12", 7)
    'hypergrid/control/ab12/beat/7'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..runtime.wire import members_digest

__all__ = ["ROOT", "DEPARTED", "beat_key", "JobChannel", "BoardWriter", "put_entry"]

#: The control plane's keys start with this, then the world's namespace token.
ROOT = "hypergrid/control"
#: Added once to a heartbeat counter by a rank that leaves cleanly: any negative value means "left".
DEPARTED = -(1 << 40)


def beat_key(namespace: str, rank: int) -> str:
    """Where ``rank``'s heartbeat counter lives."""
    return f"{namespace}/beat/{rank}"


@dataclass(frozen=True)
class JobChannel:
    """Where one job's board and rounds live: the world's ``namespace``, the job's first ranks (a
    digest, ``origin``) and its ``instance``, which all of its ranks read together when it is made.

    Example::

        >>> JobChannel.of([1, 0], 2).key("round") == JobChannel.of([0, 1], 2).key("round")
        True
    """

    namespace: str
    origin: str
    instance: int

    @classmethod
    def of(cls, origin: Sequence[int], instance: int, namespace: str = ROOT) -> JobChannel:
        return cls(namespace, members_digest(sorted(set(origin))), instance)

    @property
    def base(self) -> str:
        return f"{self.namespace}/job/{self.origin}/{self.instance}"

    def key(self, *parts: object) -> str:
        """A key of the job's rounds: ``key("round")``, ``key(n, "verdict")``."""
        return "/".join([self.base, *map(str, parts)])

    def events(self) -> str:
        """The board's counter: how many entries were published (``add``; an entry holds one
        event, or the losses one watcher found at one look)."""
        return f"{self.base}/events"

    def event(self, index: int) -> str:
        """The board's entry number ``index`` (set once by its publisher)."""
        return f"{self.base}/event/{index}"


class BoardWriter(Protocol):
    """What :func:`put_entry` needs of a store: a monitor's :class:`~hypergrid.control.tcpstore.WireStore`,
    or a rank's :class:`~hypergrid.runtime.store.StoreClient`."""

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...

    def set(self, key: str, value: bytes) -> None: ...

    def add(self, key: str, amount: int) -> int: ...


def put_entry(store: BoardWriter, channel: JobChannel, payload: bytes, first: int) -> int:
    """Put ``payload`` on ``channel``'s board in the first free slot from ``first``; its index.

    Each ``compare_set`` either fills a slot or finds it taken, so a publisher that ends between
    its requests leaves no empty slot below a filled one, on which every wait on the board would
    block. The entry is written again with ``set`` (torch's classic server wakes no waiter on a
    ``compare_set``), as is a slot found taken (one whose publisher ended between the two is then
    not waited on for ever either), and only then counted: three requests, two more for each slot
    found taken.

    Example::

        >>> class Store(dict):
        ...     def compare_set(self, key, expected, desired):
        ...         return self.setdefault(key, desired)
        ...     def set(self, key, value): self[key] = value
        ...     def add(self, key, amount): self[key] = self.get(key, 0) + amount; return self[key]
        >>> store, channel = Store(), JobChannel("ns", "f00d", 0)
        >>> put_entry(store, channel, b"a", 0), put_entry(store, channel, b"b", 0), store[channel.events()]
        (0, 1, 2)
    """
    index = first
    while (held := store.compare_set(channel.event(index), b"", payload)) != payload:
        store.set(channel.event(index), held)
        index += 1
    store.set(channel.event(index), payload)
    store.add(channel.events(), 1)
    return index
