"""Benchmark: logit capture at real token geometry on CPU, against a plain zarr write.

Real geometry (docs/DESIGN.md, "Scale, on paper"): a 60 x 104 latent, i.e. T = 1560 tokens per
latent frame after the 2 x 2 patch, 21 latent frames in 7 blocks of 3, the Self-Forcing schedule (4
denoising steps and the cache pass per block). The model is a narrow random-init Wan DiT built in
process (head_dim 16), so the rollout is cheap on CPU while the captured logits have their real
size: one head and one pass kind of one layer is 252 visible (T, T) tiles = 1.23 GB of float16.

Three measurements, each in its own subprocess so that peak memories do not mix:

- rollout: the plain rollout, no capture;
- capture: the same rollout with LogitCapture + TokenStoreWriter on one layer;
- plain: the same rows (real rows read back from the capture store, one per block width) written
  with the same array creation, one shard row at a time in a simple loop in the main thread.

Printed: extraction time with and without capture, capture throughput (logical bytes of the
visible tiles per second of the capture run) as a ratio of the plain write, the writer thread's
throughput per core (bytes over its own CPU time, user and kernel apart: issue 44 asks for 3x the
zarr pipeline's), peak resident memory of the capture run, bytes on disk and compression ratio.
Ratios are of one run; not a test. The writer writes each row's shard as a file past the page
cache where the file system takes it (`extraction/shards.py`; SINKSCOPE_DIRECT_IO=0 measures the
page cache instead).

The store's chunks carry crc32c checksums. `--checksums both` runs the capture and the plain write
also without them, taking turns, and prints what the checksums cost; `--checksums no` measures
only that. `--repeat N` runs the capture and the plain write N times each (taking turns with the
other variant) and keeps the fastest run of each.

    python benchmarks/capture.py                      # 4 heads, cache pass: 4.9 GB of logits
    python benchmarks/capture.py --heads 2 --passes all
    python benchmarks/capture.py --heads 1 --checksums both --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import (
    add_checksums_option,
    cpu_seconds,
    current_rss,
    gb,
    mbps,
    peak_rss,
    tree_bytes,
    verdict,
    without_checksums,
)

LATENT_HEIGHT, LATENT_WIDTH = 60, 104
NUM_FRAMES, FRAMES_PER_BLOCK = 21, 3
HEAD_DIM = 16
TEXT_DIM, TEXT_LEN = 32, 32
CAPTURED_LAYER = 0

THROUGHPUT_TARGET = 0.8  # capture throughput / plain zarr write throughput, at least
PEAK_RSS_TARGET = 2e9  # bytes, less than
LOGICAL_BYTES_TARGET = 4e9  # "while writing several GB": at least this many logical bytes


# --- measurements ---------------------------------------------------------------------------


# --- the model and the rollout ----------------------------------------------------------------


def geometry():
    from sinkscope.extraction.sampling import Geometry

    return Geometry(
        num_frames=NUM_FRAMES,
        frames_per_block=FRAMES_PER_BLOCK,
        latent_height=LATENT_HEIGHT,
        latent_width=LATENT_WIDTH,
    )


def build_model(heads: int, layers: int, seed: int):
    """A narrow random-init Wan DiT (head_dim 16) and a random prompt embedding."""
    import torch

    from sinkscope.wan.config import WanConfig
    from sinkscope.wan.model import WanModel

    cfg = WanConfig(
        dim=heads * HEAD_DIM,
        ffn_dim=64,
        num_heads=heads,
        num_layers=layers,
        freq_dim=32,
        text_dim=TEXT_DIM,
        text_len=TEXT_LEN,
    )
    model = WanModel(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    model.eval().requires_grad_(False)
    text = torch.randn(1, TEXT_LEN, TEXT_DIM, generator=torch.Generator().manual_seed(seed + 1))
    return model, text


def visible_tiles_per_pass(heads: int) -> int:
    """Visible (query frame, key frame) tiles of one pass kind over the rollout, all heads."""
    from sinkscope.frames import visible_frames

    sizes = geometry().block_sizes
    return heads * int(visible_frames(sizes).sum())


def store_params(heads: int, passes: list[int], frame_seq_length: int) -> dict:
    from sinkscope.extraction.sampling import SELF_FORCING

    timesteps = SELF_FORCING.pass_timesteps()
    kinds = SELF_FORCING.pass_kinds()
    return {
        "num_heads": heads,
        "num_frames": NUM_FRAMES,
        "frame_seq_length": frame_seq_length,
        "timesteps": [timesteps[p] for p in passes],
        "pass_kinds": [kinds[p] for p in passes],
        "attrs": {
            "benchmark": "benchmarks/capture.py",
            "num_frames": NUM_FRAMES,
            "frame_seq_length": frame_seq_length,
        },
    }


def pass_spec(text: str) -> str | int:
    """--passes as capture.passes takes it: all, cache, last or a pass index."""
    return int(text) if text.isdigit() else text


class CountingWriter:
    """Forwards write_row to a TokenStoreWriter, counting the tiles and the time spent waiting
    (the put blocks while the writer's queue is full, i.e. while the writer is behind)."""

    def __init__(self, writer):
        self.writer = writer
        self.rows = 0
        self.tiles = 0
        self.wait_seconds = 0.0

    def __getattr__(self, name: str):
        # Everything else LogitCapture uses (write_pooled, tokens, ...) goes to the writer.
        return getattr(self.writer, name)

    def write_row(self, step, head, query_frame, tile, key_frames) -> None:
        self.rows += 1
        self.tiles += len(key_frames)
        started = time.perf_counter()
        self.writer.write_row(step, head, query_frame, tile, key_frames)
        self.wait_seconds += time.perf_counter() - started


# --- worker modes (each in its own process) ------------------------------------------------


def run_rollout(args) -> dict:
    import torch

    from sinkscope.extraction.sampling import SELF_FORCING, rollout

    model, text = build_model(args.heads, args.layers, args.seed)
    rss_before = current_rss()
    cpu0, started = cpu_seconds(), time.perf_counter()
    rollout(model, text, geometry=geometry(), schedule=SELF_FORCING, seed=args.seed, progress=False)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds() - cpu0,
        "rss_before": rss_before,
        "peak_rss": peak_rss(),
        "torch_threads": torch.get_num_threads(),
    }


