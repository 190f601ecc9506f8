"""A real 8-rank gloo job loses a rank: in-process recovery beside a full restart of the same job.

bench_recovery.py plays one rank of a huge world on the fake backend; this one runs a whole job
of real processes on loopback and times what a user waits for.

The job: 8 ranks, Megatron-Core's layout with tensor parallel 2 on ranks 0-5 (data parallel 3),
ranks 6 and 7 spares (``hypergrid.ResilientJob.of_megatron(spares=[6, 7], ...)``), a heartbeat
every 0.5 s, two ranks per node (``gpus_per_node=2``). A step is an all-reduce on
``parallel_state``'s tensor-parallel group, then one on its data-parallel group. At step 3, rank 3
writes ``time.time()`` into the job's store and SIGKILLs itself. Every survivor catches the
``RuntimeError``, calls ``hypergrid.recover(job, step=step)`` and runs one more
step on the new groups; the spare that takes rank 3's place (rank 6) runs that step from
``job.wait_as_spare``. Each reports the seconds from the kill to the end of that step (time.time()
across processes of one machine); the time printed is the largest: every rank of the new
placement back in a working one. Cases:

* ``gloo-8s``, ``gloo-30s``: gloo, with a collective timeout (``init_process_group(timeout=)`` and
  Megatron-Core's ``distributed_timeout_minutes``) of 8 s or 30 s. Ranks 0 and 4 sit in a
  data-parallel all-reduce with rank 2, which has left for the recovery, until that collective
  times out, and the recovery waits for them: the time is about the collective timeout.
* ``abortable-30s``: the test backend of tests/abortable_backend.py (gloo underneath, and its
  ``abort()`` ends the collectives in flight, as NCCL's does), collective timeout 30 s: the
  blocked ranks are aborted out of their collective when the recovery opens, so the time is a few
  seconds whatever the collective timeout. The ranks import ``tests.abortable_backend``, with the
  repository's root put on ``sys.path`` for it; nothing else of tests/ is used.

The anchor, ``restart``: a full restart of the same job on its 6 remaining positions: 6 fresh
processes (started with ``python``, so each imports torch and megatron-core again, as a restarted
job's would), each ``init_process_group("gloo", ...)``, Megatron-Core's own
``parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
create_gloo_process_groups=False)`` and one step; the time is from launching the processes to the
last rank's end of that step. A real restart adds, on top of this and not counted here: the
scheduler noticing the failure and placing the job again (seconds to minutes), the collective
timeout or the launcher's watchdog before the failure is even seen, and reading the checkpoint
back (often minutes). The recovery rows count neither: the model state is the caller's (a peer's
copy, see docs/recovery.md), and nothing is rescheduled.

The launcher is this script's own (no tests/harness.py): the job's TCPStore is hosted by this
process on a free port (as torchrun's agent hosts it), the ranks are ``python`` processes of this
file (``--worker``) that report through the store, every wait has a deadline, and every process
still running at the end of a case is killed (the ranks' output is kept in a temporary folder
only when a case fails). On a machine with few cores the restart's processes compete for the CPU
while they import torch and megatron-core: each rank's own phases are printed below the table,
and so are the same imports in one process with the machine to itself. A run that fails (an error
on some rank, or a rank that does not report in time) is counted in the ``failed`` column, with
each rank's error below the table, and the other runs go on; the exit status is then 1.

Run::

    python benchmarks/bench_recovery_job.py                       # every case once
    python benchmarks/bench_recovery_job.py --repeats 3 --cases restart,gloo-8s,abortable-30s --json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, SPARES, VICTIM, KILL_STEP = 8, (6, 7), 3, 3
GPUS_PER_NODE = 2
HEARTBEAT_S = 0.5
#: The recovery's own deadline (``ResilientJob.of_megatron(timeout=)``); the wait for ranks blocked
#: in a collective comes on top of it.
RECOVERY_S = 30.0
#: How long the ranks of a case may take to start (8 processes importing torch on a few cores).
START_S = 240.0
#: name -> (backend, collective timeout in seconds)
CASES = {"gloo-8s": ("gloo", 8.0), "gloo-30s": ("gloo", 30.0), "abortable-30s": ("abortable", 30.0)}
ANCHOR = "restart"
PREFIX = "bench/"


# ---------------------------------------------------------------------------------------- ranks
def _store(port: int, world: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=START_S))


def _report(store: Any, rank: int, value: dict) -> None:
    store.set(f"{PREFIX}result/{rank}", json.dumps(value))


def _wait_count(store: Any, key: str, count: int, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while store.add(key, 0) < count:
        if time.monotonic() > end:
            raise TimeoutError(f"{key} did not reach {count} within {deadline_s} s")
        time.sleep(0.05)


def _restart_rank(rank: int, port: int, marks: dict) -> dict:
    """One rank of the restarted job: what a fresh process of a restart does before its first step."""
    import torch
    import torch.distributed as dist

    marks["import torch"] = time.time()
    store = _store(port, WORLD - len(SPARES))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD - len(SPARES),
                            timeout=datetime.timedelta(seconds=60))
    marks["init_process_group"] = time.time()
    from megatron.core import parallel_state as ps

    marks["import megatron-core"] = time.time()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    marks["initialize_model_parallel"] = time.time()
    for group in (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()):
        dist.all_reduce(torch.ones(1), group=group)
    marks["step"] = time.time()
    _report(store, rank, {"marks": marks})


def _imports_alone(port: int, marks: dict) -> None:
    """The restart's imports in one process with the machine to itself."""
    import torch.distributed  # noqa: F401

    marks["import torch"] = time.time()
    from megatron.core import parallel_state  # noqa: F401

    marks["import megatron-core"] = time.time()
    _report(_store(port, 1), 0, {"marks": marks})


