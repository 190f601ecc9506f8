"""What a world step costs the store while its participants wait, and what ends the wait early.

Inside a recovery, each rank's heartbeat forwards the job's board to the rank's view of it
(:meth:`hypergrid.liveness.board.BoardView.hear_from`), and a world step's waits then block once:
a participant lost before it got there is heard, and the outcome is decided to say so, which ends
every participant's wait alike; a step named by its recovery's round is heard from the board as
well, at no request of the participants. The participants are simulated by threads of this process
over one ``HashStore`` (a one-rank gloo world; each thread is a rank of its own, as
``dist.get_rank`` tells it), each through :func:`~hypergrid.runtime.world_step.world_start` and
:func:`~hypergrid.runtime.world_step.world_checkpoint` as a rank's rebuild takes them, with its
store wrapped to count its requests. The heartbeat is a stand-in that hands every view what a
monitor would forward, the outcomes decided included.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch.distributed as dist

from hypergrid.store import meeting
from hypergrid.store.client import StoreClient
from hypergrid.store.keys import Meeting
from tests.test_agreement_waits import _Counted

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0
LATE_S = 6.0


class _Heartbeat:
    """Forwards to its listeners what the test says the board published."""

    def __init__(self) -> None:
        self.listeners: dict[str, Callable[[Any], None]] = {}

    def listen(self, name: str, callback: Callable[[Any], None], replay: bool = False) -> None:
        self.listeners[name] = callback

    def forward(self, event: Any) -> None:
        for callback in self.listeners.values():
            callback(event)


class _Scope:
    """A participant's recovery scope: its view of the board, whose publications (made in the store,
    as a rank does) the stand-in heartbeats forward to every participant."""

    def __init__(self, view: Any, step: _Step) -> None:
        self.view, self.step = view, step

    @property
    def hearing(self) -> bool:
        return self.view.hearing

    fallback_s = 10.0

    def lost_among(self, ranks: Any) -> list[int]:
        return self.view.lost_among(ranks)

    def on_loss(self, ranks: Any, callback: Any) -> Any:
        return self.view.on_loss(ranks, callback)

    def heard(self, key: str, seconds: float) -> Optional[bytes]:
        return self.view.heard(key, seconds)

    def publish(self, key: str, value: bytes) -> None:
        from hypergrid.store.records import BoardEvent, EventKind

        self.view.publish(key, value)
        for beat in self.step.beats.values():
            beat.forward(BoardEvent(EventKind.DECIDED, -1, key=key, value=value.decode()))

    def arrive(self, store: StoreClient, at: Meeting, size: int) -> meeting.Place:
        return meeting.arrive(store, at, size)

    def succeeded(self, key: str) -> None:
        self.step.succeeded.append(key)


class _Step:
    """``size`` simulated participants of one world step (ranks 0 ...), each hearing the board."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, size: int, hearing: bool = True,
                 attempt: Optional[str] = None, timeouts: Optional[dict[int, float]] = None) -> None:
        import hypergrid.runtime.environment as store_module
        from hypergrid.liveness.board import BoardView
        from hypergrid.store.client import StoreClient
        from hypergrid.store.keys import JobChannel

        self.members = tuple(range(size))
        self.attempt = attempt  # the step is named by the recovery's round: no start, its outcome heard
        self.timeouts = timeouts or {}  # a participant's own timeout, where not TIMEOUT_S
        self.counts = {r: {"requests": 0, "keys": 0} for r in self.members}
        self.alarms = {"requests": 0, "keys": 0}  # what the heartbeat's thread asked, for all ranks
        self.outcomes: dict[int, tuple[str, str, float]] = {}
        self.succeeded: list[str] = []
        self.label = f"recover-{uuid.uuid4()}"
        self._local = threading.local()
        self._stores: dict[Any, _Counted] = {}
        self.real = store_module.default_store()
        self.beats = {r: _Heartbeat() for r in self.members}
        channel = JobChannel(f"test-{uuid.uuid4()}", "job", 0)
        self.views = {r: BoardView(channel, lambda: StoreClient(time.monotonic() + 5.0, base=self._store()))
                      for r in self.members}
        if hearing:
            for rank, view in self.views.items():
                view.hear_from(self.beats[rank])
        monkeypatch.setattr(store_module, "default_store", self._store)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: getattr(self._local, "rank", 0))

    def _store(self) -> Any:
        rank = getattr(self._local, "rank", None)
        if rank not in self._stores:
            self._stores[rank] = _Counted(self.real, self.counts[rank] if rank is not None else self.alarms)
        return self._stores[rank]

    def take_part(self, rank: int, delay_s: float = 0.0, end: bool = True) -> threading.Thread:
        thread = threading.Thread(target=self._participant, args=(rank, delay_s, end), daemon=True)
        thread.start()
        return thread

    def _participant(self, rank: int, delay_s: float, end: bool) -> None:
        from hypergrid.runtime.scope import watching
        from hypergrid.runtime.world_step import world_checkpoint, world_start

        self._local.rank = rank
        time.sleep(delay_s)
        started = time.monotonic()
        seconds = self.timeouts.get(rank, TIMEOUT_S)
        timeout = timedelta(seconds=seconds)
        try:
            with watching(_Scope(self.views[rank], self), started + seconds):
                step = world_start(self.label, timeout=timeout, ranks=self.members, attempt=self.attempt)
                if end:
                    world_checkpoint(step, None, timeout=timeout)
            self.outcomes[rank] = ("ok", "", time.monotonic() - started)
        except Exception as exc:  # reported to the test
            self.outcomes[rank] = (type(exc).__name__, str(exc), time.monotonic() - started)

    def lose(self, rank: int) -> None:
        """The board says ``rank`` was lost: every other participant's heartbeat forwards it."""
        from hypergrid.store.records import BoardEvent, EventKind

        event = BoardEvent(EventKind.LOST, rank, "its process ended", by=rank)
        for other, beat in self.beats.items():
            if other != rank:
                beat.forward(event)


