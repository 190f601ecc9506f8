"""The group registry: creates each distinct process group once, shares it, destroys it.

Every grid, view and adapter asks this registry for groups; it is the only module that calls
``torch.distributed``'s group constructors. A group is identified by what makes two
communicators interchangeable: its member ranks, its backend, its timeout and its options.
Whoever asks for an identical group gets the existing object (unless they ask for a private one),
and a group is destroyed only when the last grid holding it lets go.

How a missing group gets made is decided per request by :func:`~hypergrid.runtime.modes.creation_mode`
from the grid's strategy and how the job was started, alike on every rank:

``local``
    Only the members of a group call ``new_group(..., use_local_synchronization=True)``; the
    other ranks do nothing. Sharing is decided by member ranks, which every member sees alike.
``split``
    Every rank of the world calls ``split_group`` once per request, passing only its own group
    (a rank in none passes a group it is not in and gets None). Required on a default group bound
    to a device whose backend splits (NCCL with ``device_id``): there torch builds every
    communicator by splitting the world's, which all ranks must join.
``enumerate``
    Megatron-Core's call pattern: every rank of the world calls
    ``new_subgroups_by_enumeration`` with every group of the request.

Under ``split`` and ``enumerate`` every rank takes part, so whether a request reuses an existing
group is decided by the request's world-wide identity, which every rank computes alike.

Every group hypergrid makes, the Megatron adapter's derived and duplicate groups included, comes
through :meth:`GroupRegistry.acquire_request` with one :class:`GroupRequest`: one strategy choice,
one agreement check (:mod:`hypergrid.runtime.agreement`) and one error type naming the group. The
registry's lock is taken only to look up, reserve and publish, never across a network wait;
creations themselves run one at a time per process (:attr:`GroupRegistry.creation_lock`), because
world-wide calls must be made in the same order on every rank.

Example, as rank 5 of an 8-rank job on torch's fake backend, which needs no other process::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from hypergrid.layout import GridLayout
    >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    >>> registry = GroupRegistry()
    >>> dp = GroupRequest.from_layout(GridLayout((2, 4), ("tp", "dp")), ["dp"], rank=5)
    >>> pg = registry.acquire_request("grid-a", dp, strategy="local")
    >>> dist.get_process_group_ranks(pg)
    [1, 3, 5, 7]
    >>> registry.acquire_request("grid-b", dp) is pg     # identical: shared
    True
    >>> sorted(registry.holders_of(pg))
    [('grid-a', 'dp'), ('grid-b', 'dp')]
    >>> registry.release("grid-a"), registry.release("grid-b")   # groups destroyed
    (0, 1)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Union

import torch.distributed as dist

from .torch_compat import default_group, forget_empty_tags, group_name_override
from .agreement import Agreement, RoundId, check_agreement, describe_ranks, explain_creation_failure, publish_position
from ..errors import GroupCreationError
from .options import GroupOptions, effective_timeout
from ..layout import Dims, GridLayout, Partition
from .modes import CreationMode, Strategy, creation_mode

__all__ = ["GroupRequest", "GroupRegistry", "REGISTRY"]

logger = logging.getLogger("hypergrid.runtime.registry")

#: What a grid passes as the owner of the groups it holds; released together by ``release``.
Owner = Hashable


@dataclass
class _Entry:
    """One process group this rank holds (``pg`` None: a world-wide request this rank is in no group of)."""

    pg: Optional[dist.ProcessGroup]
    #: The keys under which the registry finds this entry for sharing (none for private groups).
    keys: tuple = ()
    holders: set = field(default_factory=set)
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
        self._shared: dict[tuple, _Entry] = {}
        # Insertion-ordered, keyed by identity: forgetting an entry costs O(its keys), not a scan.
        self._entries: dict[int, _Entry] = {}
        # The default group the entries were created under; a new one means a new world, in
        # which the old entries are dead (destroy_process_group() + init_process_group()).
        self._world: Optional[dist.ProcessGroup] = None
        # Attempts to create a group of exactly these members without an agreement round (which
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
    def acquire_request(
        self,
        owner: Owner,
        request: "GroupRequest",
        *,
        strategy: Union[str, Strategy] = Strategy.AUTO,
        options: GroupOptions = GroupOptions(),
        private: bool = False,
    ) -> Optional[dist.ProcessGroup]:
        """This rank's group of ``request``: an identical existing one, or a new one. The one door.

        ``owner`` is recorded as a holder; :meth:`release` with the same owner lets go. Every rank
        of the world must call this for a request whose creation mode (see
        :mod:`hypergrid.runtime.modes`) is ``split`` or ``enumerate``; only members for ``local``.

        Example, as rank 0 of an 8-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
            >>> req = GroupRequest("embd", (0, 7), ("derived", "embd"))   # this rank's group: [0, 7]
            >>> pg = REGISTRY.acquire_request("owner", req, options=GroupOptions(group_desc="EMBD"))
            >>> dist.get_process_group_ranks(pg), pg.group_desc
            ([0, 7], 'EMBD')
            >>> REGISTRY.release("owner")
            1
            >>> dist.destroy_process_group()
        """
        if not isinstance(options, GroupOptions):
            raise TypeError(f"options must be a GroupOptions, got {type(options).__name__} {options!r}")
        if not isinstance(request, GroupRequest):
            raise TypeError(f"request must be a GroupRequest, got {type(request).__name__} {request!r}")
        mode = creation_mode(strategy, options.backend)
        if mode is CreationMode.ENUMERATE and request.enumeration is None:
            raise ValueError(
                f"group {request.label!r} was requested by its members alone, which strategy "
                f"'enumerate' cannot create (it needs every group of the request); use "
                f"GroupRequest.for_partition, or strategy 'auto', 'local' or 'split'"
            )
        if mode is CreationMode.ENUMERATE:
            # Megatron-Core's call pattern is one torch call per created group, never a reused
            # one: code that counts or mocks torch's constructor sees exactly that.
            private = True
        if mode is CreationMode.LOCAL:
            if request.members is None:
                if request.agreement is not None:
                    publish_position(request.agreement)
                return None
            key: tuple = ("members", request.ordered_members, options.identity)
        else:
            key = ("request", request.identity, options.identity)
        with self._lock:
            self._follow_world()  # a new world's first request forgets the old one before naming
        held = None if private else self._hold_existing(owner, request.label, key)
        if held is not None:
            return held.pg
        with self.creation_lock:
            # Another thread may have made it while this one waited for the creation lock.
            held = None if private else self._hold_existing(owner, request.label, key)
            if held is not None:
                return held.pg
            require_initialized(request.label)
            entry = self._create(mode, request, options)
            with self._lock:
                self._follow_world()
                if not private:
                    keys = [key]
                    if entry.pg is not None and mode is not CreationMode.LOCAL:
                        keys.append(("members", request.ordered_members, options.identity))
                    entry.keys = tuple(keys)
                    for k in keys:
                        self._shared[k] = entry
                self._entries[id(entry)] = entry
                # Held and released like a member's entry even when its pg is None: a rank that
                # kept it after its grids let go would skip the next world-wide call others make.
                entry.holders.add((owner, request.label))
        return entry.pg

    def _hold_existing(self, owner: Owner, label: str, key: tuple) -> Optional[_Entry]:
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

    def destroy_foreign(self, groups: "list[Optional[dist.ProcessGroup]]") -> int:
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
            >>> same_members = GridLayout((4, 2), ("tp", "dp"))  # its tp group of rank 0: [0, 1, 2, 3]
            >>> REGISTRY.acquire_request("other", GroupRequest.from_layout(same_members, "tp", rank=0)) is tp
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
                key = ("members", tuple(sorted(members)), options.identity)
                entry = _Entry(pg, keys=(key,), adopted=True)
                self._entries[id(entry)] = entry
                self._shared[key] = entry
            entry.holders.add((owner, label))
            return pg

    def _forget(self, entry: _Entry) -> None:
        del self._entries[id(entry)]
        for key in entry.keys:
            if self._shared.get(key) is entry:
                del self._shared[key]

    # ------------------------------------------------------------------ creation
    def _create(self, mode: CreationMode, request: "GroupRequest", options: GroupOptions) -> _Entry:
        members = request.members
        timeout = effective_timeout(options)
        round_id: Optional[RoundId] = None
        if members is not None and request.agreement is not None:
            round_id = check_agreement(request.label, members, request.agreement, timeout=timeout)
        elif members is None and request.agreement is not None:
            publish_position(request.agreement)
        name = self._group_name(request, round_id)
        if mode is CreationMode.LOCAL:
            assert members is not None
            pg = self._call_torch(
                round_id,
                request,
                options,
                name,
                list(members),
                lambda: dist.new_group(
                    ranks=list(members),
                    timeout=timeout,
                    backend=options.backend,
                    pg_options=options.pg_options,
                    use_local_synchronization=True,
                    group_desc=options.group_desc,
                ),
            )
        elif mode is CreationMode.ENUMERATE:
            enumeration = request.enumerate()
            pg, _ = self._call_torch(
                round_id,
                request,
                options,
                name,
                list(members or ()),
                lambda: dist.new_subgroups_by_enumeration(
                    enumeration,
                    timeout=timeout,
                    backend=options.backend,
                    pg_options=options.pg_options,
                    group_desc=options.group_desc,
                ),
            )
        else:
            # split_group uses only the caller's own split; a rank in no group passes one it is
            # not in and takes part in the world-wide split as a non-member (None back).
            mine = list(members) if members is not None else [1 if dist.get_rank() == 0 else 0]
            pg = self._call_torch(
                round_id,
                request,
                options,
                name,
                mine,
                lambda: dist.split_group(
                    split_ranks=[mine],
                    timeout=timeout,
                    pg_options=options.pg_options,
                    group_desc=options.group_desc,
                ),
            )
        if members is None or pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
            return _Entry(None)
        return _Entry(pg)

    def _group_name(self, request: "GroupRequest", round_id: Optional[RoundId]) -> Optional[str]:
        """The torch name of this rank's new group: alike on every member, unlike any earlier one.

        From the round its members agreed in (their member set and its epoch in the store), which
        is theirs alone; without one (a group of one rank, no agreement check, no store to meet
        in) from how many times this process made the group, which names it alike only where
        every member made the same groups."""
        if request.members is None:
            return None
        if round_id is not None:
            return "hypergrid-" + hashlib.sha1(round_id.seed.encode()).hexdigest()
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

    @staticmethod
    def _call_torch(
        round_id: Optional[RoundId],
        request: "GroupRequest",
        options: GroupOptions,
        name: Optional[str],
        ranks: list[int],
        create: Callable[[], Any],
    ) -> Any:
        """Run a torch group constructor under hypergrid's name, its failures named with the group."""
        try:
            if name is None:
                return create()
            with group_name_override(name, ranks):
                return create()
        except (TypeError, ValueError, AttributeError) as exc:
            # pg_options reach torch's C++ backends untouched (a mock must pass, as on
            # Megatron-Core), so what they refuse is known only here.
            if options.pg_options is not None:
                backend = f"backend {options.backend!r}" if options.backend else "the default group's backend"
                raise TypeError(
                    f"process group {request.label!r}: torch refused pg_options={options.pg_options!r} "
                    f"({type(options.pg_options).__name__}; {backend} takes its own options type, "
                    f"e.g. ProcessGroupNCCL.Options for 'nccl'): "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                ) from exc
            raise
        except Exception as exc:
            members = request.members
            shown = describe_ranks(members) if members is not None else "none (not a member)"
            who = explain_creation_failure(request.label, members or (), request.agreement, round_id)
            raise GroupCreationError(
                f"creating process group {request.label!r} with members {shown} failed: "
                f"{type(exc).__name__}: {exc}" + (f"; {who}" if who else "")
            ) from exc


