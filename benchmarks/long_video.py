"""Benchmark: a long closed loop over cache slots at real token geometry on CPU.

A closed-loop rollout (Contract 6) under the `window` policy keeps a fixed number of frames in
every layer's KV cache, and its attention stores (Contract 4, "over cache slots") have a key axis
of the cache's slots, not of the video's tokens. So neither the work per block nor the bytes per
latent frame should grow with the length of the video. Targets, every layer of the model surveyed
(all passes):

- time per block stays constant once the window is full: the median wall time of the last 3
  blocks / the median of blocks 4-6 at most 1.1 (0-based; block 4 is the first that evicts frames
  from the full 12-frame window: block 3 already sees 12 frames but only fills the cache). Also
  printed with the process's CPU time per block (all threads), which another process on the
  machine disturbs less than wall time;
- bytes per latent frame of the stores stay constant: the same closed loop at two lengths
  (`--blocks`, `--short-blocks`), bytes on disk of the whole stores per latent frame, long run /
  short run, at most 1.1; and the same for the chunks of the blocks with a full window alone (the
  first blocks see fewer keys: their empty slots compress to almost nothing, so a short run's
  whole store is cheaper per frame than a long one's, whatever the length of the long one).

Method: the real token geometry of benchmarks/survey.py (a 60 x 104 latent, T = 1560 tokens per
latent frame, blocks of 3 latent frames, the Self-Forcing schedule of 4 denoising steps and the
cache pass, Wan's text length 512) and its narrow random-init Wan DiT (head_dim 128, dim = heads
x 128, the 1.3B model's FFN width per head), with fewer layers by default (`--layers 4`, not 30):
every layer does the same work per block, so the ratios do not depend on the depth, and four
layers keep both runs at about 5 minutes on 2 CPU cores. The rollout runs on one torch thread
(`--threads`): on a 2-core machine shared with other work, two threads slowed single blocks
several-fold whenever another process took a core (8x in a trial run); one thread is slowed at
most by its share of the CPU.

The loop is built as the closed-loop job builds one (`sinkscope.extraction.closed_loop.
_roll_out`): `CachePolicy("window", 12)` (a 12-frame window, LongLive's) and its caches
(`CachePolicy.new_caches`), a `RolloutPlan` with the policy's window, one `SlotStoreWriter` per
layer from `plan_stores(..., "attention", key_slots=12 x T)` (the slots of
`frames.closed_loop_key_frames`), `LogitCapture` under `PositionProbe`, and `sampling.rollout`
with the policy's caches. Its `on_call` hook stamps the first pass of each block: a block's time
runs from its first pass to the next block's first pass, the last block's until the rollout
returns (the writer threads keep running meanwhile; their close is reported apart). Single
blocks drift by a few percent, so the time ratio compares medians of 3 blocks; single blocks are
printed too.

Each length runs in its own subprocess (long first). Afterwards every store is read back:
key_mass sums to 1 over the slots a query saw and is NaN in the slots past them, no slot holds a
frame outside the window, and the logical bytes are `frames.attention_store_bytes(...,
key_slots=...)`. Also printed: the bytes of each block's chunks (all slot arrays and passes) per
latent frame and layer, in the long run. Ratios are of one run; not a test.

    python benchmarks/long_video.py                       # 4 layers, 14 + 7 blocks: ~5 min
    python benchmarks/long_video.py --layers 1 --blocks 8 --short-blocks 5  # ~1 min
    python benchmarks/long_video.py --blocks 30           # a longer loop: ~9 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import cpu_seconds, gb, peak_rss, tree_bytes, verdict
from survey import (
    FRAMES_PER_BLOCK,
    HEAD_DIM,
    LATENT_HEIGHT,
    LATENT_WIDTH,
    TEXT_DIM,
    TEXT_LEN,
    build_model,
    geometry,
    model_config,
    store_path,
    survey_passes,
)

WINDOW = 12  # latent frames the cache keeps, the own block included (LongLive's)
TIME_RATIO_TARGET = 1.1  # time per block, last blocks / first blocks with a full window
BYTES_RATIO_TARGET = 1.1  # store bytes per latent frame, long run / short run
MEDIAN_OF = 3  # blocks per median
KEY_MASS_SUM_TOLERANCE = 1e-4
# The arrays of a store over cache slots, chunked (passes, heads, 3, slots): one chunk per block.
SLOT_ARRAYS = (
    "key_mass",
    "key_logit_mean",
    "slot_frame",
    "slot_token",
    "slot_position",
    "slot_kind",
)


def policy(args):
    from sinkscope.extraction.cache_policies import CachePolicy

    return CachePolicy("window", args.window)


def first_full_block(window: int) -> int:
    """The first block that evicts frames from a full window (0-based; 4 for 12 frames in blocks
    of 3): from there on every block sees the same number of keys and drops as many."""
    return window // FRAMES_PER_BLOCK


def slot_frames(args, frames: int) -> int:
    """The key slots' worth of frames of a closed loop of `frames` latent frames."""
    from sinkscope.frames import closed_loop_key_frames

    entry = {"name": "window", "budget": args.window}
    return closed_loop_key_frames(entry, frames, FRAMES_PER_BLOCK)


