"""How sinkscope writes files: atomically, and with the zarr settings every store shares.

Every output is written under a temporary sibling name and renamed into place only when it is
whole, so a killed or failed job never leaves something at the final path that looks finished,
and a stale temporary from an earlier kill is removed before the next write. Shared by every
world (jobs, analysis, the parse-time digest cache); no torch.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
import logging
import os
import shutil
import socket
import sys
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from sinkscope.cache_choices import KEY_KINDS
from sinkscope.schedules import KEY_VERSIONS, NOISY_VERSION

log = logging.getLogger(__name__)

TEMPORARY_SUFFIX = ".tmp"
# Where jobs of one workflow record the disk space they are about to fill (relative to the
# workdir, where every job runs, on a cluster too).
SPACE_LEDGER = ".snakemake/sinkscope/space"
# A reservation of another host cannot be checked for a live job; after this it no longer counts.
FOREIGN_RESERVATION_SECONDS = 24 * 3600
# zarr's default pipeline runs every inner chunk of a shard through the codecs on its own; batching
# them halves write and read time when tiles are small (measured on the demo's 24 x 24 tiles).
ZARR_TUNING = {"codec_pipeline.batch_size": 32}
# The group attribute that holds the crc32 of all the others (`attributes_checksum`): zarr checks
# chunks, not metadata, and a changed attribute (layer, checkpoint) would otherwise pass unseen.
ATTRIBUTES_CHECKSUM = "attributes_crc32"
# The group attribute that names (space-separated, sorted) the attributes stored as JSON text:
# netCDF attributes hold only text, numbers and flat lists of numbers, and netCDF-3 no 64-bit
# integer, so mappings (`config`, `gpu`), booleans (`complete`), None, other lists and integers
# beyond int32 (the checksum) are written as JSON (`encode_attrs`) and a reader gets them back
# with `decoded_attrs`.
JSON_ATTRIBUTES = "json_attributes"
_INT32 = (-(2**31), 2**31 - 1)
# The value side of an attention store's keys, per (step, head, query frame, key frame): the
# survey writes them when the capture sees the values; reduced to the frame dataset as they are.
VALUE_FRAME_VARIABLES = ("value_norm", "mass_value_norm")
# long_name and units of every variable and coordinate of the stores (Contracts 1, 2 and 4),
# written beside each array (xarray shows them as the variable's attrs; docs/DATA.md lists them).
# Probabilities are dimensionless ("1"), entropies in nats, logits q.k/sqrt(head_dim) in "logit"
# (a dimensionless pre-softmax score), indices and labels "1".
VARIABLE_ATTRS = {
    "logits": {
        "long_name": "pre-softmax attention logit q.k/sqrt(head_dim)",
        "units": "logit",
    },
    "logit_mean_pooled": {
        "long_name": "mean logit over a frame pair's token pairs, from mean-pooled q and k",
        "units": "logit",
    },
    "key_mass": {
        "long_name": "attention probability of the key token, mean over the query frame's tokens",
        "units": "1",
    },
    "key_logit_mean": {
        "long_name": "attention logit of the key token, mean over the query frame's tokens",
        "units": "logit",
    },
    "key_logit_head_sum": {
        "long_name": "attention logit of the key token, mean over the query frame's tokens, "
        "summed over the heads",
        "units": "logit",
    },
    "prob_mass_pooled": {
        "long_name": "attention probability mass on the key frame, mean over the query frame's "
        "tokens, summed exactly from the float32 key mass",
        "units": "1",
    },
    "logit_mean": {
        "long_name": "mean logit over the visible token pairs of the query and key frame",
        "units": "logit",
    },
    "prob_mass": {
        "long_name": "attention probability mass on the key frame, mean over the query frame's "
        "tokens",
        "units": "1",
    },
    "entropy": {
        "long_name": "softmax entropy of the attention rows, mean over the query frame's tokens",
        "units": "nats",
    },
    "value_norm": {
        "long_name": "L2 norm of the value vectors of the key frame's tokens (the copy the query "
        "frame saw), mean over the tokens",
        "units": "1",
    },
    "mass_value_norm": {
        "long_name": "attention probability x value norm summed over the key frame's tokens, "
        "mean over the query frame's tokens",
        "units": "1",
    },
    "slot_frame": {
        "long_name": "latent frame the key of the cache slot came from (-1: empty)",
        "units": "1",
    },
    "slot_token": {
        "long_name": "token of the key inside its latent frame (-1: empty)",
        "units": "1",
    },
    "slot_position": {
        "long_name": "temporal RoPE position of the key as the query saw it (-1: empty)",
        "units": "1",
    },
    "slot_kind": {
        "long_name": "why the key was in the cache (-1: empty slot)",
        "units": "1",
        "flag_values": list(range(len(KEY_KINDS))),
        "flag_meanings": " ".join(KEY_KINDS),
    },
    "slot_version": {
        "long_name": "which copy of its frame the key was (-1: empty slot)",
        "units": "1",
        "flag_values": list(range(len(KEY_VERSIONS))),
        "flag_meanings": " ".join(KEY_VERSIONS),
        "comment": f"{NOISY_VERSION} + s: a noisy copy at denoising step s",
    },
    "key_version": {
        "long_name": "which copy of the key frame the query frame saw (-1: unseen)",
        "units": "1",
        "flag_values": list(range(len(KEY_VERSIONS))),
        "flag_meanings": " ".join(KEY_VERSIONS),
        "comment": f"{NOISY_VERSION} + s: a noisy copy at denoising step s",
    },
    "key_slot": {
        "long_name": "slot of the cache as the query saw it, in cache order",
        "units": "1",
    },
    "step": {"long_name": "captured pass of a block, in pass order (0-based)", "units": "1"},
    "head": {"long_name": "attention head (0-based)", "units": "1"},
    "timestep": {"long_name": "diffusion timestep the model received (warped)", "units": "1"},
    "pass_kind": {"long_name": "kind of pass: denoise or cache (the cache update)", "units": "1"},
    "query_frame": {"long_name": "latent frame of the query (0-based)", "units": "1"},
    "key_frame": {"long_name": "latent frame of the key (0-based)", "units": "1"},
    "block": {"long_name": "block of the query frame (0-based)", "units": "1"},
    "checkpoint": {"long_name": "checkpoint name", "units": "1"},
    "prompt": {"long_name": "prompt name", "units": "1"},
    "layer": {"long_name": "transformer layer (0-based)", "units": "1"},
}


# zarr notes, at every consolidation, that consolidated metadata is not in the v3 specification;
# sinkscope's stores consolidate on purpose (one read of the metadata). Silenced for the process,
# not inside `warnings.catch_warnings`, which is not thread-safe (a store process closes its stores
# side by side).
CONSOLIDATED_NOTE = "Consolidated metadata is currently not part in the Zarr format 3"
warnings.filterwarnings("ignore", message=CONSOLIDATED_NOTE, category=UserWarning)


def tune_zarr() -> None:
    """Apply ZARR_TUNING to this process (extraction and reduction jobs call it)."""
    import zarr  # here: the parse-time digest cache uses this module and needs no zarr

    zarr.config.set(ZARR_TUNING)


def checked_compressors():
    """The compressors of a store's small arrays: zarr's default zstd plus a crc32c checksum, so
    that a changed byte fails the read."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return (ZstdCodec(level=0), Crc32cCodec())


