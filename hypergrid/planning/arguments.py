"""The layout arguments of ``hypergrid plan`` and ``check``, turned into a :class:`~hypergrid.planning.plan.Plan`.

A layout comes one way of four: Megatron-Core sizes (``--tp``, ``--pp``, ...), a free grid
(``--shape``/``--dims``), a Megatron-LM launch line (``--megatron-args[-file]``) or a torchtitan
job config (``--torchtitan``); given two ways, or with a size missing, the arguments are refused
naming the flags. ``plan`` also chooses the release of Megatron-Core or torchtitan whose groups it
plans (:func:`add_release_args`), and with ``--fail`` the failure whose recovery it shows
(:func:`failure_from_args`). Pure: no torch, no megatron import.

Example::

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_release_args(parser)
    >>> parser.parse_args(["--torchtitan-version", "0.3"]).torchtitan_version
    '0.3'
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import LayoutArgumentError
from ..layout.describe import member_runs
from .plan import Plan, plan_grid, plan_megatron

#: The largest world a plan answers for: what a rank number in an int64 can reach.
MAX_WORLD = (1 << 63) - 1

__all__ = ["Failure", "add_release_args", "failure_from_args", "plan_from_args"]


def add_release_args(parser: argparse.ArgumentParser) -> None:
    """``--megatron-core-version`` and ``--torchtitan-version``: the release a plan follows."""
    from ..megatron.spec.features import MEGATRON_CORE_RELEASES
    from .torchtitan import TorchtitanRelease

    parser.add_argument("--megatron-core-version", choices=list(MEGATRON_CORE_RELEASES),
                        help="the megatron-core release whose groups are planned and counted (default: the "
                             "installed one, read from its source; without one, the newest)")
    parser.add_argument("--torchtitan-version", choices=[r.value for r in TorchtitanRelease],
                        help="with --torchtitan: the torchtitan release whose meshes are planned (default: the "
                             "installed one; without one, the newest)")


def plan_from_args(args: argparse.Namespace, follow_release: bool = False) -> Plan:
    """The plan the layout arguments of ``plan`` or ``check`` give (``args`` as
    :func:`hypergrid.app.cli.build_parser` parses them): Megatron sizes, a free grid, a Megatron-LM
    launch line or a torchtitan job config, one of them. ``follow_release`` (``plan``; ``check``
    keeps the groups every supported megatron-core makes): a Megatron plan follows
    ``--megatron-core-version`` or the installed megatron-core, and says so in ``follows``; a
    torchtitan plan always follows a release (``--torchtitan-version`` or the installed one).
    Two layouts at once, or a size missing, is a :class:`LayoutArgumentError` naming the flags.

    Example::

        >>> args = argparse.Namespace(world_size=16, tp=2, pp=None, cp=None, ep=None, etp=None, dp=None,
        ...                           order=None, shape=None, dims=None, group=[], megatron_args=None,
        ...                           megatron_args_file=None, torchtitan=None, megatron_core_version="0.19")
        >>> plan = plan_from_args(args, follow_release=True)
        >>> plan.megatron.dp, plan.follows.release, plan.kinds[0].name
        (8, '0.19.2', 'gtp_remat')
        >>> plan_from_args(argparse.Namespace(**{**vars(args), "shape": [16], "dims": ["dp"]}))
        Traceback (most recent call last):
        ...
        hypergrid.errors.LayoutArgumentError: --megatron-core-version goes with Megatron sizes or --megatron-args, not another layout
    """
    megatron_given = [n for n in ("tp", "pp", "cp", "ep", "etp", "dp", "order") if getattr(args, n) is not None]
    titan_release, megatron_release = (getattr(args, n, None) for n in ("torchtitan_version", "megatron_core_version"))
    overrides = getattr(args, "parallelism", None) or []  # torchtitan's --parallelism.NAME VALUE flags
    titan = args.torchtitan is not None or bool(overrides)
    if titan_release is not None and not titan:
        raise LayoutArgumentError("--torchtitan-version goes with --torchtitan FILE or --parallelism.* flags")
    if megatron_release is not None and (titan or args.shape is not None):
        raise LayoutArgumentError("--megatron-core-version goes with Megatron sizes or --megatron-args, not another layout")
    if titan:
        from .torchtitan import parallelism_overrides, plan_torchtitan

        others = megatron_given + [n for n in ("shape", "dims") if getattr(args, n) is not None]
        others += [n.replace("_", "-") for n in ("megatron_args", "megatron_args_file") if getattr(args, n) is not None]
        which = "--torchtitan" if args.torchtitan is not None else "--parallelism.*"
        if others or args.group:
            raise LayoutArgumentError(f"{which} and {', '.join('--' + n for n in others or ['group'])} are two ways "
                                      f"to give a layout; use one")
        world, _ = _world_size(args)
        if world is None:
            raise LayoutArgumentError(f"{which} needs --world-size (or WORLD_SIZE=N in front of the command): "
                                      f"torchtitan takes the world size from the launcher")
        source = None if args.torchtitan is None else Path(args.torchtitan)  # a Path: always read as a file
        return plan_torchtitan(source, world, titan_release, overrides=parallelism_overrides(overrides))
    chosen, followed = {}, None
    if follow_release:
        from ..megatron.spec.features import choose_megatron_core

        chosen["features"], followed = choose_megatron_core(megatron_release)
    if args.megatron_args is not None or args.megatron_args_file is not None:
        plan = _plan_from_launch_line(args, megatron_given, chosen)
        plan.follows = followed
        return plan
    if args.shape is not None or args.dims is not None:
        if args.shape is None or args.dims is None:
            raise LayoutArgumentError("a free grid needs both --shape and --dims, e.g. --shape 2,3,4 --dims tp,cp,dp")
        if megatron_given:
            raise LayoutArgumentError(
                f"--shape/--dims and Megatron sizes ({', '.join('--' + n for n in megatron_given)}) "
                f"are two ways to give a layout; use one"
            )
        return plan_grid(args.shape, args.dims, world_size=args.world_size, groups=args.group)
    if args.group:
        raise LayoutArgumentError("--group needs a free grid (--shape and --dims)")
    tp, pp, cp = args.tp or 1, args.pp or 1, args.cp or 1
    world = args.world_size
    if world is None and args.dp is not None:
        world = tp * cp * pp * args.dp  # how Megatron users count their GPUs
    if world is None:
        raise LayoutArgumentError("give --world-size (or --dp) with Megatron sizes, or --shape and --dims for a free grid")
    plan = plan_megatron(world, tp=tp, pp=pp, cp=cp, ep=args.ep or 1, etp=args.etp,
                         order=args.order or "tp-cp-ep-dp-pp", **chosen)
    if args.dp is not None and plan.megatron is not None and plan.megatron.dp != args.dp:
        raise LayoutArgumentError(
            f"--dp {args.dp} does not fit: {world} ranks / (tp {tp} x cp {cp} x pp {pp}) leave a data-parallel "
            f"size of {plan.megatron.dp}; expected --dp {plan.megatron.dp} or --world-size {tp * cp * pp * args.dp}"
        )
    plan.follows = followed
    return plan


def _plan_from_launch_line(args: argparse.Namespace, megatron_given: list[str], chosen: dict) -> Plan:
    from .megatron_args import parse_megatron_args, plan_from_megatron_args

    other = ["--" + n for n in megatron_given] + [
        f"--{n}" for n in ("shape", "dims") if getattr(args, n) is not None] + (["--group"] if args.group else [])
    if args.megatron_args is not None and args.megatron_args_file is not None:
        other.append("--megatron-args-file")
    if other:
        raise LayoutArgumentError(f"--megatron-args{'-file' * (args.megatron_args is None)} and {', '.join(other)} "
                         f"are two ways to give a layout; use one")
    text = args.megatron_args
    if text is None:
        try:
            text = Path(args.megatron_args_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise LayoutArgumentError(f"--megatron-args-file {args.megatron_args_file}: cannot read it: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    launch = parse_megatron_args(text)
    world, world_from = _world_size(args)
    if world is None and launch.world_size is None and launch.launched_world_size is None:
        raise LayoutArgumentError("a Megatron-LM launch line needs --world-size N (Megatron-LM reads it from WORLD_SIZE: "
                                  "WORLD_SIZE=N in front of the command, or a torchrun --nnodes N --nproc-per-node M "
                                  "in front of the launch line, gives it too)")
    plan = plan_from_megatron_args(launch, world_size=world, world_size_from=world_from, **chosen)
    gpus = getattr(args, "gpus_per_node", None)
    if launch.gpus_per_node is not None and gpus is not None and gpus != launch.gpus_per_node:
        raise LayoutArgumentError(f"--gpus-per-node {gpus} differs from the launch line's torchrun --nproc-per-node "
                                  f"{launch.gpus_per_node}; give one")
    if launch.gpus_per_node is not None and hasattr(args, "gpus_per_node"):
        args.gpus_per_node = launch.gpus_per_node  # the launch line's nodes, as torchrun starts them
    return plan


def _world_size(args: argparse.Namespace) -> tuple[Optional[int], Optional[str]]:
    """``--world-size``, else ``WORLD_SIZE`` in the environment (where Megatron-LM and torchtitan
    read it), and how to name it in a message; (None, None) with neither."""
    if args.world_size is not None:
        return args.world_size, f"--world-size {args.world_size}"
    text = os.environ.get("WORLD_SIZE")
    if text is None or not text.strip():
        return None, None
    if not text.strip().isdigit() or int(text) < 1:
        raise LayoutArgumentError(f"WORLD_SIZE={text} in the environment: expected a positive integer (the number "
                                  f"of ranks), or --world-size N")
    if int(text) > MAX_WORLD:
        raise LayoutArgumentError(f"WORLD_SIZE={text} in the environment: world size {int(text)} is too large: plans "
                                  f"answer for worlds up to {MAX_WORLD} ranks (int64)")
    return int(text), f"WORLD_SIZE={int(text)} in the environment"


@dataclass(frozen=True)
class Failure:
    """What ``plan --fail`` plans a recovery from: the failed ranks, the spares in the order they
    are used, and the dim whose replicas a shrink drops.

    Example::

        >>> Failure(failed=(5,), spares=(16, 17), replica_dim="dp").spares
        (16, 17)
    """

    failed: tuple[int, ...]
    spares: tuple[int, ...]
    replica_dim: str


def failure_from_args(args: argparse.Namespace, plan: Plan) -> Optional[Failure]:
    """The :class:`Failure` that ``--fail``, ``--spares`` (N ranks after the grid's last) or
    ``--spare-ranks`` and ``--replica-dim`` give for ``plan``; None without ``--fail``. A value that
    does not fit is a :class:`LayoutArgumentError` naming the flag and what it expects.

    Example::

        >>> args = argparse.Namespace(fail=[5], spares=2, spare_ranks=None, replica_dim=None)
        >>> failure_from_args(args, plan_megatron(16, tp=2))
        Failure(failed=(5,), spares=(16, 17), replica_dim='dp')
        >>> failure_from_args(argparse.Namespace(**{**vars(args), "fail": [5, 16]}), plan_megatron(16, tp=2))
        Traceback (most recent call last):
        ...
        hypergrid.errors.LayoutArgumentError: --fail 5,16: rank 16 is not in the grid, which spans ranks [0, 16); expected ranks of the grid
    """
    from .recovery import spare_ranks_after

    given = [flag for flag, value in (("--spares", args.spares), ("--spare-ranks", args.spare_ranks),
                                      ("--replica-dim", args.replica_dim)) if value is not None]
    if args.fail is None:
        if given:
            raise LayoutArgumentError(f"{given[0]} goes with --fail RANKS (the ranks whose failure is planned)")
        return None
    layout = plan.layout
    span = f"[{layout.rank_offset}, {layout.rank_offset + layout.size})"
    for flag, ranks in (("--fail", args.fail), ("--spare-ranks", args.spare_ranks or [])):
        text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in member_runs(ranks))  # as given: runs as ranges
        twice = sorted(r for r, times in Counter(ranks).items() if times > 1)
        if twice:
            raise LayoutArgumentError(f"{flag} {text}: rank {twice[0]} is given twice; expected distinct ranks")
        wrong = [r for r in ranks if layout.contains(r) != (flag == "--fail")]
        if wrong and flag == "--fail":
            raise LayoutArgumentError(f"{flag} {text}: rank {wrong[0]} is not in the grid, which spans ranks {span}; "
                                      f"expected ranks of the grid")
        if wrong:
            raise LayoutArgumentError(f"{flag} {text}: rank {wrong[0]} is in the grid, which spans ranks {span}; "
                                      f"expected ranks outside it, e.g. {layout.rank_offset + layout.size}")
    spares = args.spare_ranks if args.spare_ranks is not None else spare_ranks_after(layout, args.spares or 0)
    dim = args.replica_dim or "dp"
    if args.replica_dim is not None and args.replica_dim not in layout.dim_names:
        raise LayoutArgumentError(f"--replica-dim {args.replica_dim}: the grid has no such dim; expected one of "
                                  f"{', '.join(layout.dim_names)}")
    if plan.megatron_config is not None and dim != "dp":
        raise LayoutArgumentError(f"--replica-dim {dim}: a Megatron layout's replicas are along dp; expected dp")
    return Failure(tuple(args.fail), tuple(spares), dim)
