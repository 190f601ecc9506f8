"""Every thread hypergrid starts is ended before the interpreter tears itself down.

Why: CPython ends the daemon threads still running at exit by ``pthread_exit`` as soon as one
tries to take the GIL back after finalization has begun (Python 3.11 to 3.13). A thread that
was inside a C++ call with the GIL released (a store call: ``add``, ``wait``, ``get``) takes it
back in pybind11's ``gil_scoped_release`` destructor, which is ``noexcept``: the unwinding that
``pthread_exit`` starts there ends in ``std::terminate`` ("terminate called without an active
exception") and the process dies with SIGABRT after the job finished. With the store answering
in 50 ms, 10 exits out of 10 ended so, on torch 2.13 and 2.15, before this module existed.

So each thread hypergrid starts is registered here as a :class:`Service` (how to ask it to stop,
how to wait for it), and one ``atexit`` hook, which runs while the interpreter is still whole,
stops every registered service and waits for it, each wait bounded: a thread inside a store call
comes back from it in the call's time, and then leaves on its own instead of at finalization.

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

#: How long the exit hook waits for all services together: a store call in flight comes back
#: well within it unless the store's host is gone, and then the process leaves anyway.
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
        except Exception as exc:  # one service failing to stop must not keep the others running
            logger.debug("stopping %s: %s", service.name, exc)
    end = time.monotonic() + timeout_s
    for service in services:
        try:
            service.join(max(0.0, end - time.monotonic()))
        except Exception as exc:
            logger.debug("waiting for %s: %s", service.name, exc)
        service.stopped = True
