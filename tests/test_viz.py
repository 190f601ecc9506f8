"""Pictures: colours follow groups, large worlds are summarised, both encoders produce valid files."""

from __future__ import annotations

import struct
import zlib
from xml.etree import ElementTree

from hypergrid.report import plan_grid, plan_megatron
from hypergrid.viz import MAX_RANKS_DRAWN, group_colour, picture, png, svg, write_picture


def _pixels(data: bytes) -> tuple[int, int, bytes]:
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        if data[pos + 4:pos + 8] == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(idat)
    rows = [raw[y * (1 + 3 * width) + 1:(y + 1) * (1 + 3 * width)] for y in range(height)]
    return width, height, b"".join(rows)


def test_cells_are_coloured_by_group_and_laid_out_by_node():
    plan = plan_grid([2, 3, 4], ["tp", "cp", "dp"])
    pic = picture(plan, "cp", gpus_per_node=6)
    assert [c.label for c in pic.cells] == [str(r) for r in range(24)]
    by_rank = {int(c.label): c for c in pic.cells}
    for group in plan.kind("cp").enumerate():
        assert len({by_rank[r].fill for r in group}) == 1
    firsts = [by_rank[g[0]].fill for g in plan.kind("cp").enumerate()]
    assert len(set(firsts)) == len(firsts)  # 8 groups, 8 colours
    # Node rows: ranks 0-5 on the first row, 6-11 on the second.
    assert by_rank[0].y == by_rank[5].y < by_rank[6].y
    assert by_rank[1].x == by_rank[7].x
    assert any("each of the 8 groups stays inside one node" in t for _, _, t in pic.texts)


def test_rank_group_is_outlined():
    plan = plan_megatron(16, tp=2, pp=2)
    pic = picture(plan, "dp", 4, rank=5)
    outlined = sorted(int(c.label) for c in pic.cells if c.outlined)
    assert outlined == plan.groups_of(5)["dp"]


def test_large_world_is_summarised_with_whole_world_counts():
    plan = plan_megatron(4096, tp=8, pp=8, ep=32, etp=1)
    pic = picture(plan, "ep", 8)
    assert len(pic.cells) == 256 < MAX_RANKS_DRAWN
    text = " ".join(t for _, _, t in pic.texts)
    assert "drawn: nodes 0-31 (ranks 0-255); 480 other nodes not drawn" in text
    assert f"{plan.summary('ep', 8).count} groups of 32" in text
    # With a rank, the window holds that rank's node, and its group is outlined there.
    pic = picture(plan, "tp", 8, rank=3000)
    assert [c.label for c in pic.cells][:1] == ["2816"] and len(pic.cells) == 256
    assert sorted(int(c.label) for c in pic.cells if c.outlined) == plan.groups_of(3000)["tp"]
    assert "drawn: nodes 352-383 (ranks 2816-3071)" in " ".join(t for _, _, t in pic.texts)


def test_png_pixels_show_the_cell_colours(tmp_path):
    plan = plan_grid([2, 4], ["tp", "dp"])
    pic = picture(plan, "tp", 4)
    width, height, pixels = _pixels(png(pic))
    assert (width, height) == (pic.width, pic.height)
    for cell in pic.cells:
        # A pixel inside the cell, off the centred label: the group colour.
        x, y = cell.x + 2, cell.y + 2
        assert pixels[(y * width + x) * 3:(y * width + x) * 3 + 3] == bytes(cell.fill)
    assert write_picture(pic, str(tmp_path / "a.png")) == len(png(pic))


def test_svg_is_well_formed_with_escaped_text(tmp_path):
    plan = plan_grid([2, 2], ["a_b", "c"])
    doc = svg(picture(plan, "a_b", 2, rank=1))
    root = ElementTree.fromstring(doc)
    assert root.tag.endswith("svg") and int(root.get("width")) == picture(plan, "a_b", 2).width
    texts = "".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "colour: a_b group" in texts and "key 'a_b'" in texts


def test_group_colours_differ_for_neighbours():
    colours = [group_colour(i) for i in range(16)]
    assert len(set(colours)) == 16
