"""Pictures: one panel per kind, touching groups never share a colour, the chosen rank's groups
are outlined, large worlds draw a window, and files are valid PNG/SVG (or one error line)."""

from __future__ import annotations

import struct
import sys
from xml.etree import ElementTree

import pytest

from hypergrid.app import cli
from hypergrid.planning import viz
from hypergrid.planning.plan import plan_grid, plan_megatron
from hypergrid.planning.viz import HATCHES, assign_styles, picture, write_picture

SVG = "{http://www.w3.org/2000/svg}"


def _touching(groups: list[list[int]], gpus_per_node: int) -> set[tuple[int, int]]:
    """Pairs of group indices whose cells are neighbours in a row or a column, or whose indices follow."""
    owner = {r: g for g, members in enumerate(groups) for r in members}
    pairs = {(g, g + 1) for g in range(len(groups) - 1)}
    for r, g in owner.items():
        for other in ([r + 1] if (r + 1) % gpus_per_node else []) + [r + gpus_per_node]:
            h = owner.get(other)
            if h is not None and h != g:
                pairs.add((min(g, h), max(g, h)))
    return pairs


def _ids(path) -> list[str]:
    return [g.get("id") for g in ElementTree.parse(path).getroot().iter(f"{SVG}g") if g.get("id")]


def test_panels_colour_ranks_by_group_laid_out_by_node():
    plan = plan_grid([2, 3, 4], ["tp", "cp", "dp"], groups=[["cp", "dp"]])
    pic = picture(plan, gpus_per_node=6)
    assert [p.name for p in pic.panels] == ["tp", "cp", "dp", "cp-dp"]
    assert (pic.first_rank, pic.end_rank, pic.gpus_per_node, pic.nvlink_domain) == (0, 24, 6, 6)
    for panel in pic.panels:
        groups = plan.kind(panel.name).enumerate()
        assert panel.group_of == {r: g for g, members in enumerate(groups) for r in members}
        assert len(set(panel.styles.values())) == len(groups)  # every group looks different
    cp = pic.panels[1]
    assert cp.title[:2] == ["cp: 8 groups of 3", "each group inside one node"]
    assert pic.panels[2].title[1] == "crosses nodes: up to 4 per group"
    assert pic.title == ["24 ranks on 4 nodes of 6 GPUs: tp 2, cp 3, dp 4, cp-dp 12"]


def test_default_kinds_leave_out_single_rank_and_repeated_groups():
    pic = picture(plan_megatron(128, tp=8, pp=4), gpus_per_node=8)
    assert [p.name for p in pic.panels] == ["tp", "dp", "pp"]
    assert pic.caption[-1] == ("not drawn: cp (groups of 1), ep (groups of 1), expt_tp (same groups as tp), "
                               "expt_dp (same groups as dp)")
    # Asked for by name, any kind is drawn, single ranks and derived kinds included.
    assert [p.name for p in picture(plan_megatron(16, tp=2, pp=2), ["cp", "embd"], 4).panels] == ["cp", "embd"]
    with pytest.raises(ValueError, match="'zz'"):
        picture(plan_megatron(16, tp=2), "zz", 4)
    with pytest.raises(ValueError, match="nvlink_domain must be a positive integer, got 0"):
        picture(plan_megatron(16, tp=2), "tp", 4, nvlink_domain=0)


def test_rank_groups_are_outlined_in_every_panel(tmp_path):
    plan = plan_megatron(16, tp=2, pp=2)
    pic = picture(plan, gpus_per_node=4, rank=5)
    for panel in pic.panels:
        assert sorted(panel.highlight) == plan.groups_of(5)[panel.name]
        assert panel.title[-1].startswith("rank 5: ")
    write_picture(pic, tmp_path / "p.svg")
    ids = _ids(tmp_path / "p.svg")
    for name in ("tp", "dp", "pp"):
        assert f"panel-{name}" in ids and f"highlight-{name}" in ids
    write_picture(picture(plan, "tp", 4), tmp_path / "q.svg")  # no rank, no outline
    assert not any(i.startswith("highlight") for i in _ids(tmp_path / "q.svg"))


