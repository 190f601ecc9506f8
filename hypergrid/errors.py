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
    "RecoveryRefused",
    "RecoveryRankError",
    "RecoveryError",
    "ExcludedByRecovery",
    "SnapshotCorrupted",
    "ParallelConfigError",
    "ParallelStateError",
    "UnknownOrderNameError",
    "MegatronArgsError",
    "UnknownMegatronFlagError",
    "LayoutArgumentError",
    "UsageError",
    "OutputError",
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



# ---------------------------------------------------------------------- recovery
class RecoveryRefused(ValueError):
    """No recovery fits the failure: too few spares and no replica that can be dropped. The message
    says which ranks failed and why neither replacement nor a shrink works."""


class RecoveryRankError(ValueError, TypeError):
    """A failed rank or a spare that is not a rank: negative, or not an integer (a bool, a float, a
    string). A ``ValueError`` naming the value (a bad value for a recovery), and a ``TypeError`` for
    the wrong types, as hypergrid's conventions have it."""


class RecoveryError(HypergridError):
    """An in-process recovery did not complete (another rank failed during it, the survivors did
    not all arrive in time, or a refused plan): the same error on every survivor that took part."""


class SnapshotCorrupted(RecoveryError):
    """A snapshot (a rank's own, or a copy a partner held) whose bytes no longer match the digest
    taken with it: refused before anything is restored from it. ``rank``: whose state it is;
    ``step``: its step; ``key``: the first state-dict path that differs.

    Example::

        >>> error = SnapshotCorrupted("the copy of rank 2's step 3 differs at model/w", rank=2, step=3, key="model/w")
        >>> isinstance(error, RecoveryError), error.rank, error.step, error.key
        (True, 2, 3, 'model/w')
    """

    def __init__(self, message: str, *, rank: Optional[int], step: int, key: str) -> None:
        super().__init__(message)
        self.rank, self.step, self.key = rank, step, key

    def __reduce__(self) -> tuple[object, ...]:  # keeps its fields when pickled to another process
        return _rebuild_corrupted, (str(self), self.rank, self.step, self.key)


def _rebuild_corrupted(message: str, rank: Optional[int], step: int, key: str) -> SnapshotCorrupted:
    return SnapshotCorrupted(message, rank=rank, step=step, key=key)


class ExcludedByRecovery(HypergridError):
    """This rank is not in the grid after a recovery: the survivors found it failed (it did not
    report in time), or its replica was dropped. It should leave the job, or wait as a spare."""


# ---------------------------------------------------------------------- Megatron-Core's configuration
class ParallelConfigError(ValueError, RuntimeError, AssertionError):
    """A Megatron parallel configuration that cannot be built; the message names the sizes.

    A ``ValueError`` (hypergrid's convention for bad values), and also a ``RuntimeError`` and an
    ``AssertionError``, the types Megatron-Core raises for the same mistakes, so ``except``
    clauses written against Megatron-Core keep catching it.
    """


class ParallelStateError(RuntimeError, AssertionError):
    """``parallel_state`` is in the wrong state for the call: already initialized, or not yet.

    A ``RuntimeError`` and an ``AssertionError`` (what Megatron-Core's ``assert`` raises there).
    """


class UnknownOrderNameError(ParallelConfigError, KeyError):
    """``order`` names a parallelism Megatron-Core does not know (it raises ``KeyError`` there)."""

    def __str__(self) -> str:
        # KeyError quotes its message; this one is a sentence.
        return str(self.args[0]) if self.args else ""


# ---------------------------------------------------------------------- planning and the command line
class MegatronArgsError(ValueError):
    """A Megatron-LM launch line that cannot be planned; ``flag`` is the flag at fault (or None).

    Example::

        >>> from hypergrid.planning.megatron_args import parse_megatron_args
        >>> try:
        ...     parse_megatron_args("--context-parallel-size two")
        ... except MegatronArgsError as exc:
        ...     print(exc.flag, "|", exc)
        --context-parallel-size | --context-parallel-size expects an integer, got 'two'
    """

    def __init__(self, message: str, flag: Optional[str] = None) -> None:
        super().__init__(message)
        self.flag = flag


class UnknownMegatronFlagError(MegatronArgsError):
    """A flag Megatron-LM does not have (in :data:`~hypergrid.planning.megatron_flags.MEGATRON_LM_RELEASES`)."""


class LayoutArgumentError(ValueError):
    """A layout given wrongly on the command line: two ways at once, a size or a file missing.
    The command line prints it as one ``hypergrid: error:`` line, exit status 2."""


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class OutputError(Exception):
    """stdout cannot be written (a full disk): printed as one line, exit status 1."""
