"""The ``plan`` command's report as people and spreadsheets read it: a table and CSV.

Both render the data ``Plan.as_dict`` gives (with the cost of :mod:`hypergrid.planning.cost`), which is also
what ``--format json`` prints, so the three formats never say different things. ``plan --fail``'s
table renders :meth:`RecoveryReport.as_dict <hypergrid.planning.recovery.RecoveryReport.as_dict>`
the same way.
"""

from __future__ import annotations

import csv
import io
import math

from ..layout.describe import describe_members, member_runs
from .cost import cost_lines
from .plan import MAX_LISTED_WORLD, Plan, plan_grid  # noqa: F401 (plan_grid: examples)

__all__ = ["plan_table", "plan_csv", "recovery_table", "only_kinds"]

#: Members of a group a table shows before it shortens the list (JSON and CSV show all).
MEMBERS_SHOWN = 16
_RUNS_SHOWN = 7  # runs of a cut group named before its "..."
_MOVES_SHOWN = 8  # a recovery's rank moves named before its "..."


def _cut_group(head: list[int], last: int, size: int) -> str:
    """A group too long to list from its first members: whole runs of consecutive ranks (a run
    the cut would shorten is left to the ``...``, lest it read as complete), then the last
    member, the size, and the step where the members are evenly spaced.

    Example::

        >>> _cut_group([r + o for r in (104, 232, 360, 488) for o in range(4)], 1003, 32)
        '104-107, 232-235, 360-363, ..., 1003 (32 ranks)'
        >>> _cut_group(list(range(896, 912)), 1023, 128)
        '896-1023 (128 ranks)'
        >>> _cut_group(list(range(0, 64, 4)), 252, 64)
        '0, 4, 8, 12, 16, 20, 24, ..., 252 (64 ranks, step 4)'
        >>> _cut_group(list(range(64, 80)), 2047, 1024)  # 64-127, 192-255, ...: the first run's end is unknown
        '64, 65, 66, ..., 2047 (1024 ranks)'
    """
    steps = {b - a for a, b in zip(head, head[1:])}
    step = steps.pop() if len(steps) == 1 else None
    even = step is not None and head[0] + step * (size - 1) == last
    if even and step == 1:
        return f"{head[0]}-{last} ({size} ranks)"
    shown = head[:MEMBERS_SHOWN - 2]
    runs = member_runs(shown)
    if shown[-1] + 1 == head[MEMBERS_SHOWN - 2]:
        if len(runs) == 1:  # one run, longer than the head: its end is not known, so none is shown
            return f"{', '.join(map(str, shown[:3]))}, ..., {last} ({size} ranks)"
        runs.pop()
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:_RUNS_SHOWN]]
    return f"{', '.join(parts)}, ..., {last} ({size} ranks{f', step {step}' if even else ''})"


def _short(members) -> str:
    if members is None:
        return "- (in no group of this kind)"
    if isinstance(members, dict):  # Plan.group_heads: the first members and the last
        head, size = members["head"], members["size"]
        if head is None:
            return f"({size} ranks)"
        if size <= MEMBERS_SHOWN:
            return describe_members(head)
        return _cut_group(head, members["last"], size)
    text = describe_members(members)  # whole runs of the whole list
    return text if len(members) <= MEMBERS_SHOWN or "ranks" in text else f"{text} ({len(members)} ranks)"


def _dims_text(grid: dict) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(grid["dim_names"], grid["shape"]))


