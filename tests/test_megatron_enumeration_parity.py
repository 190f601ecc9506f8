"""Differential tests against the installed megatron-core: enumerations equal, rank for rank.

Compared with Megatron-Core's own code, not a copy of it:

* ``megatron.core.hyper_comm_grid.HyperCommGrid``: ``get_rank_enum``, ``_gen_rank_enum`` (dims
  in the order given), ``_order_dims`` (ordered dims and key; 0.16) or ``_order_dims_for`` and
  ``_gen_rank_enum_for`` (0.17+), ``rank_offset`` included;
* ``megatron.core.parallel_state.RankGenerator(...).get_ranks(token)`` for every order of
  ``tp-cp-ep-dp-pp`` (and orders naming only some dims) and every subset of dims as the token;
* grids with registered views: a view's enumerations equal a Megatron grid of the view's shape;
  on megatron-core 0.17+ (which has views) also ``register_view`` itself: what it accepts and
  rejects (exception types), what it returns and stores, every view's enumerations, and, in a
  fake 8-rank world, the keys groups are stored under, their members, and the KeyErrors of
  ``create_pg`` / ``get_pg`` / unknown views.

Every comparison is counted; each test asserts that it made comparisons and found no mismatch.
Run with ``-s`` to see the totals.
"""

from __future__ import annotations

import itertools
import random
import sys
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hypergrid
from tests.harness import fake_world

# Set by the megatron_core fixture when the first test here runs: importing megatron-core takes
# seconds, which collecting the suite should not spend.
mcore_hcg: Any = None  # megatron.core.hyper_comm_grid
RankGenerator: Any = None  # megatron.core.parallel_state.RankGenerator
#: Megatron-Core 0.17+ has rank views and ``_order_dims_for``; 0.16 has ``_order_dims``.
MEGATRON_HAS_VIEWS = False
MEGATRON_HAS_ORDER_DIMS = False


@pytest.fixture(scope="module", autouse=True)
def megatron_core() -> None:
    """Import Megatron-Core's HyperCommGrid and RankGenerator (every test here skips without them)."""
    global mcore_hcg, RankGenerator, MEGATRON_HAS_VIEWS, MEGATRON_HAS_ORDER_DIMS
    pytest.importorskip("megatron.core")
    pytest.importorskip("einops")
    from megatron.core import hyper_comm_grid as mcore_hcg
    from megatron.core.parallel_state import RankGenerator

    MEGATRON_HAS_VIEWS = hasattr(mcore_hcg.HyperCommGrid, "register_view")
    MEGATRON_HAS_ORDER_DIMS = hasattr(mcore_hcg.HyperCommGrid, "_order_dims")


@pytest.fixture(scope="module")
def needs_views(megatron_core: None) -> None:
    if not MEGATRON_HAS_VIEWS:
        pytest.skip("the installed megatron-core has no register_view (0.16)")

WORLD = 1 << 16
DIMS5 = ("tp", "cp", "ep", "dp", "pp")
NAME_POOL = ("tp", "cp", "ep", "dp", "pp", "a", "b", "etp", "edp")

