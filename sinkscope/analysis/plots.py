"""Frame datasets (Contract 2) -> paper figures: Deep Forcing Fig. 4 and its companions.

Two layers of API:
- `plot_*` builders take loaded frame datasets and return a `matplotlib.figure.Figure`; tests read
  the plotted numbers back from them.
- `render_figures` opens the zarr stores (frame datasets, and for the whole-model survey the
  attention stores of Contract 4), calls the builders and writes the files the workflow declares.

Figures are bare `Figure` objects (no pyplot global state, no GUI backend) drawn under one style
(`STYLE`): text stays text in SVG, everything is vector, and the same data give the same bytes.
"""

from __future__ import annotations

import inspect
import math
import os
import textwrap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import wraps
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.collections import QuadMesh
from matplotlib.colors import Colormap, LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter
from matplotlib.transforms import ScaledTranslation

from sinkscope import frames
from sinkscope.analysis import closed_loop, figures, policies, stats
from sinkscope.analysis.reduce import open_attention_store, open_frame_dataset
from sinkscope.storage import atomic_path

MEASURE_VARIABLES = {"logits": "logit_mean", "probabilities": "prob_mass"}
PROFILE_LABELS = {
    "logits": "Attention logit (query-averaged)",
    "probabilities": "Probability mass (query-averaged)",
}
MAP_LABELS = {
    "logits": "Attention logit (frame-pair mean)",
    "probabilities": "Attention probability mass",
}
FRAME_AXES = ("latent", "video")
KEY_AXIS_LABELS = {"latent": "Key frame (latent)", "video": "Key frame (video)"}
QUERY_AXIS_LABELS = {"latent": "Query frame (latent)", "video": "Query frame (video)"}
PARTS = ("first", "middle", "last")
PART_LABELS = {"first": "First frame", "middle": "Middle frames", "last": "Last frame"}

UNSEEN_COLOR = "0.8"  # tiles the query frame could not see
QUERY_BLOCK_COLOR = "0.9"  # the band over the query block's own key frames (figure4, heads grid)
ANNOTATIONS = ("max", "min")  # what figure4 may annotate (`figures.annotate`)
MAP_LOG_DECADES = 1.0  # a probability map is drawn on a log scale when it spans more decades
# Every cell of a colour map (and of a colorbar) is stroked in its own colour this wide (points),
# so neighbours overlap: vector viewers otherwise antialias each cell's edge on its own and show
# hairline seams between cells. The maps stay vector (no embedded image).
SEAM_STROKE_PT = 0.3
LOGIT_CMAP = "RdBu_r"
PROBABILITY_CMAP = "viridis"
BAR_COLOR = "#9ecae1"
LINE_COLOR = "#08519c"

FULL_WIDTH_IN = 6.9  # two-column paper text width
COLUMN_WIDTH_IN = 3.4

STYLE = {
    "svg.fonttype": "none",
    "svg.hashsalt": "sinkscope",  # stable element ids: same data, same bytes
    "pdf.fonttype": 42,  # TrueType, so PDF text stays selectable text as well
    # Arial first and DejaVu Sans (shipped with matplotlib) as fallback, through the generic
    # family so that a machine without Arial falls back silently instead of warning per glyph.
    "font.family": "sans-serif",
    "font.sans-serif": ["Arial", "DejaVu Sans"],
    "font.size": 7,
    "axes.titlesize": 7,
    "axes.labelsize": 7,
    "xtick.labelsize": 6,
    "ytick.labelsize": 6,
    "legend.fontsize": 6,
    "figure.titlesize": 8,
    "figure.labelsize": 7,
    "axes.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "xtick.major.size": 2.5,
    "ytick.major.size": 2.5,
    "lines.linewidth": 1.0,
    "lines.markersize": 2.5,
    "legend.frameon": False,
    "savefig.dpi": 300,
}

# Drop creation dates so that reruns write identical files.
_SAVE_METADATA: dict[str, dict[str, None] | None] = {
    "svg": {"Date": None},
    "pdf": {"CreationDate": None},
    "png": None,
}


# --------------------------------------------------------------------------------------------
# names, options, loading


def head_label(layer: int, head: int) -> str:
    """Head name in every label, 0-based like everything (figures.py): layer 4 head 9 -> 'L4H9'."""
    return f"L{int(layer)}H{int(head)}"


def timestep_label(timestep: float, pass_kind: str) -> str:
    """Legend label of one step: 't=1000', 't=937.5', 't=833.33' or 'cache'."""
    if str(pass_kind) == "cache":
        return "cache"
    return f"t={round(float(timestep), 2):g}"


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_options(measure: str, frame_axis: str) -> None:
    _check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    _check_choice("frame_axis", frame_axis, FRAME_AXES)


def _layer(ds: xr.Dataset) -> int:
    return int(ds["layer"].values)


def _checkpoint(ds: xr.Dataset) -> str:
    return str(ds["checkpoint"].values)


def _prompt(ds: xr.Dataset) -> str:
    return str(ds["prompt"].values)


def _describe(ds: xr.Dataset) -> str:
    return f"{_checkpoint(ds)}/{_prompt(ds)}/layer{_layer(ds)}"


def _by_layer(datasets: Sequence[xr.Dataset]) -> dict[int, xr.Dataset]:
    """Layers of one run, sorted; all datasets must share checkpoint and prompt."""
    if not datasets:
        raise ValueError("no frame datasets given")
    runs = {(_checkpoint(ds), _prompt(ds)) for ds in datasets}
    if len(runs) > 1:
        raise ValueError(f"frame datasets of one run must share checkpoint and prompt, got {runs}")
    layers: dict[int, xr.Dataset] = {}
    for ds in datasets:
        if _layer(ds) in layers:
            raise ValueError(f"layer {_layer(ds)} given twice: {_describe(ds)}")
        layers[_layer(ds)] = ds
    return dict(sorted(layers.items()))


def _select_step(ds: xr.Dataset, step: int) -> xr.Dataset:
    steps = [int(s) for s in ds["step"].values]
    if int(step) not in steps:
        raise ValueError(f"step {step} not in {_describe(ds)}: its steps are {steps}")
    return ds.sel(step=int(step))


def step_title(ds: xr.Dataset, step: int) -> str:
    """'t=1000' for a denoising step, 'cache pass' for the cache-update pass."""
    one = _select_step(ds, step)
    label = timestep_label(one["timestep"].values, _pass_kind(one))
    return "cache pass" if label == "cache" else label


def _pass_kind(one_step: xr.Dataset) -> str:
    return str(one_step["pass_kind"].values) if "pass_kind" in one_step.variables else "denoise"


def _check_head(ds: xr.Dataset, head: int) -> None:
    heads = [int(h) for h in ds["head"].values]
    if int(head) not in heads:
        raise ValueError(
            f"head {head} ({head_label(_layer(ds), head)}) out of range: {_describe(ds)} "
            f"has heads {heads[0]}..{heads[-1]}"
        )


# --------------------------------------------------------------------------------------------
# the plotted numbers: read from sinkscope.analysis.stats, the functions that write Contract 3


def last_block_profile(ds: xr.Dataset, measure: str = "logits", step: int = 0) -> xr.DataArray:
    """The last-block profile the statistics see (`stats.last_block_profile`): (head, key_frame).

    NaN where some query frame of the last block could not see that key frame.
    """
    _check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    _select_step(ds, step)
    profile = stats.last_block_profile(ds, MEASURE_VARIABLES[measure], step)
    profile.attrs = {"long_name": PROFILE_LABELS[measure]}
    return profile


def head_statistics(ds: xr.Dataset, measure: str = "logits", step: int = 0) -> pd.DataFrame:
    """The `last_block` rows of the statistics CSV for `measure` and `step`, indexed by head."""
    _check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    _select_step(ds, step)
    return stats.head_statistics(ds, MEASURE_VARIABLES[measure], step, "last_block")


def key_frame_positions(num_frames: int, frame_axis: str = "latent") -> np.ndarray:
    """Where each latent frame is drawn on the axis: its index, or on the video axis the centre
    of its cell (`frame_edges`): the centre of its decoded video frames, for latent 0 (a single
    video frame, drawn as wide as the others) the centre of its widened cell, -1.5."""
    edges = frame_edges(num_frames, frame_axis)
    return (edges[:-1] + edges[1:]) / 2


def frame_edges(num_frames: int, frame_axis: str = "latent") -> np.ndarray:
    """Cell edges of the latent frames on the axis (num_frames + 1 values).

    On the video axis latent k >= 1 spans its 4 decoded video frames (4k-3 .. 4k). Latent 0
    decodes to video frame 0 alone; a cell one frame wide would be a sliver beside the others,
    and frame 0 is where attention sinks sit, so its cell is drawn as wide as a latent's, ending
    where latent 1 starts: -3.5 .. 0.5.
    """
    _check_choice("frame_axis", frame_axis, FRAME_AXES)
    if frame_axis == "video":
        spans = [frames.video_frames_of_latent(k) for k in range(max(num_frames, 2))]
        stops = [span.stop - 0.5 for span in spans[:num_frames]]
        return np.array([stops[0] - len(spans[1]), *stops])
    return np.arange(num_frames + 1, dtype=np.float64) - 0.5


def _frame_name(latent: int, frame_axis: str) -> str:
    if frame_axis == "latent":
        return f"frame {latent}"
    span = frames.video_frames_of_latent(latent)
    if len(span) == 1:
        return f"frame {span.start}"
    return f"frames {span.start}–{span.stop - 1}"


def _format_value(value: float) -> str:
    return "nan" if not np.isfinite(value) else f"{value:.3g}"


# --------------------------------------------------------------------------------------------
# drawing helpers


@contextmanager
def _style() -> Iterator[None]:
    with matplotlib.rc_context(STYLE):
        yield


def _styled(builder: Callable[..., Figure]) -> Callable[..., Figure]:
    """Build a figure under STYLE: font sizes and families are fixed when artists are created."""

    @wraps(builder)
    def build(*args, **kwargs) -> Figure:
        with _style():
            return builder(*args, **kwargs)

    return build


def _panel_grid(fig: Figure, count: int, ncols: int, **subplot_kw) -> list[Axes]:
    """`count` panels in rows of `ncols`; unused grid cells are removed, not left blank."""
    ncols = max(1, min(ncols, count))
    nrows = math.ceil(count / ncols)
    grid = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw).ravel()
    for extra in grid[count:]:
        extra.remove()
    return list(grid[:count])


def _frame_axis_format(ax: Axes, num_frames: int, frame_axis: str, which: str = "x") -> None:
    edges = frame_edges(num_frames, frame_axis)
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    if which == "x":
        ax.set_xlim(edges[0], edges[-1])


def _series_colors(count: int) -> list:
    """Qualitative colours while they last, then samples of a sequential map."""
    if count <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(count)]
    return [matplotlib.colormaps["viridis"](x) for x in np.linspace(0.0, 0.9, count)]


