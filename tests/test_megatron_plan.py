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

from hypergrid.megatron import plan_model_parallel

PLANS = [
    (8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    (48, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, context_parallel_size=2,
              expert_model_parallel_size=4, expert_tensor_parallel_size=1, num_distributed_optimizer_instances=2)),
    (32, dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2], hybrid_context_parallel=True,
              create_all_gather_group=True, order="tp-cp-ep-pp-dp")),
    (30, dict(tensor_model_parallel_size=3, pipeline_model_parallel_size=5, order="pp-dp-tp")),
]


def test_plan_imports_without_megatron_or_torch_distributed_use() -> None:
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "from hypergrid.megatron import plan_model_parallel\n"
        "import hypergrid.megatron.plan as plan\n"
        "p = plan_model_parallel(16, tensor_model_parallel_size=2, expert_model_parallel_size=2)\n"
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
    for name in ("hypergrid.megatron.plan", "hypergrid.megatron.config", "hypergrid.layout"):
        tree = ast.parse(open(importlib.import_module(name).__file__).read())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.startswith(("torch", "megatron"))], (name, imported)


@pytest.mark.parametrize("world,kwargs", PLANS)
def test_rank_groups_are_the_rows_of_the_enumerations(world: int, kwargs: dict) -> None:
    plan = plan_model_parallel(world, **kwargs)
    groups = plan.groups
    for rank in range(world):
        for name, members in plan.rank_groups(rank).items():
            holding = [g for g in groups[name] if rank in g]
            if members is None:
                assert holding == [], (name, rank)
            else:
                # Megatron-Core keeps the last group that holds the rank.
                assert holding and holding[-1] == members, (name, rank, members, holding)
    # Grid kinds partition the world.
    for spec in plan.specs:
        if spec.derive is None:
            assert sorted(r for g in groups[spec.name] for r in g) == list(range(world)), spec.name


@pytest.mark.parametrize("world,kwargs", PLANS)
def test_enumerations_equal_megatron_rank_generator(world: int, kwargs: dict) -> None:
    ps = pytest.importorskip("megatron.core.parallel_state")
    plan = plan_model_parallel(world, **kwargs)
    c = plan.config
    dense = ps.RankGenerator(tp=c.tp, ep=1, dp=c.data_parallel_size, pp=c.pp, cp=c.cp, order=c.order)
    expert = ps.RankGenerator(tp=c.expert_tensor_size, ep=c.ep, dp=c.expert_data_parallel_size, pp=c.pp, cp=1,
                              order=c.order)
    tokens = {"dp_cp": (dense, "dp-cp"), "dp": (dense, "dp"), "cp": (dense, "cp"), "mp": (dense, "tp-pp"),
              "tp": (dense, "tp"), "pp": (dense, "pp"), "tp_dp_cp": (dense, "tp-dp-cp"), "tp_dp": (dense, "tp-dp"),
              "tp_cp": (dense, "tp-cp"), "ep": (expert, "ep"), "expt_tp": (expert, "tp"), "tp_ep": (expert, "tp-ep"),
              "tp_ep_pp": (expert, "tp-ep-pp"), "expt_dp": (expert, "dp")}
    for name, (generator, token) in tokens.items():
        assert plan.groups[name] == generator.get_ranks(token), name
    assert plan.groups["embd"] == [ps.default_embedding_ranks(g) for g in dense.get_ranks("pp")]


def test_json_round_trip() -> None:
    plan = plan_model_parallel(16, tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)
    data = json.loads(plan.to_json(rank=3))
    assert data["rank_groups"]["tp"] == [2, 3]
    assert data["groups"]["intra_dp_cp"] == plan.groups["intra_dp_cp"]
    assert data["sizes"]["data_parallel_size"] == 8
    assert {s["name"] for s in data["specs"]} == set(plan.names)


def test_unknown_kind_names_the_kinds() -> None:
    with pytest.raises(KeyError, match="no group kind 'tensor'"):
        plan_model_parallel(8).rank_group("tensor", 0)


@pytest.mark.parametrize(
    "name", ["hypergrid.megatron", "hypergrid.megatron.config", "hypergrid.megatron.plan", "hypergrid.megatron.initialize"]
)
def test_module_doctests(name: str) -> None:
    if name.endswith("initialize"):
        pytest.importorskip("megatron.core")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
