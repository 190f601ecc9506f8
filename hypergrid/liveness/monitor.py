"""A rank's monitor: the process that speaks for it on its node, and its node's delegate's work.

Each rank of a resilient job runs one (:func:`hypergrid.start_heartbeat`): a process in a session
of its own, with no torch, so that nothing the rank's interpreter does (a GIL held, a SIGSTOP)
stops it. A node's monitors elect a delegate (:mod:`~hypergrid.liveness.relay`), and only it talks
to the store, for the whole node: every interval it beats the node's counter and reads the counters
of the nodes its node watches in the ring of nodes (two requests per node, whatever the job's
size; in a job whose nodes read the board in groups, a group's reader beats and reads for all the
group's nodes in one message, each delegate asking it over the group's link), hears its node's monitors over the node's socket (each says every interval that it is alive:
:mod:`~hypergrid.liveness.node`), keeps the node's one wait on the board and hands each entry on.
A node whose counter stands still is lost whole, its ranks in one entry; a rank whose monitor
falls silent on a live node is published by the delegate. A follower hands what it would publish
to its delegate (and to the next one, until it is on the board); one follower stands by with a
connection made, and takes the watch over once the delegate is quiet for two intervals (frozen:
its keep-alive comes from a thread of its own, so a store that answers late does not make it quiet).
Followers whose delegate stays quiet past the staleness bound go alone, and follow it again once it
answers (a delegate frozen, then let run).

The rank's end is seen from outside (a ``pidfd``, else its parent pid every 0.1 s) and published at
once; a hang only after ``progress_timeout_s`` with no tick from its interpreter; ``bye`` leaves the
node cleanly (its last monitor marks the node :data:`~hypergrid.store.keys.DEPARTED`). A late store
is waited for up to ``connect_timeout_s``, and a monitor started again resumes at the board position
its rank was last told.

Example, one rank's monitor against a store of torch's, its parent played by this process: the
job's other node (node 1) beats once, then never again::

    >>> import torch.distributed as dist
    >>> from hypergrid.store.keys import JobChannel
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> config = MonitorConfig("127.0.0.1", server.port, "ns", rank=0, interval_s=1.0)
    >>> seen = []
    >>> monitor = RankMonitor(config, forward=seen.append, now=0.0)
    >>> job = JobSpec(JobChannel("ns", "job", 0), ((0, 2),), gpus_per_node=1)
    >>> monitor.attach(job)
    >>> monitor.tick(now=0.0); server.add("ns/node/1/1", 1)          # node 1 beats once
    1
    >>> for second in range(1, 7):                                  # then never again: after 5
    ...     monitor.tick(now=float(second))                        # seconds of standing still, it is gone
    >>> monitor.on_board(); [(e.kind.value, e.rank, e.by) for e in seen]
    [('lost', 1, 0)]
    >>> monitor.close()
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional

from ..store.keys import DEPARTED, JobChannel, node_beat_key
from ..store.records import BoardEvent, EventKind, decode_events, encode_events
from ..store.tcpstore import StoreProtocolError, WireStore
from .board import claim_slot, note_losses
from .calls import NodeCalls
from .config import DEFAULT_PROGRESS_TIMEOUT_S, STALE_BEATS, START_TIMEOUT_S, JobSpec, MonitorConfig
from .fanout import QUIET_TICKS, READER_LOOKS, GroupLink, follow_reader, lead_group
from .link import STORE_ERRORS, StoreLink
from .node import NodeRanks
from .progress import RankProgress, frozen_delegate, rank_process, tick_every_s
from .relay import NodeNames, NodeRelay, Relayed, Role
from .served import ServedJob
from .watch import Watch

__all__ = ["MonitorConfig", "JobSpec", "RankMonitor", "DEFAULT_PROGRESS_TIMEOUT_S", "KEEP_ALIVE_OVERDUE", "STALE_BEATS",
           "START_TIMEOUT_S"]

#: How many intervals after a delegate's last word its keep-alive thread speaks for a loop held up
#: (a late store): its followers hear it at least every 1.5 intervals, so none counts more than two
#: quiet ticks (where a standby takes the watch over); a loop that speaks in time wakes nobody twice.
KEEP_ALIVE_OVERDUE = 1.5


class RankMonitor:
    """One rank's monitor, driven by a loop: :meth:`tick` every interval, :meth:`on_ready` when one of
    :meth:`readers` is readable, :meth:`progress` on the rank's ticks, :meth:`parent_ended` at its end,
    and :meth:`keep_alive` every interval from a thread (a delegate's word to its node, whatever the
    store does). ``forward`` gets every event of the board; ``reached`` the board's position after each entry."""

    def __init__(self, config: MonitorConfig, *, forward: Callable[[BoardEvent], None], now: float,
                 connect: Optional[Callable[[float], WireStore]] = None,
                 reached: Optional[Callable[[JobChannel, int], None]] = None) -> None:
        self.config = config
        self._forward = forward
        self._reached = reached
        # ``connect``: a caller hosting many monitors (or a proxy in front of the store) gives its own.
        self.link = StoreLink(connect or (lambda s: WireStore.connect(config.host, config.port, timeout_s=s)),
                              give_up_s=config.connect_timeout_s)
        self.board: Optional[WireStore] = None  # the node's one wait pending on the board's next event
        self._board_waits_on = -1  # the entry the board's pending wait is for
        self._put_from: Optional[int] = None  # the first entry it put and took in itself this interval
        self.group: Optional[GroupLink] = None  # its group's reader's end, or its connection to that reader
        self._shunned: set[str] = set()  # readers that failed this delegate: it waits on the board itself
        self._reader_looks = 0  # how many times this delegate looked for its group's reader since attaching
        self.relay: Optional[NodeRelay] = None  # the node's monitors: this one is its delegate, or follows it
        self._probe: Optional[NodeRelay] = None  # gone alone: a connection to the node's name, until its holder answers
        self.node_ranks: Optional[NodeRanks] = None  # a delegate's: what its node's monitors said
        self.names = NodeNames("", 0)  # the node's relay and its standby's name (held: this one stands by)
        self._delegate_quiet = 0  # this monitor's ticks since its delegate last said anything
        self._answered = False  # a follower said it is alive, answering its delegate, since its last tick
        self._told: dict = {}  # what the delegate last told: its spec's digest, its watch, whom it heard
        self._state = ""  # what this delegate tells its node's monitors at each keep-alive
        #: When (the host's monotonic clock) it last spoke to its node and group, from its loop or its thread.
        self.spoke_at = 0.0
        #: Set once this monitor first serves its node (its delegate, or alone): :meth:`keep_alive` has work.
        self.served = threading.Event()
        self._unconfirmed: list[BoardEvent] = []  # handed to the delegate to publish, not yet on the board
        self.calls = NodeCalls()  # the node's ranks' calls held for a batch (a delegate), or handed on (a follower)
        self._leaving = False
        self.job: Optional[ServedJob] = None
        self.now = now
        self.rank_progress = RankProgress(config.progress_timeout_s, now, slack_s=tick_every_s(
            config.interval_s, config.progress_timeout_s) - config.interval_s)
        self.closed = False

    @property
    def role(self) -> Optional[Role]:
        """What this monitor is to its node now (None: it serves no job, or is between two elections)."""
        return self.relay.role if self.relay is not None else None

    def call_route(self) -> Optional[NodeRelay]:
        """Where the rank's calls go (:meth:`NodeCalls.ask`): the node's relay, but none from a follower
        whose delegate said nothing for two intervals (frozen, maybe): its rank makes them itself."""
        quiet = self.role is Role.FOLLOWER and self._delegate_quiet > 2
        return None if quiet else self.relay

    @property
    def node(self) -> int:
        """This rank's node in the attached job (0 with none)."""
        return self.config.rank // self.job.spec.gpus_per_node if self.job is not None else 0

    def _node_key(self, node: int) -> str:
        assert self.job is not None
        return node_beat_key(self.config.namespace, node, self.job.spec.gpus_per_node)

    # ------------------------------------------------------------------ the job
    def attach(self, spec: JobSpec, first: Optional[int] = None) -> None:
        """Serve ``spec``'s job (the same job again: its ranks changed), reading its board from entry
        ``first`` (a monitor started again), else from its delegate's position or the board's count."""
        if self.job is not None and self.job.spec.channel == spec.channel:
            self.job = ServedJob.of(spec, self.job.next_event, self.job.lost)
            return
        self._leave_board(say=True)
        self._shunned.clear()
        self._reader_looks = 0
        self._put_from = None
        self.job = ServedJob.of(spec, -1 if first is None else first)
        if first is not None:
            self._tell_reached(self.job)
        self._join_board(first=True)

    def detach(self) -> None:
        """Serve no job (the rank left it)."""
        self._leave_board(say=True)
        self.job = None

    def _tell_reached(self, job: ServedJob) -> None:
        if self._reached is not None and job.next_event >= 0:
            self._reached(job.spec.channel, job.next_event)

    def _join_board(self, first: bool = False) -> None:
        """Be the node's delegate or follow it; ``first``: as the job is attached (a store that cannot
        be reached is then an error)."""
        job = self.job
        assert job is not None
        board = f"{self.config.host}:{self.config.port}/{job.spec.channel.board_count()}"
        if (board, self.node) != (self.names.board, self.names.node):  # electing again on its node: still standing by
            self.names.release()
            self.names = NodeNames(board, self.node)
        self.relay = NodeRelay.join(self.names.relay)
        self._delegate_quiet = 0
        if self.relay.role is not Role.FOLLOWER:
            self._delegate(fatal=first)
            return
        self._greet(self.relay)

    def _greet(self, relay: NodeRelay) -> None:
        """A follower's first words to its delegate: it is here, and what it handed on and is not on the board yet."""
        relay.tell(f"hi {self.config.rank}")
        if self._unconfirmed:
            relay.tell("pub " + encode_events(self._unconfirmed))

    def _delegate(self, fatal: bool = False) -> None:
        """Serve the node: beat for it, watch for it, wait on the board for it, hear its monitors."""
        job, relay = self.job, self.relay
        assert job is not None and relay is not None
        self.served.set()  # before its first call: a late store's answer must not keep its followers waiting
        self.names.release()
        self._hear_node()
        known = job.next_event >= 0
        if not known:  # told nothing by a delegate: from the board's count
            count = self.link.call(lambda store: store.add(job.spec.channel.board_count(), 0))
            assert count is not None
            with relay.lock:  # a follower the keep-alive thread took meanwhile hears it before any entry
                job.next_event = count
                relay.keep_alive(count, self._state)
            self._tell_reached(job)
        self._open_board(fatal=fatal, catch_up=known and not fatal)
        pending, self._unconfirmed = self._unconfirmed, []
        if pending:
            self.publish(*pending)

    def _hear_node(self) -> None:
        """A delegate with a listener hears its node's monitors, from what the last delegate told."""
        if self.role is Role.DELEGATE:
            self.node_ranks = NodeRanks(self.config.rank, self.config.interval_s, self.config.stale_beats,
                                        START_TIMEOUT_S, self.now)
            self.node_ranks.adopt(self._told, self.now)

    def _open_board(self, fatal: bool = False, catch_up: bool = True) -> None:
        """Connect to the board and wait on its next entry; unless ``fatal``, a failed connection is tried
        again at the next tick. A monitor taking the board over mid-job first catches up on the connection
        it has: torch's server resolves each new client's name on the thread that answers everyone (a
        dropped DNS query holds it 5 s), and the entry (often its rank's own end) must not wait for that."""
        job = self.job
        assert job is not None
        if catch_up:
            published = self.link.call(lambda store: store.add(job.spec.channel.board_count(), 0))
            assert published is not None
            self._catch_up(job, published)
        if self._follow_reader(job):
            return
        try:
            board = self.link.connection(self.config.connect_timeout_s)
        except (OSError, StoreProtocolError):
            if fatal:
                raise
            return
        self.board = board
        try:
            board.start_wait([job.spec.channel.board_slot(job.next_event)])
            self._board_waits_on = job.next_event
        except STORE_ERRORS:
            self._drop_board()
            return
        self._lead_group(job, board)

    def _follow_reader(self, job: ServedJob) -> bool:
        """A delegate whose node's group another reads hears the board from that reader; whether it does."""
        self._reader_looks += 1
        group = follow_reader(self.link, job, self.node, self._shunned)
        if group is None:
            return False
        self._drop_board()
        self.group = group
        return True

    def _lead_group(self, job: ServedJob, board: WireStore) -> None:
        """The delegate of its group's reader node listens for the group's delegates and says where."""
        self.group = lead_group(self.link, job, self.node, board.local_host)

    def _read_board_again(self) -> None:
        """The reader went, dropped this delegate or stayed quiet: wait on the board itself, from where it read."""
        if self.group is not None:
            self._shunned.add(self.group.address)
        self._drop_board()
        self._open_board()

    def _drop_board(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.group is not None:
            self.group.close()
            self.group = None

    def _go_alone(self) -> None:
        """Stop counting on the node's delegate (silent for the staleness bound): serve the node alone."""
        assert self.relay is not None
        self.calls.lose_handed_on()
        self.relay.close()
        self.relay = NodeRelay(None, None)
        self._delegate()

    def _rejoin(self) -> None:
        """A monitor gone alone looks for its node's delegate again, each interval: it holds the node's
        name where nobody does (the frozen delegate ended), else waits on a connection to its holder,
        which a frozen delegate answers with its position once it runs again (:meth:`_follow_again`)."""
        if self._probe is not None or self.relay is None:
            return
        joined = NodeRelay.join(self.names.relay)
        if joined.listener is not None:
            self.relay.close()
            self.relay = joined
            self.names.release()
            self._hear_node()
        elif joined.upstream is not None:
            self._probe = joined

    def _follow_again(self) -> None:
        """The node's delegate answered a monitor gone alone: follow it (its board wait is the node's again)."""
        probe, self._probe = self._probe, None
        assert probe is not None and self.relay is not None
        self.relay.close()
        self.relay, self._delegate_quiet = probe, 0
        self._drop_board()
        if self.names.standby is None:  # only the node's standby keeps a connection made
            self.link.drop()
        self._greet(probe)
        self._on_relayed(probe)

    def _leave_board(self, say: bool = False) -> None:
        """Leave the node's relay; ``say``: cleanly (a follower tells its delegate; a delegate tells its
        followers, or with none marks the node departed, nobody's loss)."""
        relay, job = self.relay, self.job
        if relay is not None and say and job is not None:
            while relay.accept(position=job.next_event):  # those still waiting hear it leave too
                pass
            if relay.role is Role.FOLLOWER:
                relay.tell(f"bye {self.config.rank}")
            elif relay.followers and self.node_ranks is not None:
                self.node_ranks.leave(self.config.rank)
                told = {**self.node_ranks.told(), "heard": sorted(self.node_ranks.heard)}
                relay.keep_alive(job.next_event, json.dumps({"spec": job.spec.digest, **told}, separators=(",", ":")))
            elif relay.role is Role.ALONE and self.names.held_by_another():
                pass  # gone alone: the node's delegate or standby is still there, and beats for it
            elif self.link.connected or self.node in job.nodes:
                with contextlib.suppress(*STORE_ERRORS):
                    self.link.call(lambda store: store.add(self._node_key(self.node), DEPARTED), again=False)
        if relay is not None:
            relay.close()
            self.relay = None
        self.node_ranks = None
        self._drop_probe()
        self._drop_board()
        self.names.release()

    def _drop_probe(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def readers(self) -> list[int]:
        """The descriptors :meth:`on_ready` handles: the board's wait, the relay's."""
        fds = [self.board.fileno()] if self.board is not None else []
        fds += self.group.readers() if self.group is not None else []
        fds += self._probe.readers() if self._probe is not None else []
        return fds + (self.relay.readers() if self.relay is not None else [])

    def on_ready(self, fd: int, now: Optional[float] = None) -> None:
        """``fd``, one of :meth:`readers`, is readable (``now``: the monitor's clock; its last tick's by default)."""
        relay = self.relay
        if self.board is not None and fd == self.board.fileno():
            self.on_board()
        elif self.group is not None and fd in self.group.readers():
            self._from_group(fd, self.now if now is None else now)
        elif self._probe is not None and fd in self._probe.readers():
            self._follow_again()
        elif relay is None or self.job is None:
            return
        elif relay.listener is not None and fd == relay.listener.fileno():
            relay.accept(position=self.job.next_event)
        elif relay.role is not Role.FOLLOWER:
            self._from_follower(relay.follower_ready(fd), fd)
        else:
            self._on_relayed(relay)

    def _from_follower(self, lines: Sequence[str], fd: int) -> None:
        """What a monitor of the node (at ``fd``) said: it is alive, it leaves, it hands over events to
        publish, or its rank's call, answered to it."""
        relay = self.relay
        for line in lines:
            word, _, rest = line.partition(" ")
            if word in ("hi", "alive") and self.node_ranks is not None:
                self.node_ranks.hear(int(rest), self.now)
            elif word == "bye" and self.node_ranks is not None:
                self.node_ranks.leave(int(rest))
            elif word == "pub":
                self.publish(*decode_events(rest))
            elif word == "call" and relay is not None:
                self.calls.from_follower(rest, relay, fd, now=time.monotonic())

    def _on_relayed(self, relay: NodeRelay) -> None:
        """The node's delegate sent entries (or its position), or went: then elect again."""
        job = self.job
        assert job is not None
        heard = self.calls.answers_taken(relay.receive())
        if heard is None:
            self.calls.lose_handed_on()
            relay.close()
            self._join_board()
            return
        self._delegate_quiet = 0
        if any(item.payload is None and item.answer is None for item in heard) and not self._answered:
            # Alive, in answer to its delegate's word: the node's followers answer together, and the
            # delegate wakes for them once or twice an interval rather than once for each.
            self._answered = relay.tell(f"alive {self.config.rank}")
        for item in heard:
            if item.payload is None:
                if item.state:
                    self._told = json.loads(item.state)
                if job.next_event < 0:
                    job.next_event = item.index
                    self._tell_reached(job)
            if job.next_event >= 0:
                self._take_relayed(job, item)

    def _take_relayed(self, job: ServedJob, item: Relayed) -> None:
        """An entry or a position relayed to this monitor: what it missed before it read from the store."""
        self._catch_up(job, item.index)
        if item.payload is not None and item.index == job.next_event:
            self._take_entry(job, item.payload)

    def _from_group(self, fd: int, now: float) -> None:
        """The group's fan-out is readable: a delegate joins the reader, or the reader sent entries, or
        it answered the node's beat with the counters the node watches: the watch looks at them now."""
        job, group = self.job, self.group
        assert job is not None and group is not None
        heard = group.on_ready(fd, job.next_event, now=time.monotonic())
        if heard is None:
            self._read_board_again()
            return
        for item in heard:
            self._take_relayed(job, item)
        counters = group.take_beaten()
        if counters is not None and self.group is group and self._watches(job):
            self._watch(job, now, given=counters)

    def make_calls(self, *, now: float) -> None:
        """Make the node's batches of calls that are due: through its group's reader where it has one
        (a group's calls made as one), else on its own connection; and, as a reader, its group's."""
        group = self.group
        self.calls.make_due(self.relay, self.link, now=now,
                            upstream=None if group is None else functools.partial(group.take_calls, now=now))
        if group is not None:
            group.make_due(self.link, now=now)

    def calls_due_at(self) -> Optional[float]:
        """When the next batch of calls (its node's, or its group's as a reader) is due at the latest."""
        due = [self.calls.due_at(), None if self.group is None else self.group.calls.due_at()]
        return min((at for at in due if at is not None), default=None)

    def _catch_up(self, job: ServedJob, position: int) -> None:
        """Read from the store, a get each, the entries before ``position`` this monitor missed (a change
        of delegate, a restart); a delegate hands each to its followers too."""
        while job.next_event < position:
            payload = self.link.call(functools.partial(_get, key=job.spec.channel.board_slot(job.next_event)))
            assert payload is not None
            self._take_entry(job, payload.decode())

    # ------------------------------------------------------------------ every interval
    def tick(self, *, now: float) -> None:
        """Speak to the node (a follower), beat and look at the watched nodes (the node's watcher), and
        judge the rank's own progress."""
        self.now = now
        self._put_from = None
        job, relay = self.job, self.relay
        if job is None:
            return
        if relay is not None and relay.role is Role.FOLLOWER:
            self._delegate_quiet += 1
            if not self._answered:  # its delegate quiet since its last tick: it still hears of this one
                relay.tell(f"alive {self.config.rank}")
            self._answered = False
            if self._delegate_quiet == self.config.stale_beats and self.names.standby is not None:
                # The standby publishes its delegate's rank, silent for the staleness bound: its monitor is stopped.
                self.publish(*frozen_delegate(self._told.get("me"), job.ring, job.lost, self._delegate_quiet,
                                              self.config.stale_beats * self.config.interval_s, self.config.rank))
            if self._delegate_quiet > self.config.stale_beats + 1:
                self._go_alone()
            elif self.names.standby is None:
                self._stand_by()
        else:
            if relay is not None and relay.role is Role.ALONE:
                self._rejoin()
            if self.group is not None and self.group.tick():
                self._read_board_again()
            elif self.board is None and self.group is None:
                self._open_board()
            elif self.group is None and self._reader_looks < READER_LOOKS:
                self._follow_reader(job)  # its reader may have begun to listen after it looked
        if self._watches(job):
            if not self._ask_reader_to_beat(job, now):
                self._watch(job, now)
        else:
            job.watched.clear()
        # Once an interval, after the watch (what it saw now): however late the store answers the
        # watch's calls, the keep-alive thread speaks meanwhile (:meth:`keep_alive`).
        self._keep_alive(job)
        hung = self.rank_progress.hung(self.config.rank, now)
        if hung is not None:
            self.publish(hung)

    def progress(self, *, now: float) -> None:
        """The rank's interpreter ran (it sent its tick)."""
        self.rank_progress.tick(now)

    def _stand_by(self) -> bool:
        """Be the follower that takes the node's watch over from a quiet delegate, if none is, its
        connection made now (a frozen delegate's node is beaten for within the bound); whether it is
        (True too where no name can be held: each on its own)."""
        if not self.names.stand_by():
            return False
        if self.names.standby is not None:
            self.link.open_soon()
        return True

    def _watches(self, job: ServedJob) -> bool:
        """Whether this monitor beats and watches for its node: its delegate does (or one alone); the
        standby once the delegate is quiet for two ticks; one told of a recovery its delegate was not
        (it watches in its own ring), each on its own where no name can be held."""
        role = self.role
        if role in (None, Role.DELEGATE):
            return True
        if role is Role.ALONE:  # its delegate quiet: the standby among them
            return self._stand_by()
        if self._told.get("spec") not in (None, job.spec.digest):
            return True
        return self._delegate_quiet > 2 and self._stand_by()

    def _keep_alive(self, job: ServedJob) -> None:
        """A delegate tells its followers its position, its spec's digest, its watch and whom it heard."""
        relay = self.relay
        if relay is None or relay.role is not Role.DELEGATE:
            return
        state = {"spec": job.spec.digest, "watched": Watch.state(job.watched),
                 "process": rank_process(self.config.parent_pid),
                 **(self.node_ranks.told() if self.node_ranks is not None else {})}
        self._state = json.dumps(state, separators=(",", ":"))
        if relay.followers:
            relay.keep_alive(job.next_event, self._state)
        if self.group is not None:
            self.group.keep_alive(job.next_event)
        self.spoke_at = time.monotonic()

    def keep_alive(self) -> None:
        """A delegate's word to its node, from a thread of the monitor's own where its loop's is overdue
        (:data:`KEEP_ALIVE_OVERDUE` intervals after :attr:`spoke_at`): a store that answers late holds
        up the delegate's calls, and must not make its followers take it for a frozen one. The
        followers that came meanwhile are taken here too (at attach, before its first call is answered,
        its position may be unknown, -1: they learn it before any entry)."""
        self.spoke_at = time.monotonic()
        relay, job, group = self.relay, self.job, self.group
        if relay is not None and job is not None and relay.role is Role.DELEGATE:
            with relay.lock:
                while relay.accept(position=job.next_event):
                    pass
                relay.keep_alive(job.next_event, self._state)
        if group is not None and job is not None:
            group.keep_alive(job.next_event)

    def _rule(self) -> Watch:
        return Watch(self.node, self.config.interval_s, self.config.stale_beats, START_TIMEOUT_S)

    def _ask_reader_to_beat(self, job: ServedJob, now: float) -> bool:
        """A group's delegate asks its reader to beat for its node with the group's next beat, and to
        read the counters its node watches (the watch looks when the answer comes); whether it may
        count on the reader: not where it has left the asks unanswered for :data:`QUIET_TICKS`
        intervals (frozen, or its store late), so a node's counter never stands still for longer."""
        group, node = self.group, self.node
        if group is None or group.leads or node not in job.nodes or len(job.nodes) < 2:
            return False
        reads = self._rule().firsts(job.nodes, [node], job.lost_nodes())
        return group.ask_beat(node, reads, now=now, within_s=QUIET_TICKS * self.config.interval_s)

    def _beat(self, node: int, reads: Sequence[int]) -> list[int]:
        """Beat for ``node`` and read the counters of ``reads``, in one message; a group's reader beats
        and reads for its delegates that asked in the same message, and answers each. The counters read."""
        group = self.group
        asked = group.take_beats() if group is not None and group.leads else []
        others = sorted({ask.node for ask in asked if ask.beat} - {node})
        every = list(dict.fromkeys([*reads, *(n for ask in asked for n in ask.reads)]))
        values = self.link.beat(self._node_key(node), [self._node_key(n) for n in every],
                                also=[self._node_key(n) for n in others])
        counters = dict(zip(every, values[1:1 + len(every)]))
        for ask in asked:
            assert group is not None
            group.answer_beat(ask.fd, {n: counters[n] for n in ask.reads})
        return [counters[n] for n in reads]

    def _watch(self, job: ServedJob, now: float, given: Optional[dict[int, int]] = None) -> None:
        """Beat for the node, read the counters of the nodes it watches (``given``: its group's reader
        beat and read them), hear what the node's monitors said, and publish those found lost in one entry."""
        node = self.node
        if node not in job.nodes:
            return
        beaten = given is not None

        def read(nodes: Sequence[int]) -> list[int]:
            nonlocal beaten
            if given is not None and all(n in given for n in nodes):
                return [given[n] for n in nodes]
            if beaten:  # walking on past a lost node: their counters in one round trip (None only with again=False)
                return self.link.call(lambda store: store.add_many([self._node_key(n) for n in nodes], 0)) or []
            beaten = True  # the node's beat, and its first reads in the same message
            return self._beat(node, nodes)

        Watch.take_over(job.watched, self._told.pop("watched", None), job.nodes)
        found: list[BoardEvent] = []
        if len(job.nodes) > 1:
            for gone in self._rule().look(read, job.nodes, [node], job.lost_nodes(), job.watched, now):
                found += [BoardEvent(EventKind.LOST, rank, gone.reason, by=self.config.rank)
                          for rank in job.ring.on_node(gone.rank) if rank not in job.lost]
        if not beaten:  # nothing to read: a beat of its own
            self._beat(node, [])
        if self.node_ranks is not None:
            found += self.node_ranks.silent([r for r in job.ring.on_node(node) if r not in job.lost], now)
        for event in found:
            job.lost[event.rank] = event.reason
        if found:
            self.publish(*found)

    # ------------------------------------------------------------------ the board
    def publish(self, *events: BoardEvent) -> Optional[int]:
        """Put ``events`` on the job's board in one entry (less the losses it has already), then count it;
        a follower hands them to its delegate, and again to the next one until they are on the board.
        The entry's index (None: handed on, or nothing was left to put)."""
        job, relay = self.job, self.relay
        if job is None or not events:
            return None
        if relay is not None and relay.role is Role.FOLLOWER and self._delegate_quiet <= 2:
            self._unconfirmed.extend(events)
            relay.tell("pub " + encode_events(list(events)))
            return None
        # From the first entry it put itself this interval, as if it had not read it yet: the same
        # losses handed on by several followers at once are put once.
        channel = job.spec.channel
        first = max(0, job.next_event if self._put_from is None else min(self._put_from, job.next_event))
        index = self.link.call(lambda store: claim_slot(store, channel, events, first))
        if index is not None:
            if index == first == job.next_event and not self._leaving:
                # Its next entry, put as it was given (the slot was free): handed on now, a store round
                # trip before its board's wait (or its reader) would have it read, and counted after.
                self._put_from = index
                self._take_entry(job, encode_events(list(events)))
            self.link.call(lambda store: store.add(channel.board_count(), 1), again=False)
        return index

    def on_board(self) -> None:
        """The board's wait was answered: read the entry, wait on the next, forward its events (two
        requests per entry; a wait only for an entry it put itself); a failed read is made again on a new connection."""
        job, board = self.job, self.board
        if job is None or board is None:
            return
        channel, index = job.spec.channel, job.next_event
        try:
            if not board.waiting:  # nothing asked yet: ask (answered at once where the entry is there)
                board.start_wait([channel.board_slot(index)])
                self._board_waits_on = index
                return
            board.finish_wait()
            if self._board_waits_on < index:  # it had that entry already (its own, handed on as put): the next
                board.start_wait([channel.board_slot(index)])
                self._board_waits_on = index
                return
            payload = board.read_then_wait(channel.board_slot(index), [channel.board_slot(index + 1)])
            self._board_waits_on = index + 1
        except STORE_ERRORS:
            self._drop_board()
            self._open_board()
            return
        self._take_entry(job, payload.decode())

    def _take_entry(self, job: ServedJob, payload: str) -> None:
        """Take in the job's next entry, read or relayed; a delegate hands it to its followers (a
        follower's relay has none)."""
        if self.group is not None:  # first: the group's delegates each hand it on again
            self.group.send(job.next_event, payload)
        if self.relay is not None:
            self.relay.send(job.next_event, payload)
        job.next_event += 1
        events = decode_events(payload)
        if self._unconfirmed:
            self._unconfirmed = [e for e in self._unconfirmed if not any(
                (x.kind, x.rank) == (e.kind, e.rank) for x in events)]
        for event in events:
            self.deliver(event)
        if self.job is not None:
            self._tell_reached(self.job)
        if self._leaving and not self._unconfirmed:
            self.depart()

    def deliver(self, event: BoardEvent) -> None:
        """Take in one event of the job's board and forward it to the rank."""
        job = self.job
        if job is None:
            return
        note_losses(job.lost, [event])
        self._forward(event)

    # ------------------------------------------------------------------ the end
    def parent_ended(self, reason: str = "its process ended") -> None:
        """The rank's process is gone (or going while the job counts on it): publish it, mark it left
        (a follower once its delegate put it on the board)."""
        if not self.closed:
            index = self.publish(BoardEvent(EventKind.LOST, self.config.rank, reason, by=self.config.rank))
            job = self.job
            if index is not None and job is not None and self.relay is not None and self.relay.followers:
                # A delegate hands its node the entry before it goes: the follower elected next would
                # otherwise hear its neighbour's end only once it has taken the board over.
                with contextlib.suppress(*STORE_ERRORS):
                    self._catch_up(job, index + 1)
            self.depart()

    def depart(self) -> None:
        """Mark the rank as left (nobody counts it lost) and stop, once what this monitor handed its
        delegate to publish is on the board."""
        if self.closed:
            return
        self._leaving = True
        if self._unconfirmed and self.role is Role.FOLLOWER:
            return  # the entry that has them closes it (or it publishes them alone, then closes)
        self._leave_board(say=True)
        self.close()

    def close(self) -> None:
        """Stop at once, saying nothing (as a killed monitor would)."""
        self.closed = True
        self.link.close()
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        self._drop_probe()
        self._drop_board()
        self.names.release()


def _get(store: WireStore, key: str) -> bytes:
    return store.get(key)
