"""A node's ranks' store calls made as one by its delegate (hypergrid/liveness/calls.py): the
monitors of two nodes of four in this process against a real TCPStore, their relays real sockets.

What a recovery round's participants make (the job's record read, the arrival, the rebuild's end)
costs the store the same few requests per node however many of the node's ranks ask; the store
holds what the ranks would have written one by one; a call whose delegate went before answering is
unknown to its rank, and one a monitor cannot hand on is refused (the rank makes it itself).
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hypergrid.liveness.calls import AnswerKind, NodeAnswer, NodeCall, NodeChannel
from hypergrid.liveness.fanout import QUIET_TICKS
from hypergrid.liveness.relay import Role
from hypergrid.store import meeting
from hypergrid.store.client import StoreClient
from hypergrid.store.keys import Meeting
from tests.test_control_late_store import reader_followers
from tests.test_control_plane import _Sim


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _requests(sim: _Sim) -> int:
    """The store requests every monitor's own connection made so far (boards apart)."""
    return sum(m.link.store.requests for m in sim.monitors.values() if m.link.store is not None)


def _ask(sim: _Sim, calls: dict[int, NodeCall]) -> dict[int, NodeAnswer]:
    """Each rank's monitor is asked its rank's call; the followers' reach their delegates, whose
    batches are made once due; the answers reach the followers."""
    answers: dict[int, NodeAnswer] = {}
    for rank, call in calls.items():
        monitor = sim.monitors[rank]
        monitor.calls.ask(call, lambda answer, rank=rank: answers.__setitem__(rank, answer), monitor.call_route(),
                          now=time.monotonic())
    sim.drain(quiet_s=0.2)
    for _ in range(3):  # a node's batch, then its group's at the group's reader
        for rank, monitor in sim.monitors.items():
            if rank not in sim.halted:
                monitor.make_calls(now=time.monotonic())
        sim.drain(quiet_s=0.2)
    return answers


def test_a_node_s_ranks_arrive_and_read_with_one_batch_of_requests_per_node(server):
    sim = _Sim(server, 8, node=4)
    sim.tick(0.0)
    assert sorted(r for r, m in sim.monitors.items() if m.role is Role.DELEGATE) == [0, 4]
    at = Meeting(f"{sim.channel.namespace}/arrivals")
    before = _requests(sim)
    answers = _ask(sim, {rank: NodeCall.arrival(rank, at, 8, f"rank {rank}", awaited=True, ident=rank + 100)
                         for rank in range(8)})
    assert _requests(sim) - before == 2 * 2 + 1  # each node's append and add; the complete key, once
    assert {r: (a.kind, a.ident) for r, a in answers.items()} == {r: (AnswerKind.DONE, r + 100) for r in range(8)}
    assert sorted(a.number for a in answers.values()) == list(range(1, 9))
    assert [r for r, a in answers.items() if a.completes] == [max(answers, key=lambda r: answers[r].number)]
    store = StoreClient(time.monotonic() + 5, base=server)
    assert sorted(meeting.lines(store, at)) == sorted(f"rank {r}" for r in range(8))
    assert store.check([at.complete]) and int(store.add(at.count, 0)) == 8

    before = _requests(sim)
    read = _ask(sim, {rank: NodeCall.read(rank, at.count, ident=rank) for rank in range(8)})
    assert _requests(sim) - before == 2 and {a.value for a in read.values()} == {"8"}


def test_the_nodes_of_a_group_arrive_and_read_with_one_batch_of_requests_made_by_the_group_s_reader(server):
    sim = _Sim(server, 16, node=2, per=4)  # 8 nodes of 2: groups {0-3} and {4-7}, read by ranks 0 and 8
    sim.tick(0.0)
    at = Meeting(f"{sim.channel.namespace}/arrivals")
    before = {r: m.link.store.requests for r, m in sim.monitors.items() if m.link.store is not None}
    answers = _ask(sim, {rank: NodeCall.arrival(rank, at, 16, f"rank {rank}", awaited=True, ident=rank + 100)
                         for rank in range(16)})
    made = {r: m.link.store.requests - before.get(r, 0) for r, m in sim.monitors.items() if m.link.store is not None}
    assert {r: n for r, n in made.items() if n} == {0: 2, 8: 2 + 1}  # each group's append and add; the complete key
    assert {r: (a.kind, a.ident) for r, a in answers.items()} == {r: (AnswerKind.DONE, r + 100) for r in range(16)}
    assert sorted(a.number for a in answers.values()) == list(range(1, 17))
    assert [r for r, a in answers.items() if a.completes] == [max(answers, key=lambda r: answers[r].number)]
    store = StoreClient(time.monotonic() + 5, base=server)
    assert sorted(meeting.lines(store, at)) == sorted(f"rank {r}" for r in range(16))

    before_all = _requests(sim)
    read = _ask(sim, {rank: NodeCall.read(rank, at.count, ident=rank) for rank in range(16)})
    assert _requests(sim) - before_all == 2 and {a.value for a in read.values()} == {"16"}


