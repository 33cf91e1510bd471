"""The figures of one run (checkpoint, prompt): Deep Forcing Fig. 4 and its per-layer companions
(`layer` scope: heads grid, heads heatmap, frame maps) and the run's layers side by side (`run`
scope: layer comparison, statistics), all drawn from frame datasets (Contract 2). The plotted
numbers are those of `sinkscope.analysis.stats`, the functions that write Contract 3.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import matplotlib
import matplotlib.patheffects as patheffects
import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path
from matplotlib.transforms import Affine2D, ScaledTranslation

from sinkscope import frames
from sinkscope.analysis import stats
from sinkscope.schedules import KEY_VERSION, NOISY_VERSION

from .common import (
    ANCHOR_LABEL,
    COLUMN_WIDTH_IN,
    FULL_WIDTH_IN,
    KEY_AXIS_LABELS,
    MEASURE_VARIABLES,
    PROFILE_LABELS,
    QUERY_AXIS_LABELS,
    add_colorbar,
    boxed,
    by_layer,
    capital,
    check_choice,
    check_head,
    check_options,
    checkpoint_of,
    color_scale,
    draw_mesh,
    format_frame_axis,
    frame_edges,
    head_label,
    key_frame_positions,
    key_versions,
    last_block_profile,
    last_block_versions,
    layer_of,
    marks_key_versions,
    noisy_steps,
    panel_grid,
    prompt_of,
    row_major,
    select_step,
    series_colors,
    step_title,
    styled,
    version_label,
)

MAP_LABELS = {
    "logits": "Attention logit (frame-pair mean)",
    "probabilities": "Attention probability mass",
}
PARTS = ("first", "middle", "last")
PART_LABELS = {"first": "First frame", "middle": "Middle frames", "last": "Last frame"}
QUERY_BLOCK_COLOR = "0.9"  # the band over the query block's own key frames (figure4, heads grid)
ANNOTATIONS = ("max", "min")  # what figure4 may annotate (`figures.annotate`)
BAR_COLOR = "#9ecae1"
LINE_COLOR = "#08519c"
# Key versions (rolling runs): the anchor's bars orange, noisy copies' purple and hatched,
# darker the noisier; on the maps the anchor's cells outlined, the noisy ones hatched.
ANCHOR_COLOR = "#fdae6b"
ANCHOR_EDGE_COLOR = "#d94801"
NOISY_CMAP = "Purples"
NOISY_SHADES = (0.75, 0.3)  # where on NOISY_CMAP the first and the last step lie
NOISY_HATCH = "////"
LEGEND_COLUMNS = 4  # at most, in the legend of figure4
MAP_ANCHOR_COLOR = "black"
MAP_NOISY_HATCH = "/////"
MAP_NOISY_COLOR = "0.45"  # mid grey: seen on dark and on light cells
MAP_HALO_COLOR = "white"  # under the anchor's outline, so that it shows on dark cells


def head_statistics(ds: xr.Dataset, measure: str = "logits", step: int = 0) -> pd.DataFrame:
    """The `last_block` rows of the statistics CSV for `measure` and `step`, indexed by head."""
    check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    select_step(ds, step)
    return stats.head_statistics(ds, MEASURE_VARIABLES[measure], step, "last_block")


def _frame_name(latent: int, frame_axis: str) -> str:
    if frame_axis == "latent":
        return f"frame {latent}"
    span = frames.video_frames_of_latent(latent)
    if len(span) == 1:
        return f"frame {span.start}"
    return f"frames {span.start}–{span.stop - 1}"


def _format_value(value: float) -> str:
    return "nan" if not np.isfinite(value) else f"{value:.3g}"


def check_annotate(annotate: Sequence[str]) -> None:
    for what in annotate:
        check_choice("annotate", what, ANNOTATIONS)


def _draw_profile(
    ax: Axes,
    values: np.ndarray,
    frame_axis: str,
    *,
    annotate: Sequence[str] = (),
    block: Sequence[int] = (),
    versions: np.ndarray | None = None,
    num_steps: int = 0,
) -> None:
    """Bars and line of one profile over key frames, optionally with its maximum and minimum
    annotated (`annotate`: 'max', 'min'), the key frames `block` (latent) shaded and each bar
    styled by the version of its key frame (`versions`, codes; `num_steps` denoising steps)."""
    num_frames = values.shape[0]
    edges = frame_edges(num_frames, frame_axis)
    positions = key_frame_positions(num_frames, frame_axis)
    if len(block):
        _shade_block(ax, edges, block)
    bars = ax.bar(positions, values, width=0.8 * np.diff(edges), color=BAR_COLOR, linewidth=0)
    if versions is not None:
        for bar, code in zip(bars, versions, strict=True):
            bar.set(**_bar_style(int(code), num_steps))
    ax.plot(positions, values, color=LINE_COLOR, marker="o")
    ax.axhline(0.0, color="0.5", linewidth=0.4)
    format_frame_axis(ax, num_frames, frame_axis)
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
        anchor = versions is not None and versions[frame] == KEY_VERSION["anchor"]
        ax.annotate(
            f"{what} {_format_value(value)}, {_frame_name(frame, frame_axis)}"
            + (" (anchor)" if anchor else ""),
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


def _bar_style(code: int, num_steps: int) -> dict:
    """How a bar shows the version `code` of its key frame: clean as always, the anchor orange,
    a noisy copy purple and hatched, darker the earlier (noisier) its step."""
    if code == KEY_VERSION["anchor"]:
        return {"facecolor": ANCHOR_COLOR, "edgecolor": ANCHOR_EDGE_COLOR, "linewidth": 0.6}
    if code >= NOISY_VERSION:
        darkest, lightest = NOISY_SHADES
        late = min((code - NOISY_VERSION) / max(num_steps - 1, 1), 1.0)
        return {
            "facecolor": matplotlib.colormaps[NOISY_CMAP](darkest + (lightest - darkest) * late),
            "edgecolor": "none",
            "hatch": NOISY_HATCH,
            "hatchcolor": "white",
            "hatch_linewidth": 0.4,
        }
    return {}


def _version_handles(ds: xr.Dataset, codes: set[int]) -> tuple[list[Patch], list[Patch]]:
    """The legend entries of the version codes `codes`: (the anchor and the clean copy, the noisy
    copies by step)."""
    handles: tuple[list[Patch], list[Patch]] = ([], [])
    for code in sorted(codes, key=lambda code: (code != KEY_VERSION["anchor"], code)):
        if code < 0:
            continue
        style = {"facecolor": BAR_COLOR, "linewidth": 0, **_bar_style(code, noisy_steps(ds))}
        handles[code >= NOISY_VERSION].append(Patch(**style, label=version_label(ds, code)))
    return handles


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
    return f"{checkpoint_of(ds)} · {prompt_of(ds)} · {step_title(ds, step)}"


def _titled(what: str, ds: xr.Dataset, step: int, titles: bool) -> str:
    """'{what} · {checkpoint} · {prompt} · t=...', or `what` alone without `titles` (a paper's
    figure, whose caption names the run)."""
    return f"{what} · {_run_title(ds, step)}" if titles else what


def check_run_heads(layers: dict[int, xr.Dataset], heads: Sequence[tuple[int, int]]) -> None:
    """Every (layer, head) of figure4 exists in the run's datasets `layers`."""
    if not heads:
        raise ValueError("figure4 needs at least one (layer, head)")
    for layer, head in heads:
        if layer not in layers:
            raise ValueError(
                f"figure4 head {head_label(layer, head)} needs layer {layer}, but no frame store "
                f"of this run holds it (layers: {list(layers)})"
            )
        check_head(layers[layer], head)


