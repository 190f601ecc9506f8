"""``python -m hypergrid``: the command line of :mod:`hypergrid.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
