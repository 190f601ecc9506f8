"""The recovery's control plane, piece by piece (hypergrid/control/): who watches whom, who is
failed, the monitor's own store client against torch's, and the monitor's work against a real
TCPStore with time given (no sleeping), up to a job of 2,048 simulated ranks.

The whole processes (a monitor seeing its rank die, a held GIL, a clean exit) are in
tests/test_control_monitor.py, the monitors of 16 to 64 stand-in ranks behind a store that
answers late in tests/test_control_late_store.py, and jobs of 8 and 16 ranks in
tests/test_control_jobs.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import select
import subprocess
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from hypergrid.liveness.board import put_entry
from hypergrid.liveness.config import DEFAULT_NODES_PER_READER
from hypergrid.liveness.fanout import QUIET_TICKS, READER_LOOKS, GroupLink
from hypergrid.liveness.monitor import JobSpec, MonitorConfig, RankMonitor
from hypergrid.liveness.relay import NodeRelay, Role
from hypergrid.liveness.ring import Ring, as_runs, from_runs
from hypergrid.liveness.watch import Watch
from hypergrid.recovery.quorum import RoundView, decide
from hypergrid.store.keys import DEPARTED, JobChannel, node_beat_key
from hypergrid.store.records import Arrival, BoardEvent, EventKind, decode_events, encode_events
from hypergrid.store.tcpstore import StoreProtocolError, WireStore


# ---------------------------------------------------------------------- the ring
@pytest.mark.parametrize("ranks, node", [
    (range(8), 4), (range(16), 8), (range(2048), 8), (range(12), 8),           # whole and partial nodes
    ([0, 1, 2, 3, 8, 9, 10, 11, 13], 4), ([5], 8), (range(7), 1), (range(10), 16),
    ([0, 1, 4, 5, 6, 7], 4), ([*range(6), *range(8, 16)], 8), ([0, 1, 4], 4),
])
def test_the_ring_watches_every_rank_exactly_once_and_from_another_node(ranks, node):
    ring = Ring.of(ranks, node)
    ranks = sorted(set(ranks))
    successors = {r: ring.successor(r) for r in ranks}
    assert sorted(successors.values()) == ranks  # a permutation: everyone is watched by one
    seen, rank = [], ranks[0]
    for _ in ranks:  # one cycle through all of them
        seen.append(rank)
        rank = successors[rank]
    assert sorted(seen) == ranks and rank == ranks[0]
    assert ring.order() == seen
    nodes = {r // node for r in ranks}
    if len(nodes) == 1:  # a watcher reads one counter: more of its own node would tell it nothing
        assert all(ring.watched_from(r) == [successors[r]] for r in ranks)
    if len(nodes) > 1:
        # With whole nodes, no rank is watched from its own node; with some nodes short of ranks,
        # the ring may go on to the next local index on the same node.
        same = [r for r, s in successors.items() if r // node == s // node]
        if all(sum(1 for r in ranks if r // node == n) == node for n in nodes):
            assert same == [], same
        # And those are read from another node all the same: with the successor they follow on their node.
        readers: dict[int, list[int]] = {}
        for reader in ranks:
            for rank in ring.watched_from(reader):
                readers.setdefault(rank, []).append(reader)
        for rank in ranks:
            assert any(r // node != rank // node for r in readers[rank]), (rank, readers[rank])


def test_runs_round_trip():
    ranks = [0, 1, 2, 7, 9, 10, 2047]
    assert list(from_runs(as_runs(ranks))) == ranks and as_runs([]) == []
    with pytest.raises(ValueError, match="gpus_per_node must be a positive number of ranks, got 0"):
        Ring.of([0, 1], 0)


# ---------------------------------------------------------------------- the verdict
def _view(arrived, lost=None, waited=0.0, domain=range(4), offers=()):
    arrivals = {r: (a if isinstance(a, Arrival) else Arrival(r, step=a)) for r, a in arrived.items()}
    return RoundView(0, list(domain), arrivals, lost or {}, waited, list(offers))


def test_a_rank_lost_on_the_board_is_failed_whether_it_arrived_or_not():
    verdict = decide(_view({0: 4, 1: 3, 2: 5}, {2: "its process ended", 3: "its heartbeat stopped"}),
                     bound_s=60, remaining_s=60)
    assert verdict.failed == (2, 3) and verdict.step == 3
    assert verdict.reasons == ("rank 2: it arrived, then its process ended",
                               "rank 3: its heartbeat stopped before it arrived")


def test_an_alive_absent_rank_is_waited_for_up_to_the_bound_then_counted_out_as_hung():
    assert decide(_view({0: 1, 1: 1, 2: 1}, waited=5.0), bound_s=10, remaining_s=60) is None
    verdict = decide(_view({0: 1, 1: 1, 2: 1}, waited=10.0), bound_s=10, remaining_s=60)
    assert verdict.failed == (3,) and "it hangs" in verdict.reasons[0]


def test_a_round_whose_deadline_comes_first_is_abandoned_naming_whom_it_waited_for():
    verdict = decide(_view({0: 1}, {1: "gone"}, waited=5.0), bound_s=10, remaining_s=0.1)
    assert verdict.failed == () and verdict.abandoned.startswith("ranks [2, 3] neither arrived nor were lost")


def test_offers_are_waited_for_and_reported_and_aborts_are_runs_of_ranks():
    arrived = {0: Arrival(0, 1, aborted=((0, 1),)), 1: Arrival(1, 1, aborted=((0, 1),)), 2: Arrival(2, 1),
               3: Arrival(3, 2, "grow"), 6: Arrival(6, None, "wait")}
    assert decide(_view(arrived, offers=[6, 7]), bound_s=60, remaining_s=60) is None  # offer 7 is waited for
    verdict = decide(_view(arrived, {7: "its process ended"}, offers=[6, 7]), bound_s=60, remaining_s=60)
    assert verdict.offered == (6,) and verdict.failed == (7,) and verdict.grow and verdict.recovering
    assert verdict.aborted_by == ((0, 2),)


# ---------------------------------------------------------------------- the monitor's client
@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def server(request):
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=request.param,
                         timeout=timedelta(seconds=30))


def test_the_wire_client_and_torch_s_client_reach_the_same_keys_with_every_message(server):
    wire = WireStore.connect("127.0.0.1", server.port, timeout_s=10)
    assert wire.add("n/count", 2) == 2 and server.add("n/count", 1) == 3 and wire.add("n/count", 0) == 3
    before = wire.requests
    assert wire.add_many(["n/count", "n/other", "n/count"], 0) == [3, 0, 3]  # sent together, answered in order
    assert wire.add_many([f"n/c{i}" for i in range(64)], 1) == [1] * 64 and wire.requests == before + 67
    wire.set("n/set", b"v")
    assert server.get("n/set") == b"v"
    server.set("n/torch", "t")
    assert wire.get("n/torch") == b"t"
    assert wire.check(["n/set", "n/torch"]) and not wire.check(["n/set", "n/absent"])
    assert wire.compare_set("n/cas", b"", b"a") == b"a" and wire.compare_set("n/cas", b"x", b"b") == b"a"
    wire.append("n/log", b"1")  # no answer comes back: a check behind it is answered once it is done
    assert wire.check(["n/log"])
    server.append("n/log", "2")
    assert wire.get("n/log") == b"12"
    assert wire.multi_get(["n/set", "n/torch"]) == [b"v", b"t"]
    assert wire.delete_key("n/cas") and not wire.delete_key("n/cas") and not server.check(["n/cas"])
    assert not wire.wait(["n/never"], 0.2)
    wire.start_wait(["n/later"])
    server.set("n/later", "1")
    assert wire.finish_wait() and not wire.waiting
    assert wire.read("n/later") == b"1"  # a key its wait was answered for: one get, no wait in front
    wire.start_wait(["n/never"])
    wire.cancel_wait()
    assert wire.add("n/count", 0) == 3  # the connection is still in step
    dist.PrefixStore("outer", dist.PrefixStore("inner", server)).set("k", "p")
    assert wire.get("inner/outer/k") == b"p"  # each layer puts its prefix in front, the innermost first
    wire.close()


def test_a_connection_s_calls_wait_their_own_timeout_not_the_time_it_had_to_open(server):
    quick = WireStore.connect("127.0.0.1", server.port, timeout_s=0.5, call_timeout_s=5.0)
    assert quick.timeout_s == 5.0 and not quick.wait(["n/never"], 0.1) and quick.add("n/c", 1) == 1
    assert WireStore.connect("127.0.0.1", server.port, timeout_s=3.0).timeout_s == 3.0  # the same, unless told


def test_a_store_stalled_past_a_ping_s_wait_is_waited_for_on_the_same_connection(server, monkeypatch):
    # A stalled store (a reverse lookup unanswered on its one thread) would queue another lookup for
    # each new connection: the client pings again on the one it has, and reads every echo, so that
    # its first call reads its own answer.
    from hypergrid.store import tcpstore
    from tests.store_proxy import StoreProxy

    monkeypatch.setattr(tcpstore, "_PING_TRY_S", 0.3)
    proxy = StoreProxy(server.port)
    try:
        proxy.stall(1.5)
        wire = WireStore.connect("127.0.0.1", proxy.port, timeout_s=10)
        assert proxy.accepted == 1
        assert (wire.add("n/stalled", 1), wire.add("n/stalled", 1), wire.get("n/stalled")) == (1, 2, b"2")
        wire.close()
    finally:
        proxy.close()


def test_something_that_is_not_a_tcpstore_is_refused_naming_its_address():
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with pytest.raises(StoreProtocolError, match=f"127.0.0.1:{port} did not answer a TCPStore's ping"):
        WireStore.connect("127.0.0.1", port, timeout_s=0.5)
    listener.close()
    with pytest.raises(OSError):
        WireStore.connect("127.0.0.1", port, timeout_s=0.5)  # nothing listens any more


# ---------------------------------------------------------------------- the monitor's work
def _first_then_new(first, port):
    """A monitor's connections: ``first`` (its beats' connection, which ranks share here), then new
    ones to ``port`` (a number, or a function giving the one at the time)."""
    pending = [first]

    def connect(timeout_s):
        if pending:
            return pending.pop()
        return WireStore.connect("127.0.0.1", port() if callable(port) else port, timeout_s=timeout_s)

    return connect


class _Sim:
    """``count`` ranks' monitors in this process against ``server``, ``share`` of them per beats
    connection (a job of thousands within this machine's descriptors; each node's delegate has
    a board connection of its own), on a clock this test advances: no sleeping."""

    def __init__(self, server, count, share=1, interval=1.0, progress=math.inf, node=8, runs=None, first=(),
                 per=DEFAULT_NODES_PER_READER):
        """``runs``: the job's ranks (all ``count`` by default; the others' monitors serve it too,
        as spares'); ``first``: ranks whose monitors attach before the others (and lead their nodes);
        ``per``: how many nodes share one reader of the board."""
        self.heard = {r: [] for r in range(count)}
        self.channel = JobChannel(f"sim-{uuid.uuid4()}", "job", 0)  # relays are named by it: one per test
        beats = {}
        self.monitors = {}
        for rank in [*first, *(r for r in range(count) if r not in first)]:
            group = rank // share
            if group not in beats:
                beats[group] = WireStore.connect("127.0.0.1", server.port, timeout_s=30)
            config = MonitorConfig("127.0.0.1", server.port, self.channel.namespace, rank, interval,
                                   progress_timeout_s=progress if math.isfinite(progress) else 1e9)
            monitor = RankMonitor(config, forward=self.heard[rank].append, now=0.0,
                                  connect=_first_then_new(beats[group], server.port))
            monitor.attach(JobSpec(self.channel, runs or ((0, count),), node, per))
            self.monitors[rank] = monitor
        self.halted = set()

    def halt(self, *ranks):
        """Those ranks' monitors stop, as killed: the kernel closes their sockets (a relay they
        led included), nobody marks them as left."""
        for rank in ranks:
            self.halted.add(rank)
            self.monitors[rank].close()

    def tick(self, now):
        for rank, monitor in self.monitors.items():
            if rank not in self.halted:
                monitor.tick(now=now)
                monitor.progress(now=now)
        self.drain()

    def drain(self, quiet_s=0.5):
        """Handle what became readable (the board's waits answered, the relays' events), until
        nothing does for ``quiet_s``."""
        while True:
            owners = {fd: m for r, m in self.monitors.items() if r not in self.halted and not m.closed
                      for fd in m.readers()}
            poller = select.poll()
            for fd in owners:
                poller.register(fd, select.POLLIN)
            ready = poller.poll(quiet_s * 1000) if owners else []
            if not ready:
                return
            for fd, _ in ready:
                monitor = owners[fd]
                if not monitor.closed and fd in monitor.readers():
                    monitor.on_ready(fd)

    def lost_heard_by_all(self, victims):
        live = [r for r in self.monitors if r not in self.halted]
        return all({e.rank for e in self.heard[r] if e.kind is EventKind.LOST} >= set(victims) for r in live)


def test_a_rank_whose_monitor_falls_silent_on_a_live_node_is_published_once_by_its_node_s_delegate(server):
    sim = _Sim(server, 4, node=2)  # node 1: rank 2 leads, rank 3 follows
    sim.tick(0.0)  # rank 3 says it is alive
    sim.halt(3)  # then its monitor is gone (its rank may live on: nobody watches it now)
    for now in (1.0, 2.0, 3.0, 4.0):
        sim.tick(now)
        assert not any(sim.heard[r] for r in (0, 1, 2)), now  # silent for less than 5 s
    sim.tick(5.0)
    events = [e for r in (0, 1, 2) for e in sim.heard[r]]
    assert {(e.kind, e.rank, e.by) for e in events} == {(EventKind.LOST, 3, 2)}, events  # by its delegate
    assert len(sim.heard[1]) == 1 and "the last word came 5.0 s ago (the bound is 5 s)" in sim.heard[1][0].reason
    sim.tick(6.0)
    assert len(sim.heard[1]) == 1  # published once


def test_a_node_s_delegate_speaks_once_an_interval_and_its_followers_answer_it_or_say_it_on_their_own(
        server, monkeypatch):
    """Each word on a node's socket wakes a process: the delegate speaks once an interval (3 times
    before), and its followers say they are alive once an interval, in answer to it; with their
    delegate quiet (frozen), on their own ticks, so that it finds their words once it runs again."""
    said = {"keep-alive": 0, "alive": 0}
    keep_alive, tell = NodeRelay.keep_alive, NodeRelay.tell

    def counted_keep_alive(relay, position, state=""):
        said["keep-alive"] += 1
        keep_alive(relay, position, state)

    def counted_tell(relay, line):
        said["alive"] += line.startswith("alive ")
        return tell(relay, line)

    monkeypatch.setattr(NodeRelay, "keep_alive", counted_keep_alive)
    monkeypatch.setattr(NodeRelay, "tell", counted_tell)
    sim = _Sim(server, 8, node=4)  # ranks 0 and 4 lead their nodes, 3 follow each
    for now in (0.0, 1.0):
        sim.tick(now)
    said.update({"keep-alive": 0, "alive": 0})
    for now in range(2, 12):
        sim.tick(float(now))
    assert said == {"keep-alive": 2 * 10, "alive": 6 * 10}
    frozen = sim.monitors.pop(4)  # node 1's delegate stops running: neither ticked nor read
    said.update({"keep-alive": 0, "alive": 0})
    for now in range(12, 15):
        sim.tick(float(now))
    # Node 1's followers still say it on each tick but the first (they answered their delegate's last word).
    assert said == {"keep-alive": 3, "alive": 3 * 3 + 3 * 2}
    sim.monitors[4] = frozen  # runs again within the bound: finds its followers' words, publishes nobody
    for now in range(15, 24):
        sim.tick(float(now))
    assert not any(sim.heard[r] for r in sim.monitors), {r: sim.heard[r] for r in sim.monitors}


def test_a_delegate_hands_on_the_entry_it_put_without_reading_it_from_the_store(server):
    """The entry a delegate puts is its node's (and group's) at once: its board's wait is answered by
    it, and the delegate waits on the next one rather than reading back what it wrote; the node's
    other delegates read it."""
    sim = _Sim(server, 16, node=8)  # rank 8 leads node 1, rank 9 follows it
    for now in (0.0, 1.0):
        sim.tick(now)
    writer, reader = sim.monitors[8].board, sim.monitors[0].board
    before = writer.requests, reader.requests
    sim.monitors[9].parent_ended()  # rank 9's process ended: its monitor hands its loss to rank 8
    sim.drain()
    assert all([(e.kind, e.rank) for e in sim.heard[r]] == [(EventKind.LOST, 9)] for r in range(16) if r != 9)
    # The writer's board: one request (the next wait); the others': a read and the next wait in one message.
    assert (writer.requests - before[0], reader.requests - before[1]) == (1, 2)
    sim.halt(9)
    for now in (2.0, 3.0):  # and the next entries as ever
        sim.tick(now)
    sim.monitors[1].parent_ended()
    sim.drain()
    assert all([e.rank for e in sim.heard[r]] == [9, 1] for r in range(16) if r not in (1, 9)), sim.heard


def test_a_watcher_that_stalled_before_it_saw_the_last_beat_still_sees_the_counter_stand_still_first(server):
    sim = _Sim(server, 4, node=2)  # nodes 0 (ranks 0, 1) and 1 (ranks 2, 3) watch each other
    sim.tick(0.0)
    for now in (1.0, 2.0):  # rank 0's monitor makes no look at 1.0 and 2.0 (its host is overloaded)
        for rank in (1, 2, 3):
            sim.monitors[rank].tick(now=now)
    sim.drain()
    sim.halt(2, 3)  # node 1's last beat came just before 2.0, after rank 0's look at 0.0
    sim.tick(3.0)  # rank 0 sees that beat: it came 1-3 s ago
    for now in (4.0, 5.0, 6.0):
        sim.tick(now)
        assert not sim.heard[1], now  # its beat came 4-6 s ago by 6.0, but rank 0 looked at it only 4 times
    sim.tick(7.0)
    assert [(e.kind, e.rank, e.by) for e in sim.heard[1]] == [(EventKind.LOST, 2, 0), (EventKind.LOST, 3, 0)]
    assert "its last beat came 4.0-7.0 s ago" in sim.heard[1][0].reason


def test_a_node_lost_whole_is_published_by_the_delegate_of_the_node_before_it_in_one_entry(server):
    sim = _Sim(server, 16, node=8)  # node 0's delegate (rank 0) watches node 1: ranks 8-15
    sim.tick(0.0)
    sim.halt(*range(8, 16))  # node 1 is gone, monitors and all, its last beat at 0.0, after rank 0 looked
    assert all(sim.monitors[r].job.watched == {} for r in range(1, 8))  # node 0's followers read nothing
    for now in (1.0, 2.0, 3.0, 4.0):
        sim.tick(now)
        assert not any(sim.heard[r] for r in range(8)), now
    sim.tick(5.0)  # its last beat came 4-5 s ago
    assert all([e.rank for e in sim.heard[r]] == list(range(8, 16)) for r in range(8))
    assert {e.by for e in sim.heard[3]} == {0}
    board = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    assert board.add(sim.channel.board_count(), 0) == 1  # one entry for the node's eight losses


def test_consecutive_nodes_lost_together_are_each_watched_from_a_node_still_there(server):
    # Eight nodes of 8, visited 0, 4, 1, 5, 2, 6, 3, 7: nodes 1-3 (a rack) are watched by nodes 4-6.
    # In rank order node 2 would be watched by node 1 and node 3 by node 2: found one bound after
    # another (5 s, 10 s, 15 s) as the watch walked on from each lost node to the next.
    sim = _Sim(server, 64, node=8)
    assert [sim.monitors[0].job.ring.successor(r) for r in (0, 32, 8, 40, 16, 48, 24)] == [32, 8, 40, 16, 48, 24, 56]
    sim.tick(0.0)
    sim.halt(*range(8, 32))
    for now in (1.0, 2.0, 3.0, 4.0):
        sim.tick(now)
        assert not any(sim.heard[r] for r in sim.monitors if r not in sim.halted), now
    sim.tick(5.0)  # no beat since 0.0: the bound
    assert sim.lost_heard_by_all(range(8, 32))
    for rank in (r for r in sim.monitors if r not in sim.halted):  # each node by the delegate before it
        assert {e.rank: e.by for e in sim.heard[rank]} == {r: 32 + 8 * (r // 8 - 1) for r in range(8, 32)}, rank
    board = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    assert board.add(sim.channel.board_count(), 0) == 3  # one entry per lost node


def test_a_delegate_whose_own_rank_is_not_in_the_job_still_watches_for_its_node_s_ranks(server):
    sim = _Sim(server, 16, node=8, runs=((0, 6), (8, 8)), first=(6,))  # 6 and 7: spares on node 0
    assert sim.monitors[6].relay.delegates and not sim.monitors[0].relay.delegates
    sim.tick(0.0)
    sim.halt(*range(8, 16))
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        sim.tick(now)
    assert sorted((e.rank, e.by) for e in sim.heard[0]) == [(r, 6) for r in range(8, 16)]


def test_a_new_delegate_continues_the_watch_of_the_last_one_so_a_loss_is_not_published_later(server):
    sim = _Sim(server, 16, node=8)  # node 0's delegate (rank 0) watches node 1: ranks 8-15
    sim.tick(0.0)
    sim.tick(1.0)
    sim.halt(*range(8, 16))  # node 1's last beat came just after 1.0
    sim.tick(2.0)  # rank 0 sees it: it tells its followers what it saw, after its look
    sim.halt(0)  # and is killed: its followers elect another delegate
    sim.drain()
    for now in (3.0, 4.0, 5.0):
        sim.tick(now)
        assert not any(e.rank >= 8 for e in sim.heard[3]), now
    delegate = next(r for r in range(1, 8) if sim.monitors[r].relay.delegates)
    sim.tick(6.0)  # 5 s after the look before the last beat, as rank 0 would have published them
    assert sorted((e.rank, e.by) for e in sim.heard[3] if e.rank >= 8) == [(r, delegate) for r in range(8, 16)]
    for now in (7.0, 8.0):  # rank 0's monitor, heard by the last delegate, is silent: published by the new one
        sim.tick(now)
    assert [(e.rank, e.by) for e in sim.heard[3] if e.rank == 0] == [(0, delegate)]


def test_a_monitor_told_of_a_recovery_its_delegate_was_not_told_of_watches_for_itself(server):
    sim = _Sim(server, 16, node=8, runs=((0, 8),))  # node 1 (ranks 8-15) not in the job yet
    grown = JobSpec(sim.channel, ((0, 16),), 8)  # the job grows by node 1: rank 0, hung, is not told
    for rank in range(1, 16):
        sim.monitors[rank].attach(grown)
    assert sim.monitors[0].relay.delegates and len(sim.monitors[0].job.nodes) == 1  # its old ring: nobody to watch
    sim.tick(0.0)  # rank 0 takes its followers in
    sim.tick(1.0)  # and tells them its spec: they watch for the node from 2.0 on
    sim.tick(2.0)
    sim.halt(*range(8, 16))  # node 1 is lost: in the grown ring, node 0 watches it
    for now in range(3, 7):
        sim.tick(float(now))
        assert sim.heard[3] == [], now
    sim.tick(7.0)
    assert sorted(e.rank for e in sim.heard[3]) == list(range(8, 16))
    assert {e.by for e in sim.heard[3]} <= set(range(1, 8))  # by node 0's monitors that were told
    board = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    losses = [e.rank for i in range(board.add(sim.channel.board_count(), 0))
              for e in decode_events(board.get(sim.channel.board_slot(i)))]
    assert sorted(losses) == list(range(8, 16))  # each once, however many of them watched


def test_a_publisher_that_ends_between_its_two_requests_leaves_no_slot_that_blocks_the_board(server):
    sim = _Sim(server, 4, node=2)
    sim.tick(0.0)
    raw = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    first = encode_events([BoardEvent(EventKind.LOST, 3, "its process ended", by=3)]).encode()
    assert raw.compare_set(sim.channel.board_slot(0), b"", first) == first  # its slot, and then it ended: never counted
    sim.monitors[1].publish(BoardEvent(EventKind.LOST, 2, "its process ended", by=2))  # slot 0 taken: slot 1
    sim.drain()
    for rank in (0, 1):
        assert [e.rank for e in sim.heard[rank]] == [3, 2], rank  # both, in the board's order
    assert raw.add(sim.channel.board_count(), 0) == 1


def test_ranks_that_left_cleanly_are_nobody_s_loss_and_a_node_left_whole_is_marked_departed(server):
    sim = _Sim(server, 6, node=2)  # nodes 0, 1, 2; node 1: rank 2 leads, rank 3 follows
    sim.tick(0.0)
    sim.monitors[2].depart()  # the delegate leaves first: it tells rank 3, which leads the node now
    sim.halted.add(2)
    sim.drain()
    sim.tick(1.0)
    assert sim.monitors[3].relay.delegates
    sim.monitors[3].depart()  # the node's last monitor: it marks the node departed
    sim.halted.add(3)
    for now in range(2, 12):
        sim.tick(float(now))
    assert not any(sim.heard[r] for r in (0, 1, 4, 5))
    assert WireStore.connect("127.0.0.1", server.port, timeout_s=5).add(
        node_beat_key(sim.channel.namespace, 1, 2), 0) < 0
    assert DEPARTED < 0


def test_a_process_that_ended_is_published_at_once_and_a_quiet_interpreter_only_after_the_progress_timeout(server):
    sim = _Sim(server, 4, node=2, progress=3.0)
    sim.tick(0.0)
    sim.monitors[1].parent_ended()
    sim.halted.add(1)
    sim.drain()
    assert all([(e.rank, e.reason) for e in sim.heard[r]] == [(1, "its process ended")] for r in (0, 2, 3))
    # Rank 3's interpreter stops ticking (the GIL held, or SIGSTOP); its monitor beats on.
    monitor = sim.monitors[3]
    for now in (1.0, 2.0):
        for rank in (0, 2):
            sim.monitors[rank].tick(now=now)
            sim.monitors[rank].progress(now=now)
        monitor.tick(now=now)
        sim.drain()
        assert len(sim.heard[0]) == 1
    monitor.tick(now=3.5)
    monitor.tick(now=4.5)  # published once
    sim.drain()
    hung = [e for e in sim.heard[0] if e.rank == 3]
    assert len(hung) == 1 and hung[0].reason.startswith("it made no progress for 4 s (the progress timeout is 3 s)")


def test_each_event_costs_a_monitor_waiting_on_the_board_two_requests_however_many_came_at_once(server):
    sim = _Sim(server, 3, node=1)
    boards = {r: sim.monitors[r].board for r in (1, 2)}
    before = {r: board.requests for r, board in boards.items()}
    published = [BoardEvent(EventKind.LOST, 2, "first", by=0), BoardEvent(EventKind.BACK, 2, by=0),
                 BoardEvent(EventKind.LOST, 1, "third", by=0)]
    sim.monitors[0].publish(published[0])
    sim.drain()
    for event in published[1:]:  # two back to back: the second is there before anyone read the first
        sim.monitors[0].publish(event)
    sim.drain()
    for rank in (1, 2):
        assert [(e.kind, e.rank, e.reason) for e in sim.heard[rank]] == [
            (e.kind, e.rank, e.reason) for e in published], rank
        assert boards[rank].requests - before[rank] == 2 * len(published), rank  # the event's get, the next wait
    assert sim.monitors[1].job.lost == {1: "third"}


def test_a_node_s_monitors_keep_one_wait_on_the_board_and_elect_another_delegate_when_theirs_goes(server):
    sim = _Sim(server, 8, node=4)
    assert [r for r, m in sim.monitors.items() if m.board is not None] == [0, 4]  # one per node
    sim.tick(0.0)
    sim.monitors[0].parent_ended()  # rank 0's process ended: its monitor publishes it and leaves
    sim.halted.add(0)
    sim.drain()
    delegates = [r for r in (1, 2, 3) if sim.monitors[r].board is not None]
    assert len(delegates) == 1, delegates
    sim.monitors[5].publish(BoardEvent(EventKind.LOST, 6, "its process ended", by=6))
    sim.drain()
    for rank in range(1, 8):
        assert [(e.rank, e.reason) for e in sim.heard[rank]] == [(0, "its process ended"), (6, "its process ended")], rank


def test_a_follower_behind_its_new_delegate_reads_what_it_missed_from_the_store_once(server):
    sim = _Sim(server, 3, node=3)  # one node: 0 leads, 1 and 2 follow
    sim.drain()  # the delegate takes its followers in: "at 0"
    raw = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    put_entry(raw, sim.channel, encode_events([BoardEvent(EventKind.LOST, 7, "first", by=9)]).encode(), 0)
    sim.monitors[0].close()  # the delegate goes before it read it
    follower, late = sim.monitors[1], sim.monitors[2]
    follower.on_ready(follower.readers()[0])  # end of file: it leads now, reads event 0, waits on the board
    assert follower.board is not None and follower.job.next_event == 1
    late.on_ready(late.readers()[0])  # end of file: it follows the new delegate
    assert late.board is None and follower.relay.listener is not None
    follower.on_ready(follower.relay.listener.fileno())  # the delegate takes it and says "at 1"
    assert select.select(late.readers(), [], [], 5)[0]
    late.on_ready(late.readers()[0])  # 1 is past its own 0: it reads event 0 from the store
    assert [(e.rank, e.reason) for e in sim.heard[2]] == [(7, "first")]
    sim.monitors[1].publish(BoardEvent(EventKind.LOST, 8, "second", by=1))
    sim.halted.add(0)
    sim.drain()
    for rank in (1, 2):
        assert [(e.rank, e.reason) for e in sim.heard[rank]] == [(7, "first"), (8, "second")], rank


def test_a_stuck_delegate_is_published_by_the_standby_and_its_followers_wait_on_the_board_themselves(server):
    sim = _Sim(server, 2, node=2)  # one node: 0 leads, 1 follows (and stands by)
    sim.tick(0.0)  # the delegate takes its follower in
    sim.tick(1.0)  # and tells it whom it heard, itself among them
    sim.halted.add(0)  # then rank 0's monitor is stuck: its sockets open, nothing read, sent or beaten
    follower = sim.monitors[1]
    board = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    for now in range(2, 8):
        sim.tick(float(now))
        assert follower.board is None, now  # still counting on its delegate for the board
        assert (board.add(sim.channel.board_count(), 0) == 1) is (now >= 6), now  # the stuck one, once
    sim.tick(8.0)  # seven ticks without a word from its delegate: it waits on the board itself
    assert follower.board is not None
    assert [(e.kind, e.rank, e.by) for e in sim.heard[1]] == [(EventKind.LOST, 0, 1)]
    assert "said nothing for 5 intervals" in sim.heard[1][0].reason


def test_a_monitor_gone_alone_that_leaves_cleanly_does_not_mark_its_still_served_node_departed(server):
    sim = _Sim(server, 3, node=3)  # one node: 0 leads, 1 and 2 follow (one of them stands by)
    sim.tick(0.0)
    sim.tick(1.0)
    sim.halted.add(0)  # rank 0's monitor is stuck: it still holds the node's name
    for now in range(2, 9):
        sim.tick(float(now))
    followers = [sim.monitors[1], sim.monitors[2]]
    assert all(m.role is Role.ALONE for m in followers)
    store = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    node_key = node_beat_key(sim.channel.namespace, 0, 3)
    for leaving in sorted(followers, key=lambda m: m.names.standby is not None):  # the standby last
        before = store.add(node_key, 0)
        leaving.depart()
        assert leaving.closed
        assert store.add(node_key, 0) == before > 0  # not marked departed: its node is still served


def test_a_delegate_elected_while_the_board_cannot_be_reached_beats_on_and_tries_again_at_its_next_tick(server):
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # takes connections and never answers: a store seconds late to take one
    channel = JobChannel(f"sim-{uuid.uuid4()}", "job", 0)

    def monitor(rank, port):
        config = MonitorConfig("127.0.0.1", port, channel.namespace, rank, 1.0, connect_timeout_s=0.5)
        made = RankMonitor(config, forward=lambda event: None, now=0.0,
                           connect=_first_then_new(WireStore.connect("127.0.0.1", server.port, timeout_s=30),
                                                   lambda: made.config.port))
        made.attach(JobSpec(channel, ((0, 2),), 2))
        return made

    delegate, follower = monitor(0, server.port), monitor(1, server.port)
    assert delegate.board is not None and follower.board is None
    follower.config = dataclasses.replace(follower.config, port=silent.getsockname()[1])  # its next connections
    delegate.detach()
    while not follower.relay.delegates:  # its position, then the end of file: it leads, and cannot connect within 0.5 s
        follower.on_ready(follower.readers()[0])
    assert follower.relay.delegates and follower.board is None
    follower.tick(now=1.0)
    follower.tick(now=2.0)  # it tries again at each tick, and beats for the node meanwhile
    assert follower.board is None
    assert WireStore.connect("127.0.0.1", server.port, timeout_s=5).add(node_beat_key(channel.namespace, 0, 2), 0) == 2
    follower.close()
    silent.close()


def test_a_delegate_elected_as_its_predecessor_s_rank_ended_hears_that_entry_before_any_new_connection(server):
    """A node's delegate whose rank ends publishes the loss and leaves; the follower elected in its
    place reads the entry on the connection it has, not on the board's new one, which the store
    may take seconds to answer (torch's server looks every new client's address up by name)."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # takes connections and never answers: every new connection is late
    channel = JobChannel(f"sim-{uuid.uuid4()}", "job", 0)
    heard: dict[int, list] = {0: [], 1: []}

    def monitor(rank):
        config = MonitorConfig("127.0.0.1", server.port, channel.namespace, rank, 1.0, connect_timeout_s=0.5)
        made = RankMonitor(config, forward=heard[rank].append, now=0.0,
                           connect=_first_then_new(WireStore.connect("127.0.0.1", server.port, timeout_s=30),
                                                   lambda: made.config.port))
        made.attach(JobSpec(channel, ((0, 2),), 2))
        return made

    delegate, follower = monitor(0), monitor(1)
    assert delegate.board is not None and follower.board is None
    follower.config = dataclasses.replace(follower.config, port=silent.getsockname()[1])  # its next connections
    delegate.parent_ended()  # rank 0 ended: its monitor published it, handed it on and left
    while not follower.relay.delegates:  # the entry, then the end of file: it leads, its board connection not made
        follower.on_ready(follower.readers()[0])
    assert follower.relay.delegates and follower.board is None
    assert [(e.kind, e.rank) for e in heard[1]] == [(EventKind.LOST, 0)]
    follower.config = dataclasses.replace(follower.config, port=server.port)  # the store takes connections again
    follower.tick(now=1.0)  # connects to the board at its next tick, and waits past the entry it has
    assert follower.board is not None and follower.job.next_event == 1
    assert not select.select([follower.board.fileno()], [], [], 0.5)[0]
    assert [(e.kind, e.rank) for e in heard[1]] == [(EventKind.LOST, 0)]  # heard once
    follower.close()
    silent.close()


