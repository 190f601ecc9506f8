"""Partner copies: every rank's unique state also held by a rank on another node, checked on restore.

Fast tests: who partners whom, the restore plan every rank derives alike, and digests that catch
a flipped byte. On gloo: FSDP2 over the grid's dp dim (dp 4 on ranks 0-3, nodes of 2, a spare
node 4-5, no replica peer: ``replica_dim`` names a dim the grid does not have) with Adam, through
``hypergrid.train(..., partner_copies=True)``:

- node 1 (ranks 2 and 3) SIGKILLed mid-step: the spares take their positions and their shards
  from the copies ranks 0 and 1 held; every step's loss on every rank bit-equal to the same job
  with no failure;
- the same with tensor parallel 2 x FSDP2 over dp 2 (tests/test_training.py's tensor-parallel
  MLP, its tp group's custom autograd functions and its dropout seeded per tp rank; tp fastest,
  so node 1 is dp index 1's whole tp group): each spare takes its tp shard's dp shard, its Adam
  moments and its RNG from its partner's copy, bit-equal again;
- the same with no FSDP2 but ZeroRedundancyOptimizer (Adam) over the grid's dp group, through
  ``TrainingState(model, zero)``: each rank's snapshot holds its partition's Adam state only (no
  consolidate_state_dict), the spares take theirs from the copies, the survivors' ZeRO is
  pointed at the new dp group; bit-equal again;
- ranks 1 and 3 (each the other's partner) SIGKILLed together: with a loader, every rank resumes
  from the loader's step (losses bit-equal to the run with no failure from there); without one,
  RecoveryRefused on every rank, naming the positions lost and who held their copies;
- node 1 lost while rank 0's copy of rank 2 has a byte flipped: SnapshotCorrupted on every rank,
  naming rank 2, the step and the key, and no step trained after it.
"""

from __future__ import annotations

import functools
import os
import signal
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from hypergrid.errors import SnapshotCorrupted
from hypergrid.training import TrainingState
from hypergrid.training.partner import PartnerCopies, partner_map
from hypergrid.training.regions import Held, Region, Wanted, block_of, plan_relay, plan_whole, table_of
from hypergrid.training.state import Snapshot, digest
from hypergrid.training.transfer import Sending, packed
from tests.harness import run_gloo
from tests.test_mesh_refresh_gloo import _model
from tests.test_training import ParallelMLP, average_gradients, mesh_job

STEPS, KILL_STEP, SAVE_STEP = 6, 3, 2
DIM, HIDDEN, BATCH = 4, 8, 3
COLLECTIVE_S = 6.0


