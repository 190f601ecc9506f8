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
has no state (``job.state`` is None) and its ``parallel_state`` answers as after Megatron-Core's
own ``destroy_model_parallel``.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

import hypergrid
import hypergrid.megatron as hm
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
    of the installed module (Megatron-Core's ``destroy_model_parallel`` leaves the rank lists of
    the initialization before, which hypergrid's clears, by design: docs/megatron.md)."""
    installed = parity.ps
    parity.ps = _fresh_parallel_state()
    try:
        with fake_world(0, config.world_size):
            return _state(config, parity.ProcessGroupCollection.use_mpu_process_groups)
    finally:
        parity.ps = installed


@functools.lru_cache(maxsize=None)
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


def hypergrid_state(case: "Case", rank: int) -> Recovered:
    """Play ``rank`` of ``case``'s world: build the job, recover it as the case says, and record
    what ``parallel_state`` answers."""
    with fake_world(rank, case.world):
        try:
            job = hypergrid.ResilientJob.of_megatron(spares=case.spares, create_gloo_process_groups=False,
                                                     **case.options, **case.kwargs)
            placements, kinds = [], []
            for failed, gpus_per_node in case.recoveries:
                job = job.recover(failed=failed, gpus_per_node=gpus_per_node)
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
    slow: bool = False


TP2_PP2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
R = range  # brevity in the placements below

CASES = [
    # tp 2 x dp 2 x pp 2 on 0-7, spares 8, 9: rank 5 lost, spare 8 takes position 5.
    Case("replace-one", 10, (8, 9), TP2_PP2, (((5,), 2),), ("replace",),
         ((0, 1, 2, 3, 4, 8, 6, 7),), ranks=(0, 4, 7, 8, 9)),
    # The same without share_groups: the communicator list is compared too (as a set either way).
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
         ranks=(4, 5, 11, 12, 13)),
]


def _params(cases: list[Case]) -> list[Any]:
    return [pytest.param(case, id=case.id, marks=[pytest.mark.slow] if case.slow else []) for case in cases]


def compare(case: Case) -> list[str]:
    """Differences between hypergrid and Megatron-Core on each of ``case``'s ranks (empty: none)."""
    parity.require_keywords(case.kwargs)
    diffs: list[str] = []
    for rank in case.ranks:
        got = hypergrid_state(case, rank)
        assert got.kinds == case.kinds and got.placements == case.placements, (rank, got.kinds, got.placements)
        placement = got.placements[-1]
        assert got.in_grid is (rank in placement) and got.state_is_none is (rank not in placement), rank
        expected = megatron_state(placement, rank, case.kwargs)
        if case.options.get("share_groups", True):
            # Equal groups are one communicator: the distinct memberships, in any order.
            for side in (expected, got.answers):
                side["communicators"] = sorted({repr(g) for g in side["communicators"]})
        diffs += [f"rank {rank} on {list(placement)}: {d}" for d in parity.differences(expected, got.answers)]
    return diffs


@pytest.mark.parametrize("case", _params(CASES))
def test_every_getter_and_global_matches_megatron_on_the_new_placement(case: Case) -> None:
    diffs = compare(case)
    assert diffs == [], "\n".join(diffs[:40])
