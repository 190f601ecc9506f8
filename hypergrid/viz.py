"""Pictures of a plan: ranks laid out by node, coloured by the groups of one kind.

One row per node, one cell per rank (its global rank written in it), the cell's colour the
index of its group of the chosen kind: a kind whose colours stay inside a row stays inside a
node; a colour that repeats down a column is a group that crosses nodes. Up to
``max_ranks`` ranks are drawn in full; a larger world draws its first nodes and says how many
were left out, with the counts and node locality of the kind computed over the whole world.

Both formats are written with the standard library only, so the pictures cost no dependency:
SVG as text (with a tooltip per rank), PNG through a small rasterizer, a 3x5 pixel font and
``zlib``. Both render the same :class:`Picture`.

Example::

    >>> from hypergrid.report import plan_grid
    >>> pic = picture(plan_grid([2, 4], ["tp", "dp"]), "tp", gpus_per_node=4)
    >>> len(pic.cells), pic.width > 0, svg(pic).startswith("<svg")
    (8, True, True)
    >>> png(pic)[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
"""

from __future__ import annotations

import colorsys
import logging
import struct
import zlib
from dataclasses import dataclass, field
from typing import Optional
from xml.sax.saxutils import escape

from .report import Plan

__all__ = ["Cell", "Picture", "picture", "svg", "png", "write_picture", "MAX_RANKS_DRAWN"]

logger = logging.getLogger("hypergrid.viz")

#: Worlds up to this many ranks are drawn rank by rank; larger ones are summarised.
MAX_RANKS_DRAWN = 512
# How many ranks a summarised picture still draws, to show the pattern of the first nodes.
_SUMMARY_RANKS = 256

_CELL_W, _CELL_H = 44, 26
_LABEL_W = 78
_MARGIN = 10
_LINE_H = 18
_TEXT = (20, 20, 20)
_BACKGROUND = (255, 255, 255)
_OUTLINE = (0, 0, 0)

RGB = tuple[int, int, int]


@dataclass(frozen=True)
class Cell:
    """One rank's box: position, fill, label, tooltip and whether it is outlined."""

    x: int
    y: int
    w: int
    h: int
    fill: RGB
    label: str
    tooltip: str
    outlined: bool = False


@dataclass
class Picture:
    """Everything drawn, in pixels: text lines ``(x, y, text)`` and rank cells."""

    width: int
    height: int
    texts: list[tuple[int, int, str]] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)


def group_colour(index: int) -> RGB:
    """A light colour for group ``index``; neighbours in index get far-apart hues.

    Example::

        >>> group_colour(0) != group_colour(1)
        True
    """
    hue = (index * 0.6180339887) % 1.0  # golden-ratio steps spread any number of groups
    r, g, b = colorsys.hsv_to_rgb(hue, 0.45, 0.97)
    return (int(r * 255), int(g * 255), int(b * 255))