# --- the worker (one closed loop, in its own process) ----------------------------------------


def run_loop(args) -> dict:
    """One closed loop of `args.run_blocks` blocks under the window policy, every layer captured
    into a store over cache slots, as `closed_loop._roll_out` sets it up; the time of each
    block."""
    import torch

    from sinkscope.extraction.capture import LogitCapture
    from sinkscope.extraction.closed_loop import PositionProbe
    from sinkscope.extraction.job import RolloutPlan, plan_stores
    from sinkscope.extraction.sampling import SELF_FORCING, rollout

    # plan_stores claims the disk space in a ledger relative to the working directory.
    os.chdir(args.stores.parent)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, text = build_model(args)
    cfg = model.config
    frames = args.run_blocks * FRAMES_PER_BLOCK
    geo = geometry(frames)
    t = cfg.tokens_per_frame(LATENT_HEIGHT, LATENT_WIDTH)
    cache_policy = policy(args)
    cache_policy.check(FRAMES_PER_BLOCK)
    local_attn_size, sink_size = cache_policy.window
    plan = RolloutPlan(
        geometry=geo,
        schedule=SELF_FORCING,
        local_attn_size=local_attn_size,
        sink_size=sink_size,
        seed=args.seed,
        passes=survey_passes(args.passes),
        tokens=False,
    )
    caches = cache_policy.new_caches(
        model,
        num_frames=frames,
        frame_seq_length=t,
        frames_per_block=FRAMES_PER_BLOCK,
        device="cpu",
        dtype=torch.float32,
        token_grid=cfg.token_grid(LATENT_HEIGHT, LATENT_WIDTH),
    )
    layers = list(range(cfg.num_layers))
    outputs = [store_path(args.stores, layer) for layer in layers]
    attrs = {
        "checkpoint": "random-init",
        "benchmark": "benchmarks/long_video.py",
        "policy": {"name": cache_policy.name, "budget": cache_policy.budget},
    }
    slots = slot_frames(args, frames) * t
    starts: list[float] = []  # wall time at each block's first pass
    cpu_starts: list[float] = []  # CPU time of the process (all threads) then
    cpu0, started = cpu_seconds(), time.perf_counter()
    with contextlib.ExitStack() as stack:
        writers = plan_stores(
            cfg, plan, layers, outputs, attrs, stack, "attention", key_slots=slots
        )
        capture = LogitCapture(
            dict(zip(layers, writers, strict=True)), plan.passes, t, cfg.head_dim
        )
        probe = PositionProbe(t, capture)

        def on_call(index: int, call, timesteps) -> None:
            if call.parts[0].pass_index == 0:
                starts.append(time.perf_counter())
                cpu_starts.append(cpu_seconds())
            probe.begin_call(index, call, timesteps)

        model.set_capture(probe, probe.layers)
        try:
            rollout(
                model,
                text,
                geometry=geo,
                schedule=plan.schedule,
                seed=plan.seed,
                on_call=on_call,
                progress=False,
                caches=caches,
            )
        finally:
            model.set_capture(None)
        rollout_done, cpu_done = time.perf_counter(), cpu_seconds()
    closed = time.perf_counter()
    ends, cpu_ends = [*starts[1:], rollout_done], [*cpu_starts[1:], cpu_done]
    return {
        "block_seconds": [end - start for start, end in zip(starts, ends, strict=True)],
        "block_cpu_seconds": [end - start for start, end in zip(cpu_starts, cpu_ends, strict=True)],
        "rollout_seconds": rollout_done - started,
        "close_seconds": closed - rollout_done,
        "cpu_seconds": cpu_seconds() - cpu0,
        "write_seconds": [writer.write_seconds for writer in writers],
        "frame_seq_length": t,
        "slots": slots,
        "passes": plan.passes,
        "positions": probe.rows,
        "peak_rss": peak_rss(),
        "torch_threads": torch.get_num_threads(),
    }


# --- reading the stores back ------------------------------------------------------------------


