"""Property-based fuzzing of the public entry points with generated invalid input.

Each test starts from a valid call, spoils one argument with generated garbage (negatives, zero,
bools, floats, None, strings, bytes, nested lists, huge ints, names with '-', duplicates, empty
lists, unicode, arbitrary objects) and checks that the library raises only the types the
conventions promise (ValueError, TypeError, KeyError, hypergrid's own errors), the specific one
for that kind of mistake, and a message that shows the offending value. A second kind of test
throws garbage at every argument at once and checks only that nothing but those types escapes.

``COUNTS`` records how many invalid inputs each entry point was given; the last test prints the
table (``pytest -s``) and checks the total.
"""

from __future__ import annotations

import collections
import contextlib
import io
import math
import subprocess
import sys
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hypergrid import GridLayout, HyperCommGrid, device_mesh
from hypergrid.errors import GridTooLargeError, HypergridError
from hypergrid.layout import RESERVED_NAME_CHARACTERS

from .harness import fake_world

#: Hypothesis with hundreds of examples per test, and CLI subprocesses: some 20 s (tests/README.md).
pytestmark = pytest.mark.slow

#: Invalid inputs tried, by entry point.
COUNTS: collections.Counter = collections.Counter()

ALLOWED = (ValueError, TypeError, KeyError, HypergridError)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


def _message(exc: BaseException) -> str:
    # KeyError's str() is the repr of its argument; the text the user reads is the argument.
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


def _shown(value: object, message: str) -> bool:
    """Whether ``message`` shows ``value`` (as str or repr; floats also as their int-free repr)."""
    candidates = {str(value), repr(value)}
    if isinstance(value, float) and math.isnan(value):
        candidates.add("nan")
    return any(c in message for c in candidates)


def check(entry: str, call, expected=ALLOWED, shows=(), count: bool = True):
    """Call ``call()``; it must raise one of ``expected`` (all of them allowed types) showing ``shows``."""
    if count:
        COUNTS[entry] += 1
    try:
        call()
    except ALLOWED as exc:
        if not isinstance(exc, expected):
            pytest.fail(f"{entry}: expected {expected}, got {type(exc).__name__}: {exc}")
        message = _message(exc)
        for value in shows:
            assert _shown(value, message), f"{entry}: message does not show {value!r}: {message}"
        return exc
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{entry}: undocumented exception {type(exc).__name__}: {exc!r}")
    pytest.fail(f"{entry}: no exception for invalid input")


def survive(entry: str, call):
    """Call ``call()`` on arbitrary input: success or an allowed exception, nothing else."""
    COUNTS[entry] += 1
    try:
        call()
    except ALLOWED:
        pass
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{entry}: undocumented exception {type(exc).__name__}: {exc!r}")


# ----------------------------------------------------------------------------- generators
NAME_ALPHABET = st.characters(blacklist_categories=("Cs",), blacklist_characters=RESERVED_NAME_CHARACTERS)
names = st.text(NAME_ALPHABET, min_size=1, max_size=6).filter(lambda s: not any(c.isspace() for c in s))
huge = st.integers(min_value=2**63, max_value=2**200)

#: Anything but an int (bools included: a size of True is a bug).
not_int = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.binary(max_size=4),
    st.lists(st.integers(-3, 3), max_size=3),
    st.tuples(st.integers(0, 4)),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.frozensets(st.integers(), max_size=2),
    st.just(object()),
    st.complex_numbers(allow_nan=False, allow_infinity=False),
)
not_positive = st.integers(max_value=0) | st.integers(min_value=-(2**200), max_value=-(2**63))
not_str = st.one_of(
    st.none(), st.booleans(), st.integers(), huge, st.floats(), st.binary(max_size=4),
    st.lists(st.text(max_size=2), max_size=2), st.tuples(st.text(max_size=2)), st.just(object()),
)
#: Strings that are no usable dim name.
bad_name_str = st.one_of(
    st.just(""),
    st.text(st.sampled_from(" \t\n\u00a0\u2003"), min_size=1, max_size=3),
    st.builds(lambda a, b: f"{a}-{b}", st.text(max_size=3), st.text(max_size=3)),
    # hypergrid's own key characters ("expert:tp", "embd(pp)") and spaces inside a name
    st.builds(lambda a, c, b: f"{a}{c}{b}", st.text(max_size=3), st.sampled_from(list(RESERVED_NAME_CHARACTERS) + [" ", "\t"]), st.text(max_size=3)),
)
#: Anything at all, for the everything-at-once tests.
garbage = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), huge, st.floats(), st.text(max_size=4),
        st.binary(max_size=3), st.just(object()), st.sampled_from(["tp", "dp", "cp", "tp-dp", ""]),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=2), inner, max_size=2),
    max_leaves=6,
)


