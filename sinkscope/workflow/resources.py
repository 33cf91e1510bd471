"""Memory and runtime a job asks a cluster for, from the sizes it will handle.

A SLURM job that asks too little is killed; one that asks too much waits longer in the queue. The
figures below come from what a job holds: the checkpoint's weights (host memory while loading
pickles), the bounded writer queue, and bytes written or read at a rate well under what the
benchmarks measured (`benchmarks/README.md`), so that a slow shared filesystem still fits.
No torch here: this runs when the workflow is parsed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from sinkscope.frames import (
    attention_store_bytes,
    block_sizes,
    closed_loop_key_frames,
    export_bytes,
    token_store_bytes,
)
from sinkscope.passes import resolve_passes
from sinkscope.schedules import ROLLING_CACHE_FRAMES, denoising_steps

from .entries import (
    closed_loop_policy,
    closed_loop_rollouts,
    model_config,
    sampler_settings,
    survey_layers,
    token_passes,
)
from .params import extraction_gpus, prompt_encoder

# Floors: interpreter, torch, CUDA context, zarr buffers and the writer queue (capture peaked at
# 1.5 GB, reduce at 0.5 GB in the benchmarks).
EXTRACT_BASE_MB = 6000
REDUCE_MB = 3000
ENCODE_BASE_MB = 4000
# Rates for the runtime limit: a quarter to a third of what the benchmarks measured.
WRITE_MB_PER_S = 50.0
READ_MB_PER_S = 50.0
EXTRACT_SETUP_MINUTES = 15
# The recall table of a run reads its frame datasets and attention stores (5 GB for 30 layers at
# 480x832) once.
POLICIES_MINUTES = 30
REDUCE_SETUP_MINUTES = 5


def files_mb(paths: Sequence[str]) -> float:
    """Size of the files that exist (the demo text encoder does not until its rule runs)."""
    return sum(os.path.getsize(path) for path in paths if os.path.isfile(path)) / 1e6


@dataclass(frozen=True)
class StoreGeometry:
    """What the size of a store of checkpoint `name` depends on, read from the config once."""

    num_passes: int  # captured passes per block
    num_heads: int
    frame_seq_length: int
    sizes: list[int]  # block sizes
    local_attn_size: int
    sink_size: int
    rolling_steps: int | None = None  # Rolling Forcing's sampler, of that many steps

    @property
    def num_frames(self) -> int:
        return sum(self.sizes)

    @property
    def token_layout(self) -> dict:
        """The arguments of `frames.token_store_bytes` and `token_store_disk_bytes`."""
        return {
            "num_passes": self.num_passes,
            "num_heads": self.num_heads,
            "frame_seq_length": self.frame_seq_length,
            "sizes": self.sizes,
            "local_attn_size": self.local_attn_size,
            "sink_size": self.sink_size,
            "rolling_steps": self.rolling_steps,
        }


def store_geometry(
    config: dict, name: str, num_frames: int | None = None, store: str = "attention"
) -> StoreGeometry:
    """The geometry of checkpoint `name`'s stores of kind `store` (`attention` or `tokens`,
    which capture `capture.token_passes`), of `num_frames` latent frames if given (the closed
    loop's), else video.num_frames."""
    model = model_config(config, name)
    sampler = sampler_settings(config, name)
    video = config["video"]
    passes = token_passes(config) if store == "tokens" else config["capture"]["passes"]
    return StoreGeometry(
        # A recaching sampler may add the recache slot (an upper bound: a prompt that
        # switches inside this rollout).
        num_passes=len(
            resolve_passes(passes, denoising_steps(sampler), recache=sampler.get("recache", False))
        ),
        num_heads=model.num_heads,
        frame_seq_length=model.tokens_per_frame(video["latent_height"], video["latent_width"]),
        sizes=block_sizes(
            num_frames or video["num_frames"],
            video["frames_per_block"],
            video["independent_first_frame"],
        ),
        local_attn_size=sampler["local_attn_size"],
        sink_size=sampler["sink_size"],
        rolling_steps=len(sampler["steps"]) if sampler["kind"] == "rolling" else None,
    )


def layer_store_bytes(config: dict, name: str) -> int:
    """Uncompressed bytes of one token store (one layer, one prompt) of checkpoint `name`."""
    if not config["capture"]["tokens"]:
        return 0
    return token_store_bytes(**store_geometry(config, name, store="tokens").token_layout)


def survey_store_bytes(config: dict, name: str) -> int:
    """Uncompressed bytes of the attention stores of one survey job (every surveyed layer)."""
    g = store_geometry(config, name)
    one = attention_store_bytes(
        num_passes=g.num_passes,
        num_heads=g.num_heads,
        num_frames=g.num_frames,
        frame_seq_length=g.frame_seq_length,
    )
    return one * len(survey_layers(config))


def survey_runtime(config: dict, name: str) -> int:
    """Minutes: setup and one rollout with every surveyed layer captured (on a GPU, about
    twice the plain rollout: minutes), plus the attention stores written at WRITE_MB_PER_S."""
    store_mb = survey_store_bytes(config, name) / 1e6
    return 2 * EXTRACT_SETUP_MINUTES + math.ceil(store_mb / WRITE_MB_PER_S / 60)


def extract_mem_mb(input_mb: float) -> int:
    """input_mb: the job's input files (the checkpoint, and prompt embeddings of kilobytes)."""
    # Pickled .pt checkpoints are memory-mapped on the host before they move to the GPU; their
    # pages count against the job's memory limit (cgroup) while they load.
    return int(EXTRACT_BASE_MB + 1.25 * input_mb)


def extract_runtime(config: dict, name: str) -> int:
    """Minutes: setup and rollout, plus the token store written at WRITE_MB_PER_S."""
    store_mb = layer_store_bytes(config, name) / 1e6
    return EXTRACT_SETUP_MINUTES + math.ceil(store_mb / WRITE_MB_PER_S / 60)


# Seconds per latent frame of a closed-loop rollout on one GPU, capture and writes included: about
# four times Self-Forcing's 15.8 FPS (0.25 s per latent frame); the full cache's twice that, as its
# attention grows with the video (not measured: no GPU has run the 1.3B model here).
CLOSED_LOOP_SECONDS_PER_FRAME = 1.0


def closed_loop_runtime(config: dict, name: str) -> int:
    """Minutes: setup and the closed loop of one run: a rollout of closed_loop.num_frames per
    policy and, with reference full, one of the full cache (twice as long)."""
    frames = config["closed_loop"]["num_frames"]
    weight = sum(2 if policy == "full" else 1 for policy in closed_loop_rollouts(config))
    seconds = weight * frames * CLOSED_LOOP_SECONDS_PER_FRAME
    return 2 * EXTRACT_SETUP_MINUTES + math.ceil(seconds / 60)


def export_runtime(config: dict, name: str, layers: Sequence[int]) -> int:
    """Minutes: the token-sized exports of `layers` (scratch, then the file) at WRITE_MB_PER_S;
    one head's softmax over the last block takes about a second."""
    g = store_geometry(config, name)
    per_layer = export_bytes(
        num_heads=g.num_heads,
        frame_seq_length=g.frame_seq_length,
        num_frames=g.num_frames,
        last_block_frames=g.sizes[-1],
        measure=config["export"]["measure"],
    )
    token_mb = sum(v for k, v in per_layer.items() if k != "frames") * len(layers) / 1e6
    return REDUCE_SETUP_MINUTES + math.ceil(2 * token_mb / WRITE_MB_PER_S / 60)


def reduce_runtime(config: dict, name: str) -> int:
    """Minutes: the token store read once at READ_MB_PER_S."""
    store_mb = layer_store_bytes(config, name) / 1e6
    return REDUCE_SETUP_MINUTES + math.ceil(store_mb / READ_MB_PER_S / 60)


def encode_gpus(config: dict, prompt: str, local: bool = False) -> int:
    """A prompt that brings its embeddings needs no GPU to be copied (`local`: extraction_gpus)."""
    return extraction_gpus(config, local) if prompt_encoder(config, prompt) else 0


def encode_mem_mb(config: dict, prompt: str) -> int:
    encoder = prompt_encoder(config, prompt)
    if encoder is None:
        return 1000
    path = encoder["path"]
    if os.path.isdir(path):
        size = files_mb([os.path.join(path, f) for f in os.listdir(path)])
    else:
        size = files_mb([path])
    return int(ENCODE_BASE_MB + 1.25 * size)


# CUDA context, cuBLAS workspaces and the caching allocator's slack: not from the sizes below.
GPU_OVERHEAD_BYTES = 1_500_000_000
# What a CUDA job runs under each `dtype` setting (wan.precision), and its bytes per value.
GPU_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "float32": "fp32"}
GPU_DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def gpu_dtype(config: dict) -> str:
    """The dtype a CUDA job of `config` runs in: `bf16` or `fp32`."""
    return GPU_DTYPES[config.get("dtype", "auto")]