def picture(
    plan: Plan,
    kind: str,
    gpus_per_node: int,
    *,
    rank: Optional[int] = None,
    max_ranks: int = MAX_RANKS_DRAWN,
) -> Picture:
    """Lay out ``plan``'s ranks by node, coloured by their group of ``kind``.

    ``rank``: outline that rank's group. Worlds over ``max_ranks`` ranks draw one window of
    nodes only (the first nodes, or those around ``rank``) and a line saying which are drawn.

    Example::

        >>> from hypergrid.report import plan_grid
        >>> pic = picture(plan_grid([8, 128], ["tp", "dp"]), "dp", 8)
        >>> len(pic.cells), any("not drawn" in t for _, _, t in pic.texts)
        (256, True)
    """
    summary = plan.summary(kind, gpus_per_node)
    group_kind = plan.kind(kind)
    layout = plan.layout if group_kind.view is None else plan.views[group_kind.view]
    end = layout.rank_offset + layout.size
    world_nodes = -(-plan.world_size // gpus_per_node)
    drawn_ranks = end if end <= max_ranks else max(gpus_per_node, min(_SUMMARY_RANKS, end))
    drawn_nodes = -(-drawn_ranks // gpus_per_node)
    # A summarised picture shows the window of nodes holding `rank` (else the first nodes).
    first_node = 0
    if rank is not None and drawn_nodes < world_nodes:
        first_node = (rank // gpus_per_node) // drawn_nodes * drawn_nodes
    last_node = min(first_node + drawn_nodes, world_nodes)
    lo, hi = first_node * gpus_per_node, min(last_node * gpus_per_node, plan.world_size)
    highlight = set(group_kind.members(rank)) if rank is not None else set()

    where = (
        f"each of the {summary.count} groups stays inside one node"
        if not summary.crosses_nodes
        else f"groups cross nodes: up to {summary.max_nodes} nodes per group, "
        f"{summary.intra_node_groups} of {summary.count} inside one node"
    )
    lines = [
        f"{plan.world_size} ranks, {world_nodes} nodes of {gpus_per_node}; "
        + ("grid " if group_kind.view is None else f"{group_kind.view} view ")
        + " x ".join(f"{n}={s}" for n, s in zip(layout.dim_names, layout.shape)),
        f"colour: {kind} group ({summary.count} groups of {summary.size}, key {summary.key!r})",
        where,
    ]
    if rank is not None:
        lines.append(f"outlined: the {kind} group of rank {rank}")
    footer = (
        f"... drawn: nodes {first_node}-{last_node - 1} (ranks {lo}-{hi - 1}); "
        f"{world_nodes - (last_node - first_node)} other nodes not drawn"
        if last_node - first_node < world_nodes
        else None
    )
    top = _MARGIN + _LINE_H * len(lines) + 6
    # Wide enough for the cells and for every line of text, the footer included.
    longest_text = max(len(t) for t in lines + ([footer] if footer else []))
    width = max(_MARGIN * 2 + _LABEL_W + gpus_per_node * _CELL_W, 8 * longest_text + 2 * _MARGIN)
    pic = Picture(width=width, height=0)
    for i, text in enumerate(lines):
        pic.texts.append((_MARGIN, _MARGIN + _LINE_H * i, text))

    coords_names = layout.dim_names
    # Group index of each drawn rank, from one pass over the enumeration: O(grid size).
    index_of: dict[int, int] = {}
    for g, members in enumerate(group_kind.enumerate()):
        for r in members:
            if lo <= r < hi:
                index_of[r] = g
    for node in range(first_node, last_node):
        y = top + (node - first_node) * _CELL_H
        pic.texts.append((_MARGIN, y + 8, f"node {node}"))
        for local in range(gpus_per_node):
            r = node * gpus_per_node + local
            if r >= hi:
                break
            x = _MARGIN + _LABEL_W + local * _CELL_W
            if r in index_of:
                coords = ", ".join(f"{n}={c}" for n, c in zip(coords_names, layout.coords(r)))
                fill, tip = group_colour(index_of[r]), f"rank {r}: {coords}; {kind} group {index_of[r]}"
            else:
                fill, tip = (235, 235, 235), f"rank {r}: not on the grid"
            pic.cells.append(Cell(x, y, _CELL_W - 2, _CELL_H - 2, fill, str(r), tip, r in highlight))
    y = top + (last_node - first_node) * _CELL_H + 6
    if footer:
        pic.texts.append((_MARGIN, y, footer))
        y += _LINE_H
    pic.height = y + _MARGIN
    logger.debug("picture of %s: %d cells, %dx%d", kind, len(pic.cells), pic.width, pic.height)
    return pic


def _hex(colour: RGB) -> str:
    return "#%02x%02x%02x" % colour


def svg(pic: Picture) -> str:
    """The picture as an SVG document (text), one ``<title>`` tooltip per rank.

    Example::

        >>> svg(Picture(10, 10, texts=[(0, 0, "a<b")]))[:4]
        '<svg'
    """
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{pic.width}" height="{pic.height}" '
        f'viewBox="0 0 {pic.width} {pic.height}" font-family="monospace" font-size="12">',
        f'<rect width="{pic.width}" height="{pic.height}" fill="{_hex(_BACKGROUND)}"/>',
    ]
    for x, y, text in pic.texts:
        out.append(f'<text x="{x}" y="{y + 11}" fill="{_hex(_TEXT)}">{escape(text)}</text>')
    for c in pic.cells:
        stroke = 'stroke="#000" stroke-width="2.5"' if c.outlined else 'stroke="#888" stroke-width="0.5"'
        out.append(
            f'<g><title>{escape(c.tooltip)}</title>'
            f'<rect x="{c.x}" y="{c.y}" width="{c.w}" height="{c.h}" fill="{_hex(c.fill)}" {stroke}/>'
            f'<text x="{c.x + c.w // 2}" y="{c.y + c.h // 2 + 4}" text-anchor="middle" '
            f'fill="{_hex(_TEXT)}">{escape(c.label)}</text></g>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


# A 3x5 pixel font: five rows of three bits per glyph. Lower case only; upper case is folded.
_FONT_ROWS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001010010",
    "8": "111101111101111", "9": "111101111001111", "a": "010101111101101", "b": "110101110101110",
    "c": "011100100100011", "d": "110101101101110", "e": "111100110100111", "f": "111100110100100",
    "g": "011100101101011", "h": "101101111101101", "i": "111010010010111", "j": "001001001101010",
    "k": "101101110101101", "l": "100100100100111", "m": "101111111101101", "n": "110101101101101",
    "o": "010101101101010", "p": "110101110100100", "q": "010101101110011", "r": "110101110101101",
    "s": "011100010001110", "t": "111010010010010", "u": "101101101101111", "v": "101101101101010",
    "w": "101101111111101", "x": "101101010101101", "y": "101101010010010", "z": "111001010100111",
    " ": "000000000000000", "-": "000000111000000", ".": "000000000000010", ",": "000000000010100",
    ":": "000010000010000", "(": "010100100100010", ")": "010001001001010", "/": "001001010100100",
    "=": "000111000111000", "+": "000010111010000", "_": "000000000000111", "[": "110100100100110",
    "]": "011001001001011", "'": "010010000000000", "?": "111001010000010", "*": "000101010101000",
    ";": "000010000010100", "<": "001010100010001", ">": "100010001010100", "#": "101111101111101",
}
_SCALE = 2  # font pixels per glyph pixel: 6x10 characters, readable at 100%
_ADVANCE = 4 * _SCALE


class _Canvas:
    """An RGB raster with the three operations the pictures need."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.data = bytearray(bytes(_BACKGROUND) * (width * height))

    def rect(self, x: int, y: int, w: int, h: int, colour: RGB) -> None:
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(self.width, x + w), min(self.height, y + h)
        if x0 >= x1:
            return
        row = bytes(colour) * (x1 - x0)
        for yy in range(y0, y1):
            start = (yy * self.width + x0) * 3
            self.data[start:start + len(row)] = row

    def text(self, x: int, y: int, text: str, colour: RGB = _TEXT) -> None:
        for i, ch in enumerate(text.lower()):
            rows = _FONT_ROWS.get(ch, _FONT_ROWS["?"])
            for bit, on in enumerate(rows):
                if on == "1":
                    px = x + i * _ADVANCE + (bit % 3) * _SCALE
                    py = y + (bit // 3) * _SCALE
                    self.rect(px, py, _SCALE, _SCALE, colour)

    def png(self) -> bytes:
        stride = self.width * 3
        # Filter type 0 on every scanline: simple, and zlib still shrinks the flat colours well.
        raw = b"".join(b"\x00" + bytes(self.data[y * stride:(y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, payload: bytes) -> bytes:
            return struct.pack(">I", len(payload)) + kind + payload + struct.pack(
                ">I", zlib.crc32(kind + payload) & 0xFFFFFFFF
            )

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def png(pic: Picture) -> bytes:
    """The picture as PNG bytes (8-bit RGB), drawn with the built-in 3x5 pixel font.

    Example::

        >>> data = png(Picture(20, 10, texts=[(1, 1, "ok")]))
        >>> data[:4], len(data) > 50
        (b'\\x89PNG', True)
    """
    canvas = _Canvas(pic.width, pic.height)
    for x, y, text in pic.texts:
        canvas.text(x, y + 1, text)
    for c in pic.cells:
        if c.outlined:
            canvas.rect(c.x - 2, c.y - 2, c.w + 4, c.h + 4, _OUTLINE)
        else:
            canvas.rect(c.x - 1, c.y - 1, c.w + 2, c.h + 2, (150, 150, 150))
        canvas.rect(c.x, c.y, c.w, c.h, c.fill)
        text_w = len(c.label) * _ADVANCE - _SCALE
        canvas.text(c.x + (c.w - text_w) // 2, c.y + (c.h - 5 * _SCALE) // 2, c.label)
    return canvas.png()


def write_picture(pic: Picture, path: str) -> int:
    """Write ``pic`` to ``path`` as SVG or PNG, by the file's suffix; return the bytes written.

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "p.svg")
        >>> write_picture(Picture(10, 10), path) > 0
        True
    """
    lowered = str(path).lower()
    if lowered.endswith(".svg"):
        data = svg(pic).encode("utf-8")
    elif lowered.endswith(".png"):
        data = png(pic)
    else:
        raise ValueError(f"picture file {path!r} must end in .svg or .png")
    with open(path, "wb") as f:
        f.write(data)
    return len(data)
