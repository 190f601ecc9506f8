"""Run torch's own DeviceMesh tests twice, on torch's groups and on hypergrid's, and compare.

``device_mesh_tests.py`` is PyTorch's ``test/distributed/test_device_mesh.py`` (see its header).
It runs once as the control (``HYPERGRID_ROUTE_MESHES`` unset: torch makes every group) and once
with its meshes coming from hypergrid (``HYPERGRID_ROUTE_MESHES=1``: ``route_device_meshes()``
is on in every rank). Each run is one pytest process writing a JUnit report; torch's
``MultiProcessTestCase`` starts each test's ranks (4 or 8, gloo on CPU) and reports over them.
The verdict of interest: every test that passes on torch passes on hypergrid.

Usage::

    python -m tests.torch_upstream.compare                # both runs, prints the comparison
    python -m tests.torch_upstream.compare -k flatten     # pytest's -k, passed to both runs

Example (in Python)::

    >>> # compare_runs().regressions   # -> [] when hypergrid's meshes behave as torch's
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tests.junit import Outcome, read_report
from tests.torch_upstream.witness import WITNESS_FILE

HERE = Path(__file__).parent
REPO = HERE.parent.parent
TESTS = HERE / "device_mesh_tests.py"

#: The two runs: the control on torch's groups, then the same file on hypergrid's.
RUNS = ("torch", "hypergrid")


@dataclass
class Comparison:
    """Every test's outcome in both runs, by ``Class::test``."""

    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
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
        lines = [f"torch's test_device_mesh.py ({len(self.outcomes)} tests), gloo on CPU:"]
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


def run_tests(run: str, workdir: Path, pytest_args: Sequence[str] = (), timeout_s: float = 1800.0) -> tuple[dict[str, Outcome], str]:
    """One run (``"torch"`` or ``"hypergrid"``) of the copied file: outcomes by test, and its log."""
    if run not in RUNS:
        raise ValueError(f"run must be one of {RUNS}, got {run!r}")
    report = workdir / f"{run}.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env[WITNESS_FILE] = str(workdir / f"{run}-witness.jsonl")
    env.pop("HYPERGRID_ROUTE_MESHES", None)
    if run == "hypergrid":
        env["HYPERGRID_ROUTE_MESHES"] = "1"
    # Without a GPU, torch's helpers run the ranks on CPU with gloo; the tests that need GPUs skip.
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               str(TESTS), f"--junitxml={report}", *pytest_args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
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


def compare_runs(pytest_args: Sequence[str] = (), timeout_s: float = 1800.0) -> Comparison:
    """Both runs, one after the other, and their outcomes side by side."""
    result = Comparison()
    with tempfile.TemporaryDirectory(prefix="hypergrid-torch-mesh-") as tmp:
        for run in RUNS:
            outcomes, log = run_tests(run, Path(tmp), pytest_args, timeout_s)
            result.logs[run] = log
            result.witnessed[run] = read_witness(run, Path(tmp))
            for test, outcome in outcomes.items():
                result.outcomes.setdefault(test, {})[run] = outcome
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default=None, help="pytest's -k expression, for both runs")
    args = parser.parse_args(argv)
    result = compare_runs(("-k", args.k) if args.k else ())
    print(result.report())
    return 1 if result.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
