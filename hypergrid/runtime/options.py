"""What a process group is made with beside its ranks: backend, timeout, options, description.

A :class:`GroupOptions` is checked when it is made (a backend torch does not know, a timeout that
is not positive, values of the wrong type) and knows which part of it makes two groups with the
same members different communicators (:attr:`GroupOptions.identity`: the description does not).
:func:`effective_timeout` is the timeout a group is really made with, and :func:`same_as_world`
whether a group of every rank would be the default group over again.

Example::

    >>> from datetime import timedelta
    >>> a = GroupOptions(timeout=timedelta(seconds=30), group_desc="TP")
    >>> b = GroupOptions(timeout=timedelta(seconds=30), group_desc="another description")
    >>> a.identity == b.identity, a.identity == GroupOptions().identity
    (True, False)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ..layout.checks import backend_names, check_timeout
from .torch_compat import default_group_timeout, new_group_default_timeout

__all__ = ["GroupOptions", "effective_timeout", "same_as_world"]


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
    _identity: Hashable = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str or None, got {type(self.backend).__name__} {self.backend!r}")
        if self.backend is not None:
            _check_backend_known(self.backend)
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(
                f"timeout must be a datetime.timedelta or None, got {type(self.timeout).__name__} {self.timeout!r}"
            )
        if self.timeout is not None:
            check_timeout("timeout", self.timeout)  # torch's bounds, before torch fails on them
        if self.group_desc is not None and not isinstance(self.group_desc, str):
            raise TypeError(f"group_desc must be a str or None, got {type(self.group_desc).__name__} {self.group_desc!r}")
        # Keep the options object alive: an identity fingerprint must not be reused by another.
        object.__setattr__(self, "_identity", (self.backend, self.timeout, _fingerprint(self.pg_options)))

    @property
    def identity(self) -> Hashable:
        return self._identity


def _check_backend_known(backend: str) -> None:
    """Refuse a backend torch has not registered (or writes otherwise), here rather than at the first create_pg."""
    backend_names(backend, [name for name in dist.Backend.backend_list if name != "undefined"])


def effective_timeout(options: GroupOptions) -> timedelta:
    """The timeout a group is created, and agreed on, with: the request's, else the job's.

    With none given, the default group's timeout (``init_process_group(timeout=...)``) rules,
    so a rank that dies is reported within the job's own timeout rather than torch's 30-minute
    default for new groups.

    Example::

        >>> effective_timeout(GroupOptions(timeout=timedelta(seconds=5)))
        datetime.timedelta(seconds=5)
    """
    if options.timeout is not None:
        return options.timeout
    job = default_group_timeout() if dist.is_initialized() else None
    if job is not None:
        return job
    return new_group_default_timeout(options.backend or (str(dist.get_backend()) if dist.is_initialized() else "gloo"))


def same_as_world(options: GroupOptions) -> bool:
    """Whether a group of every rank made with ``options`` is interchangeable with the default group.

    Then it is the default group: torch's DeviceMesh hands out the default group for a dim that
    spans the world, and so do hypergrid's adapters, instead of a second communicator over the
    same ranks. Options that differ (another backend, timeout or ``pg_options``) make a new one.

    Example, in a one-rank gloo world started with a 60 s timeout::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
        ...                         timeout=timedelta(seconds=60))
        >>> same_as_world(GroupOptions()), same_as_world(GroupOptions(timeout=timedelta(seconds=5)))
        (True, False)
        >>> dist.destroy_process_group()
    """
    if options.pg_options is not None:
        return False
    backend = str(dist.get_backend()).lower()
    if options.backend is not None and str(options.backend).lower() != backend:
        return False
    world_timeout = default_group_timeout()
    if world_timeout is None:
        # A backend without timeouts (e.g. torch's fake backend): nothing to differ in.
        return True
    # A group given no timeout is made with the job's (effective_timeout), the world's own.
    return effective_timeout(options) == world_timeout
