"""The CPU a TCPStore server hosted in this process has used: every thread's but the main one's.

Shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, which puts this folder
on ``sys.path``). The benchmark runs nothing else on other threads while it measures: the main
thread sends its own probes, and is not counted.
"""

from __future__ import annotations

import os


def server_cpu_s() -> float:
    """CPU seconds (user and system) of this process's threads other than the main one, from /proc."""
    ticks, main, total = os.sysconf("SC_CLK_TCK"), os.getpid(), 0
    for task in os.listdir(f"/proc/{main}/task"):
        if int(task) == main:
            continue
        try:
            with open(f"/proc/{main}/task/{task}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])
    return total / ticks