@styled
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
    check_options(measure, frame_axis)
    check_annotate(annotate)
    layers = by_layer(datasets)
    check_run_heads(layers, heads)
    profiles = {layer: last_block_profile(layers[layer], measure, step) for layer, _ in heads}
    first = next(iter(layers.values()))
    block = _query_block(first)
    versions = {
        layer: last_block_versions(ds, step)
        for layer, ds in layers.items()
        if marks_key_versions(ds)
    }
    shown: set[int] = set()  # the version codes of the bars drawn
    for layer, head in heads:
        if layer in versions:
            seen = np.isfinite(profiles[layer].sel(head=head).values)
            shown.update(int(code) for code in versions[layer][seen])
    handles, ncols = _query_block_handles(block, _version_handles(first, shown))

    legend_rows = math.ceil(len(handles) / ncols)
    fig = Figure(
        figsize=(FULL_WIDTH_IN, 2.5 * math.ceil(len(heads) / 3) + 0.13 * legend_rows + 0.07),
        layout="constrained",
    )
    for ax, (layer, head) in zip(panel_grid(fig, len(heads), 3), heads, strict=True):
        _draw_profile(
            ax,
            profiles[layer].sel(head=head).values,
            frame_axis,
            annotate=annotate,
            block=block,
            versions=versions.get(layer),
            num_steps=noisy_steps(layers[layer]),
        )
        ax.set_title(head_label(layer, head))
        ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
        ax.set_ylabel(PROFILE_LABELS[measure])
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols)
    title = last_block_label(first)
    fig.suptitle(f"{_run_title(first, step)} · {title}" if titles else capital(title))
    return fig