def check_stores(args, stores: Path, blocks: int, t: int, slots: int, passes: list[int]) -> dict:
    """Every store of one run: key_mass sums to 1 over the slots each query saw and is NaN past
    them, the slots hold frames of the window only, logical bytes as `attention_store_bytes`.
    Returns bytes on disk (whole stores; each block's chunks of the slot arrays)."""
    import zarr

    from sinkscope.frames import attention_store_bytes

    frames = blocks * FRAMES_PER_BLOCK
    logical = attention_store_bytes(
        num_passes=len(passes),
        num_heads=args.heads,
        num_frames=frames,
        frame_seq_length=t,
        key_slots=slots,
    )
    query_frame = np.arange(frames)
    block_start = query_frame // FRAMES_PER_BLOCK * FRAMES_PER_BLOCK
    # The window holds the frames since max(0, block end - window) up to the block's end.
    lowest = np.maximum(0, block_start + FRAMES_PER_BLOCK - args.window)
    seen = (block_start + FRAMES_PER_BLOCK - lowest) * t  # keys each query frame saw
    worst_sum = 0.0
    sizes, allocated = [], []
    block_bytes = np.zeros(blocks, dtype=np.int64)
    for layer in range(args.layers):
        path = store_path(stores, layer)
        apparent, on_disk = tree_bytes(path)
        sizes.append(apparent)
        allocated.append(on_disk)
        for name in SLOT_ARRAYS:
            # Chunks (passes, heads, 3, slots): c/0/0/<block>/0.
            for chunk in (path / name / "c").glob("*/*/*/*"):
                block_bytes[int(chunk.parent.name)] += chunk.stat().st_size
        group = zarr.open_group(str(path), mode="r")
        key_mass = group["key_mass"][...]
        slot_frame = group["slot_frame"][...]
        entropy = group["entropy"][...]
        stored = sum(group[name][...].nbytes for name in SLOT_ARRAYS) + entropy.nbytes
        assert stored == logical, (path, stored, logical)
        assert key_mass.shape == (len(passes), args.heads, frames, slots), key_mass.shape
        filled = np.arange(slots)[None, :] < seen[:, None]  # [query frame, slot]
        finite = np.isfinite(key_mass)
        assert (finite == filled[None, None]).all(), f"{path}: slots filled past what was seen"
        sums = np.nansum(key_mass, axis=-1, dtype=np.float64)
        worst_sum = max(worst_sum, float(np.abs(sums - 1).max()))
        assert worst_sum < KEY_MASS_SUM_TOLERANCE, f"{path}: key_mass sums off 1 by {worst_sum}"
        inside = (slot_frame >= lowest[:, None]) & (
            slot_frame < block_start[:, None] + FRAMES_PER_BLOCK
        )
        assert (inside == filled[None, None]).all(), f"{path}: a slot outside the window"
        assert np.isfinite(entropy).all(), f"{path}: entropy not finite"
    return {
        "worst_sum": worst_sum,
        "sizes": sizes,
        "allocated": allocated,
        "logical": logical,
        "block_bytes": block_bytes.tolist(),
    }


# --- the driver -------------------------------------------------------------------------------


def run_mode(args, workdir: Path, blocks: int, stores: Path) -> dict:
    """One closed loop of `blocks` blocks in a subprocess of this script."""
    result = workdir / f"loop_{blocks}.json"
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--mode",
        "loop",
        "--result",
        str(result),
        "--stores",
        str(stores),
        "--run-blocks",
        str(blocks),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--window",
        str(args.window),
        "--passes",
        args.passes,
        "--seed",
        str(args.seed),
        "--threads",
        str(args.threads),
    ]
    print(f"[{time.strftime('%H:%M:%S')}] closed loop of {blocks} blocks ...", flush=True)
    subprocess.run(command, check=True)
    return json.loads(result.read_text())


def median_blocks(seconds: list[float], first: int) -> float:
    return statistics.median(seconds[first : first + MEDIAN_OF])


def summary_line(label: str, value: str, target: str, ok: bool) -> str:
    return f"{label:<36}{value:>10}   target {target:<9} {verdict(ok)}"


