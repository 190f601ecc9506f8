"""Every use of torch's private c10d internals, in one place, feature-detected.

The group registry and the agreement check need some c10d internals:
``distributed_c10d._process_group_name`` (overridden for one call so that a group's name depends
only on what its members share, see :func:`group_name_override`), ``_get_default_store`` (where
members meet to agree), ``_get_default_timeout`` and a backend's ``options._timeout`` (to tell
whether a whole-world request can be served by the default group), and ``_world.pg_map`` (to
count a rank's process groups, proving none was created). Each degrades to torch's own
behaviour, with a log line, where it is missing. DeviceMesh's internals are in
:mod:`hypergrid.runtime.mesh_compat`.

Tested torch: :data:`TESTED_TORCH`. Nothing here compares version strings: each internal is
looked up where it is used.

Group creation needs to know how torch makes a new communicator in this job, and that changed
between releases; :func:`bound_split_device`, :func:`world_backend_on` and
:func:`torchcomms_subgroups` read it from what the installed torch has (see
:mod:`hypergrid.runtime.modes` for the decision they feed).

Example::

    >>> TESTED_TORCH
    '2.13.0 to 2.15.0'
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import UnsupportedTorchError

__all__ = [
    "TESTED_TORCH",
    "process_group_count",
    "group_name_override",
    "default_store",
    "default_group_timeout",
    "new_group_default_timeout",
    "bound_split_device",
    "world_backend_on",
    "TorchCommsSubgroups",
    "torchcomms_enabled",
    "torchcomms_subgroups",
    "default_group",
    "forget_empty_tags",
    "new_group_keeps_order",
    "Unsplit",
    "unsplit_mechanism",
    "unsplit",
    "fake_store",
]

logger = logging.getLogger(__name__)

#: The torch releases the project's CI runs on (information only: behaviour follows features).
TESTED_TORCH = "2.13.0 to 2.15.0"

def process_group_count() -> int:
    """How many process groups this process has (default group included), as c10d counts them.

    Example, as rank 0 of an 8-rank job on torch's fake backend: a grid's DeviceMesh creates no
    group beyond the grid's own::

        >>> process_group_count()                       # no process group yet
        0
        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> from hypergrid import HyperCommGrid, device_mesh
        >>> grid = HyperCommGrid([2, 4], ["tp", "dp"])
        >>> groups = [grid.create_pg("tp"), grid.create_pg("dp")]
        >>> before = process_group_count()
        >>> mesh = device_mesh(grid, device_type="cpu")
        >>> process_group_count() == before
        True
        >>> grid.destroy()
        >>> dist.destroy_process_group()
    """
    if not dist.is_available() or not dist.is_initialized():
        return 0
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if pg_map is None:
        raise UnsupportedTorchError(
            f"torch {torch.__version__} has no distributed_c10d._world.pg_map, where hypergrid counts "
            f"this process's groups (tested on torch {TESTED_TORCH})"
        )
    return len(pg_map)


@contextlib.contextmanager
def group_name_override(name: str, ranks: Sequence[int]) -> Iterator[None]:
    """Make torch name the group it creates for exactly ``ranks`` ``name``, for one call.

    With ``use_local_synchronization=True`` torch names a group by hashing its ranks together
    with the number of groups this process already has. Members that made different numbers of
    groups before (Megatron's embedding groups exist only on some pipeline stages, say) then
    disagree on the name, rendezvous under different store prefixes and hang until the timeout.

    Example, as rank 0 of an 8-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> with group_name_override("hypergrid-abc", [0, 1]):
        ...     pg = dist.new_group([0, 1], use_local_synchronization=True)
        >>> pg.group_name
        'hypergrid-abc'
        >>> dist.destroy_process_group()
    """
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    if original is None:
        logger.warning("torch.distributed has no _process_group_name; group names are torch's own")
        yield
        return
    # torch hands the name function the group's ranks, sorted unless the group keeps their order
    # (sort_ranks=False): the member set decides (sorting an ascending list is one pass).
    wanted = sorted(ranks)

    def named(group_ranks: list[int], use_hashed_name: bool) -> str:
        # torch's list is usually the very order asked for; the sort is for the kept-order case.
        if use_hashed_name and len(group_ranks) == len(wanted) and (
                group_ranks == wanted or sorted(group_ranks) == wanted):
            return c10d.GroupName(name) if hasattr(c10d, "GroupName") else name
        torch_name: str = original(group_ranks, use_hashed_name)
        return torch_name

    c10d._process_group_name = named  # type: ignore[assignment]  # torch's hook returns its GroupName (a str)
    try:
        yield
    finally:
        c10d._process_group_name = original


def default_store() -> Optional[dist.Store]:
    """The default group's store (where ranks can meet), or None where torch does not say.

    Example, in a one-rank gloo world whose store is a ``HashStore``::

        >>> default_store() is None                     # no process group
        True
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> default_store().set("key", "value")
        >>> default_store().get("key")
        b'value'
        >>> dist.destroy_process_group()
    """
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None or not dist.is_initialized():
        return None
    try:
        store: dist.Store = getter()
    except (RuntimeError, ValueError):
        return None
    return store


def default_group_timeout() -> Optional[timedelta]:
    """The timeout the default group was created with; None where its backend has none (fake).

    Example, in a one-rank gloo world whose store is a ``HashStore``::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
        ...                         timeout=timedelta(seconds=60))
        >>> default_group_timeout()
        datetime.timedelta(seconds=60)
        >>> dist.destroy_process_group()
    """
    default = dist.distributed_c10d._get_default_group()
    devices = []
    bound = getattr(default, "bound_device_id", None)
    if bound is not None:
        devices.append(bound)
    devices += [torch.device("cuda"), torch.device("cpu")]
    for device in devices:
        try:
            backend_options = default._get_backend(device).options
        except Exception:  # no backend for this device type
            continue
        timeout: Optional[timedelta] = getattr(backend_options, "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def new_group_default_timeout(backend: str) -> timedelta:
    """The timeout torch gives a new group of ``backend`` when none is passed.

    Example::

        >>> new_group_default_timeout("gloo")
        datetime.timedelta(seconds=1800)
    """
    getter = getattr(dist.distributed_c10d, "_get_default_timeout", None)
    if getter is None:
        from torch.distributed.constants import default_pg_timeout

        return default_pg_timeout
    timeout: timedelta = getter(dist.Backend(backend))
    return timeout


def default_group() -> dist.ProcessGroup:
    """The default (world) process group; torch.distributed must be initialized.

    Example, as rank 0 of an 8-rank job on torch's fake backend::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> default_group() is dist.group.WORLD
        True
        >>> dist.destroy_process_group()
    """
    return dist.distributed_c10d._get_default_group()


def bound_split_device() -> Optional[str]:
    """The type of the device the default group is bound to, if torch splits communicators there.

    torch makes a subgroup by splitting the world's communicator (which every rank of the world
    must then join) only once the default group is bound to a device and that device's backend
    can split. A group is bound by ``init_process_group(..., device_id=...)``; torch 2.15's
    ``nccl2`` backend (its default "nccl") and ``nccl-lazy`` bind the default group by themselves
    when it is created, so on those a world started without ``device_id`` is bound too.

    Asked of torch's own ``_get_split_source``, so that hypergrid decides as torch does: its
    signature is read, not assumed (torch 2.15 also takes the requested backend, here the world's
    own; 2.13 takes the group alone). Where torch has no such helper, the bound backend's
    ``supports_splitting`` is read. None: torch makes every communicator afresh among its members.

    Example::

        >>> bound_split_device() is None    # no process group; or unbound gloo, legacy NCCL without device_id
        True
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    world = default_group()
    device = getattr(world, "bound_device_id", None)
    if device is None:
        return None
    helper = getattr(dist.distributed_c10d, "_get_split_source", None)
    if helper is not None:
        if _takes_requested_backend(helper):
            source = helper(world, dist.get_backend(world))
        else:
            source = helper(world)
        return device.type if source is not None else None
    try:
        backend = world._get_backend(device)
    except RuntimeError:  # no backend registered for the bound device
        return None
    return device.type if getattr(backend, "supports_splitting", False) else None


