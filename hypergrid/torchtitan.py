"""torchtitan's layout, read from its TOML job config and planned as hypergrid groups.

torchtitan keeps a job's layout in the ``[parallelism]`` section of a TOML job config, and its
``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``) validates the degrees and builds
DeviceMeshes from them. This module reimplements, as pure rank arithmetic, the meshes of
**torchtitan 0.2.0** (``ParallelDims`` with ``etp``, ``_build_mesh_without_ep`` and
``_build_mesh_with_ep``); torchtitan 0.3.0 rebuilt ``ParallelDims`` around unflattened meshes
(``batch``, ``loss``, ``fsdp``, ``efsdp`` and no ``etp``), which this module does not follow.

* Without expert parallelism the world mesh has the dims ``pp, dp_replicate, dp_shard, cp, tp``
  whose degree is above 1, slowest first, and torchtitan flattens ``dp`` (dp_replicate x
  dp_shard), ``dp_shard_cp`` (dp_shard x cp) and ``dp_cp`` (all three) out of it, each when one
  of its dims is there.
* With ``expert_parallel_degree > 1`` ep borrows all of cp (and all of tp when
  ``expert_tensor_parallel_degree`` is 1) and part of dp_shard: dp_shard is split into
  ``dp_shard_mod_ep`` (slower, always a mesh dim, even of size 1) and ``dp_shard_in_ep``, and
  ``ep`` is one more flattened dim.

hypergrid's dims run fastest first, so the plan's grid is the world mesh's ``mesh_dim_names``
reversed. Each mesh dim and each flattened dim is one kind, named as torchtitan names it.

Nothing here imports torch: a job config is planned on a laptop.

Example::

    >>> plan = plan_torchtitan('''
    ... [parallelism]
    ... data_parallel_shard_degree = -1
    ... tensor_parallel_degree = 8
    ... ''', world_size=64)
    >>> plan.layout.dim_names, plan.layout.shape
    (('tp', 'dp_shard'), (8, 8))
    >>> [kind.name for kind in plan.kinds]
    ['dp_shard', 'tp', 'dp', 'dp_shard_cp', 'dp_cp']
    >>> plan.groups_of(9)["dp_shard_cp"]
    [1, 9, 17, 25, 33, 41, 49, 57]
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass
from typing import Optional, Union

from .kinds import GroupKind
from .layout import GridLayout
from .report import Anchor, Plan

__all__ = [
    "TORCHTITAN_VERSION",
    "TorchtitanParallelism",
    "TorchtitanMesh",
    "read_parallelism",
    "torchtitan_mesh",
    "plan_torchtitan",
    "torchtitan_groups_per_rank",
    "shared_groups_per_rank",
]

#: The torchtitan release whose ``ParallelDims`` the meshes here follow.
TORCHTITAN_VERSION = "0.2.0"

#: What :func:`read_parallelism` and :func:`plan_torchtitan` take: a path, or the TOML text.
Source = Union[str, "os.PathLike[str]"]

# torchtitan's [parallelism] keys -> the short names ParallelDims gives them.
_SHORT = {
    "data_parallel_replicate_degree": "dp_replicate",
    "data_parallel_shard_degree": "dp_shard",
    "tensor_parallel_degree": "tp",
    "context_parallel_degree": "cp",
    "pipeline_parallel_degree": "pp",
    "expert_parallel_degree": "ep",
    "expert_tensor_parallel_degree": "etp",
}


@dataclass(frozen=True)
class TorchtitanParallelism:
    """The degrees of torchtitan's ``[parallelism]`` section, with torchtitan's names and defaults.

    ``data_parallel_shard_degree = -1`` means "what the other degrees leave of the world";
    :meth:`resolved` fills it in and checks the degrees against a world size as ``ParallelDims``
    does. ``world_size`` is None until then. A degree below 1 (or a shard degree other than -1
    below 1) is a ValueError naming the field.

    Example::

        >>> p = TorchtitanParallelism(tensor_parallel_degree=4)
        >>> p.data_parallel_shard_degree, p.world_size
        (-1, None)
        >>> r = p.resolved(32)
        >>> r.data_parallel_shard_degree, r.world_size
        (8, 32)
        >>> TorchtitanParallelism(context_parallel_degree=0)
        Traceback (most recent call last):
        ...
        ValueError: parallelism.context_parallel_degree must be an integer >= 1, got 0
    """

    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    expert_tensor_parallel_degree: int = 1
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
        if self.world_size is not None and (
            isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1
        ):
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")

    def degrees(self) -> dict[str, int]:
        """The degrees under ``ParallelDims``' short names (``dp_replicate``, ``dp_shard``, ...).

        Example::

            >>> TorchtitanParallelism(pipeline_parallel_degree=2).degrees()["pp"]
            2
        """
        return {short: getattr(self, name) for name, short in _SHORT.items()}

    def resolved(self, world_size: int) -> "TorchtitanParallelism":
        """These degrees for ``world_size`` ranks: -1 filled in, checked as ``ParallelDims`` checks.

        The product of dp_replicate, dp_shard, cp, tp and pp must be the world size; with
        expert parallelism, etp must be tp or 1 and ep must divide as torchtitan requires (ep
        takes all of cp, and of tp when etp is 1, and a divisor of dp_shard). Each failure is a
        ValueError naming the fields.

        Example::

            >>> TorchtitanParallelism(tensor_parallel_degree=3).resolved(8)
            Traceback (most recent call last):
            ...
            ValueError: parallelism degrees do not fill the world: data_parallel_replicate_degree (1) x data_parallel_shard_degree (2, from -1) x context_parallel_degree (1) x tensor_parallel_degree (3) x pipeline_parallel_degree (1) = 6, but the world has 8 ranks
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
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
        if ep > 1:
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
        return dataclasses.replace(self, data_parallel_shard_degree=shard, world_size=world_size)


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


