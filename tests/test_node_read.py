"""One blocking read per node (hypergrid.runtime.node_read): real processes of one "node" waiting
for one key of a real TCPStore, the reader ended or frozen while they wait."""

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

from hypergrid.runtime.node_read import QUIET_S, TELL_EVERY_S, NodeRead, Read, read_address
from hypergrid.runtime.store import StoreClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One waiter: it joins its node's read of the key, says so (whether it reads the store), and
# reads a slice at a time until the value comes or its deadline passes; it prints each slice.
_WAITER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {root!r})
    import torch.distributed as dist
    from hypergrid.runtime.node_read import NodeRead
    from hypergrid.runtime.store import StoreClient
    port, key, node, slice_s, seconds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=60))
    began = time.monotonic()
    store = StoreClient(began + seconds, base=base)
    shared = NodeRead.of(key, node)
    print(json.dumps({{"reads": shared.reads}}), flush=True)
    slices = []
    while store.remaining() > 0:
        read = shared.read(store, key, slice_s)
        slices.append(read.covered)
        if read.value is not None:
            break
    shared.close()
    print(json.dumps({{"value": read.value.decode() if read.value is not None else None, "covered": slices,
                      "seconds": time.monotonic() - began}}), flush=True)
""").format(root=ROOT)


@pytest.fixture()
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


def _start(server, key: str, node: int, slice_s: float = 1.0, seconds: float = 30.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _WAITER, str(server.port), key, str(node), str(slice_s), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    return proc


def _joined(proc: subprocess.Popen) -> bool:
    return bool(json.loads(proc.stdout.readline())["reads"])


def _outcome(proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def _reader_and_followers(server, key: str, slice_s: float, count: int = 2) -> tuple[subprocess.Popen, list]:
    """A waiter that holds node 0's read of ``key``, then ``count`` that follow it."""
    reader = _start(server, key, node=0, slice_s=slice_s)
    assert _joined(reader)
    followers = [_start(server, key, node=0, slice_s=slice_s) for _ in range(count)]
    assert not any(_joined(p) for p in followers)
    return reader, followers


def _key() -> str:
    return f"test/{uuid.uuid4()}/verdict"


def test_one_waiter_of_a_node_reads_the_store_and_every_other_hears_the_value(server):
    key = _key()
    procs = []
    for _ in range(4):  # one after another: each joins the node's read as the earlier ones hold it
        procs.append(_start(server, key, node=0))
        _joined(procs[-1])
    server.set(key, "ranks 5 and 6 failed")
    outcomes = [_outcome(p) for p in procs]
    assert [o["value"] for o in outcomes] == ["ranks 5 and 6 failed"] * 4
    # Exactly one waiter looked at the store; the others' slices were all covered by it.
    assert sorted(all(o["covered"]) for o in outcomes) == [False, True, True, True]


def test_each_node_has_a_reader_of_its_own(server):
    key = _key()
    procs = [_start(server, key, node=n) for n in (0, 0, 1, 1)]
    reads = [_joined(p) for p in procs]
    server.set(key, "done")
    outcomes = [_outcome(p) for p in procs]
    assert [o["value"] for o in outcomes] == ["done"] * 4
    assert reads[0] != reads[1] and reads[2] != reads[3]  # one reader per node


def test_followers_of_a_killed_reader_elect_another_and_get_the_value(server):
    key = _key()
    procs = [_start(server, key, node=0)]
    assert _joined(procs[0])
    procs += [_start(server, key, node=0) for _ in range(3)]
    assert not any(_joined(p) for p in procs[1:])
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(timeout=30)
    time.sleep(1.5)  # the followers read end-of-file and elect again before the value is set
    server.set(key, "rank 0 failed")
    outcomes = [_outcome(p) for p in procs[1:]]
    assert [o["value"] for o in outcomes] == ["rank 0 failed"] * 3
    # One of the three took the node's read over (it looked at the store itself).
    assert sum(not all(o["covered"]) for o in outcomes) == 1


