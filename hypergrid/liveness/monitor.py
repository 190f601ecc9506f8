"""A rank's monitor: the process that beats for it, watches for its node, and publishes losses.

Each rank of a resilient job runs one (:func:`hypergrid.start_heartbeat` starts it); it is a
process of its own, in a session of its own, that imports no torch (some 8 MB), so that nothing
the rank's interpreter does (a C call holding the GIL for seconds, a SIGSTOP, a launcher ending
the rank's process group) stops it. Every ``interval_s`` a node's monitors make two store
requests per rank (one ``add`` each), whatever the job's size:

- each adds 1 to its rank's heartbeat counter;
- the node's relay delegate (:mod:`hypergrid.liveness.relay`) reads, for each rank of its node, the
  counter of the rank it watches, its successor in the job's ring (:mod:`hypergrid.liveness.ring`,
  on another node, and where nodes are short of ranks those after it on that node:
  :meth:`~hypergrid.liveness.ring.Ring.watched_from`); a monitor alone (no relay, a delegate silent for more than two of its ticks,
  or one that watches an older ring of the job) reads its own successor's. A counter that made
  no beat for ``stale_beats`` intervals of the monitor's own clock (no clocks are compared across
  hosts), counted from the look before the one that saw its last beat and over ``stale_beats``
  looks (a watcher that could not run meanwhile saw nothing stand still), means that rank's node,
  or its monitor, is gone: the watcher publishes the losses of one look in one entry, and watches
  the next rank too. So a
  rank silent for the bound is on the board by then (having been silent for between the bound
  less one interval and the bound), the interval after it is left for the board's delivery, and
  a node lost whole takes one or two entries of the board, not one per rank.

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

:class:`RankMonitor` is that work for one rank, driven by a loop: this module's :func:`main` in
the monitor process, or the control-plane benchmark's, which runs thousands of them against one
real store.

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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..store.keys import DEPARTED, JobChannel, beat_key
from ..store.records import BoardEvent, EventKind, decode_events, encode, encode_events
from ..store.tcpstore import StoreProtocolError, StoreTimeout, WireStore
from .board import put_entry
from .relay import NodeRelay, socket_name
from .ring import Ring, from_runs

__all__ = ["MonitorConfig", "JobSpec", "RankMonitor", "main", "DEFAULT_PROGRESS_TIMEOUT_S", "STALE_BEATS"]

#: How long a rank's interpreter may make no progress before it counts as hung (as NVIDIA
#: Resiliency Extension's in-process restart, minutes: pauses of seconds are routine at scale).
DEFAULT_PROGRESS_TIMEOUT_S = 180.0
#: How many heartbeat intervals a counter may stand still before its rank counts as gone.
STALE_BEATS = 5


@dataclass(frozen=True)
class MonitorConfig:
    """What a monitor needs: the store's address, the world's control namespace, its rank, the
    heartbeat interval, the staleness bound in intervals and the progress timeout."""

    host: str
    port: int
    namespace: str
    rank: int
    interval_s: float = 1.0
    stale_beats: int = STALE_BEATS
    progress_timeout_s: float = DEFAULT_PROGRESS_TIMEOUT_S
    connect_timeout_s: float = 30.0
    parent_pid: int = 0

    @property
    def stale_after_s(self) -> float:
        return self.stale_beats * self.interval_s


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
class _Watched:
    value: int
    #: When the counter's last beat may have come at the earliest: the look before the one that
    #: first found ``value`` (the beat came between the two), or that first look where there was
    #: none before it.
    since: float
    #: When a look first found ``value``: the beat came at this moment at the latest.
    first_seen: float
    #: When the watcher last looked.
    last_look: float
    #: How many looks found the counter at ``value``: a watcher that did not run for a while (an
    #: overloaded host) has not seen the counter stand still, it has not looked.
    looks: int = 1


@dataclass
class _Job:
    spec: JobSpec
    ring: Ring
    next_event: int
    lost: dict[int, str] = field(default_factory=dict)
    watched: dict[int, _Watched] = field(default_factory=dict)


class RankMonitor:
    """One rank's control-plane work (see the module): :meth:`tick` every interval,
    :meth:`on_ready` when one of :meth:`readers` is readable, :meth:`progress` on each tick of the
    rank's interpreter, :meth:`parent_ended` when the rank's process is gone.

    ``forward`` receives every event of the board (in the monitor process: sent to the rank).
    """

    def __init__(self, config: MonitorConfig, *, forward: Callable[[BoardEvent], None], now: float,
                 connect: Optional[Callable[[float], WireStore]] = None) -> None:
        self.config = config
        self._forward = forward
        # Where its connections come from (a timeout in, a connection out): the store's address by
        # default; a caller that hosts many monitors (or a proxy in front of the store) gives its own.
        self._connect: Callable[[float], WireStore] = connect or (
            lambda timeout_s: WireStore.connect(self.config.host, self.config.port, timeout_s=timeout_s))
        # Beats, reads and publications: one round trip each.
        self.store = self._connect(config.connect_timeout_s)
        self.board: Optional[WireStore] = None  # the node's one wait pending on the board's next event
        self.relay: Optional[NodeRelay] = None  # the node's monitors: this one is its delegate, or follows it
        self._delegate_quiet = 0  # this monitor's ticks since its delegate last said anything
        # What the node's delegate last told of its watch: the digest of its job spec (a follower
        # whose spec differs watches for itself), and the counters it watched, which this monitor
        # takes over once it watches (it was elected, or went alone).
        self._delegate_spec: Optional[str] = None
        self._delegate_watched: Optional[list[list[float]]] = None
        self.job: Optional[_Job] = None
        self.last_progress = now
        self.hung_published = False
        self.closed = False

    # ------------------------------------------------------------------ the job
    def attach(self, spec: JobSpec) -> None:
        """Serve ``spec``'s job from now on (the same job again: its ranks changed after a recovery)."""
        if self.job is not None and self.job.spec.channel == spec.channel:
            self.job = _Job(spec, Ring.of(from_runs(spec.runs), spec.gpus_per_node), self.job.next_event, self.job.lost)
            return
        self._leave_board()
        first = self.store.add(spec.channel.board_count(), 0)
        self.job = _Job(spec, Ring.of(from_runs(spec.runs), spec.gpus_per_node), first)
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
        board = f"{self.config.host}:{self.config.port}/{job.spec.channel.board_count()}"
        self.relay = NodeRelay.join(socket_name("relay", board, node))
        self._delegate_quiet = 0
        self._delegate_spec = None
        if self.relay.delegates:
            self._open_board(within_s=None if first else self.config.interval_s / 2)

    def _open_board(self, within_s: Optional[float]) -> None:
        """Connect to the board and wait on its next event. ``within_s``: a delegate elected while the
        job runs tries for that long only, and again at its next tick, so that its own beats go on
        (a store takes a new connection seconds late now and then, and a monitor that stops beating
        for the staleness bound is published as lost)."""
        job = self.job
        assert job is not None
        if within_s is None:
            board = self._connect(self.config.connect_timeout_s)
        else:
            try:
                board = self._connect(within_s)
            except (OSError, StoreProtocolError):
                return
        self.board = board
        board.start_wait([job.spec.channel.board_slot(job.next_event)])

    def _go_alone(self) -> None:
        """Stop counting on the node's delegate (it said nothing for the staleness bound: alive but
        stuck): wait on the board itself from here on, for this job."""
        assert self.relay is not None
        self.relay.close()
        self.relay = NodeRelay(None, None)
        self._open_board(within_s=self.config.interval_s / 2)

    def _leave_board(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.board is not None:
            self.board.close()
            self.board = None

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
        joined the relay after its delegate read them, or changed delegate): rare, a get each.

        Every entry before a delegate's position was read by it, so it is written; the read waits
        half an interval at most all the same (an entry not had then is passed over), so that a
        store slow to answer does not hold the monitor's beats back."""
        while job.next_event < position:
            key = job.spec.channel.board_slot(job.next_event)
            job.next_event += 1
            try:
                payload = self.store.get(key, within_s=self.config.interval_s / 2)
            except StoreTimeout:
                continue
            self._deliver_entry(payload)

    # ------------------------------------------------------------------ every interval
    def tick(self, *, now: float) -> None:
        """Beat, look at the watched ranks, and judge the rank's own progress."""
        self.store.add(beat_key(self.config.namespace, self.config.rank), 1)
        job = self.job
        if job is None:
            return
        relay = self.relay
        if relay is not None and relay.delegates:
            if self.board is None:  # elected, and its connection to the board not made yet
                self._open_board(within_s=self.config.interval_s / 2)
        elif relay is not None:
            self._delegate_quiet += 1
            if self._delegate_quiet > self.config.stale_beats + 1:
                self._go_alone()
        self._watch(job, now)
        relay = self.relay
        if relay is not None and relay.delegates and relay.followers:  # after the watch: what it saw now
            relay.keep_alive(job.next_event, self._watch_state(job))
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

    def _watch(self, job: _Job, now: float) -> None:
        """Read the counters this monitor watches, and publish those found lost, in one entry.

        A node's relay delegate watches for the whole node: the successor of each of the node's
        ranks. So a node lost whole is found by the one delegate of the node before it in the ring, at one or
        two of its looks (its ranks' last beats came within one interval), and published in one
        or two entries, not eight: the board's delivery is the store's work per entry. A follower
        whose delegate speaks watches nothing; one alone (no relay here, or its delegate silent for
        more than two of its ticks, or one whose spec differs: a recovery it was not told of)
        watches its own successor.
        """
        me, ring = self.config.rank, job.ring
        relay = self.relay
        following = (relay is not None and not relay.delegates and self._delegate_quiet <= 2
                     and self._delegate_spec in (None, job.spec.digest))
        for_node = relay is not None and relay.delegates and relay.listener is not None
        # A delegate watches for its node's ranks of the job, whether its own rank is one or not,
        # and for those lost too: the successor of a rank of its node lost alone is watched from
        # another node so (and from its own, by the lost rank's watcher, walking past it: its loss
        # may be published twice, which readers take as once; but a node lost whole with it is
        # seen at once, not a bound later).
        starts = ring.on_node(me // ring.gpus_per_node) if for_node else [me] if me in ring else []
        if len(ring) < 2 or following or not starts:
            job.watched.clear()
            return
        self._take_over(job)
        # The successors' counters read together, one round trip (a node's eight in one); those
        # past a lost or departed rank, rare, one at a time.
        firsts = sorted({r for start in starts for r in ring.watched_from(start)} - job.lost.keys() - {me})
        read = dict(zip(firsts, self.store.add_many([beat_key(self.config.namespace, r) for r in firsts], 0)))
        visited: set[int] = set()
        found: list[BoardEvent] = []
        for start in starts:
            self._walk(job, start, now, visited, found, read)
        for rank in [r for r in job.watched if r not in visited]:
            del job.watched[rank]
        if found:
            self.publish(*found)

    def _watch_state(self, job: _Job) -> str:
        """What a delegate tells its followers of its watch, with its position: its spec's digest
        and what it saw of each counter (times of the host's monotonic clock, which the node's
        monitors share)."""
        watched = [[rank, w.value, w.since, w.first_seen, w.last_look, w.looks] for rank, w in job.watched.items()]
        return json.dumps({"spec": job.spec.digest, "watched": watched}, separators=(",", ":"))

    def _take_over(self, job: _Job) -> None:
        """Continue from what the node's last delegate saw of the counters this monitor now watches
        (it was elected, or went alone): a rank lost just before a delegate changed is published
        within the bound of its last beat still, not a bound after the change."""
        told, self._delegate_watched = self._delegate_watched, None
        for rank, value, since, first_seen, last_look, looks in told or []:
            if int(rank) in job.ring and int(rank) not in job.watched:
                job.watched[int(rank)] = _Watched(int(value), since=since, first_seen=first_seen, last_look=last_look,
                                                  looks=int(looks))

    def _walk(self, job: _Job, start: int, now: float, visited: set[int], found: list[BoardEvent],
              read: dict[int, int]) -> None:
        """Look at the counters :meth:`Ring.watched_from` ``start`` (``read``: counters read
        already): its successor's, and past a lost or departed one the next one's too. Those
        found lost go to ``found``."""
        me, ring, stale_after = self.config.rank, job.ring, self.config.stale_after_s
        candidate = ring.successor(start)
        while candidate not in (me, start) and candidate not in visited:
            visited.add(candidate)
            following = ring.successor(candidate)
            if candidate in job.lost:
                candidate = following
                continue
            value = read.pop(candidate) if candidate in read else self.store.add(
                beat_key(self.config.namespace, candidate), 0)
            seen = job.watched.get(candidate)
            if value < 0:  # it left cleanly: nobody's loss
                candidate = following
                continue
            if seen is None or seen.value != value:
                job.watched[candidate] = _Watched(value, since=now if seen is None else seen.last_look, first_seen=now,
                                                  last_look=now)
            else:
                seen.looks += 1
                seen.last_look = now
                # Judged from the earliest moment the last beat may have come, so that a rank
                # silent for the bound is published by then (its silence is between the bound less
                # one interval and the bound), and the board's delivery has the interval after it.
                # The looks count the intervals (a watcher that stalled before it saw the last beat
                # has a ``since`` long past, but still needs its looks since); the clock only
                # guards against looks that came too fast. Half an interval of slack: two ticks' own
                # lateness differ, and a bound met to the microsecond would otherwise cost a whole
                # further interval half of the time.
                if seen.looks >= self.config.stale_beats and now - seen.since >= stale_after - self.config.interval_s / 2:
                    job.lost[candidate] = "stale"
                    found.append(BoardEvent(EventKind.LOST, candidate, (
                        f"its heartbeat stopped: its last beat came {now - seen.first_seen:.1f}-{now - seen.since:.1f} "
                        f"s ago (the bound is {stale_after:g} s): its node, or its monitor, is gone"), by=me))
                    candidate = following
                    continue
            # Alive as far as seen: the rank after it is its watcher's, unless it is on this one's
            # node (only some nodes have its local index), where it would be watched from a node
            # lost with it.
            if not ring.run_goes_on(candidate, following, start):
                return
            candidate = following

    # ------------------------------------------------------------------ the board
    def publish(self, *events: BoardEvent) -> None:
        """Put ``events`` on the job's board, in one entry (nothing where no job is served), in
        the first free slot from the next this monitor would read (:func:`~hypergrid.store.keys.put_entry`)."""
        job = self.job
        if job is not None:
            put_entry(self.store, job.spec.channel, encode_events(events).encode(), job.next_event)

    def on_board(self) -> None:
        """The board connection is readable: its wait was answered, the entry it waited for is on
        the board. Read it, wait on the next one, forward its events: two requests per entry,
        whatever came before (an entry already published answers the new wait at once, and brings
        the monitor back here)."""
        job, board = self.job, self.board
        if job is None or board is None:
            return
        channel = job.spec.channel
        if not board.waiting:  # nothing asked yet: ask (answered at once where the event is there)
            board.start_wait([channel.board_slot(job.next_event)])
            return
        board.finish_wait()
        index = job.next_event
        payload = board.read(channel.board_slot(index))
        job.next_event += 1
        board.start_wait([channel.board_slot(job.next_event)])
        if self.relay is not None:
            self.relay.send(index, payload.decode())
        self._deliver_entry(payload)

    def _deliver_entry(self, payload: bytes | str) -> None:
        for event in decode_events(payload):
            self.deliver(event)

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
            self.store.add(beat_key(self.config.namespace, self.config.rank), DEPARTED)
            self.close()

    def close(self) -> None:
        self.closed = True
        self.store.close()
        self._leave_board()


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
        monitor = RankMonitor(config, forward=lambda e: out.send("event " + encode(e)), now=time.monotonic())
    except (OSError, StoreProtocolError) as exc:
        out.send(f"error the monitor could not reach the job's store at {config.host}:{config.port}: "
                 f"{type(exc).__name__}: {exc}")
        return 2
    parent = _parent_watch(config.parent_pid)
    stdin: Optional[int] = sys.stdin.fileno()
    inbox = b""
    next_tick = time.monotonic()
    out.send("ready")
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
