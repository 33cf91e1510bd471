"""One command for the first GPU: the CUDA tests, the survey and capture costs at the real
geometry and width, and bfloat16 against float32, printed as one table to paste into
benchmarks/README.md (device named).

On a machine without CUDA it says so and exits 0 (`--cpu-smoke` runs the same code at toy size
on the CPU instead, to check the script itself).

What it measures, with random weights of Wan2.1-T2V-1.3B's shape (30 layers, 12 heads of 128,
ffn 8960, text 512 x 4096) at the real token geometry (60 x 104 latent: T = 1560 tokens per
frame; 21 frames in 7 blocks of 3; Self-Forcing's 4 steps and the cache pass), in the dtype a
GPU job runs (`dtype: auto`, bfloat16):
1. the CUDA tests (`pytest -m "not workflow"` on the modules with CUDA paths);
2. a plain rollout; the survey of all 30 layers x 5 passes (attention stores, as the survey job
   writes them: the softmax reductions in `extraction/fused_softmax.py`'s kernels, the writers in
   a `StoreProcess` whose child has started and opened its stores before the timer, as the job
   starts it before its weights load; once more with the child started inside the timer; once
   more with the reductions copied to the store process, which drops them; once more with the
   reductions computed on the device and dropped there, no copy: the three split the survey's
   cost into the device's, the copies' and the stores'; once more on the torch path the kernels
   replace; `--profile`: once more under torch.profiler, its tables printed);
   the token capture of layer 0 at pass 0 (token stores, as the extract job with
   `capture.token_passes: 0`). Targets: survey / plain <= 2.0 (TIME_RATIO_TARGET), and each
   run's peak GPU memory (`torch.cuda.max_memory_allocated`: tensors only, the CUDA context
   comes on top) within the plan's estimate (`workflow.resources.gpu_memory_bytes`, which
   `snakemake -n` prints, its 1.5 GB allowance for the context included);
3. bfloat16 against float32 at that width on the first --compare-layers layers: latents
   (relative L2 per frame) and the surveyed key_mass (largest absolute difference);
4. the decode job's VAE decode (`sinkscope.wan.vae.iter_decoded_frames`, one latent frame a
   call, each chunk of uint8 frames copied to the CPU and dropped) of the rollout's 21 latent
   frames (81 pixel frames at 480 x 832) with a random VAE of Wan2.1's shape, in bfloat16 and
   in float32, after a warm-up decode of 2 latent frames: pixel frames per second (target
   >= VAE_FPS_TARGET, the videos' playback rate, on one GPU) and the peak GPU memory against
   the plan's estimate (`workflow.resources.vae_decode_bytes`).

    python benchmarks/gpu.py                 # ~5 min on an H200
    python benchmarks/gpu.py --vae-only      # the VAE decode rows alone
    python benchmarks/gpu.py --cpu-smoke     # the same code, toy size, on the CPU (~1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
TIME_RATIO_TARGET = 2.0
VAE_FPS_TARGET = 16.0  # pixel frames a second: Wan's videos play at 16 fps
# The modules whose tests take a CUDA path when a GPU is there.
CUDA_TESTS = [
    "tests/test_precision.py",
    "tests/test_text.py",
    "tests/test_gpus.py",
    "tests/test_fused_softmax.py",
]
# Wan2.1-T2V-1.3B's shape and the real geometry; the smoke run's toy ones.
REAL = {
    "model": {
        "dim": 1536,
        "ffn_dim": 8960,
        "num_heads": 12,
        "num_layers": 30,
        "freq_dim": 256,
        "text_dim": 4096,
        "text_len": 512,
    },
    "video": {"num_frames": 21, "frames_per_block": 3, "latent_height": 60, "latent_width": 104},
    "vae": {"base_dim": 96},  # Wan2.1's VAE
}
SMOKE = {
    "model": {
        "dim": 32,
        "ffn_dim": 48,
        "num_heads": 2,
        "num_layers": 5,
        "freq_dim": 16,
        "text_dim": 8,
        "text_len": 8,
    },
    "video": {"num_frames": 6, "frames_per_block": 3, "latent_height": 4, "latent_width": 6},
    "vae": {"base_dim": 8},
}
# As the embedded default captures (`layers: [0]`): 12 heads of pass 0 are 14.7 GB of float16.
TOKEN_LAYERS = [0]


def plan_config(scale: dict, dtype: str) -> dict:
    """The embedded default with the demo model at `scale`'s shape, as `snakemake -n` would plan
    it (schema defaults filled in)."""
    from snakemake.utils import validate

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["demo"]["model"] = dict(scale["model"])
    config["video"] = {**config["video"], **scale["video"]}
    config["dtype"] = dtype
    validate(config, str(REPO / "schemas" / "config.schema.yaml"))
    return config


def build(scale: dict, device: torch.device, dtype: torch.dtype, layers: int | None = None):
    from sinkscope.extraction.sampling import Geometry
    from sinkscope.wan.config import WanConfig
    from sinkscope.wan.model import WanModel

    shape = dict(scale["model"])
    if layers is not None:
        shape["num_layers"] = layers
    cfg = WanConfig(**shape)
    model = WanModel(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.eval().requires_grad_(False).to(device=device, dtype=dtype)
    text = torch.randn(1, cfg.text_len, cfg.text_dim, generator=torch.Generator().manual_seed(1))
    return model, text, Geometry(**scale["video"])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


class OnDevice:
    """The writer a device-only capture is given: it is never written to."""

    store_kind = "attention"
    write_seconds = 0.0


ON_DEVICE = OnDevice()


def device_only_capture(writers, passes, t, head_dim):
    """A LogitCapture that computes the survey's reductions on the device and drops them: no
    copy to the host, no wait for the GPU, no store. Against the discarded survey it splits the
    device's part into the kernels and the copies (with the waits they force)."""
    from sinkscope.extraction.capture import LogitCapture

    class DeviceOnlyCapture(LogitCapture):
        def _frames(self, writer, step, first_frame, q, k, visible, call, value_norm=None):
            self._reductions(q, k)  # the value norms: computed per call, as in the survey

    return DeviceOnlyCapture(writers, passes, t, head_dim)


