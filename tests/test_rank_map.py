"""A layout laid over any ranks: RankMap, and GridLayout / Partition with one.

The default placement (``rank_offset + position``) must stay exactly what it was, and a layout
with a rank map must give, for every question, the default layout's answer with each rank put
through the map.
"""

from __future__ import annotations

import random

import pytest

from hypergrid.layout import GridLayout
from hypergrid.layout.rank_map import RankMap

SHAPES = [((2, 2, 2), ("tp", "dp", "pp")), ((4, 3), ("tp", "dp")), ((2, 1, 3, 2), ("tp", "cp", "dp", "pp"))]


def _random_placement(size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    ranks = rng.sample(range(3 * size), size)
    return ranks


def test_runs_compress_and_answer_both_ways():
    placement = RankMap.of([0, 1, 2, 3, 8, 9, 6, 7])
    assert placement.runs == ((0, 0, 4), (4, 8, 2), (6, 6, 2))
    assert [placement.rank(p) for p in range(8)] == [0, 1, 2, 3, 8, 9, 6, 7]
    assert [placement.position(r) for r in (0, 3, 4, 5, 6, 8, 9, 10)] == [0, 3, None, None, 6, 4, 5, None]
    assert list(placement) == [0, 1, 2, 3, 8, 9, 6, 7] and len(placement) == 8
    assert RankMap.contiguous(5, 3) == RankMap.of([5, 6, 7]) and RankMap.of([5, 6, 7]).is_contiguous


@pytest.mark.parametrize("bad, words", [
    ([1, 1], "two positions to rank 1"),
    ([], "at least one position"),
    ([0, -1], "ranks >= 0"),
])
def test_a_map_that_is_not_one_rank_per_position_is_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        RankMap.of(bad)


def test_replacing_ranks_keeps_every_other_position():
    moved = RankMap.contiguous(0, 16).replaced({4: 16, 5: 17, 6: 18, 7: 19})
    assert moved.runs == ((0, 0, 4), (4, 16, 4), (8, 8, 8))
    with pytest.raises(ValueError, match="rank 20 is not in the map"):
        moved.replaced({20: 21})


def test_a_contiguous_map_is_the_default_placement():
    assert GridLayout((2, 4), ("tp", "dp"), rank_map=RankMap.contiguous(8, 8)) == GridLayout((2, 4), ("tp", "dp"), 8)
    assert GridLayout((2, 4), ("tp", "dp"), rank_map=RankMap.contiguous(8, 8)).rank_map is None
    layout = GridLayout((2, 4), ("tp", "dp"))
    assert repr(layout) == "GridLayout(shape=(2, 4), dim_names=('tp', 'dp'), rank_offset=0)"


@pytest.mark.parametrize("shape, names", SHAPES)
@pytest.mark.parametrize("seed", range(3))
def test_every_answer_is_the_default_layouts_put_through_the_map(shape, names, seed):
    plain = GridLayout(shape, names)
    placement = _random_placement(plain.size, seed)
    placed = GridLayout(shape, names, rank_map=RankMap.of(placement))
    assert list(placed.ranks) == placement
    for position, rank in enumerate(placement):
        assert placed.contains(rank) and placed.coords(rank) == plain.coords(position)
        assert placed.rank_of(plain.coords(position)) == rank
    outsider = max(placement) + 1
    assert not placed.contains(outsider)
    with pytest.raises(ValueError, match=f"rank {outsider} is not one of the grid's ranks"):
        placed.coords(outsider)
    for count in range(1, len(names) + 1):
        for dims in [list(names[:count]), list(names[-count:])]:
            expected = [[placement[p] for p in group] for group in plain.enumerate(dims)]
            assert placed.enumerate(dims) == expected
            for position, rank in enumerate(placement):
                assert placed.group_ranks(dims, rank) == [placement[p] for p in plain.group_ranks(dims, position)]
                assert placed.partition(dims).group_ranks(rank) == placed.group_ranks(dims, rank)
            assert placed.partition(dims).enumerate() == expected


def test_partitions_of_different_placements_differ_and_of_equal_ones_match():
    replaced = RankMap.contiguous(0, 8).replaced({5: 9})
    a = GridLayout((2, 4), ("tp", "dp"), rank_map=replaced).partition(["tp"])
    b = GridLayout((2, 2, 2), ("tp", "cp", "dp"), rank_map=replaced).partition(["tp"])
    c = GridLayout((2, 4), ("tp", "dp")).partition(["tp"])
    assert a == b and hash(a) == hash(b) and a != c
    assert a.group_ranks(4) == [4, 9] and a.enumerate()[2] == [4, 9]
    assert "rank_map=RankMap" in repr(a) and "rank_map" not in repr(c)


def test_a_view_must_be_placed_like_its_grid():
    replaced = RankMap.contiguous(0, 8).replaced({5: 9})
    grid = GridLayout((2, 4), ("tp", "dp"), rank_map=replaced)
    grid.check_view(GridLayout((4, 2), ("ep", "pp"), rank_map=replaced))
    with pytest.raises(ValueError, match="a view must span the grid's ranks"):
        grid.check_view(GridLayout((4, 2), ("ep", "pp")))


def test_a_map_of_the_wrong_size_or_offset_is_refused():
    with pytest.raises(ValueError, match="places 4 positions, but shape \\[2, 4\\] has 8"):
        GridLayout((2, 4), ("tp", "dp"), rank_map=RankMap.contiguous(0, 4))
    with pytest.raises(ValueError, match="rank_offset 3 contradicts rank_map"):
        GridLayout((2, 2), ("tp", "dp"), rank_offset=3, rank_map=RankMap.of([0, 1, 5, 6]))
    with pytest.raises(TypeError, match="rank_map must be a RankMap"):
        GridLayout((2, 2), ("tp", "dp"), rank_map=[0, 1, 2, 3])  # type: ignore[arg-type]


def test_a_million_positions_with_a_replaced_node_are_three_runs():
    world = 1 << 20
    placement = RankMap.contiguous(0, world).replaced({r: world + 8 + r % 8 for r in range(4096, 4104)})
    assert len(placement.runs) == 3
    layout = GridLayout((8, 2, world // 16), ("tp", "cp", "dp"), rank_map=placement)
    assert layout.group_ranks("tp", world + 8 + 3) == list(range(world + 8, world + 16))
    expected = [4 + 16 * k for k in range(world // 16)]
    expected[256] = world + 8 + 4  # position 4100 is on the spare node now
    assert layout.group_ranks("dp", 4) == expected


@pytest.mark.parametrize("seed", range(5))
def test_mapping_many_positions_or_ranks_at_once_is_mapping_each(seed):
    rng = random.Random(seed)
    placement = RankMap.of(_random_placement(64, seed))
    positions = sorted(rng.sample(range(64), 20))
    assert placement.ranks_of(positions) == [placement.rank(p) for p in positions]
    shuffled = positions[:]
    rng.shuffle(shuffled)
    assert placement.ranks_of(shuffled) == [placement.rank(p) for p in shuffled]
    ranks = [placement.rank(p) for p in shuffled] + [1000, 999]  # two outside the map
    by_position = sorted(ranks[:-2], key=placement.position) + [999, 1000]
    assert placement.in_position_order(ranks) == by_position