@st.composite
def valid_grids(draw, max_dims: int = 4):
    """(shape, dim_names) of a small valid grid."""
    n = draw(st.integers(1, max_dims))
    shape = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    dim_names = draw(st.lists(names, min_size=n, max_size=n, unique=True))
    return shape, dim_names


def _grid(shape, dim_names, **kwargs):
    return HyperCommGrid(shape, dim_names, world_size=math.prod(shape) + kwargs.pop("extra", 0), **kwargs)


# ----------------------------------------------------------------------------- constructor
@FUZZ
@given(valid_grids(), st.data())
def test_constructor_bad_shape_element(grid, data):
    shape, dim_names = grid
    i = data.draw(st.integers(0, len(shape) - 1))
    bad = data.draw(not_int | not_positive)
    shape = list(shape)
    shape[i] = bad
    expected = ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    check("HyperCommGrid(shape=)", lambda: HyperCommGrid(shape, dim_names, world_size=8), expected, [bad])
    check("GridLayout(shape=)", lambda: GridLayout(tuple(shape), tuple(dim_names)), expected, [bad])


@FUZZ
@given(st.one_of(not_int.filter(lambda v: not isinstance(v, (list, tuple))), st.text(max_size=4)), valid_grids())
def test_constructor_shape_not_a_list(shape, grid):
    check("HyperCommGrid(shape=)", lambda: HyperCommGrid(shape, grid[1], world_size=8), TypeError, [shape])


@FUZZ
@given(valid_grids(), st.data())
def test_constructor_bad_dim_name(grid, data):
    shape, dim_names = grid
    i = data.draw(st.integers(0, len(shape) - 1))
    kind = data.draw(st.sampled_from(["type", "value", "duplicate"]))
    dim_names = list(dim_names)
    if kind == "duplicate":
        assume(len(dim_names) > 1)
        j = data.draw(st.integers(0, len(dim_names) - 1).filter(lambda j: j != i))
        dim_names[i] = dim_names[j]
        bad, expected = dim_names[j], ValueError
    elif kind == "type":
        bad, expected = data.draw(not_str), TypeError
        dim_names[i] = bad
    else:
        bad, expected = data.draw(bad_name_str), ValueError
        dim_names[i] = bad
    check("HyperCommGrid(dim_names=)", lambda: HyperCommGrid(shape, dim_names, world_size=64), expected, [bad])


@FUZZ
@given(valid_grids(), st.integers(0, 3), st.data())
def test_constructor_length_mismatch_and_empty(grid, extra, data):
    shape, dim_names = grid
    if extra == 0:
        check("HyperCommGrid(shape=)", lambda: HyperCommGrid([], [], world_size=8), ValueError)
        check("HyperCommGrid(dim_names=)", lambda: HyperCommGrid(shape, [], world_size=64), ValueError, [len(shape)])
        return
    longer = list(dim_names) + [f"extra{k}" for k in range(extra)]
    check("HyperCommGrid(dim_names=)", lambda: HyperCommGrid(shape, longer, world_size=64), ValueError,
          [len(shape), len(longer)])
    check("HyperCommGrid(shape=)", lambda: HyperCommGrid(list(shape) + [2] * extra, dim_names, world_size=64),
          ValueError, [len(dim_names)])


