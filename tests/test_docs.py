"""The docs build with Sphinx without a warning, and every Python example in them runs.

Each fenced ``python`` block of ``docs/*.md`` runs in a fresh namespace. A block starting with
``# doc-test: world N`` runs as rank 0 of an N-rank world on torch's fake backend (it shows code
that runs inside a job), and its next lines say how to do the same alone (:data:`ALONE`; run so in
a process of their own too); ``# doc-test: skip`` is allowed only for blocks that need a
multi-node cluster, and says why and how to launch it. The site is built as CI would, ``python -m sphinx -W --keep-going -b html
docs OUT``, and any warning (a broken docstring, a link to a missing page) fails the test.
A ``text`` block that starts with ``$ hypergrid ...`` shows a command and its output: the command
is run, and every line shown (but ``...`` and timings) must be among the lines it prints.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from xml.etree import ElementTree

import pytest

from hypergrid.app import cli
from tests.harness import fake_world

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Any fence whose language says Python: each must be a plain ```python block, which BLOCK runs.
PYTHON_FENCE = re.compile(r"^```\s*(\{[\w-]+\}\s*)?(python3?|py|pycon|ipython3?)\b.*$", re.M | re.I)


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for i, match in enumerate(BLOCK.finditer(page.read_text(encoding="utf-8"))):
            found.append((page.name, i, match.group(1)))
    return found


BLOCKS = _blocks()


def test_docs_have_examples_on_every_page_of_ours():
    pages = {name for name, _, _ in BLOCKS}
    for page in ("quickstart.md", "concepts.md", "migrating.md", "cli.md", "cluster.md"):
        assert page in pages, f"{page} has no python example"


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{p}#{i}" for p, i, _ in BLOCKS])
def test_doc_example_runs(page, index, code):
    first = code.splitlines()[0] if code.strip() else ""
    if first.startswith("# doc-test: skip"):
        assert "multi-node" in first, f"{page} block {index}: skip only examples that need a multi-node job"
        compile(code, f"{page}#{index}", "exec")  # it must at least be valid Python
        return
    world = re.match(r"# doc-test: world (\d+)", first)
    namespace: dict = {"__name__": f"doc_{page}_{index}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if world:
            with fake_world(0, int(world.group(1))):
                exec(compile(code, f"{page}#{index}", "exec"), namespace)
        else:
            exec(compile(code, f"{page}#{index}", "exec"), namespace)


#: The lines after "# doc-test: world N" that say how to run the example alone: the same fake-backend
#: set-up the test makes, as comments to copy.
ALONE = ("# Alone (no job): first play rank 0 of {n} on torch's fake backend:",
         "#   import torch.distributed as dist; from torch.testing._internal.distributed.fake_pg import FakeStore",
         '#   dist.init_process_group("fake", store=FakeStore(), rank=0, world_size={n})')


def test_every_example_says_how_to_run_it_alone():
    # A plain block runs alone as it is; one shown inside a job says how to play its rank alone, and
    # a multi-node one how to launch it.
    for page, index, code in BLOCKS:
        lines = code.splitlines()
        world = re.match(r"# doc-test: world (\d+)$", lines[0] if lines else "")
        if world:
            assert tuple(lines[1:4]) == tuple(line.format(n=world.group(1)) for line in ALONE), (page, index, lines[:4])
        elif lines and lines[0].startswith("# doc-test: skip"):
            assert lines[1].startswith("# Alone: "), (page, index, lines[:2])
        else:
            assert not any(line.startswith("# doc-test") for line in lines), (page, index)


@pytest.mark.slow
def test_the_examples_run_alone_as_they_say(tmp_path):
    # Each "world N" example with its "Alone" lines uncommented, in a process of its own with no
    # harness: one fresh process runs them one after the other, each in a fresh namespace.
    scripts = []
    for page, index, code in BLOCKS:
        lines = code.splitlines()
        if re.match(r"# doc-test: world \d+$", lines[0] if lines else ""):
            setup = [line[len("#   "):] for line in lines[2:4]]
            scripts.append((f"{page}#{index}", "\n".join(setup + lines[4:])))
    assert len(scripts) >= 10
    runner = tmp_path / "run_alone.py"
    runner.write_text(
        "import json, sys, warnings\n"
        "import torch.distributed as dist\n"
        "from hypergrid.runtime.registry import REGISTRY\n"
        "warnings.simplefilter('ignore')\n"
        "for name, code in json.load(open(sys.argv[1])):\n"
        "    exec(compile(code, name, 'exec'), {'__name__': name})\n"
        "    assert dist.is_initialized(), name\n"
        "    dist.destroy_process_group(); REGISTRY.reset()\n"
        "    print('ran', name)\n")
    listing = tmp_path / "examples.json"
    listing.write_text(json.dumps(scripts))
    proc = subprocess.run([sys.executable, str(runner), str(listing)], capture_output=True, text=True, timeout=600,
                          cwd=DOCS.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ran ") == len(scripts)


# A shown command line and what it prints: ```text blocks whose first line is "$ hypergrid ...".
SHOWN_RUN = re.compile(r"^```text\n\$ hypergrid ([^\n]*)\n(.*?)^```", re.S | re.M)
TIMING = re.compile(r" in [0-9.]+s$")


def _shown_runs() -> list[tuple[str, str, str]]:
    return [(page.name, match.group(1), match.group(2)) for page in sorted(DOCS.glob("*.md"))
            for match in SHOWN_RUN.finditer(page.read_text(encoding="utf-8"))]


SHOWN_RUNS = _shown_runs()


def test_the_cli_pages_show_runs():
    assert len([run for run in SHOWN_RUNS if run[0] == "cli.md"]) >= 3


@pytest.mark.parametrize("page,command,shown", SHOWN_RUNS, ids=[f"{p}:{c.split()[0]}#{i}" for i, (p, c, _) in
                                                                 enumerate(SHOWN_RUNS)])
def test_shown_output_is_what_the_command_prints(page, command, shown, capsys, monkeypatch):
    # Run from the repository root, where the docs' example files are found as the pages name them.
    monkeypatch.chdir(DOCS.parent)
    assert cli.main(shlex.split(command)) == 0
    # Timings differ from run to run; every other line shown must be printed as shown ("..." stands
    # for lines left out).
    printed = [TIMING.sub("", line) for line in capsys.readouterr().out.splitlines()]
    for line in shown.splitlines():
        if line != "...":
            assert TIMING.sub("", line) in printed, (f"{page}: shown but not printed", line, printed)


# Command lines in ```bash blocks that answer without a job: plan and check.
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
PLAN_OR_CHECK = re.compile(r"^(?:python3? -m )?hypergrid (plan|check)\b")


def _shown_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in BASH_BLOCK.finditer(page.read_text(encoding="utf-8")):
            for line in block.group(1).replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if PLAN_OR_CHECK.match(line) and not any(w.startswith("[") for w in words):  # "[--cp N]": a synopsis
                    found.append((page.name, words[words.index("hypergrid") + 1:]))
    return found


SHOWN_COMMANDS = _shown_commands()


def test_the_pages_show_plan_and_check_commands():
    assert {"cli.md", "quickstart.md", "cluster.md"} <= {page for page, _ in SHOWN_COMMANDS}


@pytest.mark.parametrize(
    "page,argv",
    [pytest.param(p, a, marks=[pytest.mark.slow] if a[0] == "check" else []) for p, a in SHOWN_COMMANDS],
    ids=[f"{p}:{' '.join(a[:3])}#{i}" for i, (p, a) in enumerate(SHOWN_COMMANDS)],
)
def test_documented_command_runs(page, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(DOCS.parent)  # the pages name example files from the repository root
    argv = list(argv)
    for i, word in enumerate(argv[:-1]):
        if word in ("--png", "--svg"):  # pictures go to a scratch folder, not over the committed ones
            argv[i + 1] = str(tmp_path / Path(argv[i + 1]).name)
    status = cli.main(argv)
    captured = capsys.readouterr()
    assert status == 0, (page, argv, captured.err)
    assert captured.out.strip() and "Traceback" not in captured.err


def test_every_python_example_is_a_block_that_runs():
    # A ```py or ```{code-block} python fence would render like the others but never run here.
    for page in sorted(DOCS.glob("*.md")):
        for match in PYTHON_FENCE.finditer(page.read_text(encoding="utf-8")):
            assert match.group(0).rstrip() == "```python", (
                f"{page.name}: {match.group(0)!r} is not run by the docs tests; write it as ```python"
            )


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx", reason="the docs build needs Sphinx: pip install -e '.[docs]'")
    pytest.importorskip("myst_parser", reason="the docs build needs myst-parser: pip install -e '.[docs]'")
    out = tmp_path / "html"
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", str(DOCS), str(out)],
        capture_output=True, text=True, timeout=300,
    )
    # Sphinx writes its warnings (and errors) to stderr, its progress to stdout.
    assert proc.returncode == 0, (
        f"the docs build failed or warned (exit {proc.returncode}):\n{proc.stderr[-8000:]}\n"
        f"--- last lines of its output:\n{proc.stdout[-2000:]}"
    )
    for page in [p.stem for p in DOCS.glob("*.md")]:
        html = (out / f"{page}.html").read_text(encoding="utf-8")
        assert "<h1" in html and "</html>" in html
    api = (out / "api.html").read_text(encoding="utf-8")
    # Generated from the docstrings: signatures and docstring text of the public API, the Megatron
    # adapter's group-creating modules included.
    for name in ("hypergrid.grid.HyperCommGrid.create_pg", "hypergrid.layout.GridLayout.group_ranks",
                 "hypergrid.mesh.device_mesh", "hypergrid.megatron.initialize.initialize_model_parallel",
                 "hypergrid.megatron.collection.process_group_collection"):
        assert f'id="{name}"' in api, f"{name} is missing from the API reference"
    assert "The members of the" in api
    concepts = (out / "concepts.html").read_text(encoding="utf-8")
    assert '<img alt="' in concepts and 'src="_images/concepts.svg"' in concepts
    assert 'href="quickstart.html"' in (out / "index.html").read_text(encoding="utf-8")
    ElementTree.parse(out / "_images" / "concepts.svg")


#: The command that draws docs/concepts.svg.
CONCEPTS_PICTURE = ["plan", "--shape", "2,3,4", "--dims", "tp,cp,dp", "--colour", "cp", "--gpus-per-node", "6"]


def test_committed_picture_is_what_the_cli_draws(tmp_path, capsys):
    from hypergrid.app.cli import main

    drawn = tmp_path / "concepts.svg"
    assert main([*CONCEPTS_PICTURE, "--svg", str(drawn)]) == 0
    capsys.readouterr()
    # Compared by what it shows (panels, highlights, fills), not byte for byte: another
    # matplotlib version may write the same picture with other ids and path data.
    def shown(path):
        tree = ElementTree.parse(path)
        ids = sorted(e.get("id") for e in tree.iter() if (e.get("id") or "").startswith(("panel-", "highlight-")))
        fills = sorted({m for e in tree.iter() for m in re.findall(r"fill: ?(#[0-9a-f]{6})", e.get("style") or "")})
        return ids, fills

    assert shown(drawn) == shown(DOCS / "concepts.svg"), (
        "docs/concepts.svg is stale: run python -m hypergrid " + " ".join(CONCEPTS_PICTURE) + " --svg docs/concepts.svg"
    )
