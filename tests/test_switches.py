"""What changes at a prompt switch (`sinkscope.analysis.switches`, the `closed_loop_switches`
figure): the switch table from stores over cache slots built here with xarray (known masses and
slot kinds, a recache pass holding only the frames it re-encoded) against plain loops, and the
figure's switch lines where the block positions put them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from sinkscope.analysis.plots.closed_loop import plot_closed_loop_switches
from sinkscope.analysis.switches import (
    read_switch_table,
    switch_starts,
    switch_table,
    write_switch_table,
)
from sinkscope.cache_choices import KEY_KIND
from sinkscope.storage import mark_complete
from sinkscope.tables import BLOCK_POSITION_COLUMNS, SWITCH_COLUMNS

RUN = ("demo_a", "story")
KEYS = ("sink_window", 6, 2, 0, 6, 0.0, 1.0)
FRAMES, BLOCK, T, HEADS = 12, 2, 3, 2
SEGMENTS = [0, 0, 0, 1, 1, 2]  # per block: switches at frames 6 and 10
STEPS = [(1000.0, "denoise"), (0.0, "cache"), (0.0, "recache")]
RECACHED = {6: range(2, 6), 10: range(6, 10)}  # switch -> the frames its recache re-encodes


def write_positions(folder: Path, segments=SEGMENTS) -> Path:
    path = folder / "closed_loop" / RUN[0] / RUN[1] / f"{KEYS[0]}.blocks.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        (*RUN, *KEYS, b, b * BLOCK, BLOCK, b * BLOCK, 0, segment)
        for b, segment in enumerate(segments)
    ]
    pd.DataFrame(rows, columns=BLOCK_POSITION_COLUMNS).to_csv(path, index=False)
    return path


def write_store(folder: Path, layer: int, seed: int) -> xr.Dataset:
    """A store over slots of a 6-frame window with 2 sinks: every pass of a query frame sees
    [sinks | its 4 newest frames], kinds sink, recent, own; the recache pass only the frames
    each recache re-encoded, its queries' own frames labelled own."""
    rng = np.random.default_rng(seed)
    slots = 6 * T
    shape = (len(STEPS), HEADS, FRAMES, slots)
    mass = np.full(shape, np.nan, np.float32)
    frame = np.full(shape, -1, np.int32)
    kind = np.full(shape, -1, np.int8)
    for step, (_, pass_kind) in enumerate(STEPS):
        for f in range(FRAMES):
            if pass_kind == "recache":
                span = next((r for r in RECACHED.values() if f in r), None)
                if span is None:
                    continue
                held = [0, 1, *span]
                own = set(span)
            else:
                end = (f // BLOCK + 1) * BLOCK
                held = list(dict.fromkeys([0, 1, *range(max(0, end - 4), end)]))
                own = set(range(end - BLOCK, end))
            for i, h in enumerate(held):
                frame[step, :, f, i * T : (i + 1) * T] = h
                code = "sink" if h < 2 else "own" if h in own else "recent"
                kind[step, :, f, i * T : (i + 1) * T] = KEY_KIND[code]
            weights = rng.gamma(0.5, size=(HEADS, len(held) * T))
            mass[step, :, f, : len(held) * T] = weights / weights.sum(axis=-1, keepdims=True)
    dims = ("step", "head", "query_frame", "key_slot")
    ds = xr.Dataset(
        {
            "key_mass": (dims, mass),
            "key_logit_mean": (dims, np.zeros(shape, np.float32)),
            "slot_frame": (dims, frame),
            "slot_token": (dims, np.where(frame >= 0, 0, -1).astype(np.int32)),
            "slot_position": (dims, frame),
            "slot_kind": (dims, kind),
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
    path = folder / "closed_loop" / RUN[0] / RUN[1] / KEYS[0] / f"layer{layer}.zarr"
    chunks = {"chunks": (1, HEADS, BLOCK, slots)}
    encoding = {name: chunks for name in ("key_mass", "slot_kind", "slot_frame")}
    ds.to_zarr(path, zarr_format=3, mode="w", consolidated=False, encoding=encoding)
    attrs = {"checkpoint": RUN[0], "prompt": RUN[1], "layer": layer, "key_axis": "slot"}
    attrs |= {"latent_grid": [FRAMES, 1, T], "frame_seq_length": T, "num_frames": FRAMES}
    mark_complete(path, {**attrs, "block_sizes": [BLOCK] * (FRAMES // BLOCK)})
    return ds


def plain_rows(ds: xr.Dataset, layer: int) -> dict:
    """(layer, step, head, block) -> (sink mass, own mass), by loops over slots."""
    mass, kind = ds["key_mass"].values, ds["slot_kind"].values
    rows = {}
    for step in range(len(STEPS)):
        for head in range(HEADS):
            for b in range(FRAMES // BLOCK):
                sums = {"sink": [], "own": []}
                for f in range(b * BLOCK, (b + 1) * BLOCK):
                    if (kind[step, head, f] < 0).all():
                        break
                    for name in sums:
                        code = KEY_KIND[name]
                        sums[name].append(
                            sum(
                                float(mass[step, head, f, s])
                                for s in range(mass.shape[-1])
                                if kind[step, head, f, s] == code
                            )
                        )
                else:
                    rows[layer, step, head, b] = tuple(
                        sum(v) / len(v) for v in (sums["sink"], sums["own"])
                    )
    return rows


def test_the_switch_table_is_the_plain_sums(tmp_path):
    positions = write_positions(tmp_path)
    stores = {layer: write_store(tmp_path, layer, seed=layer) for layer in (0, 3)}
    paths = [tmp_path / f"closed_loop/{RUN[0]}/{RUN[1]}/{KEYS[0]}/layer{n}.zarr" for n in stores]
    out = tmp_path / "switches.csv"
    written = write_switch_table([positions], paths, out)
    table = read_switch_table(out)
    assert list(table.columns) == SWITCH_COLUMNS and len(table) == len(written)
    want = {}
    for layer, ds in stores.items():
        want |= plain_rows(ds, layer)
    got = {
        (r.layer, r.step, r.head, r.block): (r.sink_mass, r.own_mass)
        for r in table.itertuples(index=False)
    }
    assert set(got) == set(want)
    for key, values in want.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-6, err_msg=str(key))
    # The recache pass: only the blocks each recache re-encoded (frames 2-5 and 6-9).
    recache = table[table["pass_kind"] == "recache"]
    assert sorted(set(recache["block"])) == [1, 2, 3, 4]
    rows = table[(table["layer"] == 0) & (table["step"] == 0) & (table["head"] == 0)]
    assert rows["segment"].tolist() == SEGMENTS
    since = rows["frames_since_switch"].tolist()
    assert np.isnan(since[:3]).all() and since[3:] == [0, 2, 0]
    assert (table["checkpoint"] == RUN[0]).all() and (table["policy"] == KEYS[0]).all()


def test_switch_starts_and_plain_prompts(tmp_path):
    blocks = pd.DataFrame({"block": range(6), "first_frame": range(0, 12, 2), "segment": SEGMENTS})
    assert switch_starts(blocks) == [6, 10]
    positions = write_positions(tmp_path, segments=[0] * 6)
    write_store(tmp_path, 0, seed=1)
    store = tmp_path / f"closed_loop/{RUN[0]}/{RUN[1]}/{KEYS[0]}/layer0.zarr"
    table = switch_table([positions], [store])
    assert (table["segment"] == 0).all() and table["frames_since_switch"].isna().all()
    assert switch_table([positions], []).empty
    # Block positions from before prompt switches have no segment column: one prompt.
    old = pd.read_csv(positions).drop(columns="segment")
    old.to_csv(positions, index=False)
    assert (switch_table([positions], [store])["segment"] == 0).all()
    old.assign(segment=0.5).to_csv(positions, index=False)
    with pytest.raises(ValueError, match="column segment must hold whole numbers"):
        switch_table([positions], [store])
    with pytest.raises(ValueError, match="no block-position table of its rollout"):
        switch_table([], [store])


def test_the_figure_marks_the_switches_and_draws_every_head(tmp_path):
    positions = write_positions(tmp_path)
    write_store(tmp_path, 0, seed=0)
    store = tmp_path / f"closed_loop/{RUN[0]}/{RUN[1]}/{KEYS[0]}/layer0.zarr"
    table = switch_table([positions], [store])
    fig = plot_closed_loop_switches(table)
    axes = fig.axes[:2]  # one (rollout, layer) row: sink mass, own mass
    for ax in axes:
        switches = [line.get_xdata()[0] for line in ax.lines if line.get_label() == "_switch"]
        assert switches == [6, 10]
        heads = [line for line in ax.lines if line.get_label().startswith("head")]
        assert len(heads) == HEADS
        # the first captured denoising pass: step 0, every block
        assert heads[0].get_xdata().tolist() == list(range(0, FRAMES, BLOCK))
    first = table[(table["step"] == 0) & (table["head"] == 0)].sort_values("block")
    sink_line = next(line for line in axes[0].lines if line.get_label() == "head 0")
    np.testing.assert_allclose(sink_line.get_ydata(), first["sink_mass"])
    assert "t=1000" in axes[0].get_title(loc="left")
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == ["head 0", "head 1", "switch (→ segment it starts)"]
    empty = plot_closed_loop_switches(table.iloc[:0])
    assert "no attention captured" in empty.axes[0].texts[0].get_text()
