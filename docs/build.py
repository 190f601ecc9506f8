"""Build hypergrid's documentation: ``python docs/build.py`` writes ``docs/_build/``.

Pure standard library, no network: every ``docs/*.md`` page is rendered to HTML by the small
Markdown subset below (headings, paragraphs, lists, tables, fenced code, inline code, links,
images), the API reference (``api.md`` and ``api.html``) is generated from the docstrings of the
public modules with :mod:`inspect`, and the pictures are drawn by :mod:`hypergrid.viz`.

    python docs/build.py                      # docs/_build/*.html, api.md, pictures
    python docs/build.py --out /tmp/site      # somewhere else
    python docs/build.py --update-pictures    # also refresh the committed docs/*.svg
"""

from __future__ import annotations

import argparse
import html
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # build from a checkout without installing

#: Modules whose public names (``__all__``) make the API reference, in reading order.
API_MODULES = [
    "hypergrid",
    "hypergrid.grid",
    "hypergrid.layout",
    "hypergrid.groups",
    "hypergrid.errors",
    "hypergrid.mesh",
    "hypergrid.megatron",
    "hypergrid.megatron.plan",
    "hypergrid.megatron.config",
    "hypergrid.report",
    "hypergrid.viz",
    "hypergrid.parity",
    "hypergrid.demo",
    "hypergrid.cli",
]

#: Pictures committed next to the pages: file -> (plan arguments, colouring kind, gpus per node).
PICTURES = {
    "concepts.svg": ({"shape": [2, 3, 4], "dim_names": ["tp", "cp", "dp"]}, "cp", 6),
}


# ---------------------------------------------------------------------------- markdown
def _inline(text: str) -> str:
    parts = re.split(r"(`[^`]+`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
            continue
        part = html.escape(part, quote=False)
        part = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", r'<img alt="\1" src="\2">', part)
        # Links to other pages point at their HTML.
        part = re.sub(r"\[([^\]]+)\]\(([^)]+?)\.md(#[^)]*)?\)", r'<a href="\2.html\3">\1</a>', part)
        part = re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r'<a href="\2">\1</a>', part)
        part = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", part)
        out.append(part)
    return "".join(out)


