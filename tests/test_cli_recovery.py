"""``hypergrid plan --fail``: what a recovery would rebuild, on the command line.

In-process through ``cli.main`` (each subprocess would cost a torch import), but for the exit
status and streams of a refusal, checked once in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hypergrid.app import cli
from hypergrid.megatron import choose_megatron_core
from hypergrid.planning.plan import plan_grid, plan_megatron
from hypergrid.planning.recovery import recovery_of

LAYOUT = ["--world-size", "16", "--tp", "2", "--pp", "2", "--gpus-per-node", "4"]


def _main(capsys, *argv):
    status = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _rows(text: str) -> dict[str, list[str]]:
    """The kinds table's rows, by kind: before, after, kept, rebuilt, dropped."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kind ") and "groups before" in line) + 2
    rows = {}
    for line in lines[start:]:
        if not line.strip() or line.startswith("kept:"):
            break
        name, *counts = line.split()
        rows[name] = counts
    return rows


def test_a_replacement_shows_the_move_and_what_each_kind_keeps(capsys):
    status, out, err = _main(capsys, *LAYOUT, "--fail", "5", "--spares", "2", "--megatron-core-version", "0.16")
    assert status == 0 and not err
    assert out.splitlines()[0] == "hypergrid plan: 16 ranks on 4 nodes of 4 ranks; spares: 16-17"
    assert "recovery from the loss of rank 5: replace" in out
    assert "  a spare takes each failed rank's position: 5 -> 16" in out and "  spares left: 17" in out
    assert "grid after: tp=2 x cp=1 x dp=4 x pp=2 on ranks 0-4, 16, 6-15 (16 ranks)" in out
    rows = _rows(out)
    assert rows["tp"] == ["8", "8", "7", "1", "1"] and rows["dp"] == ["4", "4", "3", "1", "1"]
    assert rows["intra_dist_opt"] == ["1", "1", "0", "1", "1"]
    assert "\nkinds: the groups megatron-core 0.16.1 (given" in out  # "; 0.19.2 is installed" where it is
    # Every kind of the plan has a row, in the plan's order.
    assert list(rows) == [k.name for k in plan_megatron(16, tp=2, pp=2).kinds]


def test_a_shrink_shows_the_replicas_dropped_and_the_ranks_leaving(capsys):
    status, out, _ = _main(capsys, *LAYOUT, "--fail", "5")
    assert status == 0
    assert "recovery from the loss of rank 5: shrink" in out
    assert "  too few spares (0 for 1 failed): replica 2 of dp dropped (dp 4 -> 3)" in out
    assert "  ranks leaving the grid with it: 4, 12-13 (3 ranks)" in out
    assert "grid after: tp=2 x cp=1 x dp=3 x pp=2 on ranks 0-3, 6-11, 14-15 (12 ranks)" in out
    rows = _rows(out)
    assert rows["tp"] == ["8", "6", "6", "0", "2"] and rows["dp"] == ["4", "4", "0", "4", "4"]


def test_rank_shows_its_groups_before_and_after(capsys):
    status, out, _ = _main(capsys, *LAYOUT, "--fail", "5", "--spare-ranks", "20", "--rank", "20")
    assert status == 0
    lines = out.splitlines()
    head = lines.index("rank 20 (node 5, local rank 0): a spare, takes rank 5's place; coords after tp=1 cp=0 dp=2 pp=0")
    table = {line.split()[0]: line.split(None, 1)[1] for line in lines[head + 3:]}
    assert table["tp"].split() == ["-", "4,", "20", "joined"]
    status, out, _ = _main(capsys, *LAYOUT, "--fail", "5", "--rank", "6")
    lines = out.splitlines()
    head = lines.index("rank 6 (node 1, local rank 2): stays; coords before tp=0 cp=0 dp=3 pp=0, after tp=0 cp=0 dp=2 pp=0")
    table = {line.split()[0]: line.split(None, 1)[1].split() for line in lines[head + 3:]}
    assert table["dp"] == ["0,", "2,", "4,", "6", "0,", "2,", "6", "rebuilt"]
    assert table["tp"] == ["6-7", "6-7", "kept"]
    status, out, _ = _main(capsys, *LAYOUT, "--fail", "5", "--rank", "5")
    assert "rank 5 (node 1, local rank 1): failed; coords before tp=1 cp=0 dp=2 pp=0" in out


def test_a_refusal_is_one_line_and_exit_status_2_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "hypergrid", "plan", "--world-size", "8", "--tp", "2", "--pp", "4",
                           "--fail", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "hypergrid: error: cannot recover from the loss of ranks [3]: no spare is left (0 given, 1 needed), and "
        "every one of the 1 replicas of 'dp' holds a failed rank, so none can be dropped"]


