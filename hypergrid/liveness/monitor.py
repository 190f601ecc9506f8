"""A rank's monitor: the process that beats for it, watches for its node, and publishes losses.

Each rank of a resilient job runs one (:func:`hypergrid.start_heartbeat`): a process in a session
of its own, with no torch, so that nothing the rank's interpreter does (a GIL held, a SIGSTOP)
stops it. Every interval a node's monitors make two store requests per rank, whatever the job's
size: each beats from a thread of its own (a late store cannot make it look silent), and the
node's relay delegate reads the counters its node's ranks watch in the ring and publishes the
losses of one look as one board entry; a follower takes the node's watch over from a stuck delegate.

The rank's end is seen from outside (a ``pidfd``, else its parent pid every 0.1 s) and published at
once; a hang only after ``progress_timeout_s`` with no tick from its interpreter; ``bye`` marks the
rank :data:`~hypergrid.store.keys.DEPARTED`. A late store is waited for up to ``connect_timeout_s``,
and a monitor started again resumes at the board position its rank was last told.

Example, one rank's monitor against a store of torch's, its parent played by this process::

    >>> import torch.distributed as dist
    >>> from hypergrid.store.keys import JobChannel
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> config = MonitorConfig("127.0.0.1", server.port, "ns", rank=0, interval_s=1.0)
    >>> seen = []
    >>> monitor = RankMonitor(config, forward=seen.append, now=0.0)
    >>> job = JobSpec(JobChannel("ns", "job", 0), ((0, 2),), gpus_per_node=1)
    >>> monitor.attach(job)
    >>> monitor.tick(now=0.0); server.add("ns/beat/1", 1)                # rank 1 beats once
    1
    >>> for second in range(1, 7):                                  # then never again: after 5
    ...     monitor.tick(now=float(second))                        # seconds of standing still, it is gone
    >>> monitor.on_board(); [(e.kind.value, e.rank, e.by) for e in seen]
    [('lost', 1, 0)]
    >>> monitor.close()
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..store.keys import DEPARTED, JobChannel, beat_key, socket_name
from ..store.records import BoardEvent, EventKind, decode_events, encode
from ..store.tcpstore import StoreProtocolError, StoreTimeout, WireStore
from .board import claim_slot, note_losses
from .link import STORE_ERRORS, StoreLink
from .poll import read_lines
from .relay import NodeRelay, hold
from .ring import Ring, from_runs
from .watch import Watch, Watched

__all__ = ["MonitorConfig", "JobSpec", "RankMonitor", "main", "DEFAULT_PROGRESS_TIMEOUT_S", "STALE_BEATS",
           "START_TIMEOUT_S"]

#: How long a rank's interpreter may make no progress before it counts as hung (minutes: pauses of seconds are routine).
DEFAULT_PROGRESS_TIMEOUT_S = 180.0
#: How many heartbeat intervals a counter may stand still before its rank counts as gone.
STALE_BEATS = 5
#: How long a new monitor may take to reach the store and say it is ready: a counter that never beat
#: is given this much more before its rank counts as gone.
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class MonitorConfig:
    """What a monitor needs: the store's address and namespace, its rank, its timing, and how long
    the store may take to connect or answer before the monitor gives it up."""

    host: str
    port: int
    namespace: str
    rank: int
    interval_s: float = 1.0
    stale_beats: int = STALE_BEATS
    progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S
    connect_timeout_s: float = 30.0
    parent_pid: int = 0


@dataclass(frozen=True)
class JobSpec:
    """The job a monitor serves: its board's channel, its ranks as ``(first, count)`` runs, its ``gpus_per_node``."""

    channel: JobChannel
    runs: tuple[tuple[int, int], ...]
    gpus_per_node: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @functools.cached_property
    def digest(self) -> str:
        """A short digest: a node's monitors compare theirs (one not told of a recovery watches an older ring)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        raw = json.loads(text)
        return cls(JobChannel(**raw["channel"]), tuple((int(a), int(b)) for a, b in raw["runs"]), int(raw["gpus_per_node"]))


@dataclass
class _Job:
    spec: JobSpec
    ring: Ring
    next_event: int
    lost: dict[int, str] = field(default_factory=dict)
    watched: dict[int, Watched] = field(default_factory=dict)


class RankMonitor:
    """One rank's monitor, driven by a loop: :meth:`tick` every interval, :meth:`on_ready` when one of
    :meth:`readers` is readable, :meth:`progress` on the rank's ticks, :meth:`parent_ended` at its end.
    ``forward`` gets every event of the board; ``reached`` the board's position after each entry.
    :meth:`tick` beats too, unless ``link.start_beats()`` runs the beats on a thread of their own."""

    def __init__(self, config: MonitorConfig, *, forward: Callable[[BoardEvent], None], now: float,
                 connect: Optional[Callable[[float], WireStore]] = None,
                 reached: Optional[Callable[[JobChannel, int], None]] = None) -> None:
        self.config = config
        self._forward = forward
        self._reached = reached
        # ``connect``: a caller hosting many monitors (or a proxy in front of the store) gives its own.
        self.link = StoreLink(connect or (lambda s: WireStore.connect(config.host, config.port, timeout_s=s)),
                              give_up_s=config.connect_timeout_s, beat_key=beat_key(config.namespace, config.rank),
                              interval_s=config.interval_s)
        self._watch_rule = Watch(config.rank, config.interval_s, config.stale_beats, START_TIMEOUT_S)
        self.board: Optional[WireStore] = None  # the node's one wait pending on the board's next event
        self.relay: Optional[NodeRelay] = None  # the node's monitors: this one is its delegate, or follows it
        self._names: tuple[str, int] = ("", 0)  # names the node's relay and watch: the board, the node
        self._watch_lock: Optional[socket.socket] = None  # held: this follower watches for the node
        self._delegate_quiet = 0  # this monitor's ticks since its delegate last said anything
        # What the delegate last told: its spec's digest, and the counters it watched (taken over on a change).
        self._delegate_spec: Optional[str] = None
        self._delegate_watched: Optional[list[list[float]]] = None
        self.job: Optional[_Job] = None
        self.last_progress = now
        self.hung_published = False
        self.closed = False

    def _read(self, ranks: Sequence[int]) -> list[int]:
        """The heartbeat counters of ``ranks``, in one round trip."""
        keys = [beat_key(self.config.namespace, r) for r in ranks]
        read = self.link.call(lambda store: store.add_many(keys, 0))
        assert read is not None
        return read

    # ------------------------------------------------------------------ the job
    def attach(self, spec: JobSpec, first: Optional[int] = None) -> None:
        """Serve ``spec``'s job (the same job again: its ranks changed), reading its board from entry
        ``first`` (a monitor started again) or else from the board's count."""
        if self.job is not None and self.job.spec.channel == spec.channel:
            self.job = _Job(spec, Ring.of(from_runs(spec.runs), spec.gpus_per_node), self.job.next_event, self.job.lost)
            return
        self._leave_board()
        if first is None:
            first = self.link.call(lambda store: store.add(spec.channel.board_count(), 0))
            assert first is not None
        self.job = _Job(spec, Ring.of(from_runs(spec.runs), spec.gpus_per_node), first)
        if self._reached is not None:
            self._reached(spec.channel, first)
        self._join_board(first=True)

    def detach(self) -> None:
        """Serve no job (the rank left it)."""
        self.job = None
        self._leave_board()

    def _join_board(self, first: bool = False) -> None:
        """Be the node's delegate (and wait on the board), or follow it; ``first``: as the job is attached."""
        job = self.job
        assert job is not None
        node = self.config.rank // max(1, job.spec.gpus_per_node)
        self._names = (f"{self.config.host}:{self.config.port}/{job.spec.channel.board_count()}", node)
        self.relay = NodeRelay.join(socket_name("relay", *self._names))
        self._delegate_quiet = 0
        self._delegate_spec = None
        if self.relay.delegates:
            self._open_board(fatal=first)

    def _open_board(self, fatal: bool = False) -> None:
        """Connect to the board and wait on its next entry; unless ``fatal``, a failed connection is tried
        again at the next tick. A monitor taking the board over mid-job first catches up on the connection
        it has: torch's server resolves each new client's name on the thread that answers everyone (a
        dropped DNS query holds it 5 s), and the entry (often its rank's own end) must not wait for that."""
        job = self.job
        assert job is not None
        if not fatal:
            published = self.link.call(lambda store: store.add(job.spec.channel.board_count(), 0))
            assert published is not None
            self._catch_up(job, published)
        try:
            board = self.link.connection(self.config.connect_timeout_s)
        except (OSError, StoreProtocolError):
            if fatal:
                raise
            return
        self.board = board
        try:
            board.start_wait([job.spec.channel.board_slot(job.next_event)])
        except STORE_ERRORS:
            self._drop_board()

    def _drop_board(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None

    def _go_alone(self) -> None:
        """Stop counting on the node's delegate (silent for the staleness bound): wait on the board itself."""
        assert self.relay is not None
        self.relay.close()
        self.relay = NodeRelay(None, None)
        self._open_board()

    def _leave_board(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        self._drop_board()
        self._release_watch()

    def readers(self) -> list[int]:
        """The descriptors :meth:`on_ready` handles: the board's wait, the relay's."""
        fds = [self.board.fileno()] if self.board is not None else []
        return fds + (self.relay.readers() if self.relay is not None else [])

    def on_ready(self, fd: int) -> None:
        """``fd``, one of :meth:`readers`, is readable."""
        relay = self.relay
        if self.board is not None and fd == self.board.fileno():
            self.on_board()
        elif relay is None or self.job is None:
            return
        elif relay.listener is not None and fd == relay.listener.fileno():
            relay.accept(position=self.job.next_event)
        elif relay.delegates:
            relay.follower_ready(fd)
        else:
            self._on_relayed(relay)

    def _on_relayed(self, relay: NodeRelay) -> None:
        """The node's delegate sent entries (or its position), or went: then elect again."""
        job = self.job
        assert job is not None
        heard = relay.receive()
        if heard is None:
            relay.close()
            self._join_board()
            return
        self._delegate_quiet = 0
        for item in heard:
            if item.payload is None and item.state:
                told = json.loads(item.state)
                self._delegate_spec, self._delegate_watched = told["spec"], told["watched"]
            self._catch_up(job, item.index)
            if item.payload is not None and item.index == job.next_event:
                self._take_entry(job, item.payload)

    def _catch_up(self, job: _Job, position: int) -> None:
        """Read from the store, a get each, the entries before ``position`` this monitor missed (a change
        of delegate, a restart); a delegate hands each to its followers too."""
        while job.next_event < position:
            payload = self.link.call(functools.partial(_get, key=job.spec.channel.board_slot(job.next_event)))
            assert payload is not None
            self._take_entry(job, payload.decode())

    # ------------------------------------------------------------------ every interval
    def tick(self, *, now: float) -> None:
        """Beat (unless on a thread), look at the watched ranks, and judge the rank's own progress."""
        if not self.link.beating:
            self.link.beat()
        job = self.job
        if job is None:
            return
        relay = self.relay
        if relay is not None and relay.delegates:
            if self.board is None:
                self._open_board()
            self._keep_alive(job)  # before its reads too: however late the store answers them
        elif relay is not None:
            self._delegate_quiet += 1
            if self._delegate_quiet > self.config.stale_beats + 1:
                self._go_alone()
        self._watch(job, now)
        self._keep_alive(job)  # after the watch: what it saw now
        quiet = now - self.last_progress
        if quiet >= self.config.progress_timeout_s and not self.hung_published:
            self.hung_published = True
            self.publish(BoardEvent(EventKind.LOST, self.config.rank, (
                f"it made no progress for {quiet:.0f} s (the progress timeout is "
                f"{self.config.progress_timeout_s:g} s): its interpreter is stopped, or stuck holding the GIL"),
                by=self.config.rank))

    def progress(self, *, now: float) -> None:
        """The rank's interpreter ran (it sent its tick)."""
        self.last_progress = now
        self.hung_published = False

    def _keep_alive(self, job: _Job) -> None:
        """A delegate tells its followers its position, its spec's digest and what it saw of its counters."""
        relay = self.relay
        if relay is not None and relay.delegates and relay.followers:
            state = {"spec": job.spec.digest, "watched": Watch.state(job.watched)}
            relay.keep_alive(job.next_event, json.dumps(state, separators=(",", ":")))

    def _starts(self, job: _Job) -> list[int]:
        """The ranks whose watched ranks this monitor reads: the whole node's for a delegate (so a node
        lost whole takes one or two entries, not one per rank) or for the follower holding the watch
        name once its delegate is quiet; its own for a monitor alone or whose spec differs."""
        me, ring, relay = self.config.rank, job.ring, self.relay
        mine = [me] if me in ring else []
        if relay is None:
            return mine
        node = ring.on_node(me // ring.gpus_per_node)
        if relay.delegates and relay.listener is not None:
            self._release_watch()
            return node
        if self._delegate_spec not in (None, job.spec.digest):
            return mine
        if not relay.delegates and self._delegate_quiet <= 2:
            self._release_watch()
            return []
        if self._watch_lock is None:
            try:
                self._watch_lock = hold(socket_name("watch", *self._names))
            except OSError:  # no names to hold here: on its own
                return mine
        return node if self._watch_lock is not None else []

    def _release_watch(self) -> None:
        if self._watch_lock is not None:
            self._watch_lock.close()
            self._watch_lock = None

    def _watch(self, job: _Job, now: float) -> None:
        """Read the counters this monitor watches, and publish those found lost in one entry."""
        starts = self._starts(job)
        if len(job.ring) < 2 or not starts:
            job.watched.clear()
            return
        told, self._delegate_watched = self._delegate_watched, None
        Watch.take_over(job.watched, told, job.ring)
        self.link.watching()
        found = self._watch_rule.look(self._read, job.ring, starts, job.lost, job.watched, now)
        for event in found:
            job.lost[event.rank] = event.reason
        if found:
            self.publish(*found)

    # ------------------------------------------------------------------ the board
    def publish(self, *events: BoardEvent) -> None:
        """Put ``events`` on the job's board in one entry (less the losses it has already), then count it."""
        job = self.job
        if job is None:
            return
        channel, first = job.spec.channel, job.next_event
        if self.link.call(lambda store: claim_slot(store, channel, events, first)) is not None:
            self.link.call(lambda store: store.add(channel.board_count(), 1), again=False)

    def on_board(self) -> None:
        """The board's wait was answered: read the entry, wait on the next, forward its events (two
        requests per entry); a failed read is made again on a new connection."""
        job, board = self.job, self.board
        if job is None or board is None:
            return
        channel, index = job.spec.channel, job.next_event
        try:
            if not board.waiting:  # nothing asked yet: ask (answered at once where the entry is there)
                board.start_wait([channel.board_slot(index)])
                return
            board.finish_wait()
            payload = board.read(channel.board_slot(index))
            board.start_wait([channel.board_slot(index + 1)])
        except STORE_ERRORS:
            self._drop_board()
            self._open_board()
            return
        self._take_entry(job, payload.decode())

    def _take_entry(self, job: _Job, payload: str) -> None:
        """Take in the job's next entry, read or relayed; a delegate hands it to its followers (a
        follower's relay has none)."""
        if self.relay is not None:
            self.relay.send(job.next_event, payload)
        job.next_event += 1
        for event in decode_events(payload):
            self.deliver(event)
        if self.job is not None and self._reached is not None:
            self._reached(self.job.spec.channel, self.job.next_event)

    def deliver(self, event: BoardEvent) -> None:
        """Take in one event of the job's board and forward it to the rank."""
        job = self.job
        if job is None:
            return
        note_losses(job.lost, [event])
        self._forward(event)

    # ------------------------------------------------------------------ the end
    def parent_ended(self, reason: str = "its process ended") -> None:
        """The rank's process is gone (or going while the job counts on it): publish it, mark it left."""
        if not self.closed:
            self.publish(BoardEvent(EventKind.LOST, self.config.rank, reason, by=self.config.rank))
            self.depart()

    def depart(self) -> None:
        """Mark the rank as left (nobody counts it lost) and stop."""
        if not self.closed:
            self.link.stop_beats()
            self.link.call(lambda store: store.add(beat_key(self.config.namespace, self.config.rank), DEPARTED))
            self.close()

    def close(self) -> None:
        self.closed = True
        self.link.close()
        self._leave_board()


def _get(store: WireStore, key: str) -> bytes:
    return store.get(key)


class _ParentPipe:
    """Lines to the rank's stdout pipe, never blocking: a rank holding the GIL reads nothing meanwhile."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.pending = b""

    def send(self, line: str) -> None:
        self.pending += line.encode() + b"\n"
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
        monitor = RankMonitor(config, forward=lambda e: out.send("event " + encode(e)), now=time.monotonic(),
                              reached=lambda channel, n: out.send(f"at {channel.board_count()} {n}"))
    except (OSError, StoreProtocolError) as exc:
        out.send(f"error the monitor could not reach the job's store at {config.host}:{config.port}: "
                 f"{type(exc).__name__}: {exc}")
        return 2
    parent = _parent_watch(config.parent_pid)
    stdin: Optional[int] = sys.stdin.fileno()
    inbox = b""
    next_tick = time.monotonic()
    out.send("ready")
    monitor.link.start_beats()
    try:
        while True:
            now = time.monotonic()
            if now >= next_tick:
                monitor.tick(now=now)
                next_tick = now + config.interval_s
            if parent is None and os.getppid() != config.parent_pid:  # no pidfd: reparented means ended
                monitor.parent_ended()
                return 0
            readers = [fd for fd in (parent, stdin) if fd is not None] + monitor.readers()
            wait_s = max(0.0, next_tick - time.monotonic())
            ready, _, _ = select.select(readers, [out.fd] if out.pending else [], [],
                                        wait_s if parent is not None else min(wait_s, 0.1))
            if parent is not None and parent in ready:
                monitor.parent_ended()
                return 0
            for fd in ready:
                if fd in monitor.readers():  # the one before may have closed it (a new delegate)
                    monitor.on_ready(fd)
            out.flush()
            if stdin is not None and stdin in ready:
                lines, inbox = read_lines(stdin, inbox)
                if lines is None:
                    stdin = None  # its end is seen by its pid
                    continue
                for line in lines:
                    if _handle(monitor, line, time.monotonic()):
                        return 0
    except (StoreTimeout, StoreProtocolError, OSError) as exc:
        out.send(f"error the monitor lost the job's store at {config.host}:{config.port}: {type(exc).__name__}: "
                 f"{exc}")
        return 3


def _handle(monitor: RankMonitor, line: str, now: float) -> bool:
    """One line from the rank; True when the monitor is done."""
    word, _, rest = line.partition(" ")
    if word == "p":
        monitor.progress(now=now)
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
