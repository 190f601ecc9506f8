"""Waiting for descriptors to become readable, whatever their numbers, and reading lines from them.

``select.select`` refuses descriptors numbered 1,024 or above, which a training process reaches
easily (NCCL's sockets, a data loader's pipes): ``poll`` has no such limit.

Example::

    >>> import os; r, w = os.pipe()
    >>> readable([r], 0.0)
    set()
    >>> _ = os.write(w, b"x"); readable([r], 1.0) == {r}
    True
    >>> os.close(r); os.close(w)
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterable
from typing import Optional

__all__ = ["readable", "read_lines"]

_READ = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def readable(fds: Iterable[int], timeout_s: float) -> set[int]:
    """Those of ``fds`` readable (data, end-of-file or an error) within ``timeout_s`` seconds (0: no wait)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, _READ)
    return {fd for fd, _ in poller.poll(max(0.0, timeout_s) * 1000.0)}


def read_lines(fd: int, pending: bytes) -> tuple[Optional[list[str]], bytes]:
    """Read what ``fd`` has (it is readable): the whole lines of ``pending`` and it, and what is left
    after the last newline. Lines None at end-of-file; none where a non-blocking ``fd`` has nothing.

    Example::

        >>> import os; r, w = os.pipe()
        >>> _ = os.write(w, b"ready\\nevent 1\\nat 3"); read_lines(r, b"")
        (['ready', 'event 1'], b'at 3')
        >>> _ = os.write(w, b" 4\\n"); os.close(w); read_lines(r, b"at 3")
        (['at 3 4'], b'')
        >>> read_lines(r, b""); os.close(r)
        (None, b'')
    """
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return [], pending
    if not chunk:
        return None, pending
    lines, _, rest = (pending + chunk).rpartition(b"\n")
    return (lines.decode().split("\n") if lines else []), rest
