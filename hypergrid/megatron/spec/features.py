"""What a megatron-core version's ``initialize_model_parallel`` offers, as plain data.

Pure Python: no megatron import. :class:`MegatronFeatures` is the list of keywords one
megatron-core's ``initialize_model_parallel`` takes (in signature order, for positional
arguments) and the version to name in messages. Everything version-dependent in the planning
modules follows from it by *feature*: the plan makes the generalized tensor-parallel
("gtp_remat") groups when ``gtp_remat_size`` is a keyword, the separate all-gather group when
``create_all_gather_group`` is, and so on. :func:`hypergrid.megatron.initialize.installed_features`
reads the installed module's signature with :mod:`inspect` to build one, and
:func:`read_installed_features` reads the same keywords from the installed source file without
importing it (what the planner uses: no torch, no seconds of import); the profiles here describe
the supported releases for planning without megatron-core installed. :func:`choose_megatron_core`
decides which one a plan follows.

Example::

    >>> MEGATRON_CORE_0_19.gtp_remat, MEGATRON_CORE_0_16.gtp_remat
    (True, False)
    >>> MEGATRON_CORE_0_16.check_keywords(["gtp_remat_size"])
    Traceback (most recent call last):
    ...
    TypeError: initialize_model_parallel() got keyword argument(s) ['gtp_remat_size'] that megatron-core 0.16.1 does not have; its keywords are [...]
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...releases import Followed, ReleaseChoice, installed_version

__all__ = [
    "MegatronFeatures",
    "MEGATRON_CORE_0_16",
    "MEGATRON_CORE_0_19",
    "COMMON_FEATURES",
    "SUPPORTED_PROFILES",
    "MEGATRON_CORE_RELEASES",
    "keywords_in_source",
    "read_installed_features",
    "choose_megatron_core",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MegatronFeatures:
    """The keywords of one megatron-core's ``initialize_model_parallel``, and its version.

    ``version`` is only used in messages: decisions are made from ``keywords``.

    Example::

        >>> features = MegatronFeatures("9.9", ("tensor_model_parallel_size", "rank_offset"))
        >>> features.rank_offset, features.accepts("rank_offset"), features.accepts("order")
        (True, True, False)
    """

    version: str
    keywords: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.version, str):
            raise TypeError(f"version must be a str, got {type(self.version).__name__} {self.version!r}")
        if isinstance(self.keywords, str) or not all(isinstance(k, str) for k in self.keywords):
            raise TypeError(f"keywords must be a tuple of keyword names, got {self.keywords!r}")
        # Frozen: normalise a list given by the caller into the hashable tuple the field promises.
        object.__setattr__(self, "keywords", tuple(self.keywords))

    def accepts(self, keyword: str) -> bool:
        """Whether ``keyword`` is a parameter of this version's ``initialize_model_parallel``."""
        return keyword in self.keywords

    @property
    def gtp_remat(self) -> bool:
        """Generalized tensor parallelism with weight rematerialization (dense side), a
        ``gtp_remat`` axis in the dense grid and its groups, created even at size 1."""
        return self.accepts("gtp_remat_size")

    @property
    def expert_gtp_remat(self) -> bool:
        """The expert-side ``gtp_remat`` axis, its groups and the EGTP-merged tp-ep-pp group."""
        return self.accepts("expert_gtp_remat_size")

    @property
    def all_gather_keyword(self) -> bool:
        """``create_all_gather_group=True`` makes a second dp-cp communicator during
        initialization (megatron-core 0.16; later versions have ``create_all_gather_groups()``)."""
        return self.accepts("create_all_gather_group")

    @property
    def rank_offset(self) -> bool:
        """The grids may start at a rank other than 0."""
        return self.accepts("rank_offset")

    @property
    def local_world_size(self) -> bool:
        """The grids may span fewer ranks than the world."""
        return self.accepts("local_world_size")

    def check_keywords(self, names: Iterable[str]) -> None:
        """Raise ``TypeError`` naming every keyword in ``names`` this version does not take.

        Example::

            >>> MEGATRON_CORE_0_19.check_keywords(["order", "rank_offset"])   # both known: no error
        """
        unknown = sorted(set(names) - set(self.keywords))
        if unknown:
            raise TypeError(
                f"initialize_model_parallel() got keyword argument(s) {unknown} that megatron-core "
                f"{self.version} does not have; its keywords are {list(self.keywords)}"
            )


_KEYWORDS_0_16 = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_comm_backend",
    "use_sharp",
    "context_parallel_size",
    "hierarchical_context_parallel_sizes",
    "hybrid_context_parallel",
    "expert_model_parallel_size",
    "num_distributed_optimizer_instances",
    "expert_tensor_parallel_size",
    "nccl_communicator_config_path",
    "distributed_timeout_minutes",
    "order",
    "get_embedding_ranks",
    "get_position_embedding_ranks",
    "create_gloo_process_groups",
    "high_priority_stream_groups",
    "sharp_enabled_group",
    "create_all_gather_group",
)

