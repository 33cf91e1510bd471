"""The video figures (`video` scope): one closed-loop run's decoded rollouts
(`results/videos/{checkpoint}/{prompt}/{rollout}.mp4`, `sinkscope.videos`) and their pixel
diagnostics (`metrics.csv`, `sinkscope.video_metrics`), beside the closed loop's own diagnostics
of the same rollouts: the frame tables (Contract 6, `analysis.closed_loop.read_deviation`: the
policy's cache, the latent `sink_distance`) and the block table (`analysis.diagnostics`:
`phase_concentration`, `sink_share`).

A rollout is named by its video's file stem, the `rollout` of the metrics: `full` (the full-cache
reference), a closed-loop policy (`window`, `sink_window`, ...: the run's frame table of that
`policy`) or `survey` (no closed-loop table). Latent frame 0 decodes to pixel frame 0, latent
f >= 1 to pixel frames 4f-3 .. 4f (`frames.video_frames_of_latent`); the figures' x axis and
columns are latent frames, the axis of the closed loop's tables.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from sinkscope.analysis.closed_loop import FULL, RUN_KEYS, evicting_frame, policy_order
from sinkscope.diagnostics import DISTANCE_THRESHOLD, PHASE_FROM, collapse_candidates
from sinkscope.frames import video_frames_of_latent

from .common import FULL_WIDTH_IN, legend_handles, styled

SURVEY = "survey"  # the survey's own rollout: decoded, but no closed-loop table
STRIP_TITLE = "Decoded rollouts at selected latent frames"
DIAGNOSTICS_TITLE = "Where the attention predicts a collapse, and where the video shows one"
STRIP_COLUMNS = 8  # latent frames shown at most: about a paper's width of frames
STRIP_DPI = 200  # pixels per inch of a cell the strip keeps of a frame (more are averaged away)
LABEL_WIDTH_IN = 0.85  # the rollouts' names left of the strip
# The marks, shared by both figures: the colours of the closed-loop collapse figure for the
# collapse candidates (red: sink-distance dip, purple: phase maximum).
EVICTED_COLOR = "#ff7f00"
DIP_COLOR = "#cb181d"
PEAK_COLOR = "#6a51a3"
EVICTION_STYLE = {"color": "0.45", "linewidth": 0.8, "linestyle": "--"}
DIP_STYLE = {"color": DIP_COLOR, "linewidth": 0.7, "linestyle": "--"}
PEAK_STYLE = {"color": PEAK_COLOR, "linewidth": 0.7, "linestyle": "-."}
TRAINING_STYLE = {"color": "0.45", "linewidth": 0.8, "linestyle": ":"}
THRESHOLD_STYLE = {"color": "0.6", "linewidth": 0.5, "linestyle": ":"}
COLLAPSED_COLOR = "#fdd0a2"  # the frames where the pixels come back to the sinks
# The lines of the diagnostics: pixels on the upper row of a panel, the model on the lower.
PIXEL_DISTANCE_STYLE = {"color": "black", "linewidth": 0.9}
SSIM_STYLE = {"color": "#d95f02", "linewidth": 0.8, "linestyle": "--"}
LATENT_DISTANCE_STYLE = {"color": "#2171b5", "linewidth": 0.9}
SHARE_STYLE = {"color": "#41ab5d", "linewidth": 0.8, "drawstyle": "steps-post"}
SSIM_LABEL = "SSIM to the full rollout"
SHARE_LABEL = "sink-head share (mean over layers, passes)"


def rollout_order(rollout: str) -> tuple:
    """Sort key of a decoded rollout: `full` first, the policies in the closed loop's order
    (`policy_order`), `survey` last."""
    return (rollout == SURVEY, policy_order(rollout))


def video_rollouts(table: pd.DataFrame) -> list[str]:
    """The rollouts of a run's video metrics, in `rollout_order`."""
    return sorted({str(rollout) for rollout in table["rollout"]}, key=rollout_order)


