"""Differential tests: after a recovery, every ``parallel_state`` getter and module global answers
as Megatron-Core's own ``initialize_model_parallel`` would for the new placement.

One rank of a simulated world on torch's fake backend builds a job
(``ResilientJob.of_megatron(spares=..., **sizes)``) and recovers it, once or twice, from a
failed set given (one simulated rank has nobody to agree with): spares taking a failed rank's or
a whole node's places, or the replicas holding a failed rank dropped (data parallel 2 to 1, 4 to
3). The new placement lists the global rank at each grid position (``after.layout.ranks``).

The anchor is Megatron-Core itself: its ``initialize_model_parallel(**sizes)`` on a fake world of
as many ranks as the placement has positions, as the rank at the same position (``p``, the index
in ``after.layout.ranks``), where it derives data parallel from that world size as it always
does. Its answers are about positions; every *global* rank in them is mapped through the
placement (``p -> after.layout.ranks[p]``) and the result must equal what hypergrid's
``parallel_state`` answers on the placed rank: every getter of the installed megatron-core
(called bare and with every combination of its keywords, as in
tests/test_megatron_parallel_state_parity.py, whose machinery this file reuses), every
``_UPPER_CASE`` module global, ``ProcessGroupCollection.use_mpu_process_groups()`` beside
:func:`hypergrid.megatron.process_group_collection`, and the communicators in
``_global_process_group_list``. Zero differences, on both supported megatron-core versions.

Which answers hold global ranks is decided by name (:func:`holds_global_ranks`): process groups
(by their members), the ``*_GLOBAL_RANKS`` lists and ``_EXPERT_MODEL_PARALLEL_RANKS``, and the
``src``/``first``/``last``/``next``/``prev`` rank getters and ``*_global_ranks`` getters; world
sizes, ranks in a group and flags are not mapped. Where the installed version has ``rank_offset``
(0.19), :func:`test_the_global_rank_answers_are_the_ones_megatron_shifts` checks that choice
against Megatron-Core: on a grid moved up the world, exactly those answers move with it.

A rank the recovery leaves outside the grid (a rank of a dropped replica, a spare not needed)
has no state (``job.state`` is None) and its ``parallel_state`` answers as Megatron-Core's does
with nothing initialized (a fresh copy of the installed module): as after Megatron-Core's own
``destroy_model_parallel``, less the previous initialization's rank lists that it leaves set
and hypergrid's destroy clears.

``_global_process_group_list`` holds None for "the default process group" on both sides; its
members are not compared (Megatron-Core's anchor world is the placement's positions, the job's
default group is its whole world, spares and failed ranks included: see ``DEFAULT_GROUP``).

Strategy ``enumerate`` (Megatron-Core's call pattern, every rank of the world calling for every
group) does not fit a job with spares: ``ResilientJob.of_megatron`` refuses it (tests/test_recovery.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

import hypergrid
import hypergrid.megatron as hm
from hypergrid.errors import RecoveryRefused
from hypergrid.recovery.settings import RecoverySettings
from tests import test_megatron_parallel_state_parity as parity
from tests.harness import fake_world


@pytest.fixture(scope="module", autouse=True)
def megatron_core() -> None:
    """Every test here skips without megatron-core (imported when the first test runs)."""
    pytest.importorskip("megatron.core")
    parity.load_megatron()


# ----------------------------------------------------------------------------- global ranks
#: Getters whose answer is a global rank, or a list of them.
GLOBAL_RANK_GETTERS = re.compile(r"^get_\w+_(src_rank|first_rank|last_rank|next_rank|prev_rank|global_ranks)$")
#: Module globals holding lists of global ranks (beyond the groups, mapped wherever they are).
GLOBAL_RANK_GLOBALS = re.compile(r"^_\w*GLOBAL_RANKS\w*$|^_EXPERT_MODEL_PARALLEL_RANKS$")


def holds_global_ranks(key: str) -> bool:
    """Whether a snapshot entry (``"call name(...)"`` or ``"global NAME"``) holds global ranks
    as plain integers (process groups hold them wherever they are, and are always mapped)."""
    kind, _, rest = key.partition(" ")
    if kind == "call":
        return bool(GLOBAL_RANK_GETTERS.match(rest.split("(", 1)[0]))
    if kind == "global":
        return bool(GLOBAL_RANK_GLOBALS.match(rest))
    return False


def _placed(value: Any, placement: tuple[int, ...], ranks: bool) -> Any:
    """``value`` (a snapshot entry) with positions turned into the global ranks that hold them:
    every process group's members, and every integer where ``ranks``."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "group":
        return ("group", tuple(placement[m] for m in value[1]))
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "ok":
        return ("ok", _placed(value[1], placement, ranks))
    if isinstance(value, list):
        return [_placed(v, placement, ranks) for v in value]
    if isinstance(value, dict):
        return {k: _placed(v, placement, ranks) for k, v in value.items()}
    if ranks and isinstance(value, int) and not isinstance(value, bool):
        return placement[value]
    return value