# ---------------------------------------------------------------------- fast: partners and plans
@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (4, 8), (2, 1)])
def test_each_rank_holds_one_copy_from_another_node_and_any_node_lost_leaves_every_copy(nodes, per_node):
    ranks = list(range(nodes * per_node))
    partners = partner_map(ranks, per_node)
    assert sorted(partners.values()) == ranks  # a permutation: each rank holds exactly one copy
    assert all(r // per_node != p // per_node for r, p in partners.items())
    for lost in range(nodes):
        gone = {r for r in ranks if r // per_node == lost}
        assert all(partners[r] not in gone for r in gone)  # each lost rank's copy is elsewhere


def test_partners_follow_the_grid_order_after_a_replacement_and_one_node_is_refused():
    assert partner_map([0, 1, 4, 5], 2) == {0: 4, 1: 5, 4: 0, 5: 1}
    with pytest.raises(ValueError, match=r"the grid's 2 ranks \[6, 7\] are all on node 3 \(gpus_per_node=2\)"):
        partner_map([6, 7], 2)


def _rows(rank: int, rows: int, shards: int, context: tuple = (), plain: tuple = ()) -> dict:
    """The region of rank ``rank``'s Shard(0) block of a ``rows`` x 3 weight over ``shards``
    ranks, as FSDP2 (torch.chunk) lays it, and of its optimizer's step count (a whole scalar, in
    context ``plain``: the rank's dp coordinate where dp is not the replica dim)."""
    size = -(-rows // shards)
    start = min(rank * size, rows)
    return {("model", "w"): Region(context, (rows, 3), (start, 0), (min(size, rows - start), 3), torch.float32),
            ("optimizer", "step"): Region(plain, (), (), (), torch.float32)}


def _relaid(old_shards: int, new_ranks: list, rows: int = 10) -> dict:
    """Old ranks 0..old_shards-1 hold their rows of a global weight; each of ``new_ranks`` is
    built from the plan's blocks: returns each new rank's tensor, to compare with its rows."""
    weight = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    held, data = [], {}
    for r in range(old_shards):
        regions = _rows(r, rows, old_shards)
        block = regions[("model", "w")]
        data[r] = weight[block.offsets[0]:block.offsets[0] + block.shape[0]]
        held.append(Held(r, r, 3, False, (("dp", r),), regions))
    wanted = [Wanted(r, (("dp", i),), _rows(i, rows, len(new_ranks))) for i, r in enumerate(new_ranks)]
    plan = plan_relay(wanted, held, 3, replica_dim="dp")
    assert not plan.missing, plan.missing
    built = {}
    for want in wanted:
        need = want.regions[("model", "w")]
        out = torch.full(need.shape, -1.0)
        for part in plan.parts:
            if part.receiver == want.rank and part.path == ("model", "w"):
                source = held[part.source].regions[("model", "w")]
                block_of(out, need, part.offsets, part.shape).copy_(
                    block_of(data[part.source], source, part.offsets, part.shape))
        built[want.rank] = (out, weight[need.offsets[0]:need.offsets[0] + need.shape[0]])
    return built


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (4, 3), (3, 4), (4, 4), (1, 3)])
def test_shards_are_re_laid_onto_another_dp_size_as_dcp_would(old, new):
    for rank, (built, want) in _relaid(old, list(range(new))).items():
        assert torch.equal(built, want), (rank, built, want)


def test_a_replacement_takes_the_lost_rank_s_regions_from_its_copy_or_a_replica_peer():
    def held(holder, source, step, copy, context=()):
        return Held(holder, source, step, copy, (("dp", source),), _rows(source, 8, 4, context, (("dp", source),)))

    # dp 4 of FSDP2, no replica dim: ranks 4 and 5 took 2's and 3's places; 0 and 1 hold their copies.
    copies = [held(0, 0, 3, False), held(0, 2, 3, True), held(1, 1, 3, False), held(1, 3, 3, True)]
    wanted = [Wanted(r, (("dp", p),), _rows(p, 8, 4, (), (("dp", p),))) for p, r in enumerate([0, 1, 4, 5])]
    plan = plan_relay(wanted, copies, 3, replica_dim="none")
    assert {(p.receiver, p.holder, p.source) for p in plan.parts} == {(0, 0, 0), (1, 1, 1), (4, 0, 2), (5, 1, 3)}
    assert plan.templates == {0: (0, 0), 1: (1, 1), 4: (0, 2), 5: (1, 3)}  # the replaced rank's RNG and objects
    # A replica peer (the same region, its own snapshot) is taken before a copy.
    peers = copies + [Held(6, 6, 3, False, (("dp", 2),), _rows(2, 8, 4, (), (("dp", 2),)))]
    assert {(p.receiver, p.holder) for p in plan_relay(wanted, peers, 3, "none").parts if p.receiver == 4} == {(4, 6)}
    # The copies of step 3 never arrived (a node lost in the exchange): back to step 2, which all hold.
    older = copies[::2] + copies[2::2] + [held(0, 2, 2, True), held(1, 3, 2, True), held(0, 0, 2, False),
                                          held(1, 1, 2, False)]
    older = [h for h in older if not (h.copy and h.step == 3)]
    assert plan_relay(wanted, older, 3, "none").step == 2
    # Nobody holds rank 3's regions: what is missing is named; tensor-parallel contexts never mix.
    lost = plan_relay(wanted, copies[:3], 3, "none")
    assert lost.step == 3 and lost.missing[0] == "rank 5: model/w in context (), 6 of 6 elements held by nobody", lost
    tp = [held(0, 0, 3, False, (("tp", 1),))]
    assert plan_relay([Wanted(0, (("dp", 0),), _rows(0, 8, 4, (("tp", 0),), (("dp", 0),)))], tp, 3, "none").missing


def test_whole_snapshots_are_traded_by_their_tables_alone_where_no_shape_changed():
    def named(holder, source, step, copy, shards=4):
        return Held(holder, source, step, copy, (("dp", source),), {},
                    table_of(_rows(source, 8, shards, (), (("dp", source),))))

    held = [named(0, 0, 3, False), named(0, 2, 3, True), named(1, 1, 3, False), named(1, 3, 3, True)]
    wanted = [Wanted(r, (("dp", p),), {}, table_of(_rows(p, 8, 4, (), (("dp", p),))))
              for p, r in enumerate([0, 1, 4, 5])]
    plan = plan_whole(wanted, held, 3)
    assert plan is not None and plan.whole and plan.step == 3
    assert plan.templates == {0: (0, 0), 1: (1, 1), 4: (0, 2), 5: (1, 3)}
    # Rank 3's copy of step 3 never arrived: whole at step 2 at best (the loop then asks the regions).
    older = [named(h.holder, h.source, 2, h.copy) for h in held] + held[:3]
    assert plan_whole(wanted, older, 3).step == 2  # type: ignore[union-attr]
    # dp 4 -> 2: no table matches a new shard; the regions re-lay them.
    shrunk = [Wanted(r, (("dp", r),), {}, table_of(_rows(r, 8, 2, (), (("dp", r),)))) for r in (0, 1)]
    assert plan_whole(shrunk, held, 3) is None


def test_zero_partitions_are_found_by_parameter_name_on_whichever_rank_held_them():
    def zero(rank, names):
        return {("optimizer", "state", n, "exp_avg"): Region((), (4,), (0,), (4,), torch.float32) for n in names}

    held = [Held(r, r, 5, False, (("dp", r),), zero(r, [f"{r}.w"])) for r in range(4)]  # one parameter each
    wanted = [Wanted(0, (("dp", 0),), zero(0, ["0.w", "1.w"])), Wanted(1, (("dp", 1),), zero(1, ["2.w", "3.w"]))]
    plan = plan_relay(wanted, held, 5, replica_dim="dp")
    assert sorted((p.receiver, p.path[2], p.holder) for p in plan.parts) == [
        (0, "0.w", 0), (0, "1.w", 1), (1, "2.w", 2), (1, "3.w", 3)]


# ---------------------------------------------------------------------- fast: digests
def test_a_digest_catches_any_flipped_byte_and_names_rank_step_and_key():
    state = TrainingState(torch.nn.Linear(3, 2))
    snapshot = state.capture(step=7, digests=True)
    weight = snapshot.tensors[("model", "weight")]
    raw = weight.view(torch.uint8).reshape(-1)
    for index in range(raw.numel()):
        for bit in (1, 128):
            raw[index] ^= bit
            with pytest.raises(SnapshotCorrupted) as caught:
                snapshot.verify(what="the copy held by rank 5")
            raw[index] ^= bit
            assert (caught.value.step, caught.value.key) == (7, "model/weight")
    snapshot.verify()
    assert "the copy held by rank 5 (the state of rank None at step 7)" in str(caught.value)
    raw[3] ^= 4
    before = state.capture(step=8)
    with pytest.raises(SnapshotCorrupted):
        state.restore(snapshot)  # refused before anything is written
    assert all(torch.equal(a, b) for a, b in zip(state.capture(step=8).tensors.values(), before.tensors.values()))


def test_digests_of_every_dtype_and_a_snapshot_in_one_buffer():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64):
        tensor = torch.zeros(5, dtype=dtype)
        assert digest(tensor) == digest(tensor.clone())
    state = TrainingState(torch.nn.Linear(3, 2))
    snapshot = state.capture(step=0)
    assert snapshot.buffer is not None and snapshot.buffer.numel() == 2 * 64  # each tensor 64-byte aligned
    base = snapshot.buffer.data_ptr()
    assert sorted(t.data_ptr() - base for t in snapshot.tensors.values()) == [0, 64]


