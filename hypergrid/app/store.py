"""``python -m hypergrid store``: a job's store, hosted outside its training nodes.

Under torchrun, the workers' store (``MASTER_ADDR:MASTER_PORT``) is a TCPStore server inside the
agent of node 0, and the c10d rendezvous's store lives in the agent whose host is the
``--rdzv-endpoint``: when that node is lost, the store goes with it, and the survivors have
nowhere left to agree on a recovery. This command hosts a TCPStore server in a process of its
own, on a host that is not a training node (the batch script's, say), for as long as the job
runs. torchrun's rendezvous (``--rdzv-endpoint HOST:PORT --rdzv-conf is_host=false``) and the
workers' default group (``init_process_group(store=TCPStore(HOST, PORT, is_master=False))``)
both use it; docs/cluster.md, "Surviving a lost node", shows the whole launch.

It prints one line once clients can connect, ``hypergrid store: serving on HOST:PORT (pid N)``,
and serves until SIGTERM or SIGINT (exit status 0), or for ``--timeout`` seconds. The server
listens on every interface; ``--host`` is the name printed for the clients, and ``--port 0``
takes any free port (the line says which).

Example, a store that serves for a tenth of a second::

    >>> import argparse
    >>> parser = argparse.ArgumentParser(); _ = add_store_parser(parser.add_subparsers())
    >>> run_store(parser.parse_args(["store", "--host", "127.0.0.1", "--port", "0", "--timeout", "0.1"]))
    ... # doctest: +ELLIPSIS
    hypergrid store: serving on 127.0.0.1:... (pid ...)
    0
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from typing import Any, Optional

from ..errors import UsageError
from .console import out

__all__ = ["add_store_parser", "run_store", "DEFAULT_PORT"]

#: torchrun's own default rendezvous port.
DEFAULT_PORT = 29400


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port (0 to 65535), got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port (0 to 65535), got {value}")
    return value


def add_store_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``store`` to the command line's subcommands (``sub``: argparse's subparsers); its parser."""
    s = sub.add_parser("store", help="host a job's TCPStore outside its nodes, until stopped (docs/cluster.md)")
    s.add_argument("--host", default=None,
                   help="the address the clients use, printed in the line (default: this host's name); the "
                        "server listens on every interface")
    s.add_argument("--port", type=_port, default=DEFAULT_PORT,
                   help=f"the port to serve on (default {DEFAULT_PORT}; 0: any free port, printed)")
    s.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="stop after this many seconds (default: serve until SIGTERM or SIGINT)")
    return s


def run_store(args: argparse.Namespace) -> int:
    """Serve until SIGTERM, SIGINT or ``args.timeout``; 0 then. A port that cannot be served on
    is a :class:`~hypergrid.errors.UsageError` naming it."""
    import torch.distributed as dist

    host = args.host or socket.gethostname()
    stop = threading.Event()
    stopped_by: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopped_by.append(signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            store = dist.TCPStore(host, args.port, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=30))
        except (RuntimeError, OSError) as exc:  # the port is taken, the host does not resolve
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"cannot serve a store on {host}:{args.port}: {first}") from None
        out(f"hypergrid store: serving on {host}:{store.port} (pid {os.getpid()})")
        timeout: Optional[float] = args.timeout
        stop.wait(timeout)  # a signal's handler runs in this thread and ends the wait at once
        why = stopped_by[0] if stopped_by else f"--timeout {timeout:g}"
        print(f"hypergrid store: {host}:{store.port} stopped ({why})", file=sys.stderr, flush=True)
        del store
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
