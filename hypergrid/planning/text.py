"""The ``plan`` command's report as people and spreadsheets read it: a table and CSV.

Both render the data ``Plan.as_dict`` gives (with the cost of :mod:`hypergrid.planning.cost`), which is also
what ``--format json`` prints, so the three formats never say different things.
"""

from __future__ import annotations

import csv
import io

from .cost import cost_lines
from ..layout.describe import describe_members, member_runs
from .plan import MAX_LISTED_WORLD, Plan, plan_grid  # noqa: F401 (plan_grid: examples)

__all__ = ["plan_table", "plan_csv"]

#: Members of a group a table shows before it shortens the list (JSON and CSV show all).
MEMBERS_SHOWN = 16
_RUNS_SHOWN = 7  # runs of a cut group named before its "..."


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
    """
    steps = {b - a for a, b in zip(head, head[1:])}
    step = steps.pop() if len(steps) == 1 else None
    even = step is not None and head[0] + step * (size - 1) == last
    if even and step == 1:
        return f"{head[0]}-{last} ({size} ranks)"
    shown = head[:MEMBERS_SHOWN - 2]
    runs = member_runs(shown)
    if len(runs) > 1 and shown[-1] + 1 == head[MEMBERS_SHOWN - 2]:
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
    return describe_members(members)


def _dims_text(layout) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(layout.dim_names, layout.shape))


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_table(plan: "Plan", data: dict) -> str:
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
    nodes, gpn = data["nodes"], data["gpus_per_node"]
    out = [f"hypergrid plan: {plan.world_size} ranks on {nodes} node{'s' * (nodes != 1)} of {gpn} ranks"]
    order_note = "first dim varies fastest over ranks"
    m = plan.megatron
    if m is not None:
        out.append(
            f"megatron sizes: tp={m.tp} pp={m.pp} cp={m.cp} ep={m.ep} etp={m.etp} "
            f"-> dp={m.dp}, expert dp={m.edp}; order {m.order}"
        )
    out.append(f"grid:   {_dims_text(plan.layout)}   ({order_note})")
    for name, view in plan.views.items():
        out.append(f"{name + ':':<7} {_dims_text(view)}")
    out.append("")
    rows = [["kind", "key", "groups", "size", "nodes/group", "domains/group", "placement", "megatron group"]]
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
            placement, k["megatron_name"] or "",
        ])
    out.append(_table(rows, right={2, 3, 4, 5}))
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
