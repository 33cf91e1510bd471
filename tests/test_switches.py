"""What changes at a prompt switch (`sinkscope.analysis.switches`, the `closed_loop_switches`
figure): the switch table from stores over cache slots written here by the GPU job's writer
(`SlotStoreWriter`: known masses and slot kinds, `switch_frames`, a recache pass holding only the
frames each recache re-encoded, the later one where two overlap) against sums by hand over what
was written, the store read in bounded runs, and the figure's switch lines where the switches
are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sinkscope.analysis import switches
from sinkscope.analysis.plots.closed_loop import plot_closed_loop_switches
from sinkscope.analysis.plots.common import save_figure
from sinkscope.analysis.switches import (
    read_switch_table,
    switch_starts,
    switch_table,
    write_switch_table,
)
from sinkscope.cache_choices import KEY_KIND
from sinkscope.tables import BLOCK_POSITION_COLUMNS, SWITCH_COLUMNS

RUN = ("demo_a", "story")
POLICIES = {  # policy -> run keys after the policy: a window of 6 frames, with 2 sinks or none
    "sink_window": (6, 2, 0, 6, 0.0, 1.0),
    "window": (6, 0, 0, 6, 0.0, 1.0),
}
FRAMES, BLOCK, T, HEADS = 12, 2, 3, 2
SINKS = 2  # closed_loop.sink_frames: the window's first frames count as sinks while it holds them
SWITCHES = [6, 10]
SEGMENTS = [0, 0, 0, 1, 1, 2]  # per block
STEPS = [(1000.0, "denoise"), (0.0, "cache"), (0.0, "recache")]
RECACHED = {6: range(2, 6), 10: range(4, 10)}  # switch -> the frames its recache re-encodes
ATTRS = {  # what the GPU job records of a prompt of segments
    "switch_frames": SWITCHES,
    "segments": [
        {"text": text, "start": start, "flush": False, "cut": None}
        for text, start in (("a cat", 0), ("a dog", 5), ("a bird", 9))
    ],
    "recache": True,
    "global_sink": False,
}


def rollout(folder: Path, policy: str) -> Path:
    return folder / "closed_loop" / RUN[0] / RUN[1] / policy


def write_positions(folder: Path, policy: str = "sink_window", segments=SEGMENTS) -> Path:
    path = rollout(folder, policy).with_suffix(".blocks.csv")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        (*RUN, policy, *POLICIES[policy], b, b * BLOCK, BLOCK, b * BLOCK, 0, segment)
        for b, segment in enumerate(segments)
    ]
    pd.DataFrame(rows, columns=BLOCK_POSITION_COLUMNS).to_csv(path, index=False)
    return path


def held_frames(policy: str, step_kind: str, first: int, frames: range) -> tuple[list, list]:
    """The frames a call's keys come from and their kinds, one slot per frame token."""
    sinks = [0, 1] if policy == "sink_window" else []
    if step_kind == "recache":
        held = [*sinks, *frames]
    else:
        end = first + BLOCK
        held = list(dict.fromkeys([*sinks, *range(max(0, end - 6 + len(sinks)), end)]))
    # the sinks' label wins over own, as the caches label them
    kinds = ["sink" if h in sinks else "own" if h in frames else "recent" for h in held]
    return held, kinds