def _every_other_wait_ended_naming(step: _Step, lost: int) -> None:
    """Every participant but ``lost`` ended its wait with the error naming ``lost``."""
    for rank in step.members:
        if rank != lost:
            kind, message, _ = step.outcomes[rank]
            assert kind == "GroupTimeoutError", (rank, step.outcomes[rank])
            assert f"ranks [{lost}] were lost (the job's board says so) while the others waited" in message, (rank,
                                                                                                      message)


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [4, 64])
def test_a_step_s_waits_cost_each_participant_the_same_few_requests_however_long_and_at_any_size(
        world, monkeypatch, size):
    # The last participant comes 6 s late; the others block once at the start meanwhile. Sliced
    # waits with a look at the board each cost 3 requests a slice: some 36 over those 6 s.
    step = _Step(monkeypatch, size)
    late = size - 1
    threads = [step.take_part(r) for r in step.members if r != late] + [step.take_part(late, LATE_S)]
    for thread in threads:
        thread.join(TIMEOUT_S + 15)
    assert {r: o[0] for r, o in step.outcomes.items()} == {r: "ok" for r in step.members}, step.outcomes
    for rank in step.members:
        waited = step.outcomes[rank][2]
        if rank != late:
            assert waited >= LATE_S - 0.5, (rank, waited)
        # The start: its epoch, its count, one blocking get; the end: its count, one blocking get
        # (no list of names: only a step that timed out calls the roll). The last to start (the
        # late one) sets the start's key; the last to end, whoever it is (the late one too, on a
        # loaded machine), ends the epoch, sets the end's key and cleans up: 4 more at most.
        assert step.counts[rank]["requests"] <= 10, (rank, step.counts[rank])
    above = [r for r in step.members if step.counts[r]["requests"] > 5]
    assert len(above) <= 2, {r: step.counts[r] for r in above}
    assert step.alarms["requests"] == 0


def test_a_participant_heard_lost_before_it_started_ends_every_participant_s_wait_naming_it(world, monkeypatch):
    step = _Step(monkeypatch, 6)
    lost = 4
    threads = [step.take_part(r) for r in step.members if r != lost]
    time.sleep(1.0)
    began = time.monotonic()
    step.lose(lost)
    for thread in threads:
        thread.join(TIMEOUT_S + 15)
    took = time.monotonic() - began
    _every_other_wait_ended_naming(step, lost)
    assert took < TIMEOUT_S / 2, took  # at the loss, not at the 30 s timeout (measured: under 1 s)
    # Each hearing participant's heartbeat tried to set the key once; the first one did.
    assert step.alarms["requests"] <= len(step.members) - 1, step.alarms


def test_a_participant_lost_after_the_start_ends_the_wait_at_the_end(world, monkeypatch):
    # Every participant started; one is lost before the end. The start, which every participant
    # passed, stands: the end's wait is the one the loss ends.
    step = _Step(monkeypatch, 4)
    lost = 3
    lost_thread = step.take_part(lost, end=False)
    threads = [step.take_part(r) for r in step.members if r != lost]
    lost_thread.join(TIMEOUT_S)
    assert step.outcomes[lost][0] == "ok", step.outcomes[lost]
    time.sleep(1.0)  # the others are in the end's wait by now
    step.lose(lost)
    for thread in threads:
        thread.join(TIMEOUT_S + 15)
    _every_other_wait_ended_naming(step, lost)


@pytest.mark.parametrize("attempt", [None, "ns/job/f00d/0/5"])
def test_a_participant_lost_after_it_ended_the_step_still_ends_the_others_wait(world, monkeypatch, attempt):
    # Rank 1 ends the step and is lost while rank 3 is still at it: the groups the step made hold a
    # lost rank, so the others learn it now, alike, rather than from their first collective.
    step = _Step(monkeypatch, 4, attempt=attempt)
    threads = [step.take_part(r) for r in (0, 1, 2)]
    time.sleep(1.0)
    step.lose(1)
    late = step.take_part(3, 1.0)
    for thread in threads + [late]:
        thread.join(TIMEOUT_S + 15)
    for rank in (0, 2, 3):
        kind, message, seconds = step.outcomes[rank]
        assert kind == "GroupTimeoutError" and "ranks [1] were lost" in message, (rank, step.outcomes[rank])
        assert seconds < TIMEOUT_S / 2, (rank, seconds)  # now, not at the 30 s timeout


