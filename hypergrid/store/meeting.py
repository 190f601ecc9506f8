"""The one meeting: participants count themselves in, one outcome is decided, and read by all.

Every rendezvous in the store has this shape: participants :func:`arrive`, the first outcome
proposed (:func:`decide`) stands, and each waits for it (:func:`wait_outcome`); where a deadline
ended the meeting, those present name the missing (:func:`roll_call`).

Example, two participants over a ``HashStore``::

    >>> import time
    >>> import torch.distributed as dist
    >>> store, meeting = StoreClient(time.monotonic() + 5, base=dist.HashStore()), Meeting("m")
    >>> arrive(store, meeting, 2, "rank 0"), arrive(store, meeting, 2, "rank 1")
    (Place(number=1, completes=False), Place(number=2, completes=True))
    >>> lines(store, meeting), decide(store, meeting, "ok"), decide(store, meeting, "late")
    (['rank 0', 'rank 1'], b'ok', b'ok')
    >>> wait_outcome(store, meeting, 1.0)
    b'ok'
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from .client import StoreClient
from .keys import Meeting

__all__ = ["Place", "Hearing", "arrive", "arrive_together", "decide", "wait_outcome", "lines", "roll_call", "forget"]

#: How long past its deadline a participant waits for the others present to answer the roll call.
ROLL_CALL_S = 2.0
_ROLL_POLL_S = 0.05


class Hearing(Protocol):
    """The outcomes of a job's meetings as its board carries them (:class:`~hypergrid.liveness.board.BoardView`)."""

    def heard(self, key: str, seconds: float) -> Optional[bytes]:
        """The outcome decided at ``key``, once heard, waiting at most ``seconds`` (None: not yet)."""


@dataclass(frozen=True)
class Place:
    """Where an arrival landed: the count just after it, and whether it completes the meeting."""

    number: int
    completes: bool


def arrive(store: StoreClient, meeting: Meeting, size: int, line: Optional[str] = None, *,
           awaited: bool = False) -> Place:
    """Count this participant in among ``size``, ``line`` appended first (the lines never lag the
    count). ``awaited``: someone blocks on the ``complete`` key, which the last arrival sets."""
    return arrive_together(store, meeting, size, [line], awaited=awaited)[0]


def arrive_together(store: StoreClient, meeting: Meeting, size: int, lines: Sequence[Optional[str]], *,
                    awaited: bool = False) -> list[Place]:
    """Count in ``len(lines)`` participants among ``size`` at once (a node's, by its delegate), their
    lines (None: none) appended first in one request: their places, in order, as if each had arrived
    in turn. ``store``: a ``StoreClient``, or any store with its ``append``, ``add`` and ``set``.

        >>> import time
        >>> import torch.distributed as dist
        >>> store = StoreClient(time.monotonic() + 5, base=dist.HashStore())
        >>> arrive_together(store, Meeting("m"), 3, ["a", None]), arrive(store, Meeting("m"), 3, "c")
        ([Place(number=1, completes=False), Place(number=2, completes=False)], Place(number=3, completes=True))
        >>> lines(store, Meeting("m"))
        ['a', 'c']
    """
    text = "".join(line + "\n" for line in lines if line is not None)
    if text:
        store.append(meeting.lines, text.encode())
    last = int(store.add(meeting.count, len(lines)))
    places = [Place(number, number == size) for number in range(last - len(lines) + 1, last + 1)]
    if awaited and any(place.completes for place in places):
        store.set(meeting.complete, b"")
    return places


def decide(store: StoreClient, meeting: Meeting, proposal: Union[str, bytes]) -> bytes:
    """Propose ``proposal`` as the meeting's outcome; the outcome that stands (the first proposed)."""
    return bytes(store.compare_set(meeting.outcome, "", proposal))


def wait_outcome(store: StoreClient, meeting: Meeting, seconds: float, hearing: Optional[Hearing] = None,
                 fallback_s: float = 10.0) -> Optional[bytes]:
    """The meeting's outcome once decided, waiting at most ``seconds`` and never past the store's
    deadline (None: not by then). With ``hearing``, the store is looked at every ``fallback_s`` of
    silence too, in case the decider ended before telling."""
    end = time.monotonic() + max(0.0, min(seconds, store.remaining()))
    if hearing is None:
        return store.get_within(meeting.outcome, max(0.0, end - time.monotonic()))
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return None
        value = hearing.heard(meeting.outcome, min(left, fallback_s))
        if value is not None:
            return value
        if time.monotonic() < end and store.check([meeting.outcome]):
            return store.get(meeting.outcome)


def lines(store: StoreClient, meeting: Meeting) -> list[str]:
    """The lines the participants that arrived brought, in the order they arrived."""
    if not store.check([meeting.lines]):
        return []
    return [line for line in store.get(meeting.lines).decode().split("\n") if line]


def roll_call(store: StoreClient, meeting: Meeting, rank: int, participants: Sequence[int]) -> list[int]:
    """The participants missing from ``meeting``, which a deadline ended: each one present names
    itself on the roll and reads it until it holds every name counted, for :data:`ROLL_CALL_S` at most."""
    store.extend(ROLL_CALL_S)
    store.append(meeting.roll, f"{rank},")
    counted = int(store.add(meeting.count, 0))
    while True:
        named = {int(r) for r in store.get(meeting.roll).decode().split(",") if r}
        if len(named) >= counted or store.remaining() <= 0:
            return [r for r in participants if r not in named]
        time.sleep(_ROLL_POLL_S)


def forget(store: StoreClient, meeting: Meeting, keep_outcome: bool = False) -> None:
    """Delete the meeting's keys (every participant is past it), its outcome too unless ``keep_outcome``."""
    for key in meeting.names:
        if not (keep_outcome and key == meeting.outcome):
            store.delete_key(key)
