"""Whether communicators that outlived a failure still work, decided alike by all their members.

A rank's death breaks more than the groups it was in: a survivor that waited in a collective for
a peer who had already left for the recovery times out, and gloo then closes that group's
connections; an operation one member issued and the other never matched leaves the group out
of step. Such a group has living members only, and would be kept by a recovery that looks at
members alone. :func:`broken_groups` probes each candidate group with one small collective (in
the same order on every member, as the groups were made) and the participants pool what they
found through the store, so that every member of a group reads the same answer: broken if any
member found it so.

Example, in a one-rank gloo world whose store is a ``HashStore``: a group of this rank alone works::

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> alone = dist.new_group([0])
    >>> broken_groups([alone], participants=[0], timeout=timedelta(seconds=5))
    set()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import RecoveryError, StoreUnresponsiveError
from ..layout.describe import describe_ranks
from .losses import lost_among, watching_now
from .store import PREFIX, StoreClient, agreement_possible
from .wire import members_digest

__all__ = ["probe", "broken_groups"]

logger = logging.getLogger(__name__)

#: The longest one probe may take: a working group answers in milliseconds once its members probe.
_PROBE_S = timedelta(seconds=10)


def probe(pg: dist.ProcessGroup, timeout: timedelta) -> bool:
    """Whether one all-reduce over ``pg`` completes, with the right sum, within ``timeout``.

    Example::

        >>> probe.__name__
        'probe'
    """
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
                  scope: Optional[str] = None, known: Iterable[tuple[int, ...]] = ()) -> set[tuple[int, ...]]:
    """The member lists of the groups, among ``groups``, that some member found broken.

    Every rank of ``participants`` calls it, each with the groups it holds among those the
    recovery could keep, in the order they were made; it returns when all have reported. Cost:
    one small collective per group, two store calls per rank and one read of the pooled reports.
    ``known``: member lists already known broken (a member aborted them): not probed, reported.
    ``scope``: names this check in the store (a recovery round's name), so that each round of a
    recovery checks afresh; by default an epoch the store counts per set of participants.

    Raises:
        RecoveryError: a participant did not report within ``timeout`` (it died or hangs).
    """
    if not agreement_possible():
        return set()  # one simulated rank (the fake backend): its groups carry nothing that can break
    known = {tuple(k) for k in known}
    bad = []
    for pg in groups:
        members = tuple(dist.get_process_group_ranks(pg))
        if members in known or not probe(pg, min(timeout, _PROBE_S)):
            bad.append(members)
    ranks = sorted(set(participants))
    store = StoreClient(time.monotonic() + timeout.total_seconds())
    try:
        if scope is None:
            base = f"{PREFIX}/health/{members_digest(ranks)}"
            epoch = int(store.add(f"{base}/epoch", 0))
            here = f"{base}/{epoch}"
        else:
            base, epoch, here = "", 0, f"{PREFIX}/health/{scope}"
        reports = f"{here}/reports"
        if bad:  # only what was found broken is pooled: every participant reads the pool
            store.append(reports, json.dumps(bad) + "\n")
        if store.add(f"{here}/count", 1) == len(ranks):
            if scope is None:
                store.compare_set(f"{base}/epoch", str(epoch), str(epoch + 1))  # everyone has read it
            store.set(f"{here}/ready", "")
        while not store.wait([f"{here}/ready"], min(1.0, store.remaining()) if watching_now() else store.remaining()):
            lost = lost_among(ranks) if store.remaining() > 0 else []
            if store.remaining() <= 0 or lost:
                raise RecoveryError(
                    f"hypergrid: ranks {describe_ranks(ranks)} did not all report which groups still work within "
                    f"{timeout.total_seconds():g} s" + (f": ranks {describe_ranks(lost)} were lost" if lost else "")
                )
        pooled = store.get(reports).decode().splitlines() if store.check([reports]) else []
    except (dist.DistError, StoreUnresponsiveError) as exc:
        raise RecoveryError(f"hypergrid: the job's store did not answer while checking groups: {exc}") from exc
    found = {tuple(members) for line in pooled if line for members in json.loads(line)}
    if found:
        logger.info("groups found broken after the failure, rebuilt: %s", sorted(found))
    return found
