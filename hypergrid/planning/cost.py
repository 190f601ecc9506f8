"""What a plan costs one rank: communicators, their estimated GPU memory, where they lie.

Pure integer work over a :class:`~hypergrid.planning.plan.Plan`; no torch. For one rank, two counts:

* **hypergrid** (:func:`hypergrid.megatron.initialize_model_parallel` with its default
  ``share_groups=True``): one communicator per distinct group among the rank's kinds, where a
  group is its set of members with the backend, timeout and NCCL options it is asked with
  (``kind.creation``); private kinds never share, and a group of every rank is the default group
  itself (no new communicator). A rank's size-1 groups share one communicator.
* **Megatron-Core** (its own ``initialize_model_parallel``): one new group per kind whose group
  holds the rank, none shared. Gloo copies are counted apart: they hold no GPU memory.
* **torchtitan** (a plan's ``anchor``; its DeviceMeshes): one new group per kind holding the rank,
  none shared, but a group of the whole world on the default backend is the default group.

Groups on torch's fake backend (torchtitan 0.3 asks it for the mesh dims it does not use) are
process groups without a communicator: both counts include them, say how many, and give them no
memory.

Which kinds a plan has is its release's (``plan.follows``): Megatron-Core 0.19 makes three groups
per rank that 0.16 does not (the ``gtp_remat`` and expert ``gtp_remat`` groups, of one rank each
at size 1, and a second tp-ep-pp group), and torchtitan 0.3 other meshes than 0.2.

Identity of a group is decided without listing its members where its kind is a grid's own groups
(or a block of them): by the lowest member and the canonical (size, stride) modes of the set, as
:class:`~hypergrid.layout.Partition` has them. The memory estimate is the GPU communicators times
a per-communicator figure (:data:`DEFAULT_COMM_MEMORY_MB`, an estimate the caller can change).

Example::

    >>> from hypergrid.planning.plan import plan_megatron
    >>> plan = plan_megatron(world_size=16, tp=2, pp=2, ep=2)
    >>> cost = rank_cost(plan, 0)
    >>> cost.hypergrid, cost.megatron, cost.world_shared
    (10, 17, ('intra_dist_opt',))
    >>> worst = max_cost(plan)
    >>> worst.hypergrid, worst.megatron, worst.method
    (10, 17, 'every rank')
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Optional

from ..layout.checks import positive_int
from ..layout.kinds import BackendChoice, GroupKind, box_modes
from .plan import Anchor, Plan

__all__ = ["DEFAULT_COMM_MEMORY_MB", "EXACT_MAX_RANKS", "RankCost", "MaxCost", "rank_cost", "max_cost", "cost_lines"]

#: GPU memory one NCCL communicator holds, in MB: an estimate. NVIDIA/nccl issue 964 measured
#: 544 MB (2 GPUs) and 688 MB (more) per communicator on A100s with NVLink; issue 864 reports
#: similar growth. It varies with NCCL version, channels, algorithms and NCCL_BUFFSIZE: measure
#: yours and pass it (``--comm-memory-mb``).
DEFAULT_COMM_MEMORY_MB = 600

#: Worlds up to this many ranks get their maximum over every rank; larger ones over a sample.
EXACT_MAX_RANKS = 4096

@dataclass(frozen=True)
class RankCost:
    """The communicators one rank holds, with hypergrid and with Megatron-Core, and their memory.

    ``hypergrid``: communicators hypergrid creates for the rank (the default group excluded),
    ``hypergrid_gloo`` of them gloo, ``hypergrid_fake`` on the fake backend; ``single_rank``: how
    many of them have one rank; ``world_shared``: kinds handed the default group. ``megatron``:
    groups the plan's anchor (Megatron-Core or torchtitan) creates for the rank, ``megatron_gloo``
    and ``megatron_fake`` of them gloo and fake. ``memory_mb`` / ``megatron_memory_mb``: the GPU
    (neither gloo nor fake) communicators times ``comm_memory_mb``. ``inside_node`` /
    ``inside_domain``: of hypergrid's GPU communicators, how many stay inside one node / one
    NVLink domain.

    Example::

        >>> from hypergrid.planning.plan import plan_grid
        >>> c = rank_cost(plan_grid([2, 4], ["tp", "dp"]), 0, gpus_per_node=2, comm_memory_mb=100)
        >>> c.hypergrid, c.memory_mb, c.inside_node
        (2, 200, 1)
    """

    rank: int
    hypergrid: int
    hypergrid_gloo: int
    single_rank: int
    world_shared: tuple[str, ...]
    megatron: int
    megatron_gloo: int
    memory_mb: int
    megatron_memory_mb: int
    inside_node: int
    inside_domain: int
    comm_memory_mb: int
    #: Per kind holding the rank, hypergrid's communicator for it: ``"default"`` (the default
    #: group) or its number, 1 for the first made; kinds sharing one have the same number.
    communicators: tuple[tuple[str, str], ...] = ()
    hypergrid_fake: int = 0
    megatron_fake: int = 0

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields (see docs/cli.md).

        Example::

            >>> from hypergrid.planning.plan import plan_grid
            >>> rank_cost(plan_grid([2], ["tp"]), 1).as_dict()["world_shared"]
            ['tp']
        """
        return {
            "rank": self.rank, "hypergrid_communicators": self.hypergrid, "hypergrid_gloo": self.hypergrid_gloo,
            "hypergrid_fake": self.hypergrid_fake, "megatron_fake": self.megatron_fake,
            "single_rank_communicators": self.single_rank, "world_shared": list(self.world_shared),
            "megatron_communicators": self.megatron, "megatron_gloo": self.megatron_gloo,
            "memory_mb": self.memory_mb, "megatron_memory_mb": self.megatron_memory_mb,
            "inside_node": self.inside_node, "inside_nvlink_domain": self.inside_domain,
            "comm_memory_mb": self.comm_memory_mb, "communicator_of_kind": dict(self.communicators),
        }


