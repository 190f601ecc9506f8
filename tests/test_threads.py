"""Thread safety: readers of the registry and of grids while another thread creates groups."""

from __future__ import annotations

import threading

import torch.distributed as dist

from hypergrid import HyperCommGrid
from hypergrid.runtime.registry import REGISTRY

from .harness import fake_world

SHAPE, NAMES = [2, 2, 2, 2, 2], ["tp", "cp", "ep", "dp", "pp"]
RANK, WORLD = 11, 64


def _all_dims() -> list[list[str]]:
    # Every non-empty combination of the five dims: 31 distinct keys per grid.
    out = []
    for mask in range(1, 2 ** len(NAMES)):
        out.append([n for i, n in enumerate(NAMES) if mask >> i & 1])
    return out


def test_readers_see_consistent_state_while_a_writer_creates_groups():
    with fake_world(rank=RANK, world_size=WORLD):
        grid = HyperCommGrid(SHAPE, NAMES, world_size=WORLD)
        # A second grid over the same ranks: its groups are shared with the first's by members.
        twin = HyperCommGrid([4, 2, 2, 2], ["tp_cp", "ep", "dp", "pp"], world_size=WORLD)
        combos = _all_dims()
        expected_ranks = {grid._order_dims(d)[1]: grid.ranks(d, rank=RANK) for d in combos}
        errors: list[BaseException] = []
        created: dict[str, object] = {}
        done = threading.Event()
        start = threading.Barrier(5)

        def writer() -> None:
            try:
                start.wait()
                for dims in combos:
                    key = grid._order_dims(dims)[1]
                    created[key] = grid.create_pg(dims)
                for dims in (["tp_cp"], ["ep", "tp_cp"], ["pp", "dp", "ep", "tp_cp"]):
                    twin.create_pg(dims)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                done.set()

        def reader(seed: int) -> None:
            try:
                start.wait()
                seen = 0
                last_count = 0
                while not done.is_set() or seen < 3:
                    seen += 1
                    count = REGISTRY.count()
                    groups = REGISTRY.groups()
                    # Only the writer changes the registry, and only by adding: never shrinks.
                    assert count >= last_count and len(groups) >= count, (last_count, count, len(groups))
                    last_count = count
                    assert len(set(map(id, groups))) == len(groups), "a group listed twice"
                    for dims in combos[seed::4]:
                        key = grid._order_dims(dims)[1]
                        assert grid.ranks(dims) == expected_ranks[key]
                        try:
                            pg = grid.get_pg(list(reversed(dims)))
                        except KeyError:
                            continue  # not created yet
                        # Once visible, a group is the one the writer got and has the right members.
                        assert dist.get_process_group_ranks(pg) == sorted(expected_ranks[key])
                        assert pg in REGISTRY.groups()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a thread did not finish"
        assert not errors, errors
        # Final state: one communicator per distinct member set, every key answered alike.
        assert len(created) == len(combos)
        distinct = {tuple(sorted(expected_ranks[k])) for k in created if len(expected_ranks[k]) > 0}
        assert REGISTRY.count() == len(distinct)
        for key, pg in created.items():
            assert grid.get_pg(key.split("-")) is pg
        assert twin.get_pg("tp_cp") is grid.get_pg(["tp", "cp"])
        grid.destroy()
        twin.destroy()
        assert REGISTRY.count() == 0


def test_many_threads_creating_in_separate_grids_share_groups():
    with fake_world(rank=RANK, world_size=WORLD):
        grids = [HyperCommGrid(SHAPE, NAMES) for _ in range(6)]
        combos = _all_dims()
        results: list[dict[str, object]] = [{} for _ in grids]
        errors: list[BaseException] = []
        start = threading.Barrier(len(grids))

        def work(i: int) -> None:
            try:
                start.wait()
                order = combos if i % 2 else list(reversed(combos))
                for dims in order:
                    results[i][grids[i]._order_dims(dims)[1]] = grids[i].create_pg(dims)
                    REGISTRY.count()
                    REGISTRY.groups()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(grids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        # Every grid got the very same communicator for each key: creation raced, sharing held.
        for key in results[0]:
            assert len({id(r[key]) for r in results}) == 1, key
        assert REGISTRY.count() == len({id(pg) for pg in results[0].values()})
        for g in grids[:-1]:
            g.destroy()
        assert REGISTRY.count() == len(results[0])  # the last grid still holds all of them
        grids[-1].destroy()
        assert REGISTRY.count() == 0
