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
    closed_loop_runs,
    deviation_spread,
    evicting_frame,
    left_out_note,
    policy_key,
    policy_keys,
    policy_rows,
    reference_marks,
    rollout_label,
    run_groups,
    run_names,
    run_sort_key,
    spans_decades,
)
from sinkscope.analysis.stats import SINK_THRESHOLD
from sinkscope.analysis.switches import shown_pass, switch_starts
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
# In words: a viewer's first font (Arial) has no double bar (U+2016) and draws a box instead.
CLOSED_LOOP_L2_FORMULA = "per frame: norm(x − x_full) / norm(x_full)"
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
# Markers in the order of CLOSED_LOOP_COLORS after full: o window, s sink_window, D deep_sink, ...
CLOSED_LOOP_MARKERS = dict(zip(list(CLOSED_LOOP_COLORS)[1:], "osDvP^<>*X", strict=True))
EVICTION_STYLE = {"color": "0.45", "linewidth": 0.6, "linestyle": "--"}
TRAINING_STYLE = {"color": "0.45", "linewidth": 0.8, "linestyle": ":"}
MARKED_BLOCKS = 16  # the deviation lines mark the first frame of at most this many blocks


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


def _block_starts(blocks: np.ndarray) -> list[int]:
    """Positions of the first frame of each block (of every k-th block when there are more than
    MARKED_BLOCKS): where a deviation line puts its markers."""
    starts = np.flatnonzero(np.diff(blocks, prepend=blocks[0] - 1) != 0)
    return starts[:: math.ceil(len(starts) / MARKED_BLOCKS)].tolist()


def _log_axis(ax: Axes, values: np.ndarray, axis: str = "y") -> None:
    """A log y (or x) axis with plain numbers (0.01, 0.02, 0.05, 0.1): ticks at 1, 2 and 5 times
    the powers of ten when `values` span at most three decades, else at the powers alone."""
    positive = values[np.isfinite(values) & (values > 0)]
    decades = np.log10(positive.max() / positive.min())
    getattr(ax, f"set_{axis}scale")("log")
    scale = ax.yaxis if axis == "y" else ax.xaxis
    scale.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,)))
    scale.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    scale.set_minor_formatter(NullFormatter())


def _frame_list(values: Sequence[int]) -> str:
    return ", ".join(str(int(v)) for v in values)


REFERENCE_LABEL_PT = 5.5  # font size of the names above the reference lines


def _name_reference_lines(
    ax: Axes, evictions: dict[int, int], train_frames: int | None, last: int, ncols: int = 1
) -> None:
    """Name the panel's vertical reference lines above it, at their frames: `capacity C` at the
    first eviction of each capacity C (`evictions`: capacity -> frame; `capacity 4, 5` where two
    evict first at one frame), `training length` at `train_frames`. Lines at one frame (the
    training length and a capacity of the same size, 21 and 21) get one name that says both. A
    name too close to the one before it (in a panel of `ncols` a row) goes a line higher
    (`closed_loop.reference_marks` says what each frame is)."""
    marks = reference_marks(evictions, train_frames, last)
    if not marks:
        return
    frames = sorted(marks)
    per_frame = (FULL_WIDTH_IN - 0.7) * 72 / ncols / max(last + 1, 1)  # points per frame
    labels, right = [], -math.inf  # the right end of the last name on the lowest line
    for frame in frames:
        text = marks[frame]
        half = 0.3 * REFERENCE_LABEL_PT * len(text) / per_frame  # half its width, in frames
        raised = frame - half < right
        labels.append(f"{text}\n" if raised else text)
        if not raised:
            right = frame + half
    top = ax.secondary_xaxis("top")
    top.set_xticks(frames, labels)
    top.tick_params(length=2, pad=1, labelsize=REFERENCE_LABEL_PT, colors="0.35")
    for spine in top.spines.values():
        spine.set_visible(False)


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
        text = "No full-cache reference (closed_loop.reference: none):\nno deviation to draw"
        fig.text(0.5, 0.5, text, ha="center", va="center", color="0.35")
        fig.suptitle(CLOSED_LOOP_TITLE)
        return fig
    runs = closed_loop_runs(table, "deviation table")
    keys = policy_keys(table)
    styles = _closed_loop_styles(keys)
    log = spans_decades(table["rel_l2"].to_numpy(dtype=float))
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
            rows = policy_rows(run, key).sort_values("frame")
            if rows.empty:
                continue
            y = rows["rel_l2"].to_numpy(dtype=float)
            ax.plot(
                rows["frame"].to_numpy(dtype=float),
                np.where(y > 0, y, np.nan) if log else y,
                label=rollout_label(*key),
                markersize=2.0,
                markevery=_block_starts(rows["block"].to_numpy()),
                **styles[key],
            )
            start = evicting_frame(rows["frame"], rows["block"], capacity)
            if start is not None:
                run_evictions.setdefault(capacity, start)
                evictions.setdefault(capacity, set()).add(start)
        for capacity, start in sorted(run_evictions.items()):
            label = f"_first eviction, capacity {capacity}"
            ax.axvline(start, label=label, zorder=1, **EVICTION_STYLE)
        if train_frames is not None:
            ax.axvline(train_frames, label="_training length", zorder=1, **TRAINING_STYLE)
        _name_reference_lines(ax, run_evictions, train_frames, last, ncols)
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
            label = "first eviction of each capacity"
        elif len(caches) == 1:
            label = f"first eviction (frame {min(evictions[caches[0]])}, capacity {caches[0]})"
        else:
            starts = _frame_list(min(evictions[cache]) for cache in caches)
            label = f"first eviction (frames {starts}, capacity {_frame_list(caches)})"
        handles[label] = Line2D([], [], **EVICTION_STYLE)
    if train_frames is not None:
        handles[f"training length ({int(train_frames)} frames)"] = Line2D([], [], **TRAINING_STYLE)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=3)
    fig.supylabel(f"{CLOSED_LOOP_L2_LABEL}\n{CLOSED_LOOP_L2_FORMULA}")
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


