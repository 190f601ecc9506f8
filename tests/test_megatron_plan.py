"""The pure plan of Megatron's groups: importable without megatron-core or a process group,
consistent with itself, and equal to Megatron-Core's RankGenerator where both list groups."""

from __future__ import annotations

import ast
import doctest
import importlib
import json
import subprocess
import sys

import pytest

from hypergrid.layout.kinds import Singletons
from hypergrid.megatron import COMMON_FEATURES, MEGATRON_CORE_0_16, MEGATRON_CORE_0_19, plan_model_parallel

# (world size, the megatron-core planned for, keywords)
PLANS = [
    (8, COMMON_FEATURES, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    (48, COMMON_FEATURES, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, context_parallel_size=2,
                               expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                               num_distributed_optimizer_instances=2)),
    (32, MEGATRON_CORE_0_16, dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                                  hybrid_context_parallel=True, create_all_gather_group=True, order="tp-cp-ep-pp-dp")),
    (30, COMMON_FEATURES, dict(tensor_model_parallel_size=3, pipeline_model_parallel_size=5, order="pp-dp-tp")),
    (32, MEGATRON_CORE_0_19, dict(tensor_model_parallel_size=2, gtp_remat_size=2, pipeline_model_parallel_size=2,
                                  expert_model_parallel_size=2, expert_tensor_parallel_size=1, expert_gtp_remat_size=2)),
    (48, MEGATRON_CORE_0_19, dict(gtp_remat_size=3, context_parallel_size=2, hierarchical_context_parallel_sizes=[2, 1],
                                  order="TP-CP-EP-DP-PP", rank_offset=8, local_world_size=36)),
    (40, MEGATRON_CORE_0_19, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, rank_offset=4,
                                  local_world_size=32, num_distributed_optimizer_instances=2, order="tp-cp-ep-pp-dp")),
]
PLAN_IDS = [f"{w}-{f.version.split()[0]}-{i}" for i, (w, f, _) in enumerate(PLANS)]


def test_plan_imports_without_megatron_or_torch_distributed_use() -> None:
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "from hypergrid.megatron import plan_model_parallel\n"
        "import hypergrid.megatron.spec.plan as plan\n"
        "p = plan_model_parallel(16, tensor_model_parallel_size=2, expert_model_parallel_size=2)\n"
        "from hypergrid.megatron import MEGATRON_CORE_0_19\n"
        "g = plan_model_parallel(16, features=MEGATRON_CORE_0_19, gtp_remat_size=2, rank_offset=8, local_world_size=8)\n"
        "assert g.rank_group('gtp_remat', 9) == [8, 9] and g.rank_group('dp', 3) is None\n"
        "assert p.rank_group('ep', 5) == [5, 7]\n"
        "assert 'megatron.core' not in sys.modules\n"
        "try:\n"
        "    from hypergrid.megatron import initialize_model_parallel\n"
        "except ImportError:\n"
        "    print('lazy')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lazy"
    # The planning modules themselves import neither torch nor megatron-core.
    for name in ("hypergrid.megatron.spec.plan", "hypergrid.megatron.spec.config", "hypergrid.megatron.spec.features", "hypergrid.layout"):
        tree = ast.parse(open(importlib.import_module(name).__file__).read())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.startswith(("torch", "megatron"))], (name, imported)


@pytest.mark.parametrize("world,features,kwargs", PLANS, ids=PLAN_IDS)
def test_rank_groups_are_the_rows_of_the_enumerations(world: int, features, kwargs: dict) -> None:
    plan = plan_model_parallel(world, features=features, **kwargs)
    groups = plan.groups
    for rank in range(world):
        for name, members in plan.rank_groups(rank).items():
            holding = [g for g in groups[name] if rank in g]
            if members is None:
                assert holding == [], (name, rank)
            else:
                # Megatron-Core keeps the last group that holds the rank.
                assert holding and holding[-1] == members, (name, rank, members, holding)
    # Grid kinds partition the ranks the grids span (all of the world without rank_offset).
    for kind in plan.kinds:
        if kind.is_grid_groups or isinstance(kind.derivation, Singletons):
            assert sorted(r for g in groups[kind.name] for r in g) == list(plan.config.grid_ranks), kind.name


