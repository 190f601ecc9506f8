"""Compare a plan's enumerations with the ones Megatron-Core itself computes.

For every layout of a :class:`~hypergrid.planning.plan.Plan` (the grid and each view) and every
non-empty subset of its dims, the enumeration hypergrid computes is compared, list for list and
rank for rank, with Megatron-Core's ``HyperCommGrid.get_rank_enum`` over the same shape; and for
every kind made from Megatron sizes, with ``RankGenerator.get_ranks`` of its token, built as
``initialize_model_parallel`` builds it (embedding groups: Megatron-Core's default callbacks over
its pipeline groups). Kinds that Megatron-Core cuts from groups inside
``initialize_model_parallel`` only (distributed-optimizer instances, hierarchical levels) have no
public Megatron-Core function to compare with; they are listed in ``not_compared``. Megatron-Core
is imported here only, when called.

Worlds over :data:`FULL_COMPARISON_RANKS` ranks are compared on a sample: ``RankGenerator`` lists
every group in pure Python (about 2 s per kind at 1,048,576 ranks here), so for each kind
Megatron-Core's own ``generate_masked_orthogonal_rank_groups`` is run for the sampled groups only
(its loop over group indices is handed the sampled indices), and compared with the groups
hypergrid computes for the same ranks in O(group size). ``HyperCommGrid.get_rank_enum`` is numpy
and fast; it is compared in full up to :data:`~hypergrid.planning.plan.MAX_LISTED_WORLD` ranks, and
not at all beyond, as it lists every rank of the world.

Example::

    >>> from hypergrid.planning.plan import plan_megatron
    >>> result = compare_with_megatron(plan_megatron(world_size=16, tp=2, pp=2, ep=2))  # doctest: +SKIP
    >>> result.compared > 0, result.differences                                            # doctest: +SKIP
    (True, [])
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..layout import GridLayout
from ..layout.describe import describe_members
from ..layout.kinds import GroupKind, PipelineSubset
from ..megatron.spec.plan import default_embedding_ranks, default_position_embedding_ranks
from .plan import MAX_LISTED_WORLD, Plan

__all__ = [
    "FULL_COMPARISON_RANKS",
    "NotCompared",
    "ParityResult",
    "SAMPLED_GROUPS",
    "compare_with_megatron",
]

logger = logging.getLogger(__name__)

#: Worlds up to this many ranks are compared in full unless a sample is asked for (RankGenerator
#: takes about half a second per kind at this size here).
FULL_COMPARISON_RANKS = 1 << 18
#: Groups compared per kind when sampling, at most (fewer where groups are large).
SAMPLED_GROUPS = 64
#: Members listed per kind when sampling (hypergrid's and Megatron-Core's each): about half a second of
#: Megatron-Core's Python; at least one group is compared unless it is larger than the limit below.
_SAMPLED_MEMBERS_BUDGET = 1 << 17
#: A group larger than this is not listed by either side when sampling.
_LARGEST_SAMPLED_GROUP = 1 << 20


@dataclass(frozen=True)
class NotCompared:
    """A kind or layout left out of the comparison, and why.

    Example::

        >>> print(NotCompared("intra_dist_opt", "computed only inside initialize_model_parallel"))
        intra_dist_opt: computed only inside initialize_model_parallel
    """

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


@dataclass
class ParityResult:
    """How many enumerations were compared, against what, and every difference found.

    ``sampled``: RankGenerator enumerations were compared on ``sampled_groups`` groups drawn with
    ``seed`` instead of in full.

    Example::

        >>> r = ParityResult(compared=3)
        >>> r.ok
        True
    """

    compared: int = 0
    compared_hyper_comm_grid: int = 0
    compared_rank_generator: int = 0
    differences: list[str] = field(default_factory=list)
    not_compared: list[NotCompared] = field(default_factory=list)
    sampled: bool = False
    sampled_groups: int = 0
    seed: int = 0

    @property
    def ok(self) -> bool:
        return not self.differences

    def _record(self, what: str, source: str, ours: list[list[int]], theirs: list[list[int]],
                indices: Optional[Sequence[int]] = None) -> None:
        """Count one enumeration compared; ``indices``: the group index of each listed group
        where only a sample is listed (None: every group, in order)."""
        self.compared += 1
        if source == "HyperCommGrid":
            self.compared_hyper_comm_grid += 1
        else:
            self.compared_rank_generator += 1
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            mine = describe_members(ours[first]) if first < len(ours) else "no group"
            other = describe_members(theirs[first]) if first < len(theirs) else "no group"
            index = first if indices is None or first >= len(indices) else indices[first]
            counts = f"{len(ours)} vs {len(theirs)} groups" if indices is None else f"{len(indices)} sampled groups"
            self.differences.append(
                f"{what}: {source} differs at group {index}: hypergrid [{mine}], megatron-core [{other}] ({counts})"
            )


@contextlib.contextmanager
def _world_size_env(world_size: int) -> Iterator[None]:
    # Megatron-Core's HyperCommGrid reads WORLD_SIZE when no process group exists; restore
    # whatever the caller had so that planning leaves no trace in the environment.
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        yield
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def _subsets(names: tuple[str, ...]) -> Iterator[list[str]]:
    for k in range(1, len(names) + 1):
        for combo in itertools.combinations(names, k):
            yield list(combo)


class _CannotSample(Exception):
    """Megatron-Core's group function does not have the shape sampling relies on."""


