"""The closed-loop summary and figures (Contract 6 deviation tables beside Contract 5 recall
tables): every summary column against plain loops over synthetic tables, the refusals, the file
names, and the plotted numbers read back from the figures."""

from __future__ import annotations

import inspect
import math
import runpy
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from sinkscope.analysis import closed_loop, diagnostics, figures, policies
from sinkscope.analysis.plots import render_figures
from sinkscope.analysis.plots.closed_loop import (
    plot_closed_loop_collapse,
    plot_closed_loop_deviation,
    plot_closed_loop_deviation_runs,
    plot_closed_loop_recall,
)
from sinkscope.analysis.plots.render import builder_of
from sinkscope.analysis.switches import read_switch_table, write_switch_table
from sinkscope.diagnostics import phase_concentration
from sinkscope.tables import BLOCK_DIAGNOSTIC_COLUMNS, BLOCK_POSITION_COLUMNS, FRAME_TABLE_COLUMNS

from .figurefixtures import svg_texts
from .workflowtools import REPO, Named

FRAMES = 12  # latent frames of a closed-loop rollout
BLOCK = 2  # latent frames per block
TRAIN_FRAMES = 6  # the training length: frames 6..11 lie beyond it
RUNS = [("demo", "cat"), ("demo", "sea")]
# (policy, budget, sink_frames, recent_frames, capacity) of the closed loop
LOOP_POLICIES = [
    ("window", 4, 0, 0, 4),
    ("sink_window", 4, 1, 0, 4),
    ("sink_window", 6, 0, 0, 6),  # S = 0: the offline window's recall
    ("deep_sink", 4, 1, 0, 4),  # the offline sink_window's recall
    ("participative", 4, 1, 1, 6),  # drops keys from the block that overflows 6 frames on
    ("deep_forcing", 4, 1, 1, 6),  # the offline participative's recall
    ("top_c", 4, 0, 1, 4),  # no offline top_c rows in the run `sea`
    ("window", 5, 0, 0, 5),  # a budget the recall table lacks
    ("window", 12, 0, 0, 12),  # covers the whole rollout: never evicts
]
# the offline recall tables: 4 query blocks of 2 frames (the last sees 8), these budgets
OFFLINE_BLOCKS = 4
OFFLINE_BUDGETS = [2, 4, 6]
OFFLINE_SINKS = [0, 1]
RECENT = 1
CAPACITY = 6


def deviation_table(
    checkpoint, prompt, policy, budget, sink, recent, capacity, seed
) -> pd.DataFrame:
    """A frame table as the closed-loop job writes it: zeros while the cache holds every
    frame, then random deviations spanning about two decades; jitter 0 and bias 1 (the policies
    have neither), a random sink_distance."""
    rng = np.random.default_rng(seed)
    rows = []
    for frame in range(FRAMES):
        block = frame // BLOCK
        full = (block + 1) * BLOCK <= capacity  # every frame its block sees is kept
        rel_l2 = 0.0 if full else float(10 ** rng.uniform(-3, -1))
        cosine = 1.0 if full else float(rng.uniform(0.9, 1.0))
        key = (checkpoint, prompt, policy, budget, sink, recent, capacity, 0.0, 1.0)
        rows.append((*key, frame, block, rel_l2, cosine, float(rng.uniform(0.3, 1.5))))
    return pd.DataFrame(rows, columns=FRAME_TABLE_COLUMNS)


def recall_table(checkpoint, prompt, *, top_c: bool, seed: int) -> pd.DataFrame:
    """A recall table (Contract 5 columns) with random recalls; sink_window S = 0 rows differ
    from the window rows, so that a summary reading the wrong ones is caught."""
    rng = np.random.default_rng(seed)
    rows = []
    for layer in range(2):
        for head in range(2):
            for step, (timestep, kind) in enumerate([(1000.0, "denoise"), (0.0, "cache")]):
                for block in range(OFFLINE_BLOCKS):
                    visible = BLOCK * (block + 1)
                    common = (checkpoint, prompt, layer, head, step, timestep, kind, block, visible)
                    choices = [("window", b, 0, pd.NA, pd.NA) for b in OFFLINE_BUDGETS]
                    choices += [
                        ("sink_window", b, s, pd.NA, pd.NA)
                        for b in OFFLINE_BUDGETS
                        for s in OFFLINE_SINKS
                        if s < b
                    ]
                    choices += [
                        ("participative", b, s, RECENT, CAPACITY)
                        for b in OFFLINE_BUDGETS
                        for s in OFFLINE_SINKS
                        if s + RECENT + BLOCK <= b
                    ]
                    if top_c and block > 0:
                        choices += [
                            (policy, b, pd.NA, RECENT, pd.NA)
                            for policy in ("top_c", "top_c_oracle")
                            for b in OFFLINE_BUDGETS
                            if b >= BLOCK + RECENT
                        ]
                    for policy, budget, sink, recent, capacity in choices:
                        recall = 1.0 if budget >= visible else float(rng.uniform())
                        rows.append((*common, policy, budget, sink, recent, capacity, recall))
    table = pd.DataFrame(rows, columns=policies.COLUMNS)
    for column in policies.OPTIONAL_COLUMNS:
        table[column] = table[column].astype("Int64")
    return table


def write_inputs(folder: Path) -> tuple[list[Path], list[Path]]:
    """Deviation and recall tables of RUNS, written where the workflow puts them."""
    deviation, recall = [], []
    for r, (checkpoint, prompt) in enumerate(RUNS):
        for p, key in enumerate(LOOP_POLICIES):
            table = deviation_table(checkpoint, prompt, *key, 10 * r + p)
            policy, budget, sink = key[:3]
            path = folder / "closed_loop" / checkpoint / prompt / f"{policy}_{budget}_{sink}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            table.to_csv(path, index=False)
            deviation.append(path)
        path = folder / "policies" / checkpoint / f"{prompt}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        recall_table(checkpoint, prompt, top_c=prompt == "cat", seed=100 + r).to_csv(
            path, index=False
        )
        recall.append(path)
    return deviation, recall