class Unsplit(str, enum.Enum):
    """How this torch is kept from splitting a new group off the world's communicator."""

    LAZY_INIT = "lazy_init"  # the group's backend options say lazy_init (torch 2.15 reads it)
    UNBOUND = "unbound"  # the default group is left unbound for the call (every torch binding by attribute)
    NONE = "none"  # no way: torch splits whatever hypergrid does


def unsplit_mechanism(pg_options: Any = None, backend: Optional[str] = None) -> Unsplit:
    """How a group of ``backend`` with ``pg_options`` can be made among its members only on a world
    that splits: by its options' ``lazy_init`` where torch's group creation reads it and the
    options have it (``pg_options``, or a fresh ``ProcessGroupNCCL.Options`` for an NCCL backend),
    else by leaving the default group unbound for the call where its ``bound_device_id`` can be set.

    Example::

        >>> unsplit_mechanism() in (Unsplit.LAZY_INIT, Unsplit.UNBOUND)
        True
    """
    if _honours_lazy_init() and _options_for(pg_options, backend) is not None:
        return Unsplit.LAZY_INIT
    setter = getattr(getattr(dist.ProcessGroup, "bound_device_id", None), "fset", None)
    return Unsplit.UNBOUND if setter is not None else Unsplit.NONE


def _honours_lazy_init() -> bool:
    """Whether torch's group creation leaves a group with ``lazy_init`` options unsplit (it says so
    in its source: no version is compared)."""
    helper = getattr(dist.distributed_c10d, "_new_process_group_helper", None)
    try:
        return helper is not None and "lazy_init" in inspect.getsource(helper)
    except (OSError, TypeError):
        return False