def _query_block_handles(
    block: Sequence[int], versions: tuple[Sequence[Patch], Sequence[Patch]] = ((), ())
) -> tuple[list[Patch], int]:
    """The legend under the panels, (handles in matplotlib's order, columns): the shaded band
    (`_shade_block`) and the key versions the bars show (`_version_handles`), the noisy copies
    on rows of their own."""
    label = f"the query block's own key frames (latent {_span(block)})"
    copies, noisy = versions
    first = [Patch(color=QUERY_BLOCK_COLOR, label=label), *copies]
    ncols = min(max(len(first), len(noisy)), LEGEND_COLUMNS)
    if noisy:
        first += [Patch(visible=False, label="")] * (-len(first) % ncols)  # noisy: a new row
    return row_major([*first, *noisy], ncols), ncols


def _query_block_legend(fig: Figure, block: Sequence[int]) -> None:
    """The legend under the panels naming the shaded band (`_shade_block`)."""
    handles, ncols = _query_block_handles(block)
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols)


def last_block_label(ds: xr.Dataset) -> str:
    """'last block: query frames 16-18 (latent)', read from the block coordinate, so it names
    the query set of the statistics whatever the block layout ([3, 3, ...] or [1, 3, 3, ...])."""
    frames = [int(f) for f in ds["query_frame"].values[stats.last_block_rows(ds)]]
    span = f"frame {frames[0]}" if len(frames) == 1 else f"frames {frames[0]}–{frames[-1]}"
    return f"last block: query {span} (latent)"


def _grid_columns(count: int) -> int:
    return 4 if count > 3 else count


@styled
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
    check_options(measure, frame_axis)
    profile = last_block_profile(ds, measure, step)
    scores = head_statistics(ds, measure, step)["sink_score"]
    heads = [int(h) for h in profile["head"].values]
    block = _query_block(ds)
    ncols = _grid_columns(len(heads))
    nrows = math.ceil(len(heads) / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.3 * nrows + 0.8), layout="constrained")
    axes = panel_grid(fig, len(heads), ncols, sharex=True, sharey=True)
    for index, (ax, head) in enumerate(zip(axes, heads, strict=True)):
        _draw_profile(ax, profile.sel(head=head).values, frame_axis, block=block)
        score = float(scores.loc[head])
        ax.set_title(f"{head_label(layer_of(ds), head)} sink {_format_value(score)}")
        if index + ncols >= len(heads):  # no panel below: this one labels the key frames
            ax.tick_params(labelbottom=True)
            ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])  # per panel: the legend takes the foot
    # One range for the shared axis, from every head (each panel fixed its own as it was drawn,
    # and the first one's held for all: a strong head's bars were clipped).
    values = profile.values
    if np.isfinite(values).any():
        low, high = min(0.0, float(np.nanmin(values))), max(0.0, float(np.nanmax(values)))
        room = 0.08 * (high - low) or 1.0
        axes[0].set_ylim(low - room, high + room)
    _query_block_legend(fig, block)
    fig.supylabel(PROFILE_LABELS[measure])
    fig.suptitle(_titled(f"Layer {layer_of(ds)}, all heads", ds, step, titles))
    return fig


@styled
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
    check_options(measure, frame_axis)
    profile = last_block_profile(ds, measure, step)
    values = profile.values
    num_heads, num_frames = values.shape
    cmap, norm, shown = color_scale(values, measure, color_limits)
    fig = Figure(figsize=(COLUMN_WIDTH_IN * 1.3, 0.18 * num_heads + 1.2), layout="constrained")
    ax = fig.add_subplot()
    mesh = draw_mesh(
        ax, frame_edges(num_frames, frame_axis), np.arange(num_heads + 1) - 0.5, shown, cmap, norm
    )
    boxed(ax)
    format_frame_axis(ax, num_frames, frame_axis)
    ax.set_yticks(range(num_heads))
    ax.set_yticklabels([head_label(layer_of(ds), h) for h in profile["head"].values])
    ax.set_ylim(num_heads - 0.5, -0.5)  # first head on top
    ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
    ax.set_ylabel("Head")
    ax.set_title(_titled(f"Layer {layer_of(ds)}, last-block profile", ds, step, titles))
    add_colorbar(fig, mesh, ax, PROFILE_LABELS[measure])
    return fig