def test_a_shrink_megatron_core_refuses_is_a_refusal_naming_the_sizes(capsys):
    status, out, err = _main(capsys, "--world-size", "64", "--pp", "8", "--ep", "8", "--fail", "5")
    assert status == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("hypergrid: error: cannot recover from the loss of ranks [5]: the shrunk grid's 56 ranks "
                          "(tp=1 x cp=1 x dp=7 x pp=8) are sizes Megatron-Core refuses: ")


@pytest.mark.parametrize("argv, words", [
    (["--fail", "5,5"], "--fail 5,5: rank 5 is given twice; expected distinct ranks"),
    (["--fail", "16"], "--fail 16: rank 16 is not in the grid, which spans ranks [0, 16); expected ranks of the grid"),
    (["--fail", "x"], "argument --fail: expected comma-separated ranks or ranges like 4,5,6,7 or 12344-12351, got 'x'"),
    (["--fail", "4,,5"], "argument --fail: expected comma-separated ranks or ranges like 4,5,6,7 or 12344-12351, "
                         "got '4,,5' (entry 2 is empty)"),
    (["--fail", "-1"], "argument --fail: expected ranks (integers >= 0), got -1 in '-1'"),
    (["--fail", "7-4"], "argument --fail: expected a range from a lower rank to a higher one, got '7-4' in '7-4'; "
                        "write 4-7"),
    (["--fail", "0-99999999"], "argument --fail: expected at most 4194304 ranks, got '0-99999999'"),
    (["--fail", "12-17"], "--fail 12-17: rank 16 is not in the grid, which spans ranks [0, 16); expected ranks of the grid"),
    (["--fail", "4-5,5"], "--fail 4-5,5: rank 5 is given twice; expected distinct ranks"),
    (["--fail", "5", "--spares", "-1"], "argument --spares: expected a number of ranks (integer >= 0), got -1"),
    (["--fail", "5", "--spare-ranks", "3"],
     "--spare-ranks 3: rank 3 is in the grid, which spans ranks [0, 16); expected ranks outside it, e.g. 16"),
    (["--fail", "5", "--spare-ranks", "16,16"], "--spare-ranks 16,16: rank 16 is given twice; expected distinct ranks"),
    (["--fail", "5", "--spares", "1", "--spare-ranks", "16"], "argument --spare-ranks: not allowed with argument --spares"),
    (["--spares", "2"], "--spares goes with --fail RANKS"),
    (["--spare-ranks", "16"], "--spare-ranks goes with --fail RANKS"),
    (["--fail", "5", "--replica-dim", "pp"], "--replica-dim pp: a Megatron layout's replicas are along dp; expected dp"),
    (["--fail", "5", "--replica-dim", "rep"], "--replica-dim rep: the grid has no such dim; expected one of tp, cp, dp, pp"),
    (["--fail", "5", "--rank", "30"], "--rank 30 is neither in the grid (ranks [0, 16)) nor a spare; expected one of them"),
    (["--fail", "5", "--csv"], "--fail shows a recovery as a table or --json; --csv goes with a plan alone"),
    (["--fail", "5", "--png", "x.png"], "--png goes with a plan alone"),
    (["--fail", "5", "--comm-memory-mb", "100"], "--comm-memory-mb goes with a plan alone"),
])
def test_bad_input_is_one_line_naming_the_flag(capsys, argv, words):
    status, out, err = _main(capsys, *LAYOUT, *argv)
    assert status == 2 and out == "", (argv, out)
    assert len(err.splitlines()) == 1 and err.startswith("hypergrid: error: ") and words in err, err


def test_json_is_the_reports_dict(capsys):
    status, out, _ = _main(capsys, *LAYOUT, "--fail", "5", "--spares", "2", "--rank", "4", "--json")
    assert status == 0
    data = json.loads(out)
    features, followed = choose_megatron_core()
    report = recovery_of(plan_megatron(16, tp=2, pp=2, features=features), failed=[5], spares=[16, 17], gpus_per_node=4)
    expected = report.as_dict(4, rank=4)
    expected["follows"] = followed.as_dict()  # plan follows the installed release, and says so
    assert data == json.loads(json.dumps(expected))
    r = data["recovery"]
    assert r["kind"] == "replace" and r["replaced"] == [[5, 16]] and r["spares_left"] == [17]
    assert r["grid_after"] == {"shape": [2, 1, 4, 2], "dim_names": ["tp", "cp", "dp", "pp"], "size": 16,
                               "rank_runs": [[0, 5], [16, 1], [6, 10]]}
    tp = next(k for k in r["kinds"] if k["name"] == "tp")
    assert tp == {"name": "tp", "view": None, "before": 8, "after": 8, "kept": 7, "rebuilt": 1, "dropped": 1,
                  "counted": "failed_groups"}
    rank = data["rank"]
    assert rank["role"] == "stays" and rank["node"] == 1 and rank["local_rank"] == 0
    assert rank["groups"]["tp"] == {"before": [4, 5], "after": [4, 16], "change": "rebuilt"}
    assert rank["groups"]["pp"] == {"before": [4, 12], "after": [4, 12], "change": "kept"}


