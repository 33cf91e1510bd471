"""sinkscope.analysis.stats against numbers worked out by hand on a 4-frame, 2-block dataset, and
the head = mean rows against numpy on the head-mean profile."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from sinkscope import frames
from sinkscope.analysis.stats import (
    COLUMNS,
    MEAN_HEAD,
    SINK_RATE_KEYS,
    SINK_THRESHOLD,
    STAT_COLUMNS,
    frame_statistics,
    per_head,
    read_stats,
    sink_rates,
    write_stats,
    write_summary,
)
from sinkscope.storage import CSV_SIGNIFICANT_DIGITS, mark_complete

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


def row(
    table: pd.DataFrame, *, head: int | str, measure: str, query: str, step: int = 0
) -> pd.Series:
    match = table[
        (table["head"] == head)
        & (table["measure"] == measure)
        & (table["query"] == query)
        & (table["step"] == step)
    ]
    assert len(match) == 1
    return match.iloc[0]


# What a value read back from a CSV keeps: 6 significant digits (storage.CSV_SIGNIFICANT_DIGITS),
# so within half a unit of the sixth.
CSV_REL = 0.5 * 10.0 ** (1 - CSV_SIGNIFICANT_DIGITS)


def check(got: pd.Series, **expected):
    for name, value in expected.items():
        if value is None:
            assert pd.isna(got[name]), (name, got[name])
        else:
            assert got[name] == pytest.approx(value, rel=CSV_REL, abs=1e-6), name


# Last block (frames 2, 3), worked out by hand from the tables above.
LAST_BLOCK = {
    # head 0, logits: profile [3, 1, 1, 2]
    (0, "logit_mean"): dict(
        first=3,
        middle=1,
        last=2,
        sink_score=2,
        first_middle_ratio=3,
        first_last_diff=1,
        spread_pct=None,  # a percent of a mean logit: none (Contract 3)
        argmax_frame=0,
        min_frame=1,  # frames 1 and 2 tie: the first, as argmax
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
        first_last_diff=0.1,
        spread_pct=(0.4 - 0.1) / 0.25 * 100,
        argmax_frame=0,
        min_frame=1,
        uniform_multiple=0.4 * 4,
        recent_mass=0.2 + 0.3,
        entropy=1.5,
    ),
    # head 1, logits: profile [-2, -4, -1, -3], negative mean; middle < 0: no ratio (not 0.8)
    (1, "logit_mean"): dict(
        first=-2,
        middle=-2.5,
        last=-3,
        sink_score=0.5,
        first_middle_ratio=None,
        first_last_diff=1,
        spread_pct=None,
        argmax_frame=2,
        min_frame=1,
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
        first_last_diff=-0.3,
        spread_pct=0.3 / 0.25 * 100,
        argmax_frame=3,
        min_frame=0,
        uniform_multiple=0.4,
        recent_mass=0.7,
        entropy=1.2,
    ),
}


def test_last_block_every_statistic():
    table = frame_statistics(hand_dataset(), query="last_block")
    assert list(table.columns) == COLUMNS
    assert len(table) == 2 * 2 * 2 + 2 * 2  # heads x steps x measures, + head = mean rows
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
    # One row per (head, step, measure, query set), in that order, then the head = mean rows.
    heads = table["head"].tolist()
    assert heads == [0] * 4 + [1] * 4 + [MEAN_HEAD] * 4
    assert all(type(head) is int for head in heads[:8])
    for part in (table.iloc[:8], table.iloc[8:]):
        keys = list(zip(part["head"], part["step"], part["measure"], strict=True))
        assert keys == sorted(keys)


def test_each_block():
    table = frame_statistics(hand_dataset(), query="each_block")
    assert len(table) == 2 * 2 * 2 * 2 + 2 * 2 * 2
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
        first_last_diff=0,
        spread_pct=None,
        argmax_frame=0,
        min_frame=0,  # a tie
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
    assert len(table) == 2 * 2 * 2 * 4 + 2 * 2 * 4
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
        spread_pct=None,
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


# The head-mean profiles of the last block: logits [3, 1, 1, 2] and [-2, -4, -1, -3] average to
# [0.5, -1.5, 0, -0.5]; masses [0.4, 0.1, 0.2, 0.3] and [0.1, 0.2, 0.3, 0.4] to
# [0.25, 0.15, 0.25, 0.35].
HEAD_MEAN = {
    "logit_mean": dict(
        first=0.5,
        middle=-0.75,
        last=-0.5,
        sink_score=1.25,
        first_last_diff=1.0,
        first_middle_ratio=None,  # middle <= 0
        spread_pct=None,
        argmax_frame=0,
        min_frame=1,
        uniform_multiple=None,
        recent_mass=None,
        entropy=None,
        importance=None,
    ),
    "prob_mass": dict(
        first=0.25,
        middle=0.2,
        last=0.35,
        sink_score=0.05,
        first_last_diff=-0.1,
        first_middle_ratio=1.25,  # the per-head ratios 0.4 / 0.15 and 0.4 average to 1.53
        spread_pct=0.2 / 0.25 * 100,
        argmax_frame=3,
        min_frame=1,
        uniform_multiple=1.0,
        recent_mass=0.6,
        entropy=None,  # belongs to single heads
        importance=None,
    ),
}


def test_head_mean_rows_by_hand():
    table = frame_statistics(hand_dataset(), query="last_block")
    for measure, expected in HEAD_MEAN.items():
        for step in (0, 1):
            got = row(table, head=MEAN_HEAD, measure=measure, query="last_block", step=step)
            check(got, **expected)
            assert got["head_class"] == ""
            assert (got["checkpoint"], got["prompt"], got["layer"]) == ("demo", "cat", 4)
    got = row(table, head=MEAN_HEAD, measure="prob_mass", query="last_block", step=1)
    assert (got["timestep"], got["pass_kind"]) == (0.0, "cache")
    heads = per_head(table[table["measure"] == "prob_mass"])
    assert heads["first_middle_ratio"].mean() == pytest.approx((0.4 / 0.15 + 0.4) / 2)


def test_head_mean_profile_needs_every_head():
    """A key frame one head cannot see leaves the head-mean profile, as for query frames."""
    ds = hand_dataset()
    ds["prob_mass"][:, 0, 3, 1] = np.nan  # head 0, query frame 3 cannot see key frame 1
    table = frame_statistics(ds, query="last_block")
    # Head-mean profile [0.25, NaN, 0.25, 0.35]: middle is frame 2 alone.
    check(
        row(table, head=MEAN_HEAD, measure="prob_mass", query="last_block"),
        first=0.25,
        middle=0.25,
        last=0.35,
        first_middle_ratio=1.0,
        argmax_frame=3,
        min_frame=0,
        uniform_multiple=0.75,
        recent_mass=0.6,
    )
    # Head 1 still sees frame 1.
    check(row(table, head=1, measure="prob_mass", query="last_block"), middle=0.25)


def _windowed_dataset(seed: int = 0) -> xr.Dataset:
    """3 heads, 2 steps, 8 frames in blocks of 2 with a rolling cache of 5 frames, 1 of them a sink:
    the last blocks cannot see some middle frames. Random values, logits of both signs."""
    rng = np.random.default_rng(seed)
    sizes = [2, 2, 2, 2]
    seen = frames.visible_frames(sizes, local_attn_size=5, sink_size=1)
    shape = (2, 3, 8, 8)
    logits = np.where(seen, rng.normal(0.0, 1.0, shape), np.nan)
    weights = np.where(seen, rng.uniform(0.01, 1.0, shape), 0.0)
    mass = np.where(seen, weights / weights.sum(axis=-1, keepdims=True), np.nan)
    dims = ("step", "head", "query_frame", "key_frame")
    return xr.Dataset(
        {
            "logit_mean": (dims, logits),
            "prob_mass": (dims, mass),
            "entropy": (dims[:3], rng.uniform(0.0, 2.0, shape[:3])),
        },
        coords={
            "step": [0, 1],
            "head": [0, 1, 2],
            "query_frame": range(8),
            "key_frame": range(8),
            "timestep": ("step", [1000.0, 0.0]),
            "pass_kind": ("step", ["denoise", "cache"]),
            "block": ("query_frame", frames.block_of_frame(sizes)),
            "checkpoint": "c",
            "prompt": "p",
            "layer": 3,
        },
    )


def _numpy_statistics(profile: np.ndarray, own: np.ndarray, measure: str) -> dict:
    """The Contract 3 statistics of one profile over key frames 0..F-1, written out in numpy."""
    frames_seen = np.flatnonzero(~np.isnan(profile))
    v = profile[frames_seen]
    middle = v[1:-1].mean()
    expected = dict(
        first=v[0],
        middle=middle,
        last=v[-1],
        sink_score=v[0] - middle,
        first_last_diff=v[0] - v[-1],
        first_middle_ratio=v[0] / middle if middle > 0 else None,
        spread_pct=(v.max() - v.min()) / abs(v.mean()) * 100 if measure == "prob_mass" else None,
        argmax_frame=frames_seen[v.argmax()],
        min_frame=frames_seen[v.argmin()],
        entropy=None,
        importance=None,
    )
    if measure == "prob_mass":
        expected.update(uniform_multiple=v[0] * v.size, recent_mass=profile[own].sum())
    else:
        expected.update(uniform_multiple=None, recent_mass=None)
    return expected


def test_head_mean_rows_are_statistics_of_the_numpy_head_mean_profile():
    ds = _windowed_dataset()
    table = frame_statistics(ds, query="each_block")
    blocks = ds["block"].values
    assert len(table[table["head"] == MEAN_HEAD]) == 2 * 2 * 4  # steps x measures x blocks
    checked_nan_middle_frame = False
    for measure in ("logit_mean", "prob_mass"):
        values = ds[measure].values
        for step in (0, 1):
            for block in (1, 2, 3):  # block 0 has no middle frame
                own = np.flatnonzero(blocks == block)
                # Mean over the block's query frames, then over heads: NaN where any misses.
                profile = values[step][:, own, :].mean(axis=1).mean(axis=0)
                checked_nan_middle_frame |= bool(np.isnan(profile[1 : own[0]]).any())
                got = row(table, head=MEAN_HEAD, measure=measure, query=f"block{block}", step=step)
                check(got, **_numpy_statistics(profile, own, measure))
                # first, middle and last are linear: the means of the per-head rows.
                heads = table[
                    (table["head"] != MEAN_HEAD)
                    & (table["measure"] == measure)
                    & (table["query"] == f"block{block}")
                    & (table["step"] == step)
                ]
                assert len(heads) == 3
                for name in ("first", "middle", "last", "first_last_diff"):
                    assert got[name] == pytest.approx(heads[name].mean())
    assert checked_nan_middle_frame  # the window did evict frames the statistics skip


def _profile_dataset(profiles: dict[str, list[list[float]]]) -> xr.Dataset:
    """One step, one block of 4 frames whose every query frame has, per head, the profile
    `profiles[measure][head]` over key frames 0-3."""
    arrays = {
        measure: np.repeat(np.asarray(rows, dtype=float)[None, :, None, :], 4, axis=2)
        for measure, rows in profiles.items()
    }
    num_heads = len(profiles["prob_mass"])
    dims = ("step", "head", "query_frame", "key_frame")
    return xr.Dataset(
        {
            **{measure: (dims, array) for measure, array in arrays.items()},
            "entropy": (dims[:3], np.ones((1, num_heads, 4))),
        },
        coords={
            "step": [0],
            "head": range(num_heads),
            "query_frame": range(4),
            "key_frame": range(4),
            "timestep": ("step", [1000.0]),
            "pass_kind": ("step", ["denoise"]),
            "block": ("query_frame", [0, 0, 0, 0]),
            "checkpoint": "c",
            "prompt": "p",
            "layer": 0,
        },
    )


def test_head_mean_ratio_is_not_the_mean_of_head_ratios():
    # A strong sink head (ratio 50) and a middle-heavy head (ratio 1/9).
    mass = [[0.5, 0.01, 0.01, 0.48], [0.05, 0.45, 0.45, 0.05]]
    table = frame_statistics(_profile_dataset({"prob_mass": mass, "logit_mean": mass}))
    rows = table[table["measure"] == "prob_mass"]
    head_ratios = per_head(rows)["first_middle_ratio"]
    assert head_ratios.tolist() == pytest.approx([50.0, 1 / 9])
    mean_row = row(table, head=MEAN_HEAD, measure="prob_mass", query="last_block")
    # The head-mean profile [0.275, 0.23, 0.23, 0.265]: ratio 0.275 / 0.23, about 1.2, where
    # the mean of the head ratios is about 25.
    assert mean_row["first_middle_ratio"] == pytest.approx(0.275 / 0.23)
    assert head_ratios.mean() > 20 * mean_row["first_middle_ratio"]
    check(mean_row, first=0.275, middle=0.23, last=0.265, first_last_diff=0.01, min_frame=1)


def test_ratio_is_nan_where_middle_is_not_positive():
    logits = [
        [1.0, -0.01, 0.01, 0.5],  # middle 0: no ratio, not inf
        [1.0, -0.5, -0.1, 0.0],  # middle -0.3: no ratio, not -3.3
        [2.0, 1.0, 1.0, 0.0],  # middle 1: ratio 2
        [-1.0, 0.5, 1.5, 2.0],  # middle 1, first negative: ratio -1
    ]
    mass = [
        [0.6, 0.0, 0.0, 0.4],  # no mass between: no ratio, not inf
        [0.4, 0.2, 0.2, 0.2],
        [0.25, 0.25, 0.25, 0.25],
        [0.1, 0.3, 0.3, 0.3],
    ]
    table = frame_statistics(_profile_dataset({"logit_mean": logits, "prob_mass": mass}))
    by_head = per_head(table).set_index(["measure", "head"])
    ratios = by_head.loc["logit_mean", "first_middle_ratio"]
    assert ratios.isna().tolist() == [True, True, False, False]
    assert ratios.loc[[2, 3]].tolist() == pytest.approx([2.0, -1.0])
    sink_scores = by_head.loc["logit_mean", "sink_score"]
    assert sink_scores.tolist() == pytest.approx([1.0, 1.3, 1.0, -2.0])  # still defined
    masses = by_head.loc["prob_mass", "first_middle_ratio"]
    assert masses.isna().tolist() == [True, False, False, False]
    assert not np.isinf(table["first_middle_ratio"]).any()
    # The head-mean logits [0.75, 0.2475, 0.6025, 0.625]: middle 0.425 > 0, so a ratio.
    mean_row = row(table, head=MEAN_HEAD, measure="logit_mean", query="last_block")
    check(mean_row, first=0.75, middle=0.425, first_middle_ratio=0.75 / 0.425)
    # Shifted down by 1, the head-mean middle is negative: no ratio, while sink_score stays.
    shifted = [[value - 1.0 for value in head] for head in logits]
    table = frame_statistics(_profile_dataset({"logit_mean": shifted, "prob_mass": mass}))
    mean_row = row(table, head=MEAN_HEAD, measure="logit_mean", query="last_block")
    check(mean_row, middle=0.425 - 1, first_middle_ratio=None, sink_score=0.75 - 0.425)


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
    table = read_stats(csv)
    assert list(table.columns) == COLUMNS
    # Heads come back as integers and "mean", in the order written; frame indices as integers.
    assert table["head"].tolist() == [0] * 8 + [1] * 8 + [MEAN_HEAD] * 8
    assert all(type(head) is int for head in table["head"].iloc[:16])
    assert str(table["argmax_frame"].dtype) == "Int64" == str(table["min_frame"].dtype)
    built = frame_statistics(hand_dataset(), query="each_block")
    pd.testing.assert_frame_equal(table, built, check_dtype=False, atol=1e-6)
    assert set(pd.read_csv(csv)["head"]) == {"0", "1", "mean"}  # plain pandas: all text
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
    summary = read_stats(out)
    assert list(summary.columns) == [*COLUMNS, "aggregate"]
    runs_rows = summary[summary["aggregate"] == "run"]
    assert len(runs_rows) == 3 * 12
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
    # The head = mean rows are their own group: logits' mean profile starts at 0.5 (cat) and 2.5
    # (dog), never mixed with heads 0 and 1 (first 3 and -2 for cat).
    check(aggregate("mean", "demo", "logit_mean", MEAN_HEAD), first=1.5, sink_score=1.25)
    check(aggregate("count", "demo", "logit_mean", MEAN_HEAD), first=2, entropy=0)
    # Groups sorted by head as numbers, then "mean".
    demo_means = summary[(summary["aggregate"] == "mean") & (summary["checkpoint"] == "demo")]
    assert list(dict.fromkeys(demo_means["head"])) == [0, 1, MEAN_HEAD]
    # demo and other: (2 heads + mean) x 2 steps x 2 measures each, and three aggregates of each.
    assert len(summary) == 3 * 12 + 3 * 2 * 12


def write_stats_from(ds: xr.Dataset, path):
    frame_statistics(ds, query="last_block").to_csv(path, index=False)


def test_summary_needs_input(tmp_path):
    with pytest.raises(ValueError):
        write_summary([], tmp_path / "summary.csv")


def test_sink_rate():
    table = frame_statistics(hand_dataset())
    # Last block, 4 visible key frames: head 0 puts 0.4 on frame 0 (1.6x its uniform share of
    # 0.25), head 1 0.1 (0.4x). At the default 3x neither is a sink.
    rates = sink_rates(table)
    assert rates["sink_rate"].tolist() == [0.0, 0.0]
    assert rates["pass_kind"].tolist() == ["denoise", "cache"]
    assert rates["query"].tolist() == ["last_block", "last_block"]
    assert rates["threshold"].tolist() == [SINK_THRESHOLD, SINK_THRESHOLD]
    assert sink_rates(table, threshold=1.5)["sink_heads"].tolist() == [1, 1]
    assert sink_rates(table, threshold=1.5)["sink_rate"].tolist() == [0.5, 0.5]
    assert sink_rates(table, threshold=0.3)["sink_rate"].tolist() == [1.0, 1.0]
    assert sink_rates(table, threshold=1.7)["sink_rate"].tolist() == [0.0, 0.0]


def test_sink_rate_per_query_set_follows_the_visible_frames():
    """each_block: one rate per query block, each block's first-frame mass against its own
    uniform share. Head 0 puts more mass on frame 0 in block 0 (0.7 of 2 visible frames: 1.4x)
    than in block 1 (0.4 of 4: 1.6x), yet only block 1 is a sink at 1.5x."""
    table = frame_statistics(hand_dataset(), query="each_block", sink_threshold=1.5)
    rates = sink_rates(table, threshold=1.5)
    assert rates[["step", "query", "sink_heads"]].values.tolist() == [
        [0, "block0", 0],
        [0, "block1", 1],
        [1, "block0", 0],
        [1, "block1", 1],
    ]
    mass = per_head(table[table["measure"] == "prob_mass"])
    sinks = mass[mass["head_class"] == "sink"]
    assert set(zip(sinks["query"], sinks["head"], strict=True)) == {("block1", 0)}


def test_uniform_attention_is_no_sink_whatever_the_visible_frames():
    """A head that spreads its mass evenly scores 1 in every query set, so it is no sink at any
    threshold above 1: with 2 visible frames its first frame holds 0.5 (the old absolute rule,
    mass >= 0.3, called that a sink), with 8 frames 0.125. A head with 3x the uniform share on
    frame 0 is a sink at the default threshold in every block that sees 4 frames or more."""
    block_sizes = [2, 2, 2, 2]
    seen = frames.visible_frames(block_sizes)
    uniform = np.where(seen, 1.0 / seen.sum(axis=1, keepdims=True), nan)
    count = seen.sum(axis=1, keepdims=True)
    # Head 1: 3/visible on frame 0 (where that is at most 1), the rest spread evenly.
    first = np.minimum(3.0 / count, 1.0)
    rest = np.where(count > 1, (1.0 - first) / np.maximum(count - 1, 1), 0.0)
    strong = np.where(seen, rest, nan)
    strong[:, 0] = first[:, 0]
    ds = _mass_dataset(np.stack([uniform, strong]), block_sizes)
    table = per_head(frame_statistics(ds, query="each_block"))
    mass = table[table["measure"] == "prob_mass"].set_index(["head", "query"])
    visible = {f"block{b}": 2 * (b + 1) for b in range(4)}
    for query, frames_seen in visible.items():
        assert mass.loc[(0, query), "uniform_multiple"] == pytest.approx(1.0)
        assert mass.loc[(0, query), "head_class"] != "sink"
        expected = min(3.0, frames_seen)
        assert mass.loc[(1, query), "uniform_multiple"] == pytest.approx(expected)
    # Block 0 (2 frames) cannot reach 3x; blocks 1-3 reach it exactly: inclusive.
    assert [mass.loc[(1, q), "head_class"] == "sink" for q in visible] == [False, True, True, True]
    rates = sink_rates(table)
    assert rates["sink_heads"].tolist() == [0, 1, 1, 1]


def _mass_dataset(prob_mass: np.ndarray, block_sizes: list[int]) -> xr.Dataset:
    """One step, the heads of `prob_mass` [head, query, key] (logits their log)."""
    heads, num_frames, _ = prob_mass.shape
    mass = prob_mass[None]
    return xr.Dataset(
        {
            "prob_mass": (("step", "head", "query_frame", "key_frame"), mass),
            "logit_mean": (("step", "head", "query_frame", "key_frame"), np.log(mass + 1e-3)),
            "entropy": (("step", "head", "query_frame"), np.ones((1, heads, num_frames))),
        },
        coords={
            "step": [0],
            "head": range(heads),
            "query_frame": range(num_frames),
            "key_frame": range(num_frames),
            "timestep": ("step", [1000.0]),
            "pass_kind": ("step", ["denoise"]),
            "block": ("query_frame", frames.block_of_frame(block_sizes)),
            "checkpoint": "c",
            "prompt": "p",
            "layer": 0,
        },
    )


def test_sink_threshold_is_inclusive_in_head_class_and_sink_rate():
    """One rule: a head whose first-frame mass is exactly the threshold times its uniform share
    is a sink head, in both."""
    ds = _class_dataset()
    ds["prob_mass"][:, 0, :, 0] = 0.5  # head 0: exactly 0.5 on frame 0 from every query frame
    # The last block sees 4 frames: 0.5 is 2x the uniform share 0.25.
    for threshold, sink in ((2.0, True), (np.nextafter(2.0, 3.0), False)):
        table = frame_statistics(ds, sink_threshold=threshold)
        head0 = table[(table["measure"] == "prob_mass") & (table["head"] == 0)].iloc[0]
        assert head0["first"] == 0.5 and head0["uniform_multiple"] == 2.0
        assert (head0["head_class"] == "sink") is sink
        rates = sink_rates(table, threshold=threshold)
        assert rates["sink_heads"].tolist() == [1 if sink else 0]


def test_head_class_and_sink_rate_share_one_definition():
    """The sink rate counts exactly the heads head_class calls sinks, at every threshold, on
    heads whose last-block first-frame mass and Gu et al.'s importance (over every query frame)
    rank them differently: the old rule counted importance for the rate and the last block's
    mass for the class."""
    ds = _class_dataset()
    table = per_head(frame_statistics(ds))
    mass = table[table["measure"] == "prob_mass"].set_index("head")
    # By hand, last block (frames 2, 3 see 4 frames): first-frame mass 0.55, 0.1, 0.225.
    multiples = {0: 0.55 * 4, 1: 0.1 * 4, 2: 0.225 * 4}
    for head, multiple in multiples.items():
        assert mass.loc[head, "uniform_multiple"] == pytest.approx(multiple)
    # importance (0.65, 0.425, 0.4875) orders heads 1 and 2 as the last block does not weigh them
    assert mass.loc[1, "importance"] > mass.loc[1, "first"]
    for threshold in (0.3, 0.42, 0.5, 0.8, 1.0, 2.0, 2.3):
        classes = per_head(frame_statistics(ds, sink_threshold=threshold))
        classes = classes[classes["measure"] == "prob_mass"]
        sinks = set(classes.loc[classes["head_class"] == "sink", "head"])
        assert sinks == {h for h, m in multiples.items() if m >= threshold}, threshold
        rates = sink_rates(classes, threshold=threshold)
        assert rates["sink_heads"].tolist() == [len(sinks)], threshold


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
    table = frame_statistics(ds, sink_threshold=2.0, recent_threshold=0.5)
    mass = per_head(table[table.measure == "prob_mass"]).set_index("head")
    # importance: mean mass on frame 0 over the 4 query frames that see it (reported, no rule).
    assert mass.loc[0, "importance"] == pytest.approx((1.0 + 0.5 + 0.6 + 0.5) / 4)
    assert mass.loc[1, "importance"] == pytest.approx((1.0 + 0.5 + 0.1 + 0.1) / 4)
    assert mass.loc[2, "importance"] == pytest.approx((1.0 + 0.5 + 0.25 + 0.2) / 4)
    # Last block (4 visible frames, uniform share 0.25): head 0 first 0.55 = 2.2x -> sink at 2;
    # head 1 first 0.1, own block 0.8 -> recent; head 2 first 0.225, own block 0.5 -> recent at
    # 0.5, spread at 0.6.
    assert list(mass["head_class"]) == ["sink", "recent", "recent"]
    stricter = frame_statistics(ds, sink_threshold=2.0, recent_threshold=0.6)
    assert list(stricter[stricter.measure == "prob_mass"]["head_class"]) == [
        "sink",
        "recent",
        "spread",
        "",  # the head = mean row has no class
    ]
    # At the default 3x head 0 (2.2x) is no sink: own block 0.35 -> spread.
    default = per_head(frame_statistics(ds))
    assert list(default[default.measure == "prob_mass"]["head_class"]) == [
        "spread",
        "recent",
        "recent",
    ]
    assert (table[table.measure == "logit_mean"]["head_class"] == "").all()
    assert table[table.measure == "logit_mean"]["importance"].isna().all()
    rates = sink_rates(table, threshold=0.8)
    # multiples 2.2, 0.4, 0.9 -> 2 of 3 heads at 0.8.
    assert rates["sink_heads"].tolist() == [2] and rates["sink_rate"].tolist() == [
        pytest.approx(2 / 3)
    ]


def test_sink_rates_never_count_the_head_mean_rows(tmp_path):
    table = frame_statistics(_class_dataset())
    assert (table["head"] == MEAN_HEAD).sum() == 2  # one per measure
    expected = sink_rates(per_head(table), threshold=0.45)
    assert expected[["num_heads", "sink_heads"]].values.tolist() == [[3, 2]]
    pd.testing.assert_frame_equal(sink_rates(table, threshold=0.45), expected)
    # The mean row has a uniform_multiple (linear in the profile), far above any threshold: it is
    # no head all the same.
    tampered = table.copy()
    tampered.loc[tampered["head"] == MEAN_HEAD, "uniform_multiple"] = 100.0
    pd.testing.assert_frame_equal(sink_rates(tampered, threshold=0.45), expected)
    # Read back from CSV, where every head is text, as well.
    table.to_csv(tmp_path / "a.csv", index=False)
    for read in (read_stats, pd.read_csv):
        rates = sink_rates(read(tmp_path / "a.csv"), threshold=0.45)
        assert rates[["num_heads", "sink_heads"]].values.tolist() == [[3, 2]]


def test_head_statistics_are_the_heads_only():
    from sinkscope.analysis.stats import head_statistics

    rows = head_statistics(hand_dataset(), "prob_mass", 0)
    assert rows.index.tolist() == [0, 1]
    assert rows["first"].tolist() == pytest.approx([0.4, 0.1])


def test_stat_columns():
    """Every statistic is numeric (summarize aggregates each) and present on every row."""
    assert {"first_last_diff", "min_frame"} <= set(STAT_COLUMNS)
    table = frame_statistics(hand_dataset())
    assert table[["first_last_diff", "min_frame"]].notna().all().all()


def test_summary_writes_sink_rates(tmp_path):
    from sinkscope.analysis.stats import write_summary

    table = frame_statistics(_class_dataset())
    table.to_csv(tmp_path / "a.csv", index=False)
    write_summary(
        [tmp_path / "a.csv"],
        tmp_path / "summary.csv",
        tmp_path / "sink_rate.csv",
        html_table=tmp_path / "summary.html",
    )
    html = (tmp_path / "summary.html").read_text()
    assert "first_last_diff" in html and "<td>mean</td>" in html  # the head = mean rows too
    rates = pd.read_csv(tmp_path / "sink_rate.csv")
    # Default threshold 3x: the multiples 2.2, 0.4 and 0.9 stay below it.
    rate_columns = ["sink_heads", "num_heads", "sink_rate", "threshold"]
    assert list(rates.columns) == [*SINK_RATE_KEYS, *rate_columns]
    assert rates[["num_heads", "sink_heads", "sink_rate"]].values.tolist() == [[3, 0, 0.0]]
    # At 2x head 0 is the one sink, in the rate as in head_class.
    classed = frame_statistics(_class_dataset(), sink_threshold=2.0)
    classed.to_csv(tmp_path / "b.csv", index=False)
    write_summary(
        [tmp_path / "b.csv"], tmp_path / "summary.csv", tmp_path / "rate.csv", sink_threshold=2.0
    )
    rates = pd.read_csv(tmp_path / "rate.csv")
    assert rates[["sink_heads", "threshold"]].values.tolist() == [[1, 2.0]]
    summary = pd.read_csv(tmp_path / "summary.csv", keep_default_na=False, na_values=[""])
    assert summary[summary["aggregate"] == "run"]["head_class"].tolist().count("sink") == 1