def write_block_positions(frame_paths: list[Path]) -> list[Path]:
    """`{rollout}.blocks.csv` beside each frame table: blocks of BLOCK frames at absolute RoPE
    positions, the first sink frame at 0 (at BLOCK for the deep sinks from the third block on)."""
    paths = []
    for path in frame_paths:
        frames = pd.read_csv(path)
        blocks = frames.groupby([*closed_loop.RUN_KEYS, "block"], as_index=False)["frame"].agg(
            first_frame="min", frames="size"
        )
        blocks["query_position"] = blocks["first_frame"]
        turned = (blocks["policy"] == "deep_sink") & (blocks["block"] >= 2)
        blocks["sink_position"] = np.where(turned, BLOCK, 0)
        blocks["segment"] = 0
        out = path.with_name(path.stem + ".blocks.csv")
        blocks[BLOCK_POSITION_COLUMNS].to_csv(out, index=False)
        paths.append(out)
    return paths


def write_block_table(folder: Path, frame_paths: list[Path], seed: int = 0) -> Path:
    """results/closed_loop/blocks.csv of the frame tables: no stores (NaN shares), then random
    sink-head shares of layers 2 and 0 over two passes for every rollout but top_c."""
    out = folder / "blocks.csv"
    table = diagnostics.write_closed_loop_diagnostics(
        frame_paths, write_block_positions(frame_paths), [], out, sink_frames=1
    )
    rng = np.random.default_rng(seed)
    rows = []
    for row in table[table["policy"] != "top_c"].to_dict("records"):
        for layer in (2, 0):
            for step, (timestep, kind) in enumerate([(1000.0, "denoise"), (0.0, "cache")]):
                rows.append(row | {"layer": layer, "step": step, "timestep": timestep})
                rows[-1] |= {"pass_kind": kind, "sink_share": float(rng.integers(0, 5) / 4)}
    captured = pd.DataFrame(rows, columns=BLOCK_DIAGNOSTIC_COLUMNS)
    table = pd.concat([captured, table[table["policy"] == "top_c"]], ignore_index=True)
    table.to_csv(out, index=False)
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def offline_recalls(
    recall, checkpoint, prompt, offline, budget, sink, recent, capacity
) -> list[float]:
    """The recalls of the offline rows of one policy where it drops keys, by a plain loop."""
    recalls = []
    for row in recall.itertuples(index=False):
        if (row.checkpoint, row.prompt, row.policy, row.budget) != (
            checkpoint,
            prompt,
            offline,
            budget,
        ):
            continue
        if row.visible_frames <= capacity:
            continue
        if offline in ("sink_window", "participative") and row.sink_frames != sink:
            continue
        if offline in ("top_c", "participative") and row.recent_frames != recent:
            continue
        if offline == "participative" and row.capacity != capacity:
            continue
        recalls.append(row.recall)
    return recalls


def expected_summary_row(deviation: pd.DataFrame, recall: pd.DataFrame, key) -> dict:
    """One summary row by plain loops over the tables (the module docstring's definitions)."""
    checkpoint, prompt, policy, budget, sink, recent, capacity = key[:7]
    frames = {}
    for row in deviation.itertuples(index=False):
        if (row.checkpoint, row.prompt, row.policy, row.budget, row.sink_frames) == key[:5]:
            if (row.recent_frames, row.capacity) == (recent, capacity):
                frames[row.frame] = (row.block, row.rel_l2, row.cosine)
    evicting = None
    for block in sorted({b for b, _, _ in frames.values()}):
        members = [f for f, (b, _, _) in frames.items() if b == block]
        if max(members) + 1 > capacity:
            evicting = min(members)
            break
    after = [f for f in frames if evicting is not None and f >= evicting]
    beyond = [frames[f][1] for f in frames if f >= TRAIN_FRAMES]
    offline = {"deep_sink": "sink_window", "deep_forcing": "participative"}.get(policy, policy)
    if offline == "sink_window" and sink == 0:
        offline = "window"
    recalls = offline_recalls(recall, checkpoint, prompt, offline, budget, sink, recent, capacity)
    return {
        "frames": len(frames),
        "evicting_from": evicting,
        "rel_l2_mean": mean([frames[f][1] for f in after]),
        "cosine_mean": mean([frames[f][2] for f in after]),
        "rel_l2_last": frames[max(frames)][1],
        "rel_l2_beyond_training": mean(beyond),
        "offline_policy": offline,
        "recall": mean(recalls),
        "recall_rows": len(recalls),
    }


# --------------------------------------------------------------------------------------------
# the summary


