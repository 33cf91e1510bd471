"""The video figures (`video` scope): one closed-loop run's decoded rollouts beside its
diagnostics. Synthetic rollouts (4 blocks of 3 latent frames: 45 pixel frames of 64 x 96)
written as the workflow writes them (mp4s, their metrics.csv, the closed loop's frame tables and
block table); the strip's rows, columns, frames and marks and the diagnostics' plotted numbers
read back from the figures; the registry's file names; `render_figures`' refusals."""

from __future__ import annotations

import inspect
from pathlib import Path

import matplotlib.colors as mcolors
import numpy as np
import pandas as pd
import pytest

from sinkscope.analysis import closed_loop, figures
from sinkscope.analysis.diagnostics import read_block_diagnostics
from sinkscope.analysis.plots import render_figures
from sinkscope.analysis.plots import video as video_plots
from sinkscope.analysis.plots.render import builder_of
from sinkscope.analysis.plots.video import (
    COLLAPSED_COLOR,
    EVICTED_COLOR,
    per_latent_frame,
    plot_video_diagnostics,
    plot_video_strip,
    rollout_marks,
    shown_pixel_frame,
    strip_frames,
)
from sinkscope.diagnostics import DISTANCE_THRESHOLD
from sinkscope.frames import video_frames_of_latent
from sinkscope.tables import BLOCK_DIAGNOSTIC_COLUMNS, FRAME_TABLE_COLUMNS
from sinkscope.video_metrics import (
    VIDEO_TABLE_COLUMNS,
    pixel_frame_count,
    read_video_metrics,
    video_metrics,
)
from sinkscope.videos import read_frames, read_frames_at, write_video

from .figurefixtures import svg_texts
from .workflowtools import REPO

RUN = ("demo", "cat")
BLOCKS = [3, 3, 3, 3]  # 12 latent frames, 45 pixel frames
HEIGHT, WIDTH = 64, 96
COPY_FROM = 9  # the window rollout shows its first frame from this latent frame on
# rollout -> (budget, sink_frames, capacity, label); the survey has no closed-loop table
ROLLOUTS = {
    "full": (12, 0, 12, "full"),
    "window": (6, 0, 6, "window B=6"),
    "sink_window": (6, 3, 6, "sink_window B=6 S=3"),
    "survey": (None, None, None, "survey"),
}
SURVEY_BLOCKS = [3, 3, 3]  # the survey's rollout is shorter: 9 latent frames
EVICTING_FROM = 6  # blocks end at 3, 6, 9, 12: the third ends past the cache of 6
WINDOW_DIP = 10  # the window's latent sink distance dips to its bottom here


