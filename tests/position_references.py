"""An independent reference of the position policies on sinkscope's Wan model: the oracle of
tests/test_position_caches.py.

Written from the facts (../shared/reference/long-video-family.md: Infinity-RoPE, Rolling-Sink,
LoL, Krea Realtime), without sinkscope's KV caches, rollout, RoPE module or `cache_choices`. Every
layer remembers, per latent frame, the keys before RoPE and the values of the last call that
wrote it (a past frame's last writer is its block's cache-update pass: checked at every read),
and every model call's self-attention is a softmax in float64 over an explicit list of key
entries built afresh from the policy's rule for that call:

    (frame whose key and value it is, token inside the frame, temporal RoPE position,
     kind: own | recent | sink | replayed, logit bias)

RoPE is applied here at each entry's position, each head with its own temporal base (LoL's
jitter; Wan's 10000 otherwise). Keys and queries are rounded to the model dtype after RoPE, as
a cache stores them. Only the model's projections and qk-norms are sinkscope's, and the sampler
and RoPE tables are tests/released_caches.py's (`run_sampler`, `_patched_self_attention`,
`Rope`), themselves independent of sinkscope.

Policies (`Position.kind`), blocks of F frames, budgets B in frames (own block included):
- `relative` (Infinity-RoPE): block 0 sees its own frames at 0..F-1; later blocks see [sinks |
  the newest non-sink frames | own block] within B at positions 0 .. n-1 in that order. The sinks'
  keys are the ones block 0's cache-update pass stored with RoPE at 0..S-1, never rotated again;
  the other past keys get RoPE at their position at every call.
- `replay` (Rolling-Sink): the window of the B newest frames at their own positions; a past
  slot at position p has been overwritten once the cache-update pass of the block after p's
  block (starting at s) is over, if s >= B: then it holds the clean key (RoPE at p) and value of
  the frame the zigzag walk over frames 0 .. R-1 (R = B - F) puts at p: positions R, R+1, ...
  hold R-1, R-2, ..., 0, 0, 1, ..., R-1, R-1, R-2, ...
- `head_jitter` (LoL): the sink window (S sinks, the newest frames, own block, B in all) at own
  positions, head h's temporal base 10000 (1 + strength u_h), u evenly spaced in (-1, 1):
  -1 + 1/H, ..., 1 - 1/H.
- `logit_bias` (Krea): the sink window with log(b) added to the logits of every past frame but
  frame 0.
A sink frame is labelled `sink` in its own block too (sinkscope's convention for sink windows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .released_caches import Rope, _patched_self_attention, run_sampler

KINDS = ("own", "recent", "sink", "replayed")


@dataclass(frozen=True)
class Position:
    """kind: relative | replay | head_jitter | logit_bias; window: B frames (own block
    included); sinks: S; strength: head_jitter's; bias: logit_bias's b."""

    kind: str
    window: int
    sinks: int = 0
    strength: float = 0.0
    bias: float = 1.0


def zigzag(position: int, span: int) -> int:
    """The frame Rolling-Sink replays at `position`: the walk R-1, ..., 0, 0, ..., R-1 from R."""
    assert position >= span, "Rolling-Sink replays only positions from R on"
    walk = list(range(span - 1, -1, -1)) + list(range(span))
    return walk[(position - span) % len(walk)]


def head_thetas(settings: Position, heads: int) -> list[float]:
    if settings.kind != "head_jitter":
        return [10000.0] * heads
    u = np.linspace(-1 + 1 / heads, 1 - 1 / heads, heads)
    return [10000.0 * (1 + settings.strength * float(x)) for x in u]


def visible(settings: Position, c: int, f: int) -> list[tuple[int, int, str]]:
    """(frame, temporal position, kind) of every key frame the block of f frames at frame c
    sees, in cache order."""
    s, B, S = settings, settings.window, settings.sinks
    own = list(range(c, c + f))
    if s.kind == "relative":
        if c == 0:
            return [(j, j, "sink" if j < S else "own") for j in own]
        recent = min(c - S, B - f - S)
        past = list(range(c - recent, c))
        rows = [(j, j, "sink") for j in range(S)]
        rows += [(j, S + i, "recent") for i, j in enumerate(past)]
        return rows + [(j, S + recent + i, "own") for i, j in enumerate(own)]
    if s.kind == "replay":
        rows = []
        for p in range(max(0, c + f - B), c):
            after = (p // f + 1) * f  # the block after p's: its cache pass overwrites p's slot
            if B <= after < c:
                rows.append((zigzag(p, B - f), p, "replayed"))
            else:
                rows.append((p, p, "recent"))
        return rows + [(j, j, "own") for j in own]
    # head_jitter, logit_bias: LongLive's sink window at the frames' own positions
    past = list(range(c)) if c + f <= B else [*range(S), *range(c - (B - S - f), c)]
    rows = [(j, j, "sink" if j < S else "recent") for j in past]
    return rows + [(j, j, "sink" if j < S else "own") for j in own]


class HeadRope:
    """Wan's 3D RoPE with a temporal base per head (the height and width axes Wan's)."""

    def __init__(self, head_dim: int, thetas: list[float]):
        self.base = Rope(head_dim)
        self.temporal = [Rope(head_dim, theta=float(t)).tables[0] for t in thetas]

    def rotation(self, positions: list[int], tokens: list[int], width: int) -> torch.Tensor:
        """complex128 [n, heads, d/2]."""
        base = self.base.rotation(positions, tokens, width)
        out = base.expand(-1, len(self.temporal), -1).clone()
        pairs = self.base.temporal_pairs
        index = torch.as_tensor(positions, dtype=torch.long)
        for head, table in enumerate(self.temporal):
            out[:, head, :pairs] = table[index]
        return out


@dataclass
class Layer:
    """One layer: per frame the last writer's keys before RoPE, values and call kind; the sink
    keys `relative` stored; the record of every call."""

    layer: int
    settings: Position
    rope: HeadRope
    latest: dict = field(default_factory=dict)  # frame -> (k_raw [T, H, D], v, call kind)
    sink_keys: dict = field(default_factory=dict)  # frame -> post-RoPE key (relative)
    record: dict = field(default_factory=dict)  # (block, pass, layer) -> per key token rows
    call: tuple[int, int, str] = (0, 0, "denoise")

    def attend(self, q, k, v, start_frame: int, grid, attention: str) -> torch.Tensor:
        s = self.settings
        block, pass_index, kind = self.call
        f, _, width = grid
        T = q.shape[0] // f
        c = start_frame
        for i in range(f):
            rows = slice(i * T, (i + 1) * T)
            self.latest[c + i] = (k[rows], v[rows], kind)
        plan = visible(s, c, f)
        tokens = list(range(T))

        def rotate(x, position):
            return Rope.apply(x, self.rope.rotation([position] * T, tokens, width))

        own_positions = [p for frame, p, _ in plan if frame >= c]
        assert len(own_positions) == f
        q_post = torch.cat([rotate(q[i * T : (i + 1) * T], p) for i, p in enumerate(own_positions)])
        keys, values, rows = [], [], []
        for frame, position, why in plan:
            raw, value, writer = self.latest[frame]
            if frame < c:
                assert writer == "cache", f"frame {frame} was last written by a {writer} pass"
            if s.kind == "relative" and why == "sink" and c > 0:
                key = self.sink_keys[frame]  # stored at block 0's cache pass, never turned
            else:
                key = rotate(raw, position)
            if s.kind == "relative" and c == 0 and kind == "cache" and frame < s.sinks:
                self.sink_keys[frame] = key
            biased = s.kind == "logit_bias" and 0 < frame < c and s.bias != 1
            bias = math.log(s.bias) if biased else 0.0
            keys.append(key)
            values.append(value)
            rows += [(frame, token, position, why, bias) for token in tokens]
        self.record[block, pass_index, self.layer] = rows
        keys, values = torch.cat(keys), torch.cat(values)
        bias = torch.tensor([row[4] for row in rows], dtype=torch.float64)
        q64, k64, v64 = q_post.double(), keys.double(), values.double()
        logits = torch.einsum("qhd,khd->hqk", q64, k64) / math.sqrt(q.shape[-1]) + bias
        p = torch.softmax(logits, dim=-1)
        return torch.einsum("hqk,khd->qhd", p, v64).to(q.dtype)


@dataclass
class Result:
    latents: torch.Tensor
    layers: list[Layer]

    def rows(self, block: int, pass_index: int, layer: int) -> list[tuple]:
        """(frame, token, position, kind, bias) of every key token the call attended, in order."""
        return self.layers[layer].record[block, pass_index, layer]


@torch.no_grad()
def reference_rollout(model, text, geometry, seed: int, settings: Position) -> Result:
    """Clean latents [1, C, F, H, W] (float32) of a Self-Forcing rollout under `settings`, its
    attention from the explicit key lists (float64)."""
    cfg = model.config
    if geometry.independent_first_frame or geometry.num_frames % geometry.frames_per_block:
        raise ValueError("the reference runs equal blocks")
    if settings.kind == "relative" and settings.sinks > geometry.frames_per_block:
        raise ValueError("relative: the sinks are frames of the first block")
    rope = HeadRope(cfg.head_dim, head_thetas(settings, cfg.num_heads))
    layers = [Layer(i, settings, rope) for i in range(cfg.num_layers)]
    with _patched_self_attention(model, "float64"):
        latents = run_sampler(model, text, geometry, seed, layers)
    return Result(latents, layers)
