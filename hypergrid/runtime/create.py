"""torch's group constructors, one function per creation mode, each failure named with its group.

Which mode runs is decided per request (:mod:`hypergrid.runtime.modes`) and travels with it:

``local``
    Only the members of a group call ``new_group(..., use_local_synchronization=True)``; the
    other ranks do nothing.
``split``
    Every rank of the world calls ``split_group`` once per request, passing only its own group
    (a rank in none passes a group it is not in and gets None).
``enumerate``
    Megatron-Core's call pattern: every rank of the world calls ``new_subgroups_by_enumeration``
    with every group of the request.

Before ``init_process_group`` only ``enumerate`` is handed to torch (:func:`enumerate_before_init`),
as Megatron-Core does; any other request is refused with an error that says what to do.

Example, as rank 5 of an 8-rank job on torch's fake backend, which needs no other process::

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from hypergrid.layout import GridLayout
    >>> from hypergrid.runtime.request import GroupRequest
    >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    >>> dp = GroupRequest.for_partition("dp", GridLayout((2, 4), ("tp", "dp")).partition(["dp"]), rank=5)
    >>> pg = create(dp, name=None, timeout=timedelta(seconds=30))
    >>> dist.get_process_group_ranks(pg)
    [1, 3, 5, 7]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, cast

import torch.distributed as dist

from ..errors import GroupCreationError, GroupTimeoutError, UnsupportedTorchError
from ..layout.describe import describe_ranks
from ..store.records import CheckId
from .agreement import explain_creation_failure
from .modes import CreationMode
from .request import GroupRequest
from .scope import creation_timeout, lost_among
from .torch_compat import group_name_override, new_group_keeps_order, unsplit

__all__ = ["create", "enumerate_before_init", "require_initialized"]


def _local(request: GroupRequest, timeout: timedelta) -> tuple[list[int], Callable[[], Any]]:
    members = list(request.members or ())
    return members, lambda: _new_member_group(request, members, timeout, request.options.pg_options)


def _fresh(request: GroupRequest, timeout: timedelta) -> tuple[list[int], Callable[[], Any]]:
    # A member-only group with torch kept from splitting it off the world's communicator: no rank
    # outside it takes part (the world's may hold a dead rank, or spares that make no group).
    members = list(request.members or ())
    options = request.options

    def make() -> Any:
        with unsplit(options.pg_options, options.backend) as pg_options:
            return _new_member_group(request, members, timeout, pg_options)

    return members, make


def _new_member_group(request: GroupRequest, members: list[int], timeout: timedelta, pg_options: Any) -> Any:
    options = request.options
    # A grid placed over other ranks lists a group in its members' positions, which need not
    # ascend; torch sorts unless told not to, and the group's rank order is its members' roles.
    in_order: dict[str, Any] = {}
    if request.keep_order and any(a > b for a, b in zip(members, members[1:])):
        if not new_group_keeps_order():
            raise UnsupportedTorchError(
                f"process group {request.label!r}: its members {describe_ranks(members)} are listed in their "
                f"positions' order, and this torch's new_group has no sort_ranks=False to keep it"
            )
        in_order["sort_ranks"] = False
    lost = lost_among(members)
    if lost:  # inside a recovery: a member lost after agreeing would only be waited for in torch
        raise GroupTimeoutError(f"hypergrid: process group {request.label!r}: members {describe_ranks(lost)} were lost "
                                f"(the job's board says so) before the group was made")
    bounded = creation_timeout(timeout)
    pg = dist.new_group(
        ranks=members,
        timeout=bounded,
        backend=options.backend,
        pg_options=pg_options,
        use_local_synchronization=True,
        group_desc=options.group_desc,
        **in_order,
    )
    if bounded != timeout and pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
        pg.set_timeout(timeout)  # made within the recovery's time; its collectives keep the group's
    return pg


def _split(request: GroupRequest, timeout: timedelta) -> tuple[list[int], Callable[[], Any]]:
    # split_group uses only the caller's own split; a rank in no group passes one it is not in and
    # takes part in the world-wide split as a non-member (None back).
    mine = list(request.members) if request.members is not None else [1 if dist.get_rank() == 0 else 0]
    options = request.options
    return mine, lambda: dist.split_group(
        split_ranks=[mine], timeout=timeout, pg_options=options.pg_options, group_desc=options.group_desc
    )


def _enumerated(request: GroupRequest, timeout: timedelta) -> tuple[list[int], Callable[[], Any]]:
    enumeration = request.enumerate()
    options = request.options
    # torch 2.13 leaves new_subgroups_by_enumeration unannotated; 2.15 types it.
    return list(request.members or ()), lambda: dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call,unused-ignore]
        enumeration,
        timeout=timeout,
        backend=options.backend,
        pg_options=options.pg_options,
        group_desc=options.group_desc,
    )[0]


_MODES = {CreationMode.LOCAL: _local, CreationMode.FRESH: _fresh, CreationMode.SPLIT: _split,
          CreationMode.ENUMERATE: _enumerated}


def create(request: GroupRequest, *, name: Optional[str], timeout: timedelta,
           check_id: Optional[CheckId] = None) -> Optional[dist.ProcessGroup]:
    """This rank's new group for ``request``, made by torch in the request's mode; None where this
    rank is in none (or the non-member sentinel torch gives).

    ``name``: the torch name the group gets, alike on every member (None: torch's own); ``check_id``:
    the check its members agreed in, for naming those that never report back if torch fails.
    torch's refusal of ``pg_options`` is a TypeError naming the group and the option; any other
    failure a :class:`~hypergrid.errors.GroupCreationError` naming the group and its members.
    """
    ranks, make = _MODES[request.mode](request, timeout)
    try:
        if name is None:
            pg = make()
        else:
            with group_name_override(name, ranks):
                pg = make()
    except (TypeError, ValueError, AttributeError) as exc:
        _refused_options(request, exc)
        raise
    except Exception as exc:
        members = request.members
        shown = describe_ranks(members) if members is not None else "none (not a member)"
        who = explain_creation_failure(request.label, members or (), request.agreement, check_id)
        raise GroupCreationError(
            f"creating process group {request.label!r} with members {shown} failed: "
            f"{type(exc).__name__}: {exc}" + (f"; {who}" if who else "")
        ) from exc
    if request.members is None or pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    made: dist.ProcessGroup = pg
    return made


def _refused_options(request: GroupRequest, exc: BaseException) -> None:
    """pg_options reach torch's C++ backends untouched (a mock must pass, as on Megatron-Core), so
    what they refuse is known only here: named as the option's fault, not a bare TypeError."""
    options = request.options
    if options.pg_options is None:
        return
    backend = f"backend {options.backend!r}" if options.backend else "the default group's backend"
    raise TypeError(
        f"process group {request.label!r}: torch refused pg_options={options.pg_options!r} "
        f"({type(options.pg_options).__name__}; {backend} takes its own options type, "
        f"e.g. ProcessGroupNCCL.Options for 'nccl'): "
        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    ) from exc


def enumerate_before_init(request: GroupRequest) -> Optional[dist.ProcessGroup]:
    """Strategy ``enumerate`` before ``init_process_group``: hand the enumeration to torch, as Megatron-Core does.

    Nothing is registered (there is no world to follow); torch's refusal comes back as
    hypergrid's RuntimeError naming the group. Code that patches torch's constructor (Megatron-LM's
    unit tests) gets its mock back, exactly as from Megatron-Core's ``create_pg``.

    Example, in a process where torch.distributed is not initialized::

        >>> from hypergrid.runtime.request import GroupRequest
        >>> tp = GroupRequest.derived("tp", None, groups=lambda: [[0, 1], [2, 3]], mode=CreationMode.ENUMERATE)
        >>> enumerate_before_init(tp)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        RuntimeError: cannot create process group 'tp': torch.distributed is not initialized; ...
    """
    options = request.options
    try:
        # torch 2.13 leaves new_subgroups_by_enumeration unannotated; 2.15 types it.
        pg, _ = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call,unused-ignore]
            request.enumerate(),
            timeout=options.timeout,
            backend=options.backend,
            pg_options=options.pg_options,
            group_desc=options.group_desc,
        )
    except ValueError as exc:
        raise RuntimeError(_not_initialized(request.label)) from exc
    return cast(Optional[dist.ProcessGroup], pg)  # torch's type adds the non-member sentinel, never returned here


def _not_initialized(label: str) -> str:
    return (
        f"cannot create process group {label!r}: torch.distributed is not initialized; call "
        f"torch.distributed.init_process_group() first (a grid built with world_size= or "
        f"WORLD_SIZE alone can plan and enumerate, but not create groups)"
    )


def require_initialized(label: str) -> None:
    """Refuse to create ``label`` in a world that torch.distributed has not started.

    Example::

        >>> require_initialized("dp")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        RuntimeError: cannot create process group 'dp': torch.distributed is not initialized; ...
    """
    if not dist.is_initialized():
        raise RuntimeError(_not_initialized(label))