def read_parallelism(source: Source, world_size: Optional[int] = None) -> TorchtitanParallelism:
    """The ``[parallelism]`` degrees of a torchtitan job config (a path, or the TOML text).

    Keys the section has besides the seven degrees (``fsdp_reshard_after_forward``, pipeline
    schedules, ...) are left alone; a missing section means torchtitan's defaults. With
    ``world_size`` the degrees come back :meth:`~TorchtitanParallelism.resolved`. Malformed TOML
    is a ValueError naming the file and the line; a degree of the wrong type names its field.

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
    """
    where, text = _source_text(source)
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
    try:
        parallelism = TorchtitanParallelism(**{name: section[name] for name in _SHORT if name in section})
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return parallelism if world_size is None else parallelism.resolved(world_size)


@dataclass(frozen=True)
class TorchtitanMesh:
    """The meshes torchtitan's ``ParallelDims.build_mesh`` makes, as names and sizes.

    ``mesh_dim_names`` and ``shape`` are the world mesh's, slowest dim first as DeviceMesh has
    them; ``flattened`` maps each flattened dim to the mesh dims it flattens, in the order
    torchtitan flattens them.

    Example::

        >>> mesh = torchtitan_mesh(TorchtitanParallelism(context_parallel_degree=2).resolved(8))
        >>> mesh.mesh_dim_names, mesh.shape
        (('dp_shard', 'cp'), (4, 2))
        >>> mesh.flattened
        {'dp': ('dp_shard',), 'dp_shard_cp': ('dp_shard', 'cp'), 'dp_cp': ('dp_shard', 'cp')}
    """

    mesh_dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    flattened: dict[str, tuple[str, ...]]


def _resolved(config: Union[TorchtitanParallelism, Source], world_size: Optional[int]) -> TorchtitanParallelism:
    if not isinstance(config, TorchtitanParallelism):
        config = read_parallelism(config)
    if world_size is not None:
        return config.resolved(world_size)
    if config.world_size is None:
        raise ValueError("the world size is needed: torchtitan takes it from the launcher")
    return config


def torchtitan_mesh(config: TorchtitanParallelism) -> TorchtitanMesh:
    """The world mesh and flattened dims torchtitan 0.2.0 builds for resolved degrees.

    Without ep the mesh dims are those of pp, dp_replicate, dp_shard, cp, tp above 1; with ep
    dp_shard is split into ``dp_shard_mod_ep`` (kept at size 1) and ``dp_shard_in_ep``, and
    ``ep`` is flattened too. A world of one rank, where torchtitan enables no dim, gets a
    ``dp_shard`` of size 1 so that the grid has a dim.

    Example::

        >>> p = TorchtitanParallelism(tensor_parallel_degree=2, expert_parallel_degree=4,
        ...                           expert_tensor_parallel_degree=1).resolved(16)
        >>> mesh = torchtitan_mesh(p)
        >>> mesh.mesh_dim_names, mesh.shape
        (('dp_shard_mod_ep', 'dp_shard_in_ep', 'tp'), (4, 2, 2))
        >>> mesh.flattened["ep"]
        ('dp_shard_in_ep', 'tp')
    """
    if config.world_size is None:
        raise ValueError("resolve the degrees against a world size first: config.resolved(world_size)")
    d = config.degrees()
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
        names = [n for n, s in sizes.items() if s > 1] or ["dp_shard"]
        has = {n for n, s in sizes.items() if s > 1}
        candidates = {name: [n for n in dims if n in has] for name, dims in (
            ("dp", ("dp_replicate", "dp_shard")), ("dp_shard_cp", ("dp_shard", "cp")),
            ("dp_cp", ("dp_replicate", "dp_shard", "cp")))}
        flattened = {name: dims for name, dims in candidates.items() if dims}
    return TorchtitanMesh(tuple(names), tuple(sizes[n] for n in names),
                          {name: tuple(dims) for name, dims in flattened.items()})


