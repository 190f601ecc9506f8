"""Differential tests: after hypergrid's initialize_model_parallel, every ``parallel_state`` global
and every getter of the *installed* megatron-core answers as after that version's own function,
on the same rank of the same fake world.

For each configuration and several ranks, this process plays that rank of a world of the given
size on torch's fake backend, runs Megatron-Core's ``initialize_model_parallel`` and records
what every getter answers (groups by their members) and what every module global holds, tears
down, runs hypergrid's, records again, and requires zero differences. The getters are found in
the installed module, not listed here: every public ``get_*`` / ``is_*`` / ``has_*`` function,
called with no arguments and with every combination of its keywords (``with_gtp_remat``,
``with_context_parallel``, ``partial_data_parallel``, ``vp_stage``, ...), so a getter a new
version adds is compared without anyone listing it. ``ProcessGroupCollection.use_mpu_process_groups()``
after Megatron-Core is compared with :func:`hypergrid.megatron.process_group_collection` the same
way. Configurations that need a keyword the installed version lacks are skipped, naming it.
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any, Optional

import pytest
import torch.distributed as dist

import hypergrid.megatron as hm
from hypergrid.megatron.spec.config import MegatronConfig
from tests.harness import fake_world

# Set by load_megatron() when the first test here runs: importing megatron-core takes seconds,
# which collecting the suite should not spend.
ps: Any = None  # megatron.core.parallel_state
ProcessGroupCollection: Any = None  # megatron.core.process_groups_config.ProcessGroupCollection
INSTALLED: Any = None  # hypergrid.megatron.installed_features()


def load_megatron() -> None:
    """Import megatron-core into this module; called by the fixture below, and by the gloo jobs
    (tests/test_megatron_gloo.py) that use :func:`snapshot` in their own processes."""
    global ps, ProcessGroupCollection, INSTALLED
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    INSTALLED = hm.installed_features()


@pytest.fixture(scope="module", autouse=True)
def megatron_core() -> None:
    """Every test here skips without megatron-core."""
    pytest.importorskip("megatron.core")
    load_megatron()

# ----------------------------------------------------------------------------- what is compared
GETTER_PREFIXES = ("get_", "is_", "has_", "model_parallel_is_")


def _vp_stages(config: MegatronConfig) -> list[Optional[int]]:
    return [None] + list(range(config.virtual_pipeline_model_parallel_size or 0))


def _hybrid_group_sizes(config: MegatronConfig) -> list[Optional[int]]:
    # Every size made, plus the full dp-cp size (no group of that size: the getter's answer for it).
    full = [config.data_parallel_size * config.cp] if config.hybrid_context_parallel else []
    return [None] + list(config.hybrid_group_sizes) + full


#: Values to try for getter parameters that are not booleans, by parameter name. A getter with a
#: parameter missing here (and no bool default) fails test_every_getter_parameter_has_values.
VALUE_DOMAINS: dict[str, Callable[[MegatronConfig], list[Any]]] = {
    "vp_stage": _vp_stages,
    "group_size": _hybrid_group_sizes,
}


def installed_getters() -> dict[str, Callable[..., Any]]:
    """The installed parallel_state's public getters that can be called without arguments."""
    out = {}
    for name, fn in vars(ps).items():
        if not (inspect.isfunction(fn) and fn.__module__ == ps.__name__ and name.startswith(GETTER_PREFIXES)):
            continue
        params = inspect.signature(fn).parameters.values()
        if all(p.default is not inspect.Parameter.empty for p in params):
            out[name] = fn
    return out


def parameter_domain(param: inspect.Parameter, config: MegatronConfig) -> Optional[list[Any]]:
    """The values to call a getter's parameter with; None where no domain is known."""
    if isinstance(param.default, bool):
        return [False, True]
    if param.name in VALUE_DOMAINS:
        return VALUE_DOMAINS[param.name](config)
    return None


def getter_calls(config: MegatronConfig) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Every getter, called bare and with every combination of its parameters' values."""
    for name, fn in sorted(installed_getters().items()):
        yield f"{name}()", fn
        params = list(inspect.signature(fn).parameters.values())
        domains = [parameter_domain(p, config) for p in params]
        if any(d is None for d in domains):
            continue  # reported by test_every_getter_parameter_has_values
        for combo in itertools.product(*domains):
            kwargs = {p.name: v for p, v in zip(params, combo)}
            label = ",".join(f"{k}={v}" for k, v in kwargs.items())
            yield f"{name}({label})", (lambda f=fn, kw=kwargs: f(**kw))


