"""Reference-free collapse diagnostics (`sinkscope.diagnostics`, `sinkscope.analysis.diagnostics`):
each against hand-written values or plain loops over small arrays, LoL's frames 132 and 201, the
collapse-candidate rule, and the per-block table from frame tables, block positions and attention
stores over cache slots built here with xarray."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from sinkscope import diagnostics
from sinkscope.analysis import closed_loop
from sinkscope.analysis import diagnostics as block_table
from sinkscope.storage import mark_complete
from sinkscope.tables import BLOCK_DIAGNOSTIC_COLUMNS, BLOCK_POSITION_COLUMNS, FRAME_TABLE_COLUMNS

# --------------------------------------------------------------------------------------------
# sinkscope.diagnostics


def test_temporal_frequencies_are_wans():
    w = diagnostics.temporal_frequencies()
    assert w.dtype == np.float64 and len(w) == 22  # 44 temporal channels at head_dim 128
    assert w[0] == 1.0
    assert w[1] == pytest.approx(math.exp(-math.log(10000) / 22), rel=1e-15)  # 0.6579...
    assert w[1] == pytest.approx(0.657933224657568, rel=1e-12)
    assert w[-1] == pytest.approx(10 ** (-4 * 42 / 44), rel=1e-12)  # 1.52e-4
    # head_dim 16 (the demo's): 16 - 4 * 2 = 8 channels, four frequencies
    np.testing.assert_allclose(diagnostics.temporal_frequencies(16), [1, 0.1, 0.01, 0.001])
    with pytest.raises(ValueError, match="head_dim"):
        diagnostics.temporal_frequencies(15)


def test_phase_concentration_by_hand():
    # head_dim 16: frequencies 1, 0.1, 0.01, 0.001; queries at 5, 6, 7, the sink at 2.
    expected = sum(math.cos(w * d) for d in (3, 4, 5) for w in (1, 0.1, 0.01, 0.001)) / 12
    got = diagnostics.phase_concentration([5, 6, 7], 2, head_dim=16)
    assert got == pytest.approx(expected, rel=1e-14)
    assert diagnostics.phase_concentration([4], 4) == 1.0  # in phase with itself
    with pytest.raises(ValueError, match="query position"):
        diagnostics.phase_concentration([], 0)


def test_phase_concentration_peaks_where_lol_sees_collapse():
    """Absolute positions, the sink at 0, one query frame: the two highest local maxima past
    frame 120 are d = 132 (0.541) and d = 201 (0.544), LoL's collapse frames."""
    d = list(range(0, 1101))
    values = [diagnostics.phase_concentration([f], 0) for f in d]
    # by a plain loop over math.cos, not the module's vectorised form
    w = [10000 ** (-2 * k / 44) for k in range(22)]
    assert values[132] == pytest.approx(sum(math.cos(x * 132) for x in w) / 22, rel=1e-12)
    peaks = [
        (values[i], i)
        for i in range(121, len(d) - 1)
        if values[i - 1] < values[i] and values[i] > values[i + 1]
    ]
    (top, second) = sorted(peaks, reverse=True)[:2]
    assert (top[1], second[1]) == (201, 132)
    assert top[0] == pytest.approx(0.544, abs=5e-4)
    assert second[0] == pytest.approx(0.541, abs=5e-4)
    # the candidate rule finds them too, from blocks of one frame past frame 120
    found = diagnostics.phase_candidates(d, values, start=121)
    assert found.tolist() == [132, 201]