def test_a_delegate_whose_rank_ended_hands_its_followers_that_entry_before_it_goes(server):
    sim = _Sim(server, 3, node=3)  # one node: 0 leads, 1 and 2 follow
    sim.tick(0.0)
    sim.monitors[0].parent_ended()
    sim.halted.add(0)
    for rank in (1, 2):
        follower = sim.monitors[rank]
        follower.on_ready(follower.readers()[0])  # what the delegate sent before its end of file
        assert follower.role is Role.FOLLOWER and follower.job.next_event == 1, rank
        assert [(e.kind, e.rank, e.by) for e in sim.heard[rank]] == [(EventKind.LOST, 0, 0)], rank
    sim.drain()  # then they elect another delegate, which waits past the entry: heard once
    assert [len(sim.heard[rank]) for rank in (1, 2)] == [1, 1]
    assert sum(sim.monitors[rank].board is not None for rank in (1, 2)) == 1


@pytest.mark.parametrize("rank_runs", [True, False])
def test_a_delegate_killed_alone_leaves_its_rank_the_time_a_monitor_takes_to_start(server, rank_runs):
    # The rank of a delegate whose monitor went (a SIGKILL) without a word still runs when its
    # heartbeat is starting another monitor: that one is waited for as any monitor starting is.
    # Where the rank's process has ended too, its silence is its loss at the usual bound.
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid names no process now
    sim = _Sim(server, 3, node=3)  # one node: 0 leads, 1 and 2 follow
    sim.monitors[0].config = dataclasses.replace(sim.monitors[0].config,
                                                 parent_pid=os.getpid() if rank_runs else ended.pid)
    sim.tick(0.0)
    sim.tick(1.0)  # the delegate told its node whom it heard, itself and its rank's process among them
    sim.halt(0)
    sim.drain()  # its followers elect another delegate
    delegate = next(rank for rank in (1, 2) if sim.monitors[rank].board is not None)
    for now in range(2, 9):  # its bound is 5 s
        sim.tick(float(now))
        for rank in (1, 2):
            lost = [(e.rank, e.by) for e in sim.heard[rank] if e.kind is EventKind.LOST]
            assert lost == ([] if rank_runs or now < 6 else [(0, delegate)]), (now, rank, lost)
    if rank_runs:  # a monitor that never comes is still found, 60 s later
        for now in range(62, 68):
            sim.tick(float(now))
        for rank in (1, 2):
            reasons = [e.reason for e in sim.heard[rank] if e.kind is EventKind.LOST and e.rank == 0]
            assert len(reasons) == 1 and "never spoke to its node's delegate" in reasons[0], (rank, reasons)