@styled
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
    check_options(measure, frame_axis)
    maps = frame_map_values(ds, measure, step)
    values = maps.values
    num_heads, num_queries, num_keys = values.shape
    cmap, norm, shown = color_scale(values, measure, color_limits)
    key_edges = frame_edges(num_keys, frame_axis)
    query_edges = frame_edges(num_queries, frame_axis)
    blocks = np.asarray(ds["block"].values)
    block_starts = np.flatnonzero(np.diff(blocks)) + 1  # first query frame of every later block
    versions = key_versions(ds, step) if marks_key_versions(ds) else None

    ncols = _grid_columns(num_heads)
    nrows = math.ceil(num_heads / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.6 * nrows + 0.7), layout="constrained")
    axes = panel_grid(fig, num_heads, ncols, sharex=True, sharey=True)
    mesh = None
    for index, (ax, head, head_map) in enumerate(
        zip(axes, maps["head"].values, shown, strict=True)
    ):
        mesh = draw_mesh(ax, key_edges, query_edges, head_map, cmap, norm)
        for start in block_starts:
            ax.axhline(query_edges[start], color="0.4", linewidth=0.3, alpha=0.5)
            if start < num_keys:
                ax.axvline(key_edges[start], color="0.4", linewidth=0.3, alpha=0.5)
        if versions is not None:
            _mark_versions(ax, versions, key_edges, query_edges)
        boxed(ax)
        format_frame_axis(ax, num_keys, frame_axis)
        format_frame_axis(ax, num_queries, frame_axis, which="y")
        ax.set_ylim(query_edges[-1], query_edges[0])  # query frame 0 on top, like a matrix
        ax.set_aspect("equal")
        ax.set_title(head_label(layer_of(ds), head))
        if versions is not None and index + ncols >= num_heads:  # the legend takes the foot
            ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
    if versions is None:
        fig.supxlabel(KEY_AXIS_LABELS[frame_axis])
    else:
        fig.legend(handles=_map_version_handles(versions), loc="outside lower center", ncols=2)
    fig.supylabel(QUERY_AXIS_LABELS[frame_axis])
    fig.suptitle(_titled(f"Layer {layer_of(ds)}, query x key frames", ds, step, titles))
    add_colorbar(fig, mesh, axes, MAP_LABELS[measure])
    return fig


def _mark_versions(
    ax: Axes, versions: np.ndarray, key_edges: np.ndarray, query_edges: np.ndarray
) -> None:
    """Mark a map's cells by key version (`versions`: query x key codes): the noisy copies
    hatched, the anchor's cells outlined; clean copies and unseen cells unmarked."""
    noisy = versions >= NOISY_VERSION
    if noisy.any():
        cells = [
            Path.unit_rectangle().transformed(_cell_transform(key_edges, query_edges, query, key))
            for query, key in zip(*np.nonzero(noisy), strict=True)
        ]
        ax.add_patch(
            PathPatch(
                Path.make_compound_path(*cells),
                facecolor="none",
                edgecolor="none",
                hatch=MAP_NOISY_HATCH,
                hatchcolor=MAP_NOISY_COLOR,
                hatch_linewidth=0.4,
                label="_noisy copies",
            )
        )
    anchor = versions == KEY_VERSION["anchor"]
    if anchor.any():
        segments = _outline(anchor, key_edges, query_edges)
        codes = [Path.MOVETO, Path.LINETO] * len(segments)
        ax.add_patch(
            PathPatch(  # one path, so that its halo is drawn under all of it at once
                Path(np.concatenate(segments), codes),
                fill=False,
                edgecolor=MAP_ANCHOR_COLOR,
                linewidth=0.9,
                capstyle="projecting",
                path_effects=[patheffects.withStroke(linewidth=2.0, foreground=MAP_HALO_COLOR)],
                label="_anchor",
            )
        )


def _cell_transform(
    key_edges: np.ndarray, query_edges: np.ndarray, query: int, key: int
) -> Affine2D:
    """The unit square onto the map cell (query, key)."""
    return (
        Affine2D()
        .scale(key_edges[key + 1] - key_edges[key], query_edges[query + 1] - query_edges[query])
        .translate(key_edges[key], query_edges[query])
    )


