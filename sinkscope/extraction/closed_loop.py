"""The closed loop (Contract 6): rollouts longer than the cache under KV-cache policies, each
with its reference-free diagnostics and, where the full-cache rollout of the same noise is the
reference (`closed_loop.reference: full`), how far its clean latents drift from it.

A job rolls out one (checkpoint, prompt) under every policy, the model loaded once: `full` first
when it is the reference. Per rollout it writes the x0 latents (safetensors), a per-frame table
(`tables.FRAME_TABLE_COLUMNS`: the deviation from the reference, relative L2 and cosine over
channels x height x width in float64, empty without one; `sink_distance`, `sinkscope.diagnostics`)
and a per-block table of RoPE positions (`tables.BLOCK_POSITION_COLUMNS`, read from the cache of
layer 0 at each block's first pass). Same seed, same schedule, same noise draws: the cache is the
only difference, so a policy whose budget covers every frame gives the reference bit for bit.
Attention inside every rollout can be captured into attention stores over the cache's slots
(Contract 4): they grow with the video, not its square, whatever the policy keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from sinkscope.diagnostics import sink_distance
from sinkscope.frames import block_sizes, closed_loop_key_frames
from sinkscope.schedules import BlockPart, ModelCall
from sinkscope.storage import csv_rows_text, write_text_atomically
from sinkscope.tables import BLOCK_POSITION_COLUMNS, FRAME_TABLE_COLUMNS

from .cache_policies import CachePolicy
from .capture import LogitCapture
from .job import RolloutPlan, loaded_job, plan_stores, stores_in_a_process
from .latents import load_latents, save_latents
from .rolling import rolling_caches
from .sampling import rollout

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
        jitter=entry.get("jitter", 0.0),
        bias=entry.get("bias", 1.0),
    )


def frame_deviation(latents: torch.Tensor, reference: torch.Tensor) -> tuple[list, list]:
    """Per latent frame of [C, F, H, W]: relative L2 ||x - ref|| / ||ref|| and cosine <x, ref> /
    (||x|| ||ref||), over channels x height x width, in float64."""
    x = latents.double().transpose(0, 1).flatten(1)
    ref = reference.double().transpose(0, 1).flatten(1)
    rel_l2 = (x - ref).norm(dim=1) / ref.norm(dim=1)
    # Rounding can put identical frames a few ulp above 1.
    cosine = ((x * ref).sum(dim=1) / (x.norm(dim=1) * ref.norm(dim=1))).clamp(-1.0, 1.0)
    return rel_l2.tolist(), cosine.tolist()


def _run_keys(checkpoint: str, prompt: str, policy: CachePolicy) -> list:
    """The values of `tables.CLOSED_LOOP_RUN_KEYS` of one rollout: the full cache keeps every
    frame, so its budget and capacity are empty (None), not 0."""
    full = policy.name == "full"
    return [
        checkpoint,
        prompt,
        policy.name,
        None if full else policy.budget,
        policy.sink_frames,
        policy.recent_frames,
        None if full else policy.cache_frames,
        policy.jitter,
        policy.bias,
    ]


def frame_table_csv(
    latents: torch.Tensor,
    reference: torch.Tensor | None,
    *,
    checkpoint: str,
    prompt: str,
    policy: CachePolicy,
    frames_per_block: int,
    independent_first_frame: bool = False,
    sink_frames: int = 0,
) -> str:
    """The per-frame table of one rollout (Contract 6, `tables.FRAME_TABLE_COLUMNS`): the
    deviation from `reference` (empty without one) and `sink_distance` (`sink_frames` 0: the
    first block's frames are the sinks)."""
    sizes = block_sizes(latents.shape[1], frames_per_block, independent_first_frame)
    blocks = [block for block, size in enumerate(sizes) for _ in range(size)]
    if reference is None:
        rel_l2 = cosine = [None] * len(blocks)
    else:
        rel_l2, cosine = frame_deviation(latents, reference)
    # NaN (written empty) where undefined: the sink frames themselves
    distance = sink_distance(latents.double().numpy(), sink_frames or sizes[0]).tolist()
    run = _run_keys(checkpoint, prompt, policy)
    rows = [
        [*run, frame, block, rel_l2[frame], cosine[frame], distance[frame]]
        for frame, block in enumerate(blocks)
    ]
    return csv_rows_text(FRAME_TABLE_COLUMNS, rows)


class PositionProbe:
    """A capture hook that records, at the first pass of every block (the call where it is at
    step 0), where layer 0's cache put the block's queries in RoPE (the positions of its own
    keys, which share the queries' rotation) and the first sink frame (frame 0: as the cache
    holds it, or its own position 0 once it has left); hands every call on to `capture`."""

    def __init__(self, frame_seq_length: int, capture: LogitCapture | None = None):
        self.frame_seq_length = frame_seq_length
        self.capture = capture
        self.rows: list[tuple[int, ...]] = []  # the BLOCK_POSITION values
        self.first_pass: BlockPart | None = None  # the block at its first pass in this call
        self.segment = 0  # of the current call

    @property
    def layers(self) -> set[int]:
        return {0} | (self.capture.layers if self.capture is not None else set())

    def begin_call(self, index: int, call: ModelCall, timesteps) -> None:
        firsts = [part for part in call.parts if part.step == 0]
        self.first_pass = firsts[0] if firsts else None
        self.segment = call.segment
        if self.capture is not None:
            self.capture.begin_call(index, call, timesteps)

    def __call__(self, layer, q, k, visible) -> None:
        part = self.first_pass
        if layer == 0 and part is not None:
            t = self.frame_seq_length
            positions, _ = visible.labels(t)
            tokens = visible.tokens
            if tokens.dim() == 2:  # per-head choices: frames and positions of head 0
                tokens, positions = tokens[:, 0], positions[:, 0]
            own = (tokens >= part.start * t) & (tokens < part.end * t)
            first = tokens // t == 0
            sink = int(positions[first].min()) if bool(first.any()) else 0
            position = int(positions[own].min())
            self.rows.append((part.block, part.start, part.frames, position, sink, self.segment))
        if self.capture is not None and layer in self.capture.layers:
            self.capture(layer, q, k, visible)

    def csv(self, checkpoint: str, prompt: str, policy: CachePolicy) -> str:
        run = _run_keys(checkpoint, prompt, policy)
        return csv_rows_text(BLOCK_POSITION_COLUMNS, [[*run, *row] for row in self.rows])


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
    table_path: str | Path,
    blocks_path: str | Path,
    reference: str | Path | None = None,
    layers: Sequence[int] = (),
    stores: Sequence[str | Path] = (),
    sink_frames: int = 0,
    progress: bool = True,
) -> None:
    """Roll out under `settings["policy"]`, write the latents, the per-frame table (against the
    full-cache `reference` latents, if given) and the per-block positions; capture the attention
    of `layers` into attention `stores` over the cache's slots on the way. `sink_frames`: the
    diagnostics' sink frames (0: the first block's).

    settings: `sinkscope.workflow.params.closed_loop_settings` (the extraction settings at the
    closed loop's length, with `policy`).
    """
    with loaded_job(checkpoint_name, prompt_name, prompt_embeddings, settings) as job:
        _roll_out(
            job,
            checkpoint_name,
            prompt_name,
            settings,
            _Outputs(latents_path, table_path, blocks_path, stores),
            reference,
            layers,
            sink_frames,
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
    tables: Sequence[str | Path],
    blocks: Sequence[str | Path],
    stores: Sequence[str | Path] = (),
    layers: Sequence[int] = (),
    sink_frames: int = 0,
    progress: bool = True,
) -> None:
    """The closed loop of one (checkpoint, prompt) in one job, the model loaded once: every
    rollout of `settings` (each rollout's settings by policy, `sinkscope.workflow.params.
    closed_loop_settings`), in that order; with `full` first, it is every other's reference.
    `latents`, `tables` (per frame) and `blocks` (per block): a file per rollout in that order;
    `stores`: `layers` attention stores per rollout, rollout by rollout, layer by layer."""
    names = list(settings)
    if "full" in names[1:]:
        raise ValueError(f"the full-cache reference rolls out first, not in {names}")
    expected = (len(names),) * 3 + (len(names) * len(layers),)
    if (len(latents), len(tables), len(blocks), len(stores)) != expected:
        raise ValueError(
            f"rollouts {names} (layers {list(layers)}) need {expected[0]} latents, per-frame "
            f"and per-block tables and {expected[3]} stores; got {len(latents)}, {len(tables)}, "
            f"{len(blocks)} and {len(stores)}"
        )
    reference = latents[0] if names[0] == "full" else None
    n = len(layers)
    with loaded_job(checkpoint_name, prompt_name, prompt_embeddings, settings[names[0]]) as job:
        for index, name in enumerate(names):
            outputs = _Outputs(
                latents[index], tables[index], blocks[index], stores[index * n : (index + 1) * n]
            )
            _roll_out(
                job,
                checkpoint_name,
                prompt_name,
                settings[name],
                outputs,
                reference if index else None,
                layers,
                sink_frames,
                progress,
            )
            log.info("closed loop %d/%d done: %s", index + 1, len(names), latents[index])


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """The files of one rollout."""

    latents: str | Path
    table: str | Path
    blocks: str | Path
    stores: Sequence[str | Path]


