"""The docstring examples of every hypergrid module stay true.

The modules are found by walking the package, so a new module's examples run without editing
this file. A module that needs megatron-core (the adapter's group-creating modules) is skipped
when megatron-core is not installed, and so is a docstring whose examples stop on its absence;
any other import error fails.

Examples that need a process group make one themselves (torch's fake backend, or a one-rank gloo
world on a ``HashStore``) and destroy it at their end; this test checks that every module leaves
no process group and no hypergrid group behind, so that the examples cannot affect each other or
the tests that run after them in the same process.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import re
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

import hypergrid
from hypergrid.runtime.registry import REGISTRY

#: Modules with no docstring examples of their own: ``python -m hypergrid`` only calls the CLI.
NO_EXAMPLES = {"hypergrid.__main__"}


def _modules() -> list[str]:
    names = [hypergrid.__name__]
    # walk_packages imports each package to find its submodules; hypergrid.megatron imports
    # megatron-core only on first use, so walking works without it.
    for info in pkgutil.walk_packages(hypergrid.__path__, prefix=hypergrid.__name__ + "."):
        names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_every_module_is_collected():
    # The walk itself: a package or module it missed would silently lose its examples.
    for name in ("hypergrid.mesh", "hypergrid.runtime.agreement", "hypergrid.runtime.torch_compat",
                 "hypergrid.megatron.initialize", "hypergrid.megatron.collection"):
        assert name in MODULES


def test_no_commented_out_examples():
    # ">>> # dp = grid.create_pg('dp')" reads like an example and checks nothing. An example that
    # needs several processes is prose and a plain literal block (no ">>>"); one that needs a
    # process group makes one (torch's fake backend) and destroys it.
    package = Path(hypergrid.__file__).parent
    found = [
        f"{path.relative_to(package.parent)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"\s*(>>>|\.\.\.) +#(?! *doctest:)", line)
    ]
    assert not found, "commented-out docstring examples:\n" + "\n".join(found)


def _import(name: str):
    try:
        with warnings.catch_warnings():
            # megatron-core warns at import about optional CUDA extras.
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if _is_megatron_missing(exc):
            pytest.skip(f"{name} needs megatron-core, which is not installed ({exc})")
        raise


def _is_megatron_missing(exc: BaseException) -> bool:
    return isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "megatron"


class _Runner(doctest.DocTestRunner):
    """Notes whether an example failed because megatron-core is not installed."""

    needs_megatron = False

    def report_unexpected_exception(self, out, test, example, exc_info):
        if _is_megatron_missing(exc_info[1]):
            self.needs_megatron = True
        super().report_unexpected_exception(out, test, example, exc_info)


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name, monkeypatch):
    # The examples plan grids with world_size=; a stray WORLD_SIZE or RANK must not change them.
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    module = _import(name)
    assert not dist.is_initialized(), "a process group was left initialised before this module's examples"
    have_megatron = _megatron_installed()
    attempted, failures, problems, skipped = 0, [], [], []
    # One docstring at a time, each in a fresh copy of the module's globals (as doctest.testmod).
    for test in doctest.DocTestFinder().find(module):
        if not test.examples:
            continue
        runner = _Runner(optionflags=doctest.ELLIPSIS)
        out: list[str] = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = runner.run(test, out=out.append)
        finally:
            left_behind = dist.is_initialized()
            if left_behind:  # clean up for the examples and tests that follow
                dist.destroy_process_group()
            groups_left = REGISTRY.count()
            REGISTRY.reset()
        if runner.needs_megatron and not have_megatron:
            # Examples of the Megatron adapter run initialize_model_parallel: not without it.
            skipped.append(test.name)
            continue
        attempted += result.attempted
        if result.failed:
            failures.append("".join(out))
        if left_behind:
            problems.append(f"the examples of {test.name} left a process group initialised")
        if groups_left:
            problems.append(f"the examples of {test.name} left {groups_left} hypergrid groups in the registry")
    assert not failures, f"doctest examples of {name} failed:\n" + "\n".join(failures)
    assert not problems, "\n".join(problems)
    if skipped and not attempted:
        pytest.skip(f"the examples of {name} need megatron-core, which is not installed: {skipped}")
    # A module whose examples were all lost (e.g. turned into comments) would pass vacuously;
    # every module documents itself with runnable examples.
    if name not in NO_EXAMPLES:
        assert attempted > 0, f"{name} has no doctest examples"
