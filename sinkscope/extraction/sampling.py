"""Flow-matching schedule and the block-wise autoregressive rollout of Self-Forcing / CausVid.

Per block of `frames_per_block` latent frames (after a lone first frame with
`independent_first_frame`): one model call per denoising step (x0 = x_t - sigma
* v, then re-noise with fresh noise to the next step), then a cache-update pass on the clean x0 at
timestep 0 that overwrites the block's noisy keys and values in the KV cache.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from sinkscope.frames import block_sizes, block_starts

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
    _table: tuple[torch.Tensor, torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.steps:
            raise ValueError("schedule needs at least one denoising step")
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
        if not self.warp:
            return [float(s) for s in self.steps]
        extended = torch.cat([self.train_timesteps, torch.zeros(1)])
        index = torch.tensor([NUM_TRAIN_TIMESTEPS - int(s) for s in self.steps])
        return [float(t) for t in extended[index]]

    def sigma(self, timestep: float) -> float:
        """sigma of the training timestep nearest to `timestep` (the reference's argmin lookup)."""
        index = torch.argmin((self.train_timesteps - timestep).abs())
        return float(self.train_sigmas[index])

    def pass_timesteps(self) -> list[float]:
        """Timesteps of all model calls of a block: the denoising steps, then the cache pass."""
        return [*self.timesteps, self.cache_timestep]

    def pass_kinds(self) -> list[str]:
        return ["denoise"] * len(self.steps) + ["cache"]


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


# Called before each model call: (block index, pass index, pass kind, timestep).
PassHook = Callable[[int, int, str, float], None]


@torch.no_grad()
def rollout(
    model,
    text: torch.Tensor,
    *,
    geometry: Geometry,
    schedule: Schedule = SELF_FORCING,
    local_attn_size: int = -1,
    sink_size: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    on_pass: PassHook | None = None,
    progress: bool = True,
    caches: list | None = None,
) -> torch.Tensor:
    """Generate clean latents [1, C, F, H, W] block by block with a KV cache.

    Noise comes from a CPU generator seeded with `seed`, so the same seed gives the same video on
    any device, whatever is captured and whatever the cache keeps. `caches`: one per layer in
    place of Self-Forcing's (`local_attn_size`, `sink_size`), e.g. a KV-cache policy's
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
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(shape, generator=generator)
    if caches is None:
        caches = model.new_kv_caches(
            num_frames=geometry.num_frames,
            frame_seq_length=frame_seq_length,
            local_attn_size=local_attn_size,
            sink_size=sink_size,
            device=device,
            dtype=dtype,
        )
    elif (local_attn_size, sink_size) != (-1, 0):
        raise ValueError("give either caches or local_attn_size/sink_size, not both")
    text = model.embed_text(text.to(device=device, dtype=dtype))
    sizes = geometry.block_sizes
    output = torch.empty(shape, dtype=torch.float32)
    timesteps = schedule.pass_timesteps()
    kinds = schedule.pass_kinds()
    # A live bar on a terminal; one log line per pass in a job's log file.
    bar = tqdm(
        total=len(sizes) * len(timesteps),
        desc="rollout",
        unit="pass",
        disable=not (progress and sys.stderr.isatty()),
    )
    started = logged = time.perf_counter()
    for block, (start, size) in enumerate(zip(block_starts(sizes), sizes, strict=True)):
        start = int(start)
        x = noise[:, :, start : start + size].to(device=device, dtype=dtype)
        x0 = x
        for pass_index, (timestep, kind) in enumerate(zip(timesteps, kinds, strict=True)):
            if on_pass is not None:
                on_pass(block, pass_index, kind, timestep)
            for cache in caches:
                cache.begin_pass(kind)
            bar.set_postfix(block=f"{block + 1}/{len(sizes)}", t=f"{timestep:g}")
            t = torch.full((1, size), timestep, device=device, dtype=torch.float32)
            if kind == "cache":
                # Clean keys/values of this block replace the noisy ones in the cache.
                model(x0, t, text, kv_caches=caches, start_frame=start, text_embedded=True)
            else:
                velocity = model(
                    x, t, text, kv_caches=caches, start_frame=start, text_embedded=True
                )
                sigma = schedule.sigma(timestep)
                x0 = (x.double() - sigma * velocity.double()).to(dtype)
                if pass_index + 1 < len(schedule.steps):
                    sigma_next = schedule.sigma(timesteps[pass_index + 1])
                    fresh = torch.randn(x0.shape, generator=generator).to(
                        device=device, dtype=dtype
                    )
                    x = (1 - sigma_next) * x0 + sigma_next * fresh
            bar.update(1)
            now = time.perf_counter()
            last = block + 1 == len(sizes) and pass_index + 1 == len(timesteps)
            # In a job's log: a line every LOG_SECONDS (a 1,000-frame rollout has 2,000 passes).
            if progress and bar.disable and (now - logged >= LOG_SECONDS or last):
                logged = now
                log.info(
                    "block %d/%d pass %d/%d (%s, t=%g) done, %.1f s",
                    block + 1,
                    len(sizes),
                    pass_index + 1,
                    len(timesteps),
                    kind,
                    timestep,
                    time.perf_counter() - started,
                )
        output[:, :, start : start + size] = x0.float().cpu()
    bar.close()
    return output