def plan_torchtitan(config: Union[TorchtitanParallelism, Source], world_size: Optional[int] = None) -> Plan:
    """The groups torchtitan's meshes make for a job config (a path, TOML text or the degrees).

    The grid is torchtitan's world mesh with hypergrid's dim order (fastest first: the mesh's
    ``mesh_dim_names`` reversed); one kind per mesh dim, then one per flattened dim, each named
    as torchtitan names it. ``world_size`` is the launcher's; it may be left out only for degrees
    already :meth:`~TorchtitanParallelism.resolved`.

    Example::

        >>> plan = plan_torchtitan(TorchtitanParallelism(
        ...     data_parallel_replicate_degree=2, tensor_parallel_degree=2, pipeline_parallel_degree=2), 16)
        >>> plan.layout.dim_names, plan.layout.shape
        (('tp', 'dp_shard', 'dp_replicate', 'pp'), (2, 2, 2, 2))
        >>> plan.groups_of(5)["pp"], plan.groups_of(5)["dp"], plan.groups_of(5)["dp_cp"]
        ([5, 13], [1, 3, 5, 7], [1, 3, 5, 7])
    """
    resolved = _resolved(config, world_size)
    mesh = torchtitan_mesh(resolved)
    layout = GridLayout(tuple(reversed(mesh.shape)), tuple(reversed(mesh.mesh_dim_names)))
    kinds = [GroupKind(name, layout, (name,)) for name in mesh.mesh_dim_names]
    kinds += [GroupKind(name, layout, tuple(reversed(dims))) for name, dims in mesh.flattened.items()]
    return Plan(resolved.world_size, layout, kinds, anchor=Anchor.TORCHTITAN)  # type: ignore[arg-type]


def torchtitan_groups_per_rank(config: Union[TorchtitanParallelism, Source], world_size: Optional[int] = None) -> int:
    """Process groups torchtitan's meshes create on each rank: one per mesh dim and flattened dim.

    DeviceMesh makes a group for every mesh dim and every ``_flatten``, also where another dim
    already has the same members (``dp`` flattened from ``dp_shard`` alone, say), and size-1
    dims included; a dim whose group is the whole world reuses the default group instead (torch
    2.13's DeviceMesh; counted against torchtitan 0.2.0's own ``ParallelDims`` on the fake
    backend). hypergrid makes one group per member set (:func:`shared_groups_per_rank`).

    Example::

        >>> toml = "[parallelism]\\ntensor_parallel_degree = 8"
        >>> torchtitan_groups_per_rank(toml, 64), shared_groups_per_rank(plan_torchtitan(toml, 64))
        (5, 2)
        >>> torchtitan_groups_per_rank("[parallelism]\\ncontext_parallel_degree = 2", 2)  # cp, dp_shard_cp, dp_cp: the world
        0
    """
    resolved = _resolved(config, world_size)
    mesh = torchtitan_mesh(resolved)
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    spans = [(name,) for name in mesh.mesh_dim_names] + list(mesh.flattened.values())
    return sum(math.prod(sizes[dim] for dim in dims) != resolved.world_size for dims in spans)


def shared_groups_per_rank(plan: Plan) -> int:
    """Distinct member sets among one rank's groups in ``plan``: what hypergrid creates per rank.

    Every rank of a grid has the same number, so rank ``rank_offset`` is asked.

    Example::

        >>> shared_groups_per_rank(plan_torchtitan("[parallelism]\\ncontext_parallel_degree = 2", 8))
        3
    """
    groups = plan.groups_of(plan.layout.rank_offset)
    return len({tuple(members) for members in groups.values() if members is not None})
