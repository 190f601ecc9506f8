"""The value types of the command line's flags: what argparse calls to read each value.

Each raises :class:`argparse.ArgumentTypeError` with what it expected and what it got, which
argparse prefixes with the flag (``argument --fail: expected ...``). Pure: no torch.

Example::

    >>> rank_list("12344-12351")
    [12344, 12345, 12346, 12347, 12348, 12349, 12350, 12351]
    >>> rank_list("0-2,8")
    [0, 1, 2, 8]
    >>> world_size(str(1 << 70))
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: world size 1180591620717411303424 is too large: plans answer for worlds up to 9223372036854775807 ranks (int64)
"""

from __future__ import annotations

import argparse
import difflib
import re

__all__ = ["MAX_WORLD", "MAX_RANKS_LISTED", "int_list", "name_list", "order", "positive", "world_size",
           "non_negative", "count", "rank_list", "unrecognized",
           "torchtitan_flags"]

#: The largest world a plan answers for: what a rank number in an int64 can reach.
MAX_WORLD = (1 << 63) - 1
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+))?\s*$")  # a rank, or a range of ranks

#: The most ranks a rank list (``--fail``, ``--spare-ranks``) may hold, ranges included.
MAX_RANKS_LISTED = 1 << 22


def _empty_entry(text: str) -> str:
    # Every entry counts: "2,,2" is a typo to point at, not the grid 2,2.
    empty = [i for i, v in enumerate(text.split(","), 1) if not v.strip()]
    return f" (entry {empty[0]} is empty)" if empty else ""


def int_list(text: str) -> list[int]:
    """Comma-separated integers, e.g. ``2,3,4``."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,3,4, got {text!r}"
                                         f"{_empty_entry(text)}") from None


def name_list(text: str) -> list[str]:
    """Comma-separated names, e.g. ``tp,cp,dp``; none empty."""
    values = [v.strip() for v in text.split(",")]
    if not all(values):
        raise argparse.ArgumentTypeError(f"expected comma-separated dim names like tp,cp,dp, got {text!r}"
                                         f"{_empty_entry(text)}")
    return values


def order(text: str) -> str:
    """A Megatron order such as ``tp-cp-ep-dp-pp``, not empty."""
    if not text.strip():  # an empty order would silently plan the default one
        raise argparse.ArgumentTypeError(f"expected a Megatron order like tp-cp-ep-dp-pp, got {text!r}")
    return text


def positive(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def world_size(text: str) -> int:
    """A number of ranks a plan answers for: 1 to :data:`MAX_WORLD`."""
    value = positive(text)
    if value > MAX_WORLD:
        raise argparse.ArgumentTypeError(f"world size {value} is too large: plans answer for worlds up to "
                                         f"{MAX_WORLD} ranks (int64)")
    return value


def _non_negative_parser(what: str):
    """A type for argparse: an integer >= 0, called ``what`` in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} (integer >= 0), got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected {what} (integer >= 0), got {value}")
        return value

    return parse


non_negative = _non_negative_parser("a rank")
count = _non_negative_parser("a number of ranks")


def rank_list(text: str) -> list[int]:
    """Comma-separated ranks and ranges of ranks, as the tool prints them: ``4,5,6,7``,
    ``12344-12351``, ``0-3,8``; a range includes both ends."""
    ranks: list[int] = []
    for entry in text.split(","):
        match = _RANGE.match(entry)
        if match is None:
            negative = re.match(r"^\s*(-\s*\d+)", entry)
            if negative:
                raise argparse.ArgumentTypeError(f"expected ranks (integers >= 0), got {negative.group(1)} in {text!r}")
            raise argparse.ArgumentTypeError(f"expected comma-separated ranks or ranges like 4,5,6,7 or 12344-12351, "
                                             f"got {text!r}{_empty_entry(text)}")
        low = int(match.group(1))
        high = low if match.group(2) is None else int(match.group(2))
        if high < low:
            raise argparse.ArgumentTypeError(f"expected a range from a lower rank to a higher one, got {entry.strip()!r} "
                                             f"in {text!r}; write {high}-{low}")
        if len(ranks) + high - low + 1 > MAX_RANKS_LISTED:
            raise argparse.ArgumentTypeError(f"expected at most {MAX_RANKS_LISTED} ranks, got {text!r}")
        ranks += range(low, high + 1)
    return ranks


def unrecognized(unknown: list[str], options: list[str], where: str) -> str:
    """The message for arguments ``where`` (``hypergrid plan``) does not take: the closest of its
    ``options`` to a misspelt flag, or where a flag of Megatron-LM or torchtitan goes instead.

    Example::

        >>> unrecognized(["--world-szie", "2048"], ["--world-size", "--tp", "--rank"], "hypergrid plan")
        'unrecognized arguments: --world-szie 2048; did you mean --world-size? (see: hypergrid plan --help)'
    """
    from ..planning.megatron_flags import MEGATRON_LM_FLAGS

    hints = []
    for token in unknown:
        name = token.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        if name[2:] in MEGATRON_LM_FLAGS and "--megatron-args" in options:
            hints.append(f"{name} is a Megatron-LM flag: give the launch line's flags as --megatron-args \"{name} ...\"")
        elif name in ("--module", "--config", "--job.config_file", "--job.config-file") and "--torchtitan" in options:
            hints.append(f"{name} is torchtitan's: give its job's [parallelism] as --torchtitan FILE (a TOML "
                         f"file) and --parallelism.NAME VALUE flags")
        else:
            close = difflib.get_close_matches(name, [o for o in options if o.startswith("--")], n=1, cutoff=0.7)
            if close:
                hints.append(f"did you mean {close[0]}?")
    hint = "".join(f"; {h}" for h in dict.fromkeys(hints))
    return f"unrecognized arguments: {' '.join(unknown)}{hint} (see: {where} --help)"


def torchtitan_flags(unknown: list[str]) -> tuple[list[str], list[str]]:
    """torchtitan's ``--parallelism.NAME [VALUE...]`` flags among the arguments argparse did not
    take, and the rest.

    Example::

        >>> torchtitan_flags(["--parallelism.tensor_parallel_degree", "8", "--oops"])
        (['--parallelism.tensor_parallel_degree', '8'], ['--oops'])
    """
    titan: list[str] = []
    rest: list[str] = []
    taking = False
    for token in unknown:
        if token.startswith("--"):
            taking = token.startswith("--parallelism.")
        (titan if taking else rest).append(token)
    return titan, rest
