"""Figures ready for a paper (issue 16, item 6): Fig. 4 shades the query block and may annotate
its minimum, colour maps show no seams in SVG, latent frame 0 stays visible on the video axis,
probability maps are linear unless they span more than a decade, legends cover no data, compare
figures adapt to one prompt or one checkpoint, titles can leave the run out, and the maps of a
run's layers share one colour scale."""

from __future__ import annotations

import runpy
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import matplotlib.colors as mcolors
import numpy as np
import pytest
from matplotlib.collections import PolyCollection, QuadMesh
from matplotlib.text import Annotation, Text

from sinkscope.analysis import plots

from .test_plots import make_frame_dataset, numpy_last_block, svg_texts, write_store
from .test_policy_figures import make_table
from .workflowtools import REPO, Named

SVG = "{http://www.w3.org/2000/svg}"
SMALL = {"num_heads": 2, "block_sizes": [3, 3, 3]}  # 9 latent frames, fast to draw


def data_range(ax, artist) -> tuple[float, float]:
    """The x range an artist covers, in data units."""
    box = artist.get_window_extent().transformed(ax.transData.inverted())
    return box.x0, box.x1


def block_bands(ax) -> list:
    return [patch for patch in ax.patches if patch.get_label() == "_query block"]


# --------------------------------------------------------------------------------------------
# figure 4


@pytest.mark.parametrize(
    ("block_sizes", "frame_axis", "expected"),
    [
        ([3] * 7, "latent", (17.5, 20.5)),  # latents 18-20
        ([3] * 7, "video", (68.5, 80.5)),  # latents 18-20 = video frames 69-80
        ([1, 3, 3], "latent", (3.5, 6.5)),  # an independent first frame: the last block is 4-6
    ],
)
def test_figure4_shades_the_query_block(block_sizes, frame_axis, expected):
    ds = make_frame_dataset(num_heads=2, block_sizes=block_sizes)
    fig = plots.plot_figure4([ds], [(0, 0), (0, 1)], frame_axis=frame_axis)
    fig.draw_without_rendering()
    for ax in fig.axes:
        (band,) = block_bands(ax)
        assert data_range(ax, band) == pytest.approx(expected, abs=1e-6)
        assert band.get_zorder() < min(line.get_zorder() for line in ax.lines)  # behind the data
    (legend,) = fig.legends
    last = expected_frames = plots._query_block(ds)
    assert expected_frames == list(range(last[0], last[-1] + 1))
    assert f"latent {last[0]}–{last[-1]}" in legend.get_texts()[0].get_text()
    # The title still names the query set.
    assert f"last block: query frames {last[0]}–{last[-1]} (latent)" in fig.get_suptitle()


def annotations(ax) -> dict[str, Annotation]:
    return {t.get_text().split()[0]: t for t in ax.texts if isinstance(t, Annotation)}


@pytest.mark.parametrize("measure", ["logits", "probabilities"])
def test_figure4_annotates_the_minimum_on_request(measure):
    ds = make_frame_dataset(seed=2, **SMALL)
    variable = plots.MEASURE_VARIABLES[measure]
    expected = numpy_last_block(ds, variable, 0)[1]

    (ax,) = plots.plot_figure4([ds], [(0, 1)], measure=measure).axes
    assert set(annotations(ax)) == {"max"}  # the default: as before

    fig = plots.plot_figure4([ds], [(0, 1)], measure=measure, annotate=["max", "min"])
    (ax,) = fig.axes
    marks = annotations(ax)
    assert set(marks) == {"max", "min"}
    low = int(np.argmin(expected))
    assert marks["min"].xy == pytest.approx((low, expected.min()))
    assert f"{expected.min():.3g}" in marks["min"].get_text()
    assert f"frame {low}" in marks["min"].get_text()
    # The label sits below the bars, in room made under them: it covers no bar.
    fig.draw_without_rendering()
    label = Text.get_window_extent(marks["min"])  # the text alone, not its leader line
    bars = [bar.get_window_extent() for bar in ax.containers[0] if np.isfinite(bar.get_height())]
    assert not any(label.overlaps(bar) for bar in bars)
    assert ax.get_window_extent().contains(label.x0, label.y0)

    with pytest.raises(ValueError, match="annotate"):
        plots.plot_figure4([ds], [(0, 1)], annotate=["median"])


