"""Inputs a user gets wrong, or right in a form Megatron-Core accepts: each answered clearly.

Every case here was once accepted silently, answered with an error about something else, or
refused although Megatron-Core takes it. The hypothesis corpus (``test_fuzz.py``) covers the
general shapes of bad input; these are the named cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hypergrid import GridLayout, HyperCommGrid, device_mesh
from hypergrid.layout import MAX_ENUMERATED_RANKS

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
    from hypergrid.megatron.config import MegatronConfig

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
