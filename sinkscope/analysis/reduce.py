"""Token store (Contract 1) -> frame dataset (Contract 2), with bounded memory.

The logits are read one query frame's rows of one head and one pass at a time, a (T, N) block that
matches the store's shards, and each block is reduced to per-(query frame, key frame) values inside
a single dask graph; only the small frame x frame results are ever held whole. Within a block only
the key frames with visible logits are touched, a few rows at a time (benchmarks/reduce.py).

Damage is named, not reduced: the store's chunks carry crc32c checksums (extraction/store.py), and
a chunk that fails its read fails the reduction with the store, the variable and the chunk named
(`stores.py` opens and checks the stores and names the damage). The frame dataset's chunks carry
crc32c checksums too.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xarray as xr
import zarr

from sinkscope.analysis import slots
from sinkscope.analysis.stores import (
    DAMAGED,
    FRAME_DIMS,
    STORE_NAMES,
    check_attention_store,
    check_token_store,
    damaged,
    error_text,
    open_array,
    open_store,
    read_region,
    read_token_rows,
    read_values,
    token_store_error,
    unreadable,
)
from sinkscope.frames import block_of_frame
from sinkscope.storage import (
    ATTRIBUTES_CHECKSUM,
    VALUE_FRAME_VARIABLES,
    VARIABLE_ATTRS,
    atomic_path,
    checked_compressors,
    decoded_attrs,
    encode_attrs,
    mark_complete,
    tune_zarr,
)

log = logging.getLogger(__name__)
# Seconds between progress lines of a reduction (one more when it finishes).
PROGRESS_SECONDS = 30.0


def _log_progress(what: str, done: int, total: int, elapsed: float) -> None:
    left = elapsed / done * (total - done) if done else float("nan")
    log.info(
        "%s: %d/%d tasks (%.0f %%), %.1f s, about %.0f s left",
        what,
        done,
        total,
        100 * done / max(total, 1),
        elapsed,
        left,
    )


@functools.cache
def _dask_progress() -> type:
    """`ReduceProgress`, a dask callback: dask is imported by the token reduction alone (1.5 s
    a job that the attention stores' reduction, in plain numpy, does not pay)."""
    from dask.callbacks import Callback

    class ReduceProgress(Callback):
        """Logs a dask reduction's progress: tasks done, elapsed time and an estimate of what
        is left, at most every `every` seconds and once at the end (a 70 GB token store takes
        minutes)."""

        def __init__(self, what: str, every: float | None = None):
            super().__init__()
            self.what = what
            self.every = PROGRESS_SECONDS if every is None else every

        def _start_state(self, dsk, state) -> None:
            self.started = self.logged = time.perf_counter()
            self.total = sum(len(state[key]) for key in ("ready", "waiting", "running", "finished"))

        def _posttask(self, key, result, dsk, state, worker_id) -> None:
            now = time.perf_counter()
            if now - self.logged >= self.every:
                self.logged = now
                _log_progress(self.what, len(state["finished"]), self.total, now - self.started)

        def _finish(self, dsk, state, errored) -> None:
            if not errored:
                elapsed = time.perf_counter() - self.started
                _log_progress(self.what, self.total, self.total, elapsed)

    return ReduceProgress


# The fast path of reduce_rows works on sub-blocks of about this many logits (an 8-byte index and
# two float32 values each: 4 MB), so that each pass after the first reads data still in the cache.
SUB_BLOCK_VALUES = 1 << 18
# Every float16 bit pattern as float32. A float16 logit has only 65536 possible values, so its
# softmax weight is looked up, by its raw 16 bits, in a table of 65536 exponentials built once per
# row block: about twice as fast as numpy's exp (benchmarks/README.md).
_FLOAT16_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
# The same with inf as NaN: the weight table built from it maps every inf and NaN logit to a NaN
# weight, which sends its sub-block to the exact path.
_FLOAT16_FINITE_OR_NAN = np.where(np.isinf(_FLOAT16_VALUES), np.nan, _FLOAT16_VALUES)
_POSITIVE_INF_BITS = 0x7C00
# float16 -> float32 by bit arithmetic (3x faster than numpy's cast): see _RowSums.add_float16.
_F16_SIGN_AND_MAGNITUDE = np.array(0x8FFFE000, dtype=np.uint32).view(np.int32)
_F16_REBIAS = np.float32(2.0**112)
# Rows whose softmax normaliser, relative to the block's largest logit, falls below this go to the
# exact path: their weights exp(x - block max) would lose precision to float32 underflow.
_MIN_RELATIVE_NORM = float(np.exp(-30.0))


class _RowSums:
    """Running sums over the rows of one query frame, per key frame."""

    def __init__(self, num_frames: int):
        self.num_frames = num_frames
        self.pair_count = np.zeros(num_frames, dtype=np.int64)
        self.logit_sum = np.zeros(num_frames, dtype=np.float64)
        self.mass_sum = np.zeros(num_frames, dtype=np.float64)  # over rows with a visible key
        self.live_rows = 0
        self.entropy_sum = 0.0

    def add_exact(self, rows: np.ndarray) -> None:
        """Any rows [R, N], NaN anywhere: a float32 copy of all keys, NaN masked."""
        num_rows, num_keys = rows.shape
        num_frames = self.num_frames
        tiles = (num_rows, num_frames, num_keys // num_frames)
        x = rows.astype(np.float32)  # a fresh copy, modified in place below
        invisible = np.isnan(x)
        x[invisible] = 0.0
        self.pair_count += (~invisible).reshape(tiles).sum(axis=(0, 2))
        self.logit_sum += x.reshape(tiles).sum(axis=(0, 2), dtype=np.float64)

        # Row-wise softmax over visible keys, shifted by the row max; invisible keys (-inf) exp
        # to 0.
        x[invisible] = -np.inf
        row_max = x.max(axis=1)
        row_max[np.isneginf(row_max)] = 0.0  # rows with nothing visible
        x -= row_max[:, None]
        weights = np.exp(x)
        x[invisible] = 0.0  # shifted logits, 0 where the weight is 0, so weight * x stays finite
        row_norm = weights.sum(axis=1, dtype=np.float64)
        frame_weight = weights.reshape(tiles).sum(axis=2, dtype=np.float64)
        weights *= x
        weighted_logit = weights.sum(axis=1, dtype=np.float64)

        live = row_norm > 0
        if live.any():
            norm = row_norm[live]
            self.mass_sum += (frame_weight[live] / norm[:, None]).sum(axis=0)
            # H = -sum p log p with log p = x - log Z, i.e. H = log Z - sum(w x) / Z.
            self.entropy_sum += float(np.sum(np.log(norm) - weighted_logit[live] / norm))
            self.live_rows += int(live.sum())

    def add_float16(self, rows: np.ndarray) -> None:
        """float16 rows [R, N]: only the key frames that hold a visible logit are read, a
        sub-block of rows at a time; sub-blocks with a NaN, an inf or a row far below the block's
        largest logit go to add_exact."""
        num_rows, num_keys = rows.shape
        t = num_keys // self.num_frames
        frames = np.flatnonzero(_visible_key_frames(rows, self.num_frames))
        if len(frames) == 0:
            return  # no visible key: nothing to add
        # Contiguous runs of visible key frames: (first key column, stop key column, column in
        # the compact buffer).
        runs = []
        column = 0
        for run in np.split(frames, np.flatnonzero(np.diff(frames) > 1) + 1):
            width = len(run) * t
            runs.append((int(run[0]) * t, int(run[0]) * t + width, column))
            column += width
        num_visible, width = len(frames), column
        bits = rows.view(np.uint16)
        top = _largest_float16(bits, runs)
        if top is None:  # +inf or NaN among the visible logits
            self.add_exact(rows)
            return
        # Softmax weights relative to the block's largest logit: exp(x - top) <= 1 for every x. A
        # row's probabilities and entropy do not depend on the shift.
        with np.errstate(invalid="ignore", over="ignore"):
            exp_table = np.exp(_FLOAT16_FINITE_OR_NAN - np.float32(top))
        sub_rows = max(1, min(num_rows, SUB_BLOCK_VALUES // width))
        index = np.empty((sub_rows, width), dtype=np.intp)
        packed = np.empty((sub_rows, width), dtype=np.int32)
        logits = packed.view(np.float32)
        weights = np.empty((sub_rows, width), dtype=np.float32)
        ones = np.ones((t, 1), dtype=np.float32)
        signed = bits.view(np.int16)
        for start in range(0, num_rows, sub_rows):
            n = min(sub_rows, num_rows - start)
            i, p, x, w = index[:n], packed[:n], logits[:n], weights[:n]
            for first, stop, at in runs:
                np.copyto(i[:, at : at + stop - first], bits[start : start + n, first:stop])
                np.copyto(p[:, at : at + stop - first], signed[start : start + n, first:stop])
            np.take(exp_table, i, out=w, mode="wrap")
            # float16 -> float32 by bit arithmetic (3x faster than numpy's cast): the sign-extended
            # 16 bits shifted into place, the sign copies cleared from the float32 exponent, and
            # the exponent rebiased by 2^(127 - 15), which also normalises float16 subnormals.
            # inf and NaN become finite values >= 65536 here, but their weights are NaN.
            np.left_shift(p, 13, out=p)
            np.bitwise_and(p, _F16_SIGN_AND_MAGNITUDE, out=p)
            np.multiply(x, _F16_REBIAS, out=x)
            # Per (row, key frame) sums and dot products of T values, which numpy's matmul hands
            # to BLAS sdot (float32 with many partial sums): [n, F', 1, T] @ [T, 1].
            row_tiles = (n, num_visible, 1, t)
            tile_logit = (x.reshape(row_tiles) @ ones)[:, :, 0, 0]
            frame_weight = (w.reshape(row_tiles) @ ones)[:, :, 0, 0]
            x -= np.float32(top)  # x - top: log weights, 0 >= x - top >= -65504 * 2
            tile_wx = np.matmul(w.reshape(row_tiles), x.reshape(n, num_visible, t, 1))
            norm = frame_weight.sum(axis=1, dtype=np.float64)
            weighted_logit = tile_wx[:, :, 0, 0].sum(axis=1, dtype=np.float64)
            # A NaN weight (an inf or NaN logit) makes both sums NaN.
            if not (np.isfinite(weighted_logit).all() and (norm >= _MIN_RELATIVE_NORM).all()):
                self.add_exact(rows[start : start + n])
                continue
            self.pair_count[frames] += n * t
            self.logit_sum[frames] += tile_logit.sum(axis=0, dtype=np.float64)
            # Every row has a visible key, so every row is live. H = log Z - sum(w x) / Z with x
            # the shifted logits and w their weights, as in add_exact.
            self.mass_sum[frames] += (frame_weight / norm[:, None]).sum(axis=0)
            self.entropy_sum += float(np.sum(np.log(norm) - weighted_logit / norm))
            self.live_rows += n

    def result(self) -> np.ndarray:
        num_frames = self.num_frames
        out = np.full(2 * num_frames + 1, np.nan, dtype=np.float32)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[:num_frames] = self.logit_sum / self.pair_count
        if self.live_rows:
            mass = self.mass_sum / self.live_rows
            mass[self.pair_count == 0] = np.nan  # key frames this query frame cannot see
            out[num_frames : 2 * num_frames] = mass
            out[2 * num_frames] = self.entropy_sum / self.live_rows
        return out


def _largest_float16(bits: np.ndarray, runs: list[tuple[int, int, int]]) -> float | None:
    """The largest float16 in the column runs of uint16 bits [R, N]; None if it is +inf or NaN.

    Non-negative float16 values order like their bits read as int16, and they beat every negative
    one; if every value is negative, the largest is the one of smallest magnitude, i.e. the
    smallest uint16. A NaN found that way (the region holds nothing else) comes back as NaN.
    """
    top = max(int(bits[:, first:stop].view(np.int16).max()) for first, stop, _ in runs)
    if top >= _POSITIVE_INF_BITS:
        return None
    if top < 0:
        top = min(int(bits[:, first:stop].min()) for first, stop, _ in runs)
    return float(_FLOAT16_VALUES[top])


def _visible_key_frames(rows: np.ndarray, num_frames: int) -> np.ndarray:
    """bool [F]: key frames with at least one non-NaN logit in float16 rows [R, N].

    The first row picks the candidates; a key frame whose first row is all NaN is tested whole.
    Never-written tiles (the usual case) hold positive NaNs only, whose bits are the largest int16
    values: one min over the tile's bits shows it.
    """
    t = rows.shape[1] // num_frames
    visible = ~np.isnan(rows[0].reshape(num_frames, t)).all(axis=1)
    signed = rows.view(np.int16)
    for frame in np.flatnonzero(~visible):
        tiles = slice(frame * t, (frame + 1) * t)
        if int(signed[:, tiles].min()) > _POSITIVE_INF_BITS:
            continue
        visible[frame] = not np.isnan(rows[:, tiles]).all()
    return visible


def reduce_rows(rows: np.ndarray, num_frames: int) -> np.ndarray:
    """Reduce the logits of one query frame's rows, [T, N] with NaN = invisible.

    Returns float32 [2 * F + 1]: logit_mean over the F key frames, prob_mass over the F key frames,
    then the mean row entropy. Rows with no visible key are left out of the means over rows, so a
    query frame whose rows are all invisible gets NaN everywhere.
    """
    sums = _RowSums(num_frames)
    if rows.dtype == np.float16 and rows.size:
        sums.add_float16(rows)
    else:
        sums.add_exact(rows)
    return sums.result()


def _reduce_shard(
    logits: zarr.Array,
    path: Path,
    tokens_per_frame: int,
    num_frames: int,
    block_id: tuple[int, ...] | None = None,
) -> np.ndarray:
    """dask block (step, head, query frame) -> (1, 1, 1, 2F + 1): the frame's (T, N) rows of one
    head and pass, one shard of the store, read here so that a damaged shard can be named."""
    step, head, frame, _ = block_id
    rows = read_token_rows(logits, path, step, head, frame, tokens_per_frame)
    return reduce_rows(rows, num_frames)[None, None, None, :]


def _strings(values) -> np.ndarray:
    """Object-dtype strings: xarray stores them as zarr v3 variable-length `string`, which is
    stable, where numpy's fixed-width unicode would become an unspecified zarr dtype."""
    return np.vectorize(str, otypes=[object])(np.asarray(values, dtype=object))


def reduce_token_store(
    token_store: str | os.PathLike, out: str | os.PathLike, *, threads: int | None = None
) -> None:
    """Reduce a token store (Contract 1) to a frame dataset written atomically at `out`.

    The result is written to a sibling `<out>.tmp` directory, marked `complete` last and renamed
    to `out` only then, so a failure never leaves something at `out` that looks finished.
    """
    _reduce_store(token_store, out, "tokens", lambda path, ds: _reduce_dataset(path, ds, threads))


def reduce_attention_store(
    attention_store: str | os.PathLike, out: str | os.PathLike, *, threads: int | None = None
) -> None:
    """Reduce an attention store (Contract 4) to a frame dataset written atomically at `out`:
    `prob_mass` is `key_mass` summed over each key frame's tokens, `entropy` is stored as is,
    `logit_mean` is the pooled mean logits; the same Contract 2 as a token store gives."""
    _reduce_store(
        attention_store,
        out,
        "attention",
        lambda path, ds: _reduce_attention_dataset(path, ds, threads),
    )


def reduce_attention_stores(
    attention_stores: Sequence[str | os.PathLike],
    outs: Sequence[str | os.PathLike],
    *,
    threads: int | None = None,
) -> None:
    """`reduce_attention_store` of each store to the matching path of `outs` (a survey's layers)."""
    if len(attention_stores) != len(outs):
        raise ValueError(f"{len(attention_stores)} attention stores but {len(outs)} outputs")
    for index, (store, out) in enumerate(zip(attention_stores, outs, strict=True)):
        started = time.perf_counter()
        reduce_attention_store(store, out, threads=threads)
        log.info(
            "%d/%d %s -> %s (%.1f s)",
            index + 1,
            len(outs),
            store,
            out,
            time.perf_counter() - started,
        )


def _reduce_store(store, out, kind: str, reducer) -> None:
    """Open a store of `kind` lazily, reduce it with `reducer(path, ds)`, write the frame dataset
    atomically at `out` and mark it complete last."""
    tune_zarr()
    store, out = Path(store), Path(out)
    opened = open_store(STORE_NAMES[kind], store, chunks=None)  # lazy: nothing read yet
    with opened as ds:
        result = reducer(store, ds)
    encoding = {variable: {"compressors": checked_compressors()} for variable in result.variables}
    with atomic_path(out) as temporary:
        result.to_zarr(temporary, mode="w", zarr_format=3, consolidated=False, encoding=encoding)
        mark_complete(temporary)


def _reduce_attention_dataset(path: Path, ds: xr.Dataset, threads: int | None) -> xr.Dataset:
    """The frame dataset of an opened attention store: key_mass summed per key frame, the
    stored entropy, pooled logits."""
    kind = STORE_NAMES["attention"]
    tokens_per_frame, num_frames, sizes = check_attention_store(path, ds)
    if slots.is_slot_store(ds):
        try:
            prob_mass, logit_mean, versions = slots.frame_view(path, num_frames)
        except Exception as err:
            raise unreadable(kind, path, "key_mass", err, open_array(path, "key_mass")) from err
        slots.check_view(kind, path, prob_mass, DAMAGED[kind])
        entropy = read_values(path, ds, "entropy", kind).astype(np.float32)
        return _frame_dataset(
            ds, path, logit_mean, prob_mass, entropy, sizes, "attention", versions
        )
    prob_mass = _attention_prob_mass(path, tokens_per_frame, num_frames, threads)
    entropy = read_values(path, ds, "entropy", kind).astype(np.float32)
    logit_mean = read_values(path, ds, "logit_mean_pooled", kind).astype(np.float32)
    _check_mass(path, prob_mass, logit_mean)
    if "prob_mass_pooled" in ds:  # stores before it have the token sums alone
        # The token sums are checked against the exact frame sums, which are then used.
        pooled = read_values(path, ds, "prob_mass_pooled", kind).astype(np.float32)
        _check_mass_sums(path, prob_mass, pooled, tokens_per_frame)
        prob_mass = pooled
    versions = read_values(path, ds, "key_version", kind) if "key_version" in ds else None
    # The value side, where the store has it (stores of older surveys have none).
    values = {
        name: read_values(path, ds, name, kind).astype(np.float32)
        for name in VALUE_FRAME_VARIABLES
        if name in ds
    }
    return _frame_dataset(
        ds, path, logit_mean, prob_mass, entropy, sizes, "attention", versions, values
    )


def _attention_prob_mass(
    path: Path, tokens_per_frame: int, num_frames: int, threads: int | None
) -> np.ndarray:
    """key_mass [pass, head, query frame, key token] summed over each key frame's tokens, float32
    [pass, head, query frame, key frame], one stored shard of (pass, head, query frame) at a time
    (a chunk where unsharded) on `threads` threads (zarr's decoding releases the GIL): a shard
    read whole is one read of its file, a part of it a read per chunk. A key frame is either
    wholly visible or not at all, so NaN stays NaN (no skipna). A chunk that fails its read is
    named."""
    kind = STORE_NAMES["attention"]
    key_mass = zarr.open_group(str(path), mode="r")["key_mass"]
    steps, heads, queries, _ = key_mass.shape
    prob_mass = np.empty((steps, heads, queries, num_frames), np.float32)
    step_run, head_run, query_run = (key_mass.shards or key_mass.chunks)[:3]
    regions = [
        (slice(s, s + step_run), slice(h, h + head_run), slice(q, q + query_run), slice(None))
        for s in range(0, steps, step_run)
        for h in range(0, heads, head_run)
        for q in range(0, queries, query_run)
    ]

    # A float16 store's key_mass is stored scaled (CF's scale_factor, a power of two: exact).
    scale = np.float32(key_mass.attrs.get("scale_factor", 1.0))

    def reduce_region(region: tuple[slice, ...]) -> None:
        values = read_region(key_mass, region, kind, path, "key_mass")
        if values.dtype != np.float32:
            values = values.astype(np.float32) * scale
        frames = values.reshape(*values.shape[:3], num_frames, tokens_per_frame)
        prob_mass[region[:3]] = frames.sum(axis=-1, dtype=np.float32)

    what, started = f"reducing {path}", time.perf_counter()
    logged = started
    with ThreadPoolExecutor(threads or os.cpu_count()) as pool:
        for done, _ in enumerate(pool.map(reduce_region, regions), 1):
            now = time.perf_counter()
            if now - logged >= PROGRESS_SECONDS or done == len(regions):
                logged = now
                _log_progress(what, done, len(regions), now - started)
    return prob_mass


def _check_mass_sums(
    path: Path, prob_mass: np.ndarray, pooled: np.ndarray, tokens_per_frame: int
) -> None:
    """The key frames' sums of the stored key_mass must equal the store's exact sums up to the
    stored precision: float16 rounds each value to 2^-11 of itself (and to 2^-40 in its subnormal
    range, scaled by KEY_MASS_SCALE), so a frame's sum moves by at most 2^-11 of itself plus
    T x 2^-40; float32 sums add 2^-20. More means a chunk holds other values than the survey
    computed."""
    kind = STORE_NAMES["attention"]
    seen = ~np.isnan(pooled)
    error = np.abs(prob_mass[seen] - pooled[seen])
    tolerance = (2.0**-11 + 2.0**-20) * np.abs(pooled[seen]) + tokens_per_frame * 2.0**-40
    if (error > tolerance).any():
        worst = float((error - tolerance).max())
        raise ValueError(
            f"{kind} {path}: key_mass summed per key frame differs from prob_mass_pooled by "
            f"{worst:.3g} beyond float16's rounding: the store is damaged; {DAMAGED[kind]}"
        )


def _check_mass(path: Path, prob_mass: np.ndarray, pooled: np.ndarray) -> None:
    """key_mass must cover exactly the tiles the pooled logits saw and sum to 1 per query frame:
    otherwise a chunk is missing or the store is not what the survey computed."""
    kind = STORE_NAMES["attention"]
    disagree = np.isnan(prob_mass) != np.isnan(pooled)
    if disagree.any():
        raise ValueError(
            f"{kind} {path}: key_mass and logit_mean_pooled disagree on the visible key frames "
            f"(first at {_tile_name(disagree)}): a key_mass chunk is missing or the store is "
            f"damaged; {DAMAGED[kind]}"
        )
    # Where both agree on what was seen, what was seen must add up to 1.
    slots.check_view(kind, path, prob_mass, DAMAGED[kind])


def _reduce_dataset(token_store: Path, ds: xr.Dataset, threads: int | None) -> xr.Dataset:
    """The frame dataset of an opened token store."""
    tokens_per_frame, num_frames, sizes = check_token_store(token_store, ds)
    pooled = (
        read_values(token_store, ds, "logit_mean_pooled") if "logit_mean_pooled" in ds else None
    )
    if "logits" in ds.variables:
        logit_mean, prob_mass, entropy = _reduce_logits(
            token_store, tokens_per_frame, num_frames, threads
        )
        if pooled is not None:
            # The token means are checked against the exact pooled ones, which are then used:
            # the same logit_mean as an attention store of the same rollout gives.
            _cross_check(token_store, logit_mean, pooled)
            logit_mean = pooled.astype(np.float32)
    else:
        # capture.tokens: false. Exact frame-level logits; probabilities need the token pairs.
        logit_mean = pooled.astype(np.float32)
        prob_mass = np.full_like(logit_mean, np.nan)
        entropy = np.full(logit_mean.shape[:3], np.nan, dtype=np.float32)
    versions = read_values(token_store, ds, "key_version") if "key_version" in ds else None
    return _frame_dataset(
        ds, token_store, logit_mean, prob_mass, entropy, sizes, "tokens", versions
    )


def _frame_dataset(
    ds: xr.Dataset,
    path: Path,
    logit_mean: np.ndarray,
    prob_mass: np.ndarray,
    entropy: np.ndarray,
    sizes: list[int],
    store: str,
    key_version: np.ndarray | None = None,
    values: dict[str, np.ndarray] | None = None,
) -> xr.Dataset:
    """Contract 2 from the reduced arrays and the store `ds` (of kind `store`) they come from;
    every variable and coordinate with its long_name and units (`storage.VARIABLE_ATTRS`), the
    attributes netCDF-safe (`storage.encode_attrs`). `key_version`: which copy of each key
    frame each query frame saw per pass (stores before it have none); `values`: frame-level
    arrays of the value side (`storage.VALUE_FRAME_VARIABLES`) as the store holds them."""
    kind = STORE_NAMES[store]
    num_steps, num_heads, num_frames = logit_mean.shape[:3]
    frames = np.arange(num_frames)
    # The store's provenance, but its own completeness: marked when the dataset is written.
    attrs = {
        k: v
        for k, v in decoded_attrs(ds.attrs).items()
        if k not in ("complete", ATTRIBUTES_CHECKSUM)
    }
    attrs["store"] = store  # stores written before the attention store lack it
    variables = {
        "logit_mean": (FRAME_DIMS, logit_mean),
        "prob_mass": (FRAME_DIMS, prob_mass),
        "entropy": (FRAME_DIMS[:3], entropy),
    }
    if key_version is not None:
        variables["key_version"] = ((FRAME_DIMS[0], *FRAME_DIMS[2:]), key_version)
    for name, array in (values or {}).items():
        variables[name] = (FRAME_DIMS, array)
    coords = {
        "step": ("step", np.arange(num_steps)),
        "head": ("head", np.arange(num_heads)),
        "query_frame": ("query_frame", frames),
        "key_frame": ("key_frame", frames),
        "timestep": ("step", np.asarray(read_values(path, ds, "timestep", kind), np.float32)),
        "pass_kind": ("step", _strings(read_values(path, ds, "pass_kind", kind))),
        "block": ("query_frame", block_of_frame(sizes)),
        "checkpoint": ((), _strings(attrs.get("checkpoint", ""))),
        "prompt": ((), _strings(attrs.get("prompt", ""))),
        "layer": ((), int(attrs.get("layer", -1))),
    }
    return xr.Dataset(
        {name: (*spec, dict(VARIABLE_ATTRS[name])) for name, spec in variables.items()},
        coords={name: (*spec, dict(VARIABLE_ATTRS[name])) for name, spec in coords.items()},
        attrs=encode_attrs(attrs),
    )


def _reduce_logits(
    path: Path, tokens_per_frame: int, num_frames: int, threads: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """logit_mean, prob_mass and entropy from the token logits, in one threaded dask pass."""
    # One dask block = one query frame's rows of one head and pass, i.e. one shard of the store,
    # read with zarr inside the block's task (read_token_rows names a shard that fails its read).
    try:
        logits = zarr.open_group(str(path), mode="r")["logits"]
    except Exception as err:
        problem = f"variable 'logits' cannot be opened ({error_text(err)})"
        raise damaged("token store", path, problem) from err
    import dask
    import dask.array as da

    num_steps, num_heads = logits.shape[:2]
    reduced = da.map_blocks(
        _reduce_shard,
        chunks=((1,) * num_steps, (1,) * num_heads, (1,) * num_frames, (2 * num_frames + 1,)),
        dtype=np.float32,
        meta=np.empty((0, 0, 0, 0), dtype=np.float32),
        logits=logits,
        path=path,
        tokens_per_frame=tokens_per_frame,
        num_frames=num_frames,
    )
    with _dask_progress()(f"reducing {path}"):
        return dask.compute(
            reduced[..., :num_frames],
            reduced[..., num_frames : 2 * num_frames],
            reduced[..., 2 * num_frames],
            scheduler="threads",
            num_workers=threads or os.cpu_count(),
        )


def _cross_check(path: Path, logit_mean: np.ndarray, pooled: np.ndarray) -> None:
    """The token reduction must equal the pooled (mean q).(mean k) up to float16 rounding."""
    seen = ~np.isnan(logit_mean)
    disagree = seen != ~np.isnan(pooled)
    if disagree.any():
        raise token_store_error(
            path,
            f"logits and logit_mean_pooled disagree on the visible tiles (first at "
            f"{_tile_name(disagree)}): a logits shard is missing or the store is damaged; "
            f"re-run its extraction",
        )
    if not seen.any():
        return
    error = np.where(seen, np.abs(logit_mean - pooled), 0.0)
    difference = float(error.max())
    # float16 keeps 11 significant bits: a mean of rounded logits is off by <= 2^-11 of their size.
    tolerance = 2.0**-10 * (1.0 + float(np.abs(pooled[seen]).max()))
    if difference > tolerance:
        raise token_store_error(
            path,
            f"logit_mean from the token logits differs from the pooled q.k by {difference:.3g} "
            f"(> {tolerance:.3g}; at {_tile_name(error == difference)}): the stored logits are "
            f"not what the model computed",
        )


def _tile_name(where: np.ndarray) -> str:
    """The first True of a (step, head, query frame, key frame) mask, in words."""
    step, head, query, key = (int(i) for i in np.argwhere(where)[0])
    return f"step {step}, head {head}, query frame {query}, key frame {key}"
