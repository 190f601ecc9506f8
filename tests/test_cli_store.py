"""``python -m hypergrid store``: a job's store hosted outside its nodes (hypergrid.app.store),
run as a user types it: it prints its address, clients use it, SIGTERM and SIGINT end it with
status 0; a taken port or a bad value is one error line and status 2."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hypergrid.app import cli

ROOT = Path(__file__).resolve().parent.parent


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hypergrid", "store", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)


def _address(proc: subprocess.Popen, timeout_s: float = 60) -> tuple[str, int]:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        line = proc.stdout.readline() if sel.select(timeout_s) else ""  # type: ignore[union-attr]
    found = re.fullmatch(r"hypergrid store: serving on (\S+):(\d+) \(pid (\d+)\)\n", line)
    assert found, (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
    assert int(found.group(3)) == proc.pid
    return found.group(1), int(found.group(2))


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, str, str]:
    try:
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=30)
        return proc.returncode, out, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serves_clients_until_a_signal_ends_it_with_status_0(sig):
    proc = _start("--host", "127.0.0.1", "--port", "0")
    try:
        host, port = _address(proc)
        assert host == "127.0.0.1"
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        other = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        client.set("key", "value")
        assert other.get("key") == b"value" and other.add("count", 2) == 2 and client.add("count", 1) == 3
        if sig == signal.SIGTERM:  # the port is taken while it serves: a second store says so, status 2
            taken = subprocess.run([sys.executable, "-m", "hypergrid", "store", "--host", host, "--port", str(port)],
                                   capture_output=True, text=True, timeout=120, cwd=ROOT)
            assert taken.returncode == 2 and taken.stdout == "", (taken.returncode, taken.stdout, taken.stderr)
            assert taken.stderr.startswith(f"hypergrid: error: cannot serve a store on {host}:{port}: ")
            assert len(taken.stderr.splitlines()) == 1 and "Traceback" not in taken.stderr, taken.stderr
            assert client.get("key") == b"value"  # the first one still serves
        del client, other
    finally:
        code, out, err = _stop(proc, sig)
    assert code == 0, (code, out, err)
    assert err.strip() == f"hypergrid store: {host}:{port} stopped ({signal.Signals(sig).name})", err


@pytest.mark.slow
def test_timeout_ends_it_on_its_own():
    proc = _start("--host", "127.0.0.1", "--port", "0", "--timeout", "0.5")
    try:
        _address(proc)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0 and "stopped (--timeout 0.5)" in err, (proc.returncode, out, err)


@pytest.mark.parametrize("argv,words", [
    (["--port", "70000"], "expected a port (0 to 65535), got 70000"),
    (["--port", "x"], "expected a port (0 to 65535), got 'x'"),
    (["--timeout", "0"], "expected seconds (a number > 0), got '0'"),
    (["--timeout", "-1"], "expected seconds (a number > 0), got '-1'"),
])
def test_bad_values_are_one_line_and_status_2(argv, words, capsys):
    assert cli.main(["store", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hypergrid: error: ") and words in err and len(err.splitlines()) == 1, err


def test_the_host_printed_defaults_to_this_host_s_name(capsys):
    import socket

    assert cli.main(["store", "--port", "0", "--timeout", "0.05"]) == 0
    assert capsys.readouterr().out.startswith(f"hypergrid store: serving on {socket.gethostname()}:")