#: comparisons made and mismatches found, by kind, over the whole module
COUNTS: dict[str, list[int]] = {}

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    """Megatron-Core's grid reads its world size from WORLD_SIZE."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", str(WORLD))
        yield
    total = sum(c for c, _ in COUNTS.values())
    bad = sum(m for _, m in COUNTS.values())
    detail = ", ".join(f"{k}: {c}" for k, (c, _) in sorted(COUNTS.items()))
    print(f"\nparity with megatron-core: {total} comparisons, {bad} mismatches ({detail})", file=sys.stderr)


class Tally:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.compared = 0
        self.mismatches: list[str] = []

    def check(self, ours, theirs, what) -> None:
        self.compared += 1
        if ours != theirs:
            self.mismatches.append(f"{what}: hypergrid {ours!r} != megatron {theirs!r}")

    def close(self, minimum: int = 1) -> None:
        entry = COUNTS.setdefault(self.kind, [0, 0])
        entry[0] += self.compared
        entry[1] += len(self.mismatches)
        assert not self.mismatches, f"{len(self.mismatches)} mismatches, first: {self.mismatches[:3]}"
        assert self.compared >= minimum, f"only {self.compared} comparisons made"


def subsets(names):
    for k in range(1, len(names) + 1):
        yield from itertools.combinations(names, k)


def both_grids(shape, names, offset):
    theirs = mcore_hcg.HyperCommGrid(list(shape), list(names), rank_offset=offset)
    ours = hypergrid.HyperCommGrid(list(shape), list(names), rank_offset=offset, world_size=WORLD)
    return ours, theirs


def compare_grids(tally, ours, theirs, rng, label):
    names = list(theirs.dim_names)
    for sub in subsets(names):
        dims = list(sub)
        rng.shuffle(dims)
        tally.check(ours.get_rank_enum(dims), theirs.get_rank_enum(dims), f"{label} get_rank_enum({dims})")
        if MEGATRON_HAS_ORDER_DIMS:
            tally.check(ours._order_dims(dims), theirs._order_dims(dims), f"{label} _order_dims({dims})")
        else:
            tally.check(ours._order_dims(dims), theirs._order_dims_for(names, dims), f"{label} _order_dims({dims})")
        if MEGATRON_HAS_VIEWS:
            tally.check(
                ours._order_dims_for(names, dims), theirs._order_dims_for(names, dims), f"{label} _order_dims_for({dims})"
            )
            tally.check(
                ours._gen_rank_enum_for(theirs.shape, names, dims),
                theirs._gen_rank_enum_for(theirs.shape, names, dims),
                f"{label} _gen_rank_enum_for({dims})",
            )
        # _gen_rank_enum takes the dims exactly as given: try the given and another order
        tally.check(ours._gen_rank_enum(dims), theirs._gen_rank_enum(dims), f"{label} _gen_rank_enum({dims})")
        other = list(reversed(dims))
        tally.check(ours._gen_rank_enum(other), theirs._gen_rank_enum(other), f"{label} _gen_rank_enum({other})")
        if len(dims) == 1:
            tally.check(ours.get_rank_enum(dims[0]), theirs.get_rank_enum(dims[0]), f"{label} get_rank_enum({dims[0]!r})")
            theirs_order = theirs._order_dims(dims[0]) if MEGATRON_HAS_ORDER_DIMS else theirs._order_dims_for(names, dims[0])
            tally.check(ours._order_dims(dims[0]), theirs_order, f"{label} _order_dims({dims[0]!r})")


# ---------------------------------------------------------------------------- HyperCommGrid
@st.composite
def grids(draw):
    ndims = draw(st.integers(1, 5))
    names = draw(st.permutations(NAME_POOL))[:ndims]
    shape = [draw(st.integers(1, 4 if ndims <= 3 else 3)) for _ in range(ndims)]
    offset = draw(st.sampled_from([0, 0, 1, 5, 64]))
    seed = draw(st.integers(0, 2**16))
    return shape, list(names), offset, seed


@settings(SETTINGS, max_examples=400)
@given(grids())
def test_hypercommgrid_enumerations(case):
    shape, names, offset, seed = case
    tally = Tally("HyperCommGrid")
    ours, theirs = both_grids(shape, names, offset)
    tally.check(
        (ours.shape, ours.dim_names, ours.rank_offset, int(ours.size), ours.backend),
        (theirs.shape, theirs.dim_names, theirs.rank_offset, int(theirs.size), theirs.backend),
        f"attributes of {shape} {names}",
    )
    compare_grids(tally, ours, theirs, random.Random(seed), f"grid {shape} {names} +{offset}")
    tally.close(minimum=5)


def test_hypercommgrid_docstring_grid():
    tally = Tally("HyperCommGrid")
    ours, theirs = both_grids([2, 3, 4, 5], ["tp", "cp", "pp", "dp"], 0)
    compare_grids(tally, ours, theirs, random.Random(0), "docstring grid")
    ours, theirs = both_grids([2, 3, 4, 5], ["tp", "cp", "pp", "dp"], 17)
    compare_grids(tally, ours, theirs, random.Random(1), "docstring grid +17")
    tally.close(minimum=2 * 15 * 3)


def test_world_size_from_environment_like_megatron(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "24")
    ours = hypergrid.HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"])
    theirs = mcore_hcg.HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"])
    assert ours.get_rank_enum(["dp", "tp"]) == theirs.get_rank_enum(["dp", "tp"])
    # one rank too many: both refuse with a RuntimeError (hypergrid's is also a ValueError)
    monkeypatch.setenv("WORLD_SIZE", "23")
    with pytest.raises(RuntimeError):
        mcore_hcg.HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"])
    with pytest.raises(RuntimeError) as info:
        hypergrid.HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"])
    assert isinstance(info.value, ValueError) and "23" in str(info.value)
    monkeypatch.setenv("WORLD_SIZE", "30")
    with pytest.raises(RuntimeError):
        mcore_hcg.HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"], rank_offset=7)
    with pytest.raises(RuntimeError) as info:
        hypergrid.HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"], rank_offset=7)
    assert "30" in str(info.value) and "7" in str(info.value)


def test_same_error_types_as_megatron():
    cases = [
        (lambda m: m([2, 2], ["tp"]), ValueError),  # length mismatch
        (lambda m: m([2, 2], ["tp", "dp"], rank_offset=-1), ValueError),
        (lambda m: m([2, 2], ["tp", "dp"])._order_dims_for(["tp", "dp"], ["tp", "zz"]), ValueError)
        if MEGATRON_HAS_VIEWS
        else (lambda m: m([2, 2], ["tp", "dp"])._order_dims(["tp", "zz"]), ValueError),
        (lambda m: m([2, 2], ["tp", "dp"]).get_rank_enum(["zz"]), ValueError),
        (lambda m: m([2, 2], ["tp", "dp"]).get_pg("tp"), KeyError),
    ]
    ours_cls = lambda *a, **k: hypergrid.HyperCommGrid(*a, world_size=WORLD, **k)  # noqa: E731
    for build, exc in cases:
        with pytest.raises(exc):
            build(mcore_hcg.HyperCommGrid)
        with pytest.raises(exc):
            build(ours_cls)


# ---------------------------------------------------------------------------- RankGenerator
def rank_generator_pair(sizes, order, offset):
    """Megatron's RankGenerator and the hypergrid grid its `order` describes."""
    gen = RankGenerator(
        tp=sizes["tp"], ep=sizes["ep"], dp=sizes["dp"], pp=sizes["pp"], cp=sizes["cp"],
        order=order, rank_offset=offset,
    )
    names = order.split("-")
    grid = hypergrid.HyperCommGrid([sizes[n] for n in names], names, rank_offset=offset, world_size=WORLD)
    return gen, grid


