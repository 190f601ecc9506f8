"""Time ``hypergrid plan`` for one rank of a 16,777,216-rank world (prints timings; asserts nothing).

    python benchmarks/bench_plan.py [--world-size N] [--rank R] [--repeat K]

Times the command in this process (the plan, the sampled summaries, the communicator counts and
the table) and, once, as a fresh ``python -m hypergrid`` process (interpreter and torch import
included).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import time

from hypergrid.app.cli import main


def run(argv: list[str], repeat: int) -> list[float]:
    """Seconds per in-process run of ``hypergrid`` with ``argv``."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            status = main(argv)
        times.append(time.perf_counter() - start)
        if status != 0:
            raise SystemExit(f"hypergrid {' '.join(argv)} exited with {status}")
    return times


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=16_777_216)
    parser.add_argument("--rank", type=int, default=12_345_678)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    argv = ["plan", "--world-size", str(args.world_size), "--tp", "8", "--pp", "16", "--cp", "2", "--ep", "64",
            "--rank", str(args.rank)]
    for fmt in ("table", "json"):
        times = run(argv + ["--format", fmt], args.repeat)
        print(f"plan {fmt:5} in process: best {min(times):.3f}s, worst {max(times):.3f}s over {len(times)} runs")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hypergrid", *argv], check=True, stdout=subprocess.DEVNULL)
    print(f"plan table as a new process (interpreter, torch import): {time.perf_counter() - start:.3f}s")
    print(f"  ({' '.join(argv)})")