def test_a_look_past_a_lost_node_reads_the_ranks_after_it_together_one_round_trip_for_all():
    ring = Ring.of(range(24), gpus_per_node=8)  # nodes visited 0, 2, 1: node 0 watches node 2, then node 1
    watch, watched, calls = Watch(me=0, interval_s=1.0, stale_beats=5), {}, []

    def read(ranks):
        calls.append(list(ranks))
        return [1] * len(ranks)

    found = watch.look(read, ring, ring.on_node(0), set(range(16, 24)), watched, now=0.0)
    # Node 2 lost: nothing of its to read; the ranks after its eight, node 1's, in one round trip.
    assert found == [] and calls == [list(range(8, 16))] and sorted(watched) == list(range(8, 16))


def test_a_resumed_monitor_reads_from_where_its_rank_had_reached_and_passes_no_entry_over(server):
    sim = _Sim(server, 3, node=3)  # one node: 0 leads, 1 and 2 follow
    reached = []
    sim.monitors[1].publish(BoardEvent(EventKind.LOST, 7, "first", by=1))
    sim.drain()
    sim.monitors[2].close()  # rank 2's monitor ends, having handed entry 0 to its rank
    sim.halted.add(2)
    sim.monitors[1].publish(BoardEvent(EventKind.LOST, 8, "second", by=1))  # before another one starts
    sim.drain()
    config = MonitorConfig("127.0.0.1", server.port, sim.channel.namespace, 2, 1.0)
    again = RankMonitor(config, forward=sim.heard[2].append, now=0.0,
                        reached=lambda channel, position: reached.append((channel, position)))
    again.attach(JobSpec(sim.channel, ((0, 3),), 3), first=1)  # the rank's heartbeat: resume 1
    sim.monitors[2] = again
    sim.halted.discard(2)
    sim.drain()
    assert [e.reason for e in sim.heard[2]] == ["first", "second"]
    assert reached == [(sim.channel, 1), (sim.channel, 2)]  # where it starts, and after each entry
    sim.tick(1.0)
    assert [e.reason for e in sim.heard[2]] == ["first", "second"]  # once


