"""The command line as a new user types it: each command is one shell line, split as a shell
splits it and run as ``python -m hypergrid ...`` in a subprocess from the repository root (plan
imports no torch: a run costs a few tenths of a second), with the environment it names in front.

Launch lines that carry their own world size (``WORLD_SIZE=N`` in the shell, torchrun's
``--nnodes`` and ``--nproc-per-node``), ranks given as ranges, the size limit of a world, the
uneven pipeline split of a real Llama 3 405B line, and the recovery the spares cover only in part.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def typed(line: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``line`` as a user types it: ``[NAME=value ...] hypergrid ARGS``, run from the repository root."""
    words = shlex.split(line)
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}  # only what the line sets
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "hypergrid", line
    return subprocess.run([sys.executable, "-m", "hypergrid", *words[1:]], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def refused(line: str) -> str:
    """The one error line a refused command prints (exit status 2, nothing on stdout)."""
    proc = typed(line)
    assert proc.returncode == 2 and proc.stdout == "", (line, proc.stdout, proc.stderr)
    (message,) = proc.stderr.splitlines()
    assert message.startswith("hypergrid: error: "), message
    return message[len("hypergrid: error: "):]


def planned(line: str) -> str:
    proc = typed(line)
    assert proc.returncode == 0, (line, proc.stderr)
    return proc.stdout


LLAMA3_405B = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --context-parallel-size 1 "
               "--num-layers 126 --hidden-size 16384 --num-attention-heads 128 --seq-length 8192 "
               "--micro-batch-size 1 --global-batch-size 2048 --bf16")


# ---------------------------------------------------------------------- the world size of a launch line
def test_world_size_in_the_shell_is_what_megatron_lm_reads():
    out = planned(f'WORLD_SIZE=16384 hypergrid plan --megatron-args "{LLAMA3_405B} '
                  f'--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"')
    assert out.splitlines()[0] == "hypergrid plan: 16384 ranks on 2048 nodes of 8 ranks"
    assert "megatron sizes: tp=8 pp=16 cp=1 ep=1 etp=8 -> dp=128, expert dp=128" in out
    assert refused("WORLD_SIZE=lots hypergrid plan --megatron-args '--tensor-model-parallel-size 8'") == (
        "WORLD_SIZE=lots in the environment: expected a positive integer (the number of ranks), or --world-size N")


def test_a_torchrun_launch_line_plans_its_own_world_and_nodes():
    # docs/examples/moe_1024.args starts with torchrun --nnodes 128 --nproc-per-node 8: no other flag needed.
    out = planned("hypergrid plan --megatron-args-file docs/examples/moe_1024.args")
    assert out.splitlines()[0] == "hypergrid plan: 1024 ranks on 128 nodes of 8 ranks"
    assert refused("hypergrid plan --world-size 2048 --megatron-args-file docs/examples/moe_1024.args") == (
        "--world-size 2048 differs from the launch line's torchrun --nnodes 128 --nproc-per-node 8, which starts "
        "1024 ranks; give one world size")
    assert refused("WORLD_SIZE=2048 hypergrid plan --megatron-args-file docs/examples/moe_1024.args").startswith(
        "WORLD_SIZE=2048 in the environment differs from the launch line's torchrun --nnodes 128")
    assert refused("hypergrid plan --gpus-per-node 4 --megatron-args-file docs/examples/moe_1024.args") == (
        "--gpus-per-node 4 differs from the launch line's torchrun --nproc-per-node 8; give one")
    # Either spelling, with "=" or not; torchrun's default of one node.
    out = planned("hypergrid plan --megatron-args 'torchrun --nproc_per_node=4 --nnodes=2 pretrain_gpt.py "
                  "--tensor-model-parallel-size 4'")
    assert out.splitlines()[0] == "hypergrid plan: 8 ranks on 2 nodes of 4 ranks"
    out = planned("hypergrid plan --megatron-args 'torchrun --nproc-per-node 8 pretrain_gpt.py --bf16'")
    assert out.splitlines()[0] == "hypergrid plan: 8 ranks on 1 node of 8 ranks"
    # Sizes the line does not fix (an elastic range, a shell variable): the world must come from elsewhere.
    for launcher in ("torchrun --nnodes 1:4 --nproc-per-node 8", "torchrun $DISTRIBUTED_ARGS"):
        message = refused(f"hypergrid plan --megatron-args '{launcher} pretrain_gpt.py --bf16'")
        assert "needs --world-size N" in message and "torchrun --nnodes N --nproc-per-node M" in message
    out = planned("hypergrid plan -n 64 --megatron-args 'torchrun --nnodes 1:4 --nproc-per-node 8 pretrain_gpt.py'")
    assert out.splitlines()[0] == "hypergrid plan: 64 ranks on 8 nodes of 8 ranks"