def _outline(mask: np.ndarray, x_edges: np.ndarray, y_edges: np.ndarray) -> list[np.ndarray]:
    """The segments around the cells of `mask` (rows on y, columns on x) inside the map: every
    cell side whose neighbour is outside the mask, but not the map's border (the spines')."""
    segments = []
    columns = np.diff(mask.astype(int), axis=1)  # between column c and c + 1
    for row, column in zip(*np.nonzero(columns), strict=True):
        x = x_edges[column + 1]
        segments.append(np.array([(x, y_edges[row]), (x, y_edges[row + 1])]))
    rows = np.diff(mask.astype(int), axis=0)  # between row r and r + 1
    for row, column in zip(*np.nonzero(rows), strict=True):
        y = y_edges[row + 1]
        segments.append(np.array([(x_edges[column], y), (x_edges[column + 1], y)]))
    return segments


def _map_version_handles(versions: np.ndarray) -> list[Patch]:
    """The legend of `_mark_versions`: the marks the maps show."""
    handles = []
    if (versions == KEY_VERSION["anchor"]).any():
        handles.append(
            Patch(
                facecolor="none",
                edgecolor=MAP_ANCHOR_COLOR,
                linewidth=0.9,
                label=ANCHOR_LABEL,
            )
        )
    if (versions >= NOISY_VERSION).any():
        handles.append(
            Patch(
                facecolor="none",
                edgecolor="none",
                hatch=MAP_NOISY_HATCH,
                hatchcolor=MAP_NOISY_COLOR,
                label="noisy copy (a block of the denoising window)",
            )
        )
    return handles


def frame_map_values(ds: xr.Dataset, measure: str, step: int) -> xr.DataArray:
    """The maps of `plot_frame_maps`: (head, query_frame, key_frame) of `measure` at `step`."""
    variable = MEASURE_VARIABLES[measure]
    return select_step(ds, step)[variable].transpose("head", "query_frame", "key_frame")


@styled
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
    check_options(measure, frame_axis)
    layers = by_layer(datasets)
    legend_rows = math.ceil(len(layers) / 4)
    fig = Figure(figsize=(COLUMN_WIDTH_IN, 2.4 + 0.12 * legend_rows), layout="constrained")
    ax = fig.add_subplot()
    num_frames = 1
    for color, (layer, ds) in zip(series_colors(len(layers)), layers.items(), strict=True):
        profile = last_block_profile(ds, measure, step)
        mean = profile.mean("head", skipna=True).values
        spread = profile.std("head", skipna=True).values
        positions = key_frame_positions(mean.shape[0], frame_axis)
        num_frames = max(num_frames, mean.shape[0])
        ax.fill_between(positions, mean - spread, mean + spread, color=color, alpha=0.2, lw=0)
        ax.plot(positions, mean, color=color, marker="o", label=f"Layer {layer}")
    format_frame_axis(ax, num_frames, frame_axis)
    ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
    ax.set_ylabel(PROFILE_LABELS[measure])
    ax.set_title("Last-block profile per layer, mean ± 1 std over heads")
    fig.legend(loc="outside lower center", ncols=min(len(layers), 4))
    if titles:
        fig.suptitle(_run_title(next(iter(layers.values())), step))
    return fig


@styled
def plot_statistics(
    datasets: Sequence[xr.Dataset], *, measure: str = "logits", step: int = 0, titles: bool = True
) -> Figure:
    """First / middle / last key frames per layer: mean over heads, std over heads as error bar;
    the legend under the panel."""
    check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    layers = by_layer(datasets)
    parts = {layer: head_statistics(ds, measure, step) for layer, ds in layers.items()}
    fig = Figure(
        figsize=(max(COLUMN_WIDTH_IN, 0.45 * len(layers) + 1.5), 2.4), layout="constrained"
    )
    ax = fig.add_subplot()
    x = np.arange(len(layers))
    width = 0.8 / len(PARTS)
    for i, (part, color) in enumerate(zip(PARTS, series_colors(len(PARTS)), strict=True)):
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


# The layer figures whose colour maps of a run's layers share one scale (`render_figures`,
# `shared_scale`): the values each draws, of one layer's dataset.
SHARED_SCALES: dict[str, Callable[[xr.Dataset, str, int], np.ndarray]] = {
    "plot_heads_heatmap": lambda ds, measure, step: last_block_profile(ds, measure, step).values,
    "plot_frame_maps": lambda ds, measure, step: frame_map_values(ds, measure, step).values,
}
