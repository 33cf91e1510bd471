"""A drawing part the survey's figures share (`survey.py` draws them): the layer x head maps, one
panel per captured step, and the colour scale of a first-frame mass over its uniform share with
its colour bar. Torch-free, like every figure module."""

from __future__ import annotations

import math
from collections.abc import Callable

import matplotlib
import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.collections import QuadMesh
from matplotlib.colors import Colormap, LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from .common import UNSEEN_COLOR, add_colorbar, layer_head_panels, step_title
from .survey_data import layer_head_values

MULTIPLE_CMAP = "RdBu_r"  # below the uniform share blue, at it white, above it red


def step_panel_title(ds: xr.Dataset, step: int) -> str:
    return f"step {int(step)} · {step_title(ds, step)}"


def layer_head_maps(
    layers: dict[int, xr.Dataset],
    table: pd.DataFrame,
    column: str,
    legend_rows: int = 0,
    scale: tuple[Colormap, Normalize] | None = None,
    shown: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[Figure, list[Axes], list[int], list[int], QuadMesh]:
    """One layer x head map of `column` per captured step, on one colour scale (`scale`: colour
    map and norm; default 0..1), the values passed through `shown` (e.g. clipped to the scale);
    layer 0 on top, head 0 on the left, NaN grey. Returns the figure, its panels, their steps and
    heads, and the last mesh (for the colorbar)."""
    first = next(iter(layers.values()))
    steps = [int(step) for step in first["step"].values]
    heads = sorted({int(head) for ds in layers.values() for head in ds["head"].values})
    layer_list = list(layers)
    maps = []
    for step in steps:
        values = layer_head_values(table, column, step, layer_list, heads)
        maps.append((step_panel_title(first, step), values if shown is None else shown(values)))
    cmap, norm = scale if scale is not None else (None, None)
    fig, axes, mesh = layer_head_panels(maps, layer_list, heads, legend_rows, cmap=cmap, norm=norm)
    return fig, axes, steps, heads, mesh


def multiple_scale(visible_frames: int) -> tuple[Colormap, LogNorm]:
    """The colour scale of a first-frame mass over its uniform share: log, from 1 / V to V (V =
    `visible_frames`, at least 2: all mass on one of V frames is V times its share), white at 1
    (uniform), red above (toward a sink), blue below; NaN grey. The same in every run of a
    geometry, so that colours compare across runs and checkpoints."""
    top = float(max(int(visible_frames), 2))
    cmap = matplotlib.colormaps[MULTIPLE_CMAP].with_extremes(bad=UNSEEN_COLOR)
    return cmap, LogNorm(vmin=1.0 / top, vmax=top)


def clipped_to(norm: Normalize) -> Callable[[np.ndarray], np.ndarray]:
    """Values clipped into `norm`'s range (NaN kept): a multiple below 1 / V (0 included, which
    a log scale cannot draw) shows as 1 / V."""

    def clip(values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=float)
        return np.where(np.isfinite(values), np.clip(values, norm.vmin, norm.vmax), np.nan)

    return clip


def add_threshold_colorbar(fig: Figure, mesh: QuadMesh, axes, label: str, threshold: float):
    """The colour bar of a map of multiples of the uniform share (`multiple_scale`): ticks at
    its ends, the decades between, the uniform share (1, dotted) and the sink threshold (a black
    line, labelled)."""
    add_colorbar(fig, mesh, axes, label)
    colorbar = mesh.colorbar
    low, high = mesh.norm.vmin, mesh.norm.vmax
    decades = [10.0**k for k in range(math.ceil(math.log10(low)), math.floor(math.log10(high)) + 1)]
    ticks = sorted({low, high, *decades, *([threshold] if low <= threshold <= high else [])})
    colorbar.set_ticks(ticks, labels=[f"{tick:.2g}" for tick in ticks])
    colorbar.ax.yaxis.set_minor_formatter(NullFormatter())
    colorbar.ax.axhline(1.0, color="0.3", linewidth=0.8, linestyle=":")
    colorbar.ax.axhline(threshold, color="black", linewidth=1.2)
