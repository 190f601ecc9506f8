"""One rank of a 1,048,576-rank world on torch's fake backend, and how a grid finds its world size.

The fake backend lets this process be any rank of any world; group creation goes through the
real torch.distributed code paths. With the default ``local`` strategy a rank must create only
its own groups, computing their members in O(group size): no enumeration of all groups, no
``new_group`` call larger than the group, nothing proportional to the world.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hypergrid import REGISTRY, GridLayout, GridTooLargeError, HyperCommGrid
from tests.harness import fake_world

WORLD = 1 << 20  # 1,048,576 ranks
SHAPE = [8, 4, 16, 2048]
NAMES = ["tp", "cp", "pp", "dp"]
REQUESTS = ["tp", "cp", "pp", "dp", ["tp", "cp"], ["cp", "dp"], ["tp", "pp", "dp"]]


@pytest.fixture(autouse=True)
def no_world_size_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


@pytest.fixture
def no_enumeration(monkeypatch):
    """Make any full enumeration, or any world-wide torch call, fail the test; count new_group."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a full enumeration was computed on the local path")

    monkeypatch.setattr(GridLayout, "enumerate", forbidden)
    monkeypatch.setattr(GridLayout, "gen_rank_enum", forbidden)
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", forbidden)
    monkeypatch.setattr(dist, "split_group", forbidden)
    calls: list[int] = []
    real_new_group = dist.new_group

    def counting_new_group(*args, **kwargs):
        ranks = kwargs.get("ranks", args[0] if args else None)
        calls.append(len(ranks))
        return real_new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", counting_new_group)
    return calls