def placed_snapshot(snap: dict[str, Any], placement: tuple[int, ...]) -> dict[str, Any]:
    """A snapshot taken at positions, as the placed ranks should see it."""
    return {key: _placed(value, placement, holds_global_ranks(key)) for key, value in snap.items()}


# ----------------------------------------------------------------------------- both sides
#: What ``_global_process_group_list`` holds for None: Megatron-Core's "the default process group"
#: (which its ``update_pg_timeout`` sets too). Megatron-Core's anchor world is the placement's
#: positions; hypergrid's default group is the job's whole world (spares included): compared as
#: the default group on both sides, whatever its members.
DEFAULT_GROUP = "<the default group>"


def _communicators() -> list[Any]:
    """``_global_process_group_list`` in order, groups by their members."""
    return [DEFAULT_GROUP if g is None else parity._ranks(g) for g in parity.ps._global_process_group_list or []]


def _state(config: Any, collection: Any) -> dict[str, Any]:
    snap = parity.snapshot(config)
    snap["collection"] = parity.collection_snapshot(collection)
    snap["communicators"] = _communicators()
    return snap


def megatron_state(placement: tuple[int, ...], rank: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``rank`` should see for ``placement``: Megatron-Core's own answers as the rank at
    ``rank``'s position of a world of the placement's size, mapped through the placement; where
    ``rank`` holds no position, Megatron-Core's state with nothing initialized."""
    n = len(placement)
    config = parity.config_of(n, kwargs)
    if rank not in placement:
        return megatron_empty_state(config)
    with fake_world(placement.index(rank), n):
        try:
            parity.ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
            snap = _state(config, parity.ProcessGroupCollection.use_mpu_process_groups)
        finally:
            hm.destroy_model_parallel()
    return placed_snapshot(snap, placement)


def megatron_empty_state(config: Any) -> dict[str, Any]:
    """Megatron-Core's ``parallel_state`` in a process that never initialized it: a fresh copy
    of the installed module, read by the getters, the globals and ``ProcessGroupCollection``
    (Megatron-Core's ``destroy_model_parallel`` leaves the previous initialization's rank lists
    set, which hypergrid's clears by design: docs/megatron.md,
    :func:`test_megatron_destroy_leaves_only_rank_lists_and_groups_set`)."""
    installed, fresh = parity.ps, _fresh_parallel_state()
    collection_module = sys.modules[parity.ProcessGroupCollection.__module__]
    parity.ps = collection_module.parallel_state = fresh
    try:
        with fake_world(0, config.world_size):
            return _state(config, parity.ProcessGroupCollection.use_mpu_process_groups)
    finally:
        parity.ps = collection_module.parallel_state = installed


@functools.cache
def _fresh_parallel_state() -> Any:
    installed = parity.ps
    spec = importlib.util.spec_from_file_location(f"{installed.__package__}._never_initialized_parallel_state",
                                                  installed.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Recovered:
    """One rank after a job's recoveries: the placements, its state and what it answers."""

    placements: tuple[tuple[int, ...], ...]
    kinds: tuple[str, ...]
    in_grid: bool
    state_is_none: bool
    answers: dict[str, Any]


def hypergrid_state(case: Case, rank: int) -> Recovered:
    """Play ``rank`` of ``case``'s world: build the job, recover it as the case says, and record
    what ``parallel_state`` answers."""
    with fake_world(rank, case.world):
        try:
            job = hypergrid.ResilientJob.of_megatron(spares=case.spares, create_gloo_process_groups=False,
                                                     **case.options, **case.kwargs)
            placements, kinds = [], []
            for failed, gpus_per_node in case.recoveries:
                job = dataclasses.replace(job, settings=RecoverySettings(gpus_per_node=gpus_per_node)).recover(failed=failed)
                placements.append(tuple(job.layout.ranks))
                kinds.append(job.last.kind.value)
            config = parity.config_of(len(job.layout.ranks), case.kwargs)
            answers = _state(config, hm.process_group_collection)
            return Recovered(tuple(placements), tuple(kinds), job.in_grid, job.state is None, answers)
        finally:
            hm.destroy_model_parallel()


# ----------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """A job on ``world`` ranks (``spares`` outside its grid) recovered from each ``(failed,
    gpus_per_node)`` in turn; ``placements`` and ``kinds``: what each recovery must choose;
    ``ranks``: the ranks played (none of them failed)."""

    id: str
    world: int
    spares: tuple[int, ...]
    kwargs: dict[str, Any]
    recoveries: tuple[tuple[tuple[int, ...], int], ...]
    kinds: tuple[str, ...]
    placements: tuple[tuple[int, ...], ...]
    ranks: tuple[int, ...]
    options: dict[str, Any] = field(default_factory=dict)
    #: A known difference, why (the test must fail, with an AssertionError).
    xfail: Optional[str] = None


TP2_PP2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
MOE = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
           pipeline_model_parallel_size=2)
MOE_ETP = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2,
               pipeline_model_parallel_size=2)


def swap(n: int, spares: dict[int, int], dropped: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Ranks ``0..n-1`` but ``dropped``, each key of ``spares`` replaced by its value."""
    return tuple(spares.get(r, r) for r in range(n) if r not in dropped)


def drop(n: int, *dropped: int) -> tuple[int, ...]:
    """Ranks ``0..n-1`` but ``dropped``."""
    return swap(n, {}, dropped)


CP_VP = dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
             virtual_pipeline_model_parallel_size=2)