# --------------------------------------------------------------------------------------------
# vector maps without seams


def mesh_styles(path: Path) -> list[dict[str, str]]:
    """The style of every cell of every colour map (and colorbar) in an SVG."""
    root = ET.parse(path).getroot()
    styles = []
    for group in root.iter(f"{SVG}g"):
        if group.get("id", "").startswith("QuadMesh"):
            for cell in group.iter(f"{SVG}path"):
                style = dict(
                    item.split(":", 1) for item in cell.get("style", "").split(";") if ":" in item
                )
                styles.append({key.strip(): value.strip() for key, value in style.items()})
    return styles


@pytest.mark.parametrize("builder", ["plot_heads_heatmap", "plot_frame_maps"])
def test_map_cells_overlap_so_no_seams_show(tmp_path, builder):
    """Vector viewers antialias each cell's edge on its own, which leaves hairline seams between
    cells drawn without a stroke: every cell, colorbar segments included, is stroked in its own
    colour, and the file stays vector."""
    ds = make_frame_dataset(**SMALL)
    fig = getattr(plots, builder)(ds, measure="probabilities")
    path = plots.save_figure(fig, tmp_path / "map.svg")
    root = ET.parse(path).getroot()
    assert not list(root.iter(f"{SVG}image")), "the map must stay vector"
    groups = [g for g in root.iter(f"{SVG}g") if g.get("id", "").startswith("QuadMesh")]
    assert len(groups) >= 2  # the map(s) and the colorbar
    styles = mesh_styles(path)
    colorbar = [g for g in groups][-1]
    assert len(list(colorbar.iter(f"{SVG}path"))) > 50  # the colorbar's segments are checked too
    for style in styles:
        assert style.get("stroke") == style["fill"], style
        assert float(style.get("stroke-width", 0)) > 0, style


# --------------------------------------------------------------------------------------------
# latent frame 0 on the video axis


def test_latent_frame_0_is_drawn_as_wide_as_a_latent_on_the_video_axis():
    ds = make_frame_dataset(**SMALL)
    edges = plots.frame_edges(9, "video")
    assert np.diff(edges)[0] == 4 and edges[1] == 0.5  # ends where latent 1 (frames 1-4) starts
    (ax,) = plots.plot_figure4([ds], [(0, 1)], frame_axis="video").axes
    widths = [bar.get_width() for bar in ax.containers[0]]
    assert widths[0] >= 3 and widths[0] == pytest.approx(widths[1])
    maps = plots.plot_frame_maps(ds, frame_axis="video")
    mesh = next(c for c in maps.axes[0].collections if isinstance(c, QuadMesh))
    corners = mesh.get_coordinates()  # (rows + 1, columns + 1, 2)
    assert corners[0, 1, 0] - corners[0, 0, 0] == 4  # key frame 0
    assert corners[1, 0, 1] - corners[0, 0, 1] == 4  # query frame 0
    # Latent 0 as one video frame would be a quarter of that: the latent axis is unchanged.
    assert np.all(np.diff(plots.frame_edges(9, "latent")) == 1)


# --------------------------------------------------------------------------------------------
# linear or log colour scale


def test_probabilities_are_linear_unless_they_span_a_decade():
    narrow = np.array([[0.04, 0.05], [0.3, np.nan]])
    _, norm, shown = plots._color_scale(narrow, "probabilities")
    assert type(norm) is mcolors.Normalize
    assert (norm.vmin, norm.vmax) == (0.0, pytest.approx(0.3))
    np.testing.assert_array_equal(shown, narrow)

    wide = np.array([[0.001, 0.05], [0.3, 0.0]])
    _, norm, shown = plots._color_scale(wide, "probabilities")
    assert isinstance(norm, mcolors.LogNorm)
    assert (norm.vmin, norm.vmax) == (pytest.approx(0.001), pytest.approx(0.3))
    assert shown[1, 1] == pytest.approx(0.001)  # an exact 0 is not mistaken for an unseen tile

    _, norm, _ = plots._color_scale(np.array([-0.5, 2.0]), "logits")
    assert (norm.vmin, norm.vmax) == (-2.0, 2.0)