def color_limits(values: np.ndarray, measure: str) -> tuple[float, float]:
    """The limits of a colour map of `measure` drawing `values` (NaN ignored): (-L, L) for
    logits, L the largest magnitude; (smallest, largest) positive value for probabilities, the
    smallest no lower than 1e-4 of the largest. Maps compared side by side share the limits of
    their values pooled (`render_figures`, `shared_scale`)."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if measure == "logits":
        limit = float(np.max(np.abs(finite))) if finite.size else 1.0
        limit = limit if limit > 0 else 1.0
        return (-limit, limit)
    positive = finite[finite > 0]
    if not positive.size:
        return (1.0, 1.0)
    vmax = float(positive.max())
    return (max(float(positive.min()), vmax * 1e-4), vmax)


def log_scaled(limits: tuple[float, float]) -> bool:
    """Whether probabilities within `limits` (`color_limits`) are drawn on a log scale: only
    when they span more than MAP_LOG_DECADES decades, else a linear scale from 0 reads better."""
    low, high = limits
    return low > 0 and bool(np.log10(high / low) > MAP_LOG_DECADES)


def _color_scale(
    values: np.ndarray, measure: str, limits: tuple[float, float] | None = None
) -> tuple[Colormap, Normalize, np.ndarray]:
    """Colormap, norm and the values to draw for a map of `measure`; NaN (unseen) is grey.
    `limits`: those of `color_limits` (default: of `values`), e.g. shared with other maps.

    Logits: diverging map with limits symmetric around 0. Probabilities: a linear scale from 0
    to the largest value, or a log scale when the positive values span more than a decade
    (`log_scaled`), where exact zeros are lifted to the lower limit so that they are not
    mistaken for unseen tiles.
    """
    low, high = color_limits(values, measure) if limits is None else limits
    if measure == "logits":
        cmap = matplotlib.colormaps[LOGIT_CMAP].with_extremes(bad=UNSEEN_COLOR)
        return cmap, Normalize(vmin=low, vmax=high), values
    cmap = matplotlib.colormaps[PROBABILITY_CMAP].with_extremes(bad=UNSEEN_COLOR)
    if not log_scaled((low, high)):
        return cmap, Normalize(vmin=0.0, vmax=high), values
    shown = np.where(np.isfinite(values), np.maximum(values, low), np.nan)
    return cmap, LogNorm(vmin=low, vmax=high), shown


def _mesh(ax: Axes, x_edges, y_edges, values, cmap: Colormap, norm: Normalize) -> QuadMesh:
    """A colour map of cells, each stroked in its own colour so that no seams show in vector
    files (`SEAM_STROKE_PT`)."""
    return ax.pcolormesh(
        x_edges,
        y_edges,
        values,
        cmap=cmap,
        norm=norm,
        edgecolors="face",
        linewidth=SEAM_STROKE_PT,
    )


def _colorbar(fig: Figure, mappable, axes, label: str) -> None:
    colorbar = fig.colorbar(mappable, ax=axes, shrink=0.9, pad=0.02)
    colorbar.set_label(label)
    colorbar.outline.set_linewidth(0.5)
    # matplotlib rasterizes long colorbars; keep the file fully vector, and stroke every
    # segment in its own colour so that vector viewers show no hairline seams between them.
    colorbar.solids.set_rasterized(False)
    colorbar.solids.set_edgecolor("face")
    colorbar.solids.set_linewidth(SEAM_STROKE_PT)


def _boxed(ax: Axes) -> None:
    for spine in ax.spines.values():
        spine.set_visible(True)


def _check_annotate(annotate: Sequence[str]) -> None:
    for what in annotate:
        _check_choice("annotate", what, ANNOTATIONS)


def _draw_profile(
    ax: Axes,
    values: np.ndarray,
    frame_axis: str,
    *,
    annotate: Sequence[str] = (),
    block: Sequence[int] = (),
) -> None:
    """Bars and line of one profile over key frames, optionally with its maximum and minimum
    annotated (`annotate`: 'max', 'min') and the key frames `block` (latent) shaded."""
    num_frames = values.shape[0]
    edges = frame_edges(num_frames, frame_axis)
    positions = key_frame_positions(num_frames, frame_axis)
    if len(block):
        _shade_block(ax, edges, block)
    ax.bar(positions, values, width=0.8 * np.diff(edges), color=BAR_COLOR, linewidth=0)
    ax.plot(positions, values, color=LINE_COLOR, marker="o")
    ax.axhline(0.0, color="0.5", linewidth=0.4)
    _frame_axis_format(ax, num_frames, frame_axis)
    ax.margins(y=0.08)
    if not np.isfinite(values).any():
        return
    extremes = {"max": int(np.nanargmax(values)), "min": int(np.nanargmin(values))}
    if extremes["max"] == extremes["min"]:  # a flat profile: its maximum says it all
        extremes.pop("min")
    # Headroom above the bars for the maximum's label, below them for the minimum's: under the
    # bar's foot (the 0 line) or its end, whichever is lower, so that the label covers no bar.
    low, high = ax.get_ylim()
    room = 0.18 * (high - low)
    ax.set_ylim(low - room * ("min" in annotate), high + room * ("max" in annotate))
    if "min" in annotate and np.nanmin(values) >= 0:
        # The headroom under 0 holds a label, not values: no ticks there.
        low, high = ax.get_ylim()
        ticks = ax.yaxis.get_major_locator().tick_values(low, high)
        ax.set_yticks([tick for tick in ticks if 0 <= tick <= high])
        ax.set_ylim(low, high)
    for what in ANNOTATIONS:
        if what not in annotate or what not in extremes:
            continue
        frame = extremes[what]
        to_left = frame > num_frames / 2  # the label leans to the side with room
        above = what == "max"
        value = float(values[frame])
        shift = ScaledTranslation(
            (-6 if to_left else 6) / 72, (7 if above else -7) / 72, ax.figure.dpi_scale_trans
        )
        ax.annotate(
            f"{what} {_format_value(value)}, {_frame_name(frame, frame_axis)}",
            xy=(positions[frame], value),
            xytext=(positions[frame], value if above else min(value, 0.0)),
            textcoords=ax.transData + shift,
            ha="right" if to_left else "left",
            va="bottom" if above else "top",
            arrowprops={
                "arrowstyle": "-",
                "color": "0.3",
                "linewidth": 0.5,
                "shrinkA": 0,
                # from the label's corner nearest the point
                "relpos": (1.0 if to_left else 0.0, 0.0 if above else 1.0),
            },
        )


def _shade_block(ax: Axes, edges: np.ndarray, block: Sequence[int]) -> None:
    """A light band behind the key frames `block` (latent frames, contiguous): the query
    block's own frames."""
    ax.axvspan(
        edges[min(block)],
        edges[max(block) + 1],
        color=QUERY_BLOCK_COLOR,
        linewidth=0,
        zorder=0,
        label="_query block",
    )


def _query_block(ds: xr.Dataset) -> list[int]:
    """The latent frames of the last block: the query frames of the last-block profile."""
    return [int(f) for f in ds["query_frame"].values[stats.last_block_rows(ds)]]


def _span(frames_: Sequence[int]) -> str:
    return f"{frames_[0]}" if len(frames_) == 1 else f"{frames_[0]}–{frames_[-1]}"


def _run_title(ds: xr.Dataset, step: int) -> str:
    return f"{_checkpoint(ds)} · {_prompt(ds)} · {step_title(ds, step)}"


def _capital(text: str) -> str:
    """`text` with its first letter in upper case (a title that no longer follows the run)."""
    return text[:1].upper() + text[1:]


def _titled(what: str, ds: xr.Dataset, step: int, titles: bool) -> str:
    """'{what} · {checkpoint} · {prompt} · t=...', or `what` alone without `titles` (a paper's
    figure, whose caption names the run)."""
    return f"{what} · {_run_title(ds, step)}" if titles else what


# --------------------------------------------------------------------------------------------
# per-run figures


def _check_run_heads(layers: dict[int, xr.Dataset], heads: Sequence[tuple[int, int]]) -> None:
    """Every (layer, head) of figure4 exists in the run's datasets `layers`."""
    if not heads:
        raise ValueError("figure4 needs at least one (layer, head)")
    for layer, head in heads:
        if layer not in layers:
            raise ValueError(
                f"figure4 head {head_label(layer, head)} needs layer {layer}, but no frame store "
                f"of this run holds it (layers: {list(layers)})"
            )
        _check_head(layers[layer], head)


@_styled
def plot_figure4(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    annotate: Sequence[str] = ("max",),
    titles: bool = True,
) -> Figure:
    """Deep Forcing Fig. 4: last-block profile of chosen (layer, head)s, the query block's own
    key frames shaded, the maximum (and with `annotate` ('max', 'min') the minimum) annotated.
    The title names the query set; without `titles` it leaves out the run (checkpoint, prompt,
    timestep)."""
    _check_options(measure, frame_axis)
    _check_annotate(annotate)
    layers = _by_layer(datasets)
    _check_run_heads(layers, heads)
    profiles = {layer: last_block_profile(layers[layer], measure, step) for layer, _ in heads}
    first = next(iter(layers.values()))
    block = _query_block(first)

    fig = Figure(
        figsize=(FULL_WIDTH_IN, 2.5 * math.ceil(len(heads) / 3) + 0.2), layout="constrained"
    )
    for ax, (layer, head) in zip(_panel_grid(fig, len(heads), 3), heads, strict=True):
        values = profiles[layer].sel(head=head).values
        _draw_profile(ax, values, frame_axis, annotate=annotate, block=block)
        ax.set_title(head_label(layer, head))
        ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
        ax.set_ylabel(PROFILE_LABELS[measure])
    _query_block_legend(fig, block)
    title = last_block_label(first)
    fig.suptitle(f"{_run_title(first, step)} · {title}" if titles else _capital(title))
    return fig


def _query_block_legend(fig: Figure, block: Sequence[int]) -> None:
    """The legend under the panels naming the shaded band (`_shade_block`)."""
    label = f"the query block's own key frames (latent {_span(block)})"
    fig.legend(handles=[Patch(color=QUERY_BLOCK_COLOR, label=label)], loc="outside lower center")


def last_block_label(ds: xr.Dataset) -> str:
    """'last block: query frames 16-18 (latent)', read from the block coordinate, so it names
    the query set of the statistics whatever the block layout ([3, 3, ...] or [1, 3, 3, ...])."""
    frames = [int(f) for f in ds["query_frame"].values[stats.last_block_rows(ds)]]
    span = f"frame {frames[0]}" if len(frames) == 1 else f"frames {frames[0]}–{frames[-1]}"
    return f"last block: query {span} (latent)"


def _grid_columns(count: int) -> int:
    return 4 if count > 3 else count


@_styled
def plot_heads_grid(
    ds: xr.Dataset,
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """Small multiples of every head's last-block profile, with its sink score in the title and
    the query block's own key frames shaded."""
    _check_options(measure, frame_axis)
    profile = last_block_profile(ds, measure, step)
    scores = head_statistics(ds, measure, step)["sink_score"]
    heads = [int(h) for h in profile["head"].values]
    block = _query_block(ds)
    ncols = _grid_columns(len(heads))
    nrows = math.ceil(len(heads) / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.3 * nrows + 0.8), layout="constrained")
    axes = _panel_grid(fig, len(heads), ncols, sharex=True, sharey=True)
    for index, (ax, head) in enumerate(zip(axes, heads, strict=True)):
        _draw_profile(ax, profile.sel(head=head).values, frame_axis, block=block)
        score = float(scores.loc[head])
        ax.set_title(f"{head_label(_layer(ds), head)} sink {_format_value(score)}")
        if index + ncols >= len(heads):  # no panel below: this one labels the key frames
            ax.tick_params(labelbottom=True)
            ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])  # per panel: the legend takes the foot
    _query_block_legend(fig, block)
    fig.supylabel(PROFILE_LABELS[measure])
    fig.suptitle(_titled(f"Layer {_layer(ds)}, all heads", ds, step, titles))
    return fig


@_styled
def plot_heads_heatmap(
    ds: xr.Dataset,
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    color_limits: tuple[float, float] | None = None,
    titles: bool = True,
) -> Figure:
    """Head x key frame image of the last-block profile; `color_limits` (`color_limits` of the
    values of every layer, as `render_figures` passes them) puts the layers on one scale."""
    _check_options(measure, frame_axis)
    profile = last_block_profile(ds, measure, step)
    values = profile.values
    num_heads, num_frames = values.shape
    cmap, norm, shown = _color_scale(values, measure, color_limits)
    fig = Figure(figsize=(COLUMN_WIDTH_IN * 1.3, 0.18 * num_heads + 1.2), layout="constrained")
    ax = fig.add_subplot()
    mesh = _mesh(
        ax, frame_edges(num_frames, frame_axis), np.arange(num_heads + 1) - 0.5, shown, cmap, norm
    )
    _boxed(ax)
    _frame_axis_format(ax, num_frames, frame_axis)
    ax.set_yticks(range(num_heads))
    ax.set_yticklabels([head_label(_layer(ds), h) for h in profile["head"].values])
    ax.set_ylim(num_heads - 0.5, -0.5)  # first head on top
    ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
    ax.set_ylabel("Head")
    ax.set_title(_titled(f"Layer {_layer(ds)}, last-block profile", ds, step, titles))
    _colorbar(fig, mesh, ax, PROFILE_LABELS[measure])
    return fig


@_styled
def plot_frame_maps(
    ds: xr.Dataset,
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    color_limits: tuple[float, float] | None = None,
    titles: bool = True,
) -> Figure:
    """Query frame x key frame map per head on one shared colour scale; unseen tiles grey.
    `color_limits` (`color_limits` of the maps of every layer, as `render_figures` passes them)
    puts the layers on one scale."""
    _check_options(measure, frame_axis)
    maps = frame_map_values(ds, measure, step)
    values = maps.values
    num_heads, num_queries, num_keys = values.shape
    cmap, norm, shown = _color_scale(values, measure, color_limits)
    key_edges = frame_edges(num_keys, frame_axis)
    query_edges = frame_edges(num_queries, frame_axis)
    blocks = np.asarray(ds["block"].values)
    block_starts = np.flatnonzero(np.diff(blocks)) + 1  # first query frame of every later block

    ncols = _grid_columns(num_heads)
    nrows = math.ceil(num_heads / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.6 * nrows + 0.7), layout="constrained")
    axes = _panel_grid(fig, num_heads, ncols, sharex=True, sharey=True)
    mesh = None
    for ax, head, head_map in zip(axes, maps["head"].values, shown, strict=True):
        mesh = _mesh(ax, key_edges, query_edges, head_map, cmap, norm)
        for start in block_starts:
            ax.axhline(query_edges[start], color="0.4", linewidth=0.3, alpha=0.5)
            if start < num_keys:
                ax.axvline(key_edges[start], color="0.4", linewidth=0.3, alpha=0.5)
        _boxed(ax)
        _frame_axis_format(ax, num_keys, frame_axis)
        _frame_axis_format(ax, num_queries, frame_axis, which="y")
        ax.set_ylim(query_edges[-1], query_edges[0])  # query frame 0 on top, like a matrix
        ax.set_aspect("equal")
        ax.set_title(head_label(_layer(ds), head))
    fig.supxlabel(KEY_AXIS_LABELS[frame_axis])
    fig.supylabel(QUERY_AXIS_LABELS[frame_axis])
    fig.suptitle(_titled(f"Layer {_layer(ds)}, query x key frames", ds, step, titles))
    _colorbar(fig, mesh, axes, MAP_LABELS[measure])
    return fig


