"""Who is alive: each rank's monitor, the ring of who watches whom, and the job's board of losses.

Every rank of a resilient job runs a monitor, a process of its own that imports no torch, so that
nothing the rank's interpreter does (a C call holding the GIL, a SIGSTOP) stops it; its store work
per rank is the same at 8 ranks and at 100,000. Importing the package imports nothing.

Example: the monitor process needs no torch::

    >>> import subprocess, sys
    >>> code = "import sys, hypergrid.liveness.process; print('torch' in sys.modules)"
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    'False'
"""