def _job_rank(rank: int, port: int, case: str) -> None:
    """One rank of the resilient job (see the module's docstring); reports through the store."""
    backend, collective_s = CASES[case]
    import torch
    import torch.distributed as dist

    store = _store(port, WORLD)
    if backend == "abortable":
        sys.path.insert(0, ROOT)  # the repository's root, for tests/abortable_backend.py only
        import tests.abortable_backend  # noqa: F401  (registers the backend with torch and hypergrid)
    collective = datetime.timedelta(seconds=collective_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=WORLD, timeout=collective)
    from megatron.core import parallel_state as ps

    import hypergrid

    def step() -> None:
        for group in (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()):
            dist.all_reduce(torch.ones(1), group=group)

    def killed_at() -> float:
        return float(store.get(f"{PREFIX}killed_at").decode())

    hypergrid.start_heartbeat(interval_s=HEARTBEAT_S)
    job = hypergrid.ResilientJob.of_megatron(
        spares=list(SPARES), tensor_model_parallel_size=2, create_gloo_process_groups=False,
        distributed_timeout_minutes=collective_s / 60, timeout=datetime.timedelta(seconds=RECOVERY_S),
        settings=hypergrid.RecoverySettings(gpus_per_node=GPUS_PER_NODE),
    )
    store.add(f"{PREFIX}ready", 1)
    if not job.in_grid:
        job = job.wait_as_spare(timeout=datetime.timedelta(seconds=START_S + 120))
        if not job.in_grid:
            _report(store, rank, {"role": "unused spare"})
            return
        joined = time.time()
        step()
        back = time.time()
        kill = killed_at()
        _report(store, rank, {"role": "spare", "plan": job.last.describe(), "ranks": list(job.layout.ranks),
                              "joined_s": joined - kill, "back_s": back - kill})
        return
    _wait_count(store, f"{PREFIX}ready", WORLD, START_S)
    number = 0
    while True:
        try:
            if rank == VICTIM and number == KILL_STEP:
                store.set(f"{PREFIX}killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            step()
            number += 1
            if number > KILL_STEP + 100:
                raise AssertionError(f"no failure seen in {number} steps")
        except RuntimeError:
            caught = time.time()
            break
    job = hypergrid.recover(job, step=number)
    recovered = time.time()
    if not job.in_grid:
        _report(store, rank, {"role": "left", "plan": job.last.describe()})
        return
    step()
    back = time.time()
    kill = killed_at()
    _report(store, rank, {"role": "survivor", "plan": job.last.describe(), "ranks": list(job.layout.ranks),
                          "error_s": caught - kill, "recovered_s": recovered - kill, "back_s": back - kill})
    if rank == 0:
        job.release_spares()  # the unused spare returns


def _worker(kind: str, rank: int, port: int, case: str) -> None:
    marks = {"started": time.time()}
    try:
        if kind == "restart":
            _restart_rank(rank, port, marks)
        elif kind == "imports":
            _imports_alone(port, marks)
        else:
            _job_rank(rank, port, case)
    except BaseException as exc:  # reported, then this rank leaves
        import traceback

        try:
            _report(_store(port, WORLD), rank, {"error": f"{type(exc).__name__}: {exc}",
                                                 "traceback": traceback.format_exc()})
        except Exception:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # A job that lost a rank may block in its groups' teardown: leave at once, as a crashed
        # job's survivors would.
        os._exit(0)


# ---------------------------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Launch:
    """``n`` ranks of this script as fresh processes over a store this process hosts."""

    def __init__(self, kind: str, n: int, world: int, case: str) -> None:
        import torch.distributed as dist

        port = _free_port()
        self.store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))
        self.logs = tempfile.mkdtemp(prefix=f"bench_recovery_job_{case}_")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["PYTHONWARNINGS"] = "ignore"
        self.procs = []
        self.launched = time.time()
        for rank in range(n):
            log = open(os.path.join(self.logs, f"rank{rank}.log"), "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", kind, str(rank), str(port), case],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            ))
            log.close()

    def results(self, expect: list[int], deadline_s: float) -> dict[int, dict]:
        """Each rank's report, for the ranks in ``expect``, until all came or their processes ended."""
        out: dict[int, dict] = {}
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            for rank in expect:
                key = f"{PREFIX}result/{rank}"
                if rank not in out and self.store.check([key]):
                    out[rank] = json.loads(self.store.get(key).decode())
            waiting = [r for r in expect if r not in out]
            if not waiting:
                return out
            if all(self.procs[r].poll() is not None for r in waiting):
                time.sleep(0.2)  # a report set just before the process ended
                if all(not self.store.check([f"{PREFIX}result/{r}"]) for r in waiting):
                    break
            time.sleep(0.05)
        missing = [r for r in expect if r not in out]
        raise RuntimeError(f"ranks {missing} did not report within {deadline_s:.0f} s "
                           f"(exit codes {[self.procs[r].poll() for r in missing]}); logs in {self.logs}:\n"
                           + "".join(self._tail(r) for r in missing))

    def _tail(self, rank: int) -> str:
        with open(os.path.join(self.logs, f"rank{rank}.log")) as f:
            return f"--- rank {rank}\n" + "".join(f.readlines()[-30:])

    def close(self, keep_logs: bool) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if not keep_logs:
            shutil.rmtree(self.logs, ignore_errors=True)


