"""Inputs a user gets wrong, or right in a form Megatron-Core accepts: each answered clearly.

Every case here was once accepted silently, answered with an error about something else, or
refused although Megatron-Core takes it. The hypothesis corpus (``test_fuzz.py``) covers the
general shapes of bad input; these are the named cases.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch

from hypergrid import GridLayout, HyperCommGrid, device_mesh
from hypergrid.layout import MAX_ENUMERATED_RANKS
from hypergrid.layout.checks import MAX_TIMEOUT, MIN_TIMEOUT

from .harness import fake_world


@pytest.mark.parametrize("make", [np.int64, np.int32, np.uint8, torch.tensor], ids=["int64", "int32", "uint8", "torch"])
def test_integer_scalars_are_accepted_everywhere_a_size_rank_or_offset_is_taken(make) -> None:
    grid = HyperCommGrid([make(2), make(4)], ["tp", "dp"], rank_offset=make(0), world_size=make(8))
    assert grid.shape == [2, 4] and all(type(size) is int for size in grid.shape)
    assert grid.ranks("dp", rank=make(5)) == [1, 3, 5, 7]
    assert GridLayout((make(2), 4), ("tp", "dp")) == GridLayout((2, 4), ("tp", "dp"))
    grid.register_view("v", [make(4), make(2)], ["a", "b"])
    assert grid.get_rank_enum("a", view="v")[0] == [0, 1, 2, 3]


def test_megatron_sizes_accept_integer_scalars() -> None:
    pytest.importorskip("megatron.core")
    from hypergrid.megatron.spec.config import MegatronConfig

    config = MegatronConfig.from_megatron_kwargs(np.int64(8), {"tensor_model_parallel_size": np.int32(2)})
    assert config.data_parallel_size == 4 and type(config.tensor_model_parallel_size) is int


@pytest.mark.parametrize("bad", [2.0, "2", True, None])
def test_non_integers_name_the_value(bad) -> None:
    with pytest.raises(TypeError, match=r"shape\[0\] \(dim 'tp'\) must be an int, got"):
        HyperCommGrid([bad, 4], ["tp", "dp"], world_size=8)


@pytest.mark.parametrize("name", ["expert:tp", "embd(pp)", "dp-cp", "a,b", "x/y", "t p"])
def test_dim_names_holding_key_characters_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="dim names may not hold") as refused:
        HyperCommGrid([2, 4], [name, "dp"], world_size=8)
    assert repr(name) in str(refused.value)


def test_duplicate_shared_dims_are_refused() -> None:
    grid = HyperCommGrid([2, 4], ["tp", "dp"], world_size=8)
    with pytest.raises(ValueError, match=r"duplicate shared_dims: \['tp', 'tp'\]"):
        grid.register_view("v", [2, 2, 2], ["tp", "a", "b"], shared_dims=["tp", "tp"])


def test_unknown_backend_is_refused_at_construction_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'nonsense' is not a backend torch knows; registered backends are \[.*'gloo'"):
        HyperCommGrid([2, 4], ["tp", "dp"], world_size=8, backend="nonsense")
    # torch's per-device form is a backend too.
    assert HyperCommGrid([2, 4], ["tp", "dp"], world_size=8, backend="cpu:gloo,cuda:nccl").backend == "cpu:gloo,cuda:nccl"


def test_enumerating_a_grid_too_large_to_hold_is_refused_up_front() -> None:
    size = 1 << 40
    grid = HyperCommGrid([1 << 20, 1 << 20], ["tp", "dp"], world_size=size)
    with pytest.raises(ValueError, match=f"{size:,}-rank grid") as refused:
        grid.get_rank_enum("tp")
    assert f"{MAX_ENUMERATED_RANKS:,}" in str(refused.value) and "GiB" in str(refused.value)
    # One rank's group is O(group size), at any size.
    assert grid.ranks("tp", rank=size - 1)[-1] == size - 1


@pytest.mark.parametrize("variable,value", [("RANK", "x"), ("RANK", "-1"), ("WORLD_SIZE", "eight"), ("WORLD_SIZE", "0")])
def test_malformed_environment_variables_are_named(monkeypatch, variable: str, value: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"environment variable {variable} is set to {value!r}"):
        HyperCommGrid([2, 4], ["tp", "dp"]).ranks("dp")


def test_device_type_is_checked_against_torch_and_the_groups_backend() -> None:
    with fake_world(0, 8):
        grid = HyperCommGrid([2, 4], ["tp", "dp"], backend="gloo")
        with pytest.raises(ValueError, match="'tpu' is not a device type torch knows"):
            device_mesh(grid, device_type="tpu")
        with pytest.raises(ValueError, match=r"'xpu' cannot be used .* backend 'gloo' supports \['cpu', 'cuda'\]"):
            device_mesh(grid, device_type="xpu")


@pytest.mark.parametrize("strategy", ["auto", "split", "enumerate"])
def test_pg_options_torch_refuses_are_named(strategy: str) -> None:
    with fake_world(0, 8):
        grid = HyperCommGrid([2, 4], ["tp", "dp"], strategy=strategy)
        with pytest.raises(TypeError, match=r"process group 'tp': torch refused pg_options='x' \(str;"):
            grid.create_pg("tp", pg_options="x")
        # The failed request leaves nothing behind: the same group with no options is made.
        assert grid.create_pg("tp") is not None


# ---------------------------------------------------------------------------- backends and timeouts
@pytest.mark.parametrize("backend,words", [
    ("gloo ", ["'gloo '", "whitespace", "'gloo'"]),
    (" cpu:gloo", ["' cpu:gloo'", "whitespace"]),
    ("cpu: gloo", ["'cpu: gloo'", "whitespace"]),
    ("gloo,cuda:nccl", ["'gloo,cuda:nccl'", "'gloo' is not a device:backend pair", "'cpu:gloo,cuda:nccl'"]),
    ("cpu:gloo,cpu:gloo", ["names device 'cpu' twice"]),
    ("gloo,", ["'gloo,'", "'gloo' is not a device:backend pair"]),
])
def test_backend_strings_torch_would_misread_are_refused_at_construction(backend: str, words: list[str]) -> None:
    # torch matches names exactly and splits only on ',' and ':': 'gloo ' passed validation and
    # failed inside torch ("Unknown backend type gloo ") at the first create_pg.
    with pytest.raises(ValueError, match="^backend ") as refused:
        HyperCommGrid([2, 4], ["tp", "dp"], world_size=8, backend=backend)
    for word in words:
        assert word in str(refused.value), (word, str(refused.value))
    with fake_world(0, 8):
        with pytest.raises(ValueError, match="whitespace"):
            HyperCommGrid([2, 4], ["tp", "dp"]).create_pg("tp", backend="gloo ")


def test_backend_case_is_read_as_torch_reads_it() -> None:
    assert HyperCommGrid([2, 4], ["tp", "dp"], world_size=8, backend="GLOO").backend == "GLOO"
    assert HyperCommGrid([2, 4], ["tp", "dp"], world_size=8, backend="CPU:gloo,cuda:NCCL").backend


@pytest.mark.parametrize("timeout,words", [
    (timedelta.max, ["at most 106751987 days, 23:39:36.868000", "9223371761976868 ms", "999999999 days"]),
    (MAX_TIMEOUT + timedelta(milliseconds=1), ["at most", "gloo"]),
    (timedelta(microseconds=500), ["at least 1 ms", "whole milliseconds", "0:00:00.000500"]),
    (timedelta(0), ["must be positive", "0:00:00"]),
    (timedelta(seconds=-1), ["must be positive"]),
])
def test_timeouts_torch_cannot_take_are_refused_naming_the_bound(timeout: timedelta, words: list[str]) -> None:
    for make in (lambda: HyperCommGrid([2, 4], ["tp", "dp"], world_size=8, timeout=timeout),
                 lambda: HyperCommGrid([2, 4], ["tp", "dp"], world_size=8).create_pg("tp", timeout=timeout)):
        with pytest.raises(ValueError, match="^timeout must be") as refused:
            make()
        for word in words:
            assert word in str(refused.value), (word, str(refused.value))


def test_the_timeout_bounds_are_gloos_own() -> None:
    # In a one-rank gloo world: the longest timeout accepted makes a working group, and what
    # hypergrid refuses above it gloo refuses too ("Invalid timeout"): timedelta.max on every
    # torch, one millisecond more from torch 2.15 on (2.13 takes up to 2**63 - 1 microseconds).
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grid = HyperCommGrid([1], ["dp"], timeout=MAX_TIMEOUT)
        ones = torch.ones(1)
        dist.all_reduce(ones, group=grid.create_pg("dp"))
        assert ones.item() == 1.0
        grid.destroy()
        too_long = [timedelta.max] + [MAX_TIMEOUT + MIN_TIMEOUT] * (tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 15))
        for timeout in too_long:
            with pytest.raises(RuntimeError, match="Invalid timeout"):
                dist.new_group([0], timeout=timeout)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("minutes,words", [
    (float("nan"), ["distributed_timeout_minutes", "finite", "nan"]),
    (float("inf"), ["distributed_timeout_minutes", "finite", "inf"]),
    (1e-9, ["distributed_timeout_minutes=1e-09", "6e-05 ms", "at least 1.67e-05 minutes (1 ms)"]),
    (1e300, ["distributed_timeout_minutes=1e+300", "at most 153722862699 minutes"]),
    (0, ["distributed_timeout_minutes", "positive", "got 0"]),
])
def test_megatron_timeout_minutes_name_the_parameter(minutes: float, words: list[str]) -> None:
    from hypergrid.megatron.spec.config import MegatronConfig, ParallelConfigError

    with pytest.raises(ParallelConfigError) as refused:
        MegatronConfig.from_megatron_kwargs(8, {"distributed_timeout_minutes": minutes})
    for word in words:
        assert word in str(refused.value), (word, str(refused.value))


def test_initialize_model_parallel_names_a_nan_timeout() -> None:
    pytest.importorskip("megatron.core.parallel_state")
    from hypergrid.megatron import ParallelConfigError, initialize_model_parallel

    with fake_world(0, 8):
        for minutes in (float("nan"), 1e-9):
            with pytest.raises(ParallelConfigError, match="distributed_timeout_minutes"):
                initialize_model_parallel(tensor_model_parallel_size=2, distributed_timeout_minutes=minutes)


@pytest.mark.parametrize("content", [None, "", "- a list\n", "tp: [unclosed\n"],
                         ids=["missing", "empty-name", "a-list", "bad-yaml"])
def test_initialize_model_parallel_names_an_unreadable_nccl_config(tmp_path, content) -> None:
    pytest.importorskip("megatron.core.parallel_state")
    pytest.importorskip("yaml")
    from hypergrid.megatron import initialize_model_parallel

    if content is None:
        path = str(tmp_path / "absent.yaml")
    elif content == "":
        path = ""
    else:
        path = str(tmp_path / "nccl.yaml")
        (tmp_path / "nccl.yaml").write_text(content)
    with fake_world(0, 8):
        with pytest.raises(ValueError, match=rf"^nccl_communicator_config_path .*{path!r}"):
            initialize_model_parallel(tensor_model_parallel_size=2, nccl_communicator_config_path=path)


# ---------------------------------------------------------------------------- the DeviceMesh adapter
@pytest.mark.parametrize("grid", [None, "grid", [2, 4]])
def test_device_mesh_of_something_else_is_a_type_error_naming_grid(grid) -> None:
    with pytest.raises(TypeError, match=r"^grid must be a hypergrid HyperCommGrid, got "):
        device_mesh(grid)


def test_device_mesh_names_an_unknown_view_as_the_grid_does() -> None:
    with fake_world(0, 8):
        grid = HyperCommGrid([2, 4], ["tp", "dp"])
        with pytest.raises(KeyError) as from_grid:
            grid.create_pg("tp", view="moe")
        with pytest.raises(KeyError) as from_mesh:
            device_mesh(grid, view="moe", device_type="cpu")
        assert str(from_mesh.value) == str(from_grid.value)
        assert "Registered views: ['base']" in str(from_mesh.value)
        with pytest.raises(TypeError, match="view must be a view name"):
            device_mesh(grid, view=["moe"], device_type="cpu")


# ---------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("argv,words", [
    (["plan", "--world-size", "8", "--order", ""], ["argument --order", "expected a Megatron order like tp-cp-ep-dp-pp", "''"]),
    (["check", "--world-size", "8", "--order", ""], ["argument --order", "''"]),
    (["demo", "--order", ""], ["argument --order", "''"]),
    (["plan", "--shape", "2,,2", "--dims", "tp,dp"], ["argument --shape", "'2,,2'", "entry 2 is empty"]),
    (["plan", "--shape", "2,2,", "--dims", "tp,dp"], ["'2,2,'", "entry 3 is empty"]),
    (["plan", "--shape", "2,2", "--dims", "tp,,dp"], ["argument --dims", "'tp,,dp'", "entry 2 is empty"]),
    (["plan", "--shape", "2,2", "--dims", "tp,dp", "--group", ",dp"], ["argument --group", "entry 1 is empty"]),
])
def test_cli_empty_order_and_empty_list_entries_are_usage_errors(argv: list[str], words: list[str], capsys) -> None:
    from hypergrid.app import cli

    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("hypergrid: error:") and "\n" not in err and captured.out == "", err
    for word in words:
        assert word in err, (word, err)
