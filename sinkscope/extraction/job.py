"""One extraction job: plan its stores, load a checkpoint, roll out a prompt and capture the
attention of some layers into them (`extract`, in those three steps).

A job writes one kind of store for a group of layers, all from one rollout: token stores
(Contract 1, `store="tokens"`) or attention stores (Contract 4, `store="attention"`, the survey).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from sinkscope import __version__
from sinkscope.frames import (
    attention_chunk_frames,
    attention_store_disk_bytes,
    token_store_disk_bytes,
    visible_frames,
)
from sinkscope.passes import resolve_passes
from sinkscope.schedules import ModelCall, block_starts_of, with_switches
from sinkscope.segments import Segment, switch_frames
from sinkscope.storage import reserved_space
from sinkscope.wan.checkpoint import load_wan_model
from sinkscope.wan.config import WanConfig
from sinkscope.wan.layout import read_model_config
from sinkscope.wan.precision import model_dtype
from sinkscope.wan.spec import CheckpointSpec
from sinkscope.wan.text import load_prompt_segments
from sinkscope.workflow.digest import combine, sha256_file
from sinkscope.workflow.gpus import job_device

from .attention_store import AttentionStoreWriter, SlotStoreWriter
from .capture import LogitCapture
from .latents import save_latents
from .sampling import Geometry, Schedule, model_calls, rollout
from .store import TokenStoreWriter, partial_path
from .store_process import RemoteWriter, attention_store_process

STORE_KINDS = ("tokens", "attention")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutPlan:
    """What one rollout computes and captures, from the job's settings and the model's config."""

    geometry: Geometry
    schedule: Schedule
    sampler: str  # sinkscope.schedules.SAMPLER_KINDS
    local_attn_size: int
    sink_size: int
    seed: int
    passes: list[int]  # captured pass indices within a block (sinkscope.passes)
    tokens: bool  # capture.tokens: the token x token logits, not only the pooled ones
    # The prompt's schedule (sinkscope.segments): where segments 1.. take effect, the RoPE cut
    # of each (Infinity-RoPE), and LongLive's recache at each switch.
    switches: tuple[int, ...] = ()
    cuts: tuple[int | None, ...] = ()
    recache: bool = False
    global_sink: bool = True
    # capture.passes as given ('all', 'cache', an index, a list), resolved again for a schedule
    capture_spec: str | int | list = "all"
    # capture.survey_precision: what an attention store's key_mass is stored in
    survey_precision: str = "float16"

    @classmethod
    def from_settings(cls, settings: dict) -> RolloutPlan:
        sampler = settings["sampler"]
        video = settings["video"]
        first = sampler.get("first_block_steps")
        schedule = Schedule(
            steps=tuple(sampler["steps"]),
            shift=float(sampler["shift"]),
            warp=bool(sampler["warp"]),
            first_block_steps=None if first is None else tuple(first),
        )
        return cls(
            geometry=Geometry(
                num_frames=video["num_frames"],
                frames_per_block=video["frames_per_block"],
                latent_height=video["latent_height"],
                latent_width=video["latent_width"],
                # Absent where settings skip the schema defaults: Self-Forcing's T2V default.
                independent_first_frame=video.get("independent_first_frame", False),
            ),
            schedule=schedule,
            # Absent where settings skip the schema defaults: Self-Forcing's sampler.
            sampler=sampler.get("kind", "self_forcing"),
            local_attn_size=sampler["local_attn_size"],
            sink_size=sampler["sink_size"],
            seed=settings["seed"],
            passes=resolve_passes(settings["capture"]["passes"], schedule.num_passes - 1),
            tokens=settings["capture"].get("tokens", True),
            # Absent where the sampler does not recache (workflow.params.sampler_params).
            recache=bool(sampler.get("recache", False)),
            global_sink=bool(sampler.get("global_sink", True)),
            capture_spec=settings["capture"]["passes"],
            # Absent at its default (workflow.params.extraction_settings).
            survey_precision=settings["capture"].get("survey_precision", "float16"),
        )

    def with_segments(self, segments: Sequence[Segment]) -> RolloutPlan:
        """The plan under a prompt of `segments`: the switches inside this rollout (a segment
        starting past it never takes effect) and, with a recache, the recache pass captured as
        `capture.passes` says."""
        starts = block_starts_of(self.geometry.block_sizes)
        switches = switch_frames(segments, starts)
        if switches and self.sampler != "self_forcing":
            raise ValueError(f"prompt switches run on the self_forcing sampler, not {self.sampler}")
        cuts = tuple(segment.cut for segment in segments[: len(switches)])
        plan = replace(self, switches=tuple(switches), cuts=cuts)
        passes = resolve_passes(
            self.capture_spec, self.schedule.num_passes - 1, recache=plan.recaches
        )
        return replace(plan, passes=passes)

    @property
    def recaches(self) -> bool:
        """Whether the rollout runs recache passes (a recaching sampler and a switch)."""
        return self.recache and bool(self.switches)

    def pass_axis(self) -> tuple[list[float], list[str]]:
        """Timesteps and kinds of every slot of the pass axis: the denoising steps, the cache
        pass and, with recache passes, the recache pass (t = 0)."""
        timesteps, kinds = self.schedule.pass_timesteps(), self.schedule.pass_kinds()
        if self.recaches:
            return [*timesteps, self.schedule.cache_timestep], [*kinds, "recache"]
        return timesteps, kinds

    @property
    def timesteps(self) -> list[float]:
        every = self.pass_axis()[0]
        return [every[p] for p in self.passes]

    @property
    def pass_kinds(self) -> list[str]:
        every = self.pass_axis()[1]
        return [every[p] for p in self.passes]

    def calls(self) -> list[ModelCall]:
        """The rollout's model calls, under the prompt's schedule."""
        calls = model_calls(self.sampler, self.geometry, self.schedule)
        if not self.switches:
            return calls
        window = self.local_attn_size
        return with_switches(
            calls,
            self.geometry.block_sizes,
            self.switches,
            recache_frames=window if self.recache else None,
            recache_slot=self.schedule.num_passes,
            global_sink=self.global_sink,
            cuts=self.cuts,
        )

    def schedule_attrs(self) -> dict:
        """What the stores record of the prompt's schedule (none for a plain prompt)."""
        if not self.switches:
            return {}
        return {
            "switch_frames": list(self.switches),
            "recache": self.recache,
            "global_sink": self.global_sink,
        }