HCP = dict(tensor_model_parallel_size=2, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
DISTOPT2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, expert_model_parallel_size=2,
                expert_tensor_parallel_size=1, num_distributed_optimizer_instances=2)

CASES = [
    # tp 2 x dp 2 x pp 2 on 0-7, spares 8, 9: rank 5 lost, spare 8 takes position 5.
    Case("replace-one", 10, (8, 9), TP2_PP2, (((5,), 2),), ("replace",),
         ((0, 1, 2, 3, 4, 8, 6, 7),), ranks=(0, 4, 7, 8, 9)),
    # The same without share_groups: the communicator list is compared in order, as Megatron-Core made it.
    Case("replace-one-unshared", 10, (8, 9), TP2_PP2, (((5,), 2),), ("replace",),
         ((0, 1, 2, 3, 4, 8, 6, 7),), ranks=(1, 8), options=dict(share_groups=False)),
    # A whole node (ranks 4-7, 4 per node) lost: spare node 8-11 takes it, local rank for local rank.
    Case("replace-node", 12, (8, 9, 10, 11), TP2_PP2, (((4, 5, 6, 7), 4),), ("replace",),
         ((0, 1, 2, 3, 8, 9, 10, 11),), ranks=(0, 3, 8, 11)),
    # No spares: the replica holding rank 5 (dp index 0: 0, 1, 4, 5) is dropped, dp 2 -> 1.
    Case("shrink-dp2-1", 8, (), TP2_PP2, (((5,), 2),), ("shrink",),
         ((2, 3, 6, 7),), ranks=(0, 2, 4, 7)),
    # dp 4 -> 3: tp 2 x dp 4 x pp 2 on 16 ranks, rank 5 (dp index 2) lost.
    Case("shrink-dp4-3", 16, (), TP2_PP2, (((5,), 2),), ("shrink",),
         ((0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 14, 15),), ranks=(0, 3, 4, 6, 13, 15)),
    # Twice: spare 8 takes rank 5's place, then spare 9 takes spare 8's.
    Case("replace-twice", 10, (8, 9), TP2_PP2, (((5,), 2), ((8,), 2)), ("replace", "replace"),
         ((0, 1, 2, 3, 4, 8, 6, 7), (0, 1, 2, 3, 4, 9, 6, 7)), ranks=(0, 4, 9)),
    # Twice: a spare takes rank 5's place, then, with no spare left, rank 2's replica is dropped.
    Case("replace-then-shrink", 9, (8,), TP2_PP2, (((5,), 2), ((2,), 2)), ("replace", "shrink"),
         ((0, 1, 2, 3, 4, 8, 6, 7), (0, 1, 4, 8)), ranks=(0, 3, 8)),
    # Twice: shrink dp 4 -> 3, then one of the dropped replica's ranks is the spare for the next loss.
    Case("shrink-then-replace", 16, (), TP2_PP2, (((5,), 2), ((10,), 2)), ("shrink", "replace"),
         ((0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 14, 15), (0, 1, 2, 3, 6, 7, 8, 9, 4, 11, 14, 15)),
         ranks=(0, 4, 11, 12, 13)),
    # Expert parallel: tp 2 x ep 2 (etp 1) x pp 2, dp 4 (expert dp 4).
    Case("moe-replace", 18, (16, 17), MOE, (((6,), 2),), ("replace",),
         (swap(16, {6: 16}),), ranks=(1, 4, 7, 14, 16, 17)),
    Case("moe-shrink-dp4-3", 16, (), MOE, (((6,), 2),), ("shrink",),
         (drop(16, 6, 7, 14, 15),), ranks=(0, 2, 7, 13)),
    Case("moe-etp2-replace-node", 20, (16, 17, 18, 19), MOE_ETP, (((8, 9, 10, 11), 4),), ("replace",),
         (swap(16, {8: 16, 9: 17, 10: 18, 11: 19}),), ranks=(0, 12, 16, 19)),
    Case("moe-shrink-then-replace", 16, (), MOE, (((6,), 2), ((9,), 2)), ("shrink", "replace"),
         (drop(16, 6, 7, 14, 15), swap(16, {9: 7}, dropped=(6, 7, 14, 15))), ranks=(4, 7, 8, 15)),
    # Context parallel and virtual pipeline: tp 2 x cp 2 x pp 2 (vp 2), dp 2, a spare node of 4.
    Case("cp-vp-replace-node", 20, (16, 17, 18, 19), CP_VP, (((4, 5, 6, 7), 4),), ("replace",),
         (swap(16, {4: 16, 5: 17, 6: 18, 7: 19}),), ranks=(0, 12, 16, 19)),
    Case("cp-vp-shrink", 16, (), CP_VP, (((3,), 2),), ("shrink",),
         (drop(16, *range(4), *range(8, 12)),), ranks=(0, 4, 10, 15)),
    Case("hcp-shrink", 16, (), HCP, (((9,), 2),), ("shrink",),
         (drop(16, *range(8, 16)),), ranks=(0, 7, 8)),
    Case("distopt2-replace", 26, (24, 25), DISTOPT2, (((13,), 2),), ("replace",), (swap(24, {13: 24}),), ranks=(1, 12, 24, 25)),
    Case("hybrid-cp-shrink", 24, (), dict(context_parallel_size=2, hybrid_context_parallel=True), (((5,), 2),),
         ("shrink",), (drop(24, 4, 5),), ranks=(0, 4, 23)),
    # An order with dp between pp and tp: dropping a replica re-numbers the positions around it.
    Case("order-pp-dp-tp-shrink", 24, (), dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3,
                                               order="pp-dp-tp"), (((5,), 3),), ("shrink",),
         (drop(24, 3, 4, 5, 15, 16, 17),), ranks=(0, 4, 6, 23)),
    Case("embedding-callbacks-replace", 18, (16, 17), dict(pipeline_model_parallel_size=4,
                                                          get_embedding_ranks=lambda r: [r[-1]],
                                                          get_position_embedding_ranks=lambda r: r[:2]),
         (((4,), 2),), ("replace",), (swap(16, {4: 16}),), ranks=(0, 1, 16)),
    # megatron-core 0.19: generalized tensor parallelism with weight rematerialization.
    Case("gtp2-moe-replace", 34, (32, 33), dict(tensor_model_parallel_size=2, gtp_remat_size=2,
                                               pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                               expert_tensor_parallel_size=1, expert_gtp_remat_size=2),
         (((9,), 2),), ("replace",), (swap(32, {9: 32}),), ranks=(0, 8, 32, 33)),
    Case("gtp2-cp-vp-shrink", 32, (), dict(tensor_model_parallel_size=2, gtp_remat_size=2,
                                           pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                           context_parallel_size=2), (((3,), 2),), ("shrink",),
         (drop(32, *range(8), *range(16, 24)),), ranks=(0, 2, 8, 20)),
]


