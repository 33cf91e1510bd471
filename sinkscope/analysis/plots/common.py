"""What every figure family shares: the style, names and labels, the frame datasets' accessors,
frame axes and edges, colour scales and limits, panel grids, legends, titles, and writing files.

Family modules (`run`, `compare`, `survey`, `policy`, `closed_loop`) import this module and
`sinkscope.analysis.stats`, never each other. Figures are bare `Figure` objects (no pyplot global
state, no GUI backend) built under one style (`STYLE`, applied by `styled`): text stays text in
SVG, everything is vector, and the same data give the same bytes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import wraps
from pathlib import Path

import matplotlib
import numpy as np
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.collections import QuadMesh
from matplotlib.colors import Colormap, LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedFormatter, FixedLocator, LogFormatter, MaxNLocator

from sinkscope import frames
from sinkscope.analysis import figures, stats
from sinkscope.schedules import KEY_VERSION, NOISY_VERSION, UNSEEN_VERSION
from sinkscope.storage import atomic_path

MEASURE_VARIABLES = {"logits": "logit_mean", "probabilities": "prob_mass"}
PROFILE_LABELS = {
    "logits": "Attention logit (query-averaged)",
    "probabilities": "Probability mass (query-averaged)",
}
FRAME_AXES = ("latent", "video")
KEY_AXIS_LABELS = {"latent": "Key frame (latent)", "video": "Key frame (video)"}
QUERY_AXIS_LABELS = {"latent": "Query frame (latent)", "video": "Query frame (video)"}

UNSEEN_COLOR = "0.8"  # tiles the query frame could not see
ANCHOR_LABEL = "anchor (block 0's keys, re-positioned)"  # Rolling Forcing's anchor, in legends
MAP_LOG_DECADES = 1.0  # a probability map is drawn on a log scale when it spans more decades
# Every cell of a colour map (and of a colorbar) is stroked in its own colour this wide (points),
# so neighbours overlap: vector viewers otherwise antialias each cell's edge on its own and show
# hairline seams between cells. The maps stay vector (no embedded image).
SEAM_STROKE_PT = 0.3
LOGIT_CMAP = "RdBu_r"
PROBABILITY_CMAP = "viridis"

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


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_options(measure: str, frame_axis: str) -> None:
    check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    check_choice("frame_axis", frame_axis, FRAME_AXES)


def layer_of(ds: xr.Dataset) -> int:
    return int(ds["layer"].values)


def checkpoint_of(ds: xr.Dataset) -> str:
    return str(ds["checkpoint"].values)


def prompt_of(ds: xr.Dataset) -> str:
    return str(ds["prompt"].values)


def describe(ds: xr.Dataset) -> str:
    return f"{checkpoint_of(ds)}/{prompt_of(ds)}/layer{layer_of(ds)}"


def by_layer(datasets: Sequence[xr.Dataset]) -> dict[int, xr.Dataset]:
    """Layers of one run, sorted; all datasets must share checkpoint and prompt."""
    if not datasets:
        raise ValueError("no frame datasets given")
    runs = {(checkpoint_of(ds), prompt_of(ds)) for ds in datasets}
    if len(runs) > 1:
        raise ValueError(f"frame datasets of one run must share checkpoint and prompt, got {runs}")
    layers: dict[int, xr.Dataset] = {}
    for ds in datasets:
        if layer_of(ds) in layers:
            raise ValueError(f"layer {layer_of(ds)} given twice: {describe(ds)}")
        layers[layer_of(ds)] = ds
    return dict(sorted(layers.items()))


def select_step(ds: xr.Dataset, step: int) -> xr.Dataset:
    steps = [int(s) for s in ds["step"].values]
    if int(step) not in steps:
        raise ValueError(f"step {step} not in {describe(ds)}: its steps are {steps}")
    return ds.sel(step=int(step))


def step_title(ds: xr.Dataset, step: int) -> str:
    """'t=1000' for a denoising step, 'cache pass' for the cache-update pass."""
    one = select_step(ds, step)
    label = timestep_label(one["timestep"].values, pass_kind_of(one))
    return "cache pass" if label == "cache" else label


def pass_kind_of(one_step: xr.Dataset) -> str:
    return str(one_step["pass_kind"].values) if "pass_kind" in one_step.variables else "denoise"


def check_head(ds: xr.Dataset, head: int) -> None:
    heads = [int(h) for h in ds["head"].values]
    if int(head) not in heads:
        raise ValueError(
            f"head {head} ({head_label(layer_of(ds), head)}) out of range: {describe(ds)} "
            f"has heads {heads[0]}..{heads[-1]}"
        )


# --------------------------------------------------------------------------------------------
# the plotted numbers: read from sinkscope.analysis.stats, the functions that write Contract 3


def last_block_profile(ds: xr.Dataset, measure: str = "logits", step: int = 0) -> xr.DataArray:
    """The last-block profile the statistics see (`stats.last_block_profile`): (head, key_frame).

    NaN where some query frame of the last block could not see that key frame.
    """
    check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    select_step(ds, step)
    profile = stats.last_block_profile(ds, MEASURE_VARIABLES[measure], step)
    profile.attrs = {"long_name": PROFILE_LABELS[measure]}
    return profile


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
    check_choice("frame_axis", frame_axis, FRAME_AXES)
    if frame_axis == "video":
        spans = [frames.video_frames_of_latent(k) for k in range(max(num_frames, 2))]
        stops = [span.stop - 0.5 for span in spans[:num_frames]]
        return np.array([stops[0] - len(spans[1]), *stops])
    return np.arange(num_frames + 1, dtype=np.float64) - 0.5


# --------------------------------------------------------------------------------------------
# key versions: which copy of a key frame a query saw (`key_version`, Contract 2)


def marks_key_versions(ds: xr.Dataset) -> bool:
    """Whether figures mark the key versions of `ds`: in a rolling run, or wherever a query saw
    the anchor or a noisy copy of a frame outside its own block. Not where block-causal attention
    says it all (Self-Forcing: the own block noisy, earlier frames clean), nor in datasets
    without `key_version`."""
    if "key_version" not in ds.variables:
        return False
    if ds.attrs.get("sampler_kind") == "rolling":
        return True
    versions = ds["key_version"].transpose("step", "query_frame", "key_frame").values
    block_of = dict(
        zip(ds["query_frame"].values.tolist(), ds["block"].values.tolist(), strict=True)
    )
    query_blocks = np.asarray(ds["block"].values)
    key_blocks = np.array([block_of.get(k, -1) for k in ds["key_frame"].values.tolist()])
    own_block = query_blocks[:, None] == key_blocks[None, :]
    anchor = versions == KEY_VERSION["anchor"]
    return bool(anchor.any() or ((versions >= NOISY_VERSION) & ~own_block).any())


def key_versions(ds: xr.Dataset, step: int) -> np.ndarray:
    """(query_frame, key_frame) version codes at `step` (`sinkscope.schedules`)."""
    one = select_step(ds, step)["key_version"]
    return one.transpose("query_frame", "key_frame").values.astype(np.int64)


def last_block_versions(ds: xr.Dataset, step: int) -> np.ndarray:
    """(key_frame,) the version of each key frame the last block's query frames saw at `step`;
    UNSEEN_VERSION where some of them did not see it or they saw different copies."""
    rows = key_versions(ds, step)[stats.last_block_rows(ds)]
    agree = (rows == rows[0]).all(axis=0)
    return np.where(agree, rows[0], UNSEEN_VERSION)


def noisy_steps(ds: xr.Dataset) -> int:
    """How many denoising steps the noisy version codes of `ds` can name."""
    if "passes_per_block" in ds.attrs:
        return int(ds.attrs["passes_per_block"]) - 1
    return int((np.asarray(ds["pass_kind"].values) != "cache").sum())


def version_label(ds: xr.Dataset, code: int) -> str:
    """Legend label of a version code: ANCHOR_LABEL, 'clean copy', 'noisy copy, t=952.38': the
    timestep of denoising step s where the dataset captured that pass (`passes` attribute: the
    pass of each step label; without it the labels are the passes), else 'noisy copy, step s'."""
    if code == KEY_VERSION["anchor"]:
        return ANCHOR_LABEL
    if code == KEY_VERSION["clean"]:
        return "clean copy"
    step = int(code) - NOISY_VERSION
    passes = [int(p) for p in ds.attrs.get("passes", ds["step"].values)]
    labels = [int(s) for s in ds["step"].values]
    if step in passes and passes.index(step) < len(labels):
        one = ds.sel(step=labels[passes.index(step)])
        if pass_kind_of(one) != "cache":
            return f"noisy copy, {timestep_label(one['timestep'].values, 'denoise')}"
    return f"noisy copy, step {step}"


# --------------------------------------------------------------------------------------------
# style, panel grids and frame axes


@contextmanager
def in_style() -> Iterator[None]:
    with matplotlib.rc_context(STYLE):
        yield


def styled(builder: Callable[..., Figure]) -> Callable[..., Figure]:
    """Build a figure under STYLE: font sizes and families are fixed when artists are created."""

    @wraps(builder)
    def build(*args, **kwargs) -> Figure:
        with in_style():
            return builder(*args, **kwargs)

    return build


def panel_grid(fig: Figure, count: int, ncols: int, **subplot_kw) -> list[Axes]:
    """`count` panels in rows of `ncols`; unused grid cells are removed, not left blank."""
    ncols = max(1, min(ncols, count))
    nrows = math.ceil(count / ncols)
    grid = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw).ravel()
    for extra in grid[count:]:
        extra.remove()
    return list(grid[:count])


def format_frame_axis(ax: Axes, num_frames: int, frame_axis: str, which: str = "x") -> None:
    """Integer ticks over the frames' extent (`frame_edges`; the x limits set to it, a y axis
    is left to its caller), at most about 6: those `MaxNLocator` gives for that extent, fixed
    once, with their labels, instead of found again at every layout pass and draw (a tenth of
    a frame map's drawing)."""
    edges = frame_edges(num_frames, frame_axis)
    axis = ax.xaxis if which == "x" else ax.yaxis
    ticks = MaxNLocator(nbins=6, integer=True).tick_values(edges[0], edges[-1])
    ticks = ticks[(ticks >= edges[0]) & (ticks <= edges[-1])]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FixedFormatter([f"{int(tick)}".replace("-", MINUS) for tick in ticks]))
    if which == "x":
        ax.set_xlim(edges[0], edges[-1])