def test_frame_maps_pick_the_scale_by_the_data():
    ds = make_frame_dataset(**SMALL)
    values = ds["prob_mass"].values[0]
    positive = values[np.isfinite(values) & (values > 0)]
    assert positive.max() / positive.min() > 10  # the synthetic maps span more than a decade
    mesh = next(c for c in plots.plot_frame_maps(ds, measure="probabilities").axes[0].collections)
    assert isinstance(mesh.norm, mcolors.LogNorm)

    flat = ds.copy()
    flat["prob_mass"] = ds["prob_mass"] * 0 + np.float32(0.1) + 0.05 * np.isfinite(ds["prob_mass"])
    flat["prob_mass"] = flat["prob_mass"].where(np.isfinite(ds["prob_mass"]))
    flat["prob_mass"][0, 0, -1, -1] = np.float32(0.2)
    mesh = next(c for c in plots.plot_frame_maps(flat, measure="probabilities").axes[0].collections)
    assert type(mesh.norm) is mcolors.Normalize and mesh.norm.vmin == 0


# --------------------------------------------------------------------------------------------
# legends


def overlapping_legends(fig) -> list[str]:
    """Legends whose box overlaps a panel (with its title, labels and ticks) or a figure text
    (title, shared axis label)."""
    fig.draw_without_rendering()
    renderer = fig._get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    boxes += [text.get_window_extent(renderer) for text in fig.texts if text.get_text()]
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [
        legend.get_texts()[0].get_text()
        for legend in legends
        for box in boxes
        if legend.get_window_extent(renderer).overlaps(box)
    ]


def compare_datasets(prompts=("cat", "sea"), checkpoints=("self_forcing", "causvid")):
    return [
        make_frame_dataset(checkpoint, prompt, 0, seed=10 * c + p, **SMALL)
        for c, checkpoint in enumerate(checkpoints)
        for p, prompt in enumerate(prompts)
    ]


def test_legends_cover_no_panel():
    run = [make_frame_dataset(layer=layer, seed=layer, **SMALL) for layer in (0, 1)]
    datasets = compare_datasets()
    figs = {
        "figure4": plots.plot_figure4(run, [(0, 0), (1, 1)]),
        "heads_grid": plots.plot_heads_grid(run[0]),
        "layer_comparison": plots.plot_layer_comparison(run),
        "statistics": plots.plot_statistics(run),
        "checkpoints": plots.plot_checkpoints(datasets, [(0, 0), (0, 1)]),
        "prompts": plots.plot_prompts(datasets, [(0, 0), (0, 1)]),
        "passes": plots.plot_passes(datasets, [(0, 0)]),
    }
    for name, fig in figs.items():
        assert fig.legends, f"{name} has no legend"
        assert not overlapping_legends(fig), f"a legend of {name} covers a panel"


# --------------------------------------------------------------------------------------------
# one prompt, one checkpoint


def test_prompts_with_one_prompt_draw_one_line_without_band(tmp_path):
    one = compare_datasets(prompts=("cat",))
    fig = plots.plot_prompts(one, [(0, 0)])
    (ax,) = fig.axes
    assert not [c for c in ax.collections if isinstance(c, PolyCollection)]  # no band
    assert len(ax.lines) == 2  # one line per checkpoint, no thin prompt lines under it
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["self_forcing: 1 prompt (cat)", "causvid: 1 prompt (cat)"]
    stores = [write_store(tmp_path / "frames", ds) for ds in one]
    out = tmp_path / "compare"
    plots.render_figures(stores, [out / "prompts.svg", out / "checkpoints.svg"], heads=[(0, 0)])
    for name in ("prompts.svg", "checkpoints.svg"):
        texts = " ".join(svg_texts(out / name))
        assert "of 1 prompts" not in texts and "1 prompts" not in texts
        assert "1 prompt" in texts

    several = plots.plot_prompts(compare_datasets(), [(0, 0)])
    (ax,) = several.axes
    assert len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 2  # the bands
    labels = [t.get_text() for t in several.legends[0].get_texts()]
    assert labels == [f"{c}: mean, min–max of 2 prompts" for c in ("self_forcing", "causvid")]


