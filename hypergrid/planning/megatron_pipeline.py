"""The pipeline split of a Megatron-LM launch line: its virtual pipeline size and its checks.

Megatron-LM's ``validate_args`` and Megatron-Core's ``TransformerConfig`` decide from
``--num-layers``, ``--pipeline-model-parallel-size`` and the flags that split layers over stages
(interleaving: ``--num-layers-per-virtual-pipeline-stage``, ``--num-virtual-stages-per-pipeline-rank``,
``--pipeline-model-parallel-layout``; uneven stages: ``--decoder-first-pipeline-num-layers``,
``--decoder-last-pipeline-num-layers``, ``--account-for-embedding-in-pipeline-split``,
``--account-for-loss-in-pipeline-split``) whether a launch runs and how many virtual stages each
pipeline rank holds. :func:`virtual_pipeline_size` does the same, and a refusal names the flags
and, for layers that do not divide, which flags Megatron-LM offers to split them unevenly. Pure.

Example::

    >>> virtual_pipeline_size({"num-layers": 32, "pipeline-model-parallel-size": 4,
    ...                        "num-layers-per-virtual-pipeline-stage": 2})
    4
    >>> virtual_pipeline_size({"num-layers": 126, "pipeline-model-parallel-size": 16})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hypergrid.errors.MegatronArgsError: --num-layers (126) is not divisible by --pipeline-model-parallel-size (16); Megatron-LM splits layers unevenly with ...
"""

from __future__ import annotations

import re
from typing import Any, Optional

from ..errors import MegatronArgsError

__all__ = ["virtual_pipeline_size", "uneven_split_hint"]

#: Flags that choose the virtual pipeline size; Megatron-LM takes at most one of them.
_VPP_FLAGS = ("num-layers-per-virtual-pipeline-stage", "num-virtual-stages-per-pipeline-rank",
              "pipeline-model-parallel-layout")
# Most copies ``*n`` a pipeline layout may ask for: a bigger one is a typo, not a model.
_MAX_LAYOUT_REPEAT = 1 << 16
_FIRST, _LAST = "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers"
_ACCOUNT = ("account-for-embedding-in-pipeline-split", "account-for-loss-in-pipeline-split")


def _layout_stages(layout: str) -> int:
    """Stages (pipeline x virtual) of a ``--pipeline-model-parallel-layout``, e.g. ``Et|(tt|)*3,L`` has 5."""
    flag = "--pipeline-model-parallel-layout"

    def repeat(match: re.Match) -> str:
        count = int(match.group(2))
        if count > _MAX_LAYOUT_REPEAT:
            raise MegatronArgsError(f"{flag} repeats {count} times, more than {_MAX_LAYOUT_REPEAT}", flag)
        return match.group(1) * count

    text = layout.replace(",", "")  # commas are cosmetic
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):  # ( ... )*n first, then x*n
        text = re.sub(pattern, repeat, text)
    unknown = sorted(set(text) - set("ELtm|"))
    if unknown:
        raise MegatronArgsError(f"{flag} {layout!r} has characters {unknown}; layers are E, L, t and m", flag)
    return text.count("|") + 1


