"""Figures from synthetic frame datasets (Contract 2): files, text, and the plotted numbers."""

from __future__ import annotations

import time
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.colors as mcolors
import numpy as np
import pytest
import xarray as xr
from matplotlib.collections import QuadMesh
from matplotlib.container import BarContainer
from matplotlib.text import Annotation

from sinkscope import frames
from sinkscope.analysis import figures, plots
from sinkscope.analysis.reduce import open_frame_dataset
from sinkscope.storage import mark_complete

TIMESTEPS = np.array([1000.0, 937.5, 833.33, 625.0, 0.0], dtype=np.float32)
PASS_KINDS = ["denoise", "denoise", "denoise", "denoise", "cache"]
DEMO_BLOCKS = [3] * 7  # 21 latent frames, 7 blocks of 3


def make_frame_dataset(
    checkpoint: str = "demo",
    prompt: str = "cat",
    layer: int = 0,
    *,
    num_heads: int = 4,
    block_sizes: list[int] = DEMO_BLOCKS,
    local_attn_size: int = -1,
    sink_size: int = 0,
    seed: int = 0,
) -> xr.Dataset:
    """A frame dataset shaped like the real thing: a strong first frame plus the own block."""
    rng = np.random.default_rng(seed)
    num_frames = sum(block_sizes)
    seen = frames.visible_frames(block_sizes, local_attn_size, sink_size)
    blocks = frames.block_of_frame(block_sizes)
    query = np.arange(num_frames)[:, None]
    key = np.arange(num_frames)[None, :]
    head_sink = 1.0 + 0.8 * np.arange(num_heads) + 0.5 * layer
    pattern = (
        head_sink[:, None, None] * (key == 0)
        + 1.5 * (blocks[query] == blocks[key])
        - 0.05 * (query - key)
    )
    step_scale = np.linspace(1.0, 0.7, TIMESTEPS.size)[:, None, None, None]
    noise = 0.2 * rng.standard_normal((TIMESTEPS.size, num_heads, num_frames, num_frames))
    logits = np.where(seen, step_scale * pattern + noise, np.nan)
    weights = np.where(seen, np.exp(logits - np.nanmax(logits, axis=-1, keepdims=True)), 0.0)
    prob = np.where(seen, weights / weights.sum(axis=-1, keepdims=True), np.nan)
    entropy = -np.nansum(prob * np.log(prob), axis=-1)
    return xr.Dataset(
        {
            "logit_mean": (("step", "head", "query_frame", "key_frame"), logits.astype(np.float32)),
            "prob_mass": (("step", "head", "query_frame", "key_frame"), prob.astype(np.float32)),
            "entropy": (("step", "head", "query_frame"), entropy.astype(np.float32)),
        },
        coords={
            "step": np.arange(TIMESTEPS.size),
            "head": np.arange(num_heads),
            "query_frame": np.arange(num_frames),
            "key_frame": np.arange(num_frames),
            "timestep": ("step", TIMESTEPS),
            "pass_kind": ("step", np.array(PASS_KINDS, dtype=object)),
            "block": ("query_frame", blocks),
            "checkpoint": np.array(checkpoint, dtype=object),
            "prompt": np.array(prompt, dtype=object),
            "layer": layer,
        },
        attrs={
            "block_sizes": list(block_sizes),
            "num_frames": num_frames,
            "frame_seq_length": 4,
            "prompt_text": f"a {prompt} walking",
            "num_heads": num_heads,
        },
    )


def write_store(root: Path, ds: xr.Dataset) -> Path:
    path = root / str(ds["checkpoint"].values) / str(ds["prompt"].values)
    path = path / f"layer{int(ds['layer'])}.zarr"
    ds.to_zarr(path, zarr_format=3, mode="w")
    mark_complete(path)  # as the reducer marks what it wrote
    return path


def numpy_last_block(ds: xr.Dataset, variable: str, step: int) -> np.ndarray:
    """(head, key_frame) mean over the last block's query frames, computed independently."""
    blocks = ds["block"].values
    rows = np.flatnonzero(blocks == blocks.max())
    values = ds[variable].values[list(ds["step"].values).index(step)].astype(np.float64)
    with warnings.catch_warnings():  # key frames no last-block query sees stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values[:, rows, :], axis=1)


