"""What the store process's child does for each survey call, at the real geometry, on one CPU
core: `AttentionStoreWriter.write_prepared` (the key versions derived, the frame-level values
filed, each visible key frame's chunk packed, of what `prepare_call` made on the model's device:
not timed) and the writer thread's `_write` (each shard's chunks checksummed and written:
`extraction/shards.py`), run one after the other on one thread into a temporary folder, so that
CPU seconds are one core's.

A survey of Wan2.1-T2V-1.3B (30 layers, 12 heads, T = 1560, 21 frames in 7 blocks of 3, 5 passes)
makes 1,050 calls of key_mass and key_logit_mean [12, 3, keys so far] (5.7 GB of float32 in
all), of which the child gets what the store keeps (1.7 GB at float16). Printed per precision
(`capture.survey_precision`): the bytes written, the seconds, and MB/s of store written per CPU
second, against the disk of the H100 machine in issue 44 (1.0-1.1 GB/s with direct I/O); and
zarr's own pipeline writing the same float16 arrays (each call's rows assigned to the sharded
array, so zarr rewrites a block's shard at each of its passes), as the writer did before
extraction/shards.py.

Run from the repository root: `python benchmarks/store_child.py [--layers 30] [--repeat 3]`
(a few minutes on 2 CPU cores; `--layers 3` for a quick look). The best of `--repeat`.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sinkscope.extraction.attention_store import AttentionStoreWriter, prepare_call
from sinkscope.extraction.store_process import ArrayRef
from sinkscope.schedules import BlockPart, ModelCall

HEADS, T, FRAMES, BLOCK, PASSES = 12, 1560, 21, 3, 5


def calls(layers: int):
    """(first query frame, key frames) of every survey call, in call order."""
    for _ in range(layers):
        for first in range(0, FRAMES, BLOCK):
            for _ in range(PASSES):
                yield first, np.arange(first + BLOCK)


DISK_MB_PER_S = 1000  # the H100 machine's disk in issue 44 (dd with direct I/O)


def call_rows(ring, refs, first, key_frames, precision):
    """One survey call as the capture hands it to the child: `prepare_call` of the call's float32
    rows (done on the model's device, so not timed here)."""
    mass, logits = (torch.from_numpy(ref.view(ring)) for ref in refs)
    entropy = np.zeros((HEADS, BLOCK), np.float32)
    call = ModelCall("denoise", (BlockPart(first // BLOCK, first, BLOCK, 0, 0),))
    prepared = prepare_call(mass, logits, None, T, precision)
    return call, np.zeros(len(key_frames), bool), entropy, [v.numpy() for v in prepared[:4]]


def writer_at(folder: str, precision: str, layer: int) -> AttentionStoreWriter:
    writer = AttentionStoreWriter(
        f"{folder}/layer{layer}.zarr",
        num_heads=HEADS,
        num_frames=FRAMES,
        frame_seq_length=T,
        frames_per_block=BLOCK,
        timesteps=[float(p) for p in range(PASSES)],
        pass_kinds=["denoise"] * PASSES,
        attrs={},
        precision=precision,
    )
    # On this thread: the writer thread's work right after the child's, one core's seconds.
    writer._put = lambda item: writer._write(*item)
    return writer


def through_zarr(writer: AttentionStoreWriter, step, first, key_frames, mass, logits) -> None:
    """The block's rows as stored, spread over every key token (NaN where not visible) and
    assigned to the sharded arrays, zarr's pipeline choosing the chunks to write: the writer
    before extraction/shards.py."""
    for array, values in ((writer.key_mass, mass), (writer.key_logits, logits)):
        rows = np.full((1, *values.shape[:-1], FRAMES * T), np.nan, array.dtype)
        rows[0, ..., : len(key_frames) * T] = values
        array[step : step + 1, ..., first : first + BLOCK, :] = rows


def cpu_seconds() -> tuple[float, float]:
    """This process's (user, kernel) CPU seconds: zarr's pipeline works in threads of its own."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def run(way: str, ring, size: int, layers: int) -> tuple[float, float, int, float]:
    """(wall seconds, CPU seconds, bytes on disk, of the CPU seconds those in the kernel) of
    the child's work on `layers` layers' calls written `way`."""
    precision = "float16" if way == "zarr" else way
    wall = user = kernel = 0.0
    with tempfile.TemporaryDirectory() as folder:
        writers = [writer_at(folder, precision, layer) for layer in range(layers)]
        for index, (first, key_frames) in enumerate(calls(layers)):
            writer = writers[index // (PASSES * FRAMES // BLOCK)]
            step = index % PASSES
            shape = (HEADS, BLOCK, len(key_frames) * T)
            refs = [ArrayRef(i * size, shape, "float32") for i in (0, 1)]
            call, anchor, entropy, prepared = call_rows(ring, refs, first, key_frames, precision)
            cpu, started = cpu_seconds(), time.perf_counter()
            if way == "zarr":
                through_zarr(writer, step, first, key_frames, *prepared[:2])
            else:
                writer.write_prepared(step, first, call, key_frames, anchor, entropy, *prepared)
            done = cpu_seconds()
            wall += time.perf_counter() - started
            user, kernel = user + done[0] - cpu[0], kernel + done[1] - cpu[1]
        written = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        for writer in writers:
            writer.abort()
    return wall, user + kernel, written, kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the store process's child: one core's seconds
    size = HEADS * BLOCK * FRAMES * T * 4
    buffer = np.random.default_rng(0).random(2 * size // 4, dtype=np.float32)
    buffer /= FRAMES * T  # masses of the size a softmax over the visible keys gives
    ring = memoryview(buffer.view(np.uint8))
    best: dict[str, tuple[float, float, int, float]] = {}
    for _ in range(args.repeat):
        for way in ("float16", "float32", "zarr"):
            result = run(way, ring, size, args.layers)
            if way not in best or result[1] < best[way][1]:
                best[way] = result
    print(
        f"{args.layers} layers x {FRAMES // BLOCK} blocks x {PASSES} passes at T={T}, {HEADS} "
        f"heads; the child's and the writer's work on one thread, best of {args.repeat}"
    )
    for way, (wall, cpu, written, kernel) in best.items():
        rate = written / 1e6 / cpu
        print(
            f"{way:>8}: {written / 1e9:5.2f} GB in {wall:6.2f} s ({cpu:6.2f} s CPU, "
            f"{kernel:5.2f} s of it in the kernel): {rate:6.0f} MB/s per core, "
            f"{rate / DISK_MB_PER_S:4.2f} x the disk's {DISK_MB_PER_S} MB/s; "
            f"{written / 1e6 / max(cpu - kernel, 1e-9):6.0f} MB/s per core outside the kernel"
        )
    ratio = (best["zarr"][1] / best["zarr"][2]) / (best["float16"][1] / best["float16"][2])
    print(f"CPU per byte, zarr's pipeline / extraction/shards.py (float16): {ratio:.1f} x")


if __name__ == "__main__":
    main()