def _netcdf_native(value) -> bool:
    """Whether netCDF (-3 too) can hold `value` as an attribute as it is: text, a number (not a
    boolean; an integer within int32) or a non-empty flat list of such numbers."""
    import numpy as np

    def number(item) -> bool:
        if isinstance(item, bool | np.bool_):
            return False
        if isinstance(item, int | np.integer):
            return _INT32[0] <= item <= _INT32[1]
        return isinstance(item, float | np.floating)

    if isinstance(value, str) or number(value):
        return True
    return isinstance(value, list | tuple) and len(value) > 0 and all(map(number, value))


def encode_attrs(attrs: Mapping) -> dict:
    """`attrs` as netCDF can hold them: values that are not text, numbers or flat lists of numbers
    (mappings, booleans, None, other lists) become JSON text, named in JSON_ATTRIBUTES. Already
    encoded attributes are decoded first, so encoding twice changes nothing."""
    encoded, names = {}, []
    for key, value in decoded_attrs(attrs).items():
        if _netcdf_native(value):
            encoded[key] = value
        else:
            encoded[key] = json.dumps(value, ensure_ascii=False)
            names.append(key)
    if names:
        encoded[JSON_ATTRIBUTES] = " ".join(sorted(names))
    return encoded


def decoded_attrs(attrs) -> dict:
    """The attributes of a store or frame dataset as they were given to `encode_attrs`: those
    JSON_ATTRIBUTES names parsed back from JSON (`config` and `gpu` as dicts, `complete` as a
    bool), the rest as stored. Takes a mapping or anything with `.attrs` (an xarray Dataset, a
    zarr group); attributes written without JSON_ATTRIBUTES come back unchanged."""
    attrs = dict(getattr(attrs, "attrs", attrs))
    names = attrs.pop(JSON_ATTRIBUTES, "")
    for name in str(names).split():
        if isinstance(attrs.get(name), str):
            attrs[name] = json.loads(attrs[name])
    return attrs