def plain_sink_distance(x: np.ndarray, sinks: int) -> list[float]:
    """min over the sink frames of the L2 distance, by loops over every value, over its median."""
    channels, frames, height, width = x.shape
    nearest = []
    for f in range(frames):
        best = math.inf
        for s in range(sinks):
            total = 0.0
            for c in range(channels):
                for h in range(height):
                    for w in range(width):
                        total += (float(x[c, f, h, w]) - float(x[c, s, h, w])) ** 2
            best = min(best, math.sqrt(total))
        nearest.append(best)
    rest = sorted(nearest[sinks:])
    n = len(rest)
    median = rest[n // 2] if n % 2 else (rest[n // 2 - 1] + rest[n // 2]) / 2
    return [math.nan if f < sinks else v / median for f, v in enumerate(nearest)]


def test_sink_distance_by_hand():
    # C = 1, H = 1, W = 2; frames (0,0) (3,4) (0,1) (6,8) (3,4): S = 1, distances to frame 0
    # are 0, 5, 1, 10, 5, median of frames >= 1 = (5 + 5) / 2 = 5.
    x = np.array([[[[0, 0]], [[3, 4]], [[0, 1]], [[6, 8]], [[3, 4]]]], dtype=np.float32)
    got = diagnostics.sink_distance(x, 1)
    assert got.dtype == np.float64
    # the sink frame itself: NaN (its distance 0 is no collapse)
    np.testing.assert_allclose(got, [np.nan, 1, 0.2, 2, 1], rtol=1e-15)
    # two sinks: frame f's nearest of frames 0 and 1: 0, 0, 1, 5, 0 -> median of 1, 5, 0 is 1
    np.testing.assert_allclose(diagnostics.sink_distance(x, 2), [np.nan, np.nan, 1, 5, 0])


def test_sink_distance_against_loops_in_chunks(monkeypatch):
    x = np.random.default_rng(3).normal(size=(3, 9, 2, 4)).astype(np.float32)
    monkeypatch.setattr(diagnostics, "_DISTANCE_CHUNK_VALUES", 50)  # two frames at a time
    for sinks in (1, 3):
        expected = plain_sink_distance(x, sinks)
        np.testing.assert_allclose(diagnostics.sink_distance(x, sinks), expected, rtol=1e-12)
    assert np.median(diagnostics.sink_distance(x, 3)[3:]) == pytest.approx(1.0)


def test_sink_distance_refusals_and_no_scale():
    x = np.zeros((1, 4, 1, 1))
    assert np.isnan(diagnostics.sink_distance(x, 1)).all()  # every frame equals the sink
    for sinks in (0, 4, 1.5):
        with pytest.raises(ValueError, match="sink_frames"):
            diagnostics.sink_distance(x, sinks)
    with pytest.raises(ValueError, match=r"\[C, F, H, W\]"):
        diagnostics.sink_distance(np.zeros((4, 1, 1)), 1)


def test_distance_candidates_one_per_dip_at_its_bottom():
    frames = list(range(12))
    distance = [0, 0, 0.3, 0.45, 0.4, 0.6, 1.0, 0.5, 0.3, 0.3, 1.1, 0.2]
    # frame 2 lies before the start; dips 3-4 (bottom 4), 7-9 (bottom 8, the first of two
    # 0.3), 11 (the rollout ends in it)
    got = diagnostics.distance_candidates(frames, distance, start=3)
    assert got.tolist() == [4, 8, 11]
    assert diagnostics.distance_candidates(frames, distance, start=3, threshold=0.35).tolist() == [
        8,
        11,
    ]
    # the order of the rows does not matter; a NaN is never low and splits a dip
    shuffled = np.random.default_rng(0).permutation(12)
    got = diagnostics.distance_candidates(
        np.array(frames)[shuffled], np.array(distance)[shuffled], start=3
    )
    assert got.tolist() == [4, 8, 11]
    distance[8] = math.nan
    assert diagnostics.distance_candidates(frames, distance, start=3).tolist() == [4, 7, 9, 11]


def test_phase_candidates_highest_local_maxima_past_start():
    first = [0, 3, 6, 9, 12, 15, 18, 21, 24, 27]
    phase = [1.0, 0.6, 0.7, 0.5, 0.8, 0.8, 0.4, 0.65, 0.3, 0.9]
    # maxima: 6 (0.7), the plateau 12-15 once (0.8), 21 (0.65); never the last block (27)
    no_margin = {"margin": -1.0}  # no level: every maximum counts
    assert diagnostics.phase_candidates(first, phase, start=6, **no_margin).tolist() == [6, 12]
    got = diagnostics.phase_candidates(first, phase, start=6, maxima=3, **no_margin)
    assert got.tolist() == [6, 12, 21]
    got = diagnostics.phase_candidates(first, phase, start=7, maxima=5, **no_margin)
    assert got.tolist() == [12, 21]
    # the margin: from block 6 on the median is (0.65 + 0.7) / 2 = 0.675, so a maximum needs
    # 0.775: only the plateau at 12; from 7 on the median is 0.65 + 0.1 = 0.75: the plateau again
    assert diagnostics.phase_candidates(first, phase, start=6).tolist() == [12]
    assert diagnostics.phase_candidates(first, phase, start=7, maxima=5).tolist() == [12]
    # a flat curve with ripples (sinks that move with the window) marks nothing
    ripple = [0.5, 0.52, 0.5, 0.52, 0.5, 0.52, 0.5]
    assert diagnostics.phase_candidates(range(7), ripple, start=0).tolist() == []
    assert diagnostics.phase_candidates(first, phase, start=100).tolist() == []
    both = diagnostics.collapse_candidates(
        list(range(30)), [1.0] * 29 + [0.1], first, phase, start=6, margin=-1.0
    )
    assert {k: v.tolist() for k, v in both.items()} == {
        "sink_distance": [29],
        "phase_concentration": [6, 12],
    }
    later = diagnostics.collapse_candidates(
        list(range(30)), [1.0] * 29 + [0.1], first, phase, start=6, phase_from=7, margin=-1.0
    )
    assert later["phase_concentration"].tolist() == [12, 21]


# --------------------------------------------------------------------------------------------
# the per-block table

T = 2  # tokens per latent frame of the test stores
BLOCK = 2  # frames per block
FRAMES = 8
HEADS = 3
STEPS = [(1000.0, "denoise"), (0.0, "cache")]
SINKS = 1  # closed_loop.sink_frames
RUN = ("demo", "cat")
# rollout -> (run keys but checkpoint and prompt, query positions of the blocks, sink positions,
# budget in frames or None for every frame)
ROLLOUTS = {
    # the full cache keeps every frame: no budget, no capacity (empty cells, as the job writes)
    "full": (("full", None, 0, 0, None, 0.0, 1.0), [0, 2, 4, 6], [0, 0, 0, 0], None),
    "deep_sink": (("deep_sink", 4, 1, 0, 4, 0.0, 1.0), [0, 2, 4, 6], [0, 0, 1, 3], 4),
    "head_jitter": (("head_jitter", 4, 0, 0, 4, 0.5, 1.0), [0, 2, 2, 2], [0, 0, 0, 0], 4),
}


def write_tables(folder: Path, name: str, seed: int) -> tuple[Path, Path, pd.DataFrame]:
    """A frame table and block positions of one rollout, where the workflow puts them."""
    keys, queries, sinks, _ = ROLLOUTS[name]
    run = folder / "closed_loop" / RUN[0] / RUN[1]
    run.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    frames = pd.DataFrame(
        [
            (*RUN, *keys, f, f // BLOCK, math.nan, math.nan, float(rng.uniform(0.2, 2)))
            for f in range(FRAMES)
        ],
        columns=FRAME_TABLE_COLUMNS,
    )
    frames.to_csv(run / f"{name}.csv", index=False)
    blocks = pd.DataFrame(
        [
            (*RUN, *keys, b, b * BLOCK, BLOCK, queries[b], sinks[b], 0)
            for b in range(FRAMES // BLOCK)
        ],
        columns=BLOCK_POSITION_COLUMNS,
    )
    blocks.to_csv(run / f"{name}.blocks.csv", index=False)
    return run / f"{name}.csv", run / f"{name}.blocks.csv", frames


def write_slot_store(path: Path, layer: int, budget: int | None, seed: int) -> xr.Dataset:
    """An attention store over cache slots as Contract 4 has it: per (step, head, query frame)
    the keys of the frames the cache holds (the last `budget` frames, or every one), T slots a
    frame in cache order, random softmax masses; empty slots -1 and NaN."""
    rng = np.random.default_rng(seed)
    slots = (budget or FRAMES) * T
    shape = (len(STEPS), HEADS, FRAMES, slots)
    mass = np.full(shape, np.nan, np.float32)
    owner = np.full(shape, -1, np.int32)
    for f in range(FRAMES):
        end = (f // BLOCK + 1) * BLOCK  # the block's queries see its own block
        held = list(range(max(0, end - budget) if budget else 0, end))
        keys = np.repeat(held, T)
        owner[:, :, f, : len(keys)] = keys
        weights = rng.gamma(0.3, size=(len(STEPS), HEADS, len(keys)))
        mass[:, :, f, : len(keys)] = weights / weights.sum(axis=-1, keepdims=True)
    dims = ("step", "head", "query_frame", "key_slot")
    ds = xr.Dataset(
        {
            "key_mass": (dims, mass),
            "key_logit_mean": (dims, np.zeros(shape, np.float32)),
            "slot_frame": (dims, owner),
            "slot_token": (dims, np.where(owner >= 0, 0, -1).astype(np.int32)),
            "slot_position": (dims, owner),
            "slot_kind": (dims, np.where(owner >= 0, 1, -1).astype(np.int8)),
            "entropy": (dims[:3], np.zeros(shape[:3], np.float32)),
        },
        coords={
            "step": np.arange(len(STEPS)),
            "head": np.arange(HEADS),
            "query_frame": np.arange(FRAMES),
            "key_slot": np.arange(slots),
            "timestep": ("step", np.array([t for t, _ in STEPS], np.float32)),
            "pass_kind": ("step", np.array([k for _, k in STEPS])),
        },
    )
    chunks = {"chunks": (1, HEADS, BLOCK, slots)}  # one pass call of one block, as written
    encoding = {name: chunks for name in ("key_mass", "slot_frame", "key_logit_mean")}
    ds.to_zarr(path, zarr_format=3, mode="w", consolidated=False, encoding=encoding)
    attrs = {"checkpoint": RUN[0], "prompt": RUN[1], "layer": layer, "key_axis": "slot"}
    attrs |= {"latent_grid": [FRAMES, 1, T], "frame_seq_length": T, "num_frames": FRAMES}
    mark_complete(path, {**attrs, "block_sizes": [BLOCK] * (FRAMES // BLOCK)})
    return ds


def plain_sink_shares(ds: xr.Dataset, sinks: int, threshold: float) -> dict:
    """(step, block) -> share of heads that are sinks by the statistics' definition, by loops:
    the mean over the block's frames of the summed key mass on slots of frames < sinks, over the
    mean of the sink frames' uniform share (sink frames held / frames held), reaches the
    threshold; a head that holds no sink frame is none."""
    mass, owner = ds["key_mass"].values, ds["slot_frame"].values
    shares = {}
    for step in range(len(STEPS)):
        for b in range(FRAMES // BLOCK):
            count = 0
            for head in range(HEADS):
                per_frame, uniform = [], []
                for f in range(b * BLOCK, (b + 1) * BLOCK):
                    total = 0.0
                    held = set()
                    for slot in range(mass.shape[-1]):
                        frame = int(owner[step, head, f, slot])
                        if frame >= 0:
                            held.add(frame)
                        if 0 <= frame < sinks:
                            total += float(mass[step, head, f, slot])
                    per_frame.append(total)
                    uniform.append(len([x for x in held if x < sinks]) / len(held))
                share = sum(uniform) / len(uniform)
                count += share > 0 and sum(per_frame) / len(per_frame) / share >= threshold
            # the first block sees only itself (the sinks among its frames): no share
            shares[(step, b)] = math.nan if b == 0 else count / HEADS
    return shares


def test_block_table_against_loops(tmp_path, monkeypatch):
    monkeypatch.setattr(block_table, "_READ_BYTES", 1)  # one chunk (block) a read
    frame_paths, block_paths, stores, expected_stores, frames = [], [], [], {}, {}
    for seed, name in enumerate(ROLLOUTS):
        frame_path, block_path, frames[name] = write_tables(tmp_path, name, seed)
        frame_paths.append(frame_path)
        block_paths.append(block_path)
        if name != "head_jitter":  # a rollout without stores
            for layer in (3, 1):
                store = frame_path.with_suffix("") / f"layer{layer}.zarr"
                budget = ROLLOUTS[name][3]
                expected_stores[(name, layer)] = write_slot_store(
                    store, layer, budget, seed + layer
                )
                stores.append(store)
    out = tmp_path / "closed_loop" / "blocks.csv"
    threshold = 2.0  # times the sink frames' uniform share
    returned = block_table.write_closed_loop_diagnostics(
        frame_paths, block_paths, stores, out, sink_frames=SINKS, sink_threshold=threshold
    )
    table = block_table.read_block_diagnostics(out)
    assert list(pd.read_csv(out).columns) == BLOCK_DIAGNOSTIC_COLUMNS
    pd.testing.assert_frame_equal(table, returned, check_dtype=False)
    # rows: full and deep_sink: 4 blocks x 2 layers x 2 steps; head_jitter: 4 blocks, no store
    assert list(table["policy"].drop_duplicates()) == ["full", "deep_sink", "head_jitter"]
    assert len(table) == 2 * 4 * 2 * 2 + 4
    # The sink share reads frame 0 alone (the statistics' sink definition), whatever SINKS is.
    plain = {key: plain_sink_shares(ds, 1, threshold) for key, ds in expected_stores.items()}
    seen_shares = set()
    # The full cache's empty budget and capacity stay empty in blocks.csv (NA once read).
    text = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert set(text[text["policy"] == "full"][["budget", "capacity"]].stack()) == {""}
    assert set(text[text["policy"] != "full"]["budget"]) == {"4"}
    assert table["budget"].dtype == "Int64" and table["capacity"].dtype == "Int64"
    for row in table.itertuples(index=False):
        keys, queries, sinks, _ = ROLLOUTS[row.policy]
        counts = (row.budget, row.sink_frames, row.recent_frames, row.capacity)
        assert (row.policy, *(None if pd.isna(c) else c for c in counts)) == keys[:5]
        assert (row.jitter, row.bias) == keys[5:]
        b = row.block
        assert (row.first_frame, row.frames) == (b * BLOCK, BLOCK)
        mine = frames[row.policy]
        own = [d for d in mine["sink_distance"][b * BLOCK : (b + 1) * BLOCK] if not math.isnan(d)]
        # blocks.csv holds 6 significant digits: 5e-6 of a value at most
        low = pytest.approx(min(own), rel=5e-6) if own else None
        assert row.sink_distance == low if own else math.isnan(row.sink_distance)
        w = [10000 ** (-2 * k / 44) for k in range(22)]
        phase = sum(math.cos(x * (queries[b] + i - sinks[b])) for i in range(BLOCK) for x in w) / (
            22 * BLOCK
        )
        assert row.phase_concentration == pytest.approx(phase, rel=5e-6)
        if row.policy == "head_jitter":
            assert pd.isna(row.layer) and pd.isna(row.step) and row.pass_kind == ""
            assert math.isnan(row.sink_share)
            continue
        expected = plain[(row.policy, row.layer)][(row.step, b)]
        assert row.sink_share == pytest.approx(expected, nan_ok=True)
        assert (row.timestep, row.pass_kind) == STEPS[row.step]
        seen_shares.add(row.sink_share)
    assert len(seen_shares) > 2  # the fixture tells the shares apart
    # sorted by run, block, layer, step
    full = table[table["policy"] == "full"]
    assert list(zip(full["block"], full["layer"], full["step"], strict=True))[:5] == [
        (0, 1, 0),
        (0, 1, 1),
        (0, 3, 0),
        (0, 3, 1),
        (1, 1, 0),
    ]


def test_without_sink_frames_the_first_block_is_the_sink(tmp_path):
    frame_path, block_path, _ = write_tables(tmp_path, "full", 0)
    store = frame_path.with_suffix("") / "layer0.zarr"
    ds = write_slot_store(store, 0, None, 5)
    table = block_table.write_closed_loop_diagnostics(
        [frame_path], [block_path], [store], tmp_path / "b.csv", sink_frames=0, sink_threshold=1.5
    )
    plain = plain_sink_shares(ds, 1, 1.5)  # frame 0, as with sink frames
    for row in table.itertuples(index=False):
        assert row.sink_share == pytest.approx(plain[(row.step, row.block)], nan_ok=True)
    # Block 0 sees only itself: every head would count as a sink (1.0 under any cache); no share.
    assert table[table["block"] == 0]["sink_share"].isna().all()
    assert table[table["block"] > 0]["sink_share"].notna().all()


def test_block_table_refusals_name_the_file(tmp_path):
    frame_path, block_path, frames = write_tables(tmp_path, "full", 0)
    out = tmp_path / "b.csv"
    stray = tmp_path / "elsewhere" / "layer0.zarr"
    write_slot_store(stray, 0, None, 1)
    with pytest.raises(ValueError, match=r"elsewhere/layer0\.zarr: no block-position table"):
        block_table.write_closed_loop_diagnostics(
            [frame_path], [block_path], [stray], out, sink_frames=1
        )
    twice = frame_path.with_suffix("") / "layer0.zarr"
    again = frame_path.with_suffix("") / "layerX.zarr"
    write_slot_store(twice, 0, None, 1)
    write_slot_store(again, 0, None, 2)
    with pytest.raises(ValueError, match="layer 0 is given twice"):
        block_table.write_closed_loop_diagnostics(
            [frame_path], [block_path], [twice, again], out, sink_frames=1
        )
    gap = tmp_path / "gap.blocks.csv"
    pd.read_csv(block_path).assign(first_frame=[0, 2, 5, 6]).to_csv(gap, index=False)
    with pytest.raises(ValueError, match=r"gap\.blocks\.csv: the blocks' first_frame"):
        block_table.read_block_tables([gap])
    # Only the full cache may leave its budget and capacity empty.
    unbounded = tmp_path / "unbounded.blocks.csv"
    pd.read_csv(block_path).assign(policy="window").to_csv(unbounded, index=False)
    with pytest.raises(ValueError, match=r"unbounded\.blocks\.csv: column budget .*full cache"):
        block_table.read_block_tables([unbounded])
    short = tmp_path / "short.blocks.csv"
    pd.read_csv(block_path).drop(columns="sink_position").to_csv(short, index=False)
    with pytest.raises(ValueError, match=r"short\.blocks\.csv.*'sink_position'"):
        block_table.read_block_tables(short)
    other = frame_path.with_name("other.csv")
    frames[frames["frame"] < 6].to_csv(other, index=False)
    with pytest.raises(ValueError, match="differ from its frame table"):
        block_table.write_closed_loop_diagnostics([other], [block_path], [], out, sink_frames=1)
    assert not out.exists()


def test_rollout_folders():
    assert block_table.rollout_folder("r/c/p/window.csv") == Path("r/c/p/window")
    assert block_table.rollout_folder("r/c/p/window.blocks.csv") == Path("r/c/p/window")
    assert block_table.rollout_folder("r/c/p/window/layer3.zarr") == Path("r/c/p/window")


def test_frame_tables_of_full_and_without_reference(tmp_path):
    """`full`'s frame table is read and gives no summary row; without a reference the summary's
    deviation columns are NaN; a policy without an offline one has no recall."""
    paths = [write_tables(tmp_path, name, seed)[0] for seed, name in enumerate(ROLLOUTS)]
    read = closed_loop.read_deviation(paths)
    assert set(read["policy"]) == set(ROLLOUTS) and read["rel_l2"].isna().all()
    summary = closed_loop.closed_loop_summary(read, pd.DataFrame(), 4)
    assert list(summary["policy"]) == ["deep_sink", "head_jitter"]
    assert summary[["rel_l2_mean", "cosine_mean", "rel_l2_last"]].isna().all().all()
    assert list(summary["evicting_from"]) == [4, 4]
    jitter = summary[summary["policy"] == "head_jitter"].iloc[0]
    assert jitter["offline_policy"] == "" and jitter["recall_rows"] == 0
    assert (jitter["jitter"], jitter["bias"]) == (0.5, 1.0)
    out = tmp_path / "summary.csv"
    closed_loop.write_closed_loop_summary(paths, [], out, 4)
    back = closed_loop.read_closed_loop_summary(out)
    assert back["offline_policy"].tolist() == ["sink_window", ""]
    assert (
        closed_loop.rollout_label("head_jitter", 4, 1, 0, 4, 0.5, 1.0)
        == "head_jitter B=4 S=1 j=0.5"
    )
    assert closed_loop.rollout_label("full", 0) == "full"


def _write_slot_store(path) -> np.ndarray:
    """A store over cache slots written by the GPU job's writer (`SlotStoreWriter`), frame 0 a
    sink; returns the sink mass per (step, head, query frame) it was given."""
    from sinkscope.extraction.attention_store import SlotStoreWriter

    rng = np.random.default_rng(7)
    attrs = {"checkpoint": RUN[0], "prompt": RUN[1], "layer": 4, "key_axis": "slot"}
    attrs |= {"latent_grid": [FRAMES, 1, T], "frame_seq_length": T, "num_frames": FRAMES}
    attrs["block_sizes"] = [BLOCK] * (FRAMES // BLOCK)
    expected = np.full((len(STEPS), HEADS, FRAMES), np.nan)
    with SlotStoreWriter(
        path,
        slots=3 * BLOCK * T,
        frames_per_block=BLOCK,
        num_heads=HEADS,
        num_frames=FRAMES,
        frame_seq_length=T,
        timesteps=[t for t, _ in STEPS],
        pass_kinds=[k for _, k in STEPS],
        attrs=attrs,
    ) as writer:
        for b in range(FRAMES // BLOCK):
            held = [0, *range(max(1, (b - 1) * BLOCK), (b + 1) * BLOCK)]  # frame 0 as a sink
            keys = np.repeat(held, T)
            for step in range(len(STEPS)):
                mass = rng.dirichlet(np.ones(len(keys)), size=(HEADS, BLOCK)).astype(np.float32)
                labels = {
                    "slot_frame": keys,
                    "slot_token": np.tile(np.arange(T), len(held)),
                    "slot_position": keys,
                    "slot_kind": np.zeros(len(keys), np.int8),
                }
                writer.write_slots(
                    step, b * BLOCK, mass, np.zeros((HEADS, BLOCK)), np.zeros_like(mass), labels
                )
                expected[step, :, b * BLOCK : (b + 1) * BLOCK] = mass[..., keys < 1].sum(-1)
    return expected


def test_sink_mass_of_a_store_the_closed_loop_writer_wrote(tmp_path):
    """The GPU job's writer (`SlotStoreWriter`): the sink mass read back per (step, head, query
    frame) is the sum of the masses it was given on the sink frames' keys."""
    path = tmp_path / "layer4.zarr"
    expected = _write_slot_store(path)
    got = block_table.store_sink_mass(path, 1)
    assert got.layer == 4 and list(got.pass_kind) == ["denoise", "cache"]
    np.testing.assert_allclose(got.mass, expected, rtol=1e-6)


@pytest.mark.parametrize("reader", ["store_sink_mass", "store_sink_own_mass"])
def test_a_flipped_byte_in_a_slot_store_names_the_store_variable_and_chunk(tmp_path, reader):
    """A flipped byte in one chunk of `key_mass` fails its crc32c: the closed-loop summary's
    readers name the store, the variable, the chunk and how to rebuild it (zarr alone says only
    "Stored and computed checksum do not match")."""
    from sinkscope.analysis import switches

    path = tmp_path / "layer4.zarr"
    _write_slot_store(path)
    chunk = sorted(p for p in (path / "key_mass" / "c").rglob("*") if p.is_file())[-1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x10
    chunk.write_bytes(bytes(data))
    read = {
        "store_sink_mass": lambda: block_table.store_sink_mass(path, 1),
        "store_sink_own_mass": lambda: switches.store_sink_own_mass(path, 1),
    }[reader]
    with pytest.raises(ValueError) as raised:
        read()
    message = str(raised.value)
    assert message.startswith(f"closed-loop store {path}: variable 'key_mass', chunk ")
    assert chunk.relative_to(path / "key_mass").as_posix() in message
    assert "re-run its closed loop" in message