class CaseFailed(RuntimeError):
    """A run of a case ended in an error on some rank (or some rank never reported)."""


def _errors(results: dict[int, dict], launch: _Launch) -> None:
    bad = {r: v for r, v in results.items() if "error" in v}
    if bad:
        first = min(bad)
        each = "".join(f"  rank {r}: {v['error']}\n" for r, v in sorted(bad.items()))
        raise CaseFailed(f"ranks {sorted(bad)} failed:\n{each}rank {first}'s traceback:\n{bad[first]['traceback']}"
                         f"(the ranks' output is in {launch.logs})")


def _results(launch: _Launch, expect: list[int], deadline_s: float) -> dict[int, dict]:
    try:
        return launch.results(expect, deadline_s)
    except RuntimeError as exc:
        raise CaseFailed(str(exc)) from exc


def run_restart() -> dict:
    """The anchor: 6 fresh processes, init_process_group, Megatron-Core's initialize_model_parallel, one step."""
    n = WORLD - len(SPARES)
    launch = _Launch(ANCHOR, n, n, ANCHOR)
    ok = False
    try:
        results = _results(launch, list(range(n)), START_S + 60)
        _errors(results, launch)
        ok = True
    finally:
        launch.close(keep_logs=not ok)
    alone = _Launch("imports", 1, 1, "imports")
    ok = False
    try:
        marks = alone.results([0], START_S)[0]["marks"]
        ok = True
    finally:
        alone.close(keep_logs=not ok)
    phases: dict[str, list[float]] = {}
    ends = []
    for value in results.values():
        marks = value["marks"]
        previous = launch.launched
        for name, at in marks.items():
            phases.setdefault(name, []).append(at - previous)
            previous = at
        ends.append(marks["step"])
    return {"seconds": max(ends) - launch.launched, "phases": phases,
            "imports_alone_s": marks["import megatron-core"] - marks["started"]}


