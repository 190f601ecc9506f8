"""hypergrid's own exception types.

They subclass the builtin types the project's conventions promise (``ValueError`` for bad values,
``RuntimeError`` for distributed failures), so ``except RuntimeError`` written against
Megatron-Core keeps working.

Example::

    >>> from hypergrid import HyperCommGrid
    >>> try:
    ...     HyperCommGrid([2, 4], ["tp", "dp"], world_size=4)
    ... except RuntimeError as exc:                 # what Megatron-Core raises here
    ...     print(type(exc).__name__, isinstance(exc, ValueError))
    GridTooLargeError True
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "HypergridError",
    "GridTooLargeError",
    "ShapeTypeError",
    "GridDestroyedError",
    "GroupCreationError",
    "GroupTimeoutError",
    "GridMismatchError",
    "UnsupportedTorchError",
    "StoreUnresponsiveError",
]


class HypergridError(RuntimeError):
    """Base of hypergrid's distributed failures.

    ``root_cause``: where one rank's failure made others fail, that rank's own error, in one line
    (None when this error is its own cause).

    Example::

        >>> error = HypergridError("group 'tp' failed on rank 2", root_cause="ValueError: bad shape")
        >>> str(error), error.root_cause
        ("group 'tp' failed on rank 2", 'ValueError: bad shape')
    """

    def __init__(self, *args: object, root_cause: Optional[str] = None) -> None:
        super().__init__(*args)
        self.root_cause = root_cause


class GridTooLargeError(ValueError, RuntimeError):
    """The grid needs more ranks than the world has past ``rank_offset``.

    A bad value (``ValueError``), and also a ``RuntimeError`` because that is what
    Megatron-Core's ``HyperCommGrid`` raises for the same mistake.
    """


class ShapeTypeError(TypeError, ValueError):
    """A size in a shape that is not an integer (``2.5``, ``"4"``, ``True``).

    A wrong type (``TypeError``), and also a ``ValueError`` because that is what
    Megatron-Core's ``register_view`` raises for it ("shape must be positive ints").
    """


class GridDestroyedError(HypergridError):
    """A grid, or a group of one, was used after ``destroy()``."""


class GroupCreationError(HypergridError):
    """torch.distributed failed to create a group; the message names the key and members."""


class GroupTimeoutError(GroupCreationError, TimeoutError):
    """Members of a group did not arrive in time; the message names the ones missing."""


class GridMismatchError(HypergridError):
    """Ranks that must agree on a grid or on a group request do not; the message names them."""


class UnsupportedTorchError(HypergridError):
    """The installed torch lacks an internal hypergrid needs; the message names it and the version."""


class StoreUnresponsiveError(HypergridError):
    """The job's store did not answer a call within the time it was given (its host stopped,
    hangs or is overloaded), as opposed to a store whose host has gone (torch's ``DistNetworkError``)."""
