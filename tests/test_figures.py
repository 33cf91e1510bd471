"""The figure registry: every kind has its function, caption and file names, one way round and
back, and the workflow asks for exactly the registry's files."""

from __future__ import annotations

import inspect

import pytest

from sinkscope.analysis import figures, plots

from .workflowtools import REPO


@pytest.mark.parametrize("kind", figures.FIGURES.values(), ids=lambda kind: kind.name)
def test_every_kind_has_a_function_and_a_caption(kind):
    builder = getattr(plots, kind.builder)
    first = next(iter(inspect.signature(builder).parameters))
    tables = {"layer": "ds", "policies": "table", "closed_loop": "table"}
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
