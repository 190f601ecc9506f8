"""Every process group Megatron-Core's ``initialize_model_parallel`` makes, as pure rank lists.

No torch.distributed, no megatron import, no process group: a :class:`MegatronPlan` is computed
from the same keywords as Megatron-Core's function plus a world size, so it serves the command
line (``hypergrid plan``), checks before launch, and the Megatron adapter itself, which creates
exactly the groups listed here.

Each group kind has a name (the ``ProcessGroupCollection`` field or ``nccl_comm_cfgs`` key where
one exists, e.g. ``"tp"``, ``"dp_cp"``, ``"expt_dp"``) and a :class:`GroupSpec` saying which
``parallel_state`` global it fills, and with which backend, options and description Megatron-Core
creates it. Two ways to ask:

* ``plan.groups`` (or ``plan.enumerate(name)``): every group of every kind, list for list in
  Megatron-Core's creation order. O(world size) per kind.
* ``plan.rank_groups(rank)`` (or ``plan.rank_group(name, rank)``): only the groups one rank is
  in, each in O(its size), never enumerating the world.

Example::

    >>> plan = plan_model_parallel(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    >>> plan.groups["tp"]
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> plan.groups["pp"]
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    >>> mine = plan.rank_groups(5)
    >>> mine["dp"], mine["embd"], mine["pos_embd"]
    ([5, 7], [1, 5], None)
    >>> plan.aliases["intra_dp_cp"]      # one distributed-optimizer instance: the same group
    'dp_cp'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

from ..layout import GridLayout
from .config import GTP_REMAT_TOKEN, MegatronConfig
from .features import COMMON_FEATURES, MegatronFeatures

__all__ = [
    "GroupSpec",
    "MegatronPlan",
    "plan_model_parallel",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "ALIAS_GLOBALS",
]

#: The ``parallel_state`` global each alias kind fills (with the group of the kind it reuses).
ALIAS_GLOBALS = {
    "intra_dp_cp": "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "intra_dp_cp_gloo": "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "intra_expt_dp": "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "intra_expt_dp_gloo": "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    # megatron-core 0.19's data-distribution groups (spanning gtp_remat): the plain ones at size 1.
    "dp_gtp": "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "dp_cp_gtp": "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
    "intra_dp_cp_gtp": "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
    "expt_dp_gtp": "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "intra_expt_dp_gtp": "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
}


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Megatron-Core's default: word embeddings live on the first and last pipeline stage.

    Example::

        >>> default_embedding_ranks([1, 5, 9]), default_embedding_ranks([3])
        ([1, 9], [3])
    """
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Megatron-Core's default: position embeddings live on the first pipeline stage.

    Example::

        >>> default_position_embedding_ranks([1, 5, 9])
        [1]
    """
    return [pp_ranks[0]]


@dataclass(frozen=True)
class GroupSpec:
    """One kind of group Megatron-Core creates, and how.

    ``layout``/``dims``: the grid (``"dense"`` or ``"expert"``) and dims the groups come from, or
    the *base* groups a derived kind is cut from. ``derive`` is None for grid groups, else one of
    ``"chunk"`` (consecutive slices of ``size`` of each base group), ``"level"`` (a hierarchical
    level: ``size`` ranks ``stride`` apart inside blocks of each base group), ``"embd"`` /
    ``"pos_embd"`` (the embedding callback applied to each pipeline group), ``"dist_opt"``
    (``size`` consecutive expert tp-ep-pp groups joined), ``"single"`` (every rank alone: an axis
    of size 1 megatron-core still makes groups for) or ``"span"`` (one group of every rank the
    grids span, in rank order). ``nccl_name`` is the key Megatron-Core
    looks up in ``nccl_comm_cfgs`` for the group's options (None: no options); ``backend`` the
    backend it asks for (None: the default; ``"pp"``: ``pipeline_model_parallel_comm_backend``);
    ``timeout`` whether it passes ``distributed_timeout_minutes``. ``private``: the group must be
    a communicator of its own even when sharing is on (the all-gather group and SHARP targets).

    Example::

        >>> plan_model_parallel(8).spec("dp_cp").megatron_global
        '_DATA_PARALLEL_GROUP_WITH_CP'
    """

    name: str
    megatron_global: str
    group_desc: str
    layout: str
    dims: tuple[str, ...]
    nccl_name: Optional[str] = None
    backend: Optional[str] = None
    timeout: bool = True
    derive: Optional[str] = None
    size: int = 0
    stride: int = 1
    private: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain JSON values."""
        return {
            "name": self.name,
            "megatron_global": self.megatron_global,
            "group_desc": self.group_desc,
            "layout": self.layout,
            "dims": list(self.dims),
            "derive": self.derive,
            "nccl_name": self.nccl_name,
            "backend": self.backend,
            "timeout": self.timeout,
            "private": self.private,
        }


