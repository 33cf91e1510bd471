"""The figure registry and the one entry point: every kind has its family's function, its caption
and its file names, one way round and back; `render_figures` draws what the file names ask in
every format, checks every request before writing, and passes the paper options (titles) to
every family; the shared helpers (labels, the plotted last-block profile, colour scales)."""

from __future__ import annotations

import inspect
import runpy
from pathlib import Path
from types import SimpleNamespace

import matplotlib.colors as mcolors
import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from sinkscope.analysis import figures
from sinkscope.analysis.plots import render, render_figures
from sinkscope.analysis.plots.common import (
    _SAVE_METADATA,
    add_colorbar,
    color_scale,
    head_label,
    in_style,
    last_block_profile,
    save_figure,
    shared_decimals,
    signed_number,
    step_title,
    timestep_label,
)
from sinkscope.analysis.plots.compare import plot_checkpoints
from sinkscope.analysis.plots.policy import plot_policy_map, plot_policy_recall
from sinkscope.analysis.plots.render import builder_of
from sinkscope.analysis.plots.survey import plot_survey_first_frame

from .figurefixtures import (
    PASS_KINDS,
    SMALL,
    TIMESTEPS,
    compare_outputs,
    make_frame_dataset,
    numpy_last_block,
    run_outputs,
    svg_texts,
    write_store,
)
from .test_policy_figures import make_table
from .workflowtools import REPO, Named


@pytest.mark.parametrize("kind", figures.FIGURES.values(), ids=lambda kind: kind.name)
def test_every_kind_has_a_function_and_a_caption(kind):
    builder = builder_of(kind)
    assert builder.__module__ == f"sinkscope.analysis.plots.{kind.family}"
    assert builder.__name__ == kind.function
    first = next(iter(inspect.signature(builder).parameters))
    tables = {"layer": "ds", "policies": "table", "closed_loop": "table", "video": "table"}
    assert first == tables.get(kind.scope, "datasets")
    assert (REPO / "report" / kind.caption).is_file()


def test_file_names_round_trip():
    files = figures.run_figures("out/c/p", [2, 0], [0], "pdf")
    names = [f.path.removeprefix("out/c/p/") for f in files]
    assert names == [
        "figure4.pdf",
        "layer0_heads_grid.pdf",
        "layer2_heads_grid.pdf",
        "layer0_heads_heatmap.pdf",
        "layer2_heads_heatmap.pdf",
        "layer0_frame_maps.pdf",
        "layer2_frame_maps.pdf",
        "layer_comparison.pdf",
        "statistics.pdf",
    ]
    labels = {f.path.removeprefix("out/c/p/"): f.labels for f in files}
    assert labels["figure4.pdf"] == {"figure": "figure4", "layer": "L0"}
    assert labels["layer2_heads_grid.pdf"] == {"figure": "heads grid", "layer": "L2"}
    assert labels["statistics.pdf"] == {"figure": "statistics", "layer": "L0, L2"}
    compare = figures.compare_figures("out/compare", [0, 2], [2, 0], "svg")
    assert [f.path for f in compare] == [
        "out/compare/checkpoints.svg",
        "out/compare/prompts.svg",
        "out/compare/passes.svg",
    ]
    for f in files + compare:
        kind, layer, fmt = figures.parse_figure_path(f.path)
        assert kind is f.kind and fmt == f.path.rsplit(".", 1)[1]
        assert layer == (f.layers[0] if kind.scope == "layer" else None)


@pytest.mark.parametrize(
    "name", ["figure5.svg", "layer0_figure4.svg", "heads_grid.svg", "figure4.jpg", "layerx_a.svg"]
)
def test_unknown_names_are_refused(name):
    with pytest.raises(ValueError, match=name.split(".")[0]):
        figures.parse_figure_path(f"results/figures/c/p/{name}")


def test_labels():
    assert head_label(0, 0) == "L0H0"
    assert head_label(4, 9) == "L4H9"
    labels = [timestep_label(t, k) for t, k in zip(TIMESTEPS, PASS_KINDS, strict=True)]
    assert labels == ["t=1000", "t=937.5", "t=833.33", "t=625", "cache"]
    ds = make_frame_dataset()
    assert step_title(ds, 0) == "t=1000"
    assert step_title(ds, 4) == "cache pass"


@pytest.mark.parametrize(
    ("values", "texts"),
    [
        (
            [-4.08, 0.000469],
            ["\u22124.08", "0.00"],
        ),  # the heads grid's "sink -4.08", "sink 0.000469"
        ([0.65, 0.0004, -0.02], ["+0.650", "0.000", "\u22120.020"]),
        ([123.4, 5.0], ["+123", "+5"]),
        ([0.000469, np.nan], ["+0.000469", "nan"]),
        ([0.0, 0.0], ["0.00", "0.00"]),
    ],
)
def test_numbers_side_by_side_share_one_precision(values, texts):
    """Printed together, numbers take the decimals that give the largest three significant
    figures, a sign, and a minus sign as the tick labels write it."""
    decimals = shared_decimals(values)
    assert [signed_number(value, decimals) for value in values] == texts