def frame_map_values(ds: xr.Dataset, measure: str, step: int) -> xr.DataArray:
    """The maps of `plot_frame_maps`: (head, query_frame, key_frame) of `measure` at `step`."""
    variable = MEASURE_VARIABLES[measure]
    return _select_step(ds, step)[variable].transpose("head", "query_frame", "key_frame")


@_styled
def plot_layer_comparison(
    datasets: Sequence[xr.Dataset],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """Per layer: mean over heads of the last-block profile with a ±1 std band across heads;
    the legend under the panel."""
    _check_options(measure, frame_axis)
    layers = _by_layer(datasets)
    legend_rows = math.ceil(len(layers) / 4)
    fig = Figure(figsize=(COLUMN_WIDTH_IN, 2.4 + 0.12 * legend_rows), layout="constrained")
    ax = fig.add_subplot()
    num_frames = 1
    for color, (layer, ds) in zip(_series_colors(len(layers)), layers.items(), strict=True):
        profile = last_block_profile(ds, measure, step)
        mean = profile.mean("head", skipna=True).values
        spread = profile.std("head", skipna=True).values
        positions = key_frame_positions(mean.shape[0], frame_axis)
        num_frames = max(num_frames, mean.shape[0])
        ax.fill_between(positions, mean - spread, mean + spread, color=color, alpha=0.2, lw=0)
        ax.plot(positions, mean, color=color, marker="o", label=f"Layer {layer}")
    _frame_axis_format(ax, num_frames, frame_axis)
    ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
    ax.set_ylabel(PROFILE_LABELS[measure])
    ax.set_title("Last-block profile per layer, mean ± 1 std over heads")
    fig.legend(loc="outside lower center", ncols=min(len(layers), 4))
    if titles:
        fig.suptitle(_run_title(next(iter(layers.values())), step))
    return fig


@_styled
def plot_statistics(
    datasets: Sequence[xr.Dataset], *, measure: str = "logits", step: int = 0, titles: bool = True
) -> Figure:
    """First / middle / last key frames per layer: mean over heads, std over heads as error bar;
    the legend under the panel."""
    _check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    layers = _by_layer(datasets)
    parts = {layer: head_statistics(ds, measure, step) for layer, ds in layers.items()}
    fig = Figure(
        figsize=(max(COLUMN_WIDTH_IN, 0.45 * len(layers) + 1.5), 2.4), layout="constrained"
    )
    ax = fig.add_subplot()
    x = np.arange(len(layers))
    width = 0.8 / len(PARTS)
    for i, (part, color) in enumerate(zip(PARTS, _series_colors(len(PARTS)), strict=True)):
        means = [float(p[part].mean(skipna=True)) for p in parts.values()]
        stds = [float(p[part].std(skipna=True, ddof=0)) for p in parts.values()]
        ax.bar(
            x + (i - (len(PARTS) - 1) / 2) * width,
            means,
            width=width,
            yerr=stds,
            color=color,
            label=PART_LABELS[part],
            error_kw={"elinewidth": 0.6, "capsize": 1.5, "capthick": 0.6},
        )
    ax.axhline(0.0, color="0.5", linewidth=0.4)
    ax.set_xticks(x)
    ax.set_xticklabels([f"L{layer}" for layer in layers])
    ax.set_xlabel("Layer")
    ax.set_ylabel(PROFILE_LABELS[measure])
    ax.set_title("Last-block key frames, mean ± std over heads")
    fig.legend(loc="outside lower center", ncols=len(PARTS))
    if titles:
        fig.suptitle(_run_title(next(iter(layers.values())), step))
    return fig


# --------------------------------------------------------------------------------------------
# across runs


def _runs_with_head(
    datasets: Sequence[xr.Dataset], layer: int, head: int
) -> dict[str, list[xr.Dataset]]:
    """The datasets holding `layer`, grouped by checkpoint in order of appearance."""
    holding = [ds for ds in datasets if _layer(ds) == layer]
    if not holding:
        raise ValueError(
            f"head {head_label(layer, head)} needs layer {layer}, but no frame store holds it "
            f"(layers: {sorted({_layer(ds) for ds in datasets})})"
        )
    by_checkpoint: dict[str, list[xr.Dataset]] = {}
    for ds in holding:
        _check_head(ds, head)
        by_checkpoint.setdefault(_checkpoint(ds), []).append(ds)
    return by_checkpoint


def _check_compare_inputs(datasets: Sequence[xr.Dataset], heads: Sequence[tuple[int, int]]) -> None:
    if not datasets:
        raise ValueError("no frame datasets given")
    if not heads:
        raise ValueError("need at least one (layer, head)")
    seen: set[tuple[str, str, int]] = set()
    for ds in datasets:
        key = (_checkpoint(ds), _prompt(ds), _layer(ds))
        if key in seen:
            raise ValueError(f"frame dataset {_describe(ds)} given twice")
        seen.add(key)
    for layer, head in heads:
        _runs_with_head(datasets, layer, head)


def _prompt_profiles(
    datasets: Sequence[xr.Dataset], head: int, measure: str, step: int
) -> xr.DataArray:
    """One head's last-block profile for each dataset (one per prompt): (prompt, key_frame)."""
    profiles = [
        last_block_profile(ds, measure, step)
        .sel(head=head, drop=True)
        .expand_dims(prompt=[_prompt(ds)])
        for ds in datasets
    ]
    return xr.concat(profiles, dim="prompt", join="outer")


def _compare_title(datasets: Sequence[xr.Dataset], step: int) -> str:
    labels = list(dict.fromkeys(step_title(ds, step) for ds in datasets))
    return " / ".join(labels)


def _head_panels(fig: Figure, heads: Sequence[tuple[int, int]]) -> list[Axes]:
    return _panel_grid(fig, len(heads), 3)


def _checkpoint_series_figure(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    draw_series: Callable[[Axes, object, str, list[xr.Dataset], int], int],
    *,
    measure: str,
    frame_axis: str,
    title: str,
) -> Figure:
    """One panel per (layer, head); `draw_series(ax, color, checkpoint, datasets, head)` draws one
    checkpoint's series and returns its number of key frames. A checkpoint keeps its colour in
    every panel; one legend under the panels names them."""
    _check_options(measure, frame_axis)
    _check_compare_inputs(datasets, heads)
    checkpoints = list(dict.fromkeys(_checkpoint(ds) for ds in datasets))
    colors = dict(zip(checkpoints, _series_colors(len(checkpoints)), strict=True))
    fig = Figure(
        figsize=(FULL_WIDTH_IN, 2.3 * math.ceil(len(heads) / 3) + 0.25), layout="constrained"
    )
    for ax, (layer, head) in zip(_head_panels(fig, heads), heads, strict=True):
        runs = _runs_with_head(datasets, layer, head)
        num_frames = 1
        for checkpoint, group in runs.items():
            drawn = draw_series(ax, colors[checkpoint], checkpoint, group, head)
            num_frames = max(num_frames, drawn)
        _frame_axis_format(ax, num_frames, frame_axis)
        ax.set_title(head_label(layer, head))
        ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
        ax.set_ylabel(PROFILE_LABELS[measure])
    _figure_legend(fig, min(len(checkpoints), 3))
    fig.suptitle(title)
    return fig


def _figure_legend(fig: Figure, ncols: int, **kwargs) -> None:
    """One legend under the panels, outside every axes, of the labelled lines of all panels
    (a label once)."""
    handles = {}
    for ax in fig.axes:
        for line in ax.lines:
            if not line.get_label().startswith("_"):
                handles.setdefault(line.get_label(), line)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=ncols, **kwargs)


def _compare_heading(
    what: str, datasets: Sequence[xr.Dataset], step: int | None, titles: bool
) -> str:
    """`what`, then the steps shown ('· t=1000') unless `titles` is off."""
    if not titles or step is None:
        return what
    return f"{what} · {_compare_title(datasets, step)}"


@_styled
def plot_checkpoints(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """For each head, one line per checkpoint: the last-block profile averaged over prompts (the
    legend counts them). With one checkpoint the title names it."""

    def draw_mean(ax: Axes, color, checkpoint: str, group: list[xr.Dataset], head: int) -> int:
        mean = _prompt_profiles(group, head, measure, step).mean("prompt", skipna=True).values
        positions = key_frame_positions(mean.shape[0], frame_axis)
        count = "1 prompt" if len(group) == 1 else f"mean of {len(group)} prompts"
        label = f"{checkpoint} ({count})"
        ax.plot(positions, mean, color=color, marker="o", label=label)
        return mean.shape[0]

    checkpoints = list(dict.fromkeys(_checkpoint(ds) for ds in datasets))
    several = any(count > 1 for count in _prompts_per_checkpoint(datasets).values())
    what = "Checkpoints" if len(checkpoints) > 1 else f"Checkpoint {checkpoints[0]}"
    what += ", mean over prompts" if several else ""
    return _checkpoint_series_figure(
        datasets,
        heads,
        draw_mean,
        measure=measure,
        frame_axis=frame_axis,
        title=_compare_heading(what, datasets, step, titles),
    )


def _prompts_per_checkpoint(datasets: Sequence[xr.Dataset]) -> dict[str, int]:
    """How many prompts each checkpoint's datasets hold, in order of appearance."""
    prompts: dict[str, set[str]] = {}
    for ds in datasets:
        prompts.setdefault(_checkpoint(ds), set()).add(_prompt(ds))
    return {checkpoint: len(names) for checkpoint, names in prompts.items()}


@_styled
def plot_prompts(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """For each head and checkpoint: thin line per prompt, mean over prompts, min-max band. A
    checkpoint with one prompt has no spread: its one line is drawn alone ('1 prompt')."""

    def draw_spread(ax: Axes, color, checkpoint: str, group: list[xr.Dataset], head: int) -> int:
        per_prompt = _prompt_profiles(group, head, measure, step)
        positions = key_frame_positions(per_prompt.sizes["key_frame"], frame_axis)
        if len(group) == 1:
            ax.plot(
                positions,
                per_prompt.values[0],
                color=color,
                linewidth=1.4,
                label=f"{checkpoint}: 1 prompt ({_prompt(group[0])})",
            )
            return positions.shape[0]
        for row in per_prompt.values:
            ax.plot(positions, row, color=color, linewidth=0.4, alpha=0.6, label="_prompt")
        ax.fill_between(
            positions,
            per_prompt.min("prompt", skipna=True).values,
            per_prompt.max("prompt", skipna=True).values,
            color=color,
            alpha=0.15,
            linewidth=0,
        )
        ax.plot(
            positions,
            per_prompt.mean("prompt", skipna=True).values,
            color=color,
            linewidth=1.4,
            label=f"{checkpoint}: mean, min–max of {len(group)} prompts",
        )
        return positions.shape[0]

    several = any(count > 1 for count in _prompts_per_checkpoint(datasets).values())
    what = (
        "Prompts: thin lines single prompts, band their min–max"
        if several
        else "Prompts: one per checkpoint, no spread across prompts to show"
    )
    return _checkpoint_series_figure(
        datasets,
        heads,
        draw_spread,
        measure=measure,
        frame_axis=frame_axis,
        title=_compare_heading(what, datasets, step, titles),
    )


def _common_steps(group: Sequence[xr.Dataset]) -> list[tuple[int, str]]:
    """(step, label) present in every dataset of the group, in step order."""
    shared = set.intersection(*({int(s) for s in ds["step"].values} for ds in group))
    first = group[0]
    return [
        (
            step,
            timestep_label(
                first["timestep"].sel(step=step).values, _pass_kind(first.sel(step=step))
            ),
        )
        for step in sorted(shared)
    ]


def _step_colors(labels: Sequence[str]) -> dict[str, object]:
    """Denoising steps from dark (t=1000) to light; the cache pass in black."""
    denoise = [label for label in labels if label != "cache"]
    shades = np.linspace(0.0, 0.85, max(len(denoise), 1))
    colors: dict[str, object] = {
        label: matplotlib.colormaps["viridis"](shade)
        for label, shade in zip(denoise, shades, strict=False)
    }
    colors["cache"] = "black"
    return colors


@_styled
def plot_passes(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
) -> Figure:
    """For each head and checkpoint, one line per step (prompt mean), labelled by timestep; the
    checkpoints of a head (a row) share their y axis."""
    _check_options(measure, frame_axis)
    _check_compare_inputs(datasets, heads)
    checkpoints = list(dict.fromkeys(_checkpoint(ds) for ds in datasets))
    # The steps of every panel, which may differ between layers (a token store of fewer passes,
    # `capture.token_passes`, beside a surveyed layer's every pass), in pass order.
    # Checkpoints with other schedules label a step by their own timestep.
    groups = [_runs_with_head(datasets, layer, head) for layer, head in heads]
    labels = dict.fromkeys(
        label
        for checkpoint in checkpoints
        for step, label in sorted(
            {
                pair
                for runs in groups
                if checkpoint in runs
                for pair in _common_steps(runs[checkpoint])
            }
        )
    )
    colors = _step_colors(list(labels))
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.8 * len(heads) + 0.5), layout="constrained")
    grid = fig.subplots(len(heads), len(checkpoints), squeeze=False, sharey="row")
    for row, (layer, head), runs in zip(grid, heads, groups, strict=True):
        for ax, checkpoint in zip(row, checkpoints, strict=True):
            ax.set_title(f"{head_label(layer, head)} · {checkpoint}")
            ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
            if ax is row[0]:  # the row shares its y axis
                ax.set_ylabel(PROFILE_LABELS[measure])
            group = runs.get(checkpoint, [])
            if not group:
                ax.text(0.5, 0.5, "layer not captured", transform=ax.transAxes, ha="center")
                continue
            num_frames = 1
            for step, label in _common_steps(group):
                mean = _prompt_profiles(group, head, measure, step).mean("prompt", skipna=True)
                positions = key_frame_positions(mean.sizes["key_frame"], frame_axis)
                num_frames = max(num_frames, positions.shape[0])
                ax.plot(
                    positions,
                    mean.values,
                    color=colors[label],
                    linestyle="--" if label == "cache" else "-",
                    marker="o",
                    label=label,
                )
            _frame_axis_format(ax, num_frames, frame_axis)
    # One legend for all panels: a step keeps its colour in every panel.
    handles = {}
    for ax in fig.axes:
        for line in ax.lines:
            handles.setdefault(line.get_label(), line)
    fig.legend(handles.values(), handles.keys(), loc="outside right upper", title="Step")
    fig.suptitle("Denoising steps and cache pass, mean over prompts")
    return fig