def series_colors(count: int) -> list:
    """Qualitative colours while they last, then samples of a sequential map."""
    if count <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(count)]
    return [matplotlib.colormaps["viridis"](x) for x in np.linspace(0.0, 0.9, count)]


# --------------------------------------------------------------------------------------------
# colour scales and limits, colour maps


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


def color_scale(
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


def draw_mesh(ax: Axes, x_edges, y_edges, values, cmap: Colormap, norm: Normalize) -> QuadMesh:
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


class DecimalLogFormatter(LogFormatter):
    """The ticks matplotlib's log formatter labels, written as decimals ("0.001", "0.002") in
    the figure's font: its default writes 10^-3 as mathtext, in another font, and parsing it
    took a third of a map figure's drawing."""

    def __call__(self, x, pos=None) -> str:
        if not super().__call__(x, pos):
            return ""
        # A minor tick is decade x sub in floating point (0.30000000000000004): to 12 digits.
        return np.format_float_positional(float(f"{x:.12g}"), trim="-")


def add_colorbar(fig: Figure, mappable, axes, label: str) -> None:
    colorbar = fig.colorbar(mappable, ax=axes, shrink=0.9, pad=0.02)
    if isinstance(mappable.norm, LogNorm):
        colorbar.formatter = DecimalLogFormatter()
        colorbar.minorformatter = DecimalLogFormatter()
        # The ticks of the norm's range, found once instead of at every layout pass and draw
        # (the same ticks: the range is fixed; the minor ones took a tenth of a frame map's time).
        low, high = mappable.norm.vmin, mappable.norm.vmax
        major = [tick for tick in colorbar.locator.tick_values(low, high) if low <= tick <= high]
        minor = colorbar.minorlocator.tick_values(low, high)
        colorbar.locator = FixedLocator(major)
        colorbar.minorlocator = FixedLocator(
            [tick for tick in minor if low <= tick <= high and tick not in major]
        )
    colorbar.set_label(label)
    colorbar.outline.set_linewidth(0.5)
    # matplotlib rasterizes long colorbars; keep the file fully vector, and stroke every
    # segment in its own colour so that vector viewers show no hairline seams between them.
    colorbar.solids.set_rasterized(False)
    colorbar.solids.set_edgecolor("face")
    colorbar.solids.set_linewidth(SEAM_STROKE_PT)


def boxed(ax: Axes) -> None:
    for spine in ax.spines.values():
        spine.set_visible(True)


# --------------------------------------------------------------------------------------------
# numbers in text

MINUS = "\N{MINUS SIGN}"  # as matplotlib writes negative tick labels


def shared_decimals(values, significant: int = 3) -> int:
    """The decimals that give the largest magnitude of `values` (NaN ignored) `significant`
    significant figures: numbers printed side by side with them share one precision, so that
    -4.08 and 0.000469 read -4.08 and 0.00 (not the small one at three figures of its own)."""
    magnitudes = np.abs(np.asarray(values, dtype=np.float64).ravel())
    magnitudes = magnitudes[np.isfinite(magnitudes) & (magnitudes > 0)]
    if not magnitudes.size:
        return significant - 1
    return max(0, significant - 1 - math.floor(math.log10(float(magnitudes.max()))))


NAMED_FONT_SIZE = 5.5  # the names of heads written beside their lines, dots or bars


def name_head(
    ax: Axes, text: str, xy: tuple[float, float], *, offset=(3, 0), ha="left", va="center", **style
) -> None:
    """A head's name (or any short label) `offset` points from data point `xy`, in the small
    size every figure names heads in; `style`: more `annotate` options (colour, halo)."""
    ax.annotate(
        text,
        xy=xy,
        xytext=offset,
        textcoords="offset points",
        ha=ha,
        va=va,
        fontsize=NAMED_FONT_SIZE,
        **style,
    )


def signed_number(value: float, decimals: int) -> str:
    """`value` with its sign and `decimals` decimals: '+0.650', '−3.68' (a minus sign, as the
    tick labels), '0.00' for what rounds to zero, 'nan'."""
    if not np.isfinite(value):
        return "nan"
    text = f"{value:+.{decimals}f}"
    if float(text) == 0:
        return f"{0.0:.{decimals}f}"
    return text.replace("-", MINUS)


# --------------------------------------------------------------------------------------------
# titles and legends


def capital(text: str) -> str:
    """`text` with its first letter in upper case (a title that no longer follows the run)."""
    return text[:1].upper() + text[1:]


def steps_title(datasets: Sequence[xr.Dataset], step: int) -> str:
    labels = list(dict.fromkeys(step_title(ds, step) for ds in datasets))
    return " / ".join(labels)


def legend_handles(axes: Sequence[Axes]) -> dict[str, Line2D]:
    """The labelled lines of `axes` by label, a label once (its first line), in drawing order;
    labels starting with '_' are left out, as matplotlib does."""
    handles: dict[str, Line2D] = {}
    for ax in axes:
        for line in ax.lines:
            if not line.get_label().startswith("_"):
                handles.setdefault(line.get_label(), line)
    return handles


def row_major(handles: Sequence, ncols: int) -> list:
    """`handles` reordered so that a legend of `ncols` columns, which matplotlib fills column by
    column, reads them row by row."""
    ncols = max(1, min(ncols, len(handles)))
    rows, longer = divmod(len(handles), ncols)
    column_rows = [rows + 1] * longer + [rows] * (ncols - longer)
    return [
        handles[row * ncols + column]
        for column in range(ncols)
        for row in range(column_rows[column])
    ]


def figure_legend(fig: Figure, ncols: int, **kwargs) -> None:
    """One legend under the panels, outside every axes, of the labelled lines of all panels
    (a label once)."""
    handles = legend_handles(fig.axes)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=ncols, **kwargs)