def attributes_checksum(attrs: dict) -> int:
    """zlib.crc32 of the attributes but ATTRIBUTES_CHECKSUM, as UTF-8 JSON with sorted keys and
    no spaces."""
    others = {key: value for key, value in attrs.items() if key != ATTRIBUTES_CHECKSUM}
    text = json.dumps(others, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return zlib.crc32(text.encode())


def mark_complete(group_path: str | os.PathLike, attrs: dict | None = None) -> None:
    """The last write of a zarr store (token store, frame dataset) before its rename: `attrs`
    and `complete: true` into the group's attributes (netCDF-safe: `encode_attrs`), their
    checksum, consolidated metadata.
    Readers refuse a store without the mark, so a killed write never passes for a whole one."""
    import zarr

    path = str(group_path)
    group = zarr.open_group(path, mode="r+")
    current = decoded_attrs(group.attrs.asdict())
    current.pop(ATTRIBUTES_CHECKSUM, None)
    encoded = encode_attrs({**current, **(attrs or {}), "complete": True})
    # The checksum, an unsigned 32-bit integer, is always JSON text: netCDF-3 cannot hold it.
    names = {*encoded.get(JSON_ATTRIBUTES, "").split(), ATTRIBUTES_CHECKSUM}
    group.attrs.put({**encoded, JSON_ATTRIBUTES: " ".join(sorted(names))})
    # The checksum of the attributes as a reader gets them back from zarr.json.
    written = zarr.open_group(path, mode="r").attrs.asdict()
    group.attrs[ATTRIBUTES_CHECKSUM] = json.dumps(attributes_checksum(written))
    zarr.consolidate_metadata(path)  # its note about zarr v3 is silenced (CONSOLIDATED_NOTE)


def temporary_path(
    path: str | os.PathLike, suffix: str = TEMPORARY_SUFFIX, *, unique: bool = False
) -> Path:
    """The sibling `path` is built under. `unique` adds host and process, for files that several
    processes (on several nodes of one filesystem) may rewrite at once."""
    path = Path(path)
    if unique:
        suffix = f".{socket.gethostname()}.{os.getpid()}{suffix}"
    return path.with_name(path.name + suffix)


def remove(path: str | os.PathLike) -> None:
    """Delete a file or a directory tree; nothing there is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace(temporary: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Move a finished `temporary` to `path`, replacing a file or directory already there."""
    path = Path(path)
    if Path(temporary).is_dir() and path.exists():
        remove(path)  # os.replace cannot replace a non-empty directory
    os.replace(temporary, path)
    return path


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, suffix: str = TEMPORARY_SUFFIX, *, unique: bool = False
) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write a file or directory to; on success it
    replaces `path`, on any failure it is deleted. A stale temporary is removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path, suffix, unique=unique)
    remove(temporary)
    try:
        yield temporary
        replace(temporary, path)
    except BaseException:
        remove(temporary)
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as temporary:
        temporary.write_text(text)
    return Path(path)


