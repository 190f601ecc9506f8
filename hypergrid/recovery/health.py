"""Whether communicators that outlived a failure still work, decided alike by all their members.

A failure breaks more than the dead rank's groups: a survivor that timed out waiting for a peer
already in the recovery leaves gloo's connections closed, or a group out of step, with only living
members. So each group is probed, and a group is broken if any member found it so.

Example, in a one-rank gloo world on a ``HashStore``: a group of this rank alone works::

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> alone = dist.new_group([0])
    >>> broken_groups([alone], participants=[0], timeout=timedelta(seconds=5))
    set()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import RecoveryError, StoreUnresponsiveError
from ..layout.describe import describe_ranks
from ..runtime.environment import agreement_possible, job_store
from ..runtime.scope import RecoveryScope, current_scope, lost_among
from ..store import meeting
from ..store.client import StoreClient, advance_epoch
from ..store.keys import Meeting, health_attempt, health_epoch, health_meeting

__all__ = ["probe", "broken_groups"]

logger = logging.getLogger(__name__)


def probe(pg: dist.ProcessGroup, timeout: timedelta) -> bool:
    """Whether one all-reduce over ``pg`` completes, with the right sum, within ``timeout``."""
    value = torch.ones(1)
    try:
        work = dist.all_reduce(value, group=pg, async_op=True)
        if not work.wait(timeout):
            return False
    except Exception as exc:  # a closed connection, a timeout: the group is what is being judged
        logger.info("probe of the group of ranks %s failed: %s", dist.get_process_group_ranks(pg), exc)
        return False
    return int(value.item()) == dist.get_world_size(pg)


def broken_groups(groups: Sequence[dist.ProcessGroup], *, participants: Sequence[int], timeout: timedelta,
                  attempt: Optional[str] = None, known: Iterable[tuple[int, ...]] = (),
                  probe_s: float = 10.0) -> set[tuple[int, ...]]:
    """The member lists of ``groups`` that some member found broken; every rank of ``participants``
    calls it with its keepable groups in creation order, and it returns once all have reported.
    ``known``: lists known broken (aborted), not probed. ``attempt``: the round's keys, naming the
    meeting (default: an epoch counted per set of participants). Raises RecoveryError where a
    participant did not report within ``timeout``."""
    if not agreement_possible():
        return set()  # one simulated rank (the fake backend): its groups carry nothing that can break
    known = {tuple(k) for k in known}
    bad = []
    for pg in groups:
        members = tuple(dist.get_process_group_ranks(pg))
        if members in known or not probe(pg, min(timeout, timedelta(seconds=probe_s))):
            bad.append(members)
    ranks = sorted(set(participants))
    store = job_store(time.monotonic() + timeout.total_seconds())
    scope = current_scope()
    hearing = scope if scope is not None and scope.hearing and attempt is not None else None
    try:
        epoch_key, epoch = "", 0
        if attempt is None:
            epoch_key = health_epoch(ranks)
            epoch = int(store.add(epoch_key, 0))
        pool = health_meeting(attempt if attempt is not None else health_attempt(ranks, epoch))
        if meeting.arrive(store, pool, len(ranks), json.dumps(bad) if bad else None).completes:
            if epoch_key:
                advance_epoch(store, epoch_key, epoch)  # everyone has read it
            found = sorted({tuple(m) for line in meeting.lines(store, pool) for m in json.loads(line)})
            _decide(store, pool, json.dumps({"broken": found}), hearing)
        outcome = _wait(store, pool, ranks, hearing, scope)
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise RecoveryError(f"hypergrid: the job's store did not answer while checking groups: {exc}") from exc
    if "lost" in outcome:
        lost = outcome["lost"]
        raise RecoveryError(
            f"hypergrid: ranks {describe_ranks(ranks)} did not all report which groups still work within "
            f"{timeout.total_seconds():g} s" + (f": ranks {describe_ranks(lost)} were lost" if lost else ""))
    broken = {tuple(members) for members in outcome["broken"]}
    if broken:
        logger.info("groups found broken after the failure, rebuilt: %s", sorted(broken))
    return broken


def _decide(store: StoreClient, pool: Meeting, proposal: str, hearing: Optional[RecoveryScope]) -> None:
    standing = meeting.decide(store, pool, proposal)
    if hearing is not None and standing == proposal.encode():
        hearing.publish(pool.outcome, standing)


def _wait(store: StoreClient, pool: Meeting, ranks: list[int], hearing: Optional[RecoveryScope],
          scope: Optional[RecoveryScope]) -> dict[str, Any]:
    """The pool's outcome, heard or read (a loss decides it); none lost (``{"lost": []}``) at the deadline."""
    with contextlib.ExitStack() as alarm:
        if hearing is not None:
            def lost(ranks_lost: list[int]) -> None:
                _decide(job_store(time.monotonic() + 5.0), pool, json.dumps({"lost": ranks_lost}), hearing)
            alarm.enter_context(hearing.on_loss(ranks, lost))
        while store.remaining() > 0:
            slice_s = store.remaining() if scope is None or hearing is not None else min(1.0, store.remaining())
            raw = meeting.wait_outcome(store, pool, slice_s, hearing, hearing.fallback_s if hearing else 0.0)
            if raw is not None:
                value: dict[str, Any] = json.loads(raw)
                return value
            gone = lost_among(ranks) if hearing is None and store.remaining() > 0 else []
            if gone:
                return {"lost": gone}
    return {"lost": []}
