"""UMT5's encoder (google/umt5-xxl, the text encoder of Wan2.1 and the models distilled from it):
torch only, its parameters named as in transformers' `UMT5EncoderModel.state_dict()`.

Written here rather than imported from transformers: importing `UMT5EncoderModel` cost ~5 s per
process (torch._dynamo, torch.distributed.tensor, the attention integrations), paid by every
encode_prompt job whose model work takes milliseconds on the demo. Every op runs in transformers'
order (5.x with its default "sdpa" attention), so that tests/test_text.py can hold it bit-equal
(float32 and bfloat16, CPU: `torch.equal`) to `UMT5EncoderModel`, which stays the test reference.

T5's particulars, as transformers has them: RMS layer norms without mean or bias, normalising in
float32; no 1/sqrt(d_kv) scaling of the attention scores (T5 folds it into the initialisation);
a learned bias per relative-position bucket and head added to the scores, in every layer (UMT5;
T5 has it in layer 0 only); padded keys masked with the dtype's lowest value; a gated GELU
(tanh approximation, "gelu_new") feed-forward; a final layer norm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The config, in transformers' names, with UMT5Config's defaults for keys a config.json leaves
# out. Dropout (`dropout_rate`) is not kept: the encoder only runs in eval mode here.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 250112,
    "d_model": 512,
    "d_kv": 64,
    "d_ff": 1024,
    "num_layers": 8,
    "num_heads": 6,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6,
}
GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)


class UMT5EncoderConfig(dict):
    """The config, its values readable as attributes too (`model.config.d_model`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def umt5_config(values: Mapping[str, Any]) -> UMT5EncoderConfig:
    """The encoder's config from `values` in transformers' names (a UMT5 config.json's, say):
    defaults for the missing ones, other keys (the decoder's, tokens, bookkeeping) ignored. A feed
    forward other than UMT5's gated GELU is refused with a ValueError."""
    cfg = UMT5EncoderConfig({key: values.get(key, value) for key, value in DEFAULTS.items()})
    if cfg.feed_forward_proj != "gated-gelu":
        raise ValueError(
            f"feed_forward_proj {cfg.feed_forward_proj!r}: only UMT5's 'gated-gelu' is supported"
        )
    return cfg


def relative_position_buckets(length: int, num_buckets: int, max_distance: int, device=None):
    """[length, length] bucket of each (query, key) pair, T5's bidirectional scheme: half the
    buckets for keys after the query, half for keys before or at it; in each half, distances
    below a quarter of num_buckets have a bucket each, longer ones share log-spaced buckets up to
    `max_distance`, beyond which all fall in the last. Op for op as transformers computes it
    (the float32 log decides the bucket boundaries)."""
    position = torch.arange(length, dtype=torch.long, device=device)
    relative = position[None, :] - position[:, None]  # key position - query position
    half = num_buckets // 2
    exact = half // 2
    after = (relative > 0).to(torch.long) * half
    distance = torch.abs(relative)
    # log(0) for distance 0 is -inf; torch.where below picks the exact bucket there.
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (half - exact)).to(torch.long)
    far = torch.min(far, torch.full_like(far, half - 1))
    return after + torch.where(distance < exact, distance, far)