def test_a_real_405b_line_is_told_which_flags_make_uneven_stages_legal():
    message = refused(f"hypergrid plan --world-size 16384 --megatron-args '{LLAMA3_405B}'")
    assert message == (
        "--num-layers (126) is not divisible by --pipeline-model-parallel-size (16); Megatron-LM splits layers "
        "unevenly with --decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers (e.g. 7 and 7: "
        "the 14 other stages take 8 layers each), with --account-for-embedding-in-pipeline-split "
        "--account-for-loss-in-pipeline-split (counting the embedding and the loss as layers: 126 + 2 = 128 = "
        "16 x 8), or with --pipeline-model-parallel-layout")
    # Each way out is taken, as Megatron-LM takes it; the groups do not depend on how layers are split.
    for extra in ("--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7",
                  "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"):
        assert "tp=8 pp=16" in planned(f"hypergrid plan --world-size 16384 --megatron-args '{LLAMA3_405B} {extra}'")
    # Uneven stages that leave the other stages uneven are refused as Megatron-Core refuses them.
    assert refused(f"hypergrid plan --world-size 16384 --megatron-args '{LLAMA3_405B} "
                   f"--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 7'") == (
        "--decoder-first-pipeline-num-layers: --num-layers 126 leaves 113 layers for the 14 other pipeline stages "
        "(--pipeline-model-parallel-size 16); Megatron-Core needs them to divide evenly")


# ---------------------------------------------------------------------- ranks and sizes
def test_failed_ranks_are_given_as_ranges_as_the_tool_prints_them():
    out = planned("hypergrid plan --world-size 16384 --tp 8 --pp 16 --fail 12344-12351 --spares 8")
    assert "recovery from the loss of ranks 12344-12351: replace" in out
    assert "12344 -> 16384" in out and "spares left: none" in out
    assert refused("hypergrid plan --world-size 16 --tp 2 --fail 9-4") == (
        "argument --fail: expected a range from a lower rank to a higher one, got '9-4' in '9-4'; write 4-9 "
        "(see: hypergrid plan --help)")


@pytest.mark.parametrize("size", ["99999999999999999999999", str(1 << 70), str(1 << 63)])
def test_a_world_too_large_is_refused_for_its_size_before_its_divisibility(size):
    assert refused(f"hypergrid plan --world-size {size} --tp 8") == (
        f"argument --world-size/-n: world size {size} is too large: plans answer for worlds up to "
        f"9223372036854775807 ranks (int64) (see: hypergrid plan --help)")


# ---------------------------------------------------------------------- recovery
def test_spares_that_cover_part_of_a_loss_are_used():
    out = planned("hypergrid plan --world-size 32 --tp 8 --pp 2 --fail 1,9 --spares 1")
    assert "recovery from the loss of ranks 1, 9: shrink" in out
    assert "too few spares (1 for 2 failed): replica 1 of dp dropped (dp 2 -> 1)" in out
    assert "in the replicas kept, a spare takes each failed rank's position: 1 -> 32" in out
    assert re.search(r"^grid after: tp=8 x cp=1 x dp=1 x pp=2 on ranks 0, 32, 2-7, 16-23 \(16 ranks\)$", out, re.M)
    data = json.loads(planned("hypergrid plan --world-size 32 --tp 8 --pp 2 --fail 1,9 --spares 1 --json"))
    assert data["recovery"]["replaced"] == [[1, 32]] and data["recovery"]["dropped_replicas"] == [1]