# --------------------------------------------------------------------------------------------
# whole-model survey: every layer of one run

SURVEY_MEASURE = "prob_mass"  # sinks are probability mass (Gu et al.)
FIRST_FRAME_LABEL = "First-frame probability mass"
IMPORTANCE_LABEL = "Importance of frame 0"
TOKEN_MASS_LABEL = "Probability mass per key token"
HEAD_CLASS_MARKERS = {"sink": "o", "recent": "^"}  # spread: no marker
SPATIAL_COLUMNS = 4
SINK_RATE_DODGE = 0.08  # layers between the markers of consecutive steps


def survey_statistics(
    datasets: Sequence[xr.Dataset], *, sink_threshold: float = 0.3, recent_threshold: float = 0.5
) -> pd.DataFrame:
    """The per-head `last_block` prob_mass rows of the statistics CSV (`stats.frame_statistics`,
    Contract 3; `stats.per_head`: no head = mean rows) of every layer of one run, stacked: one
    row per (layer, head, step)."""
    tables = [
        stats.per_head(
            stats.frame_statistics(
                ds, "last_block", sink_threshold=sink_threshold, recent_threshold=recent_threshold
            )
        )
        for ds in _by_layer(datasets).values()
    ]
    table = pd.concat(tables, ignore_index=True)
    return table[table["measure"] == SURVEY_MEASURE].reset_index(drop=True)


def _survey_layers(datasets: Sequence[xr.Dataset]) -> dict[int, xr.Dataset]:
    """The layers of one run, which must share their captured steps (and their timesteps)."""
    layers = _by_layer(datasets)
    first = next(iter(layers.values()))
    for ds in layers.values():
        if not (
            np.array_equal(ds["step"].values, first["step"].values)
            and np.array_equal(ds["timestep"].values, first["timestep"].values)
        ):
            raise ValueError(
                f"surveyed layers must share their steps: {_describe(ds)} has steps "
                f"{ds['step'].values.tolist()} at timesteps {ds['timestep'].values.tolist()}, "
                f"{_describe(first)} {first['step'].values.tolist()} at "
                f"{first['timestep'].values.tolist()}"
            )
    return layers


def _survey_title(layers: dict[int, xr.Dataset], what: str, titles: bool = True) -> str:
    """'{checkpoint} · {prompt} · {what}', or `what` alone without `titles`."""
    first = next(iter(layers.values()))
    return f"{_checkpoint(first)} · {_prompt(first)} · {what}" if titles else _capital(what)


def _step_panel_title(ds: xr.Dataset, step: int) -> str:
    return f"step {int(step)} · {step_title(ds, step)}"


def _layer_head_values(
    table: pd.DataFrame, column: str, step: int, layers: Sequence[int], heads: Sequence[int]
) -> np.ndarray:
    """(layer, head) array of one statistics column at `step`; NaN where a head is missing."""
    rows = table[table["step"] == int(step)]
    grid = rows.pivot(index="layer", columns="head", values=column)
    return grid.reindex(index=list(layers), columns=list(heads)).to_numpy(dtype=float)


