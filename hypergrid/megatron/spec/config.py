"""The arguments of Megatron-Core's ``initialize_model_parallel``, checked, with the sizes they imply.

Pure Python: no torch.distributed, no megatron import. :class:`MegatronConfig` holds every keyword
of ``megatron.core.parallel_state.initialize_model_parallel`` that hypergrid knows (megatron-core
0.16.1 to 0.19.2) plus the world size and the :class:`~hypergrid.megatron.spec.features.MegatronFeatures`
of the version planned for, which says which of those keywords exist there. It checks them the
way that version does, up front. Where Megatron-Core raises a bare ``assert`` or a
``ZeroDivisionError``, this module raises :class:`ParallelConfigError` naming the sizes involved
and the value expected.

Example::

    >>> cfg = MegatronConfig(world_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    >>> cfg.data_parallel_size, cfg.expert_data_parallel_size
    (4, 4)
    >>> MegatronConfig(world_size=12, tensor_model_parallel_size=8)
    Traceback (most recent call last):
    ...
    hypergrid.errors.ParallelConfigError: world_size (12) is not divisible by tensor_model_parallel_size (8) * pipeline_model_parallel_size (1) * context_parallel_size (1) = 8
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ...errors import ParallelConfigError, UnknownOrderNameError
from ...layout.checks import MAX_TIMEOUT_MS, int_at_least
from .features import COMMON_FEATURES, MegatronFeatures

__all__ = [
    "MegatronConfig",
    "MEGATRON_KEYWORDS",
    "PARALLEL_TOKENS",
    "GTP_REMAT_TOKEN",
]

#: The parallelism names Megatron-Core's ``order`` string is made of.
PARALLEL_TOKENS = ("tp", "cp", "ep", "dp", "pp")
#: The generalized tensor-parallel axis megatron-core 0.19 injects into the order (after ``tp`` in
#: the dense grid, after ``ep`` in the expert grid) unless the order places it itself.
GTP_REMAT_TOKEN = "gtp_remat"

#: Callback type of ``get_embedding_ranks`` / ``get_position_embedding_ranks``: a pipeline group's
#: ranks in, the ranks holding the (position) embedding out.
RanksCallback = Callable[[list], list]


def _check_int(name: str, value: object, minimum: int = 1) -> int:
    # By operator.index, as Megatron-Core's own arithmetic takes numpy and torch integers too.
    return int_at_least(value, name, minimum, ParallelConfigError)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-Core's ``initialize_model_parallel`` keywords for a world of ``world_size`` ranks.

    Every field but ``world_size`` and ``features`` is a keyword of Megatron-Core's function, with
    its default and its meaning; ``features`` says which of them the megatron-core version planned
    for has (:data:`~hypergrid.megatron.spec.features.COMMON_FEATURES`, the keywords of every
    supported release, unless told otherwise). A keyword that version lacks, set to anything but
    its default, is a ``TypeError``. Construction validates everything (types, sizes,
    divisibility, ``order``, SHARP and backend options) and raises before anything is built.

    Example::

        >>> cfg = MegatronConfig(world_size=64, tensor_model_parallel_size=2, context_parallel_size=2,
        ...                      expert_model_parallel_size=4, expert_tensor_parallel_size=1)
        >>> cfg.dense_dims, cfg.dense_shape
        (('tp', 'cp', 'dp', 'pp'), (2, 2, 16, 1))
        >>> cfg.expert_dims, cfg.expert_shape
        (('tp', 'ep', 'dp', 'pp'), (1, 4, 16, 1))
        >>> from hypergrid.megatron.spec.features import MEGATRON_CORE_0_19
        >>> gtp = MegatronConfig(world_size=16, tensor_model_parallel_size=2, gtp_remat_size=2,
        ...                      rank_offset=8, local_world_size=8, features=MEGATRON_CORE_0_19)
        >>> gtp.dense_dims, gtp.dense_shape, gtp.grid_ranks
        (('tp', 'gtp_remat', 'cp', 'dp', 'pp'), (2, 2, 1, 2, 1), range(8, 16))
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_comm_backend: Optional[str] = None
    use_sharp: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: Optional[list] = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    gtp_remat_size: int = 1
    expert_gtp_remat_size: int = 1
    num_distributed_optimizer_instances: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    nccl_communicator_config_path: Optional[str] = None
    distributed_timeout_minutes: int = 30
    order: str = "tp-cp-ep-dp-pp"
    get_embedding_ranks: Optional[RanksCallback] = field(default=None, compare=False)
    get_position_embedding_ranks: Optional[RanksCallback] = field(default=None, compare=False)
    create_gloo_process_groups: bool = True
    high_priority_stream_groups: Optional[list] = None
    sharp_enabled_group: Optional[str] = None
    create_all_gather_group: Optional[bool] = False
    rank_offset: int = 0
    local_world_size: Optional[int] = None
    features: MegatronFeatures = COMMON_FEATURES

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def gtp(self) -> int:
        """Ranks one dense weight is sharded over, ``gtp_remat_size`` (1 where the version has none)."""
        return self.gtp_remat_size

    @property
    def egtp(self) -> int:
        """Ranks one routed-expert weight is sharded over, ``expert_gtp_remat_size``."""
        return self.expert_gtp_remat_size

    @property
    def gtp_active(self) -> bool:
        """Whether either gtp_remat axis spans more than one rank (megatron-core then skips the
        gloo groups and makes the distributed-optimizer group span every rank)."""
        return self.gtp > 1 or self.egtp > 1

    @property
    def grid_size(self) -> int:
        """Ranks the grids span, ``local_world_size`` if given, else the world."""
        return self.world_size if self.local_world_size is None else self.local_world_size

    @property
    def grid_ranks(self) -> range:
        """The global ranks the grids span, ``rank_offset`` first."""
        return range(self.rank_offset, self.rank_offset + self.grid_size)

    @property
    def model_size(self) -> int:
        """The ranks one data-parallel replica spans, ``tp * pp * cp * gtp_remat``."""
        return self.tp * self.pp * self.cp * self.gtp

    @property
    def data_parallel_size(self) -> int:
        return self.grid_size // self.model_size

    @property
    def expert_tensor_size(self) -> int:
        """``expert_tensor_parallel_size``, defaulting to the tensor-parallel size as in Megatron."""
        return self.tp if self.expert_tensor_parallel_size is None else self.expert_tensor_parallel_size

    @property
    def expert_model_size(self) -> int:
        """The ranks one expert data-parallel replica spans, ``etp * ep * pp * expert_gtp_remat``."""
        return self.expert_tensor_size * self.ep * self.pp * self.egtp

    @property
    def expert_data_parallel_size(self) -> int:
        return self.grid_size // self.expert_model_size

    @property
    def intra_partial_data_parallel_size(self) -> int:
        """Ranks of one distributed-optimizer instance in a dp-cp group."""
        return self.data_parallel_size * self.cp // self.num_distributed_optimizer_instances

    @property
    def intra_partial_expert_data_parallel_size(self) -> int:
        """Ranks of one distributed-optimizer instance in an expert-dp group."""
        return self.expert_data_parallel_size // self.num_distributed_optimizer_instances

    @property
    def dense_gloo(self) -> bool:
        """Whether the dense gloo groups are made (megatron-core 0.19 skips them under gtp_remat)."""
        return self.create_gloo_process_groups and self.gtp == 1

    @property
    def expert_gloo(self) -> bool:
        """Whether the expert gloo groups are made (skipped under either gtp_remat axis)."""
        return self.dense_gloo and self.egtp == 1

    @property
    def order_tokens(self) -> tuple[str, ...]:
        """``order`` lower-cased and split, with absent size-1 names appended as Megatron does."""
        tokens = self.order.lower().split("-")
        return tuple(tokens) + tuple(t for t in PARALLEL_TOKENS if t not in tokens)

    def _grid_tokens(self, anchor: str) -> tuple[str, ...]:
        # megatron-core 0.19 inserts 'gtp_remat' into the order *as given* (before lower-casing):
        # after `anchor`, else after 'tp', else first. An order that places it is kept.
        raw = self.order.split("-")
        if self.features.gtp_remat and GTP_REMAT_TOKEN not in raw:
            at = anchor if anchor in raw else "tp"
            raw.insert(raw.index(at) + 1 if at in raw else 0, GTP_REMAT_TOKEN)
        tokens = [t.lower() for t in raw]
        return tuple(tokens) + tuple(t for t in PARALLEL_TOKENS if t not in tokens)

    @property
    def dense_tokens(self) -> tuple[str, ...]:
        """The dense grid's order with the gtp_remat axis where megatron-core puts it (after 'tp')."""
        return self._grid_tokens("tp")

    @property
    def expert_tokens(self) -> tuple[str, ...]:
        """The expert grid's order with the gtp_remat axis where megatron-core puts it (after 'ep')."""
        return self._grid_tokens("ep")

    @property
    def dense_dims(self) -> tuple[str, ...]:
        """Dims of the dense grid, the order without ``ep`` (size 1 outside expert layers), with
        ``gtp_remat`` where it spans more than one rank."""
        return tuple(t for t in self.dense_tokens if t != "ep" and (t != GTP_REMAT_TOKEN or self.gtp > 1))

    @property
    def dense_shape(self) -> tuple[int, ...]:
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.data_parallel_size, "pp": self.pp, GTP_REMAT_TOKEN: self.gtp}
        return tuple(sizes[d] for d in self.dense_dims)

    @property
    def expert_dims(self) -> tuple[str, ...]:
        """Dims of the expert grid, the order without ``cp`` (expert layers have none), with
        ``gtp_remat`` where the expert axis spans more than one rank."""
        return tuple(t for t in self.expert_tokens if t != "cp" and (t != GTP_REMAT_TOKEN or self.egtp > 1))

    @property
    def expert_shape(self) -> tuple[int, ...]:
        sizes = {"tp": self.expert_tensor_size, "ep": self.ep, "dp": self.expert_data_parallel_size, "pp": self.pp,
                 GTP_REMAT_TOKEN: self.egtp}
        return tuple(sizes[d] for d in self.expert_dims)

    @property
    def hybrid_group_sizes(self) -> tuple[int, ...]:
        """Sizes of the hybrid DP x CP groups, powers of two from 2 below the dp-cp size."""
        if not self.hybrid_context_parallel:
            return ()
        n = self.data_parallel_size * self.cp
        return tuple(2**i for i in range(int(math.log2(n))))[1:]

    @property
    def hierarchical_cp_sizes(self) -> tuple[int, ...]:
        """The hierarchical context-parallel level sizes, () when hierarchical CP is off."""
        return tuple(self.hierarchical_context_parallel_sizes or ())

    @property
    def sharp_group(self) -> Optional[str]:
        """The group SHARP is enabled on, ``sharp_enabled_group``, ``"dp"`` by default, None without SHARP."""
        if not self.use_sharp:
            return None
        return self.sharp_enabled_group or "dp"

    def sizes(self) -> dict[str, Any]:
        """Every size of the configuration, JSON-friendly (sizes the version lacks left out).

        Example::

            >>> MegatronConfig(world_size=8, tensor_model_parallel_size=2).sizes()["data_parallel_size"]
            4
        """
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
            "context_parallel_size": self.cp,
            "hierarchical_context_parallel_sizes": list(self.hierarchical_cp_sizes) or None,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.expert_tensor_size,
            "data_parallel_size": self.data_parallel_size,
            "expert_data_parallel_size": self.expert_data_parallel_size,
            "num_distributed_optimizer_instances": self.num_distributed_optimizer_instances,
            "order": "-".join(self.order_tokens),
        }
        if self.features.gtp_remat:
            out["gtp_remat_size"] = self.gtp
        if self.features.expert_gtp_remat:
            out["expert_gtp_remat_size"] = self.egtp
        if self.features.rank_offset:
            out["rank_offset"] = self.rank_offset
        if self.features.local_world_size:
            out["local_world_size"] = self.local_world_size
        return out

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        if not isinstance(self.features, MegatronFeatures):
            raise TypeError(f"features must be a MegatronFeatures, got {type(self.features).__name__} {self.features!r}")
        self._validate_features()
        self._validate_types()
        self._validate_span()
        # The checks below follow Megatron-Core's, in its order, so the first mistake reported is
        # the one Megatron-Core would report.
        self._validate_sharp()
        self._validate_dense_sizes()
        self._validate_order()
        self._validate_expert_sizes()
        self._validate_pipeline_agreement()
        self._validate_data_parallel_split()

    def _validate_types(self) -> None:
        """Every keyword's type, and the integers stored as plain ints."""
        for name, minimum, optional in (
            ("world_size", 1, False),
            ("tensor_model_parallel_size", 1, False),
            ("pipeline_model_parallel_size", 1, False),
            ("context_parallel_size", 1, False),
            ("expert_model_parallel_size", 1, False),
            ("gtp_remat_size", 1, False),
            ("expert_gtp_remat_size", 1, False),
            ("num_distributed_optimizer_instances", 1, False),
            ("rank_offset", 0, False),
            ("local_world_size", 1, True),
            ("expert_tensor_parallel_size", 1, True),
            ("virtual_pipeline_model_parallel_size", 1, True),
        ):
            value = getattr(self, name)
            if value is None and optional:
                continue
            # Stored as plain ints: numpy integers would otherwise reach keys and messages.
            object.__setattr__(self, name, _check_int(name, value, minimum))
        if isinstance(self.distributed_timeout_minutes, bool) or not isinstance(
            self.distributed_timeout_minutes, (int, float)
        ):
            raise TypeError(
                f"distributed_timeout_minutes must be a number, got "
                f"{type(self.distributed_timeout_minutes).__name__} {self.distributed_timeout_minutes!r}"
            )
        self._check_timeout_minutes()
        for name in ("use_sharp", "hybrid_context_parallel", "create_gloo_process_groups"):
            _check_bool(name, getattr(self, name))
        if self.create_all_gather_group is not None:
            _check_bool("create_all_gather_group", self.create_all_gather_group)
        for name in ("get_embedding_ranks", "get_position_embedding_ranks"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable or None, got {type(value).__name__} {value!r}")
        if self.high_priority_stream_groups is not None:
            if isinstance(self.high_priority_stream_groups, str) or not all(
                isinstance(g, str) for g in self.high_priority_stream_groups
            ):
                raise TypeError(
                    f"high_priority_stream_groups must be a list of group names (e.g. ['dp_cp', 'ep_dp']), "
                    f"got {self.high_priority_stream_groups!r}"
                )
        if self.nccl_communicator_config_path is not None and not isinstance(self.nccl_communicator_config_path, str):
            raise TypeError(
                f"nccl_communicator_config_path must be a str path, got {self.nccl_communicator_config_path!r}"
            )

    def _check_timeout_minutes(self) -> None:
        """distributed_timeout_minutes as a timeout torch can take (hypergrid.layout.checks): finite,
        at least 1 ms, at most gloo's bound; named here, before timedelta or torch fail on it."""
        minutes = self.distributed_timeout_minutes
        if (isinstance(minutes, float) and not math.isfinite(minutes)) or minutes <= 0:
            raise ParallelConfigError(f"distributed_timeout_minutes must be a positive, finite number of minutes, "
                                      f"got {minutes}")
        ms = minutes * 60_000
        if ms < 1:
            raise ParallelConfigError(
                f"distributed_timeout_minutes={minutes} is {ms:g} ms: torch counts whole milliseconds, so a timeout "
                f"under 1 ms is 0 ms and expires at once; expected at least {1 / 60_000:.3g} minutes (1 ms)")
        if ms > MAX_TIMEOUT_MS:
            raise ParallelConfigError(
                f"distributed_timeout_minutes={minutes} is longer than torch's gloo backend takes: expected at most "
                f"{MAX_TIMEOUT_MS // 60_000} minutes ({MAX_TIMEOUT_MS} ms, microseconds in 64 bits)")

    def _validate_span(self) -> None:
        # The grids must fit in the world (Megatron-Core finds out inside torch, groups half made).
        if self.rank_offset + self.grid_size > self.world_size:
            raise ParallelConfigError(
                f"the grids span ranks [{self.rank_offset}, {self.rank_offset + self.grid_size}) "
                f"(rank_offset {self.rank_offset}, local_world_size {self.local_world_size}), beyond "
                f"the world of {self.world_size} ranks; expected rank_offset + local_world_size <= {self.world_size}"
            )

    def _validate_sharp(self) -> None:
        if self.use_sharp:
            if self.sharp_enabled_group is not None:
                if self.sharp_enabled_group not in ("dp", "dp_replica"):
                    raise ParallelConfigError(
                        f"sharp_enabled_group must be 'dp' or 'dp_replica', got {self.sharp_enabled_group!r}"
                    )
                if self.sharp_enabled_group == "dp_replica" and self.num_distributed_optimizer_instances <= 1:
                    raise ParallelConfigError(
                        f"sharp_enabled_group='dp_replica' needs num_distributed_optimizer_instances > 1, "
                        f"got {self.num_distributed_optimizer_instances}"
                    )
        elif self.sharp_enabled_group is not None:
            raise ParallelConfigError(
                f"sharp_enabled_group={self.sharp_enabled_group!r} is only valid with use_sharp=True"
            )

    def _validate_dense_sizes(self) -> None:
        if self.gtp_active and self.num_distributed_optimizer_instances > 1:
            raise ParallelConfigError(
                f"gtp_remat_size={self.gtp}, expert_gtp_remat_size={self.egtp} with "
                f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances}: "
                f"megatron-core {self.features.version} supports GTP_remat with one distributed-optimizer "
                f"instance only; expected num_distributed_optimizer_instances=1 or both gtp_remat sizes 1"
            )

        if self.grid_size % self.model_size != 0:
            gtp = f" * gtp_remat_size ({self.gtp})" if self.features.gtp_remat else ""
            raise ParallelConfigError(
                f"world_size ({self.grid_size}) is not divisible by tensor_model_parallel_size "
                f"({self.tp}) * pipeline_model_parallel_size ({self.pp}) * context_parallel_size "
                f"({self.cp}){gtp} = {self.model_size}"
            )
        if self.virtual_pipeline_model_parallel_size is not None and self.pp <= 1:
            raise ParallelConfigError(
                f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} "
                f"needs pipeline_model_parallel_size > 1 (an interleaved schedule), got {self.pp}"
            )

    def _validate_expert_sizes(self) -> None:
        if self.grid_size % self.expert_model_size != 0:
            egtp = f" * expert_gtp_remat_size ({self.egtp})" if self.features.expert_gtp_remat else ""
            raise ParallelConfigError(
                f"world_size ({self.grid_size}) is not divisible by expert_tensor_parallel_size "
                f"({self.expert_tensor_size}) * expert_model_parallel_size ({self.ep}) * "
                f"pipeline_model_parallel_size ({self.pp}){egtp} = {self.expert_model_size}"
            )
        placed = self.order.lower().split("-")
        expert_sizes = {"tp": self.expert_tensor_size, "pp": self.pp, "dp": self.expert_data_parallel_size, "ep": self.ep}
        for name, size in expert_sizes.items():
            if name not in placed and size != 1:
                raise ParallelConfigError(
                    f"the expert-layer size of {name} is {size}, but order {self.order!r} does not "
                    f"place it; add '{name}' to the order"
                )
        # Megatron-Core tests the order string as given (not lower-cased) here.
        if not self.order.endswith("pp") and self.pp != 1 and self.expert_data_parallel_size != self.data_parallel_size:
            raise ParallelConfigError(
                f"with order {self.order!r} (not ending in 'pp') and pipeline_model_parallel_size "
                f"{self.pp}, the expert data-parallel size ({self.expert_data_parallel_size}) must "
                f"equal the data-parallel size ({self.data_parallel_size})"
            )

    def _validate_data_parallel_split(self) -> None:
        """Optimizer instances, hybrid and hierarchical context parallelism: how dp x cp divides."""
        ninst = self.num_distributed_optimizer_instances
        dp_cp = self.data_parallel_size * self.cp
        if dp_cp % ninst != 0:
            raise ParallelConfigError(
                f"data_parallel_size ({self.data_parallel_size}) * context_parallel_size ({self.cp}) "
                f"= {dp_cp} is not divisible by num_distributed_optimizer_instances ({ninst})"
            )
        if self.hybrid_context_parallel and dp_cp % 2 != 0:
            raise ParallelConfigError(
                f"hybrid_context_parallel needs an even data-parallel x context-parallel size, got "
                f"data_parallel_size ({self.data_parallel_size}) * context_parallel_size ({self.cp}) = {dp_cp}"
            )
        if self.hierarchical_context_parallel_sizes:
            sizes = self.hierarchical_context_parallel_sizes
            if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
                raise TypeError(f"hierarchical_context_parallel_sizes must be a list of ints, got {sizes!r}")
            for i, size in enumerate(sizes):
                _check_int(f"hierarchical_context_parallel_sizes[{i}]", size)
            if math.prod(sizes) != self.cp:
                raise ParallelConfigError(
                    f"the product of hierarchical_context_parallel_sizes {list(sizes)} is "
                    f"{math.prod(sizes)}, but context_parallel_size is {self.cp}"
                )
        if self.pipeline_model_parallel_comm_backend not in (None, "nccl", "ucc"):
            raise ParallelConfigError(
                f"pipeline_model_parallel_comm_backend must be None, 'nccl' or 'ucc', got "
                f"{self.pipeline_model_parallel_comm_backend!r}"
            )
        if self.expert_data_parallel_size % ninst != 0:
            raise ParallelConfigError(
                f"expert data-parallel size ({self.expert_data_parallel_size} = world_size "
                f"{self.grid_size} / (expert_tensor_parallel_size {self.expert_tensor_size} * "
                f"expert_model_parallel_size {self.ep} * pipeline_model_parallel_size {self.pp})) "
                f"is not divisible by num_distributed_optimizer_instances ({ninst})"
            )

    def _validate_features(self) -> None:
        # A keyword this version lacks may only hold its default (the value every version before
        # it behaved as); anything else is what Megatron-Core calls an unexpected keyword.
        set_but_absent = [
            f.name
            for f in fields(self)
            if f.name in MEGATRON_KEYWORDS and not self.features.accepts(f.name) and getattr(self, f.name) != f.default
        ]
        self.features.check_keywords(set_but_absent)

    def _validate_order(self) -> None:
        if not isinstance(self.order, str):
            raise TypeError(f"order must be a str like 'tp-cp-ep-dp-pp', got {type(self.order).__name__} {self.order!r}")
        tokens = self.order.lower().split("-")
        known = PARALLEL_TOKENS + ((GTP_REMAT_TOKEN,) if self.features.gtp_remat else ())
        unknown = [t for t in tokens if t not in known]
        if unknown:
            raise UnknownOrderNameError(
                f"order {self.order!r} has unknown parallelism name(s) {unknown}; expected names "
                f"from {list(known)} joined by '-', e.g. 'tp-cp-ep-dp-pp'"
            )
        for grid_tokens in (self.dense_tokens, self.expert_tokens):
            repeated = sorted({t for t in grid_tokens if grid_tokens.count(t) > 1})
            if repeated:
                raise ParallelConfigError(f"order {self.order!r} names {repeated} more than once")
        if self.features.gtp_remat and "tp" not in tokens:
            # megatron-core 0.19 appends a missing size-1 name only if its text is nowhere in the
            # order, and the injected 'gtp_remat' contains 'tp': its rank generator then has no
            # 'tp' dim and fails (ValueError) on its first tensor-parallel group.
            raise ParallelConfigError(
                f"order {self.order!r} does not place 'tp'; megatron-core {self.features.version} "
                f"needs it (its gtp_remat axis hides a missing 'tp'), e.g. 'tp-cp-ep-dp-pp'"
            )
        # The dense generator's check: a dim of size > 1 must be placed by the order.
        dense_sizes = {"tp": self.tp, "pp": self.pp, "dp": self.data_parallel_size, "cp": self.cp}
        for name, size in dense_sizes.items():
            if name not in tokens and size != 1:
                raise ParallelConfigError(
                    f"the size of {name} is {size}, but order {self.order!r} does not place it; "
                    f"add '{name}' to the order"
                )

    def _validate_pipeline_agreement(self) -> None:
        # Dense and expert layers must see the same pipeline groups. Pipeline groups are equal
        # exactly when the pipeline dim has the same stride in both layouts (or a single stage).
        if self.pp == 1:
            return
        dense_stride = math.prod(self.dense_shape[: self.dense_dims.index("pp")])
        expert_stride = math.prod(self.expert_shape[: self.expert_dims.index("pp")])
        if dense_stride != expert_stride:
            raise ParallelConfigError(
                f"pipeline groups differ between dense layers (ranks {dense_stride} apart) and "
                f"expert layers (ranks {expert_stride} apart) with order {self.order!r}: the sizes "
                f"placed before 'pp' must have equal products (dense {dict(zip(self.dense_dims, self.dense_shape))}, "
                f"expert {dict(zip(self.expert_dims, self.expert_shape))})"
            )

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_megatron_kwargs(
        cls, world_size: int, kwargs: dict[str, Any], features: MegatronFeatures = COMMON_FEATURES
    ) -> MegatronConfig:
        """Build from the keywords of a Megatron-Core call, rejecting any ``features`` lacks.

        Example::

            >>> MegatronConfig.from_megatron_kwargs(8, {"tensor_model_parallel_size": 2}).data_parallel_size
            4
            >>> MegatronConfig.from_megatron_kwargs(8, {"tensor_parallel_size": 2})
            Traceback (most recent call last):
            ...
            TypeError: initialize_model_parallel() got keyword argument(s) ['tensor_parallel_size'] that megatron-core ... does not have; ...
        """
        if not isinstance(features, MegatronFeatures):
            raise TypeError(f"features must be a MegatronFeatures, got {type(features).__name__} {features!r}")
        features.check_keywords(kwargs)
        # A keyword the installed version has but hypergrid does not know cannot be honoured.
        unsupported = sorted(set(kwargs) - set(MEGATRON_KEYWORDS))
        if unsupported:
            raise TypeError(
                f"initialize_model_parallel() keyword argument(s) {unsupported} of megatron-core "
                f"{features.version} are not supported by hypergrid.megatron, which knows "
                f"{list(MEGATRON_KEYWORDS)}"
            )
        return cls(world_size=world_size, features=features, **kwargs)


#: Every keyword of Megatron-Core's ``initialize_model_parallel`` this module understands, from any
#: supported version (a given version takes the subset its :class:`MegatronFeatures` lists).
MEGATRON_KEYWORDS: tuple[str, ...] = tuple(
    f.name for f in fields(MegatronConfig) if f.name not in ("world_size", "features")
)