def module_globals() -> list[str]:
    """The installed parallel_state's state: every ``_UPPER_CASE`` module global."""
    return sorted(n for n in vars(ps) if n.startswith("_") and n[1:2].isupper())


def _ranks(value: Any) -> Any:
    """A value with process groups replaced by their members (objects by their type's name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)))
    if isinstance(value, (list, tuple)):
        return [_ranks(v) for v in value]
    if isinstance(value, dict):
        return {k: _ranks(v) for k, v in sorted(value.items())}
    return f"<{type(value).__name__}>"


def _call(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", _ranks(fn()))
    except (AssertionError, KeyError, TypeError, AttributeError, ValueError, RuntimeError, IndexError) as exc:
        return ("raises", type(exc).__name__)


def snapshot(config: MegatronConfig) -> dict[str, Any]:
    """Every getter's answer and every global's value, keyed by the call or name."""
    out = {f"call {key}": _call(fn) for key, fn in getter_calls(config)}
    for name in module_globals():
        out[f"global {name}"] = _ranks(getattr(ps, name))
    return out


def collection_snapshot(make: Callable[[], Any]) -> Any:
    """A ``ProcessGroupCollection``'s fields by members (or what making one raised)."""
    try:
        pgc = make()
    except (AssertionError, RuntimeError, ValueError) as exc:
        return ("raises", "AssertionError" if isinstance(exc, AssertionError) else type(exc).__name__)
    # Fields the collection was built with; 0.19's class answers None for the others.
    return {f.name: _ranks(vars(pgc).get(f.name, "unset")) for f in fields(pgc)}


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences between two snapshots (empty: identical)."""
    diffs = []
    for key in sorted(set(expected) | set(actual)):
        if expected.get(key, "<missing>") != actual.get(key, "<missing>"):
            diffs.append(f"{key}: megatron={expected.get(key, '<missing>')!r} hypergrid={actual.get(key, '<missing>')!r}")
    return diffs


# ----------------------------------------------------------------------------- configurations
# (id, world size, Megatron-Core keywords). Gloo groups cannot exist on the fake backend, so
# every run passes create_gloo_process_groups=False (the real-process tests cover gloo). A
# configuration using a keyword the installed version lacks is skipped.
CONFIGS: list[tuple[str, int, dict[str, Any]]] = [
    ("world1", 1, {}),
    ("dp-only", 6, {}),
    ("tp2-pp2", 8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ("tp2-pp4-vp3", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=3)),
    ("tp3-pp2-npot", 12, dict(tensor_model_parallel_size=3, pipeline_model_parallel_size=2)),
    ("tp-all", 4, dict(tensor_model_parallel_size=4)),
    ("pp-all", 5, dict(pipeline_model_parallel_size=5)),
    ("cp2-tp2-pp2-ep2", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2)),
    ("hcp-2x2", 16, dict(tensor_model_parallel_size=2, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])),
    ("hcp-3x2-npot", 24, dict(context_parallel_size=6, hierarchical_context_parallel_sizes=[3, 2], pipeline_model_parallel_size=2)),
    ("ep4-etp1", 16, dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)),
    ("ep2-etp4", 32, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=4)),
    ("distopt2", 24, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, expert_model_parallel_size=2, expert_tensor_parallel_size=1, num_distributed_optimizer_instances=2)),
    ("distopt4-cp", 32, dict(context_parallel_size=2, expert_model_parallel_size=2, num_distributed_optimizer_instances=4)),
    ("hybrid-cp", 32, dict(tensor_model_parallel_size=2, context_parallel_size=2, hybrid_context_parallel=True)),
    ("hybrid-cp-npot", 20, dict(context_parallel_size=2, hybrid_context_parallel=True)),
    ("allgather", 16, dict(tensor_model_parallel_size=2, context_parallel_size=2, create_all_gather_group=True)),
    ("order-tp-pp-dp", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, order="tp-pp-dp")),
    ("order-tp-cp-ep-pp-dp", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2, order="tp-cp-ep-pp-dp")),
    ("order-pp-dp-tp", 24, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, order="pp-dp-tp")),
    ("order-dp-cp-tp-ep-pp", 32, dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2, order="dp-cp-tp-ep-pp")),
    ("order-ep-tp-dp-pp", 32, dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1, pipeline_model_parallel_size=2, order="ep-tp-dp-pp")),
    ("order-upper", 8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="TP-CP-EP-DP-PP")),
    ("embedding-callbacks", 16, dict(pipeline_model_parallel_size=4, get_embedding_ranks=lambda r: [r[-1]], get_position_embedding_ranks=lambda r: r[:2])),
    ("timeout-vp", 8, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, distributed_timeout_minutes=5)),
    # megatron-core 0.19: the grids on part of the world.
    ("offset-tp2-pp2", 16, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, rank_offset=4, local_world_size=8)),
    ("local-world-only", 12, dict(tensor_model_parallel_size=2, context_parallel_size=2, local_world_size=8)),
    ("offset-moe-hcp-vp", 48, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, context_parallel_size=2, hierarchical_context_parallel_sizes=[2, 1], expert_model_parallel_size=4, expert_tensor_parallel_size=1, rank_offset=16, local_world_size=32)),
    ("offset-distopt", 24, dict(expert_model_parallel_size=2, num_distributed_optimizer_instances=2, rank_offset=8, local_world_size=16)),
    # megatron-core 0.19: generalized tensor parallelism with weight rematerialization.
    ("gtp2", 16, dict(tensor_model_parallel_size=2, gtp_remat_size=2)),
    ("gtp2-pp2-cp2-vp2", 32, dict(tensor_model_parallel_size=2, gtp_remat_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, context_parallel_size=2)),
    ("gtp2-hcp", 32, dict(gtp_remat_size=2, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2], hybrid_context_parallel=True)),
    ("egtp2", 16, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1, expert_gtp_remat_size=2)),
    ("gtp2-egtp2-moe-pp", 32, dict(tensor_model_parallel_size=2, gtp_remat_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1, expert_gtp_remat_size=2)),
    ("gtp3-egtp3-npot", 36, dict(gtp_remat_size=3, expert_gtp_remat_size=3, expert_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ("gtp2-order-upper", 16, dict(tensor_model_parallel_size=2, gtp_remat_size=2, expert_model_parallel_size=2, order="TP-CP-EP-DP-PP")),
    ("gtp2-order-placed", 16, dict(tensor_model_parallel_size=2, gtp_remat_size=2, pipeline_model_parallel_size=2, order="tp-cp-ep-dp-gtp_remat-pp")),
    ("gtp2-order-tp-ep-pp-dp", 24, dict(tensor_model_parallel_size=2, gtp_remat_size=2, expert_model_parallel_size=2, pipeline_model_parallel_size=3, order="tp-ep-pp-dp")),
    ("gtp2-offset", 32, dict(tensor_model_parallel_size=2, gtp_remat_size=2, expert_model_parallel_size=2, expert_gtp_remat_size=2, expert_tensor_parallel_size=1, rank_offset=8, local_world_size=16)),
    ("big-4096", 4096, dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, context_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=2)),
    ("big-3072-npot", 3072, dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=3, context_parallel_size=2, expert_model_parallel_size=8, expert_tensor_parallel_size=1, hierarchical_context_parallel_sizes=[2, 1])),
    ("big-6144-distopt", 6144, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=6, expert_model_parallel_size=4, num_distributed_optimizer_instances=4, virtual_pipeline_model_parallel_size=2)),
    ("big-4096-gtp-offset", 4096, dict(tensor_model_parallel_size=4, gtp_remat_size=2, pipeline_model_parallel_size=4, context_parallel_size=2, expert_model_parallel_size=4, expert_gtp_remat_size=2, expert_tensor_parallel_size=2, rank_offset=1024, local_world_size=2048)),
]


def require_keywords(kwargs: dict[str, Any]) -> None:
    """Skip, naming them, when the installed version lacks keywords the configuration uses."""
    missing = sorted(set(kwargs) - set(INSTALLED.keywords))
    if missing:
        pytest.skip(f"megatron-core {INSTALLED.version} has no {missing}")


def config_of(world: int, kwargs: dict[str, Any]) -> MegatronConfig:
    return MegatronConfig.from_megatron_kwargs(world, dict(kwargs, create_gloo_process_groups=False), INSTALLED)


def ranks_to_check(world: int, seed: str, kwargs: dict[str, Any]) -> list[int]:
    """First, last and a few others: stage boundaries, interior ranks, and the ranks on both
    sides of each edge of the grids' span when it is not the whole world."""
    rng = random.Random(f"{seed}-{world}")
    chosen = {0, world - 1, world // 2, rng.randrange(world), rng.randrange(world)}
    start = kwargs.get("rank_offset", 0)
    end = start + kwargs.get("local_world_size", world - start)
    chosen |= {r for r in (start - 1, start, end - 1, end) if 0 <= r < world}
    return sorted(chosen)


def _world_ranks(world: int) -> tuple[int, ...]:
    return tuple(range(world))


def _group_list(world: int) -> list[Any]:
    # ps._global_process_group_list in order; None stands for the default group.
    return [("group", _world_ranks(world)) if g is None else _ranks(g) for g in ps._global_process_group_list or []]


def _megatron_state(world: int, kwargs: dict[str, Any], config: MegatronConfig) -> tuple[dict[str, Any], list[Any]]:
    try:
        ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        expected = snapshot(config)
        expected["collection"] = collection_snapshot(ProcessGroupCollection.use_mpu_process_groups)
        group_list = _group_list(world)
    finally:
        hm.destroy_model_parallel()
    return expected, group_list


def compare_rank(world: int, rank: int, kwargs: dict[str, Any], variants: list[dict[str, Any]]) -> list[str]:
    """Differences between Megatron-Core and each hypergrid variant on one rank (empty: none)."""
    config = config_of(world, kwargs)
    diffs: list[str] = []
    with fake_world(rank, world):
        expected, megatron_list = _megatron_state(world, kwargs, config)
        for variant in variants:
            try:
                result = hm.initialize_model_parallel(create_gloo_process_groups=False, **variant, **kwargs)
                assert result is None, f"initialize_model_parallel returned {result!r}; Megatron-Core returns None"
                grids = hm.active_grids()
                actual = snapshot(config)
                actual["collection"] = collection_snapshot(hm.process_group_collection)
                hypergrid_list = _group_list(world)
                if not grids.share_groups and hypergrid_list != megatron_list:
                    diffs.append(f"rank {rank} {variant}: communicator list {hypergrid_list} != Megatron's {megatron_list}")
            finally:
                hm.destroy_model_parallel()
            # With sharing, equal groups are one communicator: compare the distinct memberships.
            expected_members = sorted(set(map(repr, megatron_list)))
            actual_members = sorted(set(map(repr, hypergrid_list)))
            if expected_members != actual_members:
                diffs.append(f"rank {rank} {variant}: communicator members {actual_members} != Megatron's {expected_members}")
            diffs += [f"rank {rank} {variant}: {d}" for d in differences(expected, actual)]
    return diffs


def _params(configs: list[tuple[str, int, dict[str, Any]]]) -> list[Any]:
    """The configurations as pytest params; worlds of thousands of ranks are ``slow`` (seconds each)."""
    return [pytest.param(world, kwargs, id=name, marks=[pytest.mark.slow] if world >= 1024 else [])
            for name, world, kwargs in configs]


@pytest.mark.parametrize("world,kwargs", _params(CONFIGS))
def test_every_getter_and_global_matches_megatron(world: int, kwargs: dict[str, Any]) -> None:
    require_keywords(kwargs)
    diffs: list[str] = []
    for rank in ranks_to_check(world, "getters", kwargs):
        diffs += compare_rank(world, rank, kwargs, [{"share_groups": True}, {"share_groups": False}])
    assert diffs == [], "\n".join(diffs[:40])


STRATEGY_CONFIGS = ("tp2-pp2", "cp2-tp2-pp2-ep2", "hcp-2x2", "distopt2", "hybrid-cp", "allgather", "embedding-callbacks",
                    "offset-tp2-pp2", "gtp2-egtp2-moe-pp", "gtp2-offset")
SMALL_FOR_STRATEGIES = [c for c in CONFIGS if c[0] in STRATEGY_CONFIGS]


@pytest.mark.parametrize("world,kwargs", _params(SMALL_FOR_STRATEGIES))
def test_enumerate_and_split_strategies_match_megatron(world: int, kwargs: dict[str, Any]) -> None:
    require_keywords(kwargs)
    diffs: list[str] = []
    for rank in ranks_to_check(world, "strategies", kwargs)[:4]:
        diffs += compare_rank(world, rank, kwargs, [
            {"strategy": "enumerate"}, {"strategy": "enumerate", "share_groups": False}, {"strategy": "split"},
        ])
    assert diffs == [], "\n".join(diffs[:40])


def test_the_comparison_covers_the_installed_module() -> None:
    # Every getter of the installed version is called (bare and with each keyword combination),
    # every global compared: here with a configuration that makes every optional group.
    config = config_of(16, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                context_parallel_size=2, hybrid_context_parallel=True))
    calls = dict(getter_calls(config))
    for name, fn in installed_getters().items():
        assert f"{name}()" in calls
        for param in inspect.signature(fn).parameters.values():
            if isinstance(param.default, bool):
                assert any(f"{param.name}={not param.default}" in key for key in calls if key.startswith(name + "(")), (name, param)
    assert "call is_pipeline_first_stage(ignore_virtual=False,vp_stage=1)" in {f"call {k}" for k in calls}
    assert len(module_globals()) > 40
    if INSTALLED.gtp_remat:
        assert "call get_data_parallel_group(with_context_parallel=True,with_gtp_remat=False,partial_data_parallel=True)" in {
            f"call {k}" for k in calls}
        assert "_GTP_WEIGHT_REMAT_GROUP" in module_globals()


