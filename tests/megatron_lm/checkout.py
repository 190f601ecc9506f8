"""Where Megatron-LM's unit tests come from: a checkout named by ``HYPERGRID_MEGATRON_LM_SOURCE``.

No file of Megatron-LM is kept in this repository. The harness reads the test files from a
checkout of https://github.com/NVIDIA/Megatron-LM at run time and puts them, with our own
``Utils`` (:mod:`tests.megatron_lm.utilities`) and our own conftest
(:mod:`tests.megatron_lm.ranks_conftest`), into a temporary tree laid out as Megatron-LM's
``tests/unit_tests/`` is, so that the files import what they import in Megatron-LM
(``from tests.unit_tests.test_utilities import Utils``) and run as they are.

The variable names either

* a working tree of Megatron-LM at a supported tag (its ``megatron/core/package_info.py`` gives
  the release; it must match the installed megatron-core's major.minor), or
* a git directory holding the tags of :data:`TAGS` (a clone's ``.git``, a bare clone, or a clone
  whose working tree is at another tag): the files are taken from the tag that matches the
  installed megatron-core with ``git show``, whatever is checked out.

Example::

    >>> sorted(TAGS.items())
    [('0.16', 'core_v0.16.1'), ('0.19', 'core_v0.19.0')]
    >>> release_of("0.19.2+211cec5")
    '0.19'
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

#: The environment variable naming the checkout.
SOURCE_ENV = "HYPERGRID_MEGATRON_LM_SOURCE"

#: megatron-core major.minor -> the Megatron-LM tag whose unit tests run against it. There is no
#: core_v0.19.2 tag; installed 0.19.2's hyper_comm_grid.py, parallel_state.py and
#: process_groups_config.py equal core_v0.19.0's, and so do the test files at core_r0.19.0's tip.
TAGS = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}

#: Megatron-LM's test files that run, under ``tests/unit_tests/`` in its repository.
TEST_FILES = ("test_hyper_comm_grid.py", "test_parallel_state.py", "test_process_groups_config.py")
UNIT_TESTS = "tests/unit_tests"

HERE = Path(__file__).parent

#: How to get a checkout; every skip for a missing one says it.
HOW_TO_GET = (
    f"{SOURCE_ENV} names a Megatron-LM checkout: `git clone https://github.com/NVIDIA/Megatron-LM`, "
    "then `git -C Megatron-LM checkout core_v0.16.1` (megatron-core 0.16) or `core_v0.19.0` (0.19); "
    "or name the clone itself, whose git directory holds both tags: the harness takes the files of the "
    "tag that matches the installed megatron-core"
)


class SourceUnavailable(Exception):
    """This checkout cannot give the tests for the installed megatron-core (the message says why)."""


def installed_megatron_core() -> Optional[str]:
    """The installed megatron-core's version, or ``None``; read from its metadata (no import)."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def release_of(version: str) -> str:
    """``"0.19.2+local"`` -> ``"0.19"``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if not found:
        raise ValueError(f"not a megatron-core version: {version!r}")
    return f"{found.group(1)}.{found.group(2)}"


@dataclass(frozen=True)
class Source:
    """Where the test files of one tag were found."""

    path: Path
    tag: str
    #: ``"working tree"`` or ``"git"``
    kind: str
    #: The commit the files come from, where git can say (working trees outside git: ``None``).
    commit: Optional[str] = None

    def describe(self) -> str:
        at = f" ({self.commit[:12]})" if self.commit else ""
        return f"{self.tag}{at} from the {self.kind} at {self.path}"


def _git(git_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, text=True, check=False)


def _git_dir_of(path: Path) -> Optional[Path]:
    """The git directory at ``path`` (a bare clone) or in it (``path/.git``), if any."""
    for candidate in (path / ".git", path):
        if (candidate / "HEAD").is_file() and (candidate / "objects").is_dir():
            return candidate
    return None


def _working_tree_release(path: Path) -> Optional[str]:
    info = path / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    text = info.read_text(encoding="utf-8")
    major = re.search(r"^MAJOR\s*=\s*(\d+)", text, re.M)
    minor = re.search(r"^MINOR\s*=\s*(\d+)", text, re.M)
    return f"{major.group(1)}.{minor.group(1)}" if major and minor else None


def find_source(megatron_version: str, source: Optional[str] = None) -> Source:
    """Where the unit tests for ``megatron_version`` are, in the checkout named by ``source``
    (default: :data:`SOURCE_ENV`).

    Raises :class:`SourceUnavailable` when the variable is unset or the checkout holds neither a
    working tree at the matching release nor its tag, and ``ValueError`` for a path that is not a
    Megatron-LM checkout at all.
    """
    release = release_of(megatron_version)
    if release not in TAGS:
        raise SourceUnavailable(
            f"no Megatron-LM tag is known for megatron-core {megatron_version} (known: "
            + ", ".join(f"{r} -> {t}" for r, t in sorted(TAGS.items())) + ")")
    tag = TAGS[release]
    source = source if source is not None else os.environ.get(SOURCE_ENV)
    if not source:
        raise SourceUnavailable(f"{SOURCE_ENV} is not set. {HOW_TO_GET}")
    path = Path(source).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"{SOURCE_ENV}={source!r} is not a directory. {HOW_TO_GET}")
    tree_release = _working_tree_release(path)
    git_dir = _git_dir_of(path)
    if tree_release == release and all((path / UNIT_TESTS / name).is_file() for name in TEST_FILES):
        commit = None
        if git_dir is not None:
            head = _git(git_dir, "rev-parse", "HEAD")
            commit = head.stdout.strip() if head.returncode == 0 else None
        return Source(path, tag, "working tree", commit)
    if git_dir is not None:
        found = _git(git_dir, "rev-parse", "--verify", "--quiet", f"refs/tags/{tag}^{{commit}}")
        if found.returncode == 0:
            return Source(git_dir, tag, "git", found.stdout.strip())
        raise SourceUnavailable(
            f"megatron-core {megatron_version} is installed: its tests are Megatron-LM's tag {tag}, which "
            f"the git directory {git_dir} does not hold (`git -C {path} fetch --tags`, or check out {tag})")
    if tree_release is not None:
        raise SourceUnavailable(
            f"{SOURCE_ENV} is a Megatron-LM working tree of release {tree_release}; megatron-core "
            f"{megatron_version} is installed, whose tests are Megatron-LM's tag {tag}: check that tag out, "
            "or name a git directory holding it")
    raise ValueError(f"{SOURCE_ENV}={source!r} is neither a Megatron-LM working tree nor a git directory. {HOW_TO_GET}")


def build_tree(source: Source, dest: Path) -> Path:
    """Lay out ``dest`` as Megatron-LM's ``tests/unit_tests/``: its test files from ``source``,
    our ``Utils`` as ``test_utilities.py`` and our conftest. Returns the directory to run pytest on.

    The test files are written as the checkout has them, byte for byte; what differs on gloo
    and CPU (``Utils``, the start of torch.distributed, tests that need CUDA) is in our two files.
    """
    unit_tests = dest / UNIT_TESTS
    unit_tests.mkdir(parents=True)
    for package in (dest / "tests", unit_tests):
        (package / "__init__.py").write_text("", encoding="utf-8")
    for name in TEST_FILES:
        if source.kind == "working tree":
            shutil.copyfile(source.path / UNIT_TESTS / name, unit_tests / name)
            continue
        shown = subprocess.run(["git", f"--git-dir={source.path}", "show", f"{source.commit}:{UNIT_TESTS}/{name}"],
                               capture_output=True, check=False)
        if shown.returncode != 0:
            raise SourceUnavailable(f"{source.tag} has no {UNIT_TESTS}/{name}: {shown.stderr.decode(errors='replace').strip()}")
        (unit_tests / name).write_bytes(shown.stdout)
    shutil.copyfile(HERE / "utilities.py", unit_tests / "test_utilities.py")
    shutil.copyfile(HERE / "ranks_conftest.py", unit_tests / "conftest.py")
    # Megatron-LM's markers, registered; warnings filtered as this repository's setup.cfg does.
    (dest / "pytest.ini").write_text(
        "[pytest]\n"
        "markers =\n    internal: Megatron-LM's marker\n    flaky: Megatron-LM's marker\n"
        "    flaky_in_dev: Megatron-LM's marker\n"
        "filterwarnings =\n    ignore::DeprecationWarning\n    ignore::UserWarning\n",
        encoding="utf-8")
    return unit_tests
