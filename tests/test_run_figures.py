"""The figures of one run (family `sinkscope.analysis.plots.run`): Deep Forcing Fig. 4, heads
grid, heads heatmap, frame maps, layer comparison and statistics, drawn from synthetic frame
datasets (Contract 2): files, text, and the plotted numbers against numpy and the statistics CSV
(Contract 3); the paper options (query block shaded, minimum annotated, seam-free vector maps,
latent frame 0 wide on the video axis, linear or log scales, one colour scale across layers,
legends off the data, the key versions of a rolling run marked); probabilities beside logits in
the headline figures, sink scores with units, and the heads a summary over heads would hide."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.colors as mcolors
import numpy as np
import pytest
from matplotlib.collections import QuadMesh
from matplotlib.container import BarContainer
from matplotlib.text import Annotation, Text

from sinkscope import frames
from sinkscope.analysis import stats
from sinkscope.analysis.plots import render, render_figures
from sinkscope.analysis.plots.common import (
    ANCHOR_LABEL,
    LOGIT_CMAP,
    MEASURE_VARIABLES,
    PROBABILITY_CMAP,
    PROFILE_LABELS,
    UNSEEN_COLOR,
    color_limits,
    frame_edges,
    log_scaled,
    marks_key_versions,
    save_figure,
    version_label,
)
from sinkscope.analysis.plots.run import (
    MAP_LABELS,
    plot_figure4,
    plot_frame_maps,
    plot_heads_grid,
    plot_heads_heatmap,
    plot_layer_comparison,
    plot_statistics,
)
from sinkscope.analysis.plots.run_data import head_statistics, query_block
from sinkscope.analysis.plots.run_profile import ANCHOR_COLOR, BAR_COLOR, UNIFORM_LABEL

from .figurefixtures import (
    SMALL,
    SVG,
    figure_texts,
    make_frame_dataset,
    mesh_styles,
    numpy_last_block,
    overlapping_legends,
    run_outputs,
    svg_has_raster,
    svg_texts,
    with_key_versions,
    write_store,
)


def profile_panels(fig, measure: str) -> list:
    """The panels of figure4 that draw `measure` (their y label says which), in drawing order."""
    return [ax for ax in fig.axes if ax.get_ylabel() == PROFILE_LABELS[measure]]


def map_panels(fig, measure: str) -> list:
    """The head panels of frame maps that draw `measure` (their title ends with its name)."""
    return [ax for ax in fig.axes if ax.get_title().endswith(f" {measure}")]


def test_sink_score_uses_frames_between_first_and_last_visible():
    # A local window with sink frames: the last block sees frames 0-2 and the latest ones only.
    ds = make_frame_dataset(local_attn_size=9, sink_size=3, seed=5)
    expected = numpy_last_block(ds, "logit_mean", 0)
    visible = np.flatnonzero(np.isfinite(expected[0]))
    assert visible[0] == 0 and visible[-1] == 20 and np.isnan(expected[0, 5])
    middle = np.nanmean(expected[:, 1:20], axis=1)
    parts = head_statistics(ds, "logits", 0)
    np.testing.assert_allclose(parts["first"], expected[:, 0], rtol=1e-6)
    np.testing.assert_allclose(parts["middle"], middle, rtol=1e-6)
    np.testing.assert_allclose(parts["last"], expected[:, 20], rtol=1e-6)
    np.testing.assert_allclose(parts["sink_score"], expected[:, 0] - middle, rtol=1e-5)


@pytest.mark.parametrize(
    ("measure", "variable"), [("logits", "logit_mean"), ("probabilities", "prob_mass")]
)
def test_figure4_plots_the_last_block_profile_and_its_max(measure, variable):
    datasets = [make_frame_dataset(layer=0, seed=1), make_frame_dataset(layer=1, seed=2)]
    heads = [(0, 0), (1, 3)]
    fig = plot_figure4(datasets, heads, measure=measure, step=2)
    panels = profile_panels(fig, measure)
    assert fig.axes[:2] == panels  # the measure asked for first
    assert [ax.get_title() for ax in panels] == ["L0H0", "L1H3"]
    for ax, (layer, head) in zip(panels, heads, strict=True):
        expected = numpy_last_block(datasets[layer], variable, 2)[head]
        heights = [patch.get_height() for patch in ax.containers[0]]
        np.testing.assert_allclose(heights, expected, rtol=1e-6)
        np.testing.assert_allclose(ax.lines[0].get_ydata(), expected, rtol=1e-6)
        (annotation,) = [t for t in ax.texts if isinstance(t, Annotation)]
        peak = int(np.argmax(expected))
        assert annotation.xy == pytest.approx((peak, expected.max()))
        assert f"{expected.max():.3g}" in annotation.get_text()
        assert f"frame {peak}" in annotation.get_text()
        assert ax.get_xlabel() == "Key frame (latent)"
        assert ax.get_ylabel() == PROFILE_LABELS[measure]
    assert "demo · cat · t=833.33" in fig.texts[0].get_text()


def test_figure4_svg_text_names_heads_zero_based(tmp_path):
    datasets = [make_frame_dataset(layer=layer, num_heads=10) for layer in (0, 4)]
    fig = plot_figure4(datasets, [(0, 0), (4, 9)])
    path = save_figure(fig, tmp_path / "figure4.svg")
    texts = svg_texts(path)
    assert "L0H0" in texts and "L4H9" in texts
    assert "Key frame (latent)" in texts and PROFILE_LABELS["logits"] in texts
    assert any("demo" in t and "cat" in t and "t=1000" in t for t in texts)
    assert "Arial" in path.read_text()
    assert not svg_has_raster(path)


def data_range(ax, artist) -> tuple[float, float]:
    """The x range an artist covers, in data units."""
    box = artist.get_window_extent().transformed(ax.transData.inverted())
    return box.x0, box.x1


def block_bands(ax) -> list:
    return [patch for patch in ax.patches if patch.get_label() == "_query block"]


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
    fig = plot_figure4([ds], [(0, 0), (0, 1)], frame_axis=frame_axis)
    fig.draw_without_rendering()
    for ax in fig.axes:
        (band,) = block_bands(ax)
        assert data_range(ax, band) == pytest.approx(expected, abs=1e-6)
        assert band.get_zorder() < min(line.get_zorder() for line in ax.lines)  # behind the data
    (legend,) = fig.legends
    last = expected_frames = query_block(ds)
    assert expected_frames == list(range(last[0], last[-1] + 1))
    assert f"latent {last[0]}–{last[-1]}" in legend.get_texts()[0].get_text()
    # The title still names the query set.
    assert f"last block: query frames {last[0]}–{last[-1]} (latent)" in fig.get_suptitle()


def annotations(ax) -> dict[str, Annotation]:
    return {t.get_text().split()[0]: t for t in ax.texts if isinstance(t, Annotation)}


@pytest.mark.parametrize("measure", ["logits", "probabilities"])
def test_figure4_annotates_the_minimum_on_request(measure):
    ds = make_frame_dataset(seed=2, **SMALL)
    variable = MEASURE_VARIABLES[measure]
    expected = numpy_last_block(ds, variable, 0)[1]

    (ax,) = profile_panels(plot_figure4([ds], [(0, 1)], measure=measure), measure)
    assert set(annotations(ax)) == {"max"}  # the default: as before

    fig = plot_figure4([ds], [(0, 1)], measure=measure, annotate=["max", "min"])
    (ax,) = profile_panels(fig, measure)
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
        plot_figure4([ds], [(0, 1)], annotate=["median"])


def test_video_frame_axis_spreads_21_latents_over_81_frames():
    ds = make_frame_dataset()
    fig = plot_figure4([ds], [(0, 1)], frame_axis="video")
    (ax,) = profile_panels(fig, "logits")
    centers = [patch.get_x() + patch.get_width() / 2 for patch in ax.containers[0]]
    # Latents 1..20 sit at the centres of their 4 video frames; latent 0 (video frame 0 alone)
    # is drawn as wide as they are, in the cell -3.5..0.5 that ends where latent 1 starts.
    np.testing.assert_allclose(centers[1:], frames.video_frame_centers(21)[1:])
    assert centers[0] == -1.5 and centers[1] == 2.5 and 78 < centers[-1] <= 80
    assert ax.get_xlim() == pytest.approx((-3.5, 80.5))
    assert ax.get_xlabel() == "Key frame (video)"
    edges = frame_edges(21, "video")
    assert edges[0] == -3.5 and edges[1] == 0.5 and edges[-1] == 80.5
    assert np.all(np.diff(edges) == 4)

    maps = plot_frame_maps(ds, frame_axis="video")
    mesh = next(c for c in maps.axes[0].collections if isinstance(c, QuadMesh))
    corners = mesh.get_coordinates()
    assert corners[..., 0].min() == -3.5 and corners[..., 0].max() == 80.5
    assert "Query frame (video)" in figure_texts(maps)


def test_latent_frame_0_is_drawn_as_wide_as_a_latent_on_the_video_axis():
    ds = make_frame_dataset(**SMALL)
    edges = frame_edges(9, "video")
    assert np.diff(edges)[0] == 4 and edges[1] == 0.5  # ends where latent 1 (frames 1-4) starts
    (ax,) = profile_panels(plot_figure4([ds], [(0, 1)], frame_axis="video"), "logits")
    widths = [bar.get_width() for bar in ax.containers[0]]
    assert widths[0] >= 3 and widths[0] == pytest.approx(widths[1])
    maps = plot_frame_maps(ds, frame_axis="video")
    mesh = next(c for c in maps.axes[0].collections if isinstance(c, QuadMesh))
    corners = mesh.get_coordinates()  # (rows + 1, columns + 1, 2)
    assert corners[0, 1, 0] - corners[0, 0, 0] == 4  # key frame 0
    assert corners[1, 0, 1] - corners[0, 0, 1] == 4  # query frame 0
    # Latent 0 as one video frame would be a quarter of that: the latent axis is unchanged.
    assert np.all(np.diff(frame_edges(9, "latent")) == 1)


def test_frame_maps_grey_unseen_symmetric_logits_log_probabilities():
    ds = make_frame_dataset()
    grey = mcolors.to_rgba(UNSEEN_COLOR)
    unseen = np.isnan(ds["logit_mean"].values[0])  # (head, query, key)
    assert unseen.any()

    fig = plot_frame_maps(ds, measure="logits")
    meshes = [c for ax in fig.axes[:4] for c in ax.collections if isinstance(c, QuadMesh)]
    assert len(meshes) == 4
    limit = np.nanmax(np.abs(ds["logit_mean"].values[0]))
    for head, mesh in enumerate(meshes):
        assert mesh.norm.vmin == pytest.approx(-limit) and mesh.norm.vmax == pytest.approx(limit)
        assert mesh.cmap.get_bad() == pytest.approx(grey)
        shown = np.ma.getmaskarray(mesh.get_array()).reshape(21, 21)
        np.testing.assert_array_equal(shown, unseen[head])
    assert [ax.get_title() for ax in fig.axes[:4]] == [f"L0H{h} logits" for h in range(4)]

    fig = plot_frame_maps(ds, measure="probabilities")
    meshes = [c for ax in fig.axes[:4] for c in ax.collections if isinstance(c, QuadMesh)]
    for head, mesh in enumerate(meshes):
        assert isinstance(mesh.norm, mcolors.LogNorm)
        assert mesh.cmap.get_bad() == pytest.approx(grey)
        np.testing.assert_array_equal(
            np.ma.getmaskarray(mesh.get_array()).reshape(21, 21), unseen[head]
        )


def test_frame_maps_pick_the_scale_by_the_data():
    ds = make_frame_dataset(**SMALL)
    values = ds["prob_mass"].values[0]
    positive = values[np.isfinite(values) & (values > 0)]
    assert positive.max() / positive.min() > 10  # the synthetic maps span more than a decade
    mesh = next(c for c in plot_frame_maps(ds, measure="probabilities").axes[0].collections)
    assert isinstance(mesh.norm, mcolors.LogNorm)

    flat = ds.copy()
    flat["prob_mass"] = ds["prob_mass"] * 0 + np.float32(0.1) + 0.05 * np.isfinite(ds["prob_mass"])
    flat["prob_mass"] = flat["prob_mass"].where(np.isfinite(ds["prob_mass"]))
    flat["prob_mass"][0, 0, -1, -1] = np.float32(0.2)
    mesh = next(c for c in plot_frame_maps(flat, measure="probabilities").axes[0].collections)
    assert type(mesh.norm) is mcolors.Normalize and mesh.norm.vmin == 0


def without_probabilities(ds):
    """`ds` as a frame dataset reduced without token logits holds it: probabilities all NaN."""
    ds = ds.copy()
    ds["prob_mass"] = ds["prob_mass"] * np.nan
    return ds


def test_figure4_shows_probabilities_beside_logits():
    """A sink reads as a share of the attention: under the logit panels the same heads in
    probability, the uniform share 1 / V marked and the maximum in multiples of it (L0H0's
    frame 0 is a pale +3.4 logit beside a loud -10, and 0.66 of the mass, 13.8x uniform)."""
    ds = make_frame_dataset(layer=0, seed=1)
    heads = [(0, 0), (0, 3)]
    fig = plot_figure4([ds], heads)
    logits, probabilities = profile_panels(fig, "logits"), profile_panels(fig, "probabilities")
    assert fig.axes == [*logits, *probabilities]
    assert [ax.get_title() for ax in probabilities] == ["L0H0", "L0H3"]
    for ax, (_, head) in zip(probabilities, heads, strict=True):
        expected = numpy_last_block(ds, "prob_mass", 0)[head]
        visible = int(np.isfinite(expected).sum())
        np.testing.assert_allclose(
            [bar.get_height() for bar in ax.containers[0]], expected, rtol=1e-6
        )
        (uniform,) = [line for line in ax.lines if line.get_label() == "_uniform share"]
        np.testing.assert_allclose(uniform.get_ydata(), 1 / visible)
        peak = int(np.nanargmax(expected))
        text = annotations(ax)["max"].get_text()
        assert (
            text
            == f"max {expected[peak]:.3g}, frame {peak}\n{expected[peak] * visible:.3g}x uniform"
        )
    for ax in logits:  # a logit has no uniform share
        assert not [line for line in ax.lines if line.get_label() == "_uniform share"]
        assert "uniform" not in annotations(ax)["max"].get_text()
    assert UNIFORM_LABEL in legend_labels(fig)

    # Probabilities asked for lead; a dataset without them draws its logits alone.
    fig = plot_figure4([ds], heads, measure="probabilities")
    assert fig.axes == [*profile_panels(fig, "probabilities"), *profile_panels(fig, "logits")]
    fig = plot_figure4([without_probabilities(ds)], heads)
    assert fig.axes == profile_panels(fig, "logits") and len(fig.axes) == 2
    assert UNIFORM_LABEL not in legend_labels(fig)


def panel_mesh(ax) -> np.ndarray:
    """The values a map panel draws, NaN where masked (unseen)."""
    (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
    return np.ma.filled(np.ma.asarray(mesh.get_array(), dtype=float), np.nan)


def test_heads_heatmap_and_frame_maps_show_probabilities_beside_logits():
    ds = make_frame_dataset(layer=2, **SMALL)
    heatmap = plot_heads_heatmap(ds)
    panels = {ax.get_title(): ax for ax in heatmap.axes if ax.get_title()}
    assert list(panels) == ["Attention logits", "Attention probabilities"]
    for title, variable in (
        ("Attention logits", "logit_mean"),
        ("Attention probabilities", "prob_mass"),
    ):
        expected = numpy_last_block(ds, variable, 0)
        np.testing.assert_allclose(
            panel_mesh(panels[title]).reshape(expected.shape), expected, rtol=1e-6
        )
    labels = [ax.get_ylabel() for ax in heatmap.axes if not ax.get_title()]  # the colour bars
    assert [label.replace("\n", " ") for label in labels] == list(PROFILE_LABELS.values())

    maps = plot_frame_maps(ds, measure="probabilities")
    for measure, variable in (("probabilities", "prob_mass"), ("logits", "logit_mean")):
        panels = map_panels(maps, measure)
        assert [ax.get_title() for ax in panels] == [f"L2H{h} {measure}" for h in (0, 1)]
        for head, ax in enumerate(panels):
            expected = ds[variable].values[0, head]
            np.testing.assert_allclose(panel_mesh(ax).reshape(expected.shape), expected, rtol=1e-6)
    assert maps.axes[0] is map_panels(maps, "probabilities")[0]  # the measure asked for first
    texts = figure_texts(maps)
    assert MAP_LABELS["logits"] in texts and MAP_LABELS["probabilities"] in texts

    # Without probabilities (a frame dataset reduced without token logits): logits alone.
    alone = without_probabilities(ds)
    assert [ax.get_title() for ax in plot_heads_heatmap(alone).axes if ax.get_title()] == []
    assert [ax.get_title() for ax in plot_frame_maps(alone).axes[:2]] == ["L2H0", "L2H1"]


@pytest.mark.parametrize("builder", [plot_heads_heatmap, plot_frame_maps], ids=lambda b: b.__name__)
def test_map_cells_overlap_so_no_seams_show(tmp_path, builder):
    """Vector viewers antialias each cell's edge on its own, which leaves hairline seams between
    cells drawn without a stroke: every cell, colorbar segments included, is stroked in its own
    colour, and the file stays vector."""
    ds = make_frame_dataset(**SMALL)
    fig = builder(ds, measure="probabilities")
    path = save_figure(fig, tmp_path / "map.svg")
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


def test_layer_comparison_and_statistics_values():
    datasets = [make_frame_dataset(layer=0, seed=1), make_frame_dataset(layer=1, seed=2)]
    fig = plot_layer_comparison(datasets)
    (ax,) = fig.axes
    means = {line.get_label(): line for line in ax.lines if line.get_label().startswith("Layer")}
    for line, ds in zip(means.values(), datasets, strict=True):
        np.testing.assert_allclose(
            line.get_ydata(), numpy_last_block(ds, "logit_mean", 0).mean(axis=0), rtol=1e-6
        )
    # The legend sits under the panel, outside the data.
    assert ax.get_legend() is None
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["Layer 0", "Layer 1", "one head"]

    fig = plot_statistics(datasets)
    (ax,) = fig.axes
    first_bars, middle_bars, _ = [c for c in ax.containers if isinstance(c, BarContainer)]
    for i, ds in enumerate(datasets):
        profile = numpy_last_block(ds, "logit_mean", 0)
        assert first_bars[i].get_height() == pytest.approx(profile[:, 0].mean(), rel=1e-6)
        middle = profile[:, 1:-1].mean(axis=1).mean()
        assert middle_bars[i].get_height() == pytest.approx(middle, rel=1e-6)


def score_text(value: float, decimals: int) -> str:
    """A sink score as the titles print it, written out here: sign, decimals, a minus sign."""
    text = f"{value:+.{decimals}f}"
    if float(text) == 0:
        return f"{0:.{decimals}f}"
    return text.replace("-", "\u2212")


def planted_run() -> list:
    """Layers 0 and 2 of a run; in layer 2 head 3's attention fifty times the others' (the
    demo's planted L2H3), the others spread evenly (none of them stands apart)."""
    plain = make_frame_dataset(layer=0, num_heads=6, seed=1)
    planted = make_frame_dataset(layer=2, num_heads=6, seed=2)
    planted["logit_mean"][:, 3] = planted["logit_mean"][:, 3] * 50
    return [plain, planted]


def test_statistics_draw_every_head_and_name_the_one_apart():
    """Mean and std over heads buried a planted head: every head is a dot of its layer's
    first, middle and last bars, and the planted head, apart from the others, is named."""
    datasets = planted_run()
    (ax,) = plot_statistics(datasets).axes
    dots = {line.get_label(): line for line in ax.lines if line.get_label().startswith("_heads")}
    assert list(dots) == [
        f"_heads: {part}" for part in ("First frame", "Middle frames", "Last frame")
    ]
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    for line, container, part in zip(dots.values(), bars, range(3), strict=True):
        expected = []
        for ds in datasets:
            profile = numpy_last_block(ds, "logit_mean", 0)
            parts = (profile[:, 0], profile[:, 1:-1].mean(axis=1), profile[:, -1])
            expected.append(parts[part])
        np.testing.assert_allclose(line.get_ydata(), np.concatenate(expected), rtol=1e-6)
        # each layer's dots within its bar, in head order
        for index, bar in enumerate(container):
            xs = line.get_xdata()[6 * index : 6 * (index + 1)]
            assert bar.get_x() < xs[0] < xs[-1] < bar.get_x() + bar.get_width()
            assert np.all(np.diff(xs) > 0)
            assert bar.get_height() == pytest.approx(expected[index].mean(), rel=1e-6)
    # Named: the planted head alone, at least on its first-frame dot (its sink), where it
    # stands apart; never a head of the evenly spread ones.
    names = [text for text in ax.texts if isinstance(text, Annotation)]
    assert {text.get_text() for text in names} == {"L2H3"}
    planted = numpy_last_block(datasets[1], "logit_mean", 0)[3]
    first = dots["_heads: First frame"]
    at = 6 + 3  # layer 2 (the second), head 3
    assert (first.get_xdata()[at], planted[0]) in [pytest.approx(text.xy) for text in names]


def test_layer_comparison_draws_every_head_and_names_the_one_apart():
    datasets = planted_run()
    (ax,) = plot_layer_comparison(datasets).axes
    lines = {line.get_label(): line for line in ax.lines}
    for ds in datasets:
        layer = int(ds["layer"])
        profile = numpy_last_block(ds, "logit_mean", 0)
        for head in range(6):
            drawn = lines[f"_head L{layer}H{head}"]
            np.testing.assert_allclose(drawn.get_ydata(), profile[head], rtol=1e-6)
        np.testing.assert_allclose(
            lines[f"Layer {layer}"].get_ydata(), profile.mean(axis=0), rtol=1e-6
        )
    (name,) = [text for text in ax.texts if isinstance(text, Annotation)]
    planted = numpy_last_block(datasets[1], "logit_mean", 0)
    frame = int(np.argmax(np.abs(planted[3] - planted.mean(axis=0))))
    assert name.get_text() == "L2H3"
    assert name.xy == pytest.approx((frame, planted[3, frame]), rel=1e-6)


@pytest.mark.parametrize(
    ("measure", "variable", "unit"),
    [("logits", "logit_mean", "logit"), ("probabilities", "prob_mass", "mass")],
)
def test_heads_grid_titles_carry_sink_scores(measure, variable, unit):
    ds = make_frame_dataset(layer=4, num_heads=10)
    fig = plot_heads_grid(ds, measure=measure)
    profile = numpy_last_block(ds, variable, 0)
    scores = profile[:, 0] - profile[:, 1:-1].mean(axis=1)
    # Every title to the decimals that give the largest score three significant figures.
    decimals = 2 - int(np.floor(np.log10(np.abs(scores).max())))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        f"L4H{h} sink score {score_text(scores[h], decimals)} {unit}" for h in range(10)
    ]