def _header(data: dict) -> list[str]:
    """The world, the Megatron sizes and the grid and views, from ``data`` (``plan`` or ``plan --fail``)."""
    nodes, gpn = math.ceil(data["world_size"] / data["gpus_per_node"]), data["gpus_per_node"]
    out = [f"hypergrid plan: {data['world_size']} ranks on {nodes} node{'s' * (nodes != 1)} of {gpn} ranks"]
    m = data["megatron"]
    if m is not None:
        out.append(
            f"megatron sizes: tp={m['tp']} pp={m['pp']} cp={m['cp']} ep={m['ep']} etp={m['etp']} "
            f"-> dp={m['dp']}, expert dp={m['edp']}; order {m['order']}"
        )
    out.append(f"grid:   {_dims_text(data['grid'])}   (first dim varies fastest over ranks)")
    for name, view in data["views"].items():
        out.append(f"{name + ':':<7} {_dims_text(view)}")
    return out


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_table(plan: Plan, data: dict) -> str:
    """The ``plan`` command's table: sizes, grid, one row per kind, placement, cost, ``--rank``'s groups.

    ``data`` is ``plan.as_dict(...)`` with its ``cost`` (what ``--format json`` prints).

    Example::

        >>> from hypergrid.planning.cost import max_cost
        >>> plan = plan_grid([2, 4], ["tp", "dp"])
        >>> data = plan.as_dict(4)
        >>> data["cost"] = {"comm_memory_mb": 600, "rank": None, "max": max_cost(plan).as_dict()}
        >>> print(plan_table(plan, data).splitlines()[0])
        hypergrid plan: 8 ranks on 2 nodes of 4 ranks
    """
    gpn = data["gpus_per_node"]
    out = _header(data)
    out.append("")
    # The parallel_state global each kind fills: a column for Megatron plans only (torchtitan's and
    # a free grid's kinds fill none).
    megatron = data["megatron"] is not None
    rows = [["kind", "key", "groups", "size", "nodes/group", "domains/group", "placement"] + ["megatron group"] * megatron]
    where = {"node": "inside a node", "nvlink": "inside an NVLink domain", "across": "ACROSS DOMAINS"}
    for k in data["kinds"]:
        key = k["key"] if k["view"] is None else f"{k['view']}:{k['key']}"
        placement = where[k["placement"]]
        if k["placement"] != "node" and k["intra_node_groups"]:
            placement += f" ({k['intra_node_groups']} groups inside a node)"
        if k.get("backend") == "fake":  # where it lies does not matter: nothing is sent
            placement = "fake backend: no communicator"
        rows.append([
            k["name"], key, str(k["count"]), "varies" if k["size"] is None else str(k["size"]),
            str(k["max_nodes_per_group"]), str(k["max_nvlink_domains_per_group"]),
            placement] + [k["megatron_name"] or ""] * megatron)
    out.append(_table(rows, right={2, 3, 4, 5}))
    if "kinds_shown" in data:
        shown = data["kinds_shown"]
        out.append(f"kinds shown: {', '.join(shown['given'])} (--kind; {shown['of']} kinds in the plan)")
    crossing = [k["name"] for k in data["kinds"] if k["crosses_nodes"]]
    out.append("")
    out.append(
        f"cross nodes ({gpn} ranks per node): {', '.join(crossing)}" if crossing
        else f"every group stays inside a node of {gpn} ranks"
    )
    if data["nvlink_domain"] != gpn:
        across = [k["name"] for k in data["kinds"] if k["placement"] == "across"]
        out.append(f"cross NVLink domains ({data['nvlink_domain']} ranks each): {', '.join(across) or 'none'}")
    sampled = [k["name"] for k in data["kinds"] if not k["locality_exact"]]
    if sampled:
        out.append(f"node locality over a sample of groups (world over {MAX_LISTED_WORLD:,} ranks): "
                   f"{', '.join(sampled)}")
    out += cost_lines(data["cost"])
    if "rank" in data:
        r = data["rank"]
        out.append("")
        out.append(f"rank {r['rank']}: node {r['node']}, local rank {r['local_rank']}")
        out.append("  coords " + " ".join(f"{n}={c}" for n, c in r["coords"].items()))
        for view, coords in r["view_coords"].items():
            out.append(f"  {view} coords " + " ".join(f"{n}={c}" for n, c in coords.items()))
        width = max(len(n) for n in r["groups"])
        for name, members in r["groups"].items():
            out.append(f"  {name.ljust(width)}  {_short(members)}")
    return "\n".join(out)


