"""What a benchmark is measuring now, on stderr, so that minutes between rows never look like a hang.

Shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, which puts this folder
on ``sys.path``).
"""

from __future__ import annotations

import sys


def progress(text: str) -> None:
    """Say what is being measured: rewritten in place on a terminal, a plain line otherwise;
    ``""`` clears the terminal line before a result row is printed."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{text}" if text else "\r\033[K")
    elif text:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()
