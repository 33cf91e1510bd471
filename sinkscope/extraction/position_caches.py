"""The caches of the position policies (`cache_choices.POSITION_POLICIES`): where keys and queries
sit in RoPE, which frame a slot holds, and how much the queries weigh the past, as the released
code of each method runs it (facts: long-video-family.md; no code of theirs is copied).

- `RelativeKVCache`: Infinity-RoPE's cache, positions relative to the window (bounded by B);
- `ReplayKVCache`: Rolling-Sink's window whose slots replay the first frames, back and forth;
- `HeadJitterKVCache`: LongLive's sink window with a per-head temporal RoPE base (LoL's fix);
- `LogitBiasKVCache`: the sink window with Krea's bias log(b) on the logits of past frames.

`update` returns the absolute token of each key's content (a replayed slot: its source frame's
tokens, so a frame can appear twice); `key_labels` gives the RoPE position the queries see it at
and why it is there (`cache_choices.KEY_KINDS`). Budgets B count frames, own block included.
"""

from __future__ import annotations

import math

import torch

from sinkscope.cache_choices import KEY_KIND, jitter_thetas, replay_frames
from sinkscope.wan.model import CacheEngine, KVCache
from sinkscope.wan.rope import apply_rope, head_angles, rope_angles


class RelativeKVCache(CacheEngine):
    """Infinity-RoPE's cache (window B frames including the query block, S sink frames; released
    with B = 6, S = 1): every call sees [sinks | newest non-sink frames | own block] within B (block
    0 its own frames only) and RoPE puts them at positions 0 .. n-1 in that order, so queries and
    own keys take the last positions, min(c, B - f) onward for the block of f frames at c: no
    position ever reaches B. Non-sink keys are cached before RoPE and given RoPE (every axis) at
    their position at each call; the sinks' keys are stored once with RoPE at positions 0..S-1,
    from block 0's last (cache-update) pass, and never turned. The cache-update pass sees the same
    keys at the same positions as the denoising passes and only replaces the block's keys and
    values with clean ones. The sinks are the first block's frames: S may not exceed it.

    With B at least the video's frames every position is the frame's own, and the rollout is the
    full cache's, bit for bit, whatever S (the same RoPE of the same keys before RoPE).

    Infinity-RoPE's scene cut (a call with `rope_cut`): the block's queries and own keys sit at
    rope_cut .. rope_cut + f - 1 in all its passes, the sinks and the cached frames at theirs."""

    runs_cut = True

    def __init__(
        self,
        *,
        budget: int,
        sink_frames: int,
        frame_seq_length: int,
        num_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        if budget < sink_frames + 1:
            raise ValueError(
                f"relative: a window of {budget} frames cannot hold {sink_frames} sinks"
            )
        t = self.frame_seq_length = frame_seq_length
        self.budget, self.sink_frames = budget, sink_frames
        self.sink_tokens = sink_frames * t
        shape = (1, self.sink_tokens, num_heads, head_dim)
        self.sink_k = torch.zeros(shape, device=device, dtype=dtype)  # post-RoPE, positions 0..S-1
        self.sink_v = torch.zeros_like(self.sink_k)
        # Keys before RoPE and values of the newest non-sink frames, own block included.
        shape = (1, (budget - sink_frames) * t, num_heads, head_dim)
        self.raw = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.raw)
        self.first = self.held_end = self.sink_tokens  # tokens [first, held_end) are in `raw`
        self.global_end = 0
        self.grid: tuple[int, int] | None = None
        self.shift = 0  # an own frame f sat at position f - shift in the last call
        self.recent_shift = 0  # and a cached non-sink frame f at f - recent_shift
        self.cut: int | None = None  # the current call's RoPE cut

    def begin_call(self, index: int, call) -> None:
        super().begin_call(index, call)
        self.cut = call.rope_cut

    def query_position(self, start_frame: int, frames: int) -> int:
        """RoPE position of the first query frame of the block of `frames` at `start_frame`."""
        if self.cut is not None:
            return self.cut
        return min(start_frame, self.budget - frames)

    def angles(self, head_dim, grid, start_frame, device):
        self.grid = tuple(grid[1:])
        return rope_angles(head_dim, grid, self.query_position(start_frame, grid[0]), device)

    def update(self, k, v, current_start, *, q=None, k_raw=None):
        if k_raw is None:
            raise ValueError("relative caches the keys before RoPE: k_raw is needed")
        t, n, sinks = self.frame_seq_length, k.shape[1], self.sink_tokens
        end = current_start + n
        if current_start == 0 and n < sinks:
            raise ValueError(
                f"relative: {self.sink_frames} sink frames do not fit in the first block of "
                f"{n // t} frames"
            )
        if end > self.global_end:  # a new block: drop the oldest non-sink frames that leave
            if self.held_end != max(current_start, sinks):
                raise RuntimeError(f"relative: block at token {current_start} is not the next")
            drop = max(
                0,
                self.held_end - self.first + (end - max(current_start, sinks)) - self.raw.shape[1],
            )
            keep = self.held_end - self.first - drop
            self.raw[:, :keep] = self.raw[:, drop : drop + keep].clone()
            self.v[:, :keep] = self.v[:, drop : drop + keep].clone()
            self.first += drop
            self.held_end = end
            self.global_end = end
        if current_start < sinks:  # block 0: the sinks' keys as RoPE gave them, at 0..S-1
            self.sink_k.copy_(k[:, :sinks])
            self.sink_v.copy_(v[:, :sinks])
        own = max(current_start, sinks)
        slots = slice(own - self.first, end - self.first)
        self.raw[:, slots] = k_raw[:, own - current_start :]
        self.v[:, slots] = v[:, own - current_start :]
        frames = n // t
        position = self.query_position(current_start // t, frames)
        self.shift = current_start // t - position
        self.recent_shift = self.first // t - self.sink_frames
        device = k.device
        tokens = torch.arange(current_start, end, device=device)
        if current_start == 0:
            return k, v, tokens
        past = current_start - self.first  # non-sink tokens before the block
        recent = self.raw[:, :past]
        if past:  # RoPE at positions S .. S + past frames - 1
            angles = rope_angles(k.shape[-1], (past // t, *self.grid), self.sink_frames, device)
            recent = apply_rope(recent, angles)
        keys = torch.cat([self.sink_k, recent, k], dim=1)
        values = torch.cat([self.sink_v, self.v[:, :past], v], dim=1)
        tokens = torch.cat(
            [
                torch.arange(sinks, device=device),
                torch.arange(self.first, current_start, device=device),
                tokens,
            ]
        )
        return keys, values, tokens

    def key_labels(self, key_tokens, query_start):
        positions, kinds = super().key_labels(key_tokens, query_start)
        sink = key_tokens < self.sink_tokens
        own = key_tokens >= query_start
        shifted = torch.where(own, positions - self.shift, positions - self.recent_shift)
        positions = torch.where(sink, positions, shifted)
        return positions, torch.where(sink, KEY_KIND["sink"], kinds)


class ReplayKVCache(KVCache):
    """Rolling-Sink's cache: a rolling window of B frames (own block included, no sinks) at
    absolute positions, whose slots replay the video's first frames. The clean keys before RoPE
    and values of frames 0 .. R-1 are kept, R = B - b (b the frames of a block; the release's
    21 - 3 = 18). At the cache-update pass of each block starting at s >= B, after that pass's
    attention, the slots of the previous block (positions p = s - b' .. s - 1, b' its frames) get
    the clean key and value of frame `cache_choices.replay_frames(p, R)`, the key given RoPE at
    p: the release's r(p) with its 36 = 2R and 18 = R, generalised so. Replays stay until the
    window evicts them. The overwrite is made at the next block's first call, before it reads
    anything (nothing reads in between). With B not a multiple of b, the first replayed
    position is the first block start >= B less b, so at least R."""

    def __init__(self, *args, span: int, **kwargs):
        super().__init__(*args, **kwargs)
        if span < 1:
            raise ValueError(f"replay: a span of {span} frames has nothing to replay")
        self.span = span
        self.kept_raw = self.k.new_zeros((1, span * self.frame_seq_length, *self.k.shape[2:]))
        self.kept_v = torch.zeros_like(self.kept_raw)
        self.starts: list[int] = []  # first frame of every block so far
        self.source: dict[int, int] = {}  # replayed position -> the frame its slot holds
        self.positions = self.slot_token[:0]  # the last call's visible slots' token positions
        self.grid: tuple[int, int] | None = None

    def angles(self, head_dim, grid, start_frame, device):
        self.grid = tuple(grid[1:])
        return super().angles(head_dim, grid, start_frame, device)

    def _replay(self) -> None:
        """The previous block's cache-update pass is over: if it started at >= B, the slots of
        the block before it replay frames r(p)."""
        if len(self.starts) < 2 or self.starts[-1] < self.local_attn_size:
            return
        t = self.frame_seq_length
        first, stop = self.starts[-2], self.starts[-1]
        held = self.slot_token[: self.local_end]
        slots = torch.nonzero((held >= first * t) & (held < stop * t)).flatten()
        if not len(slots):
            return
        start = int(held[slots[0]]) // t
        positions = list(range(start, stop))
        sources = replay_frames(positions, self.span).tolist()
        raw = torch.cat([self.kept_raw[:, s * t : (s + 1) * t] for s in sources], dim=1)
        value = torch.cat([self.kept_v[:, s * t : (s + 1) * t] for s in sources], dim=1)
        height, width = self.grid
        angles = rope_angles(self.k.shape[-1], (len(positions), height, width), start, raw.device)
        self.k[:, slots] = apply_rope(raw, angles)
        self.v[:, slots] = value
        self.source.update(zip(positions, sources, strict=True))

    def update(self, k, v, current_start, *, q=None, k_raw=None):
        t = self.frame_seq_length
        n = k.shape[1]
        if current_start + n > self.global_end:
            self._replay()
            self.starts.append(current_start // t)
        kept = min(n, self.span * t - current_start)
        if kept > 0:  # frames 0 .. R-1: the last write (the cache-update pass) is the clean key
            if k_raw is None:
                raise ValueError("replay keeps the first frames' keys before RoPE: k_raw needed")
            self.kept_raw[:, current_start : current_start + kept] = k_raw[:, :kept]
            self.kept_v[:, current_start : current_start + kept] = v[:, :kept]
        keys, values, positions = super().update(k, v, current_start)
        self.positions = positions.clone()
        frames = positions // t
        source = torch.tensor(
            [self.source.get(int(f), int(f)) for f in frames[::t]], device=positions.device
        )
        return keys, values, source.repeat_interleave(t) * t + positions % t

    def key_labels(self, key_tokens, query_start):
        if key_tokens.shape != self.positions.shape:
            raise RuntimeError("replay labels the keys of its last call only")
        t = self.frame_seq_length
        positions = self.positions // t
        # Slots hold whole frames: one look-up a frame, not a token.
        replayed = torch.tensor(
            [int(p) in self.source for p in positions[::t].tolist()], device=positions.device
        ).repeat_interleave(t)
        kinds = torch.where(self.positions >= query_start, KEY_KIND["own"], KEY_KIND["recent"])
        return positions, torch.where(replayed, KEY_KIND["replayed"], kinds)


class HeadJitterKVCache(KVCache):
    """LongLive's sink window (B, S) with LoL's fix against sink collapse: a per-head jitter of
    the temporal RoPE base, on queries and keys alike (`cache_choices.jitter_thetas`: head h of H
    gets 10000 (1 + strength u_h), u_h = 2 (h + 0.5) / H - 1); height and width keep Wan's base.
    LoL's exact form is not published (its paper: a per-head jitter of the base frequency,
    strength about 0.8, on all heads): this spread is sinkscope's. Strength 0 is the sink window,
    bit for bit (Wan's own angles)."""

    def __init__(self, *args, strength: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.strength = strength
        self.thetas = torch.from_numpy(jitter_thetas(self.k.shape[2], strength))

    def angles(self, head_dim, grid, start_frame, device):
        if self.strength == 0:
            return super().angles(head_dim, grid, start_frame, device)
        return head_angles(head_dim, grid, start_frame, device, self.thetas)


class LogitBiasKVCache(KVCache):
    """The sink window (B, S) with Krea Realtime's attention bias: log(b) is added to the logits
    of every visible key whose frame is neither frame 0 nor in the query block, so the softmax
    weighs those frames b times less (a public port of Krea: b = 0.3). b = 1 adds nothing (no
    bias at all: the sink window, bit for bit). Krea's own cache is [first frame | last 2 frames]
    at positions 0..2, the block at 3..5 (what `relative` keeps at B = 6, S = 1); here the bias
    sits on the absolute-position sink window instead."""

    def __init__(self, *args, bias: float, **kwargs):
        super().__init__(*args, **kwargs)
        if not 0 < bias <= 1:
            raise ValueError(f"logit_bias: b must lie in (0, 1], got {bias}")
        self.bias = bias

    def logit_bias(self, key_tokens, query_start):
        if self.bias == 1:
            return None
        past = (key_tokens >= self.frame_seq_length) & (key_tokens < query_start)
        zero = torch.zeros((), dtype=torch.float32, device=key_tokens.device)
        return torch.where(past, torch.tensor(math.log(self.bias), device=key_tokens.device), zero)
