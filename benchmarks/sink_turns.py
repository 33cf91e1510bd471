"""Two ways of turning sink keys in time, measured (Deep Forcing's tracker issue #8).

Deep Forcing turns the temporal RoPE channels of its cached post-RoPE sink keys by each step,
in place (`delta`); Rolling Forcing keeps its anchor's keys before RoPE and applies RoPE afresh at
the new position (`rerope`). In exact arithmetic both give RoPE at the target position (Wan's 3D
RoPE is a product of per-axis rotations); they differ in where they round. This script measures:

1. Keys: sink keys of the real head geometry (head_dim 128: 44 temporal channels, RoPE base
   10000), turned by 3 frames per block as Deep Sink turns them, stored in float32 and in
   bfloat16; the relative error of each way against RoPE at the target position in float64,
   after 1 .. 300 turns, over all channels and over the temporal channels of the lowest
   frequencies (the ones a bfloat16 rounding can swallow: a turn of w x 3 radians below half a
   bfloat16 step is lost).
2. Latents: a closed loop under `deep_sink` of a narrow random-init Wan model with the real head
   geometry (2 heads of 128), once per way of turning, in float32 and in bfloat16 (the model,
   its caches and its keys), on the CPU; the relative L2 per latent frame between the two ways.

Run from the repository root: `python benchmarks/sink_turns.py` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from sinkscope.cache_choices import deep_sink_shifts
from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.sampling import Geometry, rollout
from sinkscope.wan.config import WanConfig
from sinkscope.wan.model import WanModel
from sinkscope.wan.rope import apply_rope, axis_dims, rope_angles, rotate_frames

HEAD_DIM = 128
TURN_FRAMES = 3  # Deep Sink turns by one block of 3 frames per evicting block
CHECKPOINTS = (1, 10, 30, 100, 300)
LOW_PAIRS = 8  # the lowest temporal frequencies reported apart: pairs 14..21 of 22


def key_errors(dtype: torch.dtype, turns: int, seed: int = 0) -> dict[str, dict[int, float]]:
    """Relative error against float64 RoPE at the target position, after each checkpoint, of
    `delta` (cumulative turns of the stored post-RoPE keys) and `rerope` (RoPE on the stored
    pre-RoPE keys), all channels and the lowest temporal pairs."""
    generator = torch.Generator().manual_seed(seed)
    sinks, height, width, heads = 3, 6, 8, 4  # 3 sink frames of 48 tokens
    shape = (1, sinks * height * width, heads, HEAD_DIM)
    raw = torch.randn(shape, generator=generator, dtype=torch.float64)  # qk-normed: unit RMS
    grid = (sinks, height, width)
    temporal = axis_dims(HEAD_DIM)[0]
    low = slice(temporal - 2 * LOW_PAIRS, temporal)
    delta = apply_rope(raw, rope_angles(HEAD_DIM, grid, 0, "cpu")).to(dtype)
    stored_raw = raw.to(dtype)
    out = {"delta": {}, "rerope": {}, "delta low": {}, "rerope low": {}}
    for turn in range(1, turns + 1):
        delta = rotate_frames(delta, TURN_FRAMES)
        if turn not in CHECKPOINTS:
            continue
        shift = turn * TURN_FRAMES
        exact = apply_rope(raw, rope_angles(HEAD_DIM, grid, shift, "cpu"))
        rerope = apply_rope(stored_raw, rope_angles(HEAD_DIM, grid, shift, "cpu"))
        for name, keys in (("delta", delta), ("rerope", rerope)):
            error = keys.double() - exact
            out[name][turn] = float(error.norm() / exact.norm())
            out[f"{name} low"][turn] = float(error[..., low].norm() / exact[..., low].norm())
    return out


def narrow_model(seed: int = 0) -> WanModel:
    cfg = WanConfig(
        dim=2 * HEAD_DIM,
        ffn_dim=256,
        num_heads=2,
        num_layers=2,
        freq_dim=64,
        text_dim=32,
        text_len=16,
    )
    model = WanModel(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval().requires_grad_(False)


def closed_loops(dtype: torch.dtype, frames: int, window: int, sinks: int) -> dict:
    """The clean latents [C, F, H, W] (float64) of two closed loops under deep_sink that differ
    only in the way of turning, the model run in `dtype`."""
    model = narrow_model().to(dtype)
    text = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    geometry = Geometry(num_frames=frames, frames_per_block=3, latent_height=8, latent_width=12)
    token_grid = model.config.token_grid(8, 12)
    latents = {}
    for turn in ("delta", "rerope"):
        policy = CachePolicy("deep_sink", window, sinks, turn=turn)
        caches = policy.new_caches(
            model,
            num_frames=frames,
            frame_seq_length=token_grid[0] * token_grid[1],
            frames_per_block=3,
            device="cpu",
            dtype=dtype,
            token_grid=token_grid,
        )
        latents[turn] = rollout(
            model, text, geometry=geometry, seed=2, dtype=dtype, caches=caches, progress=False
        )[0].double()
    return latents


def per_frame(x: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    """||x - ref|| / ||ref|| per latent frame of [C, F, H, W]."""
    x, ref = x.transpose(0, 1).flatten(1), ref.transpose(0, 1).flatten(1)
    return ((x - ref).norm(dim=1) / ref.norm(dim=1)).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=900, help="latent frames of the closed loop")
    parser.add_argument("--window", type=int, default=21, help="deep_sink budget (frames)")
    parser.add_argument("--sinks", type=int, default=14, help="sink frames")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    print("1. keys: relative error against RoPE at the target position (float64)")
    print(f"   head_dim {HEAD_DIM}, turns of {TURN_FRAMES} frames; 'low': the {LOW_PAIRS} lowest")
    print("   temporal frequency pairs alone")
    header = (
        "   "
        + f"{'storage':9} {'way':7} {'channels':9}"
        + "".join(f"{f'{t} turns':>11}" for t in CHECKPOINTS)
    )
    print(header)
    for dtype, label in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        errors = key_errors(dtype, max(CHECKPOINTS))
        for way in ("delta", "rerope"):
            for suffix, channels in (("", "all"), (" low", "low")):
                row = errors[way + suffix]
                values = "".join(f"{row[t]:11.2e}" for t in CHECKPOINTS)
                print(f"   {label:9} {way:7} {channels:9}{values}")
    shifts = deep_sink_shifts([3] * (args.frames // 3), args.window, args.sinks)
    first = 3 * next(block for block, shift in enumerate(shifts) if shift)
    print(
        f"\n2. latents: deep_sink B={args.window} S={args.sinks}, {args.frames} frames in blocks of"
        f" 3 (the sinks first turn at frame {first}), relative L2 of delta against rerope"
    )
    runs = {
        label: closed_loops(dtype, args.frames, args.window, args.sinks)
        for dtype, label in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"))
    }
    marks = [f for f in (first, 100, 300, 600, args.frames - 1) if first <= f < args.frames]
    print("   " + f"{'':34}" + "".join(f"{f'frame {f}':>12}" for f in marks))
    rows = [
        ("float32: delta vs rerope", per_frame(*(runs["float32"][t] for t in ("delta", "rerope")))),
        (
            "bfloat16: delta vs rerope",
            per_frame(*(runs["bfloat16"][t] for t in ("delta", "rerope"))),
        ),
        (
            "bfloat16 vs float32, delta",
            per_frame(runs["bfloat16"]["delta"], runs["float32"]["delta"]),
        ),
        (
            "bfloat16 vs float32, rerope",
            per_frame(runs["bfloat16"]["rerope"], runs["float32"]["rerope"]),
        ),
    ]
    for label, diff in rows:
        print(f"   {label:34}" + "".join(f"{diff[f]:12.2e}" for f in marks))
    before = max(rows[0][1][:first].max(), rows[1][1][:first].max())
    print(f"   (delta and rerope agree exactly before the first turn: largest difference {before})")
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
