"""The docs build with one command, and every Python example in them runs.

Each fenced ``python`` block of ``docs/*.md`` runs in a fresh namespace. A block starting with
``# doc-test: world N`` runs as rank 0 of an N-rank world on torch's fake backend (it shows code
that runs inside a job); ``# doc-test: skip`` is allowed only for blocks that need a multi-node
cluster, and says why.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from xml.etree import ElementTree

import pytest

from tests.harness import fake_world

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


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


@pytest.mark.slow
def test_docs_build_with_one_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(DOCS / "build.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for page in ("index", "quickstart", "concepts", "migrating", "cli", "cluster", "api"):
        html = (tmp_path / f"{page}.html").read_text(encoding="utf-8")
        assert "<h1" in html and "</html>" in html
    api = (tmp_path / "api.html").read_text(encoding="utf-8")
    # Generated from the docstrings: signatures and docstring text of the public API.
    assert "HyperCommGrid.create_pg" in api and "group_ranks" in api
    assert "The members of the" in api
    concepts = (tmp_path / "concepts.html").read_text(encoding="utf-8")
    assert '<img alt="' in concepts and 'src="concepts.svg"' in concepts
    assert 'href="quickstart.html"' in (tmp_path / "index.html").read_text(encoding="utf-8")
    ElementTree.parse(tmp_path / "concepts.svg")


def test_committed_picture_is_what_the_builder_draws(tmp_path):
    sys.path.insert(0, str(DOCS))
    try:
        import build  # docs/build.py
    finally:
        sys.path.remove(str(DOCS))
    build.write_pictures(tmp_path)
    for name in build.PICTURES:
        assert (tmp_path / name).read_text() == (DOCS / name).read_text(), (
            f"docs/{name} is stale: run python docs/build.py --update-pictures"
        )
