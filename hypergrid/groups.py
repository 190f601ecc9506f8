"""The group registry: creates each distinct process group once, shares it, destroys it.

Every grid, view and adapter asks this registry for groups; it is the only module that calls
``torch.distributed``'s group constructors. A group is identified by what makes two
communicators interchangeable: its member ranks, its backend, its timeout and its options.
Whoever asks for an identical group gets the existing object (unless they ask for a private one),
and a group is destroyed only when the last grid holding it lets go.

How a missing group gets made is the grid's *strategy*:

``local`` (default)
    Only the members of a group call ``new_group(..., use_local_synchronization=True)``; the
    other ranks do nothing. A rank's cost is its own groups, independent of the world size.
    Sharing is decided by member ranks, which every member of a group sees alike.
``enumerate``
    Megatron-Core's call pattern: every rank of the world calls
    ``new_subgroups_by_enumeration`` with every group of the request. Sharing is decided per
    whole request (its :class:`~hypergrid.layout.Partition`), which every rank sees alike.
``split``
    Every rank of the world calls ``split_group`` on the default group once per request, passing
    only its own group. Needs a default group bound to a device on a backend that can split
    (NCCL); otherwise it falls back to ``local``, the same way on every rank.

Example::

    >>> from hypergrid.layout import GridLayout
    >>> registry = GroupRegistry()
    >>> layout = GridLayout((2, 4), ("tp", "dp"))
    >>> # in a job: pg = registry.acquire(owner, layout, ["dp"], rank=5, strategy="local")
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Hashable, Mapping, Optional, Union

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ._torch_compat import group_name_override
from .agreement import check_agreement, describe_ranks
from .errors import GroupCreationError
from .layout import Dims, GridLayout
from .strategy import CreationMode, Strategy, creation_mode, parse_strategy

__all__ = ["STRATEGIES", "GroupOptions", "GroupRequest", "GroupRegistry", "REGISTRY", "split_supported"]

logger = logging.getLogger("hypergrid.groups")

#: The ways a grid can create its groups (see :mod:`hypergrid.strategy`).
STRATEGIES = tuple(s.value for s in Strategy)

#: What a grid passes as the owner of the groups it holds; released together by ``release``.
Owner = Hashable


def _fingerprint(value: Any, depth: int = 0) -> Hashable:
    """A hashable summary of a ``pg_options`` object by value, so equal options share a group.

    Falls back to the object's identity where its public attributes do not say what it is
    (an option we cannot compare is treated as different, never wrongly shared).
    """
    if value is None or isinstance(value, (bool, int, float, str, timedelta)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_fingerprint(v, depth + 1) for v in value)
    if depth >= 2:
        return ("id", id(value))
    fields = []
    for name in sorted(dir(value)):
        if name.startswith("_"):
            continue
        try:
            attr = getattr(value, name)
        except Exception:  # a property that cannot be read says nothing about equality
            continue
        if callable(attr):
            continue
        fields.append((name, _fingerprint(attr, depth + 1)))
    if not fields:
        return ("id", id(value))
    return (type(value).__qualname__, tuple(fields))


@dataclass(frozen=True)
class GroupOptions:
    """What is passed to torch for a group, beside its ranks.

    ``identity`` is the part that makes two groups with the same members different
    communicators; ``group_desc`` is only a label and does not prevent sharing.
    """

    backend: Optional[str] = None
    timeout: Optional[timedelta] = None
    pg_options: Any = None
    group_desc: Optional[str] = None

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str or None, got {type(self.backend).__name__} {self.backend!r}")
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(
                f"timeout must be a datetime.timedelta or None, got {type(self.timeout).__name__} {self.timeout!r}"
            )
        if self.timeout is not None and self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.group_desc is not None and not isinstance(self.group_desc, str):
            raise TypeError(f"group_desc must be a str or None, got {type(self.group_desc).__name__} {self.group_desc!r}")
        # Keep the options object alive: an identity fingerprint must not be reused by another.
        object.__setattr__(self, "_identity", (self.backend, self.timeout, _fingerprint(self.pg_options)))

    @property
    def identity(self) -> Hashable:
        return self._identity  # type: ignore[attr-defined]


def check_strategy(strategy: object) -> Strategy:
    """``strategy`` as a :class:`~hypergrid.strategy.Strategy`, or a clear error.

    Example::

        >>> check_strategy("local")
        <Strategy.LOCAL: 'local'>
        >>> check_strategy("fast")
        Traceback (most recent call last):
        ...
        ValueError: strategy must be one of ['auto', 'local', 'split', 'enumerate'], got 'fast'
    """
    return parse_strategy(strategy)  # type: ignore[arg-type]


def split_supported(backend: Optional[str] = None) -> bool:
    """Whether ``split_group`` can make groups on this process's default group.

    True only when the default group is bound to a device, its backend for that device can
    split, and the requested backend (if any) is the default one. Every rank of a job that was
    started alike answers the same, which is what lets ``split`` fall back consistently.
    """
    if not dist.is_initialized():
        return False
    default = dist.distributed_c10d._get_default_group()
    device = getattr(default, "bound_device_id", None)
    if device is None:
        return False
    if backend is not None and str(backend).lower() != str(dist.get_backend(default)).lower():
        return False
    try:
        return bool(default._get_backend(device).supports_splitting)
    except Exception:  # backends without a per-device entry cannot split
        return False


@dataclass
class _Entry:
    """One process group this rank holds (``pg`` None: a request this rank is not part of)."""

    pg: Optional[dist.ProcessGroup]
    members: Optional[tuple[int, ...]]
    identity: Hashable
    collective_key: Optional[tuple]
    private: bool
    holders: set = field(default_factory=set)
    #: Made outside hypergrid and adopted (see GroupRegistry.adopt): shared, never destroyed.
    adopted: bool = False


class GroupRegistry:
    """This process's table of the groups hypergrid created, with who holds each.

    Thread-safe: every method takes the registry's lock, so adapters on other threads may read
    while a grid creates. One instance, :data:`REGISTRY`, serves the whole process.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._by_members: dict[tuple, _Entry] = {}
        self._by_partition: dict[tuple, _Entry] = {}
        self._entries: list[_Entry] = []
        # The default group the entries were created under; a new one means a new world, in
        # which the old entries are dead (destroy_process_group() + init_process_group()).
        self._world: Optional[dist.ProcessGroup] = None
        # How many groups of exactly these members this process created in this world: the same
        # on every member, so (members, count) names a group alike on all of them.
        self._made: dict[tuple[int, ...], int] = {}

    # ------------------------------------------------------------------ queries
    def count(self) -> int:
        """Number of distinct process groups this rank holds through hypergrid."""
        with self._lock:
            return sum(1 for e in self._entries if e.pg is not None)

    def holders_of(self, pg: dist.ProcessGroup) -> set[tuple[Owner, str]]:
        """The (owner, label) pairs currently holding ``pg`` (empty if hypergrid does not)."""
        with self._lock:
            for entry in self._entries:
                if entry.pg is pg:
                    return set(entry.holders)
            return set()

    def groups(self) -> list[dist.ProcessGroup]:
        """Every process group this rank holds through hypergrid, in creation order."""
        with self._lock:
            return [e.pg for e in self._entries if e.pg is not None]

    def reset(self) -> None:
        """Forget every entry without destroying anything (the world they lived in is gone)."""
        with self._lock:
            self._by_members.clear()
            self._by_partition.clear()
            self._entries.clear()
            self._made.clear()
            self._world = None

    def _follow_world(self) -> None:
        current = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        if current is not self._world:
            if self._entries:
                logger.debug("default process group changed; forgetting %d stale groups", len(self._entries))
            self.reset()
            self._world = current

    # ------------------------------------------------------------------ acquire / release
    def acquire(
        self,
        owner: Owner,
        layout: GridLayout,
        dims: Dims,
        *,
        rank: int,
        strategy: Union[str, Strategy] = Strategy.AUTO,
        options: GroupOptions = GroupOptions(),
        private: bool = False,
        label: Optional[str] = None,
    ) -> Optional[dist.ProcessGroup]:
        """The group of ``dims`` holding ``rank``, created if no identical one exists yet.

        Returns None on a rank outside ``layout`` (Megatron-Core returns None there too).
        ``owner`` is recorded as a holder; :meth:`release` with the same owner lets go.

        Example::

            >>> # pg = REGISTRY.acquire("my-grid", GridLayout((2, 4), ("tp", "dp")), "dp", rank=5)
        """
        return self.acquire_request(owner, GroupRequest.from_layout(layout, dims, rank, label), strategy=strategy, options=options, private=private)

    def acquire_request(
        self,
        owner: Owner,
        request: "GroupRequest",
        *,
        strategy: Union[str, Strategy] = Strategy.AUTO,
        options: GroupOptions = GroupOptions(),
        private: bool = False,
    ) -> Optional[dist.ProcessGroup]:
        """Like :meth:`acquire`, for any :class:`GroupRequest` (e.g. explicit rank lists)."""
        if not isinstance(options, GroupOptions):
            raise TypeError(f"options must be a GroupOptions, got {type(options).__name__} {options!r}")
        mode = creation_mode(strategy, options.backend)
        with self._lock:
            self._follow_world()
            if mode is CreationMode.LOCAL:
                entry = self._local(request, options, private)
            else:
                entry = self._collective(mode.value, request, options, private)
            if entry is None:
                return None
            entry.holders.add((owner, request.label))
            return entry.pg

    def release(self, owner: Owner) -> int:
        """Drop every hold of ``owner``; destroy groups nobody holds any more. Returns how many.

        Idempotent: releasing an owner that holds nothing does nothing.
        """
        destroyed = 0
        with self._lock:
            self._follow_world()
            for entry in list(self._entries):
                stale = [h for h in entry.holders if h[0] == owner]
                if not stale:
                    continue
                entry.holders.difference_update(stale)
                if entry.holders:
                    continue
                self._forget(entry)
                if entry.pg is not None and not entry.adopted:
                    _destroy_quietly(entry.pg)
                    destroyed += 1
        return destroyed

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

        Example::

            >>> # mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            >>> # REGISTRY.adopt("my-grid", mesh.get_group("tp"))
            >>> # REGISTRY.acquire("other", GridLayout((4, 2), ("tp", "dp")), "tp", rank=r)  # that group
        """
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"pg must be a torch.distributed.ProcessGroup, got {type(pg).__name__} {pg!r}")
        if not isinstance(options, GroupOptions):
            raise TypeError(f"options must be a GroupOptions, got {type(options).__name__}")
        members = tuple(dist.get_process_group_ranks(pg))
        with self._lock:
            self._follow_world()
            entry = next((e for e in self._entries if e.pg is pg), None)
            if entry is None:
                entry = _Entry(pg, members, options.identity, None, False, adopted=True)
                self._entries.append(entry)
                self._by_members[(tuple(sorted(members)), options.identity)] = entry
            entry.holders.add((owner, label))
            return pg

    def _forget(self, entry: _Entry) -> None:
        self._entries.remove(entry)
        for table in (self._by_members, self._by_partition):
            for key in [k for k, v in table.items() if v is entry]:
                del table[key]

    # ------------------------------------------------------------------ strategies
    def _local(self, request: "GroupRequest", options: GroupOptions, private: bool) -> Optional[_Entry]:
        members = request.members
        if members is None:
            return None
        key = (tuple(sorted(members)), options.identity)
        if not private and key in self._by_members:
            return self._by_members[key]
        _require_initialized(request.label)
        name = self._next_name(members)
        _agree(request, options, name)
        with group_name_override(name, list(members)):
            pg = _call_torch(
                request.label,
                members,
                lambda: dist.new_group(
                    ranks=list(members),
                    timeout=options.timeout,
                    backend=options.backend,
                    pg_options=options.pg_options,
                    use_local_synchronization=True,
                    group_desc=options.group_desc,
                ),
            )
        self._made[tuple(sorted(members))] = self._made.get(tuple(sorted(members)), 0) + 1
        return self._record(pg, members, options, None, private)

    def _next_name(self, members: tuple[int, ...]) -> str:
        """The name of the next group with exactly these members: alike on every member."""
        ordered = tuple(sorted(members))
        count = self._made.get(ordered, 0)
        return "hypergrid-" + hashlib.sha1(f"{','.join(map(str, ordered))}#{count}".encode()).hexdigest()

    def _collective(
        self, strategy: str, request: "GroupRequest", options: GroupOptions, private: bool
    ) -> Optional[_Entry]:
        # Every rank of the world takes part, so whether to reuse must be decided alike on all of
        # them: by the request's world-wide identity, which every rank computes the same.
        members = request.members
        key = (request.identity, options.identity)
        if not private and key in self._by_partition:
            return self._by_partition[key]  # held (and released) alike on every rank
        _require_initialized(request.label)
        if members is not None:
            # Only this rank's own group meets here; the world-wide call comes after.
            _agree(request, options, self._next_name(members))
            self._made[tuple(sorted(members))] = self._made.get(tuple(sorted(members)), 0) + 1
        if strategy == "enumerate":
            enumeration = request.enumerate()
            pg, _ = _call_torch(
                request.label,
                members,
                lambda: dist.new_subgroups_by_enumeration(
                    enumeration,
                    timeout=options.timeout,
                    backend=options.backend,
                    pg_options=options.pg_options,
                    group_desc=options.group_desc,
                ),
            )
        else:
            # split_group takes the caller's own split; a rank in no group passes some split it
            # is not in and gets None back, as split_group documents.
            mine = list(members) if members is not None else list(request.enumerate()[0])
            pg = _call_torch(
                request.label,
                members,
                lambda: dist.split_group(
                    split_ranks=[mine],
                    timeout=options.timeout,
                    pg_options=options.pg_options,
                    group_desc=options.group_desc,
                ),
            )
        if members is None or pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
            entry = _Entry(None, None, options.identity, key, private)
            if not private:
                self._by_partition[key] = entry
            self._entries.append(entry)
            # Held and released like a member's entry (its pg is None): a rank that kept it
            # after its grids let go would skip the next world-wide call the other ranks make.
            return entry
        return self._record(pg, members, options, key, private)

    def _record(
        self,
        pg: dist.ProcessGroup,
        members: tuple[int, ...],
        options: GroupOptions,
        collective_key: Optional[tuple],
        private: bool,
    ) -> _Entry:
        entry = _Entry(pg, members, options.identity, collective_key, private)
        self._entries.append(entry)
        if not private:
            self._by_members[(tuple(sorted(members)), options.identity)] = entry
            if collective_key is not None:
                self._by_partition[collective_key] = entry
        return entry


@dataclass(frozen=True)
class GroupRequest:
    """One request for groups, as the registry sees it.

    ``members``: this rank's group, in enumeration order (None: this rank is in none).
    ``identity``: a hashable value equal on every rank for the same set of groups, world-wide;
    the collective strategies share by it. ``enumerate``: every group of the request, computed
    only when a collective strategy needs it (O(world)).

    Example::

        >>> req = GroupRequest.from_rank_lists("embd", [[0, 3], [4, 7]], rank=3)
        >>> req.members
        (0, 3)
    """

    label: str
    members: Optional[tuple[int, ...]]
    identity: Hashable
    enumerate: Callable[[], list[list[int]]] = field(compare=False)
    #: What the members must agree on before waiting for each other (see hypergrid.agreement);
    #: None skips the check.
    agreement: Optional[Mapping[str, Any]] = field(default=None, compare=False)

    @classmethod
    def from_layout(
        cls,
        layout: GridLayout,
        dims: Dims,
        rank: int,
        label: Optional[str] = None,
        agreement: Optional[Mapping[str, Any]] = None,
    ) -> "GroupRequest":
        """The ``dims`` groups of ``layout`` as seen by global ``rank``: O(group size)."""
        members = tuple(layout.group_ranks(dims, rank)) if layout.contains(rank) else None
        return cls(
            label or layout.key(dims), members, layout.partition(dims), lambda: layout.enumerate(dims), agreement
        )

    @classmethod
    def from_rank_lists(cls, label: str, groups: list[list[int]], rank: int) -> "GroupRequest":
        """Explicit, disjoint groups of global ranks (all of them: O(total size))."""
        frozen = [list(g) for g in groups]
        mine = next((tuple(g) for g in frozen if rank in g), None)
        identity = ("rank-lists", tuple(tuple(sorted(g)) for g in frozen))
        return cls(label, mine, identity, lambda: frozen)

    @classmethod
    def from_members(cls, label: str, members: Optional[list[int]]) -> "GroupRequest":
        """Only this rank's own group (``local`` strategy only: nothing else is known)."""

        def unknown() -> list[list[int]]:
            raise ValueError(
                f"group {label!r} was requested by its members alone, which only the 'local' "
                f"strategy can create; pass every group (GroupRequest.from_rank_lists) instead"
            )

        return cls(label, None if members is None else tuple(members), ("members-only", label), unknown)