@pytest.mark.parametrize("how, kind", [("killed", AnswerKind.UNKNOWN), ("frozen", AnswerKind.UNKNOWN),
                                       ("closed", AnswerKind.REFUSED)])
def test_calls_handed_to_a_group_s_reader_that_goes_are_unknown_to_their_ranks_or_refused_if_it_said_so(
        server, how, kind):
    # Killed: its connections close at once, with nothing said. Frozen (its sockets open, nothing
    # read or said): its group's delegates stop counting on it after its quiet bound, as they do for
    # the board. Closed: it tells each that it never made them (their ranks make them themselves).
    sim = _Sim(server, 8, node=1, per=4)  # groups {0-3} and {4-7}, read by ranks 0 and 4
    sim.tick(0.0)
    at = Meeting(f"{sim.channel.namespace}/arrivals")
    heard: dict[int, NodeAnswer] = {}
    for rank in (5, 6):  # the reader holds them for its group's other nodes, which have not asked
        sim.monitors[rank].calls.ask(NodeCall.arrival(rank, at, 8, f"rank {rank}", ident=rank),
                                     lambda a, r=rank: heard.__setitem__(r, a), sim.monitors[rank].call_route(),
                                     now=time.monotonic())
        sim.monitors[rank].make_calls(now=time.monotonic())
    sim.drain(quiet_s=0.2)
    assert heard == {}
    if how == "frozen":
        sim.halted.add(4)
        for now in range(1, QUIET_TICKS + 2):
            sim.tick(float(now))
    else:
        if how == "killed":
            sim.monitors[4].group.relay.close()  # the kernel closes its sockets: nothing is said
        sim.halt(4)
        sim.drain(quiet_s=0.2)
    assert {r: (a.ident, a.kind) for r, a in heard.items()} == {5: (5, kind), 6: (6, kind)}
    store = StoreClient(time.monotonic() + 5, base=server)
    assert int(store.add(at.count, 0)) == 0  # the reader never made them
    answers = _ask(sim, {7: NodeCall.read(7, at.count, ident=70)})  # its delegate makes its calls itself now
    assert answers[7].kind is AnswerKind.DONE and answers[7].value == "0"


def test_a_call_whose_delegate_went_is_unknown_and_one_that_cannot_be_handed_on_is_refused(server):
    sim = _Sim(server, 4, node=4)
    sim.tick(0.0)
    follower = sim.monitors[1]
    heard: list[NodeAnswer] = []
    follower.calls.ask(NodeCall.read(1, "k", ident=7), heard.append, follower.relay, now=time.monotonic())
    sim.drain(quiet_s=0.2)  # the delegate holds it for the batch of its node's four ranks
    sim.halt(0)
    sim.drain(quiet_s=0.2)  # the follower hears its delegate go
    assert [(a.ident, a.kind) for a in heard] == [(7, AnswerKind.UNKNOWN)]

    alone: list[NodeAnswer] = []
    sim.monitors[2].calls.ask(NodeCall.read(2, "k", ident=8), alone.append, None, now=time.monotonic())
    assert [(a.ident, a.kind) for a in alone] == [(8, AnswerKind.REFUSED)]


