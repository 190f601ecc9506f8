"""One batched write per node (hypergrid.runtime.node_count): real processes of one "node" adding
themselves to a count of a real TCPStore, their writer ended or frozen where it hurts most."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch.distributed as dist

from hypergrid.runtime.node_count import Counted, Tally, count_in
from hypergrid.runtime.node_read import Node
from hypergrid.runtime.store import StoreClient

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One participant: it counts itself in (its line "rank N"), printing "writes" once it holds its
# node's name, and, as the writer, stopping itself (SIGSTOP) or ending at its claim if told to.
_PARTICIPANT = textwrap.dedent("""
    import json, os, signal, sys, time
    from datetime import timedelta
    sys.path.insert(0, {root!r})
    import torch.distributed as dist
    from hypergrid.runtime import node_count, node_read
    from hypergrid.runtime.node_count import Tally, count_in
    from hypergrid.runtime.node_read import Node
    from hypergrid.runtime.store import StoreClient
    port, name, rank, peers, mode = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    node_count.GATHER_S, node_read.QUIET_S = float(sys.argv[6]), float(sys.argv[7])
    exactly_once = sys.argv[8] == "exactly-once"
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    store = StoreClient(time.monotonic() + 60, base=base)

    class AtClaim:
        # The writer's store: its claim (or, with no claim, its append) is where it stops or ends,
        # before or after that lands.
        def __getattr__(self, attr):
            return getattr(store, attr)
        def compare_set(self, key, expected, desired):
            if "/node/" in key and mode.endswith("before-claim"):
                self.pause()
            value = store.compare_set(key, expected, desired)
            if "/node/" in key and mode.endswith("after-claim"):
                self.pause()
            return value
        def append(self, key, value):
            if mode.endswith("before-append"):
                self.pause()
            return store.append(key, value)
        def add(self, key, amount):
            value = store.add(key, amount)
            if mode.endswith("after-add"):
                self.pause()
            return value
        def pause(self):
            print(json.dumps({{"at": "claim"}}), flush=True)
            if mode.startswith("stop"):
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os._exit(3)

    writing = node_count._write_for_node
    def announced(*args, **kwargs):
        print(json.dumps({{"writes": True}}), flush=True)
        if mode == "stop-gathering":
            os.kill(os.getpid(), signal.SIGSTOP)
        return writing(*args, **kwargs)
    node_count._write_for_node = announced
    counted = count_in(AtClaim() if mode != "plain" else store, Tally(name + "/count", name + "/here", exactly_once),
                       rank, f"rank {{rank}}\\n", node=Node(0, 8), peers=peers)
    print(json.dumps({{"place": counted.place, "end": counted.batch_end, "wrote": counted.wrote}}), flush=True)
