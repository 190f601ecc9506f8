"""Where a world's control plane lives: the root store, its address and the world's namespace.

A monitor process imports no torch and reaches only the root store under torch's ``PrefixStore``
layers, by address; so the keys live there, below a namespace the world's ranks agree on once
(a fresh token under the default group's prefix), and two worlds never share keys.

Example, in a one-rank gloo world over a ``TCPStore``::

    >>> import torch.distributed as dist
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> dist.init_process_group("gloo", store=server, rank=0, world_size=1)
    >>> plane = control_plane()
    >>> plane.namespace.startswith("hypergrid/control/"), plane.address == ("127.0.0.1", server.port)
    (True, True)
    >>> control_plane() is plane
    True
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from ..errors import StoreUnresponsiveError
from ..runtime.environment import agreement_possible, job_store
from ..runtime.torch_compat import default_store
from ..store.client import StoreClient
from ..store.keys import CONTROL_ROOT, NAMESPACE_TOKEN

__all__ = ["ControlPlane", "control_plane", "root_store"]


@dataclass(frozen=True)
class ControlPlane:
    """A world's ``namespace`` in the root ``store``, and the store's address (None: no monitor can reach it)."""

    namespace: str
    store: Any
    address: Optional[tuple[str, int]]

    @property
    def reached(self) -> bool:
        """Whether this process reaches the store at ``address`` (a TCPStore of its own): so can its monitor."""
        return self.address is not None and isinstance(self.store, dist.TCPStore)

    def client(self, deadline: float) -> StoreClient:
        """The root store over this thread's own connection, calls bounded by ``deadline``."""
        return StoreClient(deadline, base=self.store)


def root_store(store: Any) -> Any:
    """The store under every ``PrefixStore`` layer of ``store``.

    Example::

        >>> import torch.distributed as dist
        >>> inner = dist.HashStore()
        >>> root_store(dist.PrefixStore("a", dist.PrefixStore("b", inner))) is inner
        True
    """
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


_lock = threading.Lock()
_cached: Optional[tuple[Any, ControlPlane]] = None


def control_plane(timeout_s: float = 60.0) -> Optional[ControlPlane]:
    """This world's control plane (agreed once, then cached), or None with no store to meet in.
    Raises RuntimeError where the store does not answer within ``timeout_s``."""
    global _cached
    if not agreement_possible():
        return None
    base = default_store()
    with _lock:
        if _cached is not None and _cached[0] is base:
            return _cached[1]
        try:
            token = job_store(time.monotonic() + timeout_s).compare_set(NAMESPACE_TOKEN, "", uuid.uuid4().hex[:12])
        except (dist.DistError, StoreUnresponsiveError) as exc:
            raise RuntimeError(f"hypergrid: the job's store did not answer while naming the control plane: {exc}") from exc
        root = root_store(base)
        address = (str(root.host), int(root.port)) if isinstance(root, dist.TCPStore) else None
        plane = ControlPlane(f"{CONTROL_ROOT}/{token.decode()}", root, address)
        _cached = (base, plane)
        return plane