@FUZZ
@given(valid_grids(), not_int | st.integers(max_value=-1) | huge)
def test_constructor_bad_rank_offset(grid, offset):
    shape, dim_names = grid
    size = math.prod(shape)
    if isinstance(offset, int) and not isinstance(offset, bool):
        # Negative: a bad value; huge: a grid that does not fit in the world.
        expected = ValueError if offset < 0 else GridTooLargeError
    else:
        expected = TypeError
    check("HyperCommGrid(rank_offset=)", lambda: HyperCommGrid(shape, dim_names, offset, world_size=size), expected, [offset])


@FUZZ
@given(valid_grids(), not_str.filter(lambda v: v is not None))
def test_constructor_bad_backend(grid, backend):
    shape, dim_names = grid
    check("HyperCommGrid(backend=)", lambda: _grid(shape, dim_names, backend=backend), TypeError, [backend])


@FUZZ
@given(valid_grids(), not_int.filter(lambda v: v is not None) | not_positive | st.data())
def test_constructor_bad_world_size(grid, world):
    shape, dim_names = grid
    size = math.prod(shape)
    if isinstance(world, st.DataObject):
        # A world too small for the grid: Megatron raises RuntimeError, hypergrid a subclass of both.
        world = world.draw(st.integers(1, size - 1)) if size > 1 else None
        assume(world is not None)
        exc = check("HyperCommGrid(world_size=)", lambda: HyperCommGrid(shape, dim_names, world_size=world),
                    GridTooLargeError, [world, size])
        assert isinstance(exc, RuntimeError)
        return
    expected = ValueError if isinstance(world, int) and not isinstance(world, bool) else TypeError
    check("HyperCommGrid(world_size=)", lambda: HyperCommGrid(shape, dim_names, world_size=world), expected, [world])


@FUZZ
@given(
    valid_grids(),
    st.text(max_size=8).filter(lambda s: s not in ("auto", "local", "enumerate", "split"))
    | not_str.filter(lambda v: v is not None),  # None: the process-wide default
)
def test_constructor_bad_strategy(grid, strategy):
    shape, dim_names = grid
    expected = ValueError if isinstance(strategy, str) else TypeError
    check("HyperCommGrid(strategy=)", lambda: _grid(shape, dim_names, strategy=strategy), expected, [strategy])


@FUZZ
@given(valid_grids(), not_int.filter(lambda v: v is not None) | st.integers() | st.timedeltas(max_value=timedelta(0)))
def test_constructor_bad_timeout(grid, timeout):
    shape, dim_names = grid
    expected = ValueError if isinstance(timeout, timedelta) else TypeError
    check("HyperCommGrid(timeout=)", lambda: _grid(shape, dim_names, timeout=timeout), expected, [timeout])


@FUZZ
@given(valid_grids(), not_int.filter(lambda v: not isinstance(v, bool)) | st.integers())
def test_constructor_bad_check_agreement(grid, flag):
    shape, dim_names = grid
    check("HyperCommGrid(check_agreement=)", lambda: _grid(shape, dim_names, check_agreement=flag), TypeError, [flag])


@settings(FUZZ, max_examples=400)
@given(garbage, garbage, garbage, garbage, garbage)
def test_constructor_everything_garbage(shape, dim_names, rank_offset, backend, world_size):
    survive("HyperCommGrid(everything)", lambda: HyperCommGrid(shape, dim_names, rank_offset, backend, world_size=world_size))
    survive("GridLayout(everything)", lambda: GridLayout(shape, dim_names, rank_offset))


