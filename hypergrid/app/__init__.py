"""The applications on top of the library: the ``hypergrid`` command line and its demo.

:mod:`hypergrid.app.cli` is ``python -m hypergrid`` (plan, check, demo, bench, store);
:mod:`hypergrid.app.demo` runs a real gloo job on this machine, launched by
:mod:`hypergrid.app.launcher`; :mod:`hypergrid.app.console` writes their output;
:mod:`hypergrid.app.store` hosts a job's store outside its nodes.

Example::

    >>> from hypergrid.app.cli import main
    >>> main(["plan", "--world-size", "8", "--tp", "2", "--rank", "5", "--json"]) == 0  # doctest: +ELLIPSIS
    {...}
    True
"""
