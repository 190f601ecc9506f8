"""torchtitan's layout, read from the ``[parallelism]`` of a job config and planned as its meshes.

torchtitan keeps a job's layout in its ``[parallelism]`` config, and its ``ParallelDims``
(``torchtitan/distributed/parallel_dims.py``) checks the degrees and builds DeviceMeshes from
them. This module reimplements those meshes as pure rank arithmetic, for two releases
(:class:`TorchtitanRelease`); a plan follows one:

* **0.2.0**: one world mesh of the dims ``pp, dp_replicate, dp_shard, cp, tp`` whose degree is
  above 1, slowest first, with ``dp`` (dp_replicate x dp_shard), ``dp_shard_cp`` and ``dp_cp``
  flattened out of it, each where one of its dims is there. With ``expert_parallel_degree > 1``
  ep borrows all of cp (and all of tp when ``expert_tensor_parallel_degree`` is 1) and part of
  dp_shard: dp_shard is split into ``dp_shard_mod_ep`` (slower, always a mesh dim, even of size 1)
  and ``dp_shard_in_ep``, and ``ep`` is flattened too.
* **0.3.0**: no ``expert_tensor_parallel_degree``; a ``spmd_backend`` (:class:`SpmdBackend`).
  ``build_mesh`` unflattens a one-dim world mesh into overlapping meshes, each a new set of
  process groups (torch caches none): ``dataloading`` (pp, batch, cp, tp) with ``loss`` flattened
  from batch x cp; ``dense`` (pp, dp_replicate, dp_shard, cp, tp), or (pp, dp_replicate, fsdp, tp)
  under ``partial_dtensor``; under ``spmd_types`` a forward/backward mesh ``fwdbwd`` (pp, dp, cp,
  tp); and ``sparse`` (pp, dp_replicate, efsdp, ep), efsdp being dp_shard x cp x tp / ep. A dim
  torchtitan does not use is asked on torch's fake backend: degree 1, except ``fsdp`` (always
  real), ``dp_shard`` under ``spmd_types`` and ``full_dtensor``, and ``efsdp`` (real only with
  ep > 1, whatever its degree). 0.3.0 configures a job in Python (``--module``/``--config`` and
  ``--parallelism.*`` flags) instead of a TOML file; its ``ParallelismConfig`` fields keep the
  names, so a ``[parallelism]`` table of them is read here alike.

Which release: the one asked for (``release``, ``--torchtitan-version``), else the installed
torchtitan's, else the newest (:func:`choose_release`).

hypergrid's dims run fastest first, so a mesh's layout is its ``mesh_dim_names`` reversed. The
plan's grid is 0.2's world mesh or 0.3's dense mesh, the other 0.3 meshes its views; each mesh dim
and flattened dim is one kind, named as torchtitan names it. Where 0.3 makes a dim again in a
later mesh, that kind is ``dim@mesh`` (``pp@sparse``): the plain name is the one torchtitan's
``get_mesh`` hands out. Nothing here imports torch: a job config is planned on a laptop.

Example::

    >>> plan = plan_torchtitan('''
    ... [parallelism]
    ... data_parallel_shard_degree = -1
    ... tensor_parallel_degree = 8
    ... ''', world_size=64, release="0.2")
    >>> plan.layout.dim_names, plan.layout.shape
    (('tp', 'dp_shard'), (8, 8))
    >>> [kind.name for kind in plan.kinds]
    ['dp_shard', 'tp', 'dp', 'dp_shard_cp', 'dp_cp']
    >>> plan.groups_of(9)["dp_shard_cp"]
    [1, 9, 17, 25, 33, 41, 49, 57]
    >>> new = plan_torchtitan("[parallelism]\\ntensor_parallel_degree = 8", world_size=64, release="0.3")
    >>> [kind.name for kind in new.kinds][:8]
    ['pp', 'batch', 'cp', 'tp', 'loss', 'pp@dense', 'dp_replicate', 'dp_shard']
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
import os
from dataclasses import dataclass, field
from typing import Optional, Union

import tomllib

from ..layout import GridLayout
from ..layout.checks import positive_int
from ..layout.kinds import BackendChoice, Creation, GroupKind
from ..releases import Followed, ReleaseChoice, installed_version
from .plan import Anchor, Plan

__all__ = [
    "TorchtitanRelease",
    "SpmdBackend",
    "NEWEST_RELEASE",
    "TorchtitanParallelism",
    "TorchtitanMesh",
    "choose_release",
    "read_parallelism",
    "parallelism_overrides",
    "torchtitan_meshes",
    "plan_torchtitan",
    "torchtitan_groups_per_rank",
    "shared_groups_per_rank",
]

logger = logging.getLogger(__name__)


class TorchtitanRelease(str, enum.Enum):
    """A torchtitan release line whose ``ParallelDims`` meshes are followed."""

    V0_2 = "0.2"
    V0_3 = "0.3"


class SpmdBackend(str, enum.Enum):
    """torchtitan 0.3's ``parallelism.spmd_backend``: which dense meshes it builds."""

    PARTIAL_DTENSOR = "partial_dtensor"
    FULL_DTENSOR = "full_dtensor"
    SPMD_TYPES = "spmd_types"


