"""The ``hypergrid`` command line: plan, check, demo, bench.

Only argument handling and printing live here; the work is done by :mod:`hypergrid.report`
(plans), :mod:`hypergrid.viz` (pictures), :mod:`hypergrid.parity` (comparison with
Megatron-Core), :mod:`hypergrid.demo` (the gloo demo) and the scripts in ``benchmarks/``.

Bad input prints one line, ``hypergrid: error: ...``, and exits with status 2.

Example::

    $ python -m hypergrid plan --world-size 1024 --tp 8 --pp 4 --ep 16 --etp 1 --rank 1000
    $ python -m hypergrid plan --world-size 128 --tp 8 --pp 4 --rank 37 --png plan.png  # needs matplotlib
    $ python -m hypergrid check --world-size 1024 --tp 8 --pp 4 --ep 16 --etp 1
    $ python -m hypergrid demo
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["main", "build_parser", "UsageError"]

logger = logging.getLogger("hypergrid.cli")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: Where ``bench`` looks for benchmark scripts: the repository's ``benchmarks/`` folder.
BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
BENCH_SCRIPTS = {"grid": "bench_grid.py", "megatron": "bench_megatron.py"}

# The largest world a plan answers for: what a rank number in an int64 can reach.
_MAX_WORLD = (1 << 63) - 1

# Members of a group shown in a table before it is shortened (JSON and CSV show all).
_MAX_MEMBERS_SHOWN = 16


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints the whole usage block; one line says what is wrong and where to look.
        raise UsageError(f"{message} (see: {self.prog} --help)")


# ---------------------------------------------------------------------------- arguments
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,3,4, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one size, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated dim names like tp,cp,dp, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rank (integer >= 0), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a rank (integer >= 0), got {value}")
    return value


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-Core sizes (dp and expert dp take what is left)")
    g.add_argument("--world-size", "-n", type=_positive, help="number of ranks")
    g.add_argument("--tp", type=_positive, help="tensor-parallel size (default 1)")
    g.add_argument("--pp", type=_positive, help="pipeline-parallel size (default 1)")
    g.add_argument("--cp", type=_positive, help="context-parallel size (default 1)")
    g.add_argument("--ep", type=_positive, help="expert-parallel size (default 1)")
    g.add_argument("--etp", type=_positive, help="expert tensor-parallel size (default: --tp)")
    g.add_argument("--order", help="Megatron order, first dim fastest (default tp-cp-ep-dp-pp)")
    f = p.add_argument_group("or a free grid")
    f.add_argument("--shape", type=_int_list, help="sizes, e.g. 2,3,4")
    f.add_argument("--dims", type=_name_list, help="dim names, first fastest, e.g. tp,cp,dp")
    f.add_argument(
        "--group", action="append", type=_name_list, default=[], metavar="DIMS",
        help="also a group over several dims, e.g. --group cp,dp (repeatable)",
    )


def _plan_from_args(args: argparse.Namespace):
    from .report import plan_grid, plan_megatron

    megatron_given = [n for n in ("tp", "pp", "cp", "ep", "etp", "order") if getattr(args, n) is not None]
    if args.shape is not None or args.dims is not None:
        if args.shape is None or args.dims is None:
            raise UsageError("a free grid needs both --shape and --dims, e.g. --shape 2,3,4 --dims tp,cp,dp")
        if megatron_given:
            raise UsageError(
                f"--shape/--dims and Megatron sizes ({', '.join('--' + n for n in megatron_given)}) "
                f"are two ways to give a layout; use one"
            )
        return plan_grid(args.shape, args.dims, world_size=args.world_size, groups=args.group)
    if args.group:
        raise UsageError("--group needs a free grid (--shape and --dims)")
    if args.world_size is None:
        raise UsageError("give --world-size with Megatron sizes, or --shape and --dims for a free grid")
    return plan_megatron(
        args.world_size,
        tp=args.tp or 1, pp=args.pp or 1, cp=args.cp or 1, ep=args.ep or 1, etp=args.etp,
        order=args.order or "tp-cp-ep-dp-pp",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``hypergrid`` argument parser (exposed for the docs and tests).

    Example::

        >>> build_parser().parse_args(["plan", "--world-size", "8", "--tp", "2"]).tp
        2
    """
    parser = _Parser(
        prog="hypergrid",
        description="Plan, check and try parallel layouts: one grid, every process group.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("plan", help="groups, node locality and a picture of a layout (no GPU needed)")
    _add_layout_args(p)
    p.add_argument("--gpus-per-node", type=_positive, default=8, help="ranks per node (default 8)")
    p.add_argument("--rank", type=_non_negative, help="show this rank's coordinates and groups")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    p.add_argument("--csv", dest="format", action="store_const", const="csv", help="same as --format csv")
    p.add_argument("--comm-memory-mb", type=_positive, default=None, metavar="MB",
                   help="GPU memory per NCCL communicator for the estimate (default 600: an estimate "
                        "from public NCCL measurements on A100s; measure yours)")
    p.add_argument("--png", metavar="FILE", help="write a picture of the ranks by node (PNG; needs matplotlib)")
    p.add_argument("--svg", metavar="FILE", help="write a picture of the ranks by node (SVG; needs matplotlib)")
    p.add_argument("--kind", "--colour", "--color", dest="kinds", type=_name_list, metavar="KINDS",
                   help="group kinds drawn, one panel each, e.g. tp,dp (default: tp, cp, dp, pp, ep, ... "
                        "that have groups of more than one rank)")
    p.add_argument("--nvlink-domain", type=_positive, metavar="GPUS",
                   help="GPUs per NVLink domain (consecutive ranks; e.g. 72 for an NVL72 rack of 18 "
                        "nodes of 4): placement column and picture (default: --gpus-per-node)")

    c = sub.add_parser("check", help="compare every enumeration with megatron-core's")
    _add_layout_args(c)

    d = sub.add_parser("demo", help="build and verify real groups on local gloo ranks (or under torchrun)")
    d.add_argument("--world-size", "-n", type=_positive, default=None, help="local ranks to launch (default 8)")
    d.add_argument("--tp", type=_positive, default=2)
    d.add_argument("--pp", type=_positive, default=2)
    d.add_argument("--cp", type=_positive, default=1)
    d.add_argument("--ep", type=_positive, default=2)
    d.add_argument("--etp", type=_positive, default=1)
    d.add_argument("--order", default="tp-cp-ep-dp-pp")
    d.add_argument("--timeout", type=_positive, default=120, help="seconds for the whole run (default 120)")
    d.add_argument("--no-megatron", action="store_true", help="skip Megatron parallel_state even if available")
    d.add_argument("--no-mesh", action="store_true", help="skip the DeviceMesh even if available")
    d.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)

    b = sub.add_parser(
        "bench", help="run the scale benchmarks in benchmarks/ (arguments after -- go to the scripts)"
    )
    b.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCH_SCRIPTS)} (default all)")
    b.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help=argparse.SUPPRESS)
    return parser