@styled
def plot_closed_loop_recall(table: pd.DataFrame, *, titles: bool = True) -> Figure:
    """Mean relative L2 from the first eviction on (y) against the offline recall of the same
    choice of keys (x) of each closed-loop rollout (the summary, `closed_loop_summary` of
    `sinkscope.analysis.closed_loop`): one point per run and policy, colour and marker by policy.
    Rows without a recall or a mean (no offline rows, no eviction) are named in a note instead.
    Without `titles` the title does not name the run (the caption does)."""
    runs = closed_loop_runs(table, "summary")
    keys = policy_keys(table)
    styles = _closed_loop_styles(keys)
    names = run_names(runs)
    recall = table["recall"].to_numpy(dtype=float)
    mean = table["rel_l2_mean"].to_numpy(dtype=float)
    drawn = table[np.isfinite(recall) & np.isfinite(mean)]
    left_out = table[~(np.isfinite(recall) & np.isfinite(mean))]
    legend_rows = math.ceil(len(keys) / 2)
    fig = Figure(figsize=(COLUMN_WIDTH_IN, 2.9 + 0.12 * legend_rows), layout="constrained")
    ax = fig.add_subplot()
    for key in keys:
        rows = policy_rows(drawn, key)
        if rows.empty:
            continue
        style = {**styles[key], "linestyle": "none"}
        size = 4.6 if style["marker"] == "^" else 4.0  # a triangle looks smaller
        ax.plot(rows["recall"].to_numpy(dtype=float), rows["rel_l2_mean"].to_numpy(dtype=float),
                label=rollout_label(*key), markersize=size, markeredgewidth=0.5,
                markeredgecolor="white", **style)  # fmt: skip
    ax.set_xlim(-0.02, 1.02)
    ax.set_xticks([0.0, 0.25, 0.5, 0.75, 1.0])
    ax.grid(color="0.9", linewidth=0.4)
    ax.set_axisbelow(True)
    means = drawn["rel_l2_mean"].to_numpy(dtype=float)
    if spans_decades(means) and (means > 0).all():
        _log_axis(ax, means)
    elif means.size and means.max() > 0:
        ax.set_ylim(0, means.max() * 1.12)  # room above the top point for its name
    else:
        ax.set_ylim(bottom=0)
    if len(runs) > 1 and not drawn.empty:
        pairs = zip(drawn["checkpoint"], drawn["prompt"], strict=True)
        labels = [names[(str(c), str(p))] for c, p in pairs]
        x, y = (drawn[c].to_numpy(dtype=float) for c in ("recall", "rel_l2_mean"))
        _label_points(ax, x, y, labels)
    ax.set_xlabel(f"{CLOSED_LOOP_RECALL_LABEL}\n(mean over the captured layers, heads and steps)")
    ax.set_ylabel(CLOSED_LOOP_MEAN_LABEL)
    if drawn.empty:
        _note(ax, "no rollout has both an offline recall and an eviction")
        ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.02), ncols=2)
    if not left_out.empty:
        fig.supxlabel(left_out_note(left_out, keys, names), fontsize=5.5, color="0.35")
    if len(runs) > 1:
        where = f"{len(runs)} runs · one point per run and policy"
    elif titles:
        where = f"{runs[0][0]} · {runs[0][1]} · one point per policy"
    else:
        where = "one point per policy"
    fig.suptitle(f"Closed loop: deviation against offline recall\n{where}")
    return fig


