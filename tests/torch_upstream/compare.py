"""Run torch's own DeviceMesh tests twice, on torch's groups and on hypergrid's, and compare.

The tests are PyTorch's ``test/distributed/test_device_mesh.py``, read from the checkout named
by ``HYPERGRID_TORCH_TESTS_SOURCE`` (a pytorch checkout, or any folder holding
``test/distributed/test_device_mesh.py``; :func:`find_tests`); no copy is kept here. The file runs
as it is, copied into a temporary folder, under our plugin (:mod:`tests.torch_upstream.plugin`):
once as the control (``HYPERGRID_ROUTE_MESHES`` unset: torch makes every group) and once with its
meshes coming from hypergrid (``HYPERGRID_ROUTE_MESHES=1``: ``route_device_meshes()`` is on in
every rank). Each run is one pytest process writing a JUnit report; torch's
``MultiProcessTestCase`` starts each test's ranks (4 or 8, gloo on CPU) and reports over them.
The verdict of interest: every test that passes on torch passes on hypergrid.

Usage::

    HYPERGRID_TORCH_TESTS_SOURCE=/path/to/pytorch python -m tests.torch_upstream.compare
    HYPERGRID_TORCH_TESTS_SOURCE=/path/to/pytorch python -m tests.torch_upstream.compare -k flatten

Example (in Python)::

    >>> # compare_runs().regressions   # -> [] when hypergrid's meshes behave as torch's
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tests.junit import Outcome, read_report
from tests.torch_upstream.plugin import ROUTE_ENV
from tests.torch_upstream.witness import WITNESS_FILE

HERE = Path(__file__).parent
REPO = HERE.parent.parent

#: The environment variable naming the checkout.
SOURCE_ENV = "HYPERGRID_TORCH_TESTS_SOURCE"
#: The file, in pytorch's repository.
TEST_FILE = Path("test/distributed/test_device_mesh.py")

#: How to get the file; the skip without it says it.
HOW_TO_GET = (
    f"{SOURCE_ENV} names a pytorch checkout (`git clone https://github.com/pytorch/pytorch`) or a "
    f"folder holding {TEST_FILE} alone, the file taken from pytorch's repository "
    f"(https://github.com/pytorch/pytorch/blob/main/{TEST_FILE.as_posix()}, or at a release's tag)"
)


class SourceUnavailable(Exception):
    """No checkout is named (the message says how to get one)."""


def find_tests(source: Optional[str] = None) -> Path:
    """torch's ``test_device_mesh.py`` in ``source`` (default: :data:`SOURCE_ENV`).

    Raises :class:`SourceUnavailable` when no source is named, ``ValueError`` when the one named
    does not hold the file.
    """
    source = source if source is not None else os.environ.get(SOURCE_ENV)
    if not source:
        raise SourceUnavailable(f"{SOURCE_ENV} is not set. {HOW_TO_GET}")
    path = Path(source).expanduser().resolve()
    for candidate in (path / TEST_FILE, path / TEST_FILE.name, path):
        if candidate.is_file() and candidate.name == TEST_FILE.name:
            return candidate
    raise ValueError(f"{SOURCE_ENV}={source!r} holds no {TEST_FILE}. {HOW_TO_GET}")


#: The two runs: the control on torch's groups, then the same file on hypergrid's.
RUNS = ("torch", "hypergrid")


@dataclass
class Comparison:
    """Every test's outcome in both runs, by ``Class::test``."""

    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    #: The file that ran.
    source: str = ""
    #: By run: the witness's lines (witness.py), one per test and rank that ended its process group.
    witnessed: dict[str, list[dict]] = field(default_factory=dict)

    def groups_made(self, run: str) -> tuple[int, int]:
        """(groups torch's mesh code made, groups in hypergrid's registry), summed over tests and ranks."""
        lines = self.witnessed.get(run, [])
        return sum(w["torch_mesh_groups"] for w in lines), sum(w["hypergrid_groups"] for w in lines)

    def left_to_torch(self) -> list[str]:
        """Tests in whose hypergrid run torch's mesh code still made groups (meshes hypergrid leaves to torch)."""
        return sorted({w["test"] for w in self.witnessed.get("hypergrid", []) if w["torch_mesh_groups"]})

    def counts(self, run: str) -> Counter:
        return Counter(o[run].status for o in self.outcomes.values() if run in o)

    @property
    def regressions(self) -> list[str]:
        """Tests that pass on torch's groups and do not pass on hypergrid's."""
        missing = Outcome("failed", "not reported")
        return sorted(t for t, o in self.outcomes.items()
                      if o.get("torch", missing).status == "passed" and o.get("hypergrid", missing).status != "passed")

    def report(self) -> str:
        lines = [f"torch's test_device_mesh.py ({len(self.outcomes)} tests, from {self.source}), gloo on CPU:"]
        for run in RUNS:
            c = self.counts(run)
            by_torch, by_hypergrid = self.groups_made(run)
            lines.append(f"  on {run:<9}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped; "
                         f"group calls by torch's mesh code {by_torch}, groups in hypergrid's registry {by_hypergrid} "
                         f"(over {len(self.witnessed.get(run, []))} test-ranks)")
        left = self.left_to_torch()
        if left:
            lines.append(f"  meshes left to torch (not over consecutive ranks) in: {', '.join(left)}")
        for test in self.regressions:
            lines.append(f"  REGRESSION {test}: {self.outcomes[test]['hypergrid'].detail[:400]}")
        for test, o in sorted(self.outcomes.items()):
            if "torch" in o and o["torch"].status == "failed":
                lines.append(f"  fails on torch too: {test}: {o['torch'].detail[:200]}")
        reasons = Counter(o["torch"].detail for o in self.outcomes.values() if "torch" in o and o["torch"].status == "skipped")
        for reason, n in sorted(reasons.items()):
            lines.append(f"  skipped x{n} (both runs): {reason[:160]}")
        return "\n".join(lines)