# --------------------------------------------------------------------------------------------
# steps as series: one line per denoising step and the cache pass


def common_steps(group: Sequence[xr.Dataset]) -> list[tuple[int, str]]:
    """(step, label) present in every dataset of the group, in step order."""
    shared = set.intersection(*({int(s) for s in ds["step"].values} for ds in group))
    first = group[0]
    return [
        (
            step,
            timestep_label(
                first["timestep"].sel(step=step).values, pass_kind_of(first.sel(step=step))
            ),
        )
        for step in sorted(shared)
    ]


def step_colors(labels: Sequence[str]) -> dict[str, object]:
    """Denoising steps from dark (t=1000) to light; the cache pass in black."""
    denoise = [label for label in labels if label != "cache"]
    shades = np.linspace(0.0, 0.85, max(len(denoise), 1))
    colors: dict[str, object] = {
        label: matplotlib.colormaps["viridis"](shade)
        for label, shade in zip(denoise, shades, strict=False)
    }
    colors["cache"] = "black"
    return colors


# --------------------------------------------------------------------------------------------
# layer x head maps (the survey's and the policy map)


def index_ticks(axis, labels: Sequence[int], room_pt: float, label_pt: float) -> None:
    """Ticks for cells 0..n-1 labelled `labels`: every cell where the labels fit (`room_pt` of
    axis for labels `label_pt` apart at least), else every 2nd, 5th, 10th... with minor ticks."""
    count = len(labels)
    fits = max(1, int(room_pt // label_pt))
    every = next(n for n in (1, 2, 5, 10, 20, 50, 100, count) if math.ceil(count / n) <= fits)
    positions = list(range(0, count, every))
    axis.set_ticks(positions)
    axis.set_ticklabels([str(int(labels[i])) for i in positions])
    axis.set_ticks(range(count) if every > 1 else [], minor=True)


def layer_head_geometry(num_layers: int, num_heads: int, panels: int) -> tuple[int, float, float]:
    """(columns, panel width, panel height) in inches of the layer x head maps: cells about
    square, a panel at most 4.5 in and at least 0.9 in tall."""
    ncols = min(panels, 5)
    width = (FULL_WIDTH_IN - 0.9) / ncols
    height = min(max(num_layers * width / num_heads, 0.9), 4.5)
    return ncols, width, height


def layer_head_panels(
    maps: Sequence[tuple[str, np.ndarray]],
    layer_list: Sequence[int],
    heads: Sequence[int],
    legend_rows: int = 0,
    *,
    cmap: Colormap | None = None,
    norm: Normalize | None = None,
) -> tuple[Figure, list[Axes], QuadMesh]:
    """One layer x head panel per (title, values) of `maps`, values (layer, head) on one colour
    scale (`cmap` and `norm`; default: the probability map from 0 to 1); layer 0 on top, head 0
    on the left, NaN grey. Returns the figure, its panels and the last mesh (for the
    colorbar)."""
    ncols, width, height = layer_head_geometry(len(layer_list), len(heads), len(maps))
    nrows = math.ceil(len(maps) / ncols)
    fig = Figure(
        figsize=(FULL_WIDTH_IN, nrows * (height + 0.3) + 0.6 + 0.15 * legend_rows),
        layout="constrained",
    )
    axes = panel_grid(fig, len(maps), ncols, sharex=True, sharey=True)
    if cmap is None:
        cmap = matplotlib.colormaps[PROBABILITY_CMAP].with_extremes(bad=UNSEEN_COLOR)
    norm = Normalize(vmin=0.0, vmax=1.0) if norm is None else norm
    mesh = None
    for index, (ax, (title, values)) in enumerate(zip(axes, maps, strict=True)):
        mesh = draw_mesh(
            ax,
            np.arange(len(heads) + 1) - 0.5,
            np.arange(len(layer_list) + 1) - 0.5,
            values,
            cmap,
            norm,
        )
        boxed(ax)
        ax.set_ylim(len(layer_list) - 0.5, -0.5)  # layer 0 on top
        index_ticks(ax.xaxis, heads, width * 72, 11)
        index_ticks(ax.yaxis, layer_list, height * 72, 9)
        ax.tick_params(which="minor", length=1.2, width=0.4)
        ax.set_title(title)
        if index + ncols >= len(maps):  # no panel below: this one labels the heads
            ax.tick_params(labelbottom=True)
            ax.set_xlabel("Head")  # per panel: a legend may take the figure's foot
    fig.supylabel("Layer (0-based)")
    return fig, axes, mesh


# --------------------------------------------------------------------------------------------
# writing files


def save_figure(fig: Figure, path: str | os.PathLike, fmt: str = "svg") -> Path:
    """Write atomically (temporary file, then rename): a failed run leaves no partial figure.
    The figure is laid out for `fmt` and its layout fixed: callers do not reuse a saved figure."""
    check_choice("fmt", fmt, figures.FORMATS)
    path = Path(path)
    with in_style(), ticks_found_once(fig), atomic_path(path) as temporary:
        lay_out_once(fig, fmt)
        fig.savefig(temporary, format=fmt, metadata=_SAVE_METADATA[fmt])
    return path


@contextmanager
def ticks_found_once(fig: Figure) -> Iterator[None]:
    """While `fig` is laid out and saved, an axis finds its ticks (locator, formatter, one label
    per tick) again only when what they depend on changed: its limits, its axes' box, locators,
    formatters, scale. Layout and drawing ask ~6 times per find (3,107 for 498 in the demo's run
    figures, a fourth of saving); the same ticks, the same bytes."""
    # matplotlib's private Axis._update_ticks (3.9 to 3.11): where it is not, nothing changes
    maps = [getattr(ax, "_axis_map", {}).values() for ax in fig.axes]
    axes = [axis for found in maps for axis in found if hasattr(type(axis), "_update_ticks")]
    for axis in axes:
        axis._update_ticks = _update_ticks_once.__get__(axis)
    try:
        yield
    finally:
        for axis in axes:
            del axis._update_ticks
            axis.__dict__.pop("_found_ticks", None)


def _update_ticks_once(axis) -> list:
    parts = (axis.major.locator, axis.major.formatter, axis.minor.locator, axis.minor.formatter)
    key = (tuple(axis.get_view_interval()), axis.axes.bbox.bounds, *map(id, (*parts, axis._scale)))
    found = axis.__dict__.get("_found_ticks")
    if found is None or found[0] != key:
        found = (key, type(axis)._update_ticks(axis))
        axis._found_ticks = found
    return list(found[1])


def lay_out_once(fig: Figure, fmt: str) -> None:
    """Run `fig`'s layout engine as `savefig(format=fmt)` would, then remove the engine.

    With an engine, `savefig` draws the whole figure twice: once with drawing switched off, only
    for the engine to measure the texts with the file's renderer, then for real. Measured here
    with the same renderer (the canvas's default format is `fmt`, at the dpi `savefig` sets), the
    layout is the same and the file the same bytes, for one draw less (a tenth to a sixth of a
    figure's time)."""
    engine = fig.get_layout_engine()
    if engine is None:
        return
    dpi = matplotlib.rcParams["savefig.dpi"]
    saved_dpi = fig.dpi
    try:
        with matplotlib.rc_context({"savefig.format": fmt}):
            if dpi != "figure":
                fig.dpi = dpi
            engine.execute(fig)
    finally:
        fig.dpi = saved_dpi  # the vector backends set 72 while they measure
    fig.set_layout_engine(None)