def _of_rollout(table: pd.DataFrame | None, rollout: str) -> pd.DataFrame:
    """The closed-loop rows (frame or block table) of one rollout: those of its policy."""
    if table is None:
        return pd.DataFrame()
    return table[table["policy"] == rollout]


@dataclass(frozen=True)
class RolloutMarks:
    """What the figures mark on one rollout, from the closed loop's tables: the first latent
    frame from which the cache has dropped keys (None: it never drops any, or no table), and the
    collapse candidates (`sinkscope.diagnostics.collapse_candidates`): the latent sink-distance
    dips and the phase maxima, from `start` on."""

    evicting_from: int | None
    dips: tuple[int, ...]
    peaks: tuple[int, ...]
    start: int | None


def rollout_marks(
    rollout: str,
    deviation: pd.DataFrame | None,
    blocks: pd.DataFrame | None,
    train_frames: int | None = None,
) -> RolloutMarks:
    """The marks of `rollout` (its policy's rows of the frame table `deviation` and the block
    table `blocks`, each may be None), found as the closed-loop collapse figure finds them: from
    the training length `train_frames` on, else from the first frame past the sinks (the first
    whose latent sink distance is above 0); the phase maxima from max(that, `PHASE_FROM`) on."""
    rows = _of_rollout(deviation, rollout)
    per_block = _of_rollout(blocks, rollout)
    if not per_block.empty:
        per_block = per_block.drop_duplicates("block").sort_values("first_frame")
    if not rows.empty:
        rows = rows.sort_values("frame")
    if rows.empty and per_block.empty:
        return RolloutMarks(None, (), (), None)
    if rollout == FULL:  # the reference keeps every key: no capacity (empty), never evicts
        evicting = None
    elif not rows.empty:
        evicting = evicting_frame(rows["frame"], rows["block"], int(rows["capacity"].iloc[0]))
    else:
        capacity = int(per_block["capacity"].iloc[0])
        ends = per_block["first_frame"] + per_block["frames"]
        over = per_block[ends > capacity]
        evicting = None if over.empty else int(over["first_frame"].iloc[0])
    frame, distance = np.zeros(0, dtype=np.int64), np.zeros(0)
    if not rows.empty:
        frame, distance = rows["frame"].to_numpy(), rows["sink_distance"].to_numpy(dtype=float)
    first, phase = np.zeros(0, dtype=np.int64), np.zeros(0)
    if not per_block.empty:
        first = per_block["first_frame"].to_numpy()
        phase = per_block["phase_concentration"].to_numpy(dtype=float)
    if train_frames is not None:
        start = int(train_frames)
    elif frame.size:
        start = int(frame[np.argmax(distance > 0)])
    else:  # the block table alone: the first block whose lowest sink distance is above 0
        start = int(first[np.argmax(per_block["sink_distance"].to_numpy(dtype=float) > 0)])
    found = collapse_candidates(
        frame, distance, first, phase, start=start, phase_from=max(start, PHASE_FROM)
    )
    dips = tuple(int(f) for f in found["sink_distance"])
    peaks = tuple(int(f) for f in found["phase_concentration"])
    return RolloutMarks(evicting, dips, peaks, start)