def compare_rank_generator(tally, sizes, order, offset, rng):
    gen, grid = rank_generator_pair(sizes, order, offset)
    names = order.split("-")
    for sub in subsets(names):
        token_dims = list(sub)
        rng.shuffle(token_dims)  # get_ranks ignores the order inside the token
        token = "-".join(token_dims)
        theirs = gen.get_ranks(token)
        tally.check(grid.get_rank_enum(token_dims), theirs, f"{sizes} order={order} +{offset} token={token}")
        tally.check(grid.layout.enumerate(sub), theirs, f"layout {sizes} order={order} token={token}")


@pytest.mark.parametrize(
    "sizes",
    [
        {"tp": 2, "cp": 3, "ep": 1, "dp": 2, "pp": 2},
        {"tp": 2, "cp": 1, "ep": 3, "dp": 2, "pp": 2},
    ],
    ids=["cp3", "ep3"],
)
def test_rank_generator_every_order_and_token(sizes):
    """All 120 orders of the five dims, all 31 tokens, dims of distinct sizes, with an offset."""
    tally = Tally("RankGenerator")
    rng = random.Random(0)
    for perm in itertools.permutations(DIMS5):
        offset = rng.choice([0, 3, 24])
        compare_rank_generator(tally, sizes, "-".join(perm), offset, rng)
    tally.close(minimum=120 * 31 * 2)


