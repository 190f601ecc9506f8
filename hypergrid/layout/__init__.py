"""The pure layer: rank arithmetic of grids and the kinds of groups derived from them.

Nothing in this package imports torch or needs a process group, so a layout can be planned,
checked and drawn anywhere. The names most callers need are importable from here:

Example::

    >>> from hypergrid.layout import GridLayout
    >>> GridLayout((2, 4), ("tp", "dp")).group_ranks(["dp"], rank=3)
    [1, 3, 5, 7]
"""

from __future__ import annotations

from .checks import RESERVED_NAME_CHARACTERS, as_int, validate_shape_and_names
from .grid_layout import KEY_SEPARATOR, Dims, GridLayout
from .partition import MAX_ENUMERATED_RANKS, Partition, canonical_modes

__all__ = [
    "Dims",
    "GridLayout",
    "Partition",
    "KEY_SEPARATOR",
    "MAX_ENUMERATED_RANKS",
    "RESERVED_NAME_CHARACTERS",
    "as_int",
    "canonical_modes",
    "validate_shape_and_names",
]
