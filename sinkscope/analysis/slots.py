"""Attention stores over cache slots (Contract 4, a closed loop's): their key-frame view.

A store over slots keeps, per (pass, head, query frame), the keys the queries saw in the cache's
order, each labelled with the latent frame it came from (`slot_frame`, -1 for an empty slot).
The key-frame view sums `key_mass` over the slots of each key frame (`prob_mass`) and averages
`key_logit_mean` over them (`logit_mean`: for a whole frame, the pooled mean logit of today's
stores; for the tokens a policy chose, the mean over those); NaN where a frame was not visible.
A frame held twice (Rolling-Sink's replays) counts once with both slots. Read a block of query
frames at a time: the view costs (passes x heads x frames^2), the store never loads whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr
import zarr

SLOT_DIMS = ("step", "head", "query_frame", "key_slot")
SLOT_LABELS = ("slot_frame", "slot_token", "slot_position", "slot_kind")
SLOT_ARRAYS = ("key_mass", "key_logit_mean", *SLOT_LABELS)


def is_slot_store(ds: xr.Dataset) -> bool:
    """Whether an attention store's key axis is the cache's slots (else every video token)."""
    return ds.attrs.get("key_axis") == "slot"


def check_slot_store(kind: str, path: Path, ds: xr.Dataset, num_frames: int) -> None:
    """Every slot array over SLOT_DIMS with one query frame per frame of the video."""
    for name in SLOT_ARRAYS:
        if name not in ds.variables:
            raise ValueError(f"{kind} {path}: missing array {name!r} of a store over slots")
        if tuple(ds[name].dims) != SLOT_DIMS:
            raise ValueError(
                f"{kind} {path}: {name} has dims {ds[name].dims}, expected {SLOT_DIMS}"
            )
    if ds.sizes["query_frame"] != num_frames:
        raise ValueError(
            f"{kind} {path}: query_frame has {ds.sizes['query_frame']} entries, expected "
            f"num_frames={num_frames}"
        )


def frame_view(path: Path, num_frames: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(prob_mass, logit_mean) [step, head, query_frame, key_frame] float32 of a store over
    slots, one chunk of query frames at a time, and `key_version` [step, query_frame, key_frame]
    (head 0's slots; None for a store without `slot_version`)."""
    group = zarr.open_group(str(path), mode="r")
    key_mass, logits, frames = (
        group[name] for name in ("key_mass", "key_logit_mean", "slot_frame")
    )
    steps, heads, queries, _ = key_mass.shape
    prob_mass = np.full((steps, heads, queries, num_frames), np.nan, np.float32)
    logit_mean = np.full_like(prob_mass, np.nan)
    has_versions = "slot_version" in group
    versions = np.full((steps, queries, num_frames), -1, np.int8) if has_versions else None
    chunk = key_mass.chunks[2]
    for step in range(steps):
        for first in range(0, queries, chunk):
            rows = slice(first, min(first + chunk, queries))
            mass, logit, frame = (a[step, :, rows] for a in (key_mass, logits, frames))
            if has_versions:
                version = group["slot_version"][step, 0, rows]
                query, slot = np.nonzero(frame[0] >= 0)
                versions[step, rows][query, frame[0][query, slot]] = version[query, slot]
            n = mass.shape[1]
            seen = frame >= 0
            # (head, query frame in the chunk, key frame) -> one flat bin
            cells = np.arange(heads * n).reshape(heads, n, 1) * num_frames
            index = (cells + frame)[seen]
            size = heads * n * num_frames
            count = np.bincount(index, minlength=size)
            visible = (count > 0).reshape(heads, n, num_frames)
            total = np.bincount(index, weights=mass[seen], minlength=size)
            logit_sum = np.bincount(index, weights=logit[seen], minlength=size)
            shape = (heads, n, num_frames)
            prob_mass[step, :, rows] = np.where(visible, total.reshape(shape), np.nan)
            mean = logit_sum / np.maximum(count, 1)
            logit_mean[step, :, rows] = np.where(visible, mean.reshape(shape), np.nan)
    return prob_mass, logit_mean, versions


def check_view(kind: str, path: Path, prob_mass: np.ndarray, damaged: str) -> None:
    """Each captured (pass, head, query frame) puts mass 1 on the frames it saw."""
    totals = np.nansum(prob_mass, axis=-1)
    seen = ~np.isnan(prob_mass).all(axis=-1)
    error = np.abs(np.where(seen, totals, 1.0) - 1.0)
    if error.max(initial=0.0) > 1e-3:
        step, head, frame = (int(i) for i in np.argwhere(error == error.max())[0])
        raise ValueError(
            f"{kind} {path}: key_mass of step {step}, head {head}, query frame {frame} sums to "
            f"{totals[step, head, frame]:.6f}, not 1; {damaged}"
        )


def key_token_view(ds: xr.Dataset) -> xr.Dataset:
    """A store over slots as a store over every token of the video (`key_mass` and
    `key_logit_mean` over `key_token`, NaN where a token was not visible; a token held in two
    slots gets the sum of its mass and the mean of its logits), in memory: what the offline
    recall and the survey figures read. Its size grows with the square of the frames: for the
    long stores, the frame view (`frame_view`) is the one to take."""
    t = int(ds.attrs["frame_seq_length"])
    num_frames = int(ds.attrs["num_frames"])
    tokens = num_frames * t
    frames, token_in_frame = ds["slot_frame"].values, ds["slot_token"].values
    seen = frames >= 0
    steps, heads, queries, _ = frames.shape
    rows = np.arange(steps * heads * queries).reshape(steps, heads, queries, 1)
    index = (rows * tokens + frames * t + token_in_frame)[seen]
    size = steps * heads * queries * tokens
    count = np.bincount(index, minlength=size).reshape(steps, heads, queries, tokens)
    arrays = {}
    for name in ("key_mass", "key_logit_mean"):
        total = np.bincount(index, weights=ds[name].values[seen], minlength=size)
        total = total.reshape(count.shape)
        value = total if name == "key_mass" else total / np.maximum(count, 1)
        arrays[name] = (
            ("step", "head", "query_frame", "key_token"),
            np.where(count > 0, value, np.nan).astype(np.float32),
            dict(ds[name].attrs),
        )
    coords = {name: ds[name] for name in ("step", "head", "timestep", "pass_kind", "query_frame")}
    coords["key_frame"] = ("key_token", np.repeat(np.arange(num_frames, dtype=np.int32), t))
    view = xr.Dataset({**arrays, "entropy": ds["entropy"].load()}, coords=coords, attrs=ds.attrs)
    return view