def _megatron_groups_at(generator: Any, token: str, indices: Sequence[int]) -> list[list[int]]:
    """Groups ``indices`` of ``generator.get_ranks(token)``, computed by Megatron-Core's own
    ``generate_masked_orthogonal_rank_groups`` for those groups only.

    That function loops over every group index (``for group_index in range(num_of_group)``) and
    computes each group from its index alone. A copy of it runs with ``range`` bound, for its
    first call only, to the sampled indices; the first call is checked to be that loop (its
    argument is the number of groups), so a Megatron-Core that computes groups another way
    raises :class:`_CannotSample` instead of giving wrong groups.
    """
    from megatron.core import parallel_state

    function = parallel_state.generate_masked_orthogonal_rank_groups
    mask = generator.get_mask(generator.order, token)
    group_size = math.prod(size for size, masked in zip(generator.ordered_size, mask) if masked)
    expected = (generator.world_size // group_size,)
    loops: list[tuple[int, ...]] = []

    def sampled_range(*args: int) -> Any:
        if loops:
            return range(*args)
        loops.append(args)
        if args != expected:
            raise _CannotSample(f"its first loop is range{args}, not over the {expected[0]} group indices")
        return list(indices)

    scope = dict(function.__globals__, range=sampled_range)
    copy = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__,
                              function.__closure__)
    groups = copy(generator.world_size, list(generator.ordered_size), mask)
    if not loops or len(groups) != len(indices):
        raise _CannotSample(f"it returned {len(groups)} groups for {len(indices)} sampled indices")
    return [[rank + generator.rank_offset for rank in group] for group in groups]


def _sampled_groups(kind: GroupKind, ranks: Sequence[int], limit: int) -> tuple[list[int], list[list[int]]]:
    """Group indices and hypergrid's groups (of ``kind.layout``'s ``kind.dims`` groups) of the
    first ``limit`` distinct groups holding ``ranks``, each in O(group size)."""
    indices: list[int] = []
    groups: list[list[int]] = []
    dims = list(kind.dims)
    for rank in ranks:
        if len(indices) >= limit:
            break
        if not kind.layout.contains(rank):
            continue
        index = kind.layout.group_index(dims, rank)
        if index not in indices:
            indices.append(index)
            groups.append(kind.layout.group_ranks(dims, rank))
    return indices, groups


def compare_with_megatron(
    plan: Plan,
    progress: Optional[Callable[[str], None]] = None,
    *,
    sample: Optional[bool] = None,
    seed: int = 0,
    groups_per_kind: int = SAMPLED_GROUPS,
) -> ParityResult:
    """Compare ``plan``'s enumerations with Megatron-Core's; see the module docstring.

    ``sample``: compare RankGenerator kinds on up to ``groups_per_kind`` groups each (the first
    and last rank's, every pipeline stage's first rank's, and random ones drawn with ``seed``)
    instead of in full; None (default): sample worlds over :data:`FULL_COMPARISON_RANKS` ranks.
    ``progress`` is called with a line before each enumeration. Raises ImportError (naming the
    missing package) when megatron-core is not installed, ValueError when a full comparison is
    asked for a world too large to list.

    Example::

        >>> from hypergrid.planning.plan import plan_grid, plan_megatron
        >>> compare_with_megatron(plan_grid([2, 4], ["tp", "dp"])).ok   # doctest: +SKIP
        True
        >>> result = compare_with_megatron(plan_megatron(1 << 30, tp=8, pp=16))   # doctest: +SKIP
        >>> result.sampled, result.ok, str(result.not_compared[0])                  # doctest: +SKIP
        (True, True, 'grid: HyperCommGrid.get_rank_enum lists every one of the 1073741824 ranks; ...')
    """
    # Bad requests fail before megatron-core's import, which takes seconds.
    sampled = plan.world_size > FULL_COMPARISON_RANKS if sample is None else sample
    if not sampled:
        plan.check_enumerable()
    if groups_per_kind < 1:
        raise ValueError(f"groups_per_kind must be at least 1, got {groups_per_kind}")
    with warnings.catch_warnings():
        # megatron-core warns at import about optional CUDA packages a planning laptop lacks.
        warnings.simplefilter("ignore")
        try:
            from megatron.core.hyper_comm_grid import HyperCommGrid as MegatronGrid
            from megatron.core.parallel_state import RankGenerator
        except ImportError as exc:
            raise ImportError(
                f"check needs megatron-core (pip install 'hypergrid[megatron]'): {exc}"
            ) from exc

    result = ParityResult(sampled=sampled, seed=seed)
    layouts: list[tuple[str, GridLayout]] = [("grid", plan.layout)] + list(plan.views.items())
    with _world_size_env(plan.world_size):
        for label, layout in layouts:
            if layout.size > MAX_LISTED_WORLD:
                result.not_compared.append(NotCompared(label, (
                    f"HyperCommGrid.get_rank_enum lists every one of the {layout.size} ranks; "
                    f"it is compared up to {MAX_LISTED_WORLD} ranks")))
                continue
            theirs = MegatronGrid(list(layout.shape), list(layout.dim_names), rank_offset=layout.rank_offset)
            for dims in _subsets(layout.dim_names):
                if progress is not None:
                    progress(f"{label} {layout.key(dims)} (HyperCommGrid)")
                result._record(
                    f"{label} {layout.key(dims)}", "HyperCommGrid", layout.enumerate(dims), theirs.get_rank_enum(dims)
                )
    if plan.megatron is not None:
        _compare_rank_generator(plan, result, RankGenerator, progress, groups_per_kind)
    logger.info("compared %d enumerations (%s), %d differences", result.compared,
                "sampled" if sampled else "in full", len(result.differences))
    return result


