"""A rank's monitor: the process that beats for it, watches for its node, and publishes losses.

Each rank of a resilient job runs one (:func:`hypergrid.start_heartbeat` starts it); it is a
process of its own, in a session of its own, that imports no torch (some 8 MB), so that nothing
the rank's interpreter does (a C call holding the GIL for seconds, a SIGSTOP, a launcher ending
the rank's process group) stops it. Every ``interval_s`` a node's monitors make two store
requests per rank (one ``add`` each), whatever the job's size:

- each adds 1 to its rank's heartbeat counter, from a thread of its own (:mod:`hypergrid.liveness.link`:
  a delegate's reads and publications go on a connection apart, a follower's few calls take turns
  with the beats), so that however late the store answers, its beats go out on time (a late
  store cannot make a watcher look silent);
- the node's relay delegate (:mod:`hypergrid.liveness.relay`) reads, for each rank of its node, the
  counter of the rank it watches, its successor in the job's ring (:mod:`hypergrid.liveness.ring`,
  on another node, and where nodes are short of ranks those after it on that node:
  :meth:`~hypergrid.liveness.ring.Ring.watched_from`), and judges their silence
  (:mod:`hypergrid.liveness.watch`): the losses found at one look are one entry of the board, so
  a node lost whole takes one or two entries, not one per rank. A follower whose delegate said
  nothing for more than two of its ticks (alive but stuck) does not watch for itself: one of the
  node's followers takes the node's watch over (it holds the node's watch name,
  :func:`~hypergrid.liveness.relay.hold`), and a loss the board has already is not published
  again (:func:`~hypergrid.liveness.board.claim_slot`). A monitor with no relay (no abstract
  sockets here), or one that watches a ring its delegate does not (a recovery its rank was told
  of, the delegate's not), reads its own successor's counter.

It sees its own rank's death from outside: the process it watches (its parent) ending is
published at once (a ``pidfd`` becomes readable; where there is none, its parent pid is looked
at every 0.1 s), before the monitor leaves. It tells a paused rank from a dead one: the rank's
interpreter sends it a tick every interval (it needs the GIL to), and only when no tick came for
``progress_timeout_s`` (minutes by default) is the rank published as hung. A rank that leaves
cleanly says so (``bye``): its counter is marked as left (:data:`~hypergrid.store.keys.DEPARTED`)
and nobody counts it lost.

Every loss goes to one place, the job's board (``events`` and ``event/<k>``,
:class:`~hypergrid.store.keys.JobChannel`): the publisher fills the first free entry's key
(:meth:`RankMonitor.publish`; an entry holds one event, or the losses found at one look), then
adds 1 to ``events``. One monitor per node keeps a wait pending on the board's next key, which costs nothing until an entry is published;
the store's answer wakes it, and it reads the entry (one get: the wait was answered, the key is
there), waits on the next key, hands the entry to the node's other monitors (the relay, which
also elects it) and forwards its events to its rank (which aborts its communicators,
:class:`~hypergrid.recovery.abort.CollectiveWatch`): two requests per entry and node.

A store that answers late is waited for: each call waits for its answer up to
``connect_timeout_s`` (30 s), a failed connection is made again within that time, and only a
store that did not answer for that long is given up (the rank's heartbeat then starts another
monitor). No entry is passed over: the monitor tells its rank the board's position it has
reached, and a monitor started again starts there (``resume``), not at the board's count.

:class:`RankMonitor` is that work for one rank, driven by a loop: this module's :func:`main` in
the monitor process, or the control-plane benchmark's, which runs thousands of them against one
real store (there each beats at its tick, before its reads).

Example, one rank's monitor against a store of torch's, its parent played by this process::

    >>> import torch.distributed as dist
    >>> from hypergrid.store.keys import JobChannel
    >>> from hypergrid.store.records import BoardEvent, EventKind
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> config = MonitorConfig("127.0.0.1", server.port, "ns", rank=0, interval_s=1.0)
    >>> seen = []
    >>> monitor = RankMonitor(config, forward=seen.append, now=0.0)
    >>> job = JobSpec(JobChannel("ns", "job", 0), ((0, 2),), gpus_per_node=1)
    >>> monitor.attach(job)
    >>> for second in range(6):                                     # rank 1 never beats: after 5
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
from .board import claim_slot
from .link import STORE_ERRORS, StoreLink
from .relay import NodeRelay, hold
from .ring import Ring, from_runs
from .watch import Watch, Watched

__all__ = ["MonitorConfig", "JobSpec", "RankMonitor", "main", "DEFAULT_PROGRESS_TIMEOUT_S", "STALE_BEATS"]

#: How long a rank's interpreter may make no progress before it counts as hung (as NVIDIA
#: Resiliency Extension's in-process restart, minutes: pauses of seconds are routine at scale).
DEFAULT_PROGRESS_TIMEOUT_S = 180.0
#: How many heartbeat intervals a counter may stand still before its rank counts as gone.
STALE_BEATS = 5


@dataclass(frozen=True)
class MonitorConfig:
    """What a monitor needs: the store's address, the world's control namespace, its rank, the
    heartbeat interval, the staleness bound in intervals, the progress timeout, and how long the
    store may take to take a connection or to answer a call before the monitor gives it up."""

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
    """The job a monitor serves: its channel (where its board is), its ranks as ``(first, count)``
    runs, and the ranks per node (what the ring keeps apart)."""

    channel: JobChannel
    runs: tuple[tuple[int, int], ...]
    gpus_per_node: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @functools.cached_property
    def digest(self) -> str:
        """A short digest of the spec: monitors of one node compare theirs (one that was not told
        of a recovery, its rank hung, watches an older ring)."""
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
    """One rank's control-plane work (see the module): :meth:`tick` every interval,
    :meth:`on_ready` when one of :meth:`readers` is readable, :meth:`progress` on each tick of the
    rank's interpreter, :meth:`parent_ended` when the rank's process is gone.

    ``forward`` receives every event of the board (in the monitor process: sent to the rank), and
    ``reached`` the board's position after each entry handed over (and where the job's reading
    starts). Its beats are made by :meth:`tick`, unless a thread of their own makes them
    (``link.start_beats()``, :class:`~hypergrid.liveness.link.StoreLink`).
    """

    def __init__(self, config: MonitorConfig, *, forward: Callable[[BoardEvent], None], now: float,
                 connect: Optional[Callable[[float], WireStore]] = None,
                 reached: Optional[Callable[[JobChannel, int], None]] = None) -> None:
        self.config = config
        self._forward = forward
        self._reached = reached
        # Where its connections come from (a timeout in, a connection out): the store's address by
        # default; a caller that hosts many monitors (or a proxy in front of the store) gives its own.
        # Beats, reads and publications: one round trip each, waited for however late.
        self.link = StoreLink(connect or (lambda s: WireStore.connect(config.host, config.port, timeout_s=s)),
                              give_up_s=config.connect_timeout_s, beat_key=beat_key(config.namespace, config.rank),
                              interval_s=config.interval_s)
        self._watch_rule = Watch(config.rank, config.interval_s, config.stale_beats)
        self.board: Optional[WireStore] = None  # the node's one wait pending on the board's next event
        self.relay: Optional[NodeRelay] = None  # the node's monitors: this one is its delegate, or follows it
        self._names: tuple[str, int] = ("", 0)  # what names the node's relay and watch: the board, the node
        self._watch_lock: Optional[socket.socket] = None  # held: this follower watches for the node
        self._delegate_quiet = 0  # this monitor's ticks since its delegate last said anything
        # What the node's delegate last told of its watch: the digest of its job spec (a follower
        # whose spec differs watches for itself), and the counters it watched, which this monitor
        # takes over once it watches (it was elected, or took the watch over).
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
        """Serve ``spec``'s job from now on (the same job again: its ranks changed after a recovery),
        reading its board from entry ``first`` (a monitor started again: where its rank's last
        one had reached) or else from the board's count."""
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
        """Be the node's delegate (and wait on the board), or follow the one that is. ``first``: as the
        job is attached (its connection is made as every other one is then, however long it takes)."""
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
        """Connect to the board (however late the store takes the connection) and wait on its next
        event. Unless ``fatal`` (as the job is attached), a delegate that could not connect tries
        again at its next tick.

        A monitor that takes the board over while the job runs (elected, or gone alone) first
        reads what was published since its position on the connection it has: often its
        predecessor's last entry, its own rank's end. torch's store server looks up every new
        client's address by name on the thread that answers everyone (a resolver that drops a
        query holds it 5 s), so the entry must not wait for a new connection. The followers that
        elected again with it have each entry as it does (:meth:`NodeRelay.send` takes them first)."""
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
        """Stop counting on the node's delegate (it said nothing for the staleness bound: alive but
        stuck): wait on the board itself from here on, for this job."""
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
        """The descriptors whose readiness :meth:`on_ready` handles: the board's wait, the relay's."""
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
        """The node's delegate sent events (or its position), or went: then elect again."""
        job = self.job
        assert job is not None
        heard = relay.receive()
        if heard is None:  # the next delegate tells its position, or this one waits on the board
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
                job.next_event += 1
                self._deliver_entry(item.payload)

    def _catch_up(self, job: _Job, position: int) -> None:
        """Read from the store the entries before ``position`` that this monitor has not had (it
        joined the relay after its delegate read them, or changed delegate, or started again
        behind it, or took the board over): rare, a get each. Every entry before a delegate's
        position (or the board's count) is written: a read the store answers late is waited for,
        none is passed over. A delegate hands each to its followers, as the board's (a follower's
        relay has nobody to hand it to)."""
        while job.next_event < position:
            index = job.next_event
            payload = self.link.call(functools.partial(_get, key=job.spec.channel.board_slot(index)))
            assert payload is not None
            job.next_event += 1
            if self.relay is not None:
                self.relay.send(index, payload.decode())
            self._deliver_entry(payload)

    # ------------------------------------------------------------------ every interval
    def tick(self, *, now: float) -> None:
        """Beat (unless apart), look at the watched ranks, and judge the rank's own progress."""
        if not self.link.beating:
            self.link.beat()
        job = self.job
        if job is None:
            return
        relay = self.relay
        if relay is not None and relay.delegates:
            if self.board is None:  # elected, and its connection to the board not made yet
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
        """A delegate tells its followers its position, its spec's digest and what it saw of the
        counters it watches (:meth:`Watch.state`)."""
        relay = self.relay
        if relay is not None and relay.delegates and relay.followers:
            state = {"spec": job.spec.digest, "watched": Watch.state(job.watched)}
            relay.keep_alive(job.next_event, json.dumps(state, separators=(",", ":")))

    def _starts(self, job: _Job) -> list[int]:
        """The ranks whose watched ranks this monitor reads (:meth:`Ring.watched_from`).

        A node's relay delegate watches for the whole node: the successor of each of the node's
        ranks (whether its own rank is in the job or not, and for those lost too: the successor
        of a rank of its node lost alone is watched from another node so). So a node lost whole is
        found by the one delegate of the node before it in the ring, at one or two of its looks
        (its ranks' last beats came within one interval), and published in one or two entries, not
        eight: the board's delivery is the store's work per entry. A follower whose delegate
        speaks watches nothing; one whose delegate said nothing for more than two of its ticks
        watches for the node if it holds the node's watch name (one follower does), else nothing;
        one alone (no relay here) or whose spec differs (a recovery its delegate was not told of)
        watches its own successor."""
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
        """Read the counters this monitor watches (:mod:`~hypergrid.liveness.watch`), and publish
        those found lost, in one entry."""
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
        """Put ``events`` on the job's board, in one entry (nothing where no job is served), in
        the first free slot from the next this monitor would read, less the losses the board
        already has (:func:`~hypergrid.liveness.board.claim_slot`), then count it."""
        job = self.job
        if job is None:
            return
        channel, first = job.spec.channel, job.next_event
        if self.link.call(lambda store: claim_slot(store, channel, events, first)) is not None:
            self.link.call(lambda store: store.add(channel.board_count(), 1), again=False)

    def on_board(self) -> None:
        """The board connection is readable: its wait was answered, the entry it waited for is on
        the board. Read it, wait on the next one, forward its events: two requests per entry,
        whatever came before (an entry already published answers the new wait at once, and brings
        the monitor back here). A read the store answers late is waited for; one that fails is
        made again on a new connection (its wait answered at once)."""
        job, board = self.job, self.board
        if job is None or board is None:
            return
        channel = job.spec.channel
        index = job.next_event
        try:
            if not board.waiting:  # nothing asked yet: ask (answered at once where the event is there)
                board.start_wait([channel.board_slot(index)])
                return
            board.finish_wait()
            payload = board.read(channel.board_slot(index))
            board.start_wait([channel.board_slot(index + 1)])
        except STORE_ERRORS:
            self._drop_board()
            self._open_board()
            return
        job.next_event += 1
        if self.relay is not None:
            self.relay.send(index, payload.decode())
        self._deliver_entry(payload)

    def _deliver_entry(self, payload: bytes | str) -> None:
        for event in decode_events(payload):
            self.deliver(event)
        if self.job is not None and self._reached is not None:
            self._reached(self.job.spec.channel, self.job.next_event)

    def deliver(self, event: BoardEvent) -> None:
        """Take in one event of the job's board and forward it to the rank."""
        job = self.job
        if job is None:
            return
        if event.kind is EventKind.LOST:
            job.lost[event.rank] = event.reason
        elif event.kind is EventKind.BACK:
            job.lost.pop(event.rank, None)
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


