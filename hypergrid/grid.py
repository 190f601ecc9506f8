"""HyperCommGrid: Megatron-Core's N-dimensional communication grid, built on hypergrid's registry.

The constructor, attributes, group keys, enumerations and errors are those of
``megatron.core.hyper_comm_grid.HyperCommGrid``; what differs is how groups are made (each rank
creates only its own, once, shared across grids) and what else a grid can answer (``ranks``,
``coords``, views).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch.distributed as dist

from .agreement import Agreement, GridFacts, Position, RequestFacts, ViewFacts
from .errors import GridDestroyedError, GridTooLargeError
from .groups import REGISTRY, GroupOptions, GroupRequest
from .strategy import creation_mode, resolve_strategy
from .layout import Dims, GridLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["HyperCommGrid", "resolve_world_size"]

logger = logging.getLogger("hypergrid.grid")

# Distinguishes grids in the registry's holder table; a counter, not id(), because ids are reused.
_grid_ids = itertools.count()

# How many grids of each family (dim names) issued requests in this process. Every rank builds
# and uses its grids in the same order, so the count names a grid's creation rounds alike on all
# of them, and a rank still busy with an earlier grid is recognised as late, not diverged.
_generations: dict[str, int] = {}
_generations_lock = threading.Lock()


def _next_generation(family: str) -> int:
    with _generations_lock:
        value = _generations.get(family, 0)
        _generations[family] = value + 1
        return value

_CREATE_KWARGS = ("timeout", "pg_options", "group_desc", "backend")


def resolve_world_size(world_size: Optional[int] = None) -> int:
    """The world size a grid must fit in.

    From torch.distributed when it is initialized (``world_size``, if given, must agree);
    otherwise ``world_size`` if given; otherwise the ``WORLD_SIZE`` environment variable.

    Example::

        >>> resolve_world_size(world_size=64)   # no process group: plan for 64 ranks
        64
    """
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
        if world_size <= 0:
            raise ValueError(f"world_size must be positive, got {world_size}")
    if dist.is_initialized():
        actual = dist.get_world_size()
        if world_size is not None and world_size != actual:
            raise ValueError(
                f"world_size={world_size} was given but torch.distributed's world has {actual} ranks"
            )
        return actual
    if world_size is not None:
        return world_size
    env = os.environ.get("WORLD_SIZE")
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"WORLD_SIZE environment variable must be an integer, got {env!r}") from None
        if value <= 0:
            raise ValueError(f"WORLD_SIZE environment variable must be positive, got {value}")
        return value
    raise RuntimeError(
        "Cannot determine world size: torch.distributed is not initialized, no world_size= was "
        "given and the WORLD_SIZE environment variable is not set. Initialize torch.distributed, "
        "set WORLD_SIZE, or pass world_size= to plan without a process group."
    )


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
        >>> # in a job (torch.distributed initialized):
        >>> # dp = grid.create_pg("dp"); dp_cp = grid.create_pg(["cp", "dp"], group_desc="DP_CP")
        >>> # grid.get_pg(["dp", "cp"]) is dp_cp

    Args:
        shape: size of each dim.
        dim_names: name of each dim, fastest-varying first (Megatron's ``order``).
        rank_offset: first global rank of the grid, for grids that do not start at rank 0.
        backend: backend of the groups; None uses the default group's backend.
        world_size: the world to fit in when torch.distributed is not initialized (planning).
        strategy: how groups are made (see :mod:`hypergrid.strategy`): ``"auto"`` (the
            default unless :func:`~hypergrid.strategy.set_default_strategy` or
            ``HYPERGRID_STRATEGY`` say otherwise: ``"split"`` on a device-bound NCCL default
            group, else ``"local"``), ``"local"`` (each rank creates only its own groups),
            ``"split"`` (every rank joins one ``split_group`` per request) or ``"enumerate"``
            (Megatron-Core's call pattern, all ranks create all groups).
        timeout: default timeout of the grid's groups (a ``create_pg`` timeout overrides it).
        check_agreement: check before each group is created that its members requested the
            same grid and group (see :mod:`hypergrid.agreement`); on by default.

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
    ) -> None:
        layout = GridLayout(shape, dim_names, rank_offset)  # type: ignore[arg-type]
        resolved_strategy = resolve_strategy(strategy)
        if not isinstance(check_agreement, bool):
            raise TypeError(f"check_agreement must be a bool, got {check_agreement!r}")
        self._defaults = GroupOptions(backend=backend, timeout=timeout)
        world = resolve_world_size(world_size)
        if layout.size > world - layout.rank_offset:
            raise GridTooLargeError(
                f"Grid shape {list(layout.shape)} is over sized: it needs {layout.size} ranks from "
                f"rank_offset {layout.rank_offset}, but the world size is {world}"
            )
        self._layout = layout
        self._world_size = world
        self._strategy = resolved_strategy
        self._check_agreement = check_agreement
        self._id = next(_grid_ids)
        self._destroyed = False
        self._views: dict[str, tuple[GridLayout, frozenset[str]]] = {}
        # Megatron-compatible attributes; lists, as Megatron-Core keeps them.
        self.shape: list[int] = list(layout.shape)
        self.dim_names: list[str] = list(layout.dim_names)
        self.rank_offset: int = layout.rank_offset
        self.backend: Optional[str] = backend
        self.size: int = layout.size
        self._pgs: dict[str, Optional[dist.ProcessGroup]] = {}
        self._requests = 0  # requests that reached the registry: a position all ranks share
        self._generation: Optional[int] = None  # assigned at the first request (see _next_generation)
        self._view_pgs: dict[str, dict[str, Optional[dist.ProcessGroup]]] = {}

    # ------------------------------------------------------------------ facts
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
        """How this grid creates groups: ``"auto"``, ``"local"``, ``"split"`` or ``"enumerate"``."""
        return self._strategy.value

    @property
    def check_agreement(self) -> bool:
        """Whether group creation first checks that the members agree on the request."""
        return self._check_agreement

    @property
    def views(self) -> dict[str, GridLayout]:
        """The registered views, by name."""
        return {name: layout for name, (layout, _) in self._views.items()}

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

        Example::

            >>> # grid = HyperCommGrid([2, 4], ["tp", "dp"])        # in an 8-rank job
            >>> # dp = grid.create_pg("dp", group_desc="DATA_PARALLEL")
            >>> # grid.create_pg("dp")                             # KeyError: already created

        Raises:
            KeyError: a group with this key was already created (Megatron-Core's behaviour;
                use :meth:`get_pg` or :meth:`get_or_create_pg`).
            ValueError / TypeError: unknown or repeated dims, unknown keyword arguments.
        """
        self._check_alive()
        unknown = sorted(set(kwargs) - set(_CREATE_KWARGS))
        if unknown:
            raise TypeError(
                f"create_pg() got unexpected keyword argument(s) {unknown}; it accepts "
                f"{list(_CREATE_KWARGS)} plus view= and private="
            )
        if not isinstance(private, bool):
            raise TypeError(f"private must be a bool, got {private!r}")
        layout, table, key, label = self._resolve(dims, view)
        if key in table:
            raise KeyError(
                f"Process group {dims} has already been created under key {key!r}. Because there is "
                f"no way to check whether options to create process group matches the first, we "
                f"error out instead of returning the process group that has already been created "
                f"before; use get_pg({dims!r}) or get_or_create_pg()."
            )
        options = GroupOptions(
            backend=kwargs.get("backend", self.backend),
            timeout=kwargs.get("timeout", self._defaults.timeout),
            pg_options=kwargs.get("pg_options"),
            group_desc=kwargs.get("group_desc"),
        )
        request = GroupRequest.from_layout(layout, dims, self._current_rank(), label)
        pg = self._acquire(self._id, request, view, options, private)
        table[key] = pg
        logger.debug("grid %d created %s: this rank's group is %s", self._id, label, pg)
        return pg

    def get_pg(self, dims: Dims, *, view: Optional[str] = None) -> Optional[dist.ProcessGroup]:
        r"""The group over ``dims`` created earlier by :meth:`create_pg` (any order of ``dims``).

        Example::

            >>> # grid.create_pg(["cp", "dp"]); grid.get_pg(["dp", "cp"])   # the same group

        Raises:
            KeyError: no group with this key was created; call create_pg first.
        """
        self._check_alive()
        _, table, key, label = self._resolve(dims, view)
        if key not in table:
            raise KeyError(f"Process group for {label} hasn't been created. Call create_pg first.")
        return table[key]

    def get_or_create_pg(self, dims: Dims, *, view: Optional[str] = None, **kwargs: Any) -> Optional[dist.ProcessGroup]:
        """:meth:`get_pg` if the group exists, else :meth:`create_pg` with ``kwargs``.

        Example::

            >>> # tp = grid.get_or_create_pg("tp")   # safe to call from several places
        """
        self._check_alive()
        _, table, key, _ = self._resolve(dims, view)
        if key in table:
            return table[key]
        return self.create_pg(dims, view=view, **kwargs)

    def create_derived_pg(
        self,
        label: str,
        members: Optional[Sequence[int]],
        *,
        groups: Optional[Callable[[], list[list[int]]]] = None,
        owner: Any = None,
        private: bool = False,
        **kwargs: Any,
    ) -> Optional[dist.ProcessGroup]:
        """A group the grid's dims do not name, made through the same door as :meth:`create_pg`.

        For groups derived from the grid by a rule of their own (Megatron's embedding group from
        the pipeline group, a distributed-optimizer instance, ...): ``members`` is this rank's
        group (None: it is in none), ``groups`` every group of the request (needed only by the
        ``enumerate`` strategy). The request takes the grid's next position, so its members
        check they agree exactly as for :meth:`create_pg`, and it follows the grid's strategy:
        under ``split`` every rank of the world must call this, members or not. The group is
        not stored under a key; ``owner`` (default: the grid) holds it until released.

        Example::

            >>> # grid = HyperCommGrid([1, 2, 4], ["tp", "dp", "pp"])               # in a job
            >>> # pp = grid.ranks("pp"); embd = grid.create_derived_pg("embd", [pp[0], pp[-1]] if ...)
        """
        self._check_alive()
        unknown = sorted(set(kwargs) - set(_CREATE_KWARGS))
        if unknown:
            raise TypeError(f"create_derived_pg() got unexpected keyword argument(s) {unknown}; it accepts {list(_CREATE_KWARGS)}")
        if not isinstance(label, str) or not label:
            raise TypeError(f"label must be a non-empty str, got {label!r}")
        mine = None if members is None else tuple(members)
        request = GroupRequest(label, mine, ("derived", label), groups)
        options = GroupOptions(
            backend=kwargs.get("backend", self.backend),
            timeout=kwargs.get("timeout", self._defaults.timeout),
            pg_options=kwargs.get("pg_options"),
            group_desc=kwargs.get("group_desc"),
        )
        return self._acquire(self._id if owner is None else owner, request, None, options, private)

    def get_rank_enum(self, dims: Dims, *, view: Optional[str] = None) -> list[list[int]]:
        r"""Every group over ``dims``: the enumeration create_pg uses, equal to Megatron-Core's.

        Example::

            >>> HyperCommGrid([2, 2, 2], ["a", "b", "c"], world_size=8).get_rank_enum(["b", "a"])
            [[0, 1, 2, 3], [4, 5, 6, 7]]
        """
        return self._layout_of(view).enumerate(dims)

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

    # ------------------------------------------------------------------ beyond Megatron
    def ranks(self, dims: Dims, rank: Optional[int] = None, *, view: Optional[str] = None) -> list[int]:
        """The members of the ``dims`` group that holds ``rank`` (default: this rank).

        O(group size): no other group is enumerated.

        Example::

            >>> HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"], world_size=24).ranks("dp", rank=7)
            [1, 7, 13, 19]
        """
        return self._layout_of(view).group_ranks(dims, self._current_rank() if rank is None else rank)

    def coords(self, rank: Optional[int] = None, *, view: Optional[str] = None) -> dict[str, int]:
        """Coordinates of ``rank`` (default: this rank), by dim name in ``dim_names`` order.

        Example::

            >>> HyperCommGrid([2, 3, 4], ["tp", "cp", "dp"], world_size=24).coords(7)
            {'tp': 1, 'cp': 0, 'dp': 1}
        """
        layout = self._layout_of(view)
        values = layout.coords(self._current_rank() if rank is None else rank)
        return dict(zip(layout.dim_names, values))

    def is_current_rank_in_grid(self) -> bool:
        """Whether this process's global rank lies in ``[rank_offset, rank_offset + size)``."""
        return self._layout.contains(self._current_rank())

    def register_view(
        self,
        name: str,
        shape: Sequence[int],
        dim_names: Sequence[str],
        shared_dims: Optional[Sequence[str]] = None,
    ) -> GridLayout:
        """Register another factorization of the grid's ranks, for ``create_pg(..., view=name)``.

        A view spans the same ranks as the grid with other dims, e.g. the expert layout of an MoE
        model beside the dense one. Groups whose members coincide are one communicator whatever
        grid or view asked for them. ``shared_dims`` names dims the view has in common with the
        grid (same size and stride, checked); a request made only of shared dims uses the grid's
        own key, so ``get_pg("pp", view="expert")`` finds the grid's ``pp`` group.

        Example::

            >>> grid = HyperCommGrid([2, 2, 4], ["tp", "cp", "dp"], world_size=16)
            >>> grid.register_view("expert", [4, 4], ["ep", "dp"], shared_dims=["dp"])
            GridLayout(shape=(4, 4), dim_names=('ep', 'dp'), rank_offset=0)
            >>> grid.get_rank_enum("ep", view="expert")[0]
            [0, 1, 2, 3]
        """
        self._check_alive()
        if not isinstance(name, str):
            raise TypeError(f"view name must be a str, got {type(name).__name__} {name!r}")
        if not name:
            raise ValueError(f"view name must be a non-empty str, got {name!r}")
        if name in self._views:
            raise KeyError(f"view {name!r} is already registered on this grid")
        if shared_dims is not None and not isinstance(shared_dims, (str, list, tuple)):
            raise TypeError(
                f"shared_dims must be a dim name, a list of dim names or None, got "
                f"{type(shared_dims).__name__} {shared_dims!r}"
            )
        shared = [] if shared_dims is None else ([shared_dims] if isinstance(shared_dims, str) else list(shared_dims))
        layout = GridLayout(shape, dim_names, self.rank_offset)  # type: ignore[arg-type]
        self._layout.check_view(layout, shared)
        self._views[name] = (layout, frozenset(shared))
        self._view_pgs[name] = {}
        return layout

    def destroy(self) -> None:
        """Release every group this grid holds; groups still held elsewhere stay alive.

        Idempotent. Afterwards creating or getting a group raises
        :class:`~hypergrid.errors.GridDestroyedError`; enumerations still work.

        Example::

            >>> # grid.destroy(); grid.destroy()   # the second call does nothing
        """
        if self._destroyed:
            return
        self._destroyed = True
        REGISTRY.release(self._id)
        self._pgs.clear()
        self._view_pgs.clear()

    def device_mesh(
        self,
        dims: Optional[Dims] = None,
        *,
        view: Optional[str] = None,
        device_type: Optional[str] = None,
        flatten: Any = None,
    ) -> "DeviceMesh":
        """A torch DeviceMesh over this grid's own groups (see :func:`hypergrid.mesh.device_mesh`).

        Mesh dims are the reversed ``dim_names`` (slowest first); multi-dim groups of the grid
        are its flattened dims (``mesh["dp_cp"]``). No process group is created beyond the
        grid's own.

        Example::

            >>> # mesh = grid.device_mesh(device_type="cuda")   # grid dims ["tp", "cp", "dp"]
            >>> # mesh.mesh_dim_names  -> ('dp', 'cp', 'tp'); mesh.get_group("tp") is grid.get_pg("tp")
        """
        from .mesh import device_mesh  # the mesh layer sits above the grid: imported on use

        return device_mesh(self, dims, view=view, device_type=device_type, flatten=flatten)

    @classmethod
    def from_device_mesh(cls, mesh: "DeviceMesh", *, backend: Optional[str] = None) -> "HyperCommGrid":
        """A grid adopting an existing DeviceMesh's groups (see :func:`hypergrid.mesh.grid_from_device_mesh`).

        Example::

            >>> # grid = HyperCommGrid.from_device_mesh(init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")))
            >>> # grid.dim_names -> ['tp', 'dp']; grid.get_pg("tp") is the mesh's tp group
        """
        from .mesh import grid_from_device_mesh

        return grid_from_device_mesh(mesh, backend=backend, grid_type=cls)

    @classmethod
    def from_process_groups(
        cls, groups: Sequence[dist.ProcessGroup], mesh_dim_names: Sequence[str], *, backend: Optional[str] = None
    ) -> "HyperCommGrid":
        """A grid adopting existing groups, slowest dim first (see :func:`hypergrid.mesh.grid_from_process_groups`).

        Example::

            >>> # grid = HyperCommGrid.from_process_groups([dp_pg, tp_pg], ["dp", "tp"])
            >>> # grid.get_pg("dp") is dp_pg
        """
        from .mesh import grid_from_process_groups

        return grid_from_process_groups(groups, mesh_dim_names, backend=backend, grid_type=cls)

    # ------------------------------------------------------------------ helpers
    def _acquire(
        self, owner: Any, request: GroupRequest, view: Optional[str], options: GroupOptions, private: bool
    ) -> Optional[dist.ProcessGroup]:
        """Stamp ``request`` with the grid's next position and hand it to the registry."""
        if self._generation is None:
            self._generation = _next_generation(self._facts().family)
        index = self._requests
        self._requests += 1
        if self._check_agreement:
            request = request.with_agreement(self._agreement(request.label, view, index, options, private))
        return REGISTRY.acquire_request(owner, request, strategy=self._strategy, options=options, private=private)

    def _facts(self) -> GridFacts:
        views = tuple(
            ViewFacts(name, tuple(layout.shape), tuple(layout.dim_names), tuple(sorted(shared)))
            for name, (layout, shared) in sorted(self._views.items())
        )
        return GridFacts.of(self.shape, self.dim_names, self.rank_offset, views)

    def _agreement(self, label: str, view: Optional[str], index: int, options: GroupOptions, private: bool) -> Agreement:
        """What every member of a group must have asked for alike (see hypergrid.agreement)."""
        facts = self._facts()
        assert self._generation is not None
        return Agreement(
            position=Position(facts.family, self._generation, index),
            grid=facts,
            request=RequestFacts(
                label=label,
                view=view,
                private=private,
                backend=options.backend,
                timeout_s=None if options.timeout is None else options.timeout.total_seconds(),
                pg_options=None if options.pg_options is None else type(options.pg_options).__name__,
                mode=creation_mode(self._strategy, options.backend).value,
            ),
        )

    def _check_alive(self) -> None:
        if self._destroyed:
            raise GridDestroyedError(f"{self!r} was destroyed; build a new grid to create or get groups")

    def _layout_of(self, view: Optional[str]) -> GridLayout:
        if view is None:
            return self._layout
        if not isinstance(view, str):
            raise TypeError(f"view must be a view name (str) or None, got {type(view).__name__} {view!r}")
        if view not in self._views:
            raise KeyError(f"unknown view {view!r}; registered views: {sorted(self._views)}")
        return self._views[view][0]

    def _resolve(self, dims: Dims, view: Optional[str]):
        """(layout, key table, key, label) for a request, following shared dims to the grid."""
        layout = self._layout_of(view)
        ordered, key = layout.order_dims(dims)
        if view is None:
            return layout, self._pgs, key, key
        shared = self._views[view][1]
        if all(name in shared for name in ordered):
            return self._layout, self._pgs, self._layout.key(ordered), self._layout.key(ordered)
        return layout, self._view_pgs[view], key, f"{view}:{key}"

    @staticmethod
    def _current_rank() -> int:
        if dist.is_initialized():
            return dist.get_rank()
        env = os.environ.get("RANK")
        if env is not None and env.lstrip("-").isdigit():
            return int(env)
        raise RuntimeError(
            "this rank is unknown: torch.distributed is not initialized and RANK is not set; "
            "pass rank= explicitly"
        )
