"""Opening and checking what the analysis reads: token stores (Contract 1), attention stores
(Contract 4) and frame datasets (Contract 2).

A store is checked before anything is read from it: its metadata copies agree, its attributes
pass their checksum and carry the `complete` mark, its layout matches its attributes. A read that
fails names the store, the variable and the chunk (read again one at a time), and says which job
to re-run. The reductions (reduce.py) read through these checks.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
import xarray as xr
import zarr

from sinkscope.analysis import slots
from sinkscope.frames import token_frames
from sinkscope.storage import (
    ATTRIBUTES_CHECKSUM,
    attributes_checksum,
    decoded_attrs,
)

LOGIT_DIMS = ("step", "head", "query_token", "key_token")
KEY_MASS_DIMS = ("step", "head", "query_frame", "key_token")
# The `store` attribute of a store (and of the frame dataset reduced from it), in words.
STORE_NAMES = {"tokens": "token store", "attention": "attention store"}
FRAME_DIMS = ("step", "head", "query_frame", "key_frame")


def defer_dask_import() -> None:
    """Let xarray import dask.array only once something else has.

    xarray asks for dask's array class (`pycompat.array_type("dask")`) the first time it builds
    any variable, to test whether data is a dask array; with dask installed that imports
    dask.array, and with it scipy.fft: 0.7 s in every analysis job, most of which never use dask
    (only the token stores' reduction does, and it imports dask.array itself). Until dask.array
    is imported nothing can be a dask array, so the class list is empty until then; after it,
    xarray's own record of dask is made and kept. Run when this module is imported (every
    analysis job reads through it); tests/test_reduce.py checks both sides."""
    from xarray.namedarray import pycompat

    class DaskOnceImported:
        def __getattr__(self, name):
            if name == "type" and "dask.array" not in sys.modules:
                return ()
            real = pycompat.DuckArrayModule("dask")
            pycompat._cached_duck_array_modules["dask"] = real
            return getattr(real, name)

    pycompat._cached_duck_array_modules.setdefault("dask", DaskOnceImported())


defer_dask_import()


def region_chunks(
    array: zarr.Array, region: tuple[slice, ...] | None = None
) -> list[tuple[int, ...]]:
    """Coordinates of the chunks (inner chunks of a sharded array) of `array` that `region`
    (default: all of it) touches."""
    region = region or tuple(slice(0, size) for size in array.shape)
    ranges = [
        range(part.start // chunk, -(-part.stop // chunk))
        for part, chunk in zip(region, array.chunks, strict=True)
    ]
    return list(itertools.product(*ranges))


def chunk_failures(
    array: zarr.Array, chunk_coords: list[tuple[int, ...]]
) -> list[tuple[tuple[int, ...], Exception]]:
    """(coordinates, error) of each of these chunks whose read fails, read one at a time."""
    failures = []
    for coords in chunk_coords:
        selection = tuple(
            slice(i * chunk, min((i + 1) * chunk, size))
            for i, chunk, size in zip(coords, array.chunks, array.shape, strict=True)
        )
        try:
            array[selection]
        except Exception as err:
            failures.append((coords, err))
    return failures


def _storage_keys(array: zarr.Array, chunk_coords: list[tuple[int, ...]]) -> str:
    """The keys of the files (shards, or chunks of an unsharded array) holding these chunks."""
    per_file = array.shards or array.chunks
    keys = []
    for coords in chunk_coords:
        file_coords = tuple(
            i * chunk // size for i, chunk, size in zip(coords, array.chunks, per_file, strict=True)
        )
        key = array.metadata.encode_chunk_key(file_coords)
        if key not in keys:
            keys.append(key)
    return ", ".join(keys)


def read_token_rows(
    logits: zarr.Array, path: Path, step: int, head: int, frame: int, tokens_per_frame: int
) -> np.ndarray:
    """logits[step, head, the query frame's T rows, :]; a failed read names its chunk."""
    t = tokens_per_frame
    rows = slice(frame * t, (frame + 1) * t)
    try:
        return logits[step, head, rows, :]
    except Exception as err:
        region = (slice(step, step + 1), slice(head, head + 1), rows, slice(0, logits.shape[3]))
        coords = region_chunks(logits, region)
        failures = chunk_failures(logits, coords)
        detail = f"step {step}, head {head}, query frame {frame}"
        if failures and len(failures) == len(coords):
            detail += "; every tile: its shard index or the whole shard is damaged"
        elif failures:
            key_frames = sorted({c[3] * logits.chunks[3] // t for c, _ in failures})
            detail += f"; the tiles of key frame(s) {', '.join(map(str, key_frames))}"
        raise unreadable("token store", path, "logits", err, logits, coords, detail) from err


# What to do about a token store or a frame dataset that fails a read, and the job that made it.
DAMAGED = {
    "token store": "the store is damaged: re-run its extraction",
    "attention store": "the store is damaged: re-run its survey",
    "frame dataset": "the dataset is damaged: re-run its reduce",
    "closed-loop store": (
        "the store is damaged: re-run its closed loop (snakemake --forcerun closed_loop, or "
        "delete the rollout's files and run again)"
    ),
}


_MADE_BY = {"token store": "extraction", "attention store": "survey", "frame dataset": "reduce"}


def damaged(kind: str, path: Path, problem: str) -> ValueError:
    """The error for a `kind` at `path` that is damaged in the way `problem` says."""
    return ValueError(f"{kind} {path}: {problem}; {DAMAGED[kind]}")


def error_text(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


def unreadable(
    kind: str,
    path: Path,
    name: str,
    err: Exception,
    array: zarr.Array | None = None,
    chunk_coords: list[tuple[int, ...]] | None = None,
    detail: str = "",
) -> ValueError:
    """The error for variable `name` of the `kind` at `path`, whose read failed with `err`.

    The chunks (default: all of `array`) are read again one at a time: those that fail are named,
    with the first one's error; if none fails on its own, all of them are named.
    """
    where, cause = f"variable {name!r}", err
    if array is not None:
        coords = chunk_coords if chunk_coords is not None else region_chunks(array)
        failures = chunk_failures(array, coords)
        if failures:
            coords, cause = [c for c, _ in failures], failures[0][1]
        where += f", chunk {_storage_keys(array, coords)}"
    if detail:
        where += f" ({detail})"
    return damaged(kind, path, f"{where} cannot be read ({error_text(cause)})")


def read_region(
    array: zarr.Array, region: tuple[slice, ...], kind: str, path: Path, name: str
) -> np.ndarray:
    """`array[region]` (variable `name` of the `kind` at `path`); a failed read (a flipped byte
    fails its chunk's crc32c) names the store, the variable and the damaged chunk."""
    try:
        return np.asarray(array[region])
    except Exception as err:
        bounded = tuple(
            slice(*part.indices(size)[:2]) for part, size in zip(region, array.shape, strict=True)
        )
        raise unreadable(kind, path, name, err, array, region_chunks(array, bounded)) from err


def open_array(path: Path, name: str) -> zarr.Array | None:
    """Array `name` of the zarr group at `path`, as xarray sees it (consolidated metadata); None
    if it cannot be opened."""
    try:
        array = zarr.open_group(str(path), mode="r")[name]
    except Exception:
        return None
    return array if isinstance(array, zarr.Array) else None


def read_values(path: Path, ds: xr.Dataset, name: str, kind: str = "token store") -> np.ndarray:
    """ds[name].values of a store; a failed read names the variable and its chunk."""
    try:
        return ds[name].values
    except Exception as err:
        raise unreadable(kind, path, name, err, open_array(path, name)) from err


def token_store_error(path: Path, message: str) -> ValueError:
    return ValueError(f"token store {path}: {message}")


def _check_metadata_copies(kind: str, path: Path) -> bool:
    """Each array's zarr.json must equal its copy in the group's consolidated metadata (which is
    what is read): a difference means one of them is damaged. Returns whether there is any."""
    try:
        root = json.loads((path / "zarr.json").read_text())
        consolidated = (root.get("consolidated_metadata") or {}).get("metadata") or {}
    except Exception as err:
        raise damaged(kind, path, f"its zarr.json cannot be read ({error_text(err)})") from err
    for name, metadata in consolidated.items():
        file = f"{name}/zarr.json"
        try:
            own = json.loads((path / file).read_text())
        except Exception as err:
            problem = f"variable {name!r}: {file} cannot be read ({error_text(err)})"
            raise damaged(kind, path, problem) from err
        if own != metadata:
            raise damaged(
                kind,
                path,
                f"variable {name!r}: {file} differs from its copy consolidated in zarr.json, so "
                "one of them is damaged",
            )
    return bool(consolidated)


def _check_attributes(kind: str, path: Path, attrs: dict) -> None:
    """The attributes pass their checksum (if they have one) and carry the `complete` mark."""
    if ATTRIBUTES_CHECKSUM in attrs:  # absent: written before the checksum, or by another writer
        stored = attrs[ATTRIBUTES_CHECKSUM]  # JSON text since the attributes are netCDF-safe
        try:
            computed = attributes_checksum(attrs)
            stored = json.loads(stored) if isinstance(stored, str) else stored
        except (TypeError, ValueError) as err:
            raise damaged(
                kind, path, f"its attributes cannot be checked ({error_text(err)})"
            ) from err
        if stored != computed:
            raise damaged(
                kind,
                path,
                f"its attributes (in zarr.json) fail their checksum: {ATTRIBUTES_CHECKSUM} is "
                f"{attrs[ATTRIBUTES_CHECKSUM]!r}, computed {computed}",
            )
    try:
        complete = decoded_attrs(attrs).get("complete")
    except (TypeError, ValueError) as err:
        raise damaged(kind, path, f"its attributes cannot be read ({error_text(err)})") from err
    if complete is not True:
        raise ValueError(
            f"{kind} {path}: not marked complete: its {_MADE_BY[kind]} was killed or is still "
            "running; re-run it"
        )


def _store_layout(
    kind: str, path: Path, ds: xr.Dataset, arrays: tuple[str, ...]
) -> tuple[int, int, list[int]]:
    """What every store must have (checked attributes, the layout attributes, `arrays`), and
    its layout: (T, F, block sizes)."""
    _check_attributes(kind, path, ds.attrs)
    for key in ("frame_seq_length", "num_frames", "block_sizes"):
        if key not in ds.attrs:
            raise ValueError(f"{kind} {path}: missing group attribute {key!r}")
    for name in arrays:
        if name not in ds.variables:
            raise ValueError(f"{kind} {path}: missing array {name!r}")
    tokens_per_frame = int(ds.attrs["frame_seq_length"])
    num_frames = int(ds.attrs["num_frames"])
    sizes = [int(size) for size in ds.attrs["block_sizes"]]
    if sum(sizes) != num_frames:
        raise ValueError(
            f"{kind} {path}: block_sizes {sizes} do not add up to num_frames={num_frames}"
        )
    return tokens_per_frame, num_frames, sizes


def check_token_store(path: Path, ds: xr.Dataset) -> tuple[int, int, list[int]]:
    """Validate the layout against the attributes; returns (T, F, block sizes)."""
    tokens_per_frame, num_frames, sizes = _store_layout(
        "token store", path, ds, ("timestep", "pass_kind")
    )
    if "logits" not in ds.variables and "logit_mean_pooled" not in ds.variables:
        raise token_store_error(path, "has neither 'logits' nor 'logit_mean_pooled'")
    if "logits" not in ds.variables:
        return tokens_per_frame, num_frames, sizes  # capture.tokens: false
    logits = ds["logits"]
    if tuple(logits.dims) != LOGIT_DIMS:
        raise token_store_error(path, f"logits has dims {logits.dims}, expected {LOGIT_DIMS}")
    num_tokens = num_frames * tokens_per_frame
    for dim in ("query_token", "key_token"):
        if ds.sizes[dim] != num_tokens:
            raise token_store_error(
                path,
                f"{dim} has {ds.sizes[dim]} tokens, expected num_frames * frame_seq_length = "
                f"{num_frames} * {tokens_per_frame} = {num_tokens}",
            )
    expected_frames = token_frames(num_frames, tokens_per_frame)
    for name in ("query_frame", "key_frame"):
        if name in ds.variables and not np.array_equal(
            read_values(path, ds, name), expected_frames
        ):
            raise token_store_error(
                path, f"{name} does not map token t to frame t // {tokens_per_frame}"
            )
    return tokens_per_frame, num_frames, sizes


def open_store(kind: str, path: Path, **open_options) -> xr.Dataset:
    """xr.open_zarr of a store after checking it is one and its metadata copies agree; errors
    name the path."""
    if not (path / "zarr.json").is_file():
        raise FileNotFoundError(f"{kind} {path} is not a zarr v3 group")
    if not _check_metadata_copies(kind, path):
        # Not consolidated (a store still being written): read as it is, without xarray's
        # warning; the `complete` check then names it.
        open_options.setdefault("consolidated", False)
    try:
        return xr.open_zarr(path, **open_options)
    except Exception as err:
        raise damaged(kind, path, f"its zarr.json cannot be read ({error_text(err)})") from err


def check_attention_store(path: Path, ds: xr.Dataset) -> tuple[int, int, list[int]]:
    """Validate an attention store's layout against its attributes: (T, F, block sizes)."""
    kind = STORE_NAMES["attention"]
    if slots.is_slot_store(ds):
        arrays = ("key_mass", "entropy", "timestep", "pass_kind")
        tokens_per_frame, num_frames, sizes = _store_layout(kind, path, ds, arrays)
        slots.check_slot_store(kind, path, ds, num_frames)
        return tokens_per_frame, num_frames, sizes
    arrays = ("key_mass", "entropy", "logit_mean_pooled", "timestep", "pass_kind")
    tokens_per_frame, num_frames, sizes = _store_layout(kind, path, ds, arrays)
    key_mass = ds["key_mass"]
    if tuple(key_mass.dims) != KEY_MASS_DIMS:
        raise ValueError(
            f"{kind} {path}: key_mass has dims {key_mass.dims}, expected {KEY_MASS_DIMS}"
        )
    expected = {"query_frame": num_frames, "key_token": num_frames * tokens_per_frame}
    for dim, size in expected.items():
        if ds.sizes[dim] != size:
            raise ValueError(
                f"{kind} {path}: {dim} has {ds.sizes[dim]} entries, expected {size} "
                f"(num_frames={num_frames}, frame_seq_length={tokens_per_frame})"
            )
    return tokens_per_frame, num_frames, sizes


def _unreadable_frames(path: Path, err: Exception, name: str | None = None) -> ValueError:
    """The error for a frame dataset that fails a read: the variable and chunk that fail, found
    with zarr (the first that fails if `name` is None), else the path alone."""
    try:
        group = zarr.open_group(str(path), mode="r")
        names = [name] if name is not None else sorted(group.array_keys())
    except Exception:
        names = []
    for variable in names:
        array = open_array(path, variable)
        if array is not None and (name is not None or chunk_failures(array, region_chunks(array))):
            return unreadable("frame dataset", path, variable, err, array)
    return ValueError(
        f"frame dataset {path} cannot be read ({error_text(err)}); {DAMAGED['frame dataset']}"
    )


def open_attention_store(path: str | os.PathLike, *, key_tokens: bool = False) -> xr.Dataset:
    """Open an attention store (Contract 4) lazily (key_mass stays on disk), checking its
    metadata copies, attribute checksum, `complete` mark and layout; errors name the path.
    `key_tokens`: a store over cache slots comes as a store over every token of the video
    (`slots.key_token_view`, in memory), as the offline recall and the survey figures read it."""
    path = Path(path)
    kind = STORE_NAMES["attention"]
    # No dask (its import is 1.5 s a job): key_mass stays lazily indexed, read where indexed.
    store = open_store(kind, path, chunks=None)
    check_attention_store(path, store)
    missing = [
        name for name in ("checkpoint", "prompt", "layer", "latent_grid") if name not in store.attrs
    ]
    if missing:
        raise ValueError(f"{kind} {path}: missing group attributes {missing}")
    if key_tokens and slots.is_slot_store(store):
        return slots.key_token_view(store)
    return store


FRAME_VARIABLES = ("logit_mean", "prob_mass", "entropy", "timestep", "pass_kind", "block")


def open_frame_dataset(path: str | os.PathLike) -> xr.Dataset:
    """Open a frame dataset (Contract 2) and load it (it is small), checking it has what the
    statistics and figures read; errors name the path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"frame dataset not found: {path}")
    _check_metadata_copies("frame dataset", path)
    try:
        # No dask: it is read whole at once (and reads the dimension coordinates already).
        opened = xr.open_zarr(path, chunks=None)
    except Exception as err:
        raise _unreadable_frames(path, err) from err
    with opened as ds:
        for name, variable in ds.variables.items():
            try:
                variable.load()
            except Exception as err:
                raise _unreadable_frames(path, err, name) from err
        ds = ds.load()
    _check_attributes("frame dataset", path, ds.attrs)
    missing = [
        name
        for name in (*FRAME_VARIABLES, "checkpoint", "prompt", "layer")
        if name not in ds.variables
    ]
    if missing:
        raise ValueError(f"frame dataset {path} lacks {missing}")
    return ds