def prompt_token_attrs(text_meta: dict[str, str]) -> dict:
    """Token counts of an encoded prompt (none for imported embeddings): `prompt_tokens` of the
    whole prompt, `prompt_tokens_kept` encoded, `prompt_truncated` when the tail was cut."""
    if "prompt_tokens" not in text_meta or "length" not in text_meta:
        return {}
    total, kept = int(text_meta["prompt_tokens"]), int(text_meta["length"])
    return {"prompt_tokens": total, "prompt_tokens_kept": kept, "prompt_truncated": kept < total}


@dataclass
class ClaimedJob:
    """What every GPU job starts from, all but the weights: its device, the checkpoint's config,
    the prompt and the provenance its outputs record (checkpoint, prompt, seed, version, the
    claimed device, start time). `load_model` loads the weights."""

    device: torch.device
    dtype: torch.dtype
    config: WanConfig
    text: torch.Tensor  # [segments, L, d]: one row per segment of the prompt
    segments: list[Segment]
    provenance: dict
    spec: CheckpointSpec

    def load_model(self) -> torch.nn.Module:
        """The checkpoint's model on the job's device, in its dtype."""
        log.info("loading %s onto %s (%s)", self.provenance["checkpoint"], self.device, self.dtype)
        return load_wan_model(self.spec, device=self.device, dtype=self.dtype)


@dataclass
class LoadedJob(ClaimedJob):
    """A `ClaimedJob` with its model loaded."""

    model: torch.nn.Module


