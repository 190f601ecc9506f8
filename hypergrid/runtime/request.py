"""One request for a group: the single value that travels from a grid to torch's constructor.

A :class:`GroupRequest` holds everything every later step needs, decided once by whoever asks
(a grid, a view, the Megatron adapter, a DeviceMesh): the label errors name, this rank's members,
the request's world-wide identity, the options torch gets, whether the group may be shared, the
creation mode (resolved once, alike on every rank) and where the request stands in its grid's
sequence, from which the agreement payload is derived. The registry takes it through its one
door (:meth:`~hypergrid.runtime.registry.GroupRegistry.acquire`).

Example::

    >>> from hypergrid.layout import GridLayout
    >>> dp = GridLayout((4, 2), ("tp", "dp")).partition(["dp"])
    >>> req = GroupRequest.for_partition("dp", dp, rank=3)
    >>> req.members, req.enumerate(), req.mode.value, req.sharing_key()
    ((3, 7), [[0, 4], [1, 5], [2, 6], [3, 7]], 'local', ByMembers(members=(3, 7), options=(None, None, None)))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from ..layout import Partition
from ..store.records import Agreement, GridFacts, Position, RequestFacts
from .modes import CreationMode
from .options import GroupOptions

__all__ = ["DerivedGroup", "GroupIdentity", "Origin", "GroupRequest", "ByMembers", "ByRequest", "SharingKey"]


@dataclass(frozen=True)
class DerivedGroup:
    """The identity of a group a rule derives and names (Megatron's embedding group, a
    distributed-optimizer instance): its label, alike on every rank that asks for it.

    Example::

        >>> DerivedGroup("embd") == DerivedGroup("embd")
        True
    """

    label: str


#: What a request is, world-wide: a partition of ranks (any grid's, view's or mesh's dims), or a
#: derived group known by its label. Equal on every rank for the same set of groups.
GroupIdentity = Union[Partition, DerivedGroup]


@dataclass(frozen=True)
class ByMembers:
    """Share by this rank's member set and the options' identity (what every member sees alike)."""

    members: tuple[int, ...]
    options: Hashable


@dataclass(frozen=True)
class ByRequest:
    """Share by the request's world-wide identity (every rank of the world takes part)."""

    identity: GroupIdentity
    options: Hashable


#: Under which a registry finds an existing group for a request.
SharingKey = Union[ByMembers, ByRequest]


@dataclass(frozen=True)
class Origin:
    """Where a request comes from, as its members compare it: the ``position``-th request of a
    grid with ``grid`` facts, in ``view`` (None: the grid itself).

    Example::

        >>> facts = GridFacts.of([2, 4], ["tp", "dp"], 0)
        >>> Origin(Position(facts.family, facts.digest, 0), facts, None).position.index
        0
    """

    position: Position
    grid: GridFacts
    view: Optional[str]