def _index_ticks(axis, labels: Sequence[int], room_pt: float, label_pt: float) -> None:
    """Ticks for cells 0..n-1 labelled `labels`: every cell where the labels fit (`room_pt` of
    axis for labels `label_pt` apart at least), else every 2nd, 5th, 10th... with minor ticks."""
    count = len(labels)
    fits = max(1, int(room_pt // label_pt))
    every = next(n for n in (1, 2, 5, 10, 20, 50, 100, count) if math.ceil(count / n) <= fits)
    positions = list(range(0, count, every))
    axis.set_ticks(positions)
    axis.set_ticklabels([str(int(labels[i])) for i in positions])
    axis.set_ticks(range(count) if every > 1 else [], minor=True)


def _survey_geometry(num_layers: int, num_heads: int, panels: int) -> tuple[int, float, float]:
    """(columns, panel width, panel height) in inches of the layer x head maps: cells about
    square, a panel at most 4.5 in and at least 0.9 in tall."""
    ncols = min(panels, 5)
    width = (FULL_WIDTH_IN - 0.9) / ncols
    height = min(max(num_layers * width / num_heads, 0.9), 4.5)
    return ncols, width, height


def _layer_head_maps(
    layers: dict[int, xr.Dataset],
    table: pd.DataFrame,
    column: str,
    legend_rows: int = 0,
) -> tuple[Figure, list[Axes], list[int], list[int], QuadMesh]:
    """One layer x head map of `column` per captured step, on one 0..1 colour scale; layer 0 on
    top, head 0 on the left, NaN grey. Returns the figure, its panels, their steps and heads,
    and the last mesh (for the colorbar)."""
    first = next(iter(layers.values()))
    steps = [int(step) for step in first["step"].values]
    heads = sorted({int(head) for ds in layers.values() for head in ds["head"].values})
    layer_list = list(layers)
    maps = [
        (_step_panel_title(first, step), _layer_head_values(table, column, step, layer_list, heads))
        for step in steps
    ]
    fig, axes, mesh = _map_panels(maps, layer_list, heads, legend_rows)
    return fig, axes, steps, heads, mesh


def _map_panels(
    maps: Sequence[tuple[str, np.ndarray]],
    layer_list: Sequence[int],
    heads: Sequence[int],
    legend_rows: int = 0,
) -> tuple[Figure, list[Axes], QuadMesh]:
    """One layer x head panel per (title, values) of `maps`, values (layer, head) on one 0..1
    colour scale; layer 0 on top, head 0 on the left, NaN grey. Returns the figure, its panels
    and the last mesh (for the colorbar)."""
    ncols, width, height = _survey_geometry(len(layer_list), len(heads), len(maps))
    nrows = math.ceil(len(maps) / ncols)
    fig = Figure(
        figsize=(FULL_WIDTH_IN, nrows * (height + 0.3) + 0.6 + 0.15 * legend_rows),
        layout="constrained",
    )
    axes = _panel_grid(fig, len(maps), ncols, sharex=True, sharey=True)
    cmap = matplotlib.colormaps[PROBABILITY_CMAP].with_extremes(bad=UNSEEN_COLOR)
    norm = Normalize(vmin=0.0, vmax=1.0)
    mesh = None
    for index, (ax, (title, values)) in enumerate(zip(axes, maps, strict=True)):
        mesh = _mesh(
            ax,
            np.arange(len(heads) + 1) - 0.5,
            np.arange(len(layer_list) + 1) - 0.5,
            values,
            cmap,
            norm,
        )
        _boxed(ax)
        ax.set_ylim(len(layer_list) - 0.5, -0.5)  # layer 0 on top
        _index_ticks(ax.xaxis, heads, width * 72, 11)
        _index_ticks(ax.yaxis, layer_list, height * 72, 9)
        ax.tick_params(which="minor", length=1.2, width=0.4)
        ax.set_title(title)
        if index + ncols >= len(maps):  # no panel below: this one labels the heads
            ax.tick_params(labelbottom=True)
            ax.set_xlabel("Head")  # per panel: a legend may take the figure's foot
    fig.supylabel("Layer (0-based)")
    return fig, axes, mesh


@_styled
def plot_survey_first_frame(datasets: Sequence[xr.Dataset], *, titles: bool = True) -> Figure:
    """Layer x head map of the last block's mass on its first key frame (the `first` statistic of
    the `last_block` prob_mass profile), one panel per captured step."""
    layers = _survey_layers(datasets)
    table = survey_statistics(list(layers.values()))
    fig, axes, _, _, mesh = _layer_head_maps(layers, table, "first")
    what = "last block's mass on the first key frame, every layer"
    fig.suptitle(_survey_title(layers, what, titles))
    _colorbar(fig, mesh, axes, FIRST_FRAME_LABEL)
    return fig


@_styled
def plot_survey_head_class(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = 0.3,
    recent_threshold: float = 0.5,
    titles: bool = True,
) -> Figure:
    """Layer x head map of Gu et al.'s importance of frame 0, one panel per captured step, each
    cell marked with its head class (statistics column `head_class`): sink o, recent ^, spread
    unmarked."""
    layers = _survey_layers(datasets)
    table = survey_statistics(
        list(layers.values()), sink_threshold=sink_threshold, recent_threshold=recent_threshold
    )
    fig, axes, steps, heads, mesh = _layer_head_maps(layers, table, "importance", legend_rows=1)
    layer_list = list(layers)
    _, width, height = _survey_geometry(len(layer_list), len(heads), len(steps))
    cell_pt = 72 * min(width / len(heads), height / len(layer_list))
    size = max(0.35 * cell_pt, 1.0) ** 2
    style = {"facecolor": "white", "edgecolor": "black", "linewidths": 0.3}
    for ax, step in zip(axes, steps, strict=True):
        classes = table[table["step"] == step]
        for name, marker in HEAD_CLASS_MARKERS.items():
            cells = classes[classes["head_class"] == name]
            ax.scatter(
                [heads.index(int(h)) for h in cells["head"]],
                [layer_list.index(int(layer)) for layer in cells["layer"]],
                s=size,
                marker=marker,
                label=name,
                **style,
            )
    marker_style = {"linestyle": "", "markerfacecolor": "white", "markeredgecolor": "black"}
    handles = [
        Line2D(
            [], [], marker="o", label=f"sink: first-frame mass ≥ {sink_threshold:g}", **marker_style
        ),
        Line2D(
            [],
            [],
            marker="^",
            label=f"recent: own-block mass ≥ {recent_threshold:g}",
            **marker_style,
        ),
        Line2D([], [], marker="", label="spread: no marker", **marker_style),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, title="Head class")
    what = "importance of frame 0 and head class, every layer"
    fig.suptitle(_survey_title(layers, what, titles))
    _colorbar(fig, mesh, axes, IMPORTANCE_LABEL)
    return fig


def _sink_rate_axes(ax: Axes, sink_threshold: float, title: str) -> None:
    """The axes of a sink rate per layer: rates 0..1, integer layers."""
    ax.set_ylim(-0.04, 1.04)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    ax.set_xlabel("Layer (0-based)")
    ax.set_ylabel(f"Sink rate (importance ≥ {sink_threshold:g})")
    ax.set_title(title)


@_styled
def plot_survey_sink_rate(
    datasets: Sequence[xr.Dataset], *, sink_threshold: float = 0.3, titles: bool = True
) -> Figure:
    """Sink rate per layer (`stats.sink_rates`: the share of heads whose importance of frame 0 is
    at least `sink_threshold`), one line per captured step."""
    layers = _survey_layers(datasets)
    table = survey_statistics(list(layers.values()), sink_threshold=sink_threshold)
    rates = stats.sink_rates(table, sink_threshold)
    steps = _common_steps(list(layers.values()))
    colors = _step_colors([label for _, label in steps])
    fig = Figure(
        figsize=(min(max(COLUMN_WIDTH_IN, 0.12 * len(layers) + 2.2), FULL_WIDTH_IN), 2.4),
        layout="constrained",
    )
    ax = fig.add_subplot()
    # Rates are multiples of 1/heads, so steps often coincide: each step's markers sit shifted
    # sideways by SINK_RATE_DODGE layers from the next, centred on the layer.
    for i, (step, label) in enumerate(steps):
        rows = rates[rates["step"] == step].sort_values("layer")
        shift = (i - (len(steps) - 1) / 2) * SINK_RATE_DODGE
        ax.plot(
            rows["layer"].to_numpy(dtype=float) + shift,
            rows["sink_rate"].to_numpy(dtype=float),
            color=colors[label],
            linestyle="--" if label == "cache" else "-",
            linewidth=0.8,
            marker="o",
            label=label,
        )
    _sink_rate_axes(ax, sink_threshold, "Share of heads that are sinks, per layer")
    fig.legend(loc="outside right upper", title="Step")
    num_heads = len(next(iter(layers.values()))["head"])
    fig.suptitle(_survey_title(layers, f"{num_heads} heads per layer", titles))
    return fig


def _survey_runs(datasets: Sequence[xr.Dataset]) -> dict[tuple[str, str], dict[int, xr.Dataset]]:
    """The datasets grouped by (checkpoint, prompt) in order of appearance, each run's layers
    sorted and sharing their steps."""
    runs: dict[tuple[str, str], list[xr.Dataset]] = {}
    for ds in datasets:
        runs.setdefault((_checkpoint(ds), _prompt(ds)), []).append(ds)
    if not runs:
        raise ValueError("no frame datasets given")
    return {run: _survey_layers(group) for run, group in runs.items()}


SURVEY_RUN_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


@_styled
def plot_survey_sink_rate_runs(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = 0.3,
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """Sink rate per layer at `step`, one line per surveyed run: colour by checkpoint, marker by
    prompt."""
    runs = _survey_runs(datasets)
    checkpoints = list(dict.fromkeys(checkpoint for checkpoint, _ in runs))
    prompts = list(dict.fromkeys(prompt for _, prompt in runs))
    colors = dict(zip(checkpoints, _series_colors(len(checkpoints)), strict=True))
    markers = {
        prompt: SURVEY_RUN_MARKERS[i % len(SURVEY_RUN_MARKERS)] for i, prompt in enumerate(prompts)
    }
    fig = Figure(figsize=(FULL_WIDTH_IN, 2.6), layout="constrained")
    ax = fig.add_subplot()
    dodge = min(SINK_RATE_DODGE, 0.5 / len(runs))
    for i, ((checkpoint, prompt), layers) in enumerate(runs.items()):
        for ds in layers.values():
            _select_step(ds, step)
        table = survey_statistics(list(layers.values()), sink_threshold=sink_threshold)
        rates = stats.sink_rates(table, sink_threshold)
        rows = rates[rates["step"] == int(step)].sort_values("layer")
        ax.plot(
            rows["layer"].to_numpy(dtype=float) + (i - (len(runs) - 1) / 2) * dodge,
            rows["sink_rate"].to_numpy(dtype=float),
            color=colors[checkpoint],
            linewidth=0.8,
            marker=markers[prompt],
            label=f"{checkpoint} · {prompt}",
        )
    _sink_rate_axes(
        ax, sink_threshold, "Share of heads that are sinks, per layer, every surveyed run"
    )
    fig.legend(loc="outside right upper", title="Checkpoint · prompt")
    when = f" · step {int(step)} · {_compare_title(datasets, step)}" if titles else ""
    fig.suptitle(f"Survey sink rates{when}")
    return fig


def _position(ds: xr.Dataset, dim: str, label: int) -> int:
    return [int(value) for value in ds[dim].values].index(int(label))


def _pick(array: xr.DataArray, dim: str, label: int, position: int) -> xr.DataArray:
    """Select by label where the store labels `dim`, else by position (step and head are plain
    indices in the stores)."""
    return array.sel({dim: label}) if dim in array.coords else array.isel({dim: position})


def first_frame_image(store: xr.Dataset, ds: xr.Dataset, head: int, step: int) -> np.ndarray:
    """(H', W') image of where in latent frame 0 a head's last block attends: the attention
    store's `key_mass` on frame 0's tokens at `step`, averaged over the last block's query frames
    of the frame dataset `ds` (`stats.query_profile`: NaN where one of them cannot see it).
    Reads only that step, head, those query frames and the first T key tokens."""
    tokens = int(store.attrs["frame_seq_length"])
    _, height, width = (int(n) for n in store.attrs["latent_grid"])
    queries = ds["query_frame"].values[stats.last_block_rows(ds)]
    mass = _pick(store["key_mass"], "step", step, _position(ds, "step", step))
    mass = _pick(mass, "head", head, _position(ds, "head", head))
    mass = mass.sel(query_frame=queries).isel(key_token=slice(0, tokens))
    values = mass.transpose("query_frame", "key_token").values
    return stats.query_profile(values, range(len(queries))).reshape(height, width)


def strongest_sinks(table: pd.DataFrame, step: int, top: int) -> pd.DataFrame:
    """The `top` (layer, head)s of `survey_statistics` with the largest first-frame mass at
    `step`, largest first (ties: lower layer, then lower head); heads without one are left out."""
    rows = table[(table["step"] == int(step)) & np.isfinite(table["first"].astype(float))]
    ordered = rows.assign(order=-rows["first"].astype(float)).sort_values(
        ["order", "layer", "head"], kind="stable"
    )
    return ordered.head(int(top))[["layer", "head", "first"]].reset_index(drop=True)


def _attention_by_layer(
    attention: Sequence[xr.Dataset], layers: dict[int, xr.Dataset]
) -> dict[int, xr.Dataset]:
    """The attention stores by layer; each must belong to the run of `layers` and hold a layer of
    it, and every layer needs its store."""
    first = next(iter(layers.values()))
    run = (_checkpoint(first), _prompt(first))
    stores: dict[int, xr.Dataset] = {}
    for store in attention:
        layer = int(store.attrs["layer"])
        where = f"attention store {store.attrs['checkpoint']}/{store.attrs['prompt']}/layer{layer}"
        if (str(store.attrs["checkpoint"]), str(store.attrs["prompt"])) != run:
            raise ValueError(f"{where} is not of the run {run[0]}/{run[1]}")
        if layer in stores:
            raise ValueError(f"{where} given twice")
        if layer not in layers:
            raise ValueError(f"{where} has no frame dataset (layers: {list(layers)})")
        stores[layer] = store
    missing = [layer for layer in layers if layer not in stores]
    if missing:
        raise ValueError(
            f"the survey figure needs the attention store of every surveyed layer; "
            f"{run[0]}/{run[1]} lacks layers {missing}"
        )
    for layer, store in stores.items():
        ds = layers[layer]
        if not np.allclose(store["timestep"].values, ds["timestep"].values):
            raise ValueError(
                f"attention store of {_describe(ds)} has timesteps "
                f"{store['timestep'].values.tolist()}, its frame dataset "
                f"{ds['timestep'].values.tolist()}"
            )
    return stores


@_styled
def plot_survey_spatial(
    datasets: Sequence[xr.Dataset],
    *,
    attention: Sequence[xr.Dataset] = (),
    step: int = 0,
    top: int = 8,
    titles: bool = True,
) -> Figure:
    """Where in latent frame 0 the `top` strongest first-frame sinks of the survey attend: per
    head the H' x W' image of `first_frame_image` at `step`, on one shared colour scale (linear,
    log when the values span more than a decade)."""
    layers = _survey_layers(datasets)
    first = next(iter(layers.values()))
    _select_step(first, step)
    stores = _attention_by_layer(attention, layers)
    strongest = strongest_sinks(survey_statistics(list(layers.values())), step, top)
    if strongest.empty:
        raise ValueError(
            f"no head of {_checkpoint(first)}/{_prompt(first)} has a first-frame mass at step "
            f"{step}: no probabilities were captured"
        )
    images = np.stack(
        [
            first_frame_image(stores[int(row.layer)], layers[int(row.layer)], row.head, step)
            for row in strongest.itertuples()
        ]
    )
    cmap, norm, shown = _color_scale(images, "probabilities")
    count, (height, width) = len(images), images.shape[1:]
    ncols = min(count, SPATIAL_COLUMNS)
    nrows = math.ceil(count / ncols)
    panel = (FULL_WIDTH_IN - 0.9) / ncols
    fig = Figure(
        figsize=(FULL_WIDTH_IN, nrows * (panel * height / width + 0.22) + 0.6),
        layout="constrained",
    )
    axes = _panel_grid(fig, count, ncols)
    mesh = None
    for ax, row, image in zip(axes, strongest.itertuples(), shown, strict=True):
        mesh = _mesh(ax, np.arange(width + 1) - 0.5, np.arange(height + 1) - 0.5, image, cmap, norm)
        ax.set_ylim(height - 0.5, -0.5)  # latent row 0 on top, like the video
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        _boxed(ax)
        ax.set_title(f"{head_label(row.layer, row.head)} · first frame {row.first:.2f}")
    what = f"where the last block attends in frame 0, {count} strongest first-frame sinks"
    if titles:
        what += f" · {_step_panel_title(first, step)}"
    fig.suptitle(_survey_title(layers, what, titles))
    fig.supxlabel(f"Latent frame 0: {height} x {width} tokens (one per 2x2 patch), as in the video")
    _colorbar(fig, mesh, axes, TOKEN_MASS_LABEL)
    return fig


# --------------------------------------------------------------------------------------------
# KV-cache policies: the recall table of one run (Contract 5, sinkscope.analysis.policies)

RECALL_LABEL = "Recall (share of full-cache attention kept)"
RECALL_MAP_LABEL = "Recall\n(share of attention kept)"  # fits a colorbar 4 layers tall
POLICY_BUDGET_LABEL = "Budget B (latent frames kept)"
POLICY_LAYER_PANELS = 6  # layers drawn by default: all up to this many, else evenly spaced
UNIFORM_LABEL = "uniform attention (B / V)"
IQR_ALPHA = 0.15


def _policy_run(table: pd.DataFrame) -> tuple[str, str]:
    """(checkpoint, prompt) of a recall table, which must hold rows of exactly one run."""
    if table.empty:
        raise ValueError("the recall table has no rows")
    runs = sorted(
        {(str(c), str(p)) for c, p in zip(table["checkpoint"], table["prompt"], strict=True)}
    )
    if len(runs) > 1:
        raise ValueError(f"policy figures show one run (checkpoint, prompt), got {runs}")
    return runs[0]


def policy_last_block(table: pd.DataFrame, step: int) -> pd.DataFrame:
    """The rows of the recall table the policy figures show: step `step`, query block = the last
    block (the one with the most history)."""
    checkpoint, prompt = _policy_run(table)
    steps = sorted({int(s) for s in table["step"]})
    if int(step) not in steps:
        raise ValueError(f"step {step} not in the recall table of {checkpoint}/{prompt}: {steps}")
    rows = table[table["step"] == int(step)]
    rows = rows[rows["query_block"] == rows["query_block"].max()]
    visible = sorted({int(v) for v in rows["visible_frames"]})
    if len(visible) != 1:
        raise ValueError(
            f"the last block of {checkpoint}/{prompt} sees {visible} frames in different rows"
        )
    return rows.reset_index(drop=True)


def default_policy_budget(rows: pd.DataFrame) -> int:
    """The budget of the sink sweep and the map when none is asked for: the middle one (the upper
    of two) of the table's budgets below the visible frames, else the smallest."""
    budgets = sorted({int(b) for b in rows["budget"]})
    below = [b for b in budgets if b < int(rows["visible_frames"].iloc[0])]
    return below[len(below) // 2] if below else budgets[0]


def _policy_budget(rows: pd.DataFrame, budget: int | None) -> int:
    if budget is None:
        return default_policy_budget(rows)
    budgets = sorted({int(b) for b in rows["budget"]})
    if int(budget) not in budgets:
        raise ValueError(f"policy budget {budget} not in the recall table: its budgets {budgets}")
    return int(budget)


def default_policy_layers(layers: Sequence[int]) -> list[int]:
    """Every layer when there are at most POLICY_LAYER_PANELS, else that many evenly spaced ones,
    the first and the last included."""
    layers = sorted({int(layer) for layer in layers})
    if len(layers) <= POLICY_LAYER_PANELS:
        return layers
    picks = np.round(np.linspace(0, len(layers) - 1, POLICY_LAYER_PANELS)).astype(int)
    return [layers[i] for i in sorted(set(picks))]


def _policy_layers(rows: pd.DataFrame, layers: Sequence[int] | None) -> list[int]:
    present = sorted({int(layer) for layer in rows["layer"]})
    if layers is None:
        return default_policy_layers(present)
    if not layers:
        raise ValueError("policy figures need at least one layer to draw")
    missing = sorted({int(layer) for layer in layers} - set(present))
    if missing:
        raise ValueError(f"policy layers {missing} are not in the recall table (layers {present})")
    return sorted({int(layer) for layer in layers})


def head_quartiles(values: np.ndarray) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of the recall of some heads (numpy's linear
    interpolation); NaN without values."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return (math.nan, math.nan, math.nan)
    low, median, high = np.quantile(values, [0.25, 0.5, 0.75])
    return float(low), float(median), float(high)


def _policy_series(rows: pd.DataFrame) -> list[tuple[str, int, pd.DataFrame]]:
    """(policy, S or R, rows) of each drawn policy: window (S = 0), sink_window once per S > 0,
    top_c and top_c_oracle once per R; those absent from the table are left out."""
    series = [("window", 0, rows[rows["policy"] == "window"])]
    sinks = rows[(rows["policy"] == "sink_window") & (rows["sink_frames"].fillna(0) > 0)]
    series += [("sink_window", int(s), group) for s, group in sinks.groupby("sink_frames")]
    for policy in ("top_c", "top_c_oracle"):
        chosen = rows[rows["policy"] == policy]
        series += [(policy, int(r), group) for r, group in chosen.groupby("recent_frames")]
    return [(policy, n, group) for policy, n, group in series if not group.empty]


def policy_label(policy: str, frames: int) -> str:
    """Legend label of a policy: 'window', 'sink + window, S = 3', 'top-C, R = 3'."""
    if policy == "window":
        return "window (S = 0)"
    if policy == "sink_window":
        return f"sinks + window, S = {frames}"
    if policy == "top_c":
        return f"top-C causal, R = {frames}"
    return f"top-C oracle, R = {frames}"


def _policy_styles(series: Sequence[tuple[str, int, pd.DataFrame]]) -> dict[tuple[str, int], dict]:
    """Window black, sink windows blue (darker and a new dash for each larger S), top-C orange,
    its oracle dashed."""
    sinks = [n for policy, n, _ in series if policy == "sink_window"]
    shades = np.linspace(0.45, 0.9, max(len(sinks), 1))
    dashes = ["-", "--", "-.", ":"]
    styles: dict[tuple[str, int], dict] = {}
    for policy, n, _ in series:
        if policy == "window":
            style = {"color": "black", "linestyle": "-", "marker": "o"}
        elif policy == "sink_window":
            i = sinks.index(n)
            color = matplotlib.colormaps["Blues"](shades[i])
            style = {"color": color, "linestyle": dashes[i % len(dashes)], "marker": "s"}
        elif policy == "top_c":
            style = {"color": "#d95f02", "linestyle": "-", "marker": "^"}
        else:
            style = {"color": "#d95f02", "linestyle": "--", "marker": "v", "markerfacecolor": "w"}
        styles[(policy, n)] = style
    return styles


def _quartile_line(ax: Axes, x: np.ndarray, groups: Sequence[np.ndarray], label: str, **style):
    """Median of each group at x, and the interquartile band behind it (label '_iqr: {label}',
    not in the legend)."""
    low, median, high = np.array([head_quartiles(group) for group in groups]).T
    color = style.get("color")
    ax.fill_between(x, low, high, color=color, alpha=IQR_ALPHA, linewidth=0, label=f"_iqr: {label}")
    ax.plot(x, median, label=label, **style)


def _policy_title(
    rows: pd.DataFrame, step: int, what: str, quartiles: bool = True, titles: bool = True
) -> str:
    """Two lines: the run and what is drawn; the query block, its visible frames and the step.
    Without `titles` the run and the step are left out."""
    checkpoint, prompt = _policy_run(rows)
    first = rows.iloc[0]
    label = timestep_label(first["timestep"], first["pass_kind"])
    when = f" · step {int(step)} · {'cache pass' if label == 'cache' else label}"
    block = int(first["query_block"])
    visible = int(first["visible_frames"])
    spread = " · line: median over heads, band: quartiles" if quartiles else ""
    run = f"{checkpoint} · {prompt} · " if titles else ""
    what = what if titles else _capital(what)
    return (
        f"{run}{what}\nlast block (query block {block}, "
        f"V = {visible} visible frames){when if titles else ''}{spread}"
    )


def _recall_axis(ax: Axes) -> None:
    ax.set_ylim(-0.02, 1.04)
    ax.set_yticks([0.0, 0.25, 0.5, 0.75, 1.0])
    ax.grid(axis="y", color="0.9", linewidth=0.4)
    ax.set_axisbelow(True)


def _layer_panels(
    rows: pd.DataFrame, layers: Sequence[int] | None
) -> tuple[Figure, list[Axes], list[tuple[str, list[int]]], int]:
    """The panels of a policy line figure: one per layer of `layers` (default
    `default_policy_layers`), then one pooling the heads of every layer of the table. Returns the
    figure, its panels, (title, layers pooled) of each, and the number of columns."""
    every = sorted({int(layer) for layer in rows["layer"]})
    panels = [(f"Layer {layer}", [layer]) for layer in _policy_layers(rows, layers)]
    panels.append((f"All {len(every)} layers, heads pooled", every))
    ncols = math.ceil(len(panels) / math.ceil(len(panels) / 4))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.75 * nrows + 1.1), layout="constrained")
    axes = _panel_grid(fig, len(panels), ncols, sharex=True, sharey=True)
    return fig, axes, panels, ncols


def _finish_panels(fig: Figure, axes: Sequence[Axes], ncols: int, xlabel: str, title: str) -> None:
    """Budget or sink ticks under every panel without one below, one legend at the foot (a line
    keeps its label in every panel), recall on the y axis, the title."""
    for index, ax in enumerate(axes):
        _recall_axis(ax)
        if index + ncols >= len(axes):  # no panel below: this one labels the x axis
            ax.tick_params(labelbottom=True)
            ax.set_xlabel(xlabel)  # per panel: the legend takes the figure's foot
    handles = {}
    for ax in axes:
        for line in ax.lines:
            if not line.get_label().startswith("_"):
                handles.setdefault(line.get_label(), line)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=3)
    fig.supylabel(RECALL_LABEL)
    fig.suptitle(title)


def _uniform_line(ax: Axes, x: Sequence[float], y: Sequence[float]) -> None:
    """The recall of uniform attention (every visible frame the same share): B / V."""
    ax.plot(
        x, y, color="0.6", linewidth=0.5, linestyle=(0, (1, 1.5)), label=UNIFORM_LABEL, zorder=1
    )


@_styled
def plot_policy_recall(
    table: pd.DataFrame,
    *,
    step: int = 0,
    layers: Sequence[int] | None = None,
    titles: bool = True,
) -> Figure:
    """Recall against budget of every policy of the recall table (Contract 5) at `step`, for the
    last query block: one panel per layer of `layers` (default `default_policy_layers`) and one
    pooling the heads of every layer; a line is the median over heads, its band the quartiles."""
    rows = policy_last_block(table, step)
    series = _policy_series(rows)
    styles = _policy_styles(series)
    visible = int(rows["visible_frames"].iloc[0])
    budgets = sorted({int(b) for b in rows["budget"]})
    limit = max(budgets[-1], visible)
    fig, axes, panels, ncols = _layer_panels(rows, layers)
    for ax, (title, pooled) in zip(axes, panels, strict=True):
        ax.axvline(visible, color="0.6", linewidth=0.5, linestyle="--")
        ax.annotate(
            f"V = {visible}: all kept",
            xy=(visible, 0.02),
            xytext=(-2, 0),
            textcoords="offset points",
            ha="right",
            va="bottom",
            color="0.4",
            fontsize=5.5,
        )
        for policy, n, group in series:
            chosen = group[group["layer"].isin(pooled)]
            by_budget = [(int(b), g["recall"].to_numpy(float)) for b, g in chosen.groupby("budget")]
            if by_budget:
                _quartile_line(
                    ax,
                    np.array([b for b, _ in by_budget], dtype=float),
                    [values for _, values in by_budget],
                    policy_label(policy, n),
                    **styles[(policy, n)],
                )
        _uniform_line(ax, [0, limit], [0, min(limit / visible, 1.0)])
        ax.set_title(title)
        ax.set_xlim(0, limit + 0.5)
        ax.set_xticks(sorted({*budgets, visible}))
    title = _policy_title(rows, step, "recall of KV-cache policies against budget", titles=titles)
    _finish_panels(fig, axes, ncols, POLICY_BUDGET_LABEL, title)
    return fig


@_styled
def plot_policy_sinks(
    table: pd.DataFrame,
    *,
    step: int = 0,
    budget: int | None = None,
    layers: Sequence[int] | None = None,
    titles: bool = True,
) -> Figure:
    """The sink ablation: recall of `sink_window` against its sink frames S at one `budget`
    (default `default_policy_budget`), S = 0 being `window`, for the last query block at `step`:
    one panel per layer of `layers` (default `default_policy_layers`) and one pooling every
    layer's heads, a line the median over heads with its quartile band. The medians of top_c and
    its oracle at the same budget are horizontal references where the table has them."""
    rows = policy_last_block(table, step)
    budget = _policy_budget(rows, budget)
    visible = int(rows["visible_frames"].iloc[0])
    at = rows[rows["budget"] == budget]
    window = at[at["policy"] == "window"]
    if window.empty:
        raise ValueError(f"the recall table has no window rows at budget {budget}")
    sinks = at[(at["policy"] == "sink_window") & (at["sink_frames"].fillna(0) > 0)]
    sweep = pd.concat(
        [window.assign(sweep=0), sinks.assign(sweep=sinks["sink_frames"].astype(int))]
    )
    sink_values = sorted({int(s) for s in sweep["sweep"]})
    references = [
        (policy_label(policy, n), group, dash)
        for (policy, n, group), dash in zip(
            [item for item in _policy_series(at) if item[0] in ("top_c", "top_c_oracle")],
            ["-", "--", "-.", ":"],
            strict=False,
        )
    ]
    fig, axes, panels, ncols = _layer_panels(rows, layers)
    for ax, (title, pooled) in zip(axes, panels, strict=True):
        chosen = sweep[sweep["layer"].isin(pooled)]
        by_sink = [(int(s), g["recall"].to_numpy(float)) for s, g in chosen.groupby("sweep")]
        _quartile_line(
            ax,
            np.array([s for s, _ in by_sink], dtype=float),
            [values for _, values in by_sink],
            f"sinks + window (S = 0: window), B = {budget}",
            color="#08519c",
            marker="s",
        )
        for label, group, dash in references:
            values = group[group["layer"].isin(pooled)]["recall"].to_numpy(float)
            if values.size:
                _, median, _ = head_quartiles(values)
                ax.axhline(
                    median, color="#d95f02", linewidth=0.8, linestyle=dash, label=f"{label}, median"
                )
        _uniform_line(ax, [sink_values[0] - 0.3, sink_values[-1] + 0.3], [budget / visible] * 2)
        ax.set_title(title)
        ax.set_xticks(sink_values)
        ax.set_xticklabels([f"{s}\nwindow" if s == 0 else str(s) for s in sink_values])
        ax.set_xlim(sink_values[0] - 0.3, sink_values[-1] + 0.3)
    what = f"recall against sink frames S at budget B = {budget}"
    title = _policy_title(rows, step, what, titles=titles)
    _finish_panels(fig, axes, ncols, "Sink frames S", title)
    return fig


@_styled
def plot_policy_map(
    table: pd.DataFrame, *, step: int = 0, budget: int | None = None, titles: bool = True
) -> Figure:
    """Layer x head maps of recall at one `budget` (default `default_policy_budget`) for the last
    query block at `step`, one panel per policy: window, sink_window with the largest S below the
    budget, top_c and top_c_oracle where the table has them; one 0..1 colour scale, NaN grey
    (a layer without the policy's rows)."""
    rows = policy_last_block(table, step)
    budget = _policy_budget(rows, budget)
    at = rows[rows["budget"] == budget]
    layer_list = sorted({int(layer) for layer in rows["layer"]})
    heads = sorted({int(head) for head in rows["head"]})
    series = _policy_series(at)
    largest = max((n for policy, n, _ in series if policy == "sink_window"), default=None)
    chosen = [
        (policy, n, group) for policy, n, group in series if policy != "sink_window" or n == largest
    ]
    maps = [
        (
            policy_label(policy, n),
            group.pivot_table(index="layer", columns="head", values="recall", aggfunc="first")
            .reindex(index=layer_list, columns=heads)
            .to_numpy(dtype=float),
        )
        for policy, n, group in chosen
    ]
    fig, axes, mesh = _map_panels(maps, layer_list, heads)
    what = f"recall at budget B = {budget} latent frames, every head"
    fig.suptitle(_policy_title(rows, step, what, quartiles=False, titles=titles))
    _colorbar(fig, mesh, axes, RECALL_MAP_LABEL)
    return fig


# --------------------------------------------------------------------------------------------
# the closed loop: rollouts longer than the cache (Contract 6, sinkscope.analysis.closed_loop)

CLOSED_LOOP_TITLE = "Closed loop: latent deviation from the full-cache rollout"
CLOSED_LOOP_L2_LABEL = "Relative L2 to the full-cache rollout"
CLOSED_LOOP_MEAN_LABEL = "Mean relative L2 from the first eviction on"
CLOSED_LOOP_RECALL_LABEL = "Offline recall where the policy drops keys"
CLOSED_LOOP_COLORS = {  # the families of plot_policy_recall: window black, sinks blue, top-C orange
    "window": "black",
    "sink_window": "#2171b5",
    "deep_sink": "#6a3d9a",
    "top_c": "#d95f02",
}
CLOSED_LOOP_MARKERS = {"window": "o", "sink_window": "s", "deep_sink": "D", "top_c": "^"}
CLOSED_LOOP_LOG_DECADES = 1.0  # a log axis when the non-zero values span more than this
EVICTION_STYLE = {"color": "0.45", "linewidth": 0.6, "linestyle": "--"}
TRAINING_STYLE = {"color": "0.45", "linewidth": 0.8, "linestyle": ":"}
NOTE_WIDTH = 70  # characters per line of a note under a figure one column wide
MARKED_BLOCKS = 16  # the deviation lines mark the first frame of at most this many blocks


def _closed_loop_policies(table: pd.DataFrame) -> list[tuple[str, int, int, int]]:
    """(policy, budget, sink_frames, recent_frames) of every closed-loop policy of `table`, in the
    order window, sink_window, deep_sink, top_c, then by budget, S and R."""
    order = {policy: i for i, policy in enumerate(closed_loop.OFFLINE_POLICY)}
    columns = table[["policy", "budget", "sink_frames", "recent_frames"]]
    keys = {(str(p), int(b), int(s), int(r)) for p, b, s, r in columns.itertuples(index=False)}
    return sorted(keys, key=lambda key: (order.get(key[0], len(order)), *key[1:]))


def _closed_loop_styles(keys: Sequence[tuple[str, int, int, int]]) -> dict[tuple, dict]:
    """Colour and marker by policy (`CLOSED_LOOP_COLORS`, `CLOSED_LOOP_MARKERS`); several budgets
    or S of one policy get lighter shades and new dashes."""
    dashes = ["-", "--", "-.", ":"]
    styles = {}
    for policy in dict.fromkeys(key[0] for key in keys):
        family = [key for key in keys if key[0] == policy]
        base = np.array(matplotlib.colors.to_rgb(CLOSED_LOOP_COLORS.get(policy, "0.3")))
        for i, key in enumerate(family):
            lighten = 0.55 * i / max(len(family) - 1, 1)  # the first one in full colour
            styles[key] = {
                "color": tuple(base + (1 - base) * lighten),
                "linestyle": dashes[i % len(dashes)],
                "marker": CLOSED_LOOP_MARKERS.get(policy, "o"),
            }
    return styles


def _closed_loop_label(key: tuple[str, int, int, int]) -> str:
    return closed_loop.policy_label(*key)


def _closed_loop_runs(table: pd.DataFrame, what: str) -> list[tuple[str, str]]:
    if table.empty:
        raise ValueError(f"the closed-loop {what} has no rows")
    pairs = zip(table["checkpoint"], table["prompt"], strict=True)
    return sorted({(str(checkpoint), str(prompt)) for checkpoint, prompt in pairs})


def _log_worthy(values: np.ndarray) -> bool:
    """True when the positive finite values span more than CLOSED_LOOP_LOG_DECADES decades."""
    values = np.asarray(values, dtype=float)
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size < 2:
        return False
    return bool(np.log10(positive.max() / positive.min()) > CLOSED_LOOP_LOG_DECADES)


def _block_starts(blocks: np.ndarray) -> list[int]:
    """Positions of the first frame of each block (of every k-th block when there are more than
    MARKED_BLOCKS): where a deviation line puts its markers."""
    starts = np.flatnonzero(np.diff(blocks, prepend=blocks[0] - 1) != 0)
    return starts[:: math.ceil(len(starts) / MARKED_BLOCKS)].tolist()


def _log_axis(ax: Axes, values: np.ndarray) -> None:
    """A log y axis with plain numbers (0.01, 0.02, 0.05, 0.1): ticks at 1, 2 and 5 times the
    powers of ten when `values` span at most three decades, else at the powers alone."""
    positive = values[np.isfinite(values) & (values > 0)]
    decades = np.log10(positive.max() / positive.min())
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _run_names(runs: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The shortest name that tells the runs apart: the prompt when the checkpoint is always the
    same, the checkpoint when the prompt is, else both."""
    if len({c for c, _ in runs}) == 1:
        return {run: run[1] for run in runs}
    if len({p for _, p in runs}) == 1:
        return {run: run[0] for run in runs}
    return {run: f"{run[0]} · {run[1]}" for run in runs}


def _frame_list(values: Sequence[int]) -> str:
    return ", ".join(str(int(v)) for v in values)


@_styled
def plot_closed_loop_deviation(
    table: pd.DataFrame, *, train_frames: int | None = None, titles: bool = True
) -> Figure:
    """Relative L2 of each latent frame to the full-cache rollout (the stacked deviation tables of
    Contract 6, `closed_loop.read_deviation`): one panel per (checkpoint, prompt), one line per
    policy, a dashed line at the first frame each budget evicts keys for, a dotted one at the
    training length `train_frames`. The y axis is logarithmic when the non-zero values span more
    than a decade; the exact zeros (frames before the first eviction) are then left out. Without
    `titles` a single run's panel is not named (the caption names it)."""
    runs = _closed_loop_runs(table, "deviation table")
    keys = _closed_loop_policies(table)
    styles = _closed_loop_styles(keys)
    log = _log_worthy(table["rel_l2"].to_numpy(dtype=float))
    last = int(table["frame"].max())
    ncols = min(len(runs), 3)
    nrows = math.ceil(len(runs) / ncols)
    legend_rows = math.ceil((len(keys) + 1 + (train_frames is not None)) / 3)
    fig = Figure(
        figsize=(FULL_WIDTH_IN, 1.9 * nrows + 0.75 + 0.12 * legend_rows), layout="constrained"
    )
    axes = _panel_grid(fig, len(runs), ncols, sharex=True, sharey=True)
    evictions: dict[int, set[int]] = {}  # budget -> its first evicting frames in every panel
    for index, (ax, (checkpoint, prompt)) in enumerate(zip(axes, runs, strict=True)):
        run = table[(table["checkpoint"] == checkpoint) & (table["prompt"] == prompt)]
        run_evictions: dict[int, int] = {}
        for key in keys:
            policy, budget, sink, recent = key
            rows = run[
                (run["policy"] == policy)
                & (run["budget"] == budget)
                & (run["sink_frames"] == sink)
                & (run["recent_frames"] == recent)
            ].sort_values("frame")
            if rows.empty:
                continue
            y = rows["rel_l2"].to_numpy(dtype=float)
            ax.plot(
                rows["frame"].to_numpy(dtype=float),
                np.where(y > 0, y, np.nan) if log else y,
                label=_closed_loop_label(key),
                markersize=2.0,
                markevery=_block_starts(rows["block"].to_numpy()),
                **styles[key],
            )
            start = closed_loop.evicting_frame(rows["frame"], rows["block"], budget)
            if start is not None:
                run_evictions.setdefault(budget, start)
                evictions.setdefault(budget, set()).add(start)
        for budget, start in sorted(run_evictions.items()):
            ax.axvline(start, label=f"_first eviction, B = {budget}", zorder=1, **EVICTION_STYLE)
        if train_frames is not None:
            ax.axvline(train_frames, label="_training length", zorder=1, **TRAINING_STYLE)
        if titles or len(runs) > 1:
            ax.set_title(f"{checkpoint} · {prompt}")
        ax.set_xlim(-0.5, last + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
        ax.grid(axis="y", color="0.9", linewidth=0.4)
        ax.set_axisbelow(True)
        if index + ncols >= len(axes):  # no panel below: this one labels the x axis
            ax.tick_params(labelbottom=True)
            ax.set_xlabel("Latent frame (0-based)")
    if log:
        _log_axis(axes[0], table["rel_l2"].to_numpy(dtype=float))
    else:
        axes[0].set_ylim(bottom=0)
    handles = {}
    for ax in axes:
        for line in ax.lines:
            if not line.get_label().startswith("_"):
                handles.setdefault(line.get_label(), line)
    if evictions:
        budgets = sorted(evictions)
        if any(len(starts) > 1 for starts in evictions.values()):
            label = "first eviction of each budget"
        elif len(budgets) == 1:
            label = f"first eviction (frame {min(evictions[budgets[0]])}, B = {budgets[0]})"
        else:
            starts = _frame_list(min(evictions[budget]) for budget in budgets)
            label = f"first eviction (frames {starts} for B = {_frame_list(budgets)})"
        handles[label] = Line2D([], [], **EVICTION_STYLE)
    if train_frames is not None:
        handles[f"training length ({int(train_frames)} frames)"] = Line2D([], [], **TRAINING_STYLE)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=3)
    fig.supylabel(f"{CLOSED_LOOP_L2_LABEL}\n‖x − x_full‖ / ‖x_full‖ per frame")
    zeros = log and bool((table["rel_l2"] == 0).any())
    detail = "clean latents, same noise, rolled out past the cache"
    if zeros:
        detail += " · log axis: frames equal to the reference (0) are not drawn"
    fig.suptitle(f"{CLOSED_LOOP_TITLE}\n{detail}")
    return fig


POINT_LABEL_PT = 5.0  # font size of the run names beside the points
_LABEL_OFFSETS = [(3, 1, "left", "bottom"), (3, -1, "left", "top"), (-3, 1, "right", "bottom")]
_LABEL_OFFSETS += [(-3, -1, "right", "top"), (0, 4, "center", "bottom"), (0, -4, "center", "top")]


def _label_points(ax: Axes, x: np.ndarray, y: np.ndarray, labels: Sequence[str]) -> None:
    """Name each point beside it, at the first of `_LABEL_OFFSETS` where the name covers no
    other name or point (measured in points on the axes' current limits, scales and figure
    size), else up and to the right. Call once the limits and scales are final."""
    width, height = (ax.figure.get_size_inches() * ax.get_position().size * 72).tolist()
    to_axes = ax.transAxes.inverted()
    points = [
        tuple(to_axes.transform(ax.transData.transform((xv, yv))) * (width, height))
        for xv, yv in zip(x, y, strict=True)
    ]
    taken = [(px - 2.5, py - 2.5, px + 2.5, py + 2.5) for px, py in points]
    for (xv, yv), (px, py), label in zip(zip(x, y, strict=True), points, labels, strict=True):
        text_width = 0.55 * POINT_LABEL_PT * len(label)
        place = _LABEL_OFFSETS[0]
        for dx, dy, ha, va in _LABEL_OFFSETS:
            left = {"left": px + dx, "right": px + dx - text_width}.get(ha, px - text_width / 2)
            bottom = py + dy if va == "bottom" else py + dy - POINT_LABEL_PT
            box = (left, bottom, left + text_width, bottom + POINT_LABEL_PT)
            if all(
                box[2] <= o[0] or o[2] <= box[0] or box[3] <= o[1] or o[3] <= box[1] for o in taken
            ):
                place = (dx, dy, ha, va)
                taken.append(box)
                break
        dx, dy, ha, va = place
        ax.annotate(
            label,
            xy=(xv, yv),
            xytext=(dx, dy),
            textcoords="offset points",
            ha=ha,
            va=va,
            fontsize=POINT_LABEL_PT,
            color="0.35",
        )


NOTE_ITEMS = 8  # policies named in the note of rows not drawn; the rest are counted


def _left_out_note(
    rows: pd.DataFrame, keys: Sequence[tuple], names: dict[tuple[str, str], str]
) -> str:
    """'Not drawn, no offline recall: top_c B=9 R=3 (cat, sea); never evicts: window B=42.',
    the runs left out when the figure has several, wrapped under the figure."""
    reasons: dict[str, dict[tuple, list[str]]] = {"no offline recall": {}, "never evicts": {}}
    for row in rows.itertuples(index=False):
        key = (str(row.policy), int(row.budget), int(row.sink_frames), int(row.recent_frames))
        why = "never evicts" if not np.isfinite(row.rel_l2_mean) else "no offline recall"
        name = names[(str(row.checkpoint), str(row.prompt))].replace(" ", "\N{NO-BREAK SPACE}")
        reasons[why].setdefault(key, []).append(name)  # a run's name stays on one line
    parts, shown, hidden = [], 0, 0
    for why, by_key in reasons.items():
        items = []
        for key in [key for key in keys if key in by_key]:
            if shown >= NOTE_ITEMS:
                hidden += 1
                continue
            shown += 1
            runs = by_key[key]
            if len(names) == 1:  # the title names the run
                where = ""
            elif len(runs) == len(names):
                where = " (every run)"
            else:
                where = f" ({', '.join(runs)})"
            items.append(f"{_closed_loop_label(key)}{where}")
        if items:
            parts.append(f"{why}: {', '.join(items)}")
    text = "Not drawn, " + "; ".join(parts)
    text += f"; and {hidden} more (see the summary table)." if hidden else "."
    return "\n".join(textwrap.wrap(text, NOTE_WIDTH))


@_styled
def plot_closed_loop_recall(table: pd.DataFrame, *, titles: bool = True) -> Figure:
    """Mean relative L2 from the first eviction on (y) against the offline recall of the same
    choice of keys (x) of each closed-loop rollout (the summary, `closed_loop.closed_loop_summary`):
    one point per run and policy, colour and marker by policy. Rows without a recall or a mean
    (no offline rows, no eviction) are named in a note instead. Without `titles` the title does
    not name the run (the caption does)."""
    runs = _closed_loop_runs(table, "summary")
    keys = _closed_loop_policies(table)
    styles = _closed_loop_styles(keys)
    names = _run_names(runs)
    recall = table["recall"].to_numpy(dtype=float)
    mean = table["rel_l2_mean"].to_numpy(dtype=float)
    drawn = table[np.isfinite(recall) & np.isfinite(mean)]
    left_out = table[~(np.isfinite(recall) & np.isfinite(mean))]
    legend_rows = math.ceil(len(keys) / 2)
    fig = Figure(figsize=(COLUMN_WIDTH_IN, 2.9 + 0.12 * legend_rows), layout="constrained")
    ax = fig.add_subplot()
    for key in keys:
        policy, budget, sink, recent = key
        rows = drawn[
            (drawn["policy"] == policy)
            & (drawn["budget"] == budget)
            & (drawn["sink_frames"] == sink)
            & (drawn["recent_frames"] == recent)
        ]
        if rows.empty:
            continue
        style = {**styles[key], "linestyle": "none"}
        ax.plot(
            rows["recall"].to_numpy(dtype=float),
            rows["rel_l2_mean"].to_numpy(dtype=float),
            label=_closed_loop_label(key),
            markersize=4.6 if style["marker"] == "^" else 4.0,  # a triangle looks smaller
            markeredgewidth=0.5,
            markeredgecolor="white",
            **style,
        )
    ax.set_xlim(-0.02, 1.02)
    ax.set_xticks([0.0, 0.25, 0.5, 0.75, 1.0])
    ax.grid(color="0.9", linewidth=0.4)
    ax.set_axisbelow(True)
    means = drawn["rel_l2_mean"].to_numpy(dtype=float)
    if _log_worthy(means) and (means > 0).all():
        _log_axis(ax, means)
    elif means.size and means.max() > 0:
        ax.set_ylim(0, means.max() * 1.12)  # room above the top point for its name
    else:
        ax.set_ylim(bottom=0)
    if len(runs) > 1 and not drawn.empty:
        _label_points(
            ax,
            drawn["recall"].to_numpy(dtype=float),
            drawn["rel_l2_mean"].to_numpy(dtype=float),
            [
                names[(str(c), str(p))]
                for c, p in zip(drawn["checkpoint"], drawn["prompt"], strict=True)
            ],
        )
    ax.set_xlabel(f"{CLOSED_LOOP_RECALL_LABEL}\n(mean over the captured layers, heads and steps)")
    ax.set_ylabel(CLOSED_LOOP_MEAN_LABEL)
    if drawn.empty:
        ax.text(
            0.5,
            0.5,
            "no rollout has both an offline recall and an eviction",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="0.4",
        )
        ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.02), ncols=2)
    if not left_out.empty:
        fig.supxlabel(_left_out_note(left_out, keys, names), fontsize=5.5, color="0.35")
    if len(runs) > 1:
        where = f"{len(runs)} runs · one point per run and policy"
    elif titles:
        where = f"{runs[0][0]} · {runs[0][1]} · one point per policy"
    else:
        where = "one point per policy"
    fig.suptitle(f"Closed loop: deviation against offline recall\n{where}")
    return fig


