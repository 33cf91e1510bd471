"""The figures sinkscope draws, declared once.

`FIGURES` maps each kind to the function that draws it (in `sinkscope.analysis.plots`), its
caption (`report/<caption>`), how many files it makes and which layers it shows. The rules build
their outputs and report labels from it (`run_figures`, `compare_figures`); the figure scripts hand
their outputs to `plots.render_figures`, which asks `parse_figure_path` what each file is.

Adding a figure: a `plot_*` function in plots.py, an entry here, a caption in report/, a test.

Scopes:
- `layer`: one file per captured layer of a (checkpoint, prompt): `layer{L}_{kind}.{fmt}`; the
  function gets that layer's frame dataset.
- `run`: one file per (checkpoint, prompt): `{kind}.{fmt}`; the function gets the datasets of the
  layers in `layers`.
- `compare`: one file across checkpoints and prompts: `compare/{kind}.{fmt}`; the function gets
  the datasets of every run of the layers in `layers`.
`layers`: `captured` (every layer in `layers:`) or `heads` (the layers of `figures.heads`).

Layers and heads are 0-based everywhere: file names, titles, labels and CSVs (layer 0 head 0 is
L0H0; Deep Forcing's paper counts from 1, so its L1H1 and L5H10 are L0H0 and L4H9 here).

Parse-time safe: Snakemake imports this while parsing, so nothing heavy is imported.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

SCOPES = ("layer", "run", "compare")
LAYER_SETS = ("captured", "heads")
FORMATS = ("svg", "png", "pdf")


@dataclass(frozen=True)
class FigureKind:
    name: str
    builder: str  # the function in sinkscope.analysis.plots
    caption: str  # file in report/
    scope: str
    layers: str = "captured"

    def __post_init__(self):
        if self.scope not in SCOPES or self.layers not in LAYER_SETS:
            raise ValueError(f"figure {self.name}: bad scope {self.scope} or layers {self.layers}")

    @property
    def title(self) -> str:
        """The `figure` label in the report."""
        return self.name.replace("_", " ")


FIGURES = {
    kind.name: kind
    for kind in (
        FigureKind("figure4", "plot_figure4", "figure4.rst", "run", "heads"),
        FigureKind("heads_grid", "plot_heads_grid", "heads_grid.rst", "layer"),
        FigureKind("heads_heatmap", "plot_heads_heatmap", "heads_heatmap.rst", "layer"),
        FigureKind("frame_maps", "plot_frame_maps", "frame_maps.rst", "layer"),
        FigureKind("layer_comparison", "plot_layer_comparison", "layer_comparison.rst", "run"),
        FigureKind("statistics", "plot_statistics", "statistics.rst", "run"),
        FigureKind(
            "checkpoints", "plot_checkpoints", "compare_checkpoints.rst", "compare", "heads"
        ),
        FigureKind("prompts", "plot_prompts", "compare_prompts.rst", "compare", "heads"),
        FigureKind("passes", "plot_passes", "compare_passes.rst", "compare", "heads"),
    )
}


def layer_label(layers: Sequence[int]) -> str:
    """The `layer` label of a figure: 'L0, L2'."""
    return ", ".join(f"L{int(layer)}" for layer in layers)


@dataclass(frozen=True)
class FigureFile:
    """One file a rule writes: where, which kind, and the layers it shows."""

    path: str
    kind: FigureKind
    layers: tuple[int, ...]

    @property
    def labels(self) -> dict[str, str]:
        return {"figure": self.kind.title, "layer": layer_label(self.layers)}


def _shown_layers(kind: FigureKind, layers: Sequence[int], head_layers: Sequence[int]):
    return tuple(sorted(set(head_layers if kind.layers == "heads" else layers)))


def run_figures(
    folder: str, layers: Sequence[int], head_layers: Sequence[int], fmt: str
) -> list[FigureFile]:
    """Every file of one (checkpoint, prompt) in `folder`, in registry order (a layer figure once
    per captured layer). `layers`: the captured layers; `head_layers`: those of figures.heads."""
    _check_format(fmt)
    files = []
    for kind in FIGURES.values():
        if kind.scope == "layer":
            files += [
                FigureFile(f"{folder}/layer{layer}_{kind.name}.{fmt}", kind, (layer,))
                for layer in sorted(layers)
            ]
        elif kind.scope == "run":
            shown = _shown_layers(kind, layers, head_layers)
            files.append(FigureFile(f"{folder}/{kind.name}.{fmt}", kind, shown))
    return files


def compare_figures(
    folder: str, layers: Sequence[int], head_layers: Sequence[int], fmt: str
) -> list[FigureFile]:
    """Every file across checkpoints and prompts, in `folder` (e.g. results/figures/compare)."""
    _check_format(fmt)
    return [
        FigureFile(f"{folder}/{kind.name}.{fmt}", kind, _shown_layers(kind, layers, head_layers))
        for kind in FIGURES.values()
        if kind.scope == "compare"
    ]


_LAYER_FILE = re.compile(r"^layer(\d+)_(\w+)$")


def parse_figure_path(path: str | PurePath) -> tuple[FigureKind, int | None, str]:
    """(kind, layer of a layer figure or None, format) of a file named as the registry names it."""
    path = PurePath(path)
    fmt = path.suffix.removeprefix(".")
    _check_format(fmt, path)
    match = _LAYER_FILE.match(path.stem)
    name, layer = (match.group(2), int(match.group(1))) if match else (path.stem, None)
    kind = FIGURES.get(name)
    if kind is None or (kind.scope == "layer") != (layer is not None):
        raise ValueError(f"{path}: not a figure file name of the registry ({sorted(FIGURES)})")
    return kind, layer, fmt


def _check_format(fmt: str, path: object = None) -> None:
    if fmt not in FORMATS:
        where = f"{path}: " if path is not None else ""
        raise ValueError(f"{where}fmt must be one of {list(FORMATS)}, got {fmt!r}")
