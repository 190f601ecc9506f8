"""A plan from a Megatron-LM launch line: the same Plan as plan_megatron for the same sizes, and
every bad input refused with the flag named (library) or one line and exit status 2 (CLI)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hypergrid.app import cli
from hypergrid.planning.megatron_args import (
    MegatronArgsError,
    MegatronLaunch,
    UnknownMegatronFlagError,
    parse_megatron_args,
    plan_from_megatron_args,
)
from hypergrid.planning.megatron_flags import MEGATRON_LM_FLAGS
from hypergrid.planning.plan import plan_megatron

# A 1,024-GPU MoE pretraining line as a launch script holds it: the parallel flags among many others.
MOE_LINE = """
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 --context-parallel-size 2
    --expert-model-parallel-size 16 --expert-tensor-parallel-size 1
    --num-layers 62 --num-layers-per-virtual-pipeline-stage 2 --account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split --hidden-size 7168 --ffn-hidden-size 18432
    --num-attention-heads 128 --group-query-attention --num-query-groups 8 --seq-length 8192
    --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 2048 --lr 3e-4
    --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --adam-beta1 0.9 --adam-beta2 0.95
    --adam-eps 1e-8 --weight-decay 0.1 --clip-grad 1.0 --bf16 --use-distributed-optimizer
    --overlap-grad-reduce --overlap-param-gather --sequence-parallel --num-experts 128
    --moe-router-topk 8 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --moe-aux-loss-coeff 1e-3 --data-path 0.5 /data/a_text_document 0.5 /data/b_text_document
    --split 99,1,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model /models/tok
    --save /ckpt --load /ckpt --save-interval 1000 --eval-interval 1000 --eval-iters 10
    --log-interval 10 --distributed-timeout-minutes 60 --seed 1234
