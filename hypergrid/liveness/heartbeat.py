"""This rank's side of the control plane: its monitor process, and the thread that talks to it.

:func:`start_heartbeat` starts the rank's monitor (:mod:`hypergrid.liveness.monitor`) and returns
once it has reached the store. A thread of the rank's own sends it a tick every interval: it needs
the GIL, which is the point, as a rank whose interpreter makes no progress for the progress
timeout is published as hung. The same thread hands the board's events the monitor forwards to
the listeners. At the interpreter's exit the monitor is told ``bye`` (the rank leaves cleanly) or
``gone`` (a job still counts on it); a process killed outright is seen by the monitor itself.

Nothing starts on the fake backend (no store) or in a world of one rank (nobody to tell). Importing
this module imports no torch, so stand-in ranks in tests run without it.

Example, with no process group::

    >>> start_heartbeat() is None, running_heartbeat() is None
    (True, True)
    >>> start_heartbeat(interval_s=0)
    Traceback (most recent call last):
        ...
    ValueError: interval_s must be a positive number of seconds, got 0
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..store.records import BoardEvent, decode, encode
from ..store.shutdown import register
from .calls import AnswerKind, NodeAnswer, NodeCall
from .config import DEFAULT_PROGRESS_TIMEOUT_S, STALE_BEATS, START_TIMEOUT_S, JobSpec, MonitorConfig
from .poll import read_lines, readable
from .progress import tick_every_s

if TYPE_CHECKING:
    from .plane import ControlPlane

__all__ = ["Heartbeat", "start_heartbeat", "running_heartbeat", "DEFAULT_PROGRESS_TIMEOUT_S", "STALE_BEATS"]

logger = logging.getLogger(__name__)

#: The directory holding this hypergrid package: the monitor runs the same.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
#: The monitor's command: no site packages, this hypergrid first on its path.
_BOOT = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from hypergrid.liveness.process import main; "
         "sys.exit(main())")
#: How many of the board's latest events a heartbeat keeps for a listener that comes late.
RECENT_EVENTS = 256


class Heartbeat:
    """This rank's monitor process and the thread that ticks it and hears its events."""

    def __init__(self, plane: ControlPlane, rank: int, interval_s: float, progress_timeout_s: float,
                 stale_beats: int) -> None:
        if plane.address is None:
            raise RuntimeError(
                f"hypergrid: a heartbeat's monitor reaches the job's store by address, and this job's store is a "
                f"{type(plane.store).__name__}, which another process cannot reach: start the default group over a "
                f"TCPStore (init_method='env://' or 'tcp://', or torchrun)")
        self.rank = rank
        self.interval_s = interval_s
        self.progress_timeout_s = progress_timeout_s
        self.stale_beats = stale_beats
        self.plane = plane
        # Where this process reaches the store itself, so can its monitor: only its node's delegate
        # connects, and no rank opens a connection for nothing at the start (a storm at 1,000 ranks).
        self.config = MonitorConfig(plane.address[0], plane.address[1], plane.namespace, rank, interval_s,
                                    stale_beats, progress_timeout_s, parent_pid=os.getpid(),
                                    check_store=not getattr(plane, "reached", False))
        self.job: Optional[JobSpec] = None
        #: The attached job's board position this rank has had every entry before: where a restarted
        #: monitor starts reading (None: not told yet).
        self.position: Optional[int] = None
        #: Whether the attached job still counts on this rank (False once it released its spares).
        self.job_running = False
        self._listeners: dict[str, Callable[[BoardEvent], None]] = {}
        self._recent: deque[BoardEvent] = deque(maxlen=RECENT_EVENTS)
        self._lock = threading.Lock()
        self._calls: dict[int, _Waiting] = {}  # the calls sent to the monitor, not answered yet
        self._call_numbers = itertools.count(1)
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._proc = self._start_monitor()
        self._thread = threading.Thread(target=self._run, name=f"hypergrid-heartbeat-{rank}", daemon=True)
        self._thread.start()
        self._service = register("the heartbeat", self.stop, self._thread.join)

    # ------------------------------------------------------------------ the monitor process
    def _start_monitor(self) -> subprocess.Popen:
        # A session of its own: a launcher ending the rank's process group must not end the monitor
        # that publishes that end.
        proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _BOOT, _PACKAGE_ROOT, json.dumps(asdict(self.config))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, start_new_session=True)
        assert proc.stdout is not None
        line = _read_line(proc.stdout.fileno(), START_TIMEOUT_S)
        if line != "ready":
            proc.kill()
            proc.wait()
            why = line[len("error "):] if line and line.startswith("error ") else (
                f"it said {line!r}" if line else f"it did not say it was ready within {START_TIMEOUT_S:g} s "
                                                 f"(exit status {proc.returncode})")
            raise RuntimeError(f"hypergrid: rank {self.rank}'s heartbeat monitor could not start: {why}")
        os.set_blocking(proc.stdout.fileno(), False)
        return proc

    @property
    def pid(self) -> int:
        """The monitor process's pid."""
        return int(self._proc.pid)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def _send(self, line: str) -> None:
        # A failed write: the monitor ended, and the thread starts another.
        with self._lock, contextlib.suppress(BrokenPipeError, ValueError, OSError):
            stdin = self._proc.stdin
            assert stdin is not None  # started with stdin=PIPE, never unset
            stdin.write(line.encode() + b"\n")
            stdin.flush()

    # ------------------------------------------------------------------ the job
    def attach(self, spec: JobSpec) -> None:
        """Serve ``spec``'s job: watch in its ring, publish on its board, forward its events."""
        if self.job is None or self.job.channel != spec.channel:
            self.position = None
        self.job, self.job_running = spec, True
        self._send("job " + spec.to_json())

    def release(self) -> None:
        """The job no longer counts on this rank: its end is nobody's loss."""
        self.job_running = False
        self._send("detach")

    def listen(self, name: str, callback: Callable[[BoardEvent], None], replay: bool = False) -> None:
        """Call ``callback`` (on the heartbeat's thread) with every event of the attached job's board, as
        listener ``name``; ``replay``: the latest :data:`RECENT_EVENTS` first (on this thread), so that an
        outcome decided just before is heard too."""
        with self._lock:
            self._listeners = {**self._listeners, name: callback}
            for event in self._recent if replay else ():
                callback(event)

    def call(self, call: NodeCall, timeout_s: float) -> NodeAnswer:
        """Have the rank's node make ``call`` with its other ranks' (:mod:`~hypergrid.liveness.calls`): the
        answer, or :attr:`AnswerKind.UNKNOWN` where none came within ``timeout_s`` (the monitor ended, or
        its delegate went)."""
        waiting = _Waiting(replace(call, ident=next(self._call_numbers), rank=self.rank))
        with self._lock:
            self._calls[waiting.call.ident] = waiting
        self._send("call " + encode(waiting.call))
        waiting.done.wait(timeout_s)
        with self._lock:
            self._calls.pop(waiting.call.ident, None)
        return waiting.answer or NodeAnswer.to(waiting.call, AnswerKind.UNKNOWN)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        next_tick = 0.0
        inbox = b""
        while not self._stopping.is_set():
            now = time.monotonic()
            if now >= next_tick:
                self._send("p")
                next_tick = now + tick_every_s(self.interval_s, self.progress_timeout_s)
            out = self._proc.stdout
            assert out is not None
            ready = readable([out.fileno(), self._wake_r], next_tick - now)
            if self._stopping.is_set():
                return
            if out.fileno() not in ready:
                continue
            lines, inbox = read_lines(out.fileno(), inbox)
            if lines is None:
                self._restart()
                inbox = b""
                continue
            for line in lines:
                self._heard(line)

    def _heard(self, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "event":
            event = decode(BoardEvent, rest)
            with self._lock:
                self._recent.append(event)
                listeners = list(self._listeners.values())
            for listener in listeners:
                try:
                    listener(event)
                except Exception:  # a listener's failure must not stop the heartbeat
                    logger.exception("rank %d: a listener of the job's events failed on %s", self.rank, event)
        elif word == "at":  # the board's position (of the job attached now only)
            board, _, position = rest.rpartition(" ")
            job = self.job
            if job is not None and board == job.channel.board_count():
                self.position = int(position)
        elif word == "ans":
            answer = decode(NodeAnswer, rest)
            with self._lock:
                waiting = self._calls.pop(answer.ident, None)
            if waiting is not None:
                waiting.answer = answer
                waiting.done.set()
        elif word == "error":
            logger.error("rank %d: heartbeat monitor: %s", self.rank, rest)

    def _restart(self) -> None:
        """The monitor ended while this rank runs (killed, or it lost the store): start another."""
        status = self._proc.wait()
        with self._lock:  # what the monitor was asked went with it
            lost, self._calls = list(self._calls.values()), {}
        for waiting in lost:
            waiting.done.set()
        logger.error("rank %d: its heartbeat monitor ended (status %s); starting another", self.rank, status)
        time.sleep(min(1.0, self.interval_s))
        try:
            self._proc = self._start_monitor()
        except RuntimeError as exc:
            logger.error("%s; retrying", exc)
            return
        job, position = self.job, self.position
        if job is not None and self.job_running:
            # From where the last one reached: no entry is passed over.
            self._send("job " + job.to_json() if position is None else f"resume {position} {job.to_json()}")

    # ------------------------------------------------------------------ the end
    def stop(self, clean: Optional[bool] = None) -> None:
        """Stop the thread and the monitor. ``clean``: the rank leaves cleanly (default: unless a job
        still counts on it and its default group is up)."""
        if self._stopping.is_set():
            return
        if clean is None:
            import torch.distributed as dist

            clean = not (self.job_running and dist.is_initialized())
        self._stopping.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5.0)
        self._send("bye" if clean else "gone its process is exiting while the job runs (an exception, or "
                                       "sys.exit, before the job was released)")
        with self._lock:
            if self._proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class _Waiting:
    """A call sent to the monitor, and its answer once it came."""

    call: NodeCall
    done: threading.Event = field(default_factory=threading.Event)
    answer: Optional[NodeAnswer] = None


