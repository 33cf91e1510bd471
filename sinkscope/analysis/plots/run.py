"""The figures of one run (checkpoint, prompt): Deep Forcing Fig. 4 and its per-layer companions
(`layer` scope: heads grid, heads heatmap, frame maps) and the run's layers side by side (`run`
scope: layer comparison, statistics), all drawn from frame datasets (Contract 2). The plotted
numbers are those of `sinkscope.analysis.stats`, the functions that write Contract 3.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.patheffects as patheffects
import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path
from matplotlib.ticker import NullLocator

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
    check_options,
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
    name_head,
    noisy_steps,
    panel_grid,
    series_colors,
    shared_decimals,
    styled,
)
from .run_data import (
    block_boundaries,
    cell_transform,
    check_annotate,
    check_run_heads,
    frame_map_values,
    grid_columns,
    head_statistics,
    headline_measures,
    last_block_label,
    outline,
    query_block,
    run_title,
    sink_score_title,
    standout,
    titled,
    value_span,
)
from .run_profile import (
    draw_profile,
    query_block_handles,
    query_block_legend,
    uniform_handle,
    version_handles,
)

MAP_LABELS = {
    "logits": "Attention logit (frame-pair mean)",
    "probabilities": "Attention probability mass",
}
# The headline figures (figure4, heads heatmap, frame maps) draw `figures.measure` and the other
# measure beside it, each part titled so: a sink is a share of the attention, which a logit's
# colour or bar height does not show (a pale +3.4 beside a loud -10 can be 0.66 of the mass).
MEASURE_TITLES = {"logits": "Attention logits", "probabilities": "Attention probabilities"}
HEAD_LINE_WIDTH = 0.5  # layer comparison: one thin line per head
HEAD_LINE_ALPHA = 0.45
HEAD_DOT_COLOR = "0.15"  # statistics: one dot per head
PARTS = ("first", "middle", "last")
PART_LABELS = {"first": "First frame", "middle": "Middle frames", "last": "Last frame"}
MAP_ANCHOR_COLOR = "black"
MAP_NOISY_HATCH = "/////"
MAP_NOISY_COLOR = "0.45"  # mid grey: seen on dark and on light cells
MAP_HALO_COLOR = "white"  # under the anchor's outline, so that it shows on dark cells


def measure_grids(
    fig: Figure, measures: Sequence[str], count: int, ncols: int, **subplot_kw
) -> list[list[Axes]]:
    """`count` panels in rows of `ncols` per measure of `measures`, the measures' rows stacked
    in one grid (one layout: subfigures took twice as long to lay out); unused grid cells are
    removed, as `panel_grid` does."""
    ncols = max(1, min(ncols, count))
    nrows = math.ceil(count / ncols)
    grid = fig.subplots(len(measures) * nrows, ncols, squeeze=False, **subplot_kw)
    groups = []
    for index in range(len(measures)):
        cells = grid[index * nrows : (index + 1) * nrows].ravel()
        for extra in cells[count:]:
            extra.remove()
        groups.append(list(cells[:count]))
    return groups


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
    One row of panels in `measure`, and below it the same heads in the other measure where the
    datasets hold it (`headline_measures`): probabilities beside logits, with the uniform share
    1 / V marked and the maximum also in multiples of it. The title names the query set;
    without `titles` it leaves out the run (checkpoint, prompt, timestep)."""
    check_options(measure, frame_axis)
    check_annotate(annotate)
    layers = by_layer(datasets)
    check_run_heads(layers, heads)
    shown_layers = [layers[layer] for layer in dict.fromkeys(layer for layer, _ in heads)]
    measures = headline_measures(shown_layers, measure, step)
    profiles = {
        shown: {layer: last_block_profile(layers[layer], shown, step) for layer, _ in heads}
        for shown in measures
    }
    first = next(iter(layers.values()))
    block = query_block(first)
    versions = {
        layer: last_block_versions(ds, step)
        for layer, ds in layers.items()
        if marks_key_versions(ds)
    }
    shown_codes: set[int] = set()  # the version codes of the bars drawn
    for layer, head in heads:
        if layer in versions:
            seen = np.isfinite(profiles[measure][layer].sel(head=head).values)
            shown_codes.update(int(code) for code in versions[layer][seen])
    extras = [uniform_handle()] if "probabilities" in measures else []
    handles, ncols = query_block_handles(block, version_handles(first, shown_codes), extras)

    legend_rows = math.ceil(len(handles) / ncols)
    head_rows = math.ceil(len(heads) / 3)
    row_height = 2.5 if len(measures) == 1 else 2.2
    fig = Figure(
        figsize=(
            FULL_WIDTH_IN,
            row_height * head_rows * len(measures) + 0.13 * legend_rows + 0.07,
        ),
        layout="constrained",
    )
    groups = measure_grids(fig, measures, len(heads), 3)
    for axes, shown in zip(groups, measures, strict=True):
        for ax, (layer, head) in zip(axes, heads, strict=True):
            draw_profile(
                ax,
                profiles[shown][layer].sel(head=head).values,
                frame_axis,
                annotate=annotate,
                block=block,
                versions=versions.get(layer),
                num_steps=noisy_steps(layers[layer]),
                uniform=shown == "probabilities",
            )
            ax.set_title(head_label(layer, head))
            ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
            ax.set_ylabel(PROFILE_LABELS[shown])
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols)
    title = last_block_label(first)
    fig.suptitle(f"{run_title(first, step)} · {title}" if titles else capital(title))
    return fig