@contextlib.contextmanager
def claimed_job(
    checkpoint_name: str, prompt_name: str, prompt_embeddings: str | Path, settings: dict
) -> Iterator[ClaimedJob]:
    """Claim the job's device (`workflow.gpus.job_device`, held until the block ends: until the
    outputs are complete), read the checkpoint's config and load the prompt's embeddings. The
    weights wait for `ClaimedJob.load_model`: a job can start what does not need them first (the
    survey's store process, `extract`)."""
    with job_device(settings["device"]) as claim:
        started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        device = torch.device(claim.device)
        # Absent where settings skip the schema defaults: bf16 on CUDA, fp32 on the CPU.
        dtype = model_dtype(device, settings.get("dtype", "auto"))
        entry = settings["checkpoint"]
        spec = CheckpointSpec.from_entry(entry)
        config = read_model_config(spec.base)
        # The workflow hashed real checkpoints when it was parsed (cached); demo ones are tiny.
        checkpoint_sha256 = entry.get("sha256") or combine(
            sha256_file(path) for path in spec.files()
        )
        text, text_meta, segments = load_prompt_segments(prompt_embeddings)
        if text.shape[2] != config.text_dim:
            raise ValueError(
                f"{prompt_embeddings}: embeddings have width {text.shape[2]}, "
                f"but {checkpoint_name} expects text_dim={config.text_dim}"
            )
        provenance = {
            "checkpoint": checkpoint_name,
            "checkpoint_sha256": checkpoint_sha256,
            "prompt": prompt_name,
            "prompt_text": text_meta.get("prompt", ""),
            **prompt_token_attrs(text_meta),
            "seed": settings["seed"],
            "sinkscope_version": __version__,
            "device": str(device),
            "gpu": claim.record(),
            "started_at": started_at,
            "dtype": str(dtype).removeprefix("torch."),
            # A prompt of segments: each one's text, start, flush and cut.
            **({"segments": [asdict(s) for s in segments]} if len(segments) > 1 else {}),
        }
        yield ClaimedJob(device, dtype, config, text, segments, provenance, spec)


@contextlib.contextmanager
def loaded_job(
    checkpoint_name: str, prompt_name: str, prompt_embeddings: str | Path, settings: dict
) -> Iterator[LoadedJob]:
    """`claimed_job` with its model loaded."""
    with claimed_job(checkpoint_name, prompt_name, prompt_embeddings, settings) as job:
        model = job.load_model()
        yield LoadedJob(**vars(job), model=model)


def stores_in_a_process(device: torch.device) -> bool:
    """Whether a job's attention stores are written by a `StoreProcess`: on a GPU, where the
    writers' Python in the model's process and its waits for the device cost the survey more than
    its kernels (benchmarks/README.md). On the CPU nothing waits for a device and the model's own
    operations leave the GIL free; a child would only add its start-up (~0.6 s) to every job."""
    return device.type == "cuda"


def _visible_tiles(plan: RolloutPlan) -> int:
    """The (query frame, key frame) pairs the rollout's queries see: an attention store's keys."""
    rolling = len(plan.schedule.steps) if plan.sampler == "rolling" else None
    sizes = list(plan.geometry.block_sizes)
    return int(visible_frames(sizes, plan.local_attn_size, plan.sink_size, rolling).sum())


