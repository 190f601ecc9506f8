"""What the command line writes: output on stdout that fails as one line, progress on stderr.

:func:`out` writes and flushes at once, so a stdout that cannot be written (``> /dev/full``, a
full disk) fails where the output is written, as an :class:`OutputError` the command line prints
as one ``hypergrid: error: ...`` line with exit status 1, and never later in a traceback while
the interpreter exits (:func:`drop_stdout` sees to what is still buffered then).

Example::

    >>> out("hello")
    hello
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Optional

from ..errors import OutputError

__all__ = ["out", "drop_stdout", "Progress", "PROGRESS_EVERY_S"]


def out(text: Optional[str] = None, end: str = "\n") -> None:
    """Write ``text`` to stdout (None: only flush it) and flush; OutputError if stdout cannot take it.

    A closed pipe (``hypergrid plan ... | head``) stays a ``BrokenPipeError``: not an error.
    """
    try:
        if text is not None:
            sys.stdout.write(text + end)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot write the output: {exc.strerror or exc}") from None


def drop_stdout() -> None:
    """Point stdout's file descriptor at the null device, after it failed: what is still buffered
    would otherwise fail again when the interpreter flushes it at exit."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


#: Off a terminal, how often a long command says what it is doing.
PROGRESS_EVERY_S = 5.0


class Progress:
    """What a long command is doing, on stderr: rewritten in place on a terminal; elsewhere (a
    log, a pipe) a plain line every few seconds, so that a slow step never looks like a hang."""

    def __init__(self, verb: str) -> None:
        self.verb, self.every_s = verb, PROGRESS_EVERY_S
        self.count, self.last = 0, time.monotonic()
        self.tty = sys.stderr.isatty()

    def __call__(self, what: str) -> None:
        self.count += 1
        if self.tty:
            sys.stderr.write(f"\r\033[K{self.verb} {self.count}: {what}")
            sys.stderr.flush()
        elif time.monotonic() - self.last >= self.every_s:
            print(f"... {self.verb} {self.count}: {what}", file=sys.stderr, flush=True)
            self.last = time.monotonic()

    def done(self) -> None:
        """Clear the line rewritten on a terminal."""
        if self.tty and self.count:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
