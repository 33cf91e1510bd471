"""The figures across runs (family `sinkscope.analysis.plots.compare`): checkpoints, prompts and
passes, drawn from the frame datasets of several runs: the plotted numbers against numpy, one
prompt or one checkpoint, a step or a checkpoint keeping its colour in every panel, legends off
the data."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.collections import PolyCollection

from sinkscope.analysis.plots import render_figures
from sinkscope.analysis.plots.common import PROFILE_LABELS
from sinkscope.analysis.plots.compare import plot_checkpoints, plot_passes, plot_prompts
from sinkscope.analysis.stores import open_frame_dataset

from .figurefixtures import (
    SMALL,
    compare_datasets,
    compare_outputs,
    make_frame_dataset,
    numpy_last_block,
    overlapping_legends,
    svg_has_raster,
    svg_texts,
    write_store,
)


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
    written = render_figures(stores, compare_outputs(out, heads), heads=heads)
    assert written == [out / f"{name}.svg" for name in ("checkpoints", "prompts", "passes")]
    for path in written:
        texts = svg_texts(path)
        assert not svg_has_raster(path)
        for text in ("L0H0", "L1H3", "Key frame (latent)", PROFILE_LABELS["logits"]):
            assert any(text in t for t in texts), f"{text!r} missing from {path.name}"
    passes = svg_texts(out / "passes.svg")
    for label in ("t=1000", "t=937.5", "t=833.33", "t=625", "cache"):
        assert label in passes
    assert "L1H3 · base_wan" in passes and "layer not captured" in passes

    datasets = [open_frame_dataset(path) for path in stores]
    fig = plot_checkpoints(datasets, heads)
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


def test_prompts_with_one_prompt_draw_one_line_without_band(tmp_path):
    one = compare_datasets(prompts=("cat",))
    fig = plot_prompts(one, [(0, 0)])
    (ax,) = fig.axes  # no spread panel: nothing spreads
    assert not [c for c in ax.collections if isinstance(c, PolyCollection)]  # no band
    assert len(ax.lines) == 2  # one line per checkpoint, no thin prompt lines under it
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["self_forcing: 1 prompt (cat)", "causvid: 1 prompt (cat)"]
    stores = [write_store(tmp_path / "frames", ds) for ds in one]
    out = tmp_path / "compare"
    render_figures(stores, [out / "prompts.svg", out / "checkpoints.svg"], heads=[(0, 0)])
    for name in ("prompts.svg", "checkpoints.svg"):
        texts = " ".join(svg_texts(out / name))
        assert "of 1 prompts" not in texts and "1 prompts" not in texts
        assert "1 prompt" in texts

    several = plot_prompts(compare_datasets(), [(0, 0)])
    _, spread_ax = several.axes
    assert len([c for c in spread_ax.collections if isinstance(c, PolyCollection)]) == 2
    labels = [t.get_text() for t in several.legends[0].get_texts()]
    assert labels == [f"{c}: mean of 2 prompts" for c in ("self_forcing", "causvid")]


def nearly_alike_prompts() -> list:
    """Two checkpoints, three prompts each, whose profiles differ by about 1e-3 of their range:
    the demo's prompts barely move its heads."""
    base = [make_frame_dataset(c, "cat", 0, seed=s, **SMALL) for s, c in enumerate(("a", "b"))]
    datasets = []
    for ds in base:
        for p, prompt in enumerate(("cat", "city", "sea")):
            nudge = 1e-3 * np.random.default_rng(10 + p).standard_normal(ds["logit_mean"].shape)
            datasets.append(
                ds.assign(logit_mean=ds["logit_mean"] + nudge.astype(np.float32)).assign_coords(
                    prompt=np.array(prompt, dtype=object)
                )
            )
    return datasets


def test_prompts_spread_is_visible_at_its_own_scale():
    """The prompts' spread sits on its own axis: each prompt minus the checkpoint's mean over
    prompts (thin lines) and their min-max band, against numpy, on an axis about as tall as the
    spread. The old figure drew the band on the profile's axis, some 1000 times taller than
    it: invisible."""
    datasets = nearly_alike_prompts()
    fig = plot_prompts(datasets, [(0, 1)])
    profile_ax, spread_ax = fig.axes
    differences = {}
    for checkpoint in ("a", "b"):
        profiles = np.stack(
            [
                numpy_last_block(ds, "logit_mean", 0)[1]
                for ds in datasets
                if str(ds["checkpoint"].values) == checkpoint
            ]
        )
        differences[checkpoint] = profiles - profiles.mean(axis=0)
    thin = [line for line in spread_ax.lines if line.get_label() == "_prompt"]
    assert len(thin) == 6
    for line, expected in zip(thin, [*differences["a"], *differences["b"]], strict=True):
        np.testing.assert_allclose(line.get_ydata(), expected, atol=1e-6)
    bands = [c for c in spread_ax.collections if isinstance(c, PolyCollection)]
    for band, checkpoint in zip(bands, ("a", "b"), strict=True):
        vertices = band.get_paths()[0].vertices[:, 1]
        low, high = differences[checkpoint].min(axis=0), differences[checkpoint].max(axis=0)
        assert vertices.min() == pytest.approx(low.min(), abs=1e-6)
        assert vertices.max() == pytest.approx(high.max(), abs=1e-6)
    largest = max(np.abs(d).max() for d in differences.values())
    bottom, top = spread_ax.get_ylim()
    assert top - bottom < 4 * largest  # the spread fills its axis
    bottom, top = profile_ax.get_ylim()
    assert top - bottom > 100 * largest  # where the old band sat
    assert "Prompt − mean (logit)" == spread_ax.get_ylabel()
    assert not overlapping_legends(fig)


def test_checkpoints_with_one_checkpoint_name_it():
    fig = plot_checkpoints(compare_datasets(checkpoints=("causvid",)), [(0, 0)])
    assert fig.get_suptitle().startswith("Checkpoint causvid, mean over prompts")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["causvid (mean of 2 prompts)"]
    fig = plot_checkpoints(compare_datasets(), [(0, 0)])
    assert fig.get_suptitle().startswith("Checkpoints, mean over prompts")


def test_passes_share_the_y_axis_across_checkpoints_of_a_head():
    fig = plot_passes(compare_datasets(), [(0, 0), (0, 1)])
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
    fig = plot_passes(one_pass + every_pass, [(0, 0), (1, 0)])
    token_panel, survey_panel = fig.axes
    assert len(token_panel.lines) == 1
    assert len(survey_panel.lines) == every_pass[0].sizes["step"] > 1
    assert token_panel.lines[0].get_label() == survey_panel.lines[0].get_label()
    assert token_panel.lines[0].get_color() == survey_panel.lines[0].get_color()
    colors = [line.get_color() for line in survey_panel.lines]
    assert len({str(c) for c in colors}) == len(colors)  # one colour per step


def test_legends_cover_no_panel():
    datasets = compare_datasets()
    figs = {
        "checkpoints": plot_checkpoints(datasets, [(0, 0), (0, 1)]),
        "prompts": plot_prompts(datasets, [(0, 0), (0, 1)]),
        "passes": plot_passes(datasets, [(0, 0)]),
    }
    for name, fig in figs.items():
        assert fig.legends, f"{name} has no legend"
        assert not overlapping_legends(fig), f"a legend of {name} covers a panel"