def test_a_reader_blocks_on_the_store_once_and_tells_its_followers_meanwhile_that_it_still_waits(server):
    # A slice of 30 s: the reader makes one blocking get, and its followers, hearing from it every
    # TELL_EVERY_S, keep to it past their quiet time (they would read the store themselves after it).
    key = _key()
    reader, followers = _reader_and_followers(server, key, slice_s=30.0)
    time.sleep(TELL_EVERY_S + QUIET_S + 1.0)
    server.set(key, "rank 2 failed")
    outcome, heard = _outcome(reader), [_outcome(p) for p in followers]
    assert (outcome["value"], outcome["covered"]) == ("rank 2 failed", [False]), outcome  # one get
    for follower in heard:
        assert follower["value"] == "rank 2 failed" and all(follower["covered"]), follower
        assert len(follower["covered"]) >= (TELL_EVERY_S + QUIET_S) // TELL_EVERY_S, follower  # its words


def test_followers_of_a_frozen_reader_read_the_store_themselves_after_the_quiet_time(server):
    key = _key()
    reader, followers = _reader_and_followers(server, key, slice_s=1.0)
    reader.send_signal(signal.SIGSTOP)  # alive, its name held, saying nothing
    try:
        time.sleep(1.0 + QUIET_S + 1.0)  # a slice and the quiet time: the followers gave up on it
        server.set(key, "nobody failed")
        outcomes = [_outcome(p, timeout=20) for p in followers]
    finally:
        reader.kill()
        reader.wait(timeout=30)
    assert [o["value"] for o in outcomes] == ["nobody failed"] * 2
    assert all(o["covered"][-1] is False for o in outcomes)  # each read it from the store itself


def test_a_waiter_that_comes_after_the_node_read_ends_reads_the_value_at_once(server):
    key = _key()
    server.set(key, "already there")
    first = _start(server, key, node=0)
    _joined(first)
    assert _outcome(first)["value"] == "already there"
    late = _start(server, key, node=0)
    assert _joined(late)  # the name was let go: it reads the store itself
    outcome = _outcome(late)
    assert (outcome["value"], outcome["covered"]) == ("already there", [False]), outcome


def test_a_follower_of_a_frozen_reader_never_waits_past_its_deadline(server):
    # Its deadline (3 s) comes before its reader's silence would count (a slice and QUIET_S): it
    # returns at its deadline, with nothing, not when it would have given up on the reader.
    key = _key()
    reader = _start(server, key, node=0, slice_s=1.0, seconds=60.0)
    assert _joined(reader)
    reader.send_signal(signal.SIGSTOP)
    try:
        follower = _start(server, key, node=0, slice_s=1.0, seconds=3.0)
        assert not _joined(follower)
        outcome = _outcome(follower, timeout=30)
    finally:
        reader.kill()
        reader.wait(timeout=30)
    assert outcome["value"] is None and outcome["covered"] == [False], outcome
    assert 3.0 <= outcome["seconds"] < 3.0 + 1.0 < 1.0 + QUIET_S, outcome


def test_no_node_means_every_waiter_reads_on_its_own(server):
    key = _key()
    server.set(key, "v")
    store = StoreClient(time.monotonic() + 5, base=server)
    with NodeRead.of(key, None) as alone:
        assert alone.reads and alone.listener is None
        read = alone.read(store, key, 1.0)
    assert (read.value, read.covered) == (b"v", False)
    assert read_address(key, 0) != read_address(key, 1)


def test_a_follower_whose_socket_is_numbered_past_1024_still_hears_its_reader():
    # select() refuses such descriptors; a training process (or a simulation of thousands of
    # ranks) has that many open easily.
    import resource
    import threading

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine allows {hard} descriptors a process")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048 if hard == resource.RLIM_INFINITY else min(hard, 4096)),
                                                hard))
    pads = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        base = dist.HashStore()
        store = StoreClient(time.monotonic() + 10, base=base)
        key = _key()
        with NodeRead.of(key, 0) as reader, NodeRead.of(key, 0) as follower:
            assert follower.upstream is not None and follower.upstream.fileno() >= 1024
            threading.Timer(0.2, base.set, (key, "v")).start()
            assert reader.read(store, key, 5.0).value == b"v"
            assert follower.read(store, key, 5.0) == Read(b"v", True)
    finally:
        for fd in pads:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