def test_a_follower_whose_delegate_said_nothing_for_two_intervals_refuses_its_rank_s_calls_until_it_speaks(server):
    # A delegate stuck (SIGSTOP: its sockets open, nothing read or said) would hold its node's
    # calls until its followers go alone; from the third quiet interval on, a follower's rank
    # makes its calls itself, and once the delegate speaks again they go through it again.
    sim = _Sim(server, 2, node=2)  # one node: 0 leads, 1 follows
    sim.tick(0.0)
    sim.tick(1.0)
    follower = sim.monitors[1]
    sim.halted.add(0)
    route = []
    for now in (2.0, 3.0, 4.0):
        sim.tick(now)
        route.append(follower.call_route() is follower.relay)
    assert route == [True, True, False]
    refused: list[NodeAnswer] = []
    follower.calls.ask(NodeCall.read(1, "k", ident=9), refused.append, follower.call_route(), now=time.monotonic())
    assert [(a.ident, a.kind) for a in refused] == [(9, AnswerKind.REFUSED)]
    sim.halted.discard(0)
    sim.tick(5.0)  # the delegate runs again and speaks to its node
    assert follower.role is Role.FOLLOWER and follower.call_route() is follower.relay
    answers = _ask(sim, {1: NodeCall.read(1, "k", ident=10)})
    assert answers[1].kind is AnswerKind.DONE


def test_a_rank_with_no_node_to_speak_for_it_makes_its_calls_itself_and_a_lost_end_count_is_not_made_twice(server):
    store = StoreClient(time.monotonic() + 5, base=server)
    at = Meeting("alone")
    assert NodeChannel().arrive(store, at, 2, "rank 0") == meeting.Place(1, False)

    class _Gone:  # a heartbeat whose monitor ended with the call
        running = True

        def call(self, call: NodeCall, timeout_s: float) -> NodeAnswer:
            return NodeAnswer.to(call, AnswerKind.UNKNOWN)

    node = NodeChannel(_Gone())
    assert node.arrive(store, at, 2, "rank 1") == meeting.Place(2, True)  # an arrival is made again
    assert node.arrive(store, Meeting("end"), 2, again=False) == meeting.Place(0, False)
    assert int(store.add(Meeting("end").count, 0)) == 0


@pytest.mark.parametrize("count, per_node, nodes_per_reader", [(3, 3, 16), (4, 1, 2)],
                         ids=["one node of three", "four nodes read in groups of two"])
def test_a_node_s_rank_processes_calls_reach_the_store_through_their_monitor_processes_as_one_batch(
        count, per_node, nodes_per_reader):
    import threading
    import uuid

    from hypergrid.liveness.heartbeat import Heartbeat
    from hypergrid.liveness.monitor import JobSpec
    from hypergrid.liveness.plane import ControlPlane
    from hypergrid.store.keys import JobChannel

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    plane = ControlPlane(f"hypergrid/calls-test/{uuid.uuid4()}", server, ("127.0.0.1", server.port))
    channel = JobChannel.of(list(range(count)), 0, plane.namespace)
    beats = [Heartbeat(plane, rank, interval_s=1.0, progress_timeout_s=60, stale_beats=5) for rank in range(count)]
    at = Meeting(f"{plane.namespace}/arrivals")
    answers: dict[int, NodeAnswer] = {}
    try:
        for beat in beats:
            beat.attach(JobSpec(channel, ((0, count),), per_node, nodes_per_reader))
        end = time.monotonic() + 30
        groups = range(count // per_node // nodes_per_reader) if count // per_node > nodes_per_reader else ()
        while any(reader_followers(server, channel, group) < nodes_per_reader - 1 for group in groups):
            assert time.monotonic() < end, "a group's delegates did not all reach its reader"
            time.sleep(0.1)  # until every delegate hands its node's calls to its group's reader
        while True:  # until every monitor has its role (a call to one between elections is refused)
            probe = {r: b.call(NodeCall.read(-1, at.count), 5.0) for r, b in enumerate(beats)}
            if all(a.kind is AnswerKind.DONE for a in probe.values()):
                break
            assert time.monotonic() < end, probe
            time.sleep(0.2)

        def arrive(rank: int) -> None:
            answers[rank] = beats[rank].call(NodeCall.arrival(-1, at, count, f"rank {rank}"), 10.0)

        threads = [threading.Thread(target=arrive, args=(rank,)) for rank in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert {r: (a.kind, a.rank) for r, a in answers.items()} == {r: (AnswerKind.DONE, r) for r in range(count)}
        assert sorted(a.number for a in answers.values()) == list(range(1, count + 1))
        store = StoreClient(time.monotonic() + 5, base=server)
        assert sorted(meeting.lines(store, at)) == [f"rank {r}" for r in range(count)]
        assert int(store.add(at.count, 0)) == count  # each counted once (the batches' cost: the test above)
    finally:
        for beat in beats:
            beat.stop(clean=True)
