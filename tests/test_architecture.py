"""The layers of docs/architecture.md, enforced: who may import whom, where torch's private names
live, and how long a file may grow.

Every module of the package has a layer; a module imports only modules of lower layers (lazy
imports inside functions included, so no import circle can hide there). A new module must be
placed here before its first import is allowed.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hypergrid"

#: module (relative to the package, dotted) -> layer. Lower layers never import higher ones.
LAYERS = {
    # pure values and rank arithmetic: no torch.distributed
    "errors": 0,
    "_lazy": 0,
    "group_args": 0,
    "releases": 0,
    "layout": 1,
    "kinds": 2,
    "megatron.features": 1,
    "megatron.lm_flags": 0,
    "megatron.config": 2,
    "megatron.plan": 3,
    "report": 4,
    "torchtitan": 5,
    "cost": 5,
    "report_text": 6,
    "plan_args": 6,
    # torch, wrapped once: c10d's internals, then DeviceMesh's
    "_torch_compat": 1,
    "_mesh_compat": 2,
    # group creation
    "strategy": 2,
    "agreement": 2,
    "group_options": 2,
    "groups": 3,
    # the public grid
    "grid": 4,
    # adapters
    "mesh_groups": 5,
    "mesh": 6,
    "megatron.grids": 5,
    "megatron.collection": 6,
    "megatron.initialize": 6,
    # tools on top
    "parity": 5,
    "viz": 5,
    "megatron.launch_args": 5,
    "launcher": 6,
    "demo": 7,
    "console": 7,
    "cli": 8,
    # package facades
    "megatron": 7,
    "": 9,
    "__main__": 10,
}

#: Modules that must not import torch.distributed at all: planning works without a process group.
PURE = {"_lazy", "errors", "releases", "layout", "kinds", "megatron.features", "megatron.config", "megatron.plan",
        "report", "torchtitan", "megatron.lm_flags", "megatron.launch_args", "cost", "report_text", "group_args",
        "launcher", "console", "plan_args"}

#: Code lines (docstrings, comments and blank lines not counted) a module may have, and the
#: modules allowed more, with the reason.
MAX_CODE_LINES = 410
LONGER = {
    "agreement": "one protocol (publish, lead, follow, diagnose the absent, end-of-step checkpoint) "
    "whose waits and diagnoses share the round's keys and states; split, one state machine would span two files",
    "grid": "HyperCommGrid is one public class, Megatron-Core's, with its views; its methods stay together",
    "megatron.config": "one value: Megatron-Core's 30-odd keywords, the sizes derived from them and their "
    "checks in Megatron-Core's order, each check a method of its own",
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Package modules ``name`` imports, anywhere in the file (function-level imports too)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    parts = name.split(".") if name else []
    package = parts if is_package else parts[:-1]
    known = set(_modules())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else list(package)
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "hypergrid":
                target = node.module.split(".")[1:]
            else:
                continue
            module = ".".join(target)
            for alias in node.names:
                sub = f"{module}.{alias.name}" if module else alias.name
                found.add(sub if sub in known else module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hypergrid":
                    found.add(".".join(alias.name.split(".")[1:]))
    found.discard(name)
    return found


def test_every_module_has_a_layer():
    missing = sorted(set(_modules()) - set(LAYERS))
    assert not missing, f"place these modules in LAYERS (and docs/architecture.md): {missing}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_a_module_imports_only_lower_layers(name):
    path = _modules()[name]
    upward = sorted(
        f"{imported} (layer {LAYERS.get(imported)})"
        for imported in _imports(name, path)
        if LAYERS.get(imported, 99) >= LAYERS[name]
    )
    assert not upward, f"{name} (layer {LAYERS[name]}) imports {upward}: a module imports only lower layers"


@pytest.mark.parametrize("name", sorted(PURE))
def test_planning_modules_need_no_torch_distributed(name):
    tree = ast.parse(_modules()[name].read_text())
    for node in ast.walk(tree):
        # A relative import is one of hypergrid's own modules (".torchtitan" is not torch).
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        )
        for module in modules:
            assert not module.startswith("torch"), f"{name} imports {module}: planning must work without torch"


def _private_torch_names(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain = node.value
            parts = []
            while isinstance(chain, ast.Attribute):
                parts.append(chain.attr)
                chain = chain.value
            if isinstance(chain, ast.Name):
                parts.append(chain.id)
            if {"dist", "torch", "distributed_c10d", "c10d"} & set(parts):
                names.append(".".join(reversed(parts)) + "." + node.attr)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private or any(part.startswith("_") for part in (node.module or "").split(".")):
                names.append(f"from {node.module} import {[a.name for a in node.names]}")
    return names


#: The only modules that may touch torch's private names: c10d's, and DeviceMesh's.
COMPAT = {"_torch_compat", "_mesh_compat"}


@pytest.mark.parametrize("name", sorted(set(_modules()) - COMPAT))
def test_private_torch_names_only_in_the_compat_modules(name):
    found = _private_torch_names(ast.parse(_modules()[name].read_text()))
    assert not found, f"{name} uses torch internals {found}: go through hypergrid._torch_compat or _mesh_compat"


def _code_lines(path: pathlib.Path) -> int:
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


@pytest.mark.parametrize("name", sorted(_modules()))
def test_a_module_stays_short_or_says_why(name):
    lines = _code_lines(_modules()[name])
    if name in LONGER:
        return
    assert lines <= MAX_CODE_LINES, (
        f"{name} has {lines} lines of code (more than {MAX_CODE_LINES}): split it along its concerns, "
        f"or add it to LONGER with the reason"
    )


def test_the_checker_sees_an_upward_import(tmp_path):
    # The check itself can fail: a layout module importing the grid is caught.
    fake = tmp_path / "layout.py"
    fake.write_text("from .grid import HyperCommGrid\n\ndef f():\n    from . import cli\n")
    assert _imports("layout", fake) == {"grid", "cli"}
    assert _private_torch_names(ast.parse("import torch.distributed as dist\ndist.distributed_c10d._world\n"))
