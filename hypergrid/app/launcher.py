"""Local ranks on this machine: how many it can hold, and starting them so that none outlives the run.

Two things the demo's launcher (:func:`hypergrid.app.demo.launch`) needs that are not about groups:

* :func:`probe_machine` reads the CPUs and the memory this process may use (its CPU affinity,
  ``MemAvailable``, a container's cgroup limits) in well under a millisecond, and
  :func:`local_rank_limit` turns them and the measured cost of one rank into the most ranks the
  machine can run: a world beyond it is refused before any process starts.
* :func:`launch` starts the ranks in one process group of their own and kills that group as a
  whole: when the run ends, fails or times out, and when the launcher gets SIGINT or SIGTERM. A
  signal's handler only kills the group and records the signal; the launcher then reaps every
  rank and raises :class:`LaunchInterrupted`, so no moment of the run (the spawn loop included)
  leaves a process behind.

Example::

    >>> limit = local_rank_limit(Machine(cpus=2, available_bytes=8 << 30), RankCost(600, 6.0), timeout_s=120)
    >>> limit.ranks, limit.by_cpu, limit.by_memory
    (10, 40, 10)
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "Machine",
    "RankCost",
    "LocalLimit",
    "MEMORY_SHARE",
    "probe_machine",
    "local_rank_limit",
    "LaunchOutcome",
    "LaunchInterrupted",
    "launch",
]

#: The share of the available memory the ranks may take: the rest is for the launcher, the
#: system and what else runs here.
MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class Machine:
    """What this process may use: ``cpus`` it may run on, ``available_bytes`` of memory (None: unknown)."""

    cpus: int
    available_bytes: Optional[int]


@dataclass(frozen=True)
class RankCost:
    """What one local rank takes, measured: peak memory (MB, proportional set size) and CPU seconds."""

    memory_mb: int
    cpu_s: float


@dataclass(frozen=True)
class LocalLimit:
    """The most local ranks a machine runs (``ranks``), from its CPUs and from its memory; ``why``
    says how, with the numbers."""

    ranks: int
    by_cpu: int
    by_memory: Optional[int]
    why: str


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_number(path: str) -> Optional[int]:
    text = _read(path)
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def probe_machine() -> Machine:
    """The CPUs and available memory of this process, container limits included (Linux; elsewhere
    the CPU count and, where the OS says, the free memory).

    Example::

        >>> machine = probe_machine()
        >>> machine.cpus >= 1
        True
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = (_read("/sys/fs/cgroup/cpu.max") or "").split()  # cgroup v2: "max 100000" or "200000 100000"
    if len(quota) == 2 and quota[0].isdigit() and quota[1].isdigit():
        cpus = min(cpus, math.ceil(int(quota[0]) / int(quota[1])))
    v1_quota, v1_period = _cgroup_number("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _cgroup_number("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if v1_quota is not None and v1_quota > 0 and v1_period:
        cpus = min(cpus, math.ceil(v1_quota / v1_period))
    available = None
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None and hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # A container's memory limit, less what it already uses (v2, then v1; "no limit" is huge).
    for limit_path, used_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, used = _cgroup_number(limit_path), _cgroup_number(used_path)
        if limit is not None and used is not None and limit < (1 << 60):
            available = max(0, limit - used) if available is None else min(available, max(0, limit - used))
    return Machine(max(1, cpus), available)


def local_rank_limit(machine: Machine, cost: RankCost, timeout_s: float) -> LocalLimit:
    """The most ranks of ``cost`` that ``machine`` runs: all must fit in memory
    (:data:`MEMORY_SHARE` of what is available), and their CPU time on its CPUs within ``timeout_s``.

    Example::

        >>> local_rank_limit(Machine(cpus=2, available_bytes=None), RankCost(600, 6.0), timeout_s=120).why
        '2 CPUs x 120 s / 6 CPU-s per rank = 40; memory unknown'
    """
    by_cpu = max(1, int(machine.cpus * timeout_s / cost.cpu_s))
    why = f"{machine.cpus} CPUs x {timeout_s:g} s / {cost.cpu_s:g} CPU-s per rank = {by_cpu}"
    by_memory = None
    if machine.available_bytes is None:
        why += "; memory unknown"
    else:
        by_memory = max(1, int(machine.available_bytes * MEMORY_SHARE / (cost.memory_mb << 20)))
        why += (f"; {machine.available_bytes / (1 << 30):.1f} GiB available x {MEMORY_SHARE:g} / "
                f"{cost.memory_mb} MB per rank = {by_memory}")
    return LocalLimit(min(by_cpu, by_memory or by_cpu), by_cpu, by_memory, why)


@dataclass
class LaunchOutcome:
    """How a local launch ended: ``failures`` maps a rank to its stderr (or why it was killed)."""

    ok: bool
    seconds: float
    failures: dict[int, str]


class LaunchInterrupted(KeyboardInterrupt):
    """The launcher got SIGINT or SIGTERM (``signum``); every rank it started was killed and reaped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# The process group's leader: it holds the group id from before the first rank starts until every
# rank is reaped, so the id is never another's while it is signalled; it ends with the launcher.
_LEADER = "import os, time\nparent = os.getppid()\nwhile os.getppid() == parent:\n    time.sleep(1)\n"


class _Ranks:
    """The ranks of one launch in one process group, killed as a whole; SIGINT and SIGTERM kill it
    at once and are remembered in ``signum`` (handlers only on the main thread, restored by ``close``)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pgid: Optional[int] = None
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        try:
            self.leader = subprocess.Popen([sys.executable, "-S", "-c", _LEADER], stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **self._join(0))
        except BaseException:
            self._restore()
            raise
        self.pgid = self.leader.pid

    @staticmethod
    def _join(pgid: int) -> dict:
        if sys.version_info >= (3, 11):
            return {"process_group": pgid}
        return {"preexec_fn": lambda: os.setpgid(0, pgid)}  # pragma: no cover (Python 3.10)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Raising here could cut the spawn loop or the clean-up anywhere; killing and noting cannot.
        self.signum = self.signum or signum
        self.kill()

    def spawn(self, argv: list[str], **kwargs) -> subprocess.Popen:
        assert self.pgid is not None
        proc = subprocess.Popen(argv, **kwargs, **self._join(self.pgid))
        self.procs.append(proc)
        if self.signum is not None:
            self.kill()  # a rank started after the signal's kill
        return proc

    def kill(self) -> None:
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)

    def close(self) -> None:
        """Kill the group, reap every rank and the leader, restore the signal handlers."""
        self.kill()
        for p in self.procs + [self.leader]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(world_size: int, argv: list[str], *, timeout_s: float = 120.0) -> LaunchOutcome:
    """Run ``argv`` as ``world_size`` local ranks with torchrun's environment; wait with a deadline.

    Rank 0's stdout is this process's stdout; every rank's stderr is kept and returned for the
    ranks that fail. When one rank fails the others get a few seconds to report, then every
    process still running is killed, as on timeout, so none outlives the call. On SIGINT or
    SIGTERM every rank is killed and reaped, then :class:`LaunchInterrupted` is raised.

    Example::

        >>> import sys
        >>> launch(2, [sys.executable, "-c", "pass"], timeout_s=60).ok   # doctest: +SKIP
        True
    """
    port = free_port()
    start = time.monotonic()
    deadline = start + timeout_s
    logs = []
    failures: dict[int, str] = {}
    ranks: Optional[_Ranks] = None
    try:
        ranks = _Ranks()
        for rank in range(world_size):
            if ranks.signum is not None:
                break
            env = dict(os.environ)
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                # N ranks share this machine's cores; one thread each avoids oversubscription.
                OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
            )
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            ranks.spawn(argv, env=env, stdout=None if rank == 0 else subprocess.DEVNULL, stderr=log)
        procs = ranks.procs
        first_failure: Optional[float] = None
        while ranks.signum is None:
            # Poll every process each round (no short-circuit): a failure must be seen at once.
            running = [p.poll() is None for p in procs]
            if not any(running):
                break
            now = time.monotonic()
            if now > deadline:
                for rank, p in enumerate(procs):
                    if p.poll() is None:
                        failures[rank] = f"still running after {timeout_s:.0f}s: killed"
                break
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = now
            # The others of a failed job would wait for it until their collective timeout.
            if first_failure is not None and now - first_failure > 5.0:
                for rank, p in enumerate(procs):
                    if p.poll() is None:
                        failures[rank] = "killed after another rank failed"
                break
            time.sleep(0.05)
    finally:
        if ranks is not None:
            ranks.close()
    if ranks.signum is not None:
        for log in logs:
            log.close()
        raise LaunchInterrupted(ranks.signum)
    for rank, (p, log) in enumerate(zip(ranks.procs, logs)):
        if p.returncode != 0 and rank not in failures:
            log.seek(0)
            failures[rank] = f"exit status {p.returncode}\n" + log.read()[-4000:]
        log.close()
    return LaunchOutcome(ok=not failures, seconds=time.monotonic() - start, failures=failures)