# ----------------------------------------------------------------------------- dims requests
@st.composite
def bad_dims(draw, dim_names):
    """(dims, expected exception, value the message must show) for a grid with ``dim_names``."""
    kind = draw(st.sampled_from(["type", "element-type", "unknown", "duplicate", "empty"]))
    if kind == "type":
        dims = draw(st.one_of(st.none(), st.booleans(), st.integers(), huge, st.floats(), st.binary(max_size=3),
                              st.sets(st.sampled_from(dim_names), max_size=2), st.dictionaries(st.sampled_from(dim_names), st.integers(), max_size=1),
                              st.just(object())))
        return dims, TypeError, dims
    if kind == "element-type":
        bad = draw(not_str)
        dims = draw(st.lists(st.sampled_from(dim_names), max_size=2, unique=True))
        dims.insert(draw(st.integers(0, len(dims))), bad)
        return dims, TypeError, bad
    if kind == "unknown":
        bad = draw(st.text(max_size=5) | bad_name_str)
        assume(bad not in dim_names)
        dims = draw(st.lists(st.sampled_from(dim_names), max_size=2, unique=True))
        dims.insert(draw(st.integers(0, len(dims))), bad)
        wrap = draw(st.sampled_from([list, tuple, "single"]))
        dims = bad if wrap == "single" else wrap(dims)
        return dims, ValueError, bad
    if kind == "duplicate":
        name = draw(st.sampled_from(dim_names))
        return [name, name], ValueError, name
    return draw(st.sampled_from([[], ()])), ValueError, None


DIM_METHODS = {
    "get_rank_enum": lambda g, d: g.get_rank_enum(d),
    "_order_dims": lambda g, d: g._order_dims(d),
    "_gen_rank_enum": lambda g, d: g._gen_rank_enum(d),
    "ranks": lambda g, d: g.ranks(d, rank=g.rank_offset),
    "create_pg": lambda g, d: g.create_pg(d),
    "get_pg": lambda g, d: g.get_pg(d),
    "get_or_create_pg": lambda g, d: g.get_or_create_pg(d),
    "GridLayout.key": lambda g, d: g.layout.key(d),
    "GridLayout.enumerate": lambda g, d: g.layout.enumerate(d),
    "GridLayout.group_ranks": lambda g, d: g.layout.group_ranks(d, g.rank_offset),
    "GridLayout.group_index": lambda g, d: g.layout.group_index(d, g.rank_offset),
    "GridLayout.group_size": lambda g, d: g.layout.group_size(d),
    "GridLayout.num_groups": lambda g, d: g.layout.num_groups(d),
    "GridLayout.partition": lambda g, d: g.layout.partition(d),
}


@settings(FUZZ, max_examples=120)
@given(valid_grids(), st.integers(0, 5), st.data())
def test_bad_dims_every_method(grid, offset, data):
    shape, dim_names = grid
    g = _grid(shape, dim_names, rank_offset=offset, extra=offset)
    dims, expected, shown = data.draw(bad_dims(dim_names))
    for entry, method in DIM_METHODS.items():
        check(entry + "(dims=)", lambda: method(g, dims), expected, [] if shown is None else [shown])


@FUZZ
@given(valid_grids(), st.data())
def test_get_pg_of_a_group_never_created(grid, data):
    shape, dim_names = grid
    g = _grid(shape, dim_names)
    dims = data.draw(st.lists(st.sampled_from(dim_names), min_size=1, unique=True))
    key = g._order_dims(dims)[1]
    check("get_pg(dims=)", lambda: g.get_pg(dims), KeyError, [key])


@FUZZ
@given(valid_grids(), st.integers(0, 5), not_int.filter(lambda v: v is not None) | st.integers(max_value=-1) | huge | st.data())
def test_bad_rank(grid, offset, rank):
    shape, dim_names = grid
    g = _grid(shape, dim_names, rank_offset=offset, extra=offset)
    if isinstance(rank, st.DataObject):
        rank = rank.draw(st.integers(-50, offset - 1) | st.integers(offset + g.size, offset + g.size + 50))
    expected = ValueError if isinstance(rank, int) and not isinstance(rank, bool) else TypeError
    check("ranks(rank=)", lambda: g.ranks(dim_names[0], rank=rank), expected, [rank])
    check("coords(rank=)", lambda: g.coords(rank), expected, [rank])
    check("GridLayout.coords", lambda: g.layout.coords(rank), expected, [rank])
    check("GridLayout.group_ranks(rank=)", lambda: g.layout.group_ranks(dim_names, rank), expected, [rank])
    if expected is TypeError:
        check("GridLayout.contains", lambda: g.layout.contains(rank), TypeError, [rank])


