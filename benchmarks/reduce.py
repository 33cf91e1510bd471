"""Benchmark: token store -> frame dataset (sinkscope.analysis.reduce) at real geometry on CPU.

A token store at the real geometry (docs/DESIGN.md, "Scale, on paper"): T = 1560 tokens per latent
frame, 21 latent frames in 7 blocks of 3, block-causal visibility. It is built without a model:
rank-structured logits q k^T / sqrt(head_dim) from random q, k (head_dim 16) with a per-key-frame
bias (a strong sink on frame 0), computed per row in float32, rounded to float16 and written with
`sinkscope.extraction.store.TokenStoreWriter` (visible tiles only), together with the pooled
(mean q).(mean k) / sqrt(head_dim) that the reducer cross-checks, exactly as the capture writes
them. One head and one pass is 252 visible (T, T) tiles = 1.23 GB of float16; the default
4 heads x 1 pass is 4.91 GB.

Three measurements, each in its own subprocess so that peak memories do not mix:

- read: every shard row of the logits read and decompressed with zarr (same thread count as the
  reduction), then discarded: the floor for any reduction of these bytes;
- reduce: `sinkscope.analysis.reduce.reduce_token_store` on the store;
- naive: the seeds' style: one step of the logits loaded whole into numpy (float16 -> float32),
  then a Python loop over query frames (row softmax) and key frames (mean logit and softmax mass
  per tile), timed on `--naive-heads` heads (default 1) and scaled to all heads.

Printed: throughputs (logical float16 bytes of the visible tiles per second), the ratios
reduce / read and reduce / naive, and peak resident memory of each process. The read and the
reduce run `--repeat` times (default 3), alternating, and the fastest run of each counts: the
machine this was written on is shared and its timings drift by 20 %. Not a test.

The store's chunks carry crc32c checksums. `--checksums both` builds a second store without
them (as TokenStoreWriter wrote it before) and measures read and reduce of both, taking turns,
to print what the checksums cost; `--checksums no` measures only that one. `--naive-heads 0`
skips the naive reduction.

    python benchmarks/reduce.py                       # 4 heads x 1 pass: 4.9 GB of logits
    python benchmarks/reduce.py --threads 2 --heads 2 --steps 2
    python benchmarks/reduce.py --heads 1 --checksums both --naive-heads 0
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
T = LATENT_HEIGHT * LATENT_WIDTH // 4  # 1560 tokens per latent frame after the 2 x 2 patch
NUM_FRAMES, FRAMES_PER_BLOCK = 21, 3
HEAD_DIM = 16
SINK_BIAS = 6.0  # mean logit added on key frame 0; the other key frames get U(0, 2)
NOISE_STD = 2.0**0.5  # of q and k entries: q.k / sqrt(head_dim) then has std ~2 per token pair

# rules/reduce.smk gives the reduce job `threads: 1`: the default here. reduce_token_store's
# own default (threads=None) is os.cpu_count().
DEFAULT_THREADS = 1

READ_RATIO_TARGET = 0.7  # reduce throughput / plain read throughput, at least
NAIVE_SPEEDUP_TARGET = 5.0  # naive time / reduce time, at least
PEAK_RSS_TARGET = 1.5e9  # bytes, at most


# --- measurements ---------------------------------------------------------------------------


class Timer:
    """Wall and CPU seconds of a `with` block, plus the RSS when it started."""

    def __enter__(self) -> Timer:
        self.rss_before = current_rss()
        self.cpu0 = cpu_seconds()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.started
        self.cpu_seconds = cpu_seconds() - self.cpu0

    def result(self) -> dict:
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "rss_before": self.rss_before,
            "peak_rss": peak_rss(),
        }


# --- the token store --------------------------------------------------------------------------


def block_sizes() -> list[int]:
    from sinkscope.frames import block_sizes as sizes

    return sizes(NUM_FRAMES, FRAMES_PER_BLOCK)


def visible() -> np.ndarray:
    """bool [F, F]: block-causal visibility, no window, no sinks."""
    from sinkscope.frames import visible_frames

    return visible_frames(block_sizes())


def visible_tiles(heads: int, steps: int) -> int:
    return heads * steps * int(visible().sum())


def logical_bytes(tiles: int) -> int:
    return tiles * T * T * 2


def random_qk(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """q and k [N, head_dim] (float32) of one head and pass, already scaled by 1 / sqrt(d).

    Every q has a shared component along a unit direction u, every k a per-key-frame one, so
    q.k / sqrt(d) is N(0, ~2^2) noise plus a key-frame bias (SINK_BIAS on frame 0).
    """
    n = NUM_FRAMES * T
    u = rng.normal(size=HEAD_DIM)
    u /= np.linalg.norm(u)
    frame_bias = rng.uniform(0.0, 2.0, size=NUM_FRAMES)
    frame_bias[0] = SINK_BIAS
    scale = HEAD_DIM**-0.5
    q_shift = HEAD_DIM**0.5  # q.u * k.u * scale = bias for k.u = bias
    q = rng.normal(0.0, NOISE_STD, size=(n, HEAD_DIM)) + q_shift * u
    k = rng.normal(0.0, NOISE_STD, size=(n, HEAD_DIM))
    k += np.repeat(frame_bias, T)[:, None] * u
    return (q * scale).astype(np.float32), k.astype(np.float32)


def run_build(args) -> dict:
    """Write the token store with TokenStoreWriter, one row (query frame) at a time."""
    from sinkscope.extraction.store import TokenStoreWriter

    if args.checksums == "no":
        without_checksums()
    sizes = block_sizes()
    seen = visible()
    timesteps = [float(937.5 - 250 * s) for s in range(args.steps)]
    writer = TokenStoreWriter(
        args.store,
        num_heads=args.heads,
        num_frames=NUM_FRAMES,
        frame_seq_length=T,
        timesteps=timesteps,
        pass_kinds=["denoise"] * args.steps,
        attrs={
            "benchmark": "benchmarks/reduce.py",
            "num_heads": args.heads,
            "head_dim": HEAD_DIM,
            "frame_seq_length": T,
            "latent_grid": [NUM_FRAMES, LATENT_HEIGHT // 2, LATENT_WIDTH // 2],
            "num_frames": NUM_FRAMES,
            "block_sizes": sizes,
            "timesteps": timesteps,
            "local_attn_size": -1,
            "sink_size": 0,
            "logit_scale": HEAD_DIM**-0.5,
        },
    )
    rng = np.random.default_rng(args.seed)
    rows = tiles = 0
    with Timer() as timer, writer:
        for step in range(args.steps):
            pooled = np.full((args.heads, NUM_FRAMES, NUM_FRAMES), np.nan)
            for head in range(args.heads):
                q, k = random_qk(rng)
                # Frame means of the scaled q and of k, in float64: (mean q).(mean k) / sqrt(d).
                q_mean = q.astype(np.float64).reshape(NUM_FRAMES, T, HEAD_DIM).mean(axis=1)
                k_mean = k.astype(np.float64).reshape(NUM_FRAMES, T, HEAD_DIM).mean(axis=1)
                pooled[head] = np.where(seen, q_mean @ k_mean.T, np.nan)
                for frame in range(NUM_FRAMES):
                    key_frames = np.flatnonzero(seen[frame])
                    keys = k[key_frames[0] * T : (key_frames[-1] + 1) * T]  # one run
                    tile = (q[frame * T : (frame + 1) * T] @ keys.T).astype(np.float16)
                    per_key_frame = np.ascontiguousarray(tile.reshape(T, -1, T).transpose(1, 0, 2))
                    writer.write_row(step, head, frame, per_key_frame, key_frames)
                    rows += 1
                    tiles += len(key_frames)
            writer.write_pooled(step, 0, np.arange(NUM_FRAMES), pooled.astype(np.float32))
    return {
        **timer.result(),
        "rows": rows,
        "tiles": tiles,
        "logical_bytes": logical_bytes(tiles),
        "writer_bytes": writer.bytes_written,
        "writer_seconds": writer.write_seconds,
    }


# --- worker modes (each in its own process) ------------------------------------------------


def run_read(args) -> dict:
    """Read and decompress every shard row (one query frame of one head and pass), discard it.

    `args.threads` rows at a time from a thread pool, as the reduction's dask threads do. Each
    row's visible tiles are counted from its first row of tokens, so the reads are not elided.
    """
    from concurrent.futures import ThreadPoolExecutor

    import zarr

    from sinkscope.storage import tune_zarr

    tune_zarr()
    logits = zarr.open_group(args.store, mode="r")["logits"]
    steps, heads = logits.shape[:2]
    jobs = [(s, h, f) for s in range(steps) for h in range(heads) for f in range(NUM_FRAMES)]

    def read(job) -> int:
        step, head, frame = job
        row = logits[step, head, frame * T : (frame + 1) * T, :]
        return int((~np.isnan(row[0].reshape(NUM_FRAMES, T)).all(axis=1)).sum())

    with Timer() as timer:
        if args.threads == 1:
            tiles = sum(map(read, jobs))
        else:
            with ThreadPoolExecutor(args.threads) as pool:
                tiles = sum(pool.map(read, jobs))
    return {
        **timer.result(),
        "rows": len(jobs),
        "tiles": tiles,
        "logical_bytes": logical_bytes(tiles),
    }


def run_reduce(args) -> dict:
    import warnings

    import xarray as xr

    from sinkscope.analysis.reduce import reduce_token_store

    # xarray's consolidated metadata: zarr warns that it is not in the v3 spec yet.
    warnings.filterwarnings("ignore", message="Consolidated metadata")
    with Timer() as timer:
        reduce_token_store(args.store, args.out, threads=args.threads)
    with xr.open_zarr(args.out) as ds:
        mass = ds["prob_mass"].values
        logit_mean = ds["logit_mean"].values
        entropy = ds["entropy"].values
    seen = visible()
    tiles = int((~np.isnan(logit_mean)).sum())
    return {
        **timer.result(),
        "tiles": tiles,
        "logical_bytes": logical_bytes(tiles),
        "nan_pattern_ok": bool((~np.isnan(logit_mean) == seen).all()),
        "mass_sum_error": float(np.abs(np.nansum(mass, axis=-1) - 1.0).max()),
        "sink_mass_last_frame": float(mass[..., -1, 0].mean()),
        "entropy_mean": float(entropy.mean()),
    }


def naive_head(logits: np.ndarray, num_frames: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The seeds' reduction of one head's [N, N] float32 logits (NaN = unseen): a Python loop
    over query frames (row softmax of the frame's rows) and key frames (tile mean, tile mass)."""
    logit_mean = np.full((num_frames, num_frames), np.nan)
    prob_mass = np.full((num_frames, num_frames), np.nan)
    for qf in range(num_frames):
        rows = logits[qf * t : (qf + 1) * t]
        shifted = rows - np.nanmax(rows, axis=1, keepdims=True)
        weights = np.exp(shifted)
        probs = weights / np.nansum(weights, axis=1, keepdims=True)
        for kf in range(num_frames):
            tile = rows[:, kf * t : (kf + 1) * t]
            if np.isnan(tile).all():
                continue
            logit_mean[qf, kf] = np.nanmean(tile)
            prob_mass[qf, kf] = np.nansum(probs[:, kf * t : (kf + 1) * t], axis=1).mean()
    return logit_mean, prob_mass


