"""What a run will write, before it writes it: bytes per store family, the largest job, and the
free space where they go (Snakemake prints `format_plan` when it parses the workflow, so
`snakemake -n` shows it before any job runs). Upper bounds on disk, from the same functions the
jobs claim their space with. Parse-time: no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sinkscope.explorer_sizes import explorer_bytes, run_bytes
from sinkscope.frames import (
    attention_chunk_frames,
    attention_store_disk_bytes,
    closed_loop_key_frames,
    export_bytes,
    token_store_disk_bytes,
)

from .entries import (
    closed_loop_policies,
    closed_loop_policy,
    closed_loop_rollouts,
    closed_loop_runs,
    export_layers,
    frame_layers,
    is_demo_encoder,
    survey_layers,
    survey_video_runs,
    token_layers,
    token_stores,
    video_runs,
)
from .prompt_cache import PROMPT_CACHE, loads_encoder
from .resources import (
    GPU_DTYPE_BYTES,
    gpu_dtype,
    gpu_memory_bytes,
    store_geometry,
    vae_base_dim,
    vae_decode_bytes,
)

LATENT_CHANNELS = 16


@dataclass
class Family:
    """One kind of output: where it goes, and the bytes each of its jobs writes."""

    name: str
    folder: str
    jobs: dict[str, int] = field(default_factory=dict)  # job label -> bytes

    @property
    def total(self) -> int:
        return sum(self.jobs.values())


def job_disk_bytes(config: dict, name: str, job: str, *, layers: int = 1) -> int:
    """Upper bound of what one job of checkpoint `name` writes: `extract` (one token store),
    `survey` (`layers` attention stores), `closed_loop` (the closed loop of one run: the latents
    of every rollout of `closed_loop.num_frames` frames, the full cache's and every policy's, and
    the attention stores of `closed_loop.survey` over the cache's slots in every rollout)."""
    frames = config["closed_loop"]["num_frames"] if job == "closed_loop" else None
    if job == "extract":
        if not config["capture"]["tokens"]:
            return 0
        return token_store_disk_bytes(**store_geometry(config, name, frames, "tokens").token_layout)
    g = store_geometry(config, name, frames)

    def attention(key_slots: int | None = None) -> int:
        """One layer's attention store: over every token, or over `key_slots` cache slots."""
        return attention_store_disk_bytes(
            num_passes=g.num_passes,
            num_heads=g.num_heads,
            num_frames=g.num_frames,
            frame_seq_length=g.frame_seq_length,
            # the chunking the job uses ([1, 3, 3, ...]: one query frame per chunk)
            frames_per_block=attention_chunk_frames(g.sizes),
            key_slots=key_slots,
            visible_tiles=None if key_slots is not None else g.visible_tiles,
            precision=config["capture"].get("survey_precision", "float16"),
        )

    if job == "survey":
        return layers * attention()
    if job == "closed_loop":
        video = config["video"]
        latents = (
            LATENT_CHANNELS * g.num_frames * video["latent_height"] * video["latent_width"] * 4
        )
        rollouts = closed_loop_rollouts(config)
        # Stores over the cache's slots: linear in the frames.
        slots = [
            closed_loop_key_frames(
                closed_loop_policy(config, policy),
                g.num_frames,
                video["frames_per_block"],
                g.rolling_steps is not None,
            )
            * g.frame_seq_length
            for policy in rollouts
        ]
        layers = len(config["closed_loop"]["survey"])
        return len(rollouts) * latents + layers * sum(attention(key_slots) for key_slots in slots)
    raise ValueError(f"unknown job kind {job!r}")


def job_disk_mb(config: dict, name: str, job: str, **kwargs) -> int:
    """`job_disk_bytes` in MB, rounded up: the rules' `disk_mb` resource."""
    return -(-job_disk_bytes(config, name, job, **kwargs) // 1_000_000)


def storage_plan(config: dict) -> list[Family]:
    """The store families the default target writes (token stores, attention stores, the
    closed loop) and what `snakemake export` would add."""
    checkpoints, prompts = list(config["checkpoints"]), list(config["prompts"])
    tokens = Family("token stores", "results/logits")
    for c, p, layer in token_stores(config):
        tokens.jobs[f"extract {c}/{p}/layer{layer}"] = job_disk_bytes(config, c, "extract")
    surveyed = survey_layers(config)
    attention = Family("attention stores", "results/attention")
    for c in checkpoints if surveyed else []:
        per_job = job_disk_bytes(config, c, "survey", layers=len(surveyed))
        for p in prompts:
            attention.jobs[f"survey {c}/{p}"] = per_job
    loop = Family("closed loop", "results/closed_loop")
    for c, p in closed_loop_runs(config):
        loop.jobs[f"closed_loop {c}/{p}"] = job_disk_bytes(config, c, "closed_loop")
    exports = Family("exports (snakemake export only)", "results/export")
    exported = export_layers(config)
    stored = set(token_stores(config))
    for c in checkpoints:
        g = store_geometry(config, c)
        per_layer = export_bytes(
            num_heads=g.num_heads,
            frame_seq_length=g.frame_seq_length,
            num_frames=g.num_frames,
            last_block_frames=g.sizes[-1],
            measure=config["export"]["measure"],
        )
        for p in prompts:
            if any((c, p, layer) not in stored for layer in exported):
                continue  # no token store to export (capture.token_runs)
            exports.jobs[f"export_run {c}/{p}"] = len(exported) * (
                per_layer["figure4"] + per_layer["logit_cache"] + per_layer["shapes_cache"]
            ) + per_layer["frames"] * len(set(token_layers(config)) | set(surveyed))
    return [family for family in (tokens, attention, loop, exports) if family.jobs]


def explorer_estimate(config: dict) -> int:
    """About what rule explorer writes to results/explorer/ (`explorer_sizes`): every run's
    frame layers, the spatial maps where the layers are surveyed, the closed loops' per-frame
    tables; the videos are links to results/videos/."""
    layers, surveyed = frame_layers(config), bool(survey_layers(config))
    height, width = config["video"]["latent_height"], config["video"]["latent_width"]
    runs = 0.0
    for name in config["checkpoints"]:
        g = store_geometry(config, name)
        runs += len(config["prompts"]) * run_bytes(
            layers=len(layers),
            heads=g.num_heads,
            passes=g.num_passes,
            block_sizes=list(g.sizes),
            token_grid=(height // 2, width // 2) if surveyed else None,
        )
    frames = 0
    if closed_loop_policies(config):
        rollouts = len(closed_loop_rollouts(config)) * len(closed_loop_runs(config))
        frames = rollouts * config["closed_loop"]["num_frames"]
    return explorer_bytes(runs, frames)


def free_bytes(folder: str) -> tuple[Path, int]:
    """Free bytes on the filesystem of `folder` (its nearest existing parent)."""
    path = Path(folder).absolute()
    while not path.exists():
        path = path.parent
    stat = os.statvfs(path)
    return path, stat.f_bavail * stat.f_frsize


def _size(value: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value} B"


def format_plan(config: dict) -> str:
    """The plan as the lines Snakemake prints before any job runs."""
    families = storage_plan(config)
    lines = ["sinkscope plan (upper bounds on disk, whatever is already written):"]
    default = [f for f in families if not f.name.startswith("exports")]
    for family in families:
        per_job = max(family.jobs.values())
        count = len(family.jobs)
        jobs = "job," if count == 1 else "jobs,"
        lines.append(
            f"  {family.name:<32} {count:>4} {jobs:<5} up to {_size(per_job)} each, "
            f"{_size(family.total)} in {family.folder}/"
        )
    if default:
        largest = max(((job, b) for f in default for job, b in f.jobs.items()), key=lambda x: x[1])
        lines.append(f"  largest job: {largest[0]}, {_size(largest[1])}")
        total = sum(f.total for f in default)
        where, free = free_bytes("results")
        verdict = "fits" if total <= free else "DOES NOT FIT: free space or fewer layers/passes"
        lines.append(
            f"  default target: {_size(total)}; {_size(free)} free on {where} ({verdict}); each "
            "job claims its share before writing, so jobs running side by side cannot overbook"
        )
    lines.append(
        f"  attention explorer (estimate): about {_size(explorer_estimate(config))} in "
        "results/explorer/ (the videos linked, not copied)"
    )
    loads = _encoder_loads(config)
    if loads:
        lines.append(
            f"  text encoder: {loads} prompts to encode, each job loading the encoder; "
            f"`snakemake ... encode_all_prompts` first encodes them all into {PROMPT_CACHE}/ "
            "with it loaded once, and their jobs copy them (docs/GUIDE.md)"
        )
    gpu = _largest_gpu_job(config)
    if gpu is not None:
        job, parts = gpu
        lines.append(
            f"  GPU memory (estimate, {gpu_dtype(config)}): about "
            f"{_size(parts['total'])} for {job} (weights "
            f"{_size(parts['weights'])}, KV cache {_size(parts['kv_cache'])}, capture "
            f"{_size(parts['capture'])})"
        )
    decode = _largest_decode_job(config)
    if decode is not None:
        job, rollouts, frames, parts = decode
        video = config["video"]
        height, width = video["latent_height"], video["latent_width"]
        side = "side by side" if rollouts > 1 else "alone"
        lines.append(
            f"  VAE decode (estimate, {gpu_dtype(config)}): about {_size(parts['total'])} for "
            f"{job} at {8 * height} x {8 * width} ({height} x {width} latent), {rollouts} "
            f"rollout{'s' if rollouts > 1 else ''} of {frames} frames {side} (weights "
            f"{_size(parts['weights'])}, feature cache {_size(parts['feature_cache'])}, "
            f"activations {_size(parts['activations'])}, latents {_size(parts['latents'])}; "
            "all but the latents the same at any length)"
        )
    return "\n".join(lines)


def _encoder_loads(config: dict) -> int:
    """How many encode jobs would load the real text encoder (the demo's loads in
    milliseconds): prompts not yet encoded, not bringing embeddings, not in the prompt cache.
    Counted only when more than one, where `encode_all_prompts` saves loads."""
    encoder = config.get("text_encoder")
    if encoder is None or is_demo_encoder(encoder):
        return 0
    loads = sum(
        1
        for name in config["prompts"]
        if loads_encoder(config, name) and not Path(f"results/prompts/{name}.safetensors").exists()
    )
    return loads if loads > 1 else 0


def _largest_decode_job(config: dict) -> tuple[str, int, int, dict] | None:
    """(job, rollouts, latent frames, `resources.vae_decode_bytes`) of the video job that holds
    the most GPU memory: per closed-loop run one decodes its rollouts as one batch of
    closed_loop.num_frames frames, per survey run (`videos: all`) one its rollout of
    video.num_frames; None when `videos` decodes nothing."""
    video = config["video"]
    value_bytes = GPU_DTYPE_BYTES[gpu_dtype(config)]
    jobs = [
        ("videos", len(closed_loop_rollouts(config)), config["closed_loop"]["num_frames"], c)
        for c in dict.fromkeys(c for c, _ in video_runs(config))
    ] + [
        ("survey_video", 1, video["num_frames"], c)
        for c in dict.fromkeys(c for c, _ in survey_video_runs(config))
    ]
    estimates = [
        (
            f"{rule} {name}",
            rollouts,
            frames,
            vae_decode_bytes(
                video["latent_height"],
                video["latent_width"],
                base_dim=vae_base_dim(config, name),
                value_bytes=value_bytes,
                batch=rollouts,
                num_frames=frames,
            ),
        )
        for rule, rollouts, frames, name in jobs
    ]
    return max(estimates, key=lambda e: e[3]["total"], default=None)


def _largest_gpu_job(config: dict) -> tuple[str, dict] | None:
    """(job kind and checkpoint, `resources.gpu_memory_bytes`) of the extraction, survey or
    closed-loop job that holds the most GPU memory, or None when there is none."""
    kinds = (["extract"] if token_layers(config) else []) + (
        ["survey"] if survey_layers(config) else []
    )
    estimates = [
        (f"{kind} {name}", gpu_memory_bytes(config, name, kind))
        for name in config["checkpoints"]
        for kind in kinds
    ]
    if closed_loop_policies(config):
        frames = config["closed_loop"]["num_frames"]
        estimates += [
            (
                f"closed_loop {name} ({frames} frames)",
                gpu_memory_bytes(config, name, "closed_loop", frames),
            )
            for name in dict.fromkeys(c for c, _ in closed_loop_runs(config))
        ]
    return max(estimates, key=lambda e: e[1]["total"], default=None)
