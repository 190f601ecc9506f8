"""The demo end to end, and ``plan`` against real groups built over gloo."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from hypergrid.planning.plan import plan_megatron
from tests.harness import run_gloo


@pytest.mark.gloo
def test_demo_four_local_ranks():
    proc = subprocess.run(
        [sys.executable, "-m", "hypergrid", "demo", "-n", "4", "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1",
         "--timeout", "150"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "hypergrid demo: 4 ranks, grid tp=2 x cp=1 x dp=1 x pp=2" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("grid ", "megatron ", "mesh "))]
    grid_rows = {r[1]: r for r in rows if r[0] == "grid"}
    assert {"tp", "pp", "dp", "cp", "mp", "ep", "expt_dp"} <= set(grid_rows)
    assert grid_rows["tp"][5] == "0-1" and grid_rows["pp"][5:7] == ["0,", "2"]
    assert all("yes" in r for r in rows), out
    assert "all " in out and "groups verified on every rank" in out
    assert "4 ranks finished" in out
    # No warning from importing megatron-core on any rank: the table is the first thing shown.
    assert "Warning" not in proc.stdout + proc.stderr, proc.stderr
    # Timings name what they time, none reads as a contradiction of another.
    timings = out[out.index("timings (slowest rank):"):].splitlines()[1:]
    names = [line.rsplit(None, 2)[0].strip() for line in timings if line.endswith(" ms")]
    assert names == ["init_process_group", "grid groups (create + verify)", "import megatron-core",
                     "megatron initialize_model_parallel", "megatron parallel_state (initialize + verify)",
                     "DeviceMesh device_mesh(grid)", "DeviceMesh (build + verify)", "total on rank"], timings
    assert "filled parallel_state" not in out
    # The issue: the first Megatron row showed initialize_model_parallel's whole time (of its slowest
    # rank) and every other 0.0. Groups made in one call have no time of their own: "-", and the
    # call's time is a phase (slowest rank) and a note (rank 0), each saying which.
    assert {r[-1] for r in rows if r[0] in ("megatron", "mesh")} == {"-"}
    assert all(float(r[-1]) >= 0 for r in rows if r[0] == "grid")
    assert "create ms -: made with the other kinds of its source in one call" in out
    assert re.search(r"megatron: initialize_model_parallel made every Megatron group in one call, [0-9.]+ ms on "
                     r"rank 0", out), out


@pytest.mark.gloo
def test_demo_timeout_is_one_line_for_all_ranks():
    # 4 ranks cannot finish in 2 s on a few cores (the machine limit says so); launched anyway.
    proc = subprocess.run([sys.executable, "-m", "hypergrid", "demo", "-n", "4", "--timeout", "2",
                           "--ignore-machine-limit"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "still running" in line]
    assert lines == ["ranks 0-3: still running after 2s: killed"], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_demo_reports_a_failed_layout_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "hypergrid", "demo", "-n", "4", "--tp", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not divisible" in proc.stderr


def _real_groups(rank: int, world: int) -> dict:
    from hypergrid import HyperCommGrid

    plan = plan_megatron(world, tp=2, ep=2, etp=1)
    grid = HyperCommGrid(list(plan.layout.shape), list(plan.layout.dim_names))
    expert = plan.views["expert"]
    grid.register_view("expert", list(expert.shape), list(expert.dim_names), shared_dims=["pp"])
    out = {}
    for kind in plan.kinds:
        if kind.is_grid_groups:
            pg = grid.get_or_create_pg(list(kind.dims), view=kind.view)
            out[kind.name] = dist.get_process_group_ranks(pg)
    grid.destroy()
    return out


@pytest.mark.gloo
def test_plan_agrees_with_groups_built_over_gloo():
    real = run_gloo(_real_groups, 4, timeout=180)
    proc = subprocess.run(
        [sys.executable, "-m", "hypergrid", "plan", "--world-size", "4", "--tp", "2", "--ep", "2",
         "--etp", "1", "--rank", "3", "--format", "json"],
        capture_output=True, text=True, timeout=60,
    )
    import json

    planned = json.loads(proc.stdout)["rank"]["groups"]
    assert real[3] and all(sorted(planned[name]) == members for name, members in real[3].items())
    assert real[3]["dp"] == [1, 3] and real[3]["ep"] == [2, 3]
    plan = plan_megatron(4, tp=2, ep=2, etp=1)
    for rank, groups in enumerate(real):
        for name, members in groups.items():
            assert sorted(plan.groups_of(rank)[name]) == members, (rank, name)


@pytest.mark.slow
def test_launcher_kills_the_rest_when_one_rank_fails(capfd):
    import os

    from hypergrid.app.demo import launch

    # Rank 1 fails at once; the others would wait 300 s for it, as ranks in a collective do.
    script = ("import os, sys, time\n"
              "print(os.getpid(), flush=True) if os.environ['RANK'] == '0' else None\n"
              "sys.exit('rank 1 broke') if os.environ['RANK'] == '1' else time.sleep(300)\n")
    outcome = launch(3, [sys.executable, "-c", script], timeout_s=120)
    assert not outcome.ok
    assert "rank 1 broke" in outcome.failures[1]
    # Killed once rank 1 had failed, not left to the deadline ("still running after 120s")...
    assert outcome.failures[0] == outcome.failures[2] == "killed after another rank failed"
    # ...and gone: rank 0, which would sleep 300 s, does not outlive the call.
    pid = int(capfd.readouterr().out.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_launcher_deadline(capfd):
    from hypergrid.app.demo import launch

    outcome = launch(2, [sys.executable, "-c", "import time; time.sleep(300)"], timeout_s=2)
    assert not outcome.ok and all("still running after 2s" in v for v in outcome.failures.values())


def test_failed_verification_is_reported_and_not_ok():
    from hypergrid.app.demo import DemoReport, GroupResult, format_report

    plan = plan_megatron(4, tp=2)
    rows = [GroupResult("grid", "tp", "tp", 2, 2, [0, 1], True, 0.01),
            GroupResult("mesh", "dp", 'mesh["dp"]', 2, 2, [0, 2], False, None, "rank 2: counted [0]")]
    report = DemoReport(4, plan, rows, {"total on rank": 1.0})
    text = format_report(report)
    assert not report.ok
    assert "FAILED mesh dp: rank 2: counted [0]" in text and "1 of 2 groups FAILED verification" in text
    table = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("grid ", "mesh "))}
    assert table["grid"][-1] == "10.0" and table["mesh"][-1] == "-"  # made in one call: timed as a phase


def test_rows_made_in_one_call_keep_no_time_of_their_own_when_merged():
    from hypergrid.app.demo import GroupResult, _merge

    def rank(grid_s):
        return ([GroupResult("grid", "tp", "tp", 2, 2, [0, 1], True, grid_s),
                 GroupResult("megatron", "tp", "TENSOR", 2, 2, [0, 1], True, None)],
                {"megatron initialize_model_parallel": grid_s * 100})
    report = _merge(2, plan_megatron(4, tp=2), [rank(0.01), rank(0.03)], [])
    assert [r.create_s for r in report.results] == [0.03, None]
    assert report.phases["megatron initialize_model_parallel"] == 3.0  # the slowest rank's


# ---------------------------------------------------------------------------- signals
def _children(pid: int) -> list[tuple[int, int]]:
    """(pid, process group) of the live children of ``pid``, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append((int(entry), int(fields[2])))
    return sorted(found)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# The launcher, with each process start announced and followed by a pause, so that the test can