def plan_stores(
    cfg: WanConfig,
    plan: RolloutPlan,
    layers: Sequence[int],
    outputs: Sequence[str | Path],
    attrs: dict,
    stack: contextlib.ExitStack,
    store: str = "tokens",
    key_slots: int | None = None,
    store_process: bool = False,
) -> list[TokenStoreWriter | AttentionStoreWriter | RemoteWriter]:
    """One open store of kind `store` (`tokens` or `attention`) per layer, entered into `stack`,
    after checking the layers and claiming their disk space (`storage.reserved_space`, held until
    the stack closes). `key_slots`: attention stores over that many cache slots
    (`SlotStoreWriter`, a closed loop's) instead of every token of the video.

    `store_process`: attention stores are written by a `StoreProcess` (their writers in a child
    process, fed without waiting for the GPU; `stores_in_a_process` says when); token stores are
    always written by their writer threads in this process.

    `attrs`: the provenance every store records; the model and geometry facts are added here.
    """
    if store not in STORE_KINDS:
        raise ValueError(f"store must be one of {STORE_KINDS}, got {store!r}")
    bad = [layer for layer in layers if not 0 <= layer < cfg.num_layers]
    if bad:
        raise ValueError(
            f"layers {bad} out of range: {attrs['checkpoint']} has {cfg.num_layers} layers"
        )
    geometry = plan.geometry
    frame_seq_length = cfg.tokens_per_frame(geometry.latent_height, geometry.latent_width)
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
        **attrs,
        "store": store,
        "num_heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
        "frame_seq_length": frame_seq_length,
        "latent_grid": grid,
        "num_frames": geometry.num_frames,
        "block_sizes": geometry.block_sizes,
        "timesteps": plan.timesteps,
        # Which pass of a block each step is, of how many (Participative Compression's offline
        # choice walks back through a block's calls).
        "passes": plan.passes,
        "passes_per_block": len(plan.schedule.pass_timesteps()),
        "sampler_kind": plan.sampler,
        # With a first block of its own steps, `timesteps` are the longer list's; the others'.
        **(
            {"later_block_timesteps": plan.schedule.timesteps}
            if plan.schedule.first_block_steps is not None
            else {}
        ),
        "local_attn_size": plan.local_attn_size,
        "sink_size": plan.sink_size,
        "logit_scale": 1.0 / math.sqrt(cfg.head_dim),
        **plan.schedule_attrs(),
    }
    folder = Path(outputs[0]).parent
    folder.mkdir(parents=True, exist_ok=True)
    block_size = os.statvfs(folder).f_frsize
    options = {
        "num_heads": cfg.num_heads,
        "num_frames": geometry.num_frames,
        "frame_seq_length": frame_seq_length,
        "timesteps": plan.timesteps,
        "pass_kinds": plan.pass_kinds,
    }
    if store == "tokens":
        attrs["tokens"] = plan.tokens
        options["tokens"] = plan.tokens
        writer_class = TokenStoreWriter
        store_bytes = token_store_disk_bytes(
            num_passes=len(plan.passes) if plan.tokens else 0,
            num_heads=cfg.num_heads,
            frame_seq_length=frame_seq_length,
            sizes=geometry.block_sizes,
            local_attn_size=plan.local_attn_size,
            sink_size=plan.sink_size,
            block_size=block_size,
            rolling_steps=len(plan.schedule.steps) if plan.sampler == "rolling" else None,
        )
        what = "the token stores (float16 logits of the visible tiles, stored raw)"
    else:
        # key_mass chunks every block exactly ([1, 3, 3, ...]: one query frame per chunk).
        options["frames_per_block"] = attention_chunk_frames(geometry.block_sizes)
        writer_class = AttentionStoreWriter
        attrs["key_axis"] = "token" if key_slots is None else "slot"
        if key_slots is not None:
            options["slots"] = key_slots
            writer_class = SlotStoreWriter
        else:
            options["precision"] = plan.survey_precision
        store_bytes = attention_store_disk_bytes(
            num_passes=len(plan.passes),
            num_heads=cfg.num_heads,
            num_frames=geometry.num_frames,
            frame_seq_length=frame_seq_length,
            frames_per_block=options["frames_per_block"],
            block_size=block_size,
            key_slots=key_slots,
            visible_tiles=None if key_slots is not None else _visible_tiles(plan),
            precision=plan.survey_precision,
        )
        what = (
            "the attention stores (key mass of the visible keys, stored raw)"
            if key_slots is None
            else "the attention stores over cache slots"
        )
    log.info(
        "%d %s store(s) of %s, up to %.3f GB each on disk",
        len(outputs),
        store,
        attrs["checkpoint"],
        store_bytes / 1e9,
    )
    stack.enter_context(
        reserved_space(
            folder,
            store_bytes * len(outputs),
            writing=[partial_path(Path(out)) for out in outputs],
            what=what,
        )
    )
    open_store = writer_class
    if store == "attention" and store_process:
        process = attention_store_process(
            cfg.num_heads,
            max(geometry.block_sizes),
            geometry.num_frames * frame_seq_length if key_slots is None else key_slots,
            slots=key_slots is not None,
        )
        open_store = stack.enter_context(process).opener(writer_class)
    return [
        stack.enter_context(open_store(out, attrs={**attrs, "layer": layer}, **options))
        for layer, out in zip(layers, outputs, strict=True)
    ]


