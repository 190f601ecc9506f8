"""Which release of Megatron-Core or torchtitan a plan follows, and how that was decided.

Megatron-Core 0.19 creates process groups 0.16 does not, and torchtitan 0.3 builds other meshes
than 0.2, so a plan (and the communicators it counts) is of one release. The release is given
(a command-line flag), or the installed one, or, with none installed, the newest one hypergrid
follows. :class:`Followed` records which and why, for the report to say so.

Pure: package versions are read from the installed distributions' metadata, nothing is imported.

Example::

    >>> Followed("torchtitan", "0.3", ReleaseChoice.GIVEN).describe()
    'torchtitan 0.3 (given)'
    >>> Followed("megatron-core", "0.19.2", ReleaseChoice.INSTALLED).describe()
    'megatron-core 0.19.2 (the installed one)'
    >>> installed_version("no-such-distribution-here") is None
    True
"""

from __future__ import annotations

import enum
import importlib.metadata
from dataclasses import dataclass
from typing import Optional

__all__ = ["ReleaseChoice", "Followed", "installed_version"]


class ReleaseChoice(str, enum.Enum):
    """How the release a plan follows was chosen."""

    #: Named by the caller (``--megatron-core-version``, ``--torchtitan-version``, an argument).
    GIVEN = "given"
    #: The installed package's, read from its files.
    INSTALLED = "installed"
    #: None installed (or one hypergrid does not follow): the newest release hypergrid follows.
    NEWEST = "newest"


@dataclass(frozen=True)
class Followed:
    """The release of ``project`` a plan follows, how it was chosen, and what is installed.

    ``installed`` is the installed version where one is and it was not the one followed (a
    release given over it, or one hypergrid does not follow).

    Example::

        >>> Followed("torchtitan", "0.3", ReleaseChoice.NEWEST, installed="0.4.0").describe()
        'torchtitan 0.3 (the newest followed; the installed 0.4.0 is not)'
        >>> Followed("torchtitan", "0.2", ReleaseChoice.GIVEN, installed="0.3.0").as_dict()["installed"]
        '0.3.0'
    """

    project: str
    release: str
    chosen_by: ReleaseChoice
    installed: Optional[str] = None

    def describe(self) -> str:
        """The release and why, in a few words, for the report."""
        if self.chosen_by is ReleaseChoice.GIVEN:
            why = "given" + (f"; {self.installed} is installed" if self.installed else "")
        elif self.chosen_by is ReleaseChoice.INSTALLED:
            why = f"the installed {self.installed}" if self.installed else "the installed one"
        elif self.installed:
            why = f"the newest followed; the installed {self.installed} is not"
        else:
            why = f"the newest followed; {self.project} is not installed"
        return f"{self.project} {self.release} ({why})"

    def as_dict(self) -> dict[str, Optional[str]]:
        """JSON-ready fields (see docs/cli.md)."""
        return {"project": self.project, "release": self.release, "chosen_by": self.chosen_by.value,
                "installed": self.installed, "description": self.describe()}


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (``"megatron-core"``, ``"torchtitan"``), or None.

    Read from the package metadata: nothing is imported (megatron-core's import alone takes
    seconds and loads torch).

    Example::

        >>> installed_version("surely-not-installed-anywhere") is None
        True
    """
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
