"""Whole-model survey figures from synthetic attention stores (Contract 4) and the frame datasets
reduced from them (Contract 2): file names, and the plotted numbers against numpy."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from matplotlib.collections import PathCollection, QuadMesh

from sinkscope import frames
from sinkscope.analysis import figures, stats
from sinkscope.analysis.plots import render_figures, survey_data
from sinkscope.analysis.plots.common import head_label, save_figure
from sinkscope.analysis.plots.survey import (
    ENTROPY_LABEL,
    FIRST_FRAME_LABEL,
    HEAD_CLASS_COLORS,
    MULTIPLE_LABEL,
    TOKEN_MULTIPLE_LABEL,
    first_frame_image,
    plot_survey_entropy,
    plot_survey_first_frame,
    plot_survey_head_class,
    plot_survey_sink_by_block,
    plot_survey_sink_checkpoints,
    plot_survey_sink_rate,
    plot_survey_sink_rate_runs,
    plot_survey_spatial,
    plot_survey_value_norms,
)
from sinkscope.analysis.stores import open_attention_store, open_frame_dataset
from sinkscope.storage import mark_complete

from .figurefixtures import svg_has_raster, svg_texts
from .workflowtools import REPO, Named

TIMESTEPS = np.array([1000.0, 937.5, 833.33, 625.0, 0.0], dtype=np.float32)
PASS_KINDS = ["denoise", "denoise", "denoise", "denoise", "cache"]
BLOCKS = [3, 3, 3]  # 9 latent frames
GRID = (3, 4)  # H' x W': T = 12 tokens per latent frame
# Planted sinks, strongest first: (layer, head) -> logit bonus of frame 0 (others: at most 2).
PLANTED = {(2, 1): 7.0, (0, 3): 5.5, (3, 0): 4.0}


def hotspot(layer: int, head: int, tokens: int) -> int:
    """The token of frame 0 a head's sink concentrates on."""
    return (5 * layer + 3 * head + 1) % tokens


