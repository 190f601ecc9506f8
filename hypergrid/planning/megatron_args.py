"""A plan from a Megatron-LM launch line: ``--tensor-model-parallel-size 8 --pipeline-... ...``.

Pure Python: no torch, no megatron import. :func:`parse_megatron_args` reads the flags of a
Megatron-LM training launch line (a string as a shell splits it, or an argv list) into a
:class:`MegatronLaunch`: the parallelism sizes under Megatron-LM's own flag names and defaults,
the virtual pipeline size derived the way Megatron-LM's ``validate_args`` derives it, and the
order ``--use-tp-pp-dp-mapping`` selects. :func:`plan_from_megatron_args` turns it into the same
:class:`~hypergrid.planning.plan.Plan` that :func:`hypergrid.planning.plan.plan_megatron` returns for those sizes.

A launch line has hundreds of flags. Those that do not change the groups (``--num-layers``,
``--hidden-size``, ``--lr``, ...) are accepted and set aside in :attr:`MegatronLaunch.ignored`; a
flag Megatron-LM does not have (:data:`~hypergrid.planning.megatron_flags.MEGATRON_LM_FLAGS`) is
refused. Every bad input raises :class:`MegatronArgsError` (a ``ValueError``) naming the flag.

Example::

    >>> launch = parse_megatron_args(
    ...     "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --num-layers 32 "
    ...     "--num-layers-per-virtual-pipeline-stage 2 --hidden-size 4096 --bf16")
    >>> launch.tensor_model_parallel_size, launch.virtual_pipeline_model_parallel_size, launch.order
    (2, 4, 'tp-cp-ep-dp-pp')
    >>> launch.ignored
    ('hidden-size', 'bf16')
    >>> plan_from_megatron_args(launch, world_size=64).megatron.dp
    8
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..errors import MegatronArgsError, UnknownMegatronFlagError
from ..layout.checks import int_at_least
from ..megatron.spec.features import MegatronFeatures
from .megatron_flags import MEGATRON_LM_FLAGS, MEGATRON_LM_RELEASES
from .megatron_pipeline import virtual_pipeline_size

__all__ = [
    "MegatronLaunch",
    "launch_world_size",
    "parse_megatron_args",
    "plan_from_megatron_args",
]

_RELEASES = f"{MEGATRON_LM_RELEASES[0]} to {MEGATRON_LM_RELEASES[-1]}"

#: Flags read as integers, with their minimum (0 for the uneven first and last stages: megatron_pipeline
#: refuses it in Megatron-Core's words).
_INT_FLAGS = {
    "tensor-model-parallel-size": 1,
    "pipeline-model-parallel-size": 1,
    "context-parallel-size": 1,
    "expert-model-parallel-size": 1,
    "expert-tensor-parallel-size": 1,
    "num-distributed-optimizer-instances": 1,
    "num-layers-per-virtual-pipeline-stage": 1,
    "num-virtual-stages-per-pipeline-rank": 1,
    "num-layers": 1,
    "decoder-num-layers": 1,
    "decoder-first-pipeline-num-layers": 0,
    "global-batch-size": 1,
    "micro-batch-size": 1,
    "decoder-last-pipeline-num-layers": 0,
}
#: Flags taking one or more integers (Megatron-LM's ``nargs='+'``).
_INT_LIST_FLAGS = {"hierarchical-context-parallel-sizes"}
#: Switches (``store_true``, or ``store_false`` for the ``--no-...`` one): they take no value.
_SWITCHES = {
    "use-sharp",
    "hybrid-context-parallel",
    "use-tp-pp-dp-mapping",
    "account-for-embedding-in-pipeline-split",
    "account-for-loss-in-pipeline-split",
    "no-overlap-p2p-communication",
}
#: Flags taking one word, with the choices Megatron-LM allows (None: any).
_WORD_FLAGS: dict[str, Optional[tuple[str, ...]]] = {
    "sharp-enabled-group": ("dp", "dp_replica"),
    "pipeline-model-parallel-layout": None,
}
#: Flags Megatron-LM still parses but refuses in ``validate_args``, with its advice.
_REFUSED = {"model-parallel-size": "is no longer valid in Megatron-LM, use --tensor-model-parallel-size instead"}
#: Megatron-Core keyword -> the Megatron-LM flag that sets it, for messages.
_KEYWORD_FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "hierarchical_context_parallel_sizes": "--hierarchical-context-parallel-sizes",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
    "num_distributed_optimizer_instances": "--num-distributed-optimizer-instances",
    "use_sharp": "--use-sharp",
    "sharp_enabled_group": "--sharp-enabled-group",
    "hybrid_context_parallel": "--hybrid-context-parallel",
    "virtual_pipeline_model_parallel_size": "the virtual pipeline size",
    "data_parallel_size": "the data-parallel size",
    "expert_data_parallel_size": "the expert data-parallel size",
}
# A launcher's environment assignment before the command, e.g. ``WORLD_SIZE=1024``.
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# torchrun's options that size the launched world, both spellings, -> MegatronLaunch's fields.
_TORCHRUN_SIZES = {"--nnodes": "nodes", "--nproc-per-node": "gpus_per_node", "--nproc_per_node": "gpus_per_node"}


@dataclass(frozen=True)
class MegatronLaunch:
    """The parallelism of a Megatron-LM launch line, under Megatron-LM's names and defaults.

    ``virtual_pipeline_model_parallel_size`` is derived as Megatron-LM derives it (None for no
    interleaving); ``world_size`` is the ``WORLD_SIZE=N`` assignment before the command, if any
    (Megatron-LM reads it from the environment); ``nodes`` and ``gpus_per_node`` are a torchrun
    launcher's ``--nnodes`` and ``--nproc-per-node`` in front (torchrun's defaults, 1 and 1, where
    it gives none; None where they are not plain numbers: ``$NNODES``, an elastic ``1:4``, ``gpu``).
    ``ignored`` names the flags given that have no say in the groups, in the order given
    (``--num-layers`` is read: it sets the interleaving).

    Example::

        >>> launch = parse_megatron_args(["--expert-model-parallel-size", "8", "--use-tp-pp-dp-mapping"])
        >>> launch.order, launch.expert_tensor_parallel_size
        ('tp-cp-ep-pp-dp', None)
        >>> launch.megatron_kwargs()
        {'tp': 1, 'pp': 1, 'cp': 1, 'ep': 8, 'etp': None, 'order': 'tp-cp-ep-pp-dp'}
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: Optional[tuple[int, ...]] = None
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_distributed_optimizer_instances: int = 1
    use_sharp: bool = False
    sharp_enabled_group: Optional[str] = None
    use_tp_pp_dp_mapping: bool = False
    world_size: Optional[int] = None
    ignored: tuple[str, ...] = ()
    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    global_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None

    @property
    def launched_world_size(self) -> Optional[int]:
        """The ranks the launcher in front starts: torchrun's ``--nnodes`` x ``--nproc-per-node``
        (None where the line has no launcher, or one whose sizes are not plain numbers).

        Example::

            >>> parse_megatron_args("torchrun --nnodes 128 --nproc-per-node 8 pretrain_gpt.py --bf16").launched_world_size
            1024
        """
        return None if self.nodes is None or self.gpus_per_node is None else self.nodes * self.gpus_per_node

    @property
    def order(self) -> str:
        """Megatron-Core's ``order``: Megatron-LM passes ``tp-cp-ep-pp-dp`` under ``--use-tp-pp-dp-mapping``."""
        return "tp-cp-ep-pp-dp" if self.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"

    def megatron_kwargs(self) -> dict[str, Any]:
        """The keywords of :func:`hypergrid.planning.plan.plan_megatron` for this launch (defaults left out).

        Example::

            >>> parse_megatron_args("--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2"
            ...                     ).megatron_kwargs()["hierarchical_context_parallel_sizes"]
            [2, 2]
        """
        kwargs: dict[str, Any] = {
            "tp": self.tensor_model_parallel_size, "pp": self.pipeline_model_parallel_size,
            "cp": self.context_parallel_size, "ep": self.expert_model_parallel_size,
            "etp": self.expert_tensor_parallel_size, "order": self.order,
        }
        optional = {
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
            "hierarchical_context_parallel_sizes": (
                None if self.hierarchical_context_parallel_sizes is None
                else list(self.hierarchical_context_parallel_sizes)
            ),
            "hybrid_context_parallel": self.hybrid_context_parallel or None,
            "num_distributed_optimizer_instances": (
                self.num_distributed_optimizer_instances if self.num_distributed_optimizer_instances != 1 else None
            ),
            "use_sharp": self.use_sharp or None,
            "sharp_enabled_group": self.sharp_enabled_group,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs


def _split(text: str) -> list[str]:
    # Backslash continuations join lines; ``#`` starts a comment to the end of its line.
    joined = re.sub(r"\\\r?\n", " ", text)
    try:
        return shlex.split(joined, comments=True)
    except ValueError as exc:  # an unclosed quote
        raise MegatronArgsError(f"cannot split the launch line as a shell would: {exc}") from None


def _unknown(flag: str) -> UnknownMegatronFlagError:
    name = flag[2:]
    if name in ("world-size", "world_size"):
        hint = ("; Megatron-LM reads the world size from the WORLD_SIZE environment variable: give it "
                "separately (world_size=..., hypergrid plan --world-size N)")
    else:
        close = difflib.get_close_matches(name, MEGATRON_LM_FLAGS, n=1)
        hint = f"; did you mean --{close[0]}?" if close else ""
    return UnknownMegatronFlagError(f"{flag} is not a Megatron-LM flag ({_RELEASES}){hint}", flag)


def _int(flag: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise MegatronArgsError(f"{flag} expects an integer, got {text!r}", flag) from None
    return int_at_least(value, flag, minimum, lambda message: MegatronArgsError(message, flag))


def _convert(name: str, values: list[str]) -> Any:
    flag = f"--{name}"
    if name in _SWITCHES:
        if values:
            raise MegatronArgsError(f"{flag} is a switch and takes no value, got {' '.join(values)!r}", flag)
        return True
    if name in _INT_LIST_FLAGS:
        if not values:
            raise MegatronArgsError(f"{flag} expects one or more integers, got none", flag)
        return tuple(_int(flag, v, 1) for v in values)
    if len(values) != 1:
        got = "none" if not values else repr(" ".join(values))
        raise MegatronArgsError(f"{flag} expects one value, got {got}", flag)
    if name in _INT_FLAGS:
        return _int(flag, values[0], _INT_FLAGS[name])
    choices = _WORD_FLAGS[name]
    if choices is not None and values[0] not in choices:
        raise MegatronArgsError(f"{flag} must be one of {list(choices)}, got {values[0]!r}", flag)
    return values[0]


def _strip_launcher(tokens: list[str]) -> tuple[list[str], dict[str, Optional[int]]]:
    """Drop ``NAME=value`` assignments and a launcher (``torchrun ... pretrain_gpt.py``) before the
    flags; what they say of the world: ``WORLD_SIZE``, torchrun's nodes and processes per node."""
    found: dict[str, Optional[int]] = {}
    while tokens and _ASSIGNMENT.match(tokens[0]):
        name, _, value = tokens.pop(0).partition("=")
        if name == "WORLD_SIZE":
            found["world_size"] = _int("WORLD_SIZE", value, 1)
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py") and not t.startswith("-")), None)
    if script is None:
        return tokens, found
    return tokens[script + 1:], {**found, **_torchrun_sizes(tokens[:script])}


def _torchrun_sizes(launcher: list[str]) -> dict[str, Optional[int]]:
    """torchrun's ``--nnodes`` and ``--nproc-per-node`` (either spelling, ``--flag N`` or
    ``--flag=N``), with torchrun's defaults of 1 where the launcher is torchrun and gives none."""
    if not any(t.rsplit("/", 1)[-1] == "torchrun" or t in ("torch.distributed.run", "torch.distributed.launch")
               for t in launcher):
        return {}
    values: dict[str, str] = {}
    for i, token in enumerate(launcher):
        name, equals, value = token.partition("=")
        key = _TORCHRUN_SIZES.get(name)
        if key is not None:
            values[key] = value if equals else (launcher[i + 1] if i + 1 < len(launcher) else "")
    # A shell variable ($DISTRIBUTED_ARGS) may hold either: then an absent one is not known either.
    unknown = any("$" in t or "`" in t for t in launcher)
    sizes: dict[str, Optional[int]] = {}
    for key in ("nodes", "gpus_per_node"):
        text = values.get(key, None if unknown else "1")
        sizes[key] = int(text) if text is not None and text.isdigit() and int(text) > 0 else None
    return sizes


def _read_flags(tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
    given: dict[str, Any] = {}
    ignored: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise MegatronArgsError(
                f"unexpected {token!r}: a Megatron-LM launch line is flags, --name or --name value", None
            )
        name, equals, inline = token[2:].partition("=")
        values = [inline] if equals else []
        i += 1
        while not equals and i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])  # values never start with --; negative numbers do not either
            i += 1
        if name not in MEGATRON_LM_FLAGS:
            raise _unknown(f"--{name}")
        if name in _REFUSED:
            raise MegatronArgsError(f"--{name} {_REFUSED[name]}", f"--{name}")
        if name not in _INT_FLAGS and name not in _INT_LIST_FLAGS and name not in _SWITCHES and name not in _WORD_FLAGS:
            ignored.append(name)
            continue
        value = _convert(name, values)
        if name in given and given[name] != value:
            raise MegatronArgsError(
                f"--{name} is given twice with different values ({given[name]!r} and {value!r})", f"--{name}"
            )
        given[name] = value
    return given, ignored


def parse_megatron_args(text_or_argv: Union[str, Sequence[str]]) -> MegatronLaunch:
    """The parallelism of a Megatron-LM launch line (a string, split as a shell would, or an argv list).

    Flags are Megatron-LM's (``--name value`` or ``--name=value``); flags that do not change the
    groups are accepted and listed in ``ignored``. A string may hold several lines with backslash
    continuations and ``#`` comments; leading ``NAME=value`` assignments (``WORLD_SIZE`` is read)
    and a launcher up to the script (``torchrun ... pretrain_gpt.py``) are skipped. Raises
    :class:`MegatronArgsError` naming the flag: an unknown flag, a malformed value, a value given
    twice differently, a virtual pipeline size Megatron-LM would refuse.

    Example::

        >>> launch = parse_megatron_args('''
        ...     WORLD_SIZE=128 torchrun --nproc-per-node 8 pretrain_gpt.py \\\\
        ...     --tensor-model-parallel-size 4 --context-parallel-size=2  # long sequences
        ...     --lr 3e-4 --adam-eps -1e-8
        ... ''')
        >>> launch.world_size, launch.tensor_model_parallel_size, launch.context_parallel_size, launch.ignored
        (128, 4, 2, ('lr', 'adam-eps'))
        >>> parse_megatron_args("--tensor-parallel-size 8")
        Traceback (most recent call last):
        ...
        hypergrid.errors.UnknownMegatronFlagError: --tensor-parallel-size is not a Megatron-LM flag (core_v0.16.1 to core_v0.19.0); did you mean --tensor-model-parallel-size?
    """
    if isinstance(text_or_argv, str):
        tokens = _split(text_or_argv)
    elif isinstance(text_or_argv, Sequence) and all(isinstance(t, str) for t in text_or_argv):
        tokens = list(text_or_argv)
    else:
        raise TypeError(f"expected a launch line (str) or a list of str, got {type(text_or_argv).__name__}")
    tokens, launcher = _strip_launcher(tokens)
    given, ignored = _read_flags(tokens)
    vpp = virtual_pipeline_size(given)
    return MegatronLaunch(
        tensor_model_parallel_size=given.get("tensor-model-parallel-size", 1),
        pipeline_model_parallel_size=given.get("pipeline-model-parallel-size", 1),
        context_parallel_size=given.get("context-parallel-size", 1),
        hierarchical_context_parallel_sizes=given.get("hierarchical-context-parallel-sizes"),
        hybrid_context_parallel=given.get("hybrid-context-parallel", False),
        expert_model_parallel_size=given.get("expert-model-parallel-size", 1),
        expert_tensor_parallel_size=given.get("expert-tensor-parallel-size"),
        virtual_pipeline_model_parallel_size=vpp,
        num_distributed_optimizer_instances=given.get("num-distributed-optimizer-instances", 1),
        use_sharp=given.get("use-sharp", False),
        sharp_enabled_group=given.get("sharp-enabled-group"),
        use_tp_pp_dp_mapping=given.get("use-tp-pp-dp-mapping", False),
        global_batch_size=given.get("global-batch-size"),
        micro_batch_size=given.get("micro-batch-size"),
        ignored=tuple(ignored),
        **launcher,
    )


def _with_flag_names(message: str, launch: MegatronLaunch, world: int) -> tuple[str, Optional[str]]:
    """Megatron-Core's keyword names in ``message`` replaced by Megatron-LM's flags, and the flag at fault.

    The flag at fault is the first one named whose size does not divide the world, else the first
    one the launch line set to more than the default (a size of 1 divides everything), else the
    first one named.
    """
    found: list[tuple[int, str]] = []

    def replace(match: re.Match) -> str:
        found.append((match.start(), match.group(0)))
        return _KEYWORD_FLAGS[match.group(0)]

    pattern = r"\b(" + "|".join(sorted(_KEYWORD_FLAGS, key=len, reverse=True)) + r")\b"
    text = re.sub(pattern, replace, message).replace("world_size", "world size")
    named = [k for _, k in sorted(found) if _KEYWORD_FLAGS[k].startswith("--")]
    defaults = MegatronLaunch()
    culprits = [k for k in named if getattr(launch, k) != getattr(defaults, k) and getattr(launch, k) not in (1, None)]
    misfits = [k for k in culprits if isinstance(getattr(launch, k), int) and world % getattr(launch, k)]
    chosen = next(iter(misfits or culprits or named), None)
    return text, None if chosen is None else _KEYWORD_FLAGS[chosen]


def launch_world_size(launch: MegatronLaunch, world_size: Optional[int] = None,
                      world_size_from: Optional[str] = None) -> int:
    """The world size of a launch: ``world_size`` (called ``world_size_from`` in messages), the
    line's ``WORLD_SIZE=N`` and its torchrun's nodes x processes per node, whichever are known,
    which must agree. None known is a :class:`MegatronArgsError` saying where to give one.

    Example::

        >>> launch = parse_megatron_args("torchrun --nnodes 128 --nproc-per-node 8 pretrain_gpt.py")
        >>> launch_world_size(launch)
        1024
        >>> launch_world_size(launch, 2048, "--world-size 2048")
        Traceback (most recent call last):
        ...
        hypergrid.errors.MegatronArgsError: --world-size 2048 differs from the launch line's torchrun --nnodes 128 --nproc-per-node 8, which starts 1024 ranks; give one world size
    """
    known: list[tuple[int, str, Optional[str]]] = []
    if world_size is not None:
        known.append((world_size, world_size_from or f"world size {world_size}", None))
    if launch.world_size is not None:
        known.append((launch.world_size, f"WORLD_SIZE={launch.world_size} in the launch line", "WORLD_SIZE"))
    if launch.launched_world_size is not None:
        known.append((launch.launched_world_size, f"the launch line's torchrun --nnodes {launch.nodes} "
                      f"--nproc-per-node {launch.gpus_per_node}, which starts {launch.launched_world_size} ranks",
                      "--nnodes"))
    if not known:
        raise MegatronArgsError(
            "a world size is needed: Megatron-LM reads it from the WORLD_SIZE environment variable; "
            "pass world_size (hypergrid plan --world-size N, or WORLD_SIZE=N in front of the command, or a torchrun "
            "--nnodes N --nproc-per-node M in front of the launch line)"
        )
    for size, where, flag in known[1:]:
        if size != known[0][0]:
            raise MegatronArgsError(f"{known[0][1]} differs from {where}; give one world size", flag)
    return known[0][0]


def plan_from_megatron_args(
    args: Union[MegatronLaunch, str, Sequence[str]], world_size: Optional[int] = None, *,
    features: Optional[MegatronFeatures] = None, world_size_from: Optional[str] = None,
) -> Any:
    """The :class:`~hypergrid.planning.plan.Plan` of a Megatron-LM launch line for ``world_size`` ranks.

    ``args`` is a :class:`MegatronLaunch` or what :func:`parse_megatron_args` takes. The plan is
    the one :func:`hypergrid.planning.plan.plan_megatron` returns for the same sizes (and ``features``,
    the megatron-core release planned for; default the groups every supported release makes). ``world_size``
    (Megatron-LM reads it from ``WORLD_SIZE``) may be left out when the launch line sets
    ``WORLD_SIZE=N`` or starts with ``torchrun --nnodes N --nproc-per-node M``; sizes that differ
    are an error (:func:`launch_world_size`; ``world_size_from`` names ``world_size``). Sizes that do not fit the world raise
    :class:`MegatronArgsError` naming the flags, as Megatron-LM would name them.

    Example::

        >>> plan = plan_from_megatron_args(
        ...     "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 "
        ...     "--expert-model-parallel-size 16 --expert-tensor-parallel-size 1", world_size=1024)
        >>> plan.megatron
        MegatronSizes(tp=8, pp=4, cp=1, ep=16, etp=1, dp=32, edp=16, order='tp-cp-ep-dp-pp')
        >>> plan_from_megatron_args("--tensor-model-parallel-size 3", world_size=1024)
        Traceback (most recent call last):
        ...
        hypergrid.errors.MegatronArgsError: world size (1024) is not divisible by --tensor-model-parallel-size (3) * --pipeline-model-parallel-size (1) * --context-parallel-size (1) = 3
    """
    from .plan import plan_megatron

    launch = args if isinstance(args, MegatronLaunch) else parse_megatron_args(args)
    world = launch_world_size(launch, world_size, world_size_from)
    try:
        given: dict[str, Any] = {} if features is None else {"features": features}
        plan = plan_megatron(world, **launch.megatron_kwargs(), **given)
    except ValueError as exc:
        message, flag = _with_flag_names(str(exc), launch, world)
        raise MegatronArgsError(message, flag) from None
    batch, micro = launch.global_batch_size, launch.micro_batch_size or 1
    assert plan.megatron is not None  # a Megatron plan has its sizes
    if batch is not None and "rampup-batch-size" not in launch.ignored and batch % (micro * plan.megatron.dp):
        raise MegatronArgsError(
            f"--global-batch-size ({batch}) is not divisible by --micro-batch-size ({micro}) x the data-parallel "
            f"size ({plan.megatron.dp}) = {micro * plan.megatron.dp}, which Megatron-Core's microbatch calculator "
            f"asserts", "--global-batch-size")
    plan.global_batch_size, plan.micro_batch_size = batch, launch.micro_batch_size
    return plan