def per_latent_frame(rows: pd.DataFrame, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(latent frames, the mean of `column` over each one's pixel frames) of one rollout's video
    metrics; NaN values are left out of a mean, a latent frame with none gives NaN."""
    means = rows.groupby("latent_frame")[column].mean().sort_index()
    return means.index.to_numpy(dtype=np.int64), means.to_numpy(dtype=float)


def pixel_collapse_frames(frames: np.ndarray, distance: np.ndarray, start: int) -> np.ndarray:
    """The latent frames from `start` on whose pixel sink distance (the mean over their pixel
    frames) is at most `DISTANCE_THRESHOLD`: frames that copy the sinks."""
    frames = np.asarray(frames)
    low = (np.asarray(distance, dtype=float) <= DISTANCE_THRESHOLD) & (frames >= start)
    return frames[low]  # NaN is never low


def _spans(frames: np.ndarray) -> list[tuple[float, float]]:
    """Runs of consecutive latent frames as (left, right) edges, frame f spanning f +- 0.5."""
    spans: list[tuple[float, float]] = []
    for frame in sorted(int(f) for f in frames):
        if spans and frame - 0.5 == spans[-1][1]:
            spans[-1] = (spans[-1][0], frame + 0.5)
        else:
            spans.append((frame - 0.5, frame + 0.5))
    return spans


def _run_name(table: pd.DataFrame) -> str:
    runs = sorted(
        {(str(c), str(p)) for c, p in zip(table["checkpoint"], table["prompt"], strict=True)}
    )
    if len(runs) != 1:
        raise ValueError(f"a video figure shows one run, got {[f'{c}/{p}' for c, p in runs]}")
    return f"{runs[0][0]} · {runs[0][1]}"


def _labels(table: pd.DataFrame) -> dict[str, str]:
    """The metrics' label of each rollout ('window B=9', 'full')."""
    first = table.drop_duplicates("rollout")
    return dict(zip(first["rollout"].astype(str), first["label"].astype(str), strict=True))


# --------------------------------------------------------------------------------------------
# the strip


def strip_frames(
    block_starts: Sequence[int],
    last: int,
    wanted: Sequence[int] = (),
    count: int = STRIP_COLUMNS,
) -> list[int]:
    """The latent frames the strip shows, ascending: the first (0) and the `last`, then the
    frames of `wanted` (first evictions, collapse candidates, in the order given) while there is
    room for them in `count`, then the block starts farthest from every frame chosen so far (the
    earlier one on ties) until `count` or no block start is left."""
    chosen = {0, int(last)}
    for frame in wanted:
        if len(chosen) >= count:
            break
        if 0 <= int(frame) <= last:
            chosen.add(int(frame))
    pool = sorted({int(s) for s in block_starts if 0 <= int(s) <= last} - chosen)
    while pool and len(chosen) < count:
        gaps = [min(abs(start - c) for c in chosen) for start in pool]
        pick = pool[int(np.argmax(gaps))]  # argmax: the first of the widest gaps
        chosen.add(pick)
        pool.remove(pick)
    return sorted(chosen)


def shown_pixel_frame(latent_frame: int) -> int:
    """The pixel frame a strip cell shows for a latent frame: the last it decodes to (for the
    last latent frame, the video's last frame)."""
    return video_frames_of_latent(int(latent_frame))[-1]


def _downsampled(frame: np.ndarray, width_in: float) -> np.ndarray:
    """`frame` averaged over k x k pixels, k the largest whole factor that keeps at least
    STRIP_DPI pixels per inch of a cell `width_in` wide: a figure of 64 frames at 832 x 480 would
    otherwise embed every pixel of each."""
    factor = max(1, int(frame.shape[1] // (width_in * STRIP_DPI)))
    if factor == 1:
        return frame
    height, width = frame.shape[0] // factor * factor, frame.shape[1] // factor * factor
    blocks = frame[:height, :width].reshape(height // factor, factor, width // factor, factor, 3)
    return np.rint(blocks.mean(axis=(1, 3))).astype(np.uint8)


def read_strip_frames(
    path: str | os.PathLike, pixel_frames: Sequence[int]
) -> dict[int, np.ndarray]:
    """The frames `pixel_frames` of a video (uint8 [H, W, 3] each), decoded in order and
    stopping after the last one wanted."""
    from sinkscope.videos import read_frames_at  # PyAV takes 0.4 s to import: only here

    return read_frames_at(path, pixel_frames)


def _mark_cell(ax: Axes, evicted: bool, dip: bool, peak: bool) -> None:
    """An evicted cell framed in EVICTED_COLOR; a dip and a phase maximum as markers in the top
    left corner (white-edged, to stand out on any frame)."""
    for spine in ax.spines.values():
        spine.set_visible(evicted)
        spine.set_edgecolor(EVICTED_COLOR)
        spine.set_linewidth(1.6)
    corner = 0.1
    for shown, marker, color, label in (
        (dip, "v", DIP_COLOR, "_dip"),
        (peak, "D", PEAK_COLOR, "_peak"),
    ):
        if shown:
            ax.plot(
                [corner],
                [0.86],
                marker=marker,
                color=color,
                markersize=4.5,
                linestyle="none",
                markeredgecolor="white",
                markeredgewidth=0.5,
                transform=ax.transAxes,
                label=label,
            )
            corner += 0.12


@styled
def plot_video_strip(
    table: pd.DataFrame,
    *,
    videos: Mapping[str, str | os.PathLike],
    deviation: pd.DataFrame | None = None,
    blocks: pd.DataFrame | None = None,
    train_frames: int | None = None,
    titles: bool = True,
) -> Figure:
    """A frame strip of one closed-loop run: one row per decoded rollout of the run's video
    metrics `table` (`read_video_metrics`; `full` first, the policies in the closed loop's order,
    `survey` last; each named by its `label`), read from `videos` (rollout -> its mp4), one
    column per latent frame of `strip_frames` (the first and the last, the first evictions and
    the collapse candidates while there is room, then block starts spread over the video), each
    cell the last pixel frame that latent frame decodes to. A cell from the rollout's first
    eviction on (`deviation`, the run's closed-loop frame tables: the first frame whose block saw
    a cache that had dropped keys) is framed in orange; a cell at one of the rollout's collapse
    candidates (`rollout_marks`, from the frame tables and the block table `blocks`, from the
    training length `train_frames` on) carries a red triangle (a latent sink-distance dip) or a
    purple diamond (a RoPE phase maximum). Without `titles` the run is not named (the caption
    names it)."""
    run = _run_name(table)
    rollouts = video_rollouts(table)
    missing = [rollout for rollout in rollouts if rollout not in videos]
    if missing:
        raise ValueError(f"{run}: no video of the rollouts {missing}")
    labels = _labels(table)
    marks = {r: rollout_marks(r, deviation, blocks, train_frames) for r in rollouts}
    last = int(table["latent_frame"].max())
    starts = table.groupby("block")["latent_frame"].min().to_numpy()
    evictions = sorted({m.evicting_from for m in marks.values() if m.evicting_from is not None})
    candidates = sorted({f for m in marks.values() for f in (*m.dips, *m.peaks)})
    columns = strip_frames(starts, last, [*evictions, *candidates])
    pixels = [shown_pixel_frame(frame) for frame in columns]
    seconds = table.drop_duplicates("pixel_frame").set_index("pixel_frame")["seconds"]
    height, width = _frame_shape(videos[rollouts[0]])
    cell_in = (FULL_WIDTH_IN - LABEL_WIDTH_IN) / len(columns)
    legend_in = 0.35
    fig = Figure(
        figsize=(FULL_WIDTH_IN, len(rollouts) * cell_in * height / width + 0.75 + legend_in),
        layout="constrained",
    )
    fig.get_layout_engine().set(w_pad=0.01, h_pad=0.01, wspace=0.02, hspace=0.02)
    axes = fig.subplots(len(rollouts), len(columns), squeeze=False)
    for row, rollout in zip(axes, rollouts, strict=True):
        shown = read_strip_frames(videos[rollout], pixels)
        mark = marks[rollout]
        for ax, frame, pixel in zip(row, columns, pixels, strict=True):
            ax.set_label(f"{rollout}:{frame}")  # what the cell shows, for the tests
            ax.set_xticks([])
            ax.set_yticks([])
            if pixel in shown:
                ax.imshow(_downsampled(shown[pixel], cell_in), interpolation="nearest")
            else:  # a shorter rollout (the survey's): no such frame
                ax.set_facecolor("0.92")
                ax.text(0.5, 0.5, "–", transform=ax.transAxes, ha="center", va="center")
            evicted = mark.evicting_from is not None and frame >= mark.evicting_from
            _mark_cell(ax, evicted, frame in mark.dips, frame in mark.peaks)
        row[0].set_ylabel(_row_label(labels[rollout]), rotation=0, ha="right", va="center")
    for ax, frame, pixel in zip(axes[0], columns, pixels, strict=True):
        when = f"\n{float(seconds[pixel]):.1f} s" if pixel in seconds.index else ""
        ax.set_title(f"f {frame}{when}", fontsize=6)
    handles: dict[str, object] = {}
    if any(m.evicting_from is not None and m.evicting_from <= last for m in marks.values()):
        handles["cache has dropped keys (from the rollout's first eviction on)"] = Patch(
            facecolor="none", edgecolor=EVICTED_COLOR, linewidth=1.6
        )
    drawn = {line.get_label() for ax in fig.axes for line in ax.lines}
    if "_dip" in drawn:
        handles[f"latent sink-distance dip ≤ {DISTANCE_THRESHOLD:g}"] = Line2D(
            [], [], marker="v", color=DIP_COLOR, linestyle="none", markersize=4.5
        )
    if "_peak" in drawn:
        handles["RoPE phase maximum"] = Line2D(
            [], [], marker="D", color=PEAK_COLOR, linestyle="none", markersize=4
        )
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=3)
    where = f"{run} · " if titles else ""
    fig.suptitle(
        f"{STRIP_TITLE}\n{where}each column a latent frame f: the last frame it decodes to, "
        "its time at 16 fps"
    )
    return fig


def _row_label(label: str) -> str:
    """A rollout's label beside its row: the policy on one line, its parameters under it
    ('participative\nB=12 S=3 R=3\ncapacity=21')."""
    policy, _, parameters = label.partition(" ")
    return "\n".join([policy, *textwrap.wrap(parameters, 13)])


def _frame_shape(path: str | os.PathLike) -> tuple[int, int]:
    """(height, width) of a video's frames."""
    from sinkscope.videos import read_video_info

    info = read_video_info(path)
    return info.height, info.width


# --------------------------------------------------------------------------------------------
# the diagnostics


DIAGNOSTIC_COLUMNS = 2  # policies side by side, from 4 of them on
GROUP_GAP = 0.22  # the empty row between two policies, in the height of one of their rows


def _share_steps(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The sink-head share of one rollout's blocks (mean over its captured layers and passes) as
    steps over the blocks' frames (frame f spanning f - 0.5 .. f + 0.5); empty without any."""
    captured = rows[rows["layer"].notna() & rows["sink_share"].notna()]
    if captured.empty:
        return np.zeros(0), np.zeros(0)
    mean = captured.groupby(["first_frame", "frames"], as_index=False)["sink_share"].mean()
    mean = mean.sort_values("first_frame")
    end = mean["first_frame"].iloc[-1] + mean["frames"].iloc[-1]
    x = np.append(mean["first_frame"].to_numpy(dtype=float), end) - 0.5
    y = mean["sink_share"].to_numpy(dtype=float)
    return x, np.append(y, y[-1])


def _diagnostics_panel(
    pixel_ax: Axes,
    model_ax: Axes,
    rows: pd.DataFrame,
    deviation: pd.DataFrame,
    blocks: pd.DataFrame,
    mark: RolloutMarks,
) -> None:
    """One policy's two rows: its pixel sink distance and SSIM to the full rollout per latent
    frame (upper), its latent sink distance per frame and sink-head share per block (lower); the
    marks across both."""
    frames, distance = per_latent_frame(rows, "sink_distance")
    pixel_ax.plot(frames, distance, label="pixel sink distance", **PIXEL_DISTANCE_STYLE)
    ssim_frames, ssim = per_latent_frame(rows, "ssim")
    if np.isfinite(ssim).any():
        pixel_ax.plot(ssim_frames, ssim, label=SSIM_LABEL, **SSIM_STYLE)
    if not deviation.empty:
        latent = deviation.sort_values("frame")
        model_ax.plot(
            latent["frame"].to_numpy(),
            latent["sink_distance"].to_numpy(dtype=float),
            label="latent sink distance",
            **LATENT_DISTANCE_STYLE,
        )
    x, share = _share_steps(blocks) if not blocks.empty else (np.zeros(0), np.zeros(0))
    if x.size:
        model_ax.plot(x, share, label=SHARE_LABEL, **SHARE_STYLE)
    else:
        note = {"ha": "right", "va": "top", "fontsize": 6, "color": "0.45"}
        model_ax.text(0.99, 0.95, "no attention captured", transform=model_ax.transAxes, **note)
    # From where the candidates may be; without the closed loop's tables, past the first block
    # (the video metrics' sink frames by default).
    start = mark.start
    if start is None:
        later = rows.loc[rows["block"] > 0, "latent_frame"]
        start = int(later.min()) if not later.empty else 0
    collapsed = pixel_collapse_frames(frames, distance, start)
    for ax in (pixel_ax, model_ax):
        for left, right in _spans(collapsed):
            ax.axvspan(
                left, right, color=COLLAPSED_COLOR, linewidth=0, zorder=0, label="_pixel collapse"
            )
        ax.axhline(DISTANCE_THRESHOLD, label="_threshold", zorder=1, **THRESHOLD_STYLE)
        if mark.evicting_from is not None:
            ax.axvline(mark.evicting_from, label="_first eviction", zorder=1, **EVICTION_STYLE)
        for frame in mark.dips:
            ax.axvline(frame, label="_dip candidate", zorder=1, **DIP_STYLE)
        for frame in mark.peaks:
            ax.axvline(frame, label="_phase candidate", zorder=1, **PEAK_STYLE)


@styled
def plot_video_diagnostics(
    table: pd.DataFrame,
    *,
    deviation: pd.DataFrame | None = None,
    blocks: pd.DataFrame | None = None,
    train_frames: int | None = None,
    titles: bool = True,
) -> Figure:
    """Where the attention predicts a collapse, and where the video shows one: one panel per
    policy rollout of the run's video metrics `table` (not `full`, not `survey`), two rows each
    against the latent frame. Upper (the video): the pixel sink distance (`sink_distance` of the
    metrics, the mean over each latent frame's pixel frames; 1 as far from the sink frames as
    usual, 0 a copy of them) and the SSIM to the full rollout's frames (likewise averaged).
    Lower (the model): the latent sink distance per frame (`deviation`, the run's closed-loop
    frame tables) and the sink-head share per block (`blocks`, the block table: the mean over the
    captured layers and passes). Across both rows: the first eviction (grey dashed), the
    attention's collapse candidates (`rollout_marks`: red dashed at a latent sink-distance dip,
    purple dash-dotted at a RoPE phase maximum), the training length `train_frames` (grey
    dotted), and shaded the latent frames from the candidates' start on whose pixel sink
    distance is at most `DISTANCE_THRESHOLD` (the video comes back to its sinks). Without
    `titles` the run is not named (the caption names it)."""
    run = _run_name(table)
    labels = _labels(table)
    policies = [r for r in video_rollouts(table) if r not in (FULL, SURVEY)]
    if not policies:
        fig = Figure(figsize=(FULL_WIDTH_IN, 1.2), layout="constrained")
        text = "No policy rollout decoded: nothing to compare with the attention"
        fig.text(0.5, 0.5, text, ha="center", va="center", color="0.35")
        fig.suptitle(DIAGNOSTICS_TITLE + (f"\n{run}" if titles else ""))
        return fig
    ncols = 1 if len(policies) < 4 else DIAGNOSTIC_COLUMNS
    groups = math.ceil(len(policies) / ncols)
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.85 * groups + 1.15), layout="constrained")
    # Two rows per policy and an empty one between policies, so that each pair reads as one.
    grid = fig.add_gridspec(3 * groups - 1, ncols, height_ratios=([1, 1, GROUP_GAP] * groups)[:-1])
    last = int(table["latent_frame"].max())
    marks = {p: rollout_marks(p, deviation, blocks, train_frames) for p in policies}
    # Every row on one scale, so that both sink distances read alike: 1 the median, 0 the sinks.
    tops: list = [np.array([1.2])]
    for policy in policies:
        tops.append(per_latent_frame(table[table["rollout"] == policy], "sink_distance")[1])
        tops.append(_of_rollout(deviation, policy).get("sink_distance", pd.Series(dtype=float)))
    top = 1.08 * float(np.nanmax(np.concatenate([np.ravel(t) for t in tops]).astype(float)))
    shared: Axes | None = None
    for index, policy in enumerate(policies):
        group, column = divmod(index, ncols)
        pixel_ax = fig.add_subplot(grid[3 * group, column], sharex=shared)
        shared = shared or pixel_ax
        model_ax = fig.add_subplot(grid[3 * group + 1, column], sharex=shared)
        rows = table[table["rollout"] == policy]
        latent, per_block = _of_rollout(deviation, policy), _of_rollout(blocks, policy)
        _diagnostics_panel(pixel_ax, model_ax, rows, latent, per_block, marks[policy])
        pixel_ax.set_title(labels[policy], loc="left")
        for ax in (pixel_ax, model_ax):
            if train_frames is not None:
                ax.axvline(train_frames, label="_training length", zorder=1, **TRAINING_STYLE)
            ax.set_xlim(-0.5, last + 0.5)
            ax.set_ylim(0, top)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(nbins=3))
            ax.grid(axis="y", color="0.92", linewidth=0.4)
            ax.set_axisbelow(True)
            ax.tick_params(labelleft=column == 0, labelbottom=False)
        if column == 0:
            pixel_ax.set_ylabel("Video\n(pixels)")
            model_ax.set_ylabel("Latents &\nattention")
        if index + ncols >= len(policies):  # no panel below: this one labels the x axis
            model_ax.tick_params(labelbottom=True)
            model_ax.set_xlabel("Latent frame")
    _diagnostics_legend(fig, train_frames)
    where = f"{run} · " if titles else ""
    fig.suptitle(
        f"{DIAGNOSTICS_TITLE}\n{where}pixel values: mean over each latent frame's decoded frames"
    )
    return fig


def _diagnostics_legend(fig: Figure, train_frames: int | None) -> None:
    """One legend under the panels, a column each for the video (its lines and collapse), the
    model (its lines and candidates) and the lines of reference, of what was drawn."""
    lines = legend_handles(fig.axes)
    drawn = {line.get_label() for ax in fig.axes for line in ax.lines}
    drawn |= {patch.get_label() for ax in fig.axes for patch in ax.patches}
    threshold = f"{DISTANCE_THRESHOLD:g}"
    video = {name: lines[name] for name in ("pixel sink distance", SSIM_LABEL) if name in lines}
    if "_pixel collapse" in drawn:
        video[f"video collapse: pixel sink distance ≤ {threshold}"] = Patch(
            facecolor=COLLAPSED_COLOR, linewidth=0
        )
    model = {name: lines[name] for name in ("latent sink distance", SHARE_LABEL) if name in lines}
    if "_dip candidate" in drawn:
        model[f"candidate: latent sink-distance dip ≤ {threshold}"] = Line2D([], [], **DIP_STYLE)
    if "_phase candidate" in drawn:
        model["candidate: RoPE phase maximum"] = Line2D([], [], **PEAK_STYLE)
    reference = {f"sink-distance threshold {threshold}": Line2D([], [], **THRESHOLD_STYLE)}
    if "_first eviction" in drawn:
        reference["first eviction"] = Line2D([], [], **EVICTION_STYLE)
    if train_frames is not None:
        reference[f"training length ({int(train_frames)} frames)"] = Line2D(
            [], [], **TRAINING_STYLE
        )
    # matplotlib fills a legend column by column: each group padded to one column's length
    groups = [video, model, reference]
    rows = max(len(group) for group in groups)
    handles, labels = [], []
    for group in groups:
        handles += [*group.values(), *[Line2D([], [], linestyle="none")] * (rows - len(group))]
        labels += [*group.keys(), *[""] * (rows - len(group))]
    fig.legend(handles, labels, loc="outside lower center", ncols=len(groups))


# --------------------------------------------------------------------------------------------
# the inputs of one run, checked before the first file is written


def video_run_inputs(
    where: str,
    run: tuple[str, str],
    metrics: pd.DataFrame,
    videos: Mapping[tuple[str, str, str], str | os.PathLike],
    deviation: pd.DataFrame,
    blocks: pd.DataFrame,
    *,
    need_videos: bool,
) -> dict[str, object]:
    """The data a video figure of `run` (checkpoint, prompt) draws, checked, naming `where` (the
    file) in every refusal: `table` (the run's rows of the video metrics `metrics`), `videos`
    (its rollouts' mp4s of `videos`, (checkpoint, prompt, rollout) -> path; when `need_videos`
    every rollout needs one, with as many frames as its metrics rows), `deviation` and `blocks`
    (the run's rows of the closed loop's frame tables and block table; every rollout but the
    survey's needs one closed-loop rollout of its policy there, as long as its video)."""
    checkpoint, prompt = run
    name = f"{checkpoint}/{prompt}"
    table = metrics[(metrics["checkpoint"] == checkpoint) & (metrics["prompt"] == prompt)]
    if table.empty:
        raise ValueError(f"{where}: no video metrics of the run {name}")
    rollouts = video_rollouts(table)
    mine = {r: path for (c, p, r), path in videos.items() if (c, p) == run}
    if need_videos:
        from sinkscope.videos import read_video_info

        for rollout in rollouts:
            if rollout not in mine:
                raise ValueError(
                    f"{where}: rollout {rollout} of {name} has no video "
                    f"({name}/{rollout}.mp4 is not among the videos given)"
                )
            frames = int((table["rollout"] == rollout).sum())
            info = read_video_info(mine[rollout])
            if info.frames != frames:
                raise ValueError(
                    f"{where}: {mine[rollout]} has {info.frames} frames, its video metrics "
                    f"{frames} rows"
                )
    data: dict[str, object] = {"table": table, "videos": mine}
    for key, closed, what in (
        ("deviation", deviation, "closed-loop frame table"),
        ("blocks", blocks, "block table"),
    ):
        closed = closed[(closed["checkpoint"] == checkpoint) & (closed["prompt"] == prompt)]
        for rollout in (r for r in rollouts if r != SURVEY):
            rows = closed[closed["policy"] == rollout]
            if rows.empty:
                raise ValueError(f"{where}: rollout {rollout} of {name} is not in the {what}")
            if len(rows[RUN_KEYS].drop_duplicates()) > 1:
                raise ValueError(f"{where}: the {what} holds several {rollout} rollouts of {name}")
            ends = rows["frame"] if key == "deviation" else rows["first_frame"] + rows["frames"] - 1
            latent = int(table.loc[table["rollout"] == rollout, "latent_frame"].max()) + 1
            if int(ends.max()) + 1 != latent:
                raise ValueError(
                    f"{where}: rollout {rollout} of {name} has {latent} latent frames in its "
                    f"video metrics, {int(ends.max()) + 1} in the {what}"
                )
        data[key] = closed
    return data