def compile_kernels(model, geometry, device, dtype) -> None:
    """Compiles the survey's fused kernels for every key count it meets (Triton specialises
    integer arguments on their divisibility by 16), so no compile lands in a timed run."""
    from sinkscope.extraction import fused_softmax

    cfg = model.config
    shape = (cfg.num_heads, cfg.head_dim)
    t = cfg.tokens_per_frame(geometry.latent_height, geometry.latent_width)
    q = torch.zeros((geometry.frames_per_block * t, *shape), device=device, dtype=dtype)
    if not fused_softmax.usable(q):
        return
    for blocks in range(1, len(geometry.block_sizes) + 1):
        keys = sum(geometry.block_sizes[:blocks]) * t
        k = torch.zeros((keys, *shape), device=device, dtype=dtype)
        fused_softmax.fused_reductions(q, k, 1.0, geometry.frames_per_block)
    synchronize(device)


class Timed(NamedTuple):
    """One timed rollout: wall seconds (stores closed), peak GPU bytes, the latents, the seconds
    its store writer threads were busy, summed; with a store process, the seconds of the wall
    time spent closing the stores after the rollout (the child's backlog), and the model thread's
    seconds in the process's calls and, of those, waiting for room in its ring."""

    seconds: float
    peak: int
    latents: torch.Tensor
    write_seconds: float
    close_seconds: float = 0.0
    call_seconds: float = 0.0
    ring_wait_seconds: float = 0.0


def waits(timed: Timed) -> str:
    """Where a survey through the store process spent its time besides the model's work."""
    return (
        f"the model thread in the process's calls {timed.call_seconds:.1f} s (waiting for ring "
        f"room {timed.ring_wait_seconds:.1f} s), closing after the rollout "
        f"{timed.close_seconds:.1f} s"
    )


