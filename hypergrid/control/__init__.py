"""The recovery's control plane: who is alive, who is lost, and the rounds that agree on it.

Everything a resilient job's ranks say to each other outside their communicators lives here, and
its store work per rank is the same at 8 ranks and at 100,000:

- :mod:`~hypergrid.control.monitor`: each rank's monitor, a process of its own (no torch) that
  beats for it, watches one other rank (:mod:`~hypergrid.control.ring`) and publishes losses,
  over its own client of the store (:mod:`~hypergrid.control.tcpstore`);
- :mod:`~hypergrid.control.heartbeat`: the rank's side: starting its monitor, ticking it, hearing
  the job's events; :mod:`~hypergrid.control.watch` aborts the rank's communicators on them
  (:mod:`~hypergrid.control.abort`);
- :mod:`~hypergrid.control.board`: the job's board of events as the rank's own code reads it;
- :mod:`~hypergrid.control.rounds`: a job's recovery rounds, whose leader decides who failed
  (:mod:`~hypergrid.control.verdict`, a pure function);
- :mod:`~hypergrid.control.keys`: every key of all of it; :mod:`~hypergrid.control.plane`: where
  they live (the root store, a namespace per world).

The monitor imports nothing of this package that needs torch: importing the package imports
nothing either. docs/recovery.md draws who reads and writes which key.

Example: the monitor process needs no torch::

    >>> import subprocess, sys
    >>> code = "import sys, hypergrid.control.monitor; print('torch' in sys.modules)"
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    'False'
"""