def test_every_getter_parameter_has_values() -> None:
    # A getter parameter that is neither a bool nor in VALUE_DOMAINS would go uncompared.
    config = config_of(8, dict(pipeline_model_parallel_size=2))
    missing = [
        f"{name}({param.name}={param.default!r})"
        for name, fn in installed_getters().items()
        for param in inspect.signature(fn).parameters.values()
        if parameter_domain(param, config) is None
    ]
    assert missing == [], f"getter parameters with no values to compare: {missing}; add them to VALUE_DOMAINS"


def test_snapshot_detects_a_difference() -> None:
    # The comparison must be able to fail: a wrong pipeline neighbour is reported.
    config = config_of(8, dict(pipeline_model_parallel_size=4))
    with fake_world(3, 8):
        try:
            hm.initialize_model_parallel(create_gloo_process_groups=False, pipeline_model_parallel_size=4)
            good = snapshot(config)
            ps._PIPELINE_GLOBAL_RANKS = list(reversed(ps._PIPELINE_GLOBAL_RANKS))
            bad = snapshot(config)
        finally:
            hm.destroy_model_parallel()
    found = differences(good, bad)
    assert any("get_pipeline_model_parallel_next_rank()" in d for d in found)
    assert any("global _PIPELINE_GLOBAL_RANKS" in d for d in found)


