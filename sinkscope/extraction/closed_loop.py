"""The closed loop (Contract 6): a rollout longer than the cache under a KV-cache policy, and how
far its clean latents drift from the full-cache rollout of the same noise.

A job rolls out one (checkpoint, prompt, policy) and writes its x0 latents (safetensors). The
`full` policy's latents are the reference; every other policy's job reads them and writes the
deviation of each latent frame (relative L2 and cosine over channels x height x width, float64).
Same seed, same schedule, same noise draws: the cache is the only difference, so a policy whose
budget covers every frame gives the reference bit for bit. Attention inside a rollout of a
frame-level policy can be captured into attention stores (Contract 4) as in a survey.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sinkscope.cache_choices import FRAME_POLICIES
from sinkscope.frames import block_sizes
from sinkscope.storage import atomic_path, write_text_atomically
from sinkscope.tables import DEVIATION_COLUMNS

from .cache_policies import CachePolicy
from .capture import LogitCapture
from .job import RolloutPlan, loaded_job, plan_stores
from .sampling import rollout

LATENTS_KEY = "x0"
# What must match between a policy's rollout and its reference for the comparison to mean anything.
_SAME_ROLLOUT = ("checkpoint_sha256", "prompt", "seed", "num_frames", "sampler", "video")

log = logging.getLogger(__name__)


def policy_of(settings: dict) -> CachePolicy:
    entry = settings["policy"]
    return CachePolicy(
        name=entry["name"],
        budget=entry.get("budget", 0),
        sink_frames=entry.get("sink_frames", 0),
        recent_frames=entry.get("recent_frames", 0),
        capacity=entry.get("capacity", 0),
        reuse_cap=entry.get("reuse_cap", 7),
        turn=entry.get("turn", "delta"),
    )


def save_latents(path: str | Path, latents: torch.Tensor, metadata: dict) -> None:
    """x0 latents [C, F, H, W] (float32) and their provenance (JSON values), atomically."""
    with atomic_path(path) as temporary:
        save_file(
            {LATENTS_KEY: latents.contiguous()},
            str(temporary),
            metadata={key: json.dumps(value) for key, value in metadata.items()},
        )


def load_latents(path: str | Path) -> tuple[torch.Tensor, dict]:
    """What `save_latents` wrote: the latents and the provenance."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            if LATENTS_KEY not in handle.keys():
                raise ValueError(f"{path}: no '{LATENTS_KEY}' tensor; it has {list(handle.keys())}")
            latents = handle.get_tensor(LATENTS_KEY)
            metadata = {key: json.loads(value) for key, value in handle.metadata().items()}
    except FileNotFoundError:
        raise FileNotFoundError(f"reference latents not found: {path}") from None
    return latents, metadata


def frame_deviation(latents: torch.Tensor, reference: torch.Tensor) -> tuple[list, list]:
    """Per latent frame of [C, F, H, W]: relative L2 ||x - ref|| / ||ref|| and cosine <x, ref> /
    (||x|| ||ref||), over channels x height x width, in float64."""
    x = latents.double().transpose(0, 1).flatten(1)
    ref = reference.double().transpose(0, 1).flatten(1)
    rel_l2 = (x - ref).norm(dim=1) / ref.norm(dim=1)
    # Rounding can put identical frames a few ulp above 1.
    cosine = ((x * ref).sum(dim=1) / (x.norm(dim=1) * ref.norm(dim=1))).clamp(-1.0, 1.0)
    return rel_l2.tolist(), cosine.tolist()