def synthetic_frames(rollout: str, latent_frames: int) -> np.ndarray:
    """uint8 [T, H, W, 3]: a background brightening by 4 levels a frame (each frame its own) and
    a square moving across it, its colour the rollout's; the window's frames copy frame 0 from
    latent frame COPY_FROM on (a collapse back to its sinks)."""
    count = pixel_frame_count(latent_frames)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    colour = {"full": (230, 60, 60), "window": (60, 200, 60), "sink_window": (60, 90, 230)}
    frames = []
    for t in range(count):
        frame = np.stack([20 + x // 2 + 4 * t, 30 + y + 4 * t, np.full_like(x, 40 + 4 * t)], -1)
        left = (2 * t) % (WIDTH - 16)
        frame[20:36, left : left + 16] = colour.get(rollout, (240, 240, 240))
        frames.append(frame.clip(0, 255).astype(np.uint8))
    frames = np.stack(frames)
    if rollout == "window":
        frames[video_frames_of_latent(COPY_FROM)[0] :] = frames[0]
    return frames


def frame_table(rollout: str) -> pd.DataFrame:
    """The rollout's closed-loop frame table: latent sink distance 0 on the sinks (latent 0-2),
    1 after, the window's dipping at 9-10 (bottom WINDOW_DIP)."""
    budget, sink, capacity, _ = ROLLOUTS[rollout]
    frames = np.arange(sum(BLOCKS))
    distance = np.where(frames < 3, 0.0, 1.0)
    if rollout == "window":
        distance[[9, 10]] = [0.45, 0.3]
    key = (*RUN, rollout, budget, sink, 0, capacity, 0.0, 1.0)
    rows = [
        (*key, f, f // 3, np.nan if rollout == "full" else 0.1, np.nan, d)
        for f, d in zip(frames, distance, strict=True)
    ]
    return pd.DataFrame(rows, columns=FRAME_TABLE_COLUMNS)


def block_table(phase_peak: bool = False) -> pd.DataFrame:
    """blocks.csv of the closed-loop rollouts: two captured layers and one pass each, sink-head
    shares that grow with the block; a flat phase concentration, with `phase_peak` a maximum on
    the window's block at frame 6."""
    rows = []
    for rollout in ("full", "window", "sink_window"):
        budget, sink, capacity, _ = ROLLOUTS[rollout]
        key = (*RUN, rollout, budget, sink, 0, capacity, 0.0, 1.0)
        for block in range(len(BLOCKS)):
            first = 3 * block
            low = 0.0 if block == 0 else (0.3 if rollout == "window" and block == 3 else 1.0)
            phase = 0.9 if phase_peak and rollout == "window" and block == 2 else 0.2
            for layer in (0, 1):
                share = (block + layer) / 5
                common = (*key, block, first, 3, 0, low, phase)
                rows.append((*common, layer, 0, 1000.0, "denoise", share))
    table = pd.DataFrame(rows, columns=BLOCK_DIAGNOSTIC_COLUMNS)
    for column in ("layer", "step"):
        table[column] = table[column].astype("Int64")
    return table


def write_run(folder: Path, phase_peak: bool = False) -> dict[str, object]:
    """The run's inputs where the workflow puts them: results/videos/demo/cat/{rollout}.mp4 and
    metrics.csv, results/closed_loop/demo/cat/{policy}.csv and blocks.csv."""
    videos_folder = folder / "videos" / RUN[0] / RUN[1]
    loop_folder = folder / "closed_loop" / RUN[0] / RUN[1]
    videos_folder.mkdir(parents=True)
    loop_folder.mkdir(parents=True)
    full = synthetic_frames("full", sum(BLOCKS))
    tables, videos, deviation = [], [], []
    for rollout, (*_, label) in ROLLOUTS.items():
        sizes = SURVEY_BLOCKS if rollout == "survey" else BLOCKS
        frames = synthetic_frames(rollout, sum(sizes))
        reference = None if rollout in ("full", "survey") else full
        table = video_metrics(frames, sizes, reference=reference, rollout=rollout)
        table.insert(0, "prompt", RUN[1])
        table.insert(0, "checkpoint", RUN[0])
        table.insert(3, "label", label)
        tables.append(table[VIDEO_TABLE_COLUMNS])
        videos.append(write_video(videos_folder / f"{rollout}.mp4", frames, crf=10))
        if rollout != "survey":
            deviation.append(loop_folder / f"{rollout}.csv")
            frame_table(rollout).to_csv(deviation[-1], index=False)
    metrics = videos_folder / "metrics.csv"
    pd.concat(tables).to_csv(metrics, index=False)
    blocks = folder / "closed_loop" / "blocks.csv"
    block_table(phase_peak).to_csv(blocks, index=False)
    return {
        "video_tables": [metrics],
        "videos": videos,
        "deviation_tables": deviation,
        "closed_loop_blocks": blocks,
    }


def read_run(inputs: dict[str, object]) -> dict[str, object]:
    """What `render_figures` hands a video builder of the run."""
    return {
        "table": read_video_metrics(inputs["video_tables"]),
        "videos": {Path(path).stem: path for path in inputs["videos"]},
        "deviation": closed_loop.read_deviation(inputs["deviation_tables"]),
        "blocks": read_block_diagnostics(inputs["closed_loop_blocks"]),
    }


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory) -> dict[str, object]:
    return write_run(tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def peaked_inputs(tmp_path_factory) -> dict[str, object]:
    return write_run(tmp_path_factory.mktemp("results"), phase_peak=True)


# --------------------------------------------------------------------------------------------
# the registry


def test_video_file_names_round_trip():
    files = figures.video_figures("results/figures/{checkpoint}/{prompt}", "svg")
    assert [f.path for f in files] == [
        "results/figures/{checkpoint}/{prompt}/video_strip.svg",
        "results/figures/{checkpoint}/{prompt}/video_diagnostics.svg",
    ]
    assert [f.kind.caption for f in files] == ["video_strip.rst", "video_diagnostics.rst"]
    for f in figures.video_figures("results/figures/demo/cat", "png"):
        assert figures.parse_figure_path(f.path) == (f.kind, None, "png")
        assert f.kind.scope == "video" and f.kind.family == "video" and f.layers == ()
        assert f.labels == {"figure": f.kind.stem.replace("_", " "), "layer": "all"}
        assert (REPO / "report" / f.kind.caption).is_file()
        assert next(iter(inspect.signature(builder_of(f.kind)).parameters)) == "table"
    others = [
        *figures.run_figures("o", [0, 1], [0], "svg"),
        *figures.compare_figures("o", [0], [0], "svg"),
        *figures.survey_figures("o", [0, 1], "svg"),
        *figures.policy_figures("o", [0, 1], "svg"),
        *figures.closed_loop_figures("o", "svg"),
    ]
    assert not [f for f in others if f.kind.scope == "video" or f.kind.stem.startswith("video_")]
    with pytest.raises(ValueError, match="whole model"):
        figures.FigureKind("x", "video.plot_x", "x.rst", "video", "captured")
    with pytest.raises(ValueError, match="video_"):
        figures.FigureKind("video_x", "video.plot_x", "x.rst", "video", "model")
    with pytest.raises(ValueError, match="fmt"):
        figures.video_figures("o", "jpg")


# --------------------------------------------------------------------------------------------
# the marks


def test_strip_frames_keep_the_ends_the_wanted_and_spread_the_rest():
    assert strip_frames([0, 3, 6, 9], 11, [6, 10]) == [0, 3, 6, 9, 10, 11]
    starts = list(range(0, 120, 3))
    chosen = strip_frames(starts, 119, [60])
    assert len(chosen) == 8 and {0, 60, 119} <= set(chosen)
    assert set(chosen) - {119} <= set(starts)
    gaps = np.diff(chosen)
    assert gaps.max() <= 2 * gaps.min() + 3, chosen  # spread, not bunched
    # more wanted frames than room: the first of them, in the order given
    assert strip_frames(starts, 119, list(range(3, 60, 3)), count=4) == [0, 3, 6, 119]
    assert [shown_pixel_frame(f) for f in (0, 1, 11)] == [0, 4, 44]


def test_rollout_marks_follow_the_closed_loop_rules():
    deviation = pd.concat([frame_table(r) for r in ("full", "window")])
    blocks = block_table()
    window = rollout_marks("window", deviation, blocks)
    assert (window.evicting_from, window.dips, window.peaks, window.start) == (6, (10,), (), 3)
    full = rollout_marks("full", deviation, blocks)
    assert (full.evicting_from, full.dips) == (None, ())
    assert rollout_marks("window", deviation, blocks, train_frames=11).dips == ()
    # the block table alone: the eviction from its blocks, no latent dips
    alone = rollout_marks("window", None, blocks)
    assert (alone.evicting_from, alone.dips, alone.start) == (6, (), 3)
    assert rollout_marks("survey", deviation, blocks) == video_plots.RolloutMarks(
        None, (), (), None
    )


# --------------------------------------------------------------------------------------------
# the strip


def strip_cells(fig) -> dict[tuple[str, int], object]:
    """(rollout, latent frame) -> the cell's axes (each labelled 'rollout:frame')."""
    cells = {}
    for ax in fig.axes:
        rollout, _, frame = ax.get_label().partition(":")
        cells[rollout, int(frame)] = ax
    return cells


def test_strip_rows_columns_frames_and_marks(peaked_inputs, monkeypatch):
    # The phase rule starts at frame 120; lowered, the window's block at frame 6 is a maximum.
    monkeypatch.setattr(video_plots, "PHASE_FROM", 0)
    data = read_run(peaked_inputs)
    fig = plot_video_strip(**data)
    rows = sorted({ax.get_subplotspec().rowspan.start for ax in fig.axes})
    labels = [
        next(
            ax.get_ylabel().replace("\n", " ")
            for ax in fig.axes
            if ax.get_subplotspec().rowspan.start == row and ax.get_subplotspec().colspan.start == 0
        )
        for row in rows
    ]
    assert labels == ["full", "window B=6", "sink_window B=6 S=3", "survey"]
    columns = [0, 3, 6, 9, 10, 11]  # the ends, the eviction, the window's dip, block starts
    cells = strip_cells(fig)
    assert sorted(cells) == sorted((r, f) for r in ROLLOUTS for f in columns)
    titles = [cells["full", f].get_title() for f in columns]
    assert titles == [f"f {f}\n{shown_pixel_frame(f) / 16:.1f} s" for f in columns]
    for rollout in ROLLOUTS:
        decoded = list(read_frames(data["videos"][rollout]))
        # what the strip reads: those frames alone, the same bytes as a full decode gives
        picked = read_frames_at(data["videos"][rollout], [5, 0, len(decoded) - 1])
        assert sorted(picked) == [0, 5, len(decoded) - 1]
        assert all(np.array_equal(picked[i], decoded[i]) for i in picked)
        written = synthetic_frames(rollout, len(decoded) // 4 + 1)
        for frame in columns:
            ax = cells[rollout, frame]
            evicted = rollout in ("window", "sink_window") and frame >= EVICTING_FROM
            assert ax.spines["top"].get_visible() == evicted, (rollout, frame)
            if evicted:
                assert mcolors.same_color(ax.spines["left"].get_edgecolor(), EVICTED_COLOR)
            markers = {line.get_label() for line in ax.lines}
            assert ("_dip" in markers) == (rollout == "window" and frame == WINDOW_DIP)
            assert ("_peak" in markers) == (rollout == "window" and frame == 6)
            pixel = shown_pixel_frame(frame)
            if pixel >= len(decoded):  # the survey is shorter: an empty cell
                assert not ax.images and rollout == "survey"
                continue
            (image,) = ax.images
            np.testing.assert_array_equal(image.get_array(), decoded[pixel])
            # and that frame is the one written there (the videos are 2x the frames' size)
            shown = np.asarray(image.get_array())[::2, ::2].astype(int)
            errors = [np.abs(shown - w.astype(int)).mean() for w in written]
            if rollout == "window" and frame >= COPY_FROM:
                assert errors[0] < 2.5  # a copy of the first frame
            else:
                assert int(np.argmin(errors)) == pixel
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert legend == [
        "cache has dropped keys (from the rollout's first eviction on)",
        f"latent sink-distance dip ≤ {DISTANCE_THRESHOLD:g}",
        "RoPE phase maximum",
    ]
    assert "demo · cat" in fig.get_suptitle()
    assert "demo" not in plot_video_strip(**data, titles=False).get_suptitle()


def test_strip_refuses_a_rollout_without_video(run_inputs):
    data = read_run(run_inputs)
    data["videos"] = {r: p for r, p in data["videos"].items() if r != "sink_window"}
    with pytest.raises(ValueError, match=r"demo · cat: no video of the rollouts \['sink_window'\]"):
        plot_video_strip(**data)


# --------------------------------------------------------------------------------------------
# the diagnostics

LONG = 150  # latent frames of the diagnostics' rollouts (blocks of 3): past PHASE_FROM = 120
TRAIN = 21


def long_run() -> dict[str, pd.DataFrame]:
    """A run of LONG latent frames, as tables only: window and sink_window (B = capacity = 21:
    evicting from frame 21) and full. Latent sink distance 0 on the sinks, 1 after, the window's
    dipping at 130-132 (bottom 131); the window's phase concentration peaks on the blocks at 126
    and 138; its pixel sink distance falls to 0.3 (0.2 and 0.4 alternating over the pixel frames)
    on latent frames 135-140, and to 0.45 on frame 10 (before the training length: no collapse
    there)."""
    rng = np.random.default_rng(0)
    metrics, deviation, blocks = [], [], []
    for rollout, budget, sink, capacity, label in (
        ("full", LONG, 0, LONG, "full"),
        ("window", 21, 0, 21, "window B=21"),
        ("sink_window", 21, 3, 21, "sink_window B=21 S=3"),
    ):
        key = (*RUN, rollout, budget, sink, 0, capacity, 0.0, 1.0)
        pixels = pixel_frame_count(LONG)
        latent = np.array([0] + [f for f in range(1, LONG) for _ in range(4)])
        distance = np.where(latent < 3, 0.0, rng.uniform(0.8, 1.3, pixels))
        if rollout == "window":
            collapse = (latent >= 135) & (latent <= 140)
            distance[collapse] = np.where(np.arange(pixels)[collapse] % 2, 0.2, 0.4)
            distance[latent == 10] = 0.45
        ssim = np.nan if rollout == "full" else rng.uniform(0.2, 1.0, pixels)
        metrics.append(
            pd.DataFrame(
                {
                    "checkpoint": RUN[0],
                    "prompt": RUN[1],
                    "rollout": rollout,
                    "label": label,
                    "pixel_frame": np.arange(pixels),
                    "latent_frame": latent,
                    "block": latent // 3,
                    "seconds": np.arange(pixels) / 16,
                    "sink_distance": distance,
                    "ssim": ssim,
                }
            ).reindex(columns=VIDEO_TABLE_COLUMNS)
        )
        frames = np.arange(LONG)
        latent_distance = np.where(frames < 3, 0.0, 1.0)
        if rollout == "window":
            latent_distance[[130, 131, 132]] = [0.45, 0.3, 0.4]
        deviation.append(
            pd.DataFrame(
                [
                    (*key, f, f // 3, 0.1, 0.9, d)
                    for f, d in zip(frames, latent_distance, strict=True)
                ],
                columns=FRAME_TABLE_COLUMNS,
            )
        )
        for block in range(LONG // 3):
            first = 3 * block
            phase = {126: 0.8, 138: 0.7}.get(first, 0.2) if rollout == "window" else 0.2
            common = (*key, block, first, 3, 0, float(latent_distance[first : first + 3].min()))
            for layer in (0, 1):
                for step in (0, 1):
                    share = float(rng.integers(0, 5) / 4)
                    blocks.append((*common, phase, layer, step, 1000.0, "denoise", share))
    return {
        "table": pd.concat(metrics, ignore_index=True),
        "deviation": pd.concat(deviation, ignore_index=True),
        "blocks": pd.DataFrame(blocks, columns=BLOCK_DIAGNOSTIC_COLUMNS),
    }


def lines_of(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.lines}


def verticals(ax, label: str) -> list[float]:
    return sorted(float(ln.get_xdata()[0]) for ln in ax.lines if ln.get_label() == label)


def test_diagnostics_draw_the_tables_and_mark_where_they_agree():
    data = long_run()
    fig = plot_video_diagnostics(**data, train_frames=TRAIN)
    titled = [ax for ax in fig.axes if ax.get_title(loc="left")]
    assert [ax.get_title(loc="left") for ax in titled] == ["window B=21", "sink_window B=21 S=3"]
    assert len(fig.axes) == 4  # two rows per policy, none for full
    table, deviation, blocks = data["table"], data["deviation"], data["blocks"]
    for pixel_ax in titled:
        policy = pixel_ax.get_title(loc="left").split()[0]
        spec = pixel_ax.get_subplotspec()
        (model_ax,) = [
            ax
            for ax in fig.axes
            if ax.get_subplotspec().rowspan.start == spec.rowspan.start + 1
            and ax.get_subplotspec().colspan.start == spec.colspan.start
        ]
        rows = table[table["rollout"] == policy]
        pixel = lines_of(pixel_ax)
        means = rows.groupby("latent_frame")["sink_distance"].mean()
        np.testing.assert_array_equal(pixel["pixel sink distance"].get_xdata(), np.arange(LONG))
        np.testing.assert_allclose(pixel["pixel sink distance"].get_ydata(), means.to_numpy())
        ssim = rows.groupby("latent_frame")["ssim"].mean().to_numpy()
        np.testing.assert_allclose(pixel["SSIM to the full rollout"].get_ydata(), ssim)
        model = lines_of(model_ax)
        latent = deviation[deviation["policy"] == policy].sort_values("frame")
        np.testing.assert_array_equal(
            model["latent sink distance"].get_ydata(), latent["sink_distance"]
        )
        shares = blocks[blocks["policy"] == policy].groupby("first_frame")["sink_share"].mean()
        share = model["sink-head share (mean over layers, passes)"]
        np.testing.assert_allclose(share.get_ydata()[:-1], shares.to_numpy())
        np.testing.assert_array_equal(share.get_xdata(), np.arange(0, LONG + 1, 3) - 0.5)
        dips, peaks = ([131.0], [126.0, 138.0]) if policy == "window" else ([], [])
        for ax in (pixel_ax, model_ax):
            assert verticals(ax, "_first eviction") == [21.0]
            assert verticals(ax, "_training length") == [float(TRAIN)]
            assert verticals(ax, "_dip candidate") == dips
            assert verticals(ax, "_phase candidate") == peaks
            spans = [p for p in ax.patches if p.get_label() == "_pixel collapse"]
            # from the training length on, the latent frames whose pixel mean is <= 0.5
            expected = [(134.5, 140.5)] if policy == "window" else []
            assert [(p.get_x(), p.get_x() + p.get_width()) for p in spans] == expected
            assert all(mcolors.same_color(p.get_facecolor(), COLLAPSED_COLOR) for p in spans)
    # a column each: the video, the model, the lines of reference (padded with blank entries)
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert legend == [
        "pixel sink distance",
        "SSIM to the full rollout",
        f"video collapse: pixel sink distance ≤ {DISTANCE_THRESHOLD:g}",
        "",
        "latent sink distance",
        "sink-head share (mean over layers, passes)",
        f"candidate: latent sink-distance dip ≤ {DISTANCE_THRESHOLD:g}",
        "candidate: RoPE phase maximum",
        f"sink-distance threshold {DISTANCE_THRESHOLD:g}",
        "first eviction",
        f"training length ({TRAIN} frames)",
        "",
    ]
    assert "demo · cat" in fig.get_suptitle()
    assert "demo" not in plot_video_diagnostics(**data, titles=False).get_suptitle()


def test_per_latent_frame_means_over_the_decoded_frames():
    rows = pd.DataFrame(
        {"latent_frame": [0, 1, 1, 1, 1, 2], "flicker": [np.nan, 1, 2, 3, np.nan, 4]}
    )
    frames, means = per_latent_frame(rows, "flicker")
    assert frames.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(means, [np.nan, 2.0, 4.0])


def test_diagnostics_of_many_policies_and_of_none():
    data = long_run()
    table = data["table"]
    many = [table]
    for extra in ("deep_sink", "participative", "top_c"):
        rows = table[table["rollout"] == "window"].assign(rollout=extra, label=f"{extra} B=21")
        many.append(rows)
    fig = plot_video_diagnostics(pd.concat(many), titles=False)  # no closed-loop tables: no marks
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]
    assert titles == [
        "window B=21",
        "sink_window B=21 S=3",
        "deep_sink B=21",
        "participative B=21",
        "top_c B=21",
    ]
    assert len(fig.axes) == 10  # five policies in two columns: the empty cell removed
    assert not any(ln.get_label() == "_first eviction" for ax in fig.axes for ln in ax.lines)
    # without the closed loop's tables the video collapse is looked for past the first block:
    # not on the sinks (latent 0-2, pixel sink distance 0), on frame 10 (0.45) and 135-140
    (window,) = [ax for ax in fig.axes if ax.get_title(loc="left") == "window B=21"]
    spans = [(p.get_x(), p.get_x() + p.get_width()) for p in window.patches]
    assert spans == [(9.5, 10.5), (134.5, 140.5)]
    only_full = plot_video_diagnostics(table[table["rollout"] == "full"])
    assert "No policy rollout decoded" in only_full.texts[0].get_text()


# --------------------------------------------------------------------------------------------
# files


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_render_video_figures(run_inputs, tmp_path, fmt):
    folder = tmp_path / "figures" / RUN[0] / RUN[1]
    outputs = [f.path for f in figures.video_figures(str(folder), fmt)]
    written = render_figures([], outputs, heads=[], titles=False, **run_inputs)
    assert [str(path) for path in written] == outputs
    assert all(path.stat().st_size > 1000 for path in written)
    if fmt == "png":
        assert all(path.read_bytes().startswith(b"\x89PNG") for path in written)
        return
    strip = svg_texts(folder / "video_strip.svg")
    assert {"full", "survey", "f 0", "f 11"} <= {t.split("\n")[0] for t in strip}
    assert not any("demo" in text for text in strip)  # titles off: the caption names the run
    diagnostics = svg_texts(folder / "video_diagnostics.svg")
    assert {"window B=6", "sink_window B=6 S=3", "first eviction"} <= set(diagnostics)


def test_bad_video_renders_fail_before_writing(run_inputs, tmp_path):
    out = tmp_path / "figures" / RUN[0] / RUN[1]
    outputs = [f.path for f in figures.video_figures(str(out), "svg")]
    videos = run_inputs["videos"]
    short = tmp_path / "short" / RUN[0] / RUN[1] / "window.mp4"
    write_video(short, synthetic_frames("window", 3))
    broken_blocks = tmp_path / "blocks.csv"
    table = read_block_diagnostics(run_inputs["closed_loop_blocks"])
    table[table["policy"] != "sink_window"].to_csv(broken_blocks, index=False)
    requests = [
        ({"video_tables": []}, outputs, "video metrics tables"),
        ({"deviation_tables": []}, outputs, "closed-loop frame tables"),
        ({"closed_loop_blocks": None}, outputs, "block table"),
        (
            {},
            [str(tmp_path / "figures" / "demo" / "dog" / "video_strip.svg")],
            r"dog/video_strip\.svg: no video metrics of the run demo/dog",
        ),
        (
            {"videos": [v for v in videos if Path(v).stem != "window"]},
            outputs,
            r"video_strip\.svg: rollout window of demo/cat has no video",
        ),
        (
            {"videos": [v for v in videos if Path(v).stem != "window"] + [short]},
            outputs,
            r"window\.mp4 has 9 frames, its video metrics 45",
        ),
        ({"videos": [*videos, short]}, outputs, r"a second video of demo/cat window"),
        (
            {"deviation_tables": run_inputs["deviation_tables"][:2]},
            outputs,
            "rollout sink_window of demo/cat is not in the closed-loop frame table",
        ),
        (
            {"closed_loop_blocks": broken_blocks},
            outputs,
            "rollout sink_window of demo/cat is not in the block table",
        ),
    ]
    for options, files, message in requests:
        with pytest.raises(ValueError, match=message):
            render_figures([], files, heads=[], **(run_inputs | options))
    assert not (tmp_path / "figures").exists(), "a failed request must not leave figures behind"
    # the diagnostics need no video
    (diagnostics,) = [path for path in outputs if "diagnostics" in path]
    no_videos = run_inputs | {"videos": []}
    assert render_figures([], [diagnostics], heads=[], **no_videos) == [Path(diagnostics)]
