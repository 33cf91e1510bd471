"""Reference-free collapse diagnostics of the closed loop (Contract 6; LoL's sink collapse): the
per-block table `results/closed_loop/blocks.csv` (`BLOCK_DIAGNOSTIC_COLUMNS`) from what the GPU
job writes per rollout, its full cache's included, with or without a full-cache reference:

- the frame table `{checkpoint}/{prompt}/{policy}.csv` (`FRAME_TABLE_COLUMNS`, read by
  `closed_loop.read_deviation`): `sink_distance` per latent frame (`sinkscope.diagnostics`);
- the block positions `{policy}.blocks.csv` (`BLOCK_POSITION_COLUMNS`, `read_block_tables`): per
  query block its first frame, frames, the temporal RoPE position of its first query frame (the
  others follow it) and that of the first sink frame (frame 0) as the cache holds it;
- the attention stores over cache slots `{policy}/layer{L}.zarr` (Contract 4, one per captured
  layer; `store_sink_mass`): the mass of each (pass, head, query frame) on the first frame
  (`SINK_SHARE_FRAMES`), the nansum of `key_mass` over the slots whose `slot_frame` is 0, and
  that frame's uniform share of the frames held, read one pass and a bounded run of query frames
  at a time (a 1,101-frame store never loads whole).

A store belongs to the rollout whose folder holds it: `X/{policy}/layer{L}.zarr` to the tables
`X/{policy}.csv` and `X/{policy}.blocks.csv`. The sink frames are the first S =
`closed_loop.sink_frames` latent frames, the same for every rollout of the table (the window's
too), or the first block's frames when S is 0.

Per (rollout, block) and, where stores were captured, per (layer, captured pass):
- `segment`: the prompt segment the block read (from the block positions);
- `sink_distance`: the lowest `sink_distance` of the block's frames;
- `phase_concentration` (`sinkscope.diagnostics.phase_concentration`): of the block's query
  positions query_position .. query_position + frames - 1 against sink_position;
- `sink_share` (LoL's diagnostic 2): the share of the layer's heads that are sinks by the
  statistics' one definition (`stats.is_sink` at `stats.sink_threshold`): whose mass on the
  first frame (frame 0, `SINK_SHARE_FRAMES`), averaged over the block's query frames, is at
  least the threshold times its uniform share (1 / the frames the query holds,
  `sink_frame_share`; a head whose cache no longer holds frame 0 is no sink); NaN where the
  pass did not capture the block (no slot seen), on the first block (it sees only its own
  frames, frame 0 among them) and on the rows of a rollout without stores (`layer`, `step`,
  `timestep`, `pass_kind` empty).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import zarr

from sinkscope.analysis.closed_loop import (
    RUN_KEYS,
    read_deviation,
    read_run_table,
    run_groups,
    run_rows,
    run_sort_key,
    typed_run_keys,
)
from sinkscope.analysis.slots import is_slot_store
from sinkscope.analysis.stats import SINK_THRESHOLD, is_sink
from sinkscope.analysis.stores import open_attention_store, read_region
from sinkscope.diagnostics import HEAD_DIM, phase_concentration
from sinkscope.storage import write_csv
from sinkscope.tables import BLOCK_DIAGNOSTIC_COLUMNS, BLOCK_POSITION_COLUMNS

BLOCKS_SUFFIX = ".blocks.csv"  # {policy}.blocks.csv beside the rollout's {policy}.csv
_BLOCK_INTEGERS = ["budget", "sink_frames", "recent_frames", "capacity"]
_BLOCK_INTEGERS += ["block", "first_frame", "frames", "query_position", "sink_position"]
_READ_BYTES = 64 << 20  # key_mass and slot_frame bytes read at once from a store
# The sink share reads the first frame alone, as the statistics' sink definition does: with S
# sink frames the mass on them could reach at most V / S times their share (3 of the 9 frames of
# the demo's sink_window: 3x, the default threshold, even with all of a head's mass on them).
SINK_SHARE_FRAMES = 1


def rollout_folder(path: str | os.PathLike) -> Path:
    """The folder of a rollout's stores: `X/{policy}` for its frame table `X/{policy}.csv`, its
    block positions `X/{policy}.blocks.csv` and a store `X/{policy}/layer{L}.zarr`."""
    path = Path(path)
    if path.suffix == ".zarr":
        return path.parent
    if path.name.endswith(BLOCKS_SUFFIX):
        return path.with_name(path.name.removesuffix(BLOCKS_SUFFIX))
    return path.with_suffix("")


def read_block_tables(paths: Iterable[str | os.PathLike] | str | os.PathLike) -> pd.DataFrame:
    """The block-position tables `paths` (`BLOCK_POSITION_COLUMNS`), stacked, with a `source`
    column (the file): counts integers, `jitter` and `bias` floats. Refuses, naming the file, a
    table that lacks a column, has no rows or a missing or fractional count, a block of one
    rollout twice, and blocks that do not follow each other (first_frame = the frames before)."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    tables = []
    for path in paths:
        # `segment` came with prompt switches: a table from before them read one prompt.
        required = [column for column in BLOCK_POSITION_COLUMNS if column != "segment"]
        table = read_run_table(
            path, required, "block-position table", _BLOCK_INTEGERS, optional=["segment"]
        )
        if "segment" not in table:
            table["segment"] = 0
        segment = pd.to_numeric(table["segment"], errors="coerce")
        if segment.isna().any() or (segment != np.round(segment)).any() or (segment < 0).any():
            raise ValueError(f"{path}: column segment must hold whole numbers >= 0")
        table["segment"] = segment.astype(np.int64)
        for _, run in run_groups(table):
            run = run.sort_values("block")
            if run["block"].duplicated().any():
                raise ValueError(f"{path}: a block of one rollout appears twice")
            frames = run["frames"].to_numpy()
            starts = np.concatenate([[0], np.cumsum(frames)[:-1]])
            if (frames < 1).any() or (run["first_frame"].to_numpy() != starts).any():
                raise ValueError(
                    f"{path}: the blocks' first_frame must follow their frames from 0 on"
                )
        tables.append(table)
    if not tables:
        raise ValueError("read_block_tables needs at least one block-position table")
    return pd.concat(tables, ignore_index=True)