def test_a_stuck_delegate_s_watch_is_taken_over_by_one_follower_and_a_lost_node_published_once(server):
    sim = _Sim(server, 24, node=8)  # nodes visited 0, 2, 1: node 0's delegate (rank 0) watches node 2
    sim.tick(0.0)
    sim.halted.add(0)  # rank 0's monitor is stuck: its sockets open, nothing read, sent or beaten
    sim.halt(*range(16, 24))  # and node 2 is lost whole
    for now in range(1, 11):
        sim.tick(float(now))
        watching = [r for r in range(1, 8) if sim.monitors[r].job.watched]
        assert len(watching) == (0 if now <= 2 else 1), (now, watching)  # one, after two quiet ticks
    assert sim.lost_heard_by_all(range(16, 24))
    board = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    entries = [decode_events(board.get(sim.channel.board_slot(i))) for i in range(board.add(sim.channel.board_count(), 0))]
    node = [[e.rank for e in entry if e.rank >= 16] for entry in entries]
    assert sorted(r for ranks in node for r in ranks) == list(range(16, 24)), entries  # each once
    assert 1 <= sum(1 for ranks in node if ranks) <= 2, entries


@pytest.mark.slow
def test_a_job_of_2048_simulated_ranks_notices_the_loss_of_rank_1500_and_of_rank_2047():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    sim = _Sim(server, 2048, share=64)
    sim.tick(0.0)
    # Rank 1,500's process ends (its monitor sees it and publishes), and rank 2,047's whole node
    # (ranks 2,040-2,047, monitors and all) goes silent.
    sim.monitors[1500].publish(BoardEvent(EventKind.LOST, 1500, "its process ended", by=1500))  # its beats
    sim.halt(1500, *range(2040, 2048))
    sim.drain()
    assert sim.lost_heard_by_all([1500]) and not sim.lost_heard_by_all([2047])
    for now in (1.0, 2.0, 3.0, 4.0):
        sim.tick(now)
        assert not sim.lost_heard_by_all([2047]), now
    sim.tick(5.0)  # no beat since 0.0, 5 s: node 255's ranks are published by node 127's delegate
    assert sim.lost_heard_by_all([1500, *range(2040, 2048)])
    publishers = {e.rank: e.by for e in sim.heard[0]}
    # The node before node 255 in the ring, the two halves of the 256 nodes interleaved, is node
    # 127; its first rank to join its relay leads it.
    assert {publishers[r] for r in range(2040, 2048)} == {1016}
    board = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    assert board.add(sim.channel.board_count(), 0) == 2  # rank 1,500's entry, and one for the whole node


