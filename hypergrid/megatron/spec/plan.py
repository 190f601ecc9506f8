"""Every process group Megatron-Core's ``initialize_model_parallel`` makes, as pure rank lists.

No torch.distributed, no megatron import, no process group: a :class:`MegatronPlan` is computed
from the same keywords as Megatron-Core's function plus a world size, so it serves the command
line (``hypergrid plan``), checks before launch, and the Megatron adapter itself, which creates
exactly the groups listed here.

Each group kind is a :class:`~hypergrid.layout.kinds.GroupKind` named after the ``ProcessGroupCollection``
field or ``nccl_comm_cfgs`` key where one exists (e.g. ``"tp"``, ``"dp_cp"``, ``"expt_dp"``),
saying how its groups come from the grid, which ``parallel_state`` global it fills, and with which
backend, options and description Megatron-Core creates it. Two ways to ask:

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
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, Optional

from ...layout import GridLayout
from ...layout.kinds import (
    GRID_GROUPS,
    BackendChoice,
    Chunks,
    Creation,
    Derivation,
    GroupKind,
    JoinedGroups,
    Levels,
    MegatronGlobal,
    PipelineSubset,
    Singletons,
    Span,
)
from ...layout.rank_map import RankMap
from .config import GTP_REMAT_TOKEN, MegatronConfig
from .features import COMMON_FEATURES, MegatronFeatures

__all__ = [
    "MegatronPlan",
    "SharpStep",
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
class SharpStep:
    """Where Megatron-Core switches NCCL SHARP on and off during initialization.

    NCCL applies SHARP to the first communicator built while ``NCCL_COLLNET_ENABLE=1``: it is set
    just before kind ``enable_before`` is created, and once kind ``barrier_after`` is, a barrier on
    kind ``barrier_on``'s group makes NCCL build that communicator, and the variable is cleared.

    Example::

        >>> plan_model_parallel(8, use_sharp=True, create_gloo_process_groups=False).sharp
        SharpStep(enable_before='dp_cp', barrier_after='dp_cp', barrier_on='dp_cp')
    """

    enable_before: str
    barrier_after: str
    barrier_on: str


class MegatronPlan:
    """All of Megatron-Core's groups for one configuration, from pure rank algebra.

    Build it with :func:`plan_model_parallel`. ``dense`` and ``expert`` are the two
    :class:`~hypergrid.layout.GridLayout` factorizations of the world (the expert one is what
    Megatron-Core's expert ``RankGenerator`` lays out); ``kinds`` lists the group kinds in
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

    def __init__(self, config: MegatronConfig, placement: Optional[RankMap] = None) -> None:
        if not isinstance(config, MegatronConfig):
            raise TypeError(f"config must be a MegatronConfig, got {type(config).__name__}")
        if placement is not None and (config.rank_offset or config.local_world_size not in (None, config.world_size)):
            raise ValueError("a placement replaces rank_offset and local_world_size; give one or the others")
        self.config = config
        self.features: MegatronFeatures = config.features
        #: Where the plan's positions sit among global ranks (None: ``rank_offset + position``).
        self.placement = placement
        self.dense = GridLayout(config.dense_shape, config.dense_dims, config.rank_offset, placement)
        self.expert = GridLayout(config.expert_shape, config.expert_dims, config.rank_offset, placement)
        self.kinds: tuple[GroupKind, ...] = tuple(self._build_kinds())
        self._by_name = {kind.name: kind for kind in self.kinds}
        self.sharp: Optional[SharpStep] = self._sharp_step()
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

    def _kind(
        self,
        name: str,
        megatron_global: Optional[str],
        group_desc: str,
        layout: str,
        dims: tuple[str, ...],
        derivation: Derivation = GRID_GROUPS,
        *,
        nccl_name: Optional[str] = None,
        backend: BackendChoice = BackendChoice.DEFAULT,
        timeout: bool = True,
        private: bool = False,
        entry: Optional[int] = None,
        in_dict: bool = False,
    ) -> GroupKind:
        """One kind as Megatron-Core creates it (``layout``: ``"dense"`` or ``"expert"``)."""
        return GroupKind(
            name, self.layout(layout), dims, derivation, view=None if layout == "dense" else layout,
            megatron_global=None if megatron_global is None else MegatronGlobal(megatron_global, entry, in_dict),
            creation=Creation(group_desc, nccl_name, backend, timeout, private),
        )

    def _axis_kind(self, name: str, megatron_global: str, group_desc: str, layout: str, size: int,
                   nccl_name: str) -> GroupKind:
        # megatron-core makes the gtp_remat groups even at size 1: one group per rank.
        if size > 1:
            return self._kind(name, megatron_global, group_desc, layout, (GTP_REMAT_TOKEN,), nccl_name=nccl_name)
        return self._kind(name, megatron_global, group_desc, layout, (), Singletons(), nccl_name=nccl_name)

    def _embedding(self, name: str, megatron_global: str, group_desc: str, keyword: str) -> GroupKind:
        user = getattr(self.config, keyword)
        if user is not None:
            select, size = user, None
        elif name == "embd":
            select, size = default_embedding_ranks, 2
        else:
            select, size = default_position_embedding_ranks, 1
        return self._kind(name, megatron_global, group_desc, "dense", ("pp",), PipelineSubset(select, keyword, size),
                          nccl_name=name)

    def _build_kinds(self) -> list[GroupKind]:
        """Every kind Megatron-Core creates, in its creation order."""
        return self._data_parallel_kinds() + self._model_parallel_kinds() + self._expert_kinds() + [
            self._optimizer_instance_kind()
        ]

    def _data_parallel_kinds(self) -> list[GroupKind]:
        c, f, k = self.config, self.features, self._kind
        gloo, ninst, sharp = c.dense_gloo, c.num_distributed_optimizer_instances, c.sharp_group
        gloo_backend = BackendChoice.GLOO
        dp_cp = ("dp", "cp")
        s: list[GroupKind] = []
        if f.gtp_remat:
            s.append(self._axis_kind("gtp_remat", "_GTP_WEIGHT_REMAT_GROUP", "GTP_WEIGHT_REMAT_GROUP", "dense", c.gtp,
                                     "gtp_remat"))
        s.append(k("dp_cp", "_DATA_PARALLEL_GROUP_WITH_CP", "DATA_PARALLEL_GROUP_WITH_CP", "dense", dp_cp,
                   nccl_name="dp_cp", private=sharp == "dp"))
        if f.all_gather_keyword and c.create_all_gather_group:
            # Its purpose is a second communicator over the same ranks: never shared.
            s.append(k("dp_cp_ag", "_DATA_PARALLEL_GROUP_WITH_CP_AG", "DATA_PARALLEL_GROUP_WITH_CP_AG", "dense", dp_cp,
                       nccl_name="dp_cp", private=True))
        if gloo:
            s.append(k("dp_cp_gloo", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "DATA_PARALLEL_GROUP_WITH_CP_GLOO", "dense",
                       dp_cp, backend=gloo_backend))
        if ninst > 1:
            chunks = Chunks(c.intra_partial_data_parallel_size)
            s.append(k("intra_dp_cp", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                       "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "dense", dp_cp, chunks, nccl_name="intra_dp_cp"))
            if gloo:
                s.append(k("intra_dp_cp_gloo", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                           "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "dense", dp_cp, chunks,
                           backend=gloo_backend))
        for size in c.hybrid_group_sizes:
            s.append(k(f"hybrid_dp_cp_{size}", "_HYBRID_DP_CP_GROUPS", f"HYBRID_DP_CP_GROUP_{size}", "dense", dp_cp,
                       Chunks(size), nccl_name="dp_cp", timeout=False, entry=size, in_dict=True))
        s.append(k("dp", "_DATA_PARALLEL_GROUP", "DATA_PARALLEL_GROUP", "dense", ("dp",), nccl_name="dp"))
        if gloo:
            s.append(k("dp_gloo", "_DATA_PARALLEL_GROUP_GLOO", "DATA_PARALLEL_GROUP_GLOO", "dense", ("dp",),
                       backend=gloo_backend))
        if f.gtp_remat and c.gtp > 1:
            s += [
                k("dp_gtp", "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "dense",
                  (GTP_REMAT_TOKEN, "dp"), nccl_name="gtp_remat_dp"),
                k("dp_cp_gtp", "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
                  "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", "dense", (GTP_REMAT_TOKEN, "dp", "cp"),
                  nccl_name="gtp_remat_dp_cp"),
            ]
        s.append(k("cp", "_CONTEXT_PARALLEL_GROUP", "CONTEXT_PARALLEL_GROUP", "dense", ("cp",), nccl_name="cp"))
        stride = 1
        for level, size in enumerate(c.hierarchical_cp_sizes):
            s.append(k(f"hcp_{level}", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
                       f"HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{level}", "dense", ("cp",), Levels(size, stride),
                       nccl_name="hcp", entry=level))
            stride *= size
        return s

    def _model_parallel_kinds(self) -> list[GroupKind]:
        c, k = self.config, self._kind
        # Dims that span the gtp_remat axis where it has more than one rank.
        gtp = (GTP_REMAT_TOKEN,) if c.gtp > 1 else ()
        return [
            k("mp", "_MODEL_PARALLEL_GROUP", "MODEL_PARALLEL_GROUP", "dense", ("tp",) + gtp + ("pp",), nccl_name="mp"),
            k("tp", "_TENSOR_MODEL_PARALLEL_GROUP", "TENSOR_MODEL_PARALLEL_GROUP", "dense", ("tp",), nccl_name="tp"),
            k("pp", "_PIPELINE_MODEL_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP", "dense", ("pp",),
              nccl_name=None if c.pipeline_model_parallel_comm_backend == "ucc" else "pp",
              backend=BackendChoice.PIPELINE),
            self._embedding("embd", "_EMBEDDING_GROUP", "EMBEDDING_GROUP", "get_embedding_ranks"),
            self._embedding("pos_embd", "_POSITION_EMBEDDING_GROUP", "POSITION_EMBEDDING_GROUP",
                            "get_position_embedding_ranks"),
            # Both span gtp_remat, like dp: its peers hold distinct data.
            k("tp_dp_cp", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "dense",
              ("tp",) + gtp + ("dp", "cp"), nccl_name="tp_dp_cp"),
            k("tp_dp", "_TENSOR_AND_DATA_PARALLEL_GROUP", "TENSOR_AND_DATA_PARALLEL_GROUP", "dense",
              ("tp",) + gtp + ("dp",), nccl_name="tp_dp"),
            k("tp_cp", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "TENSOR_AND_CONTEXT_PARALLEL_GROUP", "dense", ("tp", "cp"),
              nccl_name="tp_cp"),
        ]

    def _expert_kinds(self) -> list[GroupKind]:
        c, f, k = self.config, self.features, self._kind
        expert_gloo, ninst, sharp = c.expert_gloo, c.num_distributed_optimizer_instances, c.sharp_group
        egtp = (GTP_REMAT_TOKEN,) if c.egtp > 1 else ()
        s: list[GroupKind] = []
        if f.expert_gtp_remat:
            s.append(self._axis_kind("expt_gtp_remat", "_EXPERT_GTP_WEIGHT_REMAT_GROUP",
                                     "EXPERT_GTP_WEIGHT_REMAT_GROUP", "expert", c.egtp, "expt_gtp_remat"))
        s += [
            k("ep", "_EXPERT_MODEL_PARALLEL_GROUP", "EXPERT_MODEL_PARALLEL_GROUP", "expert", ("ep",), nccl_name="ep"),
            k("expt_tp", "_EXPERT_TENSOR_PARALLEL_GROUP", "EXPERT_TENSOR_PARALLEL_GROUP", "expert", ("tp",),
              nccl_name="ep_tp"),
            k("tp_ep", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "expert",
              ("tp", "ep"), nccl_name="tp_ep_mp"),
            k("tp_ep_pp", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
              "expert", ("tp", "ep", "pp"), nccl_name="tp_ep_pp"),
        ]
        if f.expert_gtp_remat:
            # Made even when the expert gtp_remat axis has one rank: then a second communicator
            # over the tp-ep-pp ranks.
            s.append(k("tp_ep_pp_egtp", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
                       "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP", "expert", ("tp", "ep") + egtp + ("pp",),
                       nccl_name="tp_ep_gtp_remat_pp"))
        s.append(k("expt_dp", "_EXPERT_DATA_PARALLEL_GROUP", "EXPERT_DATA_PARALLEL_GROUP", "expert", ("dp",),
                   nccl_name="ep_dp"))
        if expert_gloo:
            # Megatron-Core creates this one without the distributed timeout.
            s.append(k("expt_dp_gloo", "_EXPERT_DATA_PARALLEL_GROUP_GLOO", "EXPERT_DATA_PARALLEL_GROUP_GLOO", "expert",
                       ("dp",), backend=BackendChoice.GLOO, timeout=False))
        if ninst > 1:
            intra = c.intra_partial_expert_data_parallel_size
            levels = [("intra_expt_dp", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "intra_ep_dp", Levels(intra, 1)),
                      ("inter_expt_dp", "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "inter_ep_dp", Levels(ninst, intra))]
            for level, (name, glob, nccl, derivation) in enumerate(levels):
                s.append(k(name, glob, f"HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L{level}", "expert", ("dp",),
                           derivation, nccl_name=nccl, private=name == "inter_expt_dp" and sharp == "dp_replica"))
                if expert_gloo:
                    # Megatron-Core passes the level's NCCL options to the gloo group too; the inter
                    # level's gloo group is created though no getter returns it.
                    s.append(k(f"{name}_gloo", f"{glob}_GLOO" if level == 0 else None,
                               f"HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L{level}", "expert", ("dp",), derivation,
                               nccl_name=nccl, backend=BackendChoice.GLOO))
        if f.expert_gtp_remat and c.egtp > 1:
            s.append(k("expt_dp_gtp", "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
                       "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT", "expert", (GTP_REMAT_TOKEN, "dp"),
                       nccl_name="ep_gtp_remat_dp"))
        return s

    def _sharp_step(self) -> Optional[SharpStep]:
        # The last kind of the family created back to back over the SHARP target's ranks.
        families = {
            "dp": ("dp_cp", ("dp_cp", "dp_cp_ag", "dp_cp_gloo", "intra_dp_cp", "intra_dp_cp_gloo"), "dp_cp"),
            "dp_replica": ("intra_expt_dp", ("inter_expt_dp", "inter_expt_dp_gloo"), "inter_expt_dp"),
        }
        if self.config.sharp_group not in families:
            return None
        enable_before, family, barrier_on = families[self.config.sharp_group]
        present = [name for name in family if name in self._by_name]
        if enable_before not in self._by_name or not present:
            return None
        return SharpStep(enable_before, present[-1], barrier_on)

    def _optimizer_instance_kind(self) -> GroupKind:
        c = self.config
        glob, desc = "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"
        if c.gtp_active:
            # Under gtp_remat the grad-norm group must cover every rank: one group of them all.
            return self._kind("intra_dist_opt", glob, desc, "expert", (), Span(), nccl_name="intra_dist_opt_instance")
        # The block of consecutive expert tp-ep-pp groups (numbered by the expert dp coordinate,
        # the only other dim) of one optimizer instance.
        return self._kind("intra_dist_opt", glob, desc, "expert", ("tp", "ep", "pp"),
                          JoinedGroups(c.intra_partial_expert_data_parallel_size, "dp"),
                          nccl_name="intra_dist_opt_instance")

    # ------------------------------------------------------------------ queries
    @property
    def expert_shared_dims(self) -> list[str]:
        """The dims whose groups the expert layout shares with the dense one: ``pp`` where it has
        more than one rank (Megatron-Core builds the pipeline groups once, from the dense grid).

        Example::

            >>> plan_model_parallel(8, pipeline_model_parallel_size=2).expert_shared_dims
            ['pp']
        """
        return ["pp"] if self.dense.dim_size("pp") > 1 else []

    @property
    def names(self) -> list[str]:
        """The kinds of groups created, in Megatron-Core's creation order."""
        return [kind.name for kind in self.kinds]

    def kind(self, name: str) -> GroupKind:
        """The :class:`~hypergrid.layout.kinds.GroupKind` called ``name`` (an alias resolves to the kind
        it reuses).

        Example::

            >>> plan_model_parallel(8).kind("dp_cp").megatron_global.name
            '_DATA_PARALLEL_GROUP_WITH_CP'
        """
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
        return self.kind(name).size

    def rank_group(self, name: str, rank: int) -> Optional[list[int]]:
        """The members of ``rank``'s group of kind ``name`` in Megatron-Core's order; None if none.

        O(size of the group): nothing else is enumerated. A rank outside
        ``[rank_offset, rank_offset + local_world_size)`` is in no group, as in Megatron-Core.

        Example::

            >>> plan = plan_model_parallel(8, pipeline_model_parallel_size=4)
            >>> plan.rank_group("embd", 6), plan.rank_group("embd", 2)
            ([0, 6], None)
        """
        kind = self.kind(name)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or (
            self.placement is None and rank >= self.config.world_size
        ):
            raise ValueError(f"rank {rank!r} is outside the world of {self.config.world_size} ranks")
        return kind.members(rank)

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
        return self.kind(name).enumerate()

    @cached_property
    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of every kind created, by kind, as ``{name: enumerate(name)}``. O(world size) each."""
        return {name: self.enumerate(name) for name in self.names}

    def to_dict(self, rank: Optional[int] = None, *, include_groups: bool = True) -> dict[str, Any]:
        """The plan as plain JSON values: sizes, layouts, kinds, aliases, groups (and ``rank``'s).

        Example::

            >>> d = plan_model_parallel(4, tensor_model_parallel_size=2).to_dict(rank=1)
            >>> d["dense"], d["rank_groups"]["tp"]
            ({'dim_names': ['tp', 'cp', 'dp', 'pp'], 'shape': [2, 1, 2, 1]}, [0, 1])
            >>> d["kinds"][0]["name"], d["kinds"][0]["megatron_global"], d["kinds"][0]["backend"]
            ('dp_cp', '_DATA_PARALLEL_GROUP_WITH_CP', 'default')
        """
        out: dict[str, Any] = {
            "megatron_core": {"version": self.features.version, "keywords": list(self.features.keywords)},
            "sizes": self.config.sizes(),
            "dense": {"dim_names": list(self.dense.dim_names), "shape": list(self.dense.shape)},
            "expert": {"dim_names": list(self.expert.dim_names), "shape": list(self.expert.shape)},
            "kinds": [_kind_dict(kind) for kind in self.kinds],
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


def _kind_dict(kind: GroupKind) -> dict[str, Any]:
    creation = asdict(kind.creation)
    creation["backend"] = kind.creation.backend.value
    return {
        "name": kind.name,
        "megatron_global": kind.megatron_global.name if kind.megatron_global else None,
        "layout": kind.view or "dense",
        "dims": list(kind.dims),
        "rule": kind.derivation.describe() or None,
        **creation,
    }


def plan_model_parallel(
    world_size: int, *, features: MegatronFeatures = COMMON_FEATURES, placement: Optional[RankMap] = None,
    **megatron_kwargs: Any
) -> MegatronPlan:
    """Plan Megatron-Core's groups for ``world_size`` ranks from its ``initialize_model_parallel`` keywords.

    ``features`` is the megatron-core version planned for
    (:data:`~hypergrid.megatron.spec.features.MEGATRON_CORE_0_16`, ``..._0_19``, or
    :func:`hypergrid.megatron.installed_features` for the installed one); by default the keywords
    and groups every supported version has. ``placement`` lays the ``world_size`` positions over
    other ranks (a :class:`~hypergrid.layout.rank_map.RankMap`, as after a recovery); by default
    position ``p`` is rank ``p``. Accepts every keyword of that version's function
    (others raise ``TypeError`` naming them and the version) and validates them as
    :class:`~hypergrid.megatron.spec.config.MegatronConfig` does. Needs no process group and no
    megatron-core.

    Example::

        >>> plan = plan_model_parallel(32, tensor_model_parallel_size=4, context_parallel_size=2,
        ...                            num_distributed_optimizer_instances=2)
        >>> plan.group_size("dp_cp"), plan.group_size("intra_dp_cp")
        (8, 4)
        >>> plan.rank_group("intra_dp_cp", 13)
        [1, 5, 9, 13]
        >>> from hypergrid.megatron.spec.features import MEGATRON_CORE_0_19
        >>> gtp = plan_model_parallel(16, features=MEGATRON_CORE_0_19, tensor_model_parallel_size=2, gtp_remat_size=2)
        >>> gtp.rank_group("gtp_remat", 5), gtp.rank_group("dp", 5), gtp.rank_group("dp_gtp", 5)
        ([5, 7], [1, 5, 9, 13], [1, 3, 5, 7, 9, 11, 13, 15])
    """
    return MegatronPlan(MegatronConfig.from_megatron_kwargs(world_size, megatron_kwargs, features), placement)