# Significant digits of the numbers in every CSV sinkscope writes (`csv_text`): the stores hold
# float32 (about 7 digits), and 6 keep a value to 1e-6 of itself, far below any difference a
# table's reader or a threshold looks at, at half the width of float64's 17.
CSV_SIGNIFICANT_DIGITS = 6
_EXACT_POWERS = 22  # 10**k is exact in float64 up to k = 22


def significant(values, digits: int = CSV_SIGNIFICANT_DIGITS) -> np.ndarray:
    """`values` as float64 rounded to `digits` significant decimal digits, so that the shortest
    repr of each (what pandas' CSV writer prints) has at most `digits` digits: 0.5636337574 ->
    0.563634, 1.2345678e-05 -> 1.23457e-05. Whole numbers below 2**53 stay exact (a count in a
    float column, 1234567.0), NaN and +-inf stay as they are."""
    x = np.array(values, dtype=np.float64)
    if digits < 1:
        raise ValueError(f"digits must be at least 1, got {digits}")
    whole = np.isfinite(x) & (np.abs(x) < 2.0**53)
    whole[whole] = x[whole] == np.round(x[whole])
    todo = np.isfinite(x) & ~whole
    if not todo.any():
        return x
    flat = x[todo]
    decimals = digits - 1 - np.floor(np.log10(np.abs(flat))).astype(np.int64)
    out = np.empty_like(flat)
    up = (decimals >= 0) & (decimals <= _EXACT_POWERS)
    down = (decimals < 0) & (decimals >= -_EXACT_POWERS)
    # m / 10**d and m * 10**d are correctly rounded: the double nearest to the short decimal.
    scale = 10.0 ** decimals[up]
    out[up] = np.round(flat[up] * scale) / scale
    scale = 10.0 ** -decimals[down]
    out[down] = np.round(flat[down] / scale) * scale
    rest = ~(up | down)  # below 1e-17 or above 1e28: 10**d is inexact, so the slow way
    out[rest] = [float(f"{value:.{digits}g}") for value in flat[rest]]
    x[todo] = out
    return x


def csv_text(table, digits: int = CSV_SIGNIFICANT_DIGITS) -> str:
    """A pandas DataFrame as CSV text without its index, the one way every sinkscope CSV is
    written: every float (float columns, and the floats of object columns) rounded to `digits`
    significant digits (`significant`); integers, text and empty cells as pandas writes them
    (a whole float stays `3.0`, so a float column reads back as floats; inf as `inf`, NaN and NA
    empty)."""
    out = table.copy(deep=False)
    for position in range(table.shape[1]):
        values = table.iloc[:, position]
        kind = getattr(values.dtype, "kind", "O")
        if kind == "f" and isinstance(values.dtype, np.dtype):
            out.isetitem(position, significant(values.to_numpy(), digits))
        elif kind == "f":  # pandas' nullable Float64: NA written empty, as NaN
            out.isetitem(
                position, significant(values.to_numpy(np.float64, na_value=np.nan), digits)
            )
        elif values.dtype == object:
            items = values.to_numpy().copy()
            floats = np.array([type(item) in (float, np.float64, np.float32) for item in items])
            if floats.any():
                rounded = significant(items[floats].astype(np.float64), digits)
                items[floats] = list(rounded)
                out.isetitem(position, items)
    text = _plain_csv_text(out)
    return out.to_csv(index=False) if text is None else text


# Below this many rows pandas' writer is as fast (its start is cheaper than one np.unique a column).
_PLAIN_CSV_ROWS = 500


