"""Flow-matching schedule and the rollout engine: it runs a sampler's schedule of model calls
(`sinkscope.schedules`) with a KV cache per layer.

- `self_forcing` (Self-Forcing, CausVid, Causal Forcing): per block of `frames_per_block` latent
  frames (after a lone first frame with `independent_first_frame`), one model call per denoising
  step (x0 = x_t - sigma * v, then re-noise with fresh noise to the next step), then a
  cache-update pass on the clean x0 at timestep 0 that overwrites the block's noisy keys and values
  in the KV cache.
- `rolling` (Rolling Forcing, Causal Forcing's long videos): a window of S blocks denoised jointly,
  each at its own step; after every window call the unfinished blocks are re-noised to their next
  step and a clean pass writes the window's oldest block (`sinkscope.extraction.rolling`).

A prompt of segments (`sinkscope.segments`) gives every call the text of its segment, and with
LongLive's recache a `recache` call before each switch re-encodes the clean frames before it
under the new prompt (`sinkscope.schedules.with_switches`): t = 0, output discarded, no noise.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from sinkscope.frames import block_sizes
from sinkscope.schedules import SAMPLER_KINDS, ModelCall, rolling_calls, self_forcing_calls

NUM_TRAIN_TIMESTEPS = 1000
LOG_SECONDS = 5.0  # between progress lines of a rollout in a job's log

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """A few-step flow-matching schedule.

    steps: the nominal denoising steps (Self-Forcing [1000, 750, 500, 250]); shift: the timestep
    shift; warp: map each step s to the shifted training timestep of index 1000 - s (Self-Forcing's
    `warp_denoising_step`), which gives 1000, 937.5, 833.33.., 625 for shift 5.
    """

    steps: tuple[float, ...] = (1000, 750, 500, 250)
    shift: float = 5.0
    warp: bool = True
    cache_timestep: float = 0.0
    # Causal Forcing++'s 1- and 2-step models denoise the first block with their own steps.
    first_block_steps: tuple[float, ...] | None = None
    _table: tuple[torch.Tensor, torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.steps:
            raise ValueError("schedule needs at least one denoising step")
        if self.first_block_steps is not None and not self.first_block_steps:
            raise ValueError("first_block_steps needs at least one step (or None)")
        if self.shift <= 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")
        # Self-Forcing's FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True), float32.
        sigmas = torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1)[:-1]
        sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        object.__setattr__(self, "_table", (sigmas, sigmas * NUM_TRAIN_TIMESTEPS))

    @property
    def train_sigmas(self) -> torch.Tensor:
        return self._table[0]

    @property
    def train_timesteps(self) -> torch.Tensor:
        return self._table[1]

    @property
    def timesteps(self) -> list[float]:
        """The timesteps the model receives, one per denoising step."""
        return self._model_timesteps(self.steps)

    def _model_timesteps(self, steps: tuple[float, ...]) -> list[float]:
        if not self.warp:
            return [float(s) for s in steps]
        extended = torch.cat([self.train_timesteps, torch.zeros(1)])
        index = torch.tensor([NUM_TRAIN_TIMESTEPS - int(s) for s in steps])
        return [float(t) for t in extended[index]]

    def timesteps_for_block(self, block: int) -> list[float]:
        """The timesteps block `block` is denoised at (the first block's own, if it has them)."""
        if block == 0 and self.first_block_steps is not None:
            return self._model_timesteps(self.first_block_steps)
        return self.timesteps

    @property
    def num_passes(self) -> int:
        """Slots of a store's pass axis: the most steps any block takes, then the cache pass."""
        return max(len(self.steps), len(self.first_block_steps or ())) + 1

    def sigma(self, timestep: float) -> float:
        """sigma of the training timestep nearest to `timestep` (the reference's argmin lookup)."""
        index = torch.argmin((self.train_timesteps - timestep).abs())
        return float(self.train_sigmas[index])

    def pass_timesteps(self) -> list[float]:
        """Timesteps of the pass axis: each slot's denoising step (the longest step list's, the
        first block's where it has more steps), then the cache pass."""
        longest = self.timesteps_for_block(0)
        if len(self.steps) >= len(longest):
            longest = self.timesteps
        return [*longest, self.cache_timestep]

    def pass_kinds(self) -> list[str]:
        return ["denoise"] * (self.num_passes - 1) + ["cache"]


SELF_FORCING = Schedule(steps=(1000, 750, 500, 250), shift=5.0, warp=True)
CAUSVID = Schedule(steps=(1000, 757, 522), shift=8.0, warp=False)


@dataclass(frozen=True)
class Geometry:
    """Latent video geometry of a rollout: with `independent_first_frame` latent frame 0 is a
    block of its own before the blocks of `frames_per_block` (Self-Forcing's [1, 3, 3, ...])."""

    num_frames: int = 21
    frames_per_block: int = 3
    latent_height: int = 60
    latent_width: int = 104
    channels: int = 16
    independent_first_frame: bool = False

    @property
    def block_sizes(self) -> list[int]:
        return block_sizes(self.num_frames, self.frames_per_block, self.independent_first_frame)


def model_calls(sampler: str, geometry: Geometry, schedule: Schedule) -> list[ModelCall]:
    """The model calls of a rollout of `geometry` under `sampler` (sinkscope.schedules)."""
    sizes = geometry.block_sizes
    if sampler == "self_forcing":
        steps = [len(schedule.timesteps_for_block(b)) for b in range(len(sizes))]
        return self_forcing_calls(sizes, steps)
    if sampler == "rolling":
        if geometry.independent_first_frame or len(set(sizes)) != 1:
            raise ValueError(
                "the rolling sampler needs equal blocks: no independent first frame, and "
                f"num_frames a multiple of frames_per_block (blocks {sizes})"
            )
        if schedule.first_block_steps is not None:
            raise ValueError("the rolling sampler denoises every block with the same steps")
        return rolling_calls(len(sizes), sizes[0], len(schedule.steps))
    raise ValueError(f"sampler kind {sampler!r} is not one of {SAMPLER_KINDS}")


# Called before each model call: (call index, the call, each part's timestep).
CallHook = Callable[[int, ModelCall, list[float]], None]
# Self-Forcing's older hook, for calls of one block: (block, pass index, pass kind, timestep).
PassHook = Callable[[int, int, str, float], None]


@torch.no_grad()
def rollout(
    model,
    text: torch.Tensor,
    *,
    geometry: Geometry,
    schedule: Schedule = SELF_FORCING,
    sampler: str = "self_forcing",
    local_attn_size: int = -1,
    sink_size: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    on_call: CallHook | None = None,
    on_pass: PassHook | None = None,
    progress: bool = True,
    caches: list | None = None,
    calls: list[ModelCall] | None = None,
) -> torch.Tensor:
    """Generate clean latents [1, C, F, H, W] by running the sampler's model calls with a KV cache.

    `text` [segments, L, d]: one row per segment of the prompt, the row a call reads being its
    `segment` (a plain prompt: one row). `calls`: the schedule of model calls, by default the
    sampler's (`model_calls`), for a prompt of segments `schedules.with_switches` of it.

    Noise comes from a CPU generator seeded with `seed`, so the same seed gives the same video on
    any device, whatever is captured and whatever the cache keeps. `caches`: one per layer in
    place of the sampler's own (Self-Forcing's from `local_attn_size`, `sink_size`; Rolling
    Forcing's anchor and working cache), e.g. a KV-cache policy's
    (sinkscope.extraction.cache_policies).
    """
    device = torch.device(device)
    cfg = model.config
    frame_seq_length = cfg.tokens_per_frame(geometry.latent_height, geometry.latent_width)
    shape = (
        1,
        geometry.channels,
        geometry.num_frames,
        geometry.latent_height,
        geometry.latent_width,
    )
    if calls is None:
        calls = model_calls(sampler, geometry, schedule)
    segments = max(call.segment for call in calls) + 1
    if text.shape[0] < segments:
        raise ValueError(f"the calls read {segments} prompt segments; the text has {text.shape[0]}")
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(shape, generator=generator)
    if caches is not None and (local_attn_size, sink_size) != (-1, 0):
        raise ValueError("give either caches or local_attn_size/sink_size, not both")
    if caches is None and sampler == "rolling":
        if (local_attn_size, sink_size) != (-1, 0):
            raise ValueError("the rolling sampler keeps Rolling Forcing's own cache")
        from .rolling import rolling_caches

        caches = rolling_caches(model, calls, geometry.frames_per_block, frame_seq_length)
    elif caches is None:
        caches = model.new_kv_caches(
            num_frames=geometry.num_frames,
            frame_seq_length=frame_seq_length,
            local_attn_size=local_attn_size,
            sink_size=sink_size,
            device=device,
            dtype=dtype,
        )
    text = model.embed_text(text.to(device=device, dtype=dtype))
    output = torch.empty(shape, dtype=torch.float32)
    state = _Blocks(noise, schedule, generator, device, dtype)
    # A live bar on a terminal; a log line every LOG_SECONDS in a job's log file.
    bar = tqdm(
        total=len(calls),
        desc="rollout",
        unit="call",
        disable=not (progress and sys.stderr.isatty()),
    )
    started = logged = time.perf_counter()
    for index, call in enumerate(calls):
        timesteps = [
            schedule.cache_timestep
            if part.step is None
            else schedule.timesteps_for_block(part.block)[part.step]
            for part in call.parts
        ]
        if on_call is not None:
            on_call(index, call, timesteps)
        if on_pass is not None:
            if len(call.parts) != 1:
                raise ValueError("on_pass serves calls of one block: use on_call")
            on_pass(call.parts[0].block, call.parts[0].pass_index, call.kind, timesteps[0])
        for cache in caches:
            cache.begin_call(index, call)
        bar.set_postfix(call=f"{index + 1}/{len(calls)}", t=f"{timesteps[-1]:g}")
        t = torch.cat(
            [
                torch.full((1, part.frames), timestep, dtype=torch.float32)
                for part, timestep in zip(call.parts, timesteps, strict=True)
            ],
            dim=1,
        ).to(device)
        context = text[call.segment : call.segment + 1]
        if call.kind == "cache":
            # Clean keys/values of this block replace the noisy ones in the cache.
            (part,) = call.parts
            x0 = state.x0[part.block]
            model(x0, t, context, kv_caches=caches, start_frame=call.start, text_embedded=True)
            if part.block not in state.x:  # finished: no later call reads its x0
                del state.x0[part.block]
        elif call.kind == "recache":
            # LongLive: the clean outputs before the switch again, under the new prompt; only
            # the cache keeps anything of this call.
            x0 = output[:, :, call.start : call.end].to(device=device, dtype=dtype)
            model(x0, t, context, kv_caches=caches, start_frame=call.start, text_embedded=True)
        else:
            x = torch.cat([state.input(part) for part in call.parts], dim=2)
            velocity = model(
                x, t, context, kv_caches=caches, start_frame=call.start, text_embedded=True
            )
            state.step(call, velocity, timesteps)
            for part in call.parts:
                if part.step + 1 == len(schedule.timesteps_for_block(part.block)):
                    output[:, :, part.start : part.end] = state.x0[part.block].float().cpu()
        bar.update(1)
        now = time.perf_counter()
        # In a job's log: a line every LOG_SECONDS (a 1,000-frame rollout makes 2,000 calls).
        if progress and bar.disable and (now - logged >= LOG_SECONDS or index + 1 == len(calls)):
            logged = now
            log.info(
                "call %d/%d (%s, frames %d-%d, t=%s) done, %.1f s",
                index + 1,
                len(calls),
                call.kind,
                call.start,
                call.end - 1,
                "/".join(f"{t:g}" for t in timesteps),
                now - started,
            )
    bar.close()
    return output


def velocity_to_x0(x: torch.Tensor, velocity: torch.Tensor, sigma: float) -> torch.Tensor:
    """x0 = x_t - sigma v in float64, rounded once to x's dtype (Self-Forcing's
    `WanDiffusionWrapper._convert_flow_pred_to_x0`)."""
    return (x.double() - sigma * velocity.double()).to(x.dtype)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """(1 - sigma) x0 + sigma noise, as Self-Forcing's `FlowMatchScheduler.add_noise` computes
    it: sigma is a float32 tensor of the schedule's table, so in a bfloat16 model both products
    and the sum are float32 and the result is rounded once, to the noise's dtype. (A Python float
    times a bfloat16 tensor would round each product and the sum: three roundings.) In float32 it
    is the same arithmetic as with Python floats."""
    sigma = torch.full((1,) * x0.dim(), sigma, dtype=torch.float32, device=x0.device)
    return ((1 - sigma) * x0 + sigma * noise).type_as(noise)


class _Blocks:
    """Each block's noisy input and latest x0 during a rollout, and the noise draws between them.

    A block takes its rows of the initial noise when first queried. After a denoising call every
    part gets x0 = x_t - sigma v; each part not at its last step is re-noised to its next step,
    oldest first, with a fresh draw the size of the call's whole input, of which it keeps its rows
    (Rolling Forcing's draws; for a call of one block, Self-Forcing's).
    """

    def __init__(self, noise, schedule: Schedule, generator, device, dtype):
        self.noise, self.schedule, self.generator = noise, schedule, generator
        self.device, self.dtype = device, dtype
        self.x: dict[int, torch.Tensor] = {}
        self.x0: dict[int, torch.Tensor] = {}

    def input(self, part) -> torch.Tensor:
        if part.block not in self.x:
            rows = self.noise[:, :, part.start : part.end]
            self.x[part.block] = rows.to(device=self.device, dtype=self.dtype)
        return self.x[part.block]

    def step(self, call: ModelCall, velocity: torch.Tensor, timesteps: list[float]) -> None:
        shape = velocity.shape
        for part, timestep in zip(call.parts, timesteps, strict=True):
            rows = slice(part.start - call.start, part.end - call.start)
            x, v = self.x[part.block], velocity[:, :, rows]
            x0 = velocity_to_x0(x, v, self.schedule.sigma(timestep))
            self.x0[part.block] = x0
            steps = self.schedule.timesteps_for_block(part.block)
            if part.step + 1 < len(steps):
                sigma_next = self.schedule.sigma(steps[part.step + 1])
                fresh = torch.randn(shape, generator=self.generator)[:, :, rows]
                fresh = fresh.to(device=self.device, dtype=self.dtype)
                self.x[part.block] = add_noise(x0, fresh, sigma_next)
            else:
                del self.x[part.block]