def markdown_to_html(text: str) -> str:
    """Render the Markdown subset the docs use.

    Example::

        >>> markdown_to_html("# T\\n\\nsome `code`")
        '<h1 id="t">T</h1>\\n<p>some <code>code</code></p>'
    """
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang = line[3:].strip()
            body = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            i += 1
            cls = f' class="language-{html.escape(lang)}"' if lang else ""
            out.append(f"<pre><code{cls}>{html.escape(chr(10).join(body))}</code></pre>")
            continue
        heading = re.match(r"(#{1,6}) (.*)", line)
        if heading:
            level, title = len(heading.group(1)), heading.group(2).strip()
            anchor = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
            out.append(f'<h{level} id="{anchor}">{_inline(title)}</h{level}>')
            i += 1
            continue
        if line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                    rows.append(cells)
                i += 1
            head, *body_rows = rows
            table = ["<table>", "<tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>"]
            table += ["<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in body_rows]
            out.append("\n".join(table + ["</table>"]))
            continue
        if re.match(r"\s*([-*]|\d+\.) ", line):
            ordered = bool(re.match(r"\s*\d+\. ", line))
            items: list[str] = []
            while i < len(lines) and (re.match(r"\s*([-*]|\d+\.) ", lines[i]) or (lines[i].startswith("  ") and items)):
                item = re.match(r"\s*(?:[-*]|\d+\.) (.*)", lines[i])
                if item:
                    items.append(item.group(1))
                else:
                    items[-1] += " " + lines[i].strip()
                i += 1
            tag = "ol" if ordered else "ul"
            out.append(f"<{tag}>" + "".join(f"<li>{_inline(t)}</li>" for t in items) + f"</{tag}>")
            continue
        if not line.strip():
            i += 1
            continue
        para = []
        while i < len(lines) and lines[i].strip() and not re.match(r"(#{1,6} |```|\||\s*([-*]|\d+\.) )", lines[i]):
            para.append(lines[i].strip())
            i += 1
        out.append(f"<p>{_inline(' '.join(para))}</p>")
    return "\n".join(out)


_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title} - hypergrid</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; padding: 0 1em; line-height: 1.45; }}
pre {{ background: #f4f4f4; padding: .8em; overflow-x: auto; }}
code {{ font-size: 90%; }} table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ccc; padding: .2em .5em; }} nav a {{ margin-right: 1em; }}
</style></head><body>
<nav>{nav}</nav>
{body}
</body></html>
"""

_NAV = [("index", "Home"), ("quickstart", "Quickstart"), ("concepts", "Concepts"), ("migrating", "Migrating"),
        ("megatron", "Megatron"), ("devicemesh", "DeviceMesh"), ("errors", "Errors"), ("cli", "CLI"), ("cluster", "Cluster"), ("api", "API")]


def _page(title: str, body: str, present: set[str]) -> str:
    nav = "".join(f'<a href="{name}.html">{label}</a>' for name, label in _NAV if name in present)
    return _PAGE.format(title=html.escape(title), nav=nav, body=body)


# ---------------------------------------------------------------------------- API reference
def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""


def _doc_block(doc: str) -> str:
    # Docstrings are reStructuredText-ish; shown verbatim in a code block they stay exact.
    return "```text\n" + doc.strip() + "\n```\n" if doc else ""


def api_markdown(modules: list[str] = API_MODULES) -> str:
    """The API reference as Markdown, from each module's ``__all__`` and docstrings.

    Example::

        >>> "### `HyperCommGrid" in api_markdown(["hypergrid.grid"])
        True
    """
    out = ["# API reference", "", "Generated from the docstrings by `python docs/build.py`.", ""]
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # an optional dependency missing: say so, build the rest
            out += [f"## `{name}`", "", f"Not importable here: {exc}", ""]
            continue
        out += [f"## `{name}`", "", _doc_block(inspect.getdoc(module) or "")]
        for public in getattr(module, "__all__", []):
            obj = getattr(module, public, None)
            if obj is None or inspect.ismodule(obj):
                continue
            if getattr(obj, "__module__", name) != name and name != "hypergrid" and not name.endswith("megatron"):
                continue  # documented where it is defined
            if name in ("hypergrid", "hypergrid.megatron") and (inspect.isclass(obj) or inspect.isfunction(obj)):
                out.append(f"- `{public}`: see `{obj.__module__}`")
                continue
            if inspect.isclass(obj):
                out += [f"### `{public}{_signature(obj)}`", "", _doc_block(inspect.getdoc(obj) or "")]
                for attr, member in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    target = member.fget if isinstance(member, property) else member
                    if isinstance(member, (staticmethod, classmethod)):
                        target = member.__func__
                    if not callable(target) or not (inspect.getdoc(target) or ""):
                        continue
                    kind = "property " if isinstance(member, property) else ""
                    sig = "" if isinstance(member, property) else _signature(target)
                    out += [f"#### {kind}`{public}.{attr}{sig}`", "", _doc_block(inspect.getdoc(target) or "")]
            elif callable(obj):
                out += [f"### `{public}{_signature(obj)}`", "", _doc_block(inspect.getdoc(obj) or "")]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------- pictures
def write_pictures(target: Path) -> list[Path]:
    """Draw :data:`PICTURES` into ``target`` (a folder); return the files written."""
    from hypergrid.report import plan_grid
    from hypergrid.viz import picture, write_picture

    written = []
    for filename, (grid, kind, gpus_per_node) in PICTURES.items():
        plan = plan_grid(grid["shape"], grid["dim_names"])
        path = target / filename
        write_picture(picture(plan, kind, gpus_per_node), str(path))
        written.append(path)
    return written


def build(out: Path, update_pictures: bool = False) -> list[Path]:
    """Build the site into ``out``; return the HTML pages written.

    Example::

        >>> import tempfile
        >>> pages = build(Path(tempfile.mkdtemp()))   # doctest: +SKIP
    """
    out.mkdir(parents=True, exist_ok=True)
    sources = {p.stem: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}
    sources["api"] = api_markdown()
    (out / "api.md").write_text(sources["api"], encoding="utf-8")
    present = set(sources)
    pages = []
    for stem, text in sources.items():
        title = next((line[2:] for line in text.splitlines() if line.startswith("# ")), stem)
        page = out / f"{stem}.html"
        page.write_text(_page(title, markdown_to_html(text), present), encoding="utf-8")
        pages.append(page)
    write_pictures(out)
    if update_pictures:
        write_pictures(DOCS)
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build hypergrid's documentation into docs/_build/.")
    parser.add_argument("--out", type=Path, default=DOCS / "_build", help="output folder (default docs/_build)")
    parser.add_argument("--update-pictures", action="store_true", help="also rewrite the committed docs/*.svg")
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        # megatron-core, imported for its adapter's docstrings, warns about absent CUDA extras.
        warnings.simplefilter("ignore")
        pages = build(args.out, update_pictures=args.update_pictures)
    print(f"wrote {len(pages)} pages and the API reference to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