def run_naive(args) -> dict:
    """One step's [heads, N, N] loaded whole into numpy and reduced in Python loops, on
    `args.naive_heads` heads; checked against the reducer's output."""
    import warnings

    import xarray as xr
    import zarr

    from sinkscope.storage import tune_zarr

    tune_zarr()
    logits = zarr.open_group(args.store, mode="r")["logits"]
    heads = min(args.naive_heads, logits.shape[1])
    with Timer() as read:
        stored = np.asarray(logits[0, :heads])
    with Timer() as cast:
        full = stored.astype(np.float32)  # float16 -> float32
    with Timer() as compute, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmax of all-NaN rows: none here
        results = [naive_head(full[h], NUM_FRAMES, T) for h in range(heads)]
    with xr.open_zarr(args.out) as ds:
        ours_mean = ds["logit_mean"].values[0, :heads]
        ours_mass = ds["prob_mass"].values[0, :heads]
    naive_mean = np.stack([r[0] for r in results])
    naive_mass = np.stack([r[1] for r in results])
    tiles = int((~np.isnan(naive_mean)).sum())
    return {
        "read": read.result(),
        "cast": cast.result(),
        "compute": compute.result(),
        "seconds": read.seconds + cast.seconds + compute.seconds,
        "heads": heads,
        "array_bytes": int(stored.nbytes + full.nbytes),
        "peak_rss": peak_rss(),
        "tiles": tiles,
        "logical_bytes": logical_bytes(tiles),
        "logit_mean_max_diff": float(np.nanmax(np.abs(naive_mean - ours_mean))),
        "prob_mass_max_diff": float(np.nanmax(np.abs(naive_mass - ours_mass))),
    }