def test_large_world_draws_a_window_with_whole_world_counts():
    plan = plan_megatron(4096, tp=2, pp=4, cp=2, ep=8, etp=1)
    pic = picture(plan, gpus_per_node=8, rank=3000, nvlink_domain=72)
    assert (pic.first_rank, pic.end_rank) == (2944, 3072)  # 16 whole nodes, rank 3000's among them
    assert pic.title[1] == "drawn: nodes 368-383 (ranks 2944-3071); 496 other nodes (3968 ranks) not drawn"
    assert "NVLink domains of 72 GPUs" in pic.title[0]
    panels = {p.name: p for p in pic.panels}
    assert list(panels) == ["tp", "cp", "dp", "pp", "ep", "expt_dp"]
    assert panels["pp"].title == ["pp: 1024 groups of 4", "crosses nodes: up to 4 per group; crosses NVLink domains",
                                  "rank 3000: 952, 1976, 3000, 4024 (1 drawn)"]
    assert panels["dp"].title[0] == "dp: 16 groups of 256"
    assert set(panels["pp"].group_of) == set(range(2944, 3072))


def _partition(panel) -> set[frozenset[int]]:
    groups: dict[int, set[int]] = {}
    for r, g in panel.group_of.items():
        groups.setdefault(g, set()).add(r)
    return {frozenset(members) for members in groups.values()}


@pytest.mark.parametrize("rank", [0, 1500, 4095])
def test_a_world_too_large_to_enumerate_draws_the_same_window(monkeypatch, rank):
    # The path for huge worlds (each drawn rank's group in O(ndims)) pictures a small world exactly
    # as the enumerating path does: the same panels, groups, outlines and titles.
    plan = plan_megatron(4096, tp=2, pp=4, cp=2, ep=8, etp=2)
    small = picture(plan, gpus_per_node=8, rank=rank, nvlink_domain=32)
    monkeypatch.setattr(viz, "MAX_LISTED_WORLD", 0)
    large = picture(plan, gpus_per_node=8, rank=rank, nvlink_domain=32)
    assert (large.first_rank, large.end_rank, large.title, large.caption) == (
        small.first_rank, small.end_rank, small.title, small.caption)
    assert [p.name for p in large.panels] == [p.name for p in small.panels]
    for a, b in zip(large.panels, small.panels):
        assert (a.title, a.highlight, _partition(a)) == (b.title, b.highlight, _partition(b)), a.name


def test_sixteen_million_ranks_draw_a_window_around_the_rank(tmp_path):
    plan = plan_megatron(1 << 24, tp=8, pp=16, cp=2, ep=64)
    pic = picture(plan, gpus_per_node=4, rank=12345678, nvlink_domain=72)
    assert pic.first_rank <= 12345678 < pic.end_rank and pic.end_rank - pic.first_rank == 128
    panels = {p.name: p for p in pic.panels}
    assert panels["dp"].title[0] == "dp: 256 groups of 65536"
    assert panels["dp"].title[2].startswith("rank 12345678: 11534350, 11534366, 11534382, 11534398, ... (65536 ranks, ")
    assert panels["tp"].highlight == set(range(12345672, 12345680))
    assert write_picture(pic, str(tmp_path / "huge.png")) > 10_000


