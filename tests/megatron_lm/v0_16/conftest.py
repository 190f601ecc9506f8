# Copyright (c) 2025 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# Adapted from Megatron-LM's tests/unit_tests/conftest.py: https://github.com/NVIDIA/Megatron-LM,
# tag core_v0.16.1 (commit 55ac7082517c3878ae653c07c09c534b8aed49f6). Licensed under Megatron-LM's LICENSE (see tests/megatron_lm/LICENSE).
# Kept: experimental, pytest_sessionfinish, cleanup, reset_env_vars. Left out: the test-data
# download, the dist-checkpoint directory and the Transformer Engine variables (no test here uses
# them). Added ("hypergrid:"): torch.distributed is started once per session, with Utils, before
# the first test, as in Megatron-LM's CI where earlier tests of the same session have started it.

import os

import pytest
import torch
import torch.distributed

from megatron.core import config
from tests.megatron_lm.v0_16.utilities import Utils


def pytest_addoption(parser):
    """
    Additional command-line arguments passed to pytest.
    For now:
        --experimental: Enable the Mcore experimental flag (DEFAULT: False)
    """
    parser.addoption(
        '--experimental',
        action='store_true',
        help="pass that argument to enable experimental flag during testing (DEFAULT: False)",
    )


@pytest.fixture(autouse=True)
def experimental(request):
    """Simple fixture setting the experimental flag [CPU | GPU]"""
    config.ENABLE_EXPERIMENTAL = request.config.getoption("--experimental") is True


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 5:
        session.exitstatus = 0


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    Utils.initialize_distributed()  # hypergrid: started here (see the header)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def reset_env_vars():
    """Reset environment variables"""
    # Store the original environment variables before the test
    original_env = dict(os.environ)

    # Run the test
    yield

    # After the test, restore the original environment
    os.environ.clear()
    os.environ.update(original_env)
