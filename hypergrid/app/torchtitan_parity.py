"""``check --torchtitan``: the installed torchtitan's own meshes compared with hypergrid's plan, rank by rank.

:mod:`hypergrid.planning.torchtitan` plans torchtitan's meshes as rank arithmetic. Here the
installed torchtitan's ``ParallelDims`` (its ``distributed/parallel_dims.py``, run alone with the
few torchtitan names it imports stubbed: torchtitan's package import pulls in its whole training
stack) builds its meshes as each compared rank of the world, on torch's fake backend, and every
process group its DeviceMeshes ask torch for that holds the rank, in order and with its backend,
is compared with the plan's kinds; so is every mesh torchtitan hands out by name
(``get_optional_mesh``, 0.2's ``world_mesh[name]``), member for member.

Which meshes the installed torchtitan builds is read from its ``ParallelDims`` (an ``etp`` field:
0.2's one world mesh; an ``spmd_backend`` field: 0.3's unflattened meshes), never from a version
string; the report names the version and the file compared. Up to :data:`FULL_RANKS` ranks every
rank is compared; beyond, a sample (the first and last rank, each pipeline stage's first, random
ones), unless every rank is asked for.

Example, a 16-rank MoE job (skipped where torchtitan is not installed)::

    >>> from hypergrid.planning.torchtitan import TorchtitanParallelism
    >>> result = compare_with_torchtitan(TorchtitanParallelism(tensor_parallel_degree=2, expert_parallel_degree=4),
    ...                                  world_size=16)  # doctest: +SKIP
    >>> result.ok, result.ranks_compared, result.groups_per_rank  # doctest: +SKIP
    (True, 16, 18)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import logging
import random
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..planning.plan import Plan
from ..planning.torchtitan import Source, TorchtitanParallelism, TorchtitanRelease, plan_torchtitan, read_parallelism

__all__ = ["FULL_RANKS", "SAMPLED_RANKS", "TorchtitanUnavailable", "TorchtitanResult", "load_parallel_dims",
           "release_of", "compare_with_torchtitan"]

#: Worlds up to this many ranks are compared on every rank by default.
FULL_RANKS = 64
#: Ranks compared in a larger world by default.
SAMPLED_RANKS = 32

#: The package modules parallel_dims.py imports from torchtitan itself, stubbed.
_STUBS = ("torchtitan", "torchtitan.tools", "torchtitan.tools.logging", "torchtitan.tools.utils",
          "torchtitan.config", "torchtitan.config.configs")


class TorchtitanUnavailable(ImportError):
    """Why the installed torchtitan's ParallelDims cannot be run here (the message is the reason)."""