# ---------------------------------------------------------------------------- plan
def _short(members) -> str:
    if members is None:
        return "- (in no group of this kind)"
    if isinstance(members, dict):  # Plan.group_heads: the first members and the last
        head, size = members["head"], members["size"]
        if head is None:
            return f"({size} ranks)"
        if size <= _MAX_MEMBERS_SHOWN:
            return "[" + ", ".join(map(str, head)) + "]"
        return f"[{', '.join(map(str, head[:_MAX_MEMBERS_SHOWN - 2]))}, ..., {members['last']}] ({size} ranks)"
    if len(members) <= _MAX_MEMBERS_SHOWN:
        return "[" + ", ".join(map(str, members)) + "]"
    head = ", ".join(map(str, members[:_MAX_MEMBERS_SHOWN - 2]))
    return f"[{head}, ..., {members[-1]}] ({len(members)} ranks)"


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


def _plan_table(plan, data: dict) -> str:
    from .cost import cost_lines
    from .report import MAX_ENUMERATED_RANKS

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
        out.append(f"node locality over a sample of groups (world over {MAX_ENUMERATED_RANKS:,} ranks): "
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


def _plan_csv(data: dict) -> str:
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
            row += ["" if members is None else " ".join(map(str, members)), of_kind.get(k["name"], "")]
        writer.writerow(row)
    return buf.getvalue().rstrip("\n")


def _picture_paths(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The pictures asked for as (path, format), checked before any work: matplotlib, folders."""
    paths = [(path, fmt) for path, fmt in ((args.png, "png"), (args.svg, "svg")) if path]
    if paths:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("pictures need matplotlib: pip install 'hypergrid[viz]'") from None
    for path, fmt in paths:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"--{fmt} {path}: cannot write there, folder {folder} does not exist")
    return paths


def _cmd_plan(args: argparse.Namespace) -> int:
    from .cost import DEFAULT_COMM_MEMORY_MB, max_cost, rank_cost
    from .viz import picture, write_picture

    plan = _plan_from_args(args)
    if plan.world_size > _MAX_WORLD:
        raise UsageError(f"world size {plan.world_size} is too large: plans answer for worlds up to "
                         f"{_MAX_WORLD} ranks (int64)")
    if args.rank is not None:
        plan.check_rank(args.rank)
    for name in args.kinds or []:
        plan.kind(name)  # an unknown kind fails before any work, naming the known ones
    pictures = _picture_paths(args)
    if pictures:
        plan.check_enumerable()  # a picture draws every rank
    data = plan.as_dict(args.gpus_per_node, rank=args.rank, nvlink_domain=args.nvlink_domain,
                        heads=_MAX_MEMBERS_SHOWN if args.format == "table" else None)
    mb = args.comm_memory_mb or DEFAULT_COMM_MEMORY_MB
    mine = None if args.rank is None else rank_cost(
        plan, args.rank, gpus_per_node=args.gpus_per_node, nvlink_domain=args.nvlink_domain, comm_memory_mb=mb)
    data["cost"] = {
        "comm_memory_mb": mb,
        "rank": None if mine is None else mine.as_dict(),
        "max": max_cost(plan, comm_memory_mb=mb).as_dict(),
    }
    if args.format == "json":
        print(json.dumps(data, indent=1))
    elif args.format == "csv":
        print(_plan_csv(data))
    else:
        print(_plan_table(plan, data))
    if pictures:
        pic = picture(plan, args.kinds, args.gpus_per_node, rank=args.rank, nvlink_domain=args.nvlink_domain)
        for path, fmt in pictures:
            try:
                written = write_picture(pic, path, format=fmt)
            except OSError as exc:
                raise UsageError(f"--{fmt} {path}: cannot write it: {exc.strerror or exc}") from None
            # Pictures are announced on stderr so that JSON/CSV on stdout stays parseable.
            kinds = ", ".join(p.name for p in pic.panels)
            print(f"wrote {path} ({written} bytes; one panel each for {kinds})", file=sys.stderr)
    return EXIT_OK


def _cmd_check(args: argparse.Namespace) -> int:
    from .parity import compare_with_megatron

    plan = _plan_from_args(args)
    plan.check_enumerable()
    start = time.perf_counter()
    result = compare_with_megatron(plan)
    elapsed = time.perf_counter() - start
    print(
        f"compared {result.compared} enumerations with megatron-core "
        f"({result.compared_hyper_comm_grid} HyperCommGrid.get_rank_enum, "
        f"{result.compared_rank_generator} RankGenerator.get_ranks) for {plan.world_size} ranks "
        f"in {elapsed:.2f}s"
    )
    if result.not_compared:
        print(f"not compared (megatron-core computes them only inside initialize_model_parallel): "
              f"{', '.join(result.not_compared)}")
    for line in result.differences:
        print(f"DIFFERENCE {line}")
    print("identical to megatron-core" if result.ok else f"{len(result.differences)} differences")
    return EXIT_OK if result.ok else EXIT_FAILED


# ---------------------------------------------------------------------------- demo, bench
def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    config = demo.DemoConfig(
        tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp, order=args.order,
        timeout_s=float(args.timeout), megatron=not args.no_megatron, mesh=not args.no_mesh,
    )
    if args.worker or demo.launched_by_torchrun():
        if args.world_size is not None and args.world_size != int(os.environ.get("WORLD_SIZE", "0")):
            raise UsageError(
                f"--world-size {args.world_size} differs from WORLD_SIZE={os.environ.get('WORLD_SIZE')} "
                f"set by the launcher; leave --world-size out under torchrun"
            )
        config.check(int(os.environ["WORLD_SIZE"]))
        try:
            report = demo.run_rank(config)
        except Exception:  # a failed rank: the whole traceback, for the launcher to show
            traceback.print_exc()
            return EXIT_FAILED
        if report is not None:  # rank 0
            print(demo.format_report(report))
            return EXIT_OK if report.ok else EXIT_FAILED
        return EXIT_OK
    world = args.world_size or demo.DEFAULT_WORLD_SIZE
    config.check(world)
    argv = [sys.executable, "-m", "hypergrid", "demo", "--worker"] + [
        f"--{n}={getattr(args, n)}" for n in ("tp", "pp", "cp", "ep", "etp", "order", "timeout")
    ] + (["--no-megatron"] if args.no_megatron else []) + (["--no-mesh"] if args.no_mesh else [])
    print(f"launching {world} local gloo ranks ...", flush=True)
    outcome = demo.launch(world, argv, timeout_s=float(args.timeout))
    for rank, text in outcome.failures.items():
        print(f"rank {rank} failed:\n{text.rstrip()}", file=sys.stderr)
    print(f"{world} ranks {'finished' if outcome.ok else 'FAILED'} in {outcome.seconds:.1f}s (wall, start-up included)")
    return EXIT_OK if outcome.ok else EXIT_FAILED


def _cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    names = args.names or list(BENCH_SCRIPTS)
    unknown = [n for n in names if n not in BENCH_SCRIPTS]
    if unknown:
        raise UsageError(f"unknown benchmark {unknown[0]!r}; expected one of {list(BENCH_SCRIPTS)}")
    status = EXIT_OK
    for name in names:
        script = args.bench_dir / BENCH_SCRIPTS[name]
        if not script.is_file():
            print(
                f"hypergrid: benchmark {name!r} not found: {script} does not exist (the benchmarks "
                f"ship with the source tree, not the installed package)",
                file=sys.stderr,
            )
            status = EXIT_USAGE
            continue
        print(f"== {name}: {script} {' '.join(extra)}".rstrip(), flush=True)
        # Inherited stdout, unbuffered: the script's own lines are the progress, as they come.
        proc = subprocess.run([sys.executable, "-u", str(script), *extra], check=False)
        if proc.returncode != 0:
            print(f"hypergrid: benchmark {name!r} exited with status {proc.returncode}", file=sys.stderr)
            status = status or EXIT_FAILED
    return status


# ---------------------------------------------------------------------------- entry point
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failed check, 2 bad input).

    Example::

        >>> main(["plan", "--shape", "2,2", "--dims", "tp,dp", "--format", "csv"])  # doctest: +ELLIPSIS
        kind,key,view,megatron_name,groups,size,max_nodes_per_group,intra_node_groups,crosses_nodes,max_nvlink_domains_per_group,placement,locality_exact
        ...
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                            format="%(name)s: %(message)s")
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        if extra and args.command != "bench":
            raise UsageError(f"arguments after -- are only for bench, got {extra}")
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "check":
            return _cmd_check(args)
        if args.command == "demo":
            return _cmd_demo(args)
        return _cmd_bench(args, extra)
    except (UsageError, ValueError, TypeError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"hypergrid: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as exc:
        print(f"hypergrid: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hypergrid: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `hypergrid plan ... | head` closes the pipe early; that is not an error.
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