def deviation_csv(
    latents: torch.Tensor,
    reference: torch.Tensor,
    *,
    checkpoint: str,
    prompt: str,
    policy: CachePolicy,
    frames_per_block: int,
    independent_first_frame: bool = False,
) -> str:
    """The deviation table of one policy rollout against its reference (Contract 6)."""
    rel_l2, cosine = frame_deviation(latents, reference)
    sizes = block_sizes(latents.shape[1], frames_per_block, independent_first_frame)
    blocks = [block for block, size in enumerate(sizes) for _ in range(size)]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(DEVIATION_COLUMNS)
    for frame, (block, l2, cos) in enumerate(zip(blocks, rel_l2, cosine, strict=True)):
        writer.writerow(
            [
                checkpoint,
                prompt,
                policy.name,
                policy.budget,
                policy.sink_frames,
                policy.recent_frames,
                policy.cache_frames,
                frame,
                block,
                repr(l2),
                repr(cos),
            ]
        )
    return out.getvalue()


def _check_reference(path: str | Path, latents: torch.Tensor, mine: dict, theirs: dict) -> None:
    if theirs.get("policy", {}).get("name") != "full":
        raise ValueError(f"{path}: not a full-cache rollout (policy {theirs.get('policy')})")
    for key in _SAME_ROLLOUT:
        if theirs.get(key) != mine.get(key):
            raise ValueError(
                f"{path}: the reference has {key}={theirs.get(key)!r}, this rollout "
                f"{mine.get(key)!r}; rerun the reference"
            )
    if tuple(latents.shape) != tuple(theirs["shape"]):
        raise ValueError(f"{path}: latents {theirs['shape']} vs {list(latents.shape)}")


def _cache_plan(plan: RolloutPlan, policy: CachePolicy) -> RolloutPlan:
    """The plan as the attention stores record it: the window and sinks the policy keeps."""
    local_attn_size, sink_size = policy.window
    return replace(plan, local_attn_size=local_attn_size, sink_size=sink_size)


def closed_loop(
    *,
    checkpoint_name: str,
    prompt_name: str,
    prompt_embeddings: str | Path,
    settings: dict,
    latents_path: str | Path,
    reference: str | Path | None = None,
    deviation_path: str | Path | None = None,
    layers: Sequence[int] = (),
    stores: Sequence[str | Path] = (),
    progress: bool = True,
) -> None:
    """Roll out under `settings["policy"]`, write the latents and, given the full-cache
    `reference` latents, the per-frame deviation table; capture the attention of `layers` into
    attention `stores` on the way.

    settings: `sinkscope.workflow.params.closed_loop_settings` (the extraction settings at the
    closed loop's length, with `policy`).
    """
    with loaded_job(checkpoint_name, prompt_name, prompt_embeddings, settings) as job:
        _roll_out(
            job,
            checkpoint_name,
            prompt_name,
            settings,
            latents_path,
            reference,
            deviation_path,
            layers,
            stores,
            progress,
        )
    log.info("closed loop done: %s", latents_path)


def closed_loops(
    *,
    checkpoint_name: str,
    prompt_name: str,
    prompt_embeddings: str | Path,
    settings: dict[str, dict],
    latents: Sequence[str | Path],
    deviations: Sequence[str | Path],
    stores: Sequence[str | Path] = (),
    layers: Sequence[int] = (),
    progress: bool = True,
) -> None:
    """The closed loop of one (checkpoint, prompt) in one job, the model loaded once: the
    full-cache reference, then every policy against it. `settings`: each rollout's settings by
    policy, `full` first (`sinkscope.workflow.params.closed_loop_settings`); `latents`: a file
    per rollout, in that order; `deviations`: a table per policy, in that order, none for
    `full`; `stores`: `layers` attention stores per rollout that can be captured (`full` and the
    frame-level policies), rollout by rollout in that order, layer by layer."""
    names = list(settings)
    if names[:1] != ["full"]:
        raise ValueError(
            f"the closed loop of a run starts with its full-cache reference, not {names}"
        )
    captured = [name for name in names if name in FRAME_POLICIES]
    expected = (len(names), len(names) - 1, len(captured) * len(layers))
    if (len(latents), len(deviations), len(stores)) != expected:
        raise ValueError(
            f"rollouts {names} (captured: {captured}, layers {list(layers)}) need "
            f"{expected[0]} latents, {expected[1]} deviation tables and {expected[2]} stores; "
            f"got {len(latents)}, {len(deviations)} and {len(stores)}"
        )
    store_of = {
        name: list(stores[i * len(layers) : (i + 1) * len(layers)])
        for i, name in enumerate(captured)
    }
    with loaded_job(checkpoint_name, prompt_name, prompt_embeddings, settings["full"]) as job:
        for index, name in enumerate(names):
            _roll_out(
                job,
                checkpoint_name,
                prompt_name,
                settings[name],
                latents[index],
                latents[0] if index else None,
                deviations[index - 1] if index else None,
                layers if name in captured else (),
                store_of.get(name, ()),
                progress,
            )
            log.info("closed loop done: %s", latents[index])