MODES = {"build": run_build, "read": run_read, "reduce": run_reduce, "naive": run_naive}


# --- the driver ------------------------------------------------------------------------------


def run_mode(mode: str, args, workdir: Path, variant: str = "yes") -> dict:
    """Run one mode in a subprocess on the store with (`yes`) or without (`no`) checksums."""
    result = workdir / f"{mode}.json"
    command = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--result", str(result)]
    for name in ("heads", "steps", "threads", "naive_heads", "seed"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    store, out = args.stores[variant]
    command += ["--store", str(store), "--out", str(out), "--checksums", variant]
    label = (
        "" if len(args.stores) == 1 else f" ({'with' if variant == 'yes' else 'without'} crc32c)"
    )
    print(f"[{time.strftime('%H:%M:%S')}] {mode}{label} ...", flush=True)
    subprocess.run(command, check=True)
    return json.loads(result.read_text())


def best_of(runs: list[dict]) -> dict:
    """The fastest run, with the highest peak RSS of all and every run's seconds."""
    best = dict(min(runs, key=lambda run: run["seconds"]))
    best["peak_rss"] = max(run["peak_rss"] for run in runs)
    best["all_seconds"] = [run["seconds"] for run in runs]
    return best


def seconds_list(run: dict) -> str:
    return ", ".join(f"{s:.1f}" for s in run["all_seconds"])


def checksum_report(args, builds: dict, stored: dict, reads: dict, reduces: dict) -> None:
    """Read and reduce with the checksums over without (same run, taking turns)."""

    def tput(run: dict) -> float:
        return run["logical_bytes"] / run["seconds"]

    def cpu(runs: dict) -> str:
        seconds = {v: runs[v]["cpu_seconds"] for v in ("yes", "no")}
        return f"CPU {seconds['yes']:.1f} / {seconds['no']:.1f} s"

    read_ratio = {v: tput(reduces[v]) / tput(reads[v]) for v in ("yes", "no")}
    build, writer = (
        {v: builds[v][key] for v in ("yes", "no")} for key in ("seconds", "writer_seconds")
    )
    lines = [
        "",
        "4. the crc32c checksums: with / without (best runs; the same run, taking turns)",
        f"   build the store               {build['yes']:.1f} s / {build['no']:.1f} s = "
        f"{build['yes'] / build['no']:.3f} (time; writer thread {writer['yes']:.1f} s / "
        f"{writer['no']:.1f} s = {writer['yes'] / writer['no']:.3f})",
        f"   on disk                       {gb(stored['yes'])} / {gb(stored['no'])} = "
        f"{stored['yes'] / stored['no']:.5f}",
        f"   plain read + decompress       {mbps(tput(reads['yes']))} / {mbps(tput(reads['no']))}"
        f" = {tput(reads['yes']) / tput(reads['no']):.3f}  (runs {seconds_list(reads['yes'])} / "
        f"{seconds_list(reads['no'])} s; {cpu(reads)})",
        f"   reduce_token_store            {mbps(tput(reduces['yes']))} / "
        f"{mbps(tput(reduces['no']))} = {tput(reduces['yes']) / tput(reduces['no']):.3f}  (runs "
        f"{seconds_list(reduces['yes'])} / {seconds_list(reduces['no'])} s; {cpu(reduces)})",
        f"   ratio reduce / read           {read_ratio['yes']:.2f} / {read_ratio['no']:.2f} = "
        f"{read_ratio['yes'] / read_ratio['no']:.3f}",
    ]
    print("\n".join(lines), flush=True)


def naive_report(args, reduce: dict, naive: dict | None) -> tuple[list, list, list]:
    """The naive reduction's lines of the report: throughput, memory, summary."""
    if naive is None:
        skipped = "2. naive reduction: skipped (--naive-heads 0)"
        return [skipped], [], ["speedup over the naive loops    skipped"]
    naive_tput = naive["logical_bytes"] / naive["seconds"]
    # The naive reduction's time for the whole store: its time per head times heads x steps.
    scale = args.heads * args.steps / naive["heads"]
    naive_seconds = naive["seconds"] * scale
    speedup = naive_seconds / reduce["seconds"]
    # What a whole step needs: [heads, N, N] float16 as read plus its float32 copy.
    naive_step_bytes = naive["array_bytes"] * args.heads / naive["heads"]
    lines = [
        "2. naive reduction (a whole step in numpy, Python loops over frames)",
        f"   timed on {naive['heads']} head(s)        {mbps(naive_tput):>10}  "
        f"(zarr read {naive['read']['seconds']:.1f} s + float32 cast "
        f"{naive['cast']['seconds']:.1f} s + loops {naive['compute']['seconds']:.1f} s "
        f"for {gb(naive['logical_bytes'])})",
        f"   scaled to the store          {naive_seconds:8.1f} s  (x {scale:g})",
        f"   speedup reduce vs naive      {speedup:8.2f} x",
        f"   agreement with reduce        logit_mean {naive['logit_mean_max_diff']:.1e}, "
        f"prob_mass {naive['prob_mass_max_diff']:.1e} (max abs difference)",
    ]
    memory = [
        f"   naive, {naive['heads']} head(s)             {gb(naive['peak_rss']):>10}  "
        f"(a whole step of {args.heads} heads: {gb(naive_step_bytes)} of arrays alone)",
    ]
    summary = [
        f"speedup over the naive loops    {speedup:6.2f} x    target >= "
        f"{NAIVE_SPEEDUP_TARGET:.2f} x  {verdict(speedup >= NAIVE_SPEEDUP_TARGET)}",
    ]
    return lines, memory, summary


def report(args, build: dict, stored: int, read: dict, reduce: dict, naive: dict | None) -> None:
    expected = visible_tiles(args.heads, args.steps)
    logical = build["logical_bytes"]
    for name, part in (("read", read), ("reduce", reduce)):
        if part["tiles"] != expected:
            raise RuntimeError(f"{name} saw {part['tiles']} tiles, expected {expected}")
    read_tput = read["logical_bytes"] / read["seconds"]
    reduce_tput = reduce["logical_bytes"] / reduce["seconds"]
    read_ratio = reduce_tput / read_tput
    naive_lines, naive_memory, naive_summary = naive_report(args, reduce, naive)
    lines = [
        "",
        f"geometry: latent {LATENT_HEIGHT}x{LATENT_WIDTH}, T={T} tokens/frame, {NUM_FRAMES} "
        f"frames in blocks of {FRAMES_PER_BLOCK}, block-causal; {args.heads} heads x "
        f"{args.steps} pass(es); threads {args.threads}; {os.cpu_count()} CPUs",
        f"token store: {build['rows']} rows, {build['tiles']} tiles of {T}x{T} (expected "
        f"{expected}), {gb(logical)} logical float16, {gb(stored)} on disk; built in "
        f"{build['seconds']:.1f} s",
        "",
        f"1. throughput (logical bytes / s; best of {args.repeat}, read and reduce alternating)",
        f"   plain read + decompress      {mbps(read_tput):>10}  "
        f"({gb(read['logical_bytes'])} in {read['seconds']:.1f} s, "
        f"CPU {read['cpu_seconds']:.0f} s; runs {seconds_list(read)} s)",
        f"   reduce_token_store           {mbps(reduce_tput):>10}  "
        f"({gb(reduce['logical_bytes'])} in {reduce['seconds']:.1f} s, "
        f"CPU {reduce['cpu_seconds']:.0f} s; runs {seconds_list(reduce)} s)",
        f"   ratio reduce / read          {read_ratio:8.2f}",
        *naive_lines,
        "3. peak resident memory (VmHWM)",
        f"   reduce                       {gb(reduce['peak_rss']):>10}  "
        f"(RSS {gb(reduce['rss_before'])} before)",
        f"   plain read                   {gb(read['peak_rss']):>10}",
        *naive_memory,
        "",
        f"checks: NaN exactly on unseen tiles {reduce['nan_pattern_ok']}, prob_mass sums to 1 "
        f"within {reduce['mass_sum_error']:.1e}, sink mass of the last frame "
        f"{reduce['sink_mass_last_frame']:.2f}, mean entropy {reduce['entropy_mean']:.2f} nats",
        "",
        "== summary ==",
        f"reduce throughput / plain read  {read_ratio:6.2f}      target >= "
        f"{READ_RATIO_TARGET:.2f}    {verdict(read_ratio >= READ_RATIO_TARGET)}",
        *naive_summary,
        f"peak RSS of the reduce          {gb(reduce['peak_rss'])}   target <= "
        f"{gb(PEAK_RSS_TARGET)}  {verdict(reduce['peak_rss'] <= PEAK_RSS_TARGET)}",
        f"(reduce {mbps(reduce_tput)}, read {mbps(read_tput)}, {gb(logical)} logical, threads "
        f"{args.threads}; 1-minute load average {args.load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs)",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--heads", type=int, default=4, help="heads in the store (default 4: 4.91 GB per pass)"
    )
    parser.add_argument("--steps", type=int, default=1, help="passes in the store (default 1)")
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"threads of the reduction and of the plain read (default {DEFAULT_THREADS}, as "
        "rules/reduce.smk)",
    )
    parser.add_argument(
        "--naive-heads",
        type=int,
        default=1,
        help="heads the naive reduction is timed on, then scaled (default 1; 0 skips it)",
    )
    add_checksums_option(parser)
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of the read and of the reduce, alternating; the fastest counts (default 3)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="parent directory for the benchmark data (default: a new temporary directory)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the token store and its result")
    parser.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        args.result.write_text(json.dumps(MODES[args.mode](args)))
        return

    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="sinkscope-bench-reduce-", dir=args.workdir))
    args.load_before = os.getloadavg()[0]
    print(f"workdir {workdir}; load average {args.load_before:.2f}", flush=True)
    variants = ("yes", "no") if args.checksums == "both" else (args.checksums,)
    args.stores = {
        variant: (
            workdir / f"layer0{'' if variant == 'yes' else '_nocrc'}.zarr",
            workdir / "frames" / f"layer0{'' if variant == 'yes' else '_nocrc'}.zarr",
        )
        for variant in variants
    }
    try:
        builds = {variant: run_mode("build", args, workdir, variant) for variant in variants}
        stored = {v: tree_bytes(args.stores[v][0] / "logits")[0] for v in variants}
        reads: dict[str, list] = {variant: [] for variant in variants}
        reduces: dict[str, list] = {variant: [] for variant in variants}
        for _ in range(args.repeat):
            for variant in variants:
                reads[variant].append(run_mode("read", args, workdir, variant))
                reduces[variant].append(run_mode("reduce", args, workdir, variant))
        first = variants[0]
        naive = None
        if args.naive_heads > 0:  # compares with the last reduce's output
            naive = run_mode("naive", args, workdir, first)
        report(
            args,
            builds[first],
            stored[first],
            best_of(reads[first]),
            best_of(reduces[first]),
            naive,
        )
        if len(variants) == 2:
            checksum_report(
                args,
                builds,
                stored,
                {v: best_of(reads[v]) for v in variants},
                {v: best_of(reduces[v]) for v in variants},
            )
    finally:
        if args.keep:
            kept = ", ".join(f"{store} and {out}" for store, out in args.stores.values())
            print(f"kept {kept}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