#: What a plan follows when no release is asked for and no torchtitan is installed.
NEWEST_RELEASE = TorchtitanRelease.V0_3

#: What :func:`read_parallelism` and :func:`plan_torchtitan` take: a path, or the TOML text.
Source = Union[str, "os.PathLike[str]"]

# torchtitan's degree fields -> the short names ParallelDims gives them (etp: 0.2 only).
_SHORT = {
    "data_parallel_replicate_degree": "dp_replicate",
    "data_parallel_shard_degree": "dp_shard",
    "tensor_parallel_degree": "tp",
    "context_parallel_degree": "cp",
    "pipeline_parallel_degree": "pp",
    "expert_parallel_degree": "ep",
    "expert_tensor_parallel_degree": "etp",
}

# Each release's parallelism config fields: both refuse any other key (0.2 names the invalid field
# of the TOML file; 0.3's ParallelismConfig is a dataclass taking no other keyword).
_COMMON_FIELDS = (
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
    "tensor_parallel_degree", "pipeline_parallel_degree", "module_fqns_per_model_part",
    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
    "pipeline_parallel_microbatch_size", "context_parallel_degree", "expert_parallel_degree",
)
_FIELDS = {
    TorchtitanRelease.V0_2: frozenset(_COMMON_FIELDS + (
        "enable_compiled_autograd", "disable_loss_parallel", "enable_async_tensor_parallel",
        "context_parallel_rotate_method", "expert_tensor_parallel_degree")),
    TorchtitanRelease.V0_3: frozenset(_COMMON_FIELDS + (
        "enable_fsdp_symm_mem", "enable_sequence_parallel", "spmd_backend", "context_parallel_load_balancer",
        "context_parallel_ptrr_mask_key")),
}


def choose_release(release: Optional[Union[str, TorchtitanRelease]] = None) -> Followed:
    """The torchtitan release a plan follows: ``release`` where given, else the installed
    torchtitan's (read from its package metadata, not imported), else :data:`NEWEST_RELEASE`.

    Example::

        >>> choose_release("0.2").release, choose_release("0.2").chosen_by.value
        ('0.2', 'given')
        >>> choose_release("0.4")
        Traceback (most recent call last):
        ...
        ValueError: torchtitan release '0.4' is not one hypergrid follows; expected one of ['0.2', '0.3']
    """
    installed = installed_version("torchtitan")
    line = ".".join(installed.split(".")[:2]) if installed else None
    known = [r.value for r in TorchtitanRelease]
    if release is not None:
        if release not in known:
            raise ValueError(f"torchtitan release {release!r} is not one hypergrid follows; expected one of {known}")
        chosen = TorchtitanRelease(release).value
        return Followed("torchtitan", chosen, ReleaseChoice.GIVEN, installed if line != chosen else None)
    if line in known:
        return Followed("torchtitan", str(line), ReleaseChoice.INSTALLED, installed)
    if installed is not None:
        logger.warning("torchtitan %s is installed, a release hypergrid does not follow; planning %s's meshes "
                       "(--torchtitan-version to choose)", installed, NEWEST_RELEASE.value)
    return Followed("torchtitan", NEWEST_RELEASE.value, ReleaseChoice.NEWEST, installed)


def _enum(cls: type[enum.Enum], value: object, what: str) -> enum.Enum:
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{what} must be one of {[m.value for m in cls]}, got {value!r}") from None