def run_capture(args) -> dict:
    from sinkscope.extraction.capture import LogitCapture
    from sinkscope.extraction.sampling import SELF_FORCING, rollout
    from sinkscope.extraction.store import TokenStoreWriter
    from sinkscope.passes import resolve_passes

    if args.checksums == "no":
        without_checksums()
    model, text = build_model(args.heads, args.layers, args.seed)
    cfg = model.config
    t = cfg.tokens_per_frame(LATENT_HEIGHT, LATENT_WIDTH)
    passes = resolve_passes(pass_spec(args.passes), len(SELF_FORCING.steps))
    rss_before = current_rss()
    cpu0, started = cpu_seconds(), time.perf_counter()
    writer = TokenStoreWriter(args.store, **store_params(args.heads, passes, t))
    counter = CountingWriter(writer)
    capture = LogitCapture({CAPTURED_LAYER: counter}, passes, t, cfg.head_dim)
    model.set_capture(capture, {CAPTURED_LAYER})
    with writer:
        rollout(
            model,
            text,
            geometry=geometry(),
            schedule=SELF_FORCING,
            seed=args.seed,
            on_pass=capture.begin_pass,
            progress=False,
        )
        rollout_done = time.perf_counter()
    model.set_capture(None)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "rollout_seconds": rollout_done - started,
        "close_seconds": seconds - (rollout_done - started),
        "queue_wait_seconds": counter.wait_seconds,
        "writer_seconds": writer.write_seconds,
        "writer_user_seconds": writer.write_user_seconds,
        "writer_system_seconds": writer.write_system_seconds,
        "writer_bytes": writer.bytes_written,
        "cpu_seconds": cpu_seconds() - cpu0,
        "rows": counter.rows,
        "tiles": counter.tiles,
        "logical_bytes": counter.tiles * t * t * 2,
        "frame_seq_length": t,
        "passes": passes,
        "rss_before": rss_before,
        "peak_rss": peak_rss(),
    }


