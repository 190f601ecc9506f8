"""Start Megatron-LM's unit tests the way torchrun does: one pytest per rank, gloo on CPU.

The test files come from the Megatron-LM checkout named by ``HYPERGRID_MEGATRON_LM_SOURCE``, at the
tag that matches the installed megatron-core (:mod:`tests.megatron_lm.checkout`), laid out with our
``Utils`` and conftest in a temporary tree. Every rank runs the same pytest session over that tree;
each writes a JUnit report. A test *passed* when it passed on every rank that ran it, *failed*
when it failed or errored on any rank, *skipped* when every rank skipped it. Every test runs
twice (``[mcore]`` and ``[hypergrid]``, see :mod:`tests.megatron_lm.ranks_conftest`); the verdict
of interest is "every test that passes on Megatron-Core passes on hypergrid".

Usage::

    HYPERGRID_MEGATRON_LM_SOURCE=/path/to/Megatron-LM python -m tests.megatron_lm.launch
    HYPERGRID_MEGATRON_LM_SOURCE=/path/to/Megatron-LM python -m tests.megatron_lm.launch -k hyper

Example (in Python)::

    >>> # result = run_suite(); result.regressions   # -> [] when hypergrid keeps up
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tests.junit import Outcome, read_report
from tests.megatron_lm.checkout import SourceUnavailable, build_tree, find_source, installed_megatron_core

HERE = Path(__file__).parent
REPO = HERE.parent.parent

IMPLEMENTATIONS = ("mcore", "hypergrid")


@dataclass
class SuiteResult:
    """The outcome of every test on both implementations, by test id without the implementation."""

    #: The installed megatron-core's version.
    version: str
    world_size: int
    #: Where the test files came from (:meth:`tests.megatron_lm.checkout.Source.describe`).
    source: str = ""
    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    rank_logs: dict[int, str] = field(default_factory=dict)

    def counts(self, implementation: str) -> Counter:
        return Counter(o[implementation].status for o in self.outcomes.values() if implementation in o)

    @property
    def regressions(self) -> list[str]:
        """Tests that pass on Megatron-Core and do not pass on hypergrid."""
        return sorted(
            test for test, o in self.outcomes.items()
            if o.get("mcore", Outcome("failed")).status == "passed" and o.get("hypergrid", Outcome("failed")).status != "passed"
        )

    def report(self) -> str:
        lines = [f"Megatron-LM unit tests ({self.source}) for megatron-core {self.version}, {self.world_size} gloo ranks:"]
        for impl in IMPLEMENTATIONS:
            c = self.counts(impl)
            lines.append(f"  on {impl:<9}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        for test in self.regressions:
            lines.append(f"  REGRESSION {test}: {self.outcomes[test]['hypergrid'].detail[:300]}")
        mcore_failures = sorted(t for t, o in self.outcomes.items() if o.get("mcore") and o["mcore"].status == "failed")
        for test in mcore_failures:
            lines.append(f"  fails on Megatron-Core too: {test}: {self.outcomes[test]['mcore'].detail[:200]}")
        skip_reasons = Counter(o["mcore"].detail for o in self.outcomes.values() if o.get("mcore") and o["mcore"].status == "skipped")
        for reason, n in sorted(skip_reasons.items()):
            lines.append(f"  skipped x{n} (each implementation): {reason[:160]}")
        return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_IMPL = re.compile(r"(?:^|-)(mcore|hypergrid)(?:-|$)")


def _split_id(name: str) -> tuple[str, Optional[str]]:
    """``test_x[hypergrid-tp-cp]`` -> (``test_x[tp-cp]``, ``hypergrid``)."""
    if "[" not in name:
        return name, None
    base, params = name.split("[", 1)
    params = params.rstrip("]")
    found = _IMPL.search(params)
    if not found:
        return name, None
    rest = (params[: found.start()] + "-" + params[found.end():]).strip("-")
    rest = rest.replace("--", "-")
    return (f"{base}[{rest}]" if rest else base), found.group(1)


def _parse(report: Path) -> dict[tuple[str, str], Outcome]:
    found: dict[tuple[str, str], Outcome] = {}
    for classname, name, outcome in read_report(report):
        test, impl = _split_id(name)
        if impl is not None:
            found[(f"{classname}::{test}", impl)] = outcome
    return found


def run_suite(
    *,
    source: Optional[str] = None,
    world_size: int = 8,
    timeout_s: float = 900.0,
    pytest_args: tuple[str, ...] = (),
) -> SuiteResult:
    """Run the installed megatron-core's Megatron-LM unit tests on ``world_size`` gloo ranks.

    ``source`` is the checkout (default: ``HYPERGRID_MEGATRON_LM_SOURCE``). Raises
    :class:`~tests.megatron_lm.checkout.SourceUnavailable` when there is no usable one (the
    message says how to get it), ``TimeoutError`` (after killing every rank) if the job does not
    end in ``timeout_s``.
    """
    version = installed_megatron_core()
    if version is None:
        raise SourceUnavailable("megatron-core is not installed")
    found = find_source(version, source)
    port = _free_port()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="hypergrid-megatron-lm-") as tmp:
        out = Path(tmp) / "reports"
        out.mkdir()
        tree = Path(tmp) / "tree"
        suite = build_tree(found, tree)
        for rank in range(world_size):
            env = dict(os.environ)
            env.pop("HYPERGRID_STRATEGY", None)  # the conftest decides the strategy per test
            env.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                # The tree first: its ``tests`` package is Megatron-LM's layout, not this repository's.
                "PYTHONPATH": os.pathsep.join([str(tree), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                "OMP_NUM_THREADS": "1",
            })
            log = open(out / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
                 "-o", "junit_family=xunit2", "-o", "faulthandler_timeout=300", f"--junitxml={out / f'rank{rank}.xml'}", *pytest_args],
                cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
            ))
        deadline = time.monotonic() + timeout_s
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running = [r for r, p in enumerate(procs) if p.poll() is None]
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            tail = (out / f"rank{running[0]}.log").read_text()[-3000:]
            raise TimeoutError(
                f"ranks {running} of the Megatron-LM job did not finish in {timeout_s}s (killed); "
                f"rank {running[0]}'s log ends:\n{tail}"
            ) from None
        result = SuiteResult(version, world_size, found.describe())
        per_rank: dict[tuple[str, str], list[tuple[int, Outcome]]] = {}
        for rank in range(world_size):
            result.rank_logs[rank] = (out / f"rank{rank}.log").read_text()
            report = out / f"rank{rank}.xml"
            if not report.exists():
                raise RuntimeError(f"rank {rank} wrote no report; its log ends:\n{result.rank_logs[rank][-3000:]}")
            for key, outcome in _parse(report).items():
                per_rank.setdefault(key, []).append((rank, outcome))
        for (test, impl), seen in per_rank.items():
            failed = [(r, o) for r, o in seen if o.status == "failed"]
            if failed:
                rank, first = failed[0]
                merged = Outcome("failed", f"ranks {[r for r, _ in failed]} failed; rank {rank}: {first.detail}")
            elif any(o.status == "passed" for _, o in seen):
                merged = Outcome("passed")
            else:
                merged = Outcome("skipped", seen[0][1].detail)
            result.outcomes.setdefault(test, {})[impl] = merged
        return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default=None,
                        help="the Megatron-LM checkout (default: $HYPERGRID_MEGATRON_LM_SOURCE)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("-k", default=None, help="pytest -k expression for every rank")
    args = parser.parse_args(argv)
    extra = ("-k", args.k) if args.k else ()
    try:
        result = run_suite(source=args.source, world_size=args.world_size, timeout_s=args.timeout, pytest_args=extra)
    except SourceUnavailable as why:
        print(f"not run: {why}", file=sys.stderr)
        return 2
    print(result.report())
    return 1 if result.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