# ---------------------------------------------------------------------- the process
class _ParentPipe:
    """Lines to the rank (its stdout pipe), never blocking the monitor: a rank that holds the GIL
    reads nothing, and what does not fit waits here."""

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
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The monitor process: ``python -c 'from hypergrid.liveness.monitor import main; main()' CONFIG``,
    started by :func:`hypergrid.liveness.heartbeat.start_heartbeat` with pipes to and from its rank."""
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
    monitor.link.start_beats()  # from now on its beats go out apart from its reads
    try:
        while True:
            now = time.monotonic()
            if now >= next_tick:
                monitor.tick(now=now)
                next_tick = now + config.interval_s
            if parent is None and os.getppid() != config.parent_pid:  # no pidfd: reparented means ended
                monitor.parent_ended()
                return 0
            board = monitor.readers()
            readers = [fd for fd in (parent, stdin) if fd is not None] + board
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
                chunk = os.read(stdin, 65536)
                if not chunk:
                    stdin = None  # the rank closed it (or ended): its end is seen by its pid
                    continue
                lines, _, inbox = (inbox + chunk).rpartition(b"\n")
                for line in lines.split(b"\n") if lines else []:
                    if _handle(monitor, line.decode(), time.monotonic()):
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
    elif word == "resume":  # a monitor started again: from where its rank's last one had reached
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