@dataclass(frozen=True)
class GroupRequest:
    """One request for groups, as the registry sees it: the one kind every creation goes through.

    ``members``: this rank's group, in enumeration order (None: this rank is in none).
    ``identity``: a hashable value equal on every rank for the same set of groups, world-wide;
    the world-wide modes share by it. ``enumeration``: every group of the request, computed only
    when the ``enumerate`` mode needs it (O(world)); None where only members are known.
    ``agreement``: what the members check they asked for alike before waiting on each other
    (None skips the check).

    Example::

        >>> req = GroupRequest.from_layout(GridLayout((4, 2), ("tp", "dp")), "dp", rank=3)
        >>> req.members, req.enumerate()
        ((3, 7), [[0, 4], [1, 5], [2, 6], [3, 7]])
    """

    label: str
    members: Optional[tuple[int, ...]]
    identity: Hashable
    enumeration: Optional[Callable[[], list[list[int]]]] = field(default=None, compare=False)
    agreement: Optional[Agreement] = field(default=None, compare=False)

    @functools.cached_property
    def ordered_members(self) -> tuple[int, ...]:
        """This rank's group, ascending (a partition's already is): what sharing by members keys on."""
        if self.members is None:
            return ()
        return self.members if isinstance(self.identity, Partition) else tuple(sorted(self.members))

    def enumerate(self) -> list[list[int]]:
        """Every group of the request (O(world)); a ValueError where only the members are known."""
        if self.enumeration is None:
            raise ValueError(
                f"group {self.label!r} was requested by its members alone; its other groups are unknown"
            )
        return self.enumeration()

    def with_agreement(self, agreement: Optional[Agreement]) -> "GroupRequest":
        """The same request, checked with ``agreement``."""
        return GroupRequest(self.label, self.members, self.identity, self.enumeration, agreement)

    @classmethod
    def from_layout(
        cls,
        layout: GridLayout,
        dims: Dims,
        rank: int,
        label: Optional[str] = None,
        agreement: Optional[Agreement] = None,
    ) -> "GroupRequest":
        """The ``dims`` groups of ``layout`` as seen by global ``rank``: O(group size)."""
        return cls.for_partition(label or layout.key(dims), layout.partition(dims), rank, agreement)

    @classmethod
    def for_partition(
        cls, label: str, partition: Partition, rank: int, agreement: Optional[Agreement] = None
    ) -> "GroupRequest":
        """The groups of ``partition`` as seen by global ``rank``: O(group size).

        Every request for the same partition (a grid's dims, a view's, a DeviceMesh's flattened
        or unflattened dims) has the same identity, so the world-wide modes share its group.

        Example::

            >>> req = GroupRequest.for_partition("dp_cp", Partition.of(0, 16, [(2, 2), (2, 8)]), rank=10)
            >>> req.members, req.identity == GridLayout((2, 2, 2, 2), ("a", "cp", "b", "dp")).partition(["cp", "dp"])
            ((0, 2, 8, 10), True)
        """
        members = tuple(partition.group_ranks(rank)) if partition.contains(rank) else None
        return cls(label, members, partition, partition.enumerate, agreement)


