"""Agreeing on who is gone: one set of failed ranks, decided once, read by every survivor.

After a failure every surviving rank of a *domain* (the grid's ranks and its spares) calls
:func:`agree_on_failures`. The survivors meet in a round named by what they share, the domain
(a digest of its ranks) and the round's epoch in the store, exactly as the agreement's rounds are
named (:mod:`hypergrid.runtime.agreement`): nothing a process counted by itself. Each survivor
writes that it is here; each then waits until every rank of the domain is here or has a stale
heartbeat (:mod:`hypergrid.runtime.liveness`), or the timeout passes, and proposes the absent
ranks as the failed set. The first proposal is the round's one verdict (``compare_set`` on one
key): every survivor reads the same set, so no two survivors can act on different failures.

A rank that was still alive but arrived after the verdict finds itself in the failed set and is
told so (:class:`~hypergrid.errors.ExcludedByRecovery`); a round that cannot finish (the store
stops answering) fails on every survivor, and its epoch is advanced so that a retry starts a
round of its own.

Example, in a one-rank gloo world whose store is a ``HashStore``: of the domain ``[0, 1]``, rank 1
never comes, and is found failed once the short timeout passes::

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> agree_on_failures([0, 1], timeout=timedelta(seconds=0.3)).failed
    (1,)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import ExcludedByRecovery, RecoveryError, StoreUnresponsiveError
from ..layout.describe import describe_ranks, one_line
from .liveness import LivenessWatch, running_heartbeat
from .store import PREFIX, StoreClient, agreement_possible, end_round
from .wire import FailureVerdict, decode, encode, members_digest

__all__ = ["agree_on_failures", "recovery_key", "release_spares", "wait_for_recovery"]

logger = logging.getLogger(__name__)

#: How long a heartbeat may stand still before its rank counts as gone, in heartbeat intervals.
STALE_BEATS = 5

#: How often a waiting spare looks whether a recovery started or the job released it, in seconds.
_RELEASE_POLL_S = 0.5


def recovery_key(domain: Sequence[int]) -> str:
    """Where the recovery rounds of ``domain`` (its ranks, any order) live in the store.

    Example::

        >>> recovery_key([1, 0]) == recovery_key([0, 1])
        True
    """
    return f"{PREFIX}/recover/{members_digest(domain)}"


def agree_on_failures(domain: Sequence[int], *, timeout: timedelta,
                      stale_after_s: Optional[float] = None) -> FailureVerdict:
    """The failed ranks of ``domain``, as every surviving member of it reads them.

    Call it on every surviving rank of ``domain`` (the grid's ranks and its spares). Returns at
    once the verdict when every rank arrived (no rank failed: an empty set) or when each absent
    rank's heartbeat has stood still for ``stale_after_s`` (default: five heartbeat intervals of
    this rank's own heartbeat, or the whole timeout where none runs); otherwise at ``timeout``,
    with the absent ranks failed.

    Raises:
        ExcludedByRecovery: this rank is in the failed set (it arrived after the verdict).
        RecoveryError: the store did not answer, or this rank is not in ``domain``.
    """
    ranks = sorted(set(domain))
    rank = dist.get_rank()
    if rank not in ranks:
        raise RecoveryError(f"rank {rank} is not in the recovery domain {describe_ranks(ranks)}")
    if not agreement_possible():
        raise RecoveryError("agreeing on failed ranks needs the job's store (not the fake backend); pass failed= instead")
    beat = running_heartbeat()
    stale_after = stale_after_s if stale_after_s is not None else (
        STALE_BEATS * beat.interval_s if beat is not None else timeout.total_seconds())
    store = StoreClient(time.monotonic() + timeout.total_seconds())
    base = recovery_key(ranks)
    try:
        epoch = int(store.add(f"{base}/epoch", 0))
        here = f"{base}/{epoch}/here"
        verdict_key = f"{base}/{epoch}/verdict"
        store.append(here, f"{rank},")
        watch = LivenessWatch(stale_after)
        while True:
            if store.check([verdict_key]):
                break
            arrived = {int(r) for r in store.get(here).decode().split(",") if r}
            absent = [r for r in ranks if r not in arrived]
            if not absent or set(absent) <= watch.stale(absent, store) or store.remaining() <= 0.2:
                proposal = FailureVerdict(tuple(absent), epoch)
                store.compare_set(verdict_key, "", encode(proposal))
                break
            time.sleep(0.05)
        verdict = decode(FailureVerdict, store.get(verdict_key))
    except (dist.DistError, StoreUnresponsiveError) as exc:
        with contextlib.suppress(dist.DistError, StoreUnresponsiveError):
            end_round(store, f"{base}/epoch", epoch)  # type: ignore[possibly-undefined]
        raise RecoveryError(
            f"hypergrid: the survivors of {describe_ranks(ranks)} could not agree on who failed: the job's store "
            f"did not answer ({type(exc).__name__}: {one_line(str(exc), 200)})"
        ) from exc
    if rank in verdict.failed:
        raise ExcludedByRecovery(
            f"hypergrid: rank {rank} arrived after the survivors of {describe_ranks(ranks)} had found ranks "
            f"{describe_ranks(verdict.failed)} failed, itself among them: it is out of the grid"
        )
    logger.info("rank %d: the survivors of %s agree that ranks %s failed", rank, describe_ranks(ranks),
                list(verdict.failed))
    return verdict


def wait_for_recovery(domain: Sequence[int], *, timeout: timedelta, origin: Optional[Sequence[int]] = None) -> bool:
    """Block (a spare, outside the grid) until some survivor of ``domain`` starts a recovery
    round, or the job releases its spares (:func:`release_spares` of ``origin``, the job's ranks
    before any recovery; default ``domain``), or ``timeout`` passes; True when a recovery started.

    Example::

        >>> wait_for_recovery([0, 1], timeout=timedelta(seconds=0.1))   # no process group
        False
    """
    if not agreement_possible():
        return False
    store = StoreClient(time.monotonic() + 30.0)  # each call bounded; the wait itself is the loop's
    base = recovery_key(sorted(set(domain)))
    epoch = int(store.add(f"{base}/epoch", 0))
    started, released = f"{base}/{epoch}/here", _released_key(domain if origin is None else origin)
    end = time.monotonic() + timeout.total_seconds()
    # Either key ends the wait, and a store wait needs all of its keys (and a TCPStore logs a
    # warning for each wait that runs out): so a look at both keys now and then.
    while True:
        if store.check([started]):
            return True
        if store.check([released]) or time.monotonic() >= end:
            return False
        store.extend(_RELEASE_POLL_S + 5.0)
        time.sleep(min(_RELEASE_POLL_S, max(0.0, end - time.monotonic())))


def release_spares(origin: Sequence[int]) -> None:
    """Tell the spares waiting in :func:`wait_for_recovery` for the job whose ranks were
    ``origin`` before any recovery that the job is over: they return (False) within half a second
    instead of at their timeout. Named by the job's first ranks, not its current ones, so that a
    release reaches a spare whatever recoveries it took part in (a survivor whose recovery failed
    still holds the job from before it). Any rank may call it, any number of times.

    Example::

        >>> release_spares([0, 1])   # no process group: nobody waits
    """
    if not agreement_possible():
        return
    store = StoreClient(time.monotonic() + 30.0)
    store.set(_released_key(origin), "1")


def _released_key(origin: Sequence[int]) -> str:
    return f"{PREFIX}/released/{members_digest(sorted(set(origin)))}"