@dataclass(frozen=True)
class TorchtitanParallelism:
    """The degrees of torchtitan's ``[parallelism]`` config, with its names and defaults, for one release.

    ``data_parallel_shard_degree = -1`` means "what the other degrees leave of the world";
    :meth:`resolved` fills it in, chooses the release where ``release`` is None
    (:func:`choose_release`) and checks the degrees as that release's ``ParallelDims`` does.
    ``expert_tensor_parallel_degree`` is 0.2's only, ``spmd_backend`` 0.3's (None: its default,
    ``spmd_types``). A value torchtitan refuses is a ValueError naming the field.

    Example::

        >>> p = TorchtitanParallelism(tensor_parallel_degree=4, release="0.3")
        >>> p.data_parallel_shard_degree, p.world_size
        (-1, None)
        >>> r = p.resolved(32)
        >>> r.data_parallel_shard_degree, r.world_size, r.spmd_backend.value
        (8, 32, 'spmd_types')
        >>> TorchtitanParallelism(context_parallel_degree=0)
        Traceback (most recent call last):
        ...
        ValueError: parallelism.context_parallel_degree must be an integer >= 1, got 0
        >>> TorchtitanParallelism(expert_tensor_parallel_degree=2, release="0.3")
        Traceback (most recent call last):
        ...
        ValueError: parallelism.expert_tensor_parallel_degree is torchtitan 0.2's (0.3 removed expert tensor parallelism), got 2 with release 0.3
    """

    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    expert_tensor_parallel_degree: int = 1
    spmd_backend: Optional[SpmdBackend] = None
    release: Optional[TorchtitanRelease] = None
    world_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name in _SHORT:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"parallelism.{name} must be an integer, got {type(value).__name__} {value!r}")
            if name == "data_parallel_shard_degree":
                if value != -1 and value < 1:
                    raise ValueError(f"parallelism.{name} must be -1 (fill the world) or >= 1, got {value}")
            elif value < 1:
                raise ValueError(f"parallelism.{name} must be an integer >= 1, got {value}")
        if self.world_size is not None:
            positive_int("world_size", self.world_size)
        # Frozen: normalise strings into the enums the fields promise.
        if self.release is not None:
            object.__setattr__(self, "release", _enum(TorchtitanRelease, self.release, "release"))
        if self.spmd_backend is not None:
            object.__setattr__(self, "spmd_backend", _enum(SpmdBackend, self.spmd_backend, "parallelism.spmd_backend"))
        if self.release is TorchtitanRelease.V0_3 and self.expert_tensor_parallel_degree != 1:
            raise ValueError(f"parallelism.expert_tensor_parallel_degree is torchtitan 0.2's (0.3 removed expert "
                             f"tensor parallelism), got {self.expert_tensor_parallel_degree} with release 0.3")
        if self.release is TorchtitanRelease.V0_2 and self.spmd_backend is not None:
            raise ValueError(f"parallelism.spmd_backend is torchtitan 0.3's, got {self.spmd_backend.value!r} "
                             f"with release 0.2")

    def degrees(self) -> dict[str, int]:
        """The degrees under ``ParallelDims``' short names (``dp_replicate``, ``dp_shard``, ...).

        Example::

            >>> TorchtitanParallelism(pipeline_parallel_degree=2).degrees()["pp"]
            2
        """
        return {short: getattr(self, name) for name, short in _SHORT.items()}

    def resolved(self, world_size: int) -> TorchtitanParallelism:
        """These degrees for ``world_size`` ranks: -1 filled in, the release chosen, checked as
        that release's ``ParallelDims`` checks them.

        The product of dp_replicate, dp_shard, cp, tp and pp must be the world size. With expert
        parallelism, 0.2 wants etp to be tp or 1 and ep to take all of cp (and of tp when etp is 1)
        and a divisor of dp_shard; 0.3 wants ep to divide dp_shard x cp x tp. Each failure is a
        ValueError naming the fields.

        Example::

            >>> TorchtitanParallelism(tensor_parallel_degree=3).resolved(8)
            Traceback (most recent call last):
            ...
            ValueError: parallelism degrees do not fill the world: data_parallel_replicate_degree (1) x data_parallel_shard_degree (2, from -1) x context_parallel_degree (1) x tensor_parallel_degree (3) x pipeline_parallel_degree (1) = 6, but the world has 8 ranks
            >>> TorchtitanParallelism(tensor_parallel_degree=2, expert_parallel_degree=3, release="0.3").resolved(8)
            Traceback (most recent call last):
            ...
            ValueError: parallelism.expert_parallel_degree (3) must divide data_parallel_shard_degree x context_parallel_degree x tensor_parallel_degree (8): torchtitan 0.3 lays efsdp x ep over those ranks
        """
        positive_int("world_size", world_size)
        release = self.release or TorchtitanRelease(choose_release().release)
        d = self.degrees()
        others = d["dp_replicate"] * d["cp"] * d["tp"] * d["pp"]
        shard, filled = d["dp_shard"], d["dp_shard"] == -1
        if filled:
            shard = world_size // others
            if shard < 1:
                raise ValueError(
                    f"parallelism.data_parallel_shard_degree = -1 leaves no rank for sharding: "
                    f"replicate x cp x tp x pp = {others} is more than the world's {world_size} ranks"
                )
        if others * shard != world_size:
            factors = " x ".join(
                f"{name} ({shard}, from -1)" if filled and name == "data_parallel_shard_degree"
                else f"{name} ({shard if name == 'data_parallel_shard_degree' else getattr(self, name)})"
                for name in ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                             "context_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree")
            )
            raise ValueError(
                f"parallelism degrees do not fill the world: {factors} = {others * shard}, "
                f"but the world has {world_size} ranks"
            )
        ep, etp, tp, cp = d["ep"], d["etp"], d["tp"], d["cp"]
        if release is TorchtitanRelease.V0_3 and (shard * cp * tp) % ep:
            raise ValueError(
                f"parallelism.expert_parallel_degree ({ep}) must divide data_parallel_shard_degree x "
                f"context_parallel_degree x tensor_parallel_degree ({shard * cp * tp}): torchtitan 0.3 lays "
                f"efsdp x ep over those ranks"
            )
        if release is TorchtitanRelease.V0_2 and ep > 1:
            if etp not in (tp, 1):
                raise ValueError(
                    f"parallelism.expert_tensor_parallel_degree must be tensor_parallel_degree ({tp}) or 1 "
                    f"when expert_parallel_degree > 1 (torchtitan supports only these), got {etp}"
                )
            borrowed = cp if etp == tp else cp * tp
            what = "context_parallel_degree" if etp == tp else "context_parallel_degree x tensor_parallel_degree"
            if ep % borrowed or (shard * borrowed) % ep:
                raise ValueError(
                    f"parallelism.expert_parallel_degree ({ep}) must be a multiple of {what} ({borrowed}) "
                    f"and divide data_parallel_shard_degree x {what} ({shard * borrowed}): ep borrows all "
                    f"of {'cp' if etp == tp else 'cp and tp'} and part of dp_shard"
                )
        backend = (self.spmd_backend or SpmdBackend.SPMD_TYPES) if release is TorchtitanRelease.V0_3 else None
        return dataclasses.replace(self, data_parallel_shard_degree=shard, world_size=world_size, release=release,
                                   spmd_backend=backend)