def test_heads_grid_titles_share_one_precision_and_name_the_unit():
    """One strong head and weak ones: the weak scores are printed to the strong one's decimals
    (the titles read "sink -4.08" beside "sink 0.000469": no unit, three figures each)."""
    ds = make_frame_dataset(layer=2, num_heads=4, seed=3)
    ds["logit_mean"][:, 1] = ds["logit_mean"][:, 1] * 0.0005  # a flat head: a tiny score
    profile = numpy_last_block(ds, "logit_mean", 0)
    scores = profile[:, 0] - profile[:, 1:-1].mean(axis=1)
    assert abs(scores[1]) < 1e-2 < 1 < np.abs(scores).max() < 10  # two decimals for every head
    titles = [ax.get_title() for ax in plot_heads_grid(ds).axes]
    assert titles == [f"L2H{h} sink score {score_text(scores[h], 2)} logit" for h in range(4)]
    assert titles[1] == "L2H1 sink score 0.00 logit"  # not 0.000469 at three figures of its own


def test_heads_grid_panels_hold_every_heads_bars(tmp_path):
    """The panels share one y-axis so heads compare directly: its range holds every head's
    profile, a planted head 50 times stronger than the others included (the first panel's
    range used to fix it for all, drawing the strong head as clipped solid bars)."""
    ds = make_frame_dataset(layer=2, num_heads=6)
    ds["logit_mean"][:, 3] = ds["logit_mean"][:, 3] * 50
    fig = plot_heads_grid(ds)
    profile = numpy_last_block(ds, "logit_mean", 0)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert len(panels) == 6
    save_figure(fig, tmp_path / "grid.svg")  # limits as drawn
    for ax, values in zip(panels, profile, strict=True):
        low, high = ax.get_ylim()
        assert low <= min(0.0, np.nanmin(values)) and np.nanmax(values) <= high, ax.get_title()


