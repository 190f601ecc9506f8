"""Waiting for descriptors to become readable, whatever their numbers.

``select.select`` refuses a descriptor numbered 1,024 or above (``ValueError: filedescriptor out
of range``), and a training process has that many open easily (NCCL's sockets, a data loader's
pipes, thousands of simulated ranks in one process): the waits of a rank's own side of the control
plane use ``poll`` instead, which has no such limit.

Example::

    >>> import os
    >>> r, w = os.pipe()
    >>> readable([r], 0.0)
    set()
    >>> _ = os.write(w, b"x"); readable([r], 1.0) == {r}
    True
    >>> os.close(r); os.close(w)
"""

from __future__ import annotations

import select
from collections.abc import Iterable

__all__ = ["readable"]

_READ = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def readable(fds: Iterable[int], timeout_s: float) -> set[int]:
    """Those of ``fds`` that can be read (data, end-of-file or an error) within ``timeout_s``
    seconds (0: look without waiting); empty if none by then."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, _READ)
    return {fd for fd, _ in poller.poll(max(0.0, timeout_s) * 1000.0)}
