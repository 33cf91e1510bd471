"""Benchmark: the survey capture (attention stores, Contract 4) at real token geometry on CPU.

The survey computes, next to the real attention, the exact softmax of every (pass, head, query
frame) tile and keeps two reductions of it: the mean probability of each key token (`key_mass`)
and the mean row entropy, written to one attention store per layer. Three targets: the rollout
with the survey costs at most 2x the rollout alone; an attention store is at most 2 % of the bytes
of the token store of the same layer (float16 logits of every visible tile, all heads and passes);
the survey run peaks below 2 GB of resident memory.

Real geometry (docs/DESIGN.md, "Scale, on paper"): a 60 x 104 latent, i.e. T = 1560 tokens per
latent frame after the 2 x 2 patch, 21 latent frames in 7 blocks of 3, the Self-Forcing schedule (4
denoising steps and the cache pass per block), every pass and every layer surveyed. The model is a
narrow random-init Wan DiT built in process with the real head_dim (128) and the real FFN width per
head (dim = heads x 128, ffn_dim = dim x 8960 / 1536, the 1.3B model's ratio), Wan's text length
(512; text_dim 64) and 30 layers. The survey's cost is per head: the attention of one head against
its visible keys and the survey's softmax of the same logits both grow with head_dim and the number
of keys, while the projections and the FFN grow with the width per head. Keeping head_dim and the
width per head real keeps the share of attention in the rollout what it is per head in
Wan2.1-T2V-1.3B, which is what the time ratio depends on; fewer heads only make the run cheaper. The
byte ratio does not depend on the model at all (both stores scale with heads x passes).

Two measurements, each in its own subprocess so that peak memories do not mix, alternating
`--repeat` times (the fastest of each counts, the highest peak RSS of each):

- rollout: `sinkscope.extraction.sampling.rollout` alone, no capture;
- survey: the same rollout with `LogitCapture` and one `AttentionStoreWriter` per layer, set up as
  the extraction job does (`sinkscope.extraction.job.plan_stores` / `extract`, store="attention"),
  timed from the writers' creation until all of them are closed. The capture and the writers are
  subclasses that only add timers (the hook's time on the model thread, `write_prepared`'s time
  including waits on the writers' queues).

Afterwards every attention store is read back and checked: key_mass sums to 1 over the key tokens
for each (step, head, query frame), is NaN exactly on the keys the query frame cannot see, the
entropies lie in [0, log(visible keys)], and the arrays' logical bytes are `attention_store_bytes`.
Ratios are of one run; not a test.

    python benchmarks/survey.py                        # 30 layers, 1 head, all passes: ~11 min
    python benchmarks/survey.py --layers 2 --frames 6  # a quick look (~1 min)
    python benchmarks/survey.py --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import cpu_seconds, current_rss, gb, peak_rss, tree_bytes, verdict

LATENT_HEIGHT, LATENT_WIDTH = 60, 104
FRAMES_PER_BLOCK = 3
# Wan2.1-T2V-1.3B: dim 1536, ffn_dim 8960, 12 heads of 128, 30 layers, text_len 512.
WAN_DIM, WAN_FFN_DIM = 1536, 8960
HEAD_DIM = 128
NUM_LAYERS = 30
FREQ_DIM = 256
TEXT_DIM, TEXT_LEN = 64, 512

TIME_RATIO_TARGET = 2.0  # survey run / rollout alone, at most
BYTES_SHARE_TARGET = 0.02  # attention store on disk / token store (float16 logits), at most
PEAK_RSS_TARGET = 2e9  # bytes, less than
DISK_PER_PROMPT_TARGET = 2.5e9  # bytes of every layer's store of one prompt on disk, at most
REAL_HEADS = 12  # Wan2.1-T2V-1.3B's
# An attention store's arrays of (step, head, query frame[, key frame]): what attention_store_bytes
# counts beside the per-key arrays.
SMALL_ARRAYS = ("entropy", "logit_mean_pooled", "prob_mass_pooled", "value_norm", "mass_value_norm")
KEY_MASS_SUM_TOLERANCE = 1e-4  # |sum over key tokens - 1|, float32 reductions


# --- the model and the rollout ----------------------------------------------------------------


def geometry(frames: int):
    from sinkscope.extraction.sampling import Geometry

    return Geometry(
        num_frames=frames,
        frames_per_block=FRAMES_PER_BLOCK,
        latent_height=LATENT_HEIGHT,
        latent_width=LATENT_WIDTH,
    )


def model_config(heads: int, head_dim: int, layers: int):
    """The narrow Wan DiT: real head_dim and FFN width per head, `heads` heads."""
    from sinkscope.wan.config import WanConfig

    dim = heads * head_dim
    return WanConfig(
        dim=dim,
        ffn_dim=round(dim * WAN_FFN_DIM / WAN_DIM),
        num_heads=heads,
        num_layers=layers,
        freq_dim=FREQ_DIM,
        text_dim=TEXT_DIM,
        text_len=TEXT_LEN,
    )


def build_model(args):
    """A random-init Wan DiT (`model_config`) and a random prompt embedding."""
    import torch

    from sinkscope.wan.model import WanModel

    model = WanModel(model_config(args.heads, args.head_dim, args.layers))
    model.init_weights(torch.Generator().manual_seed(args.seed))
    model.eval().requires_grad_(False)
    text = torch.randn(
        1, TEXT_LEN, TEXT_DIM, generator=torch.Generator().manual_seed(args.seed + 1)
    )
    return model, text


def pass_spec(text: str) -> str | int:
    """--passes as capture.passes takes it: all, cache, last or a pass index."""
    return int(text) if text.isdigit() else text


def survey_passes(spec: str) -> list[int]:
    from sinkscope.extraction.sampling import SELF_FORCING
    from sinkscope.passes import resolve_passes

    return resolve_passes(pass_spec(spec), len(SELF_FORCING.steps))


def store_path(stores: Path, layer: int) -> Path:
    return stores / f"layer_{layer:02d}.zarr"


# --- worker modes (each in its own process) ------------------------------------------------


def run_rollout(args) -> dict:
    import torch

    from sinkscope.extraction.sampling import SELF_FORCING, rollout

    model, text = build_model(args)
    rss_before = current_rss()
    cpu0, started = cpu_seconds(), time.perf_counter()
    rollout(
        model,
        text,
        geometry=geometry(args.frames),
        schedule=SELF_FORCING,
        seed=args.seed,
        progress=False,
    )
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds() - cpu0,
        "rss_before": rss_before,
        "peak_rss": peak_rss(),
        "torch_threads": torch.get_num_threads(),
    }


def run_survey(args) -> dict:
    import torch

    from sinkscope.extraction.attention_store import AttentionStoreWriter
    from sinkscope.extraction.capture import LogitCapture
    from sinkscope.extraction.sampling import SELF_FORCING, rollout

    class TimedCapture(LogitCapture):
        """LogitCapture with a timer around each call on the model thread; counts the calls of
        surveyed passes."""

        seconds = 0.0
        calls = 0

        def __call__(self, layer, q, k, visible) -> None:
            started = time.perf_counter()
            super().__call__(layer, q, k, visible)
            self.seconds += time.perf_counter() - started
            # a call of a surveyed layer at a surveyed pass (Self-Forcing: one block a pass)
            self.calls += layer in self.writers and self._pass[1] in self.step_of_pass

    class TimedWriter(AttentionStoreWriter):
        """AttentionStoreWriter with a timer around write_prepared (filing the call's frame-level
        values, packing its key frames' chunks and queueing them, waits on a full queue
        included)."""

        block_seconds = 0.0

        def write_prepared(self, *call) -> None:
            started = time.perf_counter()
            super().write_prepared(*call)
            self.block_seconds += time.perf_counter() - started

    model, text = build_model(args)
    cfg = model.config
    geo = geometry(args.frames)
    t = cfg.tokens_per_frame(LATENT_HEIGHT, LATENT_WIDTH)
    passes = survey_passes(args.passes)
    every_timestep, every_kind = SELF_FORCING.pass_timesteps(), SELF_FORCING.pass_kinds()
    layers = list(range(cfg.num_layers))
    common = {
        "frames_per_block": geo.frames_per_block,
        "num_heads": cfg.num_heads,
        "num_frames": geo.num_frames,
        "frame_seq_length": t,
        "timesteps": [every_timestep[p] for p in passes],
        "pass_kinds": [every_kind[p] for p in passes],
        "precision": args.precision,
    }
    attrs = {
        "benchmark": "benchmarks/survey.py",
        "store": "attention",
        "num_heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
        "frame_seq_length": t,
        "num_frames": geo.num_frames,
        "block_sizes": geo.block_sizes,
        "logit_scale": 1.0 / math.sqrt(cfg.head_dim),
    }
    rss_before = current_rss()
    cpu0, started = cpu_seconds(), time.perf_counter()
    with contextlib.ExitStack() as stack:
        writers = [
            stack.enter_context(
                TimedWriter(
                    store_path(args.stores, layer), attrs={**attrs, "layer": layer}, **common
                )
            )
            for layer in layers
        ]
        capture = TimedCapture(dict(zip(layers, writers, strict=True)), passes, t, cfg.head_dim)
        model.set_capture(capture, capture.layers)
        try:
            rollout(
                model,
                text,
                geometry=geo,
                schedule=SELF_FORCING,
                seed=args.seed,
                on_pass=capture.begin_pass,
                progress=False,
            )
        finally:
            model.set_capture(None)
        rollout_done = time.perf_counter()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "rollout_seconds": rollout_done - started,
        "close_seconds": seconds - (rollout_done - started),
        "hook_seconds": capture.seconds,
        "hook_calls": capture.calls,
        "block_seconds": sum(writer.block_seconds for writer in writers),
        "write_seconds": [writer.write_seconds for writer in writers],
        "bytes_written": sum(writer.bytes_written for writer in writers),
        "cpu_seconds": cpu_seconds() - cpu0,
        "frame_seq_length": t,
        "passes": passes,
        "rss_before": rss_before,
        "peak_rss": peak_rss(),
        "torch_threads": torch.get_num_threads(),
    }


MODES = {"rollout": run_rollout, "survey": run_survey}


# --- reading the stores back ---------------------------------------------------------------


def check_stores(args, stores: Path, passes: list[int], t: int) -> dict:
    """Every store: key_mass sums to 1 over the key tokens per (step, head, query frame), NaN
    exactly on invisible keys (key_logit_mean too), entropies in [0, log(visible keys)], logical
    bytes as `attention_store_bytes`. Returns the largest deviations and the per-layer file
    sizes."""
    import zarr

    from sinkscope.frames import attention_store_bytes, visible_frames

    geo = geometry(args.frames)
    frames = geo.num_frames
    visible = visible_frames(geo.block_sizes)  # [query frame, key frame]
    visible_tokens = np.repeat(visible, t, axis=1)  # [query frame, key token]
    log_keys = np.log(visible.sum(axis=1) * t)  # the largest entropy of each query frame
    logical = attention_store_bytes(
        num_passes=len(passes),
        num_heads=args.heads,
        num_frames=frames,
        frame_seq_length=t,
        visible_tiles=int(visible.sum()),
        precision=args.precision,
    )
    worst_sum = worst_entropy = 0.0
    rows = 0
    sizes, allocated = [], []
    for layer in range(args.layers):
        path = store_path(stores, layer)
        apparent, on_disk = tree_bytes(path)
        sizes.append(apparent)
        allocated.append(on_disk)
        group = zarr.open_group(str(path), mode="r")
        stored_mass = group["key_mass"][...]
        # float16: stored scaled (CF scale_factor)
        scale = group["key_mass"].attrs.get("scale_factor", 1.0)
        key_mass = stored_mass.astype(np.float32) * np.float32(scale)
        head_sum = args.precision == "float16"
        logits = group["key_logit_head_sum" if head_sum else "key_logit_mean"][...]
        small = [group[name][...] for name in SMALL_ARRAYS if name in group]
        entropy = group["entropy"][...]
        shape = (len(passes), args.heads, frames, frames * t)
        assert key_mass.shape == shape, (path, key_mass.shape, shape)
        finite = np.isfinite(key_mass)
        # the visible keys' bytes, as stored: invisible key frames have no chunk
        visible_logits = np.isfinite(logits)
        stored = finite.sum() * stored_mass.itemsize + visible_logits.sum() * logits.itemsize
        stored += sum(array.nbytes for array in small)
        assert stored == logical, (path, stored, logical)
        assert (finite == visible_tokens[None, None]).all(), f"{path}: NaN off the invisible keys"
        per_head = visible_logits if not head_sum else visible_logits[:, None]
        assert (per_head == finite).all(), f"{path}: logits NaN elsewhere than key_mass"
        sums = np.nansum(key_mass, axis=-1, dtype=np.float64)
        worst_sum = max(worst_sum, float(np.abs(sums - 1).max()))
        assert worst_sum < KEY_MASS_SUM_TOLERANCE, f"{path}: key_mass sums off 1 by {worst_sum}"
        assert (key_mass[finite] >= 0).all(), f"{path}: negative key_mass"
        assert np.isfinite(entropy).all(), f"{path}: entropy not finite"
        excess = max(float((-entropy).max()), float((entropy - log_keys).max()))
        worst_entropy = max(worst_entropy, excess)
        assert worst_entropy < 1e-4, f"{path}: entropy outside [0, log(visible keys)]"
        rows += sums.size
    return {
        "worst_sum": worst_sum,
        "worst_entropy": worst_entropy,
        "rows": rows,
        "sizes": sizes,
        "allocated": allocated,
        "logical": logical,
    }


# --- the driver ------------------------------------------------------------------------------


def run_mode(mode: str, args, workdir: Path, **paths: Path) -> dict:
    """Run one mode in a subprocess of this script and return what it measured."""
    result = workdir / f"{mode}.json"
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--mode",
        mode,
        "--result",
        str(result),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--head-dim",
        str(args.head_dim),
        "--frames",
        str(args.frames),
        "--passes",
        args.passes,
        "--precision",
        args.precision,
        "--seed",
        str(args.seed),
    ]
    for name, path in paths.items():
        command += [f"--{name}", str(path)]
    print(f"[{time.strftime('%H:%M:%S')}] {mode} ...", flush=True)
    subprocess.run(command, check=True)
    return json.loads(result.read_text())


def fastest(runs: list[dict]) -> dict:
    """The run of least wall time, with the highest peak RSS of all and every run's seconds."""
    best = dict(min(runs, key=lambda run: run["seconds"]))
    best["peak_rss"] = max(run["peak_rss"] for run in runs)
    best["all_seconds"] = [round(run["seconds"], 1) for run in runs]
    return best