def enumerate_before_init(label: str, enumeration: list[list[int]], options: GroupOptions) -> Optional[dist.ProcessGroup]:
    """Strategy ``enumerate`` before ``init_process_group``: hand the enumeration to torch, as Megatron-Core does.

    Nothing is registered (there is no world to follow); torch's refusal comes back as
    hypergrid's RuntimeError naming the group. Code that patches torch's constructor (Megatron-LM's
    unit tests) gets its mock back, exactly as from Megatron-Core's ``create_pg``.

    Example, in a process where torch.distributed is not initialized::

        >>> enumerate_before_init("tp", [[0, 1], [2, 3]], GroupOptions())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        RuntimeError: cannot create process group 'tp': torch.distributed is not initialized; ...
    """
    try:
        pg, _ = dist.new_subgroups_by_enumeration(
            enumeration,
            timeout=options.timeout,
            backend=options.backend,
            pg_options=options.pg_options,
            group_desc=options.group_desc,
        )
    except ValueError as exc:
        raise RuntimeError(_not_initialized(label)) from exc
    return pg


def _not_initialized(label: str) -> str:
    return (
        f"cannot create process group {label!r}: torch.distributed is not initialized; call "
        f"torch.distributed.init_process_group() first (a grid built with world_size= or "
        f"WORLD_SIZE alone can plan and enumerate, but not create groups)"
    )


def require_initialized(label: str) -> None:
    """Refuse to create ``label`` in a world that torch.distributed has not started."""
    if not dist.is_initialized():
        raise RuntimeError(_not_initialized(label))


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
