"""Read pytest's JUnit reports: each test case's outcome.

Shared by the runs of other projects' suites (``tests/megatron_lm/launch.py``,
``tests/torch_upstream/compare.py``), which start pytest in subprocesses and compare outcomes.

Example::

    >>> # for classname, name, outcome in read_report(Path("report.xml")): ...
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Outcome:
    """One test in one run."""

    status: str  # "passed", "failed" or "skipped"
    detail: str = ""  # the first failure's message or the skip reason


def read_report(report: Path) -> Iterator[tuple[str, str, Outcome]]:
    """``(classname, name, outcome)`` of every test case in ``report``; an error counts as failed."""
    for case in ET.parse(report).iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            outcome = Outcome("failed", (failure.get("message") or failure.text or "").strip())
        elif skipped is not None:
            outcome = Outcome("skipped", (skipped.get("message") or "").strip())
        else:
            outcome = Outcome("passed")
        yield case.get("classname", ""), case.get("name", ""), outcome