def timed_rollout(
    model,
    text,
    geometry,
    device,
    dtype,
    *,
    stores=None,
    store="attention",
    layers=(),
    ready_first=True,
):
    """One rollout, capturing `layers` into stores of kind `store` (`attention`, `tokens`,
    `discarded`: attention reductions copied to the store process, which drops them, or `device`:
    the reductions computed and dropped on the device) under the folder `stores` when given.
    Attention stores are written as `extraction.job.plan_stores` writes them: in a
    `StoreProcess`; `ready_first`: the timer starts once its child has started and opened them,
    as in the survey job, which starts it before its weights load (False: before it starts)."""
    from sinkscope.extraction.attention_store import AttentionStoreWriter
    from sinkscope.extraction.capture import LogitCapture
    from sinkscope.extraction.sampling import SELF_FORCING, rollout
    from sinkscope.extraction.store import TokenStoreWriter
    from sinkscope.extraction.store_process import attention_store_process
    from sinkscope.passes import resolve_passes

    cfg = model.config
    t = cfg.tokens_per_frame(geometry.latent_height, geometry.latent_width)
    passes = resolve_passes(0 if store == "tokens" else "all", len(SELF_FORCING.steps))
    timesteps, kinds = SELF_FORCING.pass_timesteps(), SELF_FORCING.pass_kinds()
    common = {
        "num_heads": cfg.num_heads,
        "num_frames": geometry.num_frames,
        "frame_seq_length": t,
        "timesteps": [timesteps[p] for p in passes],
        "pass_kinds": [kinds[p] for p in passes],
        "attrs": {"benchmark": "benchmarks/gpu.py", "block_sizes": geometry.block_sizes},
    }
    reset_peak(device)
    synchronize(device)
    started = time.perf_counter()
    process = None
    with contextlib.ExitStack() as stack:
        capture, writers = None, {}
        if stores is not None:
            if store == "device":
                open_store = lambda path, **common: contextlib.nullcontext(ON_DEVICE)  # noqa: E731
            elif store != "tokens":
                process = attention_store_process(
                    cfg.num_heads,
                    geometry.frames_per_block,
                    geometry.num_frames * t,
                    slots=False,
                    dry_run=store != "attention",
                )
                open_store = stack.enter_context(process).opener(AttentionStoreWriter)
                common["frames_per_block"] = geometry.frames_per_block
            else:
                open_store = TokenStoreWriter
            for layer in layers:
                path = stores / f"{store}{layer}.zarr"
                writers[layer] = stack.enter_context(open_store(path, **common))
            if ready_first and process is not None:
                process.ready()
                started = time.perf_counter()
            make = device_only_capture if store == "device" else LogitCapture
            capture = make(writers, passes, t, cfg.head_dim)
            model.set_capture(capture, capture.layers)
        try:
            latents = rollout(
                model,
                text,
                geometry=geometry,
                schedule=SELF_FORCING,
                seed=42,
                device=device,
                dtype=dtype,
                on_pass=None if capture is None else capture.begin_pass,
                progress=False,
            )
        finally:
            model.set_capture(None)
        synchronize(device)
        rolled_out = time.perf_counter()
    seconds = time.perf_counter() - started  # the writers closed: everything on disk
    write_seconds = sum(writer.write_seconds for writer in writers.values())
    if process is None:
        return Timed(seconds, peak(device), latents, write_seconds)
    return Timed(
        seconds,
        peak(device),
        latents,
        write_seconds,
        started + seconds - rolled_out,
        process.call_seconds,
        process.ring_wait_seconds,
    )


def profile(model, text, geometry, device, dtype, stores: Path, layers) -> None:
    """One more survey under torch.profiler: the operators and kernels that take the device's
    time, and those that take the model thread's (printed above the table)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    stores.mkdir()
    with profiler(activities=activities) as prof:
        timed_rollout(model, text, geometry, device, dtype, stores=stores, layers=layers)
    events = prof.key_averages()
    for key in ("self_cuda_time_total", "self_cpu_time_total")[2 - len(activities) :]:
        print(f"[gpu.py] profile of the survey, by {key}:", flush=True)
        print(events.table(sort_by=key, row_limit=18, max_name_column_width=60), flush=True)


def cuda_tests() -> str:
    """The CUDA tests' pytest summary line."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not workflow", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, *CUDA_TESTS],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0:  # what failed, above the table
        print("\n".join(lines[-60:]) or result.stderr[-4000:], flush=True)
    return (lines[-1] if lines else result.stderr.strip()[-200:]).strip("= ")


