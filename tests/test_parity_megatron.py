"""Differential tests against the installed megatron-core: enumerations equal, rank for rank.

Compared with Megatron-Core's own code, not a copy of it:

* ``megatron.core.hyper_comm_grid.HyperCommGrid``: ``get_rank_enum``, ``_gen_rank_enum`` (dims
  in the order given), ``_order_dims`` (ordered dims and key), ``rank_offset`` included;
* ``megatron.core.parallel_state.RankGenerator(...).get_ranks(token)`` for every order of
  ``tp-cp-ep-dp-pp`` (and orders naming only some dims) and every subset of dims as the token;
* grids with registered views: a view's enumerations equal a Megatron grid of the view's shape.

Every comparison is counted; each test asserts that it made comparisons and found no mismatch.
Run with ``-s`` to see the totals.
"""

from __future__ import annotations

import itertools
import random
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")
pytest.importorskip("einops")

from megatron.core import hyper_comm_grid as mcore_hcg  # noqa: E402
from megatron.core.parallel_state import RankGenerator  # noqa: E402

import hypergrid  # noqa: E402

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
        tally.check(ours._order_dims(dims), theirs._order_dims(dims), f"{label} _order_dims({dims})")
        # _gen_rank_enum takes the dims exactly as given: try the given and another order
        tally.check(ours._gen_rank_enum(dims), theirs._gen_rank_enum(dims), f"{label} _gen_rank_enum({dims})")
        other = list(reversed(dims))
        tally.check(ours._gen_rank_enum(other), theirs._gen_rank_enum(other), f"{label} _gen_rank_enum({other})")
        if len(dims) == 1:
            tally.check(ours.get_rank_enum(dims[0]), theirs.get_rank_enum(dims[0]), f"{label} get_rank_enum({dims[0]!r})")
            tally.check(ours._order_dims(dims[0]), theirs._order_dims(dims[0]), f"{label} _order_dims({dims[0]!r})")


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
        (lambda m: m([2, 2], ["tp", "dp"])._order_dims(["tp", "zz"]), ValueError),
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