def only_kinds(data: dict, names: list[str]) -> dict:
    """``data`` (``plan``'s) with only the kinds ``names`` (``--kind``), in the plan's order, in the
    kinds and in ``--rank``'s groups, and ``kinds_shown`` saying so; the cost stays the rank's whole.

    Example::

        >>> data = only_kinds(plan_grid([2, 4], ["tp", "dp"]).as_dict(4, rank=1), ["dp"])
        >>> [k["name"] for k in data["kinds"]], data["rank"]["groups"], data["kinds_shown"]
        (['dp'], {'dp': [1, 3, 5, 7]}, {'given': ['dp'], 'of': 2})
    """
    wanted = set(names)
    out = {**data, "kinds": [k for k in data["kinds"] if k["name"] in wanted],
           "kinds_shown": {"given": list(dict.fromkeys(names)), "of": len(data["kinds"])}}
    if "rank" in data:
        out["rank"] = {**data["rank"], "groups": {n: g for n, g in data["rank"]["groups"].items() if n in wanted}}
    return out


def plan_csv(data: dict) -> str:
    """The ``plan`` command's CSV: one row per kind (with ``--rank``, that rank's group and communicator:
    its members space-separated, or a group over ``LISTED_MEMBERS`` ranks shortened as in the table).

    Example::

        >>> from hypergrid.planning.cost import max_cost
        >>> plan = plan_grid([2, 4], ["tp", "dp"])
        >>> data = plan.as_dict(4)
        >>> data["cost"] = {"comm_memory_mb": 600, "rank": None, "max": max_cost(plan).as_dict()}
        >>> plan_csv(data).splitlines()[1].split(",")[:6]
        ['tp', 'tp', '', '', '4', '2']
    """
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    header = ["kind", "key", "view", "megatron_name", "groups", "size", "max_nodes_per_group",
              "intra_node_groups", "crosses_nodes", "max_nvlink_domains_per_group", "placement", "locality_exact"]
    rank = data.get("rank")
    if rank is not None:
        header += [f"rank_{rank['rank']}_group", f"rank_{rank['rank']}_communicator"]
    writer.writerow(header)
    of_kind = data["cost"]["rank"]["communicator_of_kind"] if rank is not None else {}
    for k in data["kinds"]:
        row = [k["name"], k["key"], k["view"] or "", k["megatron_name"] or "", k["count"], k["size"],
               k["max_nodes_per_group"], "" if k["intra_node_groups"] is None else k["intra_node_groups"],
               str(k["crosses_nodes"]).lower(), k["max_nvlink_domains_per_group"], k["placement"],
               str(k["locality_exact"]).lower()]
        if rank is not None:
            members = rank["groups"][k["name"]]
            # A group too large to list (Plan.rank_groups) is written as the table shows it.
            text = "" if members is None else _short(members) if isinstance(members, dict) else " ".join(map(str, members))
            row += [text, of_kind.get(k["name"], "")]
        writer.writerow(row)
    return buf.getvalue().rstrip("\n")


def _runs_text(runs: list[list[int]], shown: int = 8) -> str:
    """Ranks given as ``[first rank, length]`` runs, for people: ``0-4, 16, 6-15``."""
    parts = [str(a) if n == 1 else f"{a}-{a + n - 1}" for a, n in runs[:shown]]
    return ", ".join(parts) + (f", ... ({len(runs)} runs)" if len(runs) > shown else "")


_ROLES = {"stays": "stays", "failed": "failed", "leaves": "leaves the grid with its replica",
          "spare": "a spare, not used", "outside": "outside the grid"}


