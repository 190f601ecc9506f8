"""The docstring examples of hypergrid's modules stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "hypergrid.layout", "hypergrid.grid", "hypergrid.groups", "hypergrid.strategy", "hypergrid._torch_compat", "hypergrid",
    # the planning modules
    "hypergrid.report", "hypergrid.viz", "hypergrid.parity", "hypergrid.cli", "hypergrid.demo",
]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name, monkeypatch):
    # The examples plan grids with world_size=; a stray WORLD_SIZE must not change them.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples of {name} failed"
    # A module whose examples were all lost (e.g. a docstring turned into a comment) would pass
    # vacuously; each of these modules documents itself with runnable examples.
    assert result.attempted > 0, f"{name} has no doctest examples"