def report(args, long: dict, short: dict, checks: dict) -> None:
    from sinkscope.frames import SLOT_ENTRY_BYTES

    cfg = model_config(args.heads, HEAD_DIM, args.layers)
    t = long["frame_seq_length"]
    seconds = long["block_seconds"]
    blocks, short_blocks = len(seconds), len(short["block_seconds"])
    first, last_first = first_full_block(args.window), blocks - MEDIAN_OF
    steady = median_blocks(seconds, first)
    last = median_blocks(seconds, last_first)
    time_ratio = last / steady
    single = seconds[-1] / seconds[first]
    cpu = long["block_cpu_seconds"]
    cpu_ratio = median_blocks(cpu, last_first) / median_blocks(cpu, first)

    # Bytes per latent frame and layer: whole stores on disk (files of every array, coordinates
    # and metadata included), and each block's chunks of the slot arrays.
    runs = {"long": (long, blocks), "short": (short, short_blocks)}
    disk = {
        name: sum(checks[name]["sizes"]) / args.layers / (n * FRAMES_PER_BLOCK)
        for name, (_, n) in runs.items()
    }
    logical = {
        name: checks[name]["logical"] / (n * FRAMES_PER_BLOCK) for name, (_, n) in runs.items()
    }
    allocated = {
        name: sum(checks[name]["allocated"]) / args.layers / (n * FRAMES_PER_BLOCK)
        for name, (_, n) in runs.items()
    }
    chunks = {
        name: np.asarray(checks[name]["block_bytes"]) / args.layers / FRAMES_PER_BLOCK
        for name in runs
    }
    full = {name: float(chunks[name][first:].mean()) for name in runs}  # full-window blocks
    bytes_ratio = disk["long"] / disk["short"]
    full_ratio = full["long"] / full["short"]
    long_frames, short_frames = blocks * FRAMES_PER_BLOCK, short_blocks * FRAMES_PER_BLOCK
    marginal = (
        (sum(checks["long"]["sizes"]) - sum(checks["short"]["sizes"]))
        / args.layers
        / (long_frames - short_frames)
    )
    passes = long["passes"]
    # Logical bytes of one query frame's slot arrays: passes x heads x slots x SLOT_ENTRY_BYTES.
    frame_logical = len(passes) * args.heads * long["slots"] * SLOT_ENTRY_BYTES

    block_lines = []
    for block, (row, secs, cpu_secs) in enumerate(
        zip(long["positions"], seconds, cpu, strict=True)
    ):
        end = (block + 1) * FRAMES_PER_BLOCK
        window = f"{max(0, end - args.window)}-{end - 1}"
        block_lines.append(
            f"   {block:>5} {secs:8.2f} s {cpu_secs:8.2f} s {chunks['long'][block] / 1e6:9.3f} MB"
            f"   frames {window:<7} (its queries at RoPE frame {row[3]})"
        )
    lines = [
        "",
        f"geometry: latent {LATENT_HEIGHT}x{LATENT_WIDTH}, T={t} tokens/frame, blocks of "
        f"{FRAMES_PER_BLOCK}; closed loops of {blocks} and {short_blocks} blocks under window "
        f"B={args.window} ({long['slots']} key slots = {long['slots'] // t} frames); passes "
        f"{args.passes!r} = {passes} of each block",
        f"model: {cfg.num_layers} layers, all surveyed; {cfg.num_heads} head(s) x head_dim "
        f"{cfg.head_dim} (dim {cfg.dim}, ffn_dim {cfg.ffn_dim}), text {TEXT_LEN} x {TEXT_DIM}; "
        f"torch threads {long['torch_threads']}, {os.cpu_count()} CPUs",
        f"checked: {2 * args.layers} stores over cache slots; key_mass sums to 1 within "
        f"{max(c['worst_sum'] for c in checks.values()):.1e} over the slots seen, NaN past them; "
        "slots hold window frames only; logical bytes = attention_store_bytes(key_slots=...)",
        "",
        f"1. time per block, {blocks}-block run (rollout {long['rollout_seconds']:.1f} s, CPU "
        f"{long['cpu_seconds']:.0f} s; stores closed {long['close_seconds']:.1f} s after it "
        f"returned; writer threads {sum(long['write_seconds']):.1f} s in the background)",
        "   block     wall       CPU  chunks/frame   keys seen",
        *block_lines,
        f"   median of blocks {first}-{first + MEDIAN_OF - 1:<8} {steady:8.2f} s "
        f"{median_blocks(cpu, first):8.2f} s",
        f"   median of blocks {last_first}-{blocks - 1:<8} {last:8.2f} s "
        f"{median_blocks(cpu, last_first):8.2f} s",
        f"   ratio last / first full window  {time_ratio:6.3f} (wall; single blocks {blocks - 1} / "
        f"{first}: {single:.3f}), {cpu_ratio:.3f} (CPU of the process, all threads)",
        "2. store bytes per latent frame and layer (on disk)",
        f"   {blocks:>2} blocks, whole store      {disk['long'] / 1e6:8.3f} MB  (logical "
        f"{logical['long'] / 1e6:.3f} MB, allocated {allocated['long'] / 1e6:.3f} MB)",
        f"   {short_blocks:>2} blocks, whole store      {disk['short'] / 1e6:8.3f} MB  (logical "
        f"{logical['short'] / 1e6:.3f} MB, allocated {allocated['short'] / 1e6:.3f} MB)",
        f"   ratio long / short            {bytes_ratio:8.3f}",
        f"   frames {short_frames}-{long_frames - 1}, long - short  {marginal / 1e6:8.3f} MB  "
        f"({marginal / disk['short']:.3f} x the short run's per frame)",
        f"   full-window blocks ({first}-), chunks  {full['long'] / 1e6:.3f} MB long, "
        f"{full['short'] / 1e6:.3f} MB short: ratio {full_ratio:.3f}",
        f"   on disk / logical             {disk['long'] / logical['long']:8.3f}  (whole "
        f"{blocks}-block store; chunks of full-window blocks: {full['long'] / frame_logical:.3f})",
        f"   peak RSS                      {gb(max(long['peak_rss'], short['peak_rss'])):>9}",
        "",
        "== summary ==",
        summary_line(
            f"time per block, last / block {first}",
            f"{time_ratio:.3f}",
            f"<= {TIME_RATIO_TARGET}",
            time_ratio <= TIME_RATIO_TARGET,
        ),
        summary_line(
            "  the same, CPU time",
            f"{cpu_ratio:.3f}",
            f"<= {TIME_RATIO_TARGET}",
            cpu_ratio <= TIME_RATIO_TARGET,
        ),
        summary_line(
            "bytes per frame, long / short",
            f"{bytes_ratio:.3f}",
            f"<= {BYTES_RATIO_TARGET}",
            bytes_ratio <= BYTES_RATIO_TARGET,
        ),
        summary_line(
            "  the same, full-window blocks",
            f"{full_ratio:.3f}",
            f"<= {BYTES_RATIO_TARGET}",
            full_ratio <= BYTES_RATIO_TARGET,
        ),
        f"(times: medians of {MEDIAN_OF} blocks; 1-minute load average {args.load_before:.2f} "
        f"before, {os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs; "
        f"{time.perf_counter() - args.started:.0f} s in all)",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers", type=int, default=4, help="model layers, all surveyed (default 4)"
    )
    parser.add_argument("--heads", type=int, default=1, help="attention heads of 128 (default 1)")
    parser.add_argument(
        "--blocks", type=int, default=14, help="blocks of 3 latent frames, long run (default 14)"
    )
    parser.add_argument(
        "--short-blocks", type=int, default=7, help="blocks of the short run (default 7)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        help=f"frames the window policy keeps, own block included (default {WINDOW})",
    )
    parser.add_argument(
        "--passes", default="all", help="capture.passes: all (default), cache, last or an index"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the rollout (default 1: on a shared machine two threads on two "
        "cores slow down several-fold whenever another process takes a core; 0: torch's default)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="parent directory for the benchmark data (default: a new temporary directory)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the attention stores")
    parser.add_argument("--mode", choices=("loop",), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stores", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--run-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.head_dim = HEAD_DIM  # build_model's
    if args.mode:
        args.result.write_text(json.dumps(run_loop(args)))
        return

    args.started = time.perf_counter()
    passes = survey_passes(args.passes)  # a bad spec fails here
    model_config(args.heads, HEAD_DIM, args.layers)  # and a bad model here
    policy(args).check(FRAMES_PER_BLOCK)  # and a bad window here
    first = first_full_block(args.window)
    if args.layers < 1 or args.blocks < first + MEDIAN_OF:
        parser.error(
            f"need --layers >= 1 and --blocks >= {first + MEDIAN_OF} (blocks {first}-"
            f"{first + MEDIAN_OF - 1} are the baseline)"
        )
    if not first < args.short_blocks < args.blocks:
        parser.error(
            f"--short-blocks must be more than {first} (a full window) and fewer than --blocks"
        )
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="sinkscope-bench-long-", dir=args.workdir)).resolve()
    args.load_before = os.getloadavg()[0]
    print(f"workdir {workdir}; load average {args.load_before:.2f}", flush=True)
    try:
        runs, checks = {}, {}
        for name, blocks in (("long", args.blocks), ("short", args.short_blocks)):
            stores = workdir / f"stores_{blocks}"
            runs[name] = run_mode(args, workdir, blocks, stores)
            checks[name] = check_stores(
                args,
                stores,
                blocks,
                runs[name]["frame_seq_length"],
                runs[name]["slots"],
                passes,
            )
        report(args, runs["long"], runs["short"], checks)
    finally:
        if args.keep:
            print(f"kept {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