def test_render_run_figures_demo(tmp_path):
    stores = [write_store(tmp_path / "frames", make_frame_dataset(layer=i, seed=i)) for i in (0, 1)]
    out = tmp_path / "figures"
    heads = [(0, 0), (1, 3)]
    started = time.perf_counter()
    written = render_figures(stores, run_outputs(out, [0, 1], heads), heads=heads)
    elapsed = time.perf_counter() - started
    expected = ["figure4"]
    for layer in (0, 1):
        expected += [f"layer{layer}_heads_grid", f"layer{layer}_heads_heatmap"]
        expected += [f"layer{layer}_frame_maps"]
    expected += ["layer_comparison", "statistics"]
    assert sorted(written) == sorted(out / f"{name}.svg" for name in expected)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}.svg" for name in expected)
    for path in written:
        texts = svg_texts(path)  # parses, or raises
        assert texts, f"{path.name} has no <text>: svg.fonttype must be 'none'"
        assert not svg_has_raster(path), f"{path.name} embeds a raster image"
    expected_texts = {
        "figure4": ["L0H0", "L1H3", "Key frame (latent)", *PROFILE_LABELS.values()],
        "layer1_heads_grid": ["Key frame (latent)", PROFILE_LABELS["logits"]],
        "layer0_heads_heatmap": ["L0H0", "L0H3", "Head", "Key frame (latent)"],
        "layer1_frame_maps": [MAP_LABELS["logits"], MAP_LABELS["probabilities"]],
        "layer0_frame_maps": ["L0H2 logits", "L0H2 probabilities", "Query frame (latent)"],
        "layer_comparison": ["Layer 0", "Layer 1", "Key frame (latent)"],
        "statistics": ["L0", "L1", "Layer", "First frame", "Middle frames", "Last frame"],
    }
    for name, wanted in expected_texts.items():
        texts = svg_texts(out / f"{name}.svg")
        for text in wanted:
            assert text in texts, f"{text!r} missing from {name}.svg"
    grid_titles = [t for t in svg_texts(out / "layer1_heads_grid.svg") if " sink " in t]
    assert [t.split(" sink ")[0] for t in grid_titles] == ["L1H0", "L1H1", "L1H2", "L1H3"]
    # Titles and file names count layers alike: layer1_* files say "Layer 1".
    assert any(t.startswith("Layer 1,") for t in svg_texts(out / "layer1_heads_heatmap.svg"))
    assert elapsed < 60, f"rendering one demo run took {elapsed:.1f} s"


