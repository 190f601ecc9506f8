"""The conftest of each rank of a Megatron-LM unit-test job: every test twice, on Megatron-Core
(the control) and on hypergrid.

Not a conftest of this repository: :func:`tests.megatron_lm.checkout.build_tree` writes it as
``tests/unit_tests/conftest.py`` in the temporary tree where Megatron-LM's test files run, in place
of Megatron-LM's own conftest (which downloads test data and sets Transformer Engine's variables,
neither of which these files use). :mod:`tests.megatron_lm.launch` starts 8 ranks, each running
pytest on that tree, as torchrun runs Megatron-LM's unit tests.

What it does, from outside the test files:

* torch.distributed is started once per session (gloo, :class:`Utils`), before the first test,
  as in Megatron-LM's CI where earlier tests of the same session have started it; ended at the
  end of the session;
* every test sees Megatron-Core's experimental flag off and gets the environment back as it was;
* tests that need CUDA devices (:data:`NEEDS_CUDA`) are skipped, with the reason, when there is
  none;
* every test is parametrized by the :func:`implementation` fixture:

``mcore``
    Megatron-Core as installed, untouched.
``hypergrid``
    The test module's ``HyperCommGrid`` is ``hypergrid.HyperCommGrid`` and
    ``parallel_state.initialize_model_parallel`` / ``destroy_model_parallel`` are hypergrid's
    Megatron adapter. A test that patches ``torch.distributed.new_subgroups_by_enumeration`` and
    expects the mock's group back runs with hypergrid's strategy ``"enumerate"``
    (:func:`hypergrid.runtime.modes.set_default_strategy`), the strategy that calls torch's
    constructor exactly as Megatron-Core does; every other test runs with the default.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from unittest import mock

import pytest
import torch

HERE = Path(__file__).parent

#: Tests that cannot run without CUDA devices, by megatron-core release and node id after the
#: file, and why. Skipped (and counted as such) when CUDA is not available.
NEEDS_CUDA: dict[tuple[str, str], str] = {}
for _release in ("0.16", "0.19"):
    _integration = "test_hyper_comm_grid.py::TestHyperCommGridIntegration::"
    NEEDS_CUDA.update({
        (_release, _integration + "test_real_distributed_process_group_creation"): "NCCL groups (backend='nccl')",
        (_release, _integration + "test_real_distributed_multi_dimensional_groups"): "NCCL groups (backend='nccl')",
        (_release, _integration + "test_real_distributed_all_reduce"): "all_reduce of CUDA tensors over NCCL",
        (_release, _integration + "test_real_distributed_different_world_sizes"): "all_reduce of CUDA tensors over NCCL",
        (_release, _integration + "test_real_distributed_rank_enumeration_verification"): "all_reduce of CUDA tensors",
    })
NEEDS_CUDA[("0.19", "test_hyper_comm_grid.py::TestHyperCommGridIntegration::test_real_distributed_registered_view")] = (
    "NCCL groups and all_reduce of CUDA tensors"
)
NEEDS_CUDA[("0.19", "test_parallel_state.py::test_expert_all_gather_group")] = "NCCL groups (backend='nccl')"


def _release() -> str:
    major, minor = metadata.version("megatron-core").split(".")[:2]
    return f"{major}.{minor}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    release = _release()
    for item in items:
        path = Path(str(item.fspath))
        node = path.name + "::" + "::".join(item.nodeid.split("::")[1:]).split("[")[0]
        reason = NEEDS_CUDA.get((release, node))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {reason}"))


@pytest.fixture(scope="session", autouse=True)
def distributed() -> Iterator[None]:
    """This rank's gloo world, from before the first test to after the last."""
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_distributed()
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_environment() -> Iterator[None]:
    """Megatron-Core's experimental flag off, and ``os.environ`` back as it was after the test."""
    from megatron.core import config

    config.ENABLE_EXPERIMENTAL = False
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _patches_enumeration(function: object) -> bool:
    """Whether a test is decorated with ``@patch('torch.distributed.new_subgroups_by_enumeration')``."""
    return any(
        getattr(patching, "attribute", None) == "new_subgroups_by_enumeration"
        for patching in getattr(function, "patchings", ())
    )


@pytest.fixture
def release_leaked_groups() -> Iterator[None]:
    """After each test, destroy the process groups it left in torch (the default group stays).

    Megatron-Core's ``destroy_model_parallel`` drops its references but does not destroy its
    groups, so on gloo every test would leave its communicators and their threads (some 180 per
    rank per initialization) to the rest of the session; with 8 ranks on a small machine the job
    then slows to a crawl. Nothing a test checks depends on them. Groups hypergrid's registry
    still holds (grids a test did not destroy) stay: hypergrid may hand them out again, as it
    would in any long-lived process.
    """
    yield
    import torch.distributed as dist

    from hypergrid.runtime.registry import REGISTRY

    if not dist.is_initialized():
        return
    world = dist.distributed_c10d._get_default_group()
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is not world and not REGISTRY.holders_of(pg):
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - already torn down by the test
                pass


@pytest.fixture(autouse=True, params=["mcore", "hypergrid"])
def implementation(request: pytest.FixtureRequest, release_leaked_groups: None) -> Iterator[str]:
    """Which implementation this run of the test exercises (see the module docstring)."""
    if request.param == "mcore":
        yield "mcore"
        return
    import megatron.core.parallel_state as ps

    import hypergrid
    import hypergrid.megatron as hg_megatron
    from hypergrid.runtime.modes import set_default_strategy

    megatron_destroy = ps.destroy_model_parallel

    def destroy_model_parallel() -> None:
        # hypergrid's destroy calls Megatron-Core's own for its globals: give it that one.
        ps.destroy_model_parallel = megatron_destroy
        try:
            hg_megatron.destroy_model_parallel()
        finally:
            ps.destroy_model_parallel = destroy_model_parallel

    with mock.patch.object(ps, "initialize_model_parallel", hg_megatron.initialize_model_parallel), \
            mock.patch.object(ps, "destroy_model_parallel", destroy_model_parallel):
        patched = mock.patch.object(request.module, "HyperCommGrid", hypergrid.HyperCommGrid) \
            if hasattr(request.module, "HyperCommGrid") else None
        if patched is not None:
            patched.start()
        if _patches_enumeration(request.function):
            set_default_strategy("enumerate")
        try:
            yield "hypergrid"
        finally:
            set_default_strategy(None)
            if patched is not None:
                patched.stop()
            # A test that failed half-way must not leave hypergrid's state to the next one.
            destroy_model_parallel()


try:
    import pytest_mock  # noqa: F401  (provides ``mocker``)
except ImportError:

    class _Mocker:
        """The part of pytest-mock's ``mocker`` Megatron-LM's tests use, when it is not installed."""

        Mock = mock.Mock
        MagicMock = mock.MagicMock

        def __init__(self) -> None:
            self._patches: list = []

        def patch(self, *args, **kwargs):
            patcher = mock.patch(*args, **kwargs)
            self._patches.append(patcher)
            return patcher.start()

        def stopall(self) -> None:
            for patcher in reversed(self._patches):
                patcher.stop()
            self._patches.clear()

    @pytest.fixture
    def mocker() -> Iterator[_Mocker]:
        instance = _Mocker()
        yield instance
        instance.stopall()