def _params(cases: list[Case]) -> list[Any]:
    # Every case takes well under a second on 2 cores: none is slow.
    return [pytest.param(case, id=case.id,
                         marks=[pytest.mark.xfail(strict=True, raises=AssertionError, reason=case.xfail)] if case.xfail else [])
            for case in cases]


def differences(expected: dict[str, Any], actual: dict[str, Any], *, shared: bool = True) -> list[str]:
    """As :func:`parity.differences`; with ``shared`` groups (equal groups are one communicator)
    the communicators compared are the distinct memberships, in any order."""
    if shared:
        expected, actual = ({**side, "communicators": sorted({repr(g) for g in side["communicators"]})}
                            for side in (expected, actual))
    return parity.differences(expected, actual)


def compare(case: Case) -> list[str]:
    """Differences between hypergrid and Megatron-Core on each of ``case``'s ranks (empty: none)."""
    parity.require_keywords(case.kwargs)
    diffs: list[str] = []
    failed = {r for lost, _ in case.recoveries for r in lost}
    assert not failed & set(case.ranks), f"{case.id} plays a failed rank"
    for rank in case.ranks:
        got = hypergrid_state(case, rank)
        assert got.kinds == case.kinds and got.placements == case.placements, (rank, got.kinds, got.placements)
        placement = got.placements[-1]
        assert got.in_grid is (rank in placement) and got.state_is_none is (rank not in placement), rank
        expected = megatron_state(placement, rank, case.kwargs)
        found = differences(expected, got.answers, shared=case.options.get("share_groups", True))
        diffs += [f"rank {rank} on {list(placement)}: {d}" for d in found]
    return diffs


