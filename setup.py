"""Packaging for hypergrid. The only runtime dependency is torch."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="hypergrid",
    version="0.1.0",
    description=(
        "N-dimensional parallel-state manager for PyTorch: Megatron-Core compatible process "
        "groups and DeviceMeshes from one grid, each rank building only its own groups"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hypergrid", "hypergrid.*"]),
    package_data={"hypergrid": ["py.typed"]},
    python_requires=">=3.10",
    # Tested on torch 2.13.0 to 2.15.0 (CI runs both ends). What hypergrid needs from torch
    # (split_group, use_local_synchronization, DeviceMesh's _MeshLayout internals) is detected
    # at run time, not inferred from the version; 2.13.0 is the oldest torch that has it all.
    install_requires=["torch>=2.13.0"],
    extras_require={
        # The adapter is tested against 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12); pip picks
        # the newest release the interpreter can run.
        "megatron": ["megatron-core>=0.16.1,<0.20"],
        # Pictures of a plan (`hypergrid plan --png/--svg`, hypergrid.planning.viz.write_picture) only.
        "viz": ["matplotlib>=3.8"],
        # The documentation: Markdown pages (MyST) and an API reference from the docstrings,
        # built with `python -m sphinx -W -b html docs docs/_build`.
        "docs": ["sphinx>=8", "myst-parser>=4"],
        # einops: only Megatron-Core's own HyperCommGrid needs it, for the parity tests;
        # matplotlib: the picture tests; Sphinx and myst-parser: tests/test_docs.py builds the
        # docs with warnings as errors; expecttest: torch's own test helpers import it
        # (tests/torch_upstream runs torch's DeviceMesh tests, from a pytorch checkout).
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "expecttest>=0.2",
            "einops>=0.8",
            "megatron-core>=0.16.1,<0.20",
            "matplotlib>=3.8",
            "sphinx>=8",
            "myst-parser>=4",
        ],
        # The checks .ci/run makes before the tests: `ruff check .` (settings in ruff.toml) and
        # `mypy` (settings in setup.cfg, [mypy]); pinned, as a newer release may find new things.
        "lint": ["ruff==0.17.6", "mypy==2.4.1"],
    },
    entry_points={"console_scripts": ["hypergrid=hypergrid.app.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
)