def _compare_rank_generator(plan: Plan, result: ParityResult, rank_generator: Any,
                            progress: Optional[Callable[[str], None]], groups_per_kind: int) -> None:
    """Every kind made from Megatron sizes against ``RankGenerator.get_ranks`` of its token."""
    from megatron.core import parallel_state

    m = plan.megatron
    assert m is not None
    generators = {
        None: rank_generator(tp=m.tp, ep=1, dp=m.dp, pp=m.pp, cp=m.cp, order=m.order),
        "expert": rank_generator(tp=m.etp, ep=m.ep, dp=m.edp, pp=m.pp, cp=1, order=m.order),
    }
    # Megatron-Core's own default callbacks, for the embedding kinds that use hypergrid's copies.
    megatron_callbacks = {
        default_embedding_ranks: parallel_state.default_embedding_ranks,
        default_position_embedding_ranks: parallel_state.default_position_embedding_ranks,
    }
    ranks = plan.sample_ranks(groups_per_kind, seed=result.seed) if result.sampled else []
    for kind in plan.kinds:
        generator = generators[kind.view]
        token = "-".join(kind.dims)
        if kind.is_grid_groups:
            # The layouts' dims are RankGenerator's tokens (the expert view's tp is expert tp).
            select: Callable[[list[int]], list[int]] = list
            ours_select: Callable[[list[int]], list[int]] = list
        elif isinstance(kind.derivation, PipelineSubset) and kind.derivation.select in megatron_callbacks:
            select = megatron_callbacks[kind.derivation.select]
            ours_select = kind.derivation.apply
        else:
            result.not_compared.append(NotCompared(kind.name, "Megatron-Core computes it only inside "
                                                              "initialize_model_parallel"))
            continue
        label = f"{kind.name} ({kind.megatron_global.label if kind.megatron_global else None})"
        if not result.sampled:
            if progress is not None:
                progress(f"{kind.name} (RankGenerator)")
            result._record(label, "RankGenerator", kind.enumerate(), [select(g) for g in generator.get_ranks(token)])
            continue
        group_size = kind.layout.group_size(list(kind.dims))
        if group_size > _LARGEST_SAMPLED_GROUP:
            result.not_compared.append(NotCompared(kind.name, (
                f"groups of {group_size} ranks; a sample lists groups of up to {_LARGEST_SAMPLED_GROUP}")))
            continue
        limit = max(1, min(groups_per_kind, _SAMPLED_MEMBERS_BUDGET // group_size))
        indices, ours = _sampled_groups(kind, ranks, limit)
        if progress is not None:
            progress(f"{kind.name} (RankGenerator, {len(indices)} sampled groups)")
        try:
            theirs = _megatron_groups_at(generator, token, indices)
        except _CannotSample as exc:
            result.not_compared.append(NotCompared(kind.name, (
                f"this megatron-core's generate_masked_orthogonal_rank_groups cannot be run on a sample "
                f"({exc}); compare it in full")))
            continue
        result.sampled_groups += len(indices)
        result._record(label, "RankGenerator", [ours_select(g) for g in ours], [select(g) for g in theirs], indices)
