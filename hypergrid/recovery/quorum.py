"""Who failed, decided from what a recovery round's leader sees: a pure function, no store.

A rank lost on the board is failed; a rank absent but not lost may be blocked in a collective, so
it is waited for up to ``bound_s``, then counted out as hung (a deadline that comes first abandons
the round, as do participants whose settings differ).

Example: of the job ``[0, 1, 2, 3]``, ranks 0 and 1 arrived and rank 2's process ended::

    >>> from hypergrid.store.records import Arrival
    >>> arrivals = {0: Arrival(0, step=5), 1: Arrival(1, step=4, aborted=((0, 1),))}
    >>> seen = RoundView(0, (0, 1, 2, 3), arrivals, {2: "its process ended"}, waited_s=1.0)
    >>> decide(seen, bound_s=30.0, remaining_s=60.0) is None     # rank 3 is alive: waited for
    True
    >>> verdict = decide(seen, bound_s=0.5, remaining_s=60.0)
    >>> verdict.failed, verdict.step, verdict.aborted_by, verdict.reasons[0]
    ((2, 3), 4, ((1, 1),), 'rank 2: its process ended before it arrived')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..layout.describe import describe_ranks
from ..liveness.ring import as_runs
from ..store.records import Arrival, FailureVerdict

__all__ = ["RoundView", "decide", "ABANDON_MARGIN_S"]

#: A leader this close to its deadline abandons the round rather than be cut off mid-proposal.
ABANDON_MARGIN_S = 0.2


@dataclass(frozen=True)
class RoundView:
    """What a round's leader sees: ``lost``, the board's lost ranks and why; ``offers``, ranks outside
    the job that offered themselves; ``board_read``, how many board entries ``lost`` came from."""

    number: int
    domain: Sequence[int]
    arrivals: Mapping[int, Arrival]
    lost: Mapping[int, str]
    waited_s: float
    offers: Sequence[int] = ()
    board_read: int = 0


def _settings_disagree(arrivals: Mapping[int, Arrival]) -> str:
    """Why the arrivals would plan apart (their settings differ); empty where they agree.

    >>> _settings_disagree({0: Arrival(0, settings="gpus_per_node=8"), 5: Arrival(5, settings="gpus_per_node=4")})
    "the participants' recovery settings differ: ranks [0] have gpus_per_node=8; ranks [5] have gpus_per_node=4"
    """
    by_value: dict[str, list[int]] = {}
    for rank, arrival in sorted(arrivals.items()):
        by_value.setdefault(arrival.settings, []).append(rank)
    if len(by_value) <= 1:
        return ""
    held = "; ".join(f"ranks {describe_ranks(ranks)} have {value or 'none said'}" for value, ranks in by_value.items())
    return f"the participants' recovery settings differ: {held}"


def decide(seen: RoundView, *, bound_s: float, remaining_s: float) -> Optional[FailureVerdict]:
    """The round's verdict, or None to wait longer."""
    disagree = _settings_disagree({r: a for r, a in seen.arrivals.items() if r not in seen.lost})
    if disagree:
        return FailureVerdict((), seen.number, abandoned=disagree)
    absent = [r for r in (*seen.domain, *seen.offers) if r not in seen.arrivals]
    live_absent = [r for r in absent if r not in seen.lost]
    reasons = {r: f"{seen.lost[r]} before it arrived" for r in absent if r in seen.lost}
    reasons.update({r: f"it arrived, then {seen.lost[r]}" for r in seen.arrivals if r in seen.lost})
    if live_absent:
        if seen.waited_s < bound_s:
            if remaining_s <= ABANDON_MARGIN_S:
                return FailureVerdict((), seen.number, abandoned=(
                    f"ranks {describe_ranks(live_absent)} neither arrived nor were lost before the recovery's "
                    f"deadline"))
            return None
        reasons.update({r: f"it is alive, but did not arrive within {bound_s:g} s (the job's longest collective "
                           f"timeout and a margin): it hangs" for r in live_absent})
    failed = tuple(sorted(reasons))
    present = {r: a for r, a in seen.arrivals.items() if r not in reasons}
    offers = set(seen.offers)
    steps = [a.step for a in present.values() if a.step is not None]
    return FailureVerdict(
        failed, seen.number, tuple(f"rank {r}: {reasons[r]}" for r in failed),
        offered=tuple(sorted(r for r in present if r in offers)),
        step=min(steps) if steps else None,
        grow=any(a.reason == "grow" for a in present.values()),
        recovering=any(a.reason == "recover" for a in present.values()),
        aborted_by=tuple(as_runs(r for r, a in present.items() if a.aborted)),
        board_read=seen.board_read,
    )