def summary_line(label: str, value: str, target: str, ok: bool) -> str:
    return f"{label:<32}{value:>10}   target {target:<11} {verdict(ok)}"


def report(args, rollout: dict, survey: dict, check: dict) -> None:
    from sinkscope.frames import attention_store_disk_bytes, token_store_bytes, visible_frames

    cfg = model_config(args.heads, args.head_dim, args.layers)
    geo = geometry(args.frames)
    t = survey["frame_seq_length"]
    passes = survey["passes"]
    tiles = int(visible_frames(geo.block_sizes).sum())
    token_bytes = token_store_bytes(
        num_passes=len(passes),
        num_heads=args.heads,
        frame_seq_length=t,
        sizes=geo.block_sizes,
        local_attn_size=-1,
        sink_size=0,
    )
    sizes = np.asarray(check["sizes"], dtype=np.float64)
    per_layer = float(sizes.mean())
    # Per prompt of the real model (30 layers x 12 heads): this run's bytes per layer times 30,
    # scaled by the plan's ratio of 12 heads to this run's heads where it had fewer.
    real = {"num_passes": len(passes), "num_frames": geo.num_frames, "frame_seq_length": t}
    plan = {
        heads: attention_store_disk_bytes(
            **real,
            num_heads=heads,
            frames_per_block=geo.frames_per_block,
            visible_tiles=tiles,
            precision=args.precision,
        )
        for heads in (args.heads, REAL_HEADS)
    }
    per_prompt = per_layer * NUM_LAYERS * plan[REAL_HEADS] / plan[args.heads]
    logical = check["logical"]
    share = per_layer / token_bytes
    time_ratio = survey["seconds"] / rollout["seconds"]
    writes = survey["write_seconds"]
    model_seconds = survey["rollout_seconds"] - survey["hook_seconds"]
    calls = len(geo.block_sizes) * len(passes) * args.layers
    runs = len(survey["all_seconds"])
    lines = [
        "",
        f"geometry: latent {LATENT_HEIGHT}x{LATENT_WIDTH}, T={t} tokens/frame, {geo.num_frames} "
        f"frames in {len(geo.block_sizes)} blocks of {FRAMES_PER_BLOCK}; passes {args.passes!r} = "
        f"{passes} of each block; {tiles} visible (T, T) tiles per pass and head",
        f"model: {cfg.num_layers} layers, all surveyed; {cfg.num_heads} head(s) x head_dim "
        f"{cfg.head_dim} (dim {cfg.dim}, ffn_dim {cfg.ffn_dim}), text {TEXT_LEN} x {TEXT_DIM}; "
        f"torch threads {survey['torch_threads']} (rollout only: {rollout['torch_threads']}), "
        f"{os.cpu_count()} CPUs",
        f"checked: {args.layers} attention store(s), {check['rows']} (step, head, query frame) "
        f"rows; key_mass sums to 1 within {check['worst_sum']:.1e} (tolerance "
        f"{KEY_MASS_SUM_TOLERANCE:.0e}), NaN exactly on the invisible keys; entropies in "
        f"[0, log(visible keys)] (worst excess {check['worst_entropy']:.1e}); logical bytes = "
        "attention_store_bytes",
        "",
        f"1. time (fastest of {runs}: rollout {rollout['all_seconds']} s, survey "
        f"{survey['all_seconds']} s)",
        f"   rollout only                 {rollout['seconds']:8.1f} s  "
        f"(CPU {rollout['cpu_seconds']:.0f} s)",
        f"   rollout + survey             {survey['seconds']:8.1f} s  "
        f"(CPU {survey['cpu_seconds']:.0f} s; rollout returned at "
        f"{survey['rollout_seconds']:.1f} s, {args.layers} stores closed "
        f"{survey['close_seconds']:.1f} s later)",
        f"     capture hook               {survey['hook_seconds']:8.1f} s  "
        f"(model thread, {survey['hook_calls']} calls of {calls} expected: pooled logits, "
        f"exact softmax reductions, write_prepared {survey['block_seconds']:.1f} s "
        "incl. queue waits)",
        f"     model, outside the hook    {model_seconds:8.1f} s  "
        f"({model_seconds / rollout['seconds']:.2f} x the rollout alone)",
        f"     writer threads             {sum(writes):8.1f} s  "
        f"(background, {len(writes)} stores, at most {max(writes):.2f} s each, "
        f"{gb(survey['bytes_written'])} logical float32 queued)",
        f"   ratio survey / rollout only  {time_ratio:8.2f} x",
        "2. bytes per layer",
        f"   attention store on disk      {per_layer / 1e6:8.2f} MB  (sum of file sizes, mean over "
        f"{len(sizes)} layers, {sizes.min() / 1e6:.2f}-{sizes.max() / 1e6:.2f} MB; allocated "
        f"{np.mean(check['allocated']) / 1e6:.2f} MB)",
        f"   attention store, logical     {logical / 1e6:8.2f} MB  (attention_store_bytes: "
        f"{args.precision} key_mass and the mean logits of the visible keys, entropy, frame-pair "
        "arrays)",
        f"   per prompt, 30 layers x {REAL_HEADS} heads {per_prompt / 1e9:6.2f} GB  (on disk, "
        + (
            "measured x 30)"
            if args.heads == REAL_HEADS
            else f"measured x 30 x {plan[REAL_HEADS] / plan[args.heads]:.2f}, the plan's ratio "
            f"of {REAL_HEADS} heads to {args.heads})"
        ),
        f"   token store, logical         {token_bytes / 1e6:8.0f} MB  (token_store_bytes: float16 "
        f"logits, {len(passes) * args.heads * tiles} tiles)",
        f"   share on disk / token store   {100 * share:8.3f} %",
        f"   share logical / token store  {100 * logical / token_bytes:8.3f} %",
        f"   compression of key_mass etc. {logical / per_layer:8.2f} x",
        "3. peak resident memory (VmHWM)",
        f"   survey run                   {gb(survey['peak_rss']):>10}  "
        f"(RSS {gb(survey['rss_before'])} before the rollout)",
        f"   rollout only                 {gb(rollout['peak_rss']):>10}  "
        f"(RSS {gb(rollout['rss_before'])} before the rollout)",
        "",
        "== summary ==",
        summary_line(
            "time survey / rollout only",
            f"{time_ratio:.2f} x",
            f"<= {TIME_RATIO_TARGET:.2f} x",
            time_ratio <= TIME_RATIO_TARGET,
        ),
        summary_line(
            "bytes per layer, survey / token",
            f"{100 * share:.3f} %",
            f"<= {100 * BYTES_SHARE_TARGET:.2f} %",
            share <= BYTES_SHARE_TARGET,
        ),
        summary_line(
            "disk per prompt (30 x 12 heads)",
            f"{per_prompt / 1e9:.2f} GB",
            f"<= {DISK_PER_PROMPT_TARGET / 1e9:.1f} GB",
            per_prompt <= DISK_PER_PROMPT_TARGET,
        ),
        summary_line(
            "peak RSS of the survey run",
            gb(survey["peak_rss"]),
            f"<  {gb(PEAK_RSS_TARGET)}",
            survey["peak_rss"] < PEAK_RSS_TARGET,
        ),
        f"({per_layer / 1e6:.2f} MB on disk and {logical / 1e6:.2f} MB logical per layer against "
        f"{token_bytes / 1e9:.2f} GB of float16 logits; 1-minute load average "
        f"{args.load_before:.2f} before, {os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs; "
        f"{time.perf_counter() - args.started:.0f} s in all)",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers",
        type=int,
        default=NUM_LAYERS,
        help=f"model layers, all surveyed (default {NUM_LAYERS}, like Wan2.1-T2V-1.3B)",
    )
    parser.add_argument("--heads", type=int, default=1, help="attention heads (default 1)")
    parser.add_argument(
        "--head-dim",
        type=int,
        default=HEAD_DIM,
        help=f"channels per head (default {HEAD_DIM}, the real model's)",
    )
    parser.add_argument(
        "--frames", type=int, default=21, help="latent frames, in blocks of 3 (default 21)"
    )
    parser.add_argument(
        "--passes", default="all", help="capture.passes: all (default), cache, last or an index"
    )
    parser.add_argument(
        "--precision",
        choices=["float16", "float32"],
        default="float16",
        help="capture.survey_precision (default float16)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of the rollout and of the survey, alternating; the fastest counts (default 1)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="parent directory for the benchmark data (default: a new temporary directory)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the attention stores")
    parser.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stores", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        args.result.write_text(json.dumps(MODES[args.mode](args)))
        return

    args.started = time.perf_counter()
    passes = survey_passes(args.passes)  # a bad spec fails here
    model_config(args.heads, args.head_dim, args.layers)  # and a bad model here
    if args.layers < 1 or args.frames < 1 or args.repeat < 1:
        parser.error("--layers, --frames and --repeat must be at least 1")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="sinkscope-bench-survey-", dir=args.workdir))
    stores = workdir / "stores"
    args.load_before = os.getloadavg()[0]
    print(f"workdir {workdir}; load average {args.load_before:.2f}", flush=True)
    rollouts, surveys = [], []
    try:
        for _ in range(args.repeat):
            rollouts.append(run_mode("rollout", args, workdir))
            shutil.rmtree(stores, ignore_errors=True)
            surveys.append(run_mode("survey", args, workdir, stores=stores))
        print(f"[{time.strftime('%H:%M:%S')}] reading the stores back ...", flush=True)
        check = check_stores(args, stores, passes, surveys[-1]["frame_seq_length"])
        report(args, fastest(rollouts), fastest(surveys), check)
    finally:
        if args.keep:
            print(f"kept {stores}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