def make_survey(
    layer: int,
    *,
    checkpoint: str = "demo",
    prompt: str = "cat",
    num_heads: int = 4,
    block_sizes: list[int] = BLOCKS,
    grid: tuple[int, int] = GRID,
    seed: int = 0,
) -> tuple[xr.Dataset, xr.Dataset]:
    """(attention store, frame dataset) of one layer: a softmax over key tokens per query frame
    (all T query tokens of a frame alike, so the mean over them is that row), sinks on frame 0
    (strong for PLANTED heads, each peaking on its `hotspot` token), a bonus for the own block.
    The frame dataset is the store reduced as the reducer does: key_mass summed per key frame."""
    rng = np.random.default_rng(1000 * seed + layer)
    num_frames = sum(block_sizes)
    tokens = grid[0] * grid[1]
    key_frame = frames.token_frames(num_frames, tokens)
    seen = frames.visible_frames(block_sizes)[:, key_frame]  # (query frame, key token)
    blocks = frames.block_of_frame(block_sizes)
    own = blocks[:, None] == blocks[key_frame][None, :]
    sink = rng.uniform(-2.0, 2.0, num_heads)
    recent = rng.uniform(0.0, 3.0, num_heads)
    for (planted_layer, head), strength in PLANTED.items():
        if planted_layer == layer and head < num_heads:
            sink[head], recent[head] = strength, 0.0
    logits = np.zeros((TIMESTEPS.size, num_heads, num_frames, key_frame.size))
    scale = np.linspace(1.0, 0.6, TIMESTEPS.size)
    for h in range(num_heads):
        first = np.where(key_frame == 0, sink[h], 0.0)
        first[hotspot(layer, h, tokens)] += 2.0
        logits[:, h] = scale[:, None, None] * (first[None, :] + recent[h] * own)
    logits += 0.3 * rng.standard_normal(logits.shape)
    logits = np.where(seen, logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    key_mass = np.where(seen, weights / weights.sum(axis=-1, keepdims=True), np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.nansum(key_mass * np.log(key_mass), axis=-1)
    prob_mass = np.stack(
        [key_mass[..., key_frame == f].sum(axis=-1) for f in range(num_frames)], axis=-1
    )
    prob_mass = np.where(frames.visible_frames(block_sizes), prob_mass, np.nan)
    logit_frames = np.stack(
        [
            np.where(seen, logits, np.nan)[..., key_frame == f].mean(axis=-1)
            for f in range(num_frames)
        ],
        axis=-1,
    )
    # The value side: a norm per key token and head, the same copy for every query (as a
    # survey's cached keys); per key frame their mean and the mass-weighted sum.
    norms = rng.uniform(0.5, 2.0, (num_heads, key_frame.size))
    norms[:, key_frame == 0] *= 0.25  # frame 0 carries small values
    value_norm = np.stack([norms[:, key_frame == f].mean(axis=-1) for f in range(num_frames)], -1)
    value_norm = np.where(
        frames.visible_frames(block_sizes)[None, None],
        np.broadcast_to(value_norm[None, :, None, :], prob_mass.shape),
        np.nan,
    )
    weighted = key_mass * norms[None, :, None, :]
    mass_value_norm = np.stack(
        [weighted[..., key_frame == f].sum(axis=-1) for f in range(num_frames)], axis=-1
    )
    mass_value_norm = np.where(frames.visible_frames(block_sizes), mass_value_norm, np.nan)
    pooled_dims = ("step", "head", "pooled_query_frame", "pooled_key_frame")
    frame_dims = ("step", "head", "query_frame", "key_frame")
    attrs = {
        "checkpoint": checkpoint,
        "prompt": prompt,
        "layer": layer,
        "num_heads": num_heads,
        "frame_seq_length": tokens,
        "latent_grid": [num_frames, *grid],
        "num_frames": num_frames,
        "block_sizes": list(block_sizes),
        "timesteps": TIMESTEPS.tolist(),
        "store": "attention",
    }
    store = xr.Dataset(
        {
            "key_mass": (("step", "head", "query_frame", "key_token"), key_mass.astype(np.float32)),
            "entropy": (("step", "head", "query_frame"), entropy.astype(np.float32)),
            "logit_mean_pooled": (
                ("step", "head", "pooled_query_frame", "pooled_key_frame"),
                logit_frames.astype(np.float32),
            ),
            "value_norm": (pooled_dims, value_norm.astype(np.float32)),
            "mass_value_norm": (pooled_dims, mass_value_norm.astype(np.float32)),
        },
        coords={
            "timestep": ("step", TIMESTEPS),
            "pass_kind": ("step", np.array(PASS_KINDS, dtype=object)),
            "key_frame": ("key_token", key_frame.astype(np.int32)),
            "query_frame": ("query_frame", np.arange(num_frames, dtype=np.int32)),
        },
        attrs=attrs,
    )
    ds = xr.Dataset(
        {
            "logit_mean": (("step", "head", "query_frame", "key_frame"), logit_frames),
            "prob_mass": (("step", "head", "query_frame", "key_frame"), prob_mass),
            "entropy": (("step", "head", "query_frame"), entropy),
            "value_norm": (frame_dims, value_norm),
            "mass_value_norm": (frame_dims, mass_value_norm),
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
        attrs={k: v for k, v in attrs.items() if k != "store"},
    )
    return store, ds


def make_run(num_layers: int = 4, **options) -> tuple[list[xr.Dataset], list[xr.Dataset]]:
    """(attention stores, frame datasets) of every layer of one run."""
    pairs = [make_survey(layer, **options) for layer in range(num_layers)]
    return [store for store, _ in pairs], [ds for _, ds in pairs]


def write(path: Path, ds: xr.Dataset) -> Path:
    ds.to_zarr(path, zarr_format=3, mode="w")
    mark_complete(path)
    return path


def write_run(root: Path, stores, datasets) -> tuple[list[Path], list[Path]]:
    """Attention stores and frame datasets where the workflow puts them."""
    attention, frame_paths = [], []
    for store, ds in zip(stores, datasets, strict=True):
        run = (
            f"{store.attrs['checkpoint']}/{store.attrs['prompt']}/layer{store.attrs['layer']}.zarr"
        )
        attention.append(write(root / "attention" / run, store))
        frame_paths.append(write(root / "frames" / run, ds))
    return attention, frame_paths


# independent numbers ------------------------------------------------------------------------


def last_rows(ds: xr.Dataset) -> np.ndarray:
    blocks = ds["block"].values
    return np.flatnonzero(blocks == blocks.max())


def numpy_first(ds: xr.Dataset) -> np.ndarray:
    """[step, head] mass of the last block's queries on frame 0 (always visible here)."""
    return ds["prob_mass"].values[:, :, last_rows(ds), 0].mean(axis=2)


def numpy_recent(ds: xr.Dataset) -> np.ndarray:
    """[step, head] mass of the last block's queries on their own block's frames."""
    rows = last_rows(ds)
    return ds["prob_mass"].values[:, :, rows][..., rows].mean(axis=2).sum(axis=-1)


def numpy_visible(ds: xr.Dataset) -> int:
    """Key frames the last block's queries see (every head alike here)."""
    return int(np.isfinite(ds["prob_mass"].values[0, 0, last_rows(ds)[0]]).sum())


def numpy_multiple(ds: xr.Dataset) -> np.ndarray:
    """[step, head] the last block's mass on frame 0 over its uniform share 1 / visible frames."""
    return numpy_first(ds) * numpy_visible(ds)


def numpy_entropy(ds: xr.Dataset) -> np.ndarray:
    """[step, head] mean entropy of the last block's query frames."""
    return ds["entropy"].values[:, :, last_rows(ds)].mean(axis=2)


def clipped(values: np.ndarray, visible: int) -> np.ndarray:
    """Multiples as the maps draw them: within 1 / V .. V."""
    return np.clip(values, 1.0 / visible, visible)


def panels(fig) -> list:
    """The map panels of a figure (not its colorbar), in order."""
    return [
        ax
        for ax in fig.axes
        if ax.get_label() != "<colorbar>" and any(isinstance(c, QuadMesh) for c in ax.collections)
    ]


def mesh_values(ax) -> np.ndarray:
    """The colour values of a panel's mesh as (rows, columns), NaN where masked."""
    (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
    rows, cols = (n - 1 for n in mesh.get_coordinates().shape[:2])
    return np.ma.filled(np.ma.asarray(mesh.get_array(), dtype=float), np.nan).reshape(rows, cols)


# --------------------------------------------------------------------------------------------
# the registry

# The survey's own figure kinds, in the registry's order.
SURVEY_KINDS = [
    "first_frame",
    "head_class",
    "sink_rate",
    "spatial",
    "sink_by_block",
    "entropy",
    "value_norms",
]


def test_survey_file_names_round_trip():
    files = figures.survey_figures("out/c/p", [3, 0, 2, 1], "png")
    names = SURVEY_KINDS
    assert [f.path for f in files] == [f"out/c/p/survey_{name}.png" for name in names]
    assert [f.kind.name for f in files] == names
    assert all(f.layers == (0, 1, 2, 3) and f.kind.scope == "survey" for f in files)
    assert files[0].labels == {"figure": "survey first frame", "layer": "L0–L3"}
    for f in files:
        kind, layer, fmt = figures.parse_figure_path(f.path)
        assert (kind, layer, fmt) == (f.kind, None, "png")
        assert (REPO / "report" / kind.caption).is_file()
        assert kind.caption == f"survey_{kind.name}.rst"
    # A run without a survey has no survey figures; the run and compare files stay as they were.
    assert figures.survey_figures("out/c/p", [], "svg") == []
    run = [f.path for f in figures.run_figures("out/c/p", [0, 2], [0], "svg")]
    compare = [f.path for f in figures.compare_figures("out/compare", [0], [0], "svg")]
    assert not any("survey" in path for path in run + compare)
    assert len(run) == 9 and len(compare) == 3
    # Surveys compared across runs: compare/survey_*, again only with a survey.
    across = figures.survey_compare_figures("out/compare", [1, 0], "svg")
    assert [f.path for f in across] == [
        "out/compare/survey_sink_rate_runs.svg",
        "out/compare/survey_sink_checkpoints.svg",
    ]
    assert across[0].labels == {"figure": "survey sink rate runs", "layer": "L0, L1"}
    for f in across:
        assert figures.parse_figure_path(f.path) == (f.kind, None, "svg")
        assert (REPO / "report" / f.kind.caption).is_file()
    assert figures.survey_compare_figures("out/compare", [], "svg") == []


@pytest.mark.parametrize(
    "name",
    [
        "first_frame.svg",  # a survey kind needs its prefix
        "survey_figure4.svg",  # a run kind must not have it
        "survey_layer_comparison.svg",
        "layer0_survey_first_frame.svg",
        "layer0_first_frame.svg",
        "survey_.svg",
        "survey_spatial.jpg",
        "sink_rate_runs.svg",
    ],
)
def test_survey_names_refused(name):
    with pytest.raises(ValueError, match=name.split(".")[0]):
        figures.parse_figure_path(f"results/figures/c/p/{name}")


def test_layer_range_labels():
    assert figures.layer_range_label(range(30)) == "L0–L29"
    assert figures.layer_range_label([8, 7, 0, 1, 2, 5]) == "L0–L2, L5, L7, L8"
    assert figures.layer_range_label([4]) == "L4"
    with pytest.raises(ValueError, match="survey"):
        figures.FigureKind("survey_x", "survey.plot_x", "x.rst", "run")
    with pytest.raises(ValueError, match="surveyed"):
        figures.FigureKind("x", "survey.plot_x", "x.rst", "survey")


# --------------------------------------------------------------------------------------------
# the plotted numbers


def test_first_frame_cells_are_the_statistics_first_column():
    _, datasets = make_run(4, num_heads=4)
    fig = plot_survey_first_frame(datasets)
    maps = panels(fig)
    assert [ax.get_title() for ax in maps] == [
        "step 0 · t=1000",
        "step 1 · t=937.5",
        "step 2 · t=833.33",
        "step 3 · t=625",
        "step 4 · cache pass",
    ]
    for step, ax in enumerate(maps):
        values = mesh_values(ax)  # rows: layers 0..3, columns: heads 0..3
        expected = np.stack([numpy_first(ds)[step] for ds in datasets])
        np.testing.assert_allclose(values, expected, rtol=1e-6)
        for layer, ds in enumerate(datasets):
            first = stats.head_statistics(ds, "prob_mass", step)["first"].to_numpy()
            np.testing.assert_allclose(values[layer], first, rtol=1e-12)
    (colorbar,) = [ax for ax in fig.axes if ax not in maps]
    assert colorbar.get_ylim() == (0.0, 1.0)
    assert colorbar.get_ylabel() == FIRST_FRAME_LABEL
    # The planted sinks are where the map is bright.
    step0 = mesh_values(maps[0])
    assert {(layer, head) for layer, head in zip(*np.nonzero(step0 > 0.8), strict=True)} == set(
        PLANTED
    )


def test_first_frame_reads_at_thirty_layers():
    _, datasets = make_run(30, num_heads=12)
    fig = plot_survey_first_frame(datasets[::-1])  # any order: layers sorted
    (ax, *_) = panels(fig)
    assert mesh_values(ax).shape == (30, 12)
    assert ax.get_ylim() == (29.5, -0.5)  # layer 0 on top
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "0" and len(labels) <= 16 and int(labels[-1]) >= 25
    ticks = {*ax.yaxis.get_majorticklocs(), *ax.yaxis.get_minorticklocs()}
    assert ticks == set(range(30))  # every layer still has a tick


@pytest.mark.parametrize(("sink", "recent"), [(3.0, 0.5), (2.0, 0.7)])
def test_head_class_colours_and_markers_share_the_sink_definition(sink, recent):
    """The colour of a cell is the last block's first-frame mass over its uniform share, the
    score the sink marker reads: a circle sits on exactly the cells at or above the threshold
    (the old figure coloured by Gu et al.'s importance and marked by the unnormalised mass)."""
    _, datasets = make_run(4, num_heads=4)
    fig = plot_survey_head_class(datasets, sink_threshold=sink, recent_threshold=recent)
    maps = panels(fig)
    assert len(maps) == len(TIMESTEPS)
    visible = numpy_visible(datasets[0])
    multiple = np.stack([numpy_multiple(ds) for ds in datasets], axis=1)  # step, layer, head
    recent_mass = np.stack([numpy_recent(ds) for ds in datasets], axis=1)
    classes_seen = set()
    for step, ax in enumerate(maps):
        colours = mesh_values(ax)
        np.testing.assert_allclose(colours, clipped(multiple[step], visible), rtol=1e-6)
        markers = {
            collection.get_label(): {(int(y), int(x)) for x, y in collection.get_offsets()}
            for collection in ax.collections
            if isinstance(collection, PathCollection)
        }
        is_sink = multiple[step] >= sink
        is_recent = ~is_sink & (recent_mass[step] >= recent)
        assert markers["sink"] == set(zip(*np.nonzero(is_sink), strict=True))
        assert markers["recent"] == set(zip(*np.nonzero(is_recent), strict=True))
        # Colour and marker agree: circles on the cells at or above the threshold, no others.
        assert markers["sink"] == set(zip(*np.nonzero(colours >= sink), strict=True))
        classes_seen |= {name for name, cells in markers.items() if cells}
        classes_seen |= {"spread"} if (~is_sink & ~is_recent).any() else set()
    assert classes_seen == {"sink", "recent", "spread"}, "the data must exercise every class"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [
        f"sink: first-frame mass ≥ {sink:g}× uniform share",
        f"recent: own-block mass ≥ {recent:g}",
        "spread: no marker",
    ]
    (colorbar,) = [ax for ax in fig.axes if ax not in maps]
    assert colorbar.get_ylim() == pytest.approx((1 / visible, visible))  # 1 / V .. V, log
    assert colorbar.get_ylabel() == MULTIPLE_LABEL
    assert sink in colorbar.get_yticks()  # the threshold is a tick of the colour bar


def test_sink_rate_markers_are_the_sink_rates_and_join_no_layers():
    _, datasets = make_run(6, num_heads=5)
    threshold = 2.0
    (ax,) = plot_survey_sink_rate(datasets, sink_threshold=threshold).axes
    table = pd.concat([stats.frame_statistics(ds) for ds in datasets], ignore_index=True)
    rates = stats.sink_rates(table, threshold)
    labels = ["t=1000", "t=937.5", "t=833.33", "t=625", "cache"]
    assert [line.get_label() for line in ax.lines] == labels
    for step, line in enumerate(ax.lines):
        expected = rates[rates["step"] == step].sort_values("layer")["sink_rate"].to_numpy()
        np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)
        # Independently: the share of each layer's heads at or above the threshold, the heads the
        # head class figure circles.
        shares = [(numpy_multiple(ds)[step] >= threshold).mean() for ds in datasets]
        np.testing.assert_allclose(line.get_ydata(), shares, rtol=1e-12)
        # x is the 0-based layer, shifted sideways by less than half a layer; markers only: a
        # line from one layer's marker to the next crossed the other steps' lines.
        np.testing.assert_array_equal(np.round(line.get_xdata()), np.arange(6))
        assert line.get_linestyle() == "None" and line.get_marker() not in (None, "None", "")
    assert len({tuple(line.get_xdata()) for line in ax.lines}) == len(ax.lines)
    assert 0 < np.concatenate([line.get_ydata() for line in ax.lines]).max() < 1
    assert ax.get_xlabel() == "Layer (0-based)"
    assert f"≥ {threshold:g}× uniform share" in ax.get_title()


@pytest.mark.parametrize("step", [0, 4])
def test_spatial_panels_are_the_sink_heads_strongest_first(step):
    """Only heads that pass the sink definition get a panel (the old figure filled its 8 panels
    with the heads of largest mass, null heads at the uniform share among them), strongest
    first, each in multiples of a key token's uniform share on one scale from 0."""
    stores, datasets = make_run(4, num_heads=4)
    fig = plot_survey_spatial(datasets, attention=stores[::-1], step=step, top=8)
    maps = panels(fig)
    multiple = {
        (layer, head): numpy_multiple(ds)[step, head]
        for layer, ds in enumerate(datasets)
        for head in range(4)
    }
    sinks = sorted((key for key in multiple if multiple[key] >= 3.0), key=lambda k: -multiple[k])
    assert sinks[:3] == list(PLANTED) and 3 <= len(sinks) < 8  # fewer sinks than panels
    assert [ax.get_title() for ax in maps] == [
        f"{head_label(*key)} · mass {multiple[key] / 9:.2f} ({multiple[key]:.3g}×)" for key in sinks
    ]
    assert f"all {len(sinks)} sink heads attend" in fig.get_suptitle()
    tokens = GRID[0] * GRID[1]
    visible_tokens = numpy_visible(datasets[0]) * tokens
    for ax, (layer, head) in zip(maps, sinks, strict=True):
        rows = last_rows(datasets[layer])
        key_mass = stores[layer]["key_mass"].values[step, head][rows, :tokens]
        expected = key_mass.mean(axis=0).reshape(GRID) * visible_tokens
        np.testing.assert_allclose(mesh_values(ax), expected, rtol=1e-6)
        assert ax.get_ylim() == (GRID[0] - 0.5, -0.5)  # latent row 0 on top
        if (layer, head) in PLANTED:
            assert np.argmax(mesh_values(ax)) == hotspot(layer, head, tokens)
        # Frame 0's tokens average to the head's first-frame multiple.
        assert mesh_values(ax).mean() == pytest.approx(multiple[(layer, head)], rel=1e-5)
    (colorbar,) = [ax for ax in fig.axes if ax not in maps]  # one shared colour scale from 0
    assert colorbar.get_ylim()[0] == 0.0
    top = max(mesh_values(ax).max() for ax in maps)
    assert colorbar.get_ylim()[1] == pytest.approx(top)
    # Top 2: the two strongest of the sinks, and the title says how many there are.
    fig = plot_survey_spatial(datasets, attention=stores, step=step, top=2)
    assert len(panels(fig)) == 2
    assert f"the 2 strongest of {len(sinks)} sink heads" in fig.get_suptitle()


def test_spatial_without_a_sink_says_so():
    stores, datasets = make_run(2, num_heads=2)
    multiple = np.stack([numpy_multiple(ds)[0] for ds in datasets])
    threshold = float(multiple.max()) * 1.01  # just above the strongest head
    fig = plot_survey_spatial(datasets, attention=stores, sink_threshold=threshold)
    assert panels(fig) == []
    assert any("No head is a sink" in text.get_text() for text in fig.texts)


def test_first_frame_image_of_a_lazily_opened_store(tmp_path):
    """A store as the survey writes it, opened lazily (key_mass stays on disk until indexed, no
    dask): the image selects step, head, the last block's query frames and frame 0's tokens by
    label and position alike."""
    stores, datasets = make_run(2, num_heads=3)
    paths = []
    for store in stores:
        path = tmp_path / f"layer{store.attrs['layer']}.zarr"
        chunked = store["key_mass"].chunk({"step": 1, "head": 1, "query_frame": 3})
        store.assign(key_mass=chunked).to_zarr(path, zarr_format=3)
        mark_complete(path)
        paths.append(path)
    opened = [open_attention_store(path) for path in paths]
    assert not any(store["key_mass"].variable._in_memory for store in opened)  # lazy
    image = first_frame_image(opened[1], datasets[1], head=2, step=3)
    rows = last_rows(datasets[1])
    expected = stores[1]["key_mass"].values[3, 2][rows, : GRID[0] * GRID[1]].mean(axis=0)
    np.testing.assert_allclose(image, expected.reshape(GRID), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# files


def survey_outputs(folder: Path, layers, fmt: str = "svg") -> list[Path]:
    return [Path(f.path) for f in figures.survey_figures(str(folder), layers, fmt)]


def test_render_survey_figures(tmp_path):
    stores, datasets = make_run(4, num_heads=4)
    attention, frame_paths = write_run(tmp_path, stores, datasets)
    out = tmp_path / "figures" / "demo" / "cat"
    written = render_figures(
        frame_paths,
        survey_outputs(out, range(4)),
        heads=[(0, 0)],
        attention_stores=attention,
        sink_threshold=2.0,
        recent_threshold=0.6,
        step=2,
    )
    names = SURVEY_KINDS
    assert written == [out / f"survey_{name}.svg" for name in names]
    rule = "first-frame mass ≥ 2× uniform share"
    wanted = {
        "first_frame": ["step 0 · t=1000", "step 4 · cache pass", "Layer (0-based)", "Head"],
        "head_class": [f"sink: {rule}", "recent: own-block mass ≥ 0.6", MULTIPLE_LABEL],
        "sink_rate": ["Sink rate (share of heads)", rule, "Layer (0-based)", "t=833.33", "cache"],
        "spatial": ["L2H1 · mass", "step 2 · t=833.33", TOKEN_MULTIPLE_LABEL, rule],
        "sink_by_block": ["step 2 · t=833.33", "Query block (0-based)", "sink: ", "≥ 2×"],
        "entropy": [ENTROPY_LABEL, "step 4 · cache pass", "Layer (0-based)"],
        "value_norms": ["L0H0: frame", "share of mass x ||v||", "t=833.33"],
    }
    for name, texts in wanted.items():
        path = out / f"survey_{name}.svg"
        found = svg_texts(path)
        assert not svg_has_raster(path), f"{path.name} embeds a raster image"
        for text in texts:
            assert any(text in t for t in found), f"{text!r} missing from {path.name}"
    # The statistics render computes once for the six are each figure's own: each builder,
    # computing them itself, draws the same bytes.
    opened = [open_frame_dataset(path) for path in frame_paths]
    stores = [open_attention_store(path, key_tokens=True) for path in attention]
    alone = {
        "first_frame": plot_survey_first_frame(opened),
        "head_class": plot_survey_head_class(opened, sink_threshold=2.0, recent_threshold=0.6),
        "sink_rate": plot_survey_sink_rate(opened, sink_threshold=2.0),
        "spatial": plot_survey_spatial(opened, attention=stores, step=2, sink_threshold=2.0),
        "sink_by_block": plot_survey_sink_by_block(
            opened, step=2, sink_threshold=2.0, recent_threshold=0.6
        ),
        "entropy": plot_survey_entropy(opened),
        "value_norms": plot_survey_value_norms(opened, heads=[(0, 0)], step=2),
    }
    for name, fig in alone.items():
        save_figure(fig, tmp_path / f"{name}.svg")
        assert (tmp_path / f"{name}.svg").read_bytes() == (out / f"survey_{name}.svg").read_bytes()


def test_survey_shows_the_surveyed_layers(tmp_path):
    """Frame datasets of layers without an attention store (captured, not surveyed) are left out
    of the survey; without any stores every frame dataset is surveyed."""
    stores, datasets = make_run(4, num_heads=2)  # head labels 0 and 1 only
    attention, frame_paths = write_run(tmp_path, stores, datasets)
    out = tmp_path / "figures"
    render_figures(
        frame_paths,
        [out / "survey_first_frame.svg", out / "survey_spatial.svg"],
        heads=[(0, 0)],
        attention_stores=attention[1:3],
    )
    texts = svg_texts(out / "survey_first_frame.svg")
    assert "2" in texts and "3" not in texts
    titles = [t.split(" · ")[0] for t in svg_texts(out / "survey_spatial.svg") if " · mass" in t]
    multiple = {
        (layer, h): numpy_multiple(datasets[layer])[0, h] for layer in (1, 2) for h in (0, 1)
    }
    sinks = sorted((key for key in multiple if multiple[key] >= 3.0), key=lambda k: -multiple[k])
    assert titles == [head_label(*key) for key in sinks]  # the sinks of layers 1 and 2 alone
    assert titles[0] == "L2H1"
    render_figures(frame_paths, [out / "survey_first_frame.svg"], heads=[(0, 0)])
    assert "3" in svg_texts(out / "survey_first_frame.svg")  # layer 3 on the axis


def test_one_call_draws_a_run_and_its_survey_as_two_would(tmp_path):
    """The figures rule draws a run's figures (token layers 0 and 2) and its survey (layers 1-3)
    in one job from the union of their frame datasets: `figure_layers` keeps layers 1 and 3 out
    of the run's figures (and of the layer figures' shared colour scale), `survey_layers` keeps
    layer 0 out of the survey. Every file has the bytes of two separate calls; without
    `survey_layers` the compare survey would take in layer 0. Of the layer figures, those of
    layer 2 whose colour scale the run's layers share (`run.SHARED_SCALES`) stand for the rest.
    Drawing the run's figures and the survey twice from the same data, this is also their
    same-data-same-bytes test."""
    stores, datasets = make_run(4, num_heads=2)
    attention, frame_paths = write_run(tmp_path, stores, datasets)
    heads = [(0, 0), (2, 1)]
    run_layers, surveyed = [0, 2], [1, 2, 3]
    shared = {f"layer2_{kind}" for kind in ("heads_heatmap", "frame_maps")}

    def outputs(folder: Path) -> tuple[list[str], list[str]]:
        run = [
            f.path
            for f in figures.run_figures(str(folder), run_layers, [0, 2], "svg")
            if f.kind.scope == "run" or Path(f.path).stem in shared
        ]
        run += [f.path for f in figures.survey_figures(str(folder), surveyed, "svg")]
        compare = [f.path for f in figures.survey_compare_figures(str(folder), surveyed, "svg")]
        return run, compare

    one_run, one_compare = outputs(tmp_path / "one")
    render_figures(
        frame_paths,
        one_run,
        heads=heads,
        attention_stores=attention[1:],
        figure_layers=run_layers,
        survey_layers=surveyed,
    )
    render_figures(frame_paths, one_compare, heads=heads, survey_layers=surveyed)
    two_run, two_compare = outputs(tmp_path / "two")
    split = len(one_run) - len(figures.survey_figures("x", surveyed, "svg"))
    render_figures([frame_paths[0], frame_paths[2]], two_run[:split], heads=heads)
    render_figures(frame_paths[1:], two_run[split:], heads=heads, attention_stores=attention[1:])
    render_figures(frame_paths[1:], two_compare, heads=heads)
    assert len(one_run) > split > 0 and one_compare
    for one, two in zip(one_run + one_compare, two_run + two_compare, strict=True):
        assert Path(one).read_bytes() == Path(two).read_bytes(), Path(one).name
    everything = tmp_path / "all" / Path(one_compare[0]).name
    render_figures(frame_paths, [everything], heads=heads)
    assert everything.read_bytes() != Path(one_compare[0]).read_bytes()


def test_bad_survey_requests_fail_before_writing(tmp_path):
    stores, datasets = make_run(3, num_heads=2)
    attention, frame_paths = write_run(tmp_path, stores, datasets)
    out = tmp_path / "figures"
    outputs = survey_outputs(out, range(3))

    def render(frames=frame_paths, stores=attention, **options):
        return render_figures(frames, outputs, heads=[(0, 0)], attention_stores=stores, **options)

    with pytest.raises(ValueError, match=r"layer1 given twice"):
        render(stores=[*attention, attention[1]])
    with pytest.raises(ValueError, match=r"lacks layers \[0, 1, 2\]"):
        render(stores=[])
    with pytest.raises(ValueError, match=r"stores \['demo/cat/layer2'\] have no frame dataset"):
        render(frames=frame_paths[:2])
    with pytest.raises(ValueError, match="step 7"):
        render(step=7)
    other_store, other_ds = make_survey(2, prompt="dog")
    other = write_run(tmp_path / "other", [other_store], [other_ds])[0][0]
    with pytest.raises(ValueError, match="demo/dog/layer2'] have no frame dataset"):
        render(stores=[*attention[:2], other])
    with pytest.raises(ValueError, match="not of the run demo/cat"):
        plot_survey_spatial(datasets, attention=[*stores[:2], other_store])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        render(stores=[tmp_path / "nowhere.zarr"])
    unfinished = tmp_path / "unfinished.zarr"
    stores[0].to_zarr(unfinished, zarr_format=3)  # never marked complete
    with pytest.raises(ValueError, match="not marked complete"):
        render(stores=[unfinished, *attention[1:]])
    assert not out.exists(), "a failed request must not leave figures behind"


def test_figures_script_reads_the_named_inputs(tmp_path):
    """scripts/figures.py as the rules run it: inputs frames= and attention=, params figures=
    and stats= (whose thresholds reach the head classes; the figures and compare_figures rules,
    whose figures read no threshold, need neither attention= nor stats=)."""
    stores, datasets = make_run(3, num_heads=2)
    attention, frame_paths = write_run(tmp_path, stores, datasets)
    out = tmp_path / "figures"
    # The two figures whose texts show the params arrived (test_render_survey_figures: all).
    outputs = [
        str(path)
        for path in survey_outputs(out, range(3))
        if path.stem in ("survey_head_class", "survey_spatial")
    ]

    figures_options = {
        "heads": [[0, 1]],
        "measure": "logits",
        "frame_axis": "latent",
        "step": 1,
        "format": "svg",
    }
    snakemake = SimpleNamespace(
        input=Named(frames=[str(p) for p in frame_paths], attention=[str(p) for p in attention]),
        output=Named(outputs),
        log=Named([str(tmp_path / "figures.log")]),
        params=Named(
            figures=figures_options,
            stats={"sink_threshold": 1.5, "recent_threshold": 0.9, "query": "last_block"},
        ),
    )
    runpy.run_path(str(REPO / "scripts" / "figures.py"), init_globals={"snakemake": snakemake})
    assert sorted(p.name for p in out.iterdir()) == sorted(Path(p).name for p in outputs)
    assert any("≥ 1.5× uniform share" in t for t in svg_texts(out / "survey_head_class.svg"))
    assert any("step 1 · t=937.5" in t for t in svg_texts(out / "survey_spatial.svg"))
    # Run figures need only the frames and figures=.
    snakemake.input = Named(frames=[str(p) for p in frame_paths])
    snakemake.output = Named([str(out / "statistics.svg")])
    snakemake.params = Named(figures=figures_options)
    runpy.run_path(str(REPO / "scripts" / "figures.py"), init_globals={"snakemake": snakemake})
    assert (out / "statistics.svg").is_file()


def write_runs(tmp_path, runs, num_layers=3):
    """Attention stores and frame datasets of several surveyed runs, each its own seed (its own
    random heads); the planted sinks are in every run."""
    stores, frame_paths = [], []
    for i, (checkpoint, prompt) in enumerate(runs):
        run_stores, run_datasets = zip(
            *[
                make_survey(layer, checkpoint=checkpoint, prompt=prompt, seed=i)
                for layer in range(num_layers)
            ],
            strict=True,
        )
        paths = write_run(tmp_path, run_stores, run_datasets)
        stores += paths[0]
        frame_paths += paths[1]
    return stores, frame_paths


def of_run(datasets, checkpoint, prompt):
    return [
        ds
        for ds in datasets
        if (str(ds["checkpoint"].values), str(ds["prompt"].values)) == (checkpoint, prompt)
    ]


def test_sink_rate_runs_compares_every_surveyed_run(tmp_path):
    runs = [("self_forcing", "cat"), ("self_forcing", "sea"), ("causvid", "cat")]
    stores, frame_paths = write_runs(tmp_path, runs)
    threshold, step = 2.0, 3
    out = tmp_path / "compare"
    paths = render_figures(
        frame_paths,
        [Path(f.path) for f in figures.survey_compare_figures(str(out), range(3), "svg")],
        heads=[(9, 9)],  # compare figures of figures.heads are not drawn: no check of them
        attention_stores=stores,
        sink_threshold=threshold,
        step=step,
    )
    path = out / "survey_sink_rate_runs.svg"
    assert paths == [path, out / "survey_sink_checkpoints.svg"]
    assert not any(svg_has_raster(p) for p in paths)
    assert "t=625" in " ".join(svg_texts(path))
    datasets = [open_frame_dataset(p) for p in frame_paths]
    fig = plot_survey_sink_rate_runs(datasets, sink_threshold=threshold, step=step)
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.lines] == [f"{c} · {p}" for c, p in runs]
    for line, (checkpoint, prompt) in zip(ax.lines, runs, strict=True):
        run = of_run(datasets, checkpoint, prompt)
        shares = [(numpy_multiple(ds)[step] >= threshold).mean() for ds in run]
        np.testing.assert_allclose(line.get_ydata(), shares, rtol=1e-12)
        np.testing.assert_array_equal(np.round(line.get_xdata()), np.arange(3))
        assert line.get_linestyle() == "None"  # markers only: no line joins two layers
    colors = [line.get_color() for line in ax.lines]
    assert colors[0] == colors[1] != colors[2]  # colour: checkpoint
    markers = [line.get_marker() for line in ax.lines]
    assert markers[0] == markers[2] != markers[1]  # marker: prompt
    assert len({tuple(np.round(line.get_ydata(), 6)) for line in ax.lines}) > 1, "runs differ"


# --------------------------------------------------------------------------------------------
# new figures: sink strength over generation time, entropy, the same heads across checkpoints


def numpy_first_by_block(ds: xr.Dataset, step: int) -> tuple[np.ndarray, np.ndarray]:
    """([head, block] mass on frame 0 averaged over each block's query frames, [block] the key
    frames a block sees: every frame up to its own, block-causal)."""
    blocks = ds["block"].values
    mass = ds["prob_mass"].values[step]
    first = np.stack([mass[:, blocks == b, 0].mean(axis=1) for b in np.unique(blocks)], axis=1)
    visible = np.array([np.flatnonzero(blocks == b).max() + 1 for b in np.unique(blocks)])
    return first, visible


@pytest.mark.parametrize("step", [0, 3])
def test_sink_by_block_lines_are_each_blocks_first_frame_mass(step):
    """Per head, the first-frame mass of each query block from block 1 on (left) and the same
    over its uniform share (right), against numpy; each head coloured by its last-block class,
    the threshold drawn, and the sinks named in the legend."""
    _, datasets = make_run(3, num_heads=3)
    threshold = 3.0
    fig = plot_survey_sink_by_block(datasets, step=step, sink_threshold=threshold)
    mass_ax, multiple_ax = fig.axes
    expected = {}
    for layer, ds in enumerate(datasets):
        first, visible = numpy_first_by_block(ds, step)
        for head in range(3):
            expected[(layer, head)] = (first[head, 1:], first[head, 1:] * visible[1:])
    assert len(mass_ax.lines) == len(expected)
    table = pd.concat(
        [stats.per_head(stats.frame_statistics(ds)) for ds in datasets], ignore_index=True
    )
    rows = table[(table["measure"] == "prob_mass") & (table["step"] == step)]
    classes = {(int(r.layer), int(r.head)): r.head_class for r in rows.itertuples()}
    lines = list(zip(mass_ax.lines, multiple_ax.lines[: len(mass_ax.lines)], strict=True))
    matched = set()
    for mass_line, multiple_line in lines:
        np.testing.assert_array_equal(mass_line.get_xdata(), np.arange(1, 3))  # blocks 1, 2
        key = next(
            k
            for k, (mass, _) in expected.items()
            if np.allclose(mass_line.get_ydata(), mass, rtol=1e-6)
        )
        np.testing.assert_allclose(multiple_line.get_ydata(), expected[key][1], rtol=1e-6)
        assert mass_line.get_color() == HEAD_CLASS_COLORS[classes[key]]
        matched.add(key)
    assert matched == set(expected)
    assert threshold in [line.get_ydata()[0] for line in multiple_ax.lines[len(lines) :]]
    assert multiple_ax.get_yscale() == "log"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    sinks = sorted(key for key, name in classes.items() if name == "sink")
    assert legend[0] == "sink: " + ", ".join(head_label(*key) for key in sinks)
    assert (2, 1) in sinks  # the planted sink among 3 layers x 3 heads


def test_first_frame_by_block_is_the_each_block_statistics():
    _, datasets = make_run(2, num_heads=3)
    for ds in datasets:
        table = stats.per_head(stats.frame_statistics(ds, "each_block"))
        for step in (0, 4):
            mine = stats.first_frame_by_block(ds, step).set_index(["head", "query"])
            rows = table[(table["measure"] == "prob_mass") & (table["step"] == step)]
            rows = rows.set_index(["head", "query"]).loc[mine.index]
            for column in ("first", "uniform_multiple"):
                np.testing.assert_allclose(
                    mine[column].to_numpy(dtype=float),
                    rows[column].to_numpy(dtype=float),
                    rtol=1e-12,
                )


def test_entropy_cells_are_the_last_blocks_entropy():
    _, datasets = make_run(4, num_heads=4)
    fig = plot_survey_entropy(datasets)
    maps = panels(fig)
    assert len(maps) == len(TIMESTEPS)
    for step, ax in enumerate(maps):
        expected = np.stack([numpy_entropy(ds)[step] for ds in datasets])
        np.testing.assert_allclose(mesh_values(ax), expected, rtol=1e-6)
    (colorbar,) = [ax for ax in fig.axes if ax not in maps]
    assert colorbar.get_ylabel() == ENTROPY_LABEL
    # From 0 to the entropy of uniform attention over the last block's 9 frames x 12 tokens.
    assert colorbar.get_ylim() == pytest.approx((0.0, np.log(9 * GRID[0] * GRID[1])))
    assert "entropy" in fig.get_suptitle()


def test_sink_checkpoints_puts_each_checkpoints_heads_side_by_side(tmp_path):
    """One layer x head panel per checkpoint of the median over its prompts of the last block's
    first-frame multiple; a circle where the head is a sink in every prompt, a dot in some."""
    runs = [("self_forcing", "cat"), ("self_forcing", "sea"), ("causvid", "cat")]
    _, frame_paths = write_runs(tmp_path, runs, num_layers=4)
    datasets = [open_frame_dataset(p) for p in frame_paths]
    threshold, step = 3.0, 1
    fig = plot_survey_sink_checkpoints(datasets, sink_threshold=threshold, step=step)
    maps = panels(fig)
    assert [ax.get_title() for ax in maps] == [
        "self_forcing (median of 2 prompts)",
        "causvid (1 prompt)",
    ]
    visible = numpy_visible(datasets[0])
    seen_some = False
    for ax, checkpoint in zip(maps, ("self_forcing", "causvid"), strict=True):
        prompts = [prompt for c, prompt in runs if c == checkpoint]
        multiples = np.stack(
            [
                np.stack([numpy_multiple(ds)[step] for ds in of_run(datasets, checkpoint, p)])
                for p in prompts
            ]
        )  # prompt, layer, head
        np.testing.assert_allclose(
            mesh_values(ax), clipped(np.median(multiples, axis=0), visible), rtol=1e-6
        )
        markers = {
            c.get_label(): {(int(y), int(x)) for x, y in c.get_offsets()}
            for c in ax.collections
            if isinstance(c, PathCollection)
        }
        sinks = (multiples >= threshold).sum(axis=0)
        every = set(zip(*np.nonzero(sinks == len(prompts)), strict=True))
        some = set(zip(*np.nonzero((sinks > 0) & (sinks < len(prompts))), strict=True))
        assert markers["every prompt"] == every and markers["some prompts"] == some
        assert set(PLANTED) <= every  # the planted sinks are sinks in every run
        seen_some |= bool(some)
    assert seen_some, "the data must exercise a head that is a sink in some prompts only"
    assert "step 1" in fig.get_suptitle()


def test_the_survey_compare_figures_share_each_runs_statistics(tmp_path, monkeypatch):
    """The renderer computes each run's survey statistics once for both compare figures of the
    survey (each would compute them again), and both draw from them as they do on their own."""
    runs = [("self_forcing", "cat"), ("causvid", "cat")]
    _, frame_paths = write_runs(tmp_path, runs, num_layers=2)
    calls = []
    original = survey_data.survey_statistics

    def counted(datasets, **kwargs):
        calls.append(len(datasets))
        return original(datasets, **kwargs)

    monkeypatch.setattr(survey_data, "survey_statistics", counted)
    outs = [
        Path(f.path) for f in figures.survey_compare_figures(str(tmp_path / "out"), [0, 1], "svg")
    ]
    assert {out.stem for out in outs} == {"survey_sink_rate_runs", "survey_sink_checkpoints"}
    render_figures(frame_paths, outs, heads=[(0, 0)])
    assert calls == [2, 2]  # once per run, not once per run and figure
    alone = tmp_path / "alone"
    for out in outs:
        render_figures(frame_paths, [alone / out.name], heads=[(0, 0)])
        assert (alone / out.name).read_bytes() == out.read_bytes()


def test_value_norms_bars_and_line_are_the_last_blocks_value_side():
    """Per head, the grey bars are each key frame's share of the last block's mass, the red
    ones its share of mass x ||v||, the line the mean ||v||; a frame of small values gets less
    of the second share. Without a surveyed figure head, the strongest sinks are shown."""
    _, datasets = make_run(4, num_heads=4)
    step = 1
    fig = plot_survey_value_norms(datasets, heads=[(2, 1), (9, 0), (0, 2)], step=step)
    axes = [ax for ax in fig.axes if ax.get_xlabel()]  # the bar panels, not their twins
    assert [ax.get_title().split(":")[0] for ax in axes] == ["L2H1", "L0H2"]  # L9 not surveyed
    twins = [ax for ax in fig.axes if not ax.get_xlabel()]
    for ax, twin, (layer, head) in zip(axes, twins, [(2, 1), (0, 2)], strict=True):
        ds = datasets[layer]
        rows = last_rows(ds)
        mass = ds["prob_mass"].values[step, head, rows].mean(axis=0)
        weighted = ds["mass_value_norm"].values[step, head, rows].mean(axis=0)
        norms = ds["value_norm"].values[step, head, rows].mean(axis=0)
        grey, red = ax.patches[: mass.size], ax.patches[mass.size :]
        np.testing.assert_allclose([bar.get_height() for bar in grey], mass / mass.sum())
        np.testing.assert_allclose([bar.get_height() for bar in red], weighted / weighted.sum())
        np.testing.assert_allclose(twin.lines[0].get_ydata(), norms)
    # L2H1 is a planted sink on frame 0, whose values are small: less of the second share.
    grey, red = axes[0].patches[0].get_height(), axes[0].patches[9].get_height()
    assert grey > 0.5 and red < grey
    strongest = plot_survey_value_norms(datasets, heads=[(9, 9)], step=step, sink_threshold=2.0)
    titles = [ax.get_title().split(":")[0] for ax in strongest.axes if ax.get_xlabel()]
    assert titles == ["L2H1", "L0H3"]  # PLANTED, strongest first


def test_value_norms_of_a_survey_without_them_names_the_rerun():
    _, datasets = make_run(2, num_heads=2)
    old = [ds.drop_vars(["value_norm", "mass_value_norm"]) for ds in datasets]
    with pytest.raises(
        ValueError, match=r"demo.*no value_norm or mass_value_norm.*forcerun survey"
    ):
        plot_survey_value_norms(old, heads=[(0, 0)])