# --------------------------------------------------------------------------------------------
# writing files


def save_figure(fig: Figure, path: str | os.PathLike, fmt: str = "svg") -> Path:
    """Write atomically (temporary file, then rename): a failed run leaves no partial figure."""
    _check_choice("fmt", fmt, figures.FORMATS)
    path = Path(path)
    try:
        with _style(), atomic_path(path) as temporary:
            fig.savefig(temporary, format=fmt, metadata=_SAVE_METADATA[fmt])
    finally:
        fig.clear()  # release the artists now; callers do not reuse a saved figure
    return path


def _datasets_for(
    layers: str, datasets: Sequence[xr.Dataset], heads: Sequence[tuple[int, int]]
) -> list[xr.Dataset]:
    """The datasets a run or compare figure reads (`FigureKind.layers`): all (`captured`), or
    those of the heads' layers (`heads`). When none holds a head's layer all are kept, so that
    the figure's own check names the missing layer."""
    if layers == "captured":
        return list(datasets)
    return _of_layers(datasets, [layer for layer, _ in heads]) or list(datasets)


def _of_layers(datasets: Sequence[xr.Dataset], layers: Sequence[int] | None) -> list[xr.Dataset]:
    """The datasets of `layers` (all of them for None)."""
    if layers is None:
        return list(datasets)
    wanted = {int(layer) for layer in layers}
    return [ds for ds in datasets if _layer(ds) in wanted]