"""
SIZES = dict(tp=4, pp=8, cp=2, ep=16, etp=1)


def _same_plan(got, want, ranks=(0, 1, 517, 1023)):
    assert got.world_size == want.world_size
    assert got.megatron == want.megatron
    assert got.layout == want.layout and got.views == want.views and got.shared_dims == want.shared_dims
    assert [(k.name, k.count, k.size) for k in got.kinds] == [(k.name, k.count, k.size) for k in want.kinds]
    for name in ("tp", "pp", "cp", "dp", "ep", "expt_dp", "embd"):
        assert got.kind(name).enumerate() == want.kind(name).enumerate(), name
    for rank in ranks:
        assert got.groups_of(rank) == want.groups_of(rank)


def test_a_moe_launch_line_gives_the_plan_of_its_sizes():
    launch = parse_megatron_args(MOE_LINE)
    # (62 layers + embedding + loss) / pp 8 = 8 layers a stage, 2 a virtual stage: vpp 4.
    assert launch.virtual_pipeline_model_parallel_size == 4
    assert (launch.tensor_model_parallel_size, launch.pipeline_model_parallel_size, launch.context_parallel_size,
            launch.expert_model_parallel_size, launch.expert_tensor_parallel_size) == (4, 8, 2, 16, 1)
    assert launch.order == "tp-cp-ep-dp-pp" and launch.world_size is None
    assert {"hidden-size", "lr", "data-path", "bf16", "moe-router-topk"} <= set(launch.ignored)
    assert "num-layers" not in launch.ignored  # read: it sets the interleaving
    plan = plan_from_megatron_args(launch, world_size=1024)
    want = plan_megatron(1024, **SIZES, virtual_pipeline_model_parallel_size=4)
    _same_plan(plan, want)
    assert plan.megatron.dp == 16 and plan.megatron.edp == 8
    # The text goes straight in too, and an argv list is the same line.
    _same_plan(plan_from_megatron_args(MOE_LINE, world_size=1024), want)
    assert parse_megatron_args(MOE_LINE.split()) == launch


def test_defaults_and_options_are_megatron_lms():
    assert parse_megatron_args("") == MegatronLaunch()
    assert MegatronLaunch().megatron_kwargs() == dict(tp=1, pp=1, cp=1, ep=1, etp=None, order="tp-cp-ep-dp-pp")
    mapped = parse_megatron_args("--tensor-model-parallel-size=2 --pipeline-model-parallel-size=2 --use-tp-pp-dp-mapping")
    _same_plan(plan_from_megatron_args(mapped, 16), plan_megatron(16, tp=2, pp=2, order="tp-cp-ep-pp-dp"), (0, 5, 15))
    rich = parse_megatron_args(
        "--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2 --num-distributed-optimizer-instances 2 "
        "--use-sharp --sharp-enabled-group dp_replica --pipeline-model-parallel-size 2 "
        "--num-virtual-stages-per-pipeline-rank 3"
    )
    want = plan_megatron(64, cp=4, pp=2, hierarchical_context_parallel_sizes=[2, 2], num_distributed_optimizer_instances=2,
                         use_sharp=True, sharp_enabled_group="dp_replica", virtual_pipeline_model_parallel_size=3)
    _same_plan(plan_from_megatron_args(rich, 64), want, (0, 33, 63))
    assert "hcp_0" in [k.name for k in want.kinds]
    # A pipeline layout's stages give the interleaving: 1 + 6 + 1 = 8 stages over pp 4.
    assert parse_megatron_args(
        ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "Et|(tt|)*6,L"]
    ).virtual_pipeline_model_parallel_size == 2


def test_launcher_and_world_size_assignment_are_read_around_the_flags():
    line = "WORLD_SIZE=64 OMP_NUM_THREADS=1 torchrun --nproc-per-node 8 --nnodes 8 pretrain_gpt.py --tensor-model-parallel-size 8"
    launch = parse_megatron_args(line)
    assert launch.world_size == 64 and launch.tensor_model_parallel_size == 8
    assert plan_from_megatron_args(launch).world_size == 64
    with pytest.raises(MegatronArgsError, match="differs from WORLD_SIZE=64"):
        plan_from_megatron_args(launch, world_size=128)
    with pytest.raises(MegatronArgsError, match="world size is needed"):
        plan_from_megatron_args("--tensor-model-parallel-size 8")


def test_the_file_form_lines_continuations_comments(tmp_path):
    script = tmp_path / "train_moe.args"
    script.write_text(
        "# parallelism\n"
        "--tensor-model-parallel-size 4 \\\n"
        "  --pipeline-model-parallel-size 8   # eight stages\n"
        "--context-parallel-size 2 --expert-model-parallel-size 16 --expert-tensor-parallel-size 1\n"
        "\n"
        "--num-layers 62 --num-layers-per-virtual-pipeline-stage 2 \\\n"
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split\n"
        "--lr 3e-4 --adam-eps -1e-8  # a negative value is a value\n"
    )
    launch = parse_megatron_args(script.read_text())
    # The same parallelism as MOE_LINE, which also gives a batch (read: it is checked against dp).
    assert replace(launch, ignored=()) == replace(parse_megatron_args(MOE_LINE), ignored=(), global_batch_size=None,
                                                  micro_batch_size=None)
    assert launch.virtual_pipeline_model_parallel_size == 4 and launch.ignored == ("lr", "adam-eps")
    want = plan_megatron(1024, **SIZES, virtual_pipeline_model_parallel_size=4)
    _same_plan(plan_from_megatron_args(launch, 1024), want)
    # The command line reads the file and prints the same plan as the sizes do.
    assert cli.main(["plan", "--world-size", "1024", "--megatron-args-file", str(script), "--format", "csv"]) == 0


def test_the_flag_list_is_megatron_lms():
    for name in ("tensor-model-parallel-size", "num-layers-per-virtual-pipeline-stage", "use-tp-pp-dp-mapping",
                 "hierarchical-context-parallel-sizes", "sharp-enabled-group", "hidden-size", "lr", "bf16"):
        assert name in MEGATRON_LM_FLAGS
    for name in ("world-size", "tp", "virtual-pipeline-model-parallel-size", "tensor-parallel-size"):
        assert name not in MEGATRON_LM_FLAGS
    assert len(MEGATRON_LM_FLAGS) > 800


@pytest.mark.parametrize(
    "line, flag, words",
    [
        ("--tensor-parallel-size 8", "--tensor-parallel-size", "did you mean --tensor-model-parallel-size"),
        ("--hidden-size 4096 --frobnicate", "--frobnicate", "not a Megatron-LM flag"),
        ("--world-size 1024", "--world-size", "WORLD_SIZE"),
        ("--virtual-pipeline-model-parallel-size 2", "--virtual-pipeline-model-parallel-size", "not a Megatron-LM flag"),
    ],
)
def test_an_unknown_flag_is_refused_by_name(line, flag, words):
    with pytest.raises(UnknownMegatronFlagError, match=words) as info:
        parse_megatron_args(line)
    assert info.value.flag == flag and flag in str(info.value)


@pytest.mark.parametrize(
    "line, flag, words",
    [
        ("--tensor-model-parallel-size 8.0", "--tensor-model-parallel-size", "expects an integer, got '8.0'"),
        ("--pipeline-model-parallel-size", "--pipeline-model-parallel-size", "expects one value, got none"),
        ("--context-parallel-size 2 4", "--context-parallel-size", "expects one value"),
        ("--expert-model-parallel-size 0", "--expert-model-parallel-size", ">= 1, got 0"),
        ("--hierarchical-context-parallel-sizes 2 x", "--hierarchical-context-parallel-sizes", "got 'x'"),
        ("--use-sharp yes", "--use-sharp", "takes no value"),
        ("--sharp-enabled-group tp", "--sharp-enabled-group", "one of ['dp', 'dp_replica']"),
        ("--tensor-model-parallel-size 8 --tensor-model-parallel-size 4", "--tensor-model-parallel-size", "twice"),
        ("--model-parallel-size 8", "--model-parallel-size", "no longer valid"),
        ("--num-layers-per-virtual-pipeline-stage 2 --pipeline-model-parallel-size 4",
         "--num-layers-per-virtual-pipeline-stage", "needs --num-layers"),
        ("--num-layers 32 --num-layers-per-virtual-pipeline-stage 3 --pipeline-model-parallel-size 4",
         "--num-layers-per-virtual-pipeline-stage", "does not divide the 8 layers"),
        ("--num-virtual-stages-per-pipeline-rank 2", "--num-virtual-stages-per-pipeline-rank",
         "--pipeline-model-parallel-size >= 2"),
        ("--num-virtual-stages-per-pipeline-rank 2 --pipeline-model-parallel-size 2 --no-overlap-p2p-communication",
         "--num-virtual-stages-per-pipeline-rank", ">= 3 with --no-overlap-p2p-communication"),
        ("--num-virtual-stages-per-pipeline-rank 2 --num-layers-per-virtual-pipeline-stage 2",
         "--num-virtual-stages-per-pipeline-rank", "exclusive"),
        ("--num-layers 30 --pipeline-model-parallel-size 4", "--num-layers", "not divisible"),
        ("--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout Et|tt|L",
         "--pipeline-model-parallel-layout", "3 stages"),
        ("--pipeline-model-parallel-layout Ex|L", "--pipeline-model-parallel-layout", "characters ['x']"),
        ("bf16", None, "unexpected 'bf16'"),
        ("--tensor-model-parallel-size '8", None, "No closing quotation"),
    ],
)
def test_a_malformed_line_is_refused_naming_the_flag(line, flag, words):
    with pytest.raises(MegatronArgsError) as info:
        parse_megatron_args(line)
    assert words in str(info.value) and info.value.flag == flag
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "line, flag",
    [
        ("--tensor-model-parallel-size 3", "--tensor-model-parallel-size"),
        ("--tensor-model-parallel-size 2 --context-parallel-size 3", "--context-parallel-size"),
        ("--expert-model-parallel-size 48 --expert-tensor-parallel-size 1", "--expert-model-parallel-size"),
        ("--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 3", "--hierarchical-context-parallel-sizes"),
        ("--sharp-enabled-group dp", "--sharp-enabled-group"),
        ("--num-distributed-optimizer-instances 3", "--num-distributed-optimizer-instances"),
    ],
)
def test_sizes_that_do_not_fit_the_world_name_the_flag(line, flag):
    with pytest.raises(MegatronArgsError) as info:
        plan_from_megatron_args(line, world_size=1024)
    assert info.value.flag == flag and flag in str(info.value)
    assert "_size" not in str(info.value)  # Megatron-Core's keywords are put in Megatron-LM's words


def test_the_cli_prints_the_plan_of_the_sizes(capsys):
    assert cli.main(["plan", "--world-size", "1024", "--megatron-args", MOE_LINE, "--format", "json", "--rank", "1000"]) == 0
    from_line = capsys.readouterr().out
    assert cli.main(["plan", "--world-size", "1024", "--tp", "4", "--pp", "8", "--cp", "2", "--ep", "16", "--etp", "1",
                     "--format", "json", "--rank", "1000"]) == 0
    assert from_line == capsys.readouterr().out
    # One flag alone goes with "=", so that argparse does not take it for an option of ours.
    assert cli.main(["plan", "--world-size", "16", "--megatron-args=--use-tp-pp-dp-mapping", "--format", "csv"]) == 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--megatron-args", "--tensor-parallel-size 8"], "--tensor-parallel-size is not a Megatron-LM flag"),
        (["--megatron-args", "--tensor-model-parallel-size 3"], "--tensor-model-parallel-size (3)"),
        (["--megatron-args", "--tensor-model-parallel-size eight x"], "--tensor-model-parallel-size expects"),
        (["--megatron-args", "--context-parallel-size 2", "--tp", "2"], "two ways to give a layout"),
        (["--megatron-args", "--context-parallel-size 2", "--shape", "2,2", "--dims", "tp,dp"], "two ways"),
        (["--megatron-args", "--context-parallel-size 2", "--megatron-args-file", "x"], "two ways"),
        (["--megatron-args-file", "/nonexistent/train.args"], "cannot read it"),
        (["--megatron-args", "--use-sharp"], "expected one argument"),
    ],
)
def test_the_cli_refuses_bad_input_in_one_line(capsys, argv, words):
    assert cli.main(["plan", "--world-size", "1024", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hypergrid: error: ") and words in err, err
    assert "Traceback" not in err


def test_the_cli_needs_a_world_size(capsys):
    assert cli.main(["plan", "--megatron-args", "--tensor-model-parallel-size 8 --lr 1e-4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hypergrid: error: ") and "--world-size" in err and err.count("\n") == 1
    # ...unless the launch line sets WORLD_SIZE, as a launcher's environment would.
    assert cli.main(["plan", "--megatron-args", "WORLD_SIZE=16 x.py --tensor-model-parallel-size 8", "--format", "csv"]) == 0
    # check takes the same layout flags.
    assert cli.main(["check", "--megatron-args", "--tensor-model-parallel-size 3", "--world-size", "8"]) == 2
    assert "--tensor-model-parallel-size (3)" in capsys.readouterr().err