def test_checkpoints_with_one_checkpoint_name_it():
    fig = plots.plot_checkpoints(compare_datasets(checkpoints=("causvid",)), [(0, 0)])
    assert fig.get_suptitle().startswith("Checkpoint causvid, mean over prompts")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["causvid (mean of 2 prompts)"]
    fig = plots.plot_checkpoints(compare_datasets(), [(0, 0)])
    assert fig.get_suptitle().startswith("Checkpoints, mean over prompts")


# --------------------------------------------------------------------------------------------
# titles without the run


RUN_WORDS = ("ckptA", "promptB", "t=1000")


def run_texts(path: Path) -> list[str]:
    return [t for t in svg_texts(path) if any(word in t for word in RUN_WORDS)]


def test_titles_option_leaves_the_run_out(tmp_path):
    datasets = [
        make_frame_dataset("ckptA", "promptB", layer, seed=layer, **SMALL) for layer in (0, 1)
    ]
    stores = [write_store(tmp_path / "frames", ds) for ds in datasets]
    names = ["figure4", "layer0_heads_grid", "layer0_heads_heatmap", "layer0_frame_maps"]
    names += ["layer_comparison", "statistics"]
    for titles in (True, False):
        out = tmp_path / f"titles_{titles}"
        outputs = [out / f"{name}.svg" for name in names]
        plots.render_figures(stores, outputs, heads=[(0, 0), (1, 1)], titles=titles)
        for path in outputs:
            assert bool(run_texts(path)) == titles, (path.name, run_texts(path))
    # What a figure shows stays: the query set, the layer.
    texts = svg_texts(tmp_path / "titles_False" / "figure4.svg")
    assert "Last block: query frames 6–8 (latent)" in texts
    assert "Layer 0, last-block profile" in svg_texts(
        tmp_path / "titles_False" / "layer0_heads_heatmap.svg"
    )

    compare = plots.plot_checkpoints(datasets, [(0, 0)], titles=False)
    assert "t=1000" not in compare.get_suptitle()
    survey = plots.plot_survey_first_frame(datasets, titles=False)
    assert not any(word in survey.get_suptitle() for word in RUN_WORDS)
    table = make_table(checkpoint="ckptA", prompt="promptB")
    for builder in (plots.plot_policy_recall, plots.plot_policy_map):
        title = builder(table, titles=False).get_suptitle()
        assert not any(word in title for word in ("ckptA", "promptB", "t=1000", "step 0")), title
        assert "V = 6 visible frames" in title
        assert "ckptA · promptB" in builder(table).get_suptitle()


def test_figures_script_passes_the_paper_options(tmp_path):
    ds = make_frame_dataset("ckptA", "promptB", 0, **SMALL)
    store = write_store(tmp_path / "frames", ds)
    out = tmp_path / "figures"
    options = {"heads": [[0, 1]], "measure": "logits", "frame_axis": "latent", "step": 0}
    options |= {"titles": False, "annotate": ["max", "min"], "shared_scale": True}
    snakemake = SimpleNamespace(
        input=Named(frames=[str(store)]),
        output=Named([str(out / "figure4.svg")]),
        log=Named([str(tmp_path / "figures.log")]),
        params=Named(figures=options),
    )
    runpy.run_path(str(REPO / "scripts" / "figures.py"), init_globals={"snakemake": snakemake})
    assert not run_texts(out / "figure4.svg")
    assert any(t.startswith("min ") for t in svg_texts(out / "figure4.svg"))