RUNS_TITLE = "Closed loop: deviation from the full-cache rollout across runs"
# The summary's deviations the across-runs figure draws, one panel each: (column, x label).
RUNS_METRICS = {
    "rel_l2_mean": "Mean relative L2\nfrom the first eviction on",
    "rel_l2_beyond_training": "Mean relative L2\nbeyond the training length",
}
RUN_POINT_STYLE = {"marker": "o", "markersize": 2.6, "markerfacecolor": "none", "alpha": 0.75}
MEAN_STYLE = {"marker": "D", "markersize": 3.2, "linestyle": "none"}


@styled
def plot_closed_loop_deviation_runs(
    table: pd.DataFrame, *, train_frames: int | None = None
) -> Figure:
    """How far each policy drifts from the full-cache rollout across the closed loop's runs (the
    summary, `closed_loop_summary`): one row per policy, one panel per column of `RUNS_METRICS`
    (a column empty in every row is left out); per checkpoint (a colour each, side by side in
    the row) the mean over its prompts with an error bar of one sample standard deviation each
    side (`deviation_spread`; none from one prompt), every run's value a hollow dot. One seed
    rolls out every run: the spread is the prompts'. A log axis past a decade."""
    runs, keys = closed_loop_runs(table, "summary"), policy_keys(table)
    metrics = [c for c in RUNS_METRICS if np.isfinite(table[c].to_numpy(dtype=float)).any()]
    checkpoints = sorted({checkpoint for checkpoint, _ in runs})
    colors = dict(zip(checkpoints, series_colors(len(checkpoints)), strict=True))
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.0 + 0.3 * len(keys)), layout="constrained")
    if not metrics:
        fig.set_figheight(1.4)
        _note(fig.add_subplot(), "no deviation to draw: no full-cache reference, or no eviction")
        fig.axes[0].set_axis_off()
        fig.suptitle(RUNS_TITLE)
        return fig
    axes = panel_grid(fig, len(metrics), len(metrics), sharey=True)
    every = table[metrics].to_numpy(dtype=float).ravel()
    log = spans_decades(every) and (every[np.isfinite(every)] > 0).all()
    offsets = np.linspace(-0.25, 0.25, len(checkpoints) + 2)[1:-1]  # within a row
    offsets = dict(zip(checkpoints, offsets, strict=True))
    rows = {key: row for row, key in enumerate(keys)}
    spreads = []  # every standard deviation drawn
    for ax, column in zip(axes, metrics, strict=True):
        spread = deviation_spread(table, column)
        for key in set(keys) - set(spread["key"]):
            why = "never evicts" if column == "rel_l2_mean" else "no value"
            ax.text(0.01, rows[key], why, transform=ax.get_yaxis_transform(), va="center",
                    color="0.45", fontsize=REFERENCE_LABEL_PT)  # fmt: skip
        for item in spread.itertuples(index=False):
            y, color = rows[item.key] + offsets[item.checkpoint], colors[item.checkpoint]
            ax.plot(item.values, np.full(item.count, y), linestyle="none", color=color,
                    label="_run", **RUN_POINT_STYLE)  # fmt: skip
            bar = None if math.isnan(item.std) else item.std
            ax.errorbar(item.mean, y, xerr=bar, color=color, capsize=2.0, elinewidth=0.8,
                        label=f"_{item.checkpoint}", **MEAN_STYLE)  # fmt: skip
            spreads += [] if bar is None else [bar]
        ends = [*spread["mean"] + spread["std"].fillna(0), *every[np.isfinite(every)]]
        if log:
            _log_axis(ax, every, axis="x")
        else:
            right = 1.08 * float(np.nanmax(ends, initial=0.0)) or 1.0
            ax.set_xlim(-0.02 * right, right)  # a mean of 0 (never evicts) drawn whole
        train = f" ({int(train_frames)} frames)" if "training" in column and train_frames else ""
        ax.set_xlabel(RUNS_METRICS[column] + train)
        ax.grid(axis="x", color="0.9", linewidth=0.4)
        for row in range(1, len(keys)):
            ax.axhline(row - 0.5, color="0.92", linewidth=0.4, zorder=0)
    axes[0].set_yticks(range(len(keys)), [rollout_label(*key) for key in keys])
    axes[0].set_ylim(len(keys) - 0.5, -0.5)  # the first policy on top
    handles = {}
    for checkpoint in checkpoints:
        n = sum(c == checkpoint for c, _ in runs)
        what = f"mean ± s.d. over {n} prompts" if n > 1 else "1 prompt: no spread"
        handles[f"{checkpoint}: {what}"] = Line2D([], [], color=colors[checkpoint], **MEAN_STYLE)
    handles["one run (checkpoint, prompt)"] = Line2D([], [], color="0.4", **RUN_POINT_STYLE)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=3)
    where = f"{len(runs)} runs, the same seed: the spread is the prompts'"
    if spreads:  # a bar narrower than its marker is hidden: say how wide they get
        where += f" (largest s.d. {max(spreads):.2g})"
    fig.suptitle(f"{RUNS_TITLE}\n{where}")
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
        rows = policy_rows(
            table[(table["checkpoint"] == checkpoint) & (table["prompt"] == prompt)], key
        )
        mine = policy_rows(
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
    sink_threshold: float = SINK_THRESHOLD,
    titles: bool = True,
) -> Figure:
    """LoL's three collapse diagnostics against the latent frame, one column per rollout (the full
    cache's included; rows of `COLLAPSE_COLUMNS`): `sink_distance` per frame (the stacked frame
    tables, `read_deviation`); the share of sink heads (mass on the sink frames >=
    `sink_threshold` times their uniform share, `stats.is_sink`) of each captured layer per
    block (`blocks`, the block table of `analysis.diagnostics`), the mean over the captured
    passes (and the runs); the RoPE phase concentration per block. One line per run (the
    policy's colour for a single run; several runs: a colour and a dash each). Collapse
    candidates (`sinkscope.diagnostics.collapse_candidates`, from the training length
    `train_frames` on, or after the sink frames without it; the phase maxima from max(that,
    `PHASE_FROM`) on): a red dashed line at each sink-distance dip and a purple dash-dotted one
    at each phase maximum, across the column; a dotted line at the training length; a grey
    dashed line at each prompt switch (where the blocks' `segment` changes). Without `titles` a
    single run is not named (the caption names it)."""
    runs = closed_loop_runs(table, "frame table")
    keys = policy_keys(table)
    if blocks is None:
        blocks = pd.DataFrame(columns=[*RUN_KEYS, "block", "first_frame", "frames", "layer"])
        blocks["phase_concentration"] = pd.Series(dtype=float)
    layers = sorted({int(layer) for layer in blocks["layer"].dropna()})
    shades = matplotlib.colormaps["viridis"](np.linspace(0, 0.85, len(layers)))
    layer_colors = dict(zip(layers, ["black"] if len(layers) == 1 else shades, strict=True))
    names = run_names(runs)
    dashes = ["-", "--", ":", "-."]
    # As few rows as COLLAPSE_COLUMNS allows, filled evenly (5 rollouts: 3 + 2, not 4 + 1).
    groups = math.ceil(len(keys) / COLLAPSE_COLUMNS)
    ncols = math.ceil(len(keys) / groups)
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
        grid[0, column].set_title(textwrap.fill(rollout_label(*key), 26))
        switches = set()
        for checkpoint, prompt in runs if "segment" in blocks else []:
            run_rows = blocks[(blocks["checkpoint"] == checkpoint) & (blocks["prompt"] == prompt)]
            switches |= set(switch_starts(policy_rows(run_rows, key)))
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
        run_groups(shown, keys), key=lambda item: (*run_sort_key(item[0][:9]), item[0][9])
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
        step, label = shown_pass(rows)
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
        name = rollout_label(*policy_key(*key[2:9]))
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
    "plot_closed_loop_deviation_runs": "summary",
}
