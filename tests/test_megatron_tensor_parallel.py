"""Megatron-Core's own tensor-parallel code on hypergrid's groups gives bit-equal results.

A 4-rank gloo job runs, after Megatron-Core's ``initialize_model_parallel`` and after
hypergrid's (sharing on and off), the same computations with the same seeds: the
column-/row-parallel linear layers (forward, backward), every tensor-parallel mapping in
``megatron.core.tensor_parallel.mappings`` (each with its backward), the expert all-to-all and
``vocab_parallel_cross_entropy`` with its gradient. They reach their process groups through
``parallel_state`` only, so any group hypergrid filled differently (other members, other order)
would change a number. Outputs and gradients must be equal bit for bit.

Megatron-Core allocates the outputs of its gathers with ``device=torch.cuda.current_device()``;
in these CPU-only child processes that call answers ``"cpu"`` (see :func:`_allocate_on_cpu`),
for Megatron-Core's initialization and hypergrid's alike, so every mapping runs unchanged on
gloo.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_gloo

#: Every test here starts multi-process gloo jobs (tests/README.md).
pytestmark = pytest.mark.gloo


def _leaf(seed: int, *shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_(True)


def _layers(seed: int) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(seed)
    column = ColumnParallelLinear(8, 16, config=config, init_method=torch.nn.init.normal_, bias=True, gather_output=True)
    row = RowParallelLinear(16, 4, config=config, init_method=torch.nn.init.normal_, bias=True,
                            input_is_parallel=False, skip_bias_add=False)
    x = _leaf(seed + ps.get_data_parallel_rank(), 3, 8).float().detach().requires_grad_(True)
    hidden, _ = column(x)
    out, _ = row(hidden)
    (out * out).sum().backward()
    return {"linear.out": out.detach(), "linear.x.grad": x.grad, "column.weight.grad": column.weight.grad,
            "row.weight.grad": row.weight.grad, "row.bias.grad": row.bias.grad}


def _mappings(seed: int) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    out: dict[str, torch.Tensor] = {}
    # Each mapping with a rank-dependent input and a rank-dependent upstream gradient.
    calls = {
        "copy": (lambda t: mappings.copy_to_tensor_model_parallel_region(t), (4, 6)),
        "reduce": (lambda t: mappings.reduce_from_tensor_model_parallel_region(t), (4, 6)),
        "scatter_last": (lambda t: mappings.scatter_to_tensor_model_parallel_region(t), (4, 6 * tp)),
        "gather_last": (lambda t: mappings.gather_from_tensor_model_parallel_region(t), (4, 6)),
        "scatter_first": (lambda t: mappings.scatter_to_sequence_parallel_region(t), (4 * tp, 6)),
        "gather_first": (lambda t: mappings.gather_from_sequence_parallel_region(t), (4, 6)),
        "reduce_scatter_first": (lambda t: mappings.reduce_scatter_to_sequence_parallel_region(t), (4 * tp, 6)),
    }
    for index, (name, (fn, shape)) in enumerate(calls.items()):
        x = _leaf(seed + 100 * index + tp_rank, *shape)
        y = fn(x)
        y.backward(_leaf(seed + 100 * index + 50 + tp_rank, *y.shape).detach())
        out[f"{name}.out"] = y.detach()
        out[f"{name}.grad"] = x.grad
    ep_group = ps.get_expert_model_parallel_group()
    ep = ps.get_expert_model_parallel_world_size()
    x = _leaf(seed + 999 + ps.get_expert_model_parallel_rank(), 2 * ep, 3)
    y = mappings.all_to_all(ep_group, x)
    y.backward(_leaf(seed + 998, *y.shape).detach())
    out["ep_all_to_all.out"], out["ep_all_to_all.grad"] = y.detach(), x.grad
    return out


def _cross_entropy(seed: int) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    tp_rank = ps.get_tensor_model_parallel_rank()
    vocab_per_rank = 5
    logits = _leaf(seed + tp_rank, 3, 2, vocab_per_rank).float().detach().requires_grad_(True)
    target = torch.randint(0, vocab_per_rank * ps.get_tensor_model_parallel_world_size(), (3, 2),
                           generator=torch.Generator().manual_seed(seed + 7))
    loss = vocab_parallel_cross_entropy(logits.clone(), target)
    loss.sum().backward()
    return {"xent.loss": loss.detach(), "xent.grad": logits.grad}


def _all(seed: int) -> dict[str, torch.Tensor]:
    return {**_layers(seed), **_mappings(seed), **_cross_entropy(seed)}


def _allocate_on_cpu() -> None:
    """Make ``torch.cuda.current_device()`` name the CPU in this (child, CPU-only) process."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _job(rank: int, world_size: int, cases: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    from megatron.core import parallel_state as ps

    import hypergrid.megatron as hm

    _allocate_on_cpu()

    results = []
    for kwargs, variants in cases:
        ps.initialize_model_parallel(**kwargs)
        try:
            reference = _all(seed=31)
        finally:
            hm.destroy_model_parallel()
        diffs: list[str] = []
        compared = 0
        for variant in variants:
            hm.initialize_model_parallel(**variant, **kwargs)
            try:
                mine = _all(seed=31)
            finally:
                hm.destroy_model_parallel()
            for key, value in reference.items():
                compared += 1
                if key not in mine or mine[key].shape != value.shape or not torch.equal(value, mine[key]):
                    diffs.append(f"rank {rank} {kwargs} {variant}: {key} differs: {value} vs {mine.get(key)}")
        results.append({"diffs": diffs, "compared": compared, "keys": sorted(reference)})
    return results


CASES = [
    # The tensor-parallel group is the whole world (with sharing: the default group itself).
    (dict(tensor_model_parallel_size=4, create_gloo_process_groups=False), [{"share_groups": True}, {"share_groups": False}]),
    # tp groups of 2 beside pipeline groups; expert all-to-all over ep=2 with etp=1.
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
          expert_tensor_parallel_size=1), [{"share_groups": True}, {"share_groups": False}, {"strategy": "enumerate"}]),
]


def test_tensor_parallel_layers_mappings_and_cross_entropy_are_bit_equal_on_4_gloo_ranks() -> None:
    pytest.importorskip("megatron.core")
    results = run_gloo(_job, 4, CASES, timeout=300)
    diffs = [d for per_rank in results for case in per_rank for d in case["diffs"]]
    assert diffs == [], "\n".join(diffs[:20])
    for per_rank in results:
        # Every case compared every quantity for every variant (nothing silently dropped).
        for case, (_, variants) in zip(per_rank, CASES):
            assert case["compared"] == len(case["keys"]) * len(variants)
            assert {"linear.out", "column.weight.grad", "gather_first.grad", "ep_all_to_all.out", "xent.grad"} <= set(case["keys"])