@pytest.mark.parametrize(
    ("measure", "variable"), [("logits", "logit_mean"), ("probabilities", "prob_mass")]
)
@pytest.mark.parametrize("step", [0, 2, 4])
def test_last_block_profile_matches_numpy(measure, variable, step):
    ds = make_frame_dataset(seed=3)
    profile = last_block_profile(ds, measure, step)
    assert profile.dims == ("head", "key_frame")
    np.testing.assert_allclose(profile.values, numpy_last_block(ds, variable, step), rtol=1e-6)
    if measure == "probabilities":
        np.testing.assert_allclose(np.nansum(profile.values, axis=1), 1.0, rtol=1e-5)


def test_probabilities_are_linear_unless_they_span_a_decade():
    narrow = np.array([[0.04, 0.05], [0.3, np.nan]])
    _, norm, shown = color_scale(narrow, "probabilities")
    assert type(norm) is mcolors.Normalize
    assert (norm.vmin, norm.vmax) == (0.0, pytest.approx(0.3))
    np.testing.assert_array_equal(shown, narrow)

    wide = np.array([[0.001, 0.05], [0.3, 0.0]])
    _, norm, shown = color_scale(wide, "probabilities")
    assert isinstance(norm, mcolors.LogNorm)
    assert (norm.vmin, norm.vmax) == (pytest.approx(0.001), pytest.approx(0.3))
    assert shown[1, 1] == pytest.approx(0.001)  # an exact 0 is not mistaken for an unseen tile

    _, norm, _ = color_scale(np.array([-0.5, 2.0]), "logits")
    assert (norm.vmin, norm.vmax) == (-2.0, 2.0)


def test_log_colour_bars_label_decimals_in_the_figure_font(tmp_path):
    """A log-scaled map's colour bar labels the ticks matplotlib would, as decimals in the
    figure's own font: no mathtext 10^-2 (another font, its pieces as SVG tspans)."""
    fig = Figure()
    ax = fig.add_subplot()
    cmap, norm, shown = color_scale(np.array([[0.002, 0.03], [0.3, 0.004]]), "probabilities")
    assert isinstance(norm, mcolors.LogNorm)
    add_colorbar(fig, ax.pcolormesh(shown, cmap=cmap, norm=norm), ax, "mass")
    path = save_figure(fig, tmp_path / "log.svg")
    assert {"0.01", "0.1"} <= set(svg_texts(path))
    assert "<tspan" not in path.read_text()


def test_log_colour_bar_labels_carry_no_floating_point_noise(tmp_path):
    """Within two decades matplotlib labels minor ticks too, each a decade times 2..9 in floating
    point: 3 x 0.1 is 0.30000000000000004, which the labels wrote out in full."""
    fig = Figure()
    ax = fig.add_subplot()
    cmap, norm, shown = color_scale(np.array([[0.02, 0.7], [0.3, 0.05]]), "probabilities")
    assert isinstance(norm, mcolors.LogNorm)
    add_colorbar(fig, ax.pcolormesh(shown, cmap=cmap, norm=norm), ax, "mass")
    save_figure(fig, tmp_path / "log.svg")
    colorbar = fig.axes[-1]
    labels = [label.get_text() for label in colorbar.yaxis.get_ticklabels(which="both")]
    labels = [label for label in labels if label]
    assert {"0.03", "0.3", "0.6"} <= set(labels)  # minor ticks labelled, as decimals
    assert set(labels) <= set(svg_texts(tmp_path / "log.svg"))
    for label in labels:
        assert label == f"{float(label):g}", label  # as short as its value


def _laid_out_figure() -> Figure:
    """Constrained layout around what it measures: tick labels, axis labels, a colour bar, a
    figure legend and a title."""
    with in_style():
        fig = Figure(figsize=(3.4, 2.4), layout="constrained")
        left, right = fig.subplots(1, 2, sharey=True)
        cmap, norm, shown = color_scale(np.array([[0.002, 0.03], [0.3, 0.004]]), "probabilities")
        add_colorbar(fig, left.pcolormesh(shown, cmap=cmap, norm=norm), left, "mass")
        right.plot([0, 1000, 2000], [0.1, 0.5, 0.25], label="a long legend entry")
        right.set_xlabel("Query frame (latent)")
        left.set_ylabel("Key frame (latent)")
        fig.legend(loc="outside lower center")
        fig.suptitle("A title as long as a paper's")
    return fig