# --------------------------------------------------------------------------------------------
# one colour scale across compared panels


def drawn_limits(monkeypatch) -> dict[str, tuple[float, float]]:
    """Record the colour limits of the first map of each figure render_figures saves."""
    limits: dict[str, tuple[float, float]] = {}
    save = plots.save_figure

    def record(fig, path, fmt="svg"):
        mesh = next(c for ax in fig.axes for c in ax.collections if isinstance(c, QuadMesh))
        limits[Path(path).stem] = (mesh.norm.vmin, mesh.norm.vmax)
        return save(fig, path, fmt)

    monkeypatch.setattr(plots, "save_figure", record)
    return limits


@pytest.mark.parametrize("measure", ["logits", "probabilities"])
def test_layers_share_one_colour_scale(tmp_path, monkeypatch, measure):
    datasets = [make_frame_dataset(layer=layer, seed=layer, **SMALL) for layer in (0, 3)]
    stores = [write_store(tmp_path / "frames", ds) for ds in datasets]
    kinds = ("heads_heatmap", "frame_maps")
    outputs = [tmp_path / f"layer{layer}_{kind}.svg" for layer in (0, 3) for kind in kinds]
    limits = drawn_limits(monkeypatch)
    plots.render_figures(stores, outputs, heads=[(0, 0)], measure=measure)
    variable = plots.MEASURE_VARIABLES[measure]
    pooled = {
        "heads_heatmap": np.concatenate(
            [plots.last_block_profile(ds, measure, 0).values.ravel() for ds in datasets]
        ),
        "frame_maps": np.concatenate([ds[variable].values[0].ravel() for ds in datasets]),
    }
    for kind in kinds:
        assert limits[f"layer0_{kind}"] == limits[f"layer3_{kind}"]
        expected = plots.color_limits(pooled[kind], measure)
        if measure == "probabilities" and not plots.log_scaled(expected):
            expected = (0.0, expected[1])
        assert limits[f"layer0_{kind}"] == pytest.approx(expected)

    # Each file its own scale on request: layer 3's sink heads are stronger than layer 0's.
    limits.clear()
    maps = [path for path in outputs if path.stem.endswith("frame_maps")]
    plots.render_figures(stores, maps, heads=[(0, 0)], measure=measure, shared_scale=False)
    assert limits["layer0_frame_maps"] != limits["layer3_frame_maps"]


def test_passes_share_the_y_axis_across_checkpoints_of_a_head():
    fig = plots.plot_passes(compare_datasets(), [(0, 0), (0, 1)])
    rows = np.array(fig.axes).reshape(2, 2)
    for row in rows:
        assert row[0].get_ylim() == row[1].get_ylim()
    assert rows[0][0].get_ylim() != rows[1][0].get_ylim()  # heads keep their own


def test_passes_of_a_one_pass_token_layer_beside_a_surveyed_layer():
    """`capture.token_passes: 0` beside a survey: layer 0's frame datasets (from token stores)
    hold step 0 alone, layer 1's every step. Each panel draws the steps its datasets hold, and a
    step keeps one colour in every panel."""
    one_pass = [
        make_frame_dataset("sf", prompt, 0, seed=p, **SMALL).isel(step=[0])
        for p, prompt in enumerate(("cat", "sea"))
    ]
    every_pass = [
        make_frame_dataset("sf", prompt, 1, seed=5 + p, **SMALL)
        for p, prompt in enumerate(("cat", "sea"))
    ]
    fig = plots.plot_passes(one_pass + every_pass, [(0, 0), (1, 0)])
    token_panel, survey_panel = fig.axes
    assert len(token_panel.lines) == 1
    assert len(survey_panel.lines) == every_pass[0].sizes["step"] > 1
    assert token_panel.lines[0].get_label() == survey_panel.lines[0].get_label()
    assert token_panel.lines[0].get_color() == survey_panel.lines[0].get_color()
    colors = [line.get_color() for line in survey_panel.lines]
    assert len({str(c) for c in colors}) == len(colors)  # one colour per step
