"""The ``hypergrid`` command line: plan, check, demo, bench.

Only argument handling and printing live here; the work is done by :mod:`hypergrid.planning.plan`
(plans), :mod:`hypergrid.planning.viz` (pictures), :mod:`hypergrid.planning.parity` (comparison with
Megatron-Core), :mod:`hypergrid.app.demo` (the gloo demo) and the scripts in ``benchmarks/``.

Bad input prints one line, ``hypergrid: error: ...``, and exits with status 2; output that cannot
be written (a full disk) one such line and status 1 (:mod:`hypergrid.app.console`).

Example::

    $ python -m hypergrid plan --world-size 1024 --tp 8 --pp 4 --ep 16 --etp 1 --rank 1000
    $ python -m hypergrid plan --world-size 128 --tp 8 --pp 4 --rank 37 --png plan.png  # needs matplotlib
    $ python -m hypergrid check --world-size 1024 --tp 8 --pp 4 --ep 16 --etp 1
    $ python -m hypergrid demo
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from ..errors import UsageError
from ..planning.parity import FULL_COMPARISON_RANKS, SAMPLED_GROUPS
from ..planning.plan import MAX_LISTED_WORLD
from . import argtypes
from .console import OutputError, Progress, drop_stdout, out
from .store import add_store_parser, run_store

__all__ = ["main", "build_parser"]

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: Where ``bench`` looks for benchmark scripts: the repository's ``benchmarks/`` folder.
BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
BENCH_SCRIPTS = {"grid": "bench_grid.py", "megatron": "bench_megatron.py", "plan": "bench_plan.py"}

# The largest world a plan answers for: what a rank number in an int64 can reach.
_MAX_WORLD = argtypes.MAX_WORLD
DEFAULT_GPUS_PER_NODE = 8


class _Parser(argparse.ArgumentParser):
    commands: dict[str, argparse.ArgumentParser]  # the top parser's subcommands, by name

    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints the whole usage block; one line says what is wrong and where to look.
        raise UsageError(f"{message} (see: {self.prog} --help)")

    def print_help(self, file: Any = None) -> None:
        # argparse drops a failed write; --help on a full disk is an error like any other output.
        if file is not None and file is not sys.stdout:
            return super().print_help(file)
        out(self.format_help(), end="")


# ---------------------------------------------------------------------------- arguments
_int_list, _name_list, _order, _positive = argtypes.int_list, argtypes.name_list, argtypes.order, argtypes.positive
_non_negative, _count, _rank_list = argtypes.non_negative, argtypes.count, argtypes.rank_list


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-Core sizes (dp and expert dp take what is left)")
    g.add_argument("--world-size", "-n", type=argtypes.world_size, help="number of ranks")
    g.add_argument("--tp", type=_positive, help="tensor-parallel size (default 1)")
    g.add_argument("--pp", type=_positive, help="pipeline-parallel size (default 1)")
    g.add_argument("--cp", type=_positive, help="context-parallel size (default 1)")
    g.add_argument("--ep", type=_positive, help="expert-parallel size (default 1)")
    g.add_argument("--etp", type=_positive, help="expert tensor-parallel size (default: --tp)")
    g.add_argument("--dp", type=_positive,
                   help="data-parallel size: checked against what the world leaves; without --world-size, "
                        "the world is tp x cp x pp x dp")
    g.add_argument("--order", type=_order, help="Megatron order, first dim fastest (default tp-cp-ep-dp-pp)")
    f = p.add_argument_group("or a free grid")
    f.add_argument("--shape", type=_int_list, help="sizes, e.g. 2,3,4")
    f.add_argument("--dims", type=_name_list, help="dim names, first fastest, e.g. tp,cp,dp")
    f.add_argument(
        "--group", action="append", type=_name_list, default=[], metavar="DIMS",
        help="also a group over several dims, e.g. --group cp,dp (repeatable)",
    )
    m = p.add_argument_group("or a Megatron-LM launch line (its world: --world-size, WORLD_SIZE=N, or its torchrun's "
                             "--nnodes x --nproc-per-node)")
    m.add_argument("--megatron-args", metavar="FLAGS",
                   help="Megatron-LM's flags in one string, e.g. \"--tensor-model-parallel-size 8 ...\" "
                        "(one flag alone: --megatron-args=--use-sharp)")
    m.add_argument("--megatron-args-file", metavar="FILE",
                   help="a file of Megatron-LM flags (lines, backslash continuations, # comments)")
    t = p.add_argument_group("or a torchtitan job config (with --world-size), and torchtitan's own "
                             "--parallelism.NAME VALUE flags over it (or over its defaults)")
    t.add_argument("--torchtitan", metavar="FILE",
                   help="a torchtitan TOML job config: its [parallelism] degrees, with --world-size")


def _plan_from_args(args: argparse.Namespace, follow_release: bool = False):
    from ..planning.arguments import plan_from_args

    return plan_from_args(args, follow_release)


def build_parser() -> _Parser:
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
    from ..planning.arguments import add_release_args

    add_release_args(p)
    p.add_argument("--gpus-per-node", type=_positive, default=None,
                   help="ranks per node (default: a launch line's torchrun --nproc-per-node, else 8)")
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
                   help="the group kinds shown (table, JSON, CSV) and drawn, one panel each, e.g. tp,dp (default: "
                        "every kind; drawn: tp, cp, dp, pp, ep, ... that have groups of more than one rank)")
    p.add_argument("--nvlink-domain", type=_positive, metavar="GPUS",
                   help="GPUs per NVLink domain (consecutive ranks; e.g. 72 for an NVL72 rack of 18 "
                        "nodes of 4): placement column and picture (default: --gpus-per-node)")
    r = p.add_argument_group("a recovery: what a failure would rebuild (a table or --json)")
    r.add_argument("--fail", type=_rank_list, metavar="RANKS",
                   help="ranks of the grid that fail, e.g. 5, 8,9,10,11 or 8-11: how the grid recovers (spares take "
                        "their places, else whole replicas are dropped) and, per kind, the groups kept, rebuilt "
                        "and dropped")
    spares = r.add_mutually_exclusive_group()
    spares.add_argument("--spares", type=_count, metavar="N",
                        help="N spare ranks, numbered after the grid's last rank (default 0)")
    spares.add_argument("--spare-ranks", type=_rank_list, metavar="RANKS",
                        help="the spare ranks themselves, outside the grid, in the order they are used, e.g. 16,17 or 16-23")
    r.add_argument("--replica-dim", metavar="DIM",
                   help="the dim whose replicas a shrink drops (default dp; a Megatron layout's is dp)")

    c = sub.add_parser("check", help="compare every enumeration with megatron-core's")
    _add_layout_args(c)
    how = c.add_mutually_exclusive_group()
    how.add_argument("--sample", action="store_true",
                     help="compare Megatron-Core's RankGenerator groups on a sample of groups (default for "
                          f"worlds over {FULL_COMPARISON_RANKS} ranks)")
    how.add_argument("--full", action="store_true",
                     help=f"compare every group, however large the world (up to {MAX_LISTED_WORLD} ranks)")
    c.add_argument("--seed", type=_non_negative, default=0, help="random seed of the sample (default 0)")
    c.add_argument("--groups", type=_positive, default=SAMPLED_GROUPS,
                   help=f"groups compared per kind when sampling, at most (default {SAMPLED_GROUPS})")

    d = sub.add_parser("demo", help="build and verify real groups on local gloo ranks (or under torchrun)")
    d.add_argument("--world-size", "-n", type=_positive, default=None, help="local ranks to launch (default 8)")
    sizes = d.add_argument_group(
        "sizes (none given: tp 2, pp 2, ep 2, expert tp 1; any given: the others are 1, expert tp follows --tp)"
    )
    for name in ("tp", "pp", "cp", "ep", "etp"):
        sizes.add_argument(f"--{name}", type=_positive, default=None)
    d.add_argument("--order", type=_order, default="tp-cp-ep-dp-pp")
    d.add_argument("--timeout", type=_positive, default=120, help="seconds for the whole run (default 120)")
    d.add_argument("--no-megatron", action="store_true", help="skip Megatron parallel_state even if available")
    d.add_argument("--no-mesh", action="store_true", help="skip the DeviceMesh even if available")
    d.add_argument("--ignore-machine-limit", action="store_true",
                   help="launch even more ranks than this machine's CPUs and memory can run (see docs/cli.md)")
    d.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)

    b = sub.add_parser(
        "bench", help="run the scale benchmarks in benchmarks/ (arguments after -- go to the scripts)"
    )
    b.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCH_SCRIPTS)} (default all)")
    b.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help=argparse.SUPPRESS)
    s = add_store_parser(sub)  # python -m hypergrid store: hypergrid.app.store
    parser.commands = {"plan": p, "check": c, "demo": d, "bench": b, "store": s}
    return parser


# ---------------------------------------------------------------------------- plan
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
    from ..planning.arguments import failure_from_args
    from ..planning.cost import DEFAULT_COMM_MEMORY_MB, max_cost, rank_cost
    from ..planning.text import only_kinds, plan_csv, plan_table
    from ..planning.viz import picture, write_picture

    plan = _plan_from_args(args, follow_release=True)  # a launch line's torchrun may set --gpus-per-node
    args.gpus_per_node = args.gpus_per_node or DEFAULT_GPUS_PER_NODE
    if plan.world_size > _MAX_WORLD:
        raise UsageError(f"world size {plan.world_size} is too large: plans answer for worlds up to "
                         f"{_MAX_WORLD} ranks (int64)")
    failure = failure_from_args(args, plan)
    if failure is not None:
        return _cmd_recovery(args, plan, failure)
    if args.rank is not None:
        plan.check_rank(args.rank)
    for name in args.kinds or []:
        plan.kind(name)  # an unknown kind fails before any work, naming the known ones
    pictures = _picture_paths(args)
    # --rank's groups listed in full up to LISTED_MEMBERS ranks, in every format: the table shows
    # whole runs of them (a group's first 16 members alone could cut a run short).
    data = plan.as_dict(args.gpus_per_node, rank=args.rank, nvlink_domain=args.nvlink_domain)
    mb = args.comm_memory_mb or DEFAULT_COMM_MEMORY_MB
    mine = None if args.rank is None else rank_cost(
        plan, args.rank, gpus_per_node=args.gpus_per_node, nvlink_domain=args.nvlink_domain, comm_memory_mb=mb)
    data["cost"] = {
        "anchor": plan.anchor.value,
        "follows": None if plan.follows is None else plan.follows.as_dict(),
        "comm_memory_mb": mb,
        "rank": None if mine is None else mine.as_dict(),
        "max": max_cost(plan, comm_memory_mb=mb).as_dict(),
    }
    if args.kinds:  # the kinds shown, in every format, as in the picture
        data = only_kinds(data, args.kinds)
    if args.format == "json":
        out(json.dumps(data, indent=1))
    elif args.format == "csv":
        out(plan_csv(data))
    else:
        out(plan_table(plan, data))
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


def _cmd_recovery(args: argparse.Namespace, plan, failure) -> int:
    from ..planning.recovery import recovery_of
    from ..planning.text import recovery_table

    others = {"--csv": args.format == "csv", "--png": args.png, "--svg": args.svg, "--kind": args.kinds,
              "--comm-memory-mb": args.comm_memory_mb, "--nvlink-domain": args.nvlink_domain}
    for flag, given in others.items():
        if given:
            raise UsageError(f"--fail shows a recovery as a table or --json; {flag} goes with a plan alone")
    if args.rank is not None and not plan.layout.contains(args.rank) and args.rank not in failure.spares:
        raise UsageError(f"--rank {args.rank} is neither in the grid (ranks [{plan.layout.rank_offset}, "
                         f"{plan.layout.rank_offset + plan.layout.size})) nor a spare; expected one of them")
    report = recovery_of(plan, failure.failed, failure.spares, replica_dim=failure.replica_dim,
                         gpus_per_node=args.gpus_per_node)
    data = report.as_dict(args.gpus_per_node, rank=args.rank)
    out(json.dumps(data, indent=1) if args.format == "json" else recovery_table(data))
    return EXIT_OK


def _cmd_check(args: argparse.Namespace) -> int:
    from ..planning.parity import compare_with_megatron

    plan = _plan_from_args(args)
    sample = True if args.sample else False if args.full else None
    titan_ok = None
    if args.torchtitan is not None or getattr(args, "parallelism", None):
        # torchtitan's own meshes first: what a torchtitan user checks; then the grid's enumerations.
        from ..planning.torchtitan import parallelism_overrides
        from .torchtitan_parity import compare_with_torchtitan

        titan = compare_with_torchtitan(None if args.torchtitan is None else Path(args.torchtitan), plan.world_size,
                                        overrides=parallelism_overrides(args.parallelism or []),
                                        full=None if sample is None else not sample, seed=args.seed)
        for line in titan.lines():
            out(line)
        titan_ok = titan.ok
        if importlib.util.find_spec("megatron.core") is None:
            out("not compared with megatron-core's enumerations: megatron-core is not installed")
            return EXIT_OK if titan_ok else EXIT_FAILED
    start = time.perf_counter()
    progress = Progress("comparing")
    result = compare_with_megatron(plan, progress=progress, sample=sample, seed=args.seed,
                                   groups_per_kind=args.groups)
    progress.done()
    elapsed = time.perf_counter() - start
    generator = (f"{result.compared_rank_generator} RankGenerator.get_ranks on a sample of "
                 f"{result.sampled_groups} groups" if result.sampled else
                 f"{result.compared_rank_generator} RankGenerator.get_ranks")
    out(
        f"compared {result.compared} enumerations with megatron-core "
        f"({result.compared_hyper_comm_grid} HyperCommGrid.get_rank_enum, {generator}) "
        f"for {plan.world_size} ranks in {elapsed:.2f}s"
    )
    if result.sampled:
        out(f"sampled (seed {result.seed}): per kind, the groups of the first and last rank, of each "
              f"pipeline stage's first rank and of random ranks, up to {args.groups}, computed by "
              f"Megatron-Core's generate_masked_orthogonal_rank_groups for those groups only; "
              + ("--full compares every group" if plan.world_size <= MAX_LISTED_WORLD else
                 f"worlds over {MAX_LISTED_WORLD} ranks are too large to compare in full"))
    for skipped in result.not_compared:
        out(f"not compared: {skipped}")
    for line in result.differences:
        out(f"DIFFERENCE {line}")
    out("identical to megatron-core" if result.ok else f"{len(result.differences)} differences")
    return EXIT_OK if result.ok and titan_ok is not False else EXIT_FAILED


# ---------------------------------------------------------------------------- demo, bench
def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    given = {n: getattr(args, n) for n in ("tp", "pp", "cp", "ep", "etp") if getattr(args, n) is not None}
    # The showcase layout only when no size is given: a user who sets --tp 4 on 6 ranks should
    # not be told about a pipeline size of 2 they never asked for.
    sizes = given if not given else {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": None, **given}
    config = demo.DemoConfig(
        **sizes, order=args.order, timeout_s=float(args.timeout), megatron=not args.no_megatron, mesh=not args.no_mesh,
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
            out(demo.format_report(report))
            return EXIT_OK if report.ok else EXIT_FAILED
        return EXIT_OK
    world = args.world_size or demo.DEFAULT_WORLD_SIZE
    config.check(world)
    if not args.ignore_machine_limit:
        demo.machine_limit(world, float(args.timeout))  # before any process starts, in well under a second
    argv = [sys.executable, "-m", "hypergrid", "demo", "--worker", f"--order={config.order}", f"--timeout={args.timeout}"]
    argv += [f"--{n}={getattr(config, n)}" for n in ("tp", "pp", "cp", "ep", "etp") if getattr(config, n) is not None]
    argv += (["--no-megatron"] if args.no_megatron else []) + (["--no-mesh"] if args.no_mesh else [])
    out(f"launching {world} local gloo ranks ...")
    outcome = demo.launch(world, argv, timeout_s=float(args.timeout))
    for line in demo.describe_failures(outcome.failures):
        print(line, file=sys.stderr)
    out(f"{world} ranks {'finished' if outcome.ok else 'FAILED'} in {outcome.seconds:.1f}s (wall, start-up included)")
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
        out(f"== {name}: {script} {' '.join(extra)}".rstrip())
        # Inherited stdout, unbuffered: the script's own lines are the progress, as they come.
        proc = subprocess.run([sys.executable, "-u", str(script), *extra], check=False)
        if proc.returncode != 0:
            print(f"hypergrid: benchmark {name!r} exited with status {proc.returncode}", file=sys.stderr)
            status = status or EXIT_FAILED
    return status


# ---------------------------------------------------------------------------- entry point
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failed check or unwritable output,
    2 bad input, 128 + N after signal N stopped a demo).

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
        try:
            args, unknown = parser.parse_known_args(argv)
        except SystemExit:
            out()
            raise
        if args.command in ("plan", "check"):  # torchtitan's own flags: --parallelism.NAME VALUE
            args.parallelism, unknown = argtypes.torchtitan_flags(unknown)
        if unknown:
            # Told by the subcommand, whose --help lists what it takes (argparse blames the top), with
            # the closest of its flags to a misspelt one.
            where = f"hypergrid {args.command}" if args.command else "hypergrid"
            taken = parser.commands.get(args.command, parser)
            options = [o for p in (taken, parser) for action in p._actions for o in action.option_strings]
            raise UsageError(argtypes.unrecognized(unknown, options, where))
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
        if args.command == "store":
            return run_store(args)
        return _cmd_bench(args, extra)
    except (UsageError, ValueError, TypeError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"hypergrid: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as exc:
        print(f"hypergrid: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        # The demo's launcher has killed its ranks by now (hypergrid.app.launcher.LaunchInterrupted).
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"hypergrid: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except OutputError as exc:
        drop_stdout()
        print(f"hypergrid: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        # `hypergrid plan ... | head` closes the pipe early; that is not an error.
        drop_stdout()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
