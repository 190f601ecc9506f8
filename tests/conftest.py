"""Keeps the ``gloo`` marker true: a test that starts a gloo job without it fails, naming itself;
and, where ``HYPERGRID_FAILED_LIST`` names a file, writes there the node ids of the tests that
failed, one a line (``.ci/run`` reruns those alone; pytest's own cache is off, setup.cfg).

The markers (``gloo``, ``slow``; registered in setup.cfg, see tests/README.md) are applied by hand,
in each file. This hook only checks them: while a test runs (its fixtures' set-up included),
:data:`tests.harness.CURRENT_TEST` is that test, and :func:`tests.harness.run_gloo` refuses to
start a job for a test not marked ``gloo``. So ``-m "not gloo"`` never starts one by accident.
"""

from __future__ import annotations

import os
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


_failed: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and report.nodeid not in _failed:
        _failed.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("HYPERGRID_FAILED_LIST")
    if path:
        with open(path, "w", encoding="utf-8") as out:
            out.writelines(f"{nodeid}\n" for nodeid in _failed)