@st.composite
def rank_generator_cases(draw):
    k = draw(st.integers(1, 5))
    named = list(draw(st.permutations(DIMS5))[:k])
    sizes = {n: 1 for n in DIMS5}
    for n in named:
        sizes[n] = draw(st.integers(1, 4))
    # RankGenerator allows ep > 1 or cp > 1, not both
    if sizes["ep"] > 1 and sizes["cp"] > 1:
        sizes[draw(st.sampled_from(["ep", "cp"]))] = 1
    # keep the world small enough for a quick comparison
    while sizes["tp"] * sizes["cp"] * sizes["ep"] * sizes["dp"] * sizes["pp"] > 96:
        biggest = max(named, key=lambda n: sizes[n])
        sizes[biggest] -= 1
    offset = draw(st.sampled_from([0, 0, 1, 8, 100]))
    seed = draw(st.integers(0, 2**16))
    return sizes, "-".join(named), offset, seed


@settings(SETTINGS, max_examples=500)
@given(rank_generator_cases())
def test_rank_generator_random(case):
    """Random sizes (1s included), orders naming all or only some dims, offsets."""
    sizes, order, offset, seed = case
    tally = Tally("RankGenerator")
    compare_rank_generator(tally, sizes, order, offset, random.Random(seed))
    tally.close(minimum=1)


def test_rank_generator_large_world():
    """A 16k-rank world: group members far apart, every dim > 1."""
    tally = Tally("RankGenerator")
    sizes = {"tp": 8, "cp": 4, "ep": 1, "dp": 16, "pp": 32}
    rng = random.Random(1)
    for order in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "pp-dp-tp-cp-ep"):
        gen, grid = rank_generator_pair(sizes, order, 8)
        for token in ("tp", "cp", "dp", "pp", "tp-cp", "cp-dp", "tp-dp-pp", "dp-cp-tp-pp"):
            theirs = gen.get_ranks(token)
            tally.check(grid.get_rank_enum(token.split("-")), theirs, f"{order} {token}")
            # a few single groups, computed alone in O(group size)
            for row in rng.sample(range(len(theirs)), min(4, len(theirs))):
                member = rng.choice(theirs[row])
                tally.check(grid.ranks(token.split("-"), rank=member), theirs[row], f"{order} {token} rank {member}")
    tally.close(minimum=3 * 8)


# ---------------------------------------------------------------------------- views
@st.composite
def grids_with_views(draw):
    """A dense grid (tp, cp, dp, pp) and an expert view (etp, ep, edp, pp) of the same span."""
    tp, cp, dp, pp = (draw(st.integers(1, 4)) for _ in range(4))
    inner = tp * cp * dp
    divisors = [d for d in range(1, inner + 1) if inner % d == 0]
    etp = draw(st.sampled_from(divisors))
    rest = inner // etp
    ep = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
    edp = rest // ep
    view_names = ["etp", "ep", "edp", "pp"]
    view_shape = [etp, ep, edp, pp]
    order = draw(st.permutations(range(3)))
    view_names = [view_names[i] for i in order] + ["pp"]
    view_shape = [view_shape[i] for i in order] + [pp]
    offset = draw(st.sampled_from([0, 4]))
    seed = draw(st.integers(0, 2**16))
    return [tp, cp, dp, pp], view_shape, view_names, offset, seed


@settings(SETTINGS, max_examples=200)
@given(grids_with_views())
def test_view_enumerations_equal_megatron_grid_of_the_view(case):
    shape, view_shape, view_names, offset, seed = case
    tally = Tally("views")
    ours = hypergrid.HyperCommGrid(shape, ["tp", "cp", "dp", "pp"], rank_offset=offset, world_size=WORLD)
    ours.register_view("expert", view_shape, view_names, shared_dims=["pp"])
    theirs_view = mcore_hcg.HyperCommGrid(view_shape, view_names, rank_offset=offset)
    theirs_dense = mcore_hcg.HyperCommGrid(shape, ["tp", "cp", "dp", "pp"], rank_offset=offset)
    rng = random.Random(seed)
    for sub in subsets(view_names):
        dims = list(sub)
        rng.shuffle(dims)
        theirs = theirs_view.get_rank_enum(dims)
        tally.check(ours.get_rank_enum(dims, view="expert"), theirs, f"view {view_shape} {view_names} {dims}")
        member = rng.randrange(offset, offset + ours.size)
        row = next(g for g in theirs if member in g)
        tally.check(ours.ranks(dims, rank=member, view="expert"), row, f"view ranks {dims} rank {member}")
    # the dense grid is untouched by the view
    for sub in subsets(["tp", "cp", "dp", "pp"]):
        tally.check(ours.get_rank_enum(list(sub)), theirs_dense.get_rank_enum(list(sub)), f"dense {shape} {sub}")
    # the shared dim has the same groups in both
    tally.check(ours.get_rank_enum("pp", view="expert"), theirs_dense.get_rank_enum("pp"), "shared pp")
    tally.close(minimum=15 * 2 + 15)