@pytest.mark.parametrize("rank", [0, WORLD - 1, WORLD // 2 + 12345, 700001])
def test_one_rank_of_a_million_creates_only_its_groups(rank, no_enumeration):
    with fake_world(rank, WORLD):
        grid = HyperCommGrid(SHAPE, NAMES)
        assert grid.world_size == WORLD and grid.size == WORLD and grid.is_current_rank_in_grid()
        sizes = []
        for dims in REQUESTS:
            pg = grid.create_pg(dims)
            members = grid.ranks(dims)
            assert rank in members and len(members) == grid.layout.group_size(dims)
            assert pg.size() == len(members), dims
            assert pg.rank() == sorted(members).index(rank), dims
            assert dist.get_process_group_ranks(pg) == sorted(members), dims
            assert grid.get_pg(dims) is pg
            sizes.append(len(members))
        # one new_group per group, each exactly as large as the group: 7 distinct groups
        assert sorted(no_enumeration) == sorted(sizes)
        assert REGISTRY.count() == len(REQUESTS)
        assert max(no_enumeration) == 8 * 16 * 2048 < WORLD
        grid.destroy()
        assert REGISTRY.count() == 0


@pytest.mark.parametrize("rank", [0, WORLD // 2 - 1, WORLD // 2, WORLD - 1])
def test_half_world_grid_off_grid_ranks_make_nothing(rank, no_enumeration):
    """A grid over the upper half: ranks below it get None and call torch for nothing."""
    with fake_world(rank, WORLD):
        grid = HyperCommGrid([8, 4, 16, 1024], NAMES, rank_offset=WORLD // 2)
        inside = rank >= WORLD // 2
        assert grid.is_current_rank_in_grid() == inside
        for dims in REQUESTS:
            pg = grid.create_pg(dims)
            if inside:
                assert dist.get_process_group_ranks(pg) == sorted(grid.ranks(dims))
            else:
                assert pg is None and grid.get_pg(dims) is None
        assert len(no_enumeration) == (len(REQUESTS) if inside else 0)
        grid.destroy()


def test_enumerate_strategy_off_grid_rank_repeats_world_wide_calls(monkeypatch):
    """Regression: with Megatron's call pattern, a rank outside a grid must make the same
    world-wide calls as the members each time the grid is built, also after destroy()."""
    calls: dict[int, int] = {}
    real = dist.new_subgroups_by_enumeration

    def counting(*args, **kwargs):
        calls[current] = calls.get(current, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", counting)
    for current in (1, 5):  # a member of the grid over ranks 0-3, and a rank outside it
        with fake_world(current, 8):
            for _ in range(3):
                grid = HyperCommGrid([2, 2], ["tp", "dp"], strategy="enumerate")
                pg = grid.create_pg("tp")
                assert (pg is None) == (current >= 4)
                grid.destroy()
            assert REGISTRY.count() == 0
    assert calls == {1: 3, 5: 3}


# ---------------------------------------------------------------------------- world size
def test_world_size_keyword():
    grid = HyperCommGrid([2, 4], ["tp", "dp"], world_size=64)
    assert grid.world_size == 64
    assert HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=56, world_size=64).rank_offset == 56


def test_world_size_keyword_wins_over_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert HyperCommGrid([2, 4], ["tp", "dp"], world_size=64).world_size == 64


@pytest.mark.parametrize(
    "value, exc, needle", [(0, ValueError, "0"), (-8, ValueError, "-8"), (True, TypeError, "True"),
                           (8.0, TypeError, "8.0"), ("8", TypeError, "'8'")]
)
def test_world_size_keyword_validation(value, exc, needle):
    with pytest.raises(exc) as info:
        HyperCommGrid([2], ["tp"], world_size=value)
    assert needle in str(info.value) and "world_size" in str(info.value)


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    grid = HyperCommGrid([2, 8], ["tp", "dp"])
    assert grid.world_size == 16


@pytest.mark.parametrize("value", ["abc", "0", "-4", "2.5"])
def test_world_size_environment_validation(monkeypatch, value):
    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(ValueError) as info:
        HyperCommGrid([2], ["tp"])
    assert "WORLD_SIZE" in str(info.value) and value.lstrip("-") in str(info.value)


def test_world_size_unknown():
    with pytest.raises(RuntimeError) as info:
        HyperCommGrid([2], ["tp"])
    assert "WORLD_SIZE" in str(info.value) and "world_size=" in str(info.value)


def test_world_size_from_initialized_torch_distributed(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with fake_world(3, 64):
        assert HyperCommGrid([2, 4, 8], ["tp", "cp", "dp"]).world_size == 64
        assert HyperCommGrid([2, 4, 8], ["tp", "cp", "dp"], world_size=64).world_size == 64
        with pytest.raises(GridTooLargeError):
            HyperCommGrid([2, 64], ["tp", "dp"])


def test_world_size_environment_before_torch_distributed_like_megatron(monkeypatch):
    """Megatron-Core reads WORLD_SIZE before torch.distributed: a larger grid can be planned in a job.

    Creating a group of such a grid is refused at once, naming both sizes (it could never
    complete: the ranks it needs do not exist).
    """
    with fake_world(3, 64):
        monkeypatch.setenv("WORLD_SIZE", "128")
        big = HyperCommGrid([2, 64], ["tp", "dp"])
        assert big.world_size == 128 and big.get_rank_enum("tp")[-1] == [126, 127]
        with pytest.raises(GridTooLargeError) as info:
            big.create_pg("dp")
        message = str(info.value)
        assert "'dp'" in message and "128" in message and "64 ranks" in message
        # world_size= plans alike, whatever the job's size
        assert HyperCommGrid([2, 4], ["tp", "dp"], world_size=32).world_size == 32
        with pytest.raises(GridTooLargeError) as info:
            HyperCommGrid([2, 4], ["tp", "dp"], rank_offset=60, world_size=128).create_pg("tp")
        assert "rank_offset 60" in str(info.value) and "64 ranks" in str(info.value)


@pytest.mark.parametrize("catch", [ValueError, RuntimeError, GridTooLargeError])
@pytest.mark.parametrize(
    "shape, offset, world",
    [([2, 4], 0, 7), ([2, 4], 1, 8), ([2, 4], 9, 16), ([4, 4, 4], 0, 32), ([1], 8, 8)],
)
def test_grid_larger_than_world(catch, shape, offset, world):
    with pytest.raises(catch) as info:
        HyperCommGrid(shape, ["tp", "dp", "cp"][: len(shape)], rank_offset=offset, world_size=world)
    assert isinstance(info.value, GridTooLargeError)
    message = str(info.value)
    assert str(shape) in message and str(world) in message and str(offset) in message


def test_grid_larger_than_fake_world():
    with fake_world(0, 1000):
        for catch in (ValueError, RuntimeError):
            with pytest.raises(catch) as info:
                HyperCommGrid([8, 4, 32], ["tp", "cp", "dp"])
            assert isinstance(info.value, GridTooLargeError) and "1000" in str(info.value)
        # exactly the world fits, at any offset that leaves room
        assert HyperCommGrid([8, 125], ["tp", "dp"]).size == 1000
        assert HyperCommGrid([8, 5], ["tp", "dp"], rank_offset=960).size == 40