@pytest.mark.parametrize("world,rank,kwargs", [
    (8, 5, dict(tensor_model_parallel_size=2)),
    (16, 6, dict(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)),
    (32, 17, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=2, tensor_model_parallel_size=2)),
])
def test_all_gather_groups_match_megatron(world: int, rank: int, kwargs: dict[str, Any]) -> None:
    if not hasattr(ps, "create_all_gather_groups"):
        pytest.skip(f"megatron-core {INSTALLED.version} has no create_all_gather_groups()")
    results: dict[str, Any] = {}
    with fake_world(rank, world):
        for name, init, make in [
            ("megatron", ps.initialize_model_parallel, ps.create_all_gather_groups),
            ("hypergrid", hm.initialize_model_parallel, hm.create_all_gather_groups),
            # Megatron-Core's own function after hypergrid's initialization works too.
            ("megatron-after-hypergrid", hm.initialize_model_parallel, ps.create_all_gather_groups),
        ]:
            try:
                init(create_gloo_process_groups=False, **kwargs)
                dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
                pair = make(for_expert_parallelism=True)
                results[name] = [_ranks(g) for g in pair] + [_ranks(make()[1])]
                # Their own communicators: never the dp-cp group they mirror, nor each other.
                assert pair[0] is not dp_cp and pair[0] is not pair[1]
                assert pair[1] is None or pair[1] is not ps.get_expert_data_parallel_group()
            finally:
                hm.destroy_model_parallel()
    assert results["hypergrid"] == results["megatron"] == results["megatron-after-hypergrid"]
    assert results["megatron"][0] == _ranks_of(kwargs, world, rank, "dp_cp")


def _ranks_of(kwargs: dict[str, Any], world: int, rank: int, kind: str) -> Any:
    return ("group", tuple(sorted(hm.plan_model_parallel(world, features=INSTALLED, **kwargs).rank_group(kind, rank))))


def test_all_gather_groups_need_initialization_and_are_released() -> None:
    from hypergrid.runtime.registry import REGISTRY

    with fake_world(1, 8):
        with pytest.raises(RuntimeError, match="requires parallel state to be initialized"):
            hm.create_all_gather_groups()
        try:
            hm.initialize_model_parallel(create_gloo_process_groups=False, tensor_model_parallel_size=2)
            held = REGISTRY.count()
            first = hm.create_all_gather_groups()
            second = hm.create_all_gather_groups()
            assert first[0] is not second[0] and first[1] is None
            assert REGISTRY.count() == held + 2
            assert hm.process_group_collection().__dict__.get("dp_cp_ag", second[0]) is second[0]
        finally:
            hm.destroy_model_parallel()
        assert REGISTRY.count() == 0
