"""Sphinx configuration for hypergrid's documentation.

Build with ``python -m sphinx -W -b html docs docs/_build`` (``pip install -e '.[docs]'``). The
pages are Markdown (MyST); the API reference (``api.md``) is generated from the docstrings by
autodoc. ``tests/test_docs.py`` builds the site with warnings as errors and runs every example.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

# Build from a checkout without installing: the package next to this folder is the documented one.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hypergrid  # noqa: E402

project = "hypergrid"
author = "hypergrid developers"
copyright = "hypergrid developers"
version = release = hypergrid.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: anchors for headings up to ###, so links like megatron.md#supported-versions resolve.
myst_heading_anchors = 3

# Docstrings are Google style (Args:, Returns:, Raises:, Example::).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# The Megatron adapter's group-creating modules import megatron-core; the reference needs only
# their docstrings and signatures, so the docs build without megatron-core installed (and fast).
autodoc_mock_imports = ["megatron"]
# Where megatron-core is installed, the adapter package's lazy names still import it; its import
# warns about optional CUDA extras, which says nothing about the docs.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

# Unresolvable references (torch types, typing aliases) are not errors; every other warning is.
nitpicky = False

html_theme = "alabaster"
html_title = f"hypergrid {release}"