def svg_texts(path: Path) -> list[str]:
    root = ET.parse(path).getroot()
    return ["".join(el.itertext()) for el in root.iter("{http://www.w3.org/2000/svg}text")]


def svg_has_raster(path: Path) -> bool:
    return any(True for _ in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}image"))


def figure_texts(fig) -> list[str]:
    texts = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        texts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        texts += [t.get_text() for t in ax.texts]
    return texts


# --------------------------------------------------------------------------------------------


def test_labels():
    assert plots.head_label(0, 0) == "L0H0"
    assert plots.head_label(4, 9) == "L4H9"
    labels = [plots.timestep_label(t, k) for t, k in zip(TIMESTEPS, PASS_KINDS, strict=True)]
    assert labels == ["t=1000", "t=937.5", "t=833.33", "t=625", "cache"]
    ds = make_frame_dataset()
    assert plots.step_title(ds, 0) == "t=1000"
    assert plots.step_title(ds, 4) == "cache pass"


@pytest.mark.parametrize(
    ("measure", "variable"), [("logits", "logit_mean"), ("probabilities", "prob_mass")]
)
@pytest.mark.parametrize("step", [0, 2, 4])
def test_last_block_profile_matches_numpy(measure, variable, step):
    ds = make_frame_dataset(seed=3)
    profile = plots.last_block_profile(ds, measure, step)
    assert profile.dims == ("head", "key_frame")
    np.testing.assert_allclose(profile.values, numpy_last_block(ds, variable, step), rtol=1e-6)
    if measure == "probabilities":
        np.testing.assert_allclose(np.nansum(profile.values, axis=1), 1.0, rtol=1e-5)


def test_sink_score_uses_frames_between_first_and_last_visible():
    # A local window with sink frames: the last block sees frames 0-2 and the latest ones only.
    ds = make_frame_dataset(local_attn_size=9, sink_size=3, seed=5)
    expected = numpy_last_block(ds, "logit_mean", 0)
    visible = np.flatnonzero(np.isfinite(expected[0]))
    assert visible[0] == 0 and visible[-1] == 20 and np.isnan(expected[0, 5])
    middle = np.nanmean(expected[:, 1:20], axis=1)
    parts = plots.head_statistics(ds, "logits", 0)
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
    fig = plots.plot_figure4(datasets, heads, measure=measure, step=2)
    assert [ax.get_title() for ax in fig.axes] == ["L0H0", "L1H3"]
    for ax, (layer, head) in zip(fig.axes, heads, strict=True):
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
        assert ax.get_ylabel() == plots.PROFILE_LABELS[measure]
    assert "demo · cat · t=833.33" in fig.texts[0].get_text()


def test_figure4_svg_text_names_heads_zero_based(tmp_path):
    datasets = [make_frame_dataset(layer=layer, num_heads=10) for layer in (0, 4)]
    fig = plots.plot_figure4(datasets, [(0, 0), (4, 9)])
    path = plots.save_figure(fig, tmp_path / "figure4.svg")
    texts = svg_texts(path)
    assert "L0H0" in texts and "L4H9" in texts
    assert "Key frame (latent)" in texts and plots.PROFILE_LABELS["logits"] in texts
    assert any("demo" in t and "cat" in t and "t=1000" in t for t in texts)
    assert "Arial" in path.read_text()
    assert not svg_has_raster(path)