def _agree(request: GroupRequest, options: GroupOptions, name: str) -> None:
    if request.agreement is None or request.members is None:
        return
    timeout = options.timeout if options.timeout is not None else default_pg_timeout
    check_agreement(request.label, request.members, request.agreement, namespace=name, timeout=timeout)


def _require_initialized(label: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"cannot create process group {label!r}: torch.distributed is not initialized; call "
            f"torch.distributed.init_process_group() first (a grid built with world_size= alone "
            f"can plan and enumerate, but not create groups)"
        )


def _call_torch(label: str, members: Optional[tuple[int, ...]], create: Callable[[], Any]) -> Any:
    """Run a torch group constructor, turning its failures into errors that name the group."""
    try:
        return create()
    except (TypeError, ValueError):
        raise
    except Exception as exc:
        shown = describe_ranks(members) if members is not None else "none (not a member)"
        raise GroupCreationError(
            f"creating process group {label!r} with members {shown} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _destroy_quietly(pg: dist.ProcessGroup) -> None:
    # The user may already have torn everything down with destroy_process_group(); then the
    # group is gone and there is nothing left to release.
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(pg)
    except (ValueError, RuntimeError, KeyError) as exc:
        logger.debug("process group %s was already gone: %s", pg, exc)
    # torch empties the group's tag list but keeps the key ("ptd:<group name>"), one per group
    # ever created: without this, create/destroy cycles grow torch's table without bound.
    tags = getattr(dist.distributed_c10d._world, "tags_to_pg", None)
    if isinstance(tags, dict):
        for tag in [t for t, pgs in tags.items() if not pgs]:
            del tags[tag]


#: The process-wide registry every grid uses.
REGISTRY = GroupRegistry()