def test_world_size_resolved_in_megatron_order(monkeypatch):
    """WORLD_SIZE before torch.distributed, in both: a 120-rank grid planned in an 8-rank job."""
    with fake_world(0, 8):
        monkeypatch.setenv("WORLD_SIZE", "120")
        ours = hypergrid.HyperCommGrid([2, 3, 4, 5], ["tp", "cp", "pp", "dp"])
        theirs = mcore_hcg.HyperCommGrid([2, 3, 4, 5], ["tp", "cp", "pp", "dp"])
        assert ours.world_size == 120 and ours.get_rank_enum("dp") == theirs.get_rank_enum("dp")
        # without WORLD_SIZE both fall back to torch.distributed's 8 ranks
        monkeypatch.delenv("WORLD_SIZE")
        assert hypergrid.HyperCommGrid([2, 4], ["tp", "dp"]).world_size == 8
        mcore_hcg.HyperCommGrid([2, 4], ["tp", "dp"])
        for build in (hypergrid.HyperCommGrid, mcore_hcg.HyperCommGrid):
            with pytest.raises(RuntimeError, match="over sized"):
                build([4, 4], ["tp", "dp"])


# ---------------------------------------------------------------------------- register_view (0.17+)
VIEW_NAMES = ("tp", "cp", "dp", "pp", "ep", "etp", "edp", "x")


def _factorizations(n: int, parts: int) -> list[list[int]]:
    """Every way to write n as an ordered product of `parts` positive factors."""
    if parts == 1:
        return [[n]]
    return [[d] + rest for d in range(1, n + 1) if n % d == 0 for rest in _factorizations(n // d, parts - 1)]


@st.composite
def views_of_grids(draw):
    """A grid and a view request that may or may not be valid: what register_view must judge.

    Views are drawn to hit every check: the grid's dims regrouped (shared dims that match,
    including size-1 dims at other strides and several shared dims at once), dims in another
    order (shared dims that do not match), wrong sizes, repeated names, bad shared dims.
    """
    ndims = draw(st.integers(1, 4))
    names = list(draw(st.permutations(VIEW_NAMES[:5]))[:ndims])
    shape = [draw(st.integers(1, 3)) for _ in range(ndims)]
    size = 1
    for n in shape:
        size *= n
    k = draw(st.integers(1, 4))
    view_shape = list(draw(st.sampled_from(_factorizations(size, k))))
    pool = list(names) + ["ep", "etp", "edp", "x"]
    view_names = list(draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k)))
    mutation = draw(st.sampled_from(["none", "none", "none", "size", "length", "nonpositive"]))
    if mutation == "size":
        view_shape[0] += 1
    elif mutation == "length" and k > 1:
        view_names = view_names[:-1]
    elif mutation == "nonpositive":
        view_shape[draw(st.integers(0, k - 1))] = draw(st.sampled_from([0, -1]))
    candidates = sorted(set(names) | set(view_names))
    shared = draw(st.one_of(st.none(), st.lists(st.sampled_from(candidates), max_size=3)))
    offset = draw(st.sampled_from([0, 3]))
    return shape, names, offset, view_shape, view_names, shared


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # noqa: BLE001 - compared with what the other side raised
        return ("raised", exc)


