"""Views: other factorizations of a grid's ranks, checked as Megatron-Core 0.17+ checks them.

A view spans the same ranks as its grid with other dims (the expert layout of an MoE model
beside the dense one). :meth:`RankView.register` accepts and rejects what Megatron-Core's
``HyperCommGrid.register_view`` does, in its order and with its exception types; a shared dim is
checked once, by :meth:`~hypergrid.layout.GridLayout.check_view`.

Example::

    >>> from hypergrid.layout import GridLayout
    >>> grid = GridLayout((2, 2, 4), ("tp", "cp", "dp"))
    >>> view = RankView.register("expert", [4, 4], ["ep", "dp"], ["dp"], grid, taken=["base"])
    >>> view.shape, view.shared_dims, view.layout.strides
    ([4, 4], ['dp'], (1, 4))
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from ..errors import ShapeTypeError
from .checks import as_int
from .grid_layout import GridLayout

__all__ = ["BASE_VIEW", "RankView"]

#: The name of the grid's own factorization among its views, as in Megatron-Core 0.17+.
BASE_VIEW = "base"


@dataclass(frozen=True)
class RankView:
    """One factorization of a grid's ranks: what ``grid._views[name]`` holds.

    Its layout is the one state; the fields Megatron-Core 0.17+'s ``_RankViewSpec`` has
    (``name``, ``shape``, ``dim_names``, ``shared_dims``) are read from it, as lists.

    Example::

        >>> RankView("base", GridLayout((2, 4), ("tp", "dp"))).dim_names
        ['tp', 'dp']
    """

    name: str
    layout: GridLayout
    shared: tuple[str, ...] = ()

    @property
    def shape(self) -> list[int]:
        return list(self.layout.shape)

    @property
    def dim_names(self) -> list[str]:
        return list(self.layout.dim_names)

    @property
    def shared_dims(self) -> list[str]:
        return list(self.shared)

    @classmethod
    def register(
        cls,
        name: str,
        shape: Sequence[int],
        dim_names: Sequence[str],
        shared_dims: Optional[Union[str, Sequence[str]]],
        base: GridLayout,
        taken: Collection[str],
    ) -> RankView:
        """The view ``name`` of the grid ``base``, after Megatron-Core's checks in its order.

        ``taken``: the names already registered (the grid's own ``"base"`` included).

        Example::

            >>> grid = GridLayout((2, 4), ("tp", "dp"))
            >>> RankView.register("v", [4, 2], ["ep", "pp"], None, grid, taken=["base"]).layout
            GridLayout(shape=(4, 2), dim_names=('ep', 'pp'), rank_offset=0)
            >>> RankView.register("v", [3, 2], ["ep", "pp"], None, grid, taken=["base"])
            Traceback (most recent call last):
            ...
            ValueError: View 'v' shape [3, 2] has size 6, but the grid size is 8
        """
        if not isinstance(name, str):
            raise TypeError(f"view name must be a str, got {type(name).__name__} {name!r}")
        if not name:
            raise ValueError(f"view name must be a non-empty str, got {name!r}")
        if name in taken:
            raise ValueError(f"View {name!r} is already registered (registered views: {sorted(taken)})")
        sizes = _view_sizes(name, shape, dim_names)
        if math.prod(sizes) != base.size:
            raise ValueError(f"View {name!r} shape {list(shape)} has size {math.prod(sizes)}, but the grid size is {base.size}")
        shared = _shared_dims(name, shared_dims)
        view = GridLayout(tuple(sizes), tuple(dim_names), base.rank_offset, base.rank_map)
        base.check_view(view, shared, name=name)
        return cls(name, view, tuple(shared))


def _view_sizes(name: str, shape: Sequence[int], dim_names: Sequence[str]) -> list[int]:
    """The sizes of ``shape``, after Megatron-Core's checks of a view's shape and names, in its order."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"View {name!r} shape must be a list of ints, got {type(shape).__name__} {shape!r}")
    if isinstance(dim_names, (str, bytes)) or not isinstance(dim_names, Sequence):
        raise TypeError(f"View {name!r} dim_names must be a list of str, got {type(dim_names).__name__} {dim_names!r}")
    if len(shape) != len(dim_names):
        raise ValueError(f"len(shape) {list(shape)} != len(dim_names) {list(dim_names)} in view {name!r}")
    repeated = sorted({d for d in dim_names if isinstance(d, str) and list(dim_names).count(d) > 1})
    if repeated:
        raise ValueError(f"View {name!r} has duplicate dim_names: {list(dim_names)} repeats {repeated}")
    sizes = []
    for size in shape:
        try:
            value = as_int(size, "a view size")
        except TypeError:
            raise ShapeTypeError(
                f"View {name!r} shape must be positive ints, got {list(shape)}: {type(size).__name__} {size!r} is not an int"
            ) from None
        if value <= 0:
            raise ValueError(f"View {name!r} shape must be positive ints, got {list(shape)}")
        sizes.append(value)
    return sizes


def _shared_dims(name: str, shared_dims: Optional[Union[str, Sequence[str]]]) -> list[str]:
    """``shared_dims`` as a list of names (one name or None allowed, as Megatron-Core allows)."""
    if shared_dims is not None and not isinstance(shared_dims, (str, list, tuple)):
        raise TypeError(
            f"shared_dims must be a dim name, a list of dim names or None, got {type(shared_dims).__name__} {shared_dims!r}"
        )
    shared = [] if shared_dims is None else ([shared_dims] if isinstance(shared_dims, str) else list(shared_dims))
    for dim in shared:
        if not isinstance(dim, str):
            raise TypeError(f"a shared dim of view {name!r} must be a str, got {type(dim).__name__} {dim!r}")
    if len(set(shared)) != len(shared):
        raise ValueError(f"View {name!r} has duplicate shared_dims: {shared}")
    return shared