# ---------------------------------------------------------------------- what the tool says back
@pytest.mark.parametrize("line, words", [
    ("hypergrid plan --world-szie 2048 --tp 8", "unrecognized arguments: --world-szie 2048; did you mean --world-size? "
                                                "(see: hypergrid plan --help)"),
    ("hypergrid check --world-size 8 --gropus 4", "did you mean --groups?"),
    ("hypergrid --verbsoe plan -n 8", "did you mean --verbose?"),
    ("hypergrid plan -n 64 --tensor-model-parallel-size 8",
     '--tensor-model-parallel-size is a Megatron-LM flag: give the launch line\'s flags as --megatron-args '
     '"--tensor-model-parallel-size ..."'),
    ("hypergrid plan -n 64 --module llama3 --config llama3_70b", "--module is torchtitan's: give its job's "
                                                                 "[parallelism] as --torchtitan FILE"),
    ("hypergrid plan -n 64 --tp 8 --kind tp,dp_pc", "unknown group kind 'dp_pc'; did you mean 'dp_cp'?"),
])
def test_a_misspelt_flag_or_kind_gets_the_closest_one(line, words):
    assert words in refused(line)


def test_kind_without_a_picture_shows_those_kinds_in_the_table():
    out = planned("hypergrid plan --world-size 2048 --tp 1 --pp 16 --ep 64 --etp 1 --rank 1000 --kind tp,dp "
                  "--megatron-core-version 0.16")  # 17 kinds (0.19 makes 20)
    table = out[out.index("kind "):out.index("kinds shown")].splitlines()[2:]
    assert [row.split()[0] for row in table] == ["dp", "tp"]  # in the plan's order
    assert "kinds shown: tp, dp (--kind; 17 kinds in the plan)" in out
    groups = [line.split()[0] for line in out[out.index("rank 1000: node"):].splitlines()[3:]]
    assert groups == ["dp", "tp"]
    data = json.loads(planned("hypergrid plan --world-size 2048 --tp 1 --pp 16 --ep 64 --etp 1 --kind tp,dp --json "
                              "--megatron-core-version 0.16"))
    assert [k["name"] for k in data["kinds"]] == ["dp", "tp"] and data["kinds_shown"] == {"given": ["tp", "dp"], "of": 17}
    csv_rows = planned("hypergrid plan --world-size 2048 --tp 1 --pp 16 --ep 64 --etp 1 --kind tp --csv").splitlines()
    assert [row.split(",")[0] for row in csv_rows] == ["kind", "tp"]


def test_a_rank_s_group_shows_its_whole_runs_as_the_json_lists_them():
    out = planned("hypergrid plan --world-size 2048 --tp 1 --pp 16 --ep 64 --etp 1 --rank 1000")
    (row,) = [line for line in out[out.index("rank 1000: node"):].splitlines() if line.split()[:1] == ["tp_ep_pp"]]
    assert row.split(None, 1)[1] == ("64-127, 192-255, 320-383, 448-511, 576-639, 704-767, 832-895, ..., 1984-2047 "
                                     "(1024 ranks)")
    data = json.loads(planned("hypergrid plan --world-size 2048 --tp 1 --pp 16 --ep 64 --etp 1 --rank 1000 --json"))
    assert data["rank"]["groups"]["tp_ep_pp"][:65] == [*range(64, 128), 192]


