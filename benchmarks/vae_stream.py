"""Benchmark: the streaming VAE decode (`sinkscope.wan.vae.iter_decoded_frames`) keeps its memory
bounded whatever the video's length.

Each length decodes in its own subprocess (so peak memories do not mix): a random VAE of Wan2.1's
structure (`--base-dim` channels, 2 by default as the tests' tiny one; 96 is Wan's) decodes
random latents [16, F, H, W] one latent frame at a time, each chunk of uint8 frames dropped as
it comes (a writer would encode it). Printed per length: pixel frames, seconds, frames per second,
peak resident memory of the process and its increase over the resident memory just before the
decode (the decode's own working set, without Python, torch and the model). The target of the
streaming decode: the 1,101-latent-frame closed loop of the demo models within 10 % of the
42-frame one. Not a test.

    python benchmarks/vae_stream.py                          # demo latents (8 x 12), F = 42, 1101
    python benchmarks/vae_stream.py --frames 21 --height 60 --width 104 --base-dim 96  # Wan's
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _child(frames: int, height: int, width: int, base_dim: int, threads: int) -> dict:
    import torch

    from sinkscope.wan.vae import iter_decoded_frames, random_vae, tiny_vae_config

    torch.set_num_threads(threads)
    vae = random_vae(tiny_vae_config(base_dim))
    latents = torch.randn(16, frames, height, width, generator=torch.Generator().manual_seed(0))
    # One latent frame first, so the allocator's first growth is not counted as the decode's.
    with torch.no_grad():
        for _ in iter_decoded_frames(vae, latents[:, :1]):
            pass
    before = _rss_mb()
    start = time.perf_counter()
    count = 0
    with torch.no_grad():
        for chunk in iter_decoded_frames(vae, latents):
            count += chunk.shape[0]
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"frames": count, "seconds": seconds, "peak_mb": peak, "increase_mb": peak - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[42, 1101])
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=12)
    parser.add_argument("--base-dim", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        (frames,) = args.frames
        result = _child(frames, args.height, args.width, args.base_dim, args.threads)
        print(json.dumps(result))
        return
    rows = []
    for frames in args.frames:
        command = [
            sys.executable, __file__, "--child", "--frames", str(frames), "--height",
            str(args.height), "--width", str(args.width), "--base-dim", str(args.base_dim),
            "--threads", str(args.threads),
        ]  # fmt: skip
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append((frames, json.loads(out.strip().splitlines()[-1])))
    print(
        f"latents {args.height} x {args.width}, VAE base_dim {args.base_dim}, "
        f"{args.threads} threads"
    )
    print(f"{'latent F':>9} {'pixel T':>8} {'s':>7} {'fps':>7} {'peak MB':>8} {'decode MB':>10}")
    for frames, row in rows:
        fps = row["frames"] / row["seconds"]
        print(
            f"{frames:>9} {row['frames']:>8} {row['seconds']:>7.1f} {fps:>7.1f} "
            f"{row['peak_mb']:>8.0f} {row['increase_mb']:>10.1f}"
        )
    if len(rows) > 1:
        first, last = rows[0][1], rows[-1][1]
        print(
            f"peak {last['peak_mb'] / first['peak_mb']:.3f} x, decode working set "
            f"{last['increase_mb'] - first['increase_mb']:+.1f} MB from F = {rows[0][0]} to "
            f"F = {rows[-1][0]} (target: peak within 1.10 x)"
        )


if __name__ == "__main__":
    main()
