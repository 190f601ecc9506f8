"""A test backend on CPU that aborts like NCCL: gloo underneath, and ``abort()`` ends what is in flight.

NCCL's ``ProcessGroup.abort()`` makes the collectives in flight on that communicator end with an
error, which is how a rank blocked in a collective with a peer that left gets out; gloo's does
not (a blocked all-reduce waits until its own timeout). This backend, registered as
``"abortable"``, forwards every operation to a gloo group and completes the caller's work object
from a thread when gloo's completes, unless :meth:`AbortableGroup.abort` came first: then every
pending work and every later operation fails at once, as on an aborted NCCL communicator.

Use it in a rank: ``import tests.abortable_backend`` registers it (and tells hypergrid that it
aborts), then ``dist.init_process_group("abortable", store=..., rank=..., world_size=...)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.futures import Future

NAME = "abortable"


class _Work(dist.Work):
    """The caller's handle on one operation: ``wait()`` raises what the operation ended in (torch's
    own wrapper of a future returns True whatever the future holds)."""

    def __init__(self, future: Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            done = threading.Event()
            self._future.add_done_callback(lambda _: done.set())
            if not done.wait(timeout.total_seconds()):
                raise RuntimeError(f"abortable: the operation did not complete within {timeout}")
        self._future.wait()  # raises the operation's error
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> Future:
        return self._future


class AbortableGroup(dist.ProcessGroup):
    """A gloo group whose ``abort()`` fails the operations in flight and every one after."""

    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._inner = inner
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._aborted = False

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return NAME

    # ------------------------------------------------------------------ the one wrapper
    def _run(self, start: Callable[[], Any], result: Any) -> Any:
        future: Future = Future()
        with self._lock:
            if self._aborted:
                future.set_exception(RuntimeError("abortable: the communicator was aborted"))
                return _Work(future)
            self._pending.add(future)
        work = start()

        def finish() -> None:
            error = None
            try:
                work.wait()
            except Exception as exc:  # gloo's own failure, handed to the caller
                error = exc
            with self._lock:
                if future not in self._pending:
                    return  # aborted meanwhile: the caller has its error already
                self._pending.discard(future)
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        threading.Thread(target=finish, name="abortable-work", daemon=True).start()
        return _Work(future)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            pending, self._pending = list(self._pending), set()
        for future in pending:
            future.set_exception(RuntimeError("abortable: the communicator was aborted while this operation was in flight"))

    def shutdown(self) -> None:
        self.abort()

    # ------------------------------------------------------------------ operations
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        return self._run(lambda: self._inner.allreduce(tensors, opts or dist.AllreduceOptions()), tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        return self._run(lambda: self._inner.broadcast(tensors, opts or dist.BroadcastOptions()), tensors)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._run(lambda: self._inner.allgather(outputs, inputs, opts or dist.AllgatherOptions()), outputs)

    def barrier(self, opts: Any = None) -> Any:
        return self._run(lambda: self._inner.barrier(opts or dist.BarrierOptions()), None)

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        return self._run(lambda: self._inner.send(tensors, dst, tag), tensors)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        return self._run(lambda: self._inner.recv(tensors, src, tag), tensors)


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> AbortableGroup:
    inner = dist.ProcessGroupGloo(store, rank, size, timeout)
    return AbortableGroup(inner, rank, size)


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])


def _tell_hypergrid() -> None:
    from hypergrid.recovery import register_abortable_backend

    register_abortable_backend(NAME)


_tell_hypergrid()
