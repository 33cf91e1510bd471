"""The whole-model survey's figures (`survey` scope, and the `compare` kind of surveyed layers):
every layer and head of one run, from the frame datasets of every surveyed layer and, where a
figure looks inside frame 0, their attention stores (Contract 4). Sinks are probability mass (Gu
et al.): the statistics' `last_block` prob_mass rows (Contract 3), and a sink is what
`stats.is_sink` says it is (first-frame mass at least `sink_threshold` times its uniform share,
the `uniform_multiple` column) in every figure here: colours, markers, rates and the heads shown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib
import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from sinkscope.analysis import stats

from .common import (
    COLUMN_WIDTH_IN,
    FULL_WIDTH_IN,
    PROBABILITY_CMAP,
    UNSEEN_COLOR,
    DecimalLogFormatter,
    add_colorbar,
    boxed,
    capital,
    checkpoint_of,
    common_steps,
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
from .survey_data import (
    attention_by_layer,
    first_frame_image,
    last_block_visible_frames,
    runs_at_step,
    statistics_of,
    strongest_sinks,
    survey_layers,
    uniform_entropy,
    value_profiles,
    visible_tokens,
)
from .survey_maps import (
    add_threshold_colorbar,
    clipped_to,
    layer_head_maps,
    multiple_scale,
    step_panel_title,
)

FIRST_FRAME_LABEL = "First-frame probability mass"
MULTIPLE_LABEL = "First-frame mass ÷ uniform share (×)"
TOKEN_MULTIPLE_LABEL = "Per key token (× uniform share)"
ENTROPY_LABEL = "Entropy (nats)"
HEAD_CLASS_MARKERS = {"sink": "o", "recent": "^"}  # spread: no marker
HEAD_CLASS_COLORS = {"sink": "tab:red", "recent": "tab:blue", "spread": "0.6"}
ENTROPY_CMAP = "viridis"
SPATIAL_COLUMNS = 4
SINK_RATE_DODGE = 0.08  # layers between the markers of consecutive steps
MULTIPLE_FLOOR = 1e-4  # a log axis of multiples: smaller ones (0 among them) drawn at it
NAMED_HEADS = 4  # a head class of at most this many heads names them in the legend


def _survey_title(layers: dict[int, xr.Dataset], what: str, titles: bool = True) -> str:
    """'{checkpoint} · {prompt} · {what}', or `what` alone without `titles`."""
    first = next(iter(layers.values()))
    return f"{checkpoint_of(first)} · {prompt_of(first)} · {what}" if titles else capital(what)


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
    layers = survey_layers(datasets)
    table = statistics_of(layers, statistics)
    fig, axes, _, _, mesh = layer_head_maps(layers, table, "first")
    what = "last block's mass on the first key frame, every layer"
    fig.suptitle(_survey_title(layers, what, titles))
    add_colorbar(fig, mesh, axes, FIRST_FRAME_LABEL)
    return fig


@styled
def plot_survey_head_class(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = stats.SINK_THRESHOLD,
    recent_threshold: float = stats.RECENT_THRESHOLD,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Layer x head map of the last block's first-frame mass over its uniform share (statistics
    column `uniform_multiple`, the sink definition's score) on `multiple_scale`, one panel per
    captured step, each cell marked with its head class (`head_class`, from the same column):
    sink o, recent ^, spread unmarked. A circle sits exactly on the cells at or above the
    threshold on the colour bar. `statistics`: see `statistics_of`."""
    layers = survey_layers(datasets)
    table = statistics_of(layers, statistics, sink_threshold, recent_threshold)
    cmap, norm = multiple_scale(last_block_visible_frames(list(layers.values())))
    fig, axes, steps, heads, mesh = layer_head_maps(
        layers, table, "uniform_multiple", 1, (cmap, norm), clipped_to(norm)
    )
    layer_list = list(layers)
    _mark_head_classes(axes, steps, table, layer_list, heads)
    marker_style = {"linestyle": "", "markerfacecolor": "white", "markeredgecolor": "black"}
    handles = [
        Line2D(
            [],
            [],
            marker="o",
            label=f"sink: {stats.sink_definition(sink_threshold)}",
            **marker_style,
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
    what = "last block's first-frame mass over its uniform share, and head class, every layer"
    fig.suptitle(_survey_title(layers, what, titles))
    add_threshold_colorbar(fig, mesh, axes, MULTIPLE_LABEL, sink_threshold)
    return fig


def _mark_head_classes(
    axes: Sequence[Axes],
    steps: Sequence[int],
    table: pd.DataFrame,
    layer_list: Sequence[int],
    heads: Sequence[int],
) -> None:
    """The head class markers (`HEAD_CLASS_MARKERS`) on layer x head panels, one per step."""
    _, width, height = layer_head_geometry(len(layer_list), len(heads), len(steps))
    cell_pt = 72 * min(width / len(heads), height / len(layer_list))
    size = max(0.35 * cell_pt, 1.0) ** 2
    style = {"facecolor": "white", "edgecolor": "black", "linewidths": 0.3}
    for ax, step in zip(axes, steps, strict=True):
        classes = table[table["step"] == step]
        for name, marker in HEAD_CLASS_MARKERS.items():
            cells = classes[classes["head_class"] == name]
            ax.scatter(
                [list(heads).index(int(h)) for h in cells["head"]],
                [list(layer_list).index(int(layer)) for layer in cells["layer"]],
                s=size,
                marker=marker,
                label=name,
                **style,
            )


def _sink_rate_axes(ax: Axes, layers: Sequence[int], sink_threshold: float, title: str) -> None:
    """The axes of a sink rate per layer: rates 0..1, integer layers, a faint rule between
    layers (each layer's markers sit in its own slot: nothing joins them across layers)."""
    low, high = min(layers), max(layers)
    ax.set_ylim(-0.04, 1.04)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    ax.set_xticks(np.arange(low, high) + 0.5, minor=True)  # the rules between layers' slots
    ax.tick_params(axis="x", which="minor", length=0)
    ax.grid(axis="x", which="minor", color="0.9", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_xlim(low - 0.5, high + 0.5)
    ax.set_xlabel("Layer (0-based)")
    ax.set_ylabel("Sink rate (share of heads)")
    ax.set_title(f"{title}\nsink: {stats.sink_definition(sink_threshold)}")


def _rate_markers(ax: Axes, rows: pd.DataFrame, shift: float, **style) -> None:
    """One marker per layer of `rows` (a run's sink rates at one step), shifted sideways by
    `shift` layers, joined by no line: the rates of different layers are separate numbers."""
    ax.plot(
        rows["layer"].to_numpy(dtype=float) + shift,
        rows["sink_rate"].to_numpy(dtype=float),
        linestyle="none",
        markersize=4,
        **style,
    )


@styled
def plot_survey_sink_rate(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = stats.SINK_THRESHOLD,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Sink rate per layer (`stats.sink_rates`: the share of heads whose first-frame mass is at
    least `sink_threshold` times its uniform share, as head_class), one marker per layer and
    captured step, no lines. `statistics`: see `statistics_of`."""
    layers = survey_layers(datasets)
    table = statistics_of(layers, statistics, sink_threshold)
    rates = stats.sink_rates(table, sink_threshold)
    steps = common_steps(list(layers.values()))
    colors = step_colors([label for _, label in steps])
    fig = Figure(
        figsize=(min(max(COLUMN_WIDTH_IN, 0.12 * len(layers) + 2.2), FULL_WIDTH_IN), 2.5),
        layout="constrained",
    )
    ax = fig.add_subplot()
    # Rates are multiples of 1/heads, so steps often coincide: each step's markers sit shifted
    # sideways by up to SINK_RATE_DODGE layers from the next, within the layer's slot.
    dodge = min(SINK_RATE_DODGE, 0.8 / max(len(steps), 1))
    for i, (step, label) in enumerate(steps):
        rows = rates[rates["step"] == step].sort_values("layer")
        _rate_markers(
            ax,
            rows,
            (i - (len(steps) - 1) / 2) * dodge,
            color=colors[label],
            marker="s" if label == "cache" else "o",
            label=label,
        )
    _sink_rate_axes(ax, list(layers), sink_threshold, "Share of heads that are sinks, per layer")
    fig.legend(loc="outside right upper", title="Step")
    num_heads = len(next(iter(layers.values()))["head"])
    fig.suptitle(_survey_title(layers, f"{num_heads} heads per layer", titles))
    return fig


SURVEY_RUN_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


@styled
def plot_survey_sink_rate_runs(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = stats.SINK_THRESHOLD,
    step: int = 0,
    titles: bool = True,
    run_statistics: Mapping[tuple[str, str], pd.DataFrame] | None = None,
) -> Figure:
    """Sink rate per layer at `step`, one marker per layer and surveyed run (no lines): colour
    by checkpoint, marker by prompt. `run_statistics`: `runs_statistics` of the datasets, if
    the caller has them."""
    runs, run_statistics = runs_at_step(
        datasets, step, sink_threshold=sink_threshold, run_statistics=run_statistics
    )
    checkpoints = list(dict.fromkeys(checkpoint for checkpoint, _ in runs))
    prompts = list(dict.fromkeys(prompt for _, prompt in runs))
    colors = dict(zip(checkpoints, series_colors(len(checkpoints)), strict=True))
    markers = {
        prompt: SURVEY_RUN_MARKERS[i % len(SURVEY_RUN_MARKERS)] for i, prompt in enumerate(prompts)
    }
    fig = Figure(figsize=(FULL_WIDTH_IN, 2.7), layout="constrained")
    ax = fig.add_subplot()
    dodge = min(SINK_RATE_DODGE, 0.8 / len(runs))
    surveyed: set[int] = set()
    for i, ((checkpoint, prompt), layers) in enumerate(runs.items()):
        table = run_statistics[checkpoint, prompt]
        rates = stats.sink_rates(table, sink_threshold)
        rows = rates[rates["step"] == int(step)].sort_values("layer")
        surveyed |= set(layers)
        _rate_markers(
            ax,
            rows,
            (i - (len(runs) - 1) / 2) * dodge,
            color=colors[checkpoint],
            marker=markers[prompt],
            label=f"{checkpoint} · {prompt}",
        )
    _sink_rate_axes(
        ax, sorted(surveyed), sink_threshold, "Share of heads that are sinks, per layer, every run"
    )
    fig.legend(loc="outside right upper", title="Checkpoint · prompt")
    when = f" · step {int(step)} · {steps_title(datasets, step)}" if titles else ""
    fig.suptitle(f"Survey sink rates{when}")
    return fig


@styled
def plot_survey_spatial(
    datasets: Sequence[xr.Dataset],
    *,
    attention: Sequence[xr.Dataset] = (),
    step: int = 0,
    top: int = 8,
    sink_threshold: float = stats.SINK_THRESHOLD,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Where in latent frame 0 the sink heads of the survey attend (`strongest_sinks`: only heads
    that pass the sink definition, the `top` strongest): per head the H' x W' image of
    `first_frame_image` at `step` in multiples of the uniform share of a key token (1 / the
    tokens the last block sees), on one linear colour scale from 0 shared by the panels. The
    title says how many heads are sinks; with none, the figure says so. `statistics`: see
    `statistics_of`."""
    layers = survey_layers(datasets)
    first = next(iter(layers.values()))
    select_step(first, step)
    stores = attention_by_layer(attention, layers)
    table = statistics_of(layers, statistics, sink_threshold)
    if not np.isfinite(table.loc[table["step"] == int(step), "first"].astype(float)).any():
        raise ValueError(
            f"no head of {checkpoint_of(first)}/{prompt_of(first)} has a first-frame mass at step "
            f"{step}: no probabilities were captured"
        )
    strongest, sinks = strongest_sinks(table, step, top, sink_threshold)
    rule = stats.sink_definition(sink_threshold)
    when = f" · {step_panel_title(first, step)}" if titles else ""
    if strongest.empty:
        fig = Figure(figsize=(FULL_WIDTH_IN, 1.3), layout="constrained")
        fig.suptitle(_survey_title(layers, f"where sink heads attend in frame 0{when}", titles))
        fig.text(
            0.5,
            0.4,
            f"No head is a sink at this step ({rule}): nothing to show.",
            ha="center",
            va="center",
        )
        return fig
    images = []
    for row in strongest.itertuples():
        ds = layers[int(row.layer)]
        image = first_frame_image(stores[int(row.layer)], ds, row.head, step)
        images.append(image * visible_tokens(ds, row.head, step))
    images = np.stack(images)
    cmap = matplotlib.colormaps[PROBABILITY_CMAP].with_extremes(bad=UNSEEN_COLOR)
    norm = Normalize(vmin=0.0, vmax=float(np.nanmax(images, initial=1.0)))
    count, (height, width) = len(images), images.shape[1:]
    ncols = min(count, SPATIAL_COLUMNS)
    nrows = math.ceil(count / ncols)
    panel = (FULL_WIDTH_IN - 0.9) / SPATIAL_COLUMNS  # as wide with one sink as with eight
    fig = Figure(
        figsize=(
            max(COLUMN_WIDTH_IN, ncols * panel + 0.9),
            nrows * (panel * height / width + 0.3) + 1.0,
        ),
        layout="constrained",
    )
    axes = panel_grid(fig, count, ncols)
    mesh = None
    for ax, row, image in zip(axes, strongest.itertuples(), images, strict=True):
        mesh = draw_mesh(
            ax, np.arange(width + 1) - 0.5, np.arange(height + 1) - 0.5, image, cmap, norm
        )
        ax.set_ylim(height - 0.5, -0.5)  # latent row 0 on top, like the video
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        boxed(ax)
        ax.set_title(
            f"{head_label(row.layer, row.head)} · mass {row.first:.2f} "
            f"({row.uniform_multiple:.3g}×)"
        )
    if sinks > count:
        which = f"the {count} strongest of {sinks} sink heads attend"
    else:
        which = f"all {count} sink heads attend" if count > 1 else "the one sink head attends"
    run = _survey_title(layers, step_panel_title(first, step), True) if titles else ""
    fig.suptitle("\n".join(filter(None, [run, capital(f"where {which} in frame 0")])))
    fig.supxlabel(
        f"Latent frame 0: {height} x {width} tokens (one per 2x2 patch), as in the video\n"
        f"sink: {rule}"
    )
    add_colorbar(fig, mesh, axes, TOKEN_MULTIPLE_LABEL)
    return fig


@styled
def plot_survey_entropy(
    datasets: Sequence[xr.Dataset],
    *,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Layer x head map of the entropy of the last block's attention (the statistics' `entropy`
    of the `last_block` rows: per query token over the key tokens it sees, in nats, averaged over
    the block's query frames), one panel per captured step, on one scale from 0 to the entropy
    of uniform attention over the tokens the last block sees (ln of their number): dark is
    focused (a sink or a narrow window), light spread evenly. `statistics`: see
    `statistics_of`."""
    layers = survey_layers(datasets)
    table = statistics_of(layers, statistics)
    uniform = uniform_entropy(list(layers.values()))
    entropy = table["entropy"].to_numpy(dtype=float)
    largest = float(np.nanmax(entropy, initial=0.0)) if np.isfinite(entropy).any() else 1.0
    # Without the token count: up to the largest entropy drawn.
    ceiling = max(uniform, largest) if np.isfinite(uniform) else largest
    cmap = matplotlib.colormaps[ENTROPY_CMAP].with_extremes(bad=UNSEEN_COLOR)
    scale = (cmap, Normalize(vmin=0.0, vmax=ceiling))
    fig, axes, _, _, mesh = layer_head_maps(layers, table, "entropy", 0, scale)
    what = "entropy of the last block's attention, every layer"
    fig.suptitle(_survey_title(layers, what, titles))
    add_colorbar(fig, mesh, axes, ENTROPY_LABEL)
    if np.isfinite(uniform):  # the top of the scale: uniform attention
        colorbar = mesh.colorbar
        colorbar.ax.axhline(uniform, color="white", linewidth=1.0, linestyle=":")
        ticks = [tick for tick in colorbar.get_ticks() if tick < uniform * 0.93]
        labels = [f"{tick:g}" for tick in ticks] + [f"uniform {uniform:.2f}"]
        colorbar.set_ticks([*ticks, uniform], labels=labels)
    return fig


def _class_label(name: str, rows: pd.DataFrame) -> str:
    """'sink: L0H0' (a few heads named) or 'spread: 14 heads'."""
    heads = [
        head_label(layer, head) for layer, head in zip(rows["layer"], rows["head"], strict=True)
    ]
    if 0 < len(heads) <= NAMED_HEADS:
        return f"{name}: {', '.join(heads)}"
    return f"{name}: {len(heads)} head{'s' if len(heads) != 1 else ''}"


@styled
def plot_survey_sink_by_block(
    datasets: Sequence[xr.Dataset],
    *,
    step: int = 0,
    sink_threshold: float = stats.SINK_THRESHOLD,
    recent_threshold: float = stats.RECENT_THRESHOLD,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """Sink strength over generation time: per query block (from block 1: block 0 sees only its
    own frames) the first-frame mass of every head of every surveyed layer at `step` (left) and
    the same over its uniform share, the sink definition's score, on a log axis with the
    threshold (right): `stats.first_frame_by_block`, the `each_block` statistics. One thin line
    per head, coloured by its head class in the last block (`head_class`, the statistics'
    `last_block` rows); the legend names the heads of a small class. `statistics`: see
    `statistics_of`."""
    layers = survey_layers(datasets)
    first = next(iter(layers.values()))
    select_step(first, step)
    table = statistics_of(layers, statistics, sink_threshold, recent_threshold)
    classes = table[table["step"] == int(step)].set_index(["layer", "head"])["head_class"]
    by_block = pd.concat(
        [stats.first_frame_by_block(ds, step).assign(layer=layer) for layer, ds in layers.items()],
        ignore_index=True,
    )
    by_block = by_block[by_block["block"] > 0]
    fig = Figure(figsize=(FULL_WIDTH_IN, 2.9), layout="constrained")
    mass_ax, multiple_ax = fig.subplots(1, 2)
    handles = []
    for name in ("spread", "recent", "sink"):  # the sinks drawn last, on top
        keys = [key for key, value in classes.items() if value == name]
        if not keys:
            continue
        style = {
            "color": HEAD_CLASS_COLORS[name],
            "linewidth": 0.6 if name == "spread" else 1.4,
            "alpha": 0.5 if name == "spread" else 1.0,
            "marker": None if name == "spread" else "o",
            "markersize": 3,
        }
        for layer, head in keys:
            rows = by_block[(by_block["layer"] == layer) & (by_block["head"] == head)]
            blocks = rows["block"].to_numpy(dtype=float)
            mass_ax.plot(blocks, rows["first"].to_numpy(dtype=float), **style)
            multiple = np.maximum(rows["uniform_multiple"].to_numpy(dtype=float), MULTIPLE_FLOOR)
            multiple_ax.plot(blocks, multiple, **style)
        named = pd.DataFrame(keys, columns=["layer", "head"])
        handles.append(Line2D([], [], label=_class_label(name, named), **style))
    blocks = sorted(int(block) for block in by_block["block"].unique())
    for ax in (mass_ax, multiple_ax):
        ax.set_xlabel("Query block (0-based)")
        if blocks:
            ax.set_xticks(blocks)
            ax.set_xlim(blocks[0] - 0.3, blocks[-1] + 0.3)
        else:  # one block: it sees only itself
            ax.text(0.5, 0.5, "no block after block 0", transform=ax.transAxes, ha="center")
    mass_ax.set_ylim(0.0, 1.0)
    mass_ax.set_ylabel(FIRST_FRAME_LABEL)
    mass_ax.set_title("Mass on the first key frame")
    multiple_ax.set_yscale("log")
    multiple_ax.yaxis.set_major_formatter(DecimalLogFormatter())
    multiple_ax.axhline(1.0, color="0.3", linewidth=0.8, linestyle=":")
    multiple_ax.axhline(sink_threshold, color="black", linewidth=1.0, linestyle="--")
    multiple_ax.set_ylabel(MULTIPLE_LABEL)
    multiple_ax.set_title(f"Over its uniform share (dashed: sink ≥ {sink_threshold:g}×)")
    handles.reverse()  # sinks first
    fig.legend(
        handles=handles, loc="outside lower center", ncols=3, title="Head class (last block)"
    )
    when = f" · {step_panel_title(first, step)}" if titles else ""
    fig.suptitle(
        _survey_title(
            layers,
            f"sink strength over generation time: first-frame mass per query block{when}",
            titles,
        )
    )
    return fig


@styled
def plot_survey_sink_checkpoints(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = stats.SINK_THRESHOLD,
    step: int = 0,
    titles: bool = True,
    run_statistics: Mapping[tuple[str, str], pd.DataFrame] | None = None,
) -> Figure:
    """The same heads across checkpoints: one layer x head panel per checkpoint, side by side, of
    the last block's first-frame mass over its uniform share at `step` (the statistics'
    `uniform_multiple`, the median over the checkpoint's prompts), on `multiple_scale`; a circle
    marks a head that is a sink (`stats.is_sink`) in every prompt, a dot one that is a sink in
    some. Checkpoints with other layers or heads show theirs; a missing cell is grey.
    `run_statistics`: `runs_statistics` of the datasets, if the caller has them."""
    runs, run_statistics = runs_at_step(
        datasets, step, sink_threshold=sink_threshold, run_statistics=run_statistics
    )
    checkpoints = list(dict.fromkeys(checkpoint for checkpoint, _ in runs))
    layer_list = sorted({layer for layers in runs.values() for layer in layers})
    heads = sorted(
        {int(h) for layers in runs.values() for ds in layers.values() for h in ds["head"].values}
    )
    tables = []
    for checkpoint, prompt in runs:
        table = run_statistics[checkpoint, prompt]
        tables.append(table[table["step"] == int(step)].assign(checkpoint=checkpoint))
    table = pd.concat(tables, ignore_index=True)
    table["is_sink"] = stats.is_sink(table["uniform_multiple"], sink_threshold)
    grouped = table.groupby(["checkpoint", "layer", "head"])
    summary = grouped.agg(
        multiple=("uniform_multiple", "median"),
        sinks=("is_sink", "sum"),
        prompts=("prompt", "nunique"),
    ).reset_index()
    visible = last_block_visible_frames([ds for layers in runs.values() for ds in layers.values()])
    cmap, norm = multiple_scale(visible)
    clip = clipped_to(norm)
    maps = []
    for checkpoint in checkpoints:
        rows = summary[summary["checkpoint"] == checkpoint]
        grid = rows.pivot(index="layer", columns="head", values="multiple")
        values = grid.reindex(index=layer_list, columns=heads).to_numpy(dtype=float)
        prompts = int(rows["prompts"].max())
        count = "1 prompt" if prompts == 1 else f"median of {prompts} prompts"
        maps.append((f"{checkpoint} ({count})", clip(values)))
    fig, axes, mesh = layer_head_panels(maps, layer_list, heads, 1, cmap=cmap, norm=norm)
    _, width, height = layer_head_geometry(len(layer_list), len(heads), len(maps))
    cell_pt = 72 * min(width / len(heads), height / len(layer_list))
    for ax, checkpoint in zip(axes, checkpoints, strict=True):
        rows = summary[summary["checkpoint"] == checkpoint]
        for which, marker, size in (
            (rows["sinks"] == rows["prompts"], "o", 0.35),
            ((rows["sinks"] > 0) & (rows["sinks"] < rows["prompts"]), ".", 0.35),
        ):
            cells = rows[which.to_numpy()]
            ax.scatter(
                [heads.index(int(h)) for h in cells["head"]],
                [layer_list.index(int(layer)) for layer in cells["layer"]],
                s=max(size * cell_pt, 1.0) ** 2,
                marker=marker,
                facecolor="white",
                edgecolor="black",
                linewidths=0.3,
                label="every prompt" if marker == "o" else "some prompts",
            )
    marker_style = {"linestyle": "", "markerfacecolor": "white", "markeredgecolor": "black"}
    rule = stats.sink_definition(sink_threshold)
    handles = [
        Line2D([], [], marker="o", label=f"sink in every prompt ({rule})", **marker_style),
        Line2D([], [], marker=".", label="sink in some prompts", **marker_style),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=2)
    when = f" · step {int(step)} · {steps_title(datasets, step)}" if titles else ""
    fig.suptitle(
        f"The same heads across checkpoints: first-frame mass over its uniform share{when}"
    )
    add_threshold_colorbar(fig, mesh, axes, MULTIPLE_LABEL, sink_threshold)
    return fig


VALUE_SHOWN_HEADS = 2  # without figure heads among the surveyed layers: the strongest sinks


@styled
def plot_survey_value_norms(
    datasets: Sequence[xr.Dataset],
    *,
    heads: Sequence[tuple[int, int]] = (),
    step: int = 0,
    sink_threshold: float = stats.SINK_THRESHOLD,
    titles: bool = True,
    statistics: pd.DataFrame | None = None,
) -> Figure:
    """The value side of a head's attention: per key frame, the share of the last block's
    attention mass it gets (grey) beside its share of mass x ||v|| (the mass weighted by the
    norm of each key token's value vector, summed over the frame: what the frame can add to the
    output, Kobayashi et al. 2020), and the mean ||v|| of its tokens (line, right axis), at
    `step`. One panel per figure head in a surveyed layer (`heads`), else per strongest sink
    (`VALUE_SHOWN_HEADS`). A sink whose keys carry small values gets less of the second share
    than of the first. `statistics`: see `statistics_of`."""
    layers = survey_layers(datasets)
    chosen = [(int(layer), int(head)) for layer, head in heads if int(layer) in layers]
    if not chosen:
        table = statistics_of(layers, statistics, sink_threshold)
        sinks, _ = strongest_sinks(table, step, VALUE_SHOWN_HEADS, sink_threshold)
        chosen = [
            (int(layer), int(head))
            for layer, head in zip(sinks["layer"], sinks["head"], strict=True)
        ]
    if not chosen:
        raise ValueError("no head to show: no figure head is surveyed and no head is a sink")
    profiles = value_profiles(layers, chosen, step)
    fig = Figure(
        figsize=(min(COLUMN_WIDTH_IN * len(chosen), FULL_WIDTH_IN), 2.6), layout="constrained"
    )
    axes = panel_grid(fig, len(chosen), len(chosen))
    norm_color = "tab:blue"
    for ax, profile in zip(axes, profiles, strict=True):
        mass, weighted = profile["prob_mass"], profile["mass_value_norm"]
        mass_share = mass / np.nansum(mass)
        value_share = weighted / np.nansum(weighted)
        frames = np.arange(len(mass))
        ax.bar(frames - 0.2, mass_share, 0.4, color="0.65", label="share of attention mass")
        ax.bar(frames + 0.2, value_share, 0.4, color="tab:red", label="share of mass x ||v||")
        ax.set_ylim(0, 1.08 * max(np.nanmax(mass_share), np.nanmax(value_share)))
        ax.set_xlabel("Key frame (latent)")
        ax.set_ylabel("Share over the key frames")
        norms = ax.twinx()
        norms.plot(frames, profile["value_norm"], color=norm_color, marker=".", linewidth=0.8)
        norms.set_ylim(0, 1.15 * np.nanmax(profile["value_norm"]))
        norms.set_ylabel("Mean ||v|| of the frame's keys", color=norm_color)
        norms.tick_params(axis="y", colors=norm_color)
        top = int(np.nanargmax(mass_share))
        ax.set_title(
            f"{head_label(profile['layer'], profile['head'])}: frame {top} has "
            f"{mass_share[top]:.0%} of the mass, {value_share[top]:.0%} of mass x ||v||"
        )
    handles = [
        *axes[0].get_legend_handles_labels()[0],
        Line2D([], [], color=norm_color, marker=".", linewidth=0.8),
    ]
    labels = ["share of attention mass", "share of mass x ||v||", "mean ||v|| (right axis)"]
    fig.legend(handles, labels, loc="outside lower center", ncols=3)
    ds = next(iter(layers.values()))
    what = f"the value side of the last block's attention · {step_title(ds, step)}"
    fig.suptitle(_survey_title(layers, what, titles))
    return fig