# ---------------------------------------------------------------------- a group's reader of the board
def _waits(sim):
    """Which monitors wait on the board themselves, and which hear it from their group's reader."""
    live = {r: m for r, m in sorted(sim.monitors.items()) if r not in sim.halted}
    return ([r for r, m in live.items() if m.board is not None],
            [r for r, m in live.items() if m.group is not None and not m.group.leads])


def test_a_group_of_nodes_keeps_one_wait_on_the_board_and_its_reader_hands_every_entry_on(server):
    sim = _Sim(server, 16, node=2, per=4)  # 8 nodes: groups {0-3} and {4-7}, read by nodes 0 and 4
    assert _waits(sim) == ([0, 8], [2, 4, 6, 10, 12, 14])  # the followers of each node hear their delegate
    store = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    before = {r: sim.monitors[r].link.store.requests for r in (2, 4, 6)}
    sim.monitors[15].publish(BoardEvent(EventKind.LOST, 15, "its process ended", by=15))
    sim.drain()
    assert all([(e.rank, e.by) for e in sim.heard[r]] == [(15, 15)] for r in range(16))
    # the group's delegates read nothing from the store for it: their reader handed it on
    assert {r: sim.monitors[r].link.store.requests - before[r] for r in (2, 4, 6)} == {2: 0, 4: 0, 6: 0}
    assert store.add(sim.channel.board_count(), 0) == 1


