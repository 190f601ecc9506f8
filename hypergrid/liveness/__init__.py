"""Who is alive: each rank's monitor, the ring of who watches whom, and the job's board of losses.

Every rank of a resilient job runs a monitor, a process of its own that imports no torch, so that
nothing the rank's interpreter does (a C call holding the GIL for seconds, a SIGSTOP, a launcher
ending the rank's process group) stops it. Its store work per rank is the same at 8 ranks and at
100,000:

- :mod:`~hypergrid.liveness.monitor`: the monitor: beats for its rank, watches for its node
  (:mod:`~hypergrid.liveness.ring`: who watches whom), publishes losses, and hands every entry of
  the job's board to its rank;
- :mod:`~hypergrid.liveness.relay`: a node's monitors elect one delegate, which alone waits on
  the board and hands each entry to the others;
- :mod:`~hypergrid.liveness.board`: the job's board, as publishers fill it and as a rank's
  recovery hears and reads it;
- :mod:`~hypergrid.liveness.heartbeat`: the rank's side: starting its monitor, ticking it,
  hearing the board's events;
- :mod:`~hypergrid.liveness.plane`: where it lives (the root store, a namespace per world).

Importing the package imports nothing; the monitor imports nothing that needs torch.

Example: the monitor process needs no torch::

    >>> import subprocess, sys
    >>> code = "import sys, hypergrid.liveness.monitor; print('torch' in sys.modules)"
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    'False'
"""
