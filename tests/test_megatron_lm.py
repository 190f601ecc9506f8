"""Megatron-LM's own unit tests, on Megatron-Core and on hypergrid: what passes on one passes on both.

Runs Megatron-LM's ``test_hyper_comm_grid.py``, ``test_process_groups_config.py`` and (with
``HYPERGRID_MEGATRON_LM=full``) ``test_parallel_state.py``, from the checkout named by
``HYPERGRID_MEGATRON_LM_SOURCE`` at the tag that matches the installed megatron-core, on 8 gloo
ranks (see :mod:`tests.megatron_lm.launch` and :mod:`tests.megatron_lm.checkout`); the other
tag's case is skipped. Without the variable both cases skip, saying how to get the checkout.
By default under a minute on 2 cores; with ``HYPERGRID_MEGATRON_LM=full`` about 2 minutes (each
parallel_state test initializes model parallelism twice on 8 gloo ranks).
Every test must pass on hypergrid where it passes on Megatron-Core, except the differences listed
in :data:`KNOWN_DIFFERENCES`, each with its reason; one of those that starts passing fails this
test too, so that the list only shrinks. Run with ``-s`` to see the counts.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.megatron_lm.checkout import TAGS, SourceUnavailable, find_source, installed_megatron_core, release_of
from tests.megatron_lm.launch import run_suite

#: Megatron-LM's suite on 8 gloo ranks, minutes per version (tests/README.md).
pytestmark = [pytest.mark.gloo, pytest.mark.slow]

#: Tests that pass on Megatron-Core and not (yet) on hypergrid, by megatron-core release, with the
#: reason. Test ids are "<module path>::<test>[<params>]" as the launcher reports them, e.g.
#: "tests.unit_tests.test_parallel_state::test_initialize_and_destroy_model_parallel[tp-cp-ep-dp-pp]".
#: Empty: everything that passes on Megatron-Core passes on hypergrid, for both releases.
KNOWN_DIFFERENCES: dict[str, dict[str, str]] = {release: {} for release in TAGS}


@pytest.mark.parametrize("release", sorted(TAGS))
def test_megatron_lm_unit_tests_pass_on_hypergrid(release):
    version = installed_megatron_core()
    if version is None:
        pytest.skip("megatron-core is not installed")
    if release_of(version) != release:
        pytest.skip(f"Megatron-LM's {TAGS[release]} tests are for megatron-core {release}; {version} is installed")
    try:
        find_source(version)
    except SourceUnavailable as why:
        pytest.skip(str(why))
    full = os.environ.get("HYPERGRID_MEGATRON_LM") == "full"
    result = run_suite(timeout_s=2400.0, pytest_args=() if full else ("-k", "not test_parallel_state"))
    print("\n" + result.report(), file=sys.stderr)
    assert result.counts("mcore")["passed"] >= 20, "the control run passed almost nothing: the harness is broken"
    known = {t: why for t, why in KNOWN_DIFFERENCES[release].items() if full or "test_parallel_state" not in t}
    unexpected = [t for t in result.regressions if t not in known]
    assert not unexpected, f"pass on Megatron-Core, fail on hypergrid: {unexpected}\n{result.report()}"
    fixed = [t for t in known if t in result.outcomes and result.outcomes[t]["hypergrid"].status == "passed"]
    assert not fixed, f"listed as known differences but pass on hypergrid now (remove them): {fixed}"
