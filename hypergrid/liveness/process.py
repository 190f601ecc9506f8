"""The monitor process: a rank's monitor (:class:`~hypergrid.liveness.monitor.RankMonitor`) driven by
its loop, started by the rank's heartbeat with its :class:`~hypergrid.liveness.config.MonitorConfig`.

It reads the rank's lines on its stdin (``p`` each interval, ``job``, ``resume``, ``detach``,
``bye``, ``gone``), sees the rank's end by a ``pidfd`` (else its parent pid every 0.1 s), writes
the board's events and positions on its stdout, and keeps, on a thread of its own, a delegate's
word to its node. Once its rank's end is published it stops. It imports no torch.

Example, the process refusing a store nobody listens at (what the rank reads first)::

    >>> import json, socket, subprocess, sys
    >>> with socket.socket() as probe:
    ...     probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]
    >>> config = json.dumps({"host": "127.0.0.1", "port": port, "namespace": "ns", "rank": 0,
    ...                      "connect_timeout_s": 0.5, "check_store": True})
    >>> done = subprocess.run([sys.executable, "-m", "hypergrid.liveness.process", config], capture_output=True, text=True)
    >>> done.returncode, done.stdout.startswith("error the monitor could not reach the job's store")
    (2, True)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Optional

from ..store.records import decode, encode
from ..store.tcpstore import StoreProtocolError, StoreTimeout, WireStore
from .calls import NodeCall
from .config import JobSpec, MonitorConfig
from .monitor import KEEP_ALIVE_OVERDUE, RankMonitor
from .poll import read_lines

__all__ = ["main"]


class _ParentPipe:
    """Lines to the rank's stdout pipe, never blocking: a rank holding the GIL reads nothing meanwhile."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.pending = b""

    def send(self, line: str, now: bool = True) -> None:
        """Write ``line``; not ``now``: at the loop's next :meth:`flush`, with the lines after it (an
        entry's events and the position after it wake the rank once)."""
        self.pending += line.encode() + b"\n"
        if now:
            self.flush()

    def flush(self) -> None:
        while self.pending:
            try:
                sent = os.write(self.fd, self.pending)
            except BlockingIOError:
                return
            except OSError:  # the rank is gone: nobody to tell
                self.pending = b""
                return
            self.pending = self.pending[sent:]


