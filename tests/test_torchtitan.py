"""torchtitan job configs: their [parallelism] read and validated for torchtitan 0.2 and 0.3,
their meshes planned as kinds, the release chosen, the CLI's --torchtitan, and the plan and its
communicator counts against the installed torchtitan's own ParallelDims on torch's fake backend
(0.2.0 in the Python 3.11 environment, 0.3.0 in the 3.12 one; the other release's comparison
skips, saying why)."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from hypergrid.app import cli
from hypergrid.planning.cost import rank_cost
from hypergrid.planning.torchtitan import (
    SpmdBackend,
    TorchtitanParallelism,
    TorchtitanRelease,
    choose_release,
    plan_torchtitan,
    read_parallelism,
    shared_groups_per_rank,
    torchtitan_groups_per_rank,
    torchtitan_meshes,
)
from hypergrid.releases import ReleaseChoice

V02, V03 = TorchtitanRelease.V0_2, TorchtitanRelease.V0_3

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
@pytest.mark.parametrize("release", [V02, V03])
def test_defaults_are_torchtitans(release):
    p = read_parallelism("[job]\ndump_folder = 'x'\n", release=release)  # no [parallelism]: every default
    assert p == TorchtitanParallelism(release=release)
    assert p.degrees() == {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "cp": 1, "pp": 1, "ep": 1, "etp": 1}
    assert read_parallelism("[model]\nname = 'llama3'\n", world_size=8, release=release).data_parallel_shard_degree == 8
    resolved = read_parallelism("[parallelism]\n", world_size=8, release=release)
    assert resolved.spmd_backend is (SpmdBackend.SPMD_TYPES if release is V03 else None)


@pytest.mark.parametrize("release", [V02, V03])
def test_auto_fill_takes_what_the_other_degrees_leave(job, release):
    p = read_parallelism(job(LLAMA3_70B), world_size=32, release=release)  # a Path
    assert p.data_parallel_shard_degree == 2 and p.world_size == 32 and p.release is release
    assert read_parallelism(str(job(LLAMA3_8B)), world_size=64, release=release).data_parallel_shard_degree == 8
    explicit = read_parallelism(LLAMA3_8B.replace("shard_degree = -1", "shard_degree = 8"), world_size=64, release=release)
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
    ('spmd_backend = "full_dtensor"', 8, "parallelism.spmd_backend is not a field of torchtitan 0.2's parallelism "
     "config, which refuses it (0.2 has no spmd_backend; --torchtitan-version 0.3 reads a 0.3 job config)"),
])
def test_validation_names_the_field_0_2(section, world, needle):
    with pytest.raises(ValueError) as info:
        read_parallelism(f"[parallelism]\n{section}\n", world_size=world, release="0.2")
    assert needle in str(info.value)


@pytest.mark.parametrize("section,world,needle", [
    ("expert_tensor_parallel_degree = 1", 8, "parallelism.expert_tensor_parallel_degree is not a field of torchtitan "
     "0.3's parallelism config, which refuses it (0.3 removed expert tensor parallelism; --torchtitan-version 0.2 "
     "reads a 0.2 job config); its fields: ['context_parallel_degree', "),
    ("tensor_parallel_degre = 2", 8, "parallelism.tensor_parallel_degre is not a field of torchtitan 0.3's "
     "parallelism config, which refuses it (a misspelt or another release's key"),
    ('spmd_backend = "dtensor"', 8, "parallelism.spmd_backend must be one of ['partial_dtensor', 'full_dtensor', "
     "'spmd_types'], got 'dtensor'"),
    ("tensor_parallel_degree = 2\nexpert_parallel_degree = 3", 8, "parallelism.expert_parallel_degree (3) must divide "
     "data_parallel_shard_degree x context_parallel_degree x tensor_parallel_degree (8): torchtitan 0.3 lays efsdp x ep"),
    ("tensor_parallel_degree = 3", 8, "parallelism degrees do not fill the world"),
])
def test_validation_names_the_field_0_3(section, world, needle):
    with pytest.raises(ValueError) as info:
        read_parallelism(f"[parallelism]\n{section}\n", world_size=world, release="0.3")
    assert needle in str(info.value)


def test_ep_checks_follow_parallel_dims():
    # 0.2: etp is not looked at without ep (torchtitan checks it only when ep > 1).
    assert TorchtitanParallelism(tensor_parallel_degree=4, expert_tensor_parallel_degree=2,
                                 release="0.2").resolved(8).world_size == 8
    # 0.2: ep may take all of dp_shard x cp (x tp with etp 1), not more.
    TorchtitanParallelism(context_parallel_degree=2, expert_parallel_degree=8, release="0.2").resolved(8)
    with pytest.raises(ValueError, match="expert_parallel_degree \\(16\\)"):
        TorchtitanParallelism(context_parallel_degree=2, expert_parallel_degree=16, release="0.2").resolved(8)
    # 0.3: ep divides dp_shard x cp x tp, and may cut tp itself (ep 2 inside tp 4).
    assert TorchtitanParallelism(tensor_parallel_degree=4, expert_parallel_degree=2, release="0.3").resolved(8)
    # The two releases' own fields are refused by the other.
    with pytest.raises(ValueError, match="expert_tensor_parallel_degree is torchtitan 0.2's"):
        TorchtitanParallelism(expert_tensor_parallel_degree=4, release="0.3")
    with pytest.raises(ValueError, match="spmd_backend is torchtitan 0.3's"):
        TorchtitanParallelism(spmd_backend="spmd_types", release="0.2")
    with pytest.raises(ValueError, match="release must be one of \\['0.2', '0.3'\\], got '0.4'"):
        TorchtitanParallelism(release="0.4")  # type: ignore[arg-type]


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


# ---------------------------------------------------------------------------- which release
def test_the_release_is_given_else_installed_else_the_newest(monkeypatch):
    import hypergrid.planning.torchtitan as tt

    monkeypatch.setattr(tt, "installed_version", lambda name: None)
    assert choose_release() == tt.Followed("torchtitan", "0.3", ReleaseChoice.NEWEST)
    assert choose_release("0.2").chosen_by is ReleaseChoice.GIVEN
    monkeypatch.setattr(tt, "installed_version", lambda name: "0.2.0")
    assert (choose_release().release, choose_release().chosen_by) == ("0.2", ReleaseChoice.INSTALLED)
    given = choose_release("0.3")  # the flag wins over the installed release, which is named
    assert (given.release, given.chosen_by, given.installed) == ("0.3", ReleaseChoice.GIVEN, "0.2.0")
    assert plan_torchtitan(LLAMA3_8B, 64).follows.release == "0.2"
    assert plan_torchtitan(TorchtitanParallelism(release="0.3"), 8).follows.chosen_by is ReleaseChoice.GIVEN
    monkeypatch.setattr(tt, "installed_version", lambda name: "0.4.1")  # not followed: the newest, said so
    newest = choose_release()
    assert (newest.release, newest.chosen_by, newest.installed) == ("0.3", ReleaseChoice.NEWEST, "0.4.1")
    assert "the installed 0.4.1 is not" in newest.describe()


# ---------------------------------------------------------------------------- planning 0.2
def test_llama3_70b_layout_by_hand(job):
    # world 32: pp=2, dp_replicate=2, dp_shard=-1 -> 2, cp=2, tp=2. hypergrid's dims run fastest
    # first: tp stride 1, cp 2, dp_shard 4, dp_replicate 8, pp 16. Rank 13 = tp 1, dp_shard 1, dp_replicate 1.
    plan = plan_torchtitan(job(LLAMA3_70B), 32, "0.2")
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
    assert torchtitan_groups_per_rank(job(LLAMA3_70B), 32, "0.2") == 8 == shared_groups_per_rank(plan)


def test_llama3_8b_only_enabled_dims_are_mesh_dims(job):
    plan = plan_torchtitan(job(LLAMA3_8B), 64, "0.2")
    (mesh,) = torchtitan_meshes(read_parallelism(LLAMA3_8B, 64, "0.2"))
    assert mesh.mesh_dim_names == ("dp_shard", "tp")
    assert plan.layout.dim_names == ("tp", "dp_shard") and plan.layout.shape == (8, 8)
    groups = plan.groups_of(9)
    assert groups["tp"] == list(range(8, 16))
    assert groups["dp_shard"] == groups["dp"] == groups["dp_shard_cp"] == groups["dp_cp"] == [1, 9, 17, 25, 33, 41, 49, 57]
    # torchtitan makes five groups with two member sets; hypergrid makes the two.
    assert torchtitan_groups_per_rank(LLAMA3_8B, 64, "0.2") == 5 and shared_groups_per_rank(plan) == 2
    assert plan.summary("tp", gpus_per_node=8).crosses_nodes is False


def test_moe_etp_1_borrows_tp_and_part_of_dp_shard():
    # world 16, tp=2, ep=4, etp=1: dp_shard 8 = dp_shard_mod_ep 4 x dp_shard_in_ep 2, and ep = dp_shard_in_ep x tp.
    plan = plan_torchtitan("[parallelism]\ntensor_parallel_degree = 2\nexpert_parallel_degree = 4\n"
                           "expert_tensor_parallel_degree = 1\n", 16, "0.2")
    assert plan.layout.dim_names == ("tp", "dp_shard_in_ep", "dp_shard_mod_ep") and plan.layout.shape == (2, 2, 4)
    assert [k.name for k in plan.kinds] == ["dp_shard_mod_ep", "dp_shard_in_ep", "tp", "dp", "dp_shard_cp", "dp_cp", "ep"]
    groups = plan.groups_of(6)  # tp 0, dp_shard_in_ep 1, dp_shard_mod_ep 1
    assert groups["ep"] == [4, 5, 6, 7]
    assert groups["dp_shard_mod_ep"] == [2, 6, 10, 14] and groups["dp_shard_in_ep"] == [4, 6] and groups["tp"] == [6, 7]
    assert groups["dp"] == groups["dp_shard_cp"] == groups["dp_cp"] == [0, 2, 4, 6, 8, 10, 12, 14]


def test_moe_etp_tp_keeps_dp_shard_mod_ep_of_one():
    # world 16, tp=2, cp=2, ep=2, etp=tp: ep takes cp only; dp_shard 4 = mod_ep 4 x in_ep 1 (left out).
    p = TorchtitanParallelism(tensor_parallel_degree=2, context_parallel_degree=2, expert_parallel_degree=2,
                              expert_tensor_parallel_degree=2, release="0.2").resolved(16)
    (mesh,) = torchtitan_meshes(p)
    assert mesh.mesh_dim_names == ("dp_shard_mod_ep", "cp", "tp") and mesh.shape == (4, 2, 2)
    plan = plan_torchtitan(p)
    assert plan.groups_of(5)["ep"] == plan.groups_of(5)["cp"] == [5, 7]
    # ep = 8 and cp = 2 over dp_shard 4: ep takes all of dp_shard, and dp_shard_mod_ep stays, of size 1.
    (full,) = torchtitan_meshes(TorchtitanParallelism(context_parallel_degree=2, expert_parallel_degree=8,
                                                      release="0.2").resolved(8))
    assert full.mesh_dim_names == ("dp_shard_mod_ep", "dp_shard_in_ep", "cp") and full.shape == (1, 4, 2)


def test_a_single_rank_world_still_has_a_dim():
    plan = plan_torchtitan("[parallelism]\n", 1, "0.2")
    assert plan.layout.dim_names == ("dp_shard",) and plan.groups_of(0)["dp_shard"] == [0]
    assert torchtitan_groups_per_rank("[parallelism]\n", 1, "0.2") == 0  # one group spanning the world: the default one


# ---------------------------------------------------------------------------- planning 0.3
def test_0_3_unflattens_overlapping_meshes_by_hand():
    # world 32: pp 2, dp_replicate 2, dp_shard 2, cp 2, tp 2 (all five), spmd_types: four meshes over
    # the same ranks, pp in each of them, tp and cp in three, dp_replicate in two.
    plan = plan_torchtitan(LLAMA3_70B.replace("pipeline_parallel_schedule", "pipeline_parallel_schedule_csv"), 32, "0.3")
    assert plan.layout.dim_names == ("tp", "cp", "dp_shard", "dp_replicate", "pp")  # the dense mesh
    assert {name: view.dim_names for name, view in plan.views.items()} == {
        "dataloading": ("tp", "cp", "batch", "pp"), "fwdbwd": ("tp", "cp", "dp", "pp"),
        "sparse": ("ep", "efsdp", "dp_replicate", "pp")}
    assert [k.name for k in plan.kinds] == [
        "pp", "batch", "cp", "tp", "loss",
        "pp@dense", "dp_replicate", "dp_shard", "cp@dense", "tp@dense",
        "pp@fwdbwd", "dp", "cp@fwdbwd", "tp@fwdbwd",
        "pp@sparse", "dp_replicate@sparse", "efsdp", "ep"]
    groups = plan.groups_of(13)  # tp 1, cp 0, dp_shard 1, dp_replicate 1, pp 0
    assert groups["pp"] == groups["pp@dense"] == groups["pp@fwdbwd"] == groups["pp@sparse"] == [13, 29]
    assert groups["batch"] == groups["dp"] == [1, 5, 9, 13]
    assert groups["loss"] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert groups["dp_replicate"] == groups["dp_replicate@sparse"] == [5, 13]
    assert groups["dp_shard"] == [9, 13] and groups["cp"] == [13, 15] and groups["tp"] == [12, 13]
    # ep 1: efsdp spans dp_shard x cp x tp and, with ep, is asked on the fake backend.
    assert groups["efsdp"] == list(range(8, 16)) and groups["ep"] == [13]
    fake = [k.name for k in plan.kinds if k.creation.backend.value == "fake"]
    assert fake == ["efsdp", "ep"]
    # 18 groups a rank, 2 of them fake; hypergrid: one per member set and backend.
    assert torchtitan_groups_per_rank(LLAMA3_70B, 32, "0.3") == 18
    # pp, batch = dp, loss, dp_replicate, dp_shard, cp, tp; efsdp and ep on the fake backend
    assert shared_groups_per_rank(plan) == 9


def test_0_3_ep_borrows_from_dp_shard_cp_and_tp():
    # ep 2 inside tp 4: an ep group is half a tp group, efsdp the rest of dp_shard x cp x tp.
    plan = plan_torchtitan("[parallelism]\ntensor_parallel_degree = 4\nexpert_parallel_degree = 2\n", 16, "0.3")
    groups = plan.groups_of(6)
    assert groups["tp"] == [4, 5, 6, 7] and groups["ep"] == [6, 7] and groups["efsdp"] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert not any(k.creation.backend.value == "fake" for k in plan.kinds if k.name in ("efsdp", "ep"))


@pytest.mark.parametrize("backend,dense,fwdbwd", [
    ("spmd_types", ("tp", "cp", "dp_shard", "dp_replicate", "pp"), True),
    ("full_dtensor", ("tp", "cp", "dp_shard", "dp_replicate", "pp"), False),
    ("partial_dtensor", ("tp", "fsdp", "dp_replicate", "pp"), False),
])
def test_0_3_spmd_backend_chooses_the_dense_meshes(backend, dense, fwdbwd):
    plan = plan_torchtitan(f'[parallelism]\nspmd_backend = "{backend}"\ntensor_parallel_degree = 2\n', 8, "0.3")
    assert plan.layout.dim_names == dense and ("fwdbwd" in plan.views) is fwdbwd
    # dp_shard (the storage axis) and fsdp are real even at size 1; other size-1 dims are fake.
    single = plan_torchtitan(f'[parallelism]\nspmd_backend = "{backend}"\ntensor_parallel_degree = 8\n', 8, "0.3")
    storage = "fsdp" if backend == "partial_dtensor" else "dp_shard"
    assert single.kind(storage).size == 1 and single.kind(storage).creation.backend.value == "default"
    assert single.kind("batch").creation.backend.value == "fake"


def test_0_3_identities_without_members_agree_with_members():
    plan = plan_torchtitan("[parallelism]\ndata_parallel_replicate_degree = 2\ntensor_parallel_degree = 2\n"
                           "context_parallel_degree = 2\nexpert_parallel_degree = 8\npipeline_parallel_degree = 2\n",
                           64, "0.3")
    for rank in (0, 21, 63):
        sets = {(tuple(k.members(rank)), k.creation.backend) for k in plan.kinds}
        cost = rank_cost(plan, rank)
        assert cost.hypergrid == len({s for s in sets if len(s[0]) < 64 or s[1].value != "default"})
        assert cost.megatron == 18 and cost.hypergrid_fake == len({s for s in sets if s[1].value == "fake"})


# ---------------------------------------------------------------------------- the command line
def test_cli_plans_a_job_config(job, capsys):
    argv = ["plan", "--torchtitan", str(job(LLAMA3_70B)), "--world-size", "32", "--rank", "13"]
    assert cli.main([*argv, "--torchtitan-version", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "grid:   tp=2 x cp=2 x dp_shard=2 x dp_replicate=2 x pp=2" in out
    assert "  dp_cp         1, 3, 5, 7, 9, 11, 13, 15\n" in out
    assert "torchtitan column: the groups torchtitan 0.2 (given" in out
    assert cli.main([*argv, "--torchtitan-version", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "dataloading: tp=2 x cp=2 x batch=4 x pp=2" in out and "  pp@sparse            13, 29\n" in out
    assert "efsdp" in out and "fake backend: no communicator" in out and "torchtitan 0.3 (given" in out


@pytest.mark.parametrize("args,needle", [
    (["--world-size", "30"], "parallelism degrees do not fill the world"),
    ([], "--torchtitan needs --world-size"),
    (["--world-size", "32", "--tp", "2"], "--torchtitan and --tp are two ways to give a layout"),
    (["--world-size", "32", "--shape", "32", "--dims", "dp"], "--torchtitan and --shape, --dims are two ways"),
    (["--world-size", "32", "--torchtitan-version", "0.4"], "argument --torchtitan-version: invalid choice: '0.4'"),
    (["--world-size", "32", "--megatron-core-version", "0.19"], "--megatron-core-version goes with Megatron sizes"),
])
def test_cli_bad_input_is_one_line_and_status_2(job, capsys, args, needle):
    assert cli.main(["plan", "--torchtitan", str(job(LLAMA3_70B)), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hypergrid: error: ") and needle in err


def test_cli_torchtitan_version_needs_a_job_config(capsys):
    assert cli.main(["plan", "--world-size", "8", "--tp", "2", "--torchtitan-version", "0.3"]) == 2
    assert "--torchtitan-version goes with --torchtitan FILE" in capsys.readouterr().err


def test_cli_a_0_2_job_config_read_as_0_3_names_the_key(job, capsys):
    path = job(LLAMA3_70B.replace("[parallelism]\n", "[parallelism]\nexpert_tensor_parallel_degree = 1\n"))
    assert cli.main(["plan", "--torchtitan", str(path), "--world-size", "32", "--torchtitan-version", "0.3"]) == 2
    assert "expert_tensor_parallel_degree is not a field of torchtitan 0.3's" in capsys.readouterr().err
    assert cli.main(["plan", "--torchtitan", str(path), "--world-size", "32", "--torchtitan-version", "0.2"]) == 0


def test_cli_unreadable_or_malformed_file(job, tmp_path, capsys):
    assert cli.main(["plan", "--torchtitan", str(tmp_path / "none.toml"), "--world-size", "8"]) == 2
    assert "none.toml: cannot read the torchtitan job config" in capsys.readouterr().err
    bad = job("[parallelism\ntensor_parallel_degree = 2\n", "bad.toml")
    proc = subprocess.run([sys.executable, "-m", "hypergrid", "plan", "--torchtitan", str(bad), "--world-size", "8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"hypergrid: error: {bad}: malformed TOML:") and "line 1" in proc.stderr


@pytest.mark.parametrize("release,toml,world", [
    ("0.2", "[parallelism]\ntensor_parallel_degree = 8\n", 64),
    ("0.2", "[parallelism]\ncontext_parallel_degree = 2\n", 2),
    ("0.2", "[parallelism]\ndata_parallel_replicate_degree = 2\ntensor_parallel_degree = 2\n"
     "context_parallel_degree = 2\npipeline_parallel_degree = 2\n", 32),
    ("0.2", "[parallelism]\ntensor_parallel_degree = 2\nexpert_parallel_degree = 4\nexpert_tensor_parallel_degree = 1\n", 16),
    ("0.3", "[parallelism]\ntensor_parallel_degree = 8\npipeline_parallel_degree = 4\n", 256),
    ("0.3", "[parallelism]\ntensor_parallel_degree = 2\nexpert_parallel_degree = 4\n", 16),
    ("0.3", "[parallelism]\n", 8),
])
def test_the_cost_report_counts_torchtitans_groups(release, toml, world):
    plan = plan_torchtitan(toml, world, release)
    cost = rank_cost(plan, world - 1)
    assert cost.megatron == torchtitan_groups_per_rank(toml, world, release)  # the anchor's column: torchtitan's
    # hypergrid's: one per member set and backend, the whole world's on the default backend being the default group
    assert cost.hypergrid == shared_groups_per_rank(plan) - (1 if cost.world_shared else 0)
    fake = [k for k in plan.kinds if k.creation.backend.value == "fake"]
    assert cost.megatron_fake == len(fake) and (cost.hypergrid_fake > 0) == bool(fake)
    assert cost.megatron_memory_mb == (cost.megatron - cost.megatron_fake) * cost.comm_memory_mb


def test_the_cost_table_names_torchtitan(job, capsys):
    assert cli.main(["plan", "--torchtitan", str(job(LLAMA3_70B)), "--world-size", "32", "--rank", "13"]) == 0
    out = capsys.readouterr().out
    assert "communicators" in out and "memory (torchtitan)" in out and "megatron-core" not in out.split("communicators")[-1]
# ---------------------------------------------------------------------------- against torchtitan itself
# The installed torchtitan's parallel_dims.py runs alone, with the few torchtitan names it imports
# stubbed (its package import pulls in a whole training stack): check --torchtitan's own loader.
@functools.cache
def _load_parallel_dims(release: str) -> Any:
    """The installed torchtitan's ParallelDims module, or a pytest.skip saying why there is none."""
    from hypergrid.app.torchtitan_parity import TorchtitanUnavailable, load_parallel_dims, release_of

    try:
        version, _, module = load_parallel_dims()
    except TorchtitanUnavailable as exc:
        pytest.skip(f"{exc} (pip install --no-deps torchtitan=={release}.0 to compare)")
    if release_of(module).value != release:
        pytest.skip(f"torchtitan {version} is installed; this compares with {release}'s ParallelDims "
                    f"(the other Python environment has it)")
    return module


