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

from ..runtime.wire import members_digest

__all__ = ["ROOT", "DEPARTED", "beat_key", "JobChannel"]

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
