"""A rank's monitor as a process of its own: it sees its rank's end from outside, tells a paused
interpreter from a dead one, and refuses clearly to start where it cannot work.

Each scenario runs ``tests/control_rank.py`` (a whole process with its monitor, serving the job
``[0, 1]``) against a store this test hosts, and reads the job's board as every other rank would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import pytest
import torch.distributed as dist

from hypergrid.liveness.heartbeat import Heartbeat, start_heartbeat
from hypergrid.liveness.plane import ControlPlane
from hypergrid.store.keys import JobChannel, node_beat_key
from hypergrid.store.records import BoardEvent, decode_events

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _board(store: dist.TCPStore, namespace: str) -> list[BoardEvent]:
    channel = JobChannel.of([0, 1], 0, namespace)
    count = store.add(channel.board_count(), 0)
    return [event for i in range(count) for event in decode_events(store.get(channel.board_slot(i)))]


def _run(scenario: str, *args: str, settle_s: float = 1.5) -> tuple[dist.TCPStore, str, int, subprocess.Popen,
                                                                    Optional[float]]:
    """Run the rank through ``scenario``; (store, namespace, monitor pid, process, when it ended). A
    monitor the rank paused is let run once the rank has ended."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    proc = subprocess.Popen([sys.executable, "-m", "tests.control_rank", "--store", f"127.0.0.1:{store.port}",
                             "--scenario", scenario, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    assert proc.stdout is not None
    namespace, monitor = proc.stdout.readline().split()
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    if scenario == "unread":
        os.kill(int(monitor), signal.SIGCONT)
    time.sleep(settle_s)
    return store, namespace, int(monitor), proc, ended


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


pytestmark = pytest.mark.slow


def test_a_rank_killed_is_published_by_its_monitor_which_then_leaves():
    store, namespace, monitor, proc, _ = _run("kill")
    assert proc.returncode == -9
    events = _board(store, namespace)
    assert [(e.kind.value, e.rank, e.reason, e.by) for e in events] == [("lost", 0, "its process ended", 0)]
    assert store.add(node_beat_key(namespace, 0, 1), 0) < 0  # marked as left: its watcher reports nothing more
    assert _gone(monitor)


def test_a_rank_killed_just_after_it_attached_a_job_is_that_job_s_loss():
    # The monitor, paused, finds the job's line and the rank's end in one look: it takes the line in
    # first, so the end is published on the job's board (not taken for the end of a rank with no job).
    store, namespace, monitor, proc, _ = _run("unread")
    assert proc.returncode == -9
    events = _board(store, namespace)
    assert [(e.kind.value, e.rank, e.reason, e.by) for e in events] == [("lost", 0, "its process ended", 0)]
    assert _gone(monitor)


def test_a_rank_that_releases_its_job_leaves_cleanly_nobody_s_loss():
    store, namespace, monitor, proc, _ = _run("bye")
    assert proc.returncode == 0
    assert _board(store, namespace) == []
    assert store.add(node_beat_key(namespace, 0, 1), 0) < 0 and _gone(monitor)


def test_a_rank_exiting_while_its_job_counts_on_it_is_published():
    store, namespace, monitor, proc, _ = _run("exit")
    assert proc.returncode == 3
    events = _board(store, namespace)
    assert len(events) == 1 and events[0].rank == 0 and "exiting while the job runs" in events[0].reason
    assert _gone(monitor)


def test_a_rank_holding_the_gil_beats_on_and_is_not_taken_for_lost():
    # 4 s in one C call, against a progress timeout of 10 s: the monitor, a process of its own,
    # beats on (20 beats of 0.2 s; 5 standing still would count as lost) and publishes nothing.
    store, namespace, _monitor, proc, _ = _run("gil", "--progress", "10", "--hold", "4")
    assert proc.returncode == 0
    assert _board(store, namespace) == []
    assert store.add(node_beat_key(namespace, 0, 1), 0) < 0  # it left cleanly afterwards


def test_a_rank_held_past_its_progress_timeout_is_published_as_hung_once():
    store, namespace, _monitor, proc, _ = _run("gil", "--progress", "2", "--hold", "5")
    assert proc.returncode == 0
    events = _board(store, namespace)
    assert len(events) == 1 and events[0].rank == 0, events
    assert events[0].reason.startswith("it made no progress for 2 s (the progress timeout is 2 s)"), events[0]


# ---------------------------------------------------------------------- inputs
@pytest.mark.parametrize("kwargs, message", [
    ({"interval_s": 0}, "interval_s must be a positive number of seconds, got 0"),
    ({"interval_s": float("nan")}, "interval_s must be a positive number of seconds, got nan"),
    ({"interval_s": "1"}, "interval_s must be a positive number of seconds, got '1'"),
    ({"interval_s": True}, "interval_s must be a positive number of seconds, got True"),
    ({"progress_timeout_s": -5}, "progress_timeout_s must be a positive number of seconds, got -5"),
    ({"progress_timeout_s": float("inf")}, "progress_timeout_s must be a positive number of seconds, got inf"),
    ({"stale_beats": 1}, "stale_beats must be an int of at least 2 intervals, got 1"),
    ({"interval_s": 2.0, "progress_timeout_s": 5.0},
     r"progress_timeout_s \(5 s\) must be at least the staleness bound, stale_beats x interval_s \(10 s\)"),
])
def test_bad_heartbeat_settings_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        start_heartbeat(**kwargs)