def write_store(folder: Path, policy: str, layer: int, seed: int, attrs=ATTRS) -> tuple:
    """A store over slots written as the closed loop writes it (blocks in order, each switch's
    recache before the block it switches at). Returns the store and, per (step, head, query
    frame), the mass, frame and kind of every slot as they must end up in it."""
    from sinkscope.extraction.attention_store import SlotStoreWriter

    rng = np.random.default_rng(seed)
    slots = 8 * T
    mass = np.full((len(STEPS), HEADS, FRAMES, slots), np.nan)
    frame = np.full(mass.shape, -1)
    kind = np.full(mass.shape, -1)
    path = rollout(folder, policy) / f"layer{layer}.zarr"
    store_attrs = {"checkpoint": RUN[0], "prompt": RUN[1], "layer": layer, "key_axis": "slot"}
    store_attrs |= {"latent_grid": [FRAMES, 1, T], "frame_seq_length": T, "num_frames": FRAMES}
    store_attrs |= {"block_sizes": [BLOCK] * (FRAMES // BLOCK), **attrs}

    def call(writer, step: int, first: int, frames: range) -> None:
        held, kinds = held_frames(policy, STEPS[step][1], first, frames)
        keys = len(held) * T
        values = rng.gamma(0.5, size=(HEADS, len(frames), keys))
        values /= values.sum(axis=-1, keepdims=True)
        labels = {
            "slot_frame": np.repeat(held, T).astype(np.int32),
            "slot_token": np.tile(np.arange(T), len(held)).astype(np.int32),
            "slot_position": np.repeat(held, T).astype(np.int32),
            "slot_kind": np.repeat([KEY_KIND[k] for k in kinds], T).astype(np.int8),
        }
        entropy = np.zeros((HEADS, len(frames)))
        writer.write_slots(step, first, values.astype(np.float32), entropy, 0 * values, labels)
        rows = slice(frames[0], frames[-1] + 1)
        mass[step, :, rows] = np.nan
        mass[step, :, rows, :keys] = values.astype(np.float32)
        frame[step, :, rows] = -1
        frame[step, :, rows, :keys] = labels["slot_frame"]
        kind[step, :, rows, :keys] = labels["slot_kind"]

    with SlotStoreWriter(
        path,
        slots=slots,
        frames_per_block=BLOCK,
        num_heads=HEADS,
        num_frames=FRAMES,
        frame_seq_length=T,
        timesteps=[t for t, _ in STEPS],
        pass_kinds=[k for _, k in STEPS],
        attrs=store_attrs,
    ) as writer:
        for first in range(0, FRAMES, BLOCK):
            if first in RECACHED and attrs.get("recache"):
                call(writer, 2, RECACHED[first][0], RECACHED[first])
            for step in (0, 1):
                call(writer, step, first, range(first, first + BLOCK))
    return path, mass, frame, kind


def sums_by_hand(policy: str, layer: int, mass, frame, kind) -> dict:
    """(policy, layer, step, head, block) -> (sink mass, own mass) of every block a pass
    captured whole: per query frame the sums over its slots, then the mean over the block."""
    rows = {}
    for step in range(len(STEPS)):
        for head in range(HEADS):
            for b in range(FRAMES // BLOCK):
                per_frame = []
                for f in range(b * BLOCK, (b + 1) * BLOCK):
                    if (frame[step, head, f] < 0).all():
                        break  # not captured by this pass
                    sink = own = 0.0
                    for s in range(mass.shape[-1]):
                        k, owner = kind[step, head, f, s], frame[step, head, f, s]
                        # A sink slot holding a frame of the query's own block (the first
                        # block's own frames) is its own block, as under any other cache.
                        in_block = owner >= 0 and owner // BLOCK == b
                        if k == KEY_KIND["own"] or (k == KEY_KIND["sink"] and in_block):
                            own += mass[step, head, f, s]
                        elif k == KEY_KIND["sink"] or 0 <= owner < SINKS:
                            sink += mass[step, head, f, s]
                    per_frame.append((sink, own))
                else:
                    rows[policy, layer, step, head, b] = tuple(np.mean(per_frame, axis=0))
    return rows


def test_the_switch_table_is_the_sums_by_hand(tmp_path):
    stores, want = [], {}
    for policy, layer, seed in (("sink_window", 0, 1), ("sink_window", 3, 2), ("window", 0, 3)):
        path, *written = write_store(tmp_path, policy, layer, seed)
        stores.append(path)
        want |= sums_by_hand(policy, layer, *written)
    positions = [write_positions(tmp_path, policy) for policy in POLICIES]
    out = tmp_path / "switches.csv"
    written = write_switch_table(positions, stores, out, SINKS)
    table = read_switch_table(out)
    assert list(table.columns) == SWITCH_COLUMNS and len(table) == len(written)
    pd.testing.assert_frame_equal(table, written, check_dtype=False)
    got = {
        (r.policy, r.layer, r.step, r.head, r.block): (r.sink_mass, r.own_mass)
        for r in table.itertuples(index=False)
    }
    assert set(got) == set(want)
    for key, values in want.items():
        # switches.csv holds 6 significant digits: 5e-6 of a value at most
        np.testing.assert_allclose(got[key], values, rtol=5e-6, err_msg=str(key))
    assert (table["sink_mass"] + table["own_mass"] <= 1 + 1e-6).all()
    # A window without sinks: its first frames are the sinks while it holds them, but not for
    # the block that is those frames (its own), and not once they left the window.
    window = table[(table["policy"] == "window") & (table["step"] == 0) & (table["head"] == 0)]
    assert window["sink_mass"].iloc[0] == 0 and window["own_mass"].iloc[0] == pytest.approx(1)
    assert (window["sink_mass"].iloc[1:3] > 0).all() and (window["sink_mass"].iloc[3:] == 0).all()
    # The recache pass: only the blocks the recaches re-encoded (frames 2-5, then 4-9).
    recache = table[(table["pass_kind"] == "recache") & (table["layer"] == 0)]
    assert sorted(set(recache["block"])) == [1, 2, 3, 4]
    assert (recache["timestep"] == 0).all() and (recache["step"] == 2).all()
    rows = table[(table["policy"] == "sink_window") & (table["layer"] == 0)]
    rows = rows[(rows["step"] == 0) & (rows["head"] == 0)]
    assert rows["segment"].tolist() == SEGMENTS
    assert rows["frames_since_switch"].tolist()[3:] == [0, 2, 0]
    assert rows["frames_since_switch"].iloc[:3].isna().all()
    assert table["frames_since_switch"].dtype == "Int64"
    text = pd.read_csv(out, dtype=str, keep_default_na=False)["frames_since_switch"]
    assert set(text) == {"", "0", "2"}  # whole numbers, never 2.0
    assert (table["checkpoint"] == RUN[0]).all() and (table["prompt"] == RUN[1]).all()


class CountingArray:
    """A zarr array that records how many query frames each read asks for."""

    def __init__(self, array, reads: list):
        self.array, self.reads = array, reads
        self.shape, self.chunks, self.dtype = array.shape, array.chunks, array.dtype

    def __getitem__(self, key):
        rows = key[2]
        self.reads.append(rows.stop - rows.start)
        return self.array[key]


def test_the_first_block_counts_alike_under_every_cache(tmp_path):
    """The first block's queries see only their own frames, which a sink cache labels `sink`
    and a window `own`: on the same masses both give own mass 1 and sink mass 0 there (the
    sink cache used to give sink 1, own 0 on an identical rollout)."""
    got = {}
    for policy in ("sink_window", "window"):
        path, *_ = write_store(tmp_path, policy, 0, seed=5)
        sink, own = switches.store_sink_own_mass(path, SINKS)
        got[policy] = (sink[:2, :, :BLOCK], own[:2, :, :BLOCK])  # its denoise and cache passes
    for policy, (sink, own) in got.items():
        np.testing.assert_array_equal(sink, 0.0, err_msg=policy)
        np.testing.assert_allclose(own, 1.0, rtol=1e-6, err_msg=policy)


class CountedGroup(dict):
    """A store's arrays by name, with the group's attributes."""

    attrs: dict


def test_a_store_is_read_in_runs_of_whole_chunks(tmp_path, monkeypatch):
    path, *_ = write_store(tmp_path, "sink_window", 0, seed=4)
    positions = write_positions(tmp_path)
    whole = switch_table([positions], [path], SINKS)
    reads: list[int] = []
    open_group = switches.zarr.open_group

    def counting(*args, **kwargs):
        group = open_group(*args, **kwargs)
        counted = CountedGroup({name: CountingArray(group[name], reads) for name in group})
        counted.attrs = group.attrs
        return counted

    monkeypatch.setattr(switches.zarr, "open_group", counting)
    monkeypatch.setattr(switches, "_READ_BYTES", 1)  # one chunk of query frames at a time
    pd.testing.assert_frame_equal(switch_table([positions], [path], SINKS), whole)
    assert reads and max(reads) == BLOCK  # a chunk: never the whole store
    # one read per array and chunk, all passes at once (a chunk holds every pass of a block)
    assert len(reads) == 3 * FRAMES // BLOCK


def test_plain_prompts_old_tables_and_refusals(tmp_path):
    blocks = pd.DataFrame({"block": range(6), "first_frame": range(0, 12, 2), "segment": SEGMENTS})
    assert switch_starts(blocks) == SWITCHES
    plain = {}  # a plain prompt's store records no schedule
    positions = write_positions(tmp_path, segments=[0] * 6)
    store, *_ = write_store(tmp_path, "sink_window", 0, seed=1, attrs=plain)
    table = switch_table([positions], [store])
    assert (table["segment"] == 0).all() and table["frames_since_switch"].isna().all()
    assert set(table["pass_kind"]) == {"denoise", "cache"}  # no recache: its slot stays empty
    assert switch_table([positions], []).empty
    assert list(switch_table([positions], []).columns) == SWITCH_COLUMNS
    # Block positions from before prompt switches have no segment column: one prompt.
    old = pd.read_csv(positions).drop(columns="segment")
    old.to_csv(positions, index=False)
    assert (switch_table([positions], [store])["segment"] == 0).all()
    old.assign(segment=0.5).to_csv(positions, index=False)
    with pytest.raises(ValueError, match="column segment must hold whole numbers"):
        switch_table([positions], [store])
    with pytest.raises(ValueError, match="no block-position table of its rollout"):
        switch_table([], [store])
    # A store and block positions of different schedules: refused, naming both.
    write_positions(tmp_path)
    with pytest.raises(ValueError, match=r"switch_frames \[\] .*blocks.csv.* \[6, 10\]"):
        switch_table([positions], [store])


def test_the_figure_marks_the_switches_and_draws_every_head(tmp_path):
    positions = write_positions(tmp_path)
    store, *_ = write_store(tmp_path, "sink_window", 0, seed=0)
    table = switch_table([positions], [store], SINKS)
    fig = plot_closed_loop_switches(table)
    axes = fig.axes[:2]  # one (rollout, layer) row: sink mass, own mass
    for ax in axes:
        marks = [line.get_xdata()[0] for line in ax.lines if line.get_label() == "_switch"]
        assert marks == SWITCHES
        labels = [(text.get_text(), text.xy[0]) for text in ax.texts]
        assert labels == [("→1", 6), ("→2", 10)]
        heads = [line for line in ax.lines if line.get_label().startswith("L0H")]
        assert len(heads) == HEADS
        # the first captured denoising pass: step 0, every block
        assert heads[0].get_xdata().tolist() == list(range(0, FRAMES, BLOCK))
    first = table[(table["step"] == 0) & (table["head"] == 0)].sort_values("block")
    for ax, column in zip(axes, ("sink_mass", "own_mass"), strict=True):
        line = next(line for line in ax.lines if line.get_label() == "L0H0")
        np.testing.assert_allclose(line.get_ydata(), first[column])
    assert "t=1000" in axes[0].get_title(loc="left")
    assert "demo_a · story" in fig.get_suptitle()  # one run: named once
    assert "across the prompt switches" in fig.get_suptitle()
    assert "demo_a" not in axes[0].get_title(loc="left")
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    # heads named as everywhere (L0H0: the layer of every row), not "head 0"
    assert texts == ["L0H0", "L0H1", "switch (→ segment it starts)"]
    untitled = plot_closed_loop_switches(table, titles=False)
    assert "demo_a" not in untitled.get_suptitle()
    svg = save_figure(fig, tmp_path / "closed_loop_switches.svg")
    assert "→1" in svg.read_text() and "sink frames" in svg.read_text()
    # A run without switches: no "across the prompt switches", shorter rows.
    plain = plot_closed_loop_switches(table.assign(segment=0, frames_since_switch=np.nan))
    assert "across the prompt switches" not in plain.get_suptitle()
    assert plain.get_figheight() < fig.get_figheight()
    empty = plot_closed_loop_switches(table.iloc[:0])
    assert "no attention captured" in empty.axes[0].texts[0].get_text()
    assert save_figure(empty, tmp_path / "empty.svg").stat().st_size > 1000


def test_a_closed_loop_rollout_of_two_segments(tmp_path):
    """The GPU job's own outputs (a tiny model's LongLive rollout, window 4 with 2 sinks, a
    switch at frame 4 and its recache without global_sink): the stores' switch_frames are where
    the block positions change segment, and the recache rows are the blocks it re-encoded."""
    import torch

    from sinkscope.extraction.closed_loop import closed_loop
    from sinkscope.segments import Segment
    from sinkscope.wan.text import EncodedPrompt, save_prompt_segments

    from .conftest import make_tiny_model
    from .test_capture import _write_inputs

    video = {"num_frames": 8, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}
    _, settings = _write_inputs(tmp_path, video=video)
    cfg = make_tiny_model(seed=4).config
    g = torch.Generator().manual_seed(2)
    texts = [torch.randn(cfg.text_len, cfg.text_dim, generator=g) for _ in range(2)]
    prompt = tmp_path / "story.safetensors"
    segments = [Segment("first", 0), Segment("second", 3)]  # acts at the block at 4
    save_prompt_segments(prompt, [EncodedPrompt(t, 5, 5) for t in texts], segments)
    sampler = {"recache": True, "local_attn_size": 4, "sink_size": 2, "global_sink": False}
    settings["sampler"] |= sampler
    folder = rollout(tmp_path, "sink_window")
    folder.parent.mkdir(parents=True)
    closed_loop(
        checkpoint_name=RUN[0],
        prompt_name=RUN[1],
        prompt_embeddings=prompt,
        settings={**settings, "policy": {"name": "sink_window", "budget": 4, "sink_frames": 2}},
        latents_path=folder.with_suffix(".safetensors"),
        table_path=folder.with_suffix(".csv"),
        blocks_path=folder.with_suffix(".blocks.csv"),
        layers=[0],
        stores=[folder / "layer0.zarr"],
        progress=False,
    )
    table = switch_table([folder.with_suffix(".blocks.csv")], [folder / "layer0.zarr"], 2)
    first = table[table["step"] == 0].drop_duplicates("block")
    assert first["segment"].tolist() == [0, 0, 1, 1]
    assert first["frames_since_switch"].tolist()[2:] == [0, 2]
    assert sorted(set(table.loc[table["pass_kind"] == "recache", "block"])) == [0, 1]
    assert (table["sink_mass"] + table["own_mass"] <= 1 + 1e-6).all()
    assert ((table["sink_mass"] > 0) & (table["own_mass"] > 0)).any()


def test_the_full_cache_has_no_budget_in_the_switch_table(tmp_path, monkeypatch):
    """The full cache keeps every frame: its rows of switches.csv leave budget and capacity
    empty (NA once read; a 0 read as a cache of nothing), beside a window's 6, and the figure
    draws its row, named `full`."""
    monkeypatch.setitem(POLICIES, "full", (None, 0, 0, None, 0.0, 1.0))  # as the job writes it
    positions = [write_positions(tmp_path, policy) for policy in ("full", "window")]
    stores = [write_store(tmp_path, policy, 0, seed=7)[0] for policy in ("full", "window")]
    out = tmp_path / "switches.csv"
    write_switch_table(positions, stores, out, SINKS)
    text = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert set(text["policy"]) == {"full", "window"}
    for policy, budget in (("full", ""), ("window", "6")):
        rows = text[text["policy"] == policy]
        assert set(rows["budget"]) == set(rows["capacity"]) == {budget}, policy
    table = read_switch_table(out)
    assert table["budget"].dtype == "Int64" and table["capacity"].dtype == "Int64"
    assert table.loc[table["policy"] == "full", ["budget", "capacity"]].isna().all().all()
    fig = plot_closed_loop_switches(table)
    titles = [ax.get_title(loc="left") for ax in fig.axes[::2]]
    assert [title.split(" · ")[0] for title in titles] == ["full", "window B=6"]