def virtual_pipeline_size(given: dict[str, Any]) -> Optional[int]:
    """The interleaving Megatron-LM's ``validate_args`` derives, with its checks, naming the flag."""
    chosen = [f for f in _VPP_FLAGS if f in given]
    if len(chosen) > 1:
        raise MegatronArgsError(
            f"{' and '.join('--' + f for f in chosen)} are exclusive: Megatron-LM takes at most one of them",
            f"--{chosen[1]}",
        )
    pp = given.get("pipeline-model-parallel-size", 1)
    layers = given.get("num-layers", given.get("decoder-num-layers"))
    if layers is not None:
        layers += sum(bool(given.get(flag)) for flag in _ACCOUNT)
    uneven = _FIRST in given or _LAST in given
    if uneven and any(given.get(flag) for flag in _ACCOUNT):
        flag = next(f for f in _ACCOUNT if given.get(f))
        raise MegatronArgsError(f"--{flag} does not go with --{_FIRST if _FIRST in given else _LAST}: Megatron-Core "
                                f"takes uneven first and last stages or the embedding and loss counted as layers, "
                                f"not both", f"--{flag}")
    vpp: Optional[int] = None
    if "pipeline-model-parallel-layout" in given:
        stages = _layout_stages(given["pipeline-model-parallel-layout"])
        if stages % pp:
            raise MegatronArgsError(
                f"--pipeline-model-parallel-layout has {stages} stages, not divisible by "
                f"--pipeline-model-parallel-size ({pp})", "--pipeline-model-parallel-layout",
            )
        vpp = stages // pp
    elif "num-virtual-stages-per-pipeline-rank" in given:
        vpp = given["num-virtual-stages-per-pipeline-rank"]
    elif "num-layers-per-virtual-pipeline-stage" in given:
        flag, per_virtual = "--num-layers-per-virtual-pipeline-stage", given["num-layers-per-virtual-pipeline-stage"]
        if uneven:
            raise MegatronArgsError(
                f"{flag} does not go with uneven pipeline stages (--decoder-first/last-pipeline-num-layers); "
                f"give --num-virtual-stages-per-pipeline-rank instead", flag,
            )
        if layers is None:
            raise MegatronArgsError(f"{flag} needs --num-layers to derive the virtual pipeline size", flag)
        if layers % pp:
            raise _indivisible(given, layers, pp, uneven_allowed=False)
        if (layers // pp) % per_virtual:
            raise MegatronArgsError(
                f"{flag} ({per_virtual}) does not divide the {layers // pp} layers of a pipeline stage "
                f"(--num-layers {layers} / --pipeline-model-parallel-size {pp})", flag,
            )
        vpp = layers // pp // per_virtual
    elif layers is not None and not uneven and layers % pp:
        raise _indivisible(given, layers, pp, uneven_allowed=True)
    if uneven and layers is not None and "pipeline-model-parallel-layout" not in given:
        _check_uneven(given, layers, pp, vpp)
    if vpp == 1:
        return None
    if vpp is not None:
        minimum = 3 if given.get("no-overlap-p2p-communication") else 2
        if pp < minimum:
            why = " with --no-overlap-p2p-communication" if minimum == 3 else ""
            raise MegatronArgsError(
                f"--{chosen[0]} makes {vpp} virtual stages per pipeline rank, an interleaved schedule, which "
                f"needs --pipeline-model-parallel-size >= {minimum}{why}; got {pp}", f"--{chosen[0]}",
            )
    return vpp


def _indivisible(given: dict[str, Any], layers: int, pp: int, uneven_allowed: bool) -> MegatronArgsError:
    """The refusal of layers that do not divide over the pipeline stages, with the way out."""
    counted = layers - sum(bool(given.get(flag)) for flag in _ACCOUNT)
    extra = f" (+{layers - counted} for the embedding and loss counted as layers)" if layers != counted else ""
    hint = uneven_split_hint(counted, pp, uneven_allowed) if layers == counted else ""
    return MegatronArgsError(f"--num-layers ({counted}){extra} is not divisible by --pipeline-model-parallel-size "
                             f"({pp}){hint}", "--num-layers")


def uneven_split_hint(layers: int, pp: int, uneven_allowed: bool = True) -> str:
    """How Megatron-LM would take ``layers`` that do not divide over ``pp`` stages: the flags, with
    values that fit where there are some (``""`` where none does).

    Example::

        >>> print(uneven_split_hint(126, 16))
        ; Megatron-LM splits layers unevenly with --decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers (e.g. 7 and 7: the 14 other stages take 8 layers each), with --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split (counting the embedding and the loss as layers: 126 + 2 = 128 = 16 x 8), or with --pipeline-model-parallel-layout
    """
    ways = []
    if uneven_allowed and pp > 1:
        middle, target = pp - 2, layers / pp
        fits = [x for x in range(1, layers) if (middle == 0 and 2 * x == layers)
                or (middle > 0 and layers - 2 * x >= middle and (layers - 2 * x) % middle == 0)]
        if fits:
            x = min(fits, key=lambda v: (abs(v - target), v))
            rest = f"the {middle} other stages take {(layers - 2 * x) // middle} layers each" if middle else "two stages"
            ways.append(f"--{_FIRST} and --{_LAST} (e.g. {x} and {x}: {rest})")
        else:
            ways.append(f"--{_FIRST} and --{_LAST}")
    for added, flags, what in ((2, " ".join(f"--{f}" for f in _ACCOUNT), "the embedding and the loss"),
                               (1, f"--{_ACCOUNT[0]} (or --{_ACCOUNT[1]})", "the embedding (or the loss)")):
        if (layers + added) % pp == 0:
            ways.append(f"{flags} (counting {what} as layers: {layers} + {added} = {layers + added} = {pp} x "
                        f"{(layers + added) // pp})")
            break
    if uneven_allowed:
        ways.append("--pipeline-model-parallel-layout")
    if not ways:
        return ""
    return "; Megatron-LM splits layers unevenly with " + ", with ".join(ways[:-1]) + (", or with " if len(ways) > 1 else "") + ways[-1]


def _check_uneven(given: dict[str, Any], layers: int, pp: int, vpp: Optional[int]) -> None:
    """Megatron-Core's checks of uneven first and last stages: the layers left divide over the
    stages left (and, interleaved, each stage's layers over the virtual stages)."""
    middle, rest = pp, layers
    for flag in (_FIRST, _LAST):
        if flag in given:
            count = given[flag]
            if count <= 0:
                raise MegatronArgsError(f"--{flag} must be larger than 0 (Megatron-Core refuses {count})", f"--{flag}")
            if vpp is not None and count % vpp:
                raise MegatronArgsError(f"--{flag} ({count}) must be divisible by the {vpp} virtual stages per "
                                        f"pipeline rank", f"--{flag}")
            middle, rest = middle - 1, rest - count
    flag = f"--{_FIRST if _FIRST in given else _LAST}"
    if bool(rest) != bool(middle) or rest < 0 or (middle and rest % middle):
        raise MegatronArgsError(
            f"{flag}: --num-layers {layers} leaves {rest} layers for the {middle} other pipeline stages "
            f"(--pipeline-model-parallel-size {pp}); Megatron-Core needs them to divide evenly", flag)
    if middle and vpp is not None and (rest // middle) % vpp:
        raise MegatronArgsError(f"{flag}: the {rest // middle} layers of each other stage must be divisible by "
                                f"the {vpp} virtual stages per pipeline rank", flag)