def test_figures_plot_the_statistics_csv_values(tmp_path):
    """Figures and Contract 3 read one rule: a key frame counts only if every query frame of the
    set sees it. Here the last block's query frames see different keys (a window evicting
    mid-block), where averaging with skipna (the figures' old rule) would disagree."""
    from sinkscope.analysis.stats import per_head, read_stats, write_stats

    ds = make_frame_dataset(layer=2, seed=4)
    last = stats.last_block_rows(ds)
    for variable in ("logit_mean", "prob_mass"):
        ds[variable][:, :, last[0], [1, 3]] = np.nan  # frames 1 and 3 evicted before query 18
    store = write_store(tmp_path / "frames", ds)
    write_stats(store, tmp_path / "layer2.csv")
    csv = per_head(read_stats(tmp_path / "layer2.csv"))  # the heads, not the head = mean rows
    rows = csv[(csv["measure"] == "logit_mean") & (csv["step"] == 0)].set_index("head")
    skipna = numpy_last_block(ds, "logit_mean", 0)
    # The old rule keeps frames 1 and 3, so its first-middle-last differ from the CSV's.
    assert np.isfinite(skipna[:, [1, 3]]).all()
    old_middle = skipna[:, 1:-1].mean(axis=1)
    assert not np.allclose(old_middle, rows["middle"].to_numpy(), rtol=1e-3)

    fig = plot_figure4([ds], [(2, h) for h in range(4)])
    csv_rel = 1e-5  # the CSV keeps 6 significant digits
    for head, ax in enumerate(profile_panels(fig, "logits")):
        heights = np.array([patch.get_height() for patch in ax.containers[0]])
        assert np.isnan(heights[[1, 3]]).all()
        visible = np.flatnonzero(np.isfinite(heights))
        assert heights[visible[0]] == pytest.approx(rows.loc[head, "first"], rel=csv_rel)
        assert heights[visible[-1]] == pytest.approx(rows.loc[head, "last"], rel=csv_rel)
        assert heights[visible[1:-1]].mean() == pytest.approx(rows.loc[head, "middle"], rel=csv_rel)
        (annotation,) = [t for t in ax.texts if isinstance(t, Annotation)]
        assert annotation.xy[0] == rows.loc[head, "argmax_frame"]

    grid = plot_heads_grid(ds)
    titles = [ax.get_title() for ax in grid.axes]
    decimals = 2 - int(np.floor(np.log10(rows["sink_score"].abs().max())))
    assert titles == [
        f"L2H{h} sink score {score_text(rows.loc[h, 'sink_score'], decimals)} logit"
        for h in range(4)
    ]

    (ax,) = plot_statistics([ds]).axes
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    for part, container in zip(("first", "middle", "last"), bars, strict=True):
        assert container[0].get_height() == pytest.approx(rows[part].mean(), rel=csv_rel)


