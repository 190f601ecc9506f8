"""One stand-in rank for tests/test_control_late_store.py: a process with no torch that runs the
rank's side of the control plane as hypergrid does (:class:`~hypergrid.liveness.heartbeat.Heartbeat`:
its monitor process started, ticked, restarted when it ends), serving one job, and writes what
happens to a log.

``python -S -m tests.liveness_rank CONFIG`` (CONFIG: JSON with ``host``, ``port``, ``namespace``,
``rank``, ``ranks``, ``node`` (ranks per node), ``interval``, ``log`` and optionally ``per``, the
nodes per reader of the board, and ``go``, a file whose making lets the ranks attach the job
together, as ranks do once past their launcher's rendezvous), from the repository's
root. Its log gets a line per monitor process it runs (``monitor <time> <pid>``: the first, and
each one the heartbeat restarted) and per event of the job's board it hears (``heard <time>
<kind> <rank> <by> <key>``), times of the host's monotonic clock, which the test shares. It
ends cleanly (the job released, the monitor told ``bye``) when its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from types import SimpleNamespace

from hypergrid.liveness.config import DEFAULT_NODES_PER_READER
from hypergrid.liveness.heartbeat import Heartbeat
from hypergrid.liveness.monitor import JobSpec
from hypergrid.store.keys import JobChannel
from hypergrid.store.records import BoardEvent


def main() -> None:
    config = json.loads(sys.argv[1])
    log = open(config["log"], "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open for the process's life)
    # The plane as a rank's would be, given by address (no store object: nothing here uses one).
    # ``reached``: the store is there (the test made it), as a rank's own connection to it would prove.
    plane = SimpleNamespace(namespace=config["namespace"], store=None, address=(config["host"], config["port"]),
                            reached=True)
    beat = Heartbeat(plane, config["rank"], interval_s=config["interval"], progress_timeout_s=600.0,  # type: ignore[arg-type]
                     stale_beats=5)

    def heard(event: BoardEvent) -> None:
        log.write(f"heard {time.monotonic():.4f} {event.kind.value} {event.rank} {event.by} {event.key or '-'}\n")

    beat.listen("log", heard)
    if "go" in config:  # its monitor process is up: attach with the others
        log.write(f"started {time.monotonic():.4f} {beat.pid}\n")
        while not os.path.exists(config["go"]):
            time.sleep(0.05)
    beat.attach(JobSpec(JobChannel(config["namespace"], "job", 0), ((0, config["ranks"]),), config["node"],
                        config.get("per", DEFAULT_NODES_PER_READER)))
    pid = beat.pid
    log.write(f"monitor {time.monotonic():.4f} {pid}\n")
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if beat.pid != pid:
            pid = beat.pid
            log.write(f"monitor {time.monotonic():.4f} {pid}\n")
        if ready and not sys.stdin.buffer.read1(4096):
            break
    beat.release()
    beat.stop(clean=True)
    log.close()


if __name__ == "__main__":
    main()