def _parent_watch(pid: int) -> Optional[int]:
    """A file descriptor that becomes readable when process ``pid`` ends (None: not on this system)."""
    try:
        return int(os.pidfd_open(pid))
    except (AttributeError, OSError):  # AttributeError: no pidfd_open (not Linux)
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The monitor process (``main()`` with a JSON :class:`MonitorConfig` argument), started by the heartbeat."""
    args = list(sys.argv[1:] if argv is None else argv)
    config = MonitorConfig(**json.loads(args[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C ends the rank, which ends this
    out = _ParentPipe(sys.stdout.fileno())
    try:
        if config.check_store:  # nobody has reached it yet: say so now, not at the first call
            WireStore.connect(config.host, config.port, timeout_s=config.connect_timeout_s).close()
        monitor = RankMonitor(config, forward=lambda e: out.send("event " + encode(e), now=False),
                              now=time.monotonic(),
                              reached=lambda channel, n: out.send(f"at {channel.board_count()} {n}", now=False))
    except (OSError, StoreProtocolError) as exc:
        out.send(f"error the monitor could not reach the job's store at {config.host}:{config.port}: "
                 f"{type(exc).__name__}: {exc}")
        return 2
    parent = _parent_watch(config.parent_pid)
    stdin: Optional[int] = sys.stdin.fileno()
    inbox = b""
    next_tick = time.monotonic()
    ended: Optional[float] = None  # when the rank's end was seen: the monitor stays until it is published
    out.send("ready")
    speaking = threading.Event()
    threading.Thread(target=lambda: _keep_alive(monitor, speaking, config.interval_s), daemon=True,
                     name="hypergrid-monitor-keep-alive").start()
    try:
        while not monitor.closed:
            now = time.monotonic()
            if ended is not None and now - ended > config.connect_timeout_s:
                monitor.close()
                break
            if now >= next_tick:
                monitor.tick(now=now)
                next_tick = now + config.interval_s
            if ended is None and parent is None and os.getppid() != config.parent_pid:  # no pidfd: reparented
                _rank_ended(monitor, stdin, inbox, out)
                ended, stdin = now, None
                continue
            readers = [fd for fd in (parent, stdin) if fd is not None] + monitor.readers()
            calls_due = monitor.calls_due_at()
            wait_s = max(0.0, min(next_tick, next_tick if calls_due is None else calls_due) - time.monotonic())
            try:
                ready, _, _ = select.select(readers, [out.fd] if out.pending else [], [],
                                            wait_s if parent is not None or ended is not None else min(wait_s, 0.1))
            except OSError as exc:  # a descriptor closed meanwhile (the relay shuts, never closes, from the keep-alive thread)
                if exc.errno != errno.EBADF:
                    raise
                continue
            if parent is not None and parent in ready:
                _rank_ended(monitor, stdin, inbox, out)
                ended, parent, stdin = time.monotonic(), None, None
                continue
            for fd in ready:
                if fd in monitor.readers():  # the one before may have closed it (a new delegate)
                    monitor.on_ready(fd, now=time.monotonic())
            out.flush()
            if stdin is not None and stdin in ready:
                lines, inbox = read_lines(stdin, inbox)
                if lines is None:
                    stdin = None  # its end is seen by its pid
                    continue
                for line in lines:
                    if _handle(monitor, line, time.monotonic(), out):
                        ended = time.monotonic()
            monitor.make_calls(now=time.monotonic())
            out.flush()
        return 0
    except (StoreTimeout, StoreProtocolError, OSError) as exc:
        out.send(f"error the monitor lost the job's store at {config.host}:{config.port}: {type(exc).__name__}: "
                 f"{exc}")
        return 3
    finally:
        out.flush()  # what its last look found, before it stops
        speaking.set()


def _rank_ended(monitor: RankMonitor, stdin: Optional[int], inbox: bytes, out: _ParentPipe) -> None:
    """The rank's process ended: take in what it wrote before (left unread where its end and its last
    lines came in one look), then publish its end unless it said it was done. A rank that attaches a
    job and dies at once is that job's loss, not nobody's."""
    done = False
    if stdin is not None:
        os.set_blocking(stdin, False)  # a child of the rank may hold the pipe open: read what is there
        while True:
            before = inbox
            lines, inbox = read_lines(stdin, inbox)
            if lines is None or (not lines and inbox == before):
                break
            for line in lines:
                done = _handle(monitor, line, time.monotonic(), out) or done
    if not done:
        monitor.parent_ended()


def _keep_alive(monitor: RankMonitor, stop: threading.Event, interval_s: float) -> None:
    """Speak for the monitor's loop where its word is overdue; woken once an interval, when it would be."""
    monitor.served.wait()  # a follower's thread sleeps: woken every interval, a thousand of them cost a core's share
    overdue_s = KEEP_ALIVE_OVERDUE * interval_s
    while not stop.wait(max(0.0, monitor.spoke_at + overdue_s - time.monotonic())):
        if time.monotonic() >= monitor.spoke_at + overdue_s:
            with contextlib.suppress(OSError, ValueError):
                monitor.keep_alive()


def _handle(monitor: RankMonitor, line: str, now: float, out: _ParentPipe) -> bool:
    """One line from the rank; True when the rank is done (the monitor stays until it has said so)."""
    word, _, rest = line.partition(" ")
    if word == "p":
        monitor.progress(now=now)
    elif word == "call":  # made with the node's others (:mod:`.calls`), answered on the rank's pipe
        monitor.calls.ask(decode(NodeCall, rest), lambda answer: out.send("ans " + encode(answer)),
                          monitor.call_route(), now=now)
    elif word == "job":
        monitor.attach(JobSpec.from_json(rest))
    elif word == "resume":
        first, _, spec = rest.partition(" ")
        monitor.attach(JobSpec.from_json(spec), first=int(first))
    elif word == "detach":
        monitor.detach()
    elif word == "bye":
        monitor.depart()
        return True
    elif word == "gone":
        monitor.parent_ended(rest or "its process ended")
        return True
    return False


if __name__ == "__main__":
    sys.exit(main())