def compare_dtypes(scale: dict, device: torch.device, layers: int, folder: Path) -> dict:
    """bfloat16 against float32, one model at the real width and `layers` layers, every layer
    surveyed."""
    import numpy as np
    import xarray as xr

    from sinkscope.extraction.closed_loop import frame_deviation

    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model, text, geometry = build(scale, device, dtype, layers)
        stores = folder / name
        stores.mkdir()
        latents = timed_rollout(
            model, text, geometry, device, dtype, stores=stores, layers=range(layers)
        ).latents
        mass = [
            xr.open_zarr(stores / f"attention{layer}.zarr").key_mass.values
            for layer in range(layers)
        ]
        out[name] = (latents, mass)
        del model
    (f32, f32_mass), (bf16, bf16_mass) = out["float32"], out["bfloat16"]
    rel_l2, _ = frame_deviation(bf16[0], f32[0])
    mass = max(float(np.nanmax(np.abs(x - y))) for x, y in zip(bf16_mass, f32_mass, strict=True))
    return {"latents": max(rel_l2), "key_mass": mass}


class Decoded(NamedTuple):
    frames: int  # pixel frames
    seconds: float
    peak: int  # torch.cuda.max_memory_allocated, weights included (0 on a CPU)
    estimate: dict  # workflow.resources.vae_decode_bytes


def timed_decode(scale: dict, device: torch.device, dtype: torch.dtype) -> Decoded:
    """The decode job's streaming decode of one rollout's latents (`scale`'s video) with a random
    VAE of `scale`'s width in `dtype`: one latent frame a decoder call, each chunk's uint8
    frames copied to the CPU and dropped as they come; timed after a warm-up decode of 2 latent
    frames, its peak GPU memory from there (the weights in it)."""
    from sinkscope.wan.vae import iter_decoded_frames, random_vae, tiny_vae_config
    from sinkscope.workflow.resources import vae_decode_bytes

    video, base_dim = scale["video"], scale["vae"]["base_dim"]
    frames, height, width = video["num_frames"], video["latent_height"], video["latent_width"]
    vae = random_vae(tiny_vae_config(base_dim)).to(device=device, dtype=dtype)
    # On the CPU, as the job loads them; the decode moves them to the device.
    latents = torch.randn(16, frames, height, width, generator=torch.Generator().manual_seed(0))
    for _ in iter_decoded_frames(vae, latents[:, :2]):  # warm-up: kernels, allocator
        pass
    synchronize(device)
    reset_peak(device)
    count = 0
    started = time.perf_counter()
    for chunk in iter_decoded_frames(vae, latents):  # uint8 frames on the CPU: synchronised
        count += chunk.shape[0]
    seconds = time.perf_counter() - started
    estimate = vae_decode_bytes(
        height, width, base_dim=base_dim, value_bytes=dtype.itemsize, num_frames=frames
    )
    return Decoded(count, seconds, peak(device), estimate)