@pytest.mark.parametrize("fmt", figures.FORMATS)
def test_one_layout_pass_gives_the_bytes_of_savefigs_two(tmp_path, monkeypatch, fmt):
    """`save_figure` lays a figure out once, measured as the file's renderer measures, and draws
    it once; matplotlib's `savefig` draws it twice (once only to lay it out). Same bytes: laid
    out at another dpi or with another renderer, the texts measure differently."""
    theirs = tmp_path / f"theirs.{fmt}"
    with in_style():
        _laid_out_figure().savefig(theirs, format=fmt, metadata=_SAVE_METADATA[fmt])
    draws = []
    monkeypatch.setattr(
        Figure, "draw", lambda fig, renderer, draw=Figure.draw: draws.append(draw(fig, renderer))
    )
    ours = save_figure(_laid_out_figure(), tmp_path / f"ours.{fmt}", fmt)
    assert len(draws) == 1
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize(("fmt", "magic"), [("png", b"\x89PNG"), ("pdf", b"%PDF")])
def test_other_formats(tmp_path, fmt, magic):
    """A line figure and a map figure (meshes, hatches, outlines) stand for the rest: the SVG
    tests draw every kind, and the backends share the artists."""
    ds = make_frame_dataset(num_heads=2, block_sizes=[3, 3, 3])
    store = write_store(tmp_path / "frames", ds)
    outputs = run_outputs(tmp_path / "out", [0], [(0, 1)], fmt)
    outputs = [path for path in outputs if path.stem in ("figure4", "layer0_frame_maps")]
    written = render_figures([store], outputs, heads=[(0, 1)], measure="probabilities")
    assert len(written) == 2
    for path in written:
        assert path.suffix == f".{fmt}" and path.read_bytes().startswith(magic)


def test_bad_requests_raise_naming_the_problem(tmp_path):
    store = write_store(tmp_path / "frames", make_frame_dataset())
    out = tmp_path / "out"

    def render(heads=((0, 0),), fmt="svg", stores=(store,), **options):
        outputs = run_outputs(out, [0], [(0, 0)], fmt) if fmt in figures.FORMATS else []
        outputs = outputs or [out / f"figure4.{fmt}"]
        return render_figures(list(stores), outputs, heads=list(heads), **options)

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
        render_figures([store], [out / "figure5.svg"], heads=[(0, 0)])
    assert not out.exists(), "a failed request must not leave figures behind"
    with pytest.raises(ValueError, match=r"layer 3"):
        render_figures([store], compare_outputs(out, [(3, 0)]), heads=[(3, 0)])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        render(stores=[tmp_path / "nowhere.zarr"])


RUN_WORDS = ("ckptA", "promptB", "t=1000")


def run_texts(path: Path) -> list[str]:
    return [t for t in svg_texts(path) if any(word in t for word in RUN_WORDS)]


def test_titles_option_leaves_the_run_out(tmp_path, monkeypatch):
    """The texts of the figures `render_figures` builds (their files' texts, svg.fonttype
    'none'), taken from the figures instead of their files: what is drawn is not in question."""
    datasets = [
        make_frame_dataset("ckptA", "promptB", layer, seed=layer, **SMALL) for layer in (0, 1)
    ]
    stores = [write_store(tmp_path / "frames", ds) for ds in datasets]
    names = ["figure4", "layer0_heads_grid", "layer0_heads_heatmap", "layer0_frame_maps"]
    names += ["layer_comparison", "statistics"]
    built: dict[tuple[bool, str], list[str]] = {}
    for titles in (True, False):

        def texts_of(fig, path, fmt="svg", titles=titles):
            built[titles, Path(path).stem] = [text.get_text() for text in fig.findobj(Text)]
            return Path(path)

        monkeypatch.setattr(render, "save_figure", texts_of)
        outputs = [tmp_path / f"{name}.svg" for name in names]
        render_figures(stores, outputs, heads=[(0, 0), (1, 1)], titles=titles)
        for name in names:
            shown = [t for t in built[titles, name] if any(word in t for word in RUN_WORDS)]
            assert bool(shown) == titles, (name, shown)
    # What a figure shows stays: the query set, the layer.
    assert "Last block: query frames 6–8 (latent)" in built[False, "figure4"]
    assert "Layer 0, last-block profile" in built[False, "layer0_heads_heatmap"]

    compare = plot_checkpoints(datasets, [(0, 0)], titles=False)
    assert "t=1000" not in compare.get_suptitle()
    survey = plot_survey_first_frame(datasets, titles=False)
    assert not any(word in survey.get_suptitle() for word in RUN_WORDS)
    table = make_table(checkpoint="ckptA", prompt="promptB")
    for builder in (plot_policy_recall, plot_policy_map):
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


@pytest.mark.parametrize("builder", ["plot_x", "plots.plot_x", "run.draw_x", "run."])
def test_a_builder_names_its_family_and_function(builder):
    with pytest.raises(ValueError, match=r"family\.plot_"):
        figures.FigureKind("x", builder, "x.rst", "run")
    assert figures.FigureKind("x", "run.plot_x", "x.rst", "run").family == "run"
