"""Zarr v3 shards written as files, without zarr's codec pipeline.

An attention store writes one shard per block (all its passes) and per-key array, a token store
one per row of logits (one query frame of one head and pass): the key frames (of each pass in
turn) as the shard's chunks, each chunk's bytes followed by their crc32c, then the shard index
(per chunk its offset and size, 2^64 - 1 for a chunk not written) and the index's crc32c, as zarr's
`ShardingCodec(codecs=(BytesCodec(little), Crc32cCodec()), index_codecs=(the same),
index_location=end)` lays it out. zarr writes the same bytes (tests/test_shards.py compares them
file for file) at 40-50 MB/s on one core for this shape, through its event loop, a check of
every chunk for the fill value and a copy per codec; here the chunks are the visible key frames
the writer already knows, copied once into the file's image, checksummed at ~10 GB/s
(google-crc32c, zarr's own checksum library) and written with one system call.

The write bypasses the page cache (O_DIRECT) where the file system takes it: the disk reads the
image from the writer's memory, so the kernel copies nothing, where a write into the page cache
costs a core ~0.3-1 s per GB (2 to 4 times the writer's own work: benchmarks/README.md) and the
cache then fills with a store nobody rereads soon. Elsewhere (tmpfs, some network file systems,
no O_DIRECT on the platform) the same bytes go through the page cache. The array's metadata is
zarr's own (`create_array`); zarr reads the shards back as it wrote them.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import google_crc32c
import numpy as np

log = logging.getLogger(__name__)

_ABSENT = np.iinfo(np.uint64).max  # an index entry of a chunk that was not written
# What O_DIRECT asks of a write's offset, length and memory: a multiple of the device's logical
# block size, 512 or 4096 bytes (the page size, which mmap's memory is aligned to).
_DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0: not on this platform (macOS)
# SINKSCOPE_DIRECT_IO=0: every shard through the page cache (a file system that takes O_DIRECT
# and then misbehaves, or a store read back at once from a machine with memory to spare).
DIRECT_IO_VARIABLE = "SINKSCOPE_DIRECT_IO"
# Per file system (st_dev), whether O_DIRECT writes work there; learnt at the first shard.
_direct_works: dict[int, bool] = {}
_images = threading.local()  # per writer thread, the page-aligned memory of its file images


def crc32c(data) -> bytes:
    """The crc32c of `data` as zarr's Crc32cCodec appends it: 4 bytes, little-endian."""
    return np.array([google_crc32c.value(data)], dtype="<u4").tobytes()


def shard_key(array: Path, index: Sequence[int], separator: str = "/") -> Path:
    """The file of shard `index` of the zarr v3 array at `array` (default chunk key encoding with
    `separator`)."""
    return array / separator.join(["c", *map(str, index)])


def _image(size: int) -> np.ndarray:
    """`size` bytes of page-aligned memory of this thread, kept for its next shard: a fresh
    buffer per shard would cost its page faults every time."""
    buffer = getattr(_images, "buffer", None)
    if buffer is None or len(buffer) < size:
        _images.buffer = buffer = np.frombuffer(mmap.mmap(-1, size), np.uint8)
    return buffer[:size]


def morton_order(positions: Sequence[int], grid: Sequence[int]) -> np.ndarray:
    """The order in which zarr lays out chunks `positions` (flat C-order indices into a shard's
    chunk `grid`) in a shard file: by their compressed Morton code (the bits of each coordinate
    interleaved from the lowest, a dimension of c chunks taking (c - 1).bit_length() bits), as
    zarr's `morton_order_iter` enumerates them. A grid of one dimension: the positions' own."""
    coords = np.stack(np.unravel_index(np.asarray(positions, np.int64), tuple(grid)), axis=1)
    bits = [(int(c) - 1).bit_length() for c in grid]
    codes = np.zeros(len(coords), np.int64)
    out_bit = 0
    for coord_bit in range(max(bits, default=0)):
        for dim, dim_bits in enumerate(bits):
            if coord_bit < dim_bits:
                codes |= ((coords[:, dim] >> coord_bit) & 1) << out_bit
                out_bit += 1
    return np.argsort(codes, kind="stable")


