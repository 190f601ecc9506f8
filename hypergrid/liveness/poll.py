"""Waiting for descriptors to become readable, whatever their numbers.

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

import select
from collections.abc import Iterable

__all__ = ["readable"]

_READ = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def readable(fds: Iterable[int], timeout_s: float) -> set[int]:
    """Those of ``fds`` readable (data, end-of-file or an error) within ``timeout_s`` seconds (0: no wait)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, _READ)
    return {fd for fd, _ in poller.poll(max(0.0, timeout_s) * 1000.0)}
