"""The recovery's control plane at the sizes where failures are routine: N simulated ranks'
monitors, hypergrid's own code, against one real TCPStore.

Each simulated rank is a :class:`hypergrid.liveness.monitor.RankMonitor` (the code a rank's monitor
process runs) with its own store connections, hosted by a few worker processes (no torch in
them, as in a monitor); the data plane is not simulated: a rank "aborts" when its monitor hands
it a loss of the job's board. The store is torch's own TCPStore server (libuv), in this process.
Ranks are on nodes of 8; each watches its successor in the job's ring.

Measured, per size:

* the steady state: store requests and bytes per rank per interval, in total per second, and
  how long a plain ``get`` by another client takes meanwhile (median, p99);
* the time from a rank's process ending (its monitor sees it and publishes) to the job's board
  having it and to every other rank having it (rank 0, rank 1,500, the last rank), and from a
  whole node going silent (monitors and all) to the board having all of its ranks (their
  watchers' publication) and to every other rank having them (the delivery as well);
* one recovery round of every rank as ``recover`` takes it, after node 1 was lost whole: the
  round opened (``RecoveryRound.open``, over a committed record, as in a job after its first
  recovery), the arrival and the verdict (``RecoveryRound.agree``), the rebuild's world step (named
  by the round, its checkpoint's wait hearing the board), and the round's end, record and close,
  each node's record read, arrivals and end made as one batch by its delegate
  (``hypergrid.liveness.calls``): one participant thread per node runs the round's code, its
  node's other ranks' calls joining its batches (see ``_round``). The time until every
  participant has the verdict and has ended the step, the store's own CPU time for all of it,
  and the requests, the participants' and their nodes' delegates', in all and by part.

Beside it, the naive design ("scan": every rank adds to its heartbeat and reads up to 1,024
other ranks' heartbeats every interval, check + multi_get) at the sizes it reaches, modelled with
the same client.

Each node's monitors elect a relay delegate (:mod:`hypergrid.liveness.relay`, abstract Unix
sockets, within a worker as on a host), which alone has a board connection and waits on the
board, and hands each event to the node's other monitors: the store's work of delivering an
event is two requests per node, and each loss's line says how many the board's waits made.

This machine allows a process 20,000 file descriptors (a hard limit). Past ``--connections``
ranks (1,024 by default), every few ranks share one connection for their beats (4 at 16,384
with ``--connections 4096``): their requests and bytes are counted the same; only the store's
socket count differs. The board's connections are one per node, as in a cluster. 65,536 ranks do
not fit with every monitor hosted; with ``--delegates-only`` (one monitor per node hosted, what
the others say on their node's socket simulated) 131,072 do: 16,384 board connections.

And ``--monitor-cost SECONDS``: real monitor processes of a 4-rank gloo job, their unique set size
and their share of a core in the steady state, read from /proc.

On two cores the simulation itself is the limit past 4,096 ranks: 16,384 monitors' Python does
not run once a second in four processes (the store keeps up; the workers fall behind), and
thousands of participant threads of one round in four processes starve one another. The figures in
docs/recovery.md ran 16,384 with a 4 s heartbeat (the per-interval figures do not depend on the
interval), and its round alone with its threads over 16 processes. ``--replay-interval SECONDS``
then stops the monitors and sends each one's last beat (the same message, on its connection)
every SECONDS: what the store spends at a heartbeat whose monitors the workers cannot run.

Run::

    python benchmarks/bench_control_plane.py                          # 8, 1,024, 4,096, the scan beside
    python benchmarks/bench_control_plane.py --scan-sizes --sizes 16384 --connections 4096 --interval 4 --steady 20 --no-round
    python benchmarks/bench_control_plane.py --scan-sizes --sizes 16384 --only-round --round-workers 16 --connections 16384
    python benchmarks/bench_control_plane.py --scan-sizes --sizes 131072 --only-round --round-workers 16 --connections 1024
    python benchmarks/bench_control_plane.py --scan-sizes --sizes 131072 --only-round --round-workers 16 --connections 1024 --nodes-make-calls
    python benchmarks/bench_control_plane.py --scan-sizes --sizes 131072 --delegates-only --interval 4 --steady 20 --no-round
    python benchmarks/bench_control_plane.py --scan-sizes --sizes 131072 --delegates-only --interval 2 --steady 20 --no-round --replay-interval 1
    python benchmarks/bench_control_plane.py --sizes 1024 --steady 5  # quicker
    python benchmarks/bench_control_plane.py --monitor-cost 60
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import os
import resource
import selectors
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, NamedTuple, Optional

from store_cpu import server_cpu_s  # benchmarks/store_cpu.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NODE = 8
#: The losses of a rack: nodes 9 to 12 at once (consecutive nodes, as a switch or a power feed takes them).
RACK_NODES = 4
RACK_LABEL = f"a rack of {RACK_NODES} nodes lost"


# ---------------------------------------------------------------------- worker side (no torch)
def _worker(spec: dict) -> None:
    """Host ``spec["ranks"]``'s monitors (or, ``scan``, the replaced design's traffic); obey stdin."""
    from concurrent.futures import ThreadPoolExecutor

    from hypergrid.liveness.monitor import JobSpec, MonitorConfig, RankMonitor
    from hypergrid.store.keys import JobChannel
    from hypergrid.store.tcpstore import StoreProtocolError, StoreTimeout, WireStore

    # In a cluster each monitor decodes each event once, on a host of its own, all of them at the
    # same time; here a worker's thousand monitors would decode the same few events one after
    # another (15 us each, most of a worker's time delivering an event). The worker decodes each
    # event once for all of them (the records are frozen): what is left of the delivery's time is
    # the store's, the relays' and the monitors' own handling, still done in turn.
    monitor_module = sys.modules["hypergrid.liveness.monitor"]
    decode_events = monitor_module.decode_events
    monitor_module.decode_events = functools.lru_cache(maxsize=256)(lambda raw: tuple(decode_events(raw)))

    host, port, n, interval, share = spec["host"], spec["port"], spec["n"], spec["interval"], spec["share"]
    ranks: list[int] = spec["ranks"]
    simulated = bool(spec.get("followers_simulated"))  # only the nodes' delegates hosted (see --delegates-only)
    # A round hosts one participant per node (see _round): only theirs need connections.
    groups = sorted({r // share for r in (_heads(ranks).values() if spec["design"] == "round" else ranks)})
    ring = spec["design"] in ("ring", "round")
    # A few at a time per worker: the store (see _host_store) takes thousands a second.
    def open_connections(count: int) -> list[Any]:
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda _: WireStore.connect(host, port, timeout_s=600.0), range(count)))

    # A round's ranks that share connections have a second one for their waits (see _round); a
    # rank with a connection of its own makes its requests and its waits on it, one after the
    # other, as a rank's store client does: 16,384 of them fit the 20,000 descriptors.
    waits_apart = spec["design"] == "round" and share > 1
    opened = open_connections(len(groups) * (2 if waits_apart else 1))
    beat_conn = {g: opened[i] for i, g in enumerate(groups)}
    board_conn = ({g: opened[len(groups) + i] for i, g in enumerate(groups)} if waits_apart
                  else dict(beat_conn) if spec["design"] == "round" else {})
    conns = list(opened)
    if spec["design"] == "round":  # only a recovery round of every hosted rank, no monitors
        print("ready", flush=True)
        word, _, namespace = sys.stdin.readline().strip().partition(" ")
        if word == "round":
            _round(spec, ranks, beat_conn, board_conn, share, namespace)
        return

    received: dict[int, dict[int, float]] = {}  # victim -> rank -> when it heard
    by_delegates: dict[int, dict[int, float]] = {}  # the same, for the ranks whose monitor waits on the board
    monitors: dict[int, Any] = {}
    selector = selectors.DefaultSelector()
    registered: dict[int, set[int]] = {}  # rank -> its monitor's descriptors in the selector

    def sync(rank: int) -> None:
        """Keep the selector on what ``rank``'s monitor reads, after anything it did: its relay
        may have changed (a new delegate), and a socket it closed may have come back under the same
        number, which epoll forgot with the old one: every one of its descriptors anew."""
        for fd in registered.pop(rank, set()):
            try:
                selector.unregister(fd)
            except (KeyError, ValueError):
                pass
        if rank in halted:
            return
        registered[rank] = set(monitors[rank].readers())
        for fd in registered[rank]:
            selector.register(fd, selectors.EVENT_READ, rank)

    halted: set[int] = set()
    boards: list[Any] = []  # every board connection a relay delegate opened, closed ones too: their requests count

    def board_connection(timeout_s: float) -> Any:
        boards.append(WireStore.connect(host, port, timeout_s=600.0))
        return boards[-1]

    # rank -> its monitor's last beat: its node's key, its reads, the keys it beat for others (a group's
    # reader), and when (a group's delegate beats itself only until its reader answers)
    last_beat: dict[int, tuple[str, tuple[str, ...], tuple[str, ...], float]] = {}
    replays: list[tuple[float, int]] = []  # (when due, rank): the last beats sent again (see "replay")
    if ring:
        # Each rank's monitor as in a cluster: its node's monitors elect a relay delegate, which
        # alone opens a board connection and waits on the board, and hands the events on.
        channel = JobChannel(spec["namespace"], "bench", 0)
        job = JobSpec(channel, ((0, n),), NODE)
        for rank in ranks:
            def hear(event: Any, rank: int = rank) -> None:
                if event.kind.value == "lost":
                    received.setdefault(event.rank, {}).setdefault(rank, time.time())
                    if monitors[rank].board is not None or monitors[rank].group is not None:  # a node's delegate
                        by_delegates.setdefault(event.rank, {}).setdefault(rank, time.time())

            monitor = RankMonitor(MonitorConfig(host, port, spec["namespace"], rank, interval), forward=hear,
                                  now=time.monotonic(), connect=_first_then_new(beat_conn[rank // share], board_connection))
            monitors[rank] = monitor
            monitor.link.beat = _recorded(monitor.link.beat, last_beat, rank)  # type: ignore[method-assign]
        for rank in ranks:  # every one of them made before any attaches: relays form with all there
            monitors[rank].attach(job)
        for rank in ranks:
            sync(rank)
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
    print("ready", flush=True)
    ticks: list[tuple[float, int]] = []
    passes = {"done": 0, "late": 0.0, "dropped": 0}

    def board_requests() -> tuple[int, int]:
        return sum(b.requests for b in boards), sum(b.bytes_sent + b.bytes_received for b in boards)

    def scan(rank: int) -> None:
        conn = beat_conn[rank // share]
        conn.add(f"{spec['namespace']}/beat/{rank}", 1)  # the replaced design's own counter per rank
        peers = [f"{spec['namespace']}/beat/{r}" for r in range(min(n, 1025)) if r != rank][:1024]
        if conn.check(peers):
            conn.multi_get(peers)
        passes["done"] += 1

    def stop(rank: int) -> None:
        """The rank's monitor ends as a killed one would: its board and relay sockets close (its
        beats connection may be shared with other simulated ranks, and stays)."""
        halted.add(rank)
        sync(rank)
        monitors[rank].link.store = None  # its calls' connection may be shared with other simulated ranks: it stays
        monitors[rank].close()

    def run_due_ticks() -> None:
        # Before anything else, and between one rank's board reads and the next: in a cluster no
        # monitor's tick waits while a thousand others read an event, and a watcher whose tick
        # came late would publish late for the simulation's sake, not its own.
        while ticks and ticks[0][0] <= time.monotonic():
            due, rank = heapq.heappop(ticks)
            if rank in halted:
                continue
            now = time.monotonic()
            passes["late"] = max(passes["late"], now - due)
            if ring:
                heard = monitors[rank].node_ranks
                if simulated and heard is not None:  # what its node's other monitors say over the node's socket
                    for other in range(rank + 1, rank - rank % NODE + NODE):
                        heard.hear(other, now)
                monitors[rank].tick(now=now)
                monitors[rank].progress(now=now)
            else:
                try:
                    scan(rank)
                except (OSError, StoreTimeout, StoreProtocolError):  # the store gave up on it
                    passes["dropped"] += 1
                    halted.add(rank)
                    continue
            passes["done"] += ring
            heapq.heappush(ticks, (due + interval, rank))

    def run_due_replays() -> None:
        # The same message as the monitor's last beat, on its connection: its node's counter and the reads.
        while replays and replays[0][0] <= time.monotonic():
            due, rank = heapq.heappop(replays)
            passes["late"] = max(passes["late"], time.monotonic() - due)
            key, reads, also, _ = last_beat[rank]
            monitors[rank].link.store.adds([(key, 1), *((read, 0) for read in reads), *((other, 1) for other in also)])
            passes["done"] += 1
            heapq.heappush(replays, (due + replay_s[0], rank))

    replay_s = [0.0]
    inbox = b""
    while True:
        run_due_ticks()
        run_due_replays()
        due_next = min([q[0][0] for q in (ticks, replays) if q], default=None)
        timeout = max(0.0, due_next - time.monotonic()) if due_next is not None else 0.5
        for key, _ in selector.select(timeout):
            if key.data is not None:
                run_due_ticks()
                rank = key.data
                if rank not in halted and key.fd in registered.get(rank, ()):
                    monitors[rank].on_ready(key.fd, now=time.monotonic())
                    sync(rank)
                continue
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return
            lines, _, inbox = (inbox + chunk).rpartition(b"\n")
            for line in lines.decode().split("\n") if lines else []:
                word, _, rest = line.partition(" ")
                if word == "go":
                    start, replays[:] = time.monotonic(), []
                    ticks[:] = [(start + interval * i / len(ranks), r) for i, r in enumerate(ranks)]
                    heapq.heapify(ticks)
                elif word == "replay":  # the monitors stop; their last beats are sent every `rest` seconds
                    replay_s[0], ticks[:] = float(rest), []
                    recent = time.monotonic() - 1.5 * interval  # those still beating when the monitors stopped
                    sending = [r for r in sorted(last_beat) if r not in halted and monitors[r].link.store is not None
                               and last_beat[r][3] >= recent]
                    start = time.monotonic()
                    replays[:] = [(start + replay_s[0] * i / len(sending), r) for i, r in enumerate(sending)]
                    heapq.heapify(replays)
                elif word == "counters":
                    on_board = board_requests()
                    print(json.dumps({"requests": sum(c.requests for c in conns) + on_board[0],
                                      "bytes": sum(c.bytes_sent + c.bytes_received for c in conns) + on_board[1],
                                      "board_requests": on_board[0],
                                      "passes": passes["done"], "late": passes["late"],
                                      "dropped": passes["dropped"]}), flush=True)
                    passes["late"] = 0.0
                elif word == "die":
                    rank = int(rest)
                    if rank in monitors and rank not in halted:
                        monitors[rank].publish(_lost(rank))  # what its monitor does when its process ends
                        stop(rank)
                elif word == "halt":
                    for rank in map(int, rest.split()):
                        if rank in monitors and rank not in halted:
                            stop(rank)  # the whole node: its monitors beat no more
                elif word == "report":
                    victims = [int(v) for v in rest.split()]
                    live = [r for r in ranks if r not in halted]
                    out = {}
                    for v in victims:
                        heard = received.get(v, {})
                        times = [heard[r] for r in live if r in heard]
                        leads = [t for r, t in by_delegates.get(v, {}).items() if r not in halted]
                        out[v] = [len(times), len(live), max(times) if times else None, max(leads) if leads else None]
                    print(json.dumps(out), flush=True)
                elif word == "quit":
                    return


def _recorded(beat: Any, last: dict, rank: int) -> Any:
    """``beat`` (a monitor's StoreLink.beat), noting in ``last[rank]`` what it sent each time."""

    def recording(key: str, reads: Any = (), also: Any = ()) -> Any:
        last[rank] = (key, tuple(reads), tuple(also), time.monotonic())
        return beat(key, reads, also)

    return recording


def _first_then_new(first: Any, connect: Any) -> Any:
    """A simulated monitor's connections: its beats' (shared by ``share`` ranks: a machine's descriptors
    are too few for one each), then its board's, one of its own where it becomes its node's delegate."""
    pending = [first]

    def connection(timeout_s: float) -> Any:
        return pending.pop() if pending else connect(timeout_s)

    return connection


def _lost(rank: int) -> Any:
    from hypergrid.store.records import BoardEvent, EventKind

    return BoardEvent(EventKind.LOST, rank, "its process ended", by=rank)


def _heads(ranks: list[int]) -> dict[int, int]:
    """Each node's hosted participant in a round: its lowest rank among ``ranks``."""
    heads: dict[int, int] = {}
    for rank in ranks:
        heads.setdefault(rank // NODE, rank)
    return heads


def _round(spec: dict, ranks: list[int], beat_conns: dict, board_conns: dict, share: int, namespace: str) -> None:
    """Every hosted rank takes part in one recovery round, as ``recover`` takes it, from the
    library's public pieces: the round opened (``RecoveryRound.open``: the job's record, as in a
    job after its first recovery), the arrival and the verdict (``RecoveryRound.agree``), and the
    rebuild's end, a meeting named by the round whose last participant decides it, tells the job's
    board and commits the record, once. The job's record read, the arrival and the rebuild's end go
    through the rank's node (``NodeChannel``): its delegate takes its ranks' calls as one batch
    (``hypergrid.liveness.calls``) and hands it to its group's reader over the group's TCP link
    (``GroupLink.take_calls``), whose thread makes the group's nodes' batches as one
    (``GroupLink.make_due``; ``--nodes-make-calls``: each node's delegate makes its own). The verdict and the rebuild's outcome reach the participants as
    they reach a rank: through the board, read once per node by the node's delegate (here a thread
    per node with a board connection of its own, as a monitor's relay), which hands each entry to
    its node's participants' views (``BoardView.hear``). Timings are the library's defaults
    (``RecoverySettings()``).

    Each node's lowest hosted rank is a participant thread running the round's code; its node's
    other ranks are simulated where only their node's socket would carry what they do: their calls
    join the hosted one's batch (their own ranks and arrivals), and each hears the verdict from the
    delegate as the hosted one does. The hosted one is first in its node's arrival batch (the round's
    first arrival publishes its opening) and last in the rebuild's end (the last counted commits);
    a simulated rank among the first three arrivals contends for the lead as it would.

    A rank with a connection of its own makes its requests and its waits on it, as a rank's store
    client does. Where ranks share one (past ``--connections``), a second one of the group's takes
    their waits, and they take turns on each (in a cluster every rank has its own)."""
    from hypergrid.liveness.board import BoardView, put_entry
    from hypergrid.liveness.calls import NodeChannel
    from hypergrid.liveness.fanout import GroupLink, ReaderGroups
    from hypergrid.liveness.plane import ControlPlane
    from hypergrid.recovery.round import RecoveryRound
    from hypergrid.recovery.settings import RecoverySettings
    from hypergrid.store import meeting
    from hypergrid.store.keys import JobChannel
    from hypergrid.store.records import (
        Arrival,
        BoardEvent,
        EventKind,
        JobRecord,
        JobState,
        StepOutcome,
        decode_events,
        encode,
        encode_events,
    )
    from hypergrid.store.tcpstore import WireStore

    settings = RecoverySettings(gpus_per_node=NODE)
    # A thread waiting for the GIL wakes every switch interval (5 ms) to ask for it: a thousand
    # participants just woken by one verdict then spend both cores waking each other (8,192 ranks
    # in 16 processes had not agreed after 8 minutes, some 200 threads per process runnable at any
    # time). The participants give the GIL up at each store call anyway; a long interval only
    # stops the waiting ones from spinning. A cluster's ranks are processes of their own.
    sys.setswitchinterval(0.5)
    threading.stack_size(256 * 1024)
    channel = JobChannel(namespace, "round", 0)
    plane = ControlPlane(namespace, None, (spec["host"], spec["port"]))
    conns = list({id(c): c for c in list(beat_conns.values()) + list(board_conns.values())}.values())
    locks = {g: threading.Lock() for g in beat_conns}
    # One connection per rank: its requests and its waits take turns on it, under one lock.
    wait_locks = {g: threading.Lock() for g in board_conns} if share > 1 else locks
    go = threading.Event()
    heads = _heads(ranks)
    participants = spec["participants"]  # in all workers: the rebuild's end counts them
    parts = _Parts(len(heads))
    results: list[Any] = []
    errors: list[str] = []
    stores: list[_Bounded] = []
    views: dict[int, list[Any]] = {}  # node -> its participants' views of the board, hearing its delegate
    registered = threading.Semaphore(0)
    n = spec["n"]
    record = JobRecord(2, (n,), ("dp",), ((0, 0, n),), (), step=1, board_from=0)

    nodes = sorted({rank // NODE for rank in ranks})
    # The job's nodes grouped as its monitors group them (``hypergrid.liveness.fanout``): the
    # delegate of each group's reader node alone waits on the board, and hands each entry to the
    # group's other delegates over TCP (the library's GroupLink, between workers too).
    readers = ReaderGroups()
    job_nodes = [node for node in range(n // NODE) if node != LOST_NODE]
    reading = [node for node in nodes if readers.reader(node, job_nodes) in (node, None)]
    delegates = {node: WireStore.connect(spec["host"], spec["port"], timeout_s=_ROUND_S) for node in reading}
    # A group's delegate that joined its reader after an entry reads that entry from the store, as a monitor does.
    catch_up = WireStore.connect(spec["host"], spec["port"], timeout_s=_ROUND_S)
    setup = WireStore.connect(spec["host"], spec["port"], timeout_s=_ROUND_S)
    leads = {node: GroupLink.lead(setup.local_host, channel.board_reader(readers.group(node)))
             for node in reading if readers.reader(node, job_nodes) == node}
    for link in leads.values():  # every reader of this worker says where it listens before any looks
        setup.set(link.group_key, link.address.encode())
    follows: dict[int, Any] = {}
    # A reader's delegate makes its group's batches of calls on its own connection, from a thread of
    # its own here (a process of its own in a cluster: no reader waits for another's requests). The
    # participants hand their nodes' batches to their group's link from their threads, each node's
    # under a lock of its own, and wake their reader where it is in this worker.
    group_calls = {node: _CountingLink(WireStore.connect(spec["host"], spec["port"], timeout_s=_ROUND_S))
                   for node in leads}
    calls_locks = {node: threading.Lock() for node in nodes}
    wakes = {node: os.pipe() for node in leads}

    def group_of(node: int) -> Any:
        """Where ``node``'s delegate hands its batches: its group's link (None: it makes them itself)."""
        return (leads.get(node) or follows.get(node)) if spec.get("group_calls", True) else None

    def join_readers() -> None:
        for node in nodes:
            if node not in delegates:
                key = channel.board_reader(readers.group(node))
                follows[node] = GroupLink.follow(setup.get(key, within_s=_ROUND_S).decode(), key, timeout_s=60.0)

    index = dict.fromkeys(nodes, 0)  # each node's next entry on the board

    def delegates_loop() -> None:
        """Every node's one wait on the board, as its relay's delegate keeps it, made by its group's
        reader: a pending wait on the next entry (nothing for the store until it is set), its read,
        and every entry handed to the group's other delegates and to the node's participants. One
        thread for the worker's nodes (a thread each would pass this machine's limit on threads at
        131,072 ranks), each node's wait answered in turn."""
        watching = selectors.DefaultSelector()

        def hand(node: int, payload: str) -> None:
            if node in leads:
                leads[node].send(index[node], payload)  # it takes those waiting to join first
                os.write(wakes[node][1], b"w")  # their calls are heard from now on
            index[node] += 1
            for view in views[node]:
                for event in decode_events(payload):
                    view.hear(event)

        for node, conn in delegates.items():
            conn.start_wait([channel.board_slot(0)])
            watching.register(conn.fileno(), selectors.EVENT_READ, ("board", node))
        for node, link in follows.items():
            watching.register(link.readers()[0], selectors.EVENT_READ, ("reader", node))
        while True:
            for key, _ in watching.select():
                kind, node = key.data
                if kind == "board":
                    conn, slot = delegates[node], channel.board_slot(index[node])
                    conn.finish_wait()
                    payload = conn.read_then_wait(slot, [channel.board_slot(index[node] + 1)]).decode()
                    hand(node, payload)
                else:
                    with calls_locks[node]:  # the answers to its node's calls pass on here
                        heard = follows[node].on_ready(key.fd, index[node])
                    for item in heard or ():
                        while index[node] < item.index:  # what it missed before it joined
                            hand(node, catch_up.get(channel.board_slot(index[node])).decode())
                        if item.payload is not None and item.index == index[node]:
                            hand(node, item.payload)

    def reader_loop(node: int) -> None:
        """A group's reader's calls, as its monitor's loop takes them: the delegates that join, the
        batches they hand on, and the group's batches made once due (``GroupLink.make_due``)."""
        link, lock, (wake, _) = leads[node], calls_locks[node], wakes[node]
        watching = selectors.DefaultSelector()
        watching.register(link.readers()[0], selectors.EVENT_READ, "joins")
        watching.register(wake, selectors.EVENT_READ, "wake")
        while True:
            with lock:
                due = link.calls.due_at()
            for key, _ in watching.select(timeout=None if due is None else max(0.0, due - time.monotonic())):
                if key.data == "joins":
                    link.accept_waiting(position=index[node])
                elif key.data == "wake":
                    os.read(wake, 4096)
                else:
                    with lock:
                        link.on_ready(key.fd, index[node], now=time.monotonic())
                    if key.fd not in link.relay.followers:
                        watching.unregister(key.fd)
            for fd in list(link.relay.followers):
                if fd not in watching.get_map():
                    watching.register(fd, selectors.EVENT_READ, "calls")
            with lock:
                link.make_due(group_calls[node], now=time.monotonic())

    def arrival(rank: int) -> Arrival:
        return Arrival(rank, step=1, settings=settings.describe())

    def participant(rank: int) -> None:
        group = rank // share
        store = _Bounded(beat_conns[group], locks[group], board_conns[group], wait_locks[group],
                         time.monotonic() + _ROUND_S, shared=share > 1)
        node = _NodeOfRanks(rank, [r for r in ranks if r // NODE == rank // NODE and r != rank], store,
                            lambda r: encode(arrival(r)), functools.partial(group_of, rank // NODE),
                            calls_locks[rank // NODE], wakes[rank // NODE][1] if rank // NODE in leads else -1)
        view = BoardView(channel, lambda: store)
        view.hear_from(_Handed(), "the node's delegate")
        views.setdefault(rank // NODE, []).append(view)
        stores.append(store)
        registered.release()
        go.wait()
        try:
            store.phase = "open"
            rnd = RecoveryRound.open(channel, plane, store.deadline, store,  # type: ignore[arg-type]
                                     node=NodeChannel(node))
            node.keys = rnd.keys
            parts.reached("open")
            store.phase = "round"
            verdict = rnd.agree(range(n), arrival(rank), bound_s=_ROUND_S / 2, board=view, settings=settings)
            agreed = time.time()
            node.contend()
            parts.reached("verdict")
            store.phase = "step"
            rebuild = rnd.keys.rebuild("recover")
            if rnd.node.arrive(store, rebuild, participants, again=False).completes:
                done = encode(StepOutcome(None)).encode()
                if meeting.decide(store, rebuild, done) == done:  # type: ignore[arg-type]
                    view.publish(rebuild.outcome, done, rank)
                    rnd.commit(record)
            elif meeting.wait_outcome(store, rebuild, store.remaining(), view,  # type: ignore[arg-type]
                                      settings.outcome_fallback_s) is None:
                raise TimeoutError("the rebuild's outcome did not come")
            stepped = time.time()
        except Exception as exc:  # a participant that did not get the verdict is a figure too
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")
            parts.leave()
            return
        results.append((agreed, stepped, verdict.failed))

    if 0 in ranks:
        # The job as its first recovery left it: the round's participants read the record.
        first = JobRecord(1, (n,), ("dp",), ((0, 0, n),), (), step=0, gone=("rank 9: stale",))
        beat_conns[0].set(channel.state, encode(JobState(1, first)).encode())
        # The node the round recovers from, lost whole: its ranks on the board, in one entry.
        lost = encode_events([BoardEvent(EventKind.LOST, r, "its node stopped beating", by=0)
                              for r in range(LOST_NODE * NODE, (LOST_NODE + 1) * NODE)])
        put_entry(beat_conns[0], channel, lost.encode(), 0)
    threads = [threading.Thread(target=participant, args=(rank,), daemon=True) for rank in heads.values()]
    for thread in threads:
        thread.start()
    for _ in heads:
        registered.acquire()
    join_readers()  # connections wait in their reader's backlog until it takes them (with its position)
    threading.Thread(target=delegates_loop, daemon=True).start()
    for node in leads:
        threading.Thread(target=reader_loop, args=(node,), daemon=True).start()
    conns += [link.conn for link in group_calls.values()]
    before = (sum(c.requests for c in conns), sum(c.bytes_sent + c.bytes_received for c in conns),
              sum(c.requests for c in [*delegates.values(), catch_up]))
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    for part in ("open", "verdict"):  # the parent reads the store's CPU between the parts
        parts.wait_all(part)
        print(f"{part} done", flush=True)
        sys.stdin.readline()
        parts.release(part)
    for thread in threads:
        thread.join()
    print(json.dumps({"last": max(t for t, _, _ in results) if results else None,
                      "last_step": max(t for _, t, _ in results) if results else None,
                      "failed": sorted({r for _, _, failed in results for r in failed}),
                      "agreed": len(results), "errors": errors[:3], "error_count": len(errors),
                      "requests": sum(c.requests for c in conns) - before[0],
                      "delegate_requests": sum(c.requests for c in [*delegates.values(), catch_up]) - before[2],
                      "delegates": len(nodes), "board_readers": len(delegates),
                      "rewaits": sum(store.rewaits for store in stores),
                      "made": {phase: sum(store.made.get(phase, 0) for store in stores)
                               for phase in ("open", "round", "step")},
                      "by_nodes": {phase: sum(store.by_node.get(phase, 0) for store in stores)
                                   + sum(link.made[phase] for link in group_calls.values())
                                   for phase in ("open", "round", "step")},
                      "group_batches": sum(link.batches for link in group_calls.values()),
                      "bytes": sum(c.bytes_sent + c.bytes_received for c in conns) - before[1]}), flush=True)


class _Parts:
    """Holds a worker's participants between the parts of the round (opening it; arriving and the
    verdict; the rebuild's end and the commit) until the parent has read the store's CPU: each
    part's figure is its own. In a cluster nobody waits there."""

    def __init__(self, count: int) -> None:
        self.count = count
        lock = threading.Lock()
        # Two conditions over one lock: an arrival wakes only the worker's main thread, not the
        # thousand participants already held (a notify_all per arrival woke them all, each time).
        self.counted, self.freed = threading.Condition(lock), threading.Condition(lock)
        self.done: dict[str, int] = {}
        self.released: set[str] = set()

    def reached(self, part: str) -> None:
        with self.counted:
            self.done[part] = self.done.get(part, 0) + 1
            self.counted.notify()
            self.freed.wait_for(lambda: part in self.released)

    def leave(self) -> None:
        """A participant that failed: the parts after it wait for one fewer."""
        with self.counted:
            self.count -= 1
            self.counted.notify()

    def wait_all(self, part: str) -> None:
        with self.counted:
            self.counted.wait_for(lambda: self.done.get(part, 0) >= self.count)

    def release(self, part: str) -> None:
        with self.freed:
            self.released.add(part)
            self.freed.notify_all()


class _Handed:
    """What a participant's view hears from: its node's delegate thread calls the view itself
    (a rank's heartbeat would, on its own thread), so there is nothing to register with."""

    def listen(self, name: str, callback: Any, replay: bool = False) -> None:
        pass


class _NodeOfRanks:
    """What a round's node calls find at the node's delegate: the hosted participant ``head``'s call,
    with the same call of each of the node's ``others`` (simulated: their own ranks, their own
    arrivals from ``arrival``), made as one batch by the library's ``NodeCalls`` and ``answer_batch``.
    Plays the rank's heartbeat for ``NodeChannel``."""

    running = True

    def __init__(self, head: int, others: list[int], store: _Bounded, arrival: Any, group: Any = None,
                 lock: Optional[threading.Lock] = None, wake: int = -1) -> None:
        self.head, self.others, self.store, self.arrival, self.wake = head, others, store, arrival, wake
        #: The node's group's link (``GroupLink``; a function: it is joined after the participants
        #: start), which its delegate hands each batch to, and the lock its calls are taken under
        #: (the worker's thread for its delegates answers them).
        self.group, self.lock = group, lock
        self.keys: Any = None  # the round's keys, once opened: the simulated ranks' contention for the lead
        self.contenders: list[int] = []  # simulated ranks among the round's first arrivals

    def contend(self) -> None:
        """The requests the simulated ranks among the first arrivals make to contend for the lead, made
        once the verdict stands: a simulated rank cannot lead, so it must not win (the same requests)."""
        for rank in self.contenders:
            self.store._on(lambda conn, rank=rank: (conn.set(self.keys.wake, b""), conn.compare_set(
                self.keys.leader, b"", str(rank).encode())))

    def call(self, call: Any, timeout_s: float) -> Any:
        import dataclasses

        from hypergrid.liveness.calls import NodeCalls, answer_batch

        call = dataclasses.replace(call, rank=self.head)
        others = [dataclasses.replace(call, rank=r, line=None if call.line is None else self.arrival(r))
                  for r in self.others]
        # The hosted rank first among its node's arrivals, last at the rebuild's end (see _round).
        ordered = [*others, call] if call.line is None and call.kind.value == "arrive" else [call, *others]
        calls = NodeCalls()
        for each in ordered:
            calls.take(each, lambda answer: None, now=0.0)
        [batch] = calls.due(members=len(ordered), now=0.0)
        answers = self._through_group(batch, self.group()) if self.group is not None else None
        if answers is None:
            answers = self.store.for_node(lambda conn: answer_batch(conn, [each for each, _ in batch]))
        self.contenders += [answer.rank for answer in answers
                            if call.line is not None and answer.rank != self.head and answer.number <= _CONTENDERS]
        return next(answer for answer in answers if answer.rank == self.head)


    def _through_group(self, batch: list, group: Any) -> Optional[list]:
        """The node's batch handed to its group (``GroupLink.take_calls``, as its delegate's monitor
        hands it): the answers, in the batch's order, once its reader made the group's batch; None
        where the group did not take it (the node makes it itself)."""
        answers: dict[int, Any] = {}
        done = threading.Event()

        def reply(answer: Any) -> None:
            answers[answer.rank] = answer
            if len(answers) == len(batch):
                done.set()

        if group is None:
            return None
        assert self.lock is not None
        with self.lock:
            if not group.take_calls([(call, reply) for call, _ in batch], now=time.monotonic()):
                return None
        if group.leads:  # held by this worker's reader: its thread sleeps until a batch is due
            os.write(self.wake, b"w")
        if not done.wait(_ROUND_S):
            raise TimeoutError(f"node {self.head // NODE}'s group did not answer its batch")
        return [answers[call.rank] for call, _ in batch]


class _CountingLink:
    """A reader's connection as the library's ``GroupLink.make_due`` makes its group's batches on it
    (a ``StoreLink``'s ``call``), its requests counted by the round's part each batch is of."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.made = {"open": 0, "round": 0, "step": 0}
        self.batches = 0

    def call(self, make: Any, again: bool = True) -> Any:
        first = make.keywords["calls"][0]
        part = "open" if first.kind.value == "read" else "round" if first.line is not None else "step"
        before = self.conn.requests
        try:
            return make(self.conn)
        finally:
            self.made[part] += self.conn.requests - before
            self.batches += 1


class _Bounded:
    """The pure client with the few methods a round's store needs (StoreClient's, over str or bytes values)."""

    def __init__(self, conn: Any, lock: threading.Lock, wait_conn: Any, wait_lock: threading.Lock,
                 deadline: float, shared: bool) -> None:
        self.conn, self.lock, self.deadline = conn, lock, deadline
        self.wait_conn, self.wait_lock, self.shared = wait_conn, wait_lock, shared
        self.rewaits = 0
        #: The participant's own requests (re-waits apart) in each part of the round it is in, and
        #: its node's delegate's for its node's ranks' calls.
        self.phase = "round"
        self.made: dict[str, int] = {}
        self.by_node: dict[str, int] = {}

    def for_node(self, call: Any) -> Any:
        """``call(conn)`` made by the node's delegate (on this connection: the store sees the same
        requests), counted apart."""
        return self._counted(call, self.by_node)

    def _on(self, call: Any) -> Any:
        """``call(conn)`` on the requests' connection, its requests counted to the phase."""
        return self._counted(call, self.made)

    def _counted(self, call: Any, tally: dict[str, int]) -> Any:
        with self.lock:
            before = self.conn.requests
            try:
                return call(self.conn)
            finally:
                tally[self.phase] = tally.get(self.phase, 0) + self.conn.requests - before

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def extend(self, seconds: float) -> None:
        self.deadline = max(self.deadline, time.monotonic() + seconds)

    def add(self, key: str, amount: int) -> int:
        return self._on(lambda conn: conn.add(key, amount))

    def set(self, key: str, value: str | bytes) -> None:
        self._on(lambda conn: conn.set(key, value.encode() if isinstance(value, str) else value))

    def append(self, key: str, value: str) -> None:
        self._on(lambda conn: conn.append(key, value.encode()))

    def get(self, key: str) -> bytes:
        return self._on(lambda conn: conn.get(key))

    def delete_key(self, key: str) -> bool:
        return self._on(lambda conn: conn.delete_key(key))

    def check(self, keys: list[str]) -> bool:
        return self._on(lambda conn: conn.check(keys))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        as_bytes = lambda v: v.encode() if isinstance(v, str) else v  # noqa: E731  (StoreClient takes both)
        return self._on(lambda conn: conn.compare_set(key, as_bytes(expected), as_bytes(desired)))

    def get_if_set(self, key: str) -> Optional[bytes]:
        from hypergrid.store.client import read_if_set

        return read_if_set(self, key)

    def get_within(self, key: str, seconds: float, *, meanwhile: Any = None, every_s: float = 1.0) -> Optional[bytes]:
        # As torch's client: a wait and a get (one blocking get), on the waits' connection. Here on
        # the caller's own thread, so ``meanwhile`` (a node's reader telling its followers it still
        # waits) is not called: the followers keep to their reader anyway (_round sets QUIET_S).
        from hypergrid.store.tcpstore import StoreTimeout

        def attempt(conn: Any, within: float) -> Optional[bytes]:
            try:
                return conn.get(key, within_s=max(within, 0.001))
            except StoreTimeout:
                return None

        return self._turns(attempt, seconds)

    def wait(self, keys: list[str], seconds: float) -> bool:
        return bool(self._turns(lambda conn, within: conn.wait(keys, within) or None, seconds))

    def _turns(self, attempt: Any, seconds: float) -> Any:
        """``attempt`` on the waits' connection for up to ``seconds``. A rank with a connection of
        its own makes one call. Ranks that share one take turns a slice at a time: a rank holding
        it for a whole blocking wait would keep the others from the step it waits for (a cluster's
        ranks each have their own). What a turn that ran out cost, where more time was left, is a
        wait a rank of its own would not have made: counted in ``rewaits``, apart."""
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            with self.wait_lock:
                before = self.wait_conn.requests
                got = attempt(self.wait_conn, min(left, _SHARED_TURN_S) if self.shared else left)
                made = self.wait_conn.requests - before
                if got is None and end - time.monotonic() > 0:
                    self.rewaits += made
                else:
                    self.made[self.phase] = self.made.get(self.phase, 0) + made
            if got is not None or end - time.monotonic() <= 0:
                return got


#: The node lost whole before the round (its ranks are not hosted; the board has them), and how
#: many of the round's first arrivals contend for the lead (hypergrid.recovery.round's).
LOST_NODE = 1
_CONTENDERS = 3

#: The simulated round's deadline, and its world step's timeout: thousands of threads per process
#: on two cores take minutes where a cluster's ranks take seconds.
_ROUND_S = 1200.0

#: How long a simulated rank holds a shared waits' connection at a time (see _Bounded._turns).
_SHARED_TURN_S = 0.25


# ---------------------------------------------------------------------- main side
class Workers:
    """The worker processes hosting one size's simulated ranks."""

    def __init__(self, spec: dict, count: int) -> None:
        hosted = spec.get("hosted", list(range(spec["n"])))
        nodes = sorted({rank // NODE for rank in hosted})  # a node's ranks in one worker: its socket is local
        bounds = [nodes[len(nodes) * i // count] if i < count else nodes[-1] + 1 for i in range(count + 1)]
        self.procs = []
        for i in range(count):
            part = dict(spec, ranks=[r for r in hosted if bounds[i] <= r // NODE < bounds[i + 1]], hosted=None)
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(part)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            self.procs.append(proc)
        for proc in self.procs:
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"a worker did not start: {line!r}")

    def send(self, line: str) -> None:
        for proc in self.procs:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def ask(self, line: str) -> list[Any]:
        self.send(line)
        return [json.loads(proc.stdout.readline()) for proc in self.procs]

    def close(self) -> None:
        self.send("quit")
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # A worker whose ranks' connections are still queued at a saturated store (the
                # replaced design at 1,024) leaves no figure behind it: end it.
                proc.kill()
                proc.wait(timeout=30)


def _probe(host: str, port: int, seconds: float) -> tuple[float, float]:
    """Median and p99 of a plain ``get`` by a client of its own, in ms, over ``seconds``."""
    from hypergrid.store.tcpstore import WireStore

    conn = WireStore.connect(host, port, timeout_s=30.0)
    conn.set("bench/probe", b"x")
    took = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        conn.get("bench/probe")
        took.append((time.perf_counter() - start) * 1000)
        time.sleep(0.01)
    conn.close()
    took.sort()
    return statistics.median(took), took[int(len(took) * 0.99)]


def _steady(workers: Workers, n: int, interval: float, seconds: float, host: str, port: int,
            hosted: Optional[int] = None, start: str = "go") -> dict:
    """The steady state over ``seconds``: requests and bytes per rank (of ``n``) per interval, the
    store's CPU per second, a probe's gets; passes made per hosted monitor (``hosted``, default ``n``).
    ``start``: what the workers are told to begin."""
    workers.send(start)
    time.sleep(3 * interval)
    before = workers.ask("counters")
    start, cpu = time.monotonic(), server_cpu_s()
    time.sleep(seconds)  # the store's own CPU, nothing but the ranks' requests to serve
    after = workers.ask("counters")
    elapsed = time.monotonic() - start
    store_cpu = (server_cpu_s() - cpu) / elapsed
    median, p99 = _probe(host, port, min(seconds, 5.0))  # then a plain get's time meanwhile
    requests = sum(a["requests"] - b["requests"] for a, b in zip(after, before))
    sent = sum(a["bytes"] - b["bytes"] for a, b in zip(after, before))
    done = sum(a["passes"] - b["passes"] for a, b in zip(after, before))
    return {"req_rank_interval": requests / n / (elapsed / interval), "bytes_rank_interval": sent / n / (elapsed / interval),
            "req_s": requests / elapsed, "bytes_s": sent / elapsed, "probe_ms": (median, p99),
            "store_cpu_s_per_s": store_cpu,
            "passes": done / (hosted or n) / (elapsed / interval), "late_s": max(a["late"] for a in after),
            "dropped": sum(a.get("dropped", 0) for a in after)}


def _replayed(workers: Workers, n: int, interval: float, seconds: float, host: str, port: int, hosted: int) -> dict:
    """The steady state with each hosted monitor's last beat sent again every ``interval`` (see "replay")."""
    return _steady(workers, n, interval, seconds, host, port, hosted, start=f"replay {interval}")


class _BoardClock(threading.Thread):
    """When each loss reached the job's board: a client of this process's own waits on the board's
    next event key, one at a time, as a monitor does, and notes the time it is set: the watchers'
    publication, apart from its delivery to every simulated rank."""

    def __init__(self, host: str, port: int, namespace: str) -> None:
        super().__init__(daemon=True)
        from hypergrid.store.keys import JobChannel
        from hypergrid.store.tcpstore import WireStore

        self.channel = JobChannel(namespace, "bench", 0)
        self.conn = WireStore.connect(host, port, timeout_s=30.0)
        self.published: dict[int, float] = {}  # rank -> when its loss was on the board
        self.halted = threading.Event()

    def run(self) -> None:
        from hypergrid.store.records import EventKind, decode_events
        from hypergrid.store.tcpstore import StoreTimeout

        index = 0
        while not self.halted.is_set():
            try:
                events = decode_events(self.conn.get(self.channel.board_slot(index), within_s=1.0))
            except StoreTimeout:  # not published yet: look again unless the clock was stopped
                continue
            for event in events:
                if event.kind is EventKind.LOST:
                    self.published.setdefault(event.rank, time.time())
            index += 1

    def close(self) -> None:
        self.halted.set()
        self.join(timeout=5)
        self.conn.close()


class Detection(NamedTuple):
    """One loss, in seconds from the death (None: not within the limit): on the board, heard by
    every node's relay delegate (the store's delivery), heard by every rank (and the relays' hop,
    and the simulation's handling of it by each simulated monitor in turn); and the requests the
    board's waits made meanwhile (the store's work of delivering it)."""

    published: Optional[float]
    delegates: Optional[float]
    everyone: Optional[float]
    board_requests: Optional[int]


def _detect(workers: Workers, clock: _BoardClock, command: str, victims: list[int], limit_s: float) -> Detection:
    """How long ``command`` (die/halt) of ``victims`` took to reach the board, the delegates and every rank."""
    before = sum(r["board_requests"] for r in workers.ask("counters"))
    killed = time.time()
    workers.send(f"{command} {' '.join(map(str, victims))}" if command == "halt" else f"die {victims[0]}")
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        time.sleep(0.2)
        reports = workers.ask("report " + " ".join(map(str, victims)))
        if any(sum(r[str(v)][0] for r in reports) < sum(r[str(v)][1] for r in reports) for v in victims):
            continue
        last = max(r[str(v)][2] for r in reports for v in victims if r[str(v)][2] is not None)
        delegates = max(r[str(v)][3] for r in reports for v in victims if r[str(v)][3] is not None)
        published = [clock.published[v] for v in victims if v in clock.published]
        spent = sum(r["board_requests"] for r in workers.ask("counters")) - before
        return Detection(max(published) - killed if len(published) == len(victims) else None, delegates - killed,
                         last - killed, spent)
    return Detection(None, None, None, None)


def _delivery(host: str, port: int, n: int, count: int, interval: float) -> dict:
    """Only the board's delivery, at ``n`` ranks: one simulated monitor per node (so each leads its
    node's relay, with a board connection of its own), no ticks. A node's 8 losses published back
    to back, in 8 entries (as 8 watchers of their own publish them, where there is no relay) and
    in 2 (the most a node's delegate needs: its ranks' last beats came within an interval, so they
    are found at one look or two). For each, the time until every delegate has all 8, the store's
    CPU meanwhile (this process's: it runs nothing else but the polling), and the board's
    requests."""
    from hypergrid.store.keys import JobChannel
    from hypergrid.store.records import encode_events
    from hypergrid.store.tcpstore import WireStore

    spec = {"host": host, "port": port, "n": n, "interval": interval, "namespace": _namespace(), "design": "ring",
            "share": 1024, "hosted": list(range(0, n, NODE))}
    workers = Workers(spec, count)
    channel = JobChannel(spec["namespace"], "bench", 0)
    conn = WireStore.connect(host, port, timeout_s=30.0)
    results: dict = {"delegates": n // NODE}
    for entries in (NODE, 2):
        victims = [n + entries * NODE + i for i in range(NODE)]  # ranks nobody hosts, new for each layout
        before = sum(r["board_requests"] for r in workers.ask("counters"))
        cpu, start = time.process_time(), time.time()
        for part in range(entries):  # as a monitor publishes: fill the next slot, then count it
            payload = encode_events([_lost(v) for v in victims[part::entries]]).encode()
            slot = channel.board_slot(conn.add(channel.board_count(), 0))
            conn.compare_set(slot, b"", payload)
            conn.set(slot, payload)
            conn.add(channel.board_count(), 1)
        last = None
        while last is None:
            time.sleep(0.05)
            reports = workers.ask("report " + " ".join(map(str, victims)))
            if all(sum(r[str(v)][0] for r in reports) == sum(r[str(v)][1] for r in reports) for v in victims):
                last = max(r[str(v)][2] for r in reports for v in victims if r[str(v)][2] is not None)
        store_cpu = time.process_time() - cpu
        spent = sum(r["board_requests"] for r in workers.ask("counters")) - before
        results[f"{entries} entries"] = {"seconds": round(last - start, 3), "store_cpu_s": round(store_cpu, 3),
                                         "board_requests": spent}
    workers.close()
    conn.close()
    return results


def _round_all(workers: Workers, namespace: str) -> dict:
    """One recovery round of every simulated rank (see the workers' _round); the store's CPU time
    is this process's (it runs nothing else meanwhile), read between the round's parts."""
    workers.send(f"round {namespace}")
    for proc in workers.procs:
        assert proc.stdout.readline().strip() == "ready"
    # The store's CPU: its user time (serving requests) and its system time (the kernel's work on
    # its sockets, waking the thousands of simulated ranks it answers among them), apart.
    cpu, kernel = {"open": time.process_time()}, {"open": os.times().system}
    workers.send("go")
    opened = time.time()
    for part, after in (("open", "round"), ("verdict", "step")):
        for proc in workers.procs:
            assert proc.stdout.readline().strip() == f"{part} done"
        cpu[after], kernel[after] = time.process_time(), os.times().system
        if part == "open":
            start = time.time()  # the round's time counts from its arrivals
            opened = start - opened
        workers.send("go")
    outs = [json.loads(proc.stdout.readline()) for proc in workers.procs]
    cpu["end"], kernel["end"] = time.process_time(), os.times().system
    for proc in workers.procs:
        proc.wait(timeout=60)
    lasts = [o["last"] for o in outs if o["last"] is not None]
    steps = [o["last_step"] for o in outs if o["last_step"] is not None]
    return {"seconds": max(lasts) - start if lasts else None, "store_cpu_s": cpu["end"] - cpu["open"],
            "open_seconds": opened,
            "store_system_by_part": {"open": kernel["round"] - kernel["open"],
                                     "arrive and verdict": kernel["step"] - kernel["round"],
                                     "rebuild's end and commit": kernel["end"] - kernel["step"]},
            "store_cpu_by_part": {"open": cpu["round"] - cpu["open"], "arrive and verdict": cpu["step"] - cpu["round"],
                                  "rebuild's end and commit": cpu["end"] - cpu["step"]},
            "step_seconds": max(steps) - start if steps else None,
            "requests": sum(o["requests"] for o in outs), "rewaits": sum(o["rewaits"] for o in outs),
            "made": {phase: sum(o["made"][phase] for o in outs) for phase in ("open", "round", "step")},
            "by_nodes": {phase: sum(o["by_nodes"][phase] for o in outs) for phase in ("open", "round", "step")},
            "group_batches": sum(o["group_batches"] for o in outs),
            "delegate_requests": sum(o["delegate_requests"] for o in outs), "delegates": sum(o["delegates"] for o in outs),
            "board_readers": sum(o["board_readers"] for o in outs),
            "bytes": sum(o["bytes"] for o in outs),
            "failed": sorted({r for o in outs for r in o["failed"]}), "agreed": sum(o["agreed"] for o in outs),
            "errors": [e for o in outs for e in o["errors"]][:3], "error_count": sum(o["error_count"] for o in outs)}


def _monitor_cost(seconds: float, interval: float) -> None:
    """A real job of 4 gloo ranks with their monitors (the heartbeat at ``interval``) for
    ``seconds``: each monitor's unique set size and its share of a core, from /proc."""
    import tempfile

    code = f"""
import os, sys, time, datetime
import torch.distributed as dist
sys.path.insert(0, {ROOT!r})
import hypergrid
from hypergrid import HyperCommGrid, ResilientJob
rank = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
beat = hypergrid.start_heartbeat(interval_s={interval})
job = ResilientJob.of_grid(HyperCommGrid([2, 2], ["tp", "dp"]), spares=[])
print(beat.pid, flush=True)
time.sleep({seconds} + 5)
job.release_spares()
"""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(code)
    ranks = [subprocess.Popen([sys.executable, script.name, str(r), str(server.port)], stdout=subprocess.PIPE,
                              text=True) for r in range(4)]
    pids = [int(p.stdout.readline()) for p in ranks]
    time.sleep(2.0)
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu(pid: int) -> float:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    def uss(pid: int) -> float:
        total = 0
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith(("Private_Clean", "Private_Dirty")):
                total += int(line.split()[1])
        return total / 1024

    before, start = [cpu(p) for p in pids], time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    shares = [(cpu(p) - b) / elapsed * 100 for p, b in zip(pids, before)]
    sizes = [uss(p) for p in pids]
    for p in ranks:
        p.wait(timeout=120)
    os.unlink(script.name)
    print(f"monitor of each of 4 ranks over {seconds:g} s (heartbeat {interval:g} s): unique set size "
          f"{min(sizes):.1f}-{max(sizes):.1f} MB, CPU {min(shares):.2f}-{max(shares):.2f}% of a core")


def _host_store(dist: Any) -> Any:
    """torch's TCPStore server (libuv) on 127.0.0.1, listening on an IPv4 socket of this process's.

    Given only a port, torch's server listens on IPv6 and IPv4 at once, and names each connection
    it accepts (for its logs) by a reverse lookup of the peer's address: ``::ffff:127.0.0.1``,
    which no hosts file lists, so a DNS query, made on the server's one thread. This machine's
    resolver leaves some queries unanswered, and each such connection stops the whole store for
    5 s (one connection in about 60 when opened one by one, nearly all of them past a few
    hundred at once: 1,024 connections took 96 s, 4,096 never finished). An IPv4 socket's peers
    are ``127.0.0.1``, which the hosts file names: 4,096 connections open in under a second.
    """
    import socket

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16384)  # the kernel caps it at net.core.somaxconn
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
                         master_listen_fd=listener.detach())


def _namespace() -> str:
    import uuid

    return f"hypergrid/control/{uuid.uuid4().hex[:12]}"  # as long as a world's own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 1024, 4096])
    parser.add_argument("--scan-sizes", type=int, nargs="*", default=[8, 64, 256, 1024])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of steady state measured")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--no-round", action="store_true")
    parser.add_argument("--only-round", action="store_true", help="no monitors: only the recovery round")
    parser.add_argument("--nodes-make-calls", action="store_true",
                        help="in the round, each node's delegate makes its node's batches itself instead of "
                             "handing them to its group's reader (the anchor for the groups' batches)")
    parser.add_argument("--round-workers", type=int, default=0,
                        help="processes the round's participants are spread over (default: --workers, the "
                             "monitors' own); more, where thousands of threads in one process starve each other")
    parser.add_argument("--monitor-cost", type=float, default=0.0, metavar="SECONDS",
                        help="only measure real monitors' memory and CPU over SECONDS (a 4-rank gloo job)")
    parser.add_argument("--delivery", action="store_true",
                        help="only the board's delivery of a node's 8 losses to one relay delegate per node")
    parser.add_argument("--delegates-only", action="store_true",
                        help="host only each node's delegate (a real monitor), what its node's other monitors "
                             "say on the node's socket simulated: the store sees what N ranks send")
    parser.add_argument("--replay-interval", type=float, default=0.0, metavar="SECONDS",
                        help="after the steady state, send each hosted monitor's last beat (the same message, on "
                             "its connection) every SECONDS, the monitors stopped: the store's cost at a heartbeat "
                             "the workers cannot run the monitors' own code at")
    parser.add_argument("--connections", type=int, default=1024,
                        help="simulated ranks share connections past this many per kind (see the module)")
    args = parser.parse_args()
    if args.monitor_cost:
        _monitor_cost(args.monitor_cost, args.interval)
        return
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import torch
    import torch.distributed as dist

    server = _host_store(dist)
    host, port = "127.0.0.1", server.port
    print(f"torch {torch.__version__}; one TCPStore (libuv) on {host}:{port}; heartbeat every {args.interval:g} s, "
          f"stale after 5 beats; nodes of {NODE}; {os.cpu_count()} cores")
    if args.delivery:
        for n in args.sizes:
            print(f"delivery {n}: {_delivery(host, port, n, args.workers, args.interval)}", flush=True)
        return
    rows = []
    for n in args.scan_sizes:
        share = max(1, n // args.connections)
        spec = {"host": host, "port": port, "n": n, "interval": args.interval, "namespace": _namespace(),
                "design": "scan", "share": share}
        workers = Workers(spec, min(args.workers, n))
        steady = _steady(workers, n, args.interval, args.steady, host, port)
        workers.close()
        rows.append(("scan (replaced)", n, steady, {}, None, share))
        print(f"scan {n}: {steady}", flush=True)
    for n in args.sizes:
        share = max(1, n // args.connections)
        spec = {"host": host, "port": port, "n": n, "interval": args.interval, "namespace": _namespace(),
                "design": "ring", "share": share}
        hosted = list(range(0, n, NODE)) if args.delegates_only else list(range(n))
        if args.delegates_only:
            spec.update(hosted=hosted, followers_simulated=True)
        steady, detect, workers = None, {}, None
        if not args.only_round:
            started = time.monotonic()
            workers = Workers(spec, args.workers)
            print(f"ring {n}: {len(hosted)} monitors hosted, {n // NODE} nodes' delegates' connections made in "
                  f"{time.monotonic() - started:.0f} s", flush=True)
            steady = _steady(workers, n, args.interval, args.steady, host, port, len(hosted))
            print(f"ring {n}: steady {steady}", flush=True)
            if args.replay_interval:
                replayed = _replayed(workers, n, args.replay_interval, args.steady, host, port, len(hosted))
                print(f"ring {n}: the same beats every {args.replay_interval:g} s: {replayed}; per request "
                      f"{replayed['store_cpu_s_per_s'] / replayed['req_s'] * 1e6:.1f} us, in the monitors' own "
                      f"{steady['store_cpu_s_per_s'] / steady['req_s'] * 1e6:.1f} us", flush=True)
                workers.send("go")  # the monitors run again (their counters moved on meanwhile: nobody stood still)
                time.sleep(3 * args.interval)
            clock = _BoardClock(host, port, spec["namespace"])
            clock.start()
            scenarios = (("rank 0 dies", "die", [0]), ("rank 1,500 dies", "die", [1500]),
                         ("the last rank dies", "die", [n - 1]),
                         ("node 5 lost", "halt", list(range(5 * NODE, 6 * NODE))),
                         # A rack: consecutive nodes lost at once, each watched from half the job away.
                         (RACK_LABEL, "halt", list(range(9 * NODE, (9 + RACK_NODES) * NODE))))
            chosen = [s for s in scenarios if (s[0] != "rank 1,500 dies" or n >= 2048)
                      and (s[0] != RACK_LABEL or n >= 4 * RACK_NODES * NODE)
                      and (s[1] == "halt" or s[2][0] in hosted)]
            for label, command, victims in chosen if n >= 64 else ():
                detect[label] = _detect(workers, clock, command, victims, limit_s=60)
                print(f"ring {n}: {label}: {detect[label]}", flush=True)
            clock.close()
        rnd = None
        round_workers = args.round_workers or args.workers
        if workers is not None:
            workers.close()
            workers = None
        if not args.no_round:
            if workers is None:
                started = time.monotonic()
                # Node 1 lost whole: every other rank takes part (see _round).
                participants = [r for r in range(n) if r // NODE != LOST_NODE]
                workers = Workers(dict(spec, design="round", hosted=participants, participants=len(participants),
                                       followers_simulated=False, group_calls=not args.nodes_make_calls),
                                  round_workers)
                print(f"ring {n}: the round's {(2 if share > 1 else 1) * n // share} connections made in "
                      f"{time.monotonic() - started:.0f} s", flush=True)
            rnd = _round_all(workers, _namespace())
        rows.append(("ring (hypergrid)", n, steady, detect, rnd, share))
        print(f"ring {n}: round {rnd}", flush=True)
    _table(rows, args.interval)


def _table(rows: list, interval: float) -> None:
    print()
    print("| design | ranks | requests / rank / interval | bytes / rank / interval | store requests/s | store bytes/s | "
          "store CPU s/s | plain get meanwhile (median, p99) |")
    print("|---|---|---|---|---|---|---|---|")
    for design, n, s, _, _, _ in rows:
        if s is None:
            continue
        behind = "" if s["passes"] >= 0.95 else f" (only {s['passes']:.2f} of the passes due were made)"
        if s.get("dropped"):
            behind += f" ({s['dropped']} ranks' connections reset by the store)"
        print(f"| {design} | {n:,} | {s['req_rank_interval']:.3f} | {s['bytes_rank_interval']:.1f} | {s['req_s']:,.0f} | "
              f"{s['bytes_s']:,.0f} | {s['store_cpu_s_per_s']:.3f} | {s['probe_ms'][0]:.2f} ms, {s['probe_ms'][1]:.2f} ms{behind} |")
    print()
    print("Losses: on the board / every node's relay delegate had it / every simulated rank had it (seconds from the "
          "death), and the requests the board's waits made meanwhile.")
    print()
    print(f"| ranks | rank 0 dies | rank 1,500 dies | the last rank dies | a node of 8 lost | {RACK_LABEL} | one recovery "
          "round: all have the verdict | and all ended its world step | store CPU (the whole round) | their requests |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for design, n, _, d, r, _ in rows:
        if design.startswith("scan") or (not d and not r):
            continue

        round_cells = "- | - | - | -"
        if r:
            took = f"{r['seconds']:.2f} s" if r["seconds"] is not None else "-"
            if r["error_count"]:
                took += f" ({r['agreed']:,} agreed, {r['error_count']:,} did not)"
            stepped = f"{r['step_seconds']:.2f} s" if r.get("step_seconds") is not None else "-"
            rewaits = f" (+{r['rewaits']:,} re-waits on shared connections)" if r.get("rewaits") else ""
            made, batched = r["made"], r["by_nodes"]
            own = made["open"] + made["round"] + made["step"]
            nodes_made = batched["open"] + batched["round"] + batched["step"]
            total = own + nodes_made + r["delegate_requests"]
            round_cells = (f"{took} | {stepped} | {r['store_cpu_s']:.2f} s | {total:,}, {total / n:.3f} per rank: "
                           f"the nodes' batches, made by {r['group_batches']:,} batches of their groups' readers, "
                           f"{nodes_made / n:.3f} ({batched['open'] / n:.3f} to open the round, "
                           f"{batched['round'] / n:.3f} to arrive, {batched['step'] / n:.3f} to end the rebuild), the "
                           f"participants' own {own:,} (the leader's and the last one's commit), the board's reads "
                           f"{r['delegate_requests'] / n:.3f} ({r['board_readers']:,} readers for {r['delegates']:,} "
                           f"nodes){rewaits}")
        cells = " | ".join(_loss_cell(d, label) for label in ("rank 0 dies", "rank 1,500 dies", "the last rank dies",
                                                               "node 5 lost", RACK_LABEL))
        print(f"| {n:,} | {cells} | {round_cells} |")


def _loss_cell(detect: dict, label: str) -> str:
    """'on the board / every rank had it' for one scenario, in seconds ('-': not run, or not within the limit)."""
    if label not in detect:
        return "-"
    show = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
    seen = detect[label]
    spent = seen.board_requests if seen.board_requests is not None else "-"
    return f"{show(seen.published)} / {show(seen.delegates)} / {show(seen.everyone)} s ({spent} board requests)"

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
    else:
        main()
