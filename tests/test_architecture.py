"""The layers of docs/architecture.md, enforced by folder: who may import whom, where torch's
private names and torch's group constructors live, and how long a file may grow.

A module's layer is its folder's (``hypergrid/runtime/`` is one layer, ``hypergrid/planning/``
another); a module imports only modules of lower layers or of its own folder, lazy imports inside
functions included, and no chain of imports comes back to where it started. A new folder, or a new
module at the top of the package, must be placed here before its first import is allowed.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hypergrid"

#: folder (dotted, relative to the package; "" is the package's own __init__) or top-level module
#: -> layer. A module takes the layer of the longest entry its name starts with.
LAYERS = {
    # values every layer uses: the exceptions, lazy package names, which release a plan follows
    "errors": 0,
    "_lazy": 0,
    "releases": 0,
    # pure: rank arithmetic and the kinds of groups; no torch
    "layout": 1,
    # how ranks talk through the store, no torch: every key, the records, the one meeting, the clients
    "store": 2,
    # Megatron-Core's rules as pure values
    "megatron.spec": 2,
    # the runtime, the only code that makes groups
    "runtime": 3,
    # the public grid; the offline planning tool (pure); who is alive: monitors, the ring, the board
    "grid": 4,
    "planning": 4,
    "liveness": 4,
    # adapters over the grid
    "mesh": 5,
    "megatron": 5,
    # recovery in-process: rounds, re-placing a job's grid and rebuilding its adapters' state
    "recovery": 6,
    # training through failures: a rank's state, its snapshots, the one-call loop
    "training": 7,
    # the applications: command line, demo, local launcher
    "app": 8,
    # the package's public names, and python -m hypergrid
    "": 9,
    "__main__": 10,
}

#: Folders and modules that must not import torch at all: planning works without a process group,
#: and a rank's monitor process imports the store room and its own modules with no torch.
PURE = ("errors", "_lazy", "releases", "layout", "megatron.spec", "planning", "app.launcher", "app.console",
        "app.argtypes", "store", "liveness.ring", "liveness.relay", "liveness.monitor", "liveness.watch",
        "liveness.link", "liveness.board", "liveness.node", "liveness.config", "liveness.process",
        "liveness.poll", "liveness.served", "liveness.calls", "liveness.progress", "recovery.quorum")

#: The only modules that may touch torch's private names: c10d's, DeviceMesh's, and the state a
#: recovery rewrites in place (a DeviceMesh's ranks and groups, FSDP2's cached groups).
COMPAT = {"runtime.torch_compat", "runtime.mesh_compat", "runtime.refresh_compat"}

#: torch.distributed's calls that make groups, and the one that destroys a given group: only the
#: runtime makes them (an application may still end its own world, destroy_process_group()).
GROUP_CALLS = ("new_group", "split_group", "new_subgroups_by_enumeration", "new_subgroups")
GROUP_DESTROY = "destroy_process_group"

#: Code lines (docstrings, comments and blank lines not counted) a module may have, and the
#: modules allowed more, with the reason.
MAX_CODE_LINES = 410
LONGER = {
    "megatron.spec.config": "one value: Megatron-Core's 30-odd keywords, the sizes derived from them and their "
    "checks in Megatron-Core's order, each check a method of its own",
    "liveness.monitor": "one rank's monitor: the roles a node's monitors take in turn (delegate, follower, "
    "standby, alone, its group's board reader) share one state and one loop; each role's mechanics live in "
    "modules of their own (relay, node, watch, calls, fanout)",
}


def _entry(name: str) -> str:
    """The LAYERS entry that places module ``name``: the longest one its dotted name starts with."""
    parts = name.split(".") if name else []
    for length in range(len(parts), -1, -1):
        prefix = ".".join(parts[:length])
        if prefix in LAYERS:
            return prefix
    raise KeyError(name)


def layer_of(name: str) -> int:
    return LAYERS[_entry(name)]


def _is_pure(name: str) -> bool:
    return any(name == folder or name.startswith(folder + ".") for folder in PURE)


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
    missing = []
    for name in _modules():
        try:
            _entry(name)
        except KeyError:
            missing.append(name)
    assert not missing, f"place these modules' folders in LAYERS (and docs/architecture.md): {missing}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_a_module_imports_only_lower_layers_or_its_own_folder(name):
    path = _modules()[name]
    upward = sorted(
        f"{imported} (folder {_entry(imported)!r}, layer {layer_of(imported)})"
        for imported in _imports(name, path)
        if layer_of(imported) > layer_of(name)
        or (layer_of(imported) == layer_of(name) and _entry(imported) != _entry(name))
    )
    assert not upward, (
        f"{name} (folder {_entry(name)!r}, layer {layer_of(name)}) imports {upward}: a module imports "
        f"only lower layers or its own folder"
    )


def test_no_import_comes_back_to_where_it_started():
    modules = _modules()
    graph = {name: _imports(name, path) & set(modules) for name, path in modules.items()}
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack + [nxt])
        done.add(node)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not cycles, f"import circles: {cycles[:5]}"


@pytest.mark.parametrize("name", sorted(n for n in _modules() if _is_pure(n)))
def test_planning_modules_need_no_torch(name):
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


@pytest.mark.parametrize("name", sorted(set(_modules()) - COMPAT))
def test_private_torch_names_only_in_the_compat_modules(name):
    found = _private_torch_names(ast.parse(_modules()[name].read_text()))
    assert not found, f"{name} uses torch internals {found}: go through {sorted(COMPAT)}"


def _group_calls(tree: ast.AST) -> list[str]:
    """Calls of torch.distributed's group constructors and destructor, by name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in GROUP_CALLS or (name == GROUP_DESTROY and (node.args or node.keywords)):
                found.append(f"{name} (line {node.lineno})")
    return found


@pytest.mark.parametrize("name", sorted(n for n in _modules() if _entry(n) != "runtime"))
def test_only_the_runtime_makes_or_destroys_groups(name):
    found = _group_calls(ast.parse(_modules()[name].read_text()))
    assert not found, f"{name} calls {found}: groups are made and destroyed only in hypergrid/runtime/"


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


def test_the_checker_sees_what_it_forbids(tmp_path):
    # Each check can fail: a layout module importing the grid and the application is caught, and
    # so are a private torch name and a group constructor.
    fake = tmp_path / "grid_layout.py"
    fake.write_text("from ..grid import HyperCommGrid\n\ndef f():\n    from .. import app\n")
    assert _imports("layout.grid_layout", fake) == {"grid", "app"}
    assert layer_of("grid") > layer_of("layout.grid_layout") and layer_of("app.cli") > layer_of("layout")
    assert _entry("megatron.spec.plan") == "megatron.spec" and _entry("megatron.state") == "megatron"
    assert _private_torch_names(ast.parse("import torch.distributed as dist\ndist.distributed_c10d._world\n"))
    assert _group_calls(ast.parse("import torch.distributed as dist\ndist.new_group([0, 1])\n"))
    assert _group_calls(ast.parse("dist.destroy_process_group(pg)\n"))
    assert not _group_calls(ast.parse("dist.destroy_process_group()\n"))
