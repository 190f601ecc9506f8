"""HyperCommGrid: Megatron-Core's N-dimensional communication grid, built on hypergrid's registry.

The constructor, attributes, group keys, enumerations and errors are those of
``megatron.core.hyper_comm_grid.HyperCommGrid``; what differs is how groups are made (each rank
creates only its own, once, shared across grids) and what else a grid can answer (``ranks``,
``coords``, views).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import torch.distributed as dist

from .errors import GridDestroyedError, GridTooLargeError
from .layout import KEY_SEPARATOR, Dims, GridLayout, Partition
from .layout.rank_map import RankMap
from .layout.views import BASE_VIEW, RankView
from .runtime.environment import current_rank, resolve_world_size, world_size_if_started
from .runtime.modes import creation_mode, resolve_strategy
from .runtime.options import GroupOptions
from .runtime.registry import REGISTRY
from .runtime.request import GroupRequest, Origin
from .store.records import GridFacts, Position, ViewFacts

__all__ = ["HyperCommGrid", "RankView", "MadeGroup"]

logger = logging.getLogger(__name__)

# Distinguishes grids in the registry's holder table; a counter, not id(), because ids are reused.
_grid_ids = itertools.count()

_CREATE_KWARGS = ("timeout", "pg_options", "group_desc", "backend")

#: A key of ``grid._pgs``, as Megatron-Core 0.17+ stores it: ``"dp-tp"`` for a group of the grid
#: (or of a view's shared dims), ``("expert", ("ep", "etp"))`` for a group private to a view.
GroupKey = Union[str, tuple[str, tuple[str, ...]]]


@dataclass(frozen=True)
class MadeGroup:
    """One ``create_pg`` a grid has answered, as it was asked: enough to ask it again of another
    grid (a recovery re-asks them of the re-placed grid, in the same order)."""

    key: GroupKey
    dims: tuple[str, ...]
    view: Optional[str]
    options: GroupOptions
    private: bool


class HyperCommGrid:
    r"""N-dimensional communication grid of named parallel dims.

    ``dim_names`` is Megatron-Core's ``order``: the first name varies fastest over global ranks.
    Group keys and enumerations list dims in the reversed order, exactly as Megatron-Core does.
    Groups are created explicitly with :meth:`create_pg` and looked up with :meth:`get_pg`.

    Example::

        >>> grid = HyperCommGrid([2, 3, 4, 5], ["tp", "cp", "pp", "dp"], world_size=120)
        >>> grid.get_rank_enum("tp")[:2]
        [[0, 1], [2, 3]]
        >>> grid.get_rank_enum(["dp", "cp"])[0][:4]
        [0, 2, 4, 24]
        >>> grid.ranks("pp", rank=7)
        [1, 7, 13, 19]

    In a job (torch.distributed initialized) :meth:`create_pg` makes this rank's groups. Here
    this process is rank 0 of an 8-rank job on torch's fake backend, which needs no other
    process::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        >>> grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
        >>> dp = grid.create_pg("dp")
        >>> dp_cp = grid.create_pg(["cp", "dp"], group_desc="DP_CP")
        >>> dist.get_process_group_ranks(dp), dist.get_process_group_ranks(dp_cp)
        ([0, 4], [0, 2, 4, 6])
        >>> grid.get_pg(["dp", "cp"]) is dp_cp
        True
        >>> grid.destroy()
        >>> dist.destroy_process_group()

    Args:
        shape: size of each dim.
        dim_names: name of each dim, fastest-varying first (Megatron's ``order``).
        rank_offset: first global rank of the grid, for grids that do not start at rank 0.
        backend: backend of the groups; None uses the default group's backend.
        world_size: the world to fit in when torch.distributed is not initialized (planning).
        strategy: how groups are made (see :mod:`hypergrid.runtime.modes`): ``"auto"`` (the
            default unless :func:`~hypergrid.runtime.modes.set_default_strategy` or
            ``HYPERGRID_STRATEGY`` say otherwise: ``"split"`` on a device-bound NCCL default
            group, else ``"local"``), ``"local"`` (each rank creates only its own groups),
            ``"split"`` (every rank joins one ``split_group`` per request) or ``"enumerate"``
            (Megatron-Core's call pattern, all ranks create all groups).
        timeout: default timeout of the grid's groups (a ``create_pg`` timeout overrides it).
        check_agreement: check before each group is created that its members requested the
            same grid and group (see :mod:`hypergrid.runtime.agreement`); on by default.

    Raises:
        ValueError: bad shape, names or offset, or a grid larger than the world (also a
            RuntimeError, as in Megatron-Core).
        TypeError: values of the wrong type.
    """

    def __init__(
        self,
        shape: Sequence[int],
        dim_names: Sequence[str],
        rank_offset: int = 0,
        backend: Optional[str] = None,
        *,
        world_size: Optional[int] = None,
        strategy: Optional[str] = None,
        timeout: Optional[timedelta] = None,
        check_agreement: bool = True,
        rank_map: Union[RankMap, Sequence[int], None] = None,
    ) -> None:
        placement = RankMap.of(rank_map) if rank_map is not None and not isinstance(rank_map, RankMap) else rank_map
        layout = GridLayout(shape, dim_names, rank_offset, placement)  # type: ignore[arg-type]
        resolved_strategy = resolve_strategy(strategy)
        if not isinstance(check_agreement, bool):
            raise TypeError(f"check_agreement must be a bool, got {check_agreement!r}")
        # Checked as every group's options are, before anything else is set up.
        self._default_timeout = GroupOptions(backend=backend, timeout=timeout).timeout
        world = resolve_world_size(world_size)
        if layout.last_rank >= world:
            raise GridTooLargeError(
                f"Grid shape {list(layout.shape)} is over sized: it needs {layout.size} ranks from "
                f"rank_offset {layout.rank_offset}, but the world size is {world}" if layout.rank_map is None else
                f"Grid shape {list(layout.shape)} is placed on ranks up to {layout.last_rank}, but the world "
                f"size is {world}"
            )
        self._layout = layout
        self._world_size = world
        self._strategy = resolved_strategy
        self._check_agreement = check_agreement
        self._id = next(_grid_ids)
        self._destroyed = False
        # Megatron-Core 0.17+ keeps the grid itself as view "base": view="base" means the grid,
        # and no view may be registered under that name.
        self._views: dict[str, RankView] = {BASE_VIEW: RankView(BASE_VIEW, layout)}
        self._facts = self._grid_facts()
        self.backend: Optional[str] = backend
        # Every group this grid created, under Megatron-Core's keys (see GroupKey).
        self._pgs: dict[GroupKey, Optional[dist.ProcessGroup]] = {}
        # What each key was created with, in creation order (a recovery asks for them again).
        self._made: dict[GroupKey, MadeGroup] = {}
        self._requests = 0  # requests that reached the registry: the position members compare
        # Orders destroy() against a create_pg() in another thread: a creation either lands before
        # the destroy (and is destroyed with the grid) or finds the grid destroyed and lets go.
        self._state_lock = threading.Lock()

    # ------------------------------------------------------------------ facts
    @property
    def shape(self) -> list[int]:
        """The size of each dim, a list as Megatron-Core keeps it."""
        return list(self._layout.shape)

    @property
    def dim_names(self) -> list[str]:
        """The dim names, fastest-varying first (Megatron's ``order``), a list as Megatron-Core keeps it."""
        return list(self._layout.dim_names)

    @property
    def rank_offset(self) -> int:
        """The grid's first global rank."""
        return self._layout.rank_offset

    @property
    def size(self) -> int:
        """How many ranks the grid spans."""
        return self._layout.size

    @property
    def rank_map(self) -> Optional[RankMap]:
        """Where the grid's positions sit among global ranks; None: ``rank_offset + position``."""
        return self._layout.rank_map

    @property
    def layout(self) -> GridLayout:
        """The grid's rank algebra as a frozen :class:`~hypergrid.layout.GridLayout`."""
        return self._layout

    @property
    def world_size(self) -> int:
        """The world size the grid was checked against."""
        return self._world_size

    @property
    def strategy(self) -> str:
        """How this grid creates groups, one of ``"auto"``, ``"local"``, ``"split"`` or ``"enumerate"``."""
        return self._strategy.value

    @property
    def default_timeout(self) -> Optional[timedelta]:
        """The timeout of the grid's groups when a request gives none (None: the job's)."""
        return self._default_timeout

    @property
    def check_agreement(self) -> bool:
        """Whether group creation first checks that the members agree on the request."""
        return self._check_agreement

    @property
    def views(self) -> dict[str, GridLayout]:
        """The registered views' layouts, by name (the grid's own ``"base"`` is :attr:`layout`)."""
        return {name: view.layout for name, view in self._views.items() if name != BASE_VIEW}

    def __repr__(self) -> str:
        return (
            f"HyperCommGrid(shape={self.shape}, dim_names={self.dim_names}, "
            f"rank_offset={self.rank_offset}, backend={self.backend!r}, strategy={self._strategy.value!r}"
            f"{', destroyed' if self._destroyed else ''})"
        )

    # ------------------------------------------------------------------ Megatron API
    def create_pg(self, dims: Dims, *, view: Optional[str] = None, private: bool = False, **kwargs: Any) -> Optional[dist.ProcessGroup]:
        r"""Create the process group over ``dims`` and return this rank's group.

        The key ignores the order of ``dims`` (it follows the reversed ``dim_names``), so
        ``create_pg(["dp", "cp"])`` and ``create_pg(["cp", "dp"])`` are the same group. Returns
        None on a rank outside the grid, like Megatron-Core.

        Keyword args ``timeout``, ``pg_options``, ``group_desc`` and ``backend`` pass through to
        torch. ``view=`` creates the group in a registered view. ``private=True`` gives this key a
        communicator of its own instead of sharing one with identical members and options.

        Example, as rank 0 of an 8-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
            >>> grid = HyperCommGrid([2, 4], ["tp", "dp"])
            >>> dp = grid.create_pg("dp", group_desc="DATA_PARALLEL")
            >>> dist.get_process_group_ranks(dp)
            [0, 2, 4, 6]
            >>> grid.create_pg("dp")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
                ...
            KeyError: "Process group dp has already been created under key 'dp'. ..."
            >>> grid.destroy()
            >>> dist.destroy_process_group()

        Raises:
            KeyError: a group with this key was already created (Megatron-Core's behaviour;
                use :meth:`get_pg` or :meth:`get_or_create_pg`).
            ValueError / TypeError: unknown or repeated dims, unknown keyword arguments.
        """
        self._check_alive()
        options = self._options("create_pg", kwargs)
        if not isinstance(private, bool):
            raise TypeError(f"private must be a bool, got {private!r}")
        layout, key, label = self._resolve(dims, view)
        if key in self._pgs:
            where = "" if isinstance(key, str) else f" for view {key[0]!r}"
            raise KeyError(
                f"Process group {dims}{where} has already been created under key {key!r}. Because "
                f"there is no way to check whether options to create process group matches the "
                f"first, we error out instead of returning the process group that has already been "
                f"created before; use get_pg({dims!r}) or get_or_create_pg()."
            )
        pg = self._acquire(self._id, label, view, options, private, layout.partition(dims), key=key)
        self._made[key] = MadeGroup(key, tuple(layout.order_dims(dims)[0]), view, options, private)
        logger.debug("grid %d created %s: this rank's group is %s", self._id, label, pg)
        return pg

    def made_groups(self) -> list[MadeGroup]:
        """Every group :meth:`create_pg` made, in creation order, with what it was asked with.

        Example::

            >>> grid = HyperCommGrid([2, 4], ["tp", "dp"], world_size=8)
            >>> grid.made_groups()
            []
        """
        return list(self._made.values())

    def get_pg(self, dims: Dims, *, view: Optional[str] = None) -> Optional[dist.ProcessGroup]:
        r"""The group over ``dims`` created earlier by :meth:`create_pg` (any order of ``dims``).

        Example, as rank 0 of an 8-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
            >>> grid = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
            >>> dp_cp = grid.create_pg(["cp", "dp"])
            >>> grid.get_pg(["dp", "cp"]) is dp_cp          # the same group, whatever the order
            True
            >>> grid.get_pg("tp")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
                ...
            KeyError: "Process group for tp hasn't been created. Call create_pg first."
            >>> grid.destroy()
            >>> dist.destroy_process_group()

        Raises:
            KeyError: no group with this key was created; call create_pg first.
        """
        self._check_alive()
        _, key, _ = self._resolve(dims, view)
        if key not in self._pgs:
            if isinstance(key, str):
                raise KeyError(f"Process group for {key} hasn't been created. Call create_pg first.")
            raise KeyError(
                f"Process group {dims} for view {key[0]!r} hasn't been created (key {key!r}). "
                f"Call create_pg first."
            )
        return self._pgs[key]

    def get_or_create_pg(self, dims: Dims, *, view: Optional[str] = None, **kwargs: Any) -> Optional[dist.ProcessGroup]:
        """:meth:`get_pg` if the group exists, else :meth:`create_pg` with ``kwargs``.

        Example, as rank 0 of an 8-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
            >>> grid = HyperCommGrid([2, 4], ["tp", "dp"])
            >>> tp = grid.get_or_create_pg("tp")            # safe to call from several places
            >>> grid.get_or_create_pg("tp") is tp
            True
            >>> grid.destroy()
            >>> dist.destroy_process_group()
        """
        self._check_alive()
        _, key, _ = self._resolve(dims, view)
        if key in self._pgs:
            return self._pgs[key]
        return self.create_pg(dims, view=view, **kwargs)

    def create_derived_pg(
        self,
        label: str,
        members: Optional[Sequence[int]] = None,
        *,
        partition: Optional[Partition] = None,
        groups: Optional[Callable[[], list[list[int]]]] = None,
        owner: Any = None,
        private: bool = False,
        **kwargs: Any,
    ) -> Optional[dist.ProcessGroup]:
        """A group the grid's dims do not name, made through the same door as :meth:`create_pg`.

        For groups derived from the grid by a rule of their own (Megatron's embedding group from
        the pipeline group, a distributed-optimizer instance, a DeviceMesh's flattened or
        unflattened dims, ...). Either ``members``, this rank's group (None: it is in none), with
        ``groups`` every group of the request (needed only by the ``enumerate`` strategy); or a
        ``partition`` of ranks (:class:`~hypergrid.layout.Partition`), from which this rank's
        group and every group follow, and which is the request's identity: a partition equal to
        one of the grid's dims gets that dims' group. The request takes the grid's next
        position, so its members check they agree exactly as for :meth:`create_pg`, and it
        follows the grid's strategy: under ``split`` every rank of the world must call this,
        members or not. The group is not stored under a key; ``owner`` (default: the grid)
        holds it until released.

        Example: Megatron's embedding group, the first and last pipeline stages, as rank 0 of an
        8-rank job on torch's fake backend (rank 0 is a first stage, so it is a member)::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
            >>> grid = HyperCommGrid([1, 2, 4], ["tp", "dp", "pp"])
            >>> pp = grid.ranks("pp")
            >>> pp
            [0, 2, 4, 6]
            >>> embd = grid.create_derived_pg("embd", [pp[0], pp[-1]], group_desc="EMBEDDING")
            >>> dist.get_process_group_ranks(embd)
            [0, 6]
            >>> dp_pp = grid.create_derived_pg("dp_pp", partition=Partition.of(0, 8, [(8, 1)]))
            >>> grid.create_pg(["dp", "pp"]) is dp_pp         # the same partition: the same group
            True
            >>> grid.destroy()                              # releases the derived groups too
            >>> dist.destroy_process_group()
        """
        self._check_alive()
        options = self._options("create_derived_pg", kwargs)
        if not isinstance(label, str) or not label:
            raise TypeError(f"label must be a non-empty str, got {label!r}")
        if partition is not None:
            if members is not None or groups is not None:
                raise TypeError("create_derived_pg() takes either members (and groups) or partition, not both")
            if not isinstance(partition, Partition):
                raise TypeError(f"partition must be a hypergrid.layout.Partition, got {type(partition).__name__} {partition!r}")
            return self._acquire(self._id if owner is None else owner, label, None, options, private, partition)
        mine = None if members is None else tuple(members)
        return self._acquire(self._id if owner is None else owner, label, None, options, private, (mine, groups))

    def get_rank_enum(self, dims: Dims, *, view: Optional[str] = None) -> list[list[int]]:
        r"""Every group over ``dims``: the enumeration create_pg uses, equal to Megatron-Core's.

        Example::

            >>> HyperCommGrid([2, 2, 2], ["a", "b", "c"], world_size=8).get_rank_enum(["b", "a"])
            [[0, 1, 2, 3], [4, 5, 6, 7]]
        """
        return self._layout_of(view, dims).enumerate(dims)

    def _gen_rank_enum(self, dims: list[str]) -> list[list[int]]:
        r"""Megatron-Core's helper: groups over ``dims`` taken in the order given (last fastest).

        Example::

            >>> HyperCommGrid([2, 2, 2], ["a", "b", "c"], world_size=8)._gen_rank_enum(["a", "b"])
            [[0, 2, 1, 3], [4, 6, 5, 7]]
        """
        return self._layout.gen_rank_enum(dims)

    def _order_dims(self, dims: Dims) -> tuple[list[str], str]:
        r"""Megatron-Core's helper: ``dims`` in reversed ``dim_names`` order, and their key.

        Example::

            >>> HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"], world_size=24)._order_dims(["tp", "dp"])
            (['dp', 'tp'], 'dp-tp')
        """
        return self._layout.order_dims(dims)

    def _order_dims_for(self, dim_names: Sequence[str], dims: Dims) -> tuple[list[str], str]:
        r"""Megatron-Core 0.17+'s helper: ``dims`` in reversed ``dim_names`` order, and their key.

        ``dim_names`` is given explicitly (a view's, or the grid's). Unlike Megatron-Core's, a
        name missing from ``dim_names`` is a ValueError even when ``dims`` is a single str.

        Example::

            >>> grid = HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"], world_size=24)
            >>> grid._order_dims_for(grid.dim_names, ["tp", "dp"])
            (['dp', 'tp'], 'dp-tp')
            >>> grid._order_dims_for(["ep", "pp"], "ep")
            (['ep'], 'ep')
        """
        names = list(dim_names)
        requested = [dims] if isinstance(dims, str) else list(dims)
        missing = [d for d in requested if d not in names]
        if missing:
            raise ValueError(f"{missing[0]!r} is not in dim_names {names}")
        # Later in dim_names sorts first: the reversed order Megatron-Core keys groups by.
        ordered = sorted(requested, key=lambda d: -names.index(d))
        return ordered, KEY_SEPARATOR.join(ordered)

    def _gen_rank_enum_for(self, shape: Sequence[int], dim_names: Sequence[str], dims: list[str]) -> list[list[int]]:
        r"""Megatron-Core 0.17+'s helper: :meth:`_gen_rank_enum` for an explicit shape and names.

        The ranks start at this grid's ``rank_offset``; ``dims`` are taken in the order given.

        Example::

            >>> grid = HyperCommGrid([2, 2, 2], ["a", "b", "c"], world_size=8)
            >>> grid._gen_rank_enum_for([4, 2], ["ep", "pp"], ["ep"])
            [[0, 1, 2, 3], [4, 5, 6, 7]]
        """
        return GridLayout(tuple(shape), tuple(dim_names), self.rank_offset, self._layout.rank_map).gen_rank_enum(dims)

    # ------------------------------------------------------------------ beyond Megatron
    def ranks(self, dims: Dims, rank: Optional[int] = None, *, view: Optional[str] = None) -> list[int]:
        """The members of the ``dims`` group that holds ``rank`` (default: this rank).

        O(group size): no other group is enumerated.

        Example::

            >>> HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"], world_size=24).ranks("dp", rank=7)
            [1, 7, 13, 19]
        """
        return self._layout_of(view, dims).group_ranks(dims, current_rank() if rank is None else rank)

    def coords(self, rank: Optional[int] = None, *, view: Optional[str] = None) -> dict[str, int]:
        """Coordinates of ``rank`` (default: this rank), by dim name in ``dim_names`` order.

        Example::

            >>> HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"], world_size=24).coords(7)
            {'tp': 1, 'cp': 0, 'dp': 1}
        """
        layout = self._layout_of(view)
        values = layout.coords(current_rank() if rank is None else rank)
        return dict(zip(layout.dim_names, values))

    def is_current_rank_in_grid(self) -> bool:
        """Whether this process's global rank lies in ``[rank_offset, rank_offset + size)``."""
        return self._layout.contains(current_rank())

    def register_view(
        self,
        name: str,
        shape: Sequence[int],
        dim_names: Sequence[str],
        shared_dims: Optional[Sequence[str]] = None,
    ) -> None:
        """Register another factorization of the grid's ranks, for ``create_pg(..., view=name)``.

        A view spans the same ranks as the grid with other dims, e.g. the expert layout of an MoE
        model beside the dense one. Groups whose members coincide are one communicator whatever
        grid or view asked for them. ``shared_dims`` names dims the view has in common with the
        grid: each must make the same groups in both, and so must all of them together (dims of
        size 1 always do). A request made only of shared dims is the grid's own group, under the
        grid's key, so ``get_pg("pp", view="expert")`` finds the grid's ``pp`` group.

        Accepts and rejects what Megatron-Core 0.17+'s ``register_view`` does, with its exception
        types, and returns None as it does; the view's layout is ``grid.views[name]``.

        Example::

            >>> grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"], world_size=16)
            >>> grid.register_view("expert", [4, 4], ["ep", "dp"], shared_dims=["dp"])
            >>> grid.views["expert"]
            GridLayout(shape=(4, 4), dim_names=('ep', 'dp'), rank_offset=0)
            >>> grid.get_rank_enum("ep", view="expert")[0]
            [0, 1, 2, 3]

        Raises:
            ValueError: the name is taken (``"base"`` included), shape and names differ in
                length, a name repeats, a size is not a positive integer, the view spans another
                number of ranks, or a shared dim is repeated, missing from the grid or the view,
                or makes other groups in the view than in the grid.
            TypeError: values of the wrong type (a non-integer size raises
                :class:`~hypergrid.errors.ShapeTypeError`, also a ValueError as in Megatron-Core).
        """
        self._check_alive()
        view = RankView.register(name, shape, dim_names, shared_dims, self._layout, taken=self._views)
        self._views[name] = view
        self._facts = self._grid_facts()

    def destroy(self) -> None:
        """Destroy the groups this grid created that this rank is in, as Megatron-Core does.

        Every group goes through ``torch.distributed.destroy_process_group``, once each, as in
        Megatron-Core 0.17+ (``None`` and the non-member sentinel are skipped). One difference:
        a communicator hypergrid shares with another grid or adapter (same members and options)
        is destroyed when its last holder lets go, not while others still use it; and a group
        adopted from a DeviceMesh belongs to whoever made it and is never destroyed. A group put
        into ``grid._pgs`` from outside is destroyed here, like Megatron-Core's.

        Idempotent. Afterwards creating or getting a group raises
        :class:`~hypergrid.errors.GridDestroyedError`; enumerations still work.

        Example, as rank 0 of an 8-rank job on torch's fake backend::

            >>> import torch.distributed as dist
            >>> from torch.testing._internal.distributed.fake_pg import FakeStore
            >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
            >>> grid = HyperCommGrid([2, 4], ["tp", "dp"])
            >>> dp = grid.create_pg("dp")
            >>> grid.destroy()
            >>> grid.destroy()                              # the second call does nothing
            >>> grid.get_pg("dp")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
                ...
            hypergrid.errors.GridDestroyedError: HyperCommGrid(...) was destroyed; build a new grid to create or get groups
            >>> grid.get_rank_enum("tp")                    # enumerations still work
            [[0, 1], [2, 3], [4, 5], [6, 7]]
            >>> dist.destroy_process_group()
        """
        with self._state_lock:
            if self._destroyed:
                return
            self._destroyed = True
            held = list(self._pgs.values())
            self._pgs.clear()
        # Groups put into _pgs from outside are destroyed as Megatron-Core destroys them;
        # hypergrid's own, by destroy_process_group too, once nobody holds them any more.
        REGISTRY.destroy_foreign(held)
        REGISTRY.release(self._id)

    # ------------------------------------------------------------------ helpers
    def _grid_facts(self) -> GridFacts:
        """What members compare of this grid: shape, names, placement and views."""
        layout = self._layout
        views = tuple(ViewFacts(v.name, v.layout.shape, v.layout.dim_names, tuple(sorted(v.shared)))
                      for v in sorted(self._views.values(), key=lambda v: v.name) if v.name != BASE_VIEW)
        placement = "" if layout.rank_map is None else layout.rank_map.digest
        return GridFacts.of(layout.shape, layout.dim_names, layout.rank_offset, views, placement)

    def _options(self, caller: str, kwargs: dict[str, Any]) -> GroupOptions:
        """The options of a request: torch's keywords, the grid's defaults where none is given."""
        unknown = sorted(set(kwargs) - set(_CREATE_KWARGS))
        if unknown:
            raise TypeError(
                f"{caller}() got unexpected keyword argument(s) {unknown}; it accepts "
                f"{list(_CREATE_KWARGS)}" + (" plus view= and private=" if caller == "create_pg" else "")
            )
        return GroupOptions(
            backend=kwargs.get("backend", self.backend),
            timeout=kwargs.get("timeout", self._default_timeout),
            pg_options=kwargs.get("pg_options"),
            group_desc=kwargs.get("group_desc"),
        )

    def _acquire(
        self,
        owner: Any,
        label: str,
        view: Optional[str],
        options: GroupOptions,
        private: bool,
        groups: Union[Partition, tuple[Optional[tuple[int, ...]], Optional[Callable[[], list[list[int]]]]]],
        key: Optional[GroupKey] = None,
    ) -> Optional[dist.ProcessGroup]:
        """Build the one request for ``groups`` (a partition of ranks, or this rank's members and
        every group), stamped with the grid's next position, and hand it to the registry.

        Raises :class:`~hypergrid.errors.GridDestroyedError`, holding nothing, when the grid was
        destroyed (by another thread) while the group was being made."""
        world = world_size_if_started()
        if world is not None and self._layout.last_rank >= world:
            raise GridTooLargeError(
                f"cannot create process group {label!r}: grid shape {self.shape} needs "
                f"{self.size} ranks from rank_offset {self.rank_offset} (ranks up to "
                f"{self.rank_offset + self.size - 1}), but torch.distributed's world has {world} "
                f"ranks; the grid was planned for a world of {self._world_size}"
            )
        with self._state_lock:
            self._check_alive()
            index = self._requests
            self._requests += 1
        origin = Origin(Position(self._facts.family, self._facts.digest, index), self._facts, view) if self._check_agreement else None
        decided = dict(options=options, mode=creation_mode(self._strategy, options.backend), private=private, origin=origin)
        rank = None if world is None else dist.get_rank()  # before init: only Megatron-Core's enumeration can run
        if isinstance(groups, Partition):
            request = GroupRequest.for_partition(label, groups, rank, **decided)
        elif self._layout.rank_map is None:
            request = GroupRequest.derived(label, groups[0], groups[1], **decided)
        else:
            # Placed over other ranks: a group's ranks in their positions' order, as torch would
            # order them if the positions were the ranks.
            members = None if groups[0] is None else tuple(self._layout.rank_map.in_position_order(groups[0]))
            request = GroupRequest.derived(label, members, groups[1], keep_order=True, **decided)
        pg = REGISTRY.acquire(owner, request)
        with self._state_lock:
            if not self._destroyed:
                if key is not None:
                    self._pgs[key] = pg
                return pg
        # destroy() ran while this creation waited on its peers: it has released what the grid
        # held then; release this one too, instead of handing out a destroyed grid's group.
        REGISTRY.release(owner)
        self._check_alive()
        return pg  # not reached: _check_alive raised

    def _check_alive(self) -> None:
        if self._destroyed:
            raise GridDestroyedError(f"{self!r} was destroyed; build a new grid to create or get groups")

    def _view_spec(self, view: Optional[str]) -> RankView:
        """The registered view called ``view`` (None: the grid itself, ``"base"``)."""
        if view is None:
            return self._views[BASE_VIEW]
        if not isinstance(view, str):
            raise TypeError(f"view must be a view name (str) or None, got {type(view).__name__} {view!r}")
        if view not in self._views:
            raise KeyError(f"View {view!r} is not registered. Registered views: {sorted(self._views)}")
        return self._views[view]

    def _layout_of(self, view: Optional[str], dims: Optional[Dims] = None) -> GridLayout:
        """The layout of ``view``, after checking that ``dims`` (if given) are among its dims."""
        spec = self._view_spec(view)
        if dims is not None:
            requested = [dims] if isinstance(dims, str) else list(dims) if isinstance(dims, (list, tuple)) else []
            missing = [d for d in requested if isinstance(d, str) and d not in spec.dim_names]
            if missing:
                # Megatron-Core's wording; other views are named because the dim may be theirs.
                elsewhere = sorted(name for name, v in self._views.items() if missing[0] in v.dim_names)
                raise ValueError(
                    f"{missing[0]!r} is not in view {spec.name!r} with dim_names {spec.dim_names}"
                    + (f"; it is a dim of view(s) {elsewhere}: pass view=" if elsewhere else "")
                )
        return spec.layout

    def _resolve(self, dims: Dims, view: Optional[str]) -> tuple[GridLayout, GroupKey, str]:
        """(layout, key in ``_pgs``, label) of a request, following shared dims to the grid.

        Keys are Megatron-Core 0.17+'s: the grid's ``"dp-tp"`` for the grid's groups and for
        requests made only of a view's shared dims, ``(view, ordered dims)`` for the others.
        """
        layout = self._layout_of(view, dims)
        ordered, key = layout.order_dims(dims)
        if view is None or view == BASE_VIEW:
            return layout, key, key
        if all(name in self._views[view].shared_dims for name in ordered):
            base_key = self._layout.key(ordered)
            return self._layout, base_key, base_key
        return layout, (view, tuple(ordered)), f"{view}:{key}"
