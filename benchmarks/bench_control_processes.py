"""The control plane with real processes on this machine: N stand-in ranks, each a process with
hypergrid's heartbeat and its own monitor process, against one TCPStore of torch's, as it is
(its server on both IPv4 and IPv6, so each new client is named by a reverse lookup on the thread
that answers everyone, which this machine's resolver now and then leaves unanswered for 5 s).

A stand-in rank imports no torch: it starts :class:`hypergrid.liveness.heartbeat.Heartbeat` (its
monitor process, ticked every interval, started again if it ends), attaches it to one job of all
N ranks on nodes of 8, and writes each loss it hears with the time it heard it.

Measured, per size, over a steady window:

* the store's connections at start-up and the new ones in the window (its sockets, from ``ss``);
* the requests the store received per rank per interval (data segments into its sockets, from
  ``ss``: each request of a monitor is one, a read of several counters one per counter or fewer);
* the store's CPU per second (its server's threads, from /proc), and per message beside one node's
  beat message (its beat and its read) sent 5,000 times by one client to the idle store first;
* each monitor's share of a core (the nodes' delegates apart from the others);
* then a rank killed (SIGKILL): when every other rank heard it; then a node killed whole (its
  ranks and their monitors): when every other rank heard its 8 losses; and the losses on the
  board that were not of those (false losses).

Run::

    python benchmarks/bench_control_processes.py --sizes 64 256 1024
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from store_cpu import server_cpu_s  # benchmarks/store_cpu.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NODE = 8
#: How many stand-in ranks start at a time.
_WAVE = 64

#: One stand-in rank: its heartbeat (monitor and all) serving the job, each loss it hears logged.
STAND_IN = """
import json, sys, time
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
from hypergrid.liveness.heartbeat import Heartbeat
from hypergrid.liveness.config import JobSpec
from hypergrid.store.keys import JobChannel
config = json.loads(sys.argv[2])
log = open(config["log"], "a", buffering=1)
plane = SimpleNamespace(namespace=config["namespace"], store=None, address=("127.0.0.1", config["port"]), reached=True)
beat = Heartbeat(plane, config["rank"], interval_s=config["interval"], progress_timeout_s=600.0, stale_beats=5)
beat.listen("log", lambda e: log.write(f"{time.monotonic():.4f} {e.kind.value} {e.rank}\\n"))
log.write(f"monitor {beat.pid}\\n")
sys.stdin.readline()  # every rank's monitor started: the job begins
beat.attach(JobSpec(JobChannel(config["namespace"], "job", 0), ((0, config["ranks"]),), config["node"]))
sys.stdin.read()
beat.release()
beat.stop(clean=True)
"""


#: The anchor: one client process sending a delegate's beat message (its node's counter, the
#: watched node's read) to an idle store, one after another, as StoreLink.beat sends it.
BEATS_ALONE = """
import sys
sys.path.insert(0, sys.argv[1])
from hypergrid.liveness.link import StoreLink
from hypergrid.store.tcpstore import WireStore
port, count = int(sys.argv[2]), int(sys.argv[3])
link = StoreLink(lambda s: WireStore.connect("127.0.0.1", port, timeout_s=s), give_up_s=30.0)
for _ in range(count):
    link.beat("alone/node/0", ["alone/node/1"])
"""


def _beat_alone_us(port: int, count: int = 5000) -> float:
    """The store's CPU per beat message with nothing else running (the anchor of the steady state's)."""
    before = server_cpu_s()
    subprocess.run([sys.executable, "-S", "-c", BEATS_ALONE, ROOT, str(port), str(count)], check=True)
    return (server_cpu_s() - before) / count * 1e6


def _process_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_sockets(port: int) -> dict[int, int]:
    """The store's accepted connections: peer port -> data segments received on it so far."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                         text=True).stdout.split("\n")
    sockets: dict[int, int] = {}
    peer = None
    for line in out:
        if not line.strip():
            continue
        if not line.startswith(("\t", " ")):
            peer = int(line.split()[-1].rsplit(":", 1)[1])
            sockets[peer] = 0
        elif peer is not None:
            for field in line.split():
                if field.startswith("data_segs_in:"):
                    sockets[peer] = int(field.split(":")[1])
    return sockets