def write_shard(
    path: Path,
    chunks: np.ndarray | Sequence[np.ndarray],
    positions: Sequence[int],
    count: int,
    *,
    grid: Sequence[int] | None = None,
    checksums: bool = True,
    direct: bool = True,
) -> int:
    """Write a shard of `count` chunks of which the i-th chunk of `chunks` (one C-contiguous
    little-endian array [n, *chunk], or several whose chunks follow one another) is chunk
    `positions[i]` (ascending; the C-order index into the shard's chunk `grid`, one dimension
    of `count` if None) and the others are not written, into the existing folder of `path`;
    returns the bytes written. The chunks lie in the file in zarr's (Morton) order. Nothing to
    write (no chunk): no file, as zarr leaves an empty shard. `checksums=False`: the chunks
    without their crc32c (an array whose chunk codecs are the bytes codec alone); the index
    always has its own. `direct`: past the page cache where the file system takes it (the
    module's docstring)."""
    parts = [chunks] if isinstance(chunks, np.ndarray) else list(chunks)
    for part in parts:
        if not part.flags.c_contiguous or part.dtype.byteorder == ">":
            raise ValueError("shard chunks must be C-contiguous and little-endian")
    data = [chunk.reshape(-1).view(np.uint8) for part in parts for chunk in part]
    if len(positions) != len(data):
        raise ValueError(f"{len(data)} chunks for {len(positions)} positions")
    if not len(positions):
        return 0
    chunk_bytes = len(data[0])
    if any(len(chunk) != chunk_bytes for chunk in data):
        raise ValueError("the chunks of a shard must have one size")
    stride = chunk_bytes + 4 * checksums
    size = len(positions) * stride + 16 * count + 4
    padded = -(-size // _DIRECT_ALIGN) * _DIRECT_ALIGN
    image = _image(padded)
    # The file's bytes: each chunk and its checksum, then the index and its checksum.
    index = np.full((count, 2), _ABSENT, dtype="<u8")
    order = range(len(data)) if grid is None or len(grid) == 1 else morton_order(positions, grid)
    for slot, chunk_number in enumerate(order):
        offset = slot * stride
        image[offset : offset + chunk_bytes] = data[chunk_number]
        if checksums:
            image[offset + chunk_bytes : offset + stride] = np.frombuffer(
                crc32c(image[offset : offset + chunk_bytes]), np.uint8
            )
        index[positions[chunk_number]] = (offset, stride)
    start = len(positions) * stride
    encoded = index.reshape(-1).view(np.uint8)
    image[start : start + len(encoded)] = encoded
    image[start + len(encoded) : size] = np.frombuffer(crc32c(encoded), np.uint8)
    direct = direct and _O_DIRECT and os.environ.get(DIRECT_IO_VARIABLE, "1") != "0"
    device = os.stat(path.parent).st_dev if direct else None
    if direct and _direct_works.get(device, True):
        try:
            _write_direct(path, image, size)
            _direct_works[device] = True
            return size
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            _direct_works[device] = False
            log.info(
                "%s: no direct I/O on this file system (%s); writing through the page cache",
                path.parent,
                err,
            )
    _write_buffered(path, image[:size])
    return size


def _write_direct(path: Path, image: np.ndarray, size: int) -> None:
    """The aligned image (its padding beyond `size` too) written past the page cache, the file
    then cut to `size`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
    try:
        done = os.write(fd, image)
        if done != len(image):  # a short direct write: not for aligned whole-file writes
            raise OSError(errno.EINVAL, f"short direct write ({done} of {len(image)} bytes)")
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _write_buffered(path: Path, data: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:  # a short write (signals, full pipes): the rest
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def direct_io_works(folder: Path) -> bool | None:
    """Whether shards written into `folder` went past the page cache (None: none written yet)."""
    return _direct_works.get(os.stat(folder).st_dev)