@dataclass(frozen=True)
class GroupRequest:
    """One request for groups: the one value every creation goes through.

    ``members``: this rank's group, in enumeration order (None: this rank is in none, or the
    world is not started yet). ``identity``: equal on every rank for the same set of groups; the
    world-wide modes share by it. ``mode``: how the group is made in this job (see
    :mod:`hypergrid.runtime.modes`), resolved once by the caller; ``enumerate`` makes the request
    private, as Megatron-Core's call pattern makes a new group each time. ``origin``: where the
    request stands in its grid (None skips the agreement check). ``enumeration``: every group of
    the request (O(world)), computed only when the ``enumerate`` mode needs it.

    Example::

        >>> req = GroupRequest.derived("embd", (0, 7), mode=CreationMode.ENUMERATE, groups=lambda: [[0, 7]])
        >>> req.private, req.identity, req.sharing_key() is None
        (True, DerivedGroup(label='embd'), True)
    """

    label: str
    members: Optional[tuple[int, ...]]
    identity: GroupIdentity
    options: GroupOptions = GroupOptions()
    mode: CreationMode = CreationMode.LOCAL
    private: bool = False
    origin: Optional[Origin] = None
    enumeration: Optional[Callable[[], list[list[int]]]] = field(default=None, compare=False)
    #: The group's ranks are in the order listed (their positions in a grid placed over other
    #: ranks), not ascending as torch makes groups by default.
    keep_order: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.options, GroupOptions):
            raise TypeError(f"options must be a GroupOptions, got {type(self.options).__name__} {self.options!r}")
        if self.mode is CreationMode.ENUMERATE:
            if self.enumeration is None:
                raise ValueError(
                    f"group {self.label!r} was requested by its members alone, which strategy "
                    f"'enumerate' cannot create (it needs every group of the request); use "
                    f"GroupRequest.for_partition, or strategy 'auto', 'local' or 'split'"
                )
            # Megatron-Core's call pattern is one torch call per created group, never a reused
            # one: code that counts or mocks torch's constructor sees exactly that.
            object.__setattr__(self, "private", True)

    @classmethod
    def for_partition(cls, label: str, partition: Partition, rank: Optional[int], **decided: Any) -> GroupRequest:
        """The groups of ``partition`` as seen by global ``rank`` (None: not known yet): O(group size).

        Every request for the same partition (a grid's dims, a view's, a DeviceMesh's flattened
        or unflattened dims) has the same identity, so the world-wide modes share its group.
        ``decided``: the other fields (options, mode, private, origin).

        Example::

            >>> req = GroupRequest.for_partition("dp_cp", Partition.of(0, 16, [(2, 2), (2, 8)]), rank=10)
            >>> req.members, req.identity == Partition.of(0, 16, [(2, 2), (2, 8)])
            ((0, 2, 8, 10), True)
        """
        members = tuple(partition.group_ranks(rank)) if rank is not None and partition.contains(rank) else None
        return cls(label, members, partition, enumeration=partition.enumerate,
                   keep_order=partition.rank_map is not None, **decided)

    @classmethod
    def derived(cls, label: str, members: Optional[tuple[int, ...]],
                groups: Optional[Callable[[], list[list[int]]]] = None, **decided: Any) -> GroupRequest:
        """A group a rule derives, given by this rank's ``members`` (None: in none) and, for the
        ``enumerate`` mode, every group of the request (``groups``).

        Example::

            >>> GroupRequest.derived("embd", (0, 7)).identity
            DerivedGroup(label='embd')
        """
        return cls(label, members, DerivedGroup(label), enumeration=groups, **decided)

    @functools.cached_property
    def ordered_members(self) -> tuple[int, ...]:
        """This rank's group in the order of its group ranks: what sharing by members keys on.

        Ascending, as torch makes groups (a default partition's already is), unless the order is
        kept (a grid placed over other ranks lists its groups in their positions' order)."""
        if self.members is None:
            return ()
        if self.keep_order or isinstance(self.identity, Partition):
            return self.members
        return tuple(sorted(self.members))

    @functools.cached_property
    def agreement(self) -> Optional[Agreement]:
        """What the members check they asked for alike, derived from this request (None: no check)."""
        if self.origin is None:
            return None
        return Agreement(
            position=self.origin.position,
            grid=self.origin.grid,
            request=RequestFacts(
                label=self.label,
                view=self.origin.view,
                private=self.private,
                backend=self.options.backend,
                timeout_s=None if self.options.timeout is None else self.options.timeout.total_seconds(),
                pg_options=None if self.options.pg_options is None else type(self.options.pg_options).__name__,
                mode=self.mode.value,
            ),
        )

    def sharing_key(self) -> Optional[SharingKey]:
        """Where an identical existing group is found (None: private, or no group to share).

        Member-only creation shares by members, which every member sees alike; the world-wide
        modes by the request's identity, which every rank of the world computes alike."""
        if self.private:
            return None
        if self.mode.members_only:
            return None if self.members is None else ByMembers(self.ordered_members, self.options.identity)
        return ByRequest(self.identity, self.options.identity)

    def members_key(self) -> Optional[ByMembers]:
        """The key of this rank's member set (None without members), under which a group made by
        a world-wide mode is found for member-only requests too."""
        return None if self.members is None else ByMembers(self.ordered_members, self.options.identity)

    def enumerate(self) -> list[list[int]]:
        """Every group of the request (O(world)); a ValueError where only the members are known."""
        if self.enumeration is None:
            raise ValueError(f"group {self.label!r} was requested by its members alone; its other groups are unknown")
        return self.enumeration()

    def without_check(self) -> GroupRequest:
        """The same request, made without the agreement check.

        Example::

            >>> GroupRequest.derived("embd", (0, 7)).without_check().origin is None
            True
        """
        return replace(self, origin=None)
