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

`--estimate` checks `workflow.resources.vae_decode_bytes` (the plan's estimate of a decode's
memory) instead: per latent size, a decode of `--frames` latent frames (4 by default) in its own
subprocess, its working set measured twice: the increase of the peak resident memory over the
resident memory before the decode (with `MALLOC_MMAP_THRESHOLD_=65536`, so that glibc hands every
freed tensor back and the peak is what was live, not what the heap kept), and the peak of torch's
CPU allocator's bytes in use (torch.profiler's allocation events: tensors only, the conv
library's own buffers are not among them) in a second decode; each against the estimate less
its weights (the model is loaded before either), then Wan's 480 x 832 in bf16 and fp32.

    python benchmarks/vae_stream.py                          # demo latents (8 x 12), F = 42, 1101
    python benchmarks/vae_stream.py --frames 21 --height 60 --width 104 --base-dim 96  # Wan's
    python benchmarks/vae_stream.py --estimate --base-dim 96 --sizes 6x10 12x20 15x26
"""

from __future__ import annotations

import argparse
import json
import os
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


def _hwm_mb() -> float:
    """The peak resident memory since the last `_reset_hwm` (VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak resident memory to the current one


def _allocator_peak(decode) -> int:
    """Peak bytes in use by torch's CPU allocator while `decode()` runs, over those at its start
    (torch.profiler's allocation events carry the allocator's running total)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        decode()
    totals = []

    def walk(nodes) -> None:
        for node in nodes:
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                fields = node.extra_fields
                totals.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    totals.sort()
    start = totals[0][1] - totals[0][2]
    return max(total for _, total, _ in totals) - start


def _estimate_child(
    frames: int, height: int, width: int, base_dim: int, threads: int, dtype: str
) -> dict:
    import torch

    from sinkscope.wan.vae import iter_decoded_frames, random_vae, tiny_vae_config

    torch.set_num_threads(threads)
    vae = random_vae(tiny_vae_config(base_dim)).to(getattr(torch, dtype))
    latents = torch.randn(16, frames, height, width, generator=torch.Generator().manual_seed(0))

    def decode(count: int = frames) -> None:
        with torch.no_grad():
            for _ in iter_decoded_frames(vae, latents[:, :count]):
                pass

    decode(2)  # the first calls of every kernel, before the baseline
    before = _rss_mb()
    _reset_hwm()
    start = time.perf_counter()
    decode()
    seconds = time.perf_counter() - start
    rss = (_hwm_mb() - before) * 2**20
    return {"seconds": seconds, "rss_bytes": rss, "allocator_bytes": _allocator_peak(decode)}


def estimate(args: argparse.Namespace) -> None:
    """`--estimate`: the decode's measured working set against `vae_decode_bytes`'s."""
    from sinkscope.workflow.resources import vae_decode_bytes

    (frames,) = args.frames or [4]
    value_bytes = {"float32": 4, "bfloat16": 2}[args.dtype]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    print(
        f"{frames} latent frames, VAE base_dim {args.base_dim}, {args.dtype}, "
        f"{args.threads} threads; MB = 1e6 bytes; estimate less its weights"
    )
    print(
        f"{'latent':>8} {'pixels':>10} {'s':>6} {'estimate':>9} {'cache':>7} {'activ.':>7} "
        f"{'RSS':>7} {'est/RSS':>8} {'alloc.':>7} {'est/alloc':>9}"
    )
    for size in args.sizes:
        height, width = (int(v) for v in size.split("x"))
        command = [
            sys.executable, __file__, "--child-estimate", "--frames", str(frames), "--height",
            str(height), "--width", str(width), "--base-dim", str(args.base_dim), "--threads",
            str(args.threads), "--dtype", args.dtype,
        ]  # fmt: skip
        out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
        row = json.loads(out.strip().splitlines()[-1])
        parts = vae_decode_bytes(
            height, width, base_dim=args.base_dim, value_bytes=value_bytes, num_frames=frames
        )
        working = parts["total"] - parts["weights"]
        print(
            f"{size:>8} {f'{8 * height}x{8 * width}':>10} {row['seconds']:>6.1f} "
            f"{working / 1e6:>9.1f} {parts['feature_cache'] / 1e6:>7.1f} "
            f"{parts['activations'] / 1e6:>7.1f} {row['rss_bytes'] / 1e6:>7.1f} "
            f"{working / row['rss_bytes']:>8.2f} {row['allocator_bytes'] / 1e6:>7.1f} "
            f"{working / row['allocator_bytes']:>9.2f}"
        )
    for name, value_bytes in (("bf16", 2), ("fp32", 4)):
        parts = vae_decode_bytes(60, 104, base_dim=args.base_dim, value_bytes=value_bytes)
        print(
            f"480 x 832 (60 x 104 latent), {name}, one video, any length: "
            + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items() if k != "latents")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, nargs="+", default=None)
    parser.add_argument("--height", type=int, default=8)
    parser.add_argument("--width", type=int, default=12)
    parser.add_argument("--base-dim", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="measure a decode's working set against workflow.resources.vae_decode_bytes",
    )
    parser.add_argument("--sizes", nargs="+", default=["6x10", "12x20", "15x26"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-estimate", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.estimate:
        estimate(args)
        return
    if args.child_estimate:
        (frames,) = args.frames
        row = _estimate_child(
            frames, args.height, args.width, args.base_dim, args.threads, args.dtype
        )
        print(json.dumps(row))
        return
    args.frames = args.frames or [42, 1101]
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
