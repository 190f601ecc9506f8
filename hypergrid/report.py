"""What a layout will do before it runs: group kinds, counts, node locality, one rank's groups.

Pure integer work over :class:`~hypergrid.layout.GridLayout`; no process group, no GPU, no
torch.distributed. The command line's ``plan`` and ``check`` and the pictures in
:mod:`hypergrid.viz` are built on the :class:`Plan` made here.

A plan is made either from Megatron-Core's keyword sizes (:func:`plan_megatron`: the dense grid
of ``order`` plus the expert view Megatron-Core builds for MoE layers) or from a free grid
(:func:`plan_grid`).

Example::

    >>> plan = plan_megatron(world_size=16, tp=2, pp=2, ep=2)
    >>> [kind.name for kind in plan.kinds][:4]
    ['dp_cp', 'dp', 'cp', 'mp']
    >>> summary = plan.summary("tp", gpus_per_node=8)
    >>> summary.count, summary.size, summary.crosses_nodes
    (8, 2, False)
    >>> plan.groups_of(5)["dp"]
    [1, 3, 5, 7]
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .kinds import GroupKind
from .layout import GridLayout

__all__ = [
    "GroupKind",
    "MegatronSizes",
    "KindSummary",
    "Plan",
    "plan_grid",
    "plan_megatron",
    "MAX_ENUMERATED_RANKS",
]

logger = logging.getLogger("hypergrid.report")

#: Largest world whose groups a plan lists in full (node locality looks at every group), about
#: ten seconds of pure Python. One rank's groups (``groups_of``) have no such limit.
MAX_ENUMERATED_RANKS = 1 << 22

@dataclass(frozen=True)
class MegatronSizes:
    """The Megatron-Core sizes a plan was made from, derived ones (``dp``, ``edp``) included.

    Example::

        >>> plan_megatron(world_size=16, tp=2, ep=4).megatron
        MegatronSizes(tp=2, pp=1, cp=1, ep=4, etp=2, dp=8, edp=2, order='tp-cp-ep-dp-pp')
    """

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    edp: int
    order: str


@dataclass(frozen=True)
class KindSummary:
    """How one group kind falls on nodes of ``gpus_per_node`` ranks.

    ``max_nodes`` is the most nodes any one group spans; ``crosses_nodes`` whether any group
    spans more than one; ``intra_node_groups`` how many groups stay inside a single node.

    Example::

        >>> plan = plan_grid([4, 4], ["tp", "dp"])
        >>> s = plan.summary("dp", gpus_per_node=4)
        >>> s.crosses_nodes, s.max_nodes, s.intra_node_groups
        (True, 4, 0)
    """

    name: str
    key: str
    view: Optional[str]
    megatron_name: Optional[str]
    count: int
    size: Optional[int]
    max_nodes: int
    intra_node_groups: int

    @property
    def crosses_nodes(self) -> bool:
        return self.max_nodes > 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "view": self.view,
            "megatron_name": self.megatron_name,
            "count": self.count,
            "size": self.size,
            "max_nodes_per_group": self.max_nodes,
            "intra_node_groups": self.intra_node_groups,
            "crosses_nodes": self.crosses_nodes,
        }


@dataclass
class Plan:
    """A layout to inspect: its grid, views, the group kinds it makes, and the world it fits in.

    ``megatron`` holds the Megatron-Core sizes the plan was made from (None for a free grid).
    ``kinds`` are :class:`~hypergrid.kinds.GroupKind` values: the same ones the Megatron adapter
    creates its groups from.

    Example::

        >>> plan = plan_grid([2, 3, 4], ["tp", "cp", "dp"])
        >>> plan.world_size, [k.name for k in plan.kinds]
        (24, ['tp', 'cp', 'dp'])
        >>> plan.coords(7)
        {'tp': 1, 'cp': 0, 'dp': 1}
    """

    world_size: int
    layout: GridLayout
    kinds: list[GroupKind]
    views: dict[str, GridLayout] = field(default_factory=dict)
    megatron: Optional[MegatronSizes] = None
    #: Per view, the dims whose groups it shares with the grid (``register_view``'s ``shared_dims``).
    shared_dims: dict[str, list[str]] = field(default_factory=dict)
    #: The backend Megatron's pipeline groups ask for (``pipeline_model_parallel_comm_backend``;
    #: None: the default group's).
    pipeline_backend: Optional[str] = None

    def kind(self, name: str) -> GroupKind:
        """The group kind called ``name``; ValueError naming the known kinds otherwise."""
        for kind in self.kinds:
            if kind.name == name:
                return kind
        raise ValueError(f"unknown group kind {name!r}; this layout has {[k.name for k in self.kinds]}")

    def check_rank(self, rank: int) -> None:
        """ValueError unless ``rank`` lies on the grid."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
        if not self.layout.contains(rank):
            raise ValueError(
                f"rank {rank} is out of range: the layout spans ranks "
                f"[{self.layout.rank_offset}, {self.layout.rank_offset + self.layout.size})"
            )

    def coords(self, rank: int, view: Optional[str] = None) -> dict[str, int]:
        """Coordinates of ``rank`` in the grid (or in ``view``), by dim name."""
        self.check_rank(rank)
        layout = self.layout if view is None else self.views[view]
        return dict(zip(layout.dim_names, layout.coords(rank)))

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        """Every group ``rank`` is in, by kind name; O(sum of group sizes)."""
        self.check_rank(rank)
        return {kind.name: kind.members(rank) for kind in self.kinds}

    def check_enumerable(self) -> None:
        """ValueError if the world is too large to list every group (:data:`MAX_ENUMERATED_RANKS`).

        Example::

            >>> plan_grid([2, 1 << 30], ["tp", "dp"]).check_enumerable()
            Traceback (most recent call last):
            ...
            ValueError: world size 2147483648 is too large to list every group: summaries and checks enumerate all groups, up to 4194304 ranks
        """
        if self.world_size > MAX_ENUMERATED_RANKS:
            raise ValueError(
                f"world size {self.world_size} is too large to list every group: summaries and checks "
                f"enumerate all groups, up to {MAX_ENUMERATED_RANKS} ranks"
            )

    def summary(self, name: str, gpus_per_node: int) -> KindSummary:
        """Count, size and node locality of the kind called ``name``; O(grid size)."""
        self.check_enumerable()
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node <= 0:
            raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
        kind = self.kind(name)
        max_nodes = 0
        intra = 0
        for group in kind.enumerate():
            if not group:
                continue
            nodes = len({rank // gpus_per_node for rank in group})
            max_nodes = max(max_nodes, nodes)
            intra += nodes == 1
        megatron_name = kind.megatron_global.label if kind.megatron_global else None
        return KindSummary(kind.name, kind.key, kind.view, megatron_name, kind.count, kind.size, max_nodes, intra)

    def summaries(self, gpus_per_node: int) -> list[KindSummary]:
        """:meth:`summary` of every kind, in plan order."""
        return [self.summary(kind.name, gpus_per_node) for kind in self.kinds]

    def as_dict(self, gpus_per_node: int, rank: Optional[int] = None) -> dict[str, Any]:
        """Everything the plan answers, as JSON-ready data (``rank``: add that rank's groups)."""
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "gpus_per_node": gpus_per_node,
            "nodes": math.ceil(self.world_size / gpus_per_node),
            "grid": {
                "shape": list(self.layout.shape),
                "dim_names": list(self.layout.dim_names),
                "rank_offset": self.layout.rank_offset,
            },
            "views": {
                name: {"shape": list(v.shape), "dim_names": list(v.dim_names)} for name, v in self.views.items()
            },
            "megatron": None if self.megatron is None else asdict(self.megatron),
            "kinds": [s.as_dict() for s in self.summaries(gpus_per_node)],
        }
        if rank is not None:
            out["rank"] = {
                "rank": rank,
                "node": rank // gpus_per_node,
                "local_rank": rank % gpus_per_node,
                "coords": self.coords(rank),
                "view_coords": {name: self.coords(rank, name) for name in self.views},
                "groups": self.groups_of(rank),
            }
        return out


def _parse_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def plan_grid(
    shape: Sequence[int],
    dim_names: Sequence[str],
    *,
    world_size: Optional[int] = None,
    rank_offset: int = 0,
    groups: Optional[Sequence[Sequence[str]]] = None,
) -> Plan:
    """A plan of a free grid: one kind per dim, plus one per multi-dim request in ``groups``.

    ``world_size`` defaults to the grid's size; a grid larger than the world is a ValueError.

    Example::

        >>> plan = plan_grid([2, 3, 4], ["tp", "cp", "dp"], groups=[["cp", "dp"]])
        >>> [(k.name, k.key, k.count, k.size) for k in plan.kinds][-1]
        ('cp-dp', 'dp-cp', 2, 12)
    """
    layout = GridLayout(tuple(shape), tuple(dim_names), rank_offset)
    world = layout.rank_offset + layout.size if world_size is None else _parse_positive("world_size", world_size)
    if layout.rank_offset + layout.size > world:
        raise ValueError(
            f"the grid {list(layout.shape)} needs {layout.size} ranks from rank {layout.rank_offset} "
            f"but the world has {world}"
        )
    kinds = [GroupKind(name, layout, (name,)) for name in layout.dim_names]
    for request in groups or []:
        dims = tuple(request)
        layout.key(list(dims))  # unknown or repeated dims fail here, naming the dim
        name = "-".join(dims)
        if any(k.name == name for k in kinds):
            continue
        kinds.append(GroupKind(name, layout, dims))
    return Plan(world, layout, kinds)


def plan_megatron(
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    order: str = "tp-cp-ep-dp-pp",
    **megatron_kwargs: Any,
) -> Plan:
    """The groups Megatron-Core's ``initialize_model_parallel`` builds for these sizes.

    The groups come from :func:`hypergrid.megatron.plan.plan_model_parallel` (pure rank algebra,
    no megatron import); ``megatron_kwargs`` are further keywords of Megatron-Core's function.
    The grid is the dense layout of ``order``; the ``"expert"`` view the layout Megatron-Core's
    expert ``RankGenerator`` uses (dims ``tp, ep, dp, pp``: expert tp and expert dp). Gloo
    duplicates of groups (same members, gloo backend) are left out. Raises ValueError naming the
    size that does not divide the world or the dim missing from ``order``.

    Example::

        >>> plan = plan_megatron(world_size=1024, tp=8, pp=4, ep=16, etp=1)
        >>> plan.layout.shape, plan.views["expert"].shape
        ((8, 1, 32, 4), (1, 16, 16, 4))
        >>> plan.kind("expt_dp").size, plan.kind("embd").members(500)
        (16, None)
    """
    from .megatron.plan import plan_model_parallel

    megatron_kwargs.setdefault("create_gloo_process_groups", False)
    mplan = plan_model_parallel(
        world_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order, **megatron_kwargs,
    )
    sizes = mplan.config.sizes()
    megatron = MegatronSizes(
        tp=sizes["tensor_model_parallel_size"], pp=sizes["pipeline_model_parallel_size"],
        cp=sizes["context_parallel_size"], ep=sizes["expert_model_parallel_size"],
        etp=sizes["expert_tensor_parallel_size"], dp=sizes["data_parallel_size"],
        edp=sizes["expert_data_parallel_size"], order=sizes["order"],
    )
    logger.debug("megatron plan %s: dense %s, expert %s", megatron, mplan.dense, mplan.expert)
    return Plan(mplan.config.world_size, mplan.dense, list(mplan.kinds), {"expert": mplan.expert}, megatron,
                {"expert": mplan.expert_shared_dims}, mplan.config.pipeline_model_parallel_comm_backend)