def test_summary_matches_plain_loops(tmp_path):
    deviation_paths, recall_paths = write_inputs(tmp_path)
    out = tmp_path / "summary.csv"
    returned = closed_loop.write_closed_loop_summary(
        deviation_paths, recall_paths, out, TRAIN_FRAMES
    )
    written = pd.read_csv(out, keep_default_na=False, na_values=[""])
    assert list(written.columns) == closed_loop.SUMMARY_COLUMNS
    assert len(written) == len(RUNS) * len(LOOP_POLICIES)
    pd.testing.assert_frame_equal(
        closed_loop.read_closed_loop_summary(out), returned, check_dtype=False
    )
    deviation = pd.concat([pd.read_csv(p) for p in deviation_paths])
    recall = pd.concat(
        [pd.read_csv(p, keep_default_na=False, na_values=[""]) for p in recall_paths]
    )
    for column in policies.OPTIONAL_COLUMNS:
        recall[column] = recall[column].fillna(-1)
    seen = set()
    for row in written.to_dict("records"):
        key = tuple(row[c] for c in closed_loop.RUN_KEYS)
        seen.add(key)
        expected = expected_summary_row(deviation, recall, key)
        for column, value in expected.items():
            got = row[column]
            if value is None:
                assert pd.isna(got), (key, column)
            elif isinstance(value, str):
                assert got == value, (key, column)
            elif math.isnan(value):
                assert math.isnan(got), (key, column)
            else:  # the CSV's 6 significant digits: 5e-6 of the value at most
                assert got == pytest.approx(value, rel=5e-6, abs=0), (key, column)
    assert seen == {(c, p, *policy, 0.0, 1.0) for c, p in RUNS for policy in LOOP_POLICIES}
    # the cases the fixture is built for, spelled out
    by_key = {
        (r["prompt"], r["policy"], r["budget"], r["sink_frames"]): r
        for r in written.to_dict("records")
    }
    assert by_key[("cat", "window", 4, 0)]["evicting_from"] == 4  # block 2 ends at 6 > 4
    assert by_key[("cat", "window", 5, 0)]["evicting_from"] == 4  # block 2 ends at 6 > 5
    assert by_key[("cat", "sink_window", 6, 0)]["evicting_from"] == 6
    assert pd.isna(by_key[("cat", "window", 12, 0)]["evicting_from"])  # never evicts
    assert math.isnan(by_key[("cat", "window", 12, 0)]["rel_l2_mean"])
    assert by_key[("cat", "window", 5, 0)]["recall_rows"] == 0
    assert math.isnan(by_key[("cat", "window", 5, 0)]["recall"])
    sea_top_c = by_key[("sea", "top_c", 4, 0)]
    assert sea_top_c["recall_rows"] == 0 and math.isnan(sea_top_c["recall"])
    cat_top_c = by_key[("cat", "top_c", 4, 0)]
    assert cat_top_c["recall_rows"] == 2 * 2 * 2 * 2  # layers x heads x steps x blocks 2, 3
    deep, sink = by_key[("cat", "deep_sink", 4, 1)], by_key[("cat", "sink_window", 4, 1)]
    assert deep["offline_policy"] == "sink_window"
    assert (deep["recall"], deep["recall_rows"]) == (sink["recall"], sink["recall_rows"])
    s0 = by_key[("cat", "sink_window", 6, 0)]
    window6 = offline_recalls(recall, "demo", "cat", "window", 6, 0, 0, 6)
    sink0 = offline_recalls(recall, "demo", "cat", "sink_window", 6, 0, 0, 6)
    assert s0["offline_policy"] == "window" and s0["recall"] == pytest.approx(mean(window6))
    assert s0["recall_rows"] == len(window6) == 2 * 2 * 2 * 1  # the last block sees 8 > 6
    assert mean(sink0) != pytest.approx(mean(window6))  # the fixture tells them apart
    # Participative Compression drops keys from the block that overflows its cache of 6 frames
    # on (block 3, frames 6-7), whatever its budget; with Deep Sink under it, the same recall.
    pc, df = by_key[("cat", "participative", 4, 1)], by_key[("cat", "deep_forcing", 4, 1)]
    assert pc["evicting_from"] == df["evicting_from"] == 6
    assert df["offline_policy"] == pc["offline_policy"] == "participative"
    assert (df["recall"], df["recall_rows"]) == (pc["recall"], pc["recall_rows"])
    assert pc["recall_rows"] == 2 * 2 * 2 * 1  # the last block sees 8 > 6
    # the order: per run, window, sink_window, deep_sink, participative, deep_forcing, top_c,
    # then by budget
    cat = written[written["prompt"] == "cat"]
    assert list(zip(cat["policy"], cat["budget"], strict=True)) == [
        ("window", 4),
        ("window", 5),
        ("window", 12),
        ("sink_window", 4),
        ("sink_window", 6),
        ("deep_sink", 4),
        ("participative", 4),
        ("deep_forcing", 4),
        ("top_c", 4),
    ]


def test_summary_without_recall_tables(tmp_path):
    deviation_paths, _ = write_inputs(tmp_path)
    summary = closed_loop.write_closed_loop_summary(
        deviation_paths[:2], [], tmp_path / "s.csv", TRAIN_FRAMES
    )
    assert (summary["recall_rows"] == 0).all() and summary["recall"].isna().all()
    with pytest.raises(ValueError, match="train_frames"):
        closed_loop.closed_loop_summary(
            closed_loop.read_deviation(deviation_paths), pd.DataFrame(), 0
        )


def test_beyond_training_is_nan_without_such_frames(tmp_path):
    table = deviation_table("demo", "cat", "window", 4, 0, 0, 4, seed=1)
    summary = closed_loop.closed_loop_summary(table, pd.DataFrame(), FRAMES)
    assert math.isnan(summary["rel_l2_beyond_training"].iloc[0])
    summary = closed_loop.closed_loop_summary(table, pd.DataFrame(), FRAMES - 1)
    assert summary["rel_l2_beyond_training"].iloc[0] == table["rel_l2"].iloc[-1]


