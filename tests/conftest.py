"""Keeps the ``gloo`` marker true: a test that starts a gloo job without it fails, naming itself.

The markers (``gloo``, ``slow``; registered in setup.cfg, see tests/README.md) are applied by hand,
in each file. This hook only checks them: while a test runs (its fixtures' set-up included),
:data:`tests.harness.CURRENT_TEST` is that test, and :func:`tests.harness.run_gloo` refuses to
start a job for a test not marked ``gloo``. So ``-m "not gloo"`` never starts one by accident.

It also bounds the resolver's wait for the tests' processes. torch's store server looks each new
client's address up by name on the thread that answers everyone, and a resolver that drops a query
(this machine's drops about one in 25) holds the whole store for its timeout, 5 s by default: a
test with a 4 s grid timeout then fails on a connection made at the wrong moment, whatever it tests.
With a 1 s timeout and one attempt the lookup gives up sooner and the address is used as numbers.
The store's stalls are tested on purpose, at the length a resolver makes them, through
tests/store_proxy.py; benchmarks/ run on the machine as it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

# Before any lookup of this process (it hosts the tests' stores) and inherited by the ranks it starts.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import pytest

from tests import harness


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
    harness.CURRENT_TEST = item
    try:
        yield
    finally:
        harness.CURRENT_TEST = None