def drawn_limits(monkeypatch) -> dict[str, dict[str, tuple[float, float]]]:
    """Record the colour limits of each figure render_figures would save, per measure (the first
    map on the measure's colour map), in place of the save: a built figure's norm is what its
    file shows, and drawing it is most of a render's time."""
    limits: dict[str, dict[str, tuple[float, float]]] = {}
    measures = {LOGIT_CMAP: "logits", PROBABILITY_CMAP: "probabilities"}

    def record(fig, path, fmt="svg"):
        shown = limits.setdefault(Path(path).stem, {})
        for ax in fig.axes:
            for mesh in (c for c in ax.collections if isinstance(c, QuadMesh)):
                shown.setdefault(measures[mesh.cmap.name], (mesh.norm.vmin, mesh.norm.vmax))
        fig.clear()
        return Path(path)

    monkeypatch.setattr(render, "save_figure", record)  # what render_figures calls
    return limits


@pytest.mark.parametrize("measure", ["logits", "probabilities"])
def test_layers_share_one_colour_scale(tmp_path, monkeypatch, measure):
    """Each measure of the heatmaps and frame maps (probabilities beside logits) on one scale
    across the run's layers: the limits of its values pooled over the layers."""
    datasets = [make_frame_dataset(layer=layer, seed=layer, **SMALL) for layer in (0, 3)]
    stores = [write_store(tmp_path / "frames", ds) for ds in datasets]
    kinds = ("heads_heatmap", "frame_maps")
    outputs = [tmp_path / f"layer{layer}_{kind}.svg" for layer in (0, 3) for kind in kinds]
    limits = drawn_limits(monkeypatch)
    render_figures(stores, outputs, heads=[(0, 0)], measure=measure)
    for shown, variable in MEASURE_VARIABLES.items():
        pooled = {
            "heads_heatmap": np.concatenate(
                [numpy_last_block(ds, variable, 0).ravel() for ds in datasets]
            ),
            "frame_maps": np.concatenate([ds[variable].values[0].ravel() for ds in datasets]),
        }
        for kind in kinds:
            assert limits[f"layer0_{kind}"][shown] == limits[f"layer3_{kind}"][shown]
            expected = color_limits(pooled[kind], shown)
            if shown == "probabilities" and not log_scaled(expected):
                expected = (0.0, expected[1])
            assert limits[f"layer0_{kind}"][shown] == pytest.approx(expected)

    # Each file its own scale on request: layer 3's sink heads are stronger than layer 0's.
    limits.clear()
    maps = [path for path in outputs if path.stem.endswith("frame_maps")]
    render_figures(stores, maps, heads=[(0, 0)], measure=measure, shared_scale=False)
    assert limits["layer0_frame_maps"][measure] != limits["layer3_frame_maps"][measure]