@dataclass(frozen=True)
class MaxCost:
    """The most communicators any rank holds, with the rank that holds them, and how it was found.

    ``method`` is ``"every rank"``, ``"every rank alike"`` (only grid groups: each rank holds the
    same number) or ``"sample of N ranks"`` (every pipeline stage and random ranks: a lower
    bound, said so).

    Example::

        >>> from hypergrid.planning.plan import plan_grid
        >>> m = max_cost(plan_grid([1 << 20, 1 << 20], ["tp", "dp"]))
        >>> m.hypergrid, m.method, m.exact
        (2, 'every rank alike', True)
    """

    hypergrid: int
    hypergrid_rank: int
    megatron: int
    megatron_rank: int
    memory_mb: int
    megatron_memory_mb: int
    ranks_examined: int
    method: str
    #: Of the two maxima, the groups on torch's fake backend.
    hypergrid_fake: int = 0
    megatron_fake: int = 0

    @property
    def exact(self) -> bool:
        """Whether the maximum is over every rank (not a sample)."""
        return not self.method.startswith("sample")

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields (see docs/cli.md).

        Example::

            >>> from hypergrid.planning.plan import plan_grid
            >>> max_cost(plan_grid([2], ["tp"])).as_dict()["exact"]
            True
        """
        return {
            "hypergrid_communicators": self.hypergrid, "hypergrid_rank": self.hypergrid_rank,
            "megatron_communicators": self.megatron, "megatron_rank": self.megatron_rank,
            "memory_mb": self.memory_mb, "megatron_memory_mb": self.megatron_memory_mb,
            "ranks_examined": self.ranks_examined, "method": self.method, "exact": self.exact,
            "hypergrid_fake": self.hypergrid_fake, "megatron_fake": self.megatron_fake,
        }


def _uniform(kind: GroupKind) -> bool:
    """Whether every rank's group of ``kind`` is the same shape, placed alike (a grid's tiling):
    the rules whose groups are boxes of the grid, wherever one is."""
    return kind.box(kind.layout.rank_offset) is not None


def _group(kind: GroupKind, rank: int) -> Optional[tuple[Hashable, int, int, int]]:
    """(identity, size, lowest, highest member) of ``rank``'s group of ``kind``; None: in none."""
    if not kind.layout.contains(rank):
        return None
    box = kind.box(rank)
    if box is None:
        members = kind.members(rank)
        if members is None:
            return None
        box = box_modes(members)
        if box is None:
            ranks = tuple(sorted(members))
            return ("set", ranks), len(ranks), ranks[0], ranks[-1]
    low, modes = box
    size, high = 1, low
    for n, s in modes:
        size *= n
        high += (n - 1) * s
    return ("box", low, modes), size, low, high


