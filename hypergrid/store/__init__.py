"""How hypergrid's ranks talk through the job's store, with no torch.

- :mod:`~hypergrid.store.keys`: every key hypergrid writes and every local socket name;
- :mod:`~hypergrid.store.records`: the frozen records that cross processes, and their serializer;
- :mod:`~hypergrid.store.meeting`: the one rendezvous (count in, one outcome, a roll call);
- :mod:`~hypergrid.store.client`: torch's store called with every call bounded by a deadline;
- :mod:`~hypergrid.store.tcpstore`: a TCPStore client speaking the wire protocol, for monitor processes;
- :mod:`~hypergrid.store.shutdown`: its threads ended before the interpreter's.

Nothing here imports torch, so a rank's monitor process can use all of it.

Example::

    >>> import subprocess, sys
    >>> code = "import sys, hypergrid.store.meeting, hypergrid.store.tcpstore; print('torch' in sys.modules)"
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    'False'
"""