def test_legends_cover_no_panel():
    run = [make_frame_dataset(layer=layer, seed=layer, **SMALL) for layer in (0, 1)]
    figs = {
        "figure4": plot_figure4(run, [(0, 0), (1, 1)]),
        "heads_grid": plot_heads_grid(run[0]),
        "layer_comparison": plot_layer_comparison(run),
        "statistics": plot_statistics(run),
    }
    for name, fig in figs.items():
        assert fig.legends, f"{name} has no legend"
        assert not overlapping_legends(fig), f"a legend of {name} covers a panel"


ROLLING = {"num_heads": 4, "block_sizes": [3, 3, 3, 3]}  # the last block: latent 9-11


def bar_looks(ax) -> dict[str, list[int]]:
    """The key frames of a profile's bars by their look: the anchor's, hatched, plain."""
    looks: dict[str, list[int]] = {"anchor": [], "hatched": [], "plain": []}
    for frame, bar in enumerate(ax.containers[0]):
        if bar.get_hatch():
            looks["hatched"].append(frame)
        elif mcolors.same_color(bar.get_facecolor(), ANCHOR_COLOR):
            looks["anchor"].append(frame)
        else:
            assert mcolors.same_color(bar.get_facecolor(), BAR_COLOR)
            looks["plain"].append(frame)
    return looks


