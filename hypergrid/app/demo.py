"""The demo: real process groups from one grid, each verified with a collective.

Two ways to run, one code path per rank:

* :func:`launch` (:mod:`hypergrid.app.launcher`) starts ``world_size`` local processes
  (``python -m hypergrid demo --worker``) with the environment torchrun would give them, on a
  free loopback port, in one process group, and waits for them with a deadline; on failure,
  timeout, SIGINT or SIGTERM it kills the group. :func:`machine_limit` first refuses a world
  this machine cannot hold.
* :func:`run_rank` is what each rank does, under :func:`launch` or under ``torchrun``: join a
  gloo world, build the grid of a Megatron layout (dense dims plus the expert view), create every
  group kind, the Megatron-Core ``parallel_state`` groups through :mod:`hypergrid.megatron` and a
  DeviceMesh through :func:`hypergrid.mesh.device_mesh` where those adapters are installed, and verify each
  group with an ``all_reduce`` of one-hot member ids that must equal ``grid.ranks()``. Rank 0
  gathers every rank's results and returns a :class:`DemoReport`; :func:`format_report` renders it.

Example::

    >>> config = DemoConfig(tp=2, pp=2, ep=2, etp=1)
    >>> config.plan(8).megatron.dp, config.plan(8).megatron.edp
    (2, 2)

From a shell, on 8 local gloo ranks (:func:`launch`) or as one rank of each of torchrun's 8
(:func:`run_rank`)::

    python -m hypergrid demo
    torchrun --nproc-per-node 8 -m hypergrid demo
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from ..layout.describe import describe_members
from ..planning.plan import Plan, plan_megatron
from .launcher import (
    LaunchInterrupted,
    LaunchOutcome,
    LocalLimit,
    Machine,
    RankCost,
    launch,
    local_rank_limit,
    probe_machine,
)

__all__ = [
    "DEFAULT_WORLD_SIZE",
    "DemoConfig",
    "GroupResult",
    "DemoReport",
    "LaunchOutcome",
    "LaunchInterrupted",
    "RANK_COST",
    "machine_limit",
    "describe_failures",
    "launched_by_torchrun",
    "launch",
    "run_rank",
    "format_report",
]

logger = logging.getLogger(__name__)

DEFAULT_WORLD_SIZE = 8

#: What one demo rank takes at most, measured with the Megatron and mesh sections on a 2-core
#: machine (a rank's peak proportional set size, and its CPU time): 596 MB and 6.1 CPU-s with
#: torch 2.15 (CUDA wheel) and megatron-core 0.19.2 on 8 ranks, 285 MB and 4.6 CPU-s with torch
#: 2.13 (CPU) and megatron-core 0.16.1 on 8 and 16 ranks. The larger of each, rounded up, so that
#: a world the limit allows fits where ranks cost the most measured.
RANK_COST = RankCost(memory_mb=600, cpu_s=6.0)


def machine_limit(world_size: int, timeout_s: float, machine: Optional[Machine] = None) -> LocalLimit:
    """The most demo ranks this machine (default: :func:`~hypergrid.app.launcher.probe_machine`) runs
    within ``timeout_s``; ValueError, with the limit and how it was found, if ``world_size`` exceeds it.

    Example::

        >>> machine_limit(100_000, 120, Machine(cpus=2, available_bytes=8 << 30))   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: demo --world-size 100000 is more local ranks than this machine runs: at most 10 (2 CPUs x 120 s ...
    """
    limit = local_rank_limit(probe_machine() if machine is None else machine, RANK_COST, timeout_s)
    if world_size > limit.ranks:
        raise ValueError(
            f"demo --world-size {world_size} is more local ranks than this machine runs: at most {limit.ranks} "
            f"({limit.why}; costs per rank as measured in docs/cli.md); give --world-size {limit.ranks} or less, "
            f"{'a longer --timeout, ' if limit.by_cpu == limit.ranks else ''}or --ignore-machine-limit to launch anyway"
        )
    return limit


@dataclass
class DemoConfig:
    """Layout and switches of a demo run (Megatron sizes; dp and expert dp take what is left).

    Example::

        >>> DemoConfig(tp=4, pp=2, ep=2, etp=1).check(8)
        >>> DemoConfig(tp=3).check(8)   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hypergrid.errors.ParallelConfigError: world_size (8) is not divisible by tensor_model_parallel_size (3) ...
    """

    tp: int = 2
    pp: int = 2
    cp: int = 1
    ep: int = 2
    etp: Optional[int] = 1
    order: str = "tp-cp-ep-dp-pp"
    timeout_s: float = 120.0
    megatron: bool = True
    mesh: bool = True

    @property
    def timeout_minutes(self) -> int:
        """``timeout_s`` rounded up to whole minutes, the unit Megatron-Core's timeout has."""
        return max(1, -(-int(self.timeout_s) // 60))

    def plan(self, world_size: int) -> Plan:
        """The plan of this layout over ``world_size`` ranks."""
        return plan_megatron(
            world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp, order=self.order
        )

    def check(self, world_size: int) -> None:
        """ValueError naming the size that does not fit ``world_size`` ranks."""
        self.plan(world_size)


@dataclass
class GroupResult:
    """One group kind on one rank (or, after :func:`run_rank` merges them, on every rank)."""

    source: str
    kind: str
    key: str
    count: int
    size: Optional[int]
    members: list[int]
    verified: bool
    create_s: Optional[float]  # None: made with the other kinds of its source in one call, timed as a phase
    detail: str = ""


@dataclass
class DemoReport:
    """What rank 0 returns: every group kind verified on every rank, and the timings.

    ``phases`` maps a phase name to its slowest rank's seconds; ``notes`` says which adapters
    were used or skipped and why.
    """

    world_size: int
    plan: Plan
    results: list[GroupResult]
    phases: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.verified for r in self.results)


def describe_failures(failures: dict[int, str]) -> list[str]:
    """What a failed launch says, one line per distinct reason: ranks that failed alike together.

    A one-line reason (killed on timeout) shares its line with the ranks; a longer one (a
    traceback) follows them once, for all the ranks that printed the same.

    Example::

        >>> describe_failures({r: "still running after 5s: killed" for r in range(8)})
        ['ranks 0-7: still running after 5s: killed']
        >>> describe_failures({2: "Traceback ...\\nValueError: bad"})
        ['rank 2 failed:', 'Traceback ...', 'ValueError: bad']
    """
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(failures.items()):
        by_text.setdefault(text.rstrip(), []).append(rank)
    lines: list[str] = []
    for text, ranks in by_text.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {describe_members(ranks)}"
        if "\n" not in text:
            lines.append(f"{who}: {text}")
        else:
            lines.append(f"{who} failed:")
            lines.extend(text.splitlines())
    return lines


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a launched job (RANK, WORLD_SIZE, MASTER_ADDR set).

    Example::

        >>> import os
        >>> launched_by_torchrun() == all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
        True
    """
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


# ---------------------------------------------------------------------------- one rank
def _verify(pg: Any, expected: Optional[list[int]], world_size: int) -> tuple[bool, str]:
    """All-reduce one-hot member ids over ``pg``: each member must be counted exactly once."""
    import torch
    import torch.distributed as dist

    if expected is None:  # e.g. the embedding group of a middle pipeline stage
        return pg is None, "" if pg is None else f"a group of size {pg.size()} where none was expected"
    if pg is None:
        return False, "no group on this rank"
    onehot = torch.zeros(world_size, dtype=torch.int64)
    onehot[dist.get_rank()] = 1
    dist.all_reduce(onehot, group=pg)
    got = [r for r in range(world_size) if onehot[r].item() == 1]
    wrong = [r for r in range(world_size) if onehot[r].item() not in (0, 1)]
    if got == sorted(expected) and not wrong and pg.size() == len(expected):
        return True, ""
    return False, f"all_reduce counted members {got} (size {pg.size()}), expected {sorted(expected)}"


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _grid_groups(grid: Any, plan: Plan, world: int, rank: int) -> list[GroupResult]:
    results = []
    for kind in plan.kinds:
        if not kind.is_grid_groups:
            continue  # cut from grid groups by Megatron's rules: verified in the megatron section
        dims = list(kind.dims)
        # get_or_create: an expert kind made only of dims shared with the grid (pp) is the grid's.
        pg, seconds = _timed(functools.partial(grid.get_or_create_pg, dims, view=kind.view))
        expected = grid.ranks(dims, view=kind.view)
        ok, detail = _verify(pg, expected, world)
        results.append(GroupResult("grid", kind.name, kind.key if kind.view is None else f"{kind.view}:{kind.key}",
                                   kind.count, kind.size, expected, ok, seconds, detail))
    return results


def _megatron_groups(config: DemoConfig, plan: Plan, world: int, notes: list[str],
                     phases: dict[str, float]) -> tuple[list[GroupResult], Any, Callable[[], None]]:
    try:
        with _quiet_imports():
            adapter = importlib.import_module("hypergrid.megatron")
            importlib.import_module("hypergrid.megatron.initialize")
        initialize = adapter.initialize_model_parallel
        active_grids = adapter.active_grids
        destroy = adapter.destroy_model_parallel
        from megatron.core import parallel_state
    except (ImportError, AttributeError) as exc:
        notes.append(f"megatron: skipped ({type(exc).__name__}: {exc})")
        return [], None, lambda: None
    _, seconds = _timed(lambda: initialize(  # every Megatron group, in one call: timed as a phase
        tensor_model_parallel_size=config.tp, pipeline_model_parallel_size=config.pp,
        context_parallel_size=config.cp, expert_model_parallel_size=config.ep,
        expert_tensor_parallel_size=config.etp, order=config.order,
        distributed_timeout_minutes=config.timeout_minutes,
    ))
    # initialize_model_parallel returns None, as Megatron-Core's does; the grids it built:
    grids = active_grids()
    distinct = getattr(grids, "num_process_groups", None)
    phases["megatron initialize_model_parallel"] = seconds
    notes.append(
        f"megatron: initialize_model_parallel made every Megatron group in one call, {seconds * 1000:.1f} ms on rank 0 "
        f"(the slowest rank's: above), reusing the grid's communicators where members match"
        + (f"; {distinct} distinct communicators on rank 0 for {len(plan.kinds)} group kinds" if distinct is not None else "")
    )
    results = []
    rank = _grid_rank()
    for kind in plan.kinds:
        glob = kind.megatron_global
        if glob is None:
            continue  # made, but no getter returns it
        # The global each getter returns: the one place every parallel_state getter reads.
        pg = getattr(parallel_state, glob.name, None)
        if glob.entry is not None and pg:
            pg = pg[glob.entry]  # one level of a list, or one size of a dict
        if isinstance(pg, list):  # several pipeline backends: the first is the default group
            pg = pg[0]
        expected = kind.members(rank)
        ok, detail = _verify(pg, expected, world)
        results.append(GroupResult("megatron", kind.name, glob.label, kind.count, kind.size or 0,
                                   expected or [], ok, None, detail))
    return results, grids, destroy


def _mesh_groups(grid: Any, world: int, notes: list[str], phases: dict[str, float],
                 megatron_grids: Any = None) -> list[GroupResult]:
    from ..mesh.adapter import device_mesh

    mesh, phases["DeviceMesh device_mesh(grid)"] = _timed(lambda: device_mesh(grid, device_type="cpu"))
    whose = "the Megatron grid's" if megatron_grids is not None else "the grid's"
    notes.append(f"mesh: DeviceMesh {tuple(mesh.mesh.shape)} dims {mesh.mesh_dim_names} over {whose} groups")
    if megatron_grids is not None:
        from megatron.core import parallel_state

        same = mesh.get_group("tp") is parallel_state.get_tensor_model_parallel_group()
        notes.append(f"mesh: mesh.get_group('tp') is parallel_state's tensor-parallel group: {same}")
    results = []
    for name in mesh.mesh_dim_names:
        expected = grid.ranks(name)
        ok, detail = _verify(mesh.get_group(name), expected, world)
        same = mesh.get_group(name) is grid.get_pg(name)
        results.append(GroupResult("mesh", name, f'mesh["{name}"]', grid.layout.num_groups(name), len(expected),
                                   expected, ok and same, None,
                                   detail or ("" if same else "mesh group is not the grid's group")))
    return results


@contextlib.contextmanager
def _quiet_imports():
    """Importing megatron-core warns, on every rank, about optional CUDA packages (Transformer
    Engine, Apex) a CPU demo does not use: a screen of them would precede the table."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _grid_rank() -> int:
    """This process's global rank (torch.distributed must be initialized)."""
    import torch.distributed as dist

    return dist.get_rank()


def run_rank(config: DemoConfig) -> Optional[DemoReport]:
    """Be one rank of the demo (environment as set by torchrun); rank 0 returns the report.

    Example: this process as the only rank of a job, with the environment torchrun would give
    it (a free loopback port); the process group is destroyed before it returns::

        >>> import os, socket
        >>> from unittest import mock
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", 0))
        ...     port = s.getsockname()[1]
        >>> env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        >>> with mock.patch.dict(os.environ, env):
        ...     report = run_rank(DemoConfig(tp=1, pp=1, ep=1, megatron=False))
        >>> report.ok, report.world_size, "tp" in {r.kind for r in report.results}
        (True, 1, True)
    """
    import torch.distributed as dist

    from ..grid import HyperCommGrid

    phases: dict[str, float] = {}
    notes: list[str] = []
    total_start = time.perf_counter()
    # Whole minutes, as Megatron's distributed_timeout_minutes: grid and Megatron groups then have
    # equal options and share one communicator wherever their members coincide.
    timeout = datetime.timedelta(minutes=config.timeout_minutes)
    _, phases["init_process_group"] = _timed(lambda: dist.init_process_group("gloo", init_method="env://", timeout=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = config.plan(world)
    grid = HyperCommGrid(list(plan.layout.shape), list(plan.layout.dim_names), timeout=timeout)
    expert = plan.views["expert"]
    grid.register_view("expert", list(expert.shape), list(expert.dim_names), shared_dims=plan.shared_dims["expert"])
    teardown: list[Callable[[], None]] = []  # undone in reverse, before the grid and the world
    try:
        results = _every_section(config, grid, plan, world, rank, phases, notes, teardown)
        phases["total on rank"] = time.perf_counter() - total_start
        gathered: Optional[list] = [None] * world if rank == 0 else None
        dist.gather_object((results, phases), gathered, dst=0)
        # Nobody tears down while a peer still talks to it: gloo aborts a process whose peer
        # closed a connection under a pending operation.
        dist.barrier()
    finally:
        for step in reversed(teardown):
            step()
        grid.destroy()
        dist.destroy_process_group()
    if rank != 0:
        return None
    assert gathered is not None
    report = _merge(world, plan, gathered, notes)
    logger.info("demo on %d ranks: %d group kinds verified", world, len(report.results))
    return report


def _every_section(
    config: DemoConfig, grid: Any, plan: Plan, world: int, rank: int, phases: dict[str, float], notes: list[str],
    teardown: list[Callable[[], None]],
) -> list[GroupResult]:
    """The grid's groups, then Megatron's parallel_state, then a DeviceMesh, each timed as a phase."""
    start = time.perf_counter()
    results = _grid_groups(grid, plan, world, rank)
    phases["grid groups (create + verify)"] = time.perf_counter() - start
    megatron_grids: Any = None
    if config.megatron:
        with contextlib.suppress(ImportError):
            # Timed apart: importing megatron-core takes seconds and is not group creation.
            with _quiet_imports():
                _, phases["import megatron-core"] = _timed(lambda: importlib.import_module("megatron.core.parallel_state"))
        start = time.perf_counter()
        megatron_results, megatron_grids, destroy_megatron = _megatron_groups(config, plan, world, notes, phases)
        teardown.append(destroy_megatron)
        results += megatron_results
        if megatron_results:
            phases["megatron parallel_state (initialize + verify)"] = time.perf_counter() - start
    else:
        notes.append("megatron: skipped (--no-megatron)")
    if config.mesh:
        start = time.perf_counter()
        # One grid for everything: the mesh over the Megatron adapter's grid where there is one.
        mesh_grid = getattr(megatron_grids, "grid", None) or grid
        mesh_results = _mesh_groups(mesh_grid, world, notes, phases, megatron_grids if mesh_grid is not grid else None)
        results += mesh_results
        if mesh_results:
            phases["DeviceMesh (build + verify)"] = time.perf_counter() - start
    else:
        notes.append("mesh: skipped (--no-mesh)")
    return results


def _merge(world: int, plan: Plan, gathered: list, notes: list[str]) -> DemoReport:
    """Rank 0's rows, verified only where every rank verified, with each phase's slowest rank."""
    merged = [r for r in gathered[0][0]]
    for i, row in enumerate(merged):
        others = [g[0][i] for g in gathered]
        row.verified = all(o.verified for o in others)
        row.create_s = None if row.create_s is None else max(o.create_s or 0.0 for o in others)
        bad = [(r, o.detail) for r, o in enumerate(others) if not o.verified]
        if bad:
            row.detail = f"rank {bad[0][0]}: {bad[0][1]}"
    slowest = {name: max(g[1][name] for g in gathered) for name in gathered[0][1]}
    return DemoReport(world, plan, merged, slowest, notes)


def format_report(report: DemoReport) -> str:
    """The summary table rank 0 prints: one row per group kind and source, then the timings.

    Example::

        >>> from hypergrid.planning.plan import plan_grid
        >>> row = GroupResult("grid", "tp", "tp", 4, 2, [0, 1], True, 0.0012)
        >>> print(format_report(DemoReport(8, plan_grid([2, 4], ["tp", "dp"]), [row], {"total on rank": 0.5})))
        ... # doctest: +ELLIPSIS
        hypergrid demo: 8 ranks, grid tp=2 x dp=4
        ...
        all 1 groups verified on every rank
    """
    plan = report.plan
    dims = " x ".join(f"{n}={s}" for n, s in zip(plan.layout.dim_names, plan.layout.shape))
    lines = [f"hypergrid demo: {report.world_size} ranks, grid {dims}"]
    for name, view in plan.views.items():
        lines.append(f"  {name} view: " + " x ".join(f"{n}={s}" for n, s in zip(view.dim_names, view.shape)))
    header = ["source", "kind", "key", "groups", "size", "rank 0's group", "verified", "create ms (slowest rank)"]
    rows = [header]
    for r in report.results:
        members = describe_members(r.members)
        rows.append([r.source, r.kind, r.key, str(r.count), str(r.size), members,
                     "yes" if r.verified else "NO", "-" if r.create_s is None else f"{r.create_s * 1000:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for j, row in enumerate(rows):
        lines.append("  ".join(c.rjust(widths[i]) if i in (3, 4, 7) else c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in report.results:
        if not r.verified:
            lines.append(f"FAILED {r.source} {r.kind}: {r.detail}")
    if any(r.create_s is None for r in report.results):
        lines.append("create ms -: made with the other kinds of its source in one call (initialize_model_parallel, "
                     "device_mesh), timed below")
    lines.append("")
    lines.append("timings (slowest rank):")
    for name, seconds in report.phases.items():
        lines.append(f"  {name:<44} {seconds * 1000:9.1f} ms")
    for note in report.notes:
        lines.append(f"  {note}")
    failed = sum(not r.verified for r in report.results)
    lines.append(
        f"all {len(report.results)} groups verified on every rank" if not failed
        else f"{failed} of {len(report.results)} groups FAILED verification"
    )
    return "\n".join(lines)
