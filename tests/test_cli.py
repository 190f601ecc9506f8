"""The command line, through subprocesses where it matters (exit codes, streams) and in-process
for the matrix of bad inputs (each a subprocess would cost a torch import)."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from xml.etree import ElementTree

import pytest

from hypergrid import HyperCommGrid
from hypergrid.app import cli, console
from hypergrid.layout.describe import describe_members
from hypergrid.megatron import choose_megatron_core, plan_model_parallel
from hypergrid.planning.cost import DEFAULT_COMM_MEMORY_MB, max_cost, rank_cost
from hypergrid.planning.plan import plan_grid, plan_megatron
from hypergrid.planning.text import only_kinds

MOE = ["--world-size", "64", "--tp", "2", "--pp", "2", "--cp", "2", "--ep", "4", "--etp", "1"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hypergrid", *args], capture_output=True, text=True, timeout=timeout)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, colour_type = struct.unpack(">IIBB", data[16:26])
    assert depth == 8 and colour_type in (2, 3, 6)  # RGB, palette or RGBA, 8 bits
    channels = {2: 3, 3: 1, 6: 4}[colour_type]
    # Walk the chunks: CRCs right, and the pixels decompress to exactly the declared size.
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, payload = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + payload) & 0xFFFFFFFF, kind
        idat += payload if kind == b"IDAT" else b""
        pos += 12 + length
    assert len(zlib.decompress(idat)) == height * (1 + channels * width)
    return width, height


def test_plan_json_png_svg_in_one_subprocess(tmp_path):
    png, svg = tmp_path / "p.png", tmp_path / "p.svg"
    proc = _run("plan", *MOE, "--rank", "37", "--format", "json", "--png", str(png), "--svg", str(svg), "--kind", "tp,ep",
                "--nvlink-domain", "16")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)  # stdout is only the JSON; picture notes go to stderr
    assert "wrote" in proc.stderr and "p.png" in proc.stderr
    # --kind shows those kinds in the JSON too, and the rank's groups of them; the cost is the rank's whole.
    whole = _run("plan", *MOE, "--rank", "37", "--format", "json", "--nvlink-domain", "16")
    data = json.loads(whole.stdout)
    assert shown == {**only_kinds(data, ["tp", "ep"]), "cost": data["cost"]}
    assert [k["name"] for k in shown["kinds"]] == ["tp", "ep"] and list(shown["rank"]["groups"]) == ["tp", "ep"]
    # Equal to the library's answers, for the megatron-core release plan follows (the installed one)...
    features, followed = choose_megatron_core()
    plan = plan_megatron(64, tp=2, pp=2, cp=2, ep=4, etp=1, features=features)
    expected = plan.as_dict(8, rank=37, nvlink_domain=16)
    cost = data.pop("cost")
    assert data == json.loads(json.dumps(expected))
    assert cost["rank"] == json.loads(json.dumps(rank_cost(plan, 37, nvlink_domain=16).as_dict()))
    assert cost["max"] == max_cost(plan).as_dict() and cost["comm_memory_mb"] == DEFAULT_COMM_MEMORY_MB
    assert cost["follows"] == json.loads(json.dumps(followed.as_dict()))
    # ...which are Megatron's groups (adapter plan) and the grid's own.
    megatron = plan_model_parallel(64, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                   context_parallel_size=2, expert_model_parallel_size=4,
                                   expert_tensor_parallel_size=1, create_gloo_process_groups=False, features=features)
    assert data["rank"]["groups"] == megatron.rank_groups(37)
    grid = HyperCommGrid(data["grid"]["shape"], data["grid"]["dim_names"], world_size=64)
    assert data["rank"]["groups"]["tp_dp_cp"] == grid.ranks(["tp", "dp", "cp"], rank=37)
    assert data["rank"]["coords"] == grid.coords(37)
    kinds = {k["name"]: k for k in data["kinds"]}
    assert kinds["tp"]["crosses_nodes"] is False and kinds["pp"]["crosses_nodes"] is True
    assert kinds["ep"]["count"] == 16 and kinds["ep"]["size"] == 4
    # Pictures: written, of sensible size, one panel per --kind, rank 37's groups outlined.
    assert "one panel each for tp, ep" in proc.stderr
    width, height = _png_size(png.read_bytes())
    assert 200 < width < 2000 and 200 < height < 3000
    assert 2_000 < png.stat().st_size < 500_000
    root = ElementTree.parse(svg).getroot()
    ids = [g.get("id") for g in root.iter("{http://www.w3.org/2000/svg}g")]
    assert [i for i in ids if i and i.startswith(("panel-", "highlight-"))] == [
        "panel-tp", "highlight-tp", "panel-ep", "highlight-ep"]
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "rank 37: 36, 37" in texts and "NVLink domains of 16 GPUs" in texts


@pytest.mark.slow
def test_plan_table_and_csv_and_console_script():
    proc = _run("plan", "--shape", "2,3,4", "--dims", "tp,cp,dp", "--group", "cp,dp", "--gpus-per-node", "6",
                "--rank", "7")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "24 ranks on 4 nodes of 6" in out
    assert "rank 7: node 1, local rank 1" in out and "coords tp=1 cp=0 dp=1" in out
    table = out.split("\n\n")[1]  # the kinds table, before the rank's section
    lines = {line.split()[0]: line for line in table.splitlines() if line.split()}
    assert "inside a node" in lines["cp"] and "ACROSS DOMAINS" in lines["dp"]
    script = Path(sys.executable).with_name("hypergrid")
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    csv_out = subprocess.run([str(script), "plan", "--shape", "2,4", "--dims", "tp,dp", "--format", "csv", "--rank", "3"],
                             capture_output=True, text=True, timeout=60)
    assert csv_out.returncode == 0, csv_out.stderr
    rows = [r.split(",") for r in csv_out.stdout.strip().splitlines()]
    assert rows[0][-2:] == ["rank_3_group", "rank_3_communicator"]
    assert rows[1][:6] == ["tp", "tp", "", "", "4", "2"] and rows[1][-2:] == ["2 3", "1"]
    assert rows[2][0] == "dp" and rows[2][-2:] == ["1 3 5 7", "2"]


def test_bad_input_subprocess_one_line_exit_2():
    proc = _run("plan", "--world-size", "10", "--tp", "4")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("hypergrid: error:") and "10" in proc.stderr and "4" in proc.stderr


@pytest.mark.parametrize(
    "argv,words",
    [
        (["plan", "--shape", "2,4", "--dims", "tp,dp", "--group", "tp,xx"], ["'xx'", "['tp', 'dp']"]),
        (["plan", "--world-size", "8", "--order", "tp-xx-dp"], ["'xx'"]),
        (["plan", "--world-size", "8", "--tp", "3"], ["8", "3"]),
        (["plan", "--world-size", "16", "--ep", "32"], ["16", "32"]),
        (["plan", "--shape", "2,4", "--dims", "tp,dp", "--rank", "8"], ["rank 8", "[0, 8)"]),
        (["plan", "--shape", "2,4", "--dims", "tp,dp", "--world-size", "4"], ["8", "4"]),
        (["plan", "--shape", "2,4", "--dims", "tp"], ["len(shape)"]),
        (["plan", "--shape", "2,x", "--dims", "tp,dp"], ["2,x"]),
        (["plan", "--shape", "2,4"], ["--dims"]),
        (["plan", "--tp", "2"], ["--world-size"]),
        (["plan", "--shape", "2,4", "--dims", "tp,dp", "--tp", "2"], ["--tp"]),
        (["plan", "--world-size", "8", "--colour", "zz"], ["'zz'"]),
        (["plan", "--world-size", "0"], ["0"]),
        (["plan", "--world-size", str(2**80)], [str(2**80), "too large"]),
        (["plan", "--shape", str(2**80), "--dims", "a"], [str(2**80), "too large"]),
        (["check", "--world-size", str(2**40), "--tp", "8", "--full"], ["too large"]),
        (["plan", "--world-size", str(2**63), "--tp", "8"], [str(2**63), "int64"]),
        (["plan", "--world-size", "8", "--rank", "-1"], ["-1"]),
        (["check", "--world-size", "8", "--cp", "16"], ["8", "16"]),
        (["bench", "nosuch"], ["'nosuch'"]),
        (["nosuch"], ["nosuch"]),
        (["plan", "--shape", "2,2", "--dims", "tp,dp", "--", "x"], ["bench"]),
    ],
)
def test_bad_input_in_process(argv, words, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("hypergrid: error:") and "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert captured.out == ""


@pytest.mark.slow
def test_check_subprocess_identical_exit_0():
    proc = _run("check", "--world-size", "64", "--tp", "2", "--pp", "2", "--ep", "4", "--etp", "1")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("compared ") and "enumerations with megatron-core" in first
    assert int(first.split()[1]) >= 30
    assert "identical to megatron-core" in proc.stdout


def test_check_reports_a_difference_and_exits_1(monkeypatch, capsys):
    from hypergrid.planning import plan as report

    real = report.GroupKind.enumerate

    def wrong(self):
        groups = real(self)
        return groups[::-1] if self.name == "ep" else groups  # a plan that disagrees with Megatron

    monkeypatch.setattr(report.GroupKind, "enumerate", wrong)
    assert cli.main(["check", "--world-size", "16", "--ep", "4"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENCE ep" in out and "RankGenerator" in out and "1 differences" in out


def test_check_free_grid_counts_every_subset(capsys):
    assert cli.main(["check", "--shape", "2,3,4", "--dims", "tp,cp,dp"]) == 0
    assert capsys.readouterr().out.startswith("compared 7 enumerations")


def test_plan_in_process_rank_table_matches_library(capsys):
    assert cli.main(["plan", "--world-size", "1024", "--tp", "8", "--pp", "4", "--ep", "16", "--etp", "1",
                     "--rank", "1000"]) == 0
    out = capsys.readouterr().out
    plan = plan_megatron(1024, tp=8, pp=4, ep=16, etp=1)
    assert f"  pp{' ' * 14}{describe_members(plan.groups_of(1000)['pp'])}" in out
    assert "cross nodes (8 ranks per node): dp_cp, dp, mp, pp" in out
    assert "- (in no group of this kind)" in out  # rank 1000 is not on the first pipeline stage


def test_bench_streams_scripts_and_reports_missing(tmp_path, capfd):
    (tmp_path / "bench_grid.py").write_text("import sys\nprint('progress 1', flush=True)\nprint('args', sys.argv[1:])\n")
    assert cli.main(["bench", "grid", "--bench-dir", str(tmp_path), "--", "--worlds", "4096"]) == 0
    out = capfd.readouterr().out
    assert "progress 1" in out and "args ['--worlds', '4096']" in out
    assert cli.main(["bench", "--bench-dir", str(tmp_path)]) == 2  # megatron's script is missing
    captured = capfd.readouterr()
    assert "bench_megatron.py does not exist" in captured.err and "progress 1" in captured.out
    (tmp_path / "bench_grid.py").write_text("raise SystemExit(3)\n")
    assert cli.main(["bench", "grid", "--bench-dir", str(tmp_path)]) == 1
    assert "exited with status 3" in capfd.readouterr().err


def _benchmark_progress():
    spec = importlib.util.spec_from_file_location("bench_progress", cli.BENCH_DIR / "progress.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_benchmark_progress_rewrites_a_terminal_line_and_writes_lines_elsewhere(monkeypatch, tty):
    stream = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    progress = _benchmark_progress().progress
    progress("4096 ranks: hypergrid ...")
    progress("4096 ranks: megatron-core ...")
    progress("")  # before a result row
    expected = ("\r\033[K4096 ranks: hypergrid ...\r\033[K4096 ranks: megatron-core ...\r\033[K" if tty
                else "4096 ranks: hypergrid ...\n4096 ranks: megatron-core ...\n")
    assert stream.getvalue() == expected


@pytest.mark.slow
def test_bench_says_what_it_measures_before_each_row():
    # Off a terminal (a pipe here) each measurement is announced on its own stderr line.
    proc = _run("bench", "grid", "--", "--worlds", "4096", "--repeat", "1", timeout=300)
    assert proc.returncode == 0, proc.stderr
    steps = [line for line in proc.stderr.splitlines() if line.startswith("4096 ranks:")]
    assert steps == ["4096 ranks: hypergrid ...", "4096 ranks: megatron-core ..."], proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["4096"])
    assert row.rstrip().endswith("x"), row  # the ratio, hypergrid against megatron-core


def test_free_grid_plan_with_world_larger_than_grid():
    plan = plan_grid([2, 2], ["tp", "dp"], world_size=8)
    assert plan.as_dict(4)["nodes"] == 2


def test_an_unknown_flag_points_at_the_subcommands_help(capsys):
    assert cli.main(["plan", "--world-size", "8", "--no-such-flag", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "hypergrid: error: unrecognized arguments: --no-such-flag 2 (see: hypergrid plan --help)"


def test_demo_sizes_the_user_did_not_give_are_one(capsys):
    # The showcase layout (pp 2, ep 2) applies only when no size is given: --tp 4 on 6 ranks is
    # refused for tp alone, not for a pipeline size of 2 the user never asked for.
    assert cli.main(["demo", "-n", "6", "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "tensor_model_parallel_size (4)" in err and "pipeline_model_parallel_size (1)" in err, err


def test_whole_groups_that_skip_ranks_never_read_as_contiguous():
    from hypergrid.layout.describe import describe_members

    dp_of_tp8 = [r for start in range(0, 128, 32) for r in range(start, start + 8)]
    assert describe_members(dp_of_tp8) == "0-7, 32-39, 64-71, 96-103 (32 ranks)"
    assert describe_members(list(range(128))) == "0-127"


def test_a_rank_s_long_groups_show_whole_runs_only(capsys):
    # A group longer than the table shows: no run cut short, no count of the shown part alone.
    assert cli.main(["plan", "--world-size", "1024", "--tp", "4", "--pp", "8", "--cp", "2", "--ep", "16",
                     "--etp", "1", "--rank", "1000"]) == 0
    rows = {line.split()[0]: line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ") and len(line.split()) > 1}
    assert rows["mp"] == "104-107, 232-235, 360-363, 488-491, 616-619, 744-747, 872-875, 1000-1003 (32 ranks)"
    assert rows["tp_dp"] == "896-899, 904-907, 912-915, 920-923, 928-931, 936-939, 944-947, ..., 1016-1019 (64 ranks)"
    assert rows["tp_dp_cp"] == "896-1023 (128 ranks)"
    assert rows["dp_cp"] == "896, 900, 904, 908, 912, 916, 920, ..., 1020 (32 ranks, step 4)"
    # A group whose runs are longer than 16 ranks: each run whole, as the JSON lists them (the issue's
    # tp_ep_pp of 1,024 ranks read "64-77, ..., 2047" from its first 16 members).
    assert cli.main(["plan", "--world-size", "2048", "--tp", "1", "--pp", "16", "--ep", "64", "--etp", "1",
                     "--rank", "1000"]) == 0
    rows = {line.split()[0]: line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ") and len(line.split()) > 1}
    assert rows["tp_ep_pp"] == ("64-127, 192-255, 320-383, 448-511, 576-639, 704-767, 832-895, ..., 1984-2047 "
                                "(1024 ranks)")
    # Beyond the listed limit only the first 16 members are known: a run longer than that is not given an end.
    assert cli.main(["plan", "--world-size", str(1 << 30), "--tp", "8", "--pp", "16", "--ep", "64",
                     "--rank", "123456789"]) == 0
    rows = {line.split()[0]: line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ") and len(line.split()) > 1}
    assert rows["tp_dp"] == "67108864-134217727 (67108864 ranks)"
    assert rows["expt_dp"] == "67109141, 67109653, 67110165, 67110677, 67111189, 67111701, 67112213, ..., 134217493 (131072 ranks, step 512)"


def test_dp_is_accepted_and_checked_against_the_world(capsys):
    assert cli.main(["plan", "--tp", "8", "--pp", "4", "--dp", "4", "--format", "json"]) == 0
    assert '"world_size": 128' in capsys.readouterr().out  # tp x pp x dp, as Megatron users count
    assert cli.main(["plan", "--world-size", "128", "--tp", "8", "--dp", "4"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "hypergrid: error: --dp 4 does not fit: 128 ranks / (tp 8 x cp 1 x pp 1) leave a data-parallel size "
        "of 16; expected --dp 16 or --world-size 32"
    )
    assert cli.main(["plan", "--shape", "2,4", "--dims", "tp,dp", "--dp", "4"]) == 2
    assert "--dp" in capsys.readouterr().err


def test_check_says_what_it_compares_while_it_runs(capsys, monkeypatch):
    # Off a terminal a line every few seconds; here every step, to see them.
    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.0)
    assert cli.main(["check", "--world-size", "16", "--tp", "2", "--ep", "2"]) == 0
    captured = capsys.readouterr()
    assert "identical to megatron-core" in captured.out
    steps = [line for line in captured.err.splitlines() if line.startswith("... comparing ")]
    assert any("HyperCommGrid" in line for line in steps) and any("RankGenerator" in line for line in steps), captured.err


def test_planning_imports_no_torch():
    # `hypergrid plan` is pure rank arithmetic: importing torch would cost most of its run time.
    code = ("import sys; from hypergrid.app import cli; "
            "sys.exit(cli.main(['plan', '--world-size', '16777216', '--tp', '8', '--pp', '16', '--cp', '2', "
            "'--ep', '64', '--rank', '12345678']) or ('torch' in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 12345678: node 1543209" in proc.stdout


def test_plan_json_for_one_rank_of_a_huge_world_is_o_ndims():
    # Was: every member of the rank's 2**30-rank groups listed (MemoryError under 3 GB; at 2**63
    # ranks the machine ran out of memory). Measured: 0.13-0.15 s and 18-20 MB of resident memory.
    resource = pytest.importorskip("resource")
    limit = 200 << 20

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    for world in (1 << 30, (1 << 63) - 1):
        proc = subprocess.run([sys.executable, "-m", "hypergrid", "plan", "-n", str(world), "--rank", "5", "--json"],
                              capture_output=True, text=True, timeout=120, preexec_fn=limit_memory)
        assert proc.returncode == 0, proc.stderr[-2000:]
        groups = json.loads(proc.stdout)["rank"]["groups"]
        assert groups["tp"] == [5] and groups["dp"] == {"size": world, "head": list(range(16)), "last": world - 1}


def test_plan_json_lists_groups_in_full_up_to_the_listed_limit(capsys):
    from hypergrid.planning.plan import LISTED_MEMBERS

    plan = plan_grid([2, LISTED_MEMBERS, 2], ["tp", "dp", "pp"])
    groups = plan.as_dict(8, rank=3)["rank"]["groups"]
    assert groups["dp"] == plan.groups_of(3)["dp"] and len(groups["dp"]) == LISTED_MEMBERS
    big = plan_grid([2, LISTED_MEMBERS + 1], ["tp", "dp"]).as_dict(8, rank=3)["rank"]["groups"]
    assert big["tp"] == [2, 3] and big["dp"] == {"size": LISTED_MEMBERS + 1, "head": list(range(1, 33, 2)),
                                                   "last": 2 * LISTED_MEMBERS + 1}
    assert cli.main(["plan", "--shape", f"2,{LISTED_MEMBERS + 1}", "--dims", "tp,dp", "--rank", "3", "--csv"]) == 0
    rows = {row[0]: row for row in csv.reader(io.StringIO(capsys.readouterr().out))}
    assert rows["dp"][-2] == f"1, 3, 5, 7, 9, 11, 13, ..., {2 * LISTED_MEMBERS + 1} ({LISTED_MEMBERS + 1} ranks, step 2)"
    assert rows["tp"][-2] == "2 3"


# Every subcommand that writes to stdout; each is in-process (stdout a file on /dev/full).
FULL_DISK = [
    ["plan", "--world-size", "64", "--tp", "8"],
    ["plan", "--world-size", "64", "--tp", "8", "--rank", "3", "--json"],
    ["plan", "--world-size", "64", "--tp", "8", "--csv"],
    ["check", "--world-size", "16", "--tp", "2"],
    ["demo", "-n", "2", "--tp", "1", "--pp", "1"],
    ["bench", "grid"],
    ["plan", "--help"],
    [],
]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", FULL_DISK, ids=[" ".join(a[:2]) or "no command" for a in FULL_DISK])
def test_a_full_disk_is_one_error_line_and_status_1(argv, monkeypatch, capsys, tmp_path):
    if argv[:1] == ["bench"]:
        (tmp_path / "bench_grid.py").write_text("pass\n")
        argv = [*argv, "--bench-dir", str(tmp_path)]
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        status = cli.main(argv)
    assert status == 1
    err = capsys.readouterr().err.strip()
    assert err == "hypergrid: error: cannot write the output: No space left on device", err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_leaves_no_traceback_at_exit():
    # The real stream: what is still buffered must not fail again while the interpreter exits.
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "hypergrid", "plan", "--world-size", "4096", "--tp", "8",
                               "--rank", "5", "--json"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == "hypergrid: error: cannot write the output: No space left on device\n"


def test_demo_refuses_a_world_this_machine_cannot_run():
    # Was: 100,000 processes started, and the machine ran out of memory. Refused before any
    # process starts (stdout says nothing was launched).
    proc = _run("demo", "-n", "100000", timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "\n" not in err and err.startswith("hypergrid: error: demo --world-size 100000 is more local ranks"), err
    for word in ("at most", "CPUs x 120 s / 6 CPU-s per rank", "600 MB per rank", "--ignore-machine-limit"):
        assert word in err, (word, err)


def test_demo_limit_follows_the_machine_and_can_be_overridden_by_name(monkeypatch, capsys):
    from hypergrid.app import demo
    from hypergrid.app.launcher import LaunchOutcome, Machine

    monkeypatch.setattr(demo, "probe_machine", lambda: Machine(cpus=2, available_bytes=8 << 30))
    launched = []
    monkeypatch.setattr(demo, "launch", lambda world, argv, timeout_s: launched.append(world) or LaunchOutcome(True, 0.1, {}))
    assert cli.main(["demo", "-n", "12", "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert "at most 10 (2 CPUs x 120 s / 6 CPU-s per rank = 40; 8.0 GiB available x 0.8 / 600 MB per rank = 10;" in err
    assert "a longer --timeout" not in err and not launched  # memory binds: more time would not help
    assert cli.main(["demo", "-n", "10", "--tp", "1"]) == 0 and launched == [10]
    assert cli.main(["demo", "-n", "12", "--tp", "1", "--ignore-machine-limit"]) == 0 and launched == [10, 12]
    monkeypatch.setattr(demo, "probe_machine", lambda: Machine(cpus=1, available_bytes=None))
    assert cli.main(["demo", "-n", "4", "--tp", "1", "--timeout", "12"]) == 2
    err = capsys.readouterr().err
    assert "at most 2 (1 CPUs x 12 s / 6 CPU-s per rank = 2; memory unknown;" in err and "a longer --timeout" in err


def test_planning_a_torchtitan_job_imports_no_torch(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[parallelism]\ntensor_parallel_degree = 8\npipeline_parallel_degree = 4\n")
    code = ("import sys; from hypergrid.app import cli; "
            f"sys.exit(cli.main(['plan', '--torchtitan', {str(job)!r}, '--world-size', '256', '--rank', '5']) "
            "or ('torch' in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "torchtitan column: the groups torchtitan 0." in proc.stdout


@pytest.mark.parametrize("release,megatron,version", [("0.16", "17 (rank 0)", "0.16.1"), ("0.19", "20 (rank 0)", "0.19.2")])
def test_plan_counts_the_megatron_core_release_asked_for(release, megatron, version, capsys):
    # 0.19's three gtp_remat groups a rank: Megatron-Core's count grows, hypergrid's does not.
    argv = ["plan", "--world-size", "16", "--tp", "2", "--pp", "2", "--ep", "2", "--megatron-core-version", release]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("most of any rank"))
    assert row.split()[6:12] == ["10", "(rank", "0)", *megatron.split()], row  # hypergrid's, then Megatron-Core's
    assert f"megatron-core column: the groups megatron-core {version} (given" in out
    assert cli.main(["plan", "--shape", "2,8", "--dims", "tp,dp", "--megatron-core-version", release]) == 2
    assert "--megatron-core-version goes with Megatron sizes or --megatron-args" in capsys.readouterr().err