def legend_labels(fig) -> set[str]:
    return {text.get_text() for legend in fig.legends for text in legend.get_texts()} - {""}


def test_figure4_shows_which_copy_of_each_key_frame_the_last_block_saw(tmp_path):
    ds = with_key_versions(make_frame_dataset(**ROLLING))
    fig = plot_figure4([ds], [(0, 0), (0, 3)], step=1)
    for ax in fig.axes:
        assert bar_looks(ax) == {
            "anchor": [0, 1, 2],
            "hatched": list(range(6, 12)),
            "plain": [3, 4, 5],
        }
        bars = ax.containers[0]
        # The window's older block (step 2) is less noisy than the own block (step 1): lighter.
        older, own = (sum(mcolors.to_rgb(bars[f].get_facecolor())) for f in (6, 9))
        assert older > own
    assert legend_labels(fig) == {
        "the query block's own key frames (latent 9–11)",
        UNIFORM_LABEL,  # the probability panels' reference line
        ANCHOR_LABEL,
        "clean copy",
        "noisy copy, t=833.33",
        "noisy copy, t=937.5",
    }
    # L0H3's sink on frame 0 is the anchor's, and its label says so.
    assert annotations(fig.axes[1])["max"].get_text().endswith("frame 0 (anchor)")
    assert not overlapping_legends(fig)
    save_figure(fig, tmp_path / "figure4.svg")  # as laid out in the file
    (legend,) = fig.legends
    assert fig.bbox.contains(*legend.get_window_extent().p0)  # no entry cut off by the page
    assert fig.bbox.contains(*legend.get_window_extent().p1)


