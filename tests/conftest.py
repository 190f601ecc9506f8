"""Keeps the ``gloo`` marker true: a test that starts a gloo job without it fails, naming itself.

The markers (``gloo``, ``slow``; registered in setup.cfg, see tests/README.md) are applied by hand,
in each file. This hook only checks them: while a test runs (its fixtures' set-up included),
:data:`tests.harness.CURRENT_TEST` is that test, and :func:`tests.harness.run_gloo` refuses to
start a job for a test not marked ``gloo``. So ``-m "not gloo"`` never starts one by accident.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import harness


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
    harness.CURRENT_TEST = item
    try:
        yield
    finally:
        harness.CURRENT_TEST = None