def _source_text(source: Source) -> tuple[str, str]:
    """(where, text): a path is read, a string holding TOML (a newline, ``=`` or ``[``) is the text."""
    if isinstance(source, str) and ("\n" in source or "=" in source or source.lstrip().startswith("[")):
        return "<torchtitan job config>", source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"expected a path or TOML text, got {type(source).__name__} {source!r}")
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as handle:
            return path, handle.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the torchtitan job config: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: the torchtitan job config is not UTF-8 text: {exc.reason}") from None


def read_parallelism(source: Optional[Source], world_size: Optional[int] = None,
                     release: Optional[Union[str, TorchtitanRelease]] = None,
                     overrides: Optional[dict[str, object]] = None) -> TorchtitanParallelism:
    """The ``[parallelism]`` degrees of a torchtitan job config (a path, or the TOML text; None:
    torchtitan's defaults), with ``overrides`` (:func:`parallelism_overrides`, torchtitan's
    ``--parallelism.NAME VALUE`` flags) over them, as torchtitan's command line sets them.

    ``release`` (default: :func:`choose_release`) decides which keys the section may have: those
    of that release's parallelism config, as torchtitan refuses any other (0.3 has no
    ``expert_tensor_parallel_degree``, 0.2 no ``spmd_backend``); keys other than the degrees are
    otherwise left alone; a misspelt key is told the closest field. A missing section means
    torchtitan's defaults. With ``world_size`` the
    degrees come back :meth:`~TorchtitanParallelism.resolved`. Malformed TOML is a ValueError
    naming the file and the line; a value of the wrong type names its field.

    Example::

        >>> text = '''
        ... [parallelism]
        ... data_parallel_replicate_degree = 2
        ... tensor_parallel_degree = 4
        ... '''
        >>> read_parallelism(text, world_size=64).data_parallel_shard_degree
        8
        >>> read_parallelism("[parallelism]\\ntensor_parallel_degree = 2\\nx y = 3")
        Traceback (most recent call last):
        ...
        ValueError: <torchtitan job config>: malformed TOML: Expected '=' after a key in a key/value pair (at line 3, column 3)
        >>> read_parallelism("[parallelism]\\nexpert_tensor_parallel_degree = 1", release="0.3")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: <torchtitan job config>: parallelism.expert_tensor_parallel_degree is not a field of torchtitan 0.3's parallelism config, which refuses it (0.3 removed expert tensor parallelism; --torchtitan-version 0.2 reads a 0.2 job config); its fields: [...]
    """
    where, text = ("<torchtitan defaults>", "") if source is None else _source_text(source)
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        if "at end of document" in message:  # tomllib names no line there: the last one is meant
            message += f" (line {text.count(chr(10)) + 1}, the last)"
        raise ValueError(f"{where}: malformed TOML: {message}") from None
    section = config.get("parallelism", {})
    if not isinstance(section, dict):
        raise ValueError(f"{where}: [parallelism] must be a table, got {type(section).__name__} {section!r}")
    chosen = TorchtitanRelease(choose_release(release).release)
    unknown = sorted(set(section) - _FIELDS[chosen])
    if unknown:
        raise ValueError(f"{where}: {_unknown_field(unknown[0], chosen, 'parallelism.')}")
    if overrides:
        for name in overrides:
            if name not in _FIELDS[chosen]:
                raise ValueError(_unknown_field(name, chosen, "--parallelism."))
        section = {**section, **overrides}
        where = "--parallelism flags" if source is None else f"{where} with --parallelism flags"
    given = {name: section[name] for name in (*_SHORT, "spmd_backend") if name in section}
    try:
        parallelism = TorchtitanParallelism(**given, release=chosen)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return parallelism if world_size is None else parallelism.resolved(world_size)