""").format(root=ROOT)


@pytest.fixture()
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _start(server, name: str, rank: int, peers: int = 8, mode: str = "plain", gather_s: float = 180.0,
           quiet_s: float = 8.0, exactly_once: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _PARTICIPANT, str(server.port), name, str(rank), str(peers), mode,
                             str(gather_s), str(quiet_s), "exactly-once" if exactly_once else "hint"],
                            stdout=subprocess.PIPE, text=True)


def _said(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, f"the participant ended without a word (exit {proc.wait(timeout=5)})"
    return json.loads(line)


def _outcome(proc: subprocess.Popen, timeout: float = 240.0) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line]
    return lines[-1]


def _count_and_lines(server, name: str) -> tuple[int, list[str]]:
    count = server.add(f"{name}/count", 0)
    lines = server.get(f"{name}/here").decode().splitlines() if server.check([f"{name}/here"]) else []
    return count, sorted(lines, key=lambda line: int(line.split()[1]))


def _writer_and_followers(server, name: str, mode: str = "plain", followers: int = 7, **kwargs) -> tuple:
    # The writer gathers until all its followers came (each a process importing torch: seconds
    # under load), so its window is long: the tests are of what happens after.
    writer = _start(server, name, 0, mode=mode, **kwargs)
    assert _said(writer) == {"writes": True}
    others = [_start(server, name, rank, **kwargs) for rank in range(1, followers + 1)]
    return writer, others


def test_a_node_counts_itself_in_one_batch_and_every_participant_learns_its_place(server):
    name = f"t/{uuid.uuid4()}"
    writer, others = _writer_and_followers(server, name)
    outcomes = [_outcome(p) for p in [writer] + others]
    assert sorted(o["place"] for o in outcomes) == list(range(1, 9)), outcomes
    assert [o["wrote"] for o in outcomes] == [True] + [False] * 7 and {o["end"] for o in outcomes} == {8}
    assert _count_and_lines(server, name) == (8, [f"rank {r}" for r in range(8)])
    assert not server.check([f"{name}/count/node/0/0"])  # its ranks hung up: the claim is gone


def test_a_writer_killed_at_its_claim_leaves_its_node_to_write_alone(server):
    name = f"t/{uuid.uuid4()}"
    writer, others = _writer_and_followers(server, name, mode="exit-before-claim", quiet_s=2.0)
    assert _said(writer) == {"at": "claim"}
    outcomes = [_outcome(p) for p in others]
    assert all(o["wrote"] for o in outcomes), outcomes  # each voided the batch, and wrote alone
    assert _count_and_lines(server, name) == (7, [f"rank {r}" for r in range(1, 8)])


@pytest.mark.parametrize("mode, counted", [("exit-after-claim", 0), ("exit-after-add", 8)],
                         ids=["before-its-add", "after-its-add"])
def test_a_writer_killed_after_its_claim_is_counted_by_nobody_twice(server, mode, counted):
    # The claim stands: the followers must not write their count again (a count that ran ahead of
    # its participants would end a step for a rank still at it), and learn no place; the count is
    # the batch's once where the writer had added it, and nothing where it had not.
    name = f"t/{uuid.uuid4()}"
    writer, others = _writer_and_followers(server, name, mode=mode, quiet_s=2.0)
    assert _said(writer) == {"at": "claim"}
    outcomes = [_outcome(p) for p in others]
    assert outcomes == [{"place": None, "end": None, "wrote": False}] * 7, outcomes
    assert _count_and_lines(server, name) == ((8, [f"rank {r}" for r in range(8)]) if counted else (0, []))


@pytest.mark.parametrize("claimed", [False, True], ids=["frozen-before-claim", "frozen-after-claim"])
def test_a_writer_frozen_at_its_claim_and_resumed_counts_everyone_once(server, claimed):
    name = f"t/{uuid.uuid4()}"
    mode = "stop-after-claim" if claimed else "stop-before-claim"
    writer, others = _writer_and_followers(server, name, mode=mode, quiet_s=2.0)
    try:
        assert _said(writer) == {"at": "claim"}
        outcomes = [_outcome(p) for p in others]
        if claimed:  # counted by the frozen writer: nobody writes, and nobody knows where
            assert outcomes == [{"place": None, "end": None, "wrote": False}] * 7, outcomes
        else:  # voided: each writes alone
            assert all(o["wrote"] for o in outcomes), outcomes
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    mine = _outcome(writer)
    assert mine["wrote"] and mine["end"] == (8 if claimed else mine["place"]), mine
    assert _count_and_lines(server, name) == (8, [f"rank {r}" for r in range(8)])


def test_arrivals_whose_writer_is_killed_before_it_writes_are_each_written_by_their_rank(server):
    # No claim (a count that may run ahead): the ranks it included hear it end and write alone.
    name = f"t/{uuid.uuid4()}"
    writer, others = _writer_and_followers(server, name, mode="exit-before-append", exactly_once=False)
    assert _said(writer) == {"at": "claim"}
    outcomes = [_outcome(p) for p in others]
    assert all(o["wrote"] for o in outcomes), outcomes
    assert _count_and_lines(server, name) == (7, [f"rank {r}" for r in range(1, 8)])


def test_arrivals_whose_writer_froze_are_written_by_their_ranks_and_again_when_it_resumes(server):
    # Every line is in the ledger while the writer is frozen (what a round's leader reads, by
    # rank); the count runs ahead once it resumes, which a count without a claim may.
    name = f"t/{uuid.uuid4()}"
    writer, others = _writer_and_followers(server, name, mode="stop-before-append", quiet_s=2.0, exactly_once=False)
    try:
        assert _said(writer) == {"at": "claim"}
        outcomes = [_outcome(p) for p in others]
        assert all(o["wrote"] for o in outcomes), outcomes
        assert _count_and_lines(server, name) == (7, [f"rank {r}" for r in range(1, 8)])
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    assert _outcome(writer) == {"place": 8, "end": 15, "wrote": True}
    count, lines = _count_and_lines(server, name)
    assert count == 15 and sorted(set(lines)) == sorted(f"rank {r}" for r in range(8)), (count, lines)


def test_a_rank_that_its_frozen_writer_never_included_writes_alone_and_is_not_included_after(server):
    # The writer stops while it gathers, before it takes the follower; the follower gives up,
    # writes alone; the writer resumes, reads the follower's share from its socket, and cannot
    # include it any more (the follower shut its socket for reading): counted once.
    name = f"t/{uuid.uuid4()}"
    writer, others = _writer_and_followers(server, name, mode="stop-gathering", followers=1, peers=2, gather_s=1.0,
                                           quiet_s=1.0)
    try:
        follower = _outcome(others[0])
        assert follower["wrote"] and follower["place"] == 1, follower
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    mine = _outcome(writer)
    assert mine == {"place": 2, "end": 2, "wrote": True}, mine
    assert _count_and_lines(server, name) == (2, ["rank 0", "rank 1"])


def test_a_rank_alone_or_without_a_node_writes_its_own_line_and_count():
    base = dist.HashStore()
    store = StoreClient(time.monotonic() + 5, base=base)
    tally = Tally("t/count", "t/here")
    assert count_in(store, tally, 3, "rank 3\n") == Counted(1, 1, True)
    assert count_in(store, tally, 4, "rank 4\n", node=Node(0, 8), peers=1) == Counted(2, 2, True)
    assert count_in(store, Tally("t/steps"), 5, node=Node(0, 8), peers=1).closes(1)
    assert base.get("t/here") == b"rank 3\nrank 4\n"