def test_video_frame_axis_spreads_21_latents_over_81_frames():
    ds = make_frame_dataset()
    fig = plots.plot_figure4([ds], [(0, 1)], frame_axis="video")
    (ax,) = fig.axes
    centers = [patch.get_x() + patch.get_width() / 2 for patch in ax.containers[0]]
    # Latents 1..20 sit at the centres of their 4 video frames; latent 0 (video frame 0 alone)
    # is drawn as wide as they are, in the cell -3.5..0.5 that ends where latent 1 starts.
    np.testing.assert_allclose(centers[1:], frames.video_frame_centers(21)[1:])
    assert centers[0] == -1.5 and centers[1] == 2.5 and 78 < centers[-1] <= 80
    assert ax.get_xlim() == pytest.approx((-3.5, 80.5))
    assert ax.get_xlabel() == "Key frame (video)"
    edges = plots.frame_edges(21, "video")
    assert edges[0] == -3.5 and edges[1] == 0.5 and edges[-1] == 80.5
    assert np.all(np.diff(edges) == 4)

    maps = plots.plot_frame_maps(ds, frame_axis="video")
    mesh = next(c for c in maps.axes[0].collections if isinstance(c, QuadMesh))
    corners = mesh.get_coordinates()
    assert corners[..., 0].min() == -3.5 and corners[..., 0].max() == 80.5
    assert "Query frame (video)" in figure_texts(maps)


def test_frame_maps_grey_unseen_symmetric_logits_log_probabilities():
    ds = make_frame_dataset()
    grey = mcolors.to_rgba(plots.UNSEEN_COLOR)
    unseen = np.isnan(ds["logit_mean"].values[0])  # (head, query, key)
    assert unseen.any()

    fig = plots.plot_frame_maps(ds, measure="logits")
    meshes = [c for ax in fig.axes[:4] for c in ax.collections if isinstance(c, QuadMesh)]
    assert len(meshes) == 4
    limit = np.nanmax(np.abs(ds["logit_mean"].values[0]))
    for head, mesh in enumerate(meshes):
        assert mesh.norm.vmin == pytest.approx(-limit) and mesh.norm.vmax == pytest.approx(limit)
        assert mesh.cmap.get_bad() == pytest.approx(grey)
        shown = np.ma.getmaskarray(mesh.get_array()).reshape(21, 21)
        np.testing.assert_array_equal(shown, unseen[head])
    assert [ax.get_title() for ax in fig.axes[:4]] == ["L0H0", "L0H1", "L0H2", "L0H3"]

    fig = plots.plot_frame_maps(ds, measure="probabilities")
    meshes = [c for ax in fig.axes[:4] for c in ax.collections if isinstance(c, QuadMesh)]
    for head, mesh in enumerate(meshes):
        assert isinstance(mesh.norm, mcolors.LogNorm)
        assert mesh.cmap.get_bad() == pytest.approx(grey)
        np.testing.assert_array_equal(
            np.ma.getmaskarray(mesh.get_array()).reshape(21, 21), unseen[head]
        )


def test_layer_comparison_and_statistics_values():
    datasets = [make_frame_dataset(layer=0, seed=1), make_frame_dataset(layer=1, seed=2)]
    fig = plots.plot_layer_comparison(datasets)
    (ax,) = fig.axes
    for line, ds in zip(ax.lines, datasets, strict=True):
        np.testing.assert_allclose(
            line.get_ydata(), numpy_last_block(ds, "logit_mean", 0).mean(axis=0), rtol=1e-6
        )
    # The legend sits under the panel, outside the data.
    assert ax.get_legend() is None
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["Layer 0", "Layer 1"]

    fig = plots.plot_statistics(datasets)
    (ax,) = fig.axes
    first_bars, middle_bars, _ = [c for c in ax.containers if isinstance(c, BarContainer)]
    for i, ds in enumerate(datasets):
        profile = numpy_last_block(ds, "logit_mean", 0)
        assert first_bars[i].get_height() == pytest.approx(profile[:, 0].mean(), rel=1e-6)
        middle = profile[:, 1:-1].mean(axis=1).mean()
        assert middle_bars[i].get_height() == pytest.approx(middle, rel=1e-6)


def test_heads_grid_titles_carry_sink_scores():
    ds = make_frame_dataset(layer=4, num_heads=10)
    fig = plots.plot_heads_grid(ds)
    profile = numpy_last_block(ds, "logit_mean", 0)
    scores = profile[:, 0] - profile[:, 1:-1].mean(axis=1)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [f"L4H{h} sink {scores[h]:.3g}" for h in range(10)]


