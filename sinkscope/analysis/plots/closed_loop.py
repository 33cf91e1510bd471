"""The closed-loop figures (`closed_loop` scope): rollouts longer than the cache under a KV-cache
policy, drawn from their frame tables, summary and block diagnostics (Contract 6,
`sinkscope.analysis.closed_loop`, `sinkscope.analysis.diagnostics`), not from frame datasets.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from sinkscope.analysis.closed_loop import (
    FULL,
    RUN_KEYS,
    evicting_frame,
    policy_order,
    rollout_label,
)
from sinkscope.analysis.switches import switch_starts
from sinkscope.diagnostics import DISTANCE_THRESHOLD, PHASE_FROM, collapse_candidates

from .common import (
    COLUMN_WIDTH_IN,
    FULL_WIDTH_IN,
    legend_handles,
    panel_grid,
    series_colors,
    styled,
)

CLOSED_LOOP_TITLE = "Closed loop: latent deviation from the full-cache rollout"
CLOSED_LOOP_L2_LABEL = "Relative L2 to the full-cache rollout"
CLOSED_LOOP_MEAN_LABEL = "Mean relative L2 from the first eviction on"
CLOSED_LOOP_RECALL_LABEL = "Offline recall where the policy drops keys"
# The families of plot_policy_recall: window black, sinks blue (turned: purple), Participative
# Compression green (with Deep Sink: dark green), top-C orange.
CLOSED_LOOP_COLORS = {
    "full": "0.5",
    "window": "black",
    "sink_window": "#2171b5",
    "deep_sink": "#6a3d9a",
    "participative": "#41ab5d",
    "deep_forcing": "#006d2c",
    "top_c": "#d95f02",
    "relative": "#e7298a",
    "replay": "#a6761d",
    "head_jitter": "#e6ab02",
    "logit_bias": "#17becf",
}
CLOSED_LOOP_MARKERS = {
    "window": "o",
    "sink_window": "s",
    "deep_sink": "D",
    "participative": "v",
    "deep_forcing": "P",
    "top_c": "^",
    "relative": "<",
    "replay": ">",
    "head_jitter": "*",
    "logit_bias": "X",
}
CLOSED_LOOP_LOG_DECADES = 1.0  # a log axis when the non-zero values span more than this
EVICTION_STYLE = {"color": "0.45", "linewidth": 0.6, "linestyle": "--"}
TRAINING_STYLE = {"color": "0.45", "linewidth": 0.8, "linestyle": ":"}
NOTE_WIDTH = 70  # characters per line of a note under a figure one column wide
MARKED_BLOCKS = 16  # the deviation lines mark the first frame of at most this many blocks
POLICY_KEYS = RUN_KEYS[2:]  # what tells the policies of one run apart


def _policy_key(policy, budget, sink, recent, capacity, jitter, bias) -> tuple:
    """(policy, budget, sink_frames, recent_frames, capacity, jitter, bias), typed."""
    counts = (int(value) for value in (budget, sink, recent, capacity))
    return (str(policy), *counts, float(jitter), float(bias))


def _closed_loop_policies(table: pd.DataFrame) -> list[tuple]:
    """`_policy_key` of every closed-loop policy of `table`, in the order of
    `cache_choices.CLOSED_LOOP_POLICIES` (full, window, sink_window, deep_sink, participative,
    deep_forcing, top_c, then the newer ones), then by budget, S, R, capacity, jitter and bias."""
    keys = {_policy_key(*values) for values in table[POLICY_KEYS].itertuples(index=False)}
    return sorted(keys, key=lambda key: (policy_order(key[0]), *key[1:]))


def _rows_of(table: pd.DataFrame, key: tuple) -> pd.DataFrame:
    """The rows of one closed-loop policy (`_closed_loop_policies`) in `table`."""
    mask = np.ones(len(table), dtype=bool)
    for column, value in zip(POLICY_KEYS, key, strict=True):
        mask &= (table[column] == value).to_numpy()
    return table[mask]


def _closed_loop_styles(keys: Sequence[tuple]) -> dict[tuple, dict]:
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


def _closed_loop_label(key: tuple) -> str:
    return rollout_label(*key)


def closed_loop_runs(table: pd.DataFrame, what: str) -> list[tuple[str, str]]:
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


@styled
def plot_closed_loop_deviation(
    table: pd.DataFrame, *, train_frames: int | None = None, titles: bool = True
) -> Figure:
    """Relative L2 of each latent frame to the full-cache rollout (the stacked deviation tables of
    Contract 6, `read_deviation`): one panel per (checkpoint, prompt), one line per
    policy, a dashed line at the first frame each cache size (the budget, or Participative
    Compression's capacity) evicts keys for, a dotted one at the training length
    `train_frames`. The y axis is logarithmic when the non-zero values span more
    than a decade; the exact zeros (frames before the first eviction) are then left out. Without
    `titles` a single run's panel is not named (the caption names it). The full cache's own
    rows and those without a reference (`closed_loop.reference: none`: NaN) are not drawn;
    without any other the figure says so."""
    closed_loop_runs(table, "deviation table")
    table = table[(table["policy"] != FULL) & table["rel_l2"].notna()]
    if table.empty:
        fig = Figure(figsize=(COLUMN_WIDTH_IN, 1.2), layout="constrained")
        fig.text(
            0.5,
            0.5,
            "No full-cache reference (closed_loop.reference: none):\nno deviation to draw",
            ha="center",
            va="center",
            color="0.35",
        )
        fig.suptitle(CLOSED_LOOP_TITLE)
        return fig
    runs = closed_loop_runs(table, "deviation table")
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
    axes = panel_grid(fig, len(runs), ncols, sharex=True, sharey=True)
    evictions: dict[int, set[int]] = {}  # capacity -> its first evicting frames in every panel
    for index, (ax, (checkpoint, prompt)) in enumerate(zip(axes, runs, strict=True)):
        run = table[(table["checkpoint"] == checkpoint) & (table["prompt"] == prompt)]
        run_evictions: dict[int, int] = {}
        for key in keys:
            capacity = key[4]
            rows = _rows_of(run, key).sort_values("frame")
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
            start = evicting_frame(rows["frame"], rows["block"], capacity)
            if start is not None:
                run_evictions.setdefault(capacity, start)
                evictions.setdefault(capacity, set()).add(start)
        for capacity, start in sorted(run_evictions.items()):
            ax.axvline(
                start, label=f"_first eviction, cache {capacity}", zorder=1, **EVICTION_STYLE
            )
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
    handles = legend_handles(axes)
    if evictions:
        caches = sorted(evictions)
        if any(len(starts) > 1 for starts in evictions.values()):
            label = "first eviction of each cache size"
        elif len(caches) == 1:
            label = f"first eviction (frame {min(evictions[caches[0]])}, cache of {caches[0]})"
        else:
            starts = _frame_list(min(evictions[cache]) for cache in caches)
            label = f"first eviction (frames {starts}, caches of {_frame_list(caches)})"
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
        key = _policy_key(*(getattr(row, column) for column in POLICY_KEYS))
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


@styled
def plot_closed_loop_recall(table: pd.DataFrame, *, titles: bool = True) -> Figure:
    """Mean relative L2 from the first eviction on (y) against the offline recall of the same
    choice of keys (x) of each closed-loop rollout (the summary, `closed_loop_summary` of
    `sinkscope.analysis.closed_loop`): one point per run and policy, colour and marker by policy.
    Rows without a recall or a mean (no offline rows, no eviction) are named in a note instead.
    Without `titles` the title does not name the run (the caption does)."""
    runs = closed_loop_runs(table, "summary")
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
        rows = _rows_of(drawn, key)
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


COLLAPSE_TITLE = "Closed loop: reference-free collapse diagnostics"
COLLAPSE_COLUMNS = 4  # rollouts per row of panels
DIP_STYLE = {"color": "#cb181d", "linewidth": 0.6, "linestyle": "--"}
PEAK_STYLE = {"color": "#6a51a3", "linewidth": 0.6, "linestyle": "-."}


def _block_steps(rows: pd.DataFrame, column: str) -> tuple[np.ndarray, np.ndarray]:
    """A per-block value as steps over its frames (steps-post, frame f spanning f - 0.5 ..
    f + 0.5): x the blocks' first frames and the end of the last, y repeating the last value."""
    rows = rows.sort_values("first_frame")
    end = rows["first_frame"].iloc[-1] + rows["frames"].iloc[-1]
    x = np.append(rows["first_frame"].to_numpy(dtype=float), end) - 0.5
    y = rows[column].to_numpy(dtype=float)
    return x, np.append(y, y[-1])


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.45")


def _collapse_column(axes, key, table, blocks, train_frames, run_styles, layer_colors) -> None:
    """One rollout's column of `plot_closed_loop_collapse`: per run (`run_styles`: run -> line
    style) its sink distance, phase concentration and collapse candidates; the sink-head share of
    each layer, averaged over the captured passes and the runs."""
    distance_ax, share_ax, phase_ax = axes
    shares = []
    for (checkpoint, prompt), style in run_styles.items():
        rows = _rows_of(
            table[(table["checkpoint"] == checkpoint) & (table["prompt"] == prompt)], key
        )
        mine = _rows_of(
            blocks[(blocks["checkpoint"] == checkpoint) & (blocks["prompt"] == prompt)], key
        )
        if rows.empty:
            continue
        rows = rows.sort_values("frame")
        frame, distance = rows["frame"].to_numpy(), rows["sink_distance"].to_numpy(dtype=float)
        distance_ax.plot(frame, distance, linewidth=0.7, **style)
        per_block = mine.drop_duplicates("block").sort_values("first_frame")
        first = per_block["first_frame"].to_numpy()
        phase = per_block["phase_concentration"].to_numpy(dtype=float)
        if not per_block.empty:
            x, y = _block_steps(per_block, "phase_concentration")
            phase_ax.plot(x, y, drawstyle="steps-post", linewidth=0.7, **{**style, "label": "_"})
        start = train_frames if train_frames is not None else int(np.argmax(distance > 0))
        found = collapse_candidates(
            frame, distance, first, phase, start=start, phase_from=max(start, PHASE_FROM)
        )
        for name, line_style in (("sink_distance", DIP_STYLE), ("phase_concentration", PEAK_STYLE)):
            for f in found[name]:
                for ax in axes:
                    ax.axvline(f, label=f"_{name} candidate", zorder=1, **line_style)
        dips = found["sink_distance"]
        bottoms = distance[np.searchsorted(frame, dips)]
        distance_ax.plot(dips, bottoms, "v", color=DIP_STYLE["color"], markersize=3, label="_dip")
        shares.append(mine[mine["layer"].notna()])
    captured = pd.concat(shares) if shares else pd.DataFrame()
    for layer, rows in captured.groupby("layer") if not captured.empty else []:
        mean = rows.groupby(["block", "first_frame", "frames"], as_index=False)["sink_share"]
        x, y = _block_steps(mean.mean(), "sink_share")
        color = layer_colors[int(layer)]
        share_ax.plot(x, y, drawstyle="steps-post", color=color, linewidth=0.7, label=f"L{layer}")
    if captured.empty:
        _note(share_ax, "no attention captured")
    if not phase_ax.lines:
        _note(phase_ax, "no block positions")


@styled
def plot_closed_loop_collapse(
    table: pd.DataFrame,
    *,
    blocks: pd.DataFrame | None = None,
    train_frames: int | None = None,
    sink_threshold: float = 0.3,
    titles: bool = True,
) -> Figure:
    """LoL's three collapse diagnostics against the latent frame, one column per rollout (the
    full cache's included; rows of `COLLAPSE_COLUMNS`): `sink_distance` per frame (the stacked
    frame tables, `read_deviation`); the share of sink heads (mass on the sink frames >=
    `sink_threshold`) of each captured layer per block (`blocks`, the block table of
    `analysis.diagnostics`), the mean over the captured passes (and the runs); the RoPE phase
    concentration per block. One line per run (the policy's colour for a single run; several
    runs: a colour and a dash each). Collapse candidates
    (`sinkscope.diagnostics.collapse_candidates`, from the training length `train_frames` on, or
    after the sink frames without it; the phase maxima from max(that, `PHASE_FROM`) on): a red
    dashed line at each sink-distance dip and a purple dash-dotted one at each phase maximum,
    across the column; a dotted line at the training length; a grey dashed line at each prompt
    switch (where the blocks' `segment` changes). Without `titles` a single run is
    not named (the caption names it)."""
    runs = closed_loop_runs(table, "frame table")
    keys = _closed_loop_policies(table)
    if blocks is None:
        blocks = pd.DataFrame(columns=[*RUN_KEYS, "block", "first_frame", "frames", "layer"])
        blocks["phase_concentration"] = pd.Series(dtype=float)
    layers = sorted({int(layer) for layer in blocks["layer"].dropna()})
    shades = matplotlib.colormaps["viridis"](np.linspace(0, 0.85, len(layers)))
    layer_colors = dict(zip(layers, ["black"] if len(layers) == 1 else shades, strict=True))
    names = _run_names(runs)
    dashes = ["-", "--", ":", "-."]
    ncols = min(len(keys), COLLAPSE_COLUMNS)
    groups = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 2.5 * groups + 0.8), layout="constrained")
    # one grid (subfigures lay out differently at each draw, by rounding): 3 rows per rollout row
    axes = fig.subplots(3 * groups, ncols, sharex=True, squeeze=False)
    grids = [axes[3 * group : 3 * group + 3] for group in range(groups)]
    distances = table["sink_distance"].to_numpy(dtype=float)
    top = max(1.25, 1.05 * float(np.nanmax(distances, initial=0.0)))
    phases = blocks["phase_concentration"].to_numpy(dtype=float)
    low = min(-0.05, float(np.nanmin(phases, initial=0.0)) - 0.05)
    for index, key in enumerate(keys):
        grid, column = grids[index // ncols], index % ncols
        if len(runs) == 1:
            color = CLOSED_LOOP_COLORS.get(key[0], "0.3")
            run_styles = {runs[0]: {"color": color, "label": "_run"}}
        else:
            run_styles = {
                run: {"color": f"C{i % 10}", "linestyle": dashes[i % 4], "label": names[run]}
                for i, run in enumerate(runs)
            }
        _collapse_column(
            grid[:, column], key, table, blocks, train_frames, run_styles, layer_colors
        )
        grid[0, column].set_title(textwrap.fill(_closed_loop_label(key), 26))
        switches = set()
        for checkpoint, prompt in runs if "segment" in blocks else []:
            run_rows = blocks[(blocks["checkpoint"] == checkpoint) & (blocks["prompt"] == prompt)]
            switches |= set(switch_starts(_rows_of(run_rows, key)))
        for frame in sorted(switches):
            for ax in grid[:, column]:
                ax.axvline(frame, label="_switch", zorder=1, **SWITCH_STYLE)
        grid[0, column].axhline(DISTANCE_THRESHOLD, color="0.6", linewidth=0.5, linestyle=":")
        for ax, limits in zip(grid[:, column], [(0, top), (-0.03, 1.03), (low, 1.05)], strict=True):
            if train_frames is not None:
                ax.axvline(train_frames, label="_training length", zorder=1, **TRAINING_STYLE)
            ax.set_xlim(-0.5, int(table["frame"].max()) + 0.5)
            ax.set_ylim(*limits)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
            ax.grid(axis="y", color="0.92", linewidth=0.4)
            ax.tick_params(labelleft=column == 0)
        grid[2, column].tick_params(labelbottom=True)
        if index + ncols >= len(keys):  # no panel below: this one labels the x axis
            grid[2, column].set_xlabel("Latent frame")
    for grid in grids:
        grid[0, 0].set_ylabel("Sink\ndistance")
        grid[1, 0].set_ylabel("Sink-head\nshare")
        grid[2, 0].set_ylabel("Phase con-\ncentration")
    for ax in grids[-1][:, len(keys) - ncols * (groups - 1) :].ravel():
        ax.remove()  # the last row of rollouts is not full
    handles = legend_handles(fig.axes)
    marked = {line.get_label() for ax in fig.axes for line in ax.lines}
    if "_sink_distance candidate" in marked:
        handles[f"sink-distance dip ≤ {DISTANCE_THRESHOLD:g}"] = Line2D([], [], **DIP_STYLE)
    if "_phase_concentration candidate" in marked:
        handles["phase maximum"] = Line2D([], [], **PEAK_STYLE)
    if train_frames is not None:
        handles[f"training length ({int(train_frames)} frames)"] = Line2D([], [], **TRAINING_STYLE)
    if "_switch" in marked:
        handles["prompt switch"] = Line2D([], [], **SWITCH_STYLE)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=5)
    passes = "passes and runs" if len(runs) > 1 else "passes"
    where = f"{runs[0][0]} · {runs[0][1]} · " if titles and len(runs) == 1 else ""
    fig.suptitle(f"{COLLAPSE_TITLE}\n{where}sink-head share: mean over the captured {passes}")
    return fig