# signal it at a chosen point of the spawn loop. Ranks sleep: no gloo job is started.
_SLOW_SPAWN = """
import subprocess, sys, time
from hypergrid.app import launcher

class Announced(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print("started", self.pid, flush=True)
        time.sleep(0.3)

subprocess.Popen = Announced
try:
    launcher.launch(4, [sys.executable, "-c", "import time; time.sleep(300)"], timeout_s=300)
except launcher.LaunchInterrupted as exc:
    print("interrupted", exc.signum, flush=True)
    sys.exit(3)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("after", [1, 2, 4, 5], ids=["group-leader-only", "first-rank", "mid-spawn", "all-running"])
def test_a_signal_at_any_point_of_the_launch_leaves_no_process(signum, after):
    # `after` processes started (the group's leader first, then ranks 0..3) when the signal comes.
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_SPAWN], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    pgid = None
    try:
        started = []
        while len(started) < after:
            line = proc.stdout.readline()
            assert line.startswith("started"), line
            started.append(int(line.split()[1]))
        pgid = started[0]
        assert all(os.getpgid(pid) == pgid for pid in started[1:])  # one group for all ranks
        os.kill(proc.pid, signum)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 3 and rest.splitlines()[-1] == f"interrupted {int(signum)}", rest
        assert _wait_for(lambda: not _group_exists(pgid), 10), "processes of the launch remain"
    finally:
        for group in (proc.pid, pgid):
            if group is not None and _group_exists(group):
                os.killpg(group, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("moment", ["spawning", "running"])
def test_a_signalled_demo_leaves_no_process(signum, moment):
    # Was: SIGTERM left every rank running (each in its own session), SIGINT in the spawn loop one.
    proc = subprocess.Popen([sys.executable, "-m", "hypergrid", "demo", "-n", "4", "--no-megatron", "--no-mesh",
                             "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pgid = None
    try:
        # The first child leads the ranks' process group; signalled once it exists, or once all ranks run.
        wanted = 1 if moment == "spawning" else 5
        assert _wait_for(lambda: len(_children(proc.pid)) >= wanted, 60), _children(proc.pid)
        pgid = _children(proc.pid)[0][1]
        if moment == "running":
            time.sleep(1.0)  # the ranks import torch and meet over gloo
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum, err
        assert f"hypergrid: interrupted ({signal.Signals(signum).name})" in err
        assert _wait_for(lambda: not _group_exists(pgid), 10), "ranks of the demo remain"
        assert not _group_exists(proc.pid)  # nor anything else the launcher started
    finally:
        for group in (proc.pid, pgid):
            if group is not None and _group_exists(group):
                os.killpg(group, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