def test_read_deviation_refusals_name_the_file(tmp_path):
    good = tmp_path / "good.csv"
    table = deviation_table("demo", "cat", "window", 4, 0, 0, 4, seed=0)
    table.to_csv(good, index=False)
    read = closed_loop.read_deviation([good])
    pd.testing.assert_frame_equal(read, table, check_dtype=False)
    assert read["prompt"].map(type).eq(str).all()
    bad = tmp_path / "no_cosine.csv"
    table.drop(columns="cosine").to_csv(bad, index=False)
    with pytest.raises(ValueError, match=r"no_cosine\.csv.*'cosine'"):
        closed_loop.read_deviation([good, bad])
    unknown = tmp_path / "unknown.csv"
    table.assign(policy="everything").to_csv(unknown, index=False)
    with pytest.raises(ValueError, match=r"unknown\.csv.*'everything'"):
        closed_loop.read_deviation([unknown])
    no_jitter = tmp_path / "no_jitter.csv"
    table.assign(jitter="").to_csv(no_jitter, index=False)
    with pytest.raises(ValueError, match=r"no_jitter\.csv.*jitter"):
        closed_loop.read_deviation([no_jitter])
    fractional = tmp_path / "fractional.csv"
    table.assign(budget=4.5).to_csv(fractional, index=False)
    with pytest.raises(ValueError, match=r"fractional\.csv.*budget"):
        closed_loop.read_deviation([fractional])
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.csv"):
        closed_loop.read_deviation([empty])
    twice = tmp_path / "twice.csv"
    table.to_csv(twice, index=False)
    with pytest.raises(
        ValueError, match=r"good\.csv, .*twice\.csv: frame 0 of demo/cat window B=4"
    ):
        closed_loop.read_deviation([good, twice])


def test_offline_policy_mapping():
    assert closed_loop.offline_policy("deep_sink", 3) == "sink_window"
    assert closed_loop.offline_policy("deep_sink", 0) == "window"
    assert closed_loop.offline_policy("sink_window", 0) == "window"
    assert closed_loop.offline_policy("top_c", 0) == "top_c"
    assert set(closed_loop.OFFLINE_POLICY.values()) <= set(policies.POLICIES)
    with pytest.raises(ValueError, match="full"):
        closed_loop.offline_policy("full")


# --------------------------------------------------------------------------------------------
# the registry


def test_closed_loop_file_names_round_trip():
    # One run (the default, the demo's): no spread across runs to draw.
    one = figures.closed_loop_figures("results/figures/closed_loop", "svg")
    files = figures.closed_loop_figures("results/figures/closed_loop", "svg", runs=2)
    assert [f.path for f in files] == [
        "results/figures/closed_loop/closed_loop_deviation.svg",
        "results/figures/closed_loop/closed_loop_recall_deviation.svg",
        "results/figures/closed_loop/closed_loop_collapse.svg",
        "results/figures/closed_loop/closed_loop_switches.svg",
        "results/figures/closed_loop/closed_loop_deviation_runs.svg",
    ]
    assert one == files[:-1]
    assert [f.kind.caption for f in files] == [
        "closed_loop_deviation.rst",
        "closed_loop_recall.rst",
        "closed_loop_collapse.rst",
        "closed_loop_switches.rst",
        "closed_loop_deviation_runs.rst",
    ]
    with pytest.raises(ValueError, match="closed-loop kinds only"):
        figures.FigureKind("x", "run.plot_x", "x.rst", "run", runs=2)
    for f in files:
        assert figures.parse_figure_path(f.path) == (f.kind, None, "svg")
        assert f.kind.scope == "closed_loop" and f.layers == ()
        assert f.labels == {"figure": f.kind.stem.replace("_", " "), "layer": "all"}
        assert (REPO / "report" / f.kind.caption).is_file()
        builder = builder_of(f.kind)
        assert next(iter(inspect.signature(builder).parameters)) == "table"
    others = [
        *figures.run_figures("o", [0, 1], [0], "svg"),
        *figures.compare_figures("o", [0], [0], "svg"),
        *figures.survey_figures("o", [0, 1], "svg"),
        *figures.survey_compare_figures("o", [0, 1], "svg"),
        *figures.policy_figures("o", [0, 1], "svg"),
    ]
    assert not [f for f in others if f.kind.scope == "closed_loop"]
    with pytest.raises(ValueError, match="whole model"):
        figures.FigureKind("x", "closed_loop.plot_x", "x.rst", "closed_loop", "captured")
    with pytest.raises(ValueError, match="whole model"):
        figures.FigureKind("x", "closed_loop.plot_x", "x.rst", "run", "model")
    with pytest.raises(ValueError, match="closed_loop_"):
        figures.FigureKind("closed_loop_x", "closed_loop.plot_x", "x.rst", "closed_loop", "model")
    with pytest.raises(ValueError, match="closed_loop_deviation"):
        figures.parse_figure_path("results/figures/closed_loop/deviation.svg")


# --------------------------------------------------------------------------------------------
# the figures


def data_lines(ax) -> dict[str, object]:
    return {
        line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")
    }


# Characters both Arial (the Windows glyph list WGL4) and DejaVu Sans draw: printable Latin-1
# and the few symbols the figures use. Not U+2016 (the double bar): Arial has none.
ARIAL_AND_DEJAVU = {chr(c) for c in (*range(0x20, 0x7F), *range(0xA0, 0x100))} | set("−–—…→≤≥")


def reference_names(ax) -> dict[float, str]:
    """frame -> the name above a deviation panel at that frame (its top axis' tick labels)."""
    (top,) = ax.child_axes
    labels = [label.get_text().strip() for label in top.get_xticklabels()]
    return dict(zip(top.get_xticks().tolist(), labels, strict=True))


