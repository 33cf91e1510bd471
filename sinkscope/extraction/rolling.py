"""Rolling Forcing's KV cache (TencentARC/RollingForcing a1477d09; Causal Forcing's long videos),
and the KV-cache policies of the closed loop in its place.

One `RollingKVCache` per layer serves the calls of `sinkscope.schedules.rolling_calls` and gives
each the keys `schedules.rolling_keys` lists: the anchor (block 0's keys from its latest clean
pass, held without RoPE and rotated with full 3D RoPE to the positions the call gives it), the
working cache (clean frames, held after RoPE at their own positions, from their block's clean
pass) and the call's own frames, with no mask (bidirectional inside the window). Only clean
passes write: Rolling Forcing's window calls also write their oldest block's noisy keys, which
its clean pass overwrites before anything reads them, so they are not kept here. The cache holds
block 0 (the anchor and the sinks) and the clean frames any later call may read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sinkscope.cache_choices import KEY_KIND
from sinkscope.schedules import (
    ROLLING_ATTENTION_FRAMES,
    ROLLING_CACHE_FRAMES,
    KeyRun,
    ModelCall,
    rolling_policy_keys,
)
from sinkscope.wan.model import CacheEngine
from sinkscope.wan.rope import apply_rope, rope_angles, rotate_frames

from .caches import TURNS

# The kind of key each version of a run is (`cache_choices.KEY_KINDS`).
_RUN_KIND = {
    "anchor": KEY_KIND["anchor"],
    "clean": KEY_KIND["recent"],
    "sink": KEY_KIND["sink"],
    "window": KEY_KIND["own"],
}


class RollingKVCache(CacheEngine):
    """One layer's cache over the rollout's `calls` (`schedules.rolling_calls`): Rolling Forcing's
    own (`policy` "full") or a KV-cache policy's in its place (`schedules.rolling_policy_keys`:
    window, sink_window, deep_sink; `budget` frames attended in all, `sinks` sink frames, `turn`
    of deep_sink's sinks: `rerope` as Rolling Forcing turns its anchor, or `delta`)."""

    def __init__(
        self,
        calls: Sequence[ModelCall],
        frames_per_block: int,
        frame_seq_length: int,
        policy: str = "full",
        budget: int = ROLLING_ATTENTION_FRAMES,
        sinks: int = 0,
        turn: str = "rerope",
    ):
        if turn not in TURNS:
            raise ValueError(f"sink turn {turn!r} is not one of {TURNS}")
        if sinks > frames_per_block:
            # Only block 0 stays in the cache beyond the newest frames (the anchor, the sinks).
            raise ValueError(
                f"{sinks} sink frames on the rolling sampler: at most block 0's "
                f"{frames_per_block} frames"
            )
        self.calls = calls
        self.frames_per_block = frames_per_block
        self.frame_seq_length = frame_seq_length
        self.policy, self.budget, self.sinks, self.turn = policy, budget, sinks, turn
        # Clean frames are read back at most `budget` frames behind a call; Rolling Forcing's
        # cache holds ROLLING_CACHE_FRAMES (its anchor and the 21 newest).
        self.reach = max(budget, ROLLING_CACHE_FRAMES - frames_per_block)
        self.anchor: tuple[torch.Tensor, torch.Tensor] | None = None  # k before RoPE, v
        self.clean: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # frame: k after RoPE, v
        self.runs: list[KeyRun] = []
        self.grid: tuple[int, int, int] | None = None
        self._labels: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin_call(self, index: int, call: ModelCall) -> None:
        self.call = call
        self.runs = rolling_policy_keys(
            self.calls, index, self.frames_per_block, self.policy, self.budget, self.sinks
        )

    def angles(self, head_dim, grid, start_frame, device):
        self.grid = grid  # the anchor's spatial RoPE follows the call's frame grid
        return super().angles(head_dim, grid, start_frame, device)

    def _write(self, k: torch.Tensor, v: torch.Tensor, k_raw: torch.Tensor) -> None:
        t, call = self.frame_seq_length, self.call
        if call.start == 0:
            self.anchor = (k_raw, v)
        for i, frame in enumerate(range(call.start, call.end)):
            rows = slice(i * t, (i + 1) * t)
            self.clean[frame] = (k[:, rows], v[:, rows])
        # Block 0 stays (the anchor, the sinks); the rest beyond the reach of any later call goes.
        for frame in [f for f in self.clean if self.frames_per_block <= f < call.end - self.reach]:
            del self.clean[frame]

    def _anchor_keys(self, run: KeyRun, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block 0's first `run.frames` frames turned to `run.position`: RoPE afresh on the keys
        before RoPE (rerope, Rolling Forcing's anchor), or the keys after RoPE turned in time by
        the shift, in float64 (delta). Here delta turns the clean keys afresh from their own
        positions at every call, one rounding each time, not turn after turn as Deep Forcing's
        cache does: no release runs Deep Sink on the rolling sampler (docs/DESIGN.md)."""
        t = self.frame_seq_length
        tokens = slice(0, run.frames * t)
        if self.turn == "delta":
            keys = torch.cat([self.clean[f][0] for f in range(run.frames)], dim=1)
            turned = rotate_frames(keys, run.position - run.first_frame)
            return turned.to(like.dtype), self.anchor[1][:, tokens]
        anchor_k, anchor_v = self.anchor
        grid = (run.frames, self.grid[1], self.grid[2])
        angles = rope_angles(anchor_k.shape[-1], grid, run.position, like.device)
        return apply_rope(anchor_k[:, tokens], angles).to(like.dtype), anchor_v[:, tokens]

    def update(self, k, v, current_start, *, q=None, k_raw=None):
        t = self.frame_seq_length
        if current_start != self.call.start * t:
            raise RuntimeError(
                f"rolling cache told call at frame {self.call.start}, got tokens from "
                f"{current_start}"
            )
        if self.call.kind == "cache":
            self._write(k, v, k_raw)
        keys, values, tokens, positions, kinds = [], [], [], [], []
        for run in self.runs:
            if run.version == "window":
                run_k, run_v = k, v
            elif run.version == "anchor":
                run_k, run_v = self._anchor_keys(run, k)
            else:
                frames = range(run.first_frame, run.first_frame + run.frames)
                run_k = torch.cat([self.clean[f][0] for f in frames], dim=1)
                run_v = torch.cat([self.clean[f][1] for f in frames], dim=1)
            keys.append(run_k)
            values.append(run_v)
            first = run.first_frame * t
            tokens.append(torch.arange(first, first + run.frames * t, device=k.device))
            offsets = torch.arange(run.frames * t, device=k.device) // t
            positions.append(run.position + offsets)
            kinds.append(torch.full_like(offsets, _RUN_KIND[run.version]))
        self._labels = (torch.cat(positions), torch.cat(kinds))
        return torch.cat(keys, dim=1), torch.cat(values, dim=1), torch.cat(tokens)

    def key_labels(self, key_tokens, query_start):
        positions, kinds = self._labels
        if positions.shape != key_tokens.shape:
            raise RuntimeError("key_labels asked of keys other than the last call's")
        return positions, kinds


def rolling_caches(
    model,
    calls: Sequence[ModelCall],
    frames_per_block: int,
    frame_seq_length: int,
    policy=None,
) -> list[RollingKVCache]:
    """One cache per layer of `model` for the rolling sampler's `calls`: Rolling Forcing's own,
    or the KV-cache policy `policy`'s (a `cache_policies.CachePolicy`: full, window,
    sink_window or deep_sink). Its tensors follow the calls' device and dtype."""
    settings = {}
    if policy is not None and policy.name != "full":
        settings = {
            "policy": policy.name,
            "budget": policy.budget,
            "sinks": policy.sink_frames,
            "turn": policy.turn,
        }
    return [
        RollingKVCache(calls, frames_per_block, frame_seq_length, **settings)
        for _ in range(model.config.num_layers)
    ]
