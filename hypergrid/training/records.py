"""What one recovery did on one rank, and how long each part took.

Example::

    >>> record = RecoveryRecord(kind="replace", plan="replace: rank 3 -> 4; 1 spares left", rank=0,
    ...                         failed_step=5, resumed_step=5, seen_at=0.0, agreed_s=0.2, rebuilt_s=0.1,
    ...                         restored_s=0.05, first_step_s=0.3)
    >>> record.describe()
    'rank 0: replace: rank 3 -> 4; 1 spares left; failed in step 5, resumed at step 5; agreed 0.20 s, \
rebuilt 0.10 s, restored 0.05 s, first step 0.30 s'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["RecoveryRecord"]


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery (or growth, or a spare's joining) as one rank saw it.

    ``kind``: the plan's kind (``replace``, ``shrink``, ``grow``), or ``joined`` on a rank that
    came from outside the grid; ``failed_step``: the step this rank was in when it saw the failure
    (None on a rank that came from outside); ``resumed_step``: the step every rank went on from;
    ``seen_at``: when this rank saw the failure (or was given a position), seconds since the epoch;
    then the parts, in seconds: until the survivors agreed (``agreed_s``), until the new
    placement's groups were made (``rebuilt_s``), until the state of ``resumed_step`` was back
    (``restored_s``), until the first step after it was done (``first_step_s``: None where
    training ended first). ``agreed_s`` and ``rebuilt_s`` are None where the rank did not take
    part in the rounds (it was given a position while waiting). ``plan_bytes``: what this rank
    received to plan its own part of the restore (the blocks of state not counted), from
    ``plan_peers`` ranks; None where the plan was made from every rank's report.
    """

    kind: str
    plan: str
    rank: int
    failed_step: Optional[int]
    resumed_step: int
    seen_at: float
    agreed_s: Optional[float]
    rebuilt_s: Optional[float]
    restored_s: float
    first_step_s: Optional[float] = None
    plan_bytes: Optional[int] = None
    plan_peers: Optional[int] = None

    @property
    def total_s(self) -> float:
        """From the failure seen to the first step done (or the state restored)."""
        return sum(part for part in (self.agreed_s, self.rebuilt_s, self.restored_s, self.first_step_s)
                   if part is not None)

    def describe(self) -> str:
        """The record in one line, as the log has it."""
        failed = f"failed in step {self.failed_step}, " if self.failed_step is not None else ""
        parts = [f"{name} {value:.2f} s" for name, value in (
            ("agreed", self.agreed_s), ("rebuilt", self.rebuilt_s), ("restored", self.restored_s),
            ("first step", self.first_step_s)) if value is not None]
        return f"rank {self.rank}: {self.plan}; {failed}resumed at step {self.resumed_step}; {', '.join(parts)}"
