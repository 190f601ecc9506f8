"""Runs Megatron-LM's own unit tests twice: on Megatron-Core (the control) and on hypergrid.

The adapted copies under ``v0_16/`` and ``v0_19/`` are collected only inside a job started by
:mod:`tests.megatron_lm.launch` (8 gloo ranks, each running pytest, as torchrun runs Megatron-LM's
unit tests); a plain ``pytest tests/`` runs them through ``tests/test_megatron_lm.py`` instead.

Every test is parametrized by the :func:`implementation` fixture:

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
from pathlib import Path
from typing import Iterator
from unittest import mock

import pytest
import torch

#: Set by the launcher in every rank of the job; without it the adapted copies are not collected.
RANK_ENV = "HYPERGRID_MLT_RANK"

HERE = Path(__file__).parent

#: Tests that cannot run without CUDA devices, by (version dir, node id after the file), and why.
#: Skipped (and counted as such) when CUDA is not available.
NEEDS_CUDA: dict[tuple[str, str], str] = {}
for _version in ("v0_16", "v0_19"):
    _integration = "test_hyper_comm_grid.py::TestHyperCommGridIntegration::"
    NEEDS_CUDA.update({
        (_version, _integration + "test_real_distributed_process_group_creation"): "NCCL groups (backend='nccl')",
        (_version, _integration + "test_real_distributed_multi_dimensional_groups"): "NCCL groups (backend='nccl')",
        (_version, _integration + "test_real_distributed_all_reduce"): "all_reduce of CUDA tensors over NCCL",
        (_version, _integration + "test_real_distributed_different_world_sizes"): "all_reduce of CUDA tensors over NCCL",
        (_version, _integration + "test_real_distributed_rank_enumeration_verification"): "all_reduce of CUDA tensors",
    })
NEEDS_CUDA[("v0_19", "test_hyper_comm_grid.py::TestHyperCommGridIntegration::test_real_distributed_registered_view")] = (
    "NCCL groups and all_reduce of CUDA tensors"
)
NEEDS_CUDA[("v0_19", "test_parallel_state.py::test_expert_all_gather_group")] = "NCCL groups (backend='nccl')"


def pytest_configure(config: pytest.Config) -> None:
    # Markers the adapted copies keep from Megatron-LM (setup.cfg runs pytest with --strict-markers).
    for marker in ("internal", "flaky", "flaky_in_dev"):
        config.addinivalue_line("markers", f"{marker}: Megatron-LM's own marker, kept in the adapted copies")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Outside the launcher's job these files would each try to start an 8-rank world alone.
    if os.environ.get(RANK_ENV) is None and collection_path.is_relative_to(HERE) and collection_path != HERE:
        return collection_path.name != "conftest.py"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    for item in items:
        path = Path(str(item.fspath))
        if not path.is_relative_to(HERE):
            continue
        node = path.name + "::" + "::".join(item.nodeid.split("::")[1:]).split("[")[0]
        reason = NEEDS_CUDA.get((path.parent.name, node))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {reason}"))


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
        """The part of pytest-mock's ``mocker`` the adapted tests use, when it is not installed."""

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
