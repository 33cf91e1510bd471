"""Rolling Forcing's KV cache (TencentARC/RollingForcing a1477d09; Causal Forcing's long videos).

One `RollingKVCache` per layer serves the calls of `sinkscope.schedules.rolling_calls` and gives
each the keys `schedules.rolling_keys` lists: the anchor (block 0's keys from its latest clean
pass, held without RoPE and rotated with full 3D RoPE to the positions the call gives it), the
working cache (clean frames, held after RoPE at their own positions, from their block's clean
pass) and the call's own frames, with no mask (bidirectional inside the window). Only clean
passes write: Rolling Forcing's window calls also write their oldest block's noisy keys, which
its clean pass overwrites before anything reads them, so they are not kept here. The cache holds
the anchor and the `ROLLING_CACHE_FRAMES - anchor` newest clean frames.
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
    rolling_keys,
)
from sinkscope.wan.model import CacheEngine
from sinkscope.wan.rope import apply_rope, rope_angles

# The kind of key each version of a run is (`cache_choices.KEY_KINDS`).
_RUN_KIND = {"anchor": KEY_KIND["anchor"], "clean": KEY_KIND["recent"], "window": KEY_KIND["own"]}


class RollingKVCache(CacheEngine):
    """One layer's Rolling Forcing cache over the rollout's `calls` (`schedules.rolling_calls`)."""

    def __init__(
        self,
        calls: Sequence[ModelCall],
        frames_per_block: int,
        frame_seq_length: int,
        attention_frames: int = ROLLING_ATTENTION_FRAMES,
        cache_frames: int = ROLLING_CACHE_FRAMES,
    ):
        self.calls = calls
        self.frames_per_block = frames_per_block
        self.frame_seq_length = frame_seq_length
        self.attention_frames = attention_frames
        self.clean_capacity = cache_frames - frames_per_block
        self.anchor: tuple[torch.Tensor, torch.Tensor] | None = None  # k before RoPE, v
        self.clean: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # frame: k after RoPE, v
        self.runs: list[KeyRun] = []
        self.grid: tuple[int, int, int] | None = None
        self._labels: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin_call(self, index: int, call: ModelCall) -> None:
        self.call = call
        self.runs = rolling_keys(self.calls, index, self.frames_per_block, self.attention_frames)

    def angles(self, head_dim, grid, start_frame, device):
        self.grid = grid  # the anchor's spatial RoPE follows the call's frame grid
        return super().angles(head_dim, grid, start_frame, device)

    def _write(self, k: torch.Tensor, v: torch.Tensor, k_raw: torch.Tensor) -> None:
        t, call = self.frame_seq_length, self.call
        if call.start == 0:
            self.anchor = (k_raw[:, : self.frames_per_block * t], v[:, : self.frames_per_block * t])
            return
        for i, frame in enumerate(range(call.start, call.end)):
            rows = slice(i * t, (i + 1) * t)
            self.clean[frame] = (k[:, rows], v[:, rows])
        for frame in sorted(self.clean)[: max(0, len(self.clean) - self.clean_capacity)]:
            del self.clean[frame]

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
                anchor_k, run_v = self.anchor
                head_dim = anchor_k.shape[-1]
                grid = (run.frames, self.grid[1], self.grid[2])
                run_k = apply_rope(anchor_k, rope_angles(head_dim, grid, run.position, k.device))
                run_k = run_k.to(k.dtype)
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
    model, calls: Sequence[ModelCall], frames_per_block: int, frame_seq_length: int
) -> list[RollingKVCache]:
    """One Rolling Forcing cache per layer of `model` (its tensors follow the calls' device and
    dtype)."""
    return [
        RollingKVCache(calls, frames_per_block, frame_seq_length)
        for _ in range(model.config.num_layers)
    ]
