"""What the attention explorer shows, gathered from the files the DAG made: per surveyed run the
statistics of every (layer, head, pass) and, per layer, a data file (frame maps, entropy, the
spatial map of frame 0's mass, key provenance); per closed-loop run the rollouts' per-frame
deviation, pixel and attention diagnostics, and the cache's contents per block.

Numbers a CSV also holds (the statistics) are carried at the CSV's 6 significant digits
(`storage.significant`), so the page prints the CSV's text; the maps are float16
(`explorer_sizes`: within 2^-11 relative). Torch-free."""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

from sinkscope import explorer_sizes
from sinkscope.analysis import stats
from sinkscope.analysis.closed_loop import (
    FULL,
    RUN_KEYS,
    policy_order,
    read_deviation,
    rollout_label,
)
from sinkscope.analysis.diagnostics import read_block_diagnostics
from sinkscope.analysis.plots.common import checkpoint_of, prompt_of, version_label
from sinkscope.analysis.plots.survey_data import (
    last_block_visible_frames,
    survey_runs,
    survey_statistics,
)
from sinkscope.analysis.plots.survey_maps import step_panel_title
from sinkscope.analysis.stores import open_attention_store, open_frame_dataset
from sinkscope.frames import evicting_frame, video_frames_of_latent
from sinkscope.storage import significant
from sinkscope.video_metrics import FPS, read_video_metrics

# The statistics columns the page shows (Contract 3's last-block prob_mass rows).
STAT_COLUMNS = ("first", "uniform_multiple", "recent_mass", "entropy")
# The pixel diagnostics the closed-loop view draws, per latent frame (mean of its pixel frames).
PIXEL_COLUMNS = ("flicker", "sink_distance", "ssim", "psnr", "colour_drift", "sharpness")
DEVIATION_SHOWN = ("rel_l2", "cosine", "sink_distance")
# The cache's contents are paged in this many blocks a file: the page loads the blocks the
# cursor is at, so a rollout of any length opens as fast as a short one.
CACHE_PAGE_BLOCKS = 32


@dataclass
class Chunk:
    """One data file of the page: `name` (its path under data/, without .js) and its payload."""

    name: str
    payload: dict


def float16(values) -> str:
    """float16, little-endian, base64: how the page carries every map (`explorer_sizes`)."""
    return base64.b64encode(np.asarray(values, dtype="<f2").tobytes()).decode("ascii")


def numbers(values) -> list:
    """A column as JSON numbers at the CSV's 6 significant digits; NaN, and the inf a PSNR of
    identical frames has, as null (JSON has neither): a gap in the page's plots."""
    rounded = significant(np.asarray(values, dtype=float))
    return [float(v) if np.isfinite(v) else None for v in rounded]


def _ints(values) -> list[int]:
    return [int(v) for v in np.asarray(values).ravel()]


# --------------------------------------------------------------------------------------------
# surveyed runs