def _roll_out(
    job,
    checkpoint_name: str,
    prompt_name: str,
    settings: dict,
    latents_path: str | Path,
    reference: str | Path | None,
    deviation_path: str | Path | None,
    layers: Sequence[int],
    stores: Sequence[str | Path],
    progress: bool,
) -> None:
    """One rollout of a loaded job under `settings["policy"]` (`closed_loop`)."""
    policy = policy_of(settings)
    plan = _cache_plan(RolloutPlan.from_settings(settings), policy)
    geometry = plan.geometry
    policy.check(geometry.frames_per_block)
    if (reference is None) != (deviation_path is None):
        raise ValueError("a reference and a deviation table go together")
    if policy.name != "full" and reference is None:
        raise ValueError(f"{policy.label}: a policy rollout needs the full-cache reference")
    if len(layers) != len(stores):
        raise ValueError(f"{len(layers)} layers but {len(stores)} stores")
    if layers and policy.name not in FRAME_POLICIES:
        raise ValueError(
            f"{policy.name} keeps tokens, not frames: attention in its rollout cannot be captured"
        )
    model, text, device, dtype = job.model, job.text, job.device, job.dtype
    cfg = model.config
    frame_seq_length = cfg.tokens_per_frame(geometry.latent_height, geometry.latent_width)
    provenance = {
        **job.provenance,
        "num_frames": geometry.num_frames,
        "sampler": settings["sampler"],
        "video": settings["video"],
        "policy": settings["policy"],
    }
    caches = policy.new_caches(
        model,
        num_frames=geometry.num_frames,
        frame_seq_length=frame_seq_length,
        frames_per_block=geometry.frames_per_block,
        device=device,
        dtype=dtype,
        token_grid=cfg.token_grid(geometry.latent_height, geometry.latent_width),
    )
    with contextlib.ExitStack() as stack:
        capture = None
        if layers:
            attrs = {**provenance, "config": settings}
            writers = plan_stores(cfg, plan, layers, stores, attrs, stack, "attention")
            by_layer = dict(zip(layers, writers, strict=True))
            capture = LogitCapture(by_layer, plan.passes, frame_seq_length, cfg.head_dim)
            model.set_capture(capture, capture.layers)

        log.info(
            "closed loop: %s, %d latent frames (%d blocks) of %s / %s",
            policy.label,
            geometry.num_frames,
            len(geometry.block_sizes),
            checkpoint_name,
            prompt_name,
        )
        try:
            latents = rollout(
                model,
                text[None],
                geometry=geometry,
                schedule=plan.schedule,
                seed=plan.seed,
                device=device,
                dtype=dtype,
                on_pass=capture.begin_pass if capture is not None else None,
                progress=progress,
                caches=caches,
            )[0]
        finally:
            model.set_capture(None)
        provenance["shape"] = list(latents.shape)
        if reference is not None:
            reference_latents, theirs = load_latents(reference)
            _check_reference(reference, latents, provenance, theirs)
            table = deviation_csv(
                latents,
                reference_latents,
                checkpoint=checkpoint_name,
                prompt=prompt_name,
                policy=policy,
                frames_per_block=geometry.frames_per_block,
                independent_first_frame=geometry.independent_first_frame,
            )
            write_text_atomically(deviation_path, table)
        save_latents(latents_path, latents, provenance)