def test_frame_maps_outline_the_anchor_and_hatch_the_noisy_copies():
    ds = with_key_versions(make_frame_dataset(**ROLLING))
    versions = ds["key_version"].values[0]
    fig = plot_frame_maps(ds, step=0)
    logits, probabilities = map_panels(fig, "logits"), map_panels(fig, "probabilities")
    for ax in [*logits, *probabilities]:  # the panels, not the colour bars
        (outline,) = [patch for patch in ax.patches if patch.get_label() == "_anchor"]
        corners = outline.get_path().vertices
        # around the anchor's cells: key frames 0-2 of query frames 3-11
        assert corners.min(axis=0) == pytest.approx((-0.5, 2.5))
        assert corners.max(axis=0) == pytest.approx((2.5, 11.5))
        (hatched,) = [patch for patch in ax.patches if patch.get_hatch()]
        cells = hatched.get_path().codes == hatched.get_path().MOVETO
        assert cells.sum() == (versions >= 2).sum()
        # the bottom row names its axis (the legend takes the figure's foot), no other
        assert ax.get_xlabel() == ("Key frame (latent)" if ax in probabilities else "")
    assert legend_labels(fig) == {ANCHOR_LABEL, "noisy copy (a block of the denoising window)"}
    assert not overlapping_legends(fig)


def test_figures_without_rolling_versions_draw_as_before(tmp_path):
    # A Self-Forcing run's versions (own block noisy, earlier frames clean) say nothing the
    # block layout does not: its files are those of a dataset without key_version.
    plain = make_frame_dataset(**SMALL)
    self_forcing = with_key_versions(plain, "self_forcing")
    assert not marks_key_versions(self_forcing)
    builders = {
        "figure4": lambda ds: plot_figure4([ds], [(0, 0), (0, 1)], step=0),
        "frame_maps": lambda ds: plot_frame_maps(ds, step=0),
    }
    for name, build in builders.items():
        fig = build(plain)
        assert len(legend_labels(fig)) == (2 if name == "figure4" else 0)
        for ax in fig.axes:
            assert not [patch for patch in ax.patches if patch.get_hatch()]
            assert not [patch for patch in ax.patches if patch.get_label() == "_anchor"]
        drawn = [save_figure(fig, tmp_path / f"{name}.svg")]
        drawn.append(save_figure(build(self_forcing), tmp_path / f"{name}_self_forcing.svg"))
        assert drawn[0].read_bytes() == drawn[1].read_bytes()


def test_version_labels_name_the_timestep_of_a_captured_pass():
    ds = with_key_versions(make_frame_dataset(**SMALL)).isel(step=[0, 4])
    ds.attrs["passes"] = [0, 4]  # the first denoising step and the cache pass
    assert version_label(ds, 2) == "noisy copy, t=1000"
    assert version_label(ds, 3) == "noisy copy, step 1"  # not captured: no timestep
    assert version_label(ds, 1).startswith("anchor")