def run_outputs(folder: Path, layers, heads, fmt: str = "svg") -> list[Path]:
    """The files the figures rule asks for, from the registry."""
    head_layers = sorted({layer for layer, _ in heads})
    return [Path(f.path) for f in figures.run_figures(str(folder), layers, head_layers, fmt)]


def compare_outputs(folder: Path, heads, fmt: str = "svg") -> list[Path]:
    head_layers = sorted({layer for layer, _ in heads})
    return [Path(f.path) for f in figures.compare_figures(str(folder), [], head_layers, fmt)]


def test_render_run_figures_demo(tmp_path):
    stores = [write_store(tmp_path / "frames", make_frame_dataset(layer=i, seed=i)) for i in (0, 1)]
    out = tmp_path / "figures"
    heads = [(0, 0), (1, 3)]
    started = time.perf_counter()
    written = plots.render_figures(stores, run_outputs(out, [0, 1], heads), heads=heads)
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
        "figure4": ["L0H0", "L1H3", "Key frame (latent)", plots.PROFILE_LABELS["logits"]],
        "layer1_heads_grid": ["Key frame (latent)", plots.PROFILE_LABELS["logits"]],
        "layer0_heads_heatmap": ["L0H0", "L0H3", "Head", "Key frame (latent)"],
        "layer0_frame_maps": ["L0H2", "Query frame (latent)", plots.MAP_LABELS["logits"]],
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


@pytest.mark.parametrize(("fmt", "magic"), [("png", b"\x89PNG"), ("pdf", b"%PDF")])
def test_other_formats(tmp_path, fmt, magic):
    ds = make_frame_dataset(num_heads=2, block_sizes=[3, 3, 3])
    store = write_store(tmp_path / "frames", ds)
    outputs = run_outputs(tmp_path / "out", [0], [(0, 1)], fmt)
    written = plots.render_figures([store], outputs, heads=[(0, 1)], measure="probabilities")
    assert len(written) == 6
    for path in written:
        assert path.suffix == f".{fmt}" and path.read_bytes().startswith(magic)


def test_same_data_same_bytes(tmp_path):
    ds = make_frame_dataset()
    first = plots.save_figure(plots.plot_frame_maps(ds), tmp_path / "a.svg").read_bytes()
    second = plots.save_figure(plots.plot_frame_maps(ds), tmp_path / "b.svg").read_bytes()
    assert first == second


def test_bad_requests_raise_naming_the_problem(tmp_path):
    store = write_store(tmp_path / "frames", make_frame_dataset())
    out = tmp_path / "out"

    def render(heads=((0, 0),), fmt="svg", stores=(store,), **options):
        outputs = run_outputs(out, [0], [(0, 0)], fmt) if fmt in figures.FORMATS else []
        outputs = outputs or [out / f"figure4.{fmt}"]
        return plots.render_figures(list(stores), outputs, heads=list(heads), **options)

    with pytest.raises(ValueError, match=r"layer 4"):
        render(heads=[(4, 9)])
    with pytest.raises(ValueError, match=r"head 7 \(L0H7\)"):
        render(heads=[(0, 7)])
    with pytest.raises(ValueError, match=r"step 9"):
        render(step=9)
    with pytest.raises(ValueError, match=r"fmt"):
        render(fmt="jpg")
    with pytest.raises(ValueError, match=r"measure"):
        render(measure="mass")
    with pytest.raises(ValueError, match=r"frame_axis"):
        render(frame_axis="pixel")
    with pytest.raises(ValueError, match=r"not a figure file name"):
        plots.render_figures([store], [out / "figure5.svg"], heads=[(0, 0)])
    assert not out.exists(), "a failed request must not leave figures behind"
    with pytest.raises(ValueError, match=r"layer 3"):
        plots.render_figures([store], compare_outputs(out, [(3, 0)]), heads=[(3, 0)])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        render(stores=[tmp_path / "nowhere.zarr"])


