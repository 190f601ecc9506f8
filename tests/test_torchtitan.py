"""torchtitan job configs: their [parallelism] read and validated, their meshes planned as kinds,
the CLI's --torchtitan, and (when torchtitan 0.2 is installed) the plan against torchtitan's own
ParallelDims on torch's fake backend."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from hypergrid import cli
from hypergrid.torchtitan import (
    TorchtitanParallelism,
    plan_torchtitan,
    read_parallelism,
    shared_groups_per_rank,
    torchtitan_groups_per_rank,
    torchtitan_mesh,
)

# Modelled on torchtitan's llama3 70B training config (job, model, training sections kept, the
# layout spread over all five dense dims).
LLAMA3_70B = """\
[job]
dump_folder = "./outputs"
description = "Llama 3 70B training"

[profiling]
enable_profiling = true
profile_freq = 100

[model]
name = "llama3"
flavor = "70B"
tokenizer_path = "./assets/tokenizer/Llama-3.1-8B"

[optimizer]
name = "AdamW"
lr = 1.5e-4

[training]
local_batch_size = 8
seq_len = 8192
max_norm = 1.0
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 2
context_parallel_degree = 2
pipeline_parallel_degree = 2
pipeline_parallel_schedule = "Interleaved1F1B"

[checkpoint]
enable_checkpoint = false

