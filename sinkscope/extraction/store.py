"""The token store (docs/DESIGN.md, Contract 1): pre-softmax logits, token-chunked zarr v3.

One background thread writes each store, so the model computes the next row while the last one is
written. The store is built under `<name>.partial` and renamed when complete: a
killed job never leaves a directory that looks whole. Every chunk and every shard index carries a
crc32c checksum: a changed byte fails its read instead of reducing to different numbers.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import resource
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec

from sinkscope.schedules import UNSEEN_VERSION
from sinkscope.storage import (
    VARIABLE_ATTRS,
    checked_compressors,
    encode_attrs,
    mark_complete,
    remove,
    replace,
    temporary_path,
    tune_zarr,
)

from .shards import shard_key, write_shard

log = logging.getLogger(__name__)

LOGITS_DIMS = ("step", "head", "query_token", "key_token")
# Frame-level mean logits from pooled q and k; own dimension names, since `query_frame` and
# `key_frame` already name the per-token frame coordinates.
POOLED_DIMS = ("step", "head", "pooled_query_frame", "pooled_key_frame")
KEY_MASS_DIMS = ("step", "head", "query_frame", "key_token")
PARTIAL_SUFFIX = ".partial"


class ThreadedCrc32cCodec(Crc32cCodec):
    """zarr's crc32c codec, the same on disk and in the metadata ({"name": "crc32c"}), that
    computes its checksums in worker threads as zarr's BloscCodec compresses: zarr's own computes
    them in its event loop, one chunk after the other, which cost the writes twice as much
    (benchmarks/README.md, "Checksums")."""

    async def _encode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)


def logits_compressors() -> tuple[Crc32cCodec, ...]:
    """The bytes -> bytes codecs of each (T, T) logits chunk: a crc32c checksum, so that any
    changed byte of a chunk fails its read, and no compression (zstd gave 1.09x on the float16
    logits for two thirds of the writer's time: benchmarks/README.md)."""
    return (Crc32cCodec(),)


def shard_index_codecs() -> tuple[BytesCodec, Crc32cCodec]:
    """The codecs of each shard's index (zarr's default, spelt out): the chunk offsets and
    lengths carry a crc32c checksum too, so a damaged or truncated shard fails its read."""
    return (BytesCodec(endian="little"), Crc32cCodec())


def logits_sharding(frame_seq_length: int) -> ShardingCodec:
    """The serializer of the logits array: (1, 1, T, T) chunks inside each shard."""
    t = frame_seq_length
    return ShardingCodec(
        chunk_shape=(1, 1, t, t),
        codecs=(BytesCodec(endian="little"), *logits_compressors()),
        index_codecs=shard_index_codecs(),
        index_location="end",
    )


def thread_cpu_seconds() -> tuple[float, float]:
    """This thread's CPU time so far, (user, kernel) seconds: Linux's per-thread rusage, or the
    thread's whole CPU time as user time where there is none."""
    if hasattr(resource, "RUSAGE_THREAD"):
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return usage.ru_utime, usage.ru_stime
    return time.thread_time(), 0.0


def partial_path(path: Path) -> Path:
    return temporary_path(path, PARTIAL_SUFFIX)


def key_frame_runs(key_frames: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of key frames that lie side by side both in the tile and in the video, as (first
    frame, stop frame, offset in the tile in frames), in tile order (ascending frames when the
    tile's are)."""
    runs = []
    offset = 0
    start = prev = int(key_frames[0])
    for frame in key_frames[1:]:
        frame = int(frame)
        if frame != prev + 1:
            runs.append((start, prev + 1, offset))
            offset += prev + 1 - start
            start = frame
        prev = frame
    runs.append((start, prev + 1, offset))
    return runs


class ClosesOrAborts:
    """A writer as a context manager: `close` when the block ends well, `abort` (nothing left
    that looks whole) when it raises."""

    def close(self):
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class _StoreWriter(ClosesOrAborts):
    """What both stores share: the group with its attributes (netCDF-safe: `encode_attrs`), the
    step, head and frame coordinates (every array with its long_name and units), the
    pooled frame-level mean logits (kept in memory, written at close), a background writer
    thread fed through a bounded queue, and the `.partial` -> complete -> rename protocol.

    Subclasses create their own arrays in `_create_arrays` and write one queued item in `_write`.
    """

    what = "store"
    store_kind = ""  # what `LogitCapture` writes to it: "tokens", "attention" or "slots"
    pooled_logits = True  # frame-level mean logits from pooled q and k (F x F per step and head)
    # Whether every write method has copied what it keeps of its arrays when it returns: a store
    # process then hands it views of its shared ring instead of copies (`store_process.serve`).
    copies_arguments = False

    def __init__(
        self,
        path: str | Path,
        *,
        num_heads: int,
        num_frames: int,
        frame_seq_length: int,
        timesteps: Sequence[float],
        pass_kinds: Sequence[str],
        attrs: dict,
        max_pending: int = 2,
    ):
        tune_zarr()
        self.path = Path(path)
        self.tmp = partial_path(self.path)
        remove(self.tmp)
        self.tmp.parent.mkdir(parents=True, exist_ok=True)
        self.num_heads = num_heads
        self.num_frames = num_frames
        self.frame_seq_length = frame_seq_length
        self.num_tokens = num_frames * frame_seq_length
        self.num_steps = len(timesteps)
        self.pass_kinds = [str(kind) for kind in pass_kinds]
        group = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
        group.attrs.update(encode_attrs(attrs))
        self._group = group
        self._create_arrays(group)
        # Small (steps x heads x F x F): kept in memory, written whole at close.
        self.pooled = (
            np.full((self.num_steps, num_heads, num_frames, num_frames), np.nan, np.float32)
            if self.pooled_logits
            else None
        )
        # Which copy of each key frame each query frame saw, on the same frame grid (written
        # when the capture gave it: stores written by hand for tests have none).
        self.versions_given = False
        self.key_version = (
            np.full((self.num_steps, num_frames, num_frames), UNSEEN_VERSION, np.int8)
            if self.pooled_logits
            else None
        )
        coordinates = [
            ("step", ("step",), np.arange(self.num_steps, dtype=np.int32)),
            ("head", ("head",), np.arange(num_heads, dtype=np.int32)),
            ("timestep", ("step",), np.asarray(timesteps, dtype=np.float32)),
            ("pass_kind", ("step",), np.asarray(pass_kinds, dtype=str)),
            *self._coordinates(),
        ]
        for name, dims, values in coordinates:
            array = group.create_array(
                name,
                shape=values.shape,
                dtype=str if name == "pass_kind" else values.dtype,
                dimension_names=dims,
                compressors=checked_compressors(),
                attributes=VARIABLE_ATTRS[name],
            )
            array[:] = values
        self.bytes_written = 0  # logical bytes of what the writer thread wrote
        self.write_seconds = 0.0  # time the writer thread spent writing them
        # the writer thread's CPU time in those writes: in user space (checksums, copies) and
        # in the kernel (the system calls: copying into the page cache)
        self.write_user_seconds = 0.0
        self.write_system_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"zarr-writer {self.path.name}", daemon=True
        )
        self._thread.start()
        self._closed = False

    def _create_arrays(self, group: zarr.Group) -> None:
        raise NotImplementedError

    def _coordinates(self) -> list[tuple[str, tuple, np.ndarray]]:
        """The per-token (or per-frame, per-slot) coordinate arrays: (name, dims, values)."""
        raise NotImplementedError

    def _token_frame(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_frames, dtype=np.int32), self.frame_seq_length)

    def _write(self, *item) -> None:
        raise NotImplementedError

    def _write_pending(self) -> int:
        """The writer thread's last write, after the last item: what `_write` kept back."""
        return 0

    def _finish(self, group: zarr.Group) -> None:
        """Write what was kept in memory (after the writer thread has finished)."""

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if self._error is not None:
                if item is None:
                    return
                continue  # drain after a failure; the error surfaces in _put/close
            try:
                started, (user, system) = time.perf_counter(), thread_cpu_seconds()
                self.bytes_written += self._write_pending() if item is None else self._write(*item)
                self.write_seconds += time.perf_counter() - started
                user_done, system_done = thread_cpu_seconds()
                self.write_user_seconds += user_done - user
                self.write_system_seconds += system_done - system
            except BaseException as err:
                self._error = err
            if item is None:
                return

    def _put(self, item: tuple) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing {self.tmp} failed") from self._error
        self._queue.put(item)

    def write_pooled(
        self,
        step: int,
        first_query_frame: int,
        key_frames: np.ndarray,
        values: np.ndarray,
        versions: np.ndarray | None = None,
    ) -> None:
        """Frame-level mean logits [heads, query frames, len(key_frames)] of one pass call, and
        the version of each key frame the call saw (`sinkscope.schedules.KEY_VERSIONS`)."""
        queries = slice(first_query_frame, first_query_frame + values.shape[1])
        # Index through views: mixing an int, a slice and an array would reorder the axes.
        self.pooled[step][:, queries][:, :, key_frames] = values
        if versions is not None:
            self.key_version[step][queries][:, key_frames] = versions
            self.versions_given = True

    def close(self) -> Path:
        """Finish writing, consolidate metadata and move the store to its final name."""
        if self._closed:
            return self.path
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            remove(self.tmp)
            raise RuntimeError(f"writing {self.tmp} failed") from self._error
        if self.pooled is not None:
            pooled = self._group.create_array(
                "logit_mean_pooled",
                shape=self.pooled.shape,
                dtype="float32",
                fill_value=np.nan,
                dimension_names=POOLED_DIMS,
                compressors=checked_compressors(),
                attributes=VARIABLE_ATTRS["logit_mean_pooled"],
            )
            pooled[:] = self.pooled
        if self.versions_given:
            version = self._group.create_array(
                "key_version",
                shape=self.key_version.shape,
                dtype="int8",
                fill_value=UNSEEN_VERSION,
                dimension_names=(POOLED_DIMS[0], *POOLED_DIMS[2:]),
                compressors=checked_compressors(),
                attributes=VARIABLE_ATTRS["key_version"],
            )
            version[:] = self.key_version
        self._finish(self._group)
        # Marked only now: a store without `complete` is never accepted downstream.
        mark_complete(
            self.tmp, {"completed_at": datetime.now(UTC).isoformat(timespec="milliseconds")}
        )
        replace(self.tmp, self.path)
        log.info(
            "%s: %.3f GB of %s written in %.1f s of writer time (%.0f MB/s)",
            self.path,
            self.bytes_written / 1e9,
            self.what,
            self.write_seconds,
            self.bytes_written / 1e6 / max(self.write_seconds, 1e-9),
        )
        return self.path

    def abort(self) -> None:
        """Stop and delete everything written so far."""
        if not self._closed:
            self._closed = True
            self._error = self._error or RuntimeError("aborted")
            self._queue.put(None)
            self._thread.join()
        remove(self.tmp)


class TokenStoreWriter(_StoreWriter):
    """Writes one layer's logits rows (one query frame x all key tokens) from a background thread.

    Each row is one zarr shard (1, 1, T, N) of a (T, T) chunk per key frame, written by this one
    writer only, as a file (`shards.write_shard`: zarr's bytes without zarr's pipeline); the
    chunks of key frames the query frame cannot see are never written (they read back as NaN).
    With `tokens=False` only the pooled frame-level mean logits are stored.
    """

    what = "float16 logits"
    store_kind = "tokens"

    def __init__(self, path: str | Path, *, tokens: bool = True, max_pending_rows: int = 2, **kw):
        self.tokens = tokens
        super().__init__(path, max_pending=max_pending_rows, **kw)

    def _create_arrays(self, group: zarr.Group) -> None:
        if not self.tokens:
            return
        t, n = self.frame_seq_length, self.num_tokens
        sharding = logits_sharding(t)
        # What write_shard writes: each chunk followed by its crc32c, or not (a store built
        # without checksums, as benchmarks/measure.py builds one).
        self._chunk_checksums = any(isinstance(c, Crc32cCodec) for c in sharding.codecs)
        if not all(isinstance(c, BytesCodec | Crc32cCodec) for c in sharding.codecs):
            raise ValueError(f"the logits shards are written as files: no codec {sharding}")
        self.logits = group.create_array(
            "logits",
            shape=(self.num_steps, self.num_heads, n, n),
            chunks=(1, 1, t, n),
            serializer=sharding,
            compressors=None,
            dtype="float16",
            fill_value=np.nan,
            dimension_names=LOGITS_DIMS,
            attributes={
                **VARIABLE_ATTRS["logits"],
                "coordinates": "timestep pass_kind query_frame key_frame",
            },
            # the row's shard files side by side in the array's folder (c.0.1.5.0)
            chunk_key_encoding={"name": "default", "separator": "."},
        )

    def _coordinates(self) -> list[tuple[str, tuple, np.ndarray]]:
        token_frame = self._token_frame()
        return [
            ("query_frame", ("query_token",), token_frame),
            ("key_frame", ("key_token",), token_frame),
        ]

    def _write(
        self, step: int, head: int, query_frame: int, tiles: np.ndarray, key_frames: np.ndarray
    ) -> int:
        order = np.argsort(key_frames, kind="stable")
        if np.any(order != np.arange(len(order))):
            tiles, key_frames = tiles[order], key_frames[order]
        tiles = np.ascontiguousarray(tiles, dtype="<f2")
        shard = shard_key(self.tmp / "logits", (step, head, query_frame, 0), separator=".")
        write_shard(
            shard,
            tiles,
            [int(f) for f in key_frames],
            self.num_frames,
            checksums=self._chunk_checksums,
        )
        return tiles.nbytes

    def write_row(
        self, step: int, head: int, query_frame: int, tiles: np.ndarray, key_frames: np.ndarray
    ) -> None:
        """Queue the logits of one query frame and head against each visible key frame: tiles
        [len(key_frames), T, T] (query token x key token), key frames distinct whole frames."""
        t = self.frame_seq_length
        if tiles.shape != (len(key_frames), t, t):
            raise ValueError(
                f"{self.path}: logits tiles {tiles.shape} for {len(key_frames)} key frames of "
                f"{t} tokens (expected {(len(key_frames), t, t)})"
            )
        self._put((step, head, query_frame, tiles, np.asarray(key_frames)))