@styled
def plot_heads_grid(
    ds: xr.Dataset,
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """Small multiples of every head's last-block profile, with its sink score in the title (in
    the measure's unit, every head's to the decimals that give the largest three significant
    figures: `sink_score_title`) and the query block's own key frames shaded."""
    check_options(measure, frame_axis)
    profile = last_block_profile(ds, measure, step)
    scores = head_statistics(ds, measure, step)["sink_score"]
    heads = [int(h) for h in profile["head"].values]
    block = query_block(ds)
    ncols = grid_columns(len(heads))
    nrows = math.ceil(len(heads) / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.3 * nrows + 0.8), layout="constrained")
    axes = panel_grid(fig, len(heads), ncols, sharex=True, sharey=True)
    decimals = shared_decimals(scores.to_numpy(dtype=float))
    for index, (ax, head) in enumerate(zip(axes, heads, strict=True)):
        draw_profile(ax, profile.sel(head=head).values, frame_axis, block=block)
        score = float(scores.loc[head])
        ax.set_title(sink_score_title(layer_of(ds), head, score, measure, decimals))
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
    query_block_legend(fig, block)
    fig.supylabel(PROFILE_LABELS[measure])
    fig.suptitle(titled(f"Layer {layer_of(ds)}, all heads", ds, step, titles))
    return fig


@styled
def plot_heads_heatmap(
    ds: xr.Dataset,
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    color_limits: Mapping[str, tuple[float, float]] | None = None,
    titles: bool = True,
) -> Figure:
    """Head x key frame image of the last-block profile in `measure`, and under it in the other
    measure where the dataset holds it (`headline_measures`), each with its colour bar.
    `color_limits` (per measure, `shared_color_limits` of every layer, as `render_figures`
    passes them) puts the layers on one scale."""
    check_options(measure, frame_axis)
    measures = headline_measures([ds], measure, step)
    num_heads = ds.sizes["head"]
    fig = Figure(
        figsize=(COLUMN_WIDTH_IN * 1.3, (0.18 * num_heads + 0.95) * len(measures) + 0.3),
        layout="constrained",
    )
    axes = fig.subplots(len(measures), 1, sharex=True, squeeze=False)[:, 0]
    for ax, shown in zip(axes, measures, strict=True):
        profile = last_block_profile(ds, shown, step)
        values = profile.values
        num_frames = values.shape[1]
        limits = None if color_limits is None else color_limits[shown]
        cmap, norm, drawn = color_scale(values, shown, limits)
        mesh = draw_mesh(
            ax,
            frame_edges(num_frames, frame_axis),
            np.arange(num_heads + 1) - 0.5,
            drawn,
            cmap,
            norm,
        )
        boxed(ax)
        format_frame_axis(ax, num_frames, frame_axis)
        ax.set_yticks(range(num_heads))
        ax.set_yticklabels([head_label(layer_of(ds), h) for h in profile["head"].values])
        ax.set_ylim(num_heads - 0.5, -0.5)  # first head on top
        ax.set_ylabel("Head")
        if len(measures) > 1:
            ax.set_title(MEASURE_TITLES[shown])
        # on two lines: the label would outrun a colour bar as short as a few heads
        add_colorbar(fig, mesh, ax, PROFILE_LABELS[shown].replace(" (", "\n("))
    axes[-1].set_xlabel(KEY_AXIS_LABELS[frame_axis])
    fig.suptitle(titled(f"Layer {layer_of(ds)}, last-block profile", ds, step, titles))
    return fig