def _plain_csv_text(table) -> str | None:
    """`table.to_csv(index=False)`, byte for byte, for the tables sinkscope writes (at least two
    columns named by strings, of numpy numbers, text, nullable integers or plain objects, no cell
    the csv module would quote), made one column at a time and each distinct value formatted once
    (pandas' writer goes row by row through the csv module: 3x the time on the policy summary's
    160,000 rows); None for any other table, which pandas then writes. Each cell is formatted as
    pandas hands it to the csv module: floats by numpy's `astype(str)`, NaN and NA empty, objects
    as that module writes them (text as is, the rest by str)."""
    pd = sys.modules["pandas"]  # `table` is a DataFrame; storage imports no pandas (export's env)

    rows, width = table.shape
    names = list(table.columns)
    if rows < _PLAIN_CSV_ROWS or width < 2 or not all(type(name) is str for name in names):
        return None
    columns = []
    for position in range(width):
        cells = _csv_cells(table.iloc[:, position], pd)
        if cells is None:
            return None
        columns.append(cells)
    text = "\n".join([",".join(names), *map(",".join, zip(*columns, strict=True)), ""])
    # A cell holding a comma, a quote or a line break would be quoted by the csv module: then
    # the separators outnumber the cells' (no such cell in sinkscope's tables).
    plain = (
        text.count(",") == (width - 1) * (rows + 1)
        and text.count("\n") == rows + 1
        and '"' not in text
        and "\r" not in text
    )
    return text if plain else None


def _csv_cells(values, pd) -> list[str] | None:
    """The cells of the column `values` as `_plain_csv_text` writes them, None for a dtype it
    leaves to pandas."""
    dtype = values.dtype
    if isinstance(dtype, np.dtype) and (dtype.kind in "iub" or dtype == np.float64):
        array = np.ascontiguousarray(values.to_numpy())
        if dtype.kind == "f":  # distinct by bits: -0.0 apart from 0.0
            bits, inverse = np.unique(array.view(np.int64), return_inverse=True)
            distinct = bits.view(np.float64)
            text = distinct.astype(str).astype(object)
            text[np.isnan(distinct)] = ""
        else:  # as Python's ints and bools
            distinct, inverse = np.unique(array, return_inverse=True)
            text = np.array([str(item) for item in distinct.tolist()], dtype=object)
        return text[inverse].tolist()
    if isinstance(dtype, np.dtype) and dtype.kind == "O":  # mixed: 1, 1.0 and True apart
        items = values.to_numpy()
        missing = pd.isna(items)
        return [
            "" if gone else item if isinstance(item, str) else str(item)
            for item, gone in zip(items.tolist(), missing.tolist(), strict=True)
        ]
    if isinstance(dtype, pd.StringDtype) or dtype.kind in "iub":  # text, nullable integers
        codes, distinct = pd.factorize(values.array)  # NA: code -1, the last cell, empty
        items = np.asarray(distinct.astype(object)).tolist()
        text = np.empty(len(items) + 1, dtype=object)
        text[:] = [*(item if isinstance(item, str) else str(item) for item in items), ""]
        return text[codes].tolist()
    return None


def csv_rows_text(
    columns: Sequence[str], rows: Sequence[Sequence], digits: int = CSV_SIGNIFICANT_DIGITS
) -> str:
    """Rows of plain values under the header `columns` as CSV text, written as `csv_text`
    writes a table (for the GPU jobs, which load no pandas): floats rounded by `significant`
    (NaN empty, inf `inf`), None empty, the rest as str()."""
    cells = [list(row) for row in rows]
    for position in range(len(columns)):
        floats = [
            i for i, row in enumerate(cells) if isinstance(row[position], float | np.floating)
        ]
        rounded = significant([cells[i][position] for i in floats], digits)
        for i, value in zip(floats, rounded.tolist(), strict=True):
            cells[i][position] = "" if value != value else repr(value)  # NaN: empty
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in cells:
        writer.writerow("" if value is None else value for value in row)
    return out.getvalue()