def _pooled(images: np.ndarray, factor: int) -> np.ndarray:
    """[..., H', W'] averaged over factor x factor cells (the edge cells over what they hold)."""
    if factor == 1:
        return images
    *lead, height, width = images.shape
    rows, cols = -(-height // factor), -(-width // factor)
    padded = np.full((*lead, rows * factor, cols * factor), np.nan)
    padded[..., :height, :width] = images
    cells = padded.reshape(*lead, rows, factor, cols, factor)
    with np.errstate(invalid="ignore"):
        count = np.isfinite(cells).sum(axis=(-3, -1))
        total = np.nansum(cells, axis=(-3, -1))
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def spatial_multiples(store: xr.Dataset, ds: xr.Dataset) -> tuple[np.ndarray, int]:
    """[step, head, rows, cols]: where in latent frame 0 each head's last block attends, each
    token's mass (averaged over the block's query frames, `stats.query_profile`) in multiples of
    its uniform share (1 / the key tokens the block sees), as the survey's spatial figure draws
    it, pooled by `explorer_sizes.spatial_pool`; and the factor."""
    tokens = int(store.attrs["frame_seq_length"])
    _, height, width = (int(n) for n in store.attrs["latent_grid"])
    rows = stats.last_block_rows(ds)
    queries = ds["query_frame"].values[rows]
    mass = store["key_mass"].sel(query_frame=queries).isel(key_token=slice(0, tokens))
    mass = mass.transpose("step", "head", "query_frame", "key_token").values
    image = stats.query_profile(mass, range(len(queries)))  # [step, head, tokens]
    profile = stats.query_profile(
        ds["prob_mass"].transpose("step", "head", "query_frame", "key_frame").values, rows
    )
    visible = np.isfinite(profile).sum(axis=-1) * tokens  # [step, head]
    image = image * visible[..., None]
    factor = explorer_sizes.spatial_pool(height, width)
    return _pooled(image.reshape(*image.shape[:2], height, width), factor), factor


def layer_chunk(ds: xr.Dataset, store: xr.Dataset | None) -> dict:
    """One layer's data file: per pass the (query, key) frame pairs it saw (`seen`, uint8 0/1,
    base64) and every head's prob_mass on those pairs in row-major order (float16), the entropy
    per (pass, head, query frame), key provenance codes where the store has them, and the
    pooled spatial map of frame 0's mass where an attention store is given."""
    mass = ds["prob_mass"].transpose("step", "head", "query_frame", "key_frame").values
    seen = np.isfinite(mass).any(axis=1)  # [step, query, key]: what any head saw
    values = np.concatenate([mass[s][:, seen[s]].ravel() for s in range(mass.shape[0])])
    payload = {
        "heads": _ints(ds["head"].values),
        "seen": base64.b64encode(seen.astype(np.uint8).tobytes()).decode("ascii"),
        "prob_mass": float16(values),
        "entropy": float16(ds["entropy"].transpose("step", "head", "query_frame").values),
    }
    if "key_version" in ds:
        versions = ds["key_version"].transpose("step", "query_frame", "key_frame").values
        payload["key_version"] = base64.b64encode(versions.astype(np.int8).tobytes()).decode()
    if store is not None:
        spatial, factor = spatial_multiples(store, ds)
        payload["spatial"] = float16(spatial)
        payload["spatial_shape"] = list(spatial.shape[-2:])
        payload["spatial_pool"] = factor
    return payload


def _version_labels(layers: dict[int, xr.Dataset]) -> dict[str, str]:
    labels = {}
    for ds in layers.values():
        if "key_version" in ds:
            for code in np.unique(ds["key_version"].values):
                labels.setdefault(str(int(code)), version_label(ds, int(code)))
    return labels


def run_entry(
    layers: dict[int, xr.Dataset],
    stores: dict[int, xr.Dataset],
    *,
    sink_threshold: float,
    recent_threshold: float,
) -> tuple[dict, list[Chunk]]:
    """The index entry of one surveyed run and its layers' data files."""
    first = next(iter(layers.values()))
    checkpoint, prompt = checkpoint_of(first), prompt_of(first)
    table = survey_statistics(
        list(layers.values()), sink_threshold=sink_threshold, recent_threshold=recent_threshold
    )
    table = table.sort_values(["layer", "head", "step"], kind="stable")
    steps = [int(s) for s in first["step"].values]
    heads = sorted({int(h) for ds in layers.values() for h in ds["head"].values})
    blocks = _ints(first["block"].values)
    chunks, files = [], {}
    for layer, ds in layers.items():
        name = f"runs/{checkpoint}/{prompt}/layer{layer}"
        chunks.append(Chunk(name, layer_chunk(ds, stores.get(layer))))
        files[str(layer)] = name
    entry = {
        "checkpoint": checkpoint,
        "prompt": prompt,
        "prompt_text": str(first.attrs.get("prompt_text", "")),
        "layers": list(layers),
        "heads": heads,
        "steps": [{"step": step, "label": step_panel_title(first, step)} for step in steps],
        "frames": int(first.sizes["query_frame"]),
        "blocks": blocks,
        "visible_frames": last_block_visible_frames(list(layers.values())),
        "files": files,
        "versions": _version_labels(layers),
        "statistics": {
            "layer": _ints(table["layer"]),
            "head": _ints(table["head"]),
            "step": _ints(table["step"]),
            **{column: numbers(table[column]) for column in STAT_COLUMNS},
            "head_class": [str(c) if isinstance(c, str) else "" for c in table["head_class"]],
        },
    }
    return entry, chunks


def surveyed_runs(
    frame_paths: Sequence[str | os.PathLike],
    attention_paths: Sequence[str | os.PathLike] = (),
    *,
    sink_threshold: float = stats.SINK_THRESHOLD,
    recent_threshold: float = stats.RECENT_THRESHOLD,
) -> tuple[list[dict], list[Chunk]]:
    """Every run of the frame datasets `frame_paths`, its layers sorted; an attention store of
    `attention_paths` gives its layer the spatial map (a store whose run or layer has no frame
    dataset is refused, named)."""
    datasets = [open_frame_dataset(path) for path in frame_paths]
    runs = survey_runs(datasets)
    stores: dict[tuple[str, str], dict[int, xr.Dataset]] = {}
    for path in attention_paths:
        store = open_attention_store(path)
        run = (str(store.attrs["checkpoint"]), str(store.attrs["prompt"]))
        layer = int(store.attrs["layer"])
        if run not in runs or layer not in runs[run]:
            raise ValueError(f"attention store {path} has no frame dataset of its run and layer")
        stores.setdefault(run, {})[layer] = store
    entries, chunks = [], []
    for run, layers in runs.items():
        entry, files = run_entry(
            layers,
            stores.get(run, {}),
            sink_threshold=sink_threshold,
            recent_threshold=recent_threshold,
        )
        entries.append(entry)
        chunks.extend(files)
    return entries, chunks


# --------------------------------------------------------------------------------------------
# closed loops


def cache_contents(
    path: str | os.PathLike, first_frames: Sequence[int]
) -> tuple[list[list[list]], dict[str, str]]:
    """Per block (its first query frame in `first_frames`), what the cache held at the first
    captured pass for head 0: [key frame, slot kind, share of the frame's tokens held], from a
    store over the cache's slots (Contract 4, `key_axis: slot`); and the slot kinds' names by
    code (`flag_values`, `flag_meanings`). Reads those query frames only: linear in the
    video's length."""
    store = open_attention_store(path)
    tokens = int(store.attrs["frame_seq_length"])
    picked = {"step": 0, "head": 0, "query_frame": list(first_frames)}
    frames = store["slot_frame"].isel(picked).values
    kinds = store["slot_kind"].isel(picked).values
    contents = []
    for block_frames, block_kinds in zip(frames, kinds, strict=True):
        held = block_frames >= 0
        pairs, counts = np.unique(
            np.stack([block_frames[held], block_kinds[held]]), axis=1, return_counts=True
        )
        shares = significant(counts / tokens)
        contents.append(
            [
                [int(frame), int(kind), float(share)]
                for (frame, kind), share in zip(pairs.T, shares, strict=True)
            ]
        )
    attrs = store["slot_kind"].attrs
    values = np.atleast_1d(attrs.get("flag_values", []))
    meanings = str(attrs.get("flag_meanings", "")).split()
    return contents, {str(int(v)): name for v, name in zip(values, meanings, strict=False)}


def _per_latent_frame(rows: pd.DataFrame, column: str, frames: np.ndarray) -> list:
    means = rows.groupby("latent_frame")[column].mean()
    return numbers(means.reindex(frames).to_numpy(dtype=float))


def closed_loop_entry(
    checkpoint: str,
    prompt: str,
    deviation: pd.DataFrame,
    *,
    blocks: pd.DataFrame | None,
    metrics: pd.DataFrame | None,
    slot_stores: dict[str, str | os.PathLike],
    videos: dict[str, str | os.PathLike],
) -> tuple[dict, list[Chunk], dict[str, Path]]:
    """One closed-loop run: its index entry (rollouts, labels, videos), its data files (the
    per-frame series; the cache's contents, `CACHE_PAGE_BLOCKS` blocks a file) and the videos
    to link (page path -> file)."""
    rollouts = sorted(set(deviation["policy"]), key=lambda p: (p != FULL, policy_order(p)))
    entry_rollouts, series, links = [], {}, {}
    kind_names: dict[str, str] = {}
    cached: dict[str, dict[int, list]] = {}  # rollout -> block -> contents
    frames_all = np.sort(deviation["frame"].unique())
    for rollout in rollouts:
        rows = deviation[deviation["policy"] == rollout].sort_values("frame")
        frame = rows["frame"].to_numpy()
        key = rows.iloc[0]
        capacity = key["capacity"]
        start = (
            None
            if pd.isna(capacity)
            else evicting_frame(frame, rows["block"].to_numpy(), int(capacity))
        )
        label = rollout_label(
            rollout,
            *(0 if pd.isna(key[c]) else int(key[c]) for c in RUN_KEYS[3:7]),
            jitter=float(key["jitter"]),
            bias=float(key["bias"]),
        )
        data: dict = {"frame": _ints(frame), "block": _ints(rows["block"])}
        for column in DEVIATION_SHOWN:
            data[column] = numbers(rows[column])
        if metrics is not None:
            pixel = metrics[metrics["rollout"] == rollout]
            if not pixel.empty:
                data["pixel"] = {c: _per_latent_frame(pixel, c, frame) for c in PIXEL_COLUMNS}
        if blocks is not None:
            mine = blocks[(blocks["policy"] == rollout) & blocks["sink_share"].notna()]
            if not mine.empty:
                share = mine.groupby("block")["sink_share"].mean()
                data["sink_share"] = numbers(share.reindex(rows["block"]).to_numpy(dtype=float))
        if rollout in slot_stores:
            starts = rows.groupby("block")["frame"].min().sort_index()
            contents, names = cache_contents(slot_stores[rollout], starts.to_numpy())
            cached[rollout] = dict(zip(_ints(starts.index), contents, strict=True))
            kind_names.update(names)
        video = None
        if rollout in videos:
            video = f"videos/{checkpoint}/{prompt}/{rollout}.mp4"
            links[video] = Path(videos[rollout])
        series[rollout] = data
        entry_rollouts.append(
            {
                "rollout": rollout,
                "label": label,
                "evicting_from": start,
                "video": video,
            }
        )
    name = f"closed_loop/{checkpoint}/{prompt}"
    pages: dict[int, dict[str, dict[str, list]]] = {}
    for rollout, by_block in cached.items():
        for block, contents in by_block.items():
            page = pages.setdefault(block // CACHE_PAGE_BLOCKS, {})
            page.setdefault(rollout, {})[str(block)] = contents
    chunks = [Chunk(name, series)]
    chunks += [Chunk(f"{name}/cache{page}", pages[page]) for page in sorted(pages)]
    entry = {
        "checkpoint": checkpoint,
        "prompt": prompt,
        "frames": int(frames_all.max()) + 1,
        "rollouts": entry_rollouts,
        "file": name,
        "slot_kinds": kind_names,
        "cached": sorted(cached, key=lambda r: [x["rollout"] for x in entry_rollouts].index(r)),
        "cache_page_blocks": CACHE_PAGE_BLOCKS,
        "fps": FPS,
        # the pixel frame the cursor shows for latent frame f: the last it decodes to
        "shown_pixel": [
            video_frames_of_latent(int(f))[-1] for f in range(int(frames_all.max()) + 1)
        ],
    }
    return entry, chunks, links


def closed_loop_runs(
    deviation_paths: Sequence[str | os.PathLike],
    *,
    blocks_path: str | os.PathLike | None = None,
    metrics_paths: Sequence[str | os.PathLike] = (),
    slot_paths: Sequence[str | os.PathLike] = (),
    video_paths: Sequence[str | os.PathLike] = (),
) -> tuple[list[dict], list[Chunk], dict[str, Path]]:
    """Every closed-loop run of the deviation tables `deviation_paths` (`{rollout}.csv`),
    with blocks.csv's attention diagnostics, the runs' video metrics, the stores over slots
    (`results/closed_loop/{c}/{p}/{rollout}/layer{L}.zarr`, the lowest layer of a rollout
    used) and the videos (`results/videos/{c}/{p}/{rollout}.mp4`) where given."""
    if not deviation_paths:
        return [], [], {}
    deviation = read_deviation(deviation_paths)
    blocks = read_block_diagnostics(blocks_path) if blocks_path else None
    metrics = read_video_metrics(metrics_paths) if metrics_paths else None
    slots: dict[tuple[str, str, str], tuple[int, str]] = {}
    for path in slot_paths:
        path = Path(path)
        layer = int(path.stem.removeprefix("layer"))
        key = (path.parents[2].name, path.parents[1].name, path.parent.name)
        if key not in slots or layer < slots[key][0]:
            slots[key] = (layer, str(path))
    videos = {(Path(p).parents[1].name, Path(p).parent.name, Path(p).stem): p for p in video_paths}
    entries, chunks, links = [], [], {}
    for (checkpoint, prompt), rows in deviation.groupby(["checkpoint", "prompt"], sort=False):
        entry, files, linked = closed_loop_entry(
            str(checkpoint),
            str(prompt),
            rows,
            blocks=None
            if blocks is None
            else blocks[(blocks["checkpoint"] == checkpoint) & (blocks["prompt"] == prompt)],
            metrics=None
            if metrics is None
            else metrics[(metrics["checkpoint"] == checkpoint) & (metrics["prompt"] == prompt)],
            slot_stores={
                r: path for (c, p, r), (_, path) in slots.items() if (c, p) == (checkpoint, prompt)
            },
            videos={
                r: path for (c, p, r), path in videos.items() if (c, p) == (checkpoint, prompt)
            },
        )
        entries.append(entry)
        chunks.extend(files)
        links.update(linked)
    return entries, chunks, links
