"""Compare a plan's enumerations with the ones Megatron-Core itself computes.

For every layout of a :class:`~hypergrid.report.Plan` (the grid and each view) and every
non-empty subset of its dims, the enumeration hypergrid computes is compared, list for list and
rank for rank, with Megatron-Core's ``HyperCommGrid.get_rank_enum`` over the same shape; and for
every kind made from Megatron sizes, with ``RankGenerator.get_ranks`` of its token, built as
``initialize_model_parallel`` builds it (embedding groups: Megatron-Core's default callbacks over
its pipeline groups). Kinds that Megatron-Core cuts from groups inside
``initialize_model_parallel`` only (distributed-optimizer instances, hierarchical levels) have no
public Megatron-Core function to compare with; they are listed in ``not_compared``. Megatron-Core is imported here only, when called.

Example::

    >>> from hypergrid.report import plan_megatron
    >>> result = compare_with_megatron(plan_megatron(world_size=16, tp=2, pp=2, ep=2))  # doctest: +SKIP
    >>> result.compared > 0, result.differences                                            # doctest: +SKIP
    (True, [])
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from .kinds import PipelineSubset
from .layout import GridLayout
from .megatron.plan import default_embedding_ranks, default_position_embedding_ranks
from .report import Plan

__all__ = ["ParityResult", "compare_with_megatron"]

logger = logging.getLogger("hypergrid.parity")


@dataclass
class ParityResult:
    """How many enumerations were compared, against what, and every difference found.

    Example::

        >>> r = ParityResult(compared=3)
        >>> r.ok
        True
    """

    compared: int = 0
    compared_hyper_comm_grid: int = 0
    compared_rank_generator: int = 0
    differences: list[str] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def _record(self, what: str, source: str, ours: list[list[int]], theirs: list[list[int]]) -> None:
        self.compared += 1
        if source == "HyperCommGrid":
            self.compared_hyper_comm_grid += 1
        else:
            self.compared_rank_generator += 1
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            mine = ours[first] if first < len(ours) else None
            other = theirs[first] if first < len(theirs) else None
            self.differences.append(
                f"{what}: {source} differs at group {first}: hypergrid {mine}, megatron-core {other} "
                f"({len(ours)} vs {len(theirs)} groups)"
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


def compare_with_megatron(plan: Plan, progress: Optional[Callable[[str], None]] = None) -> ParityResult:
    """Compare every enumeration of ``plan`` with Megatron-Core's; see the module docstring.

    Raises ImportError (naming the missing package) when megatron-core is not installed.

    Example::

        >>> from hypergrid.report import plan_grid
        >>> compare_with_megatron(plan_grid([2, 4], ["tp", "dp"])).ok   # doctest: +SKIP
        True
    """
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

    result = ParityResult()
    layouts: list[tuple[str, GridLayout]] = [("grid", plan.layout)] + list(plan.views.items())
    with _world_size_env(plan.world_size):
        for label, layout in layouts:
            theirs = MegatronGrid(list(layout.shape), list(layout.dim_names), rank_offset=layout.rank_offset)
            for dims in _subsets(layout.dim_names):
                if progress is not None:
                    progress(f"{label} {layout.key(dims)} (HyperCommGrid)")
                result._record(
                    f"{label} {layout.key(dims)}", "HyperCommGrid", layout.enumerate(dims), theirs.get_rank_enum(dims)
                )
    if plan.megatron is not None:
        m = plan.megatron
        generators = {
            None: RankGenerator(tp=m.tp, ep=1, dp=m.dp, pp=m.pp, cp=m.cp, order=m.order),
            "expert": RankGenerator(tp=m.etp, ep=m.ep, dp=m.edp, pp=m.pp, cp=1, order=m.order),
        }
        from megatron.core import parallel_state

        # Megatron-Core's own default callbacks, for the embedding kinds that use hypergrid's copies.
        megatron_callbacks = {
            default_embedding_ranks: parallel_state.default_embedding_ranks,
            default_position_embedding_ranks: parallel_state.default_position_embedding_ranks,
        }
        for kind in plan.kinds:
            generator = generators[kind.view]
            label = f"{kind.name} ({kind.megatron_global.label if kind.megatron_global else None})"
            if kind.is_grid_groups:
                # The layouts' dims are RankGenerator's tokens (the expert view's tp is expert tp).
                theirs = generator.get_ranks("-".join(kind.dims))
            elif isinstance(kind.derivation, PipelineSubset) and kind.derivation.select in megatron_callbacks:
                callback = megatron_callbacks[kind.derivation.select]
                theirs = [callback(ranks) for ranks in generator.get_ranks("-".join(kind.dims))]
            else:
                result.not_compared.append(kind.name)
                continue
            if progress is not None:
                progress(f"{kind.name} (RankGenerator)")
            result._record(label, "RankGenerator", kind.enumerate(), theirs)
    logger.info("compared %d enumerations, %d differences", result.compared, len(result.differences))
    return result
