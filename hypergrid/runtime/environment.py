"""Where a grid learns how large the world is, which rank this process is, and where ranks meet.

Megatron-Core's ``HyperCommGrid`` reads the world size from ``WORLD_SIZE`` before
torch.distributed, so that a grid larger than the running job can be planned and enumerated
(its own tests plan a 120-rank grid inside an 8-rank job); hypergrid does the same. This rank is
torch.distributed's once it is initialized, else ``RANK``. A variable that is set but malformed
is an error naming it: a launcher's typo must not read as "not set".

Example::

    >>> resolve_world_size(world_size=64)   # plan for 64 ranks, whatever the job
    64
    >>> import os; os.environ["RANK"] = "3"
    >>> current_rank()
    3
    >>> del os.environ["RANK"]
"""

from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from ..layout import as_int
from ..store.client import StoreClient
from .torch_compat import default_store

__all__ = ["resolve_world_size", "int_from_environment", "current_rank", "world_size_if_started", "agreement_possible",
           "job_store"]


def resolve_world_size(world_size: Optional[int] = None) -> int:
    """The world size a grid is planned in, resolved as Megatron-Core's ``HyperCommGrid`` does.

    ``world_size`` if given; otherwise the ``WORLD_SIZE`` environment variable; otherwise
    torch.distributed's world size when it is initialized. Whether the grid fits the real world is
    checked when a group is created, not here.

    Example::

        >>> import os; os.environ["WORLD_SIZE"] = "120"
        >>> resolve_world_size()                # WORLD_SIZE before torch.distributed
        120
        >>> del os.environ["WORLD_SIZE"]

    Raises:
        TypeError / ValueError: ``world_size`` or ``WORLD_SIZE`` is not a positive integer.
        RuntimeError: none of the three says how large the world is.
    """
    if world_size is not None:
        size = as_int(world_size, "world_size")
        if size <= 0:
            raise ValueError(f"world_size must be positive, got {size}")
        return size
    value = int_from_environment("WORLD_SIZE", minimum=1)
    if value is not None:
        return value
    if dist.is_initialized():
        return dist.get_world_size()
    raise RuntimeError(
        "Cannot determine world size: no world_size= was given, the WORLD_SIZE environment "
        "variable is not set and torch.distributed is not initialized. Set WORLD_SIZE, "
        "initialize torch.distributed, or pass world_size= to plan without a process group."
    )


def int_from_environment(name: str, minimum: int) -> Optional[int]:
    """The integer in environment variable ``name``, None when it is not set.

    Example::

        >>> import os; os.environ["RANK"] = "x"
        >>> int_from_environment("RANK", minimum=0)
        Traceback (most recent call last):
        ...
        ValueError: environment variable RANK is set to 'x', which is not an integer >= 0
        >>> del os.environ["RANK"]
    """
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"environment variable {name} is set to {text!r}, which is not an integer >= {minimum}")
    return value


def current_rank() -> int:
    """This process's global rank: torch.distributed's once initialized, else ``RANK``.

    Example::

        >>> current_rank()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: this rank is unknown: torch.distributed is not initialized and RANK is not set; ...
    """
    if dist.is_initialized():
        return dist.get_rank()
    env = int_from_environment("RANK", minimum=0)
    if env is not None:
        return env
    raise RuntimeError(
        "this rank is unknown: torch.distributed is not initialized and RANK is not set; "
        "pass rank= explicitly"
    )


def world_size_if_started() -> Optional[int]:
    """torch.distributed's world size, None before ``init_process_group``.

    Example::

        >>> world_size_if_started() is None
        True
    """
    return dist.get_world_size() if dist.is_initialized() else None


def agreement_possible() -> bool:
    """Whether this job has a store its ranks can meet in (not on the fake backend).

    Example::

        >>> agreement_possible()     # no process group
        False
    """
    if not dist.is_available() or not dist.is_initialized():
        return False
    # The fake backend simulates one rank: there is nobody to agree with.
    return str(dist.get_backend()).lower() != "fake" and default_store() is not None


def job_store(deadline: float) -> StoreClient:
    """The default group's store, over this thread's own connection, every call bounded by
    ``deadline`` (a monotonic time).

    Raises:
        RuntimeError: there is no store to meet in (:func:`agreement_possible` says so).

    Example, in a one-rank gloo world whose store is a ``HashStore``::

        >>> import time
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> job_store(time.monotonic() + 5).add("count", 1)
        1
        >>> dist.destroy_process_group()
    """
    base = default_store()
    if base is None:
        raise RuntimeError("hypergrid: the job has no store to meet in (torch.distributed is not initialized, or "
                           "its default group has no store)")
    return StoreClient(deadline, base=base)
