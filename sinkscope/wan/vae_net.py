"""Wan2.1's VAE network, `WanVAE`: torch only, its parameters named as in Wan's `Wan2.1_VAE.pth`.

Written here rather than imported from diffusers (`AutoencoderKLWan`): importing diffusers cost
5-6.5 s per process (torch._dynamo, every autoencoder and unet it has), paid by each job that
decodes or encodes. The network is Wan's `WanVAE_` (its module tree, so the original file loads
as it is); every op runs in diffusers' order, so that tests/test_vae.py can hold it bit-equal
(float32, CPU) to `AutoencoderKLWan`'s `decode` and `encode`, which stays the test reference.

Time is causal: a frame's features see it and the frames before it, never after. Videos run a
chunk at a time (encode: the first frame, then 4 at a time; decode: one latent frame at a time),
each causal conv keeping the last `CACHE_T` frames of its input in a `cache` (a dict, module ->
frames) for the next chunk, where they replace the zero padding. The first chunk differs: the
decoder's temporal upsamplers pass it through (1 latent frame -> 1 pixel frame, then 4 each) and
the encoder's temporal downsamplers keep it whole (1 pixel frame -> 1 latent frame).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CACHE_T = 2  # frames of its input a causal conv keeps for the next chunk (its kernel's 3 - 1)

Cache = dict[nn.Module, "torch.Tensor | None"]

# The config, in diffusers' names, with its defaults: Wan2.1's (AutoencoderKLWan's too).
DEFAULTS: dict[str, Any] = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "in_channels": 3,
    "out_channels": 3,
    "patch_size": None,  # Wan2.2's VAE patchifies; Wan2.1's does not
    "is_residual": False,  # Wan2.2's residual up and down blocks
}


class VAEConfig(dict):
    """The config, its values readable as attributes too (`vae.config.z_dim`, as diffusers')."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def vae_config(values: Mapping[str, Any]) -> VAEConfig:
    """The network's config from `values` in diffusers' names (a diffusers config.json's, say):
    defaults for the missing ones, other keys (the latent statistics, diffusers' bookkeeping)
    ignored. What this network is not refuses with a ValueError: Wan2.2's VAE (`patch_size`,
    `is_residual`), attention inside the levels (`attn_scales`: diffusers' decoder ignores it
    where Wan's applies it), a decoder of another width (`decoder_base_dim`)."""
    cfg = VAEConfig({k: values.get(k, v) for k, v in DEFAULTS.items()})
    if cfg.patch_size is not None or cfg.is_residual:
        raise ValueError(
            f"patch_size={cfg.patch_size}, is_residual={cfg.is_residual}: Wan2.2's VAE, not "
            "Wan2.1's"
        )
    if list(cfg.attn_scales):
        raise ValueError(f"attn_scales {list(cfg.attn_scales)}: Wan2.1's VAE has none")
    if values.get("decoder_base_dim") not in (None, cfg.base_dim):
        raise ValueError(f"decoder_base_dim {values['decoder_base_dim']} != base_dim")
    if len(cfg.temperal_downsample) != len(cfg.dim_mult) - 1:
        raise ValueError("temperal_downsample needs one flag per level but the last")
    for key in ("dim_mult", "attn_scales", "temperal_downsample"):
        cfg[key] = list(cfg[key])
    return cfg


class CausalConv3d(nn.Conv3d):
    """A 3D conv whose time padding is all before the frames (2p zero frames, none after), so an
    output frame sees its input frame and earlier ones. Padded with F.pad and run unpadded, as
    Wan and diffusers do: the same conv call on the same tensor, so the same bits."""

    def __init__(self, c_in: int, c_out: int, kernel, stride=1, padding=0) -> None:
        super().__init__(c_in, c_out, kernel, stride=stride)
        t, h, w = (padding,) * 3 if isinstance(padding, int) else padding
        self.causal_padding = (w, w, h, h, 2 * t, 0)

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        pad = list(self.causal_padding)
        if cache is not None and pad[4] > 0:
            # The frames before x (the previous chunk's last CACHE_T) stand for as many zero
            # frames; keep x's last CACHE_T (topped up from the past when x is one frame).
            past = cache.get(self)
            keep = x[:, :, -CACHE_T:].clone()
            if keep.shape[2] < CACHE_T and past is not None:
                keep = torch.cat([past[:, :, -1:], keep], 2)
            if past is not None:
                x = torch.cat([past, x], 2)
                pad[4] -= past.shape[2]
            cache[self] = keep
        return super().forward(F.pad(x, pad))


class RMSNorm(nn.Module):
    """x / ||x|| over channels, times sqrt(channels) and a gain per channel: F.normalize, whose
    op order diffusers' `WanRMS_norm` has; in float32 for 16-bit (or narrower) inputs as there.
    `images`: 4D inputs [N, C, H, W] (attention), else 5D [B, C, T, H, W]."""

    def __init__(self, dim: int, images: bool = False, bias: bool = False) -> None:
        super().__init__()
        shape = (dim, 1, 1) if images else (dim, 1, 1, 1)
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float() if x.element_size() < 4 else x
        y = F.normalize(wide, dim=1).to(x.dtype) * self.scale * self.gamma
        return y if self.bias is None else y + self.bias


class Upsample2x(nn.Module):
    """Nearest-exact x2 in height and width, computed in float32 as diffusers' `WanUpsample`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact")
        return y.type_as(x)


class Resample(nn.Module):
    """A level change, frame by frame in space: `upsample2d` (x2, half the channels),
    `upsample3d` (also x2 in time: `time_conv` makes 2 frames of each), `downsample2d` (/2, the
    pad right and bottom), `downsample3d` (also /2 in time: `time_conv`, stride 2, over the
    previous chunk's last frame and this chunk's)."""

    def __init__(self, dim: int, mode: str) -> None:
        super().__init__()
        self.mode = mode
        if mode.startswith("up"):
            self.resample = nn.Sequential(Upsample2x(), nn.Conv2d(dim, dim // 2, 3, padding=1))
        else:
            pad = nn.ZeroPad2d((0, 1, 0, 1))
            self.resample = nn.Sequential(pad, nn.Conv2d(dim, dim, 3, stride=(2, 2)))
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if self.mode == "upsample3d":
            if self.time_conv not in cache:  # the first chunk: its one frame stays one
                cache[self.time_conv] = None  # (zero history, as diffusers' "Rep")
            else:  # 2c channels -> 2 frames of c each, interleaved in time
                x = self.time_conv(x, cache).reshape(b, 2, c, t, h, w)
                x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, 2 * t, h, w)
        t = x.shape[2]
        x = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        x = x.view(b, t, *x.shape[1:]).permute(0, 2, 1, 3, 4)
        if self.mode == "downsample3d":
            past = cache.get(self.time_conv)
            cache[self.time_conv] = x[:, :, -1:].clone()
            if past is not None:  # the first chunk (one frame) is kept as it is
                x = self.time_conv(torch.cat([past, x], 2))
        return x


class ResidualBlock(nn.Module):
    """x + residual(x): `residual` is Wan's Sequential (0 norm, 1 SiLU, 2 conv, 3 norm, 4 SiLU,
    5 dropout, 6 conv); `shortcut` a 1x1x1 conv where the width changes."""

    def __init__(self, c_in: int, c_out: int, dropout: float) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            RMSNorm(c_in),
            nn.SiLU(),
            CausalConv3d(c_in, c_out, 3, padding=1),
            RMSNorm(c_out),
            nn.SiLU(),
            nn.Dropout(dropout),
            CausalConv3d(c_out, c_out, 3, padding=1),
        )
        self.shortcut = CausalConv3d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        h = self.shortcut(x)
        for layer in self.residual:
            x = layer(x, cache) if isinstance(layer, CausalConv3d) else layer(x)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (none across frames)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = self.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        # [frames, 1 head, pixels, 3c] -> q, k, v of c channels each
        qkv = self.to_qkv(y).reshape(b * t, 1, 3 * c, h * w).permute(0, 1, 3, 2).contiguous()
        y = F.scaled_dot_product_attention(*qkv.chunk(3, dim=-1))
        y = self.proj(y.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w))
        return y.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + x


def _middle(dim: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        ResidualBlock(dim, dim, dropout), AttentionBlock(dim), ResidualBlock(dim, dim, dropout)
    )


def _head(dim: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(RMSNorm(dim), nn.SiLU(), CausalConv3d(dim, c_out, 3, padding=1))


def _run_head(head: nn.Sequential, x: torch.Tensor, cache: Cache) -> torch.Tensor:
    norm, silu, conv = head
    return conv(silu(norm(x)), cache)


class Encoder(nn.Module):
    """Pixels -> 2 z_dim channels (mean and log-variance) at /8 in space, /4 in time."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv1 = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1)
        layers: list[nn.Module] = []
        for i, (c_in, c_out) in enumerate(itertools.pairwise(dims)):
            for j in range(cfg.num_res_blocks):
                layers.append(ResidualBlock(c_in if j == 0 else c_out, c_out, cfg.dropout))
            if i < len(cfg.temperal_downsample):
                temporal = cfg.temperal_downsample[i]
                layers.append(Resample(c_out, "downsample3d" if temporal else "downsample2d"))
        self.downsamples = nn.Sequential(*layers)
        self.middle = _middle(dims[-1], cfg.dropout)
        self.head = _head(dims[-1], 2 * cfg.z_dim)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        x = self.conv1(x, cache)
        for layer in (*self.downsamples, *self.middle):
            x = layer(x, cache)
        return _run_head(self.head, x, cache)