def run_case(case: str) -> dict:
    """One run of the resilient job losing rank 3 (see the module's docstring)."""
    _backend, collective_s = CASES[case]
    launch = _Launch("job", WORLD, WORLD, case)
    survivors = [r for r in range(WORLD) if r != VICTIM]
    ok = False
    try:
        results = _results(launch, survivors, START_S + collective_s + RECOVERY_S + 60)
        _errors(results, launch)
        victim = launch.procs[VICTIM].wait(timeout=10)
        ok = True
    finally:
        launch.close(keep_logs=not ok)
    members = {r: v for r, v in results.items() if v["role"] in ("survivor", "spare")}
    plans = {v["plan"] for v in members.values()}
    placements = {tuple(v["ranks"]) for v in members.values()}
    if len(plans) != 1 or len(placements) != 1 or sorted(members) != sorted(next(iter(placements))):
        raise RuntimeError(f"{case}: the ranks disagree on the recovery: {results}")
    spare = [v for v in members.values() if v["role"] == "spare"]
    return {
        "seconds": max(v["back_s"] for v in members.values()),
        "error_s": max(v["error_s"] for v in members.values() if v["role"] == "survivor"),
        "spare_s": spare[0]["back_s"] if spare else None,
        "plan": plans.pop(),
        "placement": list(placements.pop()),
        "victim_exit": victim,
        "ranks": {str(r): v for r, v in sorted(results.items())},
    }


