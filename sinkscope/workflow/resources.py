"""Memory and runtime a job asks a cluster for, from the sizes it will handle.

A SLURM job that asks too little is killed; one that asks too much waits longer in the queue. The
figures below come from what a job holds: the checkpoint's weights (host memory while loading
pickles), the bounded writer queue, and bytes written or read at a rate well under what the
benchmarks measured (`benchmarks/README.md`), so that a slow shared filesystem still fits.
No torch here: this runs when the workflow is parsed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from sinkscope.frames import (
    attention_store_bytes,
    block_sizes,
    closed_loop_key_frames,
    export_bytes,
    pixel_frame_count,
    token_store_bytes,
    visible_frames,
)
from sinkscope.passes import resolve_passes
from sinkscope.schedules import ROLLING_CACHE_FRAMES, denoising_steps
from sinkscope.wan.layout import CONFIG_NAME, vae_dir

from .entries import (
    closed_loop_policy,
    closed_loop_rollouts,
    is_demo_vae,
    model_config,
    sampler_settings,
    survey_layers,
    token_passes,
    vae_path,
)
from .params import extraction_gpus
from .prompt_cache import loads_encoder

# Floors: interpreter, torch, CUDA context, zarr buffers and the writer queue (capture peaked at
# 1.5 GB, reduce at 0.5 GB in the benchmarks).
EXTRACT_BASE_MB = 6000
REDUCE_MB = 3000
ENCODE_BASE_MB = 4000
# An encode job that copies embeddings (its prompt's own, or the prompt cache's entry).
COPY_MEM_MB = 1000
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
    def visible_tiles(self) -> int:
        """The (query frame, key frame) pairs the queries see (`frames.visible_frames`)."""
        return int(
            visible_frames(
                self.sizes, self.local_attn_size, self.sink_size, self.rolling_steps
            ).sum()
        )

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
        visible_tiles=g.visible_tiles,
        precision=config["capture"].get("survey_precision", "float16"),
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


# A decoded, scored and encoded pixel frame of one rollout, at 480 x 832, at worst: the CPU's
# H.264 encode and SSIM (about 50 frames/s on 2 CPU cores at the demo's 64 x 96, 65 times
# fewer pixels).
DECODE_FRAMES_PER_SECOND = 5
DECODE_MEM_MB = 8000  # CPU side: the latents, one chunk of frames per rollout, the encoders


def video_runtime(config: dict, rollouts: int, latent_frames: int) -> int:
    """Minutes: a decode job of `rollouts` videos of `latent_frames` latent frames (setup, then
    DECODE_FRAMES_PER_SECOND pixel frames a second per rollout)."""
    seconds = rollouts * pixel_frame_count(latent_frames) / DECODE_FRAMES_PER_SECOND
    return EXTRACT_SETUP_MINUTES + math.ceil(seconds / 60)


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
    """A prompt that brings its embeddings, or whose encoding is in the prompt cache, needs no
    GPU to be copied (`local`: extraction_gpus)."""
    return extraction_gpus(config, local) if loads_encoder(config, prompt) else 0


def encode_mem_mb(config: dict, prompt: str) -> int:
    """An encode job's memory: the encoder's weights and a floor; 1000 MB for a copy."""
    return encoder_mem_mb(config) if loads_encoder(config, prompt) else COPY_MEM_MB


def encoder_mem_mb(config: dict) -> int:
    """A job that loads the text encoder: its weights (1.25x, a pickle's copy) and a floor."""
    if "text_encoder" not in config:
        return COPY_MEM_MB
    path = config["text_encoder"]["path"]
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


# --- the VAE decode (rule videos) --------------------------------------------------------------

# Wan2.1's VAE (`sinkscope.wan.vae.WAN21_VAE_CONFIG`; `wan.vae_net.WanVAE`) at base_dim C:
# the decoder's levels run at 4C, 4C, 4C, 2C, C channels from the latent resolution up, each up
# block 3 residual blocks, the first two blocks' upsamplers temporal (x2 frames) and spatial, the
# third's spatial only, the fourth at full resolution (8x the latent's height and width).
VAE_BASE_DIM = 96
VAE_Z_DIM = 16
VAE_DIM_MULT = (1, 2, 4, 4)
VAE_RES_BLOCKS = 2
VAE_TEMPORAL_DOWN = (False, True, True)  # the encoder's; the decoder's is its reverse
VAE_CACHE_FRAMES = 2  # Wan's CACHE_T: a causal conv keeps the last 2 frames of its input
VAE_CALL_FRAMES = 4  # pixel frames of one decoder call (one latent frame) past the first
# float32 values of the decode whatever the VAE's dtype: WanUpsample upsamples in float32.
FLOAT32 = 4


def _conv(c_in: int, c_out: int, kernel: int) -> int:
    return c_in * c_out * kernel + c_out


def _residual_block(c_in: int, c_out: int) -> int:
    """Two RMS-norm gains, two 3x3x3 causal convs, and a 1x1x1 shortcut conv between widths."""
    shortcut = _conv(c_in, c_out, 1) if c_in != c_out else 0
    return c_in + _conv(c_in, c_out, 27) + c_out + _conv(c_out, c_out, 27) + shortcut


def _mid_block(dim: int) -> int:
    attention = dim + _conv(dim, 3 * dim, 1) + _conv(dim, dim, 1)  # norm, qkv, projection
    return 2 * _residual_block(dim, dim) + attention


def _decoder_dims(base_dim: int) -> list[tuple[int, int]]:
    """(input, output) channels of the decoder's 4 up blocks, from the latent resolution up:
    Wan2.1's upsamplers halve the channels, so each block after the first takes half of the
    previous block's output."""
    dims = [base_dim * m for m in (VAE_DIM_MULT[-1], *VAE_DIM_MULT[::-1])]
    return [
        (c_in if i == 0 else c_in // 2, c_out)
        for i, (c_in, c_out) in enumerate(itertools.pairwise(dims))
    ]


def vae_parameters(base_dim: int = VAE_BASE_DIM) -> int:
    """Parameters of Wan2.1's VAE at `base_dim` (126,892,531 at 96; encoder and decoder: a job
    loads both), counted from its shapes without building it."""
    z, temporal_up = VAE_Z_DIM, VAE_TEMPORAL_DOWN[::-1]
    dims = [base_dim * m for m in (1, *VAE_DIM_MULT)]
    encoder = _conv(3, base_dim, 27) + _mid_block(dims[-1]) + dims[-1] + _conv(dims[-1], 2 * z, 27)
    for i, (c_in, c_out) in enumerate(itertools.pairwise(dims)):
        inputs = [c_in] + [c_out] * (VAE_RES_BLOCKS - 1)
        encoder += sum(_residual_block(c, c_out) for c in inputs)
        if i != len(VAE_DIM_MULT) - 1:
            encoder += _conv(c_out, c_out, 9)
            encoder += _conv(c_out, c_out, 3) if VAE_TEMPORAL_DOWN[i] else 0
    decoder = _conv(z, dims[-1], 27) + _mid_block(dims[-1]) + base_dim + _conv(base_dim, 3, 27)
    for i, (c_in, c_out) in enumerate(_decoder_dims(base_dim)):
        decoder += _residual_block(c_in, c_out) + VAE_RES_BLOCKS * _residual_block(c_out, c_out)
        if i != len(VAE_DIM_MULT) - 1:
            decoder += _conv(c_out, c_out // 2, 9)
            decoder += _conv(c_out, 2 * c_out, 3) if temporal_up[i] else 0
    return encoder + _conv(2 * z, 2 * z, 1) + decoder + _conv(z, z, 1)


def vae_cached_channels(base_dim: int = VAE_BASE_DIM) -> dict[int, int]:
    """Spatial scale (1, 2, 4, 8 x the latent's height and width) -> the input channels of the
    decoder's causal convs at that scale, summed: what its feature cache holds per frame and
    latent pixel's worth of area. At the latent scale: conv_in (z_dim), the mid block's and the
    first up block's residual blocks (2 convs each) and its temporal upsampler's time conv; at
    each scale up, that up block's residual blocks (and time conv); conv_out at full scale. The
    1x1x1 shortcut convs cache nothing."""
    temporal_up = VAE_TEMPORAL_DOWN[::-1]
    top = _decoder_dims(base_dim)[0][0]
    channels = {1: VAE_Z_DIM + 2 * 2 * top}  # conv_in, the mid block's 2 residual blocks
    for i, (c_in, c_out) in enumerate(_decoder_dims(base_dim)):
        blocks = (c_in + c_out) + VAE_RES_BLOCKS * 2 * c_out  # conv1 and conv2 inputs
        time_conv = c_out if i < len(temporal_up) and temporal_up[i] else 0
        channels[2**i] = channels.get(2**i, 0) + blocks + time_conv
    channels[8] += base_dim  # conv_out
    return channels


def vae_base_dim(config: dict, name: str) -> int:
    """The base_dim of the VAE that decodes checkpoint `name`'s videos: the demo VAE's
    (`demo.vae.base_dim`), a diffusers folder's config.json's, else Wan2.1's 96 (its .pth)."""
    path = vae_path(config, name)
    if is_demo_vae(path):
        return int(config.get("demo", {}).get("vae", {}).get("base_dim", 1))
    file = vae_dir(path) / CONFIG_NAME
    if file.is_file():
        try:
            return int(json.loads(file.read_text()).get("base_dim", VAE_BASE_DIM))
        except (OSError, ValueError, TypeError, AttributeError):
            pass  # the job's loader names what is wrong with it
    return VAE_BASE_DIM


def vae_decode_bytes(
    latent_height: int,
    latent_width: int,
    *,
    base_dim: int = VAE_BASE_DIM,
    value_bytes: int = 2,
    batch: int = 1,
    num_frames: int = 0,
) -> dict:
    """An estimate of the peak memory of the streaming decode (`wan.vae.iter_decoded_pixels`:
    one latent frame a decoder call) of `batch` videos side by side (the decode job stacks a
    run's rollouts) of latents `latent_height` x `latent_width`, by part (bytes), with values of
    `value_bytes` (2: bf16, 4: fp32):

    - `weights`: the whole VAE (`vae_parameters`: the job loads the encoder too);
    - `feature_cache`: 2 frames of every causal conv's input at its scale
      (`vae_cached_channels`) per video: the same at any length;
    - `activations`: the largest transient of one call, at full resolution with its 4 pixel
      frames of C = base_dim channels. In a residual block's conv, 24 frames of C channels: the
      up block's input (which the decoder holds), the block's input (kept for the shortcut),
      its normalised copy, the conv's new cache (2 frames), its input with the old cache (6
      frames, padded by a pixel) and its output; or in the upsampler into full resolution, 3
      copies of its 2C-channel input at a quarter of the area, the 2C x 4 frames upsampled in
      float32 (WanUpsample's), then their copy in the VAE's dtype or the conv's output: the
      larger of the two. Plus the conv library's copy of that padded input (6 frames: oneDNN
      reorders it on a CPU, where the decode measured it; an allowance for cuDNN's workspace);
    - `output`: one call's 4 pixel frames (3 channels): the decoder's output and its clamp in the
      VAE's dtype, two float32 temporaries of `frames_to_uint8` and the uint8 frames;
    - `latents` (with `num_frames`): the post-quant conv of the whole latents, which the decode
      holds in the VAE's dtype throughout (16 values a latent pixel and frame). At its start,
      before the cache fills, 3 float32 copies of them are made while they are de-normalised:
      not counted (smaller unless a batch is thousands of frames long).

    `total` sums them; the allocator's rounding and the CUDA context come on top. No torch:
    parse time. `benchmarks/README.md` compares it with what decodes held (vae_stream.py
    --estimate on a CPU, gpu.py on a GPU)."""
    area = latent_height * latent_width
    pixels = 64 * area  # per pixel frame at full resolution
    padded = (8 * latent_height + 2) * (8 * latent_width + 2)
    frame = base_dim * pixels  # values of one full-resolution frame of the last level
    call, cached = VAE_CALL_FRAMES, VAE_CACHE_FRAMES
    # up block input, block input, its SiLU, new cache, output; the padded input with the cache
    block = (4 * call + cached) * frame + (call + cached) * base_dim * padded
    upsampled = 2 * call * frame  # 2C channels, 4 frames, full resolution
    upsample = (
        3 * upsampled // 4 * value_bytes  # its input: the up block's, the block's, permuted
        + upsampled * FLOAT32
        + (upsampled * value_bytes if value_bytes < FLOAT32 else upsampled // 2 * FLOAT32)
    )
    workspace = (call + cached) * base_dim * padded * value_bytes
    channels = vae_cached_channels(base_dim)
    parts = {
        "weights": vae_parameters(base_dim) * value_bytes,
        "feature_cache": batch
        * cached
        * area
        * sum(c * scale * scale for scale, c in channels.items())
        * value_bytes,
        "activations": batch * (max(block * value_bytes, upsample) + workspace),
        "output": batch * 3 * call * pixels * (2 * value_bytes + 2 * FLOAT32 + 1),
        "latents": batch * VAE_Z_DIM * num_frames * area * value_bytes,
    }
    parts["total"] = sum(parts.values())
    return parts
