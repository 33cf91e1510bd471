"""sinkscope.analysis.stats against numbers worked out by hand on a 4-frame, 2-block dataset."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from sinkscope.analysis.stats import (
    COLUMNS,
    frame_statistics,
    sink_rates,
    write_stats,
    write_summary,
)
from sinkscope.storage import mark_complete

nan = np.nan

# Blocks [0, 0, 1, 1]: frames 0-1 see frames 0-1, frames 2-3 see all four.
PROB_MASS = {  # head -> query frame x key frame
    0: [[0.6, 0.4, nan, nan], [0.8, 0.2, nan, nan], [0.5, 0.1, 0.2, 0.2], [0.3, 0.1, 0.2, 0.4]],
    1: [[0.4, 0.6, nan, nan], [0.4, 0.6, nan, nan], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]],
}
LOGIT_MEAN = {
    0: [[1, 3, nan, nan], [3, 1, nan, nan], [4, 1, 2, 3], [2, 1, 0, 1]],
    1: [[0, 0, nan, nan], [0, 0, nan, nan], [-2, -4, -1, -3], [-2, -4, -1, -3]],
}
ENTROPY = {0: [0.5, 0.7, 1.0, 2.0], 1: [0.1, 0.3, 1.2, 1.2]}


def hand_dataset(prompt: str = "cat", checkpoint: str = "demo", logit_shift: float = 0.0):
    """Two steps with the same values (denoise at 500, cache at 0), two heads, four frames."""
    prob = np.array([PROB_MASS[0], PROB_MASS[1]], dtype=np.float32)
    logit = np.array([LOGIT_MEAN[0], LOGIT_MEAN[1]], dtype=np.float32) + logit_shift
    entropy = np.array([ENTROPY[0], ENTROPY[1]], dtype=np.float32)
    dims = ("step", "head", "query_frame", "key_frame")
    return xr.Dataset(
        {
            "logit_mean": (dims, np.stack([logit, logit])),
            "prob_mass": (dims, np.stack([prob, prob])),
            "entropy": (dims[:3], np.stack([entropy, entropy])),
        },
        coords={
            "step": [0, 1],
            "head": [0, 1],
            "query_frame": [0, 1, 2, 3],
            "key_frame": [0, 1, 2, 3],
            "timestep": ("step", np.array([500.0, 0.0], dtype=np.float32)),
            "pass_kind": ("step", np.array(["denoise", "cache"], dtype=object)),
            "block": ("query_frame", np.array([0, 0, 1, 1], dtype=np.int32)),
            # Object-dtype strings, as the reducer writes them (zarr v3 `string`).
            "checkpoint": np.array(checkpoint, dtype=object),
            "prompt": np.array(prompt, dtype=object),
            "layer": 4,
        },
        attrs={"block_sizes": [2, 2]},
    )


def row(table: pd.DataFrame, *, head: int, measure: str, query: str, step: int = 0) -> pd.Series:
    match = table[
        (table["head"] == head)
        & (table["measure"] == measure)
        & (table["query"] == query)
        & (table["step"] == step)
    ]
    assert len(match) == 1
    return match.iloc[0]


def check(got: pd.Series, **expected):
    for name, value in expected.items():
        if value is None:
            assert pd.isna(got[name]), (name, got[name])
        else:
            assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name


# Last block (frames 2, 3), worked out by hand from the tables above.
LAST_BLOCK = {
    # head 0, logits: profile [3, 1, 1, 2]
    (0, "logit_mean"): dict(
        first=3,
        middle=1,
        last=2,
        sink_score=2,
        first_middle_ratio=3,
        spread_pct=(3 - 1) / 1.75 * 100,
        argmax_frame=0,
        uniform_multiple=None,
        recent_mass=None,
        entropy=1.5,
    ),
    # head 0, mass: profile [0.4, 0.1, 0.2, 0.3]
    (0, "prob_mass"): dict(
        first=0.4,
        middle=0.15,
        last=0.3,
        sink_score=0.25,
        first_middle_ratio=0.4 / 0.15,
        spread_pct=(0.4 - 0.1) / 0.25 * 100,
        argmax_frame=0,
        uniform_multiple=0.4 * 4,
        recent_mass=0.2 + 0.3,
        entropy=1.5,
    ),
    # head 1, logits: profile [-2, -4, -1, -3], negative mean
    (1, "logit_mean"): dict(
        first=-2,
        middle=-2.5,
        last=-3,
        sink_score=0.5,
        first_middle_ratio=0.8,
        spread_pct=3 / 2.5 * 100,
        argmax_frame=2,
        uniform_multiple=None,
        recent_mass=None,
        entropy=1.2,
    ),
    # head 1, mass: profile [0.1, 0.2, 0.3, 0.4], no sink
    (1, "prob_mass"): dict(
        first=0.1,
        middle=0.25,
        last=0.4,
        sink_score=-0.15,
        first_middle_ratio=0.4,
        spread_pct=0.3 / 0.25 * 100,
        argmax_frame=3,
        uniform_multiple=0.4,
        recent_mass=0.7,
        entropy=1.2,
    ),
}


def test_last_block_every_statistic():
    table = frame_statistics(hand_dataset(), query="last_block")
    assert list(table.columns) == COLUMNS
    assert len(table) == 2 * 2 * 2  # heads x steps x measures
    assert set(table["query"]) == {"last_block"}
    for (head, measure), expected in LAST_BLOCK.items():
        for step in (0, 1):
            check(row(table, head=head, measure=measure, query="last_block", step=step), **expected)


def test_provenance_and_step_columns():
    table = frame_statistics(hand_dataset(), query="last_block")
    assert set(table["checkpoint"]) == {"demo"}
    assert set(table["prompt"]) == {"cat"}
    assert set(table["layer"]) == {4}
    step1 = table[table["step"] == 1]
    assert set(step1["timestep"]) == {0.0}
    assert set(step1["pass_kind"]) == {"cache"}
    assert set(table[table["step"] == 0]["pass_kind"]) == {"denoise"}
    # One row per (head, step, measure, query set), in that order.
    keys = list(zip(table["head"], table["step"], table["measure"], strict=True))
    assert keys == sorted(keys)


def test_each_block():
    table = frame_statistics(hand_dataset(), query="each_block")
    assert len(table) == 2 * 2 * 2 * 2
    assert set(table["query"]) == {"block0", "block1"}
    for (head, measure), expected in LAST_BLOCK.items():
        check(row(table, head=head, measure=measure, query="block1"), **expected)
    # Block 0 sees only frames 0-1: nothing lies between first and last.
    check(
        row(table, head=0, measure="logit_mean", query="block0"),
        first=2,  # mean of 1 and 3
        middle=None,
        last=2,
        sink_score=None,
        first_middle_ratio=None,
        spread_pct=0,
        argmax_frame=0,
        uniform_multiple=None,
        recent_mass=None,
        entropy=0.6,
    )
    check(
        row(table, head=0, measure="prob_mass", query="block0"),
        first=0.7,
        middle=None,
        last=0.3,
        spread_pct=0.4 / 0.5 * 100,
        argmax_frame=0,
        uniform_multiple=1.4,
        recent_mass=1.0,
        entropy=0.6,
    )
    check(
        row(table, head=1, measure="prob_mass", query="block0"),
        first=0.4,
        last=0.6,
        argmax_frame=1,
        uniform_multiple=0.8,
        recent_mass=1.0,
        entropy=0.2,
    )


def test_each_frame():
    table = frame_statistics(hand_dataset(), query="each_frame")
    assert len(table) == 2 * 2 * 2 * 4
    assert set(table["query"]) == {"frame0", "frame1", "frame2", "frame3"}
    check(
        row(table, head=0, measure="prob_mass", query="frame0"),
        first=0.6,
        middle=None,
        last=0.4,
        argmax_frame=0,
        uniform_multiple=1.2,
        recent_mass=1.0,
        entropy=0.5,
    )
    check(
        row(table, head=0, measure="prob_mass", query="frame2"),
        first=0.5,
        middle=0.15,
        last=0.2,
        sink_score=0.35,
        first_middle_ratio=0.5 / 0.15,
        spread_pct=(0.5 - 0.1) / 0.25 * 100,
        argmax_frame=0,
        uniform_multiple=2.0,
        recent_mass=0.4,  # frames 2 and 3: frame 2's own block
        entropy=1.0,
    )
    check(
        row(table, head=0, measure="logit_mean", query="frame3"),
        first=2,
        middle=0.5,
        last=1,
        sink_score=1.5,
        first_middle_ratio=4,
        spread_pct=2 / 1 * 100,
        argmax_frame=0,
        entropy=2.0,
    )


def test_evicted_frame_is_skipped():
    # A rolling cache evicted frame 1 for the last block: visible key frames are 0, 2, 3.
    ds = hand_dataset()
    for name in ("logit_mean", "prob_mass"):
        ds[name][:, :, 2:, 1] = np.nan
    table = frame_statistics(ds, query="last_block")
    check(
        row(table, head=1, measure="prob_mass", query="last_block"),
        first=0.1,
        middle=0.3,
        last=0.4,
        spread_pct=0.3 / (0.8 / 3) * 100,
        argmax_frame=3,
        uniform_multiple=0.1 * 3,
        recent_mass=0.7,
    )
    check(
        row(table, head=1, measure="logit_mean", query="last_block"),
        first=-2,
        middle=-1,
        last=-3,
        argmax_frame=2,
    )


def test_unknown_query_mode():
    with pytest.raises(ValueError, match="each_head"):
        frame_statistics(hand_dataset(), query="each_head")


def test_write_stats_round_trip(tmp_path):
    store = tmp_path / "layer4.zarr"
    hand_dataset().to_zarr(store, zarr_format=3, consolidated=True)
    mark_complete(store)
    csv = tmp_path / "stats" / "layer4.csv"
    write_stats(store, csv, query="each_block")
    assert not csv.with_name(csv.name + ".tmp").exists()
    table = pd.read_csv(csv)
    assert list(table.columns) == COLUMNS
    assert set(table["checkpoint"]) == {"demo"}
    assert set(table["prompt"]) == {"cat"}
    assert set(table["layer"]) == {4}
    for (head, measure), expected in LAST_BLOCK.items():
        check(row(table, head=head, measure=measure, query="block1"), **expected)


def test_summary_mean_std_count(tmp_path):
    paths = []
    runs = [("cat", "demo", 0.0), ("dog", "demo", 2.0), ("cat", "other", 10.0)]
    for prompt, checkpoint, shift in runs:
        path = tmp_path / f"{checkpoint}_{prompt}.csv"
        write_stats_from(hand_dataset(prompt, checkpoint, shift), path)
        paths.append(path)
    out = tmp_path / "summary.csv"
    write_summary(paths, out)
    assert not out.with_name(out.name + ".tmp").exists()
    summary = pd.read_csv(out)
    assert list(summary.columns) == [*COLUMNS, "aggregate"]
    runs_rows = summary[summary["aggregate"] == "run"]
    assert len(runs_rows) == 3 * 8
    assert set(runs_rows["prompt"]) == {"cat", "dog"}

    def aggregate(kind, checkpoint, measure, head=0):
        match = summary[
            (summary["aggregate"] == kind)
            & (summary["checkpoint"] == checkpoint)
            & (summary["measure"] == measure)
            & (summary["head"] == head)
            & (summary["step"] == 0)
        ]
        assert len(match) == 1
        assert match.iloc[0]["prompt"] == "*"
        return match.iloc[0]

    # demo, head 0, logits: first is 3 (cat) and 5 (dog); middle is 1 and 3.
    check(aggregate("mean", "demo", "logit_mean"), first=4, middle=2, sink_score=2, entropy=1.5)
    check(
        aggregate("std", "demo", "logit_mean"),
        first=np.sqrt(2),
        middle=np.sqrt(2),
        sink_score=0,
        entropy=0,
        uniform_multiple=None,
    )
    check(
        aggregate("count", "demo", "logit_mean"),
        first=2,
        middle=2,
        argmax_frame=2,
        uniform_multiple=0,
        recent_mass=0,
    )
    check(aggregate("mean", "demo", "prob_mass"), first=0.4, uniform_multiple=1.6, recent_mass=0.5)
    # One prompt only: the std is undefined.
    check(aggregate("mean", "other", "logit_mean"), first=13)
    check(aggregate("std", "other", "logit_mean"), first=None)
    check(aggregate("count", "other", "logit_mean"), first=1)
    # demo and other: 2 heads x 2 steps x 2 measures each, and three aggregates of each.
    assert len(summary) == 3 * 8 + 3 * 2 * 8


def write_stats_from(ds: xr.Dataset, path):
    frame_statistics(ds, query="last_block").to_csv(path, index=False)


def test_summary_needs_input(tmp_path):
    with pytest.raises(ValueError):
        write_summary([], tmp_path / "summary.csv")


def test_sink_rate():
    table = frame_statistics(hand_dataset())
    # Importance of frame 0: head 0 (0.6 + 0.8 + 0.5 + 0.3) / 4 = 0.55; head 1 0.25.
    rates = sink_rates(table)
    assert rates["sink_rate"].tolist() == [0.5, 0.5]
    assert rates["sink_heads"].tolist() == [1, 1]
    assert rates["pass_kind"].tolist() == ["denoise", "cache"]
    assert sink_rates(table, threshold=0.2)["sink_rate"].tolist() == [1.0, 1.0]
    assert sink_rates(table, threshold=0.6)["sink_rate"].tolist() == [0.0, 0.0]
    # A query frame that cannot see frame 0 is left out: head 0 becomes (0.6 + 0.8 + 0.5) / 3.
    blind = hand_dataset()
    blind["prob_mass"][:, 0, 3, 0] = np.nan
    assert sink_rates(frame_statistics(blind), 0.6)["sink_rate"].tolist() == [0.5, 0.5]


def test_sink_threshold_is_inclusive_in_head_class_and_sink_rate():
    """One rule: a head whose mass on frame 0 equals the threshold is a sink head, in both."""
    ds = _class_dataset()
    ds["prob_mass"][:, 0, :, 0] = 0.5  # head 0: exactly 0.5 on frame 0 from every query frame
    for threshold, sink in ((0.5, True), (np.nextafter(0.5, 1.0), False)):
        table = frame_statistics(ds, sink_threshold=threshold)
        head0 = table[(table["measure"] == "prob_mass") & (table["head"] == 0)].iloc[0]
        assert head0["first"] == 0.5 and head0["importance"] == 0.5
        assert (head0["head_class"] == "sink") is sink
        rates = sink_rates(table, threshold=threshold)
        assert rates["sink_heads"].tolist() == [1 if sink else 0]


def _class_dataset() -> xr.Dataset:
    """4 frames in blocks [2, 2], 1 step, 3 heads: a sink head, a recent head, a spread head."""
    nan = np.nan
    first_block = [[1.0, 0.0, nan, nan], [0.5, 0.5, nan, nan]]  # queries 0, 1 see frames 0, 1
    rows = {
        0: [*first_block, [0.6, 0.1, 0.1, 0.2], [0.5, 0.1, 0.2, 0.2]],  # sink
        1: [*first_block, [0.1, 0.1, 0.4, 0.4], [0.1, 0.1, 0.3, 0.5]],  # recent
        2: [*first_block, [0.25, 0.25, 0.25, 0.25], [0.2, 0.3, 0.25, 0.25]],  # spread
    }
    mass = np.array([[rows[h] for h in range(3)]])  # (step, head, query, key)
    return xr.Dataset(
        {
            "prob_mass": (("step", "head", "query_frame", "key_frame"), mass),
            "logit_mean": (("step", "head", "query_frame", "key_frame"), np.log(mass + 1e-3)),
            "entropy": (("step", "head", "query_frame"), np.ones((1, 3, 4))),
        },
        coords={
            "step": [0],
            "head": [0, 1, 2],
            "query_frame": range(4),
            "key_frame": range(4),
            "timestep": ("step", [1000.0]),
            "pass_kind": ("step", ["denoise"]),
            "block": ("query_frame", [0, 0, 1, 1]),
            "checkpoint": "c",
            "prompt": "p",
            "layer": 0,
        },
    )


def test_importance_head_class_and_sink_rate_by_hand():
    ds = _class_dataset()
    table = frame_statistics(ds, sink_threshold=0.3, recent_threshold=0.5)
    mass = table[table.measure == "prob_mass"].set_index("head")
    # importance: mean mass on frame 0 over the 4 query frames that see it.
    assert mass.loc[0, "importance"] == pytest.approx((1.0 + 0.5 + 0.6 + 0.5) / 4)
    assert mass.loc[1, "importance"] == pytest.approx((1.0 + 0.5 + 0.1 + 0.1) / 4)
    assert mass.loc[2, "importance"] == pytest.approx((1.0 + 0.5 + 0.25 + 0.2) / 4)
    # Last block: head 0 first 0.55 -> sink; head 1 first 0.1, own block 0.8 -> recent;
    # head 2 first 0.225, own block 0.5 -> recent at 0.5, spread at 0.6.
    assert list(mass["head_class"]) == ["sink", "recent", "recent"]
    stricter = frame_statistics(ds, recent_threshold=0.6)
    assert list(stricter[stricter.measure == "prob_mass"]["head_class"]) == [
        "sink",
        "recent",
        "spread",
    ]
    assert (table[table.measure == "logit_mean"]["head_class"] == "").all()
    assert table[table.measure == "logit_mean"]["importance"].isna().all()
    rates = sink_rates(table, threshold=0.45)
    # importances 0.65, 0.425, 0.4875 -> 2 of 3 heads above 0.45.
    assert rates["sink_heads"].tolist() == [2] and rates["sink_rate"].tolist() == [
        pytest.approx(2 / 3)
    ]


def test_summary_writes_sink_rates(tmp_path):
    from sinkscope.analysis.stats import write_summary

    table = frame_statistics(_class_dataset())
    table.to_csv(tmp_path / "a.csv", index=False)
    write_summary([tmp_path / "a.csv"], tmp_path / "summary.csv", tmp_path / "sink_rate.csv")
    rates = pd.read_csv(tmp_path / "sink_rate.csv")
    # Default threshold 0.3: importances 0.65, 0.425 and 0.4875 all exceed it.
    assert rates[["num_heads", "sink_heads", "sink_rate"]].values.tolist() == [[3, 3, 1.0]]
    summary = pd.read_csv(tmp_path / "summary.csv", keep_default_na=False, na_values=[""])
    assert summary[summary["aggregate"] == "run"]["head_class"].tolist().count("sink") == 1