def sink_frame_count(sink_frames: int, first_block_frames: int) -> int:
    """The sink frames of the diagnostics: `closed_loop.sink_frames`, or the first block's frames
    when it is 0."""
    if int(sink_frames) != sink_frames or sink_frames < 0:
        raise ValueError(f"sink_frames must be a whole number >= 0, got {sink_frames!r}")
    return int(sink_frames) if sink_frames > 0 else int(first_block_frames)


@dataclass(frozen=True)
class SinkMass:
    """The mass on the sink frames of one store: `mass` float64 [step, head, query_frame] (NaN
    where the pass saw no slot for that query frame), with each step's `timestep` and
    `pass_kind`, and the store's `layer`; `share` [step, head, query_frame]: the sink frames'
    uniform share of what the query frame saw (`sink_frame_share`; NaN where it saw nothing)."""

    layer: int
    mass: np.ndarray
    timestep: np.ndarray
    pass_kind: np.ndarray
    share: np.ndarray | None = None


def sink_frame_share(owner: np.ndarray, sink_frames: int) -> np.ndarray:
    """[...]: the uniform share of the sink frames 0 .. sink_frames - 1 among the key frames of
    `owner` [..., slot] (each slot's frame, -1 empty): the distinct sink frames held over the
    distinct frames held (every frame has the same number of tokens), as the statistics'
    1 / visible frames for one sink frame; NaN where no slot is held."""
    frames = np.sort(np.where(owner >= 0, owner, -1), axis=-1)
    new = np.ones(frames.shape, dtype=bool)
    new[..., 1:] = frames[..., 1:] != frames[..., :-1]
    distinct = new & (frames >= 0)
    held = distinct.sum(axis=-1)
    sinks = (distinct & (frames < sink_frames)).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(held > 0, sinks / held, np.nan)


