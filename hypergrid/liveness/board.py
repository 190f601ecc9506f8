"""A job's board: where every loss, recovery round opened and outcome decided is published once.

The board is a run of slots in the job's store (``event/<k>`` holds entry ``k``, ``events`` counts
them). A publisher fills the first free slot with ``compare_set`` (:func:`put_entry`), so no slot
is left empty below a filled one, which would block every wait on the board; an entry costs its
publisher three requests and each node two, whatever the job's size. :class:`BoardView` is the
board as a rank's recovery reads it, or hears it from its heartbeat. No torch: monitors use it too.

Example, over a ``HashStore``::

    >>> import time
    >>> import torch.distributed as dist
    >>> from hypergrid.store.client import StoreClient
    >>> from hypergrid.store.records import BoardEvent, EventKind
    >>> base, channel = dist.HashStore(), JobChannel.of([0, 1, 2], 0)
    >>> view = BoardView(channel, lambda: StoreClient(time.monotonic() + 5, base=base))
    >>> view.lost_among([1, 2])
    []
    >>> view.publish_event(BoardEvent(EventKind.LOST, 2, "its process ended", by=2))
    >>> view.lost_among([1, 2]), view.lost
    ([2], {2: 'its process ended'})
    >>> view.publish_event(BoardEvent(EventKind.BACK, 2, by=2)); view.lost_among([1, 2])
    []
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, Optional, Protocol, Union

from ..errors import StoreUnresponsiveError
from ..store.keys import JobChannel
from ..store.records import BoardEvent, EventKind, decode_events, encode_events

__all__ = ["BoardView", "BoardWriter", "claim_slot", "put_entry", "note_losses"]

#: How many decided outcomes a view remembers (a recovery waits on a few at a time).
_OUTCOMES_KEPT = 64


class BoardWriter(Protocol):
    """What :func:`put_entry` needs of a store: a monitor's ``WireStore`` or a rank's ``StoreClient``."""

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...

    def set(self, key: str, value: bytes) -> None: ...

    def add(self, key: str, amount: int) -> int: ...


def put_entry(store: BoardWriter, channel: JobChannel, payload: bytes, first: int) -> int:
    """Put ``payload`` on ``channel``'s board in the first free slot from ``first``, then count it; its index.

    Each slot is written again with ``set``, a slot found taken too: torch's classic server wakes
    no waiter on a ``compare_set``.

    Example::

        >>> class Store(dict):
        ...     def compare_set(self, key, expected, desired):
        ...         return self.setdefault(key, desired)
        ...     def set(self, key, value): self[key] = value
        ...     def add(self, key, amount): self[key] = self.get(key, 0) + amount; return self[key]
        >>> store, channel = Store(), JobChannel("ns", "f00d", 0)
        >>> put_entry(store, channel, b"a", 0), put_entry(store, channel, b"b", 0), store[channel.board_count()]
        (0, 1, 2)
    """
    index = first
    while (held := store.compare_set(channel.board_slot(index), b"", payload)) != payload:
        # Its publisher may have ended between its compare_set and its set: wake its waiters.
        store.set(channel.board_slot(index), held)
        index += 1
    store.set(channel.board_slot(index), payload)
    store.add(channel.board_count(), 1)
    return index


def claim_slot(store: BoardWriter, channel: JobChannel, events: Sequence[BoardEvent], first: int) -> Optional[int]:
    """Put ``events`` on ``channel``'s board as :func:`put_entry` does, less the losses the slots found
    taken already hold; its index, or None where nothing was left. Not counted: the caller adds 1
    to the count (a claim tried again finds its own entry and returns its slot).

    Example::

        >>> class Store(dict):
        ...     def compare_set(self, key, expected, desired):
        ...         return self.setdefault(key, desired)
        ...     def set(self, key, value): self[key] = value
        >>> store, channel = Store(), JobChannel("ns", "f00d", 0)
        >>> def lost(*ranks, by): return [BoardEvent(EventKind.LOST, r, "stale", by=by) for r in ranks]
        >>> claim_slot(store, channel, lost(8, by=0), 0), claim_slot(store, channel, lost(8, 9, by=1), 0)
        (0, 1)
        >>> [e.rank for e in decode_events(store[channel.board_slot(1)])], claim_slot(store, channel, lost(8, 9, by=2), 0)
        ([9], None)
    """
    on_board: dict[int, str] = {}
    left = list(events)
    index = first
    while True:
        payload = encode_events(left).encode()
        held = store.compare_set(channel.board_slot(index), b"", payload)
        if held == payload:
            break
        store.set(channel.board_slot(index), held)  # wake its waiters, as above
        note_losses(on_board, decode_events(held))
        left = [e for e in left if not (e.kind is EventKind.LOST and e.rank in on_board)]
        if not left:
            return None
        index += 1
    store.set(channel.board_slot(index), payload)
    return index


def note_losses(lost: dict[int, str], events: Iterable[BoardEvent]) -> None:
    """Mark in ``lost`` the ranks ``events`` lose, with why, and unmark those a BACK brings back.

    Example::

        >>> lost = {3: "its process ended"}
        >>> note_losses(lost, [BoardEvent(EventKind.LOST, 5, "stale"), BoardEvent(EventKind.BACK, 3)]); lost
        {5: 'stale'}
    """
    for event in events:
        if event.kind is EventKind.LOST:
            lost[event.rank] = event.reason
        elif event.kind is EventKind.BACK:
            lost.pop(event.rank, None)


class BoardView:
    """The ranks lost on ``channel``'s board from entry ``first`` on, with why (a BACK undoes a loss),
    read or heard, and the outcomes heard; ``seen``: the next entry it reads. ``store()`` gives a
    client of the job's root store bounded by a short deadline."""

    def __init__(self, channel: JobChannel, store: Callable[[], Any], first: int = 0) -> None:
        self.channel = channel
        self._store = store
        self.seen = first
        self.lost: dict[int, str] = {}
        #: The ranks heard lost since :meth:`hear_from`, less those heard back since.
        self.heard_lost: set[int] = set()
        self._outcomes: OrderedDict[str, bytes] = OrderedDict()
        self._leaders: dict[int, int] = {}
        self._hearing = False
        self._alarms: list[tuple[frozenset[int], Callable[[list[int]], None]]] = []
        self._changed = threading.Condition()

    # ------------------------------------------------------------------ what the heartbeat hands it
    @property
    def hearing(self) -> bool:
        """Whether the board's events reach this view as they are published (:meth:`hear_from`)."""
        return self._hearing

    def hear_from(self, source: Any, name: str = "recovery's board") -> None:
        """Hear every event the rank's heartbeat ``source`` hands its listeners, the recent ones first."""
        source.listen(name, self.hear, replay=True)
        self._hearing = True

    def hear(self, event: BoardEvent) -> None:
        """Take one event of the board as it was published (called on the heartbeat's thread)."""
        alarms: list[Callable[[list[int]], None]] = []
        with self._changed:
            if event.kind is EventKind.BACK:
                self.heard_lost.discard(event.rank)
                self.lost.pop(event.rank, None)
            elif event.kind is EventKind.ROUND and event.value:
                self._leaders[event.number] = int(event.value)
            elif event.kind is EventKind.DECIDED:
                self._outcomes[event.key] = event.value.encode()
                while len(self._outcomes) > _OUTCOMES_KEPT:
                    self._outcomes.popitem(last=False)
            elif event.kind is EventKind.LOST and event.rank not in self.heard_lost:
                self.heard_lost.add(event.rank)
                self.lost.setdefault(event.rank, event.reason)
                alarms = [callback for ranks, callback in self._alarms if event.rank in ranks]
            self._changed.notify_all()
        for callback in alarms:
            callback([event.rank])

    def known_lost(self) -> set[int]:
        """The ranks this view holds lost without asking the store."""
        with self._changed:
            return set(self.lost) | self.heard_lost

    def round_leader(self, number: int) -> Optional[int]:
        """The leader of recovery round ``number`` as its opening said (None: not heard)."""
        with self._changed:
            return self._leaders.get(number)

    def heard(self, key: str, seconds: float) -> Optional[bytes]:
        """The outcome decided at ``key`` once heard, waiting at most ``seconds`` (None: not yet)."""
        return self.wait_heard(key, seconds, ())[0]

    def wait_heard(self, key: str, seconds: float, lost_any: Collection[int]) -> tuple[Optional[bytes], list[int]]:
        """Wait at most ``seconds`` for the outcome at ``key`` or a loss among ``lost_any``:
        ``(outcome or None, ranks heard lost)``."""
        end, watched = time.monotonic() + seconds, set(lost_any)
        with self._changed:
            while True:
                lost = sorted(watched & self.heard_lost)
                if key in self._outcomes or lost:
                    return self._outcomes.get(key), lost
                left = end - time.monotonic()
                if left <= 0:
                    return None, []
                self._changed.wait(left)

    @contextlib.contextmanager
    def on_loss(self, ranks: Collection[int], callback: Callable[[list[int]], None]) -> Iterator[None]:
        """While the block runs, call ``callback`` with those of ``ranks`` heard lost: at once with
        any heard already, then (on the heartbeat's thread) with each one heard.

        Example::

            >>> view = BoardView(JobChannel("ns", "f00d", 0), store=lambda: None)
            >>> view.hear(BoardEvent(EventKind.LOST, 5, "its process ended"))
            >>> heard = []
            >>> with view.on_loss([4, 5, 6], heard.append):
            ...     view.hear(BoardEvent(EventKind.LOST, 6, "its heartbeat stopped"))
            ...     view.hear(BoardEvent(EventKind.LOST, 9, "its heartbeat stopped"))
            >>> view.hear(BoardEvent(EventKind.LOST, 4, "its process ended")); heard
            [[5], [6]]
        """
        members = frozenset(ranks)
        entry = (members, callback)
        with self._changed:
            self._alarms.append(entry)
            already = sorted(self.heard_lost & members)
        try:
            if already:
                callback(already)
            yield
        finally:
            with self._changed:
                self._alarms.remove(entry)

    # ------------------------------------------------------------------ what it reads and writes
    def refresh(self, store: Optional[Any] = None) -> dict[int, str]:
        """Read what was published since the last look: one request when nothing was (whether the
        next slot is filled; the count lags a publisher that ended between its slot and its count)."""
        store = store or self._store()
        while store.check([self.channel.board_slot(self.seen)]):
            note_losses(self.lost, decode_events(store.get(self.channel.board_slot(self.seen))))
            self.seen += 1
        return self.lost

    def lost_among(self, ranks: Collection[int]) -> list[int]:
        """Those of ``ranks`` lost on the board (one look; none where the store does not answer)."""
        try:
            lost = self.refresh()
        except (RuntimeError, StoreUnresponsiveError):
            return []
        return sorted(r for r in lost if r in ranks)

    def publish_event(self, event: BoardEvent, store: Optional[Any] = None) -> None:
        """Put ``event`` on the board (:func:`put_entry`) from the count: four store requests."""
        store = store or self._store()
        put_entry(store, self.channel, encode_events([event]).encode(), store.add(self.channel.board_count(), 0))

    def publish(self, key: str, value: Union[bytes, str], rank: int = -1) -> None:
        """Tell every rank of the job that the outcome at ``key`` is ``value`` (it heard it too)."""
        text = value.decode() if isinstance(value, bytes) else value
        self.publish_event(BoardEvent(EventKind.DECIDED, rank, key=key, value=text, by=rank))