def test_deviation_figure_draws_the_tables(tmp_path):
    deviation_paths, _ = write_inputs(tmp_path)
    table = closed_loop.read_deviation(deviation_paths)
    fig = plot_closed_loop_deviation(table, train_frames=TRAIN_FRAMES)
    assert isinstance(fig, Figure)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert sorted(panels) == ["demo · cat", "demo · sea"]
    labels = {
        "window": "window B={}",
        "sink_window": "sink_window B={} S={}",
        "deep_sink": "deep_sink B={} S={}",
        "participative": "participative B={} S={} R={} capacity={}",
        "deep_forcing": "deep_forcing B={} S={} R={} capacity={}",
        "top_c": "top_c B={} R={}",
    }
    for checkpoint, prompt in RUNS:
        ax = panels[f"{checkpoint} · {prompt}"]
        lines = data_lines(ax)
        assert len(lines) == len(LOOP_POLICIES)
        assert ax.get_yscale() == "log"  # the deviations span two decades
        for policy, budget, sink, recent, capacity in LOOP_POLICIES:
            values = {"top_c": (recent,), "participative": (sink, recent, capacity)}
            values["deep_forcing"] = values["participative"]
            line = lines[labels[policy].format(budget, *values.get(policy, (sink,)))]
            rows = table[
                (table["prompt"] == prompt)
                & (table["policy"] == policy)
                & (table["budget"] == budget)
                & (table["sink_frames"] == sink)
            ].sort_values("frame")
            np.testing.assert_array_equal(line.get_xdata(), rows["frame"].to_numpy(float))
            values = rows["rel_l2"].to_numpy(float)
            # zeros cannot sit on a log axis: left out (NaN), the rest exactly the table's
            np.testing.assert_array_equal(line.get_ydata(), np.where(values > 0, values, np.nan))
        verticals = {
            line.get_label(): line.get_xdata()[0]
            for line in ax.get_lines()
            if line.get_label().startswith("_")
        }
        assert verticals == {
            "_first eviction, capacity 4": 4,
            "_first eviction, capacity 5": 4,
            "_first eviction, capacity 6": 6,
            "_training length": TRAIN_FRAMES,
        }
        # The lines are named above the panel; the training length (6) and the first eviction
        # of the capacity 6 share a frame, and its name says both.
        assert reference_names(ax) == {4: "capacity 4, 5", 6: "capacity 6 · training length"}
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "training length (6 frames)" in texts
    assert "first eviction (frames 4, 4, 6, capacity 4, 5, 6)" in texts
    assert "frames equal to the reference (0) are not drawn" in fig.get_suptitle()
    assert "latent deviation from the full-cache rollout" in fig.get_suptitle()


def test_deviation_figure_of_one_run_and_policy_is_linear_when_narrow():
    table = deviation_table("demo", "cat", "window", 4, 0, 0, 4, seed=3)
    table["rel_l2"] = np.where(table["rel_l2"] > 0, 0.2 + 0.01 * table["frame"], 0.0)
    fig = plot_closed_loop_deviation(table)
    (ax,) = fig.axes
    assert ax.get_yscale() == "linear"
    (line,) = data_lines(ax).values()
    np.testing.assert_array_equal(line.get_ydata(), table["rel_l2"].to_numpy(float))
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "window B=4",
        "first eviction (frame 4, capacity 4)",
    ]
    assert reference_names(ax) == {4: "capacity 4"}  # no training length given


def test_recall_figure_draws_the_summary(tmp_path):
    deviation_paths, recall_paths = write_inputs(tmp_path)
    summary = closed_loop.write_closed_loop_summary(
        deviation_paths, recall_paths, tmp_path / "s.csv", TRAIN_FRAMES
    )
    fig = plot_closed_loop_recall(summary)
    (ax,) = fig.axes
    lines = data_lines(ax)
    drawn = summary[summary["recall"].notna() & summary["rel_l2_mean"].notna()]
    assert len(drawn) < len(summary)  # the fixture has rows that cannot be drawn
    points = set()
    for label, line in lines.items():
        assert line.get_linestyle() == "None"
        points |= {(label, float(x), float(y)) for x, y in zip(*line.get_data(), strict=True)}
    expected = {
        (
            closed_loop.policy_label(
                r.policy, r.budget, r.sink_frames, r.recent_frames, r.capacity
            ),
            float(r.recall),
            float(r.rel_l2_mean),
        )
        for r in drawn.itertuples()
    }
    assert points == expected
    assert ax.get_xlim() == (-0.02, 1.02)
    names = sorted(t.get_text() for t in ax.texts)
    assert names == sorted(drawn["prompt"])  # one checkpoint: each point named by its prompt
    note = fig.get_supxlabel().replace("\N{NO-BREAK SPACE}", " ").replace("\n", " ")
    assert "no offline recall: window B=5 (every run)" in note
    assert "top_c B=4 R=1 (sea)" in note
    assert "never evicts: window B=12 (every run)" in note


def test_recall_figure_with_nothing_to_draw():
    summary = closed_loop.closed_loop_summary(
        deviation_table("demo", "cat", "top_c", 4, 0, 1, 4, seed=2), pd.DataFrame(), TRAIN_FRAMES
    )
    fig = plot_closed_loop_recall(summary)
    (ax,) = fig.axes
    assert not data_lines(ax)
    assert "Not drawn, no offline recall: top_c B=4 R=1." in fig.get_supxlabel()
    assert "demo · cat" in fig.get_suptitle()


def test_closed_loop_figures_without_titles_leave_out_a_single_run():
    """`figures.titles: false`: a single run is named in neither figure (the caption names it);
    several runs keep their panel titles and point names, which tell them apart."""
    one = deviation_table("demo", "cat", "window", 4, 0, 0, 4, seed=3)
    for titles in (True, False):
        (ax,) = plot_closed_loop_deviation(one, titles=titles).axes
        assert ax.get_title() == ("demo · cat" if titles else "")
        summary = closed_loop.closed_loop_summary(one, pd.DataFrame(), TRAIN_FRAMES)
        suptitle = plot_closed_loop_recall(summary, titles=titles).get_suptitle()
        assert ("demo · cat" in suptitle) == titles
        assert "one point per policy" in suptitle
    two = pd.concat([one, deviation_table("demo", "dog", "window", 4, 0, 0, 4, seed=4)])
    fig = plot_closed_loop_deviation(two, titles=False)
    assert [ax.get_title() for ax in fig.axes] == ["demo · cat", "demo · dog"]