def run_plain(args) -> dict:
    """The capture's rows, written with the same array creation by the main thread, one shard
    row at a time. The rows are real: one per block (visible width), read back from the capture
    store, all heads and passes reuse them."""
    import zarr

    from sinkscope.extraction.sampling import SELF_FORCING
    from sinkscope.extraction.store import TokenStoreWriter
    from sinkscope.frames import block_starts
    from sinkscope.passes import resolve_passes
    from sinkscope.storage import tune_zarr

    if args.checksums == "no":
        without_checksums()
    tune_zarr()
    source = zarr.open_group(args.source, mode="r")["logits"]
    steps, heads, n, _ = source.shape
    t = n // NUM_FRAMES
    sizes = geometry().block_sizes
    starts = [int(s) for s in block_starts(sizes)]
    rows = []
    for start in starts:
        row = np.asarray(source[0, 0, start * t : (start + 1) * t, :])
        rows.append(row)
    tiles_per_row = [
        int((~np.isnan(row[0].reshape(NUM_FRAMES, t)).all(axis=1)).sum()) for row in rows
    ]
    passes = resolve_passes(pass_spec(args.passes), len(SELF_FORCING.steps))
    assert len(passes) == steps, (passes, steps)
    rss_before = current_rss()
    # The same array creation as the capture run: a TokenStoreWriter, whose queue stays unused.
    writer = TokenStoreWriter(args.store, **store_params(heads, passes, t))
    logits = writer.logits
    tiles = 0
    cpu0, started = cpu_seconds(), time.perf_counter()
    for block, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        for step in range(steps):
            for head in range(heads):
                for frame in range(start, start + size):
                    # The same bytes the capture writes: the row's visible key frames only.
                    width = tiles_per_row[block] * t
                    logits[step, head, frame * t : (frame + 1) * t, :width] = rows[block][:, :width]
                    tiles += tiles_per_row[block]
    loop_seconds = time.perf_counter() - started
    writer.close()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "loop_seconds": loop_seconds,
        "cpu_seconds": cpu_seconds() - cpu0,
        "tiles": tiles,
        "logical_bytes": tiles * t * t * 2,
        "tiles_per_row": tiles_per_row,
        "rss_before": rss_before,
        "peak_rss": peak_rss(),
    }


MODES = {"rollout": run_rollout, "capture": run_capture, "plain": run_plain}


# --- the driver ------------------------------------------------------------------------------


def run_mode(mode: str, args, workdir: Path, variant: str = "yes", **paths: Path) -> dict:
    """Run one mode in a subprocess, writing stores with (`yes`) or without (`no`) checksums."""
    result = workdir / f"{mode}.json"
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--mode",
        mode,
        "--result",
        str(result),
        "--heads",
        str(args.heads),
        "--layers",
        str(args.layers),
        "--passes",
        args.passes,
        "--seed",
        str(args.seed),
        "--checksums",
        variant,
    ]
    for name, path in paths.items():
        command += [f"--{name}", str(path)]
    label = "" if mode == "rollout" else f" ({'with' if variant == 'yes' else 'without'} crc32c)"
    print(f"[{time.strftime('%H:%M:%S')}] {mode}{label} ...", flush=True)
    subprocess.run(command, check=True)
    return json.loads(result.read_text())


def fastest(runs: list[dict]) -> dict:
    """The run of least wall time, with the highest peak RSS of all and every run's seconds."""
    best = dict(min(runs, key=lambda run: run["seconds"]))
    best["peak_rss"] = max(run["peak_rss"] for run in runs)
    best["all_seconds"] = [round(run["seconds"], 1) for run in runs]
    return best


def checksum_report(captures: dict, plains: dict, stored: dict) -> None:
    """Write throughputs with the crc32c checksums over without (the same run)."""

    def writer(run: dict) -> float:
        return run["writer_bytes"] / run["writer_seconds"]

    def plain(run: dict) -> float:
        return run["logical_bytes"] / run["seconds"]

    ratio = {v: writer(captures[v]) / plain(plains[v]) for v in ("yes", "no")}
    lines = [
        "",
        "5. the crc32c checksums: with / without (fastest runs; the same run, taking turns: "
        f"capture {captures['yes']['all_seconds']} / {captures['no']['all_seconds']} s, plain "
        f"{plains['yes']['all_seconds']} / {plains['no']['all_seconds']} s)",
        f"   capture writer               {mbps(writer(captures['yes']))} / "
        f"{mbps(writer(captures['no']))} = {writer(captures['yes']) / writer(captures['no']):.3f}",
        f"   capture run, end to end      {captures['yes']['seconds']:.1f} s / "
        f"{captures['no']['seconds']:.1f} s = "
        f"{captures['yes']['seconds'] / captures['no']['seconds']:.3f} (time)",
        f"   plain zarr write             {mbps(plain(plains['yes']))} / "
        f"{mbps(plain(plains['no']))} = {plain(plains['yes']) / plain(plains['no']):.3f}",
        f"   ratio capture / plain        {ratio['yes']:.2f} / {ratio['no']:.2f} = "
        f"{ratio['yes'] / ratio['no']:.3f}",
        f"   logits on disk               {gb(stored['yes'][0])} / {gb(stored['no'][0])} = "
        f"{stored['yes'][0] / stored['no'][0]:.5f}",
    ]
    print("\n".join(lines), flush=True)


