"""What the store process's child does on its own thread for each survey call, at the real
geometry, on the CPU: before, and as `store_process.serve` and `AttentionStoreWriter.write_call`
do it now.

A survey of Wan2.1-T2V-1.3B (30 layers, 12 heads, T = 1560, 21 frames in 7 blocks of 3, 5 passes)
hands the child 1,050 calls of key_mass and key_logit_mean [12, 3, keys so far] (5.7 GB in all);
the child spreads each over all 32,760 key tokens (NaN where not visible) into the two chunks the
writer thread compresses. On an H200 the child lagged the model (benchmarks/README.md): this is
its thread's part of the work, without compression or disk (the writer threads' part).

- before: each array copied out of the ring (`ArrayRef.read`), then each chunk filled with NaN
  (`np.full`) and the visible keys copied over it;
- now: the arrays read in place (`ArrayRef.view`, the writer declares `copies_arguments`) and
  each chunk's bytes written once (`write_block`: the runs of visible keys, NaN between and
  after) into a chunk the writer thread has handed back (a new one page-faults each call); and,
  since the survey's calls hand the child the keys as the cache holds them (`write_call`), the
  key versions and the pooled logits (the mean of key_logit_mean over each key frame's tokens)
  derived here, which the model's thread computed on the GPU before.

Run from the repository root: `python benchmarks/store_child.py [--layers 30] [--repeat 3]`
(about a minute on 2 CPU cores). It prints the seconds of each way and their ratio, best of
`--repeat`.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from sinkscope.extraction.store import AttentionStoreWriter
from sinkscope.extraction.store_process import ArrayRef
from sinkscope.schedules import BlockPart, ModelCall

HEADS, T, FRAMES, BLOCK, PASSES = 12, 1560, 21, 3, 5


def calls(layers: int):
    """(first query frame, key frames) of every survey call, in call order."""
    for _ in range(layers):
        for first in range(0, FRAMES, BLOCK):
            for _ in range(PASSES):
                yield first, np.arange(first + BLOCK)


def before(ring: memoryview, refs, first: int, key_frames: np.ndarray) -> None:
    """The child and `write_block` as they were at 5868048."""
    mass, logits = (ref.read(ring) for ref in refs)
    for values in (mass, logits):
        rows = np.full((1, HEADS, BLOCK, FRAMES * T), np.nan, np.float32)
        rows[0, :, :, : len(key_frames) * T] = values  # one run: frames 0 .. last
        del rows


def now(writer: AttentionStoreWriter, ring: memoryview, refs, first, key_frames) -> None:
    mass, logits = (ref.view(ring) for ref in refs)
    entropy = np.zeros((HEADS, BLOCK), np.float32)
    call = ModelCall("denoise", (BlockPart(first // BLOCK, first, BLOCK, 0, 0),))
    anchor = np.zeros(len(key_frames), bool)
    writer.write_call(0, first, call, key_frames, anchor, mass, entropy, logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    size = HEADS * BLOCK * FRAMES * T * 4
    buffer = np.random.default_rng(0).random(2 * size // 4, dtype=np.float32)
    ring = memoryview(buffer.view(np.uint8))
    with tempfile.TemporaryDirectory() as folder:
        writer = AttentionStoreWriter(
            f"{folder}/s.zarr",
            num_heads=HEADS,
            num_frames=FRAMES,
            frame_seq_length=T,
            frames_per_block=BLOCK,
            timesteps=[1.0],
            pass_kinds=["denoise"],
            attrs={},
        )
        # The child's thread only: no compression, no disk; the writer thread hands the chunks
        # back as `_write` does once zarr has them.
        writer._put = lambda item: writer._spare_rows.extend(item[2:])
        ways = {"before": lambda *a: before(ring, *a), "now": lambda *a: now(writer, ring, *a)}
        best = dict.fromkeys(ways, float("inf"))
        nbytes = 0
        for _ in range(args.repeat):
            for name, way in ways.items():
                started, nbytes = time.perf_counter(), 0
                for first, key_frames in calls(args.layers):
                    shape = (HEADS, BLOCK, len(key_frames) * T)
                    refs = [ArrayRef(i * size, shape, "float32") for i in (0, 1)]
                    way(refs, first, key_frames)
                    nbytes += 2 * np.prod(shape) * 4
                best[name] = min(best[name], time.perf_counter() - started)
        writer.abort()
    print(
        f"{args.layers} layers x {FRAMES // BLOCK} blocks x {PASSES} passes: "
        f"{nbytes / 1e9:.2f} GB of key_mass and key_logit_mean handed to the child"
    )
    for name, seconds in best.items():
        print(f"{name:>7}: {seconds:6.2f} s  ({nbytes / 1e9 / seconds:.1f} GB/s)")
    print(f"before / now: {best['before'] / best['now']:.2f}")


if __name__ == "__main__":
    main()