_KEYWORDS_0_19 = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_comm_backend",
    "use_sharp",
    "context_parallel_size",
    "hierarchical_context_parallel_sizes",
    "hybrid_context_parallel",
    "expert_model_parallel_size",
    "gtp_remat_size",
    "expert_gtp_remat_size",
    "num_distributed_optimizer_instances",
    "expert_tensor_parallel_size",
    "nccl_communicator_config_path",
    "distributed_timeout_minutes",
    "order",
    "get_embedding_ranks",
    "get_position_embedding_ranks",
    "create_gloo_process_groups",
    "high_priority_stream_groups",
    "sharp_enabled_group",
    "rank_offset",
    "local_world_size",
)

#: megatron-core 0.16.1 (the last release for Python 3.11).
MEGATRON_CORE_0_16 = MegatronFeatures("0.16.1", _KEYWORDS_0_16)
#: megatron-core 0.19.2 (Python 3.12).
MEGATRON_CORE_0_19 = MegatronFeatures("0.19.2", _KEYWORDS_0_19)
#: The releases hypergrid.megatron is tested against, oldest first.
SUPPORTED_PROFILES = (MEGATRON_CORE_0_16, MEGATRON_CORE_0_19)
#: The keywords every supported release takes, what the pure planner assumes when told nothing
#: else, so that its groups are the ones every supported megatron-core creates.
COMMON_FEATURES = MegatronFeatures(
    "0.16.1 to 0.19.2 (the keywords all of them take)",
    tuple(k for k in _KEYWORDS_0_16 if k in _KEYWORDS_0_19),
)
#: The releases a plan can be asked to follow (``--megatron-core-version``), by release line.
MEGATRON_CORE_RELEASES = {"0.16": MEGATRON_CORE_0_16, "0.19": MEGATRON_CORE_0_19}


def keywords_in_source(source: str) -> Optional[tuple[str, ...]]:
    """The keywords of ``initialize_model_parallel`` defined in ``source`` (the text of a
    megatron-core ``parallel_state.py``), in signature order; None where it defines none.

    The same names :mod:`inspect` reports for the imported function: its positional-or-keyword
    and keyword-only parameters.

    Example::

        >>> keywords_in_source("def initialize_model_parallel(tensor_model_parallel_size=1, *, order='tp'): pass")
        ('tensor_model_parallel_size', 'order')
        >>> keywords_in_source("x = 1") is None
        True
    """
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "initialize_model_parallel":
            return tuple(a.arg for a in node.args.args + node.args.kwonlyargs)
    return None


@functools.lru_cache(maxsize=1)
def read_installed_features() -> Optional[MegatronFeatures]:
    """The installed megatron-core's ``initialize_model_parallel`` keywords, read from its
    ``megatron/core/parallel_state.py`` where ``import megatron.core`` would find it, without
    importing it; None where megatron-core is not installed (or its file defines no such function).

    Example::

        >>> features = read_installed_features()
        >>> features is None or features.accepts("tensor_model_parallel_size")
        True
    """
    spec = importlib.util.find_spec("megatron")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / "core" / "parallel_state.py"
        if not path.is_file():
            continue
        keywords = keywords_in_source(path.read_text(encoding="utf-8"))
        if keywords is None:
            logger.warning("%s defines no initialize_model_parallel; megatron-core's groups are not read from it", path)
            return None
        return MegatronFeatures(installed_version("megatron-core") or "(version unknown)", keywords)
    return None


def choose_megatron_core(release: Optional[str] = None) -> tuple[MegatronFeatures, Followed]:
    """The megatron-core whose groups a plan follows: ``release`` where given (``"0.16"``,
    ``"0.19"`` or a profile's full version), else the installed one (read by
    :func:`read_installed_features`, whatever its version), else the newest profile.

    Example::

        >>> features, followed = choose_megatron_core("0.16")
        >>> features is MEGATRON_CORE_0_16, followed.release, followed.chosen_by.value
        (True, '0.16.1', 'given')
        >>> choose_megatron_core("0.17")
        Traceback (most recent call last):
        ...
        ValueError: megatron-core release '0.17' is not one hypergrid follows; expected one of ['0.16', '0.19']
    """
    installed = installed_version("megatron-core")
    if release is not None:
        profile = MEGATRON_CORE_RELEASES.get(release) or next(
            (p for p in SUPPORTED_PROFILES if p.version == release), None)
        if profile is None:
            raise ValueError(f"megatron-core release {release!r} is not one hypergrid follows; "
                             f"expected one of {list(MEGATRON_CORE_RELEASES)}")
        other = installed if installed is not None and installed != profile.version else None
        return profile, Followed("megatron-core", profile.version, ReleaseChoice.GIVEN, other)
    found = read_installed_features()
    if found is not None:
        return found, Followed("megatron-core", found.version, ReleaseChoice.INSTALLED)
    newest = SUPPORTED_PROFILES[-1]
    return newest, Followed("megatron-core", newest.version, ReleaseChoice.NEWEST, installed)
