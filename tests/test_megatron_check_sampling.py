"""``hypergrid check`` on worlds too large to compare in full: a sample of groups, compared with
the groups Megatron-Core's own ``generate_masked_orthogonal_rank_groups`` computes for them.

The sampling runs Megatron-Core's function with its loop over group indices handed the sampled
indices; the tests here check that what comes back is exactly the rows of Megatron-Core's full
``RankGenerator.get_ranks`` (on worlds small enough to list), that a hypergrid group that differs
is caught and named by its group index, that a Megatron-Core whose function loops differently is
reported as not compared instead of trusted, and that the command line says it sampled. They run
in both CI environments (megatron-core 0.16.1 and the current one).
"""

from __future__ import annotations

import random
import warnings

import pytest

from hypergrid.app import cli
from hypergrid.layout import GridLayout
from hypergrid.planning import parity
from hypergrid.planning.plan import plan_megatron

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    parallel_state = pytest.importorskip("megatron.core.parallel_state")

ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "pp-dp-ep-cp-tp"]


@pytest.mark.parametrize("order", ORDERS)
def test_sampled_megatron_groups_are_rows_of_its_full_enumeration(order):
    rng = random.Random(order)
    for sizes in ({"tp": 2, "cp": 3, "ep": 1, "dp": 4, "pp": 5}, {"tp": 4, "cp": 1, "ep": 1, "dp": 3, "pp": 2},
                  {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 3}):
        generator = parallel_state.RankGenerator(**sizes, order=order)
        tokens = ["tp", "pp", "dp", "cp", "ep", "tp-cp", "dp-cp", "tp-dp", "tp-ep", "tp-cp-ep-dp-pp", "pp-dp"]
        for token in tokens:
            full = generator.get_ranks(token)
            indices = rng.sample(range(len(full)), min(len(full), 5))
            sampled = parity._megatron_groups_at(generator, token, indices)
            assert sampled == [full[i] for i in indices], (order, sizes, token, indices)


def test_sampled_groups_carry_megatron_rank_offset():
    generator = parallel_state.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp", rank_offset=8)
    assert parity._megatron_groups_at(generator, "dp", [3, 0]) == [generator.get_ranks("dp")[i] for i in (3, 0)]


def test_sample_of_a_moe_plan_is_identical_and_counted():
    plan = plan_megatron(4096, tp=2, pp=4, cp=2, ep=8, etp=1)
    result = parity.compare_with_megatron(plan, sample=True, seed=7, groups_per_kind=6)
    assert result.ok, result.differences
    assert result.sampled and result.seed == 7
    generator_kinds = [k for k in plan.kinds if k.name not in {s.name for s in result.not_compared}]
    assert result.compared_rank_generator == len(generator_kinds) > 10
    assert len(generator_kinds) < result.sampled_groups <= 6 * len(generator_kinds)
    assert result.compared_hyper_comm_grid > 0  # 4,096 ranks: HyperCommGrid still in full


def test_a_wrong_group_is_caught_in_a_sample_and_named_by_its_index(monkeypatch):
    real = GridLayout.group_ranks

    def wrong(self, dims, rank):
        members = real(self, dims, rank)
        # Reversing the dp groups of the grid (not of the expert view): a member-order difference.
        return members[::-1] if self.order_dims(dims)[1] == "dp" and "ep" not in self.dim_names else members

    monkeypatch.setattr(GridLayout, "group_ranks", wrong)
    monkeypatch.setattr(parity, "FULL_COMPARISON_RANKS", 1024)
    plan = plan_megatron(4096, tp=8, pp=4, ep=16, etp=1)
    result = parity.compare_with_megatron(plan, groups_per_kind=4)
    assert result.sampled  # a world over FULL_COMPARISON_RANKS is sampled without being asked
    assert result.differences == [
        "dp (DATA_PARALLEL_GROUP): RankGenerator differs at group 0: hypergrid [1016, 1008, 1000, 992, 984, "
        "976, 968, ..., 0 (128 ranks, step -8)], megatron-core [0, 8, 16, 24, 32, 40, 48, ..., 1016 "
        "(128 ranks, step 8)] (4 sampled groups)"
    ]


def test_huge_world_is_sampled_and_says_what_it_left_out():
    result = parity.compare_with_megatron(plan_megatron(1 << 40, tp=8, pp=16))
    assert result.ok and result.sampled and result.compared_rank_generator >= 3
    reasons = {s.name: s.reason for s in result.not_compared}
    assert "lists every one of the 1099511627776 ranks" in reasons["grid"]
    assert "groups of 8589934592 ranks" in reasons["dp"]


def test_a_megatron_core_that_loops_differently_is_not_trusted(monkeypatch):
    def other_generate(world_size, parallel_size, mask):  # same groups, another loop first
        checks = [size for size in range(len(parallel_size))]
        assert checks is not None
        return [[0]]

    monkeypatch.setattr(parallel_state, "generate_masked_orthogonal_rank_groups", other_generate)
    result = parity.compare_with_megatron(plan_megatron(64, tp=2, pp=2), sample=True)
    assert result.ok and result.compared_rank_generator == 0
    reasons = {s.name: s.reason for s in result.not_compared}
    assert "initialize_model_parallel" in reasons.pop("intra_dist_opt")
    assert len(reasons) > 5 and all("cannot be run on a sample (its first loop is range(" in r
                                    for r in reasons.values()), reasons


def test_full_is_refused_for_a_world_too_large_to_list():
    with pytest.raises(ValueError, match="too large to list every group"):
        parity.compare_with_megatron(plan_megatron(1 << 23, tp=8), sample=False)


def test_cli_check_says_it_sampled(capsys):
    assert cli.main(["check", "--world-size", str(1 << 34), "--tp", "8", "--pp", "8", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("compared ") and "RankGenerator.get_ranks on a sample of" in first, out
    assert "sampled (seed 3)" in out and "too large to compare in full" in out
    assert "not compared: grid: HyperCommGrid.get_rank_enum lists every one" in out
    assert out.rstrip().endswith("identical to megatron-core")


def test_cli_check_sample_on_a_small_world_points_at_full(capsys):
    assert cli.main(["check", "--world-size", "64", "--tp", "2", "--ep", "4", "--sample", "--groups", "2"]) == 0
    out = capsys.readouterr().out
    assert "--full compares every group" in out and "up to 2," in out


@pytest.mark.parametrize("argv, words", [
    (["check", "--world-size", "64", "--sample", "--full"], ["--full", "--sample"]),
    (["check", "--world-size", str(1 << 40), "--tp", "8", "--full"], ["too large"]),
    (["check", "--world-size", "64", "--groups", "0"], ["--groups", "0"]),
])
def test_cli_check_bad_sampling_options(argv, words, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hypergrid: error:") and "\n" not in err, err
    for word in words:
        assert word in err, (word, err)