@styled
def plot_frame_maps(
    ds: xr.Dataset,
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    color_limits: Mapping[str, tuple[float, float]] | None = None,
    titles: bool = True,
) -> Figure:
    """Query frame x key frame map per head on one shared colour scale; unseen tiles grey. The
    heads in `measure`, and under them in the other measure where the dataset holds it
    (`headline_measures`), each part with its colour bar. `color_limits` (per measure,
    `shared_color_limits` of the maps of every layer, as `render_figures` passes them) puts the
    layers on one scale."""
    check_options(measure, frame_axis)
    measures = headline_measures([ds], measure, step)
    num_heads = ds.sizes["head"]
    num_queries, num_keys = ds.sizes["query_frame"], ds.sizes["key_frame"]
    key_edges = frame_edges(num_keys, frame_axis)
    query_edges = frame_edges(num_queries, frame_axis)
    blocks = np.asarray(ds["block"].values)
    block_starts = np.flatnonzero(np.diff(blocks)) + 1  # first query frame of every later block
    versions = key_versions(ds, step) if marks_key_versions(ds) else None

    ncols = grid_columns(num_heads)
    nrows = math.ceil(num_heads / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.6 * nrows * len(measures) + 0.7), layout="constrained")
    # Every panel has the same frames: ticks only on the grid's outer edges, where the labels
    # are (no ticks made and placed for the inner panels, a third of the maps' layout).
    groups = measure_grids(fig, measures, num_heads, ncols)
    boundaries = block_boundaries(block_starts, key_edges, query_edges, num_keys)
    for group, (axes, shown) in enumerate(zip(groups, measures, strict=True)):
        maps = frame_map_values(ds, shown, step)
        limits = None if color_limits is None else color_limits[shown]
        cmap, norm, drawn = color_scale(maps.values, shown, limits)
        mesh = None
        for index, (ax, head, head_map) in enumerate(
            zip(axes, maps["head"].values, drawn, strict=True)
        ):
            mesh = draw_mesh(ax, key_edges, query_edges, head_map, cmap, norm)
            ax.add_collection(
                LineCollection(
                    boundaries, colors="0.4", linewidths=0.3, alpha=0.5, label="_blocks"
                ),
                autolim=False,
            )
            if versions is not None:
                _mark_versions(ax, versions, key_edges, query_edges)
            boxed(ax)
            bottom = group == len(groups) - 1 and index + ncols >= num_heads
            _frame_ticks(ax, num_keys, frame_axis, "x", shown=bottom)
            _frame_ticks(ax, num_queries, frame_axis, "y", shown=index % ncols == 0)
            ax.set_ylim(query_edges[-1], query_edges[0])  # query frame 0 on top, like a matrix
            ax.set_aspect("equal")
            title = head_label(layer_of(ds), head)
            ax.set_title(f"{title} {shown}" if len(measures) > 1 else title)  # "L0H0 logits"
            if versions is not None and bottom:  # the legend takes the foot
                ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
        add_colorbar(fig, mesh, axes, MAP_LABELS[shown])
    if versions is None:
        fig.supxlabel(KEY_AXIS_LABELS[frame_axis])
    else:
        fig.legend(handles=_map_version_handles(versions), loc="outside lower center", ncols=2)
    fig.supylabel(QUERY_AXIS_LABELS[frame_axis])
    fig.suptitle(titled(f"Layer {layer_of(ds)}, query x key frames", ds, step, titles))
    return fig


def _frame_ticks(ax: Axes, num_frames: int, frame_axis: str, which: str, shown: bool) -> None:
    """The frame ticks of a map's axis `which` (`format_frame_axis`) where `shown`, else none."""
    format_frame_axis(ax, num_frames, frame_axis, which)
    if not shown:
        (ax.xaxis if which == "x" else ax.yaxis).set_major_locator(NullLocator())