def _parse(report: Path) -> dict[str, Outcome]:
    return {f"{classname.rsplit('.', 1)[-1]}::{name}": outcome for classname, name, outcome in read_report(report)}


def run_tests(run: str, workdir: Path, tests: Path, pytest_args: Sequence[str] = (),
              timeout_s: float = 1800.0) -> tuple[dict[str, Outcome], str]:
    """One run (``"torch"`` or ``"hypergrid"``) of ``tests`` (a copy of torch's file in
    ``workdir``): outcomes by test, and its log."""
    if run not in RUNS:
        raise ValueError(f"run must be one of {RUNS}, got {run!r}")
    report = workdir / f"{run}.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env[WITNESS_FILE] = str(workdir / f"{run}-witness.jsonl")
    env.pop(ROUTE_ENV, None)
    if run == "hypergrid":
        env[ROUTE_ENV] = "1"
    # Without a GPU, torch's helpers run the ranks on CPU with gloo; the tests that need GPUs skip.
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.torch_upstream.plugin",
               "--rootdir", str(workdir), str(tests), f"--junitxml={report}", *pytest_args]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    log = done.stdout + done.stderr
    if not report.exists():
        raise RuntimeError(f"the {run} run wrote no report (exit {done.returncode}):\n{log[-4000:]}")
    return _parse(report), log


def read_witness(run: str, workdir: Path) -> list[dict]:
    """The witness's lines of one run (none where no test ended its process group)."""
    path = workdir / f"{run}-witness.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def compare_runs(pytest_args: Sequence[str] = (), timeout_s: float = 1800.0, source: Optional[str] = None) -> Comparison:
    """Both runs of the file :func:`find_tests` finds, one after the other, and their outcomes side by side."""
    original = find_tests(source)
    result = Comparison(source=str(original))
    with tempfile.TemporaryDirectory(prefix="hypergrid-torch-mesh-") as tmp:
        workdir = Path(tmp)
        tests = workdir / TEST_FILE.name
        shutil.copyfile(original, tests)
        # This repository's warning filters, as when the tests ran from it; no other setting.
        (workdir / "pytest.ini").write_text(
            "[pytest]\nfilterwarnings =\n    ignore::DeprecationWarning\n    ignore::UserWarning\n", encoding="utf-8")
        for run in RUNS:
            outcomes, log = run_tests(run, workdir, tests, pytest_args, timeout_s)
            result.logs[run] = log
            result.witnessed[run] = read_witness(run, workdir)
            for test, outcome in outcomes.items():
                result.outcomes.setdefault(test, {})[run] = outcome
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help=f"the pytorch checkout (default: ${SOURCE_ENV})")
    parser.add_argument("-k", default=None, help="pytest's -k expression, for both runs")
    args = parser.parse_args(argv)
    try:
        result = compare_runs(("-k", args.k) if args.k else (), source=args.source)
    except SourceUnavailable as why:
        print(f"not run: {why}", file=sys.stderr)
        return 2
    print(result.report())
    return 1 if result.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