def _build(module: Any, rank: int, world: int, parallel_dims: dict) -> tuple[int, list, dict[str, list[int]]]:
    """torchtitan's own ParallelDims(...).build_mesh() as ``rank`` of a fake world: the process groups
    it added to torch's map, the groups DeviceMesh asked for, and the members of every mesh dim
    torchtitan hands out by name."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from hypergrid.app.torchtitan_parity import recorded_mesh_groups
    from tests.harness import fake_world

    with fake_world(rank, world), warnings.catch_warnings(), recorded_mesh_groups(rank) as made:
        warnings.simplefilter("ignore")  # torch: slicing a flattened dim from the root mesh will change
        before = len(c10d._world.pg_map)
        dims = module.ParallelDims(**parallel_dims, world_size=world)
        world_mesh = dims.build_mesh()  # (0.2's world_mesh property would build it all again)
        grown = len(c10d._world.pg_map) - before
        if getattr(dims, "_single_axis_meshes", None):  # 0.3: what get_mesh hands out
            named = dict(dims._single_axis_meshes)
        else:  # 0.2: the world mesh's dims and the dims flattened out of it
            named = {n: world_mesh[n] for n in world_mesh.mesh_dim_names}
            named.update(world_mesh._get_root_mesh()._flatten_mapping)
        members = {n: sorted(dist.get_process_group_ranks(m.get_group())) for n, m in named.items()}
    assert not dist.is_initialized()
    return grown, list(made), members


def _compare(release: str, world: int, config: TorchtitanParallelism, parallel_dims: dict) -> None:
    """Every group the installed torchtitan makes on a few ranks, in order and with its backend, is
    the plan's; the cost report's counts are what it makes (torchtitan) and its distinct member
    sets per backend (hypergrid)."""
    module = _load_parallel_dims(release)
    resolved = config.resolved(world)
    plan = plan_torchtitan(resolved)
    assert plan.follows.release == release
    for rank in sorted({r for r in (0, 1, world // 2 + 1, world - 1) if r < world}):
        grown, made, members = _build(module, rank, world, parallel_dims)
        expected = [(tuple(k.members(rank)), k.creation.backend.value == "fake") for k in plan.kinds
                    if k.size != world or k.creation.backend.value != "default"]  # the world's: the default group
        assert made == expected, (rank, [k.name for k in plan.kinds])
        mine = plan.groups_of(rank)
        for name, group in members.items():
            assert group == sorted(mine[name]), (rank, name)
        cost = rank_cost(plan, rank)
        assert (cost.megatron, cost.megatron_fake) == (grown, sum(fake for _, fake in made)) == (len(made), cost.megatron_fake)
        assert cost.megatron == torchtitan_groups_per_rank(resolved)
        distinct = set(made)
        assert (cost.hypergrid, cost.hypergrid_fake) == (len(distinct), sum(fake for _, fake in distinct))


CASES_0_2 = [
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
    (256, {"tensor_parallel_degree": 8, "pipeline_parallel_degree": 4}),  # llama3 70B-like, as in docs/cli.md
    (64, {"tensor_parallel_degree": 2, "context_parallel_degree": 2, "pipeline_parallel_degree": 2,
          "expert_parallel_degree": 4, "expert_tensor_parallel_degree": 1}),  # docs/cli.md's MoE job
]


@pytest.mark.parametrize("world,degrees", CASES_0_2, ids=[str(i) for i in range(len(CASES_0_2))])
def test_against_torchtitan_0_2_parallel_dims(world, degrees):
    config = TorchtitanParallelism(**degrees, release="0.2")
    d = config.degrees()
    _compare("0.2", world, config, d)
    (mesh,) = torchtitan_meshes(config.resolved(world))
    assert not mesh.fake_dims


#: (name, world, [parallelism] fields): torchtitan 0.3 configurations, the spmd_backend included.
CASES_0_3 = [
    ("llama3-70b-like", 256, {"tensor_parallel_degree": 8, "pipeline_parallel_degree": 4}),
    ("moe", 64, {"tensor_parallel_degree": 2, "context_parallel_degree": 2, "pipeline_parallel_degree": 2,
                 "expert_parallel_degree": 4}),
    ("moe-ep-inside-tp", 32, {"tensor_parallel_degree": 4, "pipeline_parallel_degree": 2, "expert_parallel_degree": 2}),
    ("moe-hsdp-ep-8", 64, {"data_parallel_replicate_degree": 2, "tensor_parallel_degree": 2,
                           "context_parallel_degree": 2, "expert_parallel_degree": 8}),
    ("hsdp-full-dtensor", 32, {"data_parallel_replicate_degree": 2, "context_parallel_degree": 2,
                               "tensor_parallel_degree": 2, "spmd_backend": "full_dtensor"}),
    ("moe-partial-dtensor", 16, {"tensor_parallel_degree": 2, "context_parallel_degree": 2,
                                 "expert_parallel_degree": 4, "spmd_backend": "partial_dtensor"}),
    ("all-data-parallel", 8, {}),
    ("one-rank", 1, {}),
]


@pytest.mark.parametrize("name,world,fields", CASES_0_3, ids=[c[0] for c in CASES_0_3])
def test_against_torchtitan_0_3_parallel_dims(name, world, fields):
    config = TorchtitanParallelism(**fields, release="0.3")
    d = {k: v for k, v in config.degrees().items() if k != "etp"}  # 0.3's ParallelDims has no etp
    _compare("0.3", world, config, {**d, "spmd_backend": config.resolved(world).spmd_backend.value})


def test_the_documented_0_3_counts():
    # docs/cli.md: a llama3 70B-like job and a MoE job, torchtitan 0.3's communicators per rank beside
    # hypergrid's (each asserted against torchtitan's own build above).
    dense = plan_torchtitan(Path(__file__).resolve().parent.parent / "docs" / "examples" / "llama3_70b_0_3.toml",
                            256, "0.3")
    cost = rank_cost(dense, 5)
    assert (cost.megatron, cost.megatron_fake, cost.hypergrid, cost.hypergrid_fake) == (18, 7, 5, 2)
    moe = plan_torchtitan(Path(__file__).resolve().parent.parent / "docs" / "examples" / "moe_0_3.toml", 64, "0.3")
    cost = rank_cost(moe, 5)
    assert (cost.megatron, cost.megatron_fake, cost.hypergrid, cost.hypergrid_fake) == (18, 2, 7, 1)
    # The same jobs under 0.2's meshes (docs/cli.md's table; asserted against 0.2's own build above).
    old = [rank_cost(plan_torchtitan(TorchtitanParallelism(**d, release="0.2"), w), 5) for w, d in CASES_0_2[-2:]]
    assert [(c.megatron, c.hypergrid) for c in old] == [(6, 3), (8, 6)]


# ---------------------------------------------------------------------------- check --torchtitan
def _installed_release() -> tuple[str, str]:
    """(version, release) of the installed torchtitan's ParallelDims, or a skip."""
    from hypergrid.app.torchtitan_parity import TorchtitanUnavailable, load_parallel_dims, release_of

    try:
        version, _, module = load_parallel_dims()
    except TorchtitanUnavailable as exc:
        pytest.skip(str(exc))
    return version, release_of(module).value


EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


@pytest.mark.parametrize("argv, compared", [
    (["--torchtitan", "llama3_70b.toml", "--world-size", "32"], "every one of the 32 ranks"),
    (["--torchtitan", "moe.toml", "--world-size", "64"], "every one of the 64 ranks"),
    (["--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "4", "-n", "256"],
     "32 of 256 ranks (seed 0"),
])
def test_check_compares_torchtitan_s_own_meshes_rank_by_rank(argv, compared, capsys, tmp_path, monkeypatch):
    version, release = _installed_release()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama3_70b.toml").write_text(LLAMA3_70B)
    moe = {"0.2": "expert_tensor_parallel_degree = 1\n", "0.3": ""}[release]
    (tmp_path / "moe.toml").write_text("[parallelism]\ntensor_parallel_degree = 2\ncontext_parallel_degree = 2\n"
                                       f"pipeline_parallel_degree = 2\nexpert_parallel_degree = 4\n{moe}")
    status = cli.main(["check", *argv])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0].startswith(f"compared torchtitan {version}'s own ParallelDims (the installed one, ")
    assert f"it builds {release}'s meshes) with the plan on {compared}" in lines[0]
    assert f"identical to torchtitan {version}" in lines
    assert "identical to megatron-core" in lines  # the grid's enumerations too, said apart