def load_parallel_dims(device_type: str = "cpu") -> tuple[str, Path, Any]:
    """``(version, path, module)``: the installed torchtitan's ``distributed/parallel_dims.py``, run
    with stubs for the torchtitan names it imports. ``sys.modules`` is restored afterwards, so a
    later real import of torchtitan is not affected.

    Raises:
        TorchtitanUnavailable: torchtitan is not installed, has no such file, or the file needs a
            module that is not installed (0.3's ``spmd_types``).
    """
    try:
        distribution = importlib.metadata.distribution("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise TorchtitanUnavailable("torchtitan is not installed (pip install --no-deps torchtitan; 0.3 also needs "
                                    "spmd_types)") from None
    version = distribution.version
    path = Path(str(distribution.locate_file("torchtitan/distributed/parallel_dims.py")))
    if not path.is_file():
        raise TorchtitanUnavailable(f"torchtitan {version} has no {path}")
    stubs = {name: types.ModuleType(name) for name in _STUBS}
    stubs["torchtitan.tools.logging"].logger = logging.getLogger("torchtitan")  # type: ignore[attr-defined]
    stubs["torchtitan.tools.utils"].device_type = device_type  # type: ignore[attr-defined]
    stubs["torchtitan.config.configs"].ParallelismConfig = object  # type: ignore[attr-defined]
    name = f"_torchtitan_{version.replace('.', '_')}_parallel_dims"
    saved = {n: sys.modules.get(n) for n in (*_STUBS, name)}
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.update(stubs)
    sys.modules[name] = module  # its dataclasses look their module up while they are made
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise TorchtitanUnavailable(f"torchtitan {version}'s parallel_dims.py needs {exc.name}, not installed "
                                    f"here: {exc}") from exc
    finally:
        for n, previous in saved.items():
            if previous is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = previous
    return version, path, module


def release_of(module: Any) -> TorchtitanRelease:
    """Which meshes a loaded ``parallel_dims`` module builds, from its ``ParallelDims`` fields.

    Raises:
        TorchtitanUnavailable: a ParallelDims with neither 0.2's ``etp`` nor 0.3's ``spmd_backend``.
    """
    names = {f.name for f in dataclasses.fields(module.ParallelDims)}
    if "etp" in names:
        return TorchtitanRelease.V0_2
    if "spmd_backend" in names:
        return TorchtitanRelease.V0_3
    raise TorchtitanUnavailable(f"the installed torchtitan's ParallelDims has fields {sorted(names)}: neither 0.2's "
                                f"etp nor 0.3's spmd_backend, so which meshes it builds is not known here")


@dataclass
class TorchtitanResult:
    """What :func:`compare_with_torchtitan` compared, against which torchtitan, and every difference."""

    version: str
    path: str
    release: TorchtitanRelease
    world_size: int
    ranks_compared: int = 0
    groups_per_rank: int = 0
    named_meshes: int = 0
    sampled: bool = False
    seed: int = 0
    seconds: float = 0.0
    differences: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def lines(self) -> list[str]:
        """The report ``check --torchtitan`` prints."""
        which = (f"{self.ranks_compared} of {self.world_size} ranks (seed {self.seed}: the first and last rank, each "
                 f"pipeline stage's first and random ones; --full compares every rank)" if self.sampled
                 else f"every one of the {self.world_size} ranks")
        out = [f"compared torchtitan {self.version}'s own ParallelDims (the installed one, {self.path}; it builds "
               f"{self.release.value}'s meshes) with the plan on {which} in {self.seconds:.2f}s: the "
               f"{self.groups_per_rank} process groups its DeviceMeshes make for a rank, in order, with their "
               f"backends, and the {self.named_meshes} meshes it hands out by name, member for member"]
        out += [f"DIFFERENCE {line}" for line in self.differences]
        out.append(f"identical to torchtitan {self.version}" if self.ok else f"{len(self.differences)} differences "
                   f"from torchtitan {self.version}")
        return out


@contextlib.contextmanager
def recorded_mesh_groups(rank: int) -> Iterator[list[tuple[tuple[int, ...], bool]]]:
    """While the block runs, the groups holding ``rank`` that DeviceMesh asks torch for, in order,
    as (sorted members, on the fake backend).

    Example::

        >>> with recorded_mesh_groups(0) as made:
        ...     pass
        >>> made
        []
    """
    import torch.distributed.device_mesh as device_mesh

    made: list[tuple[tuple[int, ...], bool]] = []
    original = device_mesh.new_group

    def recording(*args: Any, **kwargs: Any) -> Any:
        ranks = kwargs.get("ranks", args[0] if args else None)
        if ranks is not None and rank in ranks:
            made.append((tuple(sorted(ranks)), kwargs.get("backend") == "fake"))
        return original(*args, **kwargs)

    device_mesh.new_group = recording
    try:
        yield made
    finally:
        device_mesh.new_group = original


@contextlib.contextmanager
def _fake_rank(rank: int, world_size: int) -> Iterator[list[tuple[tuple[int, ...], bool]]]:
    """Play ``rank`` of ``world_size`` on torch's fake backend; yields the groups holding the rank
    that DeviceMesh asks torch for, as (sorted members, on the fake backend), in order."""
    import torch.distributed as dist

    from ..runtime.torch_compat import fake_store

    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        with warnings.catch_warnings(), recorded_mesh_groups(rank) as made:
            warnings.simplefilter("ignore")  # torch: slicing a flattened dim from the root mesh will change
            yield made
    finally:
        dist.destroy_process_group()


def _named(dims: Any, built: Any, names: list[str]) -> dict[str, Any]:
    """The meshes torchtitan hands out by these names (0.3's get_optional_mesh, 0.2's world mesh)."""
    out = {}
    for name in names:
        try:
            if hasattr(dims, "get_optional_mesh"):
                mesh = dims.get_optional_mesh(name, include_singleton_axes=True)
            else:
                mesh = built[name]
        except (KeyError, ValueError, RuntimeError):
            continue  # not a name torchtitan hands out
        if mesh is not None:
            out[name] = mesh
    return out


def _ranks(plan: Plan, full: Optional[bool], seed: int, count: int) -> tuple[list[int], bool]:
    world = plan.world_size
    if full or (full is None and world <= FULL_RANKS):
        return list(range(world)), False
    layout = plan.layout
    chosen = {0, world - 1}
    if "pp" in layout.dim_names:
        stride = layout.strides[layout.dim_names.index("pp")]
        chosen |= {stage * stride for stage in range(layout.dim_size("pp"))}
    rng = random.Random(seed)
    while len(chosen) < min(count, world):
        chosen.add(rng.randrange(world))
    return sorted(chosen), len(chosen) < world


def compare_with_torchtitan(config: Union[TorchtitanParallelism, Source, None], world_size: int, *,
                            overrides: Optional[dict[str, object]] = None, full: Optional[bool] = None,
                            seed: int = 0, ranks: int = SAMPLED_RANKS) -> TorchtitanResult:
    """The installed torchtitan's ``ParallelDims`` meshes against hypergrid's plan of the same job
    config (a path, TOML text, the degrees or None for torchtitan's defaults, with ``overrides``,
    its ``--parallelism.*`` flags), for the release the installed ``ParallelDims`` builds.

    ``full``: every rank (True), a sample of ``ranks`` ranks drawn with ``seed`` (False), or every
    rank up to :data:`FULL_RANKS` and a sample beyond (None). Needs a process with no default
    process group: each compared rank is played on torch's fake backend in turn.

    Raises:
        TorchtitanUnavailable: no installed torchtitan's ParallelDims to compare with.
        RuntimeError: torch.distributed is already initialized in this process.
    """
    import time

    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("compare_with_torchtitan plays each rank on torch's fake backend: it needs a process "
                           "with no default process group")
    version, path, module = load_parallel_dims()
    release = release_of(module)
    if not isinstance(config, TorchtitanParallelism):
        config = read_parallelism(config, release=release, overrides=overrides)
    resolved = dataclasses.replace(config, release=release).resolved(world_size)
    plan = plan_torchtitan(resolved)
    result = TorchtitanResult(version, str(path), release, world_size, seed=seed)
    degrees = {short: value for short, value in resolved.degrees().items() if short != "etp"}
    if release is TorchtitanRelease.V0_2:
        degrees["etp"] = resolved.expert_tensor_parallel_degree
    else:
        degrees["spmd_backend"] = resolved.spmd_backend.value  # type: ignore[union-attr]
    compared, result.sampled = _ranks(plan, full, seed, ranks)
    names = [kind.name for kind in plan.kinds if "@" not in kind.name]
    start = time.perf_counter()
    for rank in compared:
        with _fake_rank(rank, world_size) as made:
            dims = module.ParallelDims(**degrees, world_size=world_size)
            built = dims.build_mesh()
            named = {n: sorted(dist.get_process_group_ranks(m.get_group())) for n, m in _named(dims, built, names).items()}
        expected = [(tuple(sorted(k.members(rank) or ())), k.creation.backend.value == "fake") for k in plan.kinds
                    if k.size != world_size or k.creation.backend.value != "default"]  # the world's: the default group
        if made != expected:
            result.differences.append(f"rank {rank}: torchtitan's DeviceMeshes make {_groups(made)}; the plan's kinds "
                                      f"{[k.name for k in plan.kinds]} make {_groups(expected)}")
        mine = plan.groups_of(rank)
        for name, members in named.items():
            ours = sorted(mine[name] or ())
            if members != ours:
                result.differences.append(f"rank {rank}: {name}: torchtitan {members}, hypergrid {ours}")
        result.groups_per_rank = max(result.groups_per_rank, len(made))
        result.named_meshes = max(result.named_meshes, len(named))
    result.ranks_compared, result.seconds = len(compared), time.perf_counter() - start
    return result


def _groups(groups: list[tuple[tuple[int, ...], bool]]) -> str:
    from ..layout.describe import describe_members

    return "[" + "; ".join(describe_members(list(m)) + (" (fake)" if fake else "") for m, fake in groups) + "]"
