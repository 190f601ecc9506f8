"""What a layout will do before it runs: group kinds, counts, node locality, one rank's groups.

Pure integer work over :class:`~hypergrid.layout.GridLayout`; no process group, no GPU, no
torch.distributed. The command line's ``plan`` and ``check`` and the pictures in
:mod:`hypergrid.planning.viz` are built on the :class:`Plan` made here.

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

import difflib
import enum
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..layout import GridLayout
from ..layout.checks import positive_int
from ..layout.kinds import GroupKind
from ..releases import Followed

if TYPE_CHECKING:
    from ..megatron.spec.config import MegatronConfig
    from ..megatron.spec.plan import MegatronPlan

__all__ = [
    "Anchor",
    "GroupKind",
    "MegatronSizes",
    "KindSummary",
    "Plan",
    "plan_grid",
    "plan_megatron",
    "plan_of_megatron",
    "MAX_LISTED_WORLD",
    "SAMPLED_RANKS_BUDGET",
    "LISTED_MEMBERS",
    "HEAD_MEMBERS",
]

logger = logging.getLogger(__name__)

#: Largest world whose every group a summary lists one by one (about ten seconds of pure Python);
#: larger worlds are summarised over a sample of groups. One rank's groups have no limit. (The
#: layout's own limit, :data:`hypergrid.layout.MAX_ENUMERATED_RANKS`, bounds what fits in memory.)
MAX_LISTED_WORLD = 1 << 22


#: How many members, in all, a sampled summary of one kind lists (groups of a sample of ranks).
SAMPLED_RANKS_BUDGET = 1 << 16
#: The largest group :meth:`Plan.rank_groups` lists member by member (so a JSON plan of any world
#: up to this many ranks lists every group in full); larger ones come as their first
#: :data:`HEAD_MEMBERS` members, their last one and their size.
LISTED_MEMBERS = 1 << 16
HEAD_MEMBERS = 16

class Anchor(str, enum.Enum):
    """Whose own way of creating a plan's groups hypergrid's sharing is compared with.

    ``megatron-core``: ``initialize_model_parallel`` (and ``HyperCommGrid``) make a new group for
    every kind holding the rank. ``torchtitan``: its DeviceMeshes make one per mesh dim and
    flattened dim, except a dim spanning the whole world, which reuses the default group.
    """

    MEGATRON_CORE = "megatron-core"
    TORCHTITAN = "torchtitan"


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
    """How one group kind falls on nodes of ``gpus_per_node`` ranks and NVLink domains.

    ``max_nodes`` / ``max_domains`` is the most nodes / NVLink domains (``nvlink_domain``
    consecutive ranks each, which need not divide a node count) any one group spans;
    ``intra_node_groups`` how many groups stay inside a single node (None when sampled);
    ``placement`` is ``"node"`` (every group inside a node), ``"nvlink"`` (inside an NVLink
    domain) or ``"across"``. ``groups_examined`` is the number of groups looked at: every group
    (``exact``), or for worlds over :data:`MAX_LISTED_WORLD` ranks a sample of them.

    Example::

        >>> plan = plan_grid([4, 4], ["tp", "dp"])
        >>> s = plan.summary("dp", gpus_per_node=4)
        >>> s.crosses_nodes, s.max_nodes, s.intra_node_groups, s.placement
        (True, 4, 0, 'across')
        >>> plan.summary("dp", gpus_per_node=4, nvlink_domain=16).placement
        'nvlink'
    """

    name: str
    key: str
    view: Optional[str]
    megatron_name: Optional[str]
    count: int
    size: Optional[int]
    max_nodes: int
    intra_node_groups: Optional[int]
    max_domains: int = 1
    groups_examined: int = 0
    exact: bool = True
    #: The backend the kind's groups ask for (:class:`~hypergrid.layout.kinds.BackendChoice` value):
    #: ``"fake"`` groups have no communicator.
    backend: str = "default"

    @property
    def crosses_nodes(self) -> bool:
        """Whether some group spans more than one node."""
        return self.max_nodes > 1

    @property
    def placement(self) -> str:
        """``"node"``, ``"nvlink"`` or ``"across"``: where the kind's widest group lies."""
        return "node" if self.max_nodes <= 1 else "nvlink" if self.max_domains <= 1 else "across"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (see docs/cli.md)."""
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
            "max_nvlink_domains_per_group": self.max_domains,
            "placement": self.placement,
            "groups_examined": self.groups_examined,
            "locality_exact": self.exact,
            "backend": self.backend,
        }


@dataclass
class Plan:
    """A layout to inspect: its grid, views, the group kinds it makes, and the world it fits in.

    ``megatron`` holds the Megatron-Core sizes the plan was made from (None for a free grid).
    ``kinds`` are :class:`~hypergrid.layout.kinds.GroupKind` values: the same ones the Megatron adapter
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
    #: Whose creation the cost report puts beside hypergrid's.
    anchor: Anchor = Anchor.MEGATRON_CORE
    #: The anchor's release the kinds follow and how it was chosen (None: not said; a Megatron
    #: plan is then of the groups every supported megatron-core makes).
    follows: Optional[Followed] = None
    #: The Megatron-Core configuration a Megatron plan was made from (None: another layout): a
    #: recovery plans Megatron-Core's groups again from it (:mod:`hypergrid.planning.recovery`).
    megatron_config: Optional[MegatronConfig] = None
    #: A Megatron-LM launch line's ``--global-batch-size`` and ``--micro-batch-size`` (None: not
    #: given): a shrink of dp warns where the global batch no longer divides.
    global_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None

    def kind(self, name: str) -> GroupKind:
        """The group kind called ``name``; ValueError naming the known kinds otherwise."""
        for kind in self.kinds:
            if kind.name == name:
                return kind
        names = [k.name for k in self.kinds]
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown group kind {name!r}; {hint}this layout has {names}")

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

    def groups_of(self, rank: int) -> dict[str, Optional[list[int]]]:
        """Every group ``rank`` is in, by kind name (None: in none of that kind); O(sum of group sizes)."""
        self.check_rank(rank)
        return {kind.name: kind.members(rank) for kind in self.kinds}

    def group_heads(self, rank: int, head: int) -> dict[str, Optional[dict[str, Any]]]:
        """Per kind, ``rank``'s group as ``{"size", "head", "last"}``: its first ``head`` members in
        order and its last, without listing a larger grid group (O(head + ndims) for those).

        Example::

            >>> plan_grid([4, 1 << 40], ["tp", "dp"]).group_heads(5, 3)["dp"]
            {'size': 1099511627776, 'head': [1, 5, 9], 'last': 4398046511101}
        """
        self.check_rank(rank)
        out: dict[str, Optional[dict[str, Any]]] = {}
        for kind in self.kinds:
            box = kind.box(rank)
            if box is not None and kind.is_grid_groups:
                ordered, _ = kind.layout.order_dims(list(kind.dims))
                index = {n: i for i, n in enumerate(kind.layout.dim_names)}
                steps = [(kind.layout.shape[index[d]], kind.layout.strides[index[d]]) for d in ordered]
                low, size = box[0], math.prod(n for n, _ in steps)
                members = []
                for i in range(min(head, size)):  # the i-th member: i in mixed radix, last dim fastest
                    rank_i = low
                    for n, st in reversed(steps):
                        i, c = divmod(i, n)
                        rank_i += c * st
                    members.append(rank_i)
                last = low + sum((n - 1) * st for n, st in steps)
                out[kind.name] = {"size": math.prod(n for n, _ in steps), "head": members, "last": last}
                continue
            if box is not None and math.prod(n for n, _ in box[1]) > SAMPLED_RANKS_BUDGET:
                low, modes = box  # a span or joined groups: in rank order
                out[kind.name] = {"size": math.prod(n for n, _ in modes), "head": None, "last": None}
                continue
            group = kind.members(rank)
            out[kind.name] = None if group is None else {"size": len(group), "head": group[:head], "last": group[-1]}
        return out

    def rank_groups(self, rank: int, listed: Optional[int] = None) -> dict[str, Any]:
        """Per kind, ``rank``'s group as a list of members where it has at most ``listed``
        (default :data:`LISTED_MEMBERS`), else as :meth:`group_heads` gives it (``{"size", "head",
        "last"}``, the first :data:`HEAD_MEMBERS`); None where the rank is in no group of the kind.

        What ``plan --json`` prints: any world answers without listing a group of billions.

        Example::

            >>> groups = plan_grid([4, 1 << 40], ["tp", "dp"]).rank_groups(5)
            >>> groups["tp"], groups["dp"]["size"], groups["dp"]["head"][:3]
            ([4, 5, 6, 7], 1099511627776, [1, 5, 9])
        """
        listed = LISTED_MEMBERS if listed is None else listed
        out: dict[str, Any] = self.group_heads(rank, HEAD_MEMBERS)
        for kind in self.kinds:
            entry = out[kind.name]
            if entry is not None and entry["size"] <= listed:
                whole = entry["head"] is not None and len(entry["head"]) == entry["size"]
                out[kind.name] = entry["head"] if whole else kind.members(rank)
        return out

    def check_enumerable(self) -> None:
        """ValueError if the world is too large to list every group (:data:`MAX_LISTED_WORLD`).

        Example::

            >>> plan_grid([2, 1 << 30], ["tp", "dp"]).check_enumerable()
            Traceback (most recent call last):
            ...
            ValueError: world size 2147483648 is too large to list every group: summaries and checks enumerate all groups, up to 4194304 ranks
        """
        if self.world_size > MAX_LISTED_WORLD:
            raise ValueError(
                f"world size {self.world_size} is too large to list every group: summaries and checks "
                f"enumerate all groups, up to {MAX_LISTED_WORLD} ranks"
            )

    def summary(self, name: str, gpus_per_node: int, nvlink_domain: Optional[int] = None) -> KindSummary:
        """Count, size and node / NVLink-domain locality of the kind called ``name``.

        ``nvlink_domain`` defaults to ``gpus_per_node``. Up to :data:`MAX_LISTED_WORLD` ranks
        every group is looked at (O(grid size)); beyond, the groups of a sample of ranks, each
        rank's in O(group size), within :data:`SAMPLED_RANKS_BUDGET` members in all: the summary
        says so (``exact`` False, ``intra_node_groups`` None). Counts and sizes are exact always.

        Example::

            >>> plan_grid([8, 1 << 30], ["tp", "dp"]).summary("tp", 8).exact
            False

        A sampled group of more than :data:`SAMPLED_RANKS_BUDGET` ranks is not listed: its nodes
        are bounded by its span (lowest to highest member), an upper bound.
        """
        gpus_per_node = positive_int("gpus_per_node", gpus_per_node)
        domain = gpus_per_node if nvlink_domain is None else positive_int("nvlink_domain", nvlink_domain)
        kind = self.kind(name)
        exact = self.world_size <= MAX_LISTED_WORLD
        groups = kind.enumerate() if exact else self._sample_groups(kind)
        max_nodes = max_domains = examined = intra = 0
        for group in groups:
            if not group:
                continue
            examined += 1
            if isinstance(group, tuple):  # a group too large to list: bounds from its span
                size, low, high = group
                nodes = min(size, high // gpus_per_node - low // gpus_per_node + 1)
                domains = min(size, high // domain - low // domain + 1)
            else:
                nodes = len({rank // gpus_per_node for rank in group})
                domains = len({rank // domain for rank in group})
            max_nodes, max_domains = max(max_nodes, nodes), max(max_domains, domains)
            intra += nodes == 1
        megatron_name = kind.megatron_global.label if kind.megatron_global else None
        return KindSummary(kind.name, kind.key, kind.view, megatron_name, kind.count, kind.size, max_nodes,
                           intra if exact else None, max_domains, examined, exact, kind.creation.backend.value)

    def sample_ranks(self, random_ranks: int, seed: int = 0) -> list[int]:
        """Ranks whose groups stand for the world's: the grid's first and last, the first rank of
        each pipeline stage (up to 64) where the grid has a ``pp`` dim, then ``random_ranks``
        drawn with ``seed``. Repeats are possible; O(count).

        Example::

            >>> plan_grid([2, 3, 4], ["tp", "pp", "dp"]).sample_ranks(2, seed=1)
            [0, 23, 0, 2, 4, 4, 18]
        """
        layout = self.layout
        rng = random.Random(seed)
        ranks = [layout.rank_offset, layout.rank_offset + layout.size - 1]
        if "pp" in layout.dim_names:
            stride = layout.strides[layout.dim_names.index("pp")]
            ranks += [layout.rank_offset + s * stride for s in range(min(layout.dim_size("pp"), 64))]
        return ranks + [layout.rank_offset + rng.randrange(layout.size) for _ in range(random_ranks)]

    def _sample_groups(self, kind: GroupKind) -> list[list[int]]:
        """The groups of a few ranks: the first and last of the grid, every pipeline stage's first
        rank where the grid has a ``pp`` dim, and random ones (fixed seed)."""
        budget = max(1, SAMPLED_RANKS_BUDGET // max(1, kind.size or 1))
        seen: set[object] = set()
        groups: list[Any] = []
        for rank in self.sample_ranks(min(256, budget))[:budget + 2]:
            box = kind.box(rank)
            if box is not None and math.prod(n for n, _ in box[1]) > SAMPLED_RANKS_BUDGET:
                low, modes = box
                group: Any = (math.prod(n for n, _ in modes), low, low + sum((n - 1) * st for n, st in modes))
            else:
                members = kind.members(rank)
                group = None if members is None else members
            key = group if isinstance(group, tuple) else None if group is None else tuple(group)
            if key is not None and key not in seen:
                seen.add(key)
                groups.append(group)
        return groups

    def summaries(self, gpus_per_node: int, nvlink_domain: Optional[int] = None) -> list[KindSummary]:
        """:meth:`summary` of every kind, in plan order."""
        return [self.summary(kind.name, gpus_per_node, nvlink_domain) for kind in self.kinds]

    def as_dict(self, gpus_per_node: int, rank: Optional[int] = None,
                nvlink_domain: Optional[int] = None, heads: Optional[int] = None) -> dict[str, Any]:
        """Everything the plan answers, as JSON-ready data (``rank``: add that rank's groups, as
        :meth:`rank_groups` gives them, or with ``heads`` as :meth:`group_heads` does). O(ndims)
        for the rank's groups at any world size beyond :data:`LISTED_MEMBERS` ranks."""
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "gpus_per_node": gpus_per_node,
            "nvlink_domain": gpus_per_node if nvlink_domain is None else nvlink_domain,
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
            "kinds": [s.as_dict() for s in self.summaries(gpus_per_node, nvlink_domain)],
        }
        if rank is not None:
            out["rank"] = {
                "rank": rank,
                "node": rank // gpus_per_node,
                "local_rank": rank % gpus_per_node,
                "coords": self.coords(rank),
                "view_coords": {name: self.coords(rank, name) for name in self.views},
                "groups": self.rank_groups(rank) if heads is None else self.group_heads(rank, heads),
            }
        return out


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
    world = layout.rank_offset + layout.size if world_size is None else positive_int("world_size", world_size)
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

    The groups come from :func:`hypergrid.megatron.spec.plan.plan_model_parallel` (pure rank algebra,
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
    from ..megatron.spec.plan import plan_model_parallel

    megatron_kwargs.setdefault("create_gloo_process_groups", False)
    return plan_of_megatron(plan_model_parallel(
        world_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order, **megatron_kwargs,
    ))


def plan_of_megatron(mplan: MegatronPlan) -> Plan:
    """The :class:`Plan` of Megatron-Core's groups as :func:`~hypergrid.megatron.spec.plan.plan_model_parallel`
    plans them: its dense grid, kinds and expert view, laid where its placement says.

    Example::

        >>> from hypergrid.layout.rank_map import RankMap
        >>> from hypergrid.megatron.spec.plan import plan_model_parallel
        >>> placed = plan_of_megatron(plan_model_parallel(4, tensor_model_parallel_size=2,
        ...                                               placement=RankMap.of([0, 1, 8, 3])))
        >>> placed.megatron.dp, placed.groups_of(8)["tp"], placed.megatron_config.world_size
        (2, [8, 3], 4)
    """
    sizes = mplan.config.sizes()
    megatron = MegatronSizes(
        tp=sizes["tensor_model_parallel_size"], pp=sizes["pipeline_model_parallel_size"],
        cp=sizes["context_parallel_size"], ep=sizes["expert_model_parallel_size"],
        etp=sizes["expert_tensor_parallel_size"], dp=sizes["data_parallel_size"],
        edp=sizes["expert_data_parallel_size"], order=sizes["order"],
    )
    logger.debug("megatron plan %s: dense %s, expert %s", megatron, mplan.dense, mplan.expert)
    return Plan(mplan.config.world_size, mplan.dense, list(mplan.kinds), {"expert": mplan.expert}, megatron,
                {"expert": mplan.expert_shared_dims}, mplan.config.pipeline_model_parallel_comm_backend,
                megatron_config=mplan.config)