@pytest.mark.parametrize("case", _params(CASES))
def test_every_getter_and_global_matches_megatron_on_the_new_placement(case: Case) -> None:
    diffs = compare(case)
    assert diffs == [], "\n".join(diffs[:40])


# ----------------------------------------------------------------------------- the comparison itself
def test_the_comparison_maps_positions_to_the_placed_ranks() -> None:
    # Rank 8 in position 5 of tp 2 x dp 2 x pp 2 (tp 1, dp 0, pp 1), as Megatron-Core's rank 5
    # answers with its positions mapped: the spare is tensor-parallel rank 1 of [4, 8],
    # data-parallel rank 0 of [8, 7], and its pipeline peer is rank 1.
    case = CASES[0]
    got = hypergrid_state(case, 8).answers
    expected = megatron_state(case.placements[0], 8, case.kwargs)
    assert differences(expected, got) == []
    assert got["global _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS"] == [4, 8]
    assert got["call get_tensor_model_parallel_rank()"] == ("ok", 1)
    assert got["call get_tensor_model_parallel_src_rank()"] == ("ok", 4)
    assert got["call get_data_parallel_group()"] == ("ok", ("group", (8, 7)))
    assert got["call get_data_parallel_rank()"] == ("ok", 0)
    assert got["call get_pipeline_model_parallel_next_rank()"] == ("ok", 1)
    assert got["call get_pipeline_model_parallel_world_size()"] == ("ok", 2)


def test_the_comparison_can_fail() -> None:
    # Megatron-Core's answers for another placement (rank 8 in position 4, not 5) differ.
    case = CASES[0]
    got = hypergrid_state(case, 8).answers
    wrong = megatron_state((0, 1, 2, 3, 8, 5, 6, 7), 8, case.kwargs)
    found = differences(wrong, got)
    assert any("get_tensor_model_parallel_rank()" in d for d in found)
    assert any("global _PIPELINE_GLOBAL_RANKS" in d for d in found)
    # Without the mapping, the answers at positions are not the placed ranks'.
    n = len(case.placements[0])
    with fake_world(5, n):
        try:
            parity.ps.initialize_model_parallel(create_gloo_process_groups=False, **case.kwargs)
            unmapped = _state(parity.config_of(n, case.kwargs), parity.ProcessGroupCollection.use_mpu_process_groups)
        finally:
            hm.destroy_model_parallel()
    assert any("get_data_parallel_src_rank()" in d for d in differences(unmapped, got))


SHIFT_CONFIGS = [
    ("tp2-pp2", 16, TP2_PP2), ("moe", 16, MOE), ("moe-etp2", 16, MOE_ETP), ("cp-vp", 16, CP_VP), ("hcp", 16, HCP),
    ("distopt2", 24, DISTOPT2), ("hybrid-cp", 16, dict(context_parallel_size=2, hybrid_context_parallel=True)),
    ("embedding-callbacks", 16, dict(pipeline_model_parallel_size=4, get_embedding_ranks=lambda r: [r[-1]],
                                     get_position_embedding_ranks=lambda r: r[:2])),
    ("gtp2-moe", 16, dict(tensor_model_parallel_size=2, gtp_remat_size=2, expert_model_parallel_size=2,
                          expert_tensor_parallel_size=1, expert_gtp_remat_size=2)),
]