class Embedding(nn.Embedding):
    """nn.Embedding, left uninitialised on the meta device (where models are built to be loaded):
    `normal_` on meta tensors runs a decomposition that imports torch._dynamo, 2.4 s."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class RMSNorm(nn.Module):
    """T5's layer norm: x / rms(x) times a gain, no mean subtracted, no bias. The mean square is
    taken in float32 and the product stays float32 (type promotion) until it is rounded once to a
    16-bit weight's dtype, as in transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class Attention(nn.Module):
    """Self-attention with this layer's own relative position bias; unscaled scores."""

    def __init__(self, cfg: UMT5EncoderConfig) -> None:
        super().__init__()
        self.heads, self.d_kv = cfg.num_heads, cfg.d_kv
        inner = cfg.num_heads * cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.relative_attention_bias = Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor, keep: torch.Tensor | None):
        batch, length = x.shape[:2]

        def split_heads(t: torch.Tensor) -> torch.Tensor:  # [B, L, H * D] -> [B, H, L, D]
            return t.view(batch, -1, self.heads, self.d_kv).transpose(1, 2)

        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, H, L, L]
        # The padding mask joins the bias as one additive float mask, padded keys at the dtype's
        # lowest value (not -inf: a row of only padding then stays finite), as transformers does.
        if keep is not None:
            bias = torch.where(keep, bias, torch.finfo(k.dtype).min)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.contiguous(), dropout_p=0.0, scale=1.0
        )
        return self.o(out.transpose(1, 2).contiguous().reshape(batch, length, -1))


class GatedGelu(nn.Module):
    """wo(gelu_tanh(wi_0 x) * wi_1 x); the GELU written as transformers' "gelu_new" (not
    F.gelu(approximate="tanh"), whose rounding differs)."""

    def __init__(self, cfg: UMT5EncoderConfig) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.wi_0(x)
        g = 0.5 * g * (1.0 + torch.tanh(GELU_TANH_SCALE * (g + 0.044715 * torch.pow(g, 3.0))))
        hidden = g * self.wi_1(x)
        # A no-op here (one dtype throughout); transformers' from_pretrained keeps `wo` in
        # float32 when loading in float16 (`_keep_in_fp32_modules`), hence its cast.
        if hidden.dtype != self.wo.weight.dtype:
            hidden = hidden.to(self.wo.weight.dtype)
        return self.wo(hidden)


class SelfAttentionLayer(nn.Module):
    def __init__(self, cfg: UMT5EncoderConfig) -> None:
        super().__init__()
        self.SelfAttention = Attention(cfg)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x, buckets, keep):
        return x + self.SelfAttention(self.layer_norm(x), buckets, keep)


class FeedForwardLayer(nn.Module):
    def __init__(self, cfg: UMT5EncoderConfig) -> None:
        super().__init__()
        self.DenseReluDense = GatedGelu(cfg)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


def _clamp_float16(x: torch.Tensor) -> torch.Tensor:
    """transformers' guard against float16 overflow after each sublayer (a no-op otherwise)."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(x.dtype).max
    limit = torch.where(torch.isinf(x).any(), top - 1000, top)
    return torch.clamp(x, min=-limit, max=limit)


class Block(nn.Module):
    def __init__(self, cfg: UMT5EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([SelfAttentionLayer(cfg), FeedForwardLayer(cfg)])

    def forward(self, x, buckets, keep):
        x = _clamp_float16(self.layer[0](x, buckets, keep))
        return _clamp_float16(self.layer[1](x))


class Stack(nn.Module):
    """transformers' `encoder` submodule: the blocks and the final norm (and, tied, the
    embedding, so that its key `encoder.embed_tokens.weight` is there too)."""

    def __init__(self, cfg: UMT5EncoderConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)


class UMT5Encoder(nn.Module):
    """UMT5's encoder: token ids [B, L] and their attention mask (1 = token, 0 = padding) to the
    last hidden state [B, L, d_model]. `shared` and `encoder.embed_tokens` are one module (tied,
    as in transformers): `state_dict()` lists the embedding under both keys."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = umt5_config(config)
        self.shared = Embedding(self.config.vocab_size, self.config.d_model)
        self.encoder = Stack(self.config, self.shared)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.config
        x = self.shared(input_ids)
        # The same buckets in every layer; each layer looks them up in its own bias table.
        buckets = relative_position_buckets(
            input_ids.shape[1],
            cfg.relative_attention_num_buckets,
            cfg.relative_attention_max_distance,
            input_ids.device,
        )
        # [B, 1, 1, L]: which keys every query of a row may attend to.
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.encoder.block:
            x = block(x, buckets, keep)
        return self.encoder.final_layer_norm(x)
