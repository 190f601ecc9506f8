"""Real processes over gloo: Megatron-Core's own layers and communication on hypergrid's groups.

Each job runs Megatron-Core's ``initialize_model_parallel`` and hypergrid's in turn in the same
processes and compares: every getter (gloo groups included, which the fake backend cannot
have), ``ColumnParallelLinear`` + ``RowParallelLinear`` forward and backward with tp=2, a
pipeline send/recv through next/prev ranks, and a collective on every
``ProcessGroupCollection`` field.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_gloo

#: Every test here starts multi-process gloo jobs (tests/README.md).
pytestmark = pytest.mark.gloo


def _linear_pass(seed: int) -> dict[str, torch.Tensor]:
    """Column- then row-parallel linear, forward and backward, on the current tp group."""
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(seed)
    column = ColumnParallelLinear(8, 12, config=config, init_method=torch.nn.init.normal_, bias=True,
                                  gather_output=False)
    row = RowParallelLinear(12, 6, config=config, init_method=torch.nn.init.normal_, bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    # Same input on every rank of a data-parallel replica, different across replicas.
    generator = torch.Generator().manual_seed(seed + ps.get_data_parallel_rank())
    x = torch.randn(5, 8, generator=generator, requires_grad=True)
    hidden, _ = column(x)
    out, _ = row(hidden)
    (out * out).sum().backward()
    return {
        "out": out.detach().clone(),
        "x.grad": x.grad.clone(),
        "column.weight.grad": column.weight.grad.clone(),
        "row.weight.grad": row.weight.grad.clone(),
        "column.weight": column.weight.detach().clone(),
    }


def _pipeline_exchange(rank: int) -> tuple[float, float]:
    """Send this rank to the next stage and receive the previous stage's, over the pp group."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    send = torch.tensor([float(rank)])
    recv = torch.zeros(1)
    ops = [
        dist.P2POp(dist.isend, send, ps.get_pipeline_model_parallel_next_rank(), group),
        dist.P2POp(dist.irecv, recv, ps.get_pipeline_model_parallel_prev_rank(), group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return float(recv.item()), float(ps.get_pipeline_model_parallel_prev_rank())


def _collection_sums(pgc: Any) -> dict[str, Any]:
    """all_reduce of ones over every group of the collection: each must give its size."""
    from dataclasses import fields

    out: dict[str, Any] = {}
    for f in fields(pgc):
        value = getattr(pgc, f.name, None)
        groups = value if isinstance(value, list) else [value]
        sums = []
        for group in groups:
            if group is None:
                sums.append(None)
                continue
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            sums.append((int(t.item()), group.size()))
        out[f.name] = sums
    return out


def _case(rank: int, kwargs: dict[str, Any], variants: list[dict[str, Any]]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    import hypergrid.megatron as hm
    from hypergrid.megatron.spec.config import MegatronConfig
    from tests.test_megatron_parallel_state_parity import collection_snapshot, differences, load_megatron, snapshot

    load_megatron()

    config = MegatronConfig.from_megatron_kwargs(dist.get_world_size(), kwargs, hm.installed_features())
    ps.initialize_model_parallel(**kwargs)
    expected = snapshot(config)
    expected_pgc = collection_snapshot(ProcessGroupCollection.use_mpu_process_groups)
    # megatron-core 0.19's layers all-gather gtp_remat-sharded weights in a way that fails on CPU
    # after its own initialization too ("not enough values to unpack" in gather_along_first_dim):
    # the layer comparison runs where gtp_remat is 1.
    runs_layers = kwargs.get("tensor_model_parallel_size", 1) > 1 and kwargs.get("gtp_remat_size", 1) == 1
    reference = _linear_pass(seed=1234) if runs_layers else None
    hm.destroy_model_parallel()

    result: dict[str, Any] = {"diffs": [], "checks": 0}
    for variant in variants:
        # Twice each: initialize, destroy and initialize again must work.
        for attempt in range(2):
            hm.initialize_model_parallel(**variant, **kwargs)
            grids = hm.active_grids()
            try:
                label = f"rank {rank} {variant} attempt {attempt}"
                actual = snapshot(config)
                result["diffs"] += [f"{label}: {d}" for d in differences(expected, actual)]
                pgc_snapshot = collection_snapshot(hm.process_group_collection)
                result["diffs"] += [f"{label}: collection {d}" for d in differences(expected_pgc, pgc_snapshot)]
                pgc = hm.process_group_collection()
                if reference is not None:
                    mine = _linear_pass(seed=1234)
                    for key, value in reference.items():
                        if not torch.equal(value, mine[key]):
                            result["diffs"].append(f"{label}: {key} differs by {(value - mine[key]).abs().max()}")
                received, prev = _pipeline_exchange(rank)
                if received != prev:
                    result["diffs"].append(f"{label}: received {received} from the previous stage, expected {prev}")
                for name, sums in _collection_sums(pgc).items():
                    for entry in sums:
                        if entry is not None and entry[0] != entry[1]:
                            result["diffs"].append(f"{label}: all_reduce over {name} gave {entry[0]}, size {entry[1]}")
                if config.dense_gloo:
                    # megatron-core 0.19 makes no gloo groups under gtp_remat.
                    gloo = ps.get_data_parallel_group_gloo(with_context_parallel=True)
                    t = torch.ones(1)
                    dist.all_reduce(t, group=gloo)
                    if int(t.item()) != gloo.size():
                        result["diffs"].append(f"{label}: gloo dp-cp all_reduce gave {t.item()}")
                # The separate all-gather communicators work as collectives on their own.
                for group in hm.create_all_gather_groups(for_expert_parallelism=True):
                    if group is not None:
                        t = torch.ones(1)
                        dist.all_reduce(t, group=group)
                        if int(t.item()) != group.size():
                            result["diffs"].append(f"{label}: all-gather group all_reduce gave {t.item()}")
                result["checks"] += 1
                result.setdefault("groups", {})[f"{variant}"] = grids.num_process_groups
            finally:
                hm.destroy_model_parallel()
    return result


def _job(rank: int, world_size: int, cases: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    # One job for every case: starting processes that import megatron-core is the slow part.
    return [_case(rank, kwargs, variants) for kwargs, variants in cases]


TP2_PP2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
MOE_CP_DISTOPT = dict(
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=2,
    context_parallel_size=2,
    expert_model_parallel_size=2,
    expert_tensor_parallel_size=1,
    num_distributed_optimizer_instances=2,
    hierarchical_context_parallel_sizes=[2, 1],
)
# megatron-core 0.19: both gtp_remat axes (no gloo groups then, as megatron-core makes none).
GTP_MOE = dict(
    tensor_model_parallel_size=2,
    gtp_remat_size=2,
    pipeline_model_parallel_size=2,
    expert_model_parallel_size=2,
    expert_tensor_parallel_size=1,
    expert_gtp_remat_size=2,
)


def test_layers_pipeline_and_collection_on_8_gloo_ranks() -> None:
    pytest.importorskip("megatron.core")
    from hypergrid.megatron import installed_features

    installed = installed_features()
    moe = dict(MOE_CP_DISTOPT, create_all_gather_group=True) if installed.all_gather_keyword else MOE_CP_DISTOPT
    cases = [
        (TP2_PP2, [{"share_groups": True}, {"share_groups": False}]),
        (moe, [{"share_groups": True}]),
    ]
    if installed.gtp_remat:
        cases.append((GTP_MOE, [{"share_groups": True}]))
    results = run_gloo(_job, 8, cases, timeout=400)
    diffs = [d for per_rank in results for case in per_rank for d in case["diffs"]]
    assert diffs == [], "\n".join(diffs[:30])
    # Every variant ran its checks twice (init, destroy, init again) on every rank.
    assert all([case["checks"] for case in per_rank] == [4, 2, 2][: len(cases)] for per_rank in results)
    # Sharing merges identical groups (e.g. expert tp with tp): fewer communicators.
    for per_rank in results:
        counts = per_rank[0]["groups"]
        assert counts["{'share_groups': True}"] < counts["{'share_groups': False}"]