@pytest.mark.usefixtures("needs_views")
@settings(SETTINGS, max_examples=600)
@given(views_of_grids(), st.randoms(use_true_random=False))
def test_register_view_accepts_and_rejects_like_megatron(case, rng):
    shape, names, offset, view_shape, view_names, shared = case
    tally = Tally("register_view")
    ours, theirs = both_grids(shape, names, offset)
    mine = _outcome(lambda: ours.register_view("v", list(view_shape), list(view_names), shared))
    other = _outcome(lambda: theirs.register_view("v", list(view_shape), list(view_names), shared))
    label = f"grid {shape} {names} view {view_shape} {view_names} shared={shared}"
    if other[0] == "raised":
        assert mine[0] == "raised", f"{label}: megatron raised {other[1]!r}, hypergrid accepted"
        tally.check(isinstance(mine[1], type(other[1])), True, f"{label}: {mine[1]!r} vs {other[1]!r}")
        assert "v" not in ours.views
    else:
        assert mine[0] == "ok", f"{label}: megatron accepted, hypergrid raised {mine[1]!r}"
        tally.check(mine[1], other[1], f"{label} return value")  # None
        spec, theirs_spec = ours._views["v"], theirs._views["v"]
        tally.check(
            (spec.name, spec.shape, spec.dim_names, spec.shared_dims),
            (theirs_spec.name, theirs_spec.shape, theirs_spec.dim_names, theirs_spec.shared_dims),
            f"{label} stored view",
        )
        for sub in subsets(view_names):
            dims = list(sub)
            rng.shuffle(dims)
            tally.check(ours.get_rank_enum(dims, view="v"), theirs.get_rank_enum(dims, view="v"), f"{label} {dims}")
    tally.close()


@pytest.mark.usefixtures("needs_views")
def test_register_view_cases_megatron_tests_name():
    """Size-1 dims, several shared dims at once, "base", numpy sizes: accepted or refused alike."""
    import numpy as np

    cases = [
        # (grid shape, grid names, view shape, view names, shared)
        ([1, 2, 4], ["tp", "cp", "dp"], [2, 1, 4], ["ep", "tp", "dp"], ["tp", "dp"]),  # size-1 dim, other stride
        ([2, 2, 2], ["tp", "dp", "pp"], [2, 2, 2], ["ep", "dp", "pp"], ["dp", "pp"]),  # two shared dims
        ([2, 2, 2], ["tp", "dp", "pp"], [2, 2, 2], ["dp", "ep", "pp"], ["dp", "pp"]),  # dp at another stride
        ([2, 2, 2], ["tp", "dp", "pp"], [2, 4], ["pp", "ep"], ["pp"]),                 # pp leading: differs
        ([2, 2, 2], ["tp", "dp", "pp"], [2, 2, 2], ["expt_tp", "ep", "pp"], ["pp", "pp"]),
        ([2, 2, 2], ["tp", "dp", "pp"], [np.int64(4), np.int64(2)], ["ep", "pp"], ["pp"]),
        ([2, 2, 2], ["tp", "dp", "pp"], [8], ["base"], None),
        ([2, 2, 2], ["tp", "dp", "pp"], [2.0, 4], ["ep", "x"], None),
    ]
    for shape, names, view_shape, view_names, shared in cases:
        ours, theirs = both_grids(shape, names, 0)
        for name in ("expert", "base"):
            mine = _outcome(lambda: ours.register_view(name, list(view_shape), list(view_names), shared))
            other = _outcome(lambda: theirs.register_view(name, list(view_shape), list(view_names), shared))
            assert mine[0] == other[0], f"{view_shape} {view_names} {shared} as {name!r}: {mine} vs {other}"
            if other[0] == "raised":
                assert isinstance(mine[1], type(other[1])), f"{mine[1]!r} vs {other[1]!r}"
            else:
                assert mine[1] is None and other[1] is None


