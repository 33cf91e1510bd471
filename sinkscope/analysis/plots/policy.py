"""The KV-cache policy figures (`policies` scope): what each policy keeps of one run's attention,
drawn from its recall table (Contract 5, `sinkscope.analysis.policies`), not from frame datasets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib
import matplotlib.patheffects as patheffects
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

from .common import (
    FULL_WIDTH_IN,
    add_colorbar,
    capital,
    figure_legend,
    head_label,
    layer_head_panels,
    name_head,
    panel_grid,
    signed_number,
    styled,
    timestep_label,
)

RECALL_LABEL = "Recall (share of full-cache attention kept)"
RECALL_MAP_LABEL = "Recall\n(share of attention kept)"  # fits a colorbar 4 layers tall
POLICY_BUDGET_LABEL = "Budget B (latent frames kept)"
POLICY_LAYER_PANELS = 6  # layers drawn by default: all up to this many, else evenly spaced
UNIFORM_LABEL = "uniform attention (B / V)"
IQR_ALPHA = 0.15
RECALL_LIMITS = (-0.02, 1.04)  # the recall axis of every panel
# A summary over heads hides the few heads a policy decides for (a median flat at 0.43 while one
# sink head goes from 0 to 1): the sink sweep draws every head and names those whose recall
# changes most with S, the recall figure each policy's worst head and names the one furthest
# below its median.
NAMED_HEADS = 3  # at most, per panel of the sink sweep
NAMED_CHANGE = 0.05  # the least change of recall (a share of the attention) that names a head
HEAD_COLOR = "0.55"  # every head, thin
HEAD_LINE_WIDTH = 0.4
# the named heads, off the policies' colours, one per head of the figure (repeating after six)
NAMED_COLORS = ("#c51b7d", "#1b7837", "#762a83", "#8c510a", "#01665e", "#b2182b")
LABEL_GAP = 0.075  # recall between two end labels at least: about their height
LABEL_ROOM = 0.55  # the room right of the sweep for its end labels, in shares of its width
LABEL_HALO = [patheffects.withStroke(linewidth=1.5, foreground="white")]
EACH_HEAD_LABEL = (
    f"each head; named: the {NAMED_HEADS} largest changes from S = 0 (at least {NAMED_CHANGE:g})"
)
WORST_HEAD_LABEL = (
    f"thin: the head a policy keeps least of; named where {NAMED_CHANGE:g} or more below the median"
)


def _policy_run(table: pd.DataFrame) -> tuple[str, str]:
    """(checkpoint, prompt) of a recall table, which must hold rows of exactly one run."""
    if table.empty:
        raise ValueError("the recall table has no rows")
    pairs = table[["checkpoint", "prompt"]].drop_duplicates()  # not a loop over 60k rows
    runs = sorted({(str(c), str(p)) for c, p in pairs.itertuples(index=False)})
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


def chosen_budget(rows: pd.DataFrame, budget: int | None) -> int:
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


def chosen_layers(rows: pd.DataFrame, layers: Sequence[int] | None) -> list[int]:
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
    rows: pd.DataFrame,
    step: int,
    what: str,
    spread: str = "line: median over heads, band: quartiles",
    titles: bool = True,
) -> str:
    """Two lines: the run and what is drawn; the query block, its visible frames, the step and
    what the lines show (`spread`). Without `titles` the run and the step are left out."""
    checkpoint, prompt = _policy_run(rows)
    first = rows.iloc[0]
    label = timestep_label(first["timestep"], first["pass_kind"])
    when = f" · step {int(step)} · {'cache pass' if label == 'cache' else label}"
    block = int(first["query_block"])
    visible = int(first["visible_frames"])
    spread = f" · {spread}" if spread else ""
    run = f"{checkpoint} · {prompt} · " if titles else ""
    what = what if titles else capital(what)
    return (
        f"{run}{what}\nlast block (query block {block}, "
        f"V = {visible} visible frames){when if titles else ''}{spread}"
    )


def _recall_axis(ax: Axes) -> None:
    ax.set_ylim(*RECALL_LIMITS)
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
    panels = [(f"Layer {layer}", [layer]) for layer in chosen_layers(rows, layers)]
    panels.append((f"All {len(every)} layers, heads pooled", every))
    ncols = math.ceil(len(panels) / math.ceil(len(panels) / 4))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.75 * nrows + 1.1), layout="constrained")
    axes = panel_grid(fig, len(panels), ncols, sharex=True, sharey=True)
    return fig, axes, panels, ncols


def _finish_panels(fig: Figure, axes: Sequence[Axes], ncols: int, xlabel: str, title: str) -> None:
    """Budget or sink ticks under every panel without one below, one legend at the foot (a line
    keeps its label in every panel), recall on the y axis, the title."""
    for index, ax in enumerate(axes):
        _recall_axis(ax)
        if index + ncols >= len(axes):  # no panel below: this one labels the x axis
            ax.tick_params(labelbottom=True)
            ax.set_xlabel(xlabel)  # per panel: the legend takes the figure's foot
    figure_legend(fig, 3)
    fig.supylabel(RECALL_LABEL)
    fig.suptitle(title)


def _uniform_line(ax: Axes, x: Sequence[float], y: Sequence[float]) -> None:
    """The recall of uniform attention (every visible frame the same share): B / V."""
    ax.plot(
        x, y, color="0.6", linewidth=0.5, linestyle=(0, (1, 1.5)), label=UNIFORM_LABEL, zorder=1
    )


def head_curves(rows: pd.DataFrame, x: str) -> pd.DataFrame:
    """Each head's recall against the column `x` of `rows`: (layer, head) x values of `x`, in
    order; NaN where a head has no row."""
    curves = rows.pivot_table(index=["layer", "head"], columns=x, values="recall", aggfunc="first")
    return curves.sort_index().sort_index(axis=1)


def strongest_changes(
    curves: pd.DataFrame, count: int = NAMED_HEADS, least: float = NAMED_CHANGE
) -> list[tuple[tuple[int, int], float]]:
    """((layer, head), change) of the up to `count` heads of `curves` (`head_curves`) whose
    recall changes most from the first column to the last, by at least `least` either way;
    the largest first, ties in (layer, head) order."""
    change = (curves.iloc[:, -1] - curves.iloc[:, 0]).dropna()
    change = change[change.abs() >= least]
    order = change.abs().sort_values(ascending=False, kind="stable")
    return [
        ((int(layer), int(head)), float(change[(layer, head)]))
        for layer, head in order.index[:count]
    ]


def named_colors(panels: Sequence[Sequence[tuple[tuple[int, int], float]]]) -> dict:
    """A colour of NAMED_COLORS per head named in `panels` (`strongest_changes` of each): a
    head keeps its colour in every panel, and the heads of one panel differ (a head takes the
    first colour no other head of the panel where it is first named has)."""
    colors: dict[tuple[int, int], str] = {}
    for heads in panels:
        for head, _ in heads:
            if head not in colors:
                taken = {colors[other] for other, _ in heads if other in colors}
                free = [color for color in NAMED_COLORS if color not in taken]
                colors[head] = free[0] if free else NAMED_COLORS[len(colors) % len(NAMED_COLORS)]
    return colors


def _head_lines(ax: Axes, curves: pd.DataFrame) -> None:
    """Every head of `curves` as a thin grey line (one collection, '_each head'), over the
    values it has."""
    x = np.asarray(curves.columns, dtype=float)
    segments = []
    for values in curves.to_numpy(dtype=float):
        finite = np.isfinite(values)
        if finite.sum() > 1:
            segments.append(np.column_stack([x[finite], values[finite]]))
    ax.add_collection(
        LineCollection(
            segments,
            colors=HEAD_COLOR,
            linewidths=HEAD_LINE_WIDTH,
            alpha=0.6,
            zorder=1.5,
            label="_each head",
        ),
        autolim=False,
    )


def spread_labels(
    values: Sequence[float], gap: float, low: float = -math.inf, high: float = math.inf
) -> list[float]:
    """Heights for labels wanted at `values`, in the same order, moved apart to `gap` at least,
    as little as the order allows (pushed up from the lowest, then down as a block where the
    highest ran past the highest wanted), and kept within `low` .. `high` where they fit."""
    order = np.argsort(values, kind="stable")
    placed = np.asarray(values, dtype=float)[order]
    for i in range(1, len(placed)):
        placed[i] = max(placed[i], placed[i - 1] + gap)
    overshoot = placed[-1] - max(values) if len(placed) else 0.0
    if overshoot > 0:
        placed -= overshoot / 2  # share the move between the top and the bottom
    if len(placed):
        placed += max(low - placed[0], 0.0) - max(placed[-1] - high, 0.0)
    result = np.empty_like(placed)
    result[order] = placed
    return [float(v) for v in result]


def _name_ends(ax: Axes, x: float, ends: Sequence[tuple[float, str, object]]) -> None:
    """Texts (y, text, colour) right of `x`, at their y moved apart (`spread_labels`)."""
    low, high = RECALL_LIMITS
    heights = spread_labels([y for y, _, _ in ends], LABEL_GAP, low + LABEL_GAP / 2, high)
    for (_, text, color), y in zip(ends, heights, strict=True):
        name_head(
            ax,
            text,
            (x, y),
            color=color,
            annotation_clip=False,
            path_effects=LABEL_HALO,  # readable over the lines it crosses
        )


def _worst_heads(ax: Axes, chosen: pd.DataFrame, median: np.ndarray, style: dict, label: str):
    """The head with the least recall of `chosen` at each budget as a thin line in the policy's
    colour and dash ('_worst: {label}'); returns (gap below `median`, budget, recall, (layer,
    head)) where the gap is largest."""
    rows = chosen.loc[chosen.groupby("budget")["recall"].idxmin()].sort_values("budget")
    budgets = rows["budget"].to_numpy(dtype=float)
    recall = rows["recall"].to_numpy(dtype=float)
    ax.plot(
        budgets,
        recall,
        color=style.get("color"),
        linestyle=style.get("linestyle", "-"),
        linewidth=0.6,
        zorder=1.8,
        label=f"_worst: {label}",
    )
    gaps = median - recall
    at = int(np.argmax(gaps))
    head = (int(rows["layer"].iloc[at]), int(rows["head"].iloc[at]))
    return float(gaps[at]), float(budgets[at]), float(recall[at]), head


@styled
def plot_policy_recall(
    table: pd.DataFrame,
    *,
    step: int = 0,
    layers: Sequence[int] | None = None,
    titles: bool = True,
) -> Figure:
    """Recall against budget of every policy of the recall table (Contract 5) at `step`, for the
    last query block: one panel per layer of `layers` (default `default_policy_layers`) and one
    pooling the heads of every layer; a line is the median over heads, its band the quartiles,
    and a thin line of the same colour the head the policy keeps least of at each budget; in
    each panel the head furthest below its policy's median (by NAMED_CHANGE at least) is
    named."""
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
        worst = []  # (gap, budget, recall, head, colour) of each policy
        for policy, n, group in series:
            chosen = group[group["layer"].isin(pooled)]
            by_budget = [(int(b), g["recall"].to_numpy(float)) for b, g in chosen.groupby("budget")]
            if by_budget:
                label = policy_label(policy, n)
                style = styles[(policy, n)]
                groups = [values for _, values in by_budget]
                _quartile_line(
                    ax, np.array([b for b, _ in by_budget], dtype=float), groups, label, **style
                )
                median = np.array([head_quartiles(values)[1] for values in groups])
                worst.append((*_worst_heads(ax, chosen, median, style, label), style["color"]))
        gap, budget, recall, head, color = max(worst, key=lambda item: item[0], default=(0,) * 5)
        if gap >= NAMED_CHANGE:
            # The name on the sides with room: above a low point, and left of a point in the
            # right half (clear of the "V = ...: all kept" label at the foot of the V line).
            low, right = recall < 0.5, budget > limit / 2
            name_head(
                ax,
                head_label(*head),
                (budget, recall),
                offset=(-2 if right else 2, 3 if low else -3),
                ha="right" if right else "left",
                va="bottom" if low else "top",
                color=color,
                path_effects=LABEL_HALO,
            )
        _uniform_line(ax, [0, limit], [0, min(limit / visible, 1.0)])
        ax.set_title(title)
        ax.set_xlim(0, limit + 0.5)
        ax.set_xticks(sorted({*budgets, visible}))
    axes[0].plot([], [], color="0.3", linewidth=0.6, label=WORST_HEAD_LABEL)  # legend only
    title = _policy_title(rows, step, "recall of KV-cache policies against budget", titles=titles)
    _finish_panels(fig, axes, ncols, POLICY_BUDGET_LABEL, title)
    return fig


@styled
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
    layer's heads, a line the median over heads with its quartile band, every head a thin grey
    line, and the heads whose recall changes most from S = 0 (`strongest_changes`) in colour,
    named with their change at the right. The medians of top_c and its oracle at the same budget
    are horizontal references where the table has them."""
    rows = policy_last_block(table, step)
    budget = chosen_budget(rows, budget)
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
    curves = [head_curves(sweep[sweep["layer"].isin(pooled)], "sweep") for _, pooled in panels]
    named = [strongest_changes(panel_curves) for panel_curves in curves]
    colors = named_colors([named[-1], *named[:-1]])  # the pooled panel's strongest first
    span = sink_values[-1] - sink_values[0] + 0.6
    room = LABEL_ROOM * span if any(named) else 0.0  # the panels share x: room in all or none
    for ax, (title, pooled), panel_curves, heads in zip(axes, panels, curves, named, strict=True):
        chosen = sweep[sweep["layer"].isin(pooled)]
        by_sink = [(int(s), g["recall"].to_numpy(float)) for s, g in chosen.groupby("sweep")]
        _head_lines(ax, panel_curves)
        ends = []
        for head, change in heads:
            color = colors[head]
            values = panel_curves.loc[head]
            ax.plot(
                values.index.to_numpy(dtype=float),
                values.to_numpy(dtype=float),
                color=color,
                linewidth=0.9,
                marker="o",
                markersize=1.8,
                zorder=2.6,
                label=f"_named {head_label(*head)}",
            )
            text = f"{head_label(*head)} {signed_number(change, 2)}"
            ends.append((float(values.iloc[-1]), text, color))
        _name_ends(ax, float(sink_values[-1]), ends)
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
        ax.set_xlim(sink_values[0] - 0.3, sink_values[-1] + 0.3 + room)
    axes[0].plot([], [], color=HEAD_COLOR, linewidth=HEAD_LINE_WIDTH, label=EACH_HEAD_LABEL)
    what = f"recall against sink frames S at budget B = {budget}"
    title = _policy_title(rows, step, what, titles=titles)
    _finish_panels(fig, axes, ncols, "Sink frames S", title)
    return fig


@styled
def plot_policy_map(
    table: pd.DataFrame, *, step: int = 0, budget: int | None = None, titles: bool = True
) -> Figure:
    """Layer x head maps of recall at one `budget` (default `default_policy_budget`) for the last
    query block at `step`, one panel per policy: window, sink_window with the largest S below the
    budget, top_c and top_c_oracle where the table has them; one 0..1 colour scale, NaN grey
    (a layer without the policy's rows)."""
    rows = policy_last_block(table, step)
    budget = chosen_budget(rows, budget)
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
    fig, axes, mesh = layer_head_panels(maps, layer_list, heads)
    what = f"recall at budget B = {budget} latent frames, every head"
    fig.suptitle(_policy_title(rows, step, what, spread="", titles=titles))
    add_colorbar(fig, mesh, axes, RECALL_MAP_LABEL)
    return fig