SWITCHES_TITLE = "Closed loop: sink and own-block attention per query block"
SWITCHES_ACROSS = " across the prompt switches"  # added where a run switches its prompt
SWITCH_STYLE = {"color": "0.35", "linewidth": 0.7, "linestyle": "--"}
SWITCH_ROWS = 8  # (rollout, layer) rows drawn at most; the note names how many are left out


def _switch_step(rows: pd.DataFrame) -> tuple[int, str]:
    """The pass a rollout's switch panels show: its first captured denoising pass (t = 1000 by
    default), else its first pass; with its label."""
    passes = rows.drop_duplicates("step").sort_values("step")
    denoise = passes[passes["pass_kind"] == "denoise"]
    chosen = (denoise if not denoise.empty else passes).iloc[0]
    kind = str(chosen["pass_kind"])
    label = "cache pass (t=0)" if kind == "cache" else f"t={float(chosen['timestep']):g}"
    return int(chosen["step"]), label if kind != "recache" else "recache pass (t=0)"


@styled
def plot_closed_loop_switches(table: pd.DataFrame, *, titles: bool = True) -> Figure:
    """Each head's mass on the sink frames (left) and on its own block (right) per query block,
    against the block's first latent frame, in the first captured denoising pass, one row per
    captured (rollout, layer) of the switch table (`analysis.switches`; the rollouts of the runs
    whose prompt switches when any does, at most `SWITCH_ROWS` rows); one line per head, a dashed
    line at every switch labelled with the segment it starts. A single run is named in the
    figure's title (not at all without `titles`: the caption names it), several in each row's.
    A recache pass is not drawn (it queries the frames before a switch again: the table has
    it)."""
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.0), layout="constrained")
    if table.empty:
        fig.set_figheight(2.0)
        ax = fig.subplots()
        ax.set_axis_off()
        _note(ax, "no attention captured over the cache's slots (closed_loop.survey)")
        fig.suptitle(SWITCHES_TITLE)
        return fig
    keys = [*RUN_KEYS, "layer"]
    switching = table.groupby(["checkpoint", "prompt"])["segment"].transform("max") > 0
    shown = table[switching] if switching.any() else table
    groups = sorted(
        shown.groupby(keys, sort=False),
        key=lambda item: (*item[0][:2], policy_order(item[0][2]), *item[0][2:]),
    )
    left_out = len(groups) - SWITCH_ROWS
    groups = groups[:SWITCH_ROWS]
    runs = sorted({(str(key[0]), str(key[1])) for key, _ in groups})  # named once when one
    heads = sorted({int(head) for head in shown["head"]})
    colors = dict(zip(heads, series_colors(len(heads)), strict=True))
    layers = sorted({int(key[9]) for key, _ in groups})
    # A head is named as everywhere else (L0H0) where every row shows the same layer.
    head_label = (lambda h: f"L{layers[0]}H{h}") if len(layers) == 1 else (lambda h: f"H{h}")
    # Rows without a switch show one trend each: shorter ones suffice.
    fig.set_figheight((1.45 if switching.any() else 1.1) * len(groups) + 1.1)
    axes = fig.subplots(len(groups), 2, sharex=True, squeeze=False)
    marked = False
    for (key, rows), row_axes in zip(groups, axes, strict=True):
        switches = switch_starts(rows)  # switch i starts segment i + 1
        marked |= bool(switches)
        step, label = _switch_step(rows)
        drawn = rows[rows["step"] == step]
        for head, per_head in drawn.groupby("head"):
            per_head = per_head.sort_values("first_frame")
            x = per_head["first_frame"].to_numpy()
            for ax, column in zip(row_axes, ("sink_mass", "own_mass"), strict=True):
                ax.plot(x, per_head[column].to_numpy(dtype=float), color=colors[int(head)],
                        linewidth=0.7, marker=".", markersize=2,
                        label=head_label(int(head)))  # fmt: skip
        for ax in row_axes:
            for segment, frame in enumerate(switches, start=1):
                ax.axvline(frame, label="_switch", zorder=1, **SWITCH_STYLE)
                ax.annotate(f"→{segment}", (frame, 1.0), xycoords=("data", "axes fraction"),
                            xytext=(2, -2), textcoords="offset points", va="top",
                            fontsize=6, color="0.35")  # fmt: skip
            ax.set_ylim(-0.03, 1.16)  # room above 1 for the switches' labels
            ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
            ax.grid(axis="y", color="0.92", linewidth=0.4)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
        run = f"{key[0]} · {key[1]} · " if len(runs) > 1 else ""
        name = _closed_loop_label(_policy_key(*key[2:9]))
        row_axes[0].set_ylabel(f"L{int(key[9])}: mass on\nthe sink frames")
        row_axes[1].set_ylabel("mass on the\nown block")
        row_axes[0].set_title(f"{run}{name} · L{int(key[9])} · {label}", loc="left")
    axes[-1, 0].set_xlabel("Query block's first latent frame")
    axes[-1, 1].set_xlabel("Query block's first latent frame")
    handles = legend_handles(fig.axes)
    if marked:
        handles["switch (→ segment it starts)"] = Line2D([], [], **SWITCH_STYLE)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=7)
    note = f"\n{left_out} more (rollout, layer) rows in switches.csv" if left_out > 0 else ""
    where = f"\n{runs[0][0]} · {runs[0][1]}" if titles and len(runs) == 1 else ""
    across = SWITCHES_ACROSS if marked else ""
    fig.suptitle(f"{SWITCHES_TITLE}{across}{where}{note}")
    return fig


# The table each closed-loop figure draws (`render_figures` reads it): the stacked frame tables
# (deviation), the summary or the switch table; the collapse figure gets the block table as
# `blocks` too.
TABLES = {
    "plot_closed_loop_deviation": "deviation",
    "plot_closed_loop_recall": "summary",
    "plot_closed_loop_collapse": "deviation",
    "plot_closed_loop_switches": "switches",
}