class MegatronPlan:
    """All of Megatron-Core's groups for one configuration, from pure rank algebra.

    Build it with :func:`plan_model_parallel`. ``dense`` and ``expert`` are the two
    :class:`~hypergrid.layout.GridLayout` factorizations of the world (the expert one is what
    Megatron-Core's expert ``RankGenerator`` lays out); ``specs`` lists the group kinds in
    Megatron-Core's creation order; ``aliases`` maps kinds that are not created separately to the
    kind whose group they reuse (e.g. ``intra_dp_cp`` is ``dp_cp`` with one optimizer instance).

    Example::

        >>> plan = plan_model_parallel(16, tensor_model_parallel_size=2, expert_model_parallel_size=4,
        ...                            expert_tensor_parallel_size=1)
        >>> plan.dense.dim_names, plan.dense.shape
        (('tp', 'cp', 'dp', 'pp'), (2, 1, 8, 1))
        >>> plan.rank_group("ep", 6), plan.rank_group("expt_dp", 6)
        ([4, 5, 6, 7], [2, 6, 10, 14])
    """

    def __init__(self, config: MegatronConfig) -> None:
        if not isinstance(config, MegatronConfig):
            raise TypeError(f"config must be a MegatronConfig, got {type(config).__name__}")
        self.config = config
        self.features: MegatronFeatures = config.features
        self.dense = GridLayout(config.dense_shape, config.dense_dims, config.rank_offset)
        self.expert = GridLayout(config.expert_shape, config.expert_dims, config.rank_offset)
        self._embd = config.get_embedding_ranks or default_embedding_ranks
        self._pos_embd = config.get_position_embedding_ranks or default_position_embedding_ranks
        self.specs: tuple[GroupSpec, ...] = tuple(self._build_specs())
        self._by_name = {spec.name: spec for spec in self.specs}
        self.aliases: dict[str, str] = self._build_aliases()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self.config.sizes().items() if v is not None)
        return f"MegatronPlan({sizes})"

    # ------------------------------------------------------------------ the kinds of groups
    def _build_aliases(self) -> dict[str, str]:
        """Kinds that are another kind's group, each resolved to a created kind."""
        c, f = self.config, self.features
        aliases: dict[str, str] = {}
        if c.num_distributed_optimizer_instances == 1:
            aliases["intra_dp_cp"] = "dp_cp"
            aliases["intra_expt_dp"] = "expt_dp"
            if c.dense_gloo:
                aliases["intra_dp_cp_gloo"] = "dp_cp_gloo"
            if c.expert_gloo:
                aliases["intra_expt_dp_gloo"] = "expt_dp_gloo"
        if f.gtp_remat:
            # The data-distribution groups span gtp_remat; at size 1 they are the plain ones.
            if c.gtp == 1:
                aliases.update(dp_gtp="dp", dp_cp_gtp="dp_cp", intra_dp_cp_gtp="intra_dp_cp")
            else:
                aliases["intra_dp_cp_gtp"] = "dp_cp_gtp"
        if f.expert_gtp_remat:
            if c.egtp == 1:
                aliases.update(expt_dp_gtp="expt_dp", intra_expt_dp_gtp="intra_expt_dp")
            else:
                aliases["intra_expt_dp_gtp"] = "expt_dp_gtp"
        resolved = {}
        for alias, target in aliases.items():
            while target in aliases:
                target = aliases[target]
            resolved[alias] = target
        return resolved

    def _axis_spec(self, name: str, megatron_global: str, group_desc: str, layout: str, size: int,
                   nccl_name: str) -> GroupSpec:
        # megatron-core makes the gtp_remat groups even at size 1: one group per rank.
        if size > 1:
            return GroupSpec(name, megatron_global, group_desc, layout, (GTP_REMAT_TOKEN,), nccl_name=nccl_name)
        return GroupSpec(name, megatron_global, group_desc, layout, (), nccl_name=nccl_name, derive="single")

    def _build_specs(self) -> list[GroupSpec]:
        c, f = self.config, self.features
        gloo = c.dense_gloo
        expert_gloo = c.expert_gloo
        ninst = c.num_distributed_optimizer_instances
        sharp = c.sharp_group
        dense, expert = "dense", "expert"
        dp_cp = ("dp", "cp")
        # Dims that span the gtp_remat axis where it has more than one rank.
        gtp = (GTP_REMAT_TOKEN,) if c.gtp > 1 else ()
        egtp = (GTP_REMAT_TOKEN,) if c.egtp > 1 else ()
        s: list[GroupSpec] = []
        if f.gtp_remat:
            s.append(self._axis_spec("gtp_remat", "_GTP_WEIGHT_REMAT_GROUP", "GTP_WEIGHT_REMAT_GROUP", dense, c.gtp,
                                     "gtp_remat"))
        s.append(GroupSpec("dp_cp", "_DATA_PARALLEL_GROUP_WITH_CP", "DATA_PARALLEL_GROUP_WITH_CP", dense, dp_cp,
                           nccl_name="dp_cp", private=sharp == "dp"))
        if f.all_gather_keyword and c.create_all_gather_group:
            # Its purpose is a second communicator over the same ranks: never shared.
            s.append(GroupSpec("dp_cp_ag", "_DATA_PARALLEL_GROUP_WITH_CP_AG", "DATA_PARALLEL_GROUP_WITH_CP_AG",
                               dense, dp_cp, nccl_name="dp_cp", private=True))
        if gloo:
            s.append(GroupSpec("dp_cp_gloo", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                               dense, dp_cp, backend="gloo"))
        if ninst > 1:
            size = c.intra_partial_data_parallel_size
            s.append(GroupSpec("intra_dp_cp", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                               "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", dense, dp_cp,
                               nccl_name="intra_dp_cp", derive="chunk", size=size))
            if gloo:
                s.append(GroupSpec("intra_dp_cp_gloo", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                                   "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", dense, dp_cp,
                                   backend="gloo", derive="chunk", size=size))
        for size in c.hybrid_group_sizes:
            s.append(GroupSpec(f"hybrid_dp_cp_{size}", "_HYBRID_DP_CP_GROUPS", f"HYBRID_DP_CP_GROUP_{size}",
                               dense, dp_cp, nccl_name="dp_cp", timeout=False, derive="chunk", size=size))
        s.append(GroupSpec("dp", "_DATA_PARALLEL_GROUP", "DATA_PARALLEL_GROUP", dense, ("dp",), nccl_name="dp"))
        if gloo:
            s.append(GroupSpec("dp_gloo", "_DATA_PARALLEL_GROUP_GLOO", "DATA_PARALLEL_GROUP_GLOO", dense, ("dp",),
                               backend="gloo"))
        if f.gtp_remat and c.gtp > 1:
            s += [
                GroupSpec("dp_gtp", "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
                          dense, (GTP_REMAT_TOKEN, "dp"), nccl_name="gtp_remat_dp"),
                GroupSpec("dp_cp_gtp", "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
                          "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", dense, (GTP_REMAT_TOKEN, "dp", "cp"),
                          nccl_name="gtp_remat_dp_cp"),
            ]
        s.append(GroupSpec("cp", "_CONTEXT_PARALLEL_GROUP", "CONTEXT_PARALLEL_GROUP", dense, ("cp",), nccl_name="cp"))
        stride = 1
        for level, size in enumerate(c.hierarchical_cp_sizes):
            s.append(GroupSpec(f"hcp_{level}", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
                               f"HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{level}", dense, ("cp",),
                               nccl_name="hcp", derive="level", size=size, stride=stride))
            stride *= size
        s += [
            GroupSpec("mp", "_MODEL_PARALLEL_GROUP", "MODEL_PARALLEL_GROUP", dense, ("tp",) + gtp + ("pp",),
                      nccl_name="mp"),
            GroupSpec("tp", "_TENSOR_MODEL_PARALLEL_GROUP", "TENSOR_MODEL_PARALLEL_GROUP", dense, ("tp",),
                      nccl_name="tp"),
            GroupSpec("pp", "_PIPELINE_MODEL_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP", dense, ("pp",),
                      nccl_name=None if c.pipeline_model_parallel_comm_backend == "ucc" else "pp", backend="pp"),
            GroupSpec("embd", "_EMBEDDING_GROUP", "EMBEDDING_GROUP", dense, ("pp",), nccl_name="embd", derive="embd"),
            GroupSpec("pos_embd", "_POSITION_EMBEDDING_GROUP", "POSITION_EMBEDDING_GROUP", dense, ("pp",),
                      nccl_name="pos_embd", derive="pos_embd"),
            # Both span gtp_remat, like dp: its peers hold distinct data.
            GroupSpec("tp_dp_cp", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
                      dense, ("tp",) + gtp + ("dp", "cp"), nccl_name="tp_dp_cp"),
            GroupSpec("tp_dp", "_TENSOR_AND_DATA_PARALLEL_GROUP", "TENSOR_AND_DATA_PARALLEL_GROUP", dense,
                      ("tp",) + gtp + ("dp",), nccl_name="tp_dp"),
            GroupSpec("tp_cp", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "TENSOR_AND_CONTEXT_PARALLEL_GROUP", dense,
                      ("tp", "cp"), nccl_name="tp_cp"),
        ]
        if f.expert_gtp_remat:
            s.append(self._axis_spec("expt_gtp_remat", "_EXPERT_GTP_WEIGHT_REMAT_GROUP", "EXPERT_GTP_WEIGHT_REMAT_GROUP",
                                     expert, c.egtp, "expt_gtp_remat"))
        s += [
            GroupSpec("ep", "_EXPERT_MODEL_PARALLEL_GROUP", "EXPERT_MODEL_PARALLEL_GROUP", expert, ("ep",),
                      nccl_name="ep"),
            GroupSpec("expt_tp", "_EXPERT_TENSOR_PARALLEL_GROUP", "EXPERT_TENSOR_PARALLEL_GROUP", expert, ("tp",),
                      nccl_name="ep_tp"),
            GroupSpec("tp_ep", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
                      expert, ("tp", "ep"), nccl_name="tp_ep_mp"),
            GroupSpec("tp_ep_pp", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
                      "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", expert, ("tp", "ep", "pp"), nccl_name="tp_ep_pp"),
        ]
        if f.expert_gtp_remat:
            # Made even when the expert gtp_remat axis has one rank: then a second communicator
            # over the tp-ep-pp ranks.
            s.append(GroupSpec("tp_ep_pp_egtp", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
                               "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", expert,
                               ("tp", "ep") + egtp + ("pp",), nccl_name="tp_ep_gtp_remat_pp"))
        s.append(GroupSpec("expt_dp", "_EXPERT_DATA_PARALLEL_GROUP", "EXPERT_DATA_PARALLEL_GROUP", expert, ("dp",),
                           nccl_name="ep_dp"))
        if expert_gloo:
            # Megatron-Core creates this one without the distributed timeout.
            s.append(GroupSpec("expt_dp_gloo", "_EXPERT_DATA_PARALLEL_GROUP_GLOO", "EXPERT_DATA_PARALLEL_GROUP_GLOO",
                               expert, ("dp",), backend="gloo", timeout=False))
        if ninst > 1:
            intra = c.intra_partial_expert_data_parallel_size
            levels = [("intra_expt_dp", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "intra_ep_dp", intra, 1),
                      ("inter_expt_dp", "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "inter_ep_dp", ninst, intra)]
            for level, (name, glob, nccl, size, stride) in enumerate(levels):
                s.append(GroupSpec(name, glob, f"HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L{level}", expert, ("dp",),
                                   nccl_name=nccl, derive="level", size=size, stride=stride,
                                   private=name == "inter_expt_dp" and sharp == "dp_replica"))
                if expert_gloo:
                    # Megatron-Core passes the level's NCCL options to the gloo group too; the inter
                    # level's gloo group is created though no getter returns it.
                    s.append(GroupSpec(f"{name}_gloo", f"{glob}_GLOO" if level == 0 else "",
                                       f"HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L{level}", expert, ("dp",),
                                       nccl_name=nccl, backend="gloo", derive="level", size=size, stride=stride))
        if f.expert_gtp_remat and c.egtp > 1:
            s.append(GroupSpec("expt_dp_gtp", "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
                               "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", expert, (GTP_REMAT_TOKEN, "dp"),
                               nccl_name="ep_gtp_remat_dp"))
        if c.gtp_active:
            # Under gtp_remat the grad-norm group must cover every rank: one group of them all.
            s.append(GroupSpec("intra_dist_opt", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
                               "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", expert, (),
                               nccl_name="intra_dist_opt_instance", derive="span"))
        else:
            s.append(GroupSpec("intra_dist_opt", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
                               "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", expert, ("tp", "ep", "pp"),
                               nccl_name="intra_dist_opt_instance", derive="dist_opt",
                               size=c.intra_partial_expert_data_parallel_size))
        return s

    # ------------------------------------------------------------------ queries
    @property
    def names(self) -> list[str]:
        """The kinds of groups created, in Megatron-Core's creation order."""
        return [spec.name for spec in self.specs]

    def spec(self, name: str) -> GroupSpec:
        """The :class:`GroupSpec` of ``name`` (an alias resolves to the kind it reuses)."""
        resolved = self.aliases.get(name, name)
        try:
            return self._by_name[resolved]
        except KeyError:
            raise KeyError(f"no group kind {name!r} in this plan; kinds: {self.names}, aliases: {sorted(self.aliases)}") from None

    def layout(self, which: str) -> GridLayout:
        """``"dense"`` or ``"expert"``: the grid layout of that name."""
        if which == "dense":
            return self.dense
        if which == "expert":
            return self.expert
        raise ValueError(f"layout must be 'dense' or 'expert', got {which!r}")

    def group_size(self, name: str) -> Optional[int]:
        """The size every group of kind ``name`` has, or None where sizes differ. O(ndims).

        Example::

            >>> plan_model_parallel(64, pipeline_model_parallel_size=4).group_size("intra_dist_opt")
            64
        """
        spec = self.spec(name)
        if spec.derive == "single":
            return 1
        if spec.derive == "span":
            return self.config.grid_size
        layout = self.layout(spec.layout)
        base = layout.group_size(list(spec.dims))
        if spec.derive is None:
            return base
        if spec.derive == "chunk":
            return spec.size if base % spec.size == 0 else None
        if spec.derive == "level":
            return spec.size
        if spec.derive == "dist_opt":
            return spec.size * base
        # Embedding groups: known sizes only for Megatron-Core's default callbacks.
        default = self.config.get_embedding_ranks if spec.derive == "embd" else self.config.get_position_embedding_ranks
        if default is None:
            return 1 if spec.derive == "pos_embd" or base == 1 else 2
        return None

    def rank_group(self, name: str, rank: int) -> Optional[list[int]]:
        """The members of ``rank``'s group of kind ``name`` in Megatron-Core's order; None if none.

        O(size of the group): nothing else is enumerated.

        Example::

            >>> plan = plan_model_parallel(8, pipeline_model_parallel_size=4)
            >>> plan.rank_group("embd", 6), plan.rank_group("embd", 2)
            ([0, 6], None)
        """
        spec = self.spec(name)
        layout = self.layout(spec.layout)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank {rank!r} is outside the world of {self.config.world_size} ranks")
        if not layout.contains(rank):
            # Megatron-Core leaves a rank outside [rank_offset, rank_offset + local_world_size) in no group.
            return None
        if spec.derive == "single":
            return [rank]
        if spec.derive == "span":
            return list(layout.ranks)
        base = layout.group_ranks(list(spec.dims), rank) if spec.derive != "dist_opt" else None
        if spec.derive is None:
            return base
        if spec.derive == "chunk":
            start = (base.index(rank) // spec.size) * spec.size
            return base[start:start + spec.size]
        if spec.derive == "level":
            return _level_group(base, base.index(rank), spec.size, spec.stride)
        if spec.derive in ("embd", "pos_embd"):
            ranks = self._callback_ranks(spec.derive, base)
            return ranks if rank in ranks else None
        # dist_opt: the block of `size` consecutive tp-ep-pp groups (indexed by the expert dp
        # coordinate) that holds this rank.
        index = layout.group_index(list(spec.dims), rank)
        first = (index // spec.size) * spec.size
        return [r for j in range(first, first + spec.size) for r in self._tp_ep_pp_group(j)]

    def rank_groups(self, rank: int) -> dict[str, Optional[list[int]]]:
        """Every kind's group for ``rank`` (None where it is in none), in creation order.

        Example::

            >>> plan_model_parallel(4, tensor_model_parallel_size=2).rank_groups(3)["tp"]
            [2, 3]
        """
        return {name: self.rank_group(name, rank) for name in self.names}

    def enumerate(self, name: str) -> list[list[int]]:
        """Every group of kind ``name``, in Megatron-Core's creation order. O(world size).

        Example::

            >>> plan_model_parallel(8, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]).enumerate("hcp_1")
            [[0, 2], [1, 3], [4, 6], [5, 7]]
        """
        spec = self.spec(name)
        layout = self.layout(spec.layout)
        if spec.derive == "single":
            return [[r] for r in layout.ranks]
        if spec.derive == "span":
            return [list(layout.ranks)]
        if spec.derive == "dist_opt":
            groups = layout.enumerate(list(spec.dims))
            return [sum(groups[i:i + spec.size], []) for i in range(0, len(groups), spec.size)]
        bases = layout.enumerate(list(spec.dims))
        if spec.derive is None:
            return bases
        out: list[list[int]] = []
        for base in bases:
            if spec.derive == "chunk":
                out += [base[i:i + spec.size] for i in range(0, len(base), spec.size)]
            elif spec.derive == "level":
                block = spec.size * spec.stride
                out += [
                    _level_group(base, start + u, spec.size, spec.stride)
                    for start in range(0, len(base), block)
                    for u in range(spec.stride)
                ]
            else:
                out.append(self._callback_ranks(spec.derive, base))
        return out

    @cached_property
    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of every kind created, by kind, as ``{name: enumerate(name)}``. O(world size) each."""
        return {name: self.enumerate(name) for name in self.names}

    def to_dict(self, rank: Optional[int] = None, *, include_groups: bool = True) -> dict[str, Any]:
        """The plan as plain JSON values: sizes, layouts, specs, aliases, groups (and ``rank``'s).

        Example::

            >>> d = plan_model_parallel(4, tensor_model_parallel_size=2).to_dict(rank=1)
            >>> d["dense"], d["rank_groups"]["tp"]
            ({'dim_names': ['tp', 'cp', 'dp', 'pp'], 'shape': [2, 1, 2, 1]}, [0, 1])
        """
        out: dict[str, Any] = {
            "megatron_core": {"version": self.features.version, "keywords": list(self.features.keywords)},
            "sizes": self.config.sizes(),
            "dense": {"dim_names": list(self.dense.dim_names), "shape": list(self.dense.shape)},
            "expert": {"dim_names": list(self.expert.dim_names), "shape": list(self.expert.shape)},
            "specs": [spec.to_dict() for spec in self.specs],
            "aliases": dict(self.aliases),
        }
        if include_groups:
            out["groups"] = self.groups
        if rank is not None:
            out["rank"] = rank
            out["rank_groups"] = self.rank_groups(rank)
        return out

    def to_json(self, rank: Optional[int] = None, *, include_groups: bool = True, **dumps_kwargs: Any) -> str:
        """:meth:`to_dict` as a JSON string (``json.dumps`` keywords pass through)."""
        return json.dumps(self.to_dict(rank, include_groups=include_groups), **dumps_kwargs)

    # ------------------------------------------------------------------ helpers
    def _tp_ep_pp_group(self, index: int) -> list[int]:
        # Expert tp-ep-pp groups are numbered by the expert dp coordinate (the only other dim).
        coords = {name: 0 for name in self.expert.dim_names}
        coords["dp"] = index
        return self.expert.group_ranks(["tp", "ep", "pp"], self.expert.rank_of(coords))

    def _callback_ranks(self, derive: str, pp_ranks: list[int]) -> list[int]:
        callback = self._embd if derive == "embd" else self._pos_embd
        keyword = "get_embedding_ranks" if derive == "embd" else "get_position_embedding_ranks"
        result = callback(list(pp_ranks))
        if isinstance(result, (str, bytes)) or not hasattr(result, "__iter__"):
            raise TypeError(f"{keyword} must return a list of ranks, got {type(result).__name__} {result!r}")
        ranks = list(result)
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int):
                raise TypeError(f"{keyword} must return ints, got {r!r} in {ranks} for pipeline group {pp_ranks}")
        # An empty list would make torch build a group of the whole world; ranks outside the
        # pipeline group would make a rank's groups depend on other pipelines (not local).
        if not ranks or not set(ranks) <= set(pp_ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"{keyword} must return distinct ranks of the pipeline group it is given, at least "
                f"one; for pipeline group {pp_ranks} it returned {ranks}"
            )
        return ranks


def _level_group(base: list[int], position: int, size: int, stride: int) -> list[int]:
    """The hierarchical-level group of ``base[position]``: ``size`` members ``stride`` apart."""
    block = size * stride
    start = (position // block) * block + position % stride
    return [base[start + j * stride] for j in range(size)]


def plan_model_parallel(
    world_size: int, *, features: MegatronFeatures = COMMON_FEATURES, **megatron_kwargs: Any
) -> MegatronPlan:
    """Plan Megatron-Core's groups for ``world_size`` ranks from its ``initialize_model_parallel`` keywords.

    ``features`` is the megatron-core version planned for
    (:data:`~hypergrid.megatron.features.MEGATRON_CORE_0_16`, ``..._0_19``, or
    :func:`hypergrid.megatron.installed_features` for the installed one); by default the keywords
    and groups every supported version has. Accepts every keyword of that version's function
    (others raise ``TypeError`` naming them and the version) and validates them as
    :class:`~hypergrid.megatron.config.MegatronConfig` does. Needs no process group and no
    megatron-core.

    Example::

        >>> plan = plan_model_parallel(32, tensor_model_parallel_size=4, context_parallel_size=2,
        ...                            num_distributed_optimizer_instances=2)
        >>> plan.group_size("dp_cp"), plan.group_size("intra_dp_cp")
        (8, 4)
        >>> plan.rank_group("intra_dp_cp", 13)
        [1, 5, 9, 13]
        >>> from hypergrid.megatron.features import MEGATRON_CORE_0_19
        >>> gtp = plan_model_parallel(16, features=MEGATRON_CORE_0_19, tensor_model_parallel_size=2, gtp_remat_size=2)
        >>> gtp.rank_group("gtp_remat", 5), gtp.rank_group("dp", 5), gtp.rank_group("dp_gtp", 5)
        ([5, 7], [1, 5, 9, 13], [1, 3, 5, 7, 9, 11, 13, 15])
    """
    return MegatronPlan(MegatronConfig.from_megatron_kwargs(world_size, megatron_kwargs, features))