def test_a_snapshot_in_one_buffer_is_saved_and_loaded_by_torch(tmp_path):
    snapshot = TrainingState(torch.nn.Linear(3, 2)).capture(step=2, digests=True)
    torch.save(snapshot, tmp_path / "s.pt")  # torch saves no storage viewed as two dtypes: cloned per tensor
    loaded = torch.load(tmp_path / "s.pt", weights_only=False)
    loaded.verify()
    assert loaded.step == 2 and loaded.buffer is None and snapshot.buffer is not None


def test_partner_copies_keep_two_steps_and_settle_to_the_gate():
    copies = PartnerCopies(gpus_per_node=2)
    for step in (1, 2, 3):
        copies.keep(2, Snapshot(step, {("w",): torch.ones(1)}, rank=2))
    assert [(c.rank, c.step) for c in copies.held()] == [(2, 2), (2, 3)]
    copies.settle(3)
    assert [(c.rank, c.step) for c in copies.held()] == [(2, 3)]


class _Pending:
    """A backend operation that has not said it completed (gloo's, before a wait)."""

    def is_completed(self) -> bool:
        return False


def test_a_copy_cut_short_by_a_failure_counts_only_where_it_arrived_whole():
    sent = TrainingState(torch.nn.Linear(3, 2)).capture(step=4, digests=True)
    sent.rank = 2
    header, payload = packed(sent)

    def in_flight(header_bytes: bytes, buffer: torch.Tensor) -> Sending:
        incoming = {2: (torch.frombuffer(bytearray(header_bytes), dtype=torch.uint8), buffer)}
        return Sending([_Pending(), _Pending()], incoming, None, [])

    (copy,) = in_flight(header, payload.clone()).arrived().values()
    assert (copy.rank, copy.step) == (2, 4) and torch.equal(copy.buffer, payload)
    torn = payload.clone()
    torn[payload.numel() // 2:] = 0  # its second half not yet written
    assert in_flight(header, torn).arrived() == {}
    assert in_flight(bytes(len(header)), payload.clone()).arrived() == {}  # no header yet
    undigested = packed(TrainingState(torch.nn.Linear(3, 2)).capture(step=4))
    assert in_flight(*undigested).arrived() == {}  # nothing to tell it whole by: not taken


# ---------------------------------------------------------------------- gloo: FSDP2 over dp 4, and tp 2 x dp 2
def _tp_model(grid: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """tests/test_training.py's tensor-parallel MLP (tp 2), its dropout seeded per tp rank, with
    FSDP2 over the grid's dp dim (the 1-D dp submesh of the grid's DeviceMesh)."""
    from torch.distributed.fsdp import fully_shard

    import hypergrid

    tp_rank = grid.ranks("tp").index(dist.get_rank())
    torch.manual_seed(2024 + tp_rank)
    model = ParallelMLP(tp_rank)
    fully_shard(model, mesh=hypergrid.device_mesh(grid, device_type="cpu")["dp"])
    return model, torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)


def _zero_model(grid: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A plain MLP, replicated, with ZeroRedundancyOptimizer (Adam) over the grid's dp group: each
    rank holds the Adam state of its partition of the parameters only."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, DIM))
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                          process_group=grid.get_pg("dp"), lr=0.05, foreach=False)


def _fsdp(rank: int, world: int, kill: tuple[int, ...], folder: str, *, with_loader: bool = False,
          corrupt: Optional[tuple[int, int, int]] = None, tp: bool = False, zero: bool = False) -> dict:
    """dp 4 of FSDP2 on ranks 0-3, spares 4-5 (nodes of 2). ``kill``: ranks SIGKILLed after
    step ``KILL_STEP``'s forward; ``corrupt``: (holder, source, step): the holder flips one byte
    of each copy of the source's snapshots up to that step as it receives it; ``tp``: tp 2 x dp 2
    instead (tp fastest: node 0 holds dp index 0's tp group), :func:`_tp_model`; ``zero``: no
    FSDP2 but ZeRO over dp 4, :func:`_zero_model`, the gradients averaged over dp."""
    import hypergrid
    from hypergrid.training import partner

    warnings.filterwarnings("ignore")
    if corrupt is not None and rank == corrupt[0]:
        keep = partner.PartnerCopies.keep

        def flipping(self: Any, source: int, copy: Any) -> None:
            if source == corrupt[1] and copy.step <= corrupt[2]:  # whichever step the job resumes from
                copy.buffer[0] ^= 1  # as a bit flipped in host memory would
            keep(self, source, copy)

        partner.PartnerCopies.keep = flipping  # type: ignore[method-assign]
    hypergrid.start_heartbeat(interval_s=0.5)
    job = mesh_job([2, 2], ["tp", "dp"]) if tp else mesh_job([4], ["dp"])  # no dp_replicate: one holder a shard
    ran: list[int] = []

    def setup(job: Any) -> Any:
        model, optimizer = _tp_model(job.state) if tp else _zero_model(job.state) if zero else _model(
            hypergrid.device_mesh(job.state, device_type="cpu"))
        return hypergrid.TrainingState(model, optimizer)

    def step(job: Any, state: Any, step: int) -> float:
        position = list(job.layout.ranks).index(dist.get_rank())
        if step == SAVE_STEP:  # the user's own checkpoint, of this position, for the loader
            torch.save(state.capture(step), Path(folder) / f"{position}.pt")
        ran.append(step)
        (model,), (optimizer,) = state.models, state.optimizers
        generator = torch.Generator().manual_seed(1000 * step + (position // 2 if tp else position))  # by dp index
        x, y = torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, DIM, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        out = model(x, hypergrid.device_mesh(job.state, device_type="cpu").get_group("tp")) if tp else model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        if rank in kill and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: before the backward's reduce-scatter
        loss.backward()
        if zero:
            average_gradients(model, job.state.get_pg("dp"))
        optimizer.step()
        return loss.item()

    loaded: list[int] = []

    def loader(job: Any, state: Any) -> int:
        position = list(job.layout.ranks).index(dist.get_rank())
        saved = torch.load(Path(folder) / f"{position}.pt", weights_only=False)
        state.restore(saved)
        loaded.append(saved.step)
        return saved.step

    try:
        run = hypergrid.train(job, setup, step, steps=STEPS, partner_copies=True,
                              loader=loader if with_loader else None)
    except (hypergrid.errors.RecoveryRefused, SnapshotCorrupted) as refused:
        return {"refused": type(refused).__name__, "message": str(refused), "ran": ran,
                "fields": (getattr(refused, "rank", None), getattr(refused, "step", None),
                           getattr(refused, "key", None))}
    if not run.job.in_grid:
        return {"in_grid": False}
    held = run.state.capture(STEPS).tensors if run.state is not None else {}
    return {"in_grid": True, "ranks": list(run.job.layout.ranks), "losses": run.losses, "loaded": loaded,
            "optimizer_tensors": sum(1 for path in held if path[:2] == ("optimizer", "state")),
            "position": list(run.job.layout.ranks).index(rank), "records": [r.describe() for r in run.records],
            "kinds": [r.kind for r in run.records]}


def _reference(folder: str, **kind: bool) -> dict[int, dict]:
    results = run_gloo(functools.partial(_fsdp, **kind), 6, (), folder, timeout=240, pg_timeout_s=COLLECTIVE_S,
                       leave_at_once=True)
    return {v["position"]: v for v in results if v.get("in_grid")}


def _node_1_replaced_bit_equal(results: list, expected: dict) -> None:
    """Node 1 died, the spare node took its positions, and every step's loss on every rank of the
    grid is that of the run with no failure."""
    assert results[2][0] == "dead" and results[3][0] == "dead", results
    for rank in (0, 1, 4, 5):
        status, value = results[rank]
        assert status == "ok" and value["ranks"] == [0, 1, 4, 5], (rank, results[rank])
        assert value["kinds"] == (["joined"] if rank >= 4 else ["replace"]), (rank, value["records"])
        steps = range(KILL_STEP, STEPS) if rank >= 4 else range(STEPS)
        want = expected[value["position"]]["losses"]
        assert {s: value["losses"][s] for s in steps} == {s: want[s] for s in steps}, (rank, value["losses"], want)


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("tp", [False, True], ids=["dp4", "tp2xdp2"])
def test_fsdp2_through_a_node_loss_restores_the_shards_from_partner_copies_bit_equal(tmp_path, tp):
    expected = _reference(str(tmp_path), tp=tp)
    assert len({v["losses"][0] for v in expected.values()}) == (2 if tp else 4), expected  # tp ranks alike
    results = run_gloo(functools.partial(_fsdp, tp=tp), 6, (2, 3), str(tmp_path), timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    _node_1_replaced_bit_equal(results, expected)
    print("recoveries:", *(results[r][1]["records"][0] for r in (0, 1, 4, 5)), sep="\n  ")


@pytest.mark.gloo
@pytest.mark.slow
def test_a_rank_lost_with_its_partner_resumes_from_the_loader_or_is_refused_on_every_rank(tmp_path):
    expected = _reference(str(tmp_path))
    results = run_gloo(functools.partial(_fsdp, with_loader=True), 6, (1, 3), str(tmp_path), timeout=300, pg_timeout_s=COLLECTIVE_S,
                       expect_failure=True, leave_at_once=True)
    assert results[1][0] == "dead" and results[3][0] == "dead", results
    for rank in (0, 2, 4, 5):
        status, value = results[rank]
        assert status == "ok" and value["ranks"] == [0, 4, 2, 5] and value["loaded"] == [SAVE_STEP], (rank, value)
        want = expected[value["position"]]["losses"]
        steps = range(SAVE_STEP, STEPS)
        assert {s: value["losses"][s] for s in steps} == {s: want[s] for s in steps}, (rank, value["losses"], want)
    refused = run_gloo(_fsdp, 6, (1, 3), str(tmp_path), timeout=300, pg_timeout_s=COLLECTIVE_S, expect_failure=True,
                       leave_at_once=True)
    for rank in (0, 2, 4, 5):
        status, value = refused[rank]
        assert status == "ok" and value["refused"] == "RecoveryRefused", (rank, refused[rank])
        assert (f"no copy of the state of step {KILL_STEP} survived for position 1 (rank 1, its copy held by "
                f"rank 3), position 3 (rank 3, its copy held by rank 1)") in value["message"], value["message"]


@pytest.mark.gloo
@pytest.mark.slow
def test_a_corrupted_partner_copy_is_refused_by_name_and_not_trained_on(tmp_path):
    results = run_gloo(functools.partial(_fsdp, corrupt=(0, 2, KILL_STEP)), 6, (2, 3), str(tmp_path), timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    for rank in (0, 1, 4, 5):
        status, value = results[rank]
        assert status == "ok" and value["refused"] == "SnapshotCorrupted", (rank, results[rank])
        # The step's copies travel during the step: the kill may come before they are in (then step 2's).
        corrupted_at = value["fields"][1]
        assert value["fields"][0] == 2 and corrupted_at in (KILL_STEP - 1, KILL_STEP), (rank, value)
        assert f"the copy of rank 2's snapshot held by rank 0 (the state of rank 2 at step {corrupted_at})" \
            in value["message"], value["message"]
        assert max(value["ran"], default=-1) <= KILL_STEP and (rank < 4 or value["ran"] == []), (rank, value["ran"])


@pytest.mark.gloo
@pytest.mark.slow
def test_zero_through_a_node_loss_restores_each_rank_s_optimizer_shard_from_partner_copies_bit_equal(tmp_path):
    expected = _reference(str(tmp_path), zero=True)
    # 4 parameters over dp 4: each rank holds one parameter's Adam state (step, exp_avg, exp_avg_sq).
    assert [expected[p]["optimizer_tensors"] for p in range(4)] == [3] * 4, expected
    results = run_gloo(functools.partial(_fsdp, zero=True), 6, (2, 3), str(tmp_path), timeout=300,
                       pg_timeout_s=COLLECTIVE_S, expect_failure=True, leave_at_once=True)
    _node_1_replaced_bit_equal(results, expected)
