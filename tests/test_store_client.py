"""The bounded store client's blocking calls near their deadline.

torch counts a store's timeout in whole milliseconds, and a timeout that rounds down to 0 ms is
its "no timeout": a get or a wait made with under a millisecond left would block until the key
is set, and the client then reports a store that stopped answering (it raised
``StoreUnresponsiveError`` 5 s later, where the step's outcome was "timed out"). Over a
``HashStore`` and over a real ``TCPStore``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

from hypergrid.store.client import StoreClient


@pytest.fixture(params=["hash", "tcp"])
def base(request: Any) -> Any:
    if request.param == "hash":
        return dist.HashStore()
    return dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)


@pytest.mark.parametrize("seconds", [0.0004, 0.0009, 0.3])
def test_a_get_with_under_a_millisecond_left_returns_unset_instead_of_blocking(base, seconds):
    store = StoreClient(time.monotonic() + 10, base=base)
    started = time.monotonic()
    assert store.get_within("never-set", seconds) is None
    assert store.wait(["never-set"], seconds) is False
    assert time.monotonic() - started < 2 * seconds + 1.0


def test_a_get_with_under_a_millisecond_left_still_reads_a_key_that_is_set(base):
    base.set("here", "1")
    store = StoreClient(time.monotonic() + 10, base=base)
    assert store.get_within("here", 0.0004) == b"1"
    assert store.wait(["here"], 0.0004) is True