def report(args, rollout: dict, capture: dict, plain: dict, stored: tuple, plain_stored: tuple):
    logical = capture["logical_bytes"]
    expected = visible_tiles_per_pass(args.heads) * len(capture["passes"])
    # The capture's write throughput: bytes over the time its writer thread spent writing them
    # (that thread shares the 2 cores with the model); the run as a whole is section 1.
    capture_tput = capture["writer_bytes"] / capture["writer_seconds"]
    # ... and per core: over the CPU time of that thread alone (time.thread_time)
    writer_cpu = capture["writer_user_seconds"] + capture["writer_system_seconds"]
    per_core = capture["writer_bytes"] / writer_cpu
    per_user_core = capture["writer_bytes"] / max(capture["writer_user_seconds"], 1e-9)
    run_tput = logical / capture["seconds"]
    plain_tput = plain["logical_bytes"] / plain["seconds"]
    tput_ratio = capture_tput / plain_tput
    extra = capture["seconds"] - rollout["seconds"]
    t = capture["frame_seq_length"]
    apparent, allocated = stored
    lines = [
        "",
        f"geometry: latent {LATENT_HEIGHT}x{LATENT_WIDTH}, T={t} tokens/frame, "
        f"{NUM_FRAMES} frames in blocks of {FRAMES_PER_BLOCK}; model: {args.layers} layers, "
        f"{args.heads} heads x head_dim {HEAD_DIM}; captured layer {CAPTURED_LAYER}, passes "
        f"{args.passes!r} = {capture['passes']}; torch threads {rollout['torch_threads']}, "
        f"{os.cpu_count()} CPUs",
        f"captured: {capture['rows']} rows, {capture['tiles']} tiles of {t}x{t} "
        f"(expected {expected}), {gb(logical)} logical float16",
        "",
        "1. extraction time",
        f"   rollout only                 {rollout['seconds']:8.1f} s  "
        f"(CPU {rollout['cpu_seconds']:.0f} s)",
        f"   rollout + capture            {capture['seconds']:8.1f} s  "
        f"(CPU {capture['cpu_seconds']:.0f} s; rollout returned at "
        f"{capture['rollout_seconds']:.1f} s, close {capture['close_seconds']:.1f} s, "
        f"model thread blocked on the full queue {capture['queue_wait_seconds']:.1f} s)",
        f"   ratio capture / rollout only {capture['seconds'] / rollout['seconds']:8.2f} x",
        "2. write throughput (logical bytes / s)",
        f"   capture writer               {mbps(capture_tput):>10}  "
        f"({gb(capture['writer_bytes'])} in {capture['writer_seconds']:.1f} s of writer time)",
        f"   capture writer, per core     {mbps(per_core):>10}  "
        f"({writer_cpu:.1f} s of the writer thread's CPU time: "
        f"{capture['writer_user_seconds']:.1f} s user, "
        f"{capture['writer_system_seconds']:.1f} s in the kernel)",
        f"   ... outside the kernel       {mbps(per_user_core):>10}  "
        "(the writer's own work: the page cache's copy aside)",
        f"   capture run, end to end      {mbps(run_tput):>10}  "
        f"({gb(logical)} in {capture['seconds']:.1f} s, rollout compute included; "
        f"{run_tput / plain_tput:.2f} x the plain write)",
        f"   plain zarr write             {mbps(plain_tput):>10}  "
        f"({gb(plain['logical_bytes'])} in {plain['seconds']:.1f} s, "
        f"CPU {plain['cpu_seconds']:.0f} s)",
        f"   ratio capture / plain        {tput_ratio:8.2f}",
        f"   capture time over the rollout: {extra:.1f} s for {gb(logical)} = "
        f"{mbps(logical / extra) if extra > 0 else 'n/a'} "
        f"({plain['seconds'] / extra if extra > 0 else float('nan'):.2f} x the plain write)",
        "3. peak resident memory (VmHWM)",
        f"   capture run                  {gb(capture['peak_rss']):>10}  "
        f"(RSS {gb(capture['rss_before'])} before the rollout)",
        f"   rollout only                 {gb(rollout['peak_rss']):>10}",
        f"   plain write                  {gb(plain['peak_rss']):>10}  "
        f"(RSS {gb(plain['rss_before'])} with its {len(plain['tiles_per_row'])} rows loaded)",
        "4. storage",
        f"   logits on disk               {gb(apparent):>10}  (allocated {gb(allocated)})",
        f"   compression ratio            {logical / apparent:8.2f} x",
        f"   plain write store            {gb(plain_stored[0]):>10}",
        "",
        "== summary ==",
        f"write throughput capture/plain  {tput_ratio:6.2f}      target >= "
        f"{THROUGHPUT_TARGET:.2f}    {verdict(tput_ratio >= THROUGHPUT_TARGET)}",
        f"peak RSS of the capture run     {gb(capture['peak_rss'])}   target <  "
        f"{gb(PEAK_RSS_TARGET)}  {verdict(capture['peak_rss'] < PEAK_RSS_TARGET)}",
        f"logical bytes written           {gb(logical)}   target >= "
        f"{gb(LOGICAL_BYTES_TARGET)}  {verdict(logical >= LOGICAL_BYTES_TARGET)}",
        f"(extraction time ratio {capture['seconds'] / rollout['seconds']:.2f} x, "
        f"compression {logical / apparent:.2f} x, {gb(apparent)} on disk; 1-minute load average "
        f"{args.load_before:.2f} before, {os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs)",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--heads",
        type=int,
        default=4,
        help="attention heads of the model, all captured (default 4: 4.9 GB for one pass kind)",
    )
    parser.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    parser.add_argument(
        "--passes", default="cache", help="capture.passes: all, cache, last or an index"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="parent directory for the benchmark data (default: a new temporary directory)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the capture store (for benchmarks/compression.py)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of the capture and of the plain write (per --checksums variant, taking turns); "
        "the fastest counts (default 1)",
    )
    add_checksums_option(parser)
    parser.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--source", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        args.result.write_text(json.dumps(MODES[args.mode](args)))
        return

    from sinkscope.extraction.sampling import SELF_FORCING
    from sinkscope.passes import resolve_passes

    resolve_passes(pass_spec(args.passes), len(SELF_FORCING.steps))  # a bad spec fails here
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="sinkscope-bench-capture-", dir=args.workdir))
    args.load_before = os.getloadavg()[0]
    print(f"workdir {workdir}; load average {args.load_before:.2f}", flush=True)
    variants = ("yes", "no") if args.checksums == "both" else (args.checksums,)
    runs: dict[tuple[str, str], list[dict]] = {}
    stored, plain_stored = {}, {}
    try:
        rollout = run_mode("rollout", args, workdir)
        for _ in range(args.repeat):
            for variant in variants:
                suffix = "" if variant == "yes" else "_nocrc"
                capture_store = workdir / f"capture{suffix}.zarr"
                plain_store = workdir / f"plain{suffix}.zarr"
                runs.setdefault(("capture", variant), []).append(
                    run_mode("capture", args, workdir, variant, store=capture_store)
                )
                stored[variant] = tree_bytes(capture_store / "logits")
                runs.setdefault(("plain", variant), []).append(
                    run_mode(
                        "plain", args, workdir, variant, store=plain_store, source=capture_store
                    )
                )
                plain_stored[variant] = tree_bytes(plain_store / "logits")
                shutil.rmtree(plain_store)
        captures = {variant: fastest(runs[("capture", variant)]) for variant in variants}
        plains = {variant: fastest(runs[("plain", variant)]) for variant in variants}
        first = variants[0]
        report(args, rollout, captures[first], plains[first], stored[first], plain_stored[first])
        if len(variants) == 2:
            checksum_report(captures, plains, stored)
    finally:
        if args.keep:
            kept = "capture.zarr" if "yes" in variants else "capture_nocrc.zarr"
            print(f"kept {workdir / kept}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