[activation_checkpoint]
mode = "full"
"""

LLAMA3_8B = """\
[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 1
seq_len = 8192

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
pipeline_parallel_degree = 1
context_parallel_degree = 1
"""


@pytest.fixture
def job(tmp_path):
    def write(text: str, name: str = "job.toml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


# ---------------------------------------------------------------------------- reading
def test_defaults_are_torchtitans():
    p = read_parallelism("[job]\ndump_folder = 'x'\n")  # no [parallelism]: every default
    assert p == TorchtitanParallelism()
    assert p.degrees() == {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "cp": 1, "pp": 1, "ep": 1, "etp": 1}
    assert read_parallelism("[model]\nname = 'llama3'\n", world_size=8).data_parallel_shard_degree == 8


def test_auto_fill_takes_what_the_other_degrees_leave(job):
    p = read_parallelism(job(LLAMA3_70B), world_size=32)  # a Path
    assert p.data_parallel_shard_degree == 2 and p.world_size == 32
    assert read_parallelism(str(job(LLAMA3_8B)), world_size=64).data_parallel_shard_degree == 8  # a str path
    explicit = read_parallelism(LLAMA3_8B.replace("shard_degree = -1", "shard_degree = 8"), world_size=64)
    assert explicit.data_parallel_shard_degree == 8


@pytest.mark.parametrize("section,world,needle", [
    ("tensor_parallel_degree = 3", 8, "parallelism degrees do not fill the world: data_parallel_replicate_degree (1) "
     "x data_parallel_shard_degree (2, from -1) x context_parallel_degree (1) x tensor_parallel_degree (3)"),
    ("data_parallel_shard_degree = 2\ntensor_parallel_degree = 2", 8, "data_parallel_shard_degree (2) x"),
    ("tensor_parallel_degree = 16", 8, "data_parallel_shard_degree = -1 leaves no rank"),
    ("tensor_parallel_degree = 4\nexpert_parallel_degree = 2\nexpert_tensor_parallel_degree = 2", 16,
     "expert_tensor_parallel_degree must be tensor_parallel_degree (4) or 1"),
    ("expert_parallel_degree = 3", 8, "expert_parallel_degree (3) must be a multiple of context_parallel_degree (1) "
     "and divide data_parallel_shard_degree x context_parallel_degree (8)"),
    ("tensor_parallel_degree = 2\nexpert_parallel_degree = 3\nexpert_tensor_parallel_degree = 1", 12,
     "multiple of context_parallel_degree x tensor_parallel_degree (2)"),
    ("tensor_parallel_degree = 0", 8, "parallelism.tensor_parallel_degree must be an integer >= 1, got 0"),
    ("data_parallel_shard_degree = -2", 8, "parallelism.data_parallel_shard_degree must be -1 (fill the world) or >= 1"),
    ('pipeline_parallel_degree = "2"', 8, "parallelism.pipeline_parallel_degree must be an integer, got str '2'"),
    ("context_parallel_degree = true", 8, "parallelism.context_parallel_degree must be an integer, got bool"),
])
def test_validation_names_the_field(section, world, needle):
    with pytest.raises(ValueError) as info:
        read_parallelism(f"[parallelism]\n{section}\n", world_size=world)
    assert needle in str(info.value)


def test_ep_checks_follow_parallel_dims():
    # etp is not looked at without ep (torchtitan checks it only when ep > 1).
    assert TorchtitanParallelism(tensor_parallel_degree=4, expert_tensor_parallel_degree=2).resolved(8).world_size == 8
    # ep may take all of dp_shard x cp (x tp with etp 1), not more.
    TorchtitanParallelism(context_parallel_degree=2, expert_parallel_degree=8).resolved(8)
    with pytest.raises(ValueError, match="expert_parallel_degree \\(16\\)"):
        TorchtitanParallelism(context_parallel_degree=2, expert_parallel_degree=16).resolved(8)


def test_malformed_toml_names_the_file_and_line(job):
    path = job(LLAMA3_8B.replace("tensor_parallel_degree = 8", "tensor_parallel_degree 8"), "bad.toml")
    with pytest.raises(ValueError) as info:
        read_parallelism(path)
    assert str(info.value).startswith(f"{path}: malformed TOML:") and "line 16" in str(info.value)
    with pytest.raises(ValueError, match=r"malformed TOML: .*line 2, the last"):
        read_parallelism("[parallelism]\ntensor_parallel_degree = [1,")


def test_unreadable_and_odd_inputs(job, tmp_path):
    with pytest.raises(ValueError, match="missing.toml: cannot read the torchtitan job config"):
        read_parallelism(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match=r"\[parallelism\] must be a table, got int 3"):
        read_parallelism("parallelism = 3")
    with pytest.raises(TypeError, match="expected a path or TOML text"):
        read_parallelism(8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world size is needed"):
        plan_torchtitan(TorchtitanParallelism())


# ---------------------------------------------------------------------------- planning
def test_llama3_70b_layout_by_hand(job):
    # world 32: pp=2, dp_replicate=2, dp_shard=-1 -> 2, cp=2, tp=2. hypergrid's dims run fastest
    # first: tp stride 1, cp 2, dp_shard 4, dp_replicate 8, pp 16. Rank 13 = tp 1, dp_shard 1, dp_replicate 1.
    plan = plan_torchtitan(job(LLAMA3_70B), 32)
    assert plan.layout.dim_names == ("tp", "cp", "dp_shard", "dp_replicate", "pp")
    assert plan.layout.shape == (2, 2, 2, 2, 2) and plan.world_size == 32
    assert [k.name for k in plan.kinds] == ["pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"]
    assert plan.coords(13) == {"tp": 1, "cp": 0, "dp_shard": 1, "dp_replicate": 1, "pp": 0}
    assert plan.groups_of(13) == {
        "pp": [13, 29],
        "dp_replicate": [5, 13],
        "dp_shard": [9, 13],
        "cp": [13, 15],
        "tp": [12, 13],
        "dp": [1, 5, 9, 13],
        "dp_shard_cp": [9, 11, 13, 15],
        "dp_cp": [1, 3, 5, 7, 9, 11, 13, 15],
    }
    assert plan.groups_of(30)["dp_cp"] == [16, 18, 20, 22, 24, 26, 28, 30]
    assert plan.views == {} and plan.megatron is None
    # Every dim and flattened dim is a group of its own to DeviceMesh; hypergrid shares none here.
    assert torchtitan_groups_per_rank(job(LLAMA3_70B), 32) == 8 == shared_groups_per_rank(plan)


def test_llama3_8b_only_enabled_dims_are_mesh_dims(job):
    plan = plan_torchtitan(job(LLAMA3_8B), 64)
    assert torchtitan_mesh(read_parallelism(LLAMA3_8B, 64)).mesh_dim_names == ("dp_shard", "tp")
    assert plan.layout.dim_names == ("tp", "dp_shard") and plan.layout.shape == (8, 8)
    groups = plan.groups_of(9)
    assert groups["tp"] == list(range(8, 16))
    assert groups["dp_shard"] == groups["dp"] == groups["dp_shard_cp"] == groups["dp_cp"] == [1, 9, 17, 25, 33, 41, 49, 57]
    # torchtitan makes five groups with two member sets; hypergrid makes the two.
    assert torchtitan_groups_per_rank(LLAMA3_8B, 64) == 5 and shared_groups_per_rank(plan) == 2
    assert plan.summary("tp", gpus_per_node=8).crosses_nodes is False


def test_moe_etp_1_borrows_tp_and_part_of_dp_shard():
    # world 16, tp=2, ep=4, etp=1: dp_shard 8 = dp_shard_mod_ep 4 x dp_shard_in_ep 2, and ep = dp_shard_in_ep x tp.
    plan = plan_torchtitan("[parallelism]\ntensor_parallel_degree = 2\nexpert_parallel_degree = 4\n"
                           "expert_tensor_parallel_degree = 1\n", 16)
    assert plan.layout.dim_names == ("tp", "dp_shard_in_ep", "dp_shard_mod_ep") and plan.layout.shape == (2, 2, 4)
    assert [k.name for k in plan.kinds] == ["dp_shard_mod_ep", "dp_shard_in_ep", "tp", "dp", "dp_shard_cp", "dp_cp", "ep"]
    groups = plan.groups_of(6)  # tp 0, dp_shard_in_ep 1, dp_shard_mod_ep 1
    assert groups["ep"] == [4, 5, 6, 7]
    assert groups["dp_shard_mod_ep"] == [2, 6, 10, 14] and groups["dp_shard_in_ep"] == [4, 6] and groups["tp"] == [6, 7]
    assert groups["dp"] == groups["dp_shard_cp"] == groups["dp_cp"] == [0, 2, 4, 6, 8, 10, 12, 14]


def test_moe_etp_tp_keeps_dp_shard_mod_ep_of_one():
    # world 16, tp=2, cp=2, ep=2, etp=tp: ep takes cp only; dp_shard 4 = mod_ep 4 x in_ep 1 (left out).
    p = TorchtitanParallelism(tensor_parallel_degree=2, context_parallel_degree=2, expert_parallel_degree=2,
                              expert_tensor_parallel_degree=2).resolved(16)
    mesh = torchtitan_mesh(p)
    assert mesh.mesh_dim_names == ("dp_shard_mod_ep", "cp", "tp") and mesh.shape == (4, 2, 2)
    plan = plan_torchtitan(p)
    assert plan.groups_of(5)["ep"] == plan.groups_of(5)["cp"] == [5, 7]
    # ep = 8 and cp = 2 over dp_shard 4: ep takes all of dp_shard, and dp_shard_mod_ep stays, of size 1.
    full = torchtitan_mesh(TorchtitanParallelism(context_parallel_degree=2, expert_parallel_degree=8).resolved(8))
    assert full.mesh_dim_names == ("dp_shard_mod_ep", "dp_shard_in_ep", "cp") and full.shape == (1, 4, 2)


def test_a_single_rank_world_still_has_a_dim():
    plan = plan_torchtitan("[parallelism]\n", 1)
    assert plan.layout.dim_names == ("dp_shard",) and plan.groups_of(0)["dp_shard"] == [0]
    assert torchtitan_groups_per_rank("[parallelism]\n", 1) == 0  # one group spanning the world: the default one


# ---------------------------------------------------------------------------- the command line
def test_cli_plans_a_job_config(job, capsys):
    assert cli.main(["plan", "--torchtitan", str(job(LLAMA3_70B)), "--world-size", "32", "--rank", "13"]) == 0
    out = capsys.readouterr().out
    assert "grid:   tp=2 x cp=2 x dp_shard=2 x dp_replicate=2 x pp=2" in out
    assert "  dp_cp         1, 3, 5, 7, 9, 11, 13, 15\n" in out


@pytest.mark.parametrize("args,needle", [
    (["--world-size", "30"], "parallelism degrees do not fill the world"),
    ([], "--torchtitan needs --world-size"),
    (["--world-size", "32", "--tp", "2"], "--torchtitan and --tp are two ways to give a layout"),
    (["--world-size", "32", "--shape", "32", "--dims", "dp"], "--torchtitan and --shape, --dims are two ways"),
])
def test_cli_bad_input_is_one_line_and_status_2(job, capsys, args, needle):
    assert cli.main(["plan", "--torchtitan", str(job(LLAMA3_70B)), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hypergrid: error: ") and needle in err


def test_cli_unreadable_or_malformed_file(job, tmp_path, capsys):
    assert cli.main(["plan", "--torchtitan", str(tmp_path / "none.toml"), "--world-size", "8"]) == 2
    assert "none.toml: cannot read the torchtitan job config" in capsys.readouterr().err
    bad = job("[parallelism\ntensor_parallel_degree = 2\n", "bad.toml")
    proc = subprocess.run([sys.executable, "-m", "hypergrid", "plan", "--torchtitan", str(bad), "--world-size", "8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"hypergrid: error: {bad}: malformed TOML:") and "line 1" in proc.stderr


# ---------------------------------------------------------------------------- against torchtitan itself
def _torchtitan_parallel_dims_source() -> Path:
    """torchtitan 0.2's parallel_dims.py, located without importing torchtitan (whose package
    import pulls in triton, tokenizers and the rest of a training stack)."""
    try:
        dist = importlib.metadata.distribution("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchtitan is not installed (pip install --no-deps torchtitan==0.2.0 to compare)")
    if not dist.version.startswith("0.2."):
        pytest.skip(f"torchtitan {dist.version} is installed; the plan follows 0.2's ParallelDims")
    path = Path(str(dist.locate_file("torchtitan/distributed/parallel_dims.py")))
    if not path.is_file():
        pytest.skip(f"torchtitan {dist.version} has no {path}")
    return path


CASES = [
    (8, {"tensor_parallel_degree": 2}),
    (32, {"data_parallel_replicate_degree": 2, "context_parallel_degree": 2, "tensor_parallel_degree": 2,
          "pipeline_parallel_degree": 2}),
    (16, {"data_parallel_replicate_degree": 2, "context_parallel_degree": 2, "data_parallel_shard_degree": 4}),
    (4, {"pipeline_parallel_degree": 4}),
    (64, {"tensor_parallel_degree": 2, "context_parallel_degree": 2, "expert_parallel_degree": 4,
          "expert_tensor_parallel_degree": 2}),
    (64, {"data_parallel_replicate_degree": 2, "tensor_parallel_degree": 2, "context_parallel_degree": 2,
          "expert_parallel_degree": 8, "expert_tensor_parallel_degree": 1}),
    (32, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "expert_parallel_degree": 4,
          "expert_tensor_parallel_degree": 1}),
    (16, {"expert_parallel_degree": 16}),
]


@pytest.mark.parametrize("world,degrees", CASES, ids=[str(i) for i in range(len(CASES))])
def test_against_torchtitans_parallel_dims(world, degrees, monkeypatch):
    """torchtitan's own ParallelDims (its parallel_dims.py, with its logger and device type
    stubbed) builds its meshes on the fake backend; every dim and flattened dim must hold the
    members the plan says, for a few ranks, and DeviceMesh must create as many groups as counted."""
    source = _torchtitan_parallel_dims_source()
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from tests.harness import fake_world

    stubs = {name: types.ModuleType(name) for name in
             ("torchtitan", "torchtitan.tools", "torchtitan.tools.logging", "torchtitan.tools.utils")}
    stubs["torchtitan.tools.logging"].logger = logging.getLogger("torchtitan")  # type: ignore[attr-defined]
    stubs["torchtitan.tools.utils"].device_type = "cpu"  # type: ignore[attr-defined]
    for name, module in stubs.items():
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location("_torchtitan_parallel_dims", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    config = TorchtitanParallelism(**degrees)
    resolved = config.resolved(world)
    plan, mesh = plan_torchtitan(resolved), torchtitan_mesh(resolved)
    for rank in sorted({0, 1, world // 2 + 1, world - 1}):
        with fake_world(rank, world), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: slicing a flattened dim from the root mesh will change
            before = len(c10d._world.pg_map)
            dims = module.ParallelDims(**config.degrees(), world_size=world)
            theirs = dims.world_mesh
            assert tuple(theirs.mesh_dim_names) == mesh.mesh_dim_names and tuple(theirs.shape) == mesh.shape
            assert len(c10d._world.pg_map) - before == torchtitan_groups_per_rank(resolved)
            assert dims.dp_shard == resolved.data_parallel_shard_degree
            mine = plan.groups_of(rank)
            for name in (*mesh.mesh_dim_names, *mesh.flattened):
                assert theirs[name].mesh.flatten().tolist() == mine[name], (rank, name)
        assert not dist.is_initialized()



@pytest.mark.parametrize("toml,world", [
    ("[parallelism]\ntensor_parallel_degree = 8\n", 64),
    ("[parallelism]\ncontext_parallel_degree = 2\n", 2),
    ("[parallelism]\ndata_parallel_replicate_degree = 2\ntensor_parallel_degree = 2\n"
     "context_parallel_degree = 2\npipeline_parallel_degree = 2\n", 32),
    ("[parallelism]\ntensor_parallel_degree = 2\nexpert_parallel_degree = 4\nexpert_tensor_parallel_degree = 1\n", 16),
])
def test_the_cost_report_counts_torchtitans_groups(toml, world):
    from hypergrid.cost import rank_cost
    from hypergrid.torchtitan import shared_groups_per_rank, torchtitan_groups_per_rank

    plan = plan_torchtitan(toml, world)
    cost = rank_cost(plan, world - 1)
    assert cost.megatron == torchtitan_groups_per_rank(toml, world)  # the anchor's column: torchtitan's
    # hypergrid's: one per member set, the whole world's being the default group itself
    assert cost.hypergrid == shared_groups_per_rank(plan) - (1 if cost.world_shared else 0)


def test_the_cost_table_names_torchtitan(job, capsys):
    assert cli.main(["plan", "--torchtitan", str(job(LLAMA3_70B)), "--world-size", "32", "--rank", "13"]) == 0
    out = capsys.readouterr().out
    assert "communicators" in out and "memory (torchtitan)" in out and "megatron-core" not in out.split("communicators")[-1]
