"""A rank that recovered exits cleanly: no process of a finished job ends in a signal.

Five whole processes (``tests/exit_worker.py``, each a fresh interpreter that ends by its own
exit, as a training script under a launcher does; the gloo harness's ranks leave by ``os._exit``
and so never reach the interpreter's teardown): a grid tp 2 x dp 2 on ranks 0-3 and spare 4.
Rank 3 is frozen past its progress timeout (3 s), so it is counted out as hung; the survivors
recover onto the spare, rank 3 thaws and learns it is out, and every rank ends as a finished
job's does. Every rank's exit status must be 0: the spare that joined, the survivors, and the
rank counted out.

The ranks reach their store through a proxy that holds every answer back 20 ms, as a busy store
host does: a hypergrid thread that is inside a store call when the interpreter finalizes then
aborts the process ("terminate called without an active exception", SIGABRT; issue 38). Before
hypergrid ended its threads at exit, 10 of 10 single-rank exits against such a store aborted on
torch 2.13 and 2.15.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
WORLD = 5
#: The whole job took 20 to 30 s here; past this it counts as hung and every process is killed.
DEADLINE_S = 150.0
#: How long rank 3 stays frozen: past the survivors' collective timeout (4 s) and the recovery.
FROZEN_S = 12.0
ANSWER_DELAY_S = 0.02


class DelayingProxy:
    """Loopback TCP proxy to ``port`` that holds each answer back ``delay_s`` seconds."""

    def __init__(self, port: int, delay_s: float) -> None:
        self._target, self._delay = port, delay_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self._delay), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()
        for sock in self._open:
            sock.close()


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def test_every_rank_of_a_recovered_job_exits_with_status_0(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=DEADLINE_S))
    proxy = DelayingProxy(store.port, ANSWER_DELAY_S)
    procs = []
    try:
        for rank in range(WORLD):
            with open(tmp_path / f"log-{rank}.txt", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.exit_worker", "--store", f"127.0.0.1:{proxy.port}", "--rank",
                     str(rank), "--world", str(WORLD), "--out", str(tmp_path)],
                    stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=_env()))
        end = time.monotonic() + DEADLINE_S
        thawed = False
        frozen_at = None
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            if frozen_at is None and (tmp_path / "frozen").exists():
                frozen_at = time.monotonic()
            if not thawed and frozen_at is not None and time.monotonic() - frozen_at >= FROZEN_S:
                os.kill(procs[3].pid, signal.SIGCONT)
                thawed = True
            time.sleep(0.1)
        still = [rank for rank, p in enumerate(procs) if p.poll() is None]
        logs = {rank: (tmp_path / f"log-{rank}.txt").read_text()[-3000:] for rank in range(WORLD)}
        assert not still, f"ranks {still} did not end within {DEADLINE_S} s; logs: {logs}"
        codes = [p.returncode for p in procs]
        assert codes == [0] * WORLD, f"exit statuses {codes} (negative: the signal); logs: {logs}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        proxy.close()
    outcome = {rank: json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(WORLD)}
    assert outcome[4]["joined"] is True and outcome[4]["role"] == "spare"
    for rank in (0, 1, 2):
        assert outcome[rank]["recovered"] == "replace: rank 3 -> 4; 0 spares left", outcome[rank]
    for rank in (0, 1, 2, 4):
        assert outcome[rank]["placement"] == [0, 1, 2, 4] and outcome[rank]["sums"] == [2, 2], outcome[rank]
    assert "no longer a rank of the job" in outcome[3]["excluded"], outcome[3]