# ---------------------------------------------------------------------------------------- main
def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f} s" if len(values) > 1 else "-"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case (default 1); the median is printed")
    parser.add_argument("--cases", default=",".join([ANCHOR, *CASES]),
                        help=f"comma-separated, of {ANCHOR}, {', '.join(CASES)} (default: all)")
    parser.add_argument("--json", action="store_true", help="print every run's figures as JSON after the table")
    parser.add_argument("--worker", nargs=4, metavar=("KIND", "RANK", "PORT", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], int(args.worker[1]), int(args.worker[2]), args.worker[3])
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c != ANCHOR and c not in CASES]
    if unknown or not cases:
        parser.error(f"--cases: unknown {unknown}; choose from {ANCHOR}, {', '.join(CASES)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from progress import progress  # benchmarks/progress.py, beside this script

    try:
        mcore_version = importlib.metadata.version("megatron-core")  # without importing it here
    except importlib.metadata.PackageNotFoundError:
        mcore_version = "not installed"
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    for repeat in range(args.repeats):
        for case in cases:
            progress(f"run {repeat + 1}/{args.repeats}: {case} ...")
            try:
                runs[case].append(run_restart() if case == ANCHOR else run_case(case))
            except CaseFailed as exc:  # recorded, reported below the table; the other runs go on
                runs[case].append({"failed": str(exc), "run": repeat + 1})
                progress(f"run {repeat + 1}/{args.repeats}: {case} FAILED (reported below the table)")
    progress("")
    ok = {case: [r for r in results if "failed" not in r] for case, results in runs.items()}
    failed = {case: [r for r in results if "failed" in r] for case, results in runs.items()}

    print(f"8-rank job on loopback (tp 2 x dp 3 on ranks 0-5, spares 6 and 7); rank {VICTIM} SIGKILLed at step "
          f"{KILL_STEP}; torch {torch.__version__}, megatron-core {mcore_version}, Python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs; median of {args.repeats} run(s)")
    header = (f"{'case':<14} {'collective timeout':>18} {'time':>9} {'spread':>14} {'vs restart':>11}"
              f" {'error seen':>11} {'spare back':>11} {'failed':>7}")
    print(header)
    print("-" * len(header))
    anchor = statistics.median(r["seconds"] for r in ok[ANCHOR]) if ok.get(ANCHOR) else None
    for case in cases:
        count = f"{len(failed[case])}/{len(runs[case])}"
        times = [r["seconds"] for r in ok[case]]
        if not times:
            print(f"{case:<14} {'every run failed':^79} {count:>7}")
            continue
        median = statistics.median(times)
        ratio = f"{median / anchor:10.2f}x" if anchor else f"{'-':>11}"
        if case == ANCHOR:
            print(f"{'restart':<14} {'-':>18} {median:7.1f} s {_spread(times):>14} {'1.00x':>11} {'-':>11} {'-':>11}"
                  f" {count:>7}")
            continue
        error = statistics.median(r["error_s"] for r in ok[case])
        spare = statistics.median(r["spare_s"] for r in ok[case] if r["spare_s"] is not None)
        print(f"{case:<14} {CASES[case][1]:16.0f} s {median:7.1f} s {_spread(times):>14} {ratio}"
              f" {error:9.1f} s {spare:9.1f} s {count:>7}")
    print("time: restart, from launching 6 fresh processes to the last rank's end of its first step (imports, "
          "init_process_group, Megatron-Core's initialize_model_parallel); recovery cases, from the kill to the "
          "last rank of the new placement's end of its first step after hypergrid.recover. error seen: the last "
          "survivor's collective failing (gloo: its timeout); spare back: the spare that took rank 3's place.")
    print("Not counted in the restart, as a real one adds them: the scheduler noticing the failure and placing the "
          "job again, the collective timeout or launcher watchdog before the failure is seen, and the checkpoint "
          "load. Not counted in the recovery either: copying the lost rank's state from a peer.")
    for case in cases:
        plans = {r["plan"] for r in ok[case] if "plan" in r}
        if plans:
            print(f"{case}: {'; '.join(sorted(plans))}")
    if ok.get(ANCHOR):
        phases: dict[str, list[float]] = {}
        for run in ok[ANCHOR]:
            for name, values in run["phases"].items():
                phases.setdefault(name, []).extend(values)
        print("restart, per rank (median over ranks and runs): " + ", ".join(
            f"{'interpreter start' if name == 'started' else name} {statistics.median(v):.1f} s"
            for name, v in phases.items()))
        alone = [run["imports_alone_s"] for run in ok[ANCHOR]]
        print(f"one process alone (no other rank of this benchmark running) imports torch and megatron-core in "
              f"{statistics.median(alone):.1f} s (spread {_spread(alone)}): what a restarted rank pays for them where "
              f"the ranks do not share CPUs, as {WORLD - len(SPARES)} processes on {os.cpu_count()} CPUs do here")
    for case in cases:
        for run in failed[case]:
            print(f"{case}, run {run['run']} of {args.repeats} failed: {run['failed']}")
    if args.json:
        print(json.dumps({"torch": torch.__version__, "megatron_core": mcore_version, "runs": runs}, indent=1))
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