@FUZZ
@given(valid_grids(), st.data())
def test_bad_rank_of(grid, data):
    shape, dim_names = grid
    layout = GridLayout(tuple(shape), tuple(dim_names))
    kind = data.draw(st.sampled_from(["type", "length", "value", "element-type", "dict-keys"]))
    coords = [data.draw(st.integers(0, s - 1)) for s in shape]
    if kind == "type":
        bad = data.draw(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.frozensets(st.integers(), max_size=2)))
        check("GridLayout.rank_of", lambda: layout.rank_of(bad), TypeError, [bad])
    elif kind == "length":
        longer = coords + [0] * data.draw(st.integers(1, 3))
        check("GridLayout.rank_of", lambda: layout.rank_of(longer), ValueError, [longer])
    elif kind in ("value", "element-type"):
        i = data.draw(st.integers(0, len(shape) - 1))
        bad = data.draw(st.integers(shape[i], 2**70) | st.integers(max_value=-1)) if kind == "value" else data.draw(not_int)
        coords[i] = bad
        check("GridLayout.rank_of", lambda: layout.rank_of(coords), ValueError if kind == "value" else TypeError, [bad])
        as_dict = dict(zip(dim_names, coords))
        check("GridLayout.rank_of", lambda: layout.rank_of(as_dict), ValueError if kind == "value" else TypeError, [bad])
    else:
        keys = data.draw(st.lists(st.text(max_size=3) | st.integers(), min_size=0, max_size=4, unique=True))
        assume(set(keys) != set(dim_names))
        check("GridLayout.rank_of", lambda: layout.rank_of({k: 0 for k in keys}), ValueError)


@FUZZ
@given(valid_grids(), garbage)
def test_bad_view_argument(grid, view):
    shape, dim_names = grid
    g = _grid(shape, dim_names)
    assume(view is not None)
    expected = KeyError if isinstance(view, str) else TypeError
    for entry, call in {
        "get_rank_enum(view=)": lambda: g.get_rank_enum(dim_names[0], view=view),
        "ranks(view=)": lambda: g.ranks(dim_names[0], rank=0, view=view),
        "coords(view=)": lambda: g.coords(0, view=view),
        "create_pg(view=)": lambda: g.create_pg(dim_names[0], view=view),
        "get_pg(view=)": lambda: g.get_pg(dim_names[0], view=view),
        "get_or_create_pg(view=)": lambda: g.get_or_create_pg(dim_names[0], view=view),
    }.items():
        check(entry, call, expected, [view])