def test_a_job_of_no_more_nodes_than_a_group_has_every_node_s_delegate_wait_itself(server):
    sim = _Sim(server, 8, node=2, per=4)  # 4 nodes: nothing to save
    assert _waits(sim) == ([0, 2, 4, 6], [])


def test_a_reader_that_ends_leaves_its_group_s_delegates_waiting_on_the_board_themselves(server):
    sim = _Sim(server, 8, node=1, per=4)  # groups {0-3} and {4-7}
    sim.tick(0.0)
    sim.halt(4)  # the reader of nodes 5-7 is killed: its sockets close
    sim.drain()
    assert _waits(sim) == ([0, 5, 6, 7], [1, 2, 3])
    sim.monitors[0].publish(BoardEvent(EventKind.LOST, 4, "its process ended", by=0))
    sim.drain()
    assert all([e.rank for e in sim.heard[r]] == [4] for r in sim.monitors if r != 4)
    for now in range(1, 2 + READER_LOOKS):
        sim.tick(float(now))
    assert _waits(sim) == ([0, 5, 6, 7], [1, 2, 3])  # the address of the one that ended is not tried again


def test_a_frozen_reader_s_group_reads_the_board_itself_within_its_quiet_bound_and_misses_nothing(server):
    sim = _Sim(server, 8, node=1, per=4)
    sim.tick(0.0)
    sim.halted.add(4)  # the reader of nodes 5-7 is stuck: its sockets open, nothing read or sent
    store = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    put_entry(store, sim.channel, encode_events([BoardEvent(EventKind.LOST, 9, "elsewhere", by=0)]).encode(), 0)
    sim.drain()
    assert [e.rank for e in sim.heard[5]] == []  # the entry waits with its reader
    for now in range(1, QUIET_TICKS + 1):
        sim.tick(float(now))
        assert _waits(sim)[1] == [1, 2, 3, 5, 6, 7], now
    sim.tick(float(QUIET_TICKS + 1))  # quiet for more than QUIET_TICKS intervals: on its own
    assert _waits(sim) == ([0, 5, 6, 7], [1, 2, 3])
    assert all([e.rank for e in sim.heard[r]] == [9] for r in sim.monitors if r != 4)


