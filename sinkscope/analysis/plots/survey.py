"""The whole-model survey's figures (`survey` scope, and the `compare` kind of surveyed layers):
every layer and head of one run, from the frame datasets of every surveyed layer and, where a
figure looks inside frame 0, their attention stores (Contract 4). Sinks are probability mass (Gu
et al.): the statistics' `last_block` prob_mass rows (Contract 3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.collections import QuadMesh
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from sinkscope.analysis import stats

from .common import (
    COLUMN_WIDTH_IN,
    FULL_WIDTH_IN,
    add_colorbar,
    boxed,
    by_layer,
    capital,
    checkpoint_of,
    color_scale,
    common_steps,
    describe,
    draw_mesh,
    head_label,
    layer_head_geometry,
    layer_head_panels,
    panel_grid,
    prompt_of,
    select_step,
    series_colors,
    step_colors,
    step_title,
    steps_title,
    styled,
)

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
        for ds in by_layer(datasets).values()
    ]
    table = pd.concat(tables, ignore_index=True)
    return table[table["measure"] == SURVEY_MEASURE].reset_index(drop=True)


def statistics_of(
    layers: dict[int, xr.Dataset],
    statistics: pd.DataFrame | None,
    sink_threshold: float = 0.3,
    recent_threshold: float = 0.5,
) -> pd.DataFrame:
    """`statistics` when the caller has it (`render_figures` computes the `survey_statistics` of
    a run once, at its thresholds, for all of the run's survey figures), else computed here. The
    columns a figure reads of it do not depend on thresholds that figure does not take."""
    if statistics is not None:
        return statistics
    return survey_statistics(
        list(layers.values()), sink_threshold=sink_threshold, recent_threshold=recent_threshold
    )


def _survey_layers(datasets: Sequence[xr.Dataset]) -> dict[int, xr.Dataset]:
    """The layers of one run, which must share their captured steps (and their timesteps)."""
    layers = by_layer(datasets)
    first = next(iter(layers.values()))
    for ds in layers.values():
        if not (
            np.array_equal(ds["step"].values, first["step"].values)
            and np.array_equal(ds["timestep"].values, first["timestep"].values)
        ):
            raise ValueError(
                f"surveyed layers must share their steps: {describe(ds)} has steps "
                f"{ds['step'].values.tolist()} at timesteps {ds['timestep'].values.tolist()}, "
                f"{describe(first)} {first['step'].values.tolist()} at "
                f"{first['timestep'].values.tolist()}"
            )
    return layers


def _survey_title(layers: dict[int, xr.Dataset], what: str, titles: bool = True) -> str:
    """'{checkpoint} · {prompt} · {what}', or `what` alone without `titles`."""
    first = next(iter(layers.values()))
    return f"{checkpoint_of(first)} · {prompt_of(first)} · {what}" if titles else capital(what)


def _step_panel_title(ds: xr.Dataset, step: int) -> str:
    return f"step {int(step)} · {step_title(ds, step)}"


def _layer_head_values(
    table: pd.DataFrame, column: str, step: int, layers: Sequence[int], heads: Sequence[int]
) -> np.ndarray:
    """(layer, head) array of one statistics column at `step`; NaN where a head is missing."""
    rows = table[table["step"] == int(step)]
    grid = rows.pivot(index="layer", columns="head", values=column)
    return grid.reindex(index=list(layers), columns=list(heads)).to_numpy(dtype=float)


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
    fig, axes, mesh = layer_head_panels(maps, layer_list, heads, legend_rows)
    return fig, axes, steps, heads, mesh


@styled
def plot_survey_first_frame(
    datasets: Sequence[xr.Dataset],
    *,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Layer x head map of the last block's mass on its first key frame (the `first` statistic of
    the `last_block` prob_mass profile), one panel per captured step. `statistics`: see
    `statistics_of`."""
    layers = _survey_layers(datasets)
    table = statistics_of(layers, statistics)
    fig, axes, _, _, mesh = _layer_head_maps(layers, table, "first")
    what = "last block's mass on the first key frame, every layer"
    fig.suptitle(_survey_title(layers, what, titles))
    add_colorbar(fig, mesh, axes, FIRST_FRAME_LABEL)
    return fig


@styled
def plot_survey_head_class(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = 0.3,
    recent_threshold: float = 0.5,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Layer x head map of Gu et al.'s importance of frame 0, one panel per captured step, each
    cell marked with its head class (statistics column `head_class`): sink o, recent ^, spread
    unmarked. `statistics`: see `statistics_of`."""
    layers = _survey_layers(datasets)
    table = statistics_of(layers, statistics, sink_threshold, recent_threshold)
    fig, axes, steps, heads, mesh = _layer_head_maps(layers, table, "importance", legend_rows=1)
    layer_list = list(layers)
    _, width, height = layer_head_geometry(len(layer_list), len(heads), len(steps))
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
    add_colorbar(fig, mesh, axes, IMPORTANCE_LABEL)
    return fig


def _sink_rate_axes(ax: Axes, sink_threshold: float, title: str) -> None:
    """The axes of a sink rate per layer: rates 0..1, integer layers."""
    ax.set_ylim(-0.04, 1.04)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    ax.set_xlabel("Layer (0-based)")
    ax.set_ylabel(f"Sink rate (importance ≥ {sink_threshold:g})")
    ax.set_title(title)


@styled
def plot_survey_sink_rate(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = 0.3,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Sink rate per layer (`stats.sink_rates`: the share of heads whose importance of frame 0 is
    at least `sink_threshold`), one line per captured step. `statistics`: see `statistics_of`."""
    layers = _survey_layers(datasets)
    table = statistics_of(layers, statistics, sink_threshold)
    rates = stats.sink_rates(table, sink_threshold)
    steps = common_steps(list(layers.values()))
    colors = step_colors([label for _, label in steps])
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


def survey_runs(datasets: Sequence[xr.Dataset]) -> dict[tuple[str, str], dict[int, xr.Dataset]]:
    """The datasets grouped by (checkpoint, prompt) in order of appearance, each run's layers
    sorted and sharing their steps."""
    runs: dict[tuple[str, str], list[xr.Dataset]] = {}
    for ds in datasets:
        runs.setdefault((checkpoint_of(ds), prompt_of(ds)), []).append(ds)
    if not runs:
        raise ValueError("no frame datasets given")
    return {run: _survey_layers(group) for run, group in runs.items()}


SURVEY_RUN_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


@styled
def plot_survey_sink_rate_runs(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = 0.3,
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """Sink rate per layer at `step`, one line per surveyed run: colour by checkpoint, marker by
    prompt."""
    runs = survey_runs(datasets)
    checkpoints = list(dict.fromkeys(checkpoint for checkpoint, _ in runs))
    prompts = list(dict.fromkeys(prompt for _, prompt in runs))
    colors = dict(zip(checkpoints, series_colors(len(checkpoints)), strict=True))
    markers = {
        prompt: SURVEY_RUN_MARKERS[i % len(SURVEY_RUN_MARKERS)] for i, prompt in enumerate(prompts)
    }
    fig = Figure(figsize=(FULL_WIDTH_IN, 2.6), layout="constrained")
    ax = fig.add_subplot()
    dodge = min(SINK_RATE_DODGE, 0.5 / len(runs))
    for i, ((checkpoint, prompt), layers) in enumerate(runs.items()):
        for ds in layers.values():
            select_step(ds, step)
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
    when = f" · step {int(step)} · {steps_title(datasets, step)}" if titles else ""
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


def attention_by_layer(
    attention: Sequence[xr.Dataset], layers: dict[int, xr.Dataset]
) -> dict[int, xr.Dataset]:
    """The attention stores by layer; each must belong to the run of `layers` and hold a layer of
    it, and every layer needs its store."""
    first = next(iter(layers.values()))
    run = (checkpoint_of(first), prompt_of(first))
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
                f"attention store of {describe(ds)} has timesteps "
                f"{store['timestep'].values.tolist()}, its frame dataset "
                f"{ds['timestep'].values.tolist()}"
            )
    return stores


@styled
def plot_survey_spatial(
    datasets: Sequence[xr.Dataset],
    *,
    attention: Sequence[xr.Dataset] = (),
    step: int = 0,
    top: int = 8,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Where in latent frame 0 the `top` strongest first-frame sinks of the survey attend: per
    head the H' x W' image of `first_frame_image` at `step`, on one shared colour scale (linear,
    log when the values span more than a decade). `statistics`: see `statistics_of`."""
    layers = _survey_layers(datasets)
    first = next(iter(layers.values()))
    select_step(first, step)
    stores = attention_by_layer(attention, layers)
    strongest = strongest_sinks(statistics_of(layers, statistics), step, top)
    if strongest.empty:
        raise ValueError(
            f"no head of {checkpoint_of(first)}/{prompt_of(first)} has a first-frame mass at step "
            f"{step}: no probabilities were captured"
        )
    images = np.stack(
        [
            first_frame_image(stores[int(row.layer)], layers[int(row.layer)], row.head, step)
            for row in strongest.itertuples()
        ]
    )
    cmap, norm, shown = color_scale(images, "probabilities")
    count, (height, width) = len(images), images.shape[1:]
    ncols = min(count, SPATIAL_COLUMNS)
    nrows = math.ceil(count / ncols)
    panel = (FULL_WIDTH_IN - 0.9) / ncols
    fig = Figure(
        figsize=(FULL_WIDTH_IN, nrows * (panel * height / width + 0.22) + 0.6),
        layout="constrained",
    )
    axes = panel_grid(fig, count, ncols)
    mesh = None
    for ax, row, image in zip(axes, strongest.itertuples(), shown, strict=True):
        mesh = draw_mesh(
            ax, np.arange(width + 1) - 0.5, np.arange(height + 1) - 0.5, image, cmap, norm
        )
        ax.set_ylim(height - 0.5, -0.5)  # latent row 0 on top, like the video
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        boxed(ax)
        ax.set_title(f"{head_label(row.layer, row.head)} · first frame {row.first:.2f}")
    what = f"where the last block attends in frame 0, {count} strongest first-frame sinks"
    if titles:
        what += f" · {_step_panel_title(first, step)}"
    fig.suptitle(_survey_title(layers, what, titles))
    fig.supxlabel(f"Latent frame 0: {height} x {width} tokens (one per 2x2 patch), as in the video")
    add_colorbar(fig, mesh, axes, TOKEN_MASS_LABEL)
    return fig
