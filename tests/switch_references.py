"""An independent reference of prompt switches on sinkscope's Wan model: the oracle of
tests/test_switches_rollout.py.

Written from the facts (../shared/reference/long-video-family.md: "LongLive", "Infinity-RoPE"),
without sinkscope's KV caches, rollout, schedules, segments or RoPE module. Every layer remembers,
per latent frame, the latest key before RoPE and value written for it and which kind of call
wrote it; every call's self-attention is a float64 softmax over an explicit list of key entries
(frame, token, temporal RoPE position, kind) built afresh from the method's rule:

- LongLive (`Switching("sink_window", B, S, recache, global_sink)`, absolute positions; B = -1:
  no window): a block at c with f frames sees every earlier frame while c + f <= B, else [the
  sink frames | the B - S - f newest frames | its own]. A switch acts at the first block start
  at or after the segment's start. Before that block (with recache) one clean call (t = 0, the
  NEW prompt, output discarded, no noise drawn) re-encodes the clean outputs c - n .. c - 1,
  n = min(B, c), at their own positions, and sees the cache after its own write:
  - c <= B: frames 0 .. c - 1, all rewritten (sinks too, whatever global_sink);
  - c > B, global_sink: [the sink frames' old keys | new c - (B - S) .. c - 1]; the keys of
    c - B .. c - B + S - 1 are dropped;
  - c > B, no global_sink: [new c - B .. c - 1]; frames c - B .. c - B + S - 1 are the sinks from
    then on.
- Infinity-RoPE (`Switching("relative", B, S)`): tests/position_references.py's `relative`
  key lists, except that the first block of a segment that follows a cut sits at positions
  cut .. cut + f - 1 in all its calls, the sinks and the cached frames at theirs.
Every call's cross-attention reads its segment's text (the cross-attention cache reset). The
sampler is Self-Forcing's, noise drawn as tests/released_caches.py draws it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .released_caches import Rope, _patched_self_attention, model_timesteps, sigma_of


@dataclass(frozen=True)
class Switching:
    """kind: sink_window (LongLive's cache; B = -1 the full cache) or relative (Infinity-RoPE);
    window B frames (own block included), sinks S; LongLive's recache and global_sink."""

    kind: str
    window: int
    sinks: int = 0
    recache: bool = False
    global_sink: bool = True


def acting_frames(starts: list[int], frames: int, per_block: int) -> list[int]:
    """The block start where each segment after the first acts, as LongLive's loop switches:
    at each block start c, one switch when c reaches the next segment's start."""
    acting, pending = [], list(starts[1:])
    for c in range(0, frames, per_block):
        if pending and c >= pending[0]:
            acting.append(c)
            pending.pop(0)
    return acting


@dataclass
class Layer:
    layer: int
    settings: Switching
    rope: Rope
    latest: dict = field(default_factory=dict)  # frame -> (k_raw, v, writer kind)
    sink_frames: list = field(default_factory=list)
    sink_keys: dict = field(default_factory=dict)  # relative: frame -> post-RoPE key
    record: dict = field(default_factory=dict)
    call: tuple = (0, 0, "denoise", None)  # (block, pass, kind, cut)

    def plan(self, c: int, f: int, kind: str) -> list[tuple[int, int, str]]:
        """(frame, position, kind) of the keys, in cache order; the own frames last."""
        s, B, S = self.settings, self.settings.window, self.settings.sinks
        own = list(range(c, c + f))
        if s.kind == "relative":
            cut = self.call[3]
            if c == 0:
                return [(j, j, "sink" if j < S else "own") for j in own]
            recent = min(c - S, B - f - S)
            rows = [(j, j, "sink") for j in range(S)]
            rows += [(j, S + i, "recent") for i, j in enumerate(range(c - recent, c))]
            first = S + recent if cut is None else cut
            return rows + [(j, first + i, "own") for i, j in enumerate(own)]
        if kind == "recache":  # the cache after the recache's own write
            if B == -1 or c + f <= B:
                return [(j, j, "sink" if j in self.sink_frames else "own") for j in own]
            if s.global_sink and S:
                rows = [(j, j, "sink") for j in self.sink_frames]
                return rows + [(j, j, "own") for j in own[S:]]
            return [(j, j, "sink" if j in self.sink_frames else "own") for j in own]
        if B == -1 or c + f <= B:
            past = list(range(c))
        else:
            past = [*self.sink_frames, *range(c - (B - S - f), c)]
        rows = [(j, j, "sink" if j in self.sink_frames else "recent") for j in past]
        return rows + [(j, j, "sink" if j in self.sink_frames else "own") for j in own]

    def attend(self, q, k, v, start_frame: int, grid, attention: str) -> torch.Tensor:
        s = self.settings
        block, pass_index, kind, _ = self.call
        f, _, width = grid
        T = q.shape[0] // f
        c = start_frame
        if kind == "recache" and s.kind == "sink_window":
            self._recache_sinks(c, f)
        kept = range(c, c + f)
        if kind == "recache" and s.global_sink and s.sinks and s.window != -1 and c + f > s.window:
            kept = range(c + s.sinks, c + f)  # the keys bound for the sink slots are dropped
        for i in range(f):
            if c + i in kept:
                rows = slice(i * T, (i + 1) * T)
                self.latest[c + i] = (k[rows], v[rows], kind)
        if s.kind == "sink_window" and c == 0 and not self.sink_frames:
            self.sink_frames = list(range(s.sinks))
        plan = self.plan(c, f, kind)
        tokens = list(range(T))

        def rotate(x, position):
            return Rope.apply(x, self.rope.rotation([position] * T, tokens, width))

        own_positions = [p for frame, p, _ in plan if frame >= c]
        if kind == "recache" and s.global_sink and s.sinks and s.window != -1 and c + f > s.window:
            own_positions = list(range(c, c + f))  # every query at its own position
        q_post = torch.cat([rotate(q[i * T : (i + 1) * T], p) for i, p in enumerate(own_positions)])
        keys, values, rows = [], [], []
        for frame, position, why in plan:
            raw, value, writer = self.latest[frame]
            if frame < c:
                assert writer in ("cache", "recache"), f"frame {frame} last written by {writer}"
            if s.kind == "relative" and why == "sink" and c > 0:
                key = self.sink_keys[frame]
            else:
                key = rotate(raw, position)
            if s.kind == "relative" and c == 0 and kind == "cache" and frame < s.sinks:
                self.sink_keys[frame] = key
            keys.append(key)
            values.append(value)
            rows += [(frame, token, position, why) for token in tokens]
        self.record[block, pass_index, kind, self.layer] = rows
        keys, values = torch.cat(keys), torch.cat(values)
        q64, k64, v64 = q_post.double(), keys.double(), values.double()
        logits = torch.einsum("qhd,khd->hqk", q64, k64) / math.sqrt(q.shape[-1])
        p = torch.softmax(logits, dim=-1)
        return torch.einsum("hqk,khd->qhd", p, v64).to(q.dtype)

    def _recache_sinks(self, c: int, f: int) -> None:
        """Before the write of a recache of frames c .. c + f - 1: without global_sink, past the
        window, its first S frames become the sinks (with it, the sinks keep their keys: no
        recache past the window writes frames 0 .. S - 1)."""
        s = self.settings
        if s.window != -1 and c + f > s.window and s.sinks and not s.global_sink:
            self.sink_frames = list(range(c, c + s.sinks))


@dataclass
class Result:
    latents: torch.Tensor
    layers: list[Layer]

    def rows(self, block: int, pass_index: int, kind: str, layer: int) -> list[tuple]:
        return self.layers[layer].record[block, pass_index, kind, layer]


@torch.no_grad()
def reference_switching(
    model,
    texts: torch.Tensor,
    geometry,
    seed: int,
    settings: Switching,
    starts: list[int],
    cuts: list[int | None] = (),
    steps=(1000, 750, 500, 250),
) -> Result:
    """Clean latents (float32) of a Self-Forcing rollout of a prompt whose segment i (text
    texts[i]) starts at latent frame starts[i]; cuts[i]: Infinity-RoPE's cut into segment i + 1."""
    cfg = model.config
    f = geometry.frames_per_block
    if geometry.independent_first_frame or geometry.num_frames % f:
        raise ValueError("the reference runs equal blocks")
    rope = Rope(cfg.head_dim)
    layers = [Layer(i, settings, rope) for i in range(cfg.num_layers)]
    switches = acting_frames(starts, geometry.num_frames, f)
    shape = (1, geometry.channels, geometry.num_frames, geometry.latent_height,
             geometry.latent_width)  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(shape, generator=generator)
    embedded = model.embed_text(texts)
    timesteps = model_timesteps(steps)
    output = torch.empty(shape, dtype=torch.float32)
    with _patched_self_attention(model, "float64"):
        for block, c in enumerate(range(0, geometry.num_frames, f)):
            segment = sum(1 for switch in switches if switch <= c)
            text = embedded[segment : segment + 1]
            cut = None
            if c in switches:
                cut = list(cuts)[switches.index(c)] if switches.index(c) < len(cuts) else None
                if settings.recache:
                    n = c if settings.window == -1 else min(settings.window, c)
                    for state in layers:
                        state.call = (block, "recache", "recache", None)
                    tt = torch.zeros((1, n))
                    model(output[:, :, c - n : c], tt, text, kv_caches=layers, start_frame=c - n,
                          text_embedded=True)  # fmt: skip
            x = noise[:, :, c : c + f]
            x0 = x
            for p, t in enumerate([*timesteps, 0.0]):
                kind = "denoise" if p < len(timesteps) else "cache"
                for state in layers:
                    state.call = (block, p, kind, cut)
                tt = torch.full((1, f), t, dtype=torch.float32)
                if kind == "cache":
                    model(x0, tt, text, kv_caches=layers, start_frame=c, text_embedded=True)
                    continue
                velocity = model(x, tt, text, kv_caches=layers, start_frame=c, text_embedded=True)
                x0 = (x.double() - sigma_of(t) * velocity.double()).float()
                if p + 1 < len(timesteps):
                    sigma_next = sigma_of(timesteps[p + 1])
                    fresh = torch.randn(x0.shape, generator=generator)
                    x = (1 - sigma_next) * x0 + sigma_next * fresh
            output[:, :, c : c + f] = x0
    return Result(output, layers)
