"""Every thread hypergrid starts is ended before the interpreter tears itself down.

CPython 3.11-3.13 ends a daemon thread that takes the GIL back during finalization by
``pthread_exit``; in a store call that happens in pybind11's ``noexcept`` ``gil_scoped_release``
destructor, so the unwinding calls ``std::terminate`` and the finished job dies with SIGABRT. Each thread is registered as a :class:`Service`, and one
``atexit`` hook, run while the interpreter is whole, stops them all and waits for each, bounded.

Example::

    >>> import threading
    >>> stop = threading.Event()
    >>> thread = threading.Thread(target=stop.wait, daemon=True); thread.start()
    >>> service = register("example", stop.set, thread.join)
    >>> stop_all(); thread.is_alive()
    False
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Service", "register", "unregister", "stop_all", "STOP_WAIT_S"]

logger = logging.getLogger(__name__)

#: How long the exit hook waits for all services together (past it, the process leaves anyway).
STOP_WAIT_S = 10.0


@dataclass(eq=False)
class Service:
    """A thread (or a process) of hypergrid's: ``stop()`` asks it to end, ``join(seconds)`` waits."""

    name: str
    stop: Callable[[], None]
    join: Callable[[float], None]
    stopped: bool = field(default=False)


_lock = threading.Lock()
_services: list[Service] = []
_hooked = False


def register(name: str, stop: Callable[[], None], join: Callable[[float], None]) -> Service:
    """Register a service to be stopped and waited for at exit (and by :func:`stop_all`)."""
    global _hooked
    service = Service(name, stop, join)
    with _lock:
        _services.append(service)
        if not _hooked:
            atexit.register(stop_all)
            _hooked = True
    return service


def unregister(service: Service) -> None:
    """Forget ``service`` (it ended on its own)."""
    with _lock:
        if service in _services:
            _services.remove(service)


def stop_all(timeout_s: float = STOP_WAIT_S) -> None:
    """Stop every registered service, newest first, then wait for each within ``timeout_s`` in all."""
    with _lock:
        services = list(reversed(_services))
        _services.clear()
    for service in services:
        try:
            service.stop()
        except Exception as exc:  # one failing must not keep the others running
            logger.debug("stopping %s: %s", service.name, exc)
    end = time.monotonic() + timeout_s
    for service in services:
        try:
            service.join(max(0.0, end - time.monotonic()))
        except Exception as exc:
            logger.debug("waiting for %s: %s", service.name, exc)
        service.stopped = True