def decode_row(scale: dict, device: torch.device, dtype: torch.dtype) -> tuple[str, str, str]:
    """The table's row of `timed_decode`: frames per second against VAE_FPS_TARGET, the peak
    against the plan's estimate."""
    video, name = scale["video"], {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    decoded = timed_decode(scale, device, dtype)
    fps = decoded.frames / decoded.seconds
    ratio = fps / VAE_FPS_TARGET
    estimate = decoded.estimate["total"]
    gb = 1e9
    if decoded.peak:
        memory = (
            f"peak {decoded.peak / gb:.2f} GB, estimate {estimate / gb:.2f} GB "
            f"(vae_decode_bytes), measured / estimate {decoded.peak / estimate:.2f}"
        )
    else:
        memory = f"peak not measured on a CPU; estimate {estimate / gb:.3f} GB (vae_decode_bytes)"
    return (
        f"VAE decode {name}, {decoded.frames} frames at {8 * video['latent_height']} x "
        f"{8 * video['latent_width']} (base_dim {scale['vae']['base_dim']})",
        f"{fps:.1f} frames/s, {ratio:.2f} x {VAE_FPS_TARGET:.0f} fps (target >= 1) "
        f"{'met' if ratio >= 1 else 'MISSED'}",
        memory,
    )


class Table(list):
    """The table's rows, each also printed as it is measured (a killed run keeps what it got)."""

    HEADER = "| what | time / result | memory / detail |\n|---|---|---|"

    @staticmethod
    def line(row: tuple[str, str, str]) -> str:
        return "| " + " | ".join(row) + " |"

    def add(self, row: tuple[str, str, str]) -> None:
        self.append(row)
        print(self.line(row), flush=True)


@contextlib.contextmanager
def stage(name: str):
    """Prints when a stage starts and ends (a first GPU run is watched live), and turns a failure
    into the stage's error (the yielded dict's "error") so the other stages still run and the
    table still prints."""
    started = time.perf_counter()
    print(f"[gpu.py] {name} ...", flush=True)
    result = {"error": None}
    try:
        yield result
    except Exception as error:  # reported in the table; traceback above it
        traceback.print_exc()
        result["error"] = f"FAILED: {type(error).__name__}: {str(error)[:160]}"
    print(f"[gpu.py] {name}: {time.perf_counter() - started:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="toy size on the CPU")
    parser.add_argument("--compare-layers", type=int, default=4)
    parser.add_argument("--no-tests", action="store_true", help="skip the CUDA tests")
    parser.add_argument(
        "--no-torch-survey", action="store_true", help="skip the survey on the torch path"
    )
    parser.add_argument(
        "--profile", action="store_true", help="print torch.profiler's tables of one survey"
    )
    parser.add_argument(
        "--survey-only",
        action="store_true",
        help="skip the token capture, bfloat16 against float32 and the VAE decode (the survey's "
        "rows alone)",
    )
    parser.add_argument(
        "--vae-only", action="store_true", help="the VAE decode rows alone (no tests, no rollout)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(
            f"benchmarks/gpu.py: no CUDA device on this machine (torch {torch.__version__}); "
            "nothing to measure. Run it on a GPU machine (--cpu-smoke checks the script here)."
        )
        return 0
    from sinkscope.workflow.resources import gpu_memory_bytes

    scale = SMOKE if args.cpu_smoke else REAL
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    device_name = "CPU (smoke, toy size)" if args.cpu_smoke else torch.cuda.get_device_name()
    dtype = torch.bfloat16  # what `dtype: auto` runs on CUDA
    rows = Table()
    if args.vae_only:
        failed = decode_rows(rows, scale, device)
        print_table(rows, device_name, scale)
        return 1 if failed else 0
    if not args.no_tests and not args.cpu_smoke:
        with stage("CUDA tests") as tests:
            summary = cuda_tests()
        rows.add(("CUDA tests", tests["error"] or summary, ""))
    config = plan_config(scale, "auto")
    estimate = {
        job: gpu_memory_bytes(config, "demo_a", job)["total"] for job in ("extract", "survey")
    }
    gb = 1e9
    with tempfile.TemporaryDirectory(dir=REPO) as folder:
        folder = Path(folder)
        with stage("rollouts") as rollouts:
            model, text, geometry = build(scale, device, dtype)
            layers = list(range(model.config.num_layers))
            timed_rollout(model, text, geometry, device, dtype)  # warm-up: kernels, allocator
            compile_kernels(model, geometry, device, dtype)
            plain, plain_peak, *_ = timed_rollout(model, text, geometry, device, dtype)
            rows.add(("plain bf16 rollout", f"{plain:.1f} s", f"peak {plain_peak / gb:.2f} GB"))
            survey_dir, token_dir = folder / "survey", folder / "tokens"
            survey_dir.mkdir()
            token_dir.mkdir()
            # As the survey job runs it: the store process's child starts and opens its stores
            # while the weights load (`extraction.job.extract`), before the rollout's timer.
            surveyed = timed_rollout(
                model, text, geometry, device, dtype, stores=survey_dir, layers=layers
            )
            survey, survey_peak = surveyed.seconds, surveyed.peak
            ratio = survey / plain
            rows.add(
                (
                    f"survey, {len(layers)} layers x 5 passes",
                    f"{survey:.1f} s, {ratio:.2f} x plain (target <= {TIME_RATIO_TARGET})"
                    f" {'met' if ratio <= TIME_RATIO_TARGET else 'MISSED'}",
                    f"peak {survey_peak / gb:.2f} GB, plan {estimate['survey'] / gb:.2f} GB "
                    f"{'within' if survey_peak <= estimate['survey'] else 'OVER'}; "
                    f"writers busy {surveyed.write_seconds:.1f} s in all; " + waits(surveyed),
                )
            )
            (survey_dir / "cold").mkdir()
            cold = timed_rollout(
                model,
                text,
                geometry,
                device,
                dtype,
                stores=survey_dir / "cold",
                layers=layers,
                ready_first=False,
            )
            rows.add(
                (
                    "survey, the store process started inside the timer",
                    f"{cold.seconds:.1f} s, {cold.seconds / plain:.2f} x plain",
                    f"what starting it before the weights saves: {cold.seconds - survey:.1f} s; "
                    + waits(cold),
                )
            )
            dropped = timed_rollout(
                model,
                text,
                geometry,
                device,
                dtype,
                stores=folder,
                store="discarded",
                layers=layers,
            )
            discarded = dropped.seconds
            rows.add(
                (
                    "survey, reductions copied to the store process, not stored",
                    f"{discarded:.1f} s, {discarded / plain:.2f} x plain",
                    f"the stores' share of the survey: {survey - discarded:.1f} s; "
                    + waits(dropped),
                )
            )
            on_device = timed_rollout(
                model, text, geometry, device, dtype, stores=folder, store="device", layers=layers
            ).seconds
            rows.add(
                (
                    "survey, reductions computed on the device only (no copy, no store)",
                    f"{on_device:.1f} s, {on_device / plain:.2f} x plain",
                    f"the copies' share (waits included): {discarded - on_device:.1f} s",
                )
            )
            if args.profile:
                profile(model, text, geometry, device, dtype, folder / "profiled", layers)
            if device.type == "cuda" and not args.no_torch_survey:
                # The same survey on the torch path the fused kernels replace on a GPU.
                with mock.patch.dict(os.environ, {"SINKSCOPE_FUSED_SOFTMAX": "0"}):
                    (folder / "survey_torch").mkdir()
                    torch_survey = timed_rollout(
                        model,
                        text,
                        geometry,
                        device,
                        dtype,
                        stores=folder / "survey_torch",
                        layers=layers,
                    ).seconds
                rows.add(
                    (
                        "survey, torch reductions (SINKSCOPE_FUSED_SOFTMAX=0)",
                        f"{torch_survey:.1f} s, {torch_survey / plain:.2f} x plain",
                        "",
                    )
                )
            if not args.survey_only:
                token_layers = [layer for layer in TOKEN_LAYERS if layer < len(layers)]
                tokens, token_peak, _, token_writer, *_ = timed_rollout(
                    model,
                    text,
                    geometry,
                    device,
                    dtype,
                    stores=token_dir,
                    store="tokens",
                    layers=token_layers,
                )
                rows.add(
                    (
                        f"token capture, layers {token_layers}, pass 0",
                        f"{tokens:.1f} s, {tokens / plain:.2f} x plain",
                        f"peak {token_peak / gb:.2f} GB, plan {estimate['extract'] / gb:.2f} GB "
                        f"{'within' if token_peak <= estimate['extract'] else 'OVER'}; "
                        f"writer busy {token_writer:.1f} s",
                    )
                )
        if rollouts["error"]:
            rows.add(("rollouts", rollouts["error"], ""))
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        comparison = {"error": None}
        if not args.survey_only:
            with stage("bfloat16 against float32") as comparison:
                compare_dir = folder / "compare"
                compare_dir.mkdir()
                compared = compare_dtypes(scale, device, args.compare_layers, compare_dir)
                rows.add(
                    (
                        f"bf16 vs fp32, {args.compare_layers} layers",
                        f"latents {compared['latents']:.2e} (rel. L2, worst frame)",
                        f"key_mass {compared['key_mass']:.2e} (abs., worst key)",
                    )
                )
            if comparison["error"]:
                rows.add((f"bf16 vs fp32, {args.compare_layers} layers", comparison["error"], ""))
        failed = bool(rollouts["error"] or comparison["error"])
    if not args.survey_only:
        failed = decode_rows(rows, scale, device) or failed
    print_table(rows, device_name, scale)
    return 1 if failed else 0


def decode_rows(rows: Table, scale: dict, device: torch.device) -> bool:
    """The VAE decode in bfloat16 and float32 (`decode_row`); True if either failed."""
    failed = False
    for dtype in (torch.bfloat16, torch.float32):
        with stage(f"VAE decode {dtype}") as decode:
            rows.add(decode_row(scale, device, dtype))
        if decode["error"]:
            rows.add((f"VAE decode {dtype}", decode["error"], ""))
            failed = True
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return failed


def print_table(rows: Table, device_name: str, scale: dict) -> None:
    print(f"\n### `benchmarks/gpu.py` on {device_name}, torch {torch.__version__}\n")
    print(Table.HEADER)
    for row in rows:
        print(Table.line(row))
    print(f"\n(one run each after a warm-up; geometry {scale['video']}; u = 2^-8 = {2**-8:.2e})")


if __name__ == "__main__":
    sys.exit(main())
