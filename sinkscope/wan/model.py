"""The Wan2.1 text-to-video DiT, bidirectional and block-causal with a KV cache.

Module and parameter names are those of Wan's original `WanModel` (and Self-Forcing's
`CausalWanModel`), so the original `diffusion_pytorch_model.safetensors` loads without renaming.
Timesteps are per latent frame ([B, F]) as in Self-Forcing, so one code path serves the
bidirectional model (all frames equal), teacher-forcing style masked forwards and the rollout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sinkscope.cache_choices import KEY_KIND

from .config import WanConfig
from .rope import apply_rope, rope_angles


def timestep_sinusoid(dim: int, timesteps: torch.Tensor) -> torch.Tensor:
    """[cos | sin] embedding of timesteps [N], computed in float64 as in the reference."""
    half = dim // 2
    position = timesteps.to(torch.float64)
    angles = torch.outer(
        position,
        torch.pow(10000, -torch.arange(half, dtype=torch.float64).div(half)).to(position.device),
    )
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


class RMSNorm(nn.Module):
    """RMS norm over the full width (all heads together), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """Wan's WanLayerNorm: `nn.LayerNorm` on the tensor as it arrives, with the affine weights
    (norm3's) in the model's dtype, cast back to the input's dtype. In bfloat16 the kernel
    normalises in float32 and rounds once, weights applied; computing it as float32 with
    float32 weights instead differs by one bfloat16 ulp in a few elements (docs/DESIGN.md,
    "Where the model rounds")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).type_as(x)


class CacheEngine:
    """What every layer cache of a rollout tells the self-attention beside its keys: where the
    call's queries sit in RoPE (`angles`), a bias added to each visible key's logits
    (`logit_bias`), and for a capture, each visible key's RoPE position and why it is there
    (`key_labels`). Caches that move keys or queries in time, or bias them, override these."""

    frame_seq_length: int
    # LongLive's recache and Infinity-RoPE's cut (sinkscope.schedules.with_switches): only the
    # caches whose release runs them say they can; the others refuse the call.
    runs_recache = False
    runs_cut = False

    def angles(
        self, head_dim: int, grid: tuple[int, int, int], start_frame: int, device: torch.device
    ) -> torch.Tensor:
        """RoPE of this call's queries and own keys: their own frames, by default."""
        return rope_angles(head_dim, grid, start_frame, device)

    def logit_bias(self, key_tokens: torch.Tensor, query_start: int) -> torch.Tensor | None:
        """A float bias [M] added to the logits of the visible keys, or None."""
        return None

    def key_labels(
        self, key_tokens: torch.Tensor, query_start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(temporal RoPE position, kind code) of each visible key (shaped as `key_tokens`), as
        the queries of the call starting at token `query_start` see it: by default its own frame,
        `own` for the call's own tokens and `recent` for the others."""
        positions = key_tokens // self.frame_seq_length
        kinds = torch.where(key_tokens >= query_start, KEY_KIND["own"], KEY_KIND["recent"])
        return positions, kinds

    def begin_pass(self, kind: str) -> None:
        """Told before every model call of a rollout which kind of pass it is (`denoise` or
        `cache`); caches that choose by the attention of one kind of pass listen."""

    def begin_call(self, index: int, call) -> None:
        """Told before every model call which call of the sampler's schedule it is (index, a
        `sinkscope.schedules.ModelCall`); by default passes its kind on to `begin_pass`, after
        refusing a recache or a RoPE cut this cache does not run."""
        if call.kind == "recache" and not self.runs_recache:
            raise ValueError(f"{type(self).__name__} does not run LongLive's recache")
        if call.rope_cut is not None and not self.runs_cut:
            raise ValueError(
                f"{type(self).__name__} keeps absolute positions: Infinity-RoPE's cut needs "
                "relative ones"
            )
        self.begin_pass(call.kind)


class KVCache(CacheEngine):
    """Self-attention key/value cache of one layer, with Self-Forcing's rolling semantics.

    `slot_token` records the absolute token each slot holds, so captured keys can be mapped back
    to absolute frames after the cache has rolled.
    """

    def __init__(
        self,
        batch: int,
        slots: int,
        num_heads: int,
        head_dim: int,
        frame_seq_length: int,
        local_attn_size: int,
        sink_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.keeps_sinks = False  # the current call is a recache with LongLive's global_sink
        self.k = torch.zeros(batch, slots, num_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.slot_token = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.frame_seq_length = frame_seq_length
        self.local_attn_size = local_attn_size
        self.sink_tokens = sink_size * frame_seq_length
        self.max_attention_size = slots
        self.global_end = 0
        self.local_end = 0

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def runs_recache(self) -> bool:
        # Self-Forcing's own window (LongLive's cache); its subclasses move or choose keys.
        return type(self) is KVCache

    def begin_call(self, index: int, call) -> None:
        super().begin_call(index, call)
        self.keeps_sinks = call.kind == "recache" and call.global_sink

    def update(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        current_start: int,
        *,
        q: torch.Tensor | None = None,
        k_raw: torch.Tensor | None = None,
    ):
        """Write k, v [B, n, heads, head_dim] (k after RoPE) of tokens
        [current_start, current_start + n).

        Returns the visible keys, values and the absolute token of each visible slot. `q` (the
        call's queries, after RoPE) and `k_raw` (its keys before RoPE) are for caches that choose
        or move keys (sinkscope.extraction.cache_policies); this one keeps a rolling window."""
        n = k.shape[1]
        current_end = current_start + n
        is_new_block = current_end > self.global_end
        if self.local_attn_size != -1 and is_new_block and n + self.local_end > self.slots:
            evict = n + self.local_end - self.slots
            keep = self.local_end - evict - self.sink_tokens
            src = slice(self.sink_tokens + evict, self.sink_tokens + evict + keep)
            dst = slice(self.sink_tokens, self.sink_tokens + keep)
            self.k[:, dst] = self.k[:, src].clone()
            self.v[:, dst] = self.v[:, src].clone()
            self.slot_token[dst] = self.slot_token[src].clone()
            local_end = self.local_end + current_end - self.global_end - evict
        else:
            local_end = self.local_end + current_end - self.global_end
        if local_end > self.slots:
            raise RuntimeError(
                f"KV cache of {self.slots} slots cannot hold tokens up to {current_end}: "
                "set local_attn_size to roll the cache for long rollouts"
            )
        tokens = torch.arange(current_start, current_end, device=self.slot_token.device)
        slots = slice(local_end - n, local_end)
        if self.keeps_sinks and self.sink_tokens:
            # LongLive's recache with global_sink: a sink slot keeps its frame unless the
            # recache rewrites that same frame (a recache from frame 0); the keys that would
            # fall into it are dropped.
            held = self.slot_token[slots]
            keep = torch.arange(local_end - n, local_end, device=held.device) < self.sink_tokens
            keep &= held != tokens
            write = ~keep
            self.k[:, slots][:, write] = k[:, write.to(k.device)]
            self.v[:, slots][:, write] = v[:, write.to(v.device)]
            self.slot_token[slots] = torch.where(write, tokens, held)
        else:
            self.k[:, slots] = k
            self.v[:, slots] = v
            self.slot_token[slots] = tokens
        self.global_end = max(self.global_end, current_end)
        self.local_end = local_end
        visible = slice(max(0, local_end - self.max_attention_size), local_end)
        return self.k[:, visible], self.v[:, visible], self.slot_token[visible]

    def key_labels(self, key_tokens, query_start):
        positions, kinds = super().key_labels(key_tokens, query_start)
        if self.sink_tokens:
            # The frames the sink slots hold: the first ones, or after a recache without
            # global_sink the frames it wrote there.
            sinks = torch.isin(key_tokens, self.slot_token[: self.sink_tokens])
            kinds = torch.where(sinks, KEY_KIND["sink"], kinds)
        return positions, kinds


@dataclass
class AttentionContext:
    """What one self-attention call needs besides its input."""

    grid: tuple[int, int, int]  # (frames, height, width) of the tokens in this call
    start_frame: int = 0  # absolute latent frame of the first token (RoPE offset)
    attn_mask: torch.Tensor | None = None  # bool [L, L], True = may attend (full forward only)
    caches: list[KVCache] | None = None


@dataclass
class VisibleKeys:
    """What the queries of one call see, for a capture: the absolute token of each key ([M], or
    [M, heads] where each head keeps its own), and where the keys came from: `cache` (None in a
    full forward, where every key is the call's own at its own position) answers
    `CacheEngine.key_labels`; `bias` [M] was added to the logits; `values` [B, M, H, D] are the
    keys' value vectors, in the order of the keys."""

    tokens: torch.Tensor
    query_start: int
    cache: CacheEngine | None = None
    bias: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def labels(self, frame_seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(temporal RoPE position, kind code) of each key, shaped as `tokens`."""
        if self.cache is not None:
            return self.cache.key_labels(self.tokens, self.query_start)
        return self.tokens // frame_seq_length, torch.zeros_like(self.tokens)


# A capture hook: (layer, q [B, n, H, D], k [B, m, H, D], the visible keys).
CaptureHook = Callable[[int, torch.Tensor, torch.Tensor, VisibleKeys], None]


class _Attention(nn.Module):
    """q, k, v, o projections and RMS qk-norm over the full width, as Wan's attention modules."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)


class SelfAttention(_Attention):
    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__(dim, num_heads, eps)
        self.layer_index = -1
        self.capture: CaptureHook | None = None

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        b, s, _ = x.shape
        shape = (b, s, self.num_heads, self.head_dim)
        cache = None if ctx.caches is None else ctx.caches[self.layer_index]
        if cache is None:
            angles = rope_angles(self.head_dim, ctx.grid, ctx.start_frame, x.device)
        else:
            angles = cache.angles(self.head_dim, ctx.grid, ctx.start_frame, x.device)
        # RMS norm over the whole width, then RoPE: exactly what the attention kernel sees.
        q = apply_rope(self.norm_q(self.q(x)).view(shape), angles)
        k_raw = self.norm_k(self.k(x)).view(shape)
        k = apply_rope(k_raw, angles)
        v = self.v(x).view(shape)
        query_start = ctx.start_frame * ctx.grid[1] * ctx.grid[2]
        if cache is not None:
            k_all, v_all, key_tokens = cache.update(k, v, query_start, q=q, k_raw=k_raw)
            bias = cache.logit_bias(key_tokens, query_start)
            # A float mask is added to the scaled logits.
            mask = None if bias is None else bias.to(q.dtype)[None, None, None, :]
        else:
            k_all, v_all = k, v
            key_tokens = torch.arange(query_start, query_start + s, device=x.device)
            mask, bias = ctx.attn_mask, None
        if self.capture is not None:
            visible = VisibleKeys(key_tokens, query_start, cache, bias, v_all)
            self.capture(self.layer_index, q, k_all, visible)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), attn_mask=mask
        )
        return self.o(out.transpose(1, 2).flatten(2))


class CrossAttention(_Attention):
    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.norm_q(self.q(x)).view(b, -1, self.num_heads, self.head_dim)
        # All text slots are attended, zero-padded ones included, as in Wan and Self-Forcing.
        k = self.norm_k(self.k(context)).view(b, -1, self.num_heads, self.head_dim)
        v = self.v(context).view(b, -1, self.num_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return self.o(out.transpose(1, 2).flatten(2))


def modulation(rows: int, dim: int) -> nn.Parameter:
    """[1, rows, dim] random parameters (randn / sqrt(dim)). Left empty on the loader's meta
    device, where the checkpoint supplies them: a random op there imports sympy through torch's
    reference implementations (about 0.5 s of every model-loading job)."""
    values = torch.empty(1, rows, dim)
    if values.device.type != "meta":
        values.normal_().mul_(dim**-0.5)  # the same draws as torch.randn
    return nn.Parameter(values)


class AttentionBlock(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.norm1 = LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.self_attn = SelfAttention(cfg.dim, cfg.num_heads, cfg.eps)
        self.norm3 = LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(cfg.dim, cfg.num_heads, cfg.eps)
        self.norm2 = LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.ffn_dim, cfg.dim),
        )
        self.modulation = modulation(6, cfg.dim)

    def forward(
        self, x: torch.Tensor, e0: torch.Tensor, context: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        frames = e0.shape[1]
        # e0 [B, F, 6, dim]: per-frame shift/scale/gate, broadcast over each frame's tokens.
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = (
            self.modulation.unsqueeze(1) + e0
        ).chunk(6, dim=2)

        def per_frame(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(1, (frames, -1))

        y = self.self_attn(
            (per_frame(self.norm1(x)) * (1 + scale_msa) + shift_msa).flatten(1, 2), ctx
        )
        x = x + (per_frame(y) * gate_msa).flatten(1, 2)
        x = x + self.cross_attn(self.norm3(x), context)
        y = self.ffn((per_frame(self.norm2(x)) * (1 + scale_ffn) + shift_ffn).flatten(1, 2))
        return x + (per_frame(y) * gate_ffn).flatten(1, 2)


class Head(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.norm = LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, math.prod(cfg.patch_size) * cfg.out_dim)
        self.modulation = modulation(2, cfg.dim)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        frames = e.shape[1]
        shift, scale = (self.modulation.unsqueeze(1) + e.unsqueeze(2)).chunk(2, dim=2)
        x = self.norm(x).unflatten(1, (frames, -1)) * (1 + scale) + shift
        return self.head(x.flatten(1, 2))


class WanModel(nn.Module):
    """Wan2.1 T2V DiT. `forward` runs a full (optionally masked) sequence or one cached block."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.config = cfg
        self.patch_embedding = nn.Conv3d(
            cfg.in_dim, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, cfg.dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.dim, cfg.dim),
        )
        self.time_embedding = nn.Sequential(
            nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim)
        )
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, cfg.dim * 6))
        self.blocks = nn.ModuleList(AttentionBlock(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        for index, block in enumerate(self.blocks):
            block.self_attn.layer_index = index

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Wan's initialisation (xavier linear/conv, N(0, 0.02) embeddings), seeded by `generator`.

        Unlike Wan the output head is not zeroed, so a random model still moves its latents.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight, generator=generator)
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1), generator=generator)
        nn.init.zeros_(self.patch_embedding.bias)
        for seq in (self.text_embedding, self.time_embedding):
            for module in seq:
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02, generator=generator)
        for name, param in self.named_parameters():
            if name.endswith("modulation"):
                with torch.no_grad():
                    param.copy_(
                        torch.randn(param.shape, generator=generator) / self.config.dim**0.5
                    )

    def set_capture(self, hook: CaptureHook | None, layers: set[int] | None = None) -> None:
        """Call `hook` from the self-attention of `layers` (all layers if None); None removes it."""
        for index, block in enumerate(self.blocks):
            wanted = hook is not None and (layers is None or index in layers)
            block.self_attn.capture = hook if wanted else None

    def new_kv_caches(
        self,
        *,
        num_frames: int,
        frame_seq_length: int,
        local_attn_size: int = -1,
        sink_size: int = 0,
        batch: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> list[KVCache]:
        """One cache per layer: num_frames (or local_attn_size) x frame_seq_length slots."""
        frames = num_frames if local_attn_size == -1 else local_attn_size
        cfg = self.config
        return [
            KVCache(
                batch,
                frames * frame_seq_length,
                cfg.num_heads,
                cfg.head_dim,
                frame_seq_length,
                local_attn_size,
                sink_size,
                torch.device(device),
                dtype,
            )
            for _ in range(cfg.num_layers)
        ]

    def embed_text(self, context: torch.Tensor) -> torch.Tensor:
        """Text embeddings [B, L, text_dim] zero-padded to text_len, projected to model width."""
        length = context.shape[1]
        if length > self.config.text_len:
            raise ValueError(
                f"text context has {length} tokens, more than text_len={self.config.text_len}"
            )
        if length < self.config.text_len:
            context = F.pad(context, (0, 0, 0, self.config.text_len - length))
        return self.text_embedding(context)

    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        context: torch.Tensor,
        *,
        kv_caches: list[KVCache] | None = None,
        start_frame: int = 0,
        attn_mask: torch.Tensor | None = None,
        text_embedded: bool = False,
    ) -> torch.Tensor:
        """Velocity prediction for latents x [B, C, F, H, W] at per-frame timesteps [B, F].

        With kv_caches, x is one block starting at latent frame `start_frame`; its keys and values
        enter the caches and it attends to everything cached. attn_mask (bool, over tokens) applies
        to full-sequence calls only.
        """
        cfg = self.config
        if kv_caches is not None and attn_mask is not None:
            raise ValueError("attn_mask applies to full-sequence forwards, not cached blocks")
        batch, _, frames = x.shape[:3]
        if timesteps.shape != (batch, frames):
            raise ValueError(
                f"timesteps must be [B, F] = {[batch, frames]}, got {list(timesteps.shape)}"
            )
        tokens = self.patch_embedding(x)
        grid = tuple(tokens.shape[2:])
        tokens = tokens.flatten(2).transpose(1, 2)

        e = self.time_embedding(
            timestep_sinusoid(cfg.freq_dim, timesteps.flatten()).to(tokens.dtype)
        )
        e = e.unflatten(0, (batch, frames))
        e0 = self.time_projection(e).unflatten(2, (6, cfg.dim))
        text = context if text_embedded else self.embed_text(context)

        ctx = AttentionContext(
            grid=grid, start_frame=start_frame, attn_mask=attn_mask, caches=kv_caches
        )
        for block in self.blocks:
            tokens = block(tokens, e0, text, ctx)
        out = self.head(tokens, e)
        return self.unpatchify(out, grid)

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        pt, ph, pw = self.config.patch_size
        f, h, w = grid
        c = self.config.out_dim
        out = tokens.view(tokens.shape[0], f, h, w, pt, ph, pw, c)
        out = torch.einsum("bfhwpqrc->bcfphqwr", out)
        return out.reshape(tokens.shape[0], c, f * pt, h * ph, w * pw)