def recovery_table(data: dict) -> str:
    """``plan --fail``'s table: the layout, the recovery (rank moves, or the replicas dropped), per
    kind the groups kept, rebuilt and dropped, and ``--rank``'s groups before and after.

    ``data`` is :meth:`RecoveryReport.as_dict <hypergrid.planning.recovery.RecoveryReport.as_dict>`
    (what ``--json`` prints).

    Example::

        >>> from hypergrid.planning.recovery import recovery_of
        >>> report = recovery_of(plan_grid([2, 4], ["tp", "dp"]), failed=[3], spares=[8], gpus_per_node=4)
        >>> print("\\n".join(recovery_table(report.as_dict(4)).splitlines()[3:6]))
        recovery from the loss of rank 3: replace
          a spare takes each failed rank's position: 3 -> 8
          spares left: none
    """
    r = data["recovery"]
    out = _header(data)
    out[0] += f"; spares: {describe_members(r['spares']) if r['spares'] else 'none'}"
    failed = r["failed"]
    out += ["", f"recovery from the loss of rank{'s' * (len(failed) > 1)} {describe_members(failed)}: {r['kind']}"]
    if r["kind"] == "replace":
        moves = [f"{a} -> {b}" for a, b in r["replaced"]]
        cut = ", ..." if len(moves) > _MOVES_SHOWN else ""
        out.append(f"  a spare takes each failed rank's position: {', '.join(moves[:_MOVES_SHOWN])}{cut}")
        out.append(f"  spares left: {describe_members(r['spares_left']) if r['spares_left'] else 'none'}")
    else:
        dim, replicas = r["replica_dim"], data["grid"]["shape"][data["grid"]["dim_names"].index(r["replica_dim"])]
        gone = r["dropped_replicas"]
        out.append(f"  too few spares ({len(r['spares'])} for {len(failed)} failed): replica{'s' * (len(gone) > 1)} "
                   f"{describe_members(gone)} of {dim} dropped ({dim} {replicas} -> {replicas - len(gone)})")
        out.append(f"  ranks leaving the grid with {'them' if len(gone) > 1 else 'it'}: "
                   f"{describe_members(r['leaving']) if r['leaving'] else 'none'}")
        if r["replaced"]:  # a mixed recovery: the spares cover the failed ranks of the replicas kept
            moves = [f"{a} -> {b}" for a, b in r["replaced"]]
            cut = ", ..." if len(moves) > _MOVES_SHOWN else ""
            out.append(f"  in the replicas kept, a spare takes each failed rank's position: "
                       f"{', '.join(moves[:_MOVES_SHOWN])}{cut}")
            out.append(f"  spares left: {describe_members(r['spares_left']) if r['spares_left'] else 'none'}")
    after = r["grid_after"]
    out.append(f"grid after: {_dims_text(after)} on ranks {_runs_text(after['rank_runs'])} ({after['size']} ranks)")
    out += [f"warning: {line}" for line in r.get("warnings", [])] + [""]
    rows = [["kind", "groups before", "after", "kept", "rebuilt", "dropped"]]
    for k in r["kinds"]:
        rows.append([k["name"]] + ["-" if k[f] is None else str(k[f])
                                   for f in ("before", "after", "kept", "rebuilt", "dropped")])
    out.append(_table(rows, right={1, 2, 3, 4, 5}))
    out.append("kept: the same members in the same order; rebuilt: groups that did not exist before; "
               "dropped: groups that no longer exist")
    if data["follows"] is not None:
        out.append(f"kinds: the groups {data['follows']['description']} creates")
    unknown = [k["name"] for k in r["kinds"] if k["counted"] == "not_computed"]
    if unknown:
        out.append(f"not counted (compared group by group up to {MAX_LISTED_WORLD:,} ranks): {', '.join(unknown)}")
    if "rank" in data:
        out += [""] + _rank_lines(data["rank"])
    return "\n".join(out)


def _rank_lines(rank: dict) -> list[str]:
    role = (f"a spare, takes rank {rank['replaces']}'s place" if rank["role"] == "replaces"
            else _ROLES[rank["role"]])
    coords = [f"{side} " + " ".join(f"{n}={c}" for n, c in rank[f"coords_{side}"].items())
              for side in ("before", "after") if rank[f"coords_{side}"] is not None]
    out = [f"rank {rank['rank']} (node {rank['node']}, local rank {rank['local_rank']}): {role}"
           + (f"; coords {', '.join(coords)}" if coords else "")]
    rows = [["kind", "before", "after", "change"]]
    for name, g in rank["groups"].items():
        rows.append([name] + [_group_text(g[side]) for side in ("before", "after")]
                    + [(g["change"] or "-").replace("_", " ")])
    out.append(_table(rows, right=set()))
    return out


def _group_text(members) -> str:
    """A group of a recovery's rank: a list in full (its evenness checked), a group too large to
    list as its first members and last (nothing inferred: a placed grid's groups skip ranks)."""
    if members is None:
        return "-"
    if isinstance(members, list):
        return describe_members(members)
    if members["head"] is None:
        return f"({members['size']} ranks)"
    runs = member_runs(members["head"][:MEMBERS_SHOWN - 2])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:_RUNS_SHOWN]]
    return f"{', '.join(parts)}, ..., {members['last']} ({members['size']} ranks)"