def write_csv(path: str | os.PathLike, table, digits: int = CSV_SIGNIFICANT_DIGITS) -> Path:
    """`csv_text` of `table`, written atomically to `path`."""
    return write_text_atomically(path, csv_text(table, digits))


@contextlib.contextmanager
def locked(lock_file: str | os.PathLike) -> Iterator[None]:
    """An exclusive flock on `lock_file` (created) while the block runs; on a filesystem without
    flock (Lustre without -o flock) the block runs unlocked, so callers keep their writes atomic."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            held = True
        except OSError:
            held = False
        try:
            yield
        finally:
            if held:
                fcntl.flock(handle, fcntl.LOCK_UN)


def disk_usage_bytes(path: str | os.PathLike) -> int:
    """Bytes a file or a directory tree occupies on disk (allocated blocks); 0 if absent."""
    path = Path(path)
    if not path.exists():
        return 0
    if not path.is_dir():
        return path.stat().st_blocks * 512
    total = path.stat().st_blocks * 512
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _reservations(ledger: Path, device: int) -> list[tuple[Path, int]]:
    """(entry, bytes still to be written) of the live reservations on filesystem `device`;
    entries of dead jobs on this host, and old ones of other hosts, are removed."""
    host = socket.gethostname()
    live = []
    for entry in sorted(ledger.glob("*.json")):
        try:
            record = json.loads(entry.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being written, or gone
        if record.get("host") == host:
            stale = not _alive(int(record.get("pid", -1)))
        else:
            stale = time.time() - float(record.get("started", 0)) > FOREIGN_RESERVATION_SECONDS
        if stale:
            entry.unlink(missing_ok=True)
            continue
        if record.get("device") != device:
            continue
        # What it already wrote is no longer free: count only the rest of its reservation.
        written = sum(disk_usage_bytes(path) for path in record.get("paths", []))
        live.append((entry, max(0, int(record["bytes"]) - written)))
    return live


@contextlib.contextmanager
def reserved_space(
    folder: str | os.PathLike,
    needed: int,
    *,
    writing: Sequence[str | os.PathLike],
    what: str = "the outputs",
    ledger: str | os.PathLike = SPACE_LEDGER,
) -> Iterator[None]:
    """Claim `needed` bytes on the filesystem of `folder` while the block writes `writing`.

    Fails (OSError, before anything is written) when the free space, less what other running jobs
    of the workflow have claimed and not yet written, cannot hold `needed`: jobs started together
    cannot all count the same free space. The claim is a file in `ledger`, removed when the block
    ends; a killed job's claim is dropped by the next job that finds its process gone.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ledger = Path(ledger)
    device = folder.stat().st_dev
    mine = ledger / f"{socket.gethostname()}.{os.getpid()}.json"
    with locked(ledger / "lock"):
        others = [(entry, left) for entry, left in _reservations(ledger, device) if entry != mine]
        held = sum(left for _, left in others)
        free = shutil.disk_usage(folder).free
        log.info(
            "will write up to %.2f GB to %s; %.2f GB free, %.2f GB of it claimed by %d other jobs",
            needed / 1e9,
            folder,
            free / 1e9,
            held / 1e9,
            len(others),
        )
        if free - held < needed:
            claims = "".join(f"\n  {entry} ({left / 1e9:.2f} GB)" for entry, left in others)
            raise OSError(
                f"{folder}: {free / 1e9:.2f} GB free, {held / 1e9:.2f} GB of it claimed by "
                f"{len(others)} running jobs, but {what} need up to {needed / 1e9:.2f} GB"
                + (f"; claims (delete one whose job is gone):{claims}" if others else "")
            )
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": device,
            "bytes": int(needed),
            "paths": [str(Path(path).resolve()) for path in writing],
            "started": time.time(),
        }
        with atomic_path(mine) as temporary:
            temporary.write_text(json.dumps(record))
    try:
        yield
    finally:
        mine.unlink(missing_ok=True)