def _counters(store, sim, nodes):
    return {node: store.add(node_beat_key(sim.channel.namespace, node, 1), 0) for node in nodes}


def _own_requests(sim):
    """The requests each live monitor's own connection made so far."""
    return {r: m.link.store.requests for r, m in sim.monitors.items() if r not in sim.halted and m.link.store is not None}


def test_a_group_s_reader_beats_and_reads_for_its_nodes_in_one_message_and_their_watch_still_finds_a_loss(server):
    sim = _Sim(server, 8, node=1, per=4)  # groups {0-3} and {4-7}: their delegates ask ranks 0 and 4 to beat
    store = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    for now in range(3):  # a delegate beats itself too until its reader has answered once
        sim.tick(float(now))
    before, counters = _own_requests(sim), _counters(store, sim, range(8))
    for now in range(3, 6):
        sim.tick(float(now))
    made = {r: n - before.get(r, 0) for r, n in _own_requests(sim).items()}
    assert {r for r, n in made.items() if n} == {0, 4}  # the readers' messages alone
    assert {n: v - counters[n] for n, v in _counters(store, sim, range(8)).items()} == dict.fromkeys(range(8), 3)
    assert all(len(sim.monitors[r].job.watched) == 1 for r in range(8))  # each delegate looks at what its reader read
    sim.halt(6)  # a node of the second group lost: its watcher looks at the counters its reader reads
    for now in range(6, 12):
        sim.tick(float(now))
    assert [sorted(e.rank for e in sim.heard[r] if e.kind is EventKind.LOST) for r in sim.monitors if r != 6] == [[6]] * 7


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_the_nodes_of_a_reader_that_goes_or_freezes_beat_themselves_before_their_counters_go_stale(server, how):
    # Killed, its connections close and its delegates beat themselves from their next tick; frozen
    # (its sockets open, nothing read or said), they beat themselves once it has left their asks
    # unanswered for QUIET_TICKS intervals: a counter stands still for less than the bound either way.
    sim = _Sim(server, 8, node=1, per=4)
    store = WireStore.connect("127.0.0.1", server.port, timeout_s=5)
    for now in range(3):
        sim.tick(float(now))
    if how == "killed":
        sim.halt(4)
    else:
        sim.halted.add(4)
    seen = _counters(store, sim, range(5, 8))
    still = dict.fromkeys(seen, 0)
    for now in range(3, 13):
        sim.tick(float(now))
        values = _counters(store, sim, range(5, 8))
        still = {n: 0 if values[n] != seen[n] else still[n] + 1 for n in values}
        seen = values
        assert max(still.values()) <= QUIET_TICKS, (now, still)
    losses = {e.rank for r in sim.monitors if r != 4 for e in sim.heard[r] if e.kind is EventKind.LOST}
    assert losses == {4}  # its own node only (one monitor, frozen or killed), none of those it beat for