def collapse_columns(fig) -> dict[str, list]:
    """Rollout label -> its three axes (sink distance, sink-head share, phase), top to bottom."""
    columns: dict[tuple, list] = {}
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        columns.setdefault((spec.rowspan.start // 3, spec.colspan.start), []).append(ax)
    named = {}
    for axes in columns.values():
        axes.sort(key=lambda ax: ax.get_subplotspec().rowspan.start)
        named[axes[0].get_title().replace("\n", " ")] = axes  # long labels wrap
    return named


def candidate_lines(ax, name: str) -> list[float]:
    return sorted(
        float(line.get_xdata()[0]) for line in ax.lines if line.get_label() == f"_{name} candidate"
    )


def test_collapse_figure_draws_the_tables(tmp_path):
    deviation_paths, _ = write_inputs(tmp_path)
    table = closed_loop.read_deviation(deviation_paths)
    blocks = diagnostics.read_block_diagnostics(write_block_table(tmp_path, deviation_paths))
    fig = plot_closed_loop_collapse(table, blocks=blocks, train_frames=TRAIN_FRAMES)
    columns = collapse_columns(fig)
    labels = [closed_loop.rollout_label(*key, 0.0, 1.0) for key in LOOP_POLICIES]
    assert sorted(columns) == sorted(labels)
    for key, label in zip(LOOP_POLICIES, labels, strict=True):
        distance_ax, share_ax, phase_ax = columns[label]
        mask = (table["policy"] == key[0]) & (table["budget"] == key[1])
        mask &= table["sink_frames"] == key[2]
        block_mask = (blocks["policy"] == key[0]) & (blocks["budget"] == key[1])
        block_mask &= blocks["sink_frames"] == key[2]
        lines = data_lines(distance_ax)
        assert sorted(lines) == ["cat", "sea"]  # one checkpoint: runs named by their prompts
        dips = []
        for name, line in lines.items():
            run = table[mask & (table["prompt"] == name)].sort_values("frame")
            np.testing.assert_array_equal(line.get_xdata(), run["frame"])
            np.testing.assert_array_equal(line.get_ydata(), run["sink_distance"])
            # this run's candidates: the bottom of each run of frames <= 0.5 from frame 6 on
            low = [(d, f) for f, d in zip(run["frame"], run["sink_distance"], strict=True)]
            low = [(d, f) if f >= TRAIN_FRAMES and d <= 0.5 else None for d, f in low]
            dip: list = []
            for item in [*low, None]:
                if item is None and dip:
                    dips.append(float(min(dip)[1]))
                    dip = []
                elif item is not None:
                    dip.append(item)
        assert candidate_lines(distance_ax, "sink_distance") == sorted(dips)
        phase_lines = [ln for ln in phase_ax.lines if ln.get_label() == "_"]
        assert len(phase_lines) == 2  # one per run (their positions are the same)
        first = blocks[block_mask & (blocks["prompt"] == "cat")].drop_duplicates("block")
        expected = [phase_concentration(range(f, f + BLOCK), 0) for f in first["first_frame"]]
        if key[0] == "deep_sink":
            expected[2:] = [phase_concentration(range(f, f + BLOCK), BLOCK) for f in (4, 6, 8, 10)]
        for phase_line in phase_lines:
            np.testing.assert_allclose(phase_line.get_ydata()[:-1], expected, rtol=1e-12)
            x = np.arange(0, FRAMES + 1, BLOCK) - 0.5
            np.testing.assert_array_equal(phase_line.get_xdata(), x)
        shares = data_lines(share_ax)
        if key[0] == "top_c":
            assert not shares and "no attention captured" in [t.get_text() for t in share_ax.texts]
            continue
        assert sorted(shares) == ["L0", "L2"]
        for layer in (0, 2):
            rows = blocks[block_mask & (blocks["layer"] == layer)]
            mean = rows.groupby("block")["sink_share"].mean().to_numpy()  # passes and runs
            np.testing.assert_allclose(shares[f"L{layer}"].get_ydata()[:-1], mean)
        verticals = [
            ln.get_xdata()[0] for ln in share_ax.lines if ln.get_label() == "_training length"
        ]
        assert verticals == [TRAIN_FRAMES]
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts[:4] == ["cat", "sea", "L0", "L2"]
    assert "training length (6 frames)" in texts
    assert "mean over the captured passes and runs" in fig.get_suptitle()


def test_collapse_candidates_are_marked_where_the_rule_puts_them():
    """One rollout of 240 frames at absolute positions (blocks of one frame): the phase maxima
    at LoL's 132 and 201, a sink-distance dip at 150-152 (bottom 151), none before the training
    length; the line of each candidate crosses the column's three rows."""
    frames = np.arange(240)
    distance = np.ones(240)
    distance[:1] = 0.0
    distance[[3, 150, 151, 152]] = [0.2, 0.45, 0.3, 0.4]  # frame 3: within the training length
    key = ("demo", "cat", "window", 21, 0, 0, 21, 0.0, 1.0)
    table = pd.DataFrame(
        [(*key, f, f, np.nan, np.nan, d) for f, d in zip(frames, distance, strict=True)],
        columns=FRAME_TABLE_COLUMNS,
    )
    blocks = pd.DataFrame(
        [
            (
                *key,
                f,
                f,
                1,
                int(f >= 120),  # the prompt switches at frame 120
                distance[f],
                phase_concentration([f], 0),
                pd.NA,
                pd.NA,
                np.nan,
                "",
                np.nan,
            )
            for f in frames
        ],
        columns=BLOCK_DIAGNOSTIC_COLUMNS,
    )
    fig = plot_closed_loop_collapse(table, blocks=blocks, train_frames=21, titles=False)
    ((distance_ax, share_ax, phase_ax),) = collapse_columns(fig).values()
    for ax in (distance_ax, share_ax, phase_ax):
        assert candidate_lines(ax, "sink_distance") == [151.0]
        assert candidate_lines(ax, "phase_concentration") == [132.0, 201.0]
    (marker,) = [ln for ln in distance_ax.lines if ln.get_label() == "_dip"]
    assert (marker.get_xdata().tolist(), marker.get_ydata().tolist()) == ([151], [0.3])
    assert "demo" not in fig.get_suptitle()  # titles off: the caption names the run
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == [
        "sink-distance dip ≤ 0.5",
        "phase maximum",
        "training length (21 frames)",
        "prompt switch",
    ]
    for ax in (distance_ax, share_ax, phase_ax):
        assert [ln.get_xdata()[0] for ln in ax.lines if ln.get_label() == "_switch"] == [120]


# --------------------------------------------------------------------------------------------
# files


# (checkpoint, prompt) -> rel_l2_mean per policy of RUNS_POLICIES: two checkpoints, three
# prompts for one and one for the other; `window B=12` never evicts (NaN), `top_c` lacks a run.
RUNS_POLICIES = [("window", 4, 0, 0, 4), ("sink_window", 4, 1, 0, 4), ("top_c", 4, 0, 1, 4)]
RUNS_POLICIES.append(("window", 12, 0, 0, 12))
RUNS_VALUES = {
    ("a", "cat"): [0.02, 0.010, 0.03, math.nan],
    ("a", "dog"): [0.05, 0.012, math.nan, math.nan],
    ("a", "sea"): [0.04, 0.020, 0.05, math.nan],
    ("b", "cat"): [0.10, 0.030, 0.07, math.nan],
}


def runs_summary() -> pd.DataFrame:
    """A closed-loop summary of the runs of RUNS_VALUES: rel_l2_mean as given, beyond the
    training length twice that."""
    rows = []
    for (checkpoint, prompt), values in RUNS_VALUES.items():
        for key, value in zip(RUNS_POLICIES, values, strict=True):
            row = dict.fromkeys(closed_loop.SUMMARY_COLUMNS, math.nan)
            keys = (checkpoint, prompt, *key, 0.0, 1.0)
            row |= dict(zip(closed_loop.RUN_KEYS, keys, strict=True))
            row |= {"rel_l2_mean": value, "rel_l2_beyond_training": 2 * value}
            rows.append(row)
    return pd.DataFrame(rows, columns=closed_loop.SUMMARY_COLUMNS)


def test_deviation_across_runs_is_the_mean_and_spread_over_prompts():
    """Per policy and checkpoint: a diamond at the mean over its prompts, a bar of one sample
    standard deviation each side (none from one prompt), a hollow dot per run; a policy that
    never evicts is named, not drawn."""
    table = runs_summary()
    fig = plot_closed_loop_deviation_runs(table, train_frames=TRAIN_FRAMES)
    left, right = fig.axes
    assert "from the first eviction on" in left.get_xlabel()
    assert "beyond the training length (6 frames)" in right.get_xlabel()
    labels = [t.get_text() for t in left.get_yticklabels()]
    assert labels == ["window B=4", "window B=12", "sink_window B=4 S=1", "top_c B=4 R=1"]
    for ax, factor in ((left, 1.0), (right, 2.0)):
        bars = {}  # (row, checkpoint) -> (mean, low, high)
        for container in ax.containers:
            mean_line, _, bar = container
            x, y = mean_line.get_xdata()[0], mean_line.get_ydata()[0]
            checkpoint = container.get_label().removeprefix("_")
            (low, _), (high, _) = bar[0].get_segments()[0] if bar else ((x, 0), (x, 0))
            bars[round(y), checkpoint] = (x, low, high)
        for row, policy in enumerate([0, 3, 1, 2]):
            for checkpoint in ("a", "b"):
                values = [
                    factor * v[policy]
                    for (c, _), v in RUNS_VALUES.items()
                    if c == checkpoint and not math.isnan(v[policy])
                ]
                if not values:
                    assert (row, checkpoint) not in bars
                    continue
                mean, low, high = bars[row, checkpoint]
                assert mean == pytest.approx(statistics.fmean(values))
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                assert (low, high) == pytest.approx((mean - spread, mean + spread))
        dots = sorted(
            round(float(x), 12)
            for line in ax.lines
            if line.get_label() == "_run"
            for x in line.get_xdata()
        )
        want = [factor * v for values in RUNS_VALUES.values() for v in values if v == v]
        assert dots == sorted(round(v, 12) for v in want)
    assert [t.get_text() for t in left.texts] == ["never evicts"]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [
        "a: mean ± s.d. over 3 prompts",
        "b: 1 prompt: no spread",
        "one run (checkpoint, prompt)",
    ]
    assert "4 runs" in fig.get_suptitle()
    # Without any deviation (no reference): a note, no panels.
    empty = plot_closed_loop_deviation_runs(table.assign(rel_l2_mean=np.nan).assign(
        rel_l2_beyond_training=np.nan))  # fmt: skip
    assert "no deviation to draw" in empty.axes[0].texts[0].get_text()


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_render_closed_loop_figures(tmp_path, fmt):
    deviation_paths, recall_paths = write_inputs(tmp_path)
    summary = tmp_path / "summary.csv"
    closed_loop.write_closed_loop_summary(deviation_paths, recall_paths, summary, TRAIN_FRAMES)
    blocks = write_block_table(tmp_path, deviation_paths)
    switches = tmp_path / "switches.csv"
    write_switch_table(write_block_positions(deviation_paths), [], switches)
    # The SVG case draws them all, then the collapse figure (drawn from the most tables) again:
    # same data, same bytes. One figure says PNG works.
    for run in ("a", "b") if fmt == "svg" else ("a",):
        files = figures.closed_loop_figures(str(tmp_path / run), fmt, runs=len(RUNS))
        outputs = [f.path for f in files]
        if fmt == "png":
            outputs = outputs[:1]
        elif run == "b":
            outputs = [path for path in outputs if Path(path).stem == "closed_loop_collapse"]
        paths = render_figures(
            [],
            outputs,
            heads=[],
            deviation_tables=deviation_paths,
            closed_loop_summary=summary,
            closed_loop_blocks=blocks,
            closed_loop_switches=switches,
            train_frames=TRAIN_FRAMES,
        )
        assert [str(p) for p in paths] == outputs
        assert all(Path(p).stat().st_size > 1000 for p in paths)
    if fmt == "svg":
        twice = [(tmp_path / run / "closed_loop_collapse.svg").read_bytes() for run in "ab"]
        assert twice[0] == twice[1]
        # The SVGs keep their text as text, drawn in the viewer's Arial where it has one: every
        # character must be one Arial (WGL4) and DejaVu Sans both have (no double bar U+2016).
        for path in (tmp_path / "a").glob("*.svg"):
            unsafe = {c for text in svg_texts(path) for c in text} - ARIAL_AND_DEJAVU
            assert not unsafe, (path.name, unsafe)
        texts = svg_texts(tmp_path / "a" / "closed_loop_deviation.svg")
        assert any("latent deviation from the full-cache rollout" in t for t in texts)
        assert "deep_sink B=4 S=1" in texts
        texts = svg_texts(tmp_path / "a" / "closed_loop_collapse.svg")
        assert any("reference-free collapse diagnostics" in t for t in texts)
        assert "training length (6 frames)" in texts
        texts = svg_texts(tmp_path / "a" / "closed_loop_deviation_runs.svg")
        assert "demo: mean ± s.d. over 2 prompts" in texts
    else:
        assert paths[0].read_bytes().startswith(b"\x89PNG")


def test_bad_closed_loop_renders_fail_before_writing(tmp_path):
    deviation_paths, recall_paths = write_inputs(tmp_path)
    summary = tmp_path / "summary.csv"
    closed_loop.write_closed_loop_summary(deviation_paths, recall_paths, summary, TRAIN_FRAMES)
    out = tmp_path / "figures"
    outputs = [f.path for f in figures.closed_loop_figures(str(out), "svg")]
    blocks = write_block_table(tmp_path, deviation_paths)
    broken = tmp_path / "broken.csv"
    pd.read_csv(deviation_paths[0]).drop(columns="rel_l2").to_csv(broken, index=False)
    requests = [
        ({"deviation_tables": deviation_paths, "closed_loop_summary": summary}, "block table"),
        ({"closed_loop_summary": summary, "closed_loop_blocks": blocks}, "deviation tables"),
        ({"deviation_tables": deviation_paths}, "closed-loop summary"),
        ({"deviation_tables": [broken], "closed_loop_summary": summary}, r"broken\.csv"),
        ({"deviation_tables": deviation_paths, "closed_loop_summary": deviation_paths[0]}, "lacks"),
        (
            {
                "deviation_tables": deviation_paths,
                "closed_loop_summary": summary,
                "train_frames": 0,
            },
            "train_frames",
        ),
        ({"deviation_tables": deviation_paths, "closed_loop_summary": summary}, "switch table"),
    ]
    for options, message in requests:
        options = {"closed_loop_blocks": blocks, **options} if "block" not in message else options
        with pytest.raises(ValueError, match=message):
            render_figures([], outputs, heads=[], **options)
    assert not out.exists(), "a failed request must not leave figures behind"


def test_closed_loop_summary_script(tmp_path):
    """scripts/closed_loop_summary.py as the rule runs it: inputs frames=, blocks=, stores=
    (none here) and policies=, outputs summary=, blocks= and the figures, params train_frames=,
    sink_frames=, sink_threshold= and figures=."""
    deviation_paths, recall_paths = write_inputs(tmp_path)
    block_paths = write_block_positions(deviation_paths)
    out = tmp_path / "results"
    summary = str(out / "closed_loop" / "summary.csv")
    blocks = str(out / "closed_loop" / "blocks.csv")
    switches = str(out / "closed_loop" / "switches.csv")
    # One figure stands for the rest (test_render_closed_loop_figures draws them all).
    figure_files = [f.path for f in figures.closed_loop_figures(str(out / "figures"), "svg")][:1]
    snakemake = SimpleNamespace(
        input=Named(
            frames=[str(p) for p in deviation_paths],
            blocks=[str(p) for p in block_paths],
            stores=[],
            policies=[str(p) for p in recall_paths],
        ),
        output=Named(summary=[summary], blocks=[blocks], switches=[switches], figures=figure_files),
        log=Named([str(tmp_path / "summary.log")]),
        params=Named(
            train_frames=TRAIN_FRAMES,
            sink_frames=1,
            sink_threshold=0.3,
            figures={"format": "svg"},
        ),
    )
    snakemake.output.summary = summary  # Snakemake names a single file by its path
    snakemake.output.blocks = blocks
    snakemake.output.switches = switches
    runpy.run_path(
        str(REPO / "scripts" / "closed_loop_summary.py"), init_globals={"snakemake": snakemake}
    )
    table = closed_loop.read_closed_loop_summary(summary)
    assert len(table) == len(RUNS) * len(LOOP_POLICIES)
    block_table = diagnostics.read_block_diagnostics(blocks)
    assert len(block_table) == len(RUNS) * len(LOOP_POLICIES) * FRAMES // BLOCK
    assert block_table["sink_share"].isna().all()  # no stores captured
    assert read_switch_table(switches).empty  # nor a switch table
    assert sorted(p.name for p in (out / "figures").iterdir()) == sorted(
        Path(p).name for p in figure_files
    )
    assert any("training length (6 frames)" in t for t in svg_texts(Path(figure_files[0])))