def _read_line(fd: int, timeout_s: float) -> Optional[str]:
    """One line from ``fd`` within ``timeout_s`` (None: none came, or the writer ended)."""
    end, data = time.monotonic() + timeout_s, b""
    while b"\n" not in data:
        left = end - time.monotonic()
        if left <= 0 or not readable([fd], left):
            return None
        chunk = os.read(fd, 1)
        if not chunk:
            return None
        data += chunk
    return data.decode().strip()


_current: Optional[Heartbeat] = None
_start_lock = threading.Lock()


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def start_heartbeat(interval_s: float = 1.0, *, progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S,
                    stale_beats: int = STALE_BEATS) -> Optional[Heartbeat]:
    """Start (or keep) this rank's heartbeat, on every rank (spares too) after ``init_process_group``.

    The rank counts as gone after ``stale_beats`` intervals of ``interval_s`` with no beat, at once
    when its process ends, and as hung after ``progress_timeout_s`` with no progress (minutes: a GIL
    held for seconds is no failure). Returns it, or None with no store or in a world of one rank.
    Raises ValueError for bad or conflicting settings, RuntimeError where the monitor cannot start.

    Example::

        >>> start_heartbeat(progress_timeout_s=-1)
        Traceback (most recent call last):
            ...
        ValueError: progress_timeout_s must be a positive number of seconds, got -1
    """
    import torch.distributed as dist

    from .plane import control_plane

    global _current
    interval = _positive("interval_s", interval_s)
    progress = _positive("progress_timeout_s", progress_timeout_s)
    if isinstance(stale_beats, bool) or not isinstance(stale_beats, int) or stale_beats < 2:
        raise ValueError(f"stale_beats must be an int of at least 2 intervals, got {stale_beats!r}")
    if progress < stale_beats * interval:
        raise ValueError(f"progress_timeout_s ({progress:g} s) must be at least the staleness bound, stale_beats "
                         f"x interval_s ({stale_beats * interval:g} s): a paused rank is not to be taken for a lost one")
    plane = control_plane()
    if plane is None or dist.get_world_size() == 1:
        return None
    with _start_lock:
        rank = dist.get_rank()
        current = _current
        if current is not None and current.running and current.rank == rank and current.plane is plane:
            asked = (interval, progress, stale_beats)
            if asked != (current.interval_s, current.progress_timeout_s, current.stale_beats):
                # Dropped silently, the user would believe in a progress timeout that is not kept.
                raise ValueError(
                    f"rank {rank}'s heartbeat already runs with interval_s={current.interval_s:g}, progress_timeout_s="
                    f"{current.progress_timeout_s:g}, stale_beats={current.stale_beats}; this call asks for "
                    f"interval_s={interval:g}, progress_timeout_s={progress:g}, stale_beats={stale_beats}: call "
                    f"start_heartbeat with its settings before ResilientJob.of_* (which starts one with the defaults "
                    f"where none runs), once per rank")
            return current
        if current is not None:
            current.stop(clean=True)
        try:
            _current = Heartbeat(plane, rank, interval, progress, stale_beats)
        except OSError as exc:
            raise RuntimeError(f"hypergrid: rank {rank}'s heartbeat monitor could not start: {exc}") from exc
        return _current


def running_heartbeat() -> Optional[Heartbeat]:
    """This rank's heartbeat if it runs, else None.

    Example::

        >>> running_heartbeat() is None
        True
    """
    beat = _current
    return beat if beat is not None and beat.running else None
