"""An independent reference of the KV-cache policies that Deep Forcing released, on sinkscope's
Wan model: the oracle of tests/test_released_caches.py.

Written from Deep Forcing's released code (Nizben/Spectral_C @ ea9961aa: `causal_model_DS.py`,
Deep Sink; `causal_model.py`, Participative Compression with Deep Sink under it; facts in
../shared/reference/long-video-family.md), without sinkscope's KV caches, rollout, RoPE or
`cache_choices`: every layer keeps an explicit, ordered list of key entries, each labelled

    (latent frame, token index inside the frame, block and pass that wrote it,
     temporal RoPE position its stored key encodes, top-C selection count)

and every model call's self-attention is a softmax over exactly that list (float64 by default),
with RoPE applied here at each entry's own position. Only the model's projections and qk-norms
are sinkscope's (`_patched_self_attention` replaces the self-attention's forward for the
duration of a rollout); the sampler is written here again (Self-Forcing's few-step schedule).

Policies (`PolicySettings.kind`): `full`, `window` (Self-Forcing++'s rolling cache),
`sink_window` (LongLive's cache: 12 frames, 3 sinks), `deep_sink` and `pc` (with Deep Sink under
it, `sink_turn=True`, as released, or the sinks kept at their own positions). Sink keys turn
(`turn_mode`) as Deep Forcing's code (`delta`: the stored post-RoPE key's temporal channels
multiplied by exp(i w delta) in float64, cumulatively, one rounding to the storage dtype per
turn) or as Rolling Forcing keeps its anchor (`rerope`: full RoPE at the target position on the
stored pre-RoPE key).
"""

from __future__ import annotations

import contextlib
import math
import types
from dataclasses import dataclass, field

import numpy as np
import torch

NUM_TRAIN_TIMESTEPS = 1000
RELEASE_CACHE_FRAMES = 21  # the constant `21` of Deep Forcing's first PC turn (21 - Budget)


# --------------------------------------------------------------------------------------------
# RoPE, written from Wan's definition: head_dim d = d_t + d_h + d_w real channels with
# d_h = d_w = 2 (d // 6), d_t = d - 4 (d // 6); channel pairs (2i, 2i + 1) are one complex
# number; the axis of length d_a rotates pair i by pos * theta^(-2i / d_a). Computed in float64.
# --------------------------------------------------------------------------------------------