def test_json_of_a_shrink_of_a_free_grid(capsys):
    status, out, _ = _main(capsys, "--shape", "2,2,4", "--dims", "tp,cp,rep", "--group", "cp,rep", "--fail", "6,7",
                           "--replica-dim", "rep", "--json")
    assert status == 0
    r = json.loads(out)["recovery"]
    assert r["kind"] == "shrink" and r["dropped_replicas"] == [1] and r["leaving"] == [4, 5]
    assert r["grid_after"]["shape"] == [2, 2, 3] and r["grid_after"]["rank_runs"] == [[0, 4], [8, 8]]
    expected = recovery_of(plan_grid([2, 2, 4], ["tp", "cp", "rep"], groups=[["cp", "rep"]]), failed=[6, 7],
                           replica_dim="rep")
    assert r["kinds"] == [c.as_dict() for c in expected.changes]


def test_a_million_ranks_answer_without_listing_every_group(capsys, monkeypatch):
    from hypergrid.layout.kinds import GroupKind

    def refuse(self):
        raise AssertionError(f"{self.name}: every group was listed")

    monkeypatch.setattr(GroupKind, "enumerate", refuse)
    world = 1 << 20
    node = ",".join(str(r) for r in range(8000, 8008))
    status, out, err = _main(capsys, "--world-size", str(world), "--tp", "8", "--pp", "4", "--fail", node,
                             "--spares", "8", "--rank", str(world + 2), "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["recovery"]["replaced"] == [[8000 + i, world + i] for i in range(8)]
    assert data["rank"]["groups"]["tp"]["after"] == list(range(world, world + 8))
    assert {k["counted"] for k in data["recovery"]["kinds"]} == {"failed_groups"}


def test_spares_for_part_of_the_loss_drop_one_replica_and_replace_the_rest(capsys):
    # The command: tp 8 x pp 2 x dp 2, ranks 1 and 9 (one in each replica), one spare.
    status, out, err = _main(capsys, "--world-size", "32", "--tp", "8", "--pp", "2", "--fail", "1,9", "--spares", "1",
                             "--megatron-core-version", "0.16")
    assert status == 0 and not err
    assert "recovery from the loss of ranks 1, 9: shrink" in out
    assert "  too few spares (1 for 2 failed): replica 1 of dp dropped (dp 2 -> 1)" in out
    assert "  ranks leaving the grid with it: 8, 10-15, 24-31 (15 ranks)" in out
    assert "  in the replicas kept, a spare takes each failed rank's position: 1 -> 32" in out
    assert "  spares left: none" in out
    assert "grid after: tp=8 x cp=1 x dp=1 x pp=2 on ranks 0, 32, 2-7, 16-23 (16 ranks)" in out
    rows = _rows(out)
    assert rows["tp"] == ["4", "2", "1", "1", "3"]  # rank 1's tp group rebuilt, replica 1's two dropped
    assert rows["pp"] == ["16", "8", "7", "1", "9"]
    status, out, _ = _main(capsys, "--world-size", "32", "--tp", "8", "--pp", "2", "--fail", "1,9", "--spares", "1",
                           "--rank", "32", "--json")
    data = json.loads(out)
    r = data["recovery"]
    assert r["kind"] == "shrink" and r["replaced"] == [[1, 32]] and r["dropped_replicas"] == [1]
    assert r["spares_left"] == [] and r["grid_after"]["size"] == 16
    assert data["rank"]["role"] == "replaces" and data["rank"]["groups"]["tp"]["after"] == [0, 32, *range(2, 8)]


def test_ranks_are_given_as_ranges_as_the_tool_prints_them(capsys):
    # The command: a whole node of a 16,384-rank job, as a range, and the spare node the same way.
    argv = ["--world-size", "16384", "--tp", "8", "--pp", "16", "--fail", "12344-12351", "--spares", "8"]
    status, out, err = _main(capsys, *argv)
    assert status == 0 and not err
    assert "recovery from the loss of ranks 12344-12351: replace" in out
    assert "12344 -> 16384" in out and "12351 -> 16391" in out
    status, listed, _ = _main(capsys, *argv[:-4], "--fail", ",".join(map(str, range(12344, 12352))),
                              "--spare-ranks", "16384-16391")
    assert status == 0 and listed == out
    status, out, _ = _main(capsys, *LAYOUT, "--fail", "4-5,9", "--spare-ranks", "16-17,20", "--json")
    r = json.loads(out)["recovery"]
    assert r["failed"] == [4, 5, 9] and r["spares"] == [16, 17, 20] and r["spares_left"] == []