def _survey_datasets(
    datasets: Sequence[xr.Dataset], attention: Sequence[xr.Dataset]
) -> list[xr.Dataset]:
    """The frame datasets a survey figure shows: those of the attention stores' layers when
    stores are given (each needs one), else every one given."""
    if not attention:
        return list(datasets)
    wanted = {_store_key(store) for store in attention}
    have = {(_checkpoint(ds), _prompt(ds), _layer(ds)) for ds in datasets}
    missing = [f"{c}/{p}/layer{layer}" for c, p, layer in sorted(wanted - have)]
    if missing:
        raise ValueError(f"the attention stores {missing} have no frame dataset given")
    return [ds for ds in datasets if (_checkpoint(ds), _prompt(ds), _layer(ds)) in wanted]


def _store_key(store: xr.Dataset) -> tuple[str, str, int]:
    return (str(store.attrs["checkpoint"]), str(store.attrs["prompt"]), int(store.attrs["layer"]))


def render_figures(
    frame_stores: Sequence[str | os.PathLike],
    outputs: Sequence[str | os.PathLike],
    *,
    heads: Sequence[tuple[int, int]],
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    attention_stores: Sequence[str | os.PathLike] = (),
    sink_threshold: float = 0.3,
    recent_threshold: float = 0.5,
    policy_tables: Sequence[str | os.PathLike] = (),
    policy_budget: int | None = None,
    policy_layers: Sequence[int] | None = None,
    deviation_tables: Sequence[str | os.PathLike] = (),
    closed_loop_summary: str | os.PathLike | None = None,
    train_frames: int | None = None,
    annotate: Sequence[str] = ("max",),
    titles: bool = True,
    shared_scale: bool = True,
    figure_layers: Sequence[int] | None = None,
    survey_layers: Sequence[int] | None = None,
) -> list[Path]:
    """Draw each file of `outputs` from the frame datasets `frame_stores`; returns the paths.

    What a file shows comes from its name (`figures.parse_figure_path`: kind, layer, format), so
    the rules' outputs alone decide what is drawn and where. Layer, run and survey figures need
    the stores of one (checkpoint, prompt); compare figures take any number of runs. Survey
    figures (and survey compare figures) show the layers of the attention stores
    `attention_stores` (Contract 4; every one needs its frame dataset), or every frame dataset
    when none is given; `survey_spatial` needs the stores. `figure_layers` and `survey_layers`,
    when given, pick the frame datasets the other figures and the survey figures show, so that
    one call draws a run's figures and its survey from one list. `sink_threshold` and
    `recent_threshold` are the statistics' (head class, sink rate). Policy figures draw the recall
    tables `policy_tables` (Contract 5) of one run, at step `step`, with `policy_budget` (the sink
    sweep and map; default `default_policy_budget`) and `policy_layers` (default
    `default_policy_layers`); they need no frame dataset. Closed-loop figures draw the
    deviation tables `deviation_tables` (Contract 6, every run and policy: `closed_loop_deviation`)
    or the summary `closed_loop_summary` (`closed_loop_recall_deviation`), with the training length
    `train_frames` (latent frames) marked; they need no frame dataset either.

    Options for a paper (`figures` in the config): `annotate` ('max', 'min': what figure4
    annotates), `titles` (False: titles leave out the run's checkpoint, prompt and timestep,
    which the caption then names), `shared_scale` (True: the colour maps of a run's layers,
    heads heatmaps and frame maps, share one colour scale, so that the files compare; False: each
    file its own). Every request (heads, step, options, names) is checked before the first file
    is written.
    """
    _check_options(measure, frame_axis)
    _check_annotate(annotate)
    plan = [(Path(out), *figures.parse_figure_path(out)) for out in outputs]
    kinds = [kind for _, kind, _, _ in plan]
    datasets = [open_frame_dataset(path) for path in frame_stores]
    # The frame datasets of the layer, run and compare figures (the survey picks its own).
    shown = _of_layers(datasets, figure_layers)
    if not datasets and any(kind.scope not in ("policies", "closed_loop") for kind in kinds):
        raise ValueError("no frame datasets given")
    tables = _closed_loop_tables(kinds, deviation_tables, closed_loop_summary, train_frames)
    attention = [open_attention_store(path) for path in attention_stores]
    for ds in datasets:
        _select_step(ds, step)
    if any(kind.scope == "policies" for kind in kinds):
        if not policy_tables:
            raise ValueError("policy figures need the run's recall table (policy_tables)")
        table = pd.concat([policies.read_policies(path) for path in policy_tables])
        rows = policy_last_block(table, step)
        _policy_budget(rows, policy_budget)
        _policy_layers(rows, policy_layers)
    if any(kind.scope in ("layer", "run") for kind in kinds):
        layers = _by_layer(shown)
        _check_run_heads(layers, heads)
    if any(kind.scope == "compare" and not kind.surveyed for kind in kinds):
        _check_compare_inputs(_datasets_for("heads", shown, heads), heads)
    if any(kind.surveyed for kind in kinds):
        survey = _survey_datasets(_of_layers(datasets, survey_layers), attention)
        runs = _survey_runs(survey)
    if any(kind.scope == "survey" for kind in kinds):
        if len(runs) > 1:
            raise ValueError(f"survey figures show one run, got {list(runs)}")
        surveyed = next(iter(runs.values()))
        if attention or any("attention" in _accepted(kind) for kind in kinds):
            _attention_by_layer(attention, surveyed)
    options = {
        "heads": heads,
        "measure": measure,
        "frame_axis": frame_axis,
        "step": step,
        "attention": attention,
        "sink_threshold": sink_threshold,
        "recent_threshold": recent_threshold,
        "budget": policy_budget,
        "layers": policy_layers,
        "train_frames": train_frames,
        "annotate": tuple(annotate),
        "titles": bool(titles),
    }
    scales: dict[str, tuple[float, float]] = {}
    written = []
    for path, kind, layer, fmt in plan:
        builder = globals()[kind.builder]
        kwargs = {name: value for name, value in options.items() if name in _accepted(kind)}
        if shared_scale and kind.builder in SHARED_SCALES:
            if kind.builder not in scales:
                values = [SHARED_SCALES[kind.builder](ds, measure, step) for ds in layers.values()]
                pooled = np.concatenate([np.ravel(v) for v in values])
                scales[kind.builder] = color_limits(pooled, measure)
            kwargs["color_limits"] = scales[kind.builder]
        if kind.scope == "layer":
            if layer not in layers:
                raise ValueError(f"{path}: no frame dataset of layer {layer} given")
            data = layers[layer]
        elif kind.surveyed:
            data = survey
        elif kind.scope == "policies":
            data = table
        elif kind.scope == "closed_loop":
            data = tables[CLOSED_LOOP_TABLES[kind.builder]]
        else:
            data = _datasets_for(kind.layers, shown, heads)
        written.append(save_figure(builder(data, **kwargs), path, fmt))
    return written