def store_sink_mass(path: str | os.PathLike, sink_frames: int) -> SinkMass:
    """`SinkMass` of the attention store over cache slots at `path` (checked as
    `stores.open_attention_store` checks it): per (step, head, query frame) the nansum of
    `key_mass` over the slots whose `slot_frame` is in 0 .. sink_frames - 1. Reads one step and
    a run of query frames at a time (at most about 64 MB)."""
    ds = open_attention_store(path)
    if not is_slot_store(ds):
        raise ValueError(f"attention store {path}: its keys are not cache slots (key_axis)")
    layer = int(ds.attrs["layer"])
    timestep = ds["timestep"].values.astype(np.float64)
    pass_kind = np.array([str(kind) for kind in ds["pass_kind"].values], dtype=object)
    group = zarr.open_group(str(path), mode="r")
    key_mass, slot_frame = group["key_mass"], group["slot_frame"]
    steps, heads, frames, slots = key_mass.shape
    chunk = max(1, int(key_mass.chunks[2]))
    per_frame = heads * slots * (key_mass.dtype.itemsize + slot_frame.dtype.itemsize)
    run = chunk * max(1, _READ_BYTES // max(per_frame * chunk, 1))  # whole chunks
    mass = np.full((steps, heads, frames), np.nan)
    share = np.full((steps, heads, frames), np.nan)
    for step in range(steps):
        for first in range(0, frames, run):
            rows = slice(first, min(first + run, frames))
            region = (slice(step, step + 1), slice(None), rows, slice(None))
            kind, name = "closed-loop store", "key_mass"
            values = read_region(key_mass, region, kind, path, name)[0].astype(np.float64)
            owner = read_region(slot_frame, region, kind, path, "slot_frame")[0]
            seen = (owner >= 0).any(axis=-1)
            sink = (owner >= 0) & (owner < sink_frames) & ~np.isnan(values)
            total = np.where(sink, values, 0.0).sum(axis=-1)
            mass[step, :, rows] = np.where(seen, total, np.nan)
            share[step, :, rows] = sink_frame_share(owner, sink_frames)
    return SinkMass(layer, mass, timestep, pass_kind, share)


def block_sink_shares(
    mass: np.ndarray,
    first_frames: Sequence[int],
    frames: Sequence[int],
    sink_threshold: float,
    share: np.ndarray,
) -> np.ndarray:
    """[step, block]: the share of the heads whose sink `mass` [step, head, query_frame], averaged
    over the block's query frames (first_frames[b] .. + frames[b] - 1), over the sink frames'
    uniform `share` [step, head, query_frame] averaged alike, is a sink (`stats.is_sink` at
    `sink_threshold`; a head that sees no sink frame is none); NaN where no head has a value
    (a block the pass did not capture, or one past the store's frames) and for the first block
    (first frame 0): it sees nothing but its own frames, so its mass on the sinks says nothing
    of its heads."""
    steps, _, stored = mass.shape
    shares = np.full((steps, len(first_frames)), np.nan)
    for b, (first, count) in enumerate(zip(first_frames, frames, strict=True)):
        if first + count > stored or first == 0:
            continue
        block = mass[:, :, first : first + count]  # [step, head, frame]
        with np.errstate(invalid="ignore", divide="ignore"):
            per_head = block.mean(axis=-1)  # NaN where any frame is not captured
            uniform = share[:, :, first : first + count].mean(axis=-1)
            multiple = np.where(uniform > 0, per_head / uniform, 0.0)
        valid = ~np.isnan(per_head)
        sinks = (is_sink(np.where(valid, multiple, 0.0), sink_threshold) & valid).sum(axis=1)
        counted = valid.sum(axis=1)
        shares[:, b] = np.where(counted > 0, sinks / np.maximum(counted, 1), np.nan)
    return shares


def _run_text(key: tuple) -> str:
    return f"{key[0]}/{key[1]} {key[2]}"


def block_diagnostics(
    frame_table: pd.DataFrame,
    block_table: pd.DataFrame,
    masses: dict[tuple, list[SinkMass]],
    *,
    sink_threshold: float,
    head_dim: int = HEAD_DIM,
) -> pd.DataFrame:
    """The rows of `BLOCK_DIAGNOSTIC_COLUMNS` (module docstring) of every rollout of
    `block_table` (`read_block_tables`), with its frames in `frame_table` (`read_deviation`)
    and the sink masses of its captured layers in `masses` (run keys -> `SinkMass`es of the
    first frame, `SINK_SHARE_FRAMES`). Sorted by run (as the summary), block, layer and step."""
    rows = []
    runs = sorted(run_groups(block_table), key=lambda item: run_sort_key(item[0]))
    for key, blocks in runs:
        blocks = blocks.sort_values("block")
        source = blocks["source"].iloc[0] if "source" in blocks else "the block table"
        frames = frame_table[run_rows(frame_table, key)]
        if frames.empty:
            raise ValueError(f"{source}: rollout {_run_text(key)} has no frame table")
        by_block = frames.groupby("block").agg(
            first=("frame", "min"), count=("frame", "size"), low=("sink_distance", "min")
        )
        expected = blocks.set_index("block")[["first_frame", "frames"]]
        got = by_block.reindex(expected.index)
        if (
            len(by_block) != len(expected)
            or (got[["first", "count"]].to_numpy() != expected.to_numpy()).any()
        ):
            raise ValueError(
                f"{source}: the blocks of rollout {_run_text(key)} differ from its frame table's"
            )
        base = dict(zip(RUN_KEYS, key, strict=True))
        first_frames = blocks["first_frame"].to_numpy()
        counts = blocks["frames"].to_numpy()
        phases = [
            phase_concentration(q + np.arange(n), s, head_dim)
            for q, n, s in zip(
                blocks["query_position"], counts, blocks["sink_position"], strict=True
            )
        ]
        per_block = [
            {
                **base,
                "block": int(block),
                "first_frame": int(first),
                "frames": int(count),
                "segment": int(segment),
                "sink_distance": float(low),
                "phase_concentration": phase,
            }
            for block, first, count, segment, low, phase in zip(
                blocks["block"],
                first_frames,
                counts,
                blocks["segment"],
                got["low"],
                phases,
                strict=True,
            )
        ]
        stores = sorted(masses.get(key, []), key=lambda m: m.layer)
        if not stores:
            rows += [{**row, "pass_kind": "", "sink_share": np.nan} for row in per_block]
            continue
        shares = {
            m.layer: block_sink_shares(m.mass, first_frames, counts, sink_threshold, m.share)
            for m in stores
        }
        for b, row in enumerate(per_block):
            for m in stores:
                for step in range(m.mass.shape[0]):
                    rows.append(
                        {
                            **row,
                            "layer": m.layer,
                            "step": step,
                            "timestep": float(m.timestep[step]),
                            "pass_kind": str(m.pass_kind[step]),
                            "sink_share": float(shares[m.layer][step, b]),
                        }
                    )
    table = typed_run_keys(pd.DataFrame(rows, columns=BLOCK_DIAGNOSTIC_COLUMNS))
    for column in ("layer", "step"):
        table[column] = table[column].astype("Int64")
    table["pass_kind"] = table["pass_kind"].astype(object)
    return table.reset_index(drop=True)


def read_pass_table(path: str | os.PathLike, columns: Sequence[str], what: str) -> pd.DataFrame:
    """A closed-loop table of `columns` with the run keys and a `pass_kind` (`what` in
    messages): text columns stay text (an empty pass_kind empty text), the others numbers with
    empty cells NaN; refuses, naming the file, one that lacks a column."""
    text = ["checkpoint", "prompt", "policy", "pass_kind"]
    table = pd.read_csv(
        path,
        keep_default_na=False,
        na_values={c: ["", "nan", "NaN"] for c in columns if c not in text},
        dtype={column: str for column in text},
    )
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise ValueError(f"{path}: not a {what}, it lacks the columns {missing}")
    return table[list(columns)]


def read_block_diagnostics(path: str | os.PathLike) -> pd.DataFrame:
    """`results/closed_loop/blocks.csv` as `write_closed_loop_diagnostics` wrote it (an empty
    layer or step stays NA, an empty pass_kind empty text); refuses, naming the file, one that
    lacks a column."""
    table = read_pass_table(path, BLOCK_DIAGNOSTIC_COLUMNS, "closed-loop block table").copy()
    table = typed_run_keys(table)
    for column in ("layer", "step"):
        table[column] = table[column].astype("Int64")
    return table[BLOCK_DIAGNOSTIC_COLUMNS]


def write_closed_loop_diagnostics(
    frame_tables: Sequence[str | os.PathLike],
    block_tables: Sequence[str | os.PathLike],
    stores: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    sink_frames: int,
    sink_threshold: float = SINK_THRESHOLD,
    head_dim: int = HEAD_DIM,
) -> pd.DataFrame:
    """`block_diagnostics` of the closed loop's rollouts, written atomically as CSV to `out`
    (`results/closed_loop/blocks.csv`); returns it. `frame_tables`, `block_tables`: every
    rollout's `{policy}.csv` and `{policy}.blocks.csv`; `stores`: every captured attention store
    over cache slots `{policy}/layer{L}.zarr`, none for a rollout without one (module docstring).
    Refuses, naming it, a store of no given block table and a layer captured twice."""
    frames = read_deviation(list(frame_tables))
    blocks = read_block_tables(list(block_tables))
    folders: dict[Path, tuple] = {}
    for (source, *key), _ in run_groups(blocks, ["source", *RUN_KEYS]):
        folders[rollout_folder(source)] = tuple(key)
    sink_frame_count(sink_frames, 1)  # checked: the sink share reads frame 0 whatever S is
    masses: dict[tuple, list[SinkMass]] = {}
    for store in stores:
        key = folders.get(rollout_folder(store))
        if key is None:
            raise ValueError(f"attention store {store}: no block-position table of its rollout")
        mass = store_sink_mass(store, SINK_SHARE_FRAMES)
        if any(m.layer == mass.layer for m in masses.get(key, [])):
            raise ValueError(f"attention store {store}: layer {mass.layer} is given twice")
        masses.setdefault(key, []).append(mass)
    table = block_diagnostics(
        frames, blocks, masses, sink_threshold=sink_threshold, head_dim=head_dim
    )
    write_csv(out, table)
    return table