class Decoder(nn.Module):
    """z_dim channels -> pixels; each level num_res_blocks + 1 residual blocks, then (but the
    last) an upsampler, which halves the channels (so the next level takes half)."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        mult = cfg.dim_mult
        dims = [cfg.base_dim * m for m in (mult[-1], *mult[::-1])]
        self.conv1 = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.middle = _middle(dims[0], cfg.dropout)
        temporal_up = cfg.temperal_downsample[::-1]
        layers: list[nn.Module] = []
        for i, (c_in, c_out) in enumerate(itertools.pairwise(dims)):
            c_in = c_in if i == 0 else c_in // 2
            for j in range(cfg.num_res_blocks + 1):
                layers.append(ResidualBlock(c_in if j == 0 else c_out, c_out, cfg.dropout))
            if i < len(temporal_up):
                layers.append(Resample(c_out, "upsample3d" if temporal_up[i] else "upsample2d"))
        self.upsamples = nn.Sequential(*layers)
        self.head = _head(dims[-1], cfg.out_channels)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        x = self.conv1(x, cache)
        for layer in (*self.middle, *self.upsamples):  # the middle at the latent resolution
            x = layer(x, cache)
        return _run_head(self.head, x, cache)


class DecodeStream:
    """One video's decode, one latent frame a call: the decoder's causal-conv cache between
    calls (`cache`: what the stream holds). Feed it `vae.conv2`'s output (the post-quant conv,
    run on the whole latents at once as diffusers' `decode` does: per frame it is not
    bit-equal), frame i as `x[:, :, i : i + 1]`; it returns the unclamped pixels [B, C, t, ...]
    (t = 1 for the first frame, 4 after)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.cache: Cache = {}

    def __call__(self, frame: torch.Tensor) -> torch.Tensor:
        if frame.ndim != 5 or frame.shape[2] != 1:
            raise ValueError(f"one latent frame [B, C, 1, H, W] a call, got {list(frame.shape)}")
        return self.decoder(frame, self.cache)