# ----------------------------------------------------------------------------- views
@settings(FUZZ, max_examples=300)
@given(valid_grids(max_dims=3), st.data())
def test_register_view_bad_input(grid, data):
    shape, dim_names = grid
    g = _grid(shape, dim_names)
    size = g.size
    kind = data.draw(st.sampled_from(
        ["name-type", "name-empty", "name-dup", "shape", "dim_names", "span", "shared-type", "shared-element", "shared-unknown", "shared-mismatch"]
    ))
    view_shape, view_names = [size], ["vw"]
    if kind == "name-type":
        bad = data.draw(not_str)
        check("register_view(name=)", lambda: g.register_view(bad, view_shape, view_names), TypeError, [bad])
    elif kind == "name-empty":
        check("register_view(name=)", lambda: g.register_view("", view_shape, view_names), ValueError, [""])
    elif kind == "name-dup":
        # A name taken ("base" is the grid's own) is a ValueError, as in Megatron-Core 0.17+.
        name = data.draw(st.text(min_size=1, max_size=4).filter(lambda n: n != "base"))
        g.register_view(name, view_shape, view_names)
        check("register_view(name=)", lambda: g.register_view(name, view_shape, view_names), ValueError, [name])
        check("register_view(name=)", lambda: g.register_view("base", view_shape, view_names), ValueError, ["base"])
    elif kind == "shape":
        bad = data.draw(not_int | not_positive)
        expected = ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
        check("register_view(shape=)", lambda: g.register_view("v", [bad], view_names), expected, [bad])
    elif kind == "dim_names":
        bad = data.draw(not_str | bad_name_str)
        expected = ValueError if isinstance(bad, str) else TypeError
        check("register_view(dim_names=)", lambda: g.register_view("v", view_shape, [bad]), expected, [bad])
    elif kind == "span":
        other = data.draw(st.integers(1, 4 * size).filter(lambda n: n != size))
        check("register_view(shape=)", lambda: g.register_view("v", [other], view_names), ValueError, [other])
    elif kind == "shared-type":
        bad = data.draw(st.one_of(st.integers(), st.floats(), st.booleans(), st.just(object()), st.frozensets(st.text(max_size=2), max_size=2)))
        check("register_view(shared_dims=)", lambda: g.register_view("v", view_shape, view_names, bad), TypeError, [bad])
    elif kind == "shared-element":
        bad = data.draw(not_str)
        check("register_view(shared_dims=)", lambda: g.register_view("v", view_shape, view_names, [bad]), TypeError, [bad])
    elif kind == "shared-unknown":
        bad = data.draw(st.text(max_size=4))
        assume(bad not in dim_names and bad != "vw")
        check("register_view(shared_dims=)", lambda: g.register_view("v", view_shape, view_names, [bad]), ValueError, [bad])
    else:
        # A dim of both with a different size or stride: its groups would differ.
        assume(len(shape) > 1 and shape[0] > 1)
        last = dim_names[-1]
        check("register_view(shared_dims=)",
              lambda: g.register_view("v", [size // shape[-1] * shape[-1]], [last], [last]), ValueError, [last])
    # A failed registration leaves nothing behind.
    assert "v" not in g.views


@FUZZ
@given(valid_grids(max_dims=3), garbage)
def test_check_view_garbage(grid, view):
    layout = GridLayout(tuple(grid[0]), tuple(grid[1]))
    check("GridLayout.check_view", lambda: layout.check_view(view), TypeError, [view])


@settings(FUZZ, max_examples=150)
@given(valid_grids(max_dims=3), garbage, garbage, garbage, garbage, garbage)
def test_views_everything_garbage(grid, name, shape, dim_names, shared, dims):
    g = _grid(*grid)
    survive("register_view(everything)", lambda: g.register_view(name, shape, dim_names, shared))
    survive("get_rank_enum(everything)", lambda: g.get_rank_enum(dims, view=name))
    rank = 0 if shape is None else shape  # None means "this rank", unknown without a world
    survive("ranks(everything)", lambda: g.ranks(dims, rank=rank, view=name))
    survive("coords(everything)", lambda: g.coords(rank, view=name))
    survive("get_pg(everything)", lambda: g.get_pg(dims, view=name))
    survive("_gen_rank_enum(everything)", lambda: g._gen_rank_enum(dims))


# ----------------------------------------------------------------------------- create_pg options
@pytest.fixture(scope="module")
def fake16():
    with fake_world(rank=5, world_size=16):
        yield


@settings(FUZZ, max_examples=250)
@given(st.data())
def test_create_pg_bad_options(fake16, data):
    from hypergrid.runtime.registry import REGISTRY

    g = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
    before = REGISTRY.count()
    try:
        kind = data.draw(st.sampled_from(["timeout-type", "timeout-value", "group_desc", "backend", "private", "kwarg", "duplicate"]))
        if kind == "timeout-type":
            bad = data.draw(not_int.filter(lambda v: v is not None) | st.integers())
            check("create_pg(timeout=)", lambda: g.create_pg("dp", timeout=bad), TypeError, [bad])
        elif kind == "timeout-value":
            bad = data.draw(st.timedeltas(max_value=timedelta(0)))
            check("create_pg(timeout=)", lambda: g.create_pg("dp", timeout=bad), ValueError, [bad])
        elif kind == "group_desc":
            bad = data.draw(not_str.filter(lambda v: v is not None))
            check("create_pg(group_desc=)", lambda: g.create_pg("dp", group_desc=bad), TypeError, [bad])
        elif kind == "backend":
            bad = data.draw(not_str.filter(lambda v: v is not None))
            check("create_pg(backend=)", lambda: g.create_pg("dp", backend=bad), TypeError, [bad])
        elif kind == "private":
            bad = data.draw(not_int.filter(lambda v: not isinstance(v, bool)) | st.integers())
            check("create_pg(private=)", lambda: g.create_pg("dp", private=bad), TypeError, [bad])
        elif kind == "kwarg":
            name = data.draw(st.text(min_size=1, max_size=6).filter(lambda s: s not in ("timeout", "pg_options", "group_desc", "backend", "view", "private")))
            check("create_pg(**kwargs)", lambda: g.create_pg("dp", **{name: 1}), TypeError, [name])
        else:
            dims = data.draw(st.permutations(["tp", "cp", "dp"]).map(lambda p: p[: data.draw(st.integers(1, 3))]))
            g.create_pg(dims)
            COUNTS["create_pg(duplicate)"] += 1
            again = data.draw(st.permutations(dims))
            check("create_pg(dims=)", lambda: g.create_pg(again), KeyError, [g._order_dims(dims)[1]], count=False)
        # A refused request creates nothing.
        assert REGISTRY.count() - before <= (1 if kind == "duplicate" else 0)
    finally:
        g.destroy()


@settings(FUZZ, max_examples=60)
@given(garbage)
def test_create_pg_garbage_pg_options(fake16, options):
    g = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
    try:
        survive("create_pg(pg_options=)", lambda: g.create_pg("dp", pg_options=options))
    finally:
        g.destroy()


# ----------------------------------------------------------------------------- adapters (if present)
def _megatron():
    try:
        from hypergrid import megatron
        from hypergrid.megatron import MEGATRON_KEYWORDS, destroy_model_parallel, initialize_model_parallel  # noqa: F401
    except ImportError:
        return None
    return megatron


@settings(FUZZ, max_examples=150)
@given(st.data(), garbage | not_positive | st.integers(17, 2**70))
def test_megatron_initialize_garbage(fake16, data, bad):
    megatron = _megatron()
    if megatron is None:
        pytest.skip("hypergrid.megatron.initialize_model_parallel does not exist yet")
    # create_gloo_process_groups is left off: True makes real gloo groups, which the fake world cannot.
    names = [n for n in megatron.MEGATRON_KEYWORDS if n != "create_gloo_process_groups"]
    name = data.draw(st.sampled_from(names + ["share_groups", "strategy", "check_agreement", "not_a_keyword"]))
    COUNTS[f"initialize_model_parallel({name}=)"] += 1
    try:
        megatron.initialize_model_parallel(create_gloo_process_groups=False, **{name: bad})
    except ALLOWED:
        pass
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"initialize_model_parallel({name}={bad!r}): undocumented exception {type(exc).__name__}: {exc!r}")
    finally:
        megatron.destroy_model_parallel()


@settings(FUZZ, max_examples=60)
@given(st.sampled_from(["tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                        "expert_model_parallel_size", "expert_tensor_parallel_size"]),
       not_positive | st.integers(17, 2**70) | st.sampled_from([3, 5, 6, 7]))
def test_megatron_initialize_bad_sizes(fake16, name, bad):
    megatron = _megatron()
    if megatron is None:
        pytest.skip("hypergrid.megatron.initialize_model_parallel does not exist yet")
    try:
        # Sizes that are not positive or do not divide the 16-rank world are configuration errors.
        check(f"initialize_model_parallel({name}=)",
              lambda: megatron.initialize_model_parallel(create_gloo_process_groups=False, **{name: bad}),
              ValueError, [bad])
    finally:
        megatron.destroy_model_parallel()


@settings(FUZZ, max_examples=60)
@given(garbage, garbage, garbage)
def test_device_mesh_garbage(fake16, dims, device_type, flatten):
    g = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"])
    try:
        survive("device_mesh(...)", lambda: device_mesh(g, dims, device_type=device_type, flatten=flatten))
    finally:
        g.destroy()


# ----------------------------------------------------------------------------- the command line
def _cli_main():
    try:
        from hypergrid.app.cli import main
    except ImportError:
        return None
    return main


CLI_FLAGS = ["--world-size", "--tp", "--pp", "--cp", "--ep", "--etp", "--order", "--shape", "--dims", "--group",
             "--rank", "--gpus-per-node", "--format"]
cli_values = st.one_of(
    st.integers(-5, 0).map(str), st.just("0"), st.just("-1"), st.just("1.5"), st.just(""), st.just("x"),
    st.just("2,,3"), st.just("tp,tp"), st.just("tp-dp"), st.just("a,b,c"), st.just("3,5,7"),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6),
)


@settings(FUZZ, max_examples=250)
@given(st.lists(st.tuples(st.sampled_from(CLI_FLAGS), cli_values), min_size=1, max_size=4))
def test_cli_plan_bad_input_in_process(pairs):
    main = _cli_main()
    if main is None:
        pytest.skip("hypergrid.app.cli does not exist yet")
    argv = ["plan"]
    for flag, value in pairs:
        argv += [flag, value] if not value.startswith("-") else [f"{flag}={value}"]
    COUNTS["cli plan"] += 1
    out_buf, err_buf = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
            status = main(argv)
    except SystemExit as exc:  # argparse's own --help / version paths
        status = exc.code
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"cli plan {argv}: exception escaped: {type(exc).__name__}: {exc!r}")
    out, err = out_buf.getvalue(), err_buf.getvalue()
    assert "Traceback" not in out + err
    if status == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("hypergrid: error: "), (argv, err)
    else:
        assert status == 0, (argv, status, err)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--shape", "2,3", "--dims", "tp,tp"],
        ["plan", "--world-size", "7", "--tp", "2"],
        ["plan", "--nonsense"],
    ],
)
def test_cli_plan_bad_input_subprocess(argv):
    if _cli_main() is None:
        pytest.skip("hypergrid.app.cli does not exist yet")
    COUNTS["cli plan (subprocess)"] += 1
    proc = subprocess.run([sys.executable, "-m", "hypergrid", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (argv, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hypergrid: error: "), proc.stderr


@pytest.mark.parametrize("argv", [["plan", "--world-size", str(2**80)], ["plan", "--shape", str(2**80), "--dims", "a"]])
def test_cli_plan_huge_world_is_refused_quickly(argv):
    if _cli_main() is None:
        pytest.skip("hypergrid.app.cli does not exist yet")
    proc = subprocess.run([sys.executable, "-m", "hypergrid", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hypergrid: error: ") and str(2**80) in lines[0], proc.stderr


# ----------------------------------------------------------------------------- the tally
def test_zz_invalid_input_count():
    """Prints how many invalid inputs each entry point got; run with ``-s`` to see the table."""
    if not COUNTS:
        pytest.skip("no fuzz test ran before this one (run the whole module)")
    width = max(map(len, COUNTS))
    print("\ninvalid inputs tried, by entry point:")
    for entry, n in sorted(COUNTS.items()):
        print(f"  {entry:<{width}}  {n:6d}")
    total = sum(COUNTS.values())
    print(f"  {'total':<{width}}  {total:6d}")
    # Every check() counted an input that raised as documented; a run of the whole module must
    # have exercised thousands of them.
    if len(COUNTS) > 20:
        assert total >= 3000, total