def _options_for(pg_options: Any, backend: Optional[str]) -> Any:
    """The options object to set ``lazy_init`` on: ``pg_options`` if it has the attribute; for an NCCL
    backend with none given, torch's default ``ProcessGroupNCCL.Options``; else None."""
    if pg_options is not None:
        return pg_options if hasattr(pg_options, "lazy_init") else None
    name = str(backend if backend is not None else (dist.get_backend() if dist.is_initialized() else "")).lower()
    options_type = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    if "nccl" not in name or options_type is None:
        return None
    options = options_type()
    options.is_high_priority_stream = False  # what torch gives an NCCL group given no options
    return options if hasattr(options, "lazy_init") else None


@contextlib.contextmanager
def unsplit(pg_options: Any = None, backend: Optional[str] = None) -> Iterator[Any]:
    """For the block, keep torch from splitting a new group of ``backend`` off the world's
    communicator; yields the ``pg_options`` to pass to ``new_group``. The group is made among its
    members only, as a communicator of its own (see :func:`unsplit_mechanism`). Callers hold the
    registry's creation lock: nothing else makes a group meanwhile.

    Example::

        >>> with unsplit() as options:      # no process group: nothing to keep from splitting
        ...     options is None
        True
    """
    if not dist.is_available() or not dist.is_initialized() or bound_split_device() is None:
        yield pg_options
        return
    mechanism = unsplit_mechanism(pg_options, backend)
    if mechanism is Unsplit.LAZY_INIT:
        options = _options_for(pg_options, backend)
        before = options.lazy_init
        options.lazy_init = True
        try:
            yield options
        finally:
            options.lazy_init = before
        return
    if mechanism is Unsplit.NONE:
        raise UnsupportedTorchError(
            f"torch {torch.__version__} can make no group among its members only on a default group bound to a "
            f"device: its group creation reads no lazy_init option and ProcessGroup.bound_device_id cannot be set "
            f"(tested on torch {TESTED_TORCH})"
        )
    world = default_group()
    bound = world.bound_device_id
    world.bound_device_id = None
    try:
        yield pg_options
    finally:
        world.bound_device_id = bound


def _takes_requested_backend(helper: Any) -> bool:
    """Whether torch's ``_get_split_source`` takes the backend requested for the new group."""
    try:
        return len(inspect.signature(helper).parameters) >= 2
    except (TypeError, ValueError):
        return False