def _roll_out(
    job,
    checkpoint_name: str,
    prompt_name: str,
    settings: dict,
    outputs: _Outputs,
    reference: str | Path | None,
    layers: Sequence[int],
    sink_frames: int,
    progress: bool,
) -> None:
    """One rollout of a loaded job under `settings["policy"]` (`closed_loop`)."""
    policy = policy_of(settings)
    plan = _cache_plan(RolloutPlan.from_settings(settings).with_segments(job.segments), policy)
    geometry = plan.geometry
    policy.check(geometry.frames_per_block, geometry.block_sizes[0])
    if len(layers) != len(outputs.stores):
        raise ValueError(f"{len(layers)} layers but {len(outputs.stores)} stores")
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
    rolling = plan.sampler == "rolling"
    calls = plan.calls()
    if rolling:
        caches = rolling_caches(
            model, calls, geometry.frames_per_block, frame_seq_length, policy=policy
        )
    else:
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
            frames = closed_loop_key_frames(
                settings["policy"], geometry.num_frames, geometry.frames_per_block, rolling
            )
            slots = frames * frame_seq_length
            writers = plan_stores(
                cfg,
                plan,
                layers,
                outputs.stores,
                attrs,
                stack,
                "attention",
                key_slots=slots,
                store_process=stores_in_a_process(device),
            )
            by_layer = dict(zip(layers, writers, strict=True))
            capture = LogitCapture(by_layer, plan.passes, frame_seq_length, cfg.head_dim)
        probe = PositionProbe(frame_seq_length, capture)
        model.set_capture(probe, probe.layers)
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
                text,
                geometry=geometry,
                schedule=plan.schedule,
                sampler=plan.sampler,
                seed=plan.seed,
                device=device,
                dtype=dtype,
                on_call=probe.begin_call,
                progress=progress,
                caches=caches,
                calls=calls,
            )[0]
        finally:
            model.set_capture(None)
        provenance["shape"] = list(latents.shape)
        reference_latents = None
        if reference is not None:
            reference_latents, theirs = load_latents(reference)
            _check_reference(reference, latents, provenance, theirs)
        table = frame_table_csv(
            latents,
            reference_latents,
            checkpoint=checkpoint_name,
            prompt=prompt_name,
            policy=policy,
            frames_per_block=geometry.frames_per_block,
            independent_first_frame=geometry.independent_first_frame,
            sink_frames=sink_frames,
        )
        write_text_atomically(outputs.table, table)
        write_text_atomically(outputs.blocks, probe.csv(checkpoint_name, prompt_name, policy))
        save_latents(outputs.latents, latents, provenance)