def _unknown_field(name: str, release: TorchtitanRelease, prefix: str) -> str:
    """Why ``name`` is refused by ``release``'s parallelism config, with the closest field."""
    why = {"expert_tensor_parallel_degree": "0.3 removed expert tensor parallelism",
           "spmd_backend": "0.2 has no spmd_backend"}.get(name, "a misspelt or another release's key")
    other = "0.2" if release is TorchtitanRelease.V0_3 else "0.3"
    close = difflib.get_close_matches(name, sorted(_FIELDS[release]), n=1)
    hint = f"did you mean {prefix}{close[0]}? " if close and name not in _FIELDS[TorchtitanRelease(other)] else ""
    return (f"{prefix}{name} is not a field of torchtitan {release.value}'s parallelism config, which refuses it "
            f"({why}; --torchtitan-version {other} reads a {other} job config); {hint}its fields: "
            f"{sorted(_FIELDS[release])}")


def parallelism_overrides(tokens: list[str]) -> dict[str, object]:
    """torchtitan's ``--parallelism.NAME VALUE`` flags (``NAME`` with underscores or hyphens, as
    torchtitan's command line takes them; ``--parallelism.NAME=VALUE``; a switch alone, or
    ``--parallelism.no-NAME``) as ``{field: value}``: the degrees as integers, other values as
    given. Which fields exist is the release's to say (:func:`read_parallelism`).

    Example::

        >>> parallelism_overrides(["--parallelism.tensor_parallel_degree", "8",
        ...                        "--parallelism.pipeline-parallel-degree=4", "--parallelism.no-disable-loss-parallel"])
        {'tensor_parallel_degree': 8, 'pipeline_parallel_degree': 4, 'disable_loss_parallel': False}
    """
    out: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        flag, equals, value = tokens[i].partition("=")
        i += 1
        if not flag.startswith("--parallelism."):
            raise ValueError(f"unexpected {tokens[i - 1]!r}: torchtitan's flags go as --parallelism.NAME VALUE")
        name = flag[len("--parallelism."):].replace("-", "_")
        values = [value] if equals else []
        while not equals and i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        if name.startswith("no_") and not values:
            out[name[3:]] = False
            continue
        if name in _SHORT:
            if len(values) != 1 or not values[0].lstrip("-").isdigit():
                raise ValueError(f"{flag} expects an integer, got {' '.join(values) or 'none'}")
            out[name] = int(values[0])
        else:
            out[name] = values[0] if len(values) == 1 else (values or True)
    return out