def _mark_versions(
    ax: Axes, versions: np.ndarray, key_edges: np.ndarray, query_edges: np.ndarray
) -> None:
    """Mark a map's cells by key version (`versions`: query x key codes): the noisy copies
    hatched, the anchor's cells outlined; clean copies and unseen cells unmarked."""
    noisy = versions >= NOISY_VERSION
    if noisy.any():
        cells = [
            Path.unit_rectangle().transformed(cell_transform(key_edges, query_edges, query, key))
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
        segments = outline(anchor, key_edges, query_edges)
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


@styled
def plot_layer_comparison(
    datasets: Sequence[xr.Dataset],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """Per layer: mean over heads of the last-block profile (bold, markers) and every head's
    profile as a thin line of the layer's colour; the head whose profile strays furthest from
    its layer's mean is named where it stands apart (`standout`, on the heads' largest distance
    from the mean). The legend under the panel."""
    check_options(measure, frame_axis)
    layers = by_layer(datasets)
    legend_rows = math.ceil((len(layers) + 1) / 4)
    fig = Figure(figsize=(COLUMN_WIDTH_IN, 2.4 + 0.12 * legend_rows), layout="constrained")
    ax = fig.add_subplot()
    num_frames = 1
    profiles = {layer: last_block_profile(ds, measure, step) for layer, ds in layers.items()}
    span = value_span(np.concatenate([p.values.ravel() for p in profiles.values()]))
    for color, (layer, profile) in zip(series_colors(len(layers)), profiles.items(), strict=True):
        mean = profile.mean("head", skipna=True).values
        positions = key_frame_positions(mean.shape[0], frame_axis)
        num_frames = max(num_frames, mean.shape[0])
        for head in profile["head"].values:
            ax.plot(
                positions,
                profile.sel(head=head).values,
                color=color,
                linewidth=HEAD_LINE_WIDTH,
                alpha=HEAD_LINE_ALPHA,
                label=f"_head {head_label(layer, head)}",
            )
        ax.plot(positions, mean, color=color, marker="o", label=f"Layer {layer}", zorder=3)
        with np.errstate(invalid="ignore"):
            distance = np.abs(profile.values - mean[None, :])
        farthest = pd.Series(
            [np.nanmax(row) if np.isfinite(row).any() else np.nan for row in distance],
            index=profile["head"].values,
        )
        head = standout(farthest, span)
        if head is not None:
            values = profile.sel(head=head).values
            frame = int(np.nanargmax(distance[list(profile["head"].values).index(head)]))
            name_head(ax, head_label(layer, head), (positions[frame], values[frame]), color=color)
    ax.plot([], [], color="0.4", linewidth=HEAD_LINE_WIDTH, label="one head")  # legend only
    format_frame_axis(ax, num_frames, frame_axis)
    ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
    ax.set_ylabel(PROFILE_LABELS[measure])
    ax.set_title("Last-block profile per layer: mean over heads, thin: each head")
    fig.legend(loc="outside lower center", ncols=min(len(layers) + 1, 4))
    if titles:
        fig.suptitle(run_title(next(iter(layers.values())), step))
    return fig


@styled
def plot_statistics(
    datasets: Sequence[xr.Dataset], *, measure: str = "logits", step: int = 0, titles: bool = True
) -> Figure:
    """First / middle / last key frames per layer: a bar the mean over heads, a dot each head
    (spread across the bar in head order), the head that stands apart from the layer's others
    (`standout`) named beside its dot; the legend under the panel."""
    check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    layers = by_layer(datasets)
    parts = {layer: head_statistics(ds, measure, step) for layer, ds in layers.items()}
    span = value_span(
        np.concatenate([p[list(PARTS)].to_numpy(dtype=float).ravel() for p in parts.values()])
    )
    fig = Figure(
        figsize=(max(COLUMN_WIDTH_IN, 0.45 * len(layers) + 1.5), 2.4), layout="constrained"
    )
    ax = fig.add_subplot()
    x = np.arange(len(layers))
    width = 0.8 / len(PARTS)
    for i, (part, color) in enumerate(zip(PARTS, series_colors(len(PARTS)), strict=True)):
        centers = x + (i - (len(PARTS) - 1) / 2) * width
        means = [float(p[part].mean(skipna=True)) for p in parts.values()]
        ax.bar(centers, means, width=width, color=color, alpha=0.55, label=PART_LABELS[part])
        dots_x, dots_y = [], []
        for center, (layer, rows) in zip(centers, parts.items(), strict=True):
            values = rows[part]
            offsets = np.linspace(-0.3, 0.3, len(values)) * width if len(values) > 1 else [0.0]
            dots_x += list(center + np.asarray(offsets))
            dots_y += list(values.to_numpy(dtype=float))
            head = standout(values, span)
            if head is not None:
                at = list(values.index).index(head)
                name_head(
                    ax,
                    head_label(layer, head),
                    (center + offsets[at], float(values[head])),
                    offset=(2, 0),
                )
        ax.plot(
            dots_x,
            dots_y,
            linestyle="none",
            marker="o",
            markersize=1.8,
            color=HEAD_DOT_COLOR,
            label=f"_heads: {PART_LABELS[part]}",
        )
    ax.plot(
        [], [], linestyle="none", marker="o", markersize=1.8, color=HEAD_DOT_COLOR, label="one head"
    )
    ax.axhline(0.0, color="0.5", linewidth=0.4)
    ax.set_xticks(x)
    ax.set_xticklabels([f"L{layer}" for layer in layers])
    ax.set_xlabel("Layer")
    ax.set_ylabel(PROFILE_LABELS[measure])
    ax.set_title("Last-block key frames: bars the mean over heads")
    fig.legend(loc="outside lower center", ncols=len(PARTS) + 1)
    if titles:
        fig.suptitle(run_title(next(iter(layers.values())), step))
    return fig
