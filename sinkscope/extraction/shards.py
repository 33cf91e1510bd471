"""Zarr v3 shards written as files, without zarr's codec pipeline.

An attention store writes one shard per pass call of a block and per-key array: the call's key
frames as the shard's chunks, each chunk's bytes followed by their crc32c, then the shard index
(per chunk its offset and size, 2^64 - 1 for a chunk not written) and the index's crc32c, as
zarr's `ShardingCodec(codecs=(BytesCodec(little), Crc32cCodec()), index_codecs=(the same),
index_location=end)` lays it out. zarr writes the same bytes (tests/test_shards.py compares them
file for file) at 40-50 MB/s on one core for this shape, through its event loop, a check of
every chunk for the fill value and a copy per codec; here the chunks are the visible key frames
the writer already knows, copied once, checksummed at ~10 GB/s (google-crc32c, zarr's own
checksum library) and written with one system call: the writer keeps pace with the disk
(benchmarks/store_child.py). The array's metadata is zarr's own (`create_array`); zarr reads the
shards back as it wrote them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import google_crc32c
import numpy as np

_ABSENT = np.iinfo(np.uint64).max  # an index entry of a chunk that was not written
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)


def crc32c(data) -> bytes:
    """The crc32c of `data` as zarr's Crc32cCodec appends it: 4 bytes, little-endian."""
    return np.array([google_crc32c.value(data)], dtype="<u4").tobytes()


def shard_key(array: Path, index: Sequence[int], separator: str = "/") -> Path:
    """The file of shard `index` of the zarr v3 array at `array` (default chunk key encoding with
    `separator`)."""
    return array / separator.join(["c", *map(str, index)])


def write_shard(path: Path, chunks: np.ndarray, positions: Sequence[int], count: int) -> int:
    """Write a shard of `count` chunks along its last axis of which `chunks[i]` (C-contiguous,
    little-endian) is chunk `positions[i]` (ascending) and the others are not written, into the
    existing folder of `path`; returns the bytes written. Nothing to write (no chunk): no file,
    as zarr leaves an empty shard."""
    if len(positions) != len(chunks):
        raise ValueError(f"{len(chunks)} chunks for {len(positions)} positions")
    if not len(positions):
        return 0
    if not chunks.flags.c_contiguous or chunks.dtype.byteorder == ">":
        raise ValueError("shard chunks must be C-contiguous and little-endian")
    index = np.full((count, 2), _ABSENT, dtype="<u8")
    buffers = []
    offset = 0
    for position, chunk in zip(positions, chunks, strict=True):
        data = chunk.reshape(-1).view(np.uint8)  # google-crc32c takes arrays, not memoryviews
        buffers += (data, crc32c(data))
        index[position] = (offset, len(data) + 4)
        offset += len(data) + 4
    encoded = index.reshape(-1).view(np.uint8)
    buffers += (encoded, crc32c(encoded))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        for start in range(0, len(buffers), _IOV_MAX):
            batch = buffers[start : start + _IOV_MAX]
            expected = sum(len(buffer) for buffer in batch)
            done = os.writev(fd, batch)
            while done < expected:  # a short write (signals, full pipes): the rest as bytes
                rest = b"".join(bytes(buffer) for buffer in batch)[done:]
                done += os.write(fd, rest)
            written += expected
    finally:
        os.close(fd)
    return written
