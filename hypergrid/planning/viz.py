"""Pictures of a plan: one panel per group kind, ranks laid out by node, drawn with matplotlib.

Each panel has one row per node and one cell per rank; a cell's colour says which group of that
kind the rank is in. Groups whose cells touch (or whose indices follow each other) never share a
colour; a panel with more groups than the palette's 20 colours also hatches its cells, so that
up to 180 groups all look different (a window never draws more than 128 ranks). Thin lines mark
nodes, thick lines NVLink domains (when a domain is not one node), and a dashed black-and-white
outline the groups of a chosen rank. Worlds over ``max_ranks`` ranks (or 64 nodes) draw one
window of whole nodes; the counts and node locality in the titles are computed over the whole
world. On the command line: ``hypergrid plan ... --rank R --png FILE`` (see ``docs/cli.md``).

:func:`picture` computes what to draw (pure, no matplotlib); :func:`write_picture` draws it to a
PNG or SVG file and is the only place matplotlib is imported (``pip install 'hypergrid[viz]'``).

Example::

    >>> import os, tempfile
    >>> from hypergrid.planning.plan import plan_megatron
    >>> pic = picture(plan_megatron(16, tp=2, pp=2), gpus_per_node=4, rank=5)
    >>> [p.name for p in pic.panels], sorted(pic.panels[0].highlight)
    (['tp', 'dp', 'pp'], [4, 5])
    >>> write_picture(pic, os.path.join(tempfile.mkdtemp(), "plan.svg")) > 1000
    True
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..layout.checks import positive_int
from .plan import MAX_LISTED_WORLD

__all__ = ["Panel", "Picture", "assign_styles", "picture", "write_picture", "MAX_RANKS_DRAWN", "HATCHES"]

logger = logging.getLogger(__name__)

#: Worlds up to this many ranks are drawn in full; larger ones draw a window of whole nodes.
MAX_RANKS_DRAWN = 256
_WINDOW_RANKS = 128  # ranks in a summarised picture's window (whole nodes, at least one)
_MAX_ROWS = 64  # nodes drawn at most (a world of 1 or 2 GPUs per node is summarised sooner)
_RANK_MEMBERS_SHOWN = 4  # members of the chosen rank's group named in a panel's title
#: Kinds drawn by default when a plan has many (a Megatron plan has ~17), in this order.
DEFAULT_KINDS = ("tp", "cp", "dp", "pp", "ep", "expt_tp", "expt_dp")
#: Second cue, used when a panel has more groups than colours: one hatch pattern per repeat.
HATCHES = ("", "////", "\\\\\\\\", "....", "xxx", "||||", "----", "oo", "++")
_HUES = 10  # tab20 reordered: the 10 dark shades, then their 10 light shades
_INSTALL_HINT = "pictures need matplotlib: pip install 'hypergrid[viz]'"


@dataclass
class Panel:
    """One group kind: the drawn ranks' group indices, each group's (colour, hatch), the outline."""

    name: str
    title: list[str]
    group_of: dict[int, int]  # drawn rank -> its group's number (see _window_groups)
    styles: dict[int, tuple[int, int]]  # group index -> (colour index, hatch index)
    highlight: set[int] = field(default_factory=set)  # drawn members of the chosen rank's group


@dataclass
class Picture:
    """What to draw: ranks ``[first_rank, end_rank)`` in rows of ``gpus_per_node``, one panel per kind."""

    gpus_per_node: int
    nvlink_domain: int
    first_rank: int
    end_rank: int
    rank: Optional[int]
    title: list[str]
    caption: list[str]
    panels: list[Panel]


def assign_styles(
    groups: Sequence[Sequence[int]], gpus_per_node: int, colours: int = 2 * _HUES, hues: int = _HUES,
    hatches: int = len(HATCHES),
) -> list[tuple[int, int]]:
    """A ``(colour, hatch)`` per group such that neighbouring groups never look alike.

    Ranks sit in rows of ``gpus_per_node``; two groups touch when a rank of one is next to a rank
    of the other in a row or a column, and groups ``i`` and ``i + 1`` count as touching too.
    Touching groups get different colours, and different hues where possible (colour ``c`` and
    ``c + hues`` are one hue in two shades). With more groups than colours, the hatch index
    counts the earlier groups of the same colour, so that up to ``colours * hatches`` groups all
    get different pairs.

    Example::

        >>> assign_styles([[0, 1], [2, 3], [4, 5], [6, 7]], gpus_per_node=4, colours=3, hues=3)
        [(0, 0), (1, 0), (2, 0), (0, 1)]
        >>> [c for c, _ in assign_styles([[0, 4], [1, 5], [2, 6], [3, 7]], 4)]
        [0, 1, 2, 3]
    """
    if gpus_per_node <= 0 or colours <= 0 or hues <= 0 or hatches <= 0:
        raise ValueError(f"gpus_per_node, colours, hues and hatches must be positive, got "
                         f"{gpus_per_node}, {colours}, {hues}, {hatches}")
    owner: dict[int, int] = {}
    for g, members in enumerate(groups):
        for r in members:
            owner.setdefault(r, g)
    near: list[set[int]] = [{g - 1, g + 1} - {-1, len(groups)} for g in range(len(groups))]
    for r, g in owner.items():
        for other in ((r + 1) if (r + 1) % gpus_per_node else None, r + gpus_per_node):
            h = owner.get(other) if other is not None else None
            if h is not None and h != g:
                near[g].add(h)
                near[h].add(g)
    hatched = len(groups) > colours
    chosen: list[int] = []
    used = [0] * colours
    start = 0
    for g in range(len(groups)):
        taken = {chosen[h] for h in near[g] if h < g}
        taken_hues = {c % hues for c in taken}
        order = [(start + i) % colours for i in range(colours)]
        fresh = [c for c in order if not hatched or used[c] < hatches]
        pick = next((c for c in fresh if c % hues not in taken_hues), None)
        pick = pick if pick is not None else next((c for c in fresh + order if c not in taken), None)
        if pick is None:  # every colour touches this group: the least used one
            pick = min(order, key=lambda c: used[c])
            logger.debug("group %d touches %d groups; it shares colour %d", g, len(near[g]), pick)
        chosen.append(pick)
        used[pick] += 1
        start = pick + 1
    seen = [0] * colours
    out = []
    for c in chosen:
        out.append((c, seen[c] % hatches if hatched else 0))
        seen[c] += 1
    return out


def _default_kinds(plan: Any) -> list[str]:
    names = [k.name for k in plan.kinds]
    if len(names) <= 6:
        return names
    return [n for n in DEFAULT_KINDS if n in names] or names


def picture(
    plan: Any,
    kinds: Union[str, Sequence[str], None] = None,
    gpus_per_node: int = 8,
    *,
    rank: Optional[int] = None,
    nvlink_domain: Optional[int] = None,
    max_ranks: int = MAX_RANKS_DRAWN,
) -> Picture:
    """What to draw for ``plan``: one panel per kind in ``kinds`` (default: the main ones).

    ``kinds`` is one name or several; by default the plan's kinds (Megatron's tp, cp, dp, pp,
    ep, expt_tp, expt_dp), leaving out kinds of single ranks and kinds whose groups equal an
    earlier panel's. ``rank``: outline its groups. ``nvlink_domain``: GPUs per NVLink domain
    (default ``gpus_per_node``). A world over ``max_ranks`` ranks draws a window of whole nodes,
    the one holding ``rank`` (else the first).

    Example::

        >>> from hypergrid.planning.plan import plan_megatron
        >>> pic = picture(plan_megatron(4096, tp=8, pp=4), gpus_per_node=8, rank=3000)
        >>> pic.first_rank, pic.end_rank, pic.title[1]
        (2944, 3072, 'drawn: nodes 368-383 (ranks 2944-3071); 496 other nodes (3968 ranks) not drawn')
        >>> [(p.name, p.title[0]) for p in pic.panels]
        [('tp', 'tp: 512 groups of 8'), ('dp', 'dp: 32 groups of 128'), ('pp', 'pp: 1024 groups of 4')]
    """
    for label, value in (("gpus_per_node", gpus_per_node), ("nvlink_domain", nvlink_domain), ("max_ranks", max_ranks)):
        if value is not None:
            positive_int(label, value)
    domain = nvlink_domain or gpus_per_node
    world = plan.world_size
    if rank is not None:
        plan.check_rank(rank)
    asked = [kinds] if isinstance(kinds, str) else list(kinds or [])
    names = asked or _default_kinds(plan)
    for name in names:
        plan.kind(name)  # an unknown kind fails here, naming the known ones
    world_nodes = -(-world // gpus_per_node)
    if world <= max_ranks and world_nodes <= _MAX_ROWS:
        first_node, drawn_nodes = 0, world_nodes
    else:
        drawn_nodes = min(_MAX_ROWS // 2, max(1, min(max_ranks, _WINDOW_RANKS) // gpus_per_node))
        first_node = 0 if rank is None else (rank // gpus_per_node) // drawn_nodes * drawn_nodes
        first_node = min(first_node, world_nodes - drawn_nodes)
    lo, hi = first_node * gpus_per_node, min((first_node + drawn_nodes) * gpus_per_node, world)
    heads = plan.group_heads(rank, _RANK_MEMBERS_SHOWN) if rank is not None else {}

    panels: list[Panel] = []
    left_out: list[str] = []
    drawn_groups: dict[str, object] = {}
    for name in names:
        kind = plan.kind(name)
        group_of, identity = _window_groups(plan, kind, lo, hi)
        if not asked:
            same = next((n for n, other in drawn_groups.items() if other == identity), None)
            if kind.size == 1 or same:
                left_out.append(f"{name} (groups of 1)" if kind.size == 1 else f"{name} (same groups as {same})")
                continue
        drawn_groups[name] = identity
        shown = sorted(set(group_of.values()))
        members_drawn: dict[int, list[int]] = {g: [] for g in shown}
        for r in range(lo, hi):
            if r in group_of:
                members_drawn[group_of[r]].append(r)
        styles = assign_styles([members_drawn[g] for g in shown], gpus_per_node)
        summary = plan.summary(name, gpus_per_node)
        size = "sizes vary" if summary.size is None else f"of {summary.size}"
        title = [f"{name}: {summary.count} groups {size}"]
        if summary.crosses_nodes:
            title.append(f"crosses nodes: up to {summary.max_nodes} per group")
        else:
            title.append("each group inside one node")
        if domain != gpus_per_node:
            in_domain = plan.summary(name, domain)
            title[-1] += "; " + ("crosses NVLink domains" if in_domain.crosses_nodes else "inside NVLink domains")
        highlight: set[int] = set()
        if rank is not None:
            info = heads.get(name)
            highlight = set(members_drawn[group_of[rank]]) if info is not None and rank in group_of else set()
            title.append(f"rank {rank}: " + ("in no group" if info is None else _short(info, len(highlight))))
        panels.append(Panel(name, title, group_of, dict(zip(shown, styles)), highlight))

    if not panels:  # every kind has groups of one rank: draw the first anyway
        return picture(plan, names[0], gpus_per_node, rank=rank, nvlink_domain=nvlink_domain, max_ranks=max_ranks)
    sizes = ", ".join(f"{p.name} {plan.kind(p.name).size}" for p in panels if plan.kind(p.name).size)
    title = [f"{world} ranks on {world_nodes} node{'s' * (world_nodes != 1)} of {gpus_per_node} GPUs"
             + (f", NVLink domains of {domain} GPUs" if domain != gpus_per_node else "")
             + (f": {sizes}" if sizes else "")]
    if drawn_nodes < world_nodes:
        nodes = f"node {first_node}" if drawn_nodes == 1 else f"nodes {first_node}-{first_node + drawn_nodes - 1}"
        title.append(f"drawn: {nodes} (ranks {lo}-{hi - 1}); "
                     f"{world_nodes - drawn_nodes} other nodes ({world - (hi - lo)} ranks) not drawn")
    caption = ["rows: nodes; thin grey lines: node boundaries"
               + (f"; thick black lines: NVLink domains of {domain} GPUs" if domain != gpus_per_node else "")
               + (f"; dashed outline: rank {rank}'s groups (its own cell boxed or starred)" if rank is not None else "")
               + "; counts and locality over the whole world"]
    if any(len(p.styles) > 2 * _HUES for p in panels):
        caption.append(f"hatching: a second cue in panels with more than {2 * _HUES} groups drawn")
    if left_out:
        caption.append("not drawn: " + ", ".join(left_out))
    logger.debug("picture of %s: ranks %d-%d of %d", [p.name for p in panels], lo, hi - 1, world)
    return Picture(gpus_per_node, domain, lo, hi, rank, title, caption, panels)


def _window_groups(plan: Any, kind: Any, lo: int, hi: int) -> tuple[dict[int, int], object]:
    """Each drawn rank's group number, and a value equal for two kinds with the same groups.

    A world small enough to enumerate numbers groups by their index in ``kind.enumerate()`` and
    compares whole enumerations. A larger one looks at the drawn ranks only, each in O(ndims)
    where the kind's groups are boxes (else O(group size)): a group is numbered by its lowest
    rank, and two kinds count as the same when their counts, sizes, boxes at a sample of ranks
    and groups among the drawn ranks all agree.
    """
    if plan.world_size <= MAX_LISTED_WORLD:
        groups = kind.enumerate()
        return {r: g for g, members in enumerate(groups) for r in members if lo <= r < hi}, groups
    group_of: dict[int, int] = {}
    for r in range(lo, hi):
        if r in group_of:
            continue
        box = kind.box(r)
        if box is not None:
            group_of[r] = box[0]
            continue
        members = kind.members(r)  # listed once per group: its drawn members are numbered together
        if members is not None:
            low = min(members)
            group_of.update((m, low) for m in members if lo <= m < hi)
    drawn = sorted(sorted(r for r in group_of if group_of[r] == g) for g in set(group_of.values()))
    boxes = [kind.box(r) for r in plan.sample_ranks(16)]
    return group_of, (kind.count, kind.size, boxes, drawn)


def _short(info: dict[str, Any], drawn: int) -> str:
    """A rank's group from :meth:`~hypergrid.planning.plan.Plan.group_heads`: its first members, its
    size where more, and how many are drawn where not all."""
    size, head = info["size"], info["head"] or []
    if not head:  # a group too large to list (a span or joined groups of a huge world)
        return f"{size} ranks ({drawn} drawn)"
    text = ", ".join(map(str, head)) + (", ..." if size > len(head) else "")
    notes = [f"{size} ranks"] if size > len(head) else []
    notes += [f"{drawn} drawn"] if drawn < size else []
    return text + (f" ({', '.join(notes)})" if notes else "")


def _edges(key: Any, cols: int, first: int, end: int, border: bool) -> list[list[tuple[int, int]]]:
    """Cell edges between ranks whose ``key`` differs; ``border``: also the outer edges of true cells."""
    out = []
    for r in range(first, end):
        row, col = divmod(r - first, cols)
        here = key(r)
        right, below = col + 1 < cols and r + 1 < end, r + cols < end
        if (right and key(r + 1) != here) or (border and here and not right):
            out.append([(col + 1, row), (col + 1, row + 1)])
        if (below and key(r + cols) != here) or (border and here and not below):
            out.append([(col, row + 1), (col + 1, row + 1)])
        if border and here and col == 0:
            out.append([(0, row), (0, row + 1)])
        if border and here and row == 0:
            out.append([(col, 0), (col + 1, 0)])
    return out


def _figure(pic: Picture) -> Any:
    """The matplotlib Figure of ``pic``: panels side by side (wrapping), sized to the cells."""
    import textwrap

    from matplotlib import colormaps
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    tab20_map: Any = colormaps["tab20"]  # a ListedColormap, whose colors are its 20 entries
    tab20 = tab20_map.colors
    palette = [tab20[i] for i in range(0, 20, 2)] + [tab20[i] for i in range(1, 20, 2)]
    cols, first, end = pic.gpus_per_node, pic.first_rank, pic.end_rank
    rows = -(-(end - first) // cols)
    ch = min(0.3, max(0.09, 6.5 / rows))  # cell height and width in inches
    cw = min(0.5, max(0.12, 1.6 * ch, 3.0 / cols)) if cols <= 16 else max(0.1, 8.0 / cols)
    font = min(8.0, ch * 72 * 0.5, cw * 72 * 0.85 / (0.62 * len(str(end - 1))))
    labels = font >= 4.5  # rank numbers in the cells only when they fit
    pw, ph = cols * cw, rows * ch
    em = 7.5 * 0.58 / 72  # inches per character of the 7.5 pt titles, about
    titles = [[ln for text in p.title for ln in textwrap.wrap(text, max(36, int(pw / em)))] for p in pic.panels]
    slot = max(pw, em * max(len(ln) for t in titles for ln in t)) + 0.35  # a panel and the gap after it
    title_h = 0.16 * max(len(t) for t in titles) + 0.1
    ncols = max(1, min(len(pic.panels), int(17 // slot)))
    nrows = -(-len(pic.panels) // ncols)
    tick_step = max(1, -(-rows // 32))
    ticks = [f"node {first // cols + n}: {first + n * cols}-{min(first + (n + 1) * cols, end) - 1}"
             for n in range(0, rows, tick_step)]
    left = 0.3 + 6.5 * 0.6 / 72 * max(len(t) for t in ticks)
    width = max(left + ncols * slot, 5.0)
    wrap = int(width / em)
    caption = [line for text in pic.caption for line in textwrap.wrap(text, wrap)]
    head, foot = 0.2 + 0.19 * len(pic.title), 0.25 + 0.15 * len(caption)
    height = head + nrows * (title_h + ph + 0.25) + foot
    fig = Figure(figsize=(width, height))
    fig.text(0.15 / width, 1 - 0.12 / height, "\n".join(pic.title), va="top", fontsize=10, weight="bold")
    fig.text(0.15 / width, 0.08 / height, "\n".join(caption), va="bottom", fontsize=7.5, color="#333")
    x_step = max(1, cols // 8)
    for i, panel in enumerate(pic.panels):
        x0 = left + (i % ncols) * slot
        y0 = height - head - (i // ncols + 1) * (title_h + ph + 0.25) + 0.25
        ax = fig.add_axes((x0 / width, y0 / height, pw / width, ph / height))
        ax.set_gid(f"panel-{panel.name}")
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_title("\n".join(titles[i]), fontsize=7.5, loc="left", pad=4)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_yticks([n + 0.5 for n in range(0, rows, tick_step)])
        ax.set_yticklabels(ticks if i % ncols == 0 else [""] * len(ticks), fontsize=6.5)
        ax.set_xticks([c + 0.5 for c in range(0, cols, x_step)])
        ax.set_xticklabels([str(c) for c in range(0, cols, x_step)], fontsize=6)
        ax.tick_params(length=0, pad=3)
        by_hatch: dict[int, tuple[list[Any], list[Any]]] = {}
        for r in range(first, end):
            row, col = divmod(r - first, cols)
            g = panel.group_of.get(r)
            colour, hatch = panel.styles[g] if g is not None else (None, 0)
            face = palette[colour] if colour is not None else (1.0, 1.0, 1.0)
            cells, faces = by_hatch.setdefault(hatch, ([], []))
            cells.append(Rectangle((col, row), 1, 1))
            faces.append(face)
            if r == pic.rank:
                ax.text(col + 0.5, row + 0.55, str(r) if labels else "", ha="center", va="center",
                        fontsize=font, weight="bold", bbox={"boxstyle": "round,pad=0.15", "fc": "white", "lw": 0})
            elif labels:
                light = sum(w * v for w, v in zip((0.3, 0.59, 0.11), to_rgb(face))) > 0.5
                ax.text(col + 0.5, row + 0.55, str(r), ha="center", va="center", fontsize=font,
                        color="black" if light else "white")
        for hatch, (cells, faces) in sorted(by_hatch.items()):
            ax.add_collection(PatchCollection(cells, facecolors=faces, edgecolors=(0, 0, 0, 0.3),
                                              linewidths=0.4, hatch=HATCHES[hatch] or None))
        ax.add_collection(LineCollection([[(0, n), (cols, n)] for n in range(1, rows)], colors="#777", linewidths=1.0))
        lines: list[tuple[list[list[tuple[int, int]]], str, float, Any, Optional[str]]] = []
        if pic.nvlink_domain != cols:
            domains = _edges(lambda r: r // pic.nvlink_domain, cols, first, end, False)
            lines.append((domains, "black", 2.6, "solid", "domains"))
        if panel.highlight:
            outline = _edges(panel.highlight.__contains__, cols, first, end, True)
            lines += [(outline, "black", 3.0, "solid", f"highlight-{panel.name}"),
                      (outline, "white", 1.4, (0, (2, 2)), None)]
        for segments, line_colour, lw, style, gid in lines:
            collection = LineCollection(segments, colors=line_colour, linewidths=lw, linestyles=style, gid=gid)
            collection.set_clip_on(False)
            ax.add_collection(collection)
        if pic.rank is not None and first <= pic.rank < end and not labels:
            row, col = divmod(pic.rank - first, cols)
            ax.plot([col + 0.5], [row + 0.5], marker="*", color="black", markeredgecolor="white", markersize=8)
    return fig


def write_picture(pic: Picture, path: Union[str, os.PathLike[str]], format: Optional[str] = None) -> int:
    """Draw ``pic`` into ``path`` as PNG or SVG (``format``, else the file's suffix); return its bytes.

    ImportError with an install hint when matplotlib is missing; OSError when ``path`` cannot
    be written.

    Example::

        >>> import os, tempfile
        >>> from hypergrid.planning.plan import plan_grid
        >>> path = os.path.join(tempfile.mkdtemp(), "grid.png")
        >>> write_picture(picture(plan_grid([2, 4], ["tp", "dp"]), gpus_per_node=4), path) > 1000
        True
        >>> open(path, "rb").read(4)
        b'\\x89PNG'
    """
    fmt = (format or os.path.splitext(str(path))[1].lstrip(".")).lower()
    if fmt not in ("png", "svg"):
        raise ValueError(f"picture file {str(path)!r}: expected a .png or .svg suffix "
                         f"(or format 'png' or 'svg'), got {fmt!r}")
    try:
        import matplotlib
        from PIL import Image  # matplotlib's own dependency
    except ImportError:
        raise ImportError(_INSTALL_HINT) from None
    # Text stays text in SVG; no date, version or random ids, so the same picture gives the same bytes.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "hypergrid", "hatch.linewidth": 0.5,
                                "font.family": "DejaVu Sans"}):
        fig = _figure(pic)
        if fmt == "svg":
            fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None})
        else:
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=100)
            # Flat colours: a 256-colour palette PNG looks the same and is about 3x smaller.
            Image.open(buffer).convert("RGB").quantize(256).save(path, format="PNG", optimize=True)
    size = os.path.getsize(path)
    logger.debug("wrote %s (%d bytes, %d panels)", path, size, len(pic.panels))
    return size