def test_render_compare_figures(tmp_path):
    root = tmp_path / "frames"
    stores = []
    for c, checkpoint in enumerate(["self_forcing", "causvid"]):
        for p, prompt in enumerate(["cat", "city", "sea"]):
            for layer in (0, 1):
                seed = 100 * c + 10 * p + layer
                ds = make_frame_dataset(checkpoint, prompt, layer, seed=seed)
                stores.append(write_store(root, ds))
    # base_wan captured layer 0 only: skipped for heads of layer 1.
    stores.append(write_store(root, make_frame_dataset("base_wan", "cat", 0, seed=7)))
    heads = [(0, 0), (1, 3)]
    out = tmp_path / "compare"
    written = plots.render_figures(stores, compare_outputs(out, heads), heads=heads)
    assert written == [out / f"{name}.svg" for name in ("checkpoints", "prompts", "passes")]
    for path in written:
        texts = svg_texts(path)
        assert not svg_has_raster(path)
        for text in ("L0H0", "L1H3", "Key frame (latent)", plots.PROFILE_LABELS["logits"]):
            assert any(text in t for t in texts), f"{text!r} missing from {path.name}"
    passes = svg_texts(out / "passes.svg")
    for label in ("t=1000", "t=937.5", "t=833.33", "t=625", "cache"):
        assert label in passes
    assert "L1H3 · base_wan" in passes and "layer not captured" in passes

    datasets = [open_frame_dataset(path) for path in stores]
    fig = plots.plot_checkpoints(datasets, heads)
    # One legend under the panels: a checkpoint keeps its colour in every panel.
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [
        "self_forcing (mean of 3 prompts)",
        "causvid (mean of 3 prompts)",
        "base_wan (1 prompt)",
    ]
    colors = {}
    for ax, (layer, head) in zip(fig.axes, heads, strict=True):
        assert ax.get_legend() is None
        names = (
            ["self_forcing", "causvid", "base_wan"] if layer == 0 else ["self_forcing", "causvid"]
        )
        for line, name in zip(ax.lines, names, strict=True):
            assert colors.setdefault(name, line.get_color()) == line.get_color()
            runs = [
                ds
                for ds in datasets
                if str(ds["checkpoint"].values) == name and int(ds["layer"]) == layer
            ]
            expected = np.mean([numpy_last_block(ds, "logit_mean", 0)[head] for ds in runs], axis=0)
            np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-5)


def test_figures_plot_the_statistics_csv_values(tmp_path):
    """Figures and Contract 3 read one rule: a key frame counts only if every query frame of the
    set sees it. Here the last block's query frames see different keys (a window evicting
    mid-block), where averaging with skipna (the figures' old rule) would disagree."""
    from sinkscope.analysis.stats import per_head, read_stats, write_stats

    ds = make_frame_dataset(layer=2, seed=4)
    last = plots.stats.last_block_rows(ds)
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

    fig = plots.plot_figure4([ds], [(2, h) for h in range(4)])
    for head, ax in enumerate(fig.axes):
        heights = np.array([patch.get_height() for patch in ax.containers[0]])
        assert np.isnan(heights[[1, 3]]).all()
        visible = np.flatnonzero(np.isfinite(heights))
        assert heights[visible[0]] == pytest.approx(rows.loc[head, "first"], rel=1e-6)
        assert heights[visible[-1]] == pytest.approx(rows.loc[head, "last"], rel=1e-6)
        assert heights[visible[1:-1]].mean() == pytest.approx(rows.loc[head, "middle"], rel=1e-6)
        (annotation,) = [t for t in ax.texts if isinstance(t, Annotation)]
        assert annotation.xy[0] == rows.loc[head, "argmax_frame"]

    grid = plots.plot_heads_grid(ds)
    titles = [ax.get_title() for ax in grid.axes]
    assert titles == [f"L2H{h} sink {rows.loc[h, 'sink_score']:.3g}" for h in range(4)]

    (ax,) = plots.plot_statistics([ds]).axes
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    for part, container in zip(("first", "middle", "last"), bars, strict=True):
        assert container[0].get_height() == pytest.approx(rows[part].mean(), rel=1e-6)