@dataclass(frozen=True)
class TorchtitanMesh:
    """One DeviceMesh torchtitan's ``ParallelDims.build_mesh`` makes, as names and sizes.

    ``mesh_dim_names`` and ``shape`` are slowest dim first, as DeviceMesh has them; ``flattened``
    maps each dim flattened out of it to the dims it flattens, in torchtitan's order;
    ``fake_dims`` are the dims asked on torch's fake backend (0.3's ``backend_override``).

    Example::

        >>> (mesh,) = torchtitan_meshes(TorchtitanParallelism(context_parallel_degree=2, release="0.2").resolved(8))
        >>> mesh.name, mesh.mesh_dim_names, mesh.shape
        ('world', ('dp_shard', 'cp'), (4, 2))
        >>> mesh.flattened
        {'dp': ('dp_shard',), 'dp_shard_cp': ('dp_shard', 'cp'), 'dp_cp': ('dp_shard', 'cp')}
    """

    name: str
    mesh_dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    flattened: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fake_dims: frozenset[str] = frozenset()


def _resolved(config: Union[TorchtitanParallelism, Source, None], world_size: Optional[int],
              release: TorchtitanRelease, overrides: Optional[dict[str, object]] = None) -> TorchtitanParallelism:
    if not isinstance(config, TorchtitanParallelism):
        config = read_parallelism(config, release=release, overrides=overrides)
    elif config.release is not release:
        config = dataclasses.replace(config, release=release)
    if world_size is not None:
        return config.resolved(world_size)
    if config.world_size is None:
        raise ValueError("the world size is needed: torchtitan takes it from the launcher")
    return config.resolved(config.world_size)


