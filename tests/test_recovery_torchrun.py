"""Recovery under torchrun as users launch it: a node lost through its agent, training goes on
on the spare node.

The launch of docs/cluster.md, "Surviving a lost node", on this machine: the job's store is
hosted outside the nodes (``python -m hypergrid store``), three torchrun agents (c10d
rendezvous on 127.0.0.1, pointed at that store with ``--rdzv-conf is_host=false``,
``--max-restarts 0``) start two workers each (:mod:`tests.torchrun_worker`), and every worker
connects its default group to the same store. The grid is tp 2 x dp 2 on nodes 0 and 1 (ranks
0-3); node 2's workers (ranks 4, 5) are spares. One worker SIGKILLs itself in the middle of the
training; its agent ends the node's other worker and exits, as torchrun does with a lost node,
and the survivors and the spare node recover in-process: the lost node's ranks go to the spare
node, local rank for local rank, and training goes on to its last step on the new groups.

Checked: the outcome of every surviving rank (placement, plan, the weight every step added to,
each step counted once, the new groups' sums), that both ranks of the lost node died and that
its agent exited with a failure, and that no agent restarted its workers. Each test took 14 to
20 s with torch 2.13.0 and 15 to 28 s with torch 2.15.0 (10 runs each on a 2-core machine at a
load of 3 to 6), most of it torchrun's and torch's start-up. Each worker's monitor (a process of
its own, in a session of its own: the agent's SIGTERM to the worker's group does not reach it)
publishes its worker's end at once, so every survivor was back 0.2 to 0.3 s after the kill, often
before the lost node's agent had ended its node (2.8 to 3.1 s after the kill); before the
monitors, a lost worker was seen only when its heartbeat went stale, 2.6 to 2.8 s after.

Every process the test starts is ended in a ``finally``: the agents and the store by their
process groups (each runs in a session of its own), the workers (torchrun starts each in a
session of its own too) by theirs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
NODES, PER_NODE, STEPS, KILL_STEP = 3, 2, 6, 2
GRID_RANKS, SPARES = [0, 1, 2, 3], [4, 5]
#: What a run may take in all before it counts as hung (it took 14 to 28 s, see above).
DEADLINE_S = 150.0
#: What every step adds: (tp rank + 1) * (step + 1) summed over tp (1 + 2) and over dp (2 replicas).
ADDED = {step: 6.0 * (step + 1) for step in range(STEPS)}


def _env() -> dict[str, str]:
    # The workers import this tree's hypergrid and tests package, whatever the venv has installed.
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1"}


def _start_store(log: Path) -> tuple[subprocess.Popen, str]:
    """``python -m hypergrid store`` on a free port, as a batch script would start it; its address."""
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "hypergrid", "store", "--host", "127.0.0.1", "--port", "0",
                                 "--timeout", str(int(DEADLINE_S) + 60)],
                                stdout=subprocess.PIPE, stderr=sink, text=True, cwd=ROOT, env=_env(),
                                start_new_session=True)
    line = _first_line(proc, timeout_s=60)
    found = re.search(r"serving on (\S+:\d+) ", line or "")
    if not found:
        _end([proc])
        pytest.fail(f"hypergrid store printed no address within 60 s: {line!r}; {log.read_text()}")
    return proc, found.group(1)


def _first_line(proc: subprocess.Popen, timeout_s: float) -> Optional[str]:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        if sel.select(timeout_s):
            return proc.stdout.readline()  # type: ignore[union-attr]
    return None


def _start_agent(node: int, store: str, out: Path, victim: int) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", store, "--rdzv-conf", "is_host=false",
        "--rdzv-id", f"hypergrid-test-{os.getpid()}",
        "--max-restarts", "0",  # torchrun's default, and what recovery needs (docs/cluster.md)
        "-m", "tests.torchrun_worker",
        "--store", store, "--out", str(out), "--victim", str(victim), "--kill-step", str(KILL_STEP),
        "--steps", str(STEPS), "--collective-timeout", "12", "--recovery-timeout", "10",
    ]
    with open(out / f"agent-{node}.log", "w") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env=_env(), start_new_session=True)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc; none elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.parent.name))
    return found


def _end(procs: list[subprocess.Popen]) -> None:
    """End ``procs`` and the workers they started, by process group: SIGTERM, then SIGKILL."""
    workers = [c for p in procs if p.poll() is None for c in _children(p.pid)]
    for p in procs:
        if p.poll() is None:
            _killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _killpg(p.pid, signal.SIGKILL)  # what is left of its group (nothing, when it ended well)
        p.wait(timeout=10)
    for pid in workers:  # torchrun starts each worker in a session of its own
        _killpg(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped by its agent counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _logs(out: Path) -> str:
    return "\n".join(f"===== {p.name}\n{p.read_text()[-6000:]}" for p in sorted(out.glob("*.log")))


def _run_job(out: Path, victim: int, survivors: list[int]) -> dict[str, Any]:
    """The launch, until every survivor has written its outcome; what each worker and agent left."""
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        store_proc, store = _start_store(out / "store.log")
        procs.append(store_proc)
        agents = [_start_agent(node, store, out, victim) for node in range(NODES)]
        procs += agents
        deadline = time.monotonic() + DEADLINE_S
        ended: dict[int, float] = {}  # node -> when its agent was first seen ended (time.time())
        while time.monotonic() < deadline:
            ended.update({node: time.time() for node, a in enumerate(agents) if node not in ended and a.poll() is not None})
            if all((out / f"exited-{r}.json").exists() for r in survivors):
                break
            if all(a.poll() is not None for a in agents):
                break  # every agent is gone: nothing more will come
            time.sleep(0.2)
        else:
            pytest.fail(f"the survivors {survivors} did not finish within {DEADLINE_S:.0f} s\n{_logs(out)}")
        finished = time.monotonic() - started
        # The survivors may be done before the lost node's agent has ended its node (its workers'
        # losses reach the job at once): give it the time it takes, to see it end.
        settle = time.monotonic() + 30
        while not ended and time.monotonic() < settle:
            ended.update({node: time.time() for node, a in enumerate(agents) if a.poll() is not None})
            time.sleep(0.2)
        starts = {r: _read(out / f"started-{r}.json") for r in range(NODES * PER_NODE)}
        # The survivors' processes end on their own once their outcome is written (up to 30 s).
        pids = [starts[r]["pid"] for r in survivors if starts[r]]
        end = time.monotonic() + 30
        while time.monotonic() < end and not all(_gone(pid) for pid in pids):
            time.sleep(0.2)
        lingering = [pid for pid in pids if not _gone(pid)]
        # The workers' agents, by the pid each worker saw as its parent.
        agent_of = {a.pid: node for node, a in enumerate(agents)}
        # The lost node's agent has exited by now (it ends its node within a second of the kill).
        codes = {}
        for a in agents:
            try:
                codes[agent_of[a.pid]] = a.wait(timeout=0.5) if a.poll() is None else a.returncode
            except subprocess.TimeoutExpired:
                codes[agent_of[a.pid]] = None  # still running: torchrun's exit barrier waits for the lost node
        return {
            "outcomes": {r: _read(out / f"rank-{r}.json") for r in range(NODES * PER_NODE)},
            "exited": {r: (out / f"exited-{r}.json").exists() for r in range(NODES * PER_NODE)},
            "starts": starts, "agent_of": agent_of, "codes": codes, "killed": _read(out / "killed.json"),
            "seconds": finished, "lingering": lingering, "ended": ended,
            "gone": {r: starts[r] is not None and _gone(starts[r]["pid"]) for r in starts},
        }
    finally:
        _end(procs)


def _check(job: dict[str, Any], out: Path, victim: int, lost_node: int, placement: list[int], plan: str) -> None:
    logs = _logs(out)
    lost = [lost_node * PER_NODE + i for i in range(PER_NODE)]
    survivors = [r for r in range(NODES * PER_NODE) if r not in lost]
    assert job["killed"] and job["killed"]["rank"] == victim and job["killed"]["step"] == KILL_STEP, logs
    # Who ran where: node n's agent started ranks 2n and 2n + 1, once each (no restart).
    for rank, start in job["starts"].items():
        assert start is not None, (rank, logs)
        assert start["node"] == rank // PER_NODE and start["local_rank"] == rank % PER_NODE, (rank, start)
        assert start["restart"] == 0, (rank, start, logs)
    agents = {job["starts"][r]["agent"] for r in lost}
    assert len(agents) == 1, (lost, agents)
    lost_agent = job["agent_of"][agents.pop()]
    # The lost node: both its ranks died (no outcome), and its agent exited with a failure.
    for rank in lost:
        assert job["outcomes"][rank] is None, (rank, job["outcomes"][rank], logs)
    assert job["codes"][lost_agent] not in (None, 0) and all(job["gone"][r] for r in lost), (job, logs)
    # The other agents kept their workers: still running (torchrun's exit barrier waits for the
    # lost node's agent) or done, never failed.
    for node in range(NODES):
        if node != lost_agent:
            assert job["codes"][node] in (None, 0), (node, job["codes"], logs)
    # Every survivor: in the new placement, the same plan, every step added once and rightly.
    for rank in survivors:
        value = job["outcomes"][rank]
        assert value is not None, (rank, logs)
        assert value["role"] == "member", (rank, value, logs)
        assert value["ranks"] == placement and value["plan"] == plan, (rank, value)
        assert value["step"] == STEPS and value["added"] == {str(s): a for s, a in ADDED.items()
                                                               if value["joined_at"] is None or s >= value["joined_at"]}, (rank, value)
        assert value["weight"] == sum(ADDED.values()), (rank, value)
        for dims, (ranks, ones, total) in value["sums"].items():
            assert rank in ranks and ones == len(ranks) and total == sum(ranks), (rank, dims, value["sums"])
            assert set(ranks) <= set(placement), (rank, dims, ranks)
        assert job["exited"][rank], (rank, "did not destroy its process group", logs)
    assert not job["lingering"], ("survivors' processes still running 30 s after their outcome", job["lingering"], logs)
    for rank in survivors:
        if rank in SPARES:  # the spares joined at the failed step; the others failed there once
            assert job["outcomes"][rank]["joined_at"] == KILL_STEP, job["outcomes"][rank]
        else:
            assert [f["step"] for f in job["outcomes"][rank]["failures"]] == [KILL_STEP], job["outcomes"][rank]
    print(f"node {lost_agent}'s agent exited {job['ended'][lost_agent] - job['killed']['time']:.1f} s after the kill;",
          f"survivors finished {job['seconds']:.1f} s after the launch; recovered in",
          {r: round(job["outcomes"][r]["failures"][0]["recovered"] - job["killed"]["time"], 2)
           for r in survivors if job["outcomes"][r]["failures"]}, "s after the kill; the rounds' deciders",
          {r: job["outcomes"][r]["deciders"] for r in survivors})


def test_node_1_lost_through_its_agent_training_goes_on_on_the_spare_node(tmp_path):
    # Rank 3 dies; node 1's agent ends rank 2. Node 1 (ranks 2, 3) -> node 2 (ranks 4, 5).
    job = _run_job(tmp_path, victim=3, survivors=[0, 1, 4, 5])
    _check(job, tmp_path, victim=3, lost_node=1, placement=[0, 1, 4, 5],
           plan="replace: rank 2 -> 4, rank 3 -> 5; 0 spares left")


def test_node_0_lost_torchrun_s_bookkeeping_node_too(tmp_path):
    # Rank 0 dies; node 0's agent (which hosts the workers' MASTER_ADDR store) ends rank 1.
    job = _run_job(tmp_path, victim=0, survivors=[2, 3, 4, 5])
    _check(job, tmp_path, victim=0, lost_node=0, placement=[4, 5, 2, 3],
           plan="replace: rank 0 -> 4, rank 1 -> 5; 0 spares left")