def _backend(kind: GroupKind, plan: Plan) -> Optional[str]:
    """The backend asked for, as hypergrid compares it (None: the default group's)."""
    choice = kind.creation.backend
    if choice is BackendChoice.GLOO:
        return "gloo"
    if choice is BackendChoice.PIPELINE:
        return plan.pipeline_backend
    if choice is BackendChoice.FAKE:
        return "fake"
    return None


def rank_cost(
    plan: Plan,
    rank: int,
    *,
    gpus_per_node: int = 8,
    nvlink_domain: Optional[int] = None,
    comm_memory_mb: int = DEFAULT_COMM_MEMORY_MB,
    nccl_options: bool = False,
) -> RankCost:
    """The communicators ``rank`` holds under ``plan``; see the module docstring.

    ``nvlink_domain``: GPUs per NVLink domain (default ``gpus_per_node``); ``nccl_options``:
    whether the job gives NCCL options per group (``nccl_communicator_config_path``), which keeps
    groups of different names apart. Cost: O(kinds x dims), plus the size of groups that are not
    a grid's own (embedding groups, optimizer-instance chunks).

    Example::

        >>> from hypergrid.planning.plan import plan_megatron
        >>> c = rank_cost(plan_megatron(1024, tp=8, pp=4, ep=16, etp=1), 1000, comm_memory_mb=500)
        >>> c.hypergrid, c.megatron, c.memory_mb, c.inside_node
        (10, 16, 5000, 2)
    """
    plan.check_rank(rank)
    gpus_per_node = positive_int("gpus_per_node", gpus_per_node)
    domain = positive_int("nvlink_domain", nvlink_domain if nvlink_domain is not None else gpus_per_node)
    comm_memory_mb = positive_int("comm_memory_mb", comm_memory_mb)
    shared: dict[Hashable, tuple[int, int, int, Optional[str]]] = {}
    private = megatron = megatron_gloo = megatron_fake = 0
    world_kinds: list[str] = []
    assignment: list[tuple[str, str]] = []
    for kind in plan.kinds:
        group = _group(kind, rank)
        if group is None:
            continue
        identity, size, low, high = group
        backend = _backend(kind, plan)
        gloo = backend == "gloo"
        # torchtitan's DeviceMesh hands a dim spanning the world the default group, unless it asks
        # another backend for it.
        if not (plan.anchor is Anchor.TORCHTITAN and size == plan.world_size and backend is None):
            megatron += 1
            megatron_gloo += gloo
            megatron_fake += backend == "fake"
        options = kind.creation.nccl_name if nccl_options and not gloo else None
        if kind.creation.private:
            private += 1
            key: Hashable = ("private", private)
        elif size == plan.world_size and backend in (None, "nccl") and options is None:
            world_kinds.append(kind.name)
            assignment.append((kind.name, "default"))
            continue
        else:
            key = (identity, backend, kind.creation.timeout, options)
        shared.setdefault(key, (size, low, high, backend))
        assignment.append((kind.name, str(list(shared).index(key) + 1)))
    gpu = [v for v in shared.values() if v[3] not in ("gloo", "fake")]
    # A rank's size-1 groups are one communicator only where their options agree; count as made.
    return RankCost(
        rank=rank,
        hypergrid=len(shared),
        hypergrid_gloo=sum(1 for v in shared.values() if v[3] == "gloo"),
        hypergrid_fake=sum(1 for v in shared.values() if v[3] == "fake"),
        single_rank=sum(1 for v in shared.values() if v[0] == 1),
        world_shared=tuple(world_kinds),
        megatron=megatron,
        megatron_gloo=megatron_gloo,
        memory_mb=len(gpu) * comm_memory_mb,
        megatron_fake=megatron_fake,
        megatron_memory_mb=(megatron - megatron_gloo - megatron_fake) * comm_memory_mb,
        inside_node=sum(1 for _, lo, hi, _ in gpu if lo // gpus_per_node == hi // gpus_per_node),
        inside_domain=sum(1 for _, lo, hi, _ in gpu if lo // domain == hi // domain),
        comm_memory_mb=comm_memory_mb,
        communicators=tuple(assignment),
    )


def _sample_ranks(plan: Plan, count: int, seed: int) -> list[int]:
    """Ranks at every pipeline stage (first, second, middle, last but one, last), at the grid's
    corners and at random: where ranks differ (embedding groups live on pipeline ends)."""
    layout = plan.layout
    rng = random.Random(seed)
    picks = {layout.rank_offset, layout.rank_offset + layout.size - 1}
    stages = [0]
    if "pp" in layout.dim_names:
        pp = layout.dim_size("pp")
        stages = sorted({0, 1 % pp, pp // 2, max(pp - 2, 0), pp - 1})
    for stage in stages:
        for corner in (0, -1):
            coords = [0 if corner == 0 else n - 1 for n in layout.shape]
            if "pp" in layout.dim_names:
                coords[layout.dim_names.index("pp")] = stage
            picks.add(layout.rank_of(coords))
        for _ in range(max(1, count // (2 * len(stages)))):
            coords = [rng.randrange(n) for n in layout.shape]
            if "pp" in layout.dim_names:
                coords[layout.dim_names.index("pp")] = stage
            picks.add(layout.rank_of(coords))
    while len(picks) < min(count, layout.size):
        picks.add(layout.rank_offset + rng.randrange(layout.size))
    return sorted(picks)


def max_cost(
    plan: Plan,
    *,
    comm_memory_mb: int = DEFAULT_COMM_MEMORY_MB,
    nccl_options: bool = False,
    exact_limit: int = EXACT_MAX_RANKS,
    sample: int = 256,
    seed: int = 0,
) -> MaxCost:
    """The most communicators any rank of ``plan`` holds, hypergrid's and Megatron-Core's.

    Every rank when the grid has at most ``exact_limit``; one rank when every kind is a grid's
    tiling (each rank then holds the same); otherwise ``sample`` ranks chosen by
    :func:`_sample_ranks` with ``seed``, and ``method`` says so.

    Example::

        >>> from hypergrid.planning.plan import plan_megatron
        >>> m = max_cost(plan_megatron(1 << 24, tp=8, pp=16, cp=2, ep=64), sample=32)
        >>> m.hypergrid, m.megatron, m.method
        (15, 17, 'sample of 32 ranks')
    """
    layout = plan.layout
    if layout.size <= exact_limit:
        ranks, method = list(layout.ranks), "every rank"
    elif all(_uniform(kind) for kind in plan.kinds):
        ranks, method = [layout.rank_offset], "every rank alike"
    else:
        ranks = _sample_ranks(plan, sample, seed)
        method = f"sample of {len(ranks)} ranks"
    best: Optional[RankCost] = None
    best_megatron: Optional[RankCost] = None
    for rank in ranks:
        cost = rank_cost(plan, rank, comm_memory_mb=comm_memory_mb, nccl_options=nccl_options)
        if best is None or (cost.hypergrid, cost.memory_mb) > (best.hypergrid, best.memory_mb):
            best = cost
        if best_megatron is None or (cost.megatron, cost.megatron_memory_mb) > (
            best_megatron.megatron, best_megatron.megatron_memory_mb
        ):
            best_megatron = cost
    assert best is not None and best_megatron is not None
    return MaxCost(
        hypergrid=best.hypergrid, hypergrid_rank=best.rank, megatron=best_megatron.megatron,
        megatron_rank=best_megatron.rank, memory_mb=best.memory_mb,
        megatron_memory_mb=best_megatron.megatron_memory_mb, ranks_examined=len(ranks), method=method,
        hypergrid_fake=best.hypergrid_fake, megatron_fake=best_megatron.megatron_fake,
    )


def cost_lines(cost: dict) -> list[str]:
    """Lines of text: the communicators and memory of ``cost["rank"]`` (a :meth:`RankCost.as_dict`
    or None) and ``cost["max"]`` (a :meth:`MaxCost.as_dict`), hypergrid's beside Megatron-Core's.

    Example::

        >>> from hypergrid.planning.plan import plan_grid
        >>> plan = plan_grid([2, 2], ["tp", "dp"])
        >>> lines = cost_lines({"comm_memory_mb": 600, "rank": rank_cost(plan, 1).as_dict(),
        ...                     "max": max_cost(plan).as_dict()})
        >>> lines[3].split()
        ['rank', '1', '2', '2', '1.2', 'GB', '1.2', 'GB']
    """
    anchor = cost.get("anchor", Anchor.MEGATRON_CORE.value)
    rows = [["communicators", "hypergrid", anchor, "memory (hypergrid)", f"memory ({anchor})"]]
    r, m = cost["rank"], cost["max"]
    if r is not None:
        rows.append([f"rank {r['rank']}", _count(r["hypergrid_communicators"], r.get("hypergrid_fake", 0)),
                     _count(r["megatron_communicators"], r.get("megatron_fake", 0)),
                     f"{r['memory_mb'] / 1000:.1f} GB", f"{r['megatron_memory_mb'] / 1000:.1f} GB"])
    rows.append([f"most of any rank ({m['method']})",
                 _count(m["hypergrid_communicators"], m.get("hypergrid_fake", 0), m["hypergrid_rank"]),
                 _count(m["megatron_communicators"], m.get("megatron_fake", 0), m["megatron_rank"]),
                 f"{m['memory_mb'] / 1000:.1f} GB", f"{m['megatron_memory_mb'] / 1000:.1f} GB"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = [""]
    for j, row in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    if r is not None:
        out.append(f"rank {r['rank']}: {r['inside_node']} of its communicators inside its node, "
                   f"{r['inside_nvlink_domain']} inside its NVLink domain; the default group serves "
                   f"{', '.join(r['world_shared']) or 'no kind'}")
    out.append(f"memory: GPU communicators x {cost['comm_memory_mb']} MB each, an estimate "
               f"(--comm-memory-mb; gloo groups hold none)")
    if any(d.get(f) for d in (r or {}, m) for f in ("hypergrid_fake", "megatron_fake")):
        out.append(f"fake: groups on torch's fake backend, which {anchor} asks for the mesh dims it does not "
                   f"use; counted, but process groups without a communicator, holding no memory")
    follows = cost.get("follows")
    if follows:
        out.append(f"{anchor} column: the groups {follows['description']} creates")
    return out


def _count(communicators: int, fake: int, rank: Optional[int] = None) -> str:
    """A count cell: ``18 (7 fake, rank 0)``, the parts in brackets only where they apply."""
    notes = ([f"{fake} fake"] if fake else []) + ([f"rank {rank}"] if rank is not None else [])
    return f"{communicators} ({', '.join(notes)})" if notes else str(communicators)
