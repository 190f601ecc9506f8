"""One rank for tests/test_control_monitor.py: a whole process with its heartbeat's monitor, serving
a job, that then ends (or pauses) the way the test asks.

``python -m tests.control_rank --store HOST:PORT --scenario NAME [--progress S]``

It starts a one-rank gloo world over the test's store, starts its monitor (``Heartbeat``, as
``start_heartbeat`` does on a world of several ranks), attaches it to a job's board (the job of
ranks ``[0, 1]``, whose ring here holds this rank alone: it watches nobody), prints the world's
control namespace and the monitor's pid, and then:

``kill``     SIGKILLs itself (the monitor must publish its end at once);
``bye``      releases its job and exits (nobody's loss);
``exit``     exits with the job still counting on it (``sys.exit(3)``: the job must learn it);
``gil``      holds the GIL for ``--hold`` seconds in one C call, then exits cleanly;
``unread``   pauses its monitor (SIGSTOP), attaches the job only then, and SIGKILLs itself: the
             monitor, let run again by the test, finds the job's line and the rank's end at once.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from hypergrid.liveness.heartbeat import Heartbeat
from hypergrid.liveness.monitor import JobSpec
from hypergrid.liveness.plane import control_plane
from hypergrid.store.keys import JobChannel


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--scenario", required=True, choices=["kill", "bye", "exit", "gil", "unread"])
    parser.add_argument("--progress", type=float, default=60.0)
    parser.add_argument("--hold", type=float, default=0.0)
    args = parser.parse_args()
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    plane = control_plane()
    assert plane is not None
    beat = Heartbeat(plane, 0, interval_s=0.2, progress_timeout_s=args.progress, stale_beats=5)
    channel = JobChannel.of([0, 1], 0, plane.namespace)
    spec = JobSpec(channel, ((0, 1),), 1)  # its ranks: itself alone (nobody to watch)
    if args.scenario != "unread":
        beat.attach(spec)
    print(plane.namespace, beat.pid, flush=True)
    time.sleep(1.0)  # a few beats
    if args.scenario == "unread":
        os.kill(beat.pid, signal.SIGSTOP)
        while _state(beat.pid) != "T":  # a signal is delivered after kill() returns
            time.sleep(0.01)
        beat.attach(spec)
        os.kill(os.getpid(), signal.SIGKILL)
    elif args.scenario == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif args.scenario == "bye":
        beat.release()
        dist.destroy_process_group()
    elif args.scenario == "exit":
        sys.exit(3)
    elif args.scenario == "gil":
        # One C call that keeps the GIL (a PyDLL call does not release it), as a long pickling or
        # a C extension does: this interpreter's own threads cannot run meanwhile.
        libc = ctypes.PyDLL(ctypes.util.find_library("c"))
        libc.usleep(int(args.hold * 1e6))
        print("held", flush=True)
        beat.release()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