@pytest.mark.parametrize("n,kwargs", [pytest.param(n, kw, id=name) for name, n, kw in SHIFT_CONFIGS])
def test_the_global_rank_answers_are_the_ones_megatron_shifts(n: int, kwargs: dict[str, Any]) -> None:
    # Which answers hold global ranks, checked against Megatron-Core itself where it can place
    # its grids up the world (rank_offset, 0.19): the grid of n ranks on ranks n..2n-1 answers as
    # the grid on 0..n-1 with exactly the answers holds_global_ranks() names (and the groups)
    # moved up by n.
    if "rank_offset" not in parity.INSTALLED.keywords:
        pytest.skip(f"megatron-core {parity.INSTALLED.version} has no rank_offset")
    parity.require_keywords(kwargs)
    config = parity.config_of(n, kwargs)
    diffs = []
    for position in (0, 5, 11, n - 1):
        with fake_world(position, n):
            try:
                parity.ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
                at_zero = _state(config, parity.ProcessGroupCollection.use_mpu_process_groups)
            finally:
                hm.destroy_model_parallel()
        with fake_world(n + position, 2 * n):
            try:
                parity.ps.initialize_model_parallel(create_gloo_process_groups=False, rank_offset=n,
                                                    local_world_size=n, **kwargs)
                moved = _state(config, parity.ProcessGroupCollection.use_mpu_process_groups)
            finally:
                hm.destroy_model_parallel()
        shifted = placed_snapshot(at_zero, tuple(range(n, 2 * n)))
        diffs += [f"position {position}: {d}" for d in parity.differences(shifted, moved)]  # list order too
    assert diffs == [], "\n".join(diffs[:40])


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("world,kwargs", [
    # Expert parallel 4 x expert tensor parallel 2 needs a multiple of 8 ranks per stage: dp 4 -> 3 leaves 6.
    pytest.param(8, dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=2),
                 id="moe-ep4-etp2"),
    # Two optimizer instances need an even data-parallel size: dp 4 -> 3.
    pytest.param(16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                          num_distributed_optimizer_instances=2), id="distopt2"),
])
def test_a_shrink_megatron_cannot_initialize_is_refused(world: int, kwargs: dict[str, Any]) -> None:
    parity.require_keywords(kwargs)
    rank = 0
    with fake_world(rank, world):
        try:
            job = hypergrid.ResilientJob.of_megatron(create_gloo_process_groups=False, **kwargs)
            tp = parity.ps.get_tensor_model_parallel_group()
            with pytest.raises(RecoveryRefused, match="Megatron-Core's sizes do not fit"):
                dataclasses.replace(job, settings=RecoverySettings(gpus_per_node=2)).recover(failed=[world - 1])
            # Nothing changed: the state from before still answers.
            assert parity.ps.get_tensor_model_parallel_group() is tp
        finally:
            hm.destroy_model_parallel()
    survivors = world - world // 4
    with fake_world(rank, survivors):
        try:
            with pytest.raises((AssertionError, RuntimeError, ValueError)):
                parity.ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        finally:
            hm.destroy_model_parallel()


def test_megatron_destroy_leaves_only_rank_lists_and_groups_set() -> None:
    # Why a rank outside the grid is compared with a never-initialized parallel_state: Megatron-Core's
    # own destroy_model_parallel differs from it only in globals that still hold the previous
    # initialization's rank lists or groups (which hypergrid's destroy clears: docs/megatron.md).
    config = parity.config_of(8, TP2_PP2)
    empty = megatron_empty_state(config)
    with fake_world(0, 8):
        try:
            parity.ps.initialize_model_parallel(create_gloo_process_groups=False, **TP2_PP2)
            parity.ps.destroy_model_parallel()
            destroyed = _state(config, parity.ProcessGroupCollection.use_mpu_process_groups)
        finally:
            hm.destroy_model_parallel()
    left = {key: value for key, value in destroyed.items() if key.startswith("global ") and value != empty[key]}
    assert left and all(empty[key] is None and isinstance(value, (list, tuple)) for key, value in left.items()), left
