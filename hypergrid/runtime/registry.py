"""The group registry: creates each distinct process group once, shares it, destroys it.

Every grid, view and adapter asks this registry for groups, through one door,
:meth:`GroupRegistry.acquire`, with one :class:`~hypergrid.runtime.request.GroupRequest`. A
group is identified by what makes two communicators interchangeable: its member ranks (or, where
every rank of the world takes part, the request's world-wide identity), its backend, its timeout
and its options. Whoever asks for an identical group gets the existing object (unless the request
is private), and a group is destroyed only when the last holder lets go.

A missing group is made in the request's creation mode (:mod:`hypergrid.runtime.create`), after
its members have agreed (:mod:`hypergrid.runtime.agreement`). The registry's lock is taken only to
look up, reserve and publish, never across a network wait; creations themselves run one at a time
per process (:attr:`GroupRegistry.creation_lock`), because world-wide calls must be made in the
same order on every rank.

Example, as rank 5 of an 8-rank job on torch's fake backend, which needs no other process::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from hypergrid.layout import GridLayout
    >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    >>> registry = GroupRegistry()
    >>> dp = GroupRequest.for_partition("dp", GridLayout((2, 4), ("tp", "dp")).partition(["dp"]), rank=5)
    >>> pg = registry.acquire("grid-a", dp)
    >>> dist.get_process_group_ranks(pg)
    [1, 3, 5, 7]
    >>> registry.acquire("grid-b", dp) is pg     # identical: shared
    True
    >>> sorted(registry.holders_of(pg))
    [('grid-a', 'dp'), ('grid-b', 'dp')]
    >>> registry.release("grid-a"), registry.release("grid-b")   # groups destroyed
    (0, 1)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from ..layout import Partition
from ..store.records import CheckId
from .agreement import check_agreement, publish_position
from .create import create, enumerate_before_init, require_initialized
from .modes import CreationMode
from .options import GroupOptions, effective_timeout
from .request import ByMembers, GroupRequest, SharingKey
from .torch_compat import default_group, forget_empty_tags

__all__ = ["GroupRegistry", "REGISTRY"]

logger = logging.getLogger(__name__)

#: What a grid passes as the owner of the groups it holds; released together by ``release``.
Owner = Hashable


@dataclass
class _Entry:
    """One process group this rank holds (``pg`` None: a world-wide request this rank is in no group of)."""

    pg: Optional[dist.ProcessGroup]
    #: The keys under which the registry finds this entry for sharing (none for private groups).
    keys: tuple[SharingKey, ...] = ()
    holders: set[tuple[Owner, str]] = field(default_factory=set)
    #: Made outside hypergrid and adopted (see GroupRegistry.adopt): shared, never destroyed.
    adopted: bool = False


class GroupRegistry:
    """This process's table of the groups hypergrid created, with who holds each.

    Thread-safe. Readers (:meth:`count`, :meth:`groups`, :meth:`holders_of`) take the registry's
    lock only briefly and are never blocked by a creation waiting on other ranks: creations hold
    :attr:`creation_lock` instead, which serialises them because every rank must make its
    world-wide calls in the same order. One instance, :data:`REGISTRY`, serves the whole process.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        #: Held while a group is being created (agreement and torch's call); never by readers.
        self.creation_lock = threading.RLock()
        self._shared: dict[SharingKey, _Entry] = {}
        # Insertion-ordered, keyed by identity: forgetting an entry costs O(its keys), not a scan.
        self._entries: dict[int, _Entry] = {}
        # The default group the entries were created under; a new one means a new world, in
        # which the old entries are dead (destroy_process_group() + init_process_group()).
        self._world: Optional[dist.ProcessGroup] = None
        # Attempts to create a group of exactly these members without an agreement check (which
        # names the group itself): the same count on every member, so it names the group alike.
        self._attempts: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ queries
    def count(self) -> int:
        """Number of distinct process groups this rank holds through hypergrid."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.pg is not None)

    def holders_of(self, pg: dist.ProcessGroup) -> set[tuple[Owner, str]]:
        """The (owner, label) pairs currently holding ``pg`` (empty if hypergrid does not)."""
        with self._lock:
            for entry in self._entries.values():
                if entry.pg is pg:
                    return set(entry.holders)
            return set()

    def groups(self) -> list[dist.ProcessGroup]:
        """Every process group this rank holds through hypergrid, in creation order."""
        with self._lock:
            return [e.pg for e in self._entries.values() if e.pg is not None]

    def reset(self) -> None:
        """Forget every entry without destroying anything (the world they lived in is gone)."""
        with self._lock:
            self._shared.clear()
            self._entries.clear()
            self._attempts.clear()
            self._world = None

    def _follow_world(self) -> None:
        current = default_group() if dist.is_initialized() else None
        if current is not self._world:
            if self._entries:
                logger.debug("default process group changed; forgetting %d stale groups", len(self._entries))
            self.reset()
            self._world = current

    # ------------------------------------------------------------------ acquire / release
    def acquire(self, owner: Owner, request: GroupRequest) -> Optional[dist.ProcessGroup]:
        """This rank's group of ``request``: an identical existing one, or a new one. The one door.

        ``owner`` is recorded as a holder; :meth:`release` with the same owner lets go. Every rank
        of the world must call this for a request whose creation mode (see
        :mod:`hypergrid.runtime.modes`) is ``split`` or ``enumerate``; only members for ``local``.
        Before ``init_process_group`` only an ``enumerate`` request is handed to torch (and
        nothing is registered); any other is refused.

        Example, as rank 0 of an 8-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
            >>> req = GroupRequest.derived("embd", (0, 7), options=GroupOptions(group_desc="EMBD"))
            >>> pg = REGISTRY.acquire("owner", req)          # this rank's group: [0, 7]
            >>> dist.get_process_group_ranks(pg), pg.group_desc
            ([0, 7], 'EMBD')
            >>> REGISTRY.release("owner")
            1
            >>> dist.destroy_process_group()
        """
        if not isinstance(request, GroupRequest):
            raise TypeError(f"request must be a GroupRequest, got {type(request).__name__} {request!r}")
        if not dist.is_initialized():
            if request.mode is CreationMode.ENUMERATE:
                return enumerate_before_init(request)
            require_initialized(request.label)
        if request.mode.members_only and request.members is None:
            # Nothing to create here; others may wait on this rank, so say where it stands.
            if request.agreement is not None:
                publish_position(request.agreement)
            return None
        key = request.sharing_key()
        with self._lock:
            self._follow_world()  # a new world's first request forgets the old one before naming
        held = None if key is None else self._hold_existing(owner, request.label, key)
        if held is not None:
            return held.pg
        with self.creation_lock:
            # Another thread may have made it while this one waited for the creation lock.
            held = None if key is None else self._hold_existing(owner, request.label, key)
            if held is not None:
                return held.pg
            require_initialized(request.label)
            entry = _Entry(self._create(request))
            with self._lock:
                self._follow_world()
                if key is not None:
                    members_key = request.members_key()
                    keys = [key] + ([members_key] if entry.pg is not None and members_key not in (None, key) else [])
                    entry.keys = tuple(k for k in keys if k is not None)
                    for k in entry.keys:
                        self._shared[k] = entry
                self._entries[id(entry)] = entry
                # Held and released like a member's entry even when its pg is None: a rank that
                # kept it after its grids let go would skip the next world-wide call others make.
                entry.holders.add((owner, request.label))
        return entry.pg

    def _hold_existing(self, owner: Owner, label: str, key: SharingKey) -> Optional[_Entry]:
        with self._lock:
            self._follow_world()
            entry = self._shared.get(key)
            if entry is not None:
                entry.holders.add((owner, label))
            return entry

    def release(self, owner: Owner) -> int:
        """Drop every hold of ``owner``; destroy groups nobody holds any more. Returns how many.

        Idempotent: releasing an owner that holds nothing does nothing.
        """
        dead: list[_Entry] = []
        with self._lock:
            self._follow_world()
            for entry in list(self._entries.values()):
                stale = [h for h in entry.holders if h[0] == owner]
                if not stale:
                    continue
                entry.holders.difference_update(stale)
                if not entry.holders:
                    self._forget(entry)
                    dead.append(entry)
        destroyed = 0
        for entry in dead:
            if entry.pg is not None and not entry.adopted:
                _destroy_quietly(entry.pg)
                destroyed += 1
        return destroyed

    def destroy_foreign(self, groups: list[Optional[dist.ProcessGroup]]) -> int:
        """Destroy each distinct group of ``groups`` that hypergrid does not hold; returns how many.

        For groups a caller put beside hypergrid's (Megatron-Core lets code write ``grid._pgs``):
        they are destroyed with ``destroy_process_group`` once, as Megatron-Core's ``destroy()``
        does; None, the non-member sentinel and hypergrid's own groups are skipped.

        Example, as rank 0 of a 4-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
            >>> mine = dist.new_group([0, 1], use_local_synchronization=True)
            >>> REGISTRY.destroy_foreign([mine, mine, None])
            1
            >>> dist.destroy_process_group()
        """
        non_member = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
        seen: set[int] = set()
        for pg in groups:
            if pg is None or pg is non_member or id(pg) in seen or self.holders_of(pg):
                continue
            seen.add(id(pg))
            dist.destroy_process_group(pg)
        return len(seen)

    def adopt(
        self,
        owner: Owner,
        pg: dist.ProcessGroup,
        *,
        options: GroupOptions = GroupOptions(),
        label: str = "adopted",
    ) -> dist.ProcessGroup:
        """Hold a process group made outside hypergrid, and share it by its members.

        Afterwards a ``local`` request for the same members and options gets ``pg`` (the newest
        adoption wins over an earlier group with those members; holders of that one keep it).
        ``owner`` holds it like an acquired group, but :meth:`release` never destroys an adopted
        group: it belongs to whoever made it. A group hypergrid made itself is only held again.

        Example, as rank 0 of an 8-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.distributed.device_mesh import init_device_mesh
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
            >>> mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            >>> tp = REGISTRY.adopt("my-grid", mesh.get_group("tp"))
            >>> from hypergrid.layout import GridLayout
            >>> same_members = GridLayout((4, 2), ("tp", "dp")).partition(["tp"])  # rank 0's: [0, 1, 2, 3]
            >>> REGISTRY.acquire("other", GroupRequest.for_partition("tp", same_members, rank=0)) is tp
            True
            >>> REGISTRY.release("my-grid"), REGISTRY.release("other")   # never destroyed
            (0, 0)
            >>> dist.destroy_process_group()
        """
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"pg must be a torch.distributed.ProcessGroup, got {type(pg).__name__} {pg!r}")
        if not isinstance(options, GroupOptions):
            raise TypeError(f"options must be a GroupOptions, got {type(options).__name__}")
        members = tuple(dist.get_process_group_ranks(pg))
        with self._lock:
            self._follow_world()
            entry = next((e for e in self._entries.values() if e.pg is pg), None)
            if entry is None:
                key = ByMembers(tuple(sorted(members)), options.identity)
                entry = _Entry(pg, keys=(key,), adopted=True)
                self._entries[id(entry)] = entry
                self._shared[key] = entry
            entry.holders.add((owner, label))
            return pg

    def evict(self, pg: dist.ProcessGroup) -> bool:
        """Stop sharing ``pg``: later requests for its members get a new group. Its holders keep it
        until they let go (then it is destroyed as usual). For a communicator that is broken (a
        failure left its connections closed) although its members are alive. True if it was shared.

        Example, as rank 0 of a 4-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
            >>> req = GroupRequest.derived("pair", (0, 1))
            >>> pg = REGISTRY.acquire("a", req)
            >>> REGISTRY.evict(pg), REGISTRY.acquire("b", req) is pg
            (True, False)
            >>> REGISTRY.release("a"), REGISTRY.release("b")
            (1, 1)
            >>> dist.destroy_process_group()
        """
        with self._lock:
            entry = next((e for e in self._entries.values() if e.pg is pg), None)
            if entry is None or not entry.keys:
                return False
            for key in entry.keys:
                if self._shared.get(key) is entry:
                    del self._shared[key]
            entry.keys = ()
            return True

    def _forget(self, entry: _Entry) -> None:
        del self._entries[id(entry)]
        for key in entry.keys:
            if self._shared.get(key) is entry:
                del self._shared[key]

    # ------------------------------------------------------------------ creation
    def _create(self, request: GroupRequest) -> Optional[dist.ProcessGroup]:
        """Check that the members agree (members only), then have torch make the group."""
        timeout = effective_timeout(request.options)
        check_id: Optional[CheckId] = None
        agreement = request.agreement
        if agreement is not None:
            if request.members is not None:
                check_id = check_agreement(request.label, request.members, agreement, timeout=timeout)
            else:
                publish_position(agreement)
        return create(request, name=self._group_name(request, check_id), timeout=timeout, check_id=check_id)

    def _group_name(self, request: GroupRequest, check_id: Optional[CheckId]) -> Optional[str]:
        """The torch name of this rank's new group: alike on every member, unlike any earlier one.

        From the check its members agreed in (their member set and its epoch in the store), which
        is theirs alone; without one (a group of one rank, no agreement check, no store to meet
        in) from how many times this process made the group, which names it alike only where
        every member made the same groups."""
        if request.members is None:
            return None
        if check_id is not None:
            return "hypergrid-" + hashlib.sha1(check_id.seed.encode()).hexdigest()
        # A partition's group is named by the partition and its lowest rank, O(1); a group given
        # by its members alone, by the members.
        if isinstance(request.identity, Partition):
            group: Hashable = (request.identity, request.members[0])
            shown = f"{request.identity}@{request.members[0]}"
        else:
            group = request.ordered_members
            shown = ",".join(map(str, group))
        attempt = self._attempts.get(group, 0)
        self._attempts[group] = attempt + 1
        return "hypergrid-" + hashlib.sha1(f"{shown}#{attempt}".encode()).hexdigest()


def _destroy_quietly(pg: dist.ProcessGroup) -> None:
    # The user may already have torn everything down with destroy_process_group(); then the
    # group is gone and there is nothing left to release.
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(pg)
    except (ValueError, RuntimeError, KeyError) as exc:
        logger.debug("process group %s was already gone: %s", pg, exc)
    forget_empty_tags()


#: The process-wide registry every grid uses.
REGISTRY = GroupRegistry()