@pytest.mark.usefixtures("needs_views")
@pytest.mark.parametrize("rank", [0, 5])
def test_view_groups_stored_under_megatron_keys(monkeypatch, rank):
    """In a fake 8-rank world: the same keys in ``_pgs``, the same members, the same KeyErrors."""
    with fake_world(rank, 8):
        monkeypatch.setenv("WORLD_SIZE", "8")
        ours, theirs = both_grids([2, 2, 2], ["tp", "dp", "pp"], 0)
        for grid in (ours, theirs):
            grid.register_view("expert", [2, 2, 2], ["expt_tp", "ep", "pp"], shared_dims=["pp"])
        requests = [("tp", None), ("pp", None), (["ep", "expt_tp"], "expert"), ("pp", "expert"), ("ep", "expert"),
                    (["dp", "tp"], None), (["pp", "ep"], "expert"), ("tp", "base")]
        for dims, view in requests:
            mine = _outcome(lambda: ours.create_pg(dims, view=view))
            other = _outcome(lambda: theirs.create_pg(dims, view=view))
            assert mine[0] == other[0], f"create_pg({dims}, view={view}): {mine} vs {other}"
            if other[0] == "raised":
                assert type(mine[1]) is type(other[1]) and "already been created" in str(mine[1])
                continue
            assert dist_ranks(mine[1]) == dist_ranks(other[1]), f"{dims} view={view}"
        assert set(ours._pgs) == set(theirs._pgs), f"{sorted(map(str, ours._pgs))} vs {sorted(map(str, theirs._pgs))}"
        for key in theirs._pgs:
            assert dist_ranks(ours._pgs[key]) == dist_ranks(theirs._pgs[key]), key
        for dims, view in [("cp", None), ("dp", "expert"), ("ep", "nope"), ("ep", None), (["expt_tp"], "expert")]:
            mine = _outcome(lambda: ours.get_pg(dims, view=view))
            other = _outcome(lambda: theirs.get_pg(dims, view=view))
            assert mine[0] == other[0] == "raised", f"get_pg({dims}, view={view}): {mine} vs {other}"
            assert type(mine[1]) is type(other[1]), f"get_pg({dims}, view={view}): {mine[1]!r} vs {other[1]!r}"
            shown = view if isinstance(other[1], KeyError) and view else (dims if isinstance(dims, str) else dims[0])
            assert str(shown) in str(mine[1]), f"{mine[1]!r} does not name {shown!r}"
        # destroy: through torch.distributed.destroy_process_group, then empty. hypergrid made one
        # communicator where two keys have the same members ("dp-tp" and the expert "ep-expt_tp"
        # are ranks 0-3), so it destroys that one once; the same members are destroyed.
        with mock.patch("torch.distributed.destroy_process_group") as mine_destroyed:
            ours.destroy()
        with mock.patch("torch.distributed.destroy_process_group") as theirs_destroyed:
            theirs.destroy()
        mine_pgs = [c.args[0] for c in mine_destroyed.call_args_list]
        assert len({id(pg) for pg in mine_pgs}) == len(mine_pgs), "a communicator destroyed twice"
        assert sorted({tuple(dist_ranks(pg)) for pg in mine_pgs}) == sorted(
            {tuple(dist_ranks(c.args[0])) for c in theirs_destroyed.call_args_list}
        )
        assert ours._pgs == theirs._pgs == {}


def dist_ranks(pg):
    import torch.distributed as dist

    if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return dist.get_process_group_ranks(pg)


@pytest.mark.usefixtures("needs_views")
def test_view_errors_like_megatron():
    ours, theirs = both_grids([2, 2, 2], ["tp", "dp", "pp"], 0)
    for grid in (ours, theirs):
        grid.register_view("expert", [2, 2, 2], ["expt_tp", "ep", "pp"], shared_dims=["pp"])
    calls = {
        "unknown view": lambda g: g.get_rank_enum("ep", view="nope"),
        "view dim without view=": lambda g: g.get_rank_enum("ep"),
        "grid dim in a view": lambda g: g.get_rank_enum("tp", view="expert"),
        "get_pg unknown view": lambda g: g.get_pg("ep", view="nope"),
        "create_pg unknown view": lambda g: g.create_pg("ep", view="nope"),
    }
    for what, call in calls.items():
        mine, other = _outcome(lambda: call(ours)), _outcome(lambda: call(theirs))
        assert mine[0] == other[0] == "raised", f"{what}: {mine} vs {other}"
        assert type(mine[1]) is type(other[1]), f"{what}: {mine[1]!r} vs {other[1]!r}"
        # Megatron-Core's wording is kept, so tests matching its messages pass on hypergrid
        assert str(other[1]).strip("\"'").split(".")[0].split(" with ")[0] in str(mine[1]), f"{what}: {mine[1]} vs {other[1]}"