def gpu_memory_bytes(config: dict, name: str, job: str, num_frames: int | None = None) -> dict:
    """An estimate of what one job of checkpoint `name` holds on its GPU, by part (bytes):
    `weights` (the DiT in bf16, float32 with `dtype: float32`), `kv_cache` (every layer's
    self-attention keys and values, as `WanModel.new_kv_caches` allocates them: all frames, or
    the sampler's local window; all frames for the closed loop's full-cache reference, the
    largest policy cache without one),
    `text_cache` (cross-attention keys and values of the prompt), `capture` (the largest
    transient of the capture: a query frame x visible keys tile in fp32 with its fp16 copy for a
    token store (`extract`), or the two fp32 buffers of the exact softmax for an attention store
    (`survey`, `closed_loop`)), `activations` (one block's FFN hidden states) and `overhead`
    (GPU_OVERHEAD_BYTES); `total` sums them. Not measured: no GPU has run the 1.3B model here.
    `num_frames`: the rollout's latent frames (the closed loop's), else video.num_frames."""
    if job not in ("extract", "survey", "closed_loop"):
        raise ValueError(f"unknown job kind {job!r}")
    model = model_config(config, name)
    g = store_geometry(config, name, num_frames)
    sampler = sampler_settings(config, name)
    window = sampler["local_attn_size"]
    if job == "closed_loop":
        # The reference keeps every frame, whatever the sampler's window; without it the
        # largest of the policies' caches.
        cached_frames = max(
            closed_loop_key_frames(
                closed_loop_policy(config, policy),
                g.num_frames,
                max(g.sizes),
                g.rolling_steps is not None,
            )
            for policy in closed_loop_rollouts(config) or ["full"]
        )
        if g.rolling_steps is not None:  # block 0 stays besides what the calls read
            cached_frames = min(cached_frames + ROLLING_CACHE_FRAMES, g.num_frames)
    elif g.rolling_steps is not None:
        # Rolling Forcing's cache: the anchor and the newest clean frames (24 frames in all).
        cached_frames = min(ROLLING_CACHE_FRAMES, g.num_frames)
    else:
        cached_frames = g.num_frames if window == -1 else min(window, g.num_frames)
    tokens = cached_frames * g.frame_seq_length
    visible_keys = tokens  # a query frame sees at most the cache
    value_bytes = GPU_DTYPE_BYTES[gpu_dtype(config)]
    parts = {
        "weights": model.num_parameters * value_bytes,
        "kv_cache": model.num_layers * 2 * tokens * model.dim * value_bytes,
        "text_cache": model.num_layers * 2 * model.text_len * model.dim * value_bytes,
        "capture": g.frame_seq_length * visible_keys * (4 + 2 if job == "extract" else 2 * 4),
        # One call's FFN hidden states: a block, or Rolling Forcing's window of blocks.
        "activations": 2
        * max(g.sizes)
        * (g.rolling_steps or 1)
        * g.frame_seq_length
        * model.ffn_dim
        * value_bytes,
        "overhead": GPU_OVERHEAD_BYTES,
    }
    parts["total"] = sum(parts.values())
    return parts