class _Job:
    def __init__(self, n: int, port: int, interval: float, folder: Path) -> None:
        self.n, self.folder = n, folder
        self.namespace = f"hypergrid/bench-processes/{os.getpid()}-{n}"
        self.logs = [folder / f"{rank}.log" for rank in range(n)]
        self.procs = []
        self.killed: set[int] = set()
        # In waves: 2,048 interpreters starting at once on two cores take minutes, past the minute a
        # heartbeat gives its monitor to say it is ready (a cluster's hosts start theirs side by side).
        for first in range(0, n, _WAVE):
            for rank in range(first, min(n, first + _WAVE)):
                config = {"port": port, "namespace": self.namespace, "rank": rank, "ranks": n, "node": NODE,
                          "interval": interval, "log": str(self.logs[rank])}
                with open(folder / f"{rank}.err", "w") as err:
                    self.procs.append(subprocess.Popen([sys.executable, "-S", "-c", STAND_IN, ROOT,
                                                        json.dumps(config)], stdin=subprocess.PIPE, stderr=err))
            end = time.monotonic() + 300
            while len(self.monitors()) < len(self.procs) and time.monotonic() < end:
                time.sleep(0.2)
        for proc in self.procs:  # the job begins on every rank at once, as after a launcher's rendezvous
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()

    def monitors(self) -> dict[int, int]:
        found = {}
        for rank, log in enumerate(self.logs):
            try:
                lines = [line for line in log.read_text().splitlines() if line.startswith("monitor ")]
            except FileNotFoundError:
                continue
            if lines:
                found[rank] = int(lines[-1].split()[1])
        return found

    def heard(self, rank: int) -> dict[int, float]:
        """The losses rank ``rank`` heard: lost rank -> when."""
        heard: dict[int, float] = {}
        try:
            text = self.logs[rank].read_text()
        except FileNotFoundError:
            return heard
        for line in text.splitlines():
            when, kind, lost = (line.split() + ["", "", ""])[:3]
            if kind == "lost":
                heard.setdefault(int(lost), float(when))
        return heard

    def all_heard(self, victims: list[int], limit_s: float) -> tuple[float | None, set[int]]:
        """When the last live rank heard every victim (None: not within ``limit_s``), and every loss heard."""
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            heard = {r: self.heard(r) for r in range(self.n) if r not in self.killed}
            if all(all(v in h for v in victims) for h in heard.values()):
                self.last_heard = heard
                return max(h[v] for h in heard.values() for v in victims), {v for h in heard.values() for v in h}
            time.sleep(1.0)  # reading a thousand logs is work of its own on two cores
        return None, set()

    def errors(self, top: int = 5) -> list[tuple[int, str]]:
        """What the stand-ins and their monitors said on stderr most often (a heartbeat logs a monitor's
        end and its error there), with how many ranks said it; and how many stand-ins had ended."""
        said: Counter[str] = Counter()
        for rank in range(self.n):
            try:
                lines = (self.folder / f"{rank}.err").read_text().splitlines()
            except FileNotFoundError:
                continue
            said.update({line.split(": ", 1)[-1][:160] for line in lines if line.strip()})
        ended = sum(1 for proc in self.procs if proc.poll() is not None)
        return [(count, line) for line, count in said.most_common(top)] + [(ended, "stand-ins ended")]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(n: int, interval: float, steady_s: float) -> dict[str, Any]:
    import torch.distributed as dist

    from hypergrid.store.keys import node_beat_key
    from hypergrid.store.tcpstore import WireStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # as torch makes one
    port = server.port
    with tempfile.TemporaryDirectory() as folder:
        # Before the ranks: their monitors' connections stall the store now and then at start-up.
        probe = WireStore.connect("127.0.0.1", port, timeout_s=60)
        alone_us = _beat_alone_us(port)
        started = time.monotonic()
        job = _Job(n, port, interval, Path(folder))
        nodes = range(n // NODE)
        while not (len(job.monitors()) == n
                   and all(probe.add(node_beat_key(job.namespace, node, NODE), 0) >= 2 for node in nodes)):
            if time.monotonic() - started > 600:
                raise RuntimeError(f"{n} ranks: not every node beating within 600 s; on stderr: {job.errors()}")
            time.sleep(0.5)
        settled = time.monotonic() - started
        time.sleep(3 * interval)
        sockets, cpu = _server_sockets(port), server_cpu_s()
        pids = job.monitors()
        monitor_cpu = {rank: _process_cpu(pid) for rank, pid in pids.items()}
        start = time.monotonic()
        time.sleep(steady_s)
        elapsed = time.monotonic() - start
        store_cpu = (server_cpu_s() - cpu) / elapsed
        after = _server_sockets(port)
        shares = {rank: (_process_cpu(pid) - monitor_cpu[rank]) / elapsed * 100 for rank, pid in pids.items()}
        requests = sum(after.get(peer, 0) - sockets.get(peer, 0) for peer in after)  # the probe's: none meanwhile
        new = sorted(set(after) - set(sockets))
        busiest = sorted(shares.values())[-len(nodes):]  # a monitor per node does its node's calls
        # A rank killed (its process: its monitor sees it end), then a whole node (ranks and monitors).
        victim = n // 2 + 3
        killed_at = time.monotonic()
        job.procs[victim].kill()
        job.killed.add(victim)
        time.sleep(2.0)  # reading a thousand logs while the loss is handed on would compete with it for the cores
        heard_at, _ = job.all_heard([victim], 60)
        # Who heard it last, and when most had: one slow process or the whole delivery.
        delays = sorted((h[victim] - killed_at, r) for r, h in getattr(job, "last_heard", {}).items())
        kill_spread = ({"p50": round(delays[len(delays) // 2][0], 2), "p90": round(delays[len(delays) * 9 // 10][0], 2),
                        "slowest": [(r, round(d, 2)) for d, r in delays[-5:]]} if delays else {})
        node = (n // NODE) // 3
        lost = list(range(node * NODE, (node + 1) * NODE))
        for rank in lost:
            os.kill(pids[rank], signal.SIGKILL)
        node_killed_at = time.monotonic()
        for rank in lost:
            job.procs[rank].kill()
            job.killed.add(rank)
        node_heard_at, heard = job.all_heard(lost, 60)
        time.sleep(3 * interval)
        _, heard = job.all_heard(lost, 1)
        false = sorted(heard - {victim, *lost})
        board = []  # the false losses' reasons, from the board
        from hypergrid.store.keys import JobChannel
        from hypergrid.store.records import decode_events

        channel = JobChannel(job.namespace, "job", 0)
        while probe.check([channel.board_slot(len(board))]):
            board.append(decode_events(probe.get(channel.board_slot(len(board)))))
        why = sorted({f"{e.reason[:90]} (by {e.by})" for entry in board for e in entry if e.rank in false})[:5]
        errors = job.errors()
        job.close()
        probe.close()
    return {"ranks": n, "settled_s": round(settled, 1), "connections_at_start": len(sockets) - 1,
            "new_connections_in_steady": len(new), "requests_per_rank_per_interval": round(
                requests / n / (elapsed / interval), 3),
            "store_cpu_s_per_s": round(store_cpu, 4),
            # Per message: the beats and reads in the steady state (one message per group of nodes and
            # interval, from its reader; per node in a job of no more nodes than a group has), beside a
            # node's own beat message from one client to an idle store.
            "store_cpu_us_per_message": round(store_cpu / (requests / elapsed) * 1e6, 1) if requests else None,
            "store_cpu_us_per_message_alone": round(alone_us, 1),
            "monitor_cpu_percent": {"busiest (one per node)": round(sum(busiest) / len(busiest), 3),
                                    "the others": round(sum(sorted(shares.values())[:-len(nodes)]) /
                                                        max(1, n - len(nodes)), 3)},
            "kill_heard_by_all_s": round(heard_at - killed_at, 2) if heard_at else None,
            "kill_heard_spread_s": kill_spread,
            "node_heard_by_all_s": round(node_heard_at - node_killed_at, 2) if node_heard_at else None,
            "false_losses": false, "why_false": why, "board_entries": len(board), "stderr": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--steady", type=float, default=30.0)
    args = parser.parse_args()
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"heartbeat every {args.interval:g} s, stale after 5; nodes of {NODE}; {os.cpu_count()} cores")
    for n in args.sizes:
        print(json.dumps(run(n, args.interval, args.steady)), flush=True)


if __name__ == "__main__":
    main()