@pytest.mark.parametrize(
    "plan,kind",
    [
        (plan_megatron(4096, tp=2, pp=4, cp=2, ep=8, etp=1), "cp"),  # 2,048 groups: colours repeat
        (plan_megatron(128, tp=8, pp=4), "dp"),  # 32 groups, one column each over 4 nodes
        (plan_megatron(128, tp=8, pp=4), "pp"),
        (plan_grid([3, 5, 7], ["a", "b", "c"]), "b"),  # groups that do not line up with nodes
    ],
    ids=["cp-4096", "dp-128", "pp-128", "b-105"],
)
def test_touching_groups_never_share_a_colour(plan, kind):
    groups = plan.kind(kind).enumerate()
    styles = assign_styles(groups, gpus_per_node=8)
    for g, h in _touching(groups, 8):
        assert styles[g][0] != styles[h][0], (g, h, groups[g], groups[h])
    if len(groups) <= 20 * len(HATCHES):
        assert len(set(styles)) == len(groups)  # beyond the palette, hatching tells them apart
    else:
        assert len(set(styles)) == 20 * len(HATCHES)
    # The hue ramp this replaces gave cp groups 0, 8, 16, 24 of this picture four near-identical pinks.
    if kind == "cp":
        assert len({styles[g] for g in (0, 8, 16, 24)}) == 4


def test_assign_styles_uses_hatching_only_beyond_the_palette():
    assert {h for _, h in assign_styles([[r] for r in range(20)], 4)} == {0}
    styles = assign_styles([[r] for r in range(64)], 8)
    assert len(set(styles)) == 64 and {h for _, h in styles} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="got 0"):
        assign_styles([[0]], 0)


def test_png_and_svg_files(tmp_path):
    pic = picture(plan_grid([2, 4], ["tp", "dp"]), gpus_per_node=4, rank=3)
    size = write_picture(pic, tmp_path / "p.png")
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and size == len(data)
    width, height = struct.unpack(">II", data[16:24])
    assert 400 <= width <= 1000 and 150 <= height <= 400  # about 5.4 x 2.3 inches at 100 dpi
    # The format flag wins over the suffix; the same picture gives the same SVG bytes.
    write_picture(pic, tmp_path / "a.out", format="svg")
    write_picture(pic, tmp_path / "b.svg")
    assert (tmp_path / "a.out").read_bytes() == (tmp_path / "b.svg").read_bytes()
    root = ElementTree.parse(tmp_path / "b.svg").getroot()
    assert [i for i in _ids(tmp_path / "b.svg") if i.startswith("panel-")] == ["panel-tp", "panel-dp"]
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "tp: 4 groups of 2" in texts and "node 1: 4-7" in texts
    with pytest.raises(ValueError, match=r"'p\.gif'.*'gif'"):
        write_picture(pic, "p.gif")


@pytest.mark.slow
def test_4096_rank_smoke(tmp_path):
    plan = plan_megatron(4096, tp=2, pp=4, cp=2, ep=8, etp=1)
    size = write_picture(picture(plan, gpus_per_node=8, rank=1000, nvlink_domain=72), tmp_path / "moe.png")
    data = (tmp_path / "moe.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < size < 400_000


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hypergrid: error: ") and "Traceback" not in err
    return err


def test_missing_matplotlib_is_one_line_and_text_still_works(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    argv = ["plan", "--world-size", "16", "--tp", "2", "--format", "csv"]
    assert cli.main(argv) == 0 and "tp,tp" in capsys.readouterr().out
    assert cli.main(argv + ["--png", str(tmp_path / "p.png")]) == 2
    assert "pictures need matplotlib: pip install 'hypergrid[viz]'" in _one_error_line(capsys)
    assert not (tmp_path / "p.png").exists()
    pic = picture(plan_megatron(16, tp=2), gpus_per_node=8)  # the plan of a picture needs no matplotlib
    with pytest.raises(ImportError, match="hypergrid\\[viz\\]"):
        write_picture(pic, tmp_path / "p.svg")


def test_unwritable_picture_path_is_one_line_exit_2(tmp_path, capsys):
    argv = ["plan", "--world-size", "16", "--tp", "2"]
    assert cli.main(argv + ["--png", "/nonexistent/dir/x.png"]) == 2
    assert "/nonexistent/dir/x.png" in _one_error_line(capsys)
    assert cli.main(argv + ["--svg", str(tmp_path)]) == 2  # a folder: open() itself fails
    err = capsys.readouterr().err
    assert err.startswith(f"hypergrid: error: --svg {tmp_path}: cannot write it") and err.count("\n") == 1