# ---------------------------------------------------------------------- torchtitan
def test_torchtitan_s_own_parallelism_flags_plan_without_a_toml_file():
    flags = "--parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 4"
    from_flags = json.loads(planned(f"hypergrid plan -n 256 {flags} --torchtitan-version 0.3 --rank 5 --json"))
    from_file = json.loads(planned("hypergrid plan -n 256 --torchtitan docs/examples/llama3_70b_0_3.toml "
                                   "--torchtitan-version 0.3 --rank 5 --json"))
    assert from_flags == from_file and from_flags["grid"]["shape"] == [8, 1, 8, 1, 4]
    # Over a job config, as torchtitan's command line sets them: hyphens or underscores, "=" or not.
    over = json.loads(planned("hypergrid plan -n 256 --torchtitan docs/examples/llama3_70b_0_3.toml "
                              "--torchtitan-version 0.3 --parallelism.pipeline-parallel-degree=8 --json"))
    assert over["grid"]["shape"] == [8, 1, 4, 1, 8]
    assert "did you mean --parallelism.tensor_parallel_degree?" in refused(
        "hypergrid plan -n 64 --torchtitan-version 0.3 --parallelism.tensor_paralel_degree 8")
    assert refused("hypergrid plan -n 64 --parallelism.tensor_parallel_degree eight") == (
        "--parallelism.tensor_parallel_degree expects an integer, got eight")
    assert refused("hypergrid plan --parallelism.tensor_parallel_degree 8").startswith("--parallelism.* needs --world-size")
    # The world from the shell, as torchtitan's launcher gives it.
    out = planned(f"WORLD_SIZE=256 hypergrid plan {flags} --torchtitan-version 0.3")
    assert out.splitlines()[0] == "hypergrid plan: 256 ranks on 32 nodes of 8 ranks"


def test_a_misspelt_toml_key_is_told_the_closest_field(tmp_path):
    job = tmp_path / "tt.toml"
    job.write_text("[parallelism]\ntensor_paralell_degree = 8\n")
    message = refused(f"hypergrid plan -n 64 --torchtitan {job} --torchtitan-version 0.3")
    assert message.startswith(f"{job}: parallelism.tensor_paralell_degree is not a field of torchtitan 0.3's "
                              f"parallelism config") and "did you mean parallelism.tensor_parallel_degree?" in message


def test_a_torchtitan_table_has_no_megatron_column():
    out = planned("hypergrid plan -n 256 --torchtitan docs/examples/llama3_70b_0_3.toml --torchtitan-version 0.3")
    header = next(line for line in out.splitlines() if line.startswith("kind "))
    assert header.split() == ["kind", "key", "groups", "size", "nodes/group", "domains/group", "placement"]
    assert "megatron group" in planned("hypergrid plan -n 16 --tp 2")


def test_a_shrink_of_dp_warns_that_the_global_batch_size_no_longer_divides():
    out = planned("hypergrid plan --world-size 1024 --tp 8 --fail 5")
    assert ("warning: dp 128 -> 127: a global batch size must be divisible by the micro-batch size x dp "
            "(Megatron-Core asserts it)") in out
    line = "--tensor-model-parallel-size 8 --global-batch-size 1024 --micro-batch-size 1"
    out = planned(f"hypergrid plan --world-size 1024 --megatron-args '{line}' --fail 5")
    assert ("warning: dp 128 -> 127: --global-batch-size 1024 is not divisible by --micro-batch-size 1 x dp 127 = "
            "127, which Megatron-Core asserts: give spares to keep dp (--spares), or a global batch size divisible "
            "by 127") in out
    data = json.loads(planned(f"hypergrid plan --world-size 1024 --megatron-args '{line}' --fail 5 --json"))
    assert data["recovery"]["warnings"] and data["recovery"]["warnings"][0].startswith("dp 128 -> 127: ")
    # A batch that divides both, a replacement, or a launch line Megatron-LM would refuse already.
    fits = "--tensor-model-parallel-size 8 --global-batch-size 16256 --micro-batch-size 1"
    assert "warning:" not in planned(f"hypergrid plan --world-size 1024 --megatron-args '{fits}' --fail 5")
    assert "warning:" not in planned(f"hypergrid plan --world-size 1024 --megatron-args '{line}' --fail 5 --spares 1")
    assert refused("hypergrid plan --world-size 1024 --megatron-args '--tensor-model-parallel-size 8 "
                   "--global-batch-size 1000'") == (
        "--global-batch-size (1000) is not divisible by --micro-batch-size (1) x the data-parallel size (128) = 128, "
        "which Megatron-Core's microbatch calculator asserts")