def test_check_reports_where_torchtitan_s_meshes_differ_and_exits_1(capsys, monkeypatch):
    from hypergrid.app import torchtitan_parity

    version, _ = _installed_release()
    real = torchtitan_parity.plan_torchtitan

    def wrong(config, *args, **kwargs):  # a plan with tp 4 where the job has tp 2
        import dataclasses

        return real(dataclasses.replace(config, tensor_parallel_degree=4, data_parallel_shard_degree=2))

    monkeypatch.setattr(torchtitan_parity, "plan_torchtitan", wrong)
    status = cli.main(["check", "-n", "8", "--parallelism.tensor_parallel_degree", "2"])
    out = capsys.readouterr().out
    assert status == 1
    differences = [line for line in out.splitlines() if line.startswith("DIFFERENCE ")]
    assert "DIFFERENCE rank 0: tp: torchtitan [0, 1], hypergrid [0, 1, 2, 3]" in differences
    assert f"differences from torchtitan {version}" in out


def test_check_without_torchtitan_installed_says_so(capsys, monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert cli.main(["check", "-n", "8", "--parallelism.tensor_parallel_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hypergrid: error: torchtitan is not installed") and err.count("\n") == 1


@pytest.mark.slow
def test_check_as_typed_in_a_subprocess():
    _installed_release()
    example = "llama3_70b_0_3.toml" if _installed_release()[1] == "0.3" else "llama3_70b.toml"
    world = "256" if example.endswith("0_3.toml") else "32"
    proc = subprocess.run([sys.executable, "-m", "hypergrid", "check", "--torchtitan", f"docs/examples/{example}",
                           "--world-size", world], capture_output=True, text=True, timeout=300,
                          cwd=EXAMPLES.parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("compared torchtitan ")
    assert "identical to torchtitan " in proc.stdout