def test_settings_other_than_those_of_the_running_heartbeat_are_refused_naming_both(monkeypatch):
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  (registers "fake")

    from hypergrid.liveness import plane as module  # start_heartbeat takes control_plane from there when called
    from hypergrid.liveness.heartbeat import running_heartbeat

    # Rank 0 of two, its monitor a real one on a real store; the fake backend has no control plane
    # of its own (nobody to agree with), so the test hands it one over that store.
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    plane = ControlPlane("hypergrid/control/test-settings", store, ("127.0.0.1", store.port))
    monkeypatch.setattr(module, "control_plane", lambda: plane)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        beat = start_heartbeat(interval_s=0.5, progress_timeout_s=30)
        assert beat is not None and start_heartbeat(interval_s=0.5, progress_timeout_s=30) is beat  # the same: kept
        with pytest.raises(ValueError, match=r"rank 0's heartbeat already runs with interval_s=0\.5, "
                                             r"progress_timeout_s=30, stale_beats=5; this call asks for "
                                             r"interval_s=1, progress_timeout_s=600, stale_beats=5"):
            start_heartbeat(progress_timeout_s=600)
        assert running_heartbeat() is beat and beat.progress_timeout_s == 30
    finally:
        running = running_heartbeat()
        if running is not None:
            running.stop(clean=True)
        dist.destroy_process_group()


def test_a_monitor_that_cannot_reach_the_store_is_an_error_at_the_call():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once the probe is closed
    plane = ControlPlane("hypergrid/control/test", object(), ("127.0.0.1", port))
    with pytest.raises(RuntimeError, match=f"rank 0's heartbeat monitor could not start: the monitor could not "
                                           f"reach the job's store at 127.0.0.1:{port}"):
        Heartbeat(plane, 0, interval_s=0.5, progress_timeout_s=60, stale_beats=5)


def test_a_store_another_process_cannot_reach_is_an_error_naming_it():
    plane = ControlPlane("hypergrid/control/test", dist.HashStore(), None)
    with pytest.raises(RuntimeError, match="this job's store is a HashStore, which another process cannot reach"):
        Heartbeat(plane, 0, interval_s=0.5, progress_timeout_s=60, stale_beats=5)


# ---------------------------------------------------------------------- a node's relay
def _sockets(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _store_connections(pid: int, port: int) -> int:
    """How many TCP connections process ``pid`` holds to ``port`` on this host."""
    inodes = _sockets(pid)
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def test_a_node_s_monitor_processes_share_one_wait_on_the_board_and_elect_again_when_its_holder_is_killed():
    import signal
    import uuid

    from hypergrid.liveness.monitor import JobSpec
    from hypergrid.store.records import EventKind, encode

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    plane = ControlPlane(f"hypergrid/relay-test/{uuid.uuid4()}", store, ("127.0.0.1", store.port))
    channel = JobChannel.of([0, 1, 2], 0, plane.namespace)
    beats = [Heartbeat(plane, rank, interval_s=1.0, progress_timeout_s=60, stale_beats=5) for rank in range(3)]
    heard: dict[int, list[BoardEvent]] = {rank: [] for rank in range(3)}
    for rank, beat in enumerate(beats):
        beat.listen("test", heard[rank].append)
        beat.attach(JobSpec(channel, ((0, 3),), 3))  # one node of three

    def publish(rank: int, reason: str) -> None:
        index = store.add(channel.board_count(), 1) - 1
        store.set(channel.board_slot(index), encode(BoardEvent(EventKind.LOST, rank, reason, by=rank)))

    def holders() -> list[int]:
        return [rank for rank, beat in enumerate(beats) if _store_connections(beat.pid, store.port) == 2]  # calls, board

    def until(check, seconds: float = 15.0) -> None:
        end = time.monotonic() + seconds
        while not check():
            assert time.monotonic() < end, (heard, holders())
            time.sleep(0.05)

    try:
        # Every monitor has its job once it holds a socket: the store's (it leads) or its node's
        # relay (it follows); one of them holds the board's.
        until(lambda: all(len(_sockets(beat.pid)) >= 1 for beat in beats) and len(holders()) == 1)
        publish(7, "first")
        until(lambda: all(len(heard[r]) == 1 for r in range(3)))
        delegate = holders()[0]
        killed = beats[delegate].pid
        os.kill(killed, signal.SIGKILL)  # its rank's heartbeat starts another monitor, which joins again
        # The new monitor has its job once it holds a socket: the store's (it leads) or its node's
        # relay (it follows).
        until(lambda: beats[delegate].pid != killed and len(_sockets(beats[delegate].pid)) >= 1 and len(holders()) == 1)
        publish(8, "second")
        until(lambda: all(len(heard[r]) >= 2 for r in range(3)))
        time.sleep(0.5)  # an event heard twice would come now
        for rank in range(3):
            assert [(e.rank, e.reason) for e in heard[rank]] == [(7, "first"), (8, "second")], rank
    finally:
        for beat in beats:
            beat.stop(clean=True)