class WanVAE(nn.Module):
    """Wan2.1's VAE (Wan's `WanVAE_`; diffusers' `AutoencoderKLWan`) from a config in diffusers'
    names (`vae_config`). Parameter names: `encoder`, `conv1` (the quant conv, 2 z_dim ->
    2 z_dim), `conv2` (the post-quant conv, z_dim -> z_dim), `decoder`, as in Wan2.1_VAE.pth."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        cfg = vae_config(config or {})
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.conv1 = CausalConv3d(2 * cfg.z_dim, 2 * cfg.z_dim, 1)
        self.conv2 = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder(cfg)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels [B, C, T, H, W] in [-1, 1] -> the posterior mean mu [B, z_dim, 1 + (T - 1) // 4,
        H / 8, W / 8]: the first frame alone, then 4 frames a chunk (frames past the last whole
        chunk are dropped), the quant conv over all of them, as diffusers' `_encode`."""
        cache: Cache = {}
        chunks = [x[:, :, :1]] + [x[:, :, i : i + 4] for i in range(1, x.shape[2] - 3, 4)]
        out = torch.cat([self.encoder(chunk, cache) for chunk in chunks], 2)
        return self.conv1(out)[:, : self.config.z_dim]  # mean; the log-variance is unused

    def decode_stream(self) -> DecodeStream:
        """A fresh stream: each video decodes from an empty cache."""
        return DecodeStream(self.decoder)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latents [B, z_dim, F, H, W] -> pixels [B, C, 4F - 3, 8H, 8W] clamped to [-1, 1], the
        whole video (one frame at a time inside), as diffusers' `decode(z).sample`."""
        x, stream = self.conv2(z), self.decode_stream()
        out = torch.cat([stream(x[:, :, i : i + 1]) for i in range(x.shape[2])], 2)
        return out.clamp(-1.0, 1.0)