def _world_mesh_0_2(d: dict[str, int]) -> TorchtitanMesh:
    """0.2's one world mesh: the dims above 1 (and dp_shard_mod_ep with ep), their flattened dims."""
    pp, rep, shard, cp, tp, ep, etp = (d[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp"))
    if ep > 1:
        borrowed = cp if etp == tp else cp * tp
        sizes = {"pp": pp, "dp_replicate": rep, "dp_shard_mod_ep": shard * borrowed // ep,
                 "dp_shard_in_ep": ep // borrowed, "cp": cp, "tp": tp}
        names = [n for n, s in sizes.items() if s > 1 or n == "dp_shard_mod_ep"]
        has = set(names)
        shard_dims = [n for n in ("dp_shard_mod_ep", "dp_shard_in_ep") if n in has]
        rep_dims = ["dp_replicate"] if "dp_replicate" in has else []
        cp_dims = ["cp"] if "cp" in has else []
        ep_dims = [n for n in ("dp_shard_in_ep", "cp") if n in has] + (["tp"] if etp == 1 and tp > 1 else [])
        flattened = {"dp": rep_dims + shard_dims, "dp_shard_cp": shard_dims + cp_dims,
                     "dp_cp": rep_dims + shard_dims + cp_dims, "ep": ep_dims}
    else:
        sizes = {"pp": pp, "dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp}
        names = [n for n, s in sizes.items() if s > 1] or ["dp_shard"]  # one rank: a dim all the same
        has = {n for n, s in sizes.items() if s > 1}
        candidates = {name: [n for n in dims if n in has] for name, dims in (
            ("dp", ("dp_replicate", "dp_shard")), ("dp_shard_cp", ("dp_shard", "cp")),
            ("dp_cp", ("dp_replicate", "dp_shard", "cp")))}
        flattened = {name: dims for name, dims in candidates.items() if dims}
    return TorchtitanMesh("world", tuple(names), tuple(sizes[n] for n in names),
                          {name: tuple(dims) for name, dims in flattened.items()})


def _meshes_0_3(d: dict[str, int], backend: SpmdBackend) -> tuple[TorchtitanMesh, ...]:
    """0.3's unflattened meshes, in the order build_mesh makes them, with their fake dims."""
    pp, rep, shard, cp, tp, ep = (d[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))

    def real(dim: str, degree: int) -> bool:
        # fsdp feeds fully_shard's mixed precision even at degree 1, as dp_shard does where it is the
        # storage axis; efsdp wraps the MoE layers whenever there are experts to shard.
        if dim == "fsdp" or (dim == "dp_shard" and backend is not SpmdBackend.PARTIAL_DTENSOR):
            return True
        return ep > 1 if dim == "efsdp" else degree > 1

    def mesh(name: str, sizes: dict[str, int], flattened: Optional[dict[str, tuple[str, ...]]] = None) -> TorchtitanMesh:
        fake = frozenset(dim for dim, degree in sizes.items() if not real(dim, degree))
        return TorchtitanMesh(name, tuple(sizes), tuple(sizes.values()), flattened or {}, fake)

    meshes = [mesh("dataloading", {"pp": pp, "batch": rep * shard, "cp": cp, "tp": tp}, {"loss": ("batch", "cp")})]
    if backend is SpmdBackend.PARTIAL_DTENSOR:
        meshes.append(mesh("dense", {"pp": pp, "dp_replicate": rep, "fsdp": shard * cp, "tp": tp}))
    else:
        meshes.append(mesh("dense", {"pp": pp, "dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp}))
    if backend is SpmdBackend.SPMD_TYPES:
        meshes.append(mesh("fwdbwd", {"pp": pp, "dp": rep * shard, "cp": cp, "tp": tp}))
    meshes.append(mesh("sparse", {"pp": pp, "dp_replicate": rep, "efsdp": shard * cp * tp // ep, "ep": ep}))
    return tuple(meshes)


def torchtitan_meshes(config: TorchtitanParallelism) -> tuple[TorchtitanMesh, ...]:
    """The meshes torchtitan's ``ParallelDims.build_mesh`` makes for resolved degrees, in order.

    0.2: its one world mesh. 0.3: ``dataloading`` (with ``loss``), ``dense``, ``fwdbwd`` (under
    ``spmd_types`` only) and ``sparse``.

    Example::

        >>> p = TorchtitanParallelism(tensor_parallel_degree=2, expert_parallel_degree=4,
        ...                           expert_tensor_parallel_degree=1, release="0.2").resolved(16)
        >>> (mesh,) = torchtitan_meshes(p)
        >>> mesh.mesh_dim_names, mesh.shape, mesh.flattened["ep"]
        (('dp_shard_mod_ep', 'dp_shard_in_ep', 'tp'), (4, 2, 2), ('dp_shard_in_ep', 'tp'))
        >>> new = torchtitan_meshes(TorchtitanParallelism(tensor_parallel_degree=2, expert_parallel_degree=4,
        ...                                               release="0.3").resolved(16))
        >>> [(m.name, m.shape) for m in new]
        [('dataloading', (1, 8, 1, 2)), ('dense', (1, 1, 8, 1, 2)), ('fwdbwd', (1, 8, 1, 2)), ('sparse', (1, 1, 4, 4))]
        >>> sorted(new[-1].fake_dims)
        ['dp_replicate', 'pp']
    """
    if config.world_size is None or config.release is None:
        raise ValueError("resolve the degrees against a world size first: config.resolved(world_size)")
    if config.release is TorchtitanRelease.V0_2:
        return (_world_mesh_0_2(config.degrees()),)
    return _meshes_0_3(config.degrees(), config.spmd_backend or SpmdBackend.SPMD_TYPES)


def plan_torchtitan(config: Union[TorchtitanParallelism, Source, None], world_size: Optional[int] = None,
                    release: Optional[Union[str, TorchtitanRelease]] = None, *,
                    overrides: Optional[dict[str, object]] = None) -> Plan:
    """The groups torchtitan's meshes make for a job config (a path, TOML text or the degrees).

    One kind per mesh dim and flattened dim, in the order torchtitan creates them, named as it
    names them (a dim made again in a later 0.3 mesh: ``dim@mesh``); dims on the fake backend are
    kinds with :attr:`~hypergrid.layout.kinds.BackendChoice.FAKE`. The grid is 0.2's world mesh or 0.3's
    ``dense`` mesh, the other meshes views, each with hypergrid's dim order (fastest first). The
    release is ``release``, else the one ``config`` names, else :func:`choose_release`'s; the
    plan's ``follows`` says which and why. ``world_size`` is the launcher's; it may be left out
    only for degrees already :meth:`~TorchtitanParallelism.resolved`. ``overrides`` are
    torchtitan's ``--parallelism.*`` flags over a job config (or over its defaults, ``config=None``).

    Example::

        >>> plan = plan_torchtitan(TorchtitanParallelism(
        ...     data_parallel_replicate_degree=2, tensor_parallel_degree=2, pipeline_parallel_degree=2), 16, "0.2")
        >>> plan.layout.dim_names, plan.layout.shape
        (('tp', 'dp_shard', 'dp_replicate', 'pp'), (2, 2, 2, 2))
        >>> plan.groups_of(5)["pp"], plan.groups_of(5)["dp"], plan.groups_of(5)["dp_cp"]
        ([5, 13], [1, 3, 5, 7], [1, 3, 5, 7])
        >>> new = plan_torchtitan("[parallelism]\\ntensor_parallel_degree = 2\\nexpert_parallel_degree = 4", 16, "0.3")
        >>> new.groups_of(5)["ep"], new.groups_of(5)["pp@sparse"], new.kind("pp@sparse").creation.backend.value
        ([4, 5, 6, 7], [5], 'fake')
    """
    given = release if release is not None else config.release if isinstance(config, TorchtitanParallelism) else None
    followed = choose_release(given)
    resolved = _resolved(config, world_size, TorchtitanRelease(followed.release), overrides)
    meshes = torchtitan_meshes(resolved)
    grid = meshes[0] if resolved.release is TorchtitanRelease.V0_2 else next(m for m in meshes if m.name == "dense")
    layouts = {m.name: GridLayout(tuple(reversed(m.shape)), tuple(reversed(m.mesh_dim_names))) for m in meshes}
    kinds: list[GroupKind] = []
    for mesh in meshes:
        layout, view = layouts[mesh.name], None if mesh is grid else mesh.name
        made = {k.name for k in kinds}
        for dim in mesh.mesh_dim_names:
            backend = BackendChoice.FAKE if dim in mesh.fake_dims else BackendChoice.DEFAULT
            kinds.append(GroupKind(dim if dim not in made else f"{dim}@{mesh.name}", layout, (dim,), view=view,
                                   creation=Creation(f"mesh_{dim}", backend=backend)))
        kinds += [GroupKind(name, layout, tuple(reversed(dims)), view=view, creation=Creation(f"mesh_{name}"))
                  for name, dims in mesh.flattened.items()]
    views = {name: layout for name, layout in layouts.items() if name != grid.name}
    return Plan(resolved.world_size, layouts[grid.name], kinds, views,  # type: ignore[arg-type]
                anchor=Anchor.TORCHTITAN, follows=followed)


def torchtitan_groups_per_rank(config: Union[TorchtitanParallelism, Source], world_size: Optional[int] = None,
                               release: Optional[Union[str, TorchtitanRelease]] = None) -> int:
    """Process groups torchtitan's meshes create on each rank, fake-backend ones included.

    DeviceMesh makes a group for every mesh dim and every ``_flatten``, and 0.3's every
    ``_unflatten`` makes its dims' groups anew, also where another dim already has the same
    members and for dims of one rank; a dim whose group is the whole world, on the default
    backend, reuses the default group instead (DeviceMesh makes a new one there only on a gloo
    world with CUDA available, not counted here). Counted against torchtitan's own
    ``ParallelDims`` on the fake backend: 0.2.0's with torch 2.13, 0.3.0's with torch 2.15.
    hypergrid makes one group per member set and backend (:func:`shared_groups_per_rank`).

    Example::

        >>> toml = "[parallelism]\\ntensor_parallel_degree = 8"
        >>> torchtitan_groups_per_rank(toml, 64, "0.2"), shared_groups_per_rank(plan_torchtitan(toml, 64, "0.2"))
        (5, 2)
        >>> torchtitan_groups_per_rank(toml, 64, "0.3"), shared_groups_per_rank(plan_torchtitan(toml, 64, "0.3"))
        (18, 4)
        >>> torchtitan_groups_per_rank("[parallelism]\\ncontext_parallel_degree = 2", 2, "0.2")  # cp, dp_shard_cp, dp_cp: the world
        0
    """
    plan = plan_torchtitan(config, world_size, release)
    return sum(1 for kind in plan.kinds
               if kind.size != plan.world_size or kind.creation.backend is not BackendChoice.DEFAULT)


def shared_groups_per_rank(plan: Plan) -> int:
    """Distinct (members, backend) among one rank's groups in ``plan``: what hypergrid creates per
    rank, a set of the whole world on the default backend being the default group itself.

    Every rank of a torchtitan plan holds one group of each kind, alike, so rank ``rank_offset``
    is asked.

    Example::

        >>> shared_groups_per_rank(plan_torchtitan("[parallelism]\\ncontext_parallel_degree = 2", 8, "0.2"))
        3
    """
    rank = plan.layout.rank_offset
    return len({(tuple(kind.members(rank) or ()), kind.creation.backend) for kind in plan.kinds
                if kind.members(rank) is not None})
