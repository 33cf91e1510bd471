"""What changes at a prompt switch (Contract 6; LongLive's interactive switches, Infinity-RoPE's
scenes): `results/closed_loop/switches.csv` (`tables.SWITCH_COLUMNS`) from the attention stores
over cache slots that the closed loop captured inside its rollouts, with their block positions.

Per (rollout, captured layer, captured pass, head, query block the pass captured): the mean over
the block's query frames of the mass on the sink frames (`sink_mass`: the keys its cache labels
`sink`, so after a LongLive recache without global_sink the frames the recache wrote into the
sink slots, and the diagnostics' sink frames, `closed_loop.sink_frames`, where a cache without
sinks still holds them, but for the block's own) and on the keys it labels `own` (`own_mass`:
the block's own frames; in a recache pass, the frames it re-encodes): no key counts for both,
so the two sum to at most 1. Beside them the block's prompt `segment` and its distance in
frames from the latest switch (`frames_since_switch`, nullable integers). The segments are the
block positions' (each block's `segment`, as the GPU job recorded it; a plain prompt's blocks
are all segment 0, as are those of a table from before switches), the switches the blocks where
it changes, which must be the store's `switch_frames` (none recorded: a plain prompt). Stores
are read a chunk's passes and a bounded run of query frames at a time (a chunk of the GPU job's
holds every pass of a block, so each is decompressed once), as `diagnostics.store_sink_mass`
bounds its reads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import zarr

from sinkscope.analysis.closed_loop import RUN_KEYS, run_key, typed_run_keys
from sinkscope.analysis.diagnostics import (
    read_block_tables,
    read_pass_table,
    rollout_folder,
    sink_frame_count,
)
from sinkscope.analysis.slots import is_slot_store
from sinkscope.analysis.stores import open_attention_store, read_region
from sinkscope.cache_choices import KEY_KIND
from sinkscope.frames import block_of_frame
from sinkscope.storage import decoded_attrs, write_csv
from sinkscope.tables import SWITCH_COLUMNS

_READ_BYTES = 64 << 20  # key_mass and slot_kind bytes read at once from a store


def store_sink_own_mass(path: str | os.PathLike, sink_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """The mass [step, head, query_frame] (float64) of the store over cache slots at `path` on
    the sink frames (the slots labelled `sink`, and those holding a frame below `sink_frames`:
    the first frames of a cache without sinks, as the collapse diagnostics count them) and on
    the own block (slots labelled `own`, and sink-labelled slots holding a frame of the query's
    own block: the first block's queries see their own frames in the sink slots, which is their
    own block whatever the cache calls it, so every policy counts them alike): nansums of
    `key_mass`, NaN where the pass saw no slot for the query frame. The two never share a slot,
    so they sum to at most 1. Reads the passes a chunk holds together (the GPU job's chunks hold
    every pass of a block: one decompression each) and a bounded run of query frames."""
    group = zarr.open_group(str(path), mode="r")
    block = block_of_frame(list(decoded_attrs(group.attrs)["block_sizes"]))
    key_mass, slot_kind, slot_frame = group["key_mass"], group["slot_kind"], group["slot_frame"]
    steps, heads, frames, slots = key_mass.shape
    passes = max(1, int(key_mass.chunks[0]))  # read together: a chunk decompresses whole
    chunk = max(1, int(key_mass.chunks[2]))
    item = key_mass.dtype.itemsize + slot_kind.dtype.itemsize + slot_frame.dtype.itemsize
    per_chunk = passes * heads * slots * item * chunk
    run = chunk * max(1, _READ_BYTES // max(per_chunk, 1))  # whole chunks
    sink, own = (np.full((steps, heads, frames), np.nan) for _ in range(2))
    for first_step in range(0, steps, passes):
        some = slice(first_step, min(first_step + passes, steps))
        for first in range(0, frames, run):
            rows = slice(first, min(first + run, frames))
            region = (some, slice(None), rows)
            values, kind, owner = (
                read_region(array, (*region, slice(None)), "closed-loop store", path, name)
                for name, array in (
                    ("key_mass", key_mass),
                    ("slot_kind", slot_kind),
                    ("slot_frame", slot_frame),
                )
            )
            values = np.where(np.isnan(values), values.dtype.type(0), values)
            seen = (owner >= 0).any(axis=-1)
            same_block = (owner >= 0) & (
                block[np.clip(owner, 0, None)] == block[rows][None, None, :, None]
            )
            is_own = (kind == KEY_KIND["own"]) | ((kind == KEY_KIND["sink"]) & same_block)
            is_sink = (
                (kind == KEY_KIND["sink"]) | ((owner >= 0) & (owner < sink_frames))
            ) & ~is_own
            for mass, chosen in ((sink, is_sink), (own, is_own)):
                total = np.where(chosen, values, 0).sum(axis=-1, dtype=np.float64)
                mass[some, :, rows] = np.where(seen, total, np.nan)
    return sink, own


def _block_means(mass: np.ndarray, first: int, count: int) -> np.ndarray:
    """[step, head]: the mean of `mass` over the block's query frames; NaN unless the pass
    captured every one of them."""
    with np.errstate(invalid="ignore"):
        return mass[:, :, first : first + count].mean(axis=-1)


def switch_starts(blocks: pd.DataFrame) -> list[int]:
    """The first frames of the blocks where a rollout's prompt segment changes: the switches, from
    rows of one rollout with `block`, `first_frame` and `segment` (its block positions,
    `read_block_tables`, or its rows of a table with several per block)."""
    blocks = blocks.drop_duplicates("block").sort_values("block")
    segment = blocks["segment"].to_numpy()
    changed = np.flatnonzero(segment[1:] != segment[:-1]) + 1
    return [int(frame) for frame in blocks["first_frame"].to_numpy()[changed]]


def shown_pass(rows: pd.DataFrame) -> tuple[int, str]:
    """The pass a rollout's switch panels show, of its rows of the switch table: its first
    captured denoising pass (t = 1000 by default), else its first pass; with its label."""
    passes = rows.drop_duplicates("step").sort_values("step")
    denoise = passes[passes["pass_kind"] == "denoise"]
    chosen = (denoise if not denoise.empty else passes).iloc[0]
    kind = str(chosen["pass_kind"])
    label = "cache pass (t=0)" if kind == "cache" else f"t={float(chosen['timestep']):g}"
    return int(chosen["step"]), label if kind != "recache" else "recache pass (t=0)"


def store_switch_rows(
    path: str | os.PathLike, blocks: pd.DataFrame, sink_frames: int = 0
) -> pd.DataFrame:
    """The `SWITCH_COLUMNS` rows of one store over cache slots of the rollout whose block
    positions are `blocks` (one rollout of `read_block_tables`); `sink_frames`: the
    diagnostics' sink frames (`diagnostics.sink_frame_count`: 0 is the first block's). Refuses,
    naming both, a store whose `switch_frames` are not where the blocks change segment."""
    ds = open_attention_store(path)
    if not is_slot_store(ds):
        raise ValueError(f"attention store {path}: its keys are not cache slots (key_axis)")
    attrs = decoded_attrs(ds)
    blocks = blocks.sort_values("block")
    switches = switch_starts(blocks)
    recorded = store_switch_frames(attrs)
    if recorded != switches:
        table = f" ({blocks['source'].iloc[0]})" if "source" in blocks else ""
        raise ValueError(
            f"attention store {path}: its switch_frames {recorded} are not the frames where its "
            f"rollout's block positions{table} change segment, {switches}"
        )
    first_block = int(blocks["frames"].iloc[0])
    sink, own = store_sink_own_mass(path, sink_frame_count(sink_frames, first_block))
    timestep = ds["timestep"].values.astype(np.float64)
    pass_kind = [str(kind) for kind in ds["pass_kind"].values]
    steps, heads, _ = sink.shape
    rows = []
    run = dict(zip(RUN_KEYS, run_key(blocks[RUN_KEYS].iloc[0]), strict=True))
    columns = ("block", "first_frame", "frames", "segment")
    for block, first, count, segment in zip(*(blocks[c] for c in columns), strict=True):
        if first + count > sink.shape[2]:
            raise ValueError(f"attention store {path}: block {block} is past its query frames")
        before = [switch for switch in switches if switch <= first]
        since = first - before[-1] if before else pd.NA
        sink_mass, own_mass = _block_means(sink, first, count), _block_means(own, first, count)
        for step in range(steps):
            for head in range(heads):
                if np.isnan(sink_mass[step, head]) and np.isnan(own_mass[step, head]):
                    continue  # the pass did not capture the block (a recache pass elsewhere)
                rows.append(
                    {
                        **run,
                        "layer": int(attrs["layer"]),
                        "step": step,
                        "timestep": float(timestep[step]),
                        "pass_kind": pass_kind[step],
                        "head": head,
                        "block": int(block),
                        "first_frame": int(first),
                        "frames": int(count),
                        "segment": int(segment),
                        "frames_since_switch": since,
                        "sink_mass": float(sink_mass[step, head]),
                        "own_mass": float(own_mass[step, head]),
                    }
                )
    return _typed(pd.DataFrame(rows, columns=SWITCH_COLUMNS))


def store_switch_frames(attrs: dict) -> list[int]:
    """The latent frames where a store's segments 1.. take effect (its `switch_frames`
    attribute, `decoded_attrs`); none for a plain prompt and a store from before switches."""
    return [int(frame) for frame in np.atleast_1d(attrs.get("switch_frames", []))]


def _typed(table: pd.DataFrame) -> pd.DataFrame:
    """`frames_since_switch`, and the full cache's empty budget and capacity, as nullable
    integers: written as whole numbers or empty."""
    table["frames_since_switch"] = table["frames_since_switch"].astype("Int64")
    return typed_run_keys(table)


def switch_table(
    block_tables: Sequence[str | os.PathLike],
    stores: Sequence[str | os.PathLike],
    sink_frames: int = 0,
) -> pd.DataFrame:
    """The switch table of the closed loop: `store_switch_rows` of every store (each belongs to
    the rollout whose folder holds it, `diagnostics.rollout_folder`), sorted by run, layer,
    pass, block and head. Refuses, naming it, a store of no given block table."""
    blocks = read_block_tables(list(block_tables)) if block_tables else None
    folders: dict[Path, pd.DataFrame] = {}
    if blocks is not None:
        for source, rollout in blocks.groupby("source", sort=False):
            folders[rollout_folder(source)] = rollout
    parts = []
    for store in stores:
        rollout = folders.get(rollout_folder(store))
        if rollout is None:
            raise ValueError(f"attention store {store}: no block-position table of its rollout")
        parts.append(store_switch_rows(store, rollout, sink_frames))
    empty = _typed(pd.DataFrame(columns=SWITCH_COLUMNS))
    table = pd.concat(parts, ignore_index=True) if parts else empty
    table = table.sort_values(
        [*RUN_KEYS, "layer", "step", "block", "head"], kind="stable", ignore_index=True
    )
    return table[SWITCH_COLUMNS]


def write_switch_table(
    block_tables: Sequence[str | os.PathLike],
    stores: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    sink_frames: int = 0,
) -> pd.DataFrame:
    """`switch_table`, written atomically as CSV to `out` (`results/closed_loop/switches.csv`);
    returns it."""
    table = switch_table(block_tables, stores, sink_frames)
    write_csv(out, table)
    return table


def read_switch_table(path: str | os.PathLike) -> pd.DataFrame:
    """`results/closed_loop/switches.csv` as `write_switch_table` wrote it (`frames_since_switch`
    nullable integers); refuses, naming the file, one that lacks a column."""
    return _typed(read_pass_table(path, SWITCH_COLUMNS, "closed-loop switch table").copy())