def _installed_rank_generators(ps, plan):
    """The installed megatron-core's dense and expert RankGenerators for the plan's sizes."""
    import inspect

    c = plan.config
    takes_gtp = "gtp_remat" in inspect.signature(ps.RankGenerator).parameters
    inject = getattr(ps, "_inject_gtp_remat_axis", None)

    def generator(layout_after: str, gtp: int, **sizes):
        order = inject(c.order, after=layout_after) if inject else c.order
        extra = {"gtp_remat": gtp} if takes_gtp else {}
        return ps.RankGenerator(order=order, rank_offset=c.rank_offset, **sizes, **extra)

    dense = generator("tp", c.gtp, tp=c.tp, ep=1, dp=c.data_parallel_size, pp=c.pp, cp=c.cp)
    expert = generator("ep", c.egtp, tp=c.expert_tensor_size, ep=c.ep, dp=c.expert_data_parallel_size, pp=c.pp, cp=1)
    return dense, expert


@pytest.mark.parametrize("world,features,kwargs", PLANS, ids=PLAN_IDS)
def test_enumerations_equal_megatron_rank_generator(world: int, features, kwargs: dict) -> None:
    ps = pytest.importorskip("megatron.core.parallel_state")
    import hypergrid.megatron as hm

    installed = hm.installed_features()
    missing = sorted(set(kwargs) - set(installed.keywords))
    if missing:
        pytest.skip(f"megatron-core {installed.version} has no {missing}")
    # Planned for the installed version: its generators are the reference.
    plan = plan_model_parallel(world, features=installed, **kwargs)
    dense, expert = _installed_rank_generators(ps, plan)
    gtp = "gtp_remat-" if installed.gtp_remat else ""
    tokens = {"dp_cp": (dense, "dp-cp"), "dp": (dense, "dp"), "cp": (dense, "cp"), "mp": (dense, f"tp-{gtp}pp"),
              "tp": (dense, "tp"), "pp": (dense, "pp"), "tp_dp_cp": (dense, f"tp-{gtp}dp-cp"),
              "tp_dp": (dense, f"tp-{gtp}dp"), "tp_cp": (dense, "tp-cp"), "ep": (expert, "ep"),
              "expt_tp": (expert, "tp"), "tp_ep": (expert, "tp-ep"), "tp_ep_pp": (expert, "tp-ep-pp"),
              "expt_dp": (expert, "dp")}
    if installed.gtp_remat:
        tokens.update(gtp_remat=(dense, "gtp_remat"), dp_gtp=(dense, "gtp_remat-dp"),
                      dp_cp_gtp=(dense, "gtp_remat-dp-cp"))
    if installed.expert_gtp_remat:
        tokens.update(expt_gtp_remat=(expert, "gtp_remat"), tp_ep_pp_egtp=(expert, "tp-ep-gtp_remat-pp"),
                      expt_dp_gtp=(expert, "gtp_remat-dp"))
    for name, (generator, token) in tokens.items():
        # enumerate() resolves kinds that alias another (e.g. dp_gtp is dp at gtp_remat size 1).
        assert plan.enumerate(name) == generator.get_ranks(token), name
    assert plan.enumerate("embd") == [ps.default_embedding_ranks(g) for g in dense.get_ranks("pp")]


def test_json_round_trip() -> None:
    plan = plan_model_parallel(16, tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)
    data = json.loads(plan.to_json(rank=3))
    assert data["rank_groups"]["tp"] == [2, 3]
    assert data["groups"]["intra_dp_cp"] == plan.groups["intra_dp_cp"]
    assert data["sizes"]["data_parallel_size"] == 8
    assert {s["name"] for s in data["kinds"]} == set(plan.names)


def test_unknown_kind_names_the_kinds() -> None:
    with pytest.raises(KeyError, match="no group kind 'tensor'"):
        plan_model_parallel(8).rank_group("tensor", 0)


@pytest.mark.parametrize(
    "name", ["hypergrid.megatron", "hypergrid.megatron.spec.config", "hypergrid.megatron.spec.features", "hypergrid.megatron.spec.plan",
             "hypergrid.megatron.initialize"]
)
def test_module_doctests(name: str) -> None:
    if name.endswith("initialize"):
        pytest.importorskip("megatron.core")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