# The layer figures whose colour maps of a run's layers share one scale (`shared_scale`): the
# values each draws, of one layer's dataset.
SHARED_SCALES: dict[str, Callable[[xr.Dataset, str, int], np.ndarray]] = {
    "plot_heads_heatmap": lambda ds, measure, step: last_block_profile(ds, measure, step).values,
    "plot_frame_maps": lambda ds, measure, step: frame_map_values(ds, measure, step).values,
}


# The table each closed-loop builder draws.
CLOSED_LOOP_TABLES = {
    "plot_closed_loop_deviation": "deviation",
    "plot_closed_loop_recall": "summary",
}


def _closed_loop_tables(
    kinds: Sequence[figures.FigureKind],
    deviation_tables: Sequence[str | os.PathLike],
    summary: str | os.PathLike | None,
    train_frames: int | None,
) -> dict[str, pd.DataFrame]:
    """The tables the closed-loop kinds of `kinds` draw, read and checked (none else)."""
    wanted = {CLOSED_LOOP_TABLES[kind.builder] for kind in kinds if kind.scope == "closed_loop"}
    if train_frames is not None and (int(train_frames) != train_frames or train_frames < 1):
        raise ValueError(f"train_frames must be a whole number >= 1, got {train_frames!r}")
    tables = {}
    if "deviation" in wanted:
        if not deviation_tables:
            raise ValueError("closed-loop deviation figures need the deviation tables")
        tables["deviation"] = closed_loop.read_deviation(list(deviation_tables))
    if "summary" in wanted:
        if summary is None:
            raise ValueError("closed-loop recall figures need the closed-loop summary")
        tables["summary"] = closed_loop.read_closed_loop_summary(summary)
        _closed_loop_runs(tables["summary"], "summary")
    return tables


def _accepted(kind: figures.FigureKind) -> set[str]:
    """The options the builder of `kind` takes."""
    return set(inspect.signature(globals()[kind.builder]).parameters)
