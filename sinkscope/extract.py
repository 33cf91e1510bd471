"""One extraction job: load a checkpoint, roll out a prompt, capture the logits of some layers."""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch

from . import __version__
from .capture import LogitCapture
from .config import resolve_passes
from .digest import combine, sha256_file
from .frames import block_sizes, token_store_bytes
from .gpus import job_device
from .sampling import Geometry, Schedule, rollout
from .store import TokenStoreWriter
from .wan.checkpoint import checkpoint_files, load_wan_model
from .wan.text import load_prompt_embedding

log = logging.getLogger(__name__)


def model_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU as Self-Forcing runs; fp32 on CPU, where bf16 matmuls are slow and lossy."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_free_space(paths: Sequence[Path], needed: int) -> None:
    """Fail before any compute when the filesystem of `paths` cannot hold `needed` bytes."""
    folder = Path(paths[0]).parent
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    log.info(
        "will write up to %.2f GB (uncompressed) to %s; %.2f GB free",
        needed / 1e9,
        folder,
        free / 1e9,
    )
    if free < needed:
        raise OSError(
            f"{folder}: {free / 1e9:.2f} GB free, but the token stores need up to "
            f"{needed / 1e9:.2f} GB (uncompressed float16 logits of the visible tiles); free space "
            "or capture fewer passes (capture.passes)"
        )


def extract(
    *,
    checkpoint_name: str,
    prompt_name: str,
    prompt_embeddings: str | Path,
    layers: Sequence[int],
    outputs: Sequence[str | Path],
    settings: dict,
    progress: bool = True,
) -> None:
    """Write one token store (Contract 1) per layer in `layers` to the matching `outputs` path.

    settings: `sinkscope.config.extraction_settings` (checkpoint, sampler, video, capture, seed,
    device). The rollout is the same whichever layers are captured. The job runs on the device
    `sinkscope.gpus.job_device` gives it.
    """
    if len(layers) != len(outputs):
        raise ValueError(f"{len(layers)} layers but {len(outputs)} outputs")
    # The GPU is held from before the model loads until the stores are complete.
    with job_device(settings["device"]) as claim:
        started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        device = torch.device(claim.device)
        dtype = model_dtype(device)
        entry = settings["checkpoint"]
        sampler = settings["sampler"]
        video = settings["video"]
        schedule = Schedule(
            steps=tuple(sampler["steps"]), shift=float(sampler["shift"]), warp=bool(sampler["warp"])
        )
        geometry = Geometry(
            num_frames=video["num_frames"],
            frames_per_block=video["frames_per_block"],
            latent_height=video["latent_height"],
            latent_width=video["latent_width"],
        )
        generator = entry.get("generator")
        # The workflow hashed real checkpoints when it was parsed (cached); demo ones are tiny.
        checkpoint_sha256 = entry.get("sha256") or combine(
            sha256_file(path) for path in checkpoint_files(entry["base"], generator)
        )
        log.info("loading %s onto %s (%s)", checkpoint_name, device, dtype)
        model = load_wan_model(
            entry["base"],
            generator=generator,
            ema=entry.get("ema", True),
            device=device,
            dtype=dtype,
        )
        cfg = model.config
        bad = [layer for layer in layers if not 0 <= layer < cfg.num_layers]
        if bad:
            raise ValueError(
                f"layers {bad} out of range: {checkpoint_name} has {cfg.num_layers} layers"
            )
        text, text_meta = load_prompt_embedding(prompt_embeddings)
        if text.shape[1] != cfg.text_dim:
            raise ValueError(
                f"{prompt_embeddings}: embeddings have width {text.shape[1]}, "
                f"but {checkpoint_name} expects text_dim={cfg.text_dim}"
            )
        frame_seq_length = cfg.tokens_per_frame(geometry.latent_height, geometry.latent_width)
        passes = resolve_passes(settings["capture"]["passes"], len(schedule.steps))
        all_timesteps = schedule.pass_timesteps()
        all_kinds = schedule.pass_kinds()
        grid = [
            geometry.num_frames,
            *(
                d // p
                for d, p in zip(
                    (geometry.latent_height, geometry.latent_width), cfg.patch_size[1:], strict=True
                )
            ),
        ]
        attrs = {
            "checkpoint": checkpoint_name,
            "checkpoint_sha256": checkpoint_sha256,
            "prompt": prompt_name,
            "prompt_text": text_meta.get("prompt", ""),
            "seed": settings["seed"],
            "num_heads": cfg.num_heads,
            "head_dim": cfg.head_dim,
            "frame_seq_length": frame_seq_length,
            "latent_grid": grid,
            "num_frames": geometry.num_frames,
            "block_sizes": block_sizes(geometry.num_frames, geometry.frames_per_block),
            "timesteps": [all_timesteps[p] for p in passes],
            "local_attn_size": sampler["local_attn_size"],
            "sink_size": sampler["sink_size"],
            "logit_scale": 1.0 / math.sqrt(cfg.head_dim),
            "sinkscope_version": __version__,
            "device": str(device),
            "gpu": claim.record(),
            "started_at": started_at,
            "dtype": str(dtype).removeprefix("torch."),
            "config": settings,
        }
        tokens = settings["capture"].get("tokens", True)
        store_bytes = tokens * token_store_bytes(
            num_passes=len(passes),
            num_heads=cfg.num_heads,
            frame_seq_length=frame_seq_length,
            sizes=geometry.block_sizes,
            local_attn_size=sampler["local_attn_size"],
            sink_size=sampler["sink_size"],
        )
        check_free_space([Path(out) for out in outputs], store_bytes * len(outputs))
        with contextlib.ExitStack() as stores:
            writers = {}
            for layer, out in zip(layers, outputs, strict=True):
                writer = TokenStoreWriter(
                    out,
                    num_heads=cfg.num_heads,
                    num_frames=geometry.num_frames,
                    frame_seq_length=frame_seq_length,
                    timesteps=[all_timesteps[p] for p in passes],
                    pass_kinds=[all_kinds[p] for p in passes],
                    attrs={**attrs, "layer": layer, "tokens": tokens},
                    tokens=tokens,
                )
                writers[layer] = stores.enter_context(writer)
            capture = LogitCapture(writers, passes, frame_seq_length, cfg.head_dim)
            model.set_capture(capture, set(layers))
            log.info(
                "rollout: %d blocks x %d passes, capturing layers %s passes %s",
                len(geometry.block_sizes),
                len(all_timesteps),
                list(layers),
                passes,
            )
            rollout(
                model,
                text[None],
                geometry=geometry,
                schedule=schedule,
                local_attn_size=sampler["local_attn_size"],
                sink_size=sampler["sink_size"],
                seed=settings["seed"],
                device=device,
                dtype=dtype,
                on_pass=capture.begin_pass,
                progress=progress,
            )
            model.set_capture(None)
            log.info("rollout done; finishing the stores")