def test_a_delegate_that_looked_before_its_reader_listened_finds_it_at_a_later_tick(server):
    sim = _Sim(server, 8, node=1, per=4, first=(1, 2, 3, 5, 6, 7))  # the readers, 0 and 4, attach last
    assert _waits(sim) == ([0, 1, 2, 3, 4, 5, 6, 7], [])
    sim.tick(0.0)
    assert _waits(sim) == ([0, 4], [1, 2, 3, 5, 6, 7])
    sim.monitors[7].publish(BoardEvent(EventKind.LOST, 7, "its process ended", by=7))
    sim.drain()
    assert all([e.rank for e in sim.heard[r]] == [7] for r in range(8))


def test_a_delegate_that_cannot_send_to_its_follower_shuts_it_and_leaves_the_close_to_the_loop_that_reads_it():
    # Sends come from the keep-alive thread too: a descriptor closed there could be reused for
    # another socket while the monitor's loop still selects on it. So a follower that takes nothing
    # (its socket full) is shut where the send failed, and closed where its end is read.
    reader = GroupLink.lead("127.0.0.1", "ns/reader/0")
    follower = GroupLink.follow(reader.address, "ns/reader/0", timeout_s=1.0)
    try:
        reader.accept_waiting(position=0)
        [(fd, conn)] = reader.relay.followers.items()
        for index in range(10_000):  # the follower reads nothing: its socket fills up
            reader.send(index, "x" * 65_536)
            if conn.fileno() == fd and select.select([fd], [], [], 0)[0]:
                break  # shut: its end is readable here
        assert reader.relay.followers == {fd: conn} and conn.fileno() == fd  # shut, not closed
        assert reader.on_ready(fd, position=0) == [] and reader.relay.followers == {} and conn.fileno() == -1
        heard = []
        while (got := follower.on_ready(follower.readers()[0], position=0)) is not None:
            heard += got
        assert heard  # what reached it before it was shut, then the end
    finally:
        reader.close()
        follower.close()


def test_a_reader_beats_no_node_for_a_delegate_that_took_the_descriptor_of_one_that_went():
    # A delegate asks its reader to beat for node 5, then goes; another delegate joins on the same
    # descriptor number and has asked nothing yet: the reader's next beat is for nobody (node 5's
    # counter would otherwise move once more after its delegate went).
    reader = GroupLink.lead("127.0.0.1", "ns/reader/0")
    first = GroupLink.follow(reader.address, "ns/reader/0", timeout_s=1.0)
    second = None
    try:
        reader.accept_waiting(position=0)
        [fd] = reader.relay.followers
        assert select.select(first.readers(), [], [], 5)[0] and first.on_ready(first.readers()[0], 0) is not None
        assert first.greeted and not first.ask_beat(5, [6], now=0.0, within_s=2.0)  # told; not answered yet
        assert select.select([fd], [], [], 5)[0] and reader.on_ready(fd, 0) == []
        first.close()
        assert select.select([fd], [], [], 5)[0] and reader.on_ready(fd, 0) == [] and reader.relay.followers == {}
        second = GroupLink.follow(reader.address, "ns/reader/0", timeout_s=1.0)
        select.select(reader.readers(), [], [], 5)
        reader.accept_waiting(position=0)
        assert list(reader.relay.followers) == [fd]  # the descriptor the first had
        assert reader.take_beats() == []
    finally:
        reader.close()
        first.close()
        if second is not None:
            second.close()
