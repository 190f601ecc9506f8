"""torch's own DeviceMesh tests, on torch's groups and on hypergrid's: what passes on one passes on both.

Runs PyTorch's ``test/distributed/test_device_mesh.py``, from the checkout named by
``HYPERGRID_TORCH_TESTS_SOURCE`` (skipped without it, saying where to get the file), twice with
the installed torch, gloo ranks on CPU: as torch has it, and with
``hypergrid.route_device_meshes()`` on in every rank, so that every mesh those tests build,
flatten, unflatten, slice or concatenate gets its groups from hypergrid's registry (see
:mod:`tests.torch_upstream.compare`). Every test that passes on torch must pass on hypergrid,
except the differences listed in :data:`KNOWN_DIFFERENCES`, each with its reason; one of those that
starts passing fails this test too, so that the list only shrinks. Run with ``-s`` to see the counts.
"""

from __future__ import annotations

import sys

import pytest

from tests.torch_upstream.compare import SourceUnavailable, compare_runs, find_tests

#: Some 80 multi-process tests, twice: minutes on 2 cores (tests/README.md).
pytestmark = [pytest.mark.gloo, pytest.mark.slow]

#: Tests that pass on torch's groups and not on hypergrid's, with the reason ("Class::test").
KNOWN_DIFFERENCES: dict[str, str] = {}


def test_torch_device_mesh_tests_pass_on_hypergrid():
    try:
        find_tests()
    except SourceUnavailable as why:
        pytest.skip(str(why))
    result = compare_runs()
    print("\n" + result.report(), file=sys.stderr)
    assert result.counts("torch")["passed"] >= 30, (
        f"the control run passed almost nothing: the harness is broken\n{result.logs['torch'][-3000:]}")
    unexpected = [t for t in result.regressions if t not in KNOWN_DIFFERENCES]
    assert not unexpected, f"pass on torch, fail on hypergrid: {unexpected}\n{result.report()}"
    fixed = [t for t in KNOWN_DIFFERENCES if result.outcomes.get(t, {}).get("hypergrid") is not None
             and result.outcomes[t]["hypergrid"].status == "passed"]
    assert not fixed, f"listed as known differences but pass on hypergrid now (remove them): {fixed}"
