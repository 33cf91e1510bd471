"""KV-cache policies a rollout can run under: what each layer's cache keeps once the video is
longer than the cache (the closed loop of Contract 6), each named after the method whose released
code it runs (docs/DESIGN.md, Contract 6, says what is identical and what differs).

Budgets B count latent frames of keys per query block, its own block included, as the offline
recall of `sinkscope.analysis.policies` does, so a closed-loop policy and its recall describe the
same choice (`sinkscope.cache_choices` decides for both):
- `full`: every frame (the reference rollout);
- `window`: the B most recent frames (Self-Forcing's `local_attn_size`; Self-Forcing++'s rolling
  cache);
- `sink_window`: the S first frames and the B - S most recent (`sink_size`; StreamingLLM,
  LongLive's cache with B = 12, S = 3): sink keys keep the RoPE phase of their own frames;
- `deep_sink`: the frames of `sink_window`, the sink keys turned in the temporal RoPE axis as
  Deep Forcing's Deep Sink does (`caches.DeepSinkKVCache`);
- `participative`: Deep Forcing's Participative Compression, a cache of `capacity` frames pruned
  to B when a block overflows it, the sinks kept at their own positions;
- `deep_forcing`: Participative Compression with Deep Sink under it, Deep Forcing's default
  (`caches.ParticipativeKVCache`);
- `top_c`: sinkscope's variant after the paper's wording: the own block, the R frames before it
  and the C = (B - own - R) x T history tokens that received the most attention from the
  previous block's cache-update queries, chosen per head (`caches.TopCKVCache`).

The position policies (`cache_choices.POSITION_POLICIES`, caches in `position_caches`) keep whole
frames and change where they sit in RoPE, which frame a slot holds, or their weight:
- `relative`: Infinity-RoPE's [S sinks | newest frames | own block] within B at positions 0 .. n-1
  (released: B = 6, S = 1), the sinks stored once with RoPE at 0 .. S-1, the rest re-RoPE'd at
  every call; S may not exceed the first block (`position_caches.RelativeKVCache`);
- `replay`: Rolling-Sink's rolling window of B frames at absolute positions (released: B = 21,
  no sinks) whose slots, once a block starts at B or later, replay frames 0 .. B - b - 1 back and
  forth (`cache_choices.replay_frames`, `position_caches.ReplayKVCache`);
- `head_jitter`: `sink_window` with a per-head jitter of the temporal RoPE base of strength
  `jitter` in [0, 1) (LoL's fix for sink collapse; `cache_choices.jitter_thetas`);
- `logit_bias`: `sink_window` with log(`bias`) added to the logits of past frames other than
  frame 0, bias in (0, 1] (Krea Realtime's attention bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sinkscope.cache_choices import (
    CLOSED_LOOP_POLICIES,
    PARTICIPATIVE_POLICIES,
    POSITION_POLICIES,
    RECENT_POLICIES,
    SINK_POLICIES,
    ParticipativeChoice,
    TopCChoice,
    policy_label,
)

from .caches import TURNS, DeepSinkKVCache, ParticipativeKVCache, TopCKVCache
from .position_caches import (
    HeadJitterKVCache,
    LogitBiasKVCache,
    RelativeKVCache,
    ReplayKVCache,
)

# The policies that keep sink_window's frames, (B, S) of Self-Forcing's cache (`window`).
_SINK_WINDOW_FRAMES = ("sink_window", "deep_sink", "relative", "head_jitter", "logit_bias")


@dataclass(frozen=True)
class CachePolicy:
    """One KV-cache policy: its name, budget B (frames, own block included), sink frames S,
    recent frames R before the own block, and for Participative Compression the cache's
    `capacity` (frames held before a prune, Deep Forcing's 21) and the `reuse_cap` (a token
    chosen that often leaves; 0: never); `turn` says how sink keys turn (`caches.TURNS`);
    `jitter`: head_jitter's strength in [0, 1); `bias`: logit_bias's factor b in (0, 1]."""

    name: str
    budget: int = 0
    sink_frames: int = 0
    recent_frames: int = 0
    capacity: int = 0
    reuse_cap: int = 7
    turn: str = "delta"
    jitter: float = 0.0
    bias: float = 1.0

    def check(self, frames_per_block: int, first_block: int | None = None) -> None:
        """Refuse a policy its cache cannot run, naming the numbers. `first_block`: the frames
        of the first block when they differ (an independent first frame)."""
        if self.name not in CLOSED_LOOP_POLICIES:
            raise ValueError(f"cache policy {self.name!r} is not one of {CLOSED_LOOP_POLICIES}")
        if self.name == "full":
            return
        if self.turn not in TURNS:
            raise ValueError(f"{self.name}: turn {self.turn!r} is not one of {TURNS}")
        room = self.budget - frames_per_block
        kept = (self.sink_frames if self.name in SINK_POLICIES else 0) + (
            self.recent_frames if self.name in RECENT_POLICIES else 0
        )
        if room < kept:
            raise ValueError(
                f"{self.name}: a budget of {self.budget} frames leaves {room} beside the own block "
                f"of {frames_per_block}, fewer than the {kept} it must keep"
            )
        if self.name in PARTICIPATIVE_POLICIES and self.capacity < self.budget:
            raise ValueError(
                f"{self.name}: a cache of {self.capacity} frames cannot be pruned to a budget of "
                f"{self.budget}"
            )
        first_block = frames_per_block if first_block is None else first_block
        if self.name == "relative" and self.sink_frames > first_block:
            raise ValueError(
                f"relative: {self.sink_frames} sink frames are more than the first block's "
                f"{first_block} frames, where the sinks are stored"
            )
        if self.name == "replay" and room < 1:
            raise ValueError(
                f"replay: a budget of {self.budget} frames leaves no frame beside the own block of "
                f"{frames_per_block} to replay"
            )
        if self.name == "head_jitter" and not 0 <= self.jitter < 1:
            raise ValueError(f"head_jitter: a strength of {self.jitter} is not in [0, 1)")
        if self.name == "logit_bias" and not 0 < self.bias <= 1:
            raise ValueError(f"logit_bias: a bias b of {self.bias} is not in (0, 1]")

    @property
    def cache_frames(self) -> int:
        """Frames the cache holds before it first drops a key: the capacity of Participative
        Compression, the budget otherwise."""
        return self.capacity if self.name in PARTICIPATIVE_POLICIES else self.budget

    @property
    def window(self) -> tuple[int, int]:
        """Self-Forcing's (local_attn_size, sink_size) of the frames a frame-level policy keeps:
        (-1, 0) for the full cache; deep_sink, relative, head_jitter and logit_bias keep
        sink_window's frames (relative at other positions), replay window's slots (some holding
        replayed frames)."""
        if self.name == "full":
            return -1, 0
        sinks = self.sink_frames if self.name in _SINK_WINDOW_FRAMES else 0
        return self.budget, sinks

    @property
    def label(self) -> str:
        """What plots and logs call it: `deep_sink B=9 S=3`, `deep_forcing B=9 S=3 R=1
        capacity=21`."""
        if self.name == "full":
            return "full cache"
        return policy_label(
            self.name,
            self.budget,
            self.sink_frames,
            self.recent_frames,
            self.capacity,
            jitter=self.jitter,
            bias=self.bias,
        )

    def new_caches(
        self,
        model,
        *,
        num_frames: int,
        frame_seq_length: int,
        frames_per_block: int,
        device: torch.device | str,
        dtype: torch.dtype,
        token_grid: tuple[int, int] | None = None,
    ) -> list:
        """One cache per layer of `model` that keeps what this policy keeps. `token_grid`: the
        (height, width) of a frame in tokens, needed to re-apply RoPE to sinks (`turn` rerope)."""
        self.check(frames_per_block)
        device = torch.device(device)
        common = {"frame_seq_length": frame_seq_length, "device": device, "dtype": dtype}
        if self.name in ("full", "window", "sink_window"):
            local_attn_size, sink_size = self.window
            return model.new_kv_caches(
                num_frames=num_frames,
                local_attn_size=local_attn_size,
                sink_size=sink_size,
                **common,
            )
        cfg = model.config
        if self.name in POSITION_POLICIES:
            return self._position_caches(model, frame_seq_length, frames_per_block, device, dtype)
        if self.name == "deep_sink":
            return [
                DeepSinkKVCache(
                    1,
                    self.budget * frame_seq_length,
                    cfg.num_heads,
                    cfg.head_dim,
                    frame_seq_length,
                    self.budget,
                    self.sink_frames,
                    device,
                    dtype,
                    turn=self.turn,
                    token_grid=token_grid,
                )
                for _ in range(cfg.num_layers)
            ]
        if self.name in PARTICIPATIVE_POLICIES:
            return [
                ParticipativeKVCache(
                    ParticipativeChoice(
                        frame_seq_length=frame_seq_length,
                        capacity=self.capacity,
                        budget=self.budget,
                        sink_frames=self.sink_frames,
                        recent_frames=self.recent_frames,
                        frames_per_block=frames_per_block,
                        reuse_cap=self.reuse_cap,
                        turn_sinks=self.name == "deep_forcing",
                    ),
                    num_frames=num_frames,
                    num_heads=cfg.num_heads,
                    head_dim=cfg.head_dim,
                    device=device,
                    dtype=dtype,
                    turn=self.turn,
                    token_grid=token_grid,
                )
                for _ in range(cfg.num_layers)
            ]
        return [
            TopCKVCache(
                TopCChoice(
                    frame_seq_length=frame_seq_length,
                    num_heads=cfg.num_heads,
                    budget=self.budget,
                    recent_frames=self.recent_frames,
                    frames_per_block=frames_per_block,
                ),
                head_dim=cfg.head_dim,
                window_frames=self.recent_frames + frames_per_block,
                device=device,
                dtype=dtype,
            )
            for _ in range(cfg.num_layers)
        ]

    def _position_caches(self, model, frame_seq_length, frames_per_block, device, dtype) -> list:
        cfg = model.config
        if self.name == "relative":
            return [
                RelativeKVCache(
                    budget=self.budget,
                    sink_frames=self.sink_frames,
                    frame_seq_length=frame_seq_length,
                    num_heads=cfg.num_heads,
                    head_dim=cfg.head_dim,
                    device=device,
                    dtype=dtype,
                )
                for _ in range(cfg.num_layers)
            ]
        local_attn_size, sink_size = self.window
        window = (
            1,
            self.budget * frame_seq_length,
            cfg.num_heads,
            cfg.head_dim,
            frame_seq_length,
            local_attn_size,
            sink_size,
            device,
            dtype,
        )
        if self.name == "replay":
            return [
                ReplayKVCache(*window, span=self.budget - frames_per_block)
                for _ in range(cfg.num_layers)
            ]
        if self.name == "head_jitter":
            return [HeadJitterKVCache(*window, strength=self.jitter) for _ in range(cfg.num_layers)]
        return [LogitBiasKVCache(*window, bias=self.bias) for _ in range(cfg.num_layers)]