def roll_out(
    model,
    text: torch.Tensor,
    plan: RolloutPlan,
    capture: LogitCapture,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool,
) -> torch.Tensor:
    """Generate the video block by block, capturing what `capture` was asked for; returns the
    x0 latents [C, F, H, W]."""
    model.set_capture(capture, capture.layers)
    log.info(
        "rollout (%s sampler): %d blocks x %d passes, capturing layers %s passes %s",
        plan.sampler,
        len(plan.geometry.block_sizes),
        len(plan.schedule.pass_timesteps()),
        sorted(capture.layers),
        plan.passes,
    )
    try:
        latents = rollout(
            model,
            text,
            geometry=plan.geometry,
            schedule=plan.schedule,
            sampler=plan.sampler,
            local_attn_size=plan.local_attn_size,
            sink_size=plan.sink_size,
            seed=plan.seed,
            device=device,
            dtype=dtype,
            on_call=capture.begin_call,
            progress=progress,
            calls=plan.calls(),
        )
    finally:
        model.set_capture(None)
    log.info("rollout done; finishing the stores")
    return latents[0]


def extract(
    *,
    checkpoint_name: str,
    prompt_name: str,
    prompt_embeddings: str | Path,
    layers: Sequence[int],
    outputs: Sequence[str | Path],
    settings: dict,
    store: str = "tokens",
    latents: str | Path | None = None,
    progress: bool = True,
) -> None:
    """Write one store per layer in `layers` to the matching `outputs` path: a token store
    (Contract 1) or, with `store="attention"`, an attention store (Contract 4); and the
    rollout's x0 latents to `latents` when given (the survey's, for its video).

    settings: `sinkscope.workflow.params.extraction_settings` (checkpoint, sampler, video,
    capture, seed, device). The rollout is the same whichever layers are captured. The job runs on
    the device `sinkscope.workflow.gpus.job_device` gives it.
    """
    if len(layers) != len(outputs):
        raise ValueError(f"{len(layers)} layers but {len(outputs)} outputs")
    # The GPU is held from before the model loads until the stores are complete.
    with claimed_job(checkpoint_name, prompt_name, prompt_embeddings, settings) as job:
        plan = RolloutPlan.from_settings(settings).with_segments(job.segments)
        text, device, dtype, cfg = job.text, job.device, job.dtype, job.config
        provenance = {**job.provenance, "config": settings}
        with contextlib.ExitStack() as stores:
            # The stores before the weights: a store process's child starts and opens its
            # stores while they load. Its ring holds fewer calls than one model call makes, so
            # otherwise the rollout's first calls wait for it (benchmarks/gpu.py times both).
            writers = plan_stores(
                cfg,
                plan,
                layers,
                outputs,
                provenance,
                stores,
                store,
                store_process=stores_in_a_process(device),
            )
            model = job.load_model()
            capture = LogitCapture(
                dict(zip(layers, writers, strict=True)),
                plan.passes,
                writers[0].frame_seq_length,
                cfg.head_dim,
            )
            x0 = roll_out(model, text, plan, capture, device=device, dtype=dtype, progress=progress)
        if latents is not None:
            provenance = {**job.provenance, "video": settings["video"], "shape": list(x0.shape)}
            provenance["block_sizes"] = list(plan.geometry.block_sizes)
            save_latents(latents, x0.float().cpu(), provenance)
