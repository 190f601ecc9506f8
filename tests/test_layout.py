"""Unit tests of the rank algebra (hypergrid.layout): pure integers, no process group.

The reference for every enumeration here is a brute force over coordinates written from the
documented convention (first dim fastest over ranks; groups and keys follow the reversed
dim_names), independent of GridLayout's own arithmetic. Parity with Megatron-Core itself is
tested in test_megatron_enumeration_parity.py.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypergrid import GridLayout, HyperCommGrid, Partition
from hypergrid.layout import KEY_SEPARATOR, validate_shape_and_names

NAMES = ("tp", "cp", "ep", "dp", "pp", "xx")


# ---------------------------------------------------------------------------- references
def ref_rank(shape, coords, offset=0):
    rank, stride = offset, 1
    for size, c in zip(shape, coords):
        rank += c * stride
        stride *= size
    return rank


def ref_gen_rank_enum(shape, names, dims, offset=0):
    """Groups over `dims` taken as given (last fastest), the other dims in reversed-name order
    with the last of them fastest across groups: what einops produces in Megatron-Core."""
    idx = {n: i for i, n in enumerate(names)}
    rest = [n for n in reversed(names) if n not in dims]
    groups = []
    for outer in itertools.product(*(range(shape[idx[n]]) for n in rest)):
        group = []
        for inner in itertools.product(*(range(shape[idx[n]]) for n in dims)):
            coords = [0] * len(shape)
            for n, c in zip(rest, outer):
                coords[idx[n]] = c
            for n, c in zip(dims, inner):
                coords[idx[n]] = c
            group.append(ref_rank(shape, coords, offset))
        groups.append(group)
    return groups


def ref_enum(shape, names, dims, offset=0):
    dims = [dims] if isinstance(dims, str) else list(dims)
    ordered = [n for n in reversed(names) if n in dims]
    return ref_gen_rank_enum(shape, names, ordered, offset)


def group_set(groups):
    return {frozenset(g) for g in groups}


@st.composite
def layouts(draw, max_dims=4, max_size=64):
    ndims = draw(st.integers(1, max_dims))
    names = draw(st.permutations(NAMES))[:ndims]
    shape = []
    for _ in range(ndims):
        room = max_size // max(1, math.prod(shape))
        shape.append(draw(st.integers(1, max(1, min(4, room)))))
    offset = draw(st.integers(0, 9))
    return GridLayout(tuple(shape), tuple(names), offset)


@st.composite
def layouts_with_dims(draw):
    layout = draw(layouts())
    k = draw(st.integers(1, len(layout.dim_names)))
    dims = draw(st.permutations(layout.dim_names))[:k]
    return layout, list(dims)


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- basic facts
def test_basic_facts():
    layout = GridLayout((2, 3, 4, 5), ("tp", "cp", "pp", "dp"), rank_offset=7)
    assert layout.size == 120
    assert layout.strides == (1, 2, 6, 24)
    assert layout.ranks == range(7, 127)
    assert layout.dim_size("pp") == 4
    assert layout.contains(7) and layout.contains(126)
    assert not layout.contains(6) and not layout.contains(127)


def test_lists_are_normalised_to_tuples_and_equal_layouts_hash_equal():
    a = GridLayout([2, 4], ["tp", "dp"], 3)
    b = GridLayout((2, 4), ("tp", "dp"), 3)
    assert a.shape == (2, 4) and a.dim_names == ("tp", "dp")
    assert a == b and hash(a) == hash(b)
    assert a != GridLayout((2, 4), ("tp", "dp"), 0)
    assert a != GridLayout((4, 2), ("dp", "tp"), 3)


def test_docstring_example_numbers():
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    assert layout.coords(7) == (1, 0, 1)
    assert layout.group_ranks(["dp"], rank=7) == [1, 7, 13, 19]
    assert layout.enumerate(["tp", "cp"])[1] == [6, 7, 8, 9, 10, 11]
    assert layout.enumerate(["dp", "tp"]) == ref_enum((2, 3, 4), ("tp", "cp", "dp"), ["dp", "tp"])


# ---------------------------------------------------------------------------- coords / rank_of
@FAST
@given(layouts())
def test_coords_rank_of_round_trip(layout):
    seen = set()
    for rank in layout.ranks:
        coords = layout.coords(rank)
        assert len(coords) == len(layout.shape)
        assert all(0 <= c < s for c, s in zip(coords, layout.shape))
        assert layout.rank_of(coords) == rank
        assert layout.rank_of(list(coords)) == rank
        assert layout.rank_of(dict(zip(layout.dim_names, coords))) == rank
        assert ref_rank(layout.shape, coords, layout.rank_offset) == rank
        seen.add(coords)
    # a bijection between the span and the coordinate box
    assert len(seen) == layout.size


def test_rank_of_dict_in_any_key_order():
    layout = GridLayout((2, 3), ("tp", "dp"))
    assert layout.rank_of({"dp": 2, "tp": 1}) == 5


@pytest.mark.parametrize(
    "coords, exc, needle",
    [
        ((2, 0, 0), ValueError, "2"),  # tp coordinate out of range
        ((0, -1, 0), ValueError, "-1"),
        ((0, 0), ValueError, "[0, 0]"),  # too few
        ((0, 0, 0, 0), ValueError, "4"),  # too many
        ((0, True, 0), TypeError, "True"),  # bool is not an int
        ((0, 1.0, 0), TypeError, "1.0"),
        ({"tp": 0, "cp": 0}, ValueError, "['tp', 'cp', 'dp']"),  # missing dp
        ({"tp": 0, "cp": 0, "dp": 0, "zz": 0}, ValueError, "zz"),
        ("010", TypeError, "str"),
    ],
)
def test_rank_of_errors(coords, exc, needle):
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    with pytest.raises(exc) as info:
        layout.rank_of(coords)
    assert needle in str(info.value)


@pytest.mark.parametrize("rank", [-1, 3, 16, 100])
def test_coords_of_rank_outside_grid(rank):
    layout = GridLayout((2, 6), ("tp", "dp"), rank_offset=4)
    with pytest.raises(ValueError) as info:
        layout.coords(rank)
    assert str(rank) in str(info.value) and "[4, 16)" in str(info.value)
    with pytest.raises(ValueError) as info:
        layout.group_ranks("dp", rank)
    assert str(rank) in str(info.value)


@pytest.mark.parametrize("rank", [True, 1.0, "1", None])
def test_coords_rank_type(rank):
    layout = GridLayout((2, 2), ("tp", "dp"))
    with pytest.raises(TypeError) as info:
        layout.coords(rank)
    assert repr(rank) in str(info.value)


# ---------------------------------------------------------------------------- enumerations
@FAST
@given(layouts_with_dims())
def test_enumerate_matches_reference(layout_dims):
    layout, dims = layout_dims
    expected = ref_enum(layout.shape, layout.dim_names, dims, layout.rank_offset)
    assert layout.enumerate(dims) == expected
    # a tuple request is the same request
    assert layout.enumerate(tuple(dims)) == expected
    if len(dims) == 1:
        assert layout.enumerate(dims[0]) == expected


@FAST
@given(layouts_with_dims())
def test_gen_rank_enum_takes_dims_as_given(layout_dims):
    layout, dims = layout_dims
    assert layout.gen_rank_enum(dims) == ref_gen_rank_enum(
        layout.shape, layout.dim_names, dims, layout.rank_offset
    )


@FAST
@given(layouts_with_dims())
def test_group_ranks_index_and_counts(layout_dims):
    layout, dims = layout_dims
    enum = layout.enumerate(dims)
    size = math.prod(layout.dim_size(d) for d in dims)
    assert layout.group_size(dims) == size
    assert layout.num_groups(dims) == layout.size // size == len(enum)
    assert all(len(g) == size for g in enum)
    # the groups partition the span exactly
    flat = sorted(r for g in enum for r in g)
    assert flat == list(layout.ranks)
    for rank in layout.ranks:
        row = layout.group_index(dims, rank)
        assert 0 <= row < len(enum)
        assert rank in enum[row]
        assert layout.group_ranks(dims, rank) == enum[row]
        # the order the dims are given in does not matter
        assert layout.group_ranks(list(reversed(dims)), rank) == enum[row]
        assert layout.group_index(list(reversed(dims)), rank) == row


def test_group_index_example():
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    assert layout.group_index(["dp"], rank=7) == 1
    assert layout.enumerate("dp")[1] == [1, 7, 13, 19]
    # with every dim grouped there is one group
    assert layout.group_index(["tp", "cp", "dp"], rank=23) == 0
    assert layout.num_groups(["dp", "cp", "tp"]) == 1


def test_gen_rank_enum_docstring_example():
    layout = GridLayout((2, 2, 2), ("a", "b", "c"))
    assert layout.gen_rank_enum(["a", "b"]) == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert layout.gen_rank_enum(["b", "a"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ---------------------------------------------------------------------------- keys
@FAST
@given(layouts_with_dims())
def test_order_dims_and_key(layout_dims):
    layout, dims = layout_dims
    ordered, key = layout.order_dims(dims)
    expected = [n for n in reversed(layout.dim_names) if n in dims]
    assert ordered == expected
    assert key == KEY_SEPARATOR.join(expected)
    assert layout.key(dims) == key
    assert layout.key(list(reversed(dims))) == key


def test_key_example():
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    assert layout.key(["dp", "tp"]) == layout.key(["tp", "dp"]) == "dp-tp"
    assert layout.order_dims("cp") == (["cp"], "cp")


# ---------------------------------------------------------------------------- partitions
def _factorizations(n, max_dims=4):
    """Every ordered factorization of n into 1..max_dims factors >= 1 (1s included)."""
    out = []

    def rec(rest, prefix):
        if prefix and rest == 1:
            out.append(tuple(prefix))
        if len(prefix) == max_dims:
            return
        for f in range(1, rest + 1):
            if rest % f == 0 and not (f == 1 and rest == 1 and prefix and prefix[-1] == 1):
                rec(rest // f, prefix + [f])

    rec(n, [])
    return out


@pytest.mark.parametrize("span", [8, 12, 16])
def test_partition_equality_iff_same_groups(span):
    rng = random.Random(span)
    requests = []
    shapes = _factorizations(span)
    for shape in rng.sample(shapes, min(len(shapes), 25)):
        names = tuple(NAMES[: len(shape)])
        layout = GridLayout(shape, names)
        for k in range(1, len(names) + 1):
            for dims in itertools.combinations(names, k):
                requests.append((layout, list(dims)))
    rng.shuffle(requests)
    requests = requests[:150]
    compared = equal = 0
    for (la, da), (lb, db) in itertools.combinations(requests, 2):
        same_groups = group_set(la.enumerate(da)) == group_set(lb.enumerate(db))
        same_partition = la.partition(da) == lb.partition(db)
        assert same_groups == same_partition, (la, da, la.partition(da), lb, db, lb.partition(db))
        if same_partition:
            assert hash(la.partition(da)) == hash(lb.partition(db))
        compared += 1
        equal += same_groups
    # the sample must exercise both outcomes, or the test proves nothing
    assert compared > 1000 and 0 < equal < compared


@FAST
@given(layouts_with_dims())
def test_partition_facts(layout_dims):
    layout, dims = layout_dims
    part = layout.partition(dims)
    assert isinstance(part, Partition)
    assert part.group_size == layout.group_size(dims)
    assert part.rank_offset == layout.rank_offset and part.span == layout.size
    assert layout.partition(list(reversed(dims))) == part
    # a different offset is a different set of groups
    moved = GridLayout(layout.shape, layout.dim_names, layout.rank_offset + 1)
    assert moved.partition(dims) != part


def test_partition_examples():
    a = GridLayout((2, 2, 4), ("tp", "cp", "dp")).partition(["tp", "cp"])
    b = GridLayout((4, 4), ("tp", "dp")).partition(["tp"])
    assert a == b
    # size-1 dims do not change the groups
    c = GridLayout((2, 1, 2, 4), ("tp", "xx", "cp", "dp")).partition(["tp", "cp"])
    assert c == a
    # tp and dp are not contiguous when cp > 1: not the same as a 4-wide block
    d = GridLayout((2, 2, 4), ("tp", "cp", "dp")).partition(["tp", "dp"])
    assert d != a and d.group_size == 8


# ---------------------------------------------------------------------------- views
def test_check_view_accepts_refactorizations():
    dense = GridLayout((2, 2, 4), ("tp", "cp", "dp"), rank_offset=3)
    dense.check_view(GridLayout((4, 4), ("ep", "dp"), 3), shared_dims=["dp"])
    dense.check_view(GridLayout((2, 8), ("tp", "edp"), 3), shared_dims=["tp"])
    dense.check_view(GridLayout((16,), ("all",), 3))
    dense.check_view(dense, shared_dims=["tp", "cp", "dp"])


@pytest.mark.parametrize(
    "view, shared, needles",
    [
        (GridLayout((4, 2), ("ep", "dp"), 3), [], ["[3, 11)", "[3, 19)"]),  # smaller span
        (GridLayout((4, 4), ("ep", "dp"), 0), [], ["rank_offset 0", "[3, 19)"]),  # other offset
        (GridLayout((4, 4), ("ep", "dp"), 3), ["pp"], ["'pp'"]),  # shared dim in neither
        (GridLayout((4, 4), ("ep", "zz"), 3), ["dp"], ["'dp'"]),  # shared dim missing in view
        (GridLayout((4, 4), ("ep", "cp"), 3), ["cp"], ["'cp'", "(4, 4)", "(2, 2)"]),  # size+stride
        (GridLayout((2, 2, 4), ("cp", "tp", "dp"), 3), ["tp"], ["'tp'", "(2, 2)", "(2, 1)"]),  # stride
        (GridLayout((4, 2, 2), ("ep", "dp", "xx"), 3), ["dp"], ["'dp'", "(2, 4)", "(4, 4)"]),
    ],
)
def test_check_view_errors(view, shared, needles):
    dense = GridLayout((2, 2, 4), ("tp", "cp", "dp"), rank_offset=3)
    with pytest.raises(ValueError) as info:
        dense.check_view(view, shared_dims=shared)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "shape, names, exc, needles",
    [
        ([], [], ValueError, ["empty"]),
        ([2, 2], ["tp"], ValueError, ["[2, 2]", "['tp']"]),
        ([2], ["tp", "dp"], ValueError, ["[2]", "['tp', 'dp']"]),
        ([2, 0], ["tp", "dp"], ValueError, ["'dp'", "got 0"]),
        ([2, -3], ["tp", "dp"], ValueError, ["'dp'", "-3"]),
        ([2.0, 2], ["tp", "dp"], TypeError, ["'tp'", "2.0"]),
        ([True, 2], ["tp", "dp"], TypeError, ["'tp'", "True"]),
        ([2, "4"], ["tp", "dp"], TypeError, ["'dp'", "'4'"]),
        ([2, None], ["tp", "dp"], TypeError, ["'dp'", "None"]),
        ("24", ["tp", "dp"], TypeError, ["'24'"]),
        (None, ["tp"], TypeError, ["None"]),
        (8, ["tp"], TypeError, ["8"]),
        ([2], "tp", TypeError, ["'tp'"]),
        ([2, 2], ["tp", "tp"], ValueError, ["'tp'", "twice"]),
        ([2, 2, 2], ["tp", "dp", "tp"], ValueError, ["'tp'"]),
        ([2, 2], ["tp", 3], TypeError, ["3", "int"]),
        ([2, 2], ["tp", None], TypeError, ["None"]),
        ([2, 2], ["tp", b"dp"], TypeError, ["b'dp'"]),
        ([2, 2], ["tp", "e-p"], ValueError, ["'e-p'", "'-'"]),
        ([2, 2], ["tp-cp", "dp"], ValueError, ["'tp-cp'"]),
        ([2, 2], ["tp", ""], ValueError, ["''"]),
        ([2, 2], ["tp", "  "], ValueError, ["'  '"]),
    ],
)
def test_shape_and_names_validation(shape, names, exc, needles):
    for build in (
        lambda: validate_shape_and_names(shape, names),
        lambda: GridLayout(shape, names),
        lambda: HyperCommGrid(shape, names, world_size=1 << 20),
    ):
        with pytest.raises(exc) as info:
            build()
        for needle in needles:
            assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize(
    "offset, exc, needle",
    [(-1, ValueError, "-1"), (-100, ValueError, "-100"), (1.5, TypeError, "1.5"), (True, TypeError, "True"),
     ("2", TypeError, "'2'"), (None, TypeError, "None")],
)
def test_rank_offset_validation(offset, exc, needle):
    for build in (
        lambda: GridLayout((2, 2), ("tp", "dp"), offset),
        lambda: HyperCommGrid([2, 2], ["tp", "dp"], offset, world_size=1 << 20),
    ):
        with pytest.raises(exc) as info:
            build()
        assert needle in str(info.value) and "rank_offset" in str(info.value)


REQUEST_CALLS = {
    "order_dims": lambda layout, d: layout.order_dims(d),
    "key": lambda layout, d: layout.key(d),
    "enumerate": lambda layout, d: layout.enumerate(d),
    "gen_rank_enum": lambda layout, d: layout.gen_rank_enum(d if isinstance(d, list) else [d]),
    "group_ranks": lambda layout, d: layout.group_ranks(d, 0),
    "group_index": lambda layout, d: layout.group_index(d, 0),
    "group_size": lambda layout, d: layout.group_size(d),
    "num_groups": lambda layout, d: layout.num_groups(d),
    "partition": lambda layout, d: layout.partition(d),
}


@pytest.mark.parametrize("call", sorted(REQUEST_CALLS))
@pytest.mark.parametrize(
    "dims, exc, needles",
    [
        ("ep", ValueError, ["'ep'", "['tp', 'cp', 'dp']"]),
        (["tp", "ep"], ValueError, ["'ep'"]),
        (["tp", "tp"], ValueError, ["'tp'", "more than once"]),
        (["dp", "cp", "dp"], ValueError, ["'dp'"]),
        ([], ValueError, ["[]"]),
        (["tp", 3], TypeError, ["3"]),
        (["tp", None], TypeError, ["None"]),
    ],
)
def test_dims_request_validation(call, dims, exc, needles):
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    with pytest.raises(exc) as info:
        REQUEST_CALLS[call](layout, dims)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize("dims", [3, None, {"tp"}, ("tp", "dp").__iter__()])
def test_dims_request_type(dims):
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    with pytest.raises(TypeError) as info:
        layout.order_dims(dims)
    assert type(dims).__name__ in str(info.value)


def test_dim_size_unknown():
    with pytest.raises(ValueError) as info:
        GridLayout((2, 2), ("tp", "dp")).dim_size("pp")
    assert "'pp'" in str(info.value)


def test_layout_is_frozen():
    layout = GridLayout((2, 2), ("tp", "dp"))
    with pytest.raises(AttributeError):
        layout.shape = (4,)  # type: ignore[misc]