@pytest.mark.parametrize("attempt", [None, "ns/job/f00d/0/6"])
def test_the_first_timeout_ends_the_step_for_every_participant_naming_who_did_not_come(world, monkeypatch, attempt):
    # Rank 5 never comes and nobody hears it lost (it hangs). Rank 0 gives up first, after 3 s;
    # the others, with 30 s, learn it from the step's key at once, and every one names rank 5
    # alone: the step's outcome is one, not each rank's own timeout at its own time.
    step = _Step(monkeypatch, 6, attempt=attempt, timeouts={0: 3.0})
    threads = [step.take_part(r) for r in range(5)]
    for thread in threads:
        thread.join(TIMEOUT_S + 15)
    for rank in range(5):
        kind, message, seconds = step.outcomes[rank]
        assert kind == "GroupTimeoutError", (rank, step.outcomes[rank])
        assert "ranks [5] did not" in message, (rank, message)
        assert seconds < TIMEOUT_S / 2, (rank, seconds)  # rank 0's 3 s timeout and the roll call, not 30 s


def test_without_a_heartbeat_the_waits_look_at_the_board_once_a_slice(world, monkeypatch):
    from hypergrid.store.records import BoardEvent, EventKind

    step = _Step(monkeypatch, 4, hearing=False)
    lost = 2
    threads = [step.take_part(r) for r in step.members if r != lost]
    time.sleep(1.0)
    step.views[0].publish_event(BoardEvent(EventKind.LOST, lost, "its process ended", by=lost))
    for thread in threads:
        thread.join(TIMEOUT_S + 15)
    _every_other_wait_ended_naming(step, lost)
    assert all(step.outcomes[r][2] < 5.0 for r in step.members if r != lost), step.outcomes


@pytest.mark.parametrize("size", [8, 64])
def test_a_step_named_by_its_recovery_round_has_no_start_and_its_outcome_is_heard(world, monkeypatch, size):
    # A recovery's participants share its round's name: the step starts at once, and only its end
    # meets (the last participant 6 s late). Each participant counts itself in (one request) and
    # hears the outcome from the board; the last one decides it, publishes it (a board entry:
    # three requests and the count's read) and makes the round's commit, once.
    step = _Step(monkeypatch, size, attempt=f"ns/job/{uuid.uuid4()}/0/3")
    late = step.members[-1]
    threads = [step.take_part(r) for r in step.members[:-1]] + [step.take_part(late, LATE_S)]
    for thread in threads:
        thread.join(TIMEOUT_S + 15)
    assert {r: o[0] for r, o in step.outcomes.items()} == {r: "ok" for r in step.members}, step.outcomes
    for rank in step.members:
        assert step.counts[rank]["requests"] <= (8 if rank == late else 1), (rank, step.counts[rank])
    from hypergrid.runtime.world_step import WorldStep

    assert step.succeeded == [WorldStep(step.label, 0, step.members, attempt=step.attempt).end.outcome]


def test_a_participant_of_an_attempt_s_step_that_never_comes_ends_the_others_wait_when_heard_lost(world, monkeypatch):
    step = _Step(monkeypatch, 5, attempt="ns/job/f00d/0/9")
    lost = 0
    threads = [step.take_part(r) for r in step.members if r != lost]
    time.sleep(1.0)
    began = time.monotonic()
    step.lose(lost)
    for thread in threads:
        thread.join(TIMEOUT_S + 15)
    assert time.monotonic() - began < TIMEOUT_S / 2  # at the loss, not at the 30 s timeout
    _every_other_wait_ended_naming(step, lost)


@pytest.mark.parametrize("hearing", [True, False], ids=["heard", "looked-up"])
def test_a_loss_while_an_attempt_s_participants_wait_ends_every_participant_s_wait(world, monkeypatch, hearing):
    # Heard: each participant's heartbeat forwards the loss and the first decides the outcome, which
    # the board carries to the others. Looked up (no heartbeat): each looks at the board once a slice.
    from hypergrid.store.records import BoardEvent, EventKind

    step = _Step(monkeypatch, 16, attempt=f"ns/job/{uuid.uuid4()}/0/2", hearing=hearing)
    lost = 3
    threads = [step.take_part(r) for r in step.members if r != lost]
    time.sleep(1.0)
    began = time.monotonic()
    if hearing:
        step.lose(lost)
    else:
        step.views[0].publish_event(BoardEvent(EventKind.LOST, lost, "its process ended", by=lost))
    for thread in threads:
        thread.join(TIMEOUT_S + 15)
    assert time.monotonic() - began < TIMEOUT_S / 2
    _every_other_wait_ended_naming(step, lost)
    assert step.succeeded == []