class Rope:
    def __init__(self, head_dim: int, positions: int = 1024, theta: float = 10000.0):
        spatial = 2 * (head_dim // 6)
        self.dims = (head_dim - 2 * spatial, spatial, spatial)
        self.tables = []
        for dim in self.dims:
            # Wan's rope_params: the reciprocal of a power (theta^-e differs in the last bit)
            exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
            frequencies = 1.0 / torch.pow(theta, exponents)
            angles = torch.outer(torch.arange(positions, dtype=torch.float64), frequencies)
            self.tables.append(torch.polar(torch.ones_like(angles), angles))
        self.temporal_pairs = self.dims[0] // 2

    def rotation(self, positions: list[int], tokens: list[int], width: int) -> torch.Tensor:
        """complex128 [n, 1, d/2] for tokens at temporal `positions`, token index `tokens`
        inside their frame (row-major over a grid of `width` columns)."""
        pos = torch.as_tensor(positions, dtype=torch.long)
        tok = torch.as_tensor(tokens, dtype=torch.long)
        if int(pos.max()) >= self.tables[0].shape[0] or int(pos.min()) < 0:
            raise ValueError(f"temporal positions {int(pos.min())}..{int(pos.max())} off the table")
        t, h, w = self.tables
        rot = torch.cat([t[pos], h[tok // width], w[tok % width]], dim=-1)
        return rot[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """x [n, heads, d] rotated by rot [n, 1, d/2], in float64, returned in x's dtype."""
        n, heads, d = x.shape
        pairs = torch.view_as_complex(x.to(torch.float64).reshape(n, heads, d // 2, 2))
        return torch.view_as_real(pairs * rot).reshape(n, heads, d).to(x.dtype)

    def turn_temporal(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Multiply only the temporal pairs of post-RoPE keys x [n, heads, d] by exp(i w delta),
        in float64; the spatial channels are returned untouched (bit for bit)."""
        if delta == 0:
            return x.clone()
        turn = self.tables[0][abs(delta)]
        turn = turn.conj() if delta < 0 else turn
        n, heads, _ = x.shape
        nt = self.temporal_pairs
        out = x.clone()
        pairs = torch.view_as_complex(x[..., : 2 * nt].to(torch.float64).reshape(n, heads, nt, 2))
        out[..., : 2 * nt] = torch.view_as_real(pairs * turn).reshape(n, heads, 2 * nt).to(x.dtype)
        return out


# --------------------------------------------------------------------------------------------
# Sampler: Self-Forcing's few-step flow matching (FlowMatchScheduler(shift, sigma_min=0,
# extra_one_step=True), warped steps), as sinkscope's rollout and Deep Forcing's pipeline run it.
# --------------------------------------------------------------------------------------------


def _train_table(shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    sigmas = torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas, sigmas * NUM_TRAIN_TIMESTEPS


def model_timesteps(steps=(1000, 750, 500, 250), shift=5.0, warp=True) -> list[float]:
    if not warp:
        return [float(s) for s in steps]
    _, timesteps = _train_table(shift)
    extended = torch.cat([timesteps, torch.zeros(1)])
    return [float(extended[NUM_TRAIN_TIMESTEPS - int(s)]) for s in steps]


def sigma_of(timestep: float, shift: float = 5.0) -> float:
    sigmas, timesteps = _train_table(shift)
    return float(sigmas[torch.argmin((timesteps - timestep).abs())])


# --------------------------------------------------------------------------------------------
# Policy settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicySettings:
    """kind: full | window | sink_window | deep_sink | pc.

    cache_frames: window L (window, sink_window, deep_sink: sinks and own block included) or the PC
        cache capacity (released: 21 = local_attn_size); frames of T tokens.
    sink_frames: S. budget_frames: PC's Budget (released 16). recent_frames: PC's Recent
        (released 4), own block included; also the query buffer length in frames.
    reuse_cap: PC's topc_max_reuse (released 7; 0 = no cap).
    sink_turn: deep_sink / pc: turn the sinks (Deep Sink) or keep them at their own positions.
    first_turn: the turn at the first eviction (deep_sink) / first prune (pc): "release"
        (deep_sink: 0, pc: 21 - Budget, as the code), "consistent" (g of that block: the sinks
        start at g(c) every time), or an int.
    turn_mode: "delta" (Deep Forcing) or "rerope" (Rolling Forcing).
    storage_dtype: dtype keys and values are stored in (None: the model's dtype).
    """

    kind: str
    cache_frames: int = 0
    sink_frames: int = 0
    budget_frames: int = 0
    recent_frames: int = 0
    reuse_cap: int = 7
    sink_turn: bool = True
    first_turn: str | int = "release"
    turn_mode: str = "delta"
    storage_dtype: torch.dtype | None = None

    @staticmethod
    def full() -> PolicySettings:
        return PolicySettings("full")

    @staticmethod
    def window(cache_frames: int) -> PolicySettings:
        return PolicySettings("window", cache_frames=cache_frames)

    @staticmethod
    def sink_window(cache_frames: int, sink_frames: int) -> PolicySettings:
        return PolicySettings("sink_window", cache_frames=cache_frames, sink_frames=sink_frames)

    @staticmethod
    def deep_sink(cache_frames: int, sink_frames: int, **kw) -> PolicySettings:
        return PolicySettings("deep_sink", cache_frames=cache_frames, sink_frames=sink_frames, **kw)

    @staticmethod
    def pc(
        cache_frames: int = 21,
        budget_frames: int = 16,
        sink_frames: int = 10,
        recent_frames: int = 4,
        reuse_cap: int = 7,
        **kw,
    ) -> PolicySettings:
        return PolicySettings(
            "pc",
            cache_frames=cache_frames,
            sink_frames=sink_frames,
            budget_frames=budget_frames,
            recent_frames=recent_frames,
            reuse_cap=reuse_cap,
            **kw,
        )

    def check(self, frames_per_block: int) -> None:
        kinds = ("full", "window", "sink_window", "deep_sink", "pc")
        if self.kind not in kinds:
            raise ValueError(f"kind {self.kind!r} not in {kinds}")
        if self.turn_mode not in ("delta", "rerope"):
            raise ValueError(f"turn_mode {self.turn_mode!r}")
        if self.kind in ("window", "sink_window", "deep_sink"):
            if self.cache_frames - self.sink_frames < frames_per_block:
                raise ValueError("the window must hold the sinks and the own block")
        if self.kind == "pc":
            if self.recent_frames < frames_per_block:
                # The released code then lets top-C pick tokens of the own block and later passes
                # overwrite the cache's last F x T slots, which no longer hold the own block.
                raise ValueError("PC needs Recent >= frames per block (see spec.md)")
            if self.cache_frames < frames_per_block:
                raise ValueError("PC cache smaller than a block")


LONGLIVE = PolicySettings.sink_window(12, 3)
DEEP_SINK_RELEASE = PolicySettings.deep_sink(21, 14)
PC_RELEASE = PolicySettings.pc(21, 16, 10, 4, 7)


def self_forcing_pp(cache_frames: int = 21) -> PolicySettings:
    """Self-Forcing++'s rolling cache without sinks (no code released)."""
    return PolicySettings.window(cache_frames)


# --------------------------------------------------------------------------------------------
# The explicit per-layer key list
# --------------------------------------------------------------------------------------------


@dataclass
class Entry:
    frame: int  # absolute latent frame of the token
    token: int  # index inside the frame (h * W' + w)
    written: tuple[int, int]  # (block, pass index) of the call that wrote it
    position: int  # temporal RoPE position its stored key encodes
    count: int = 0  # PC: times chosen among the top C

    def label(self) -> tuple[int, int, int, int, int]:
        return (self.frame, self.token, self.written[0], self.written[1], self.position)


@dataclass
class LayerState:
    """Everything one layer keeps: the entries and, aligned with them, the stored keys (post-RoPE
    as the policy stores them; attention reads these), the pre-RoPE keys (for `rerope`), the
    values; PC's query buffer; Deep Sink's last sink target g."""

    layer: int
    settings: PolicySettings
    rope: Rope
    T: int
    width: int
    frames_per_block: int
    storage: torch.dtype
    entries: list[Entry] = field(default_factory=list)
    k_post: torch.Tensor | None = None  # [M, heads, d] storage dtype, what attention reads
    k_pre: torch.Tensor | None = None  # [M, heads, d] storage dtype, before RoPE
    v: torch.Tensor | None = None
    q_buffer: torch.Tensor | None = None  # [m, heads, d] post-RoPE queries, model dtype
    q_sources: list[tuple[int, int, int]] = field(default_factory=list)  # (block, pass, frame)
    sink_g: int | None = None  # the g of the last turn (Deep Forcing's sink_base_abs_start_frame)
    call: tuple[int, int, str] = (0, 0, "denoise")
    recorder: Recorder | None = None

    # ---- helpers -------------------------------------------------------------------------
    @property
    def sink_tokens(self) -> int:
        s = self.settings
        return s.sink_frames * self.T if s.kind in ("sink_window", "deep_sink", "pc") else 0

    def _take(self, index: list[int]) -> None:
        idx = torch.as_tensor(index, dtype=torch.long)
        self.entries = [self.entries[i] for i in index]
        self.k_post, self.k_pre, self.v = self.k_post[idx], self.k_pre[idx], self.v[idx]

    def _append(self, entries, k_post, k_pre, v) -> None:
        self.entries = self.entries + entries
        if self.k_post is None:
            self.k_post, self.k_pre, self.v = k_post, k_pre, v
        else:
            self.k_post = torch.cat([self.k_post, k_post])
            self.k_pre = torch.cat([self.k_pre, k_pre])
            self.v = torch.cat([self.v, v])

    def _turn_sinks(self, delta: int, block: int) -> None:
        """Move the sink entries by `delta` frames (Deep Sink's in-place turn)."""
        n = min(self.sink_tokens, len(self.entries))
        if n == 0 or delta == 0:
            return
        mode = self.settings.turn_mode
        sinks = self.entries[:n]
        targets = [e.position + delta for e in sinks]
        if mode == "delta":
            self.k_post[:n] = self.rope.turn_temporal(self.k_post[:n], delta)
        else:  # rerope: full RoPE at the target position on the stored pre-RoPE key
            rot = self.rope.rotation(targets, [e.token for e in sinks], self.width)
            self.k_post[:n] = Rope.apply(self.k_pre[:n].to(torch.float64), rot).to(self.storage)
        for e, t in zip(sinks, targets, strict=True):
            e.position = t
        if self.recorder is not None:
            self.recorder.event(
                kind="turn",
                block=block,
                layer=self.layer,
                delta=delta,
                sink_positions=sorted({e.position for e in sinks}),
            )

    # ---- one self-attention call -------------------------------------------------------------
    def attend(self, q, k, v, start_frame: int, grid, attention: str) -> torch.Tensor:
        s = self.settings
        block, pass_index, kind = self.call
        frames, height, width = grid
        T = height * width
        assert T == self.T and width == self.width and frames == self.frames_per_block
        n = q.shape[0]
        frames_of = [start_frame + i // T for i in range(n)]
        tokens_of = [i % T for i in range(n)]
        rot = self.rope.rotation(frames_of, tokens_of, width)
        q_post = Rope.apply(q, rot)  # model dtype
        k_post = Rope.apply(k, rot).to(self.storage)
        k_pre = k.to(self.storage)
        v_st = v.to(self.storage)
        new = [
            Entry(f, j, (block, pass_index), f) for f, j in zip(frames_of, tokens_of, strict=True)
        ]

        if s.kind == "pc":  # every call's queries enter the buffer before anything else
            self._buffer_queries(q_post, block, pass_index, frames_of)

        if pass_index == 0:  # a new block: the only call that may evict, prune or turn
            cap = (s.cache_frames * T) if s.kind != "full" else None
            overflow = cap is not None and len(self.entries) + n > cap
            if not overflow:
                self._append(new, k_post, k_pre, v_st)
            elif s.kind == "pc":
                self._prune(new, k_post, k_pre, v_st, start_frame, block)
            else:
                self._roll(new, k_post, k_pre, v_st, start_frame, block)
        else:  # later passes and the cache-update pass rewrite the own block's entries
            own = [
                i
                for i, e in enumerate(self.entries)
                if start_frame <= e.frame < start_frame + frames
            ]
            assert own == list(range(len(self.entries) - n, len(self.entries))), (
                "the own block must be the last F x T entries"
            )
            for i, e in zip(own, new, strict=True):
                assert (self.entries[i].frame, self.entries[i].token) == (e.frame, e.token)
                self.entries[i].written = e.written
            self.k_post[own[0] :] = k_post
            self.k_pre[own[0] :] = k_pre
            self.v[own[0] :] = v_st

        if self.recorder is not None:
            self.recorder.call(block, pass_index, kind, self.layer, self.entries)
        return self._attention(q_post, attention)

    def _attention(self, q_post: torch.Tensor, attention: str) -> torch.Tensor:
        d = q_post.shape[-1]
        if attention == "float64":
            q64 = q_post.to(torch.float64)
            k64 = self.k_post.to(torch.float64)
            v64 = self.v.to(torch.float64)
            logits = torch.einsum("qhd,khd->hqk", q64, k64) / math.sqrt(d)
            p = torch.softmax(logits, dim=-1)
            return torch.einsum("hqk,khd->qhd", p, v64).to(q_post.dtype)
        # "model": the model dtype's fused kernel, as sinkscope's SelfAttention calls it
        out = torch.nn.functional.scaled_dot_product_attention(
            q_post.transpose(0, 1)[None],
            self.k_post.to(q_post.dtype).transpose(0, 1)[None],
            self.v.to(q_post.dtype).transpose(0, 1)[None],
        )
        return out[0].transpose(0, 1)

    # ---- window / sink_window / deep_sink ------------------------------------------------------
    def _roll(self, new, k_post, k_pre, v, c: int, block: int) -> None:
        s = self.settings
        cap = s.cache_frames * self.T
        n = len(new)
        sinks = self.sink_tokens
        evict = len(self.entries) + n - cap
        keep = list(range(sinks)) + list(range(sinks + evict, len(self.entries)))
        dropped = sorted({self.entries[i].frame for i in range(sinks, sinks + evict)})
        self._take(keep)
        self._append(new, k_post, k_pre, v)
        if self.recorder is not None:
            self.recorder.event(kind="evict", block=block, layer=self.layer, dropped=dropped)
        if s.kind == "deep_sink" and sinks and s.sink_turn:
            tail_frames = (len(self.entries) - sinks) // self.T  # own block included
            self._aim_sinks(c - tail_frames - s.sink_frames, block)

    # ---- Participative Compression --------------------------------------------------------------
    def _buffer_queries(self, q_post, block, pass_index, frames_of) -> None:
        limit = self.settings.recent_frames * self.T
        src = [(block, pass_index, f) for f in frames_of]
        if self.q_buffer is None:
            self.q_buffer, self.q_sources = q_post.clone(), src
        else:
            self.q_buffer = torch.cat([self.q_buffer, q_post])
            self.q_sources = self.q_sources + src
        if self.q_buffer.shape[0] > limit:
            self.q_buffer = self.q_buffer[-limit:]
            self.q_sources = self.q_sources[-limit:]

    def _prune(self, new, k_post, k_pre, v, c: int, block: int) -> None:
        s = self.settings
        T = self.T
        self._append(new, k_post, k_pre, v)  # the block's keys join first (count 0)
        m = len(self.entries)
        r_eff = min(self.q_buffer.shape[0], m)
        n_sink = min(self.sink_tokens, m)
        total = min(s.budget_frames * T, s.cache_frames * T)
        total = max(total, n_sink + r_eff)
        total = min(total, m)
        top_c = max(0, total - n_sink - r_eff)
        candidates = list(range(n_sink, m - r_eff))
        eligible = [
            i for i in candidates if s.reuse_cap == 0 or self.entries[i].count < s.reuse_cap
        ]
        # One score per token, shared by the layer's heads: raw q.k summed over the heads and
        # the buffered queries (Deep Forcing divides by sqrt(d) x heads; it never changes the
        # order, kept here so recorded scores are the code's numbers).
        q64 = self.q_buffer[-r_eff:].to(torch.float64)
        k64 = self.k_post.to(torch.float64)
        heads, d = q64.shape[1], q64.shape[2]
        score = torch.einsum("hd,khd->k", q64.sum(0), k64) / (math.sqrt(d) * heads)
        chosen: list[int] = []
        margin = math.inf
        if top_c > 0 and eligible:
            ranked = sorted(eligible, key=lambda i: (-float(score[i]), i))  # ties: earlier slot
            k_eff = min(top_c, len(ranked))
            chosen = sorted(ranked[:k_eff])
            if k_eff < len(ranked):
                margin = float(score[ranked[k_eff - 1]] - score[ranked[k_eff]])
        keep = list(range(n_sink)) + chosen + list(range(m - r_eff, m))
        if self.recorder is not None:
            chosen_set, eligible_set = set(chosen), set(eligible)
            self.recorder.event(
                kind="prune",
                block=block,
                layer=self.layer,
                top_c=top_c,
                r_eff=r_eff,
                # (frame, token, score, count before this prune, eligible, chosen)
                candidates=[
                    (
                        self.entries[i].frame,
                        self.entries[i].token,
                        float(score[i]),
                        self.entries[i].count,
                        i in eligible_set,
                        i in chosen_set,
                    )
                    for i in candidates
                ],
                chosen=[(self.entries[i].frame, self.entries[i].token) for i in chosen],
                margin=margin,
                queries=sorted(set(self.q_sources[-r_eff:])),
            )
        if s.reuse_cap > 0:  # the count travels with the token; never reset
            for i in chosen:
                self.entries[i].count += 1
        self._take(keep)
        if n_sink and s.sink_turn:
            tail_frames = (len(self.entries) - n_sink) // T  # own block included, floored
            self._aim_sinks(c - tail_frames - n_sink // T, block)

    def _aim_sinks(self, g: int, block: int) -> None:
        """Deep Sink's turn toward the target g: the first as `first_turn` says, later ones by
        g - g(last)."""
        delta = _first_turn(self.settings, g) if self.sink_g is None else g - self.sink_g
        self.sink_g = g
        self._turn_sinks(delta, block)


def _first_turn(s: PolicySettings, g: int) -> int:
    if s.first_turn == "release":
        return 0 if s.kind == "deep_sink" else RELEASE_CACHE_FRAMES - s.budget_frames
    if s.first_turn == "consistent":
        return g  # the sinks were at 0..S-1: move them to start at g
    return int(s.first_turn)


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------


@dataclass
class Recorder:
    calls: dict = field(default_factory=dict)  # (block, pass, layer) -> np.ndarray [M, 5]
    events: list = field(default_factory=list)

    def call(self, block, pass_index, kind, layer, entries) -> None:
        self.calls[(block, pass_index, layer)] = np.array(
            [e.label() for e in entries], dtype=np.int64
        ).reshape(-1, 5)

    def event(self, **kw) -> None:
        self.events.append(kw)


@dataclass
class RefResult:
    latents: torch.Tensor
    settings: PolicySettings
    geometry: object
    recorder: Recorder
    states: list[LayerState]

    @property
    def events(self) -> list[dict]:
        return self.recorder.events

    def attended(self, block: int, pass_index: int, layer: int) -> np.ndarray:
        """[M, 5] int64: (frame, token, written block, written pass, RoPE position) of every key
        the call attended, in cache order."""
        return self.recorder.calls[(block, pass_index, layer)]

    def kept_tokens(self, block: int, layer: int, pass_index: int = 0) -> list[tuple[int, int]]:
        a = self.attended(block, pass_index, layer)
        return [(int(f), int(t)) for f, t in a[:, :2]]

    def attended_frames(self, block: int, layer: int, pass_index: int = 0) -> dict[int, int]:
        """frame -> tokens of it attended (PC keeps tokens, not frames)."""
        a = self.attended(block, pass_index, layer)
        frames, counts = np.unique(a[:, 0], return_counts=True)
        return {int(f): int(c) for f, c in zip(frames, counts, strict=True)}

    def sink_positions(self, block: int, pass_index: int = 0, layer: int = 0) -> list[int]:
        """The temporal RoPE positions of sink frames 0..S-1 as the call saw them."""
        s = self.settings
        S = s.sink_frames if s.kind in ("sink_window", "deep_sink", "pc") else 0
        a = self.attended(block, pass_index, layer)
        out = []
        for f in range(S):
            rows = a[(a[:, 0] == f)]
            if len(rows):
                assert len(set(rows[:, 4].tolist())) == 1
                out.append(int(rows[0, 4]))
        return out

    def prunes(self, layer: int | None = None) -> list[dict]:
        return [e for e in self.events if e["kind"] == "prune" and layer in (None, e["layer"])]


# --------------------------------------------------------------------------------------------
# The model's self-attention, from the explicit lists
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _patched_self_attention(model, attention: str):
    """Give each SelfAttention module a forward that attends through its LayerState (passed as
    the model's `kv_caches`); the projections and qk-norms stay the module's own."""

    def forward(self, x, ctx):
        state = ctx.caches[self.layer_index]
        b, s, _ = x.shape
        assert b == 1, "the reference runs one video"
        shape = (s, self.num_heads, self.head_dim)
        q = self.norm_q(self.q(x)).view(shape)
        k = self.norm_k(self.k(x)).view(shape)
        v = self.v(x).view(shape)
        out = state.attend(q, k, v, ctx.start_frame, ctx.grid, attention)
        return self.o(out.reshape(1, s, -1))

    modules = [block.self_attn for block in model.blocks]
    for m in modules:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in modules:
            del m.forward


@torch.no_grad()
def reference_rollout(
    model,
    text: torch.Tensor,
    geometry,
    seed: int,
    settings: PolicySettings,
    *,
    steps=(1000, 750, 500, 250),
    shift: float = 5.0,
    warp: bool = True,
    attention: str = "float64",
    dtype: torch.dtype = torch.float32,
    record: bool = True,
) -> RefResult:
    """Clean latents [1, C, F, H, W] (float32) of a Self-Forcing rollout under `settings`.

    Noise: one CPU generator seeded with `seed`: the whole video's initial noise first, then per
    block one fresh draw after each denoising call but the last (Self-Forcing's order, as
    sinkscope's rollout). Per block: len(steps) denoising calls, then the cache-update call at
    t = 0 on the block's x0. `attention`: "float64" (explicit softmax in float64) or "model"
    (scaled_dot_product_attention in the model dtype)."""
    cfg = model.config
    if geometry.independent_first_frame:
        raise ValueError("the reference runs equal blocks (Deep Forcing's release does)")
    F_ = geometry.frames_per_block
    if geometry.num_frames % F_:
        raise ValueError("frames must be a whole number of blocks")
    settings.check(F_)
    ph, pw = cfg.patch_size[1], cfg.patch_size[2]
    height, width = geometry.latent_height // ph, geometry.latent_width // pw
    T = height * width
    rope = Rope(cfg.head_dim)
    recorder = Recorder() if record else None
    storage = settings.storage_dtype or dtype
    states = [
        LayerState(
            layer=i,
            settings=settings,
            rope=rope,
            T=T,
            width=width,
            frames_per_block=F_,
            storage=storage,
            recorder=recorder,
        )
        for i in range(cfg.num_layers)
    ]
    with _patched_self_attention(model, attention):
        output = run_sampler(
            model, text, geometry, seed, states, steps=steps, shift=shift, warp=warp, dtype=dtype
        )
    return RefResult(output, settings, geometry, recorder or Recorder(), states)


@torch.no_grad()
def run_sampler(
    model,
    text,
    geometry,
    seed,
    states,
    *,
    steps=(1000, 750, 500, 250),
    shift=5.0,
    warp=True,
    dtype=torch.float32,
) -> torch.Tensor:
    """The Self-Forcing rollout; before each call every state's `.call` is set to
    (block, pass index, kind). `states` go to the model as its kv_caches."""
    F_ = geometry.frames_per_block
    shape = (
        1,
        geometry.channels,
        geometry.num_frames,
        geometry.latent_height,
        geometry.latent_width,
    )
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(shape, generator=generator)
    text_emb = model.embed_text(text.to(dtype))
    timesteps = model_timesteps(steps, shift, warp)
    output = torch.empty(shape, dtype=torch.float32)
    for block, c in enumerate(range(0, geometry.num_frames, F_)):
        x = noise[:, :, c : c + F_].to(dtype)
        x0 = x
        for p, t in enumerate([*timesteps, 0.0]):
            kind = "denoise" if p < len(timesteps) else "cache"
            for st in states:
                st.call = (block, p, kind)
            tt = torch.full((1, F_), t, dtype=torch.float32)
            if kind == "cache":  # the clean x0 rewrites the block's keys and values
                model(x0, tt, text_emb, kv_caches=states, start_frame=c, text_embedded=True)
                continue
            velocity = model(x, tt, text_emb, kv_caches=states, start_frame=c, text_embedded=True)
            sigma = sigma_of(t, shift)
            x0 = (x.double() - sigma * velocity.double()).to(dtype)
            if p + 1 < len(timesteps):
                sigma_next = sigma_of(timesteps[p + 1], shift)
                fresh = torch.randn(x0.shape, generator=generator).to(dtype)
                x = (1 - sigma_next) * x0 + sigma_next * fresh
        output[:, :, c : c + F_] = x0.float()
    return output


# --------------------------------------------------------------------------------------------
# Arithmetic of the schedules (no model): the tables of spec.md
# --------------------------------------------------------------------------------------------


def deep_sink_positions(cache_frames: int, sinks: int, frames_per_block: int, blocks: int):
    """Per block: (c, evicts, Deep Forcing's first sink position, sinkscope's current one,
    the non-sink frames attended). The sinks sit at start .. start + S - 1 on every pass."""
    L, S, F_ = cache_frames, sinks, frames_per_block
    rows, g_prev, df_start = [], None, 0
    for b in range(blocks):
        c = b * F_
        evicts = c + F_ > L
        if evicts:
            g = c - L  # tail = L - S frames ending with the own block
            if g_prev is not None:
                df_start += g - g_prev
            g_prev = g
            oldest = c + F_ - (L - S)
            ss_start = oldest - S
            tail = list(range(oldest, c + F_))
        else:
            ss_start = 0
            tail = list(range(S, c + F_)) if c + F_ > S else []
        rows.append((b, c, evicts, df_start, ss_start, tail))
    return rows


def pc_schedule(cache_frames, budget, sinks, recent, frames_per_block, blocks, first_turn=None):
    """Per block, assuming enough eligible candidates (no reuse-cap shortfall): (c, prune?, frames
    attended by pass 0, frames after the block's write, sink start position)."""
    L, B, S, R, F_ = cache_frames, budget, sinks, recent, frames_per_block
    first = (RELEASE_CACHE_FRAMES - B) if first_turn is None else first_turn
    rows, held, g_prev, start = [], 0, None, 0
    for b in range(blocks):
        c = b * F_
        prune = held + F_ > L
        if prune:
            aug = held + F_
            total = min(max(min(B, L), S + R), aug)
            held = total
            t = held - S
            g = c - t - S
            start += first if g_prev is None else g - g_prev
            g_prev = g
        else:
            held += F_
        rows.append((b, c, prune, held, start))
    return rows
