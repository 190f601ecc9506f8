"""The pytest plugin (``-p tests.torch_upstream.plugin``) under which torch's DeviceMesh tests run.

torch's ``test/distributed/test_device_mesh.py`` runs as torch has it; everything that differs in
our runs is done here, from outside, before pytest imports the file
(:func:`pytest_configure`):

* with ``HYPERGRID_ROUTE_MESHES=1`` (the hypergrid run), ``hypergrid.route_device_meshes()`` is on
  before any mesh exists, in the pytest process whose forked ranks run the tests: every group
  those tests' meshes need comes from hypergrid's registry;
* ``DTensorTestBase`` forks its ranks instead of spawning them, in both runs (torch's
  ``MultiProcessTestCase`` offers both; a spawned rank imports torch again, seconds on two cores
  for each of some 80 tests and 4 to 8 ranks);
* each rank reports who made its groups (:mod:`tests.torch_upstream.witness`).

Example::

    >>> # python -m pytest -p tests.torch_upstream.plugin test_device_mesh.py
"""

from __future__ import annotations

import os
from typing import Any

import pytest

#: Environment variable: ``1`` routes every DeviceMesh of the run through hypergrid.
ROUTE_ENV = "HYPERGRID_ROUTE_MESHES"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(ROUTE_ENV) == "1":
        import hypergrid

        hypergrid.route_device_meshes()
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase

    from tests.torch_upstream import witness

    witness.install(DTensorTestBase)

    def set_up_forked(self: Any) -> None:
        # DTensorTestBase.setUp with its ranks started by fork rather than spawn.
        import torch.multiprocessing

        super(DTensorTestBase, self).setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    DTensorTestBase.setUp = set_up_forked
