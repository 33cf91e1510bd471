"""The decode job (rule `videos`): the rollouts of one run, latents -> what a person watches.

For one (checkpoint, prompt), every rollout's x0 latents (the closed loop's `{policy}.safetensors`,
the full cache's among them, and with `videos: all` the survey's) are decoded with Wan2.1's VAE
(`sinkscope.wan.vae`), as one batch one latent frame at a time, so that memory stays bounded
whatever the length and each pixel frame meets the full-cache reference's frame of the same
index. As the frames come they go to:

- one H.264 video per rollout (`sinkscope.videos.VideoWriter`: `{rollout}.mp4`),
- the side-by-side grid of every rollout (`sinkscope.video_grid`: `grid.mp4`), each tile
  labelled with its policy and budget, its band red from its first eviction on, a frame counter,
- the pixel-space diagnostics (`sinkscope.video_metrics.VideoMetricAccumulator`), against the
  full cache's frames where that rollout is there: `metrics.csv`, `VIDEO_TABLE_COLUMNS`.

Each rollout's label, block layout and first eviction come from its closed-loop frame table
(Contract 6); a survey rollout (no table) is the full cache, its blocks from its latents'
provenance. Every output appears complete or not at all: the videos through a partial file
renamed when its last frame is in, the table atomically; a failure or a kill leaves no mp4
that looks complete.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from sinkscope.cache_choices import policy_label
from sinkscope.frames import evicting_frame
from sinkscope.storage import write_csv
from sinkscope.video_grid import GridComposer, GridTile, frame_counter
from sinkscope.video_metrics import FPS, VIDEO_TABLE_COLUMNS, VideoMetricAccumulator
from sinkscope.videos import VideoWriter
from sinkscope.wan.precision import model_dtype
from sinkscope.wan.vae import iter_decoded_batch, load_wan_vae
from sinkscope.workflow.gpus import job_device

from .latents import load_latents, read_latents_metadata

log = logging.getLogger(__name__)

FULL = "full"  # the full-cache rollout: the reference of PSNR and SSIM
SURVEY = "survey"  # the survey's rollout (`videos: all`)
# Frames under this many pixels a side (the demo's 64 x 96) are encoded with libx264's ultrafast
# preset: 2.3 times veryfast's speed there, where the bytes are few anyway.
SMALL_FRAME_SIDE = 256
# The frame table's columns this job reads (Contract 6).
_TABLE_COLUMNS = ["policy", "budget", "sink_frames", "recent_frames", "capacity", "frame", "block"]


@dataclass(frozen=True)
class Rollout:
    """One rollout to decode: its name (the video's file stem), latents, label, block sizes
    (latent frames per block) and the latent frame from which its cache has dropped keys."""

    name: str
    latents: Path
    label: str
    block_sizes: tuple[int, ...]
    evicting_from: int | None = None


def closed_loop_rollout(name: str, latents: str | Path, table: str | Path) -> Rollout:
    """A closed-loop rollout, described by its frame table `table`."""
    try:
        frames = pd.read_csv(table)
    except FileNotFoundError:
        raise FileNotFoundError(f"closed-loop frame table not found: {table}") from None
    missing = [column for column in _TABLE_COLUMNS if column not in frames.columns]
    if missing or frames.empty:
        raise ValueError(f"{table}: not a closed-loop frame table (no rows, or no {missing})")
    frames = frames.sort_values("frame")
    first = frames.iloc[0]
    if str(first["policy"]) != name:
        raise ValueError(f"{table}: the frame table of {first['policy']!r}, not of {name!r}")
    sizes = tuple(int(size) for size in frames.groupby("block", sort=True).size())
    if name == FULL:
        return Rollout(name, Path(latents), FULL, sizes)
    jitter = float(first["jitter"]) if "jitter" in frames.columns else 0.0
    bias = float(first["bias"]) if "bias" in frames.columns else 1.0
    label = policy_label(
        name,
        int(first["budget"]),
        int(first["sink_frames"]),
        int(first["recent_frames"]),
        int(first["capacity"]),
        jitter=jitter,
        bias=bias,
    )
    start = evicting_frame(frames["frame"], frames["block"], int(first["capacity"]))
    return Rollout(name, Path(latents), label, sizes, start)


def survey_rollout(latents: str | Path) -> Rollout:
    """The survey's rollout (the full cache), its blocks from the latents' provenance."""
    provenance = read_latents_metadata(latents)
    if "block_sizes" not in provenance:
        raise ValueError(f"{latents}: no block_sizes in its metadata (not a survey's latents)")
    sizes = tuple(int(size) for size in provenance["block_sizes"])
    return Rollout(SURVEY, Path(latents), SURVEY, sizes)


def _load(rollouts: Sequence[Rollout], z_dim: int, vae_path: str) -> list[torch.Tensor]:
    latents = []
    for rollout in rollouts:
        tensor, _ = load_latents(rollout.latents)
        if tensor.ndim != 4 or tensor.shape[0] != z_dim:
            raise ValueError(
                f"{rollout.latents}: latents {list(tensor.shape)} have {tensor.shape[0]} "
                f"channels; the VAE {vae_path} decodes {z_dim} (z_dim)"
            )
        if tensor.shape[1] != sum(rollout.block_sizes):
            raise ValueError(
                f"{rollout.latents}: {tensor.shape[1]} latent frames, its frame table "
                f"{sum(rollout.block_sizes)}"
            )
        latents.append(tensor)
    shapes = {tuple(t.shape) for t in latents}
    if len(shapes) > 1:
        named = {r.name: list(t.shape) for r, t in zip(rollouts, latents, strict=True)}
        raise ValueError(f"the rollouts of one grid must have one shape, got {named}")
    return latents


def decode_videos(
    *,
    checkpoint_name: str,
    prompt_name: str,
    rollouts: Sequence[Rollout],
    videos: Sequence[str | Path],
    grid: str | Path | None,
    metrics: str | Path,
    vae: str | Path,
    settings: dict,
    sink_frames: int = 0,
    progress: bool = True,
) -> None:
    """Decode `rollouts` (the grid's order) to `videos` (one each), `grid` (None: no grid) and
    `metrics`.
    `settings`: `device` and `dtype` as the other GPU jobs take them; `sink_frames`: the latent
    frames the pixel sink distance compares to (0: the first block's)."""
    if len(videos) != len(rollouts):
        raise ValueError(f"{len(rollouts)} rollouts but {len(videos)} videos")
    names = [rollout.name for rollout in rollouts]
    if len(set(names)) != len(names):
        raise ValueError(f"rollouts named twice: {names}")
    with job_device(settings.get("device", "auto")) as claim:
        device = torch.device(claim.device)
        dtype = model_dtype(device, settings.get("dtype", "auto"))
        log.info("loading the VAE %s onto %s (%s)", vae, device, dtype)
        model = load_wan_vae(vae, device=device, dtype=dtype)
        latents = _load(rollouts, model.config.z_dim, str(vae))
        reference = names.index(FULL) if FULL in names else None
        num_frames = latents[0].shape[1]
        height, width = 8 * latents[0].shape[2], 8 * latents[0].shape[3]
        accumulators = [
            VideoMetricAccumulator(
                rollout.block_sizes, sink_frames=sink_frames or None, rollout=rollout.name
            )
            for rollout in rollouts
        ]
        composer = GridComposer(
            [GridTile(rollout.label, rollout.evicting_from) for rollout in rollouts],
            (height, width),
            title=f"{checkpoint_name} · {prompt_name}",
        )
        log.info(
            "decoding %d rollouts of %d latent frames (%d x %d px) of %s/%s",
            len(rollouts),
            num_frames,
            height,
            width,
            checkpoint_name,
            prompt_name,
        )
        started = time.perf_counter()
        # All rollouts as one batch: one decoder call a latent frame for all of them.
        stream = iter_decoded_batch(model, torch.stack(latents))
        with contextlib.ExitStack() as stack:
            options = {"preset": "ultrafast"} if min(height, width) < SMALL_FRAME_SIDE else {}
            writers = [stack.enter_context(VideoWriter(path, **options)) for path in videos]
            grid_writer = (
                None if grid is None else stack.enter_context(VideoWriter(grid, **options))
            )
            pixel_frame = 0
            for latent_frame in tqdm(
                range(num_frames), desc="decode", unit="latent frame", disable=not progress
            ):
                chunks = [chunk.numpy() for chunk in next(stream)]
                for t in range(len(chunks[0])):
                    frames = [chunk[t] for chunk in chunks]
                    target = None if reference is None else frames[reference]
                    for writer, accumulator, frame in zip(
                        writers, accumulators, frames, strict=True
                    ):
                        writer.write(frame)
                        accumulator.add(frame, target)
                    if grid_writer is not None:
                        counter = frame_counter(latent_frame, num_frames, pixel_frame, FPS)
                        grid_writer.write(
                            composer.compose(
                                frames,
                                latent_frame=latent_frame,
                                pixel_frame=pixel_frame,
                                counter=counter,
                            )
                        )
                    pixel_frame += 1
            if next(stream, None) is not None:  # spent: one more chunk would be a bug
                raise RuntimeError("the decoder gave more frames than the latents hold")
        seconds = time.perf_counter() - started
        log.info(
            "decoded %d pixel frames x %d rollouts in %.1f s (%.1f frames/s)",
            pixel_frame,
            len(rollouts),
            seconds,
            pixel_frame * len(rollouts) / max(seconds, 1e-9),
        )
    labels = {rollout.name: rollout.label for rollout in rollouts}
    table = pd.concat([accumulator.table() for accumulator in accumulators], ignore_index=True)
    table.insert(0, "checkpoint", checkpoint_name)
    table.insert(1, "prompt", prompt_name)
    table.insert(3, "label", table["rollout"].map(labels))
    write_csv(metrics, table[VIDEO_TABLE_COLUMNS])
