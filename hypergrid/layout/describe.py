"""Rank lists and messages written for people: one home for every way hypergrid shortens them.

Two forms: :func:`describe_members` for reports (runs as ranges, ``0-7, 32-39 (16 ranks)``) and
:func:`describe_ranks` for error messages (a Python list, summarised past a limit, so a message
stays readable and can be pasted); :func:`members_fingerprint` is what agreement publishes of a
member list (whole when small, summarised with a digest when large), and :func:`one_line` makes an
error text fit one line.

Example::

    >>> describe_members(range(8)), describe_ranks(range(3)), one_line("a\\n  b")
    ('0-7', '[0, 1, 2]', 'a; b')
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

__all__ = ["member_runs", "describe_members", "describe_ranks", "members_fingerprint", "one_line", "shorten"]


def member_runs(members: Iterable[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ranks, in order, as ``(first, last)``.

    Example::

        >>> member_runs([4, 5, 6, 9, 1])
        [(4, 6), (9, 9), (1, 1)]
    """
    runs: list[tuple[int, int]] = []
    for r in members:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return runs


def describe_members(members: Sequence[int], limit: int = 8) -> str:
    """A group's members for people: runs of consecutive ranks as ranges, long lists cut.

    Cutting keeps whole runs and says what was left out, so that a group that skips ranks never
    reads as if it were contiguous.

    Example::

        >>> describe_members([0, 1, 2, 3])
        '0-3'
        >>> describe_members([1, 5, 9, 13])
        '1, 5, 9, 13'
        >>> describe_members([r for start in range(0, 128, 32) for r in range(start, start + 8)])
        '0-7, 32-39, 64-71, 96-103 (32 ranks)'
        >>> describe_members(list(range(0, 4096, 8)))
        '0, 8, 16, 24, 32, 40, 48, ..., 4088 (512 ranks, step 8)'
    """
    members = list(members)
    if not members:
        return "none"
    runs = member_runs(members)
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(parts) > limit:
        steps = {b - a for a, b in zip(members, members[1:])}
        pattern = f", step {steps.pop()}" if len(steps) == 1 else ""
        parts = parts[: limit - 1] + ["...", parts[-1]]
        return f"{', '.join(parts)} ({len(members)} ranks{pattern})"
    text = ", ".join(parts)
    return text if len(runs) == 1 or len(members) == len(runs) else f"{text} ({len(members)} ranks)"


def describe_ranks(ranks: Iterable[int], limit: int = 16) -> str:
    """A rank list short enough for an error message.

    Example::

        >>> describe_ranks([0, 1, 2])
        '[0, 1, 2]'
        >>> describe_ranks(list(range(100)))
        '100 ranks [0, 1, 2, 3, 4, 5, 6, 7, ..., 99]'
    """
    ranks = list(ranks)
    if len(ranks) <= limit:
        return str(ranks)
    head = ", ".join(str(r) for r in ranks[: limit // 2])
    return f"{len(ranks)} ranks [{head}, ..., {ranks[-1]}]"


def members_fingerprint(members: Iterable[int]) -> str:
    """What members publish about a group's member list: short, whatever the group's size.

    Small groups are shown whole, larger ones summarised, with a digest deciding equality (an
    entry holding the whole list would cost the leader O(group size squared) bytes).

    Example::

        >>> members_fingerprint([3, 1, 2])
        '[1, 2, 3]'
        >>> members_fingerprint(range(1000))  # doctest: +ELLIPSIS
        '1000 ranks [0, 1, 2, 3, 4, 5, 6, 7, ..., 999] sha1:...'
    """
    ordered = sorted(members)
    if len(ordered) <= 16:
        return str(ordered)
    digest = hashlib.sha1(",".join(map(str, ordered)).encode()).hexdigest()[:16]
    return f"{describe_ranks(ordered)} sha1:{digest}"


def shorten(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters, marked with ``...`` where cut.

    Example::

        >>> shorten("x" * 10, limit=6)
        'xxx...'
    """
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(message: str, limit: int = 400) -> str:
    """An error text on one line (its lines joined by ``;``), cut to ``limit`` characters.

    Example::

        >>> one_line("ranks disagree:\\n  grid.shape: ...")
        'ranks disagree: grid.shape: ...'
    """
    text = "; ".join(part.strip() for part in message.splitlines() if part.strip()).replace(":;", ":")
    return shorten(text, limit)