def world_backend_on(device_type: str) -> Optional[str]:
    """The default group's backend name on ``device_type`` (``"nccl"``, ``"gloo"``, ...), or None.

    Read from :func:`torch.distributed.get_backend_config`, which resolves a world started with
    no backend, or with one per device (``"cpu:gloo,cuda:nccl"``), to one name per device.

    Example, in a one-rank gloo world::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> world_backend_on("cpu"), world_backend_on("xpu")
        ('gloo', None)
        >>> dist.destroy_process_group()
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    for pair in str(dist.get_backend_config()).split(","):
        device, _, name = pair.strip().partition(":")
        if device == device_type and name:
            return name.lower()
    return None


class TorchCommsSubgroups(str, enum.Enum):
    """How torch makes a subgroup while TorchComms is enabled (``TORCH_DISTRIBUTED_USE_TORCHCOMMS``)."""

    #: TorchComms is not enabled.
    OFF = "off"
    #: ``new_group`` delegates to ``split_group``: every rank of the world joins each creation, and
    #: ``use_local_synchronization=True`` is refused (torch 2.13's ``_new_group_via_split_group``).
    WORLD_SPLIT = "world-split"
    #: Subgroups are new communicators among their members only (TorchComms' ``new_comm``, torch 2.15).
    MEMBERS_ONLY = "members-only"


def torchcomms_subgroups() -> TorchCommsSubgroups:
    """Which :class:`TorchCommsSubgroups` the installed torch follows in this process.

    Detected by what torch has, not by its version: a torch whose ``new_group`` delegates to
    ``split_group`` under TorchComms has the helper that does it, ``_new_group_via_split_group``.

    Example::

        >>> torchcomms_subgroups()     # TorchComms not enabled
        <TorchCommsSubgroups.OFF: 'off'>
    """
    if not torchcomms_enabled():
        return TorchCommsSubgroups.OFF
    if callable(getattr(dist.distributed_c10d, "_new_group_via_split_group", None)):
        return TorchCommsSubgroups.WORLD_SPLIT
    return TorchCommsSubgroups.MEMBERS_ONLY


def torchcomms_enabled() -> bool:
    """Whether torch routes group creation through TorchComms (``TORCH_DISTRIBUTED_USE_TORCHCOMMS``).

    Example::

        >>> torchcomms_enabled()
        False
    """
    probe = getattr(dist.distributed_c10d, "_use_torchcomms_enabled", None)
    return bool(probe()) if probe is not None else False


def forget_empty_tags() -> None:
    """Drop torch's empty ``tags_to_pg`` entries left behind by destroyed groups.

    torch empties a destroyed group's tag list but keeps the key (``"ptd:<group name>"``), one
    per group ever created: without this, create/destroy cycles grow torch's table without bound.

    Example::

        >>> forget_empty_tags()   # nothing to drop without a process group
    """
    tags = getattr(getattr(dist.distributed_c10d, "_world", None), "tags_to_pg", None)
    if isinstance(tags, dict):
        for tag in [t for t, pgs in tags.items() if not pgs]:
            del tags[tag]


def new_group_keeps_order() -> bool:
    """Whether ``new_group`` takes ``sort_ranks=False``, making a group whose ranks keep the order
    given (group rank ``i`` is the ``i``-th rank listed) instead of ascending global ranks.

    A grid placed over other ranks (after a recovery) needs it: a group's order is its members'
    positions, and Megatron-Core reads a rank's place in its group (its tensor-parallel rank, say)
    from the group. Public in torch 2.13 and 2.15; looked up, not assumed.

    Example::

        >>> new_group_keeps_order()
        True
    """
    try:
        return "sort_ranks" in inspect.signature(dist.new_group).parameters
    except (TypeError, ValueError):
        return False


def fake_store() -> dist.Store:
    """A store for torch's fake backend, ``init_process_group("fake", store=fake_store(), rank=r,
    world_size=n)``: one process plays one rank of any world, with no peer (``check --torchtitan``
    builds torchtitan's meshes so, rank by rank).

    Example::

        >>> isinstance(fake_store(), dist.Store)
        True
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()
