"""The tiny random-init models of the embedded default: the real architecture at tiny width, with
two planted heads so the demo's figures show the phenomenon sinkscope is for.

A planted head reads nothing of its input: its q and k are constant vectors on chosen temporal
RoPE pairs (projection rows zeroed, a bias on the pair's first channel), so after RoPE its logit
between a query and a key frame Delta frames apart is sum_j sign * A_j * cos(omega_j * Delta),
omega_j = 10000^(-2j / temporal channels) (1, 0.1, ... at head_dim 16). The full-width RMS norm
scales the constants by a factor near 1 per token; the norm weights set the amplitudes A_j.
- a first-frame sink (`sign` -1 on the slow pair, omega 0.1): the logit grows with the distance,
  so the last block's queries (frames 18-20 of 21) put about half their mass on frame 0;
- an own-block head (`sign` +1, a fast and a slow pair): the logit peaks at Delta = 0, so the
  block's own frames get about two thirds of the mass.
Every other head stays random (near-uniform attention). Amplitudes keep |logits| below about 9,
where float16 token logits stay accurate to a few 1e-3 of probability.
"""

from __future__ import annotations

from pathlib import Path

from .config import WanConfig

# Wan2.1 at toy width: 4 layers of 4 heads, head_dim 16 (RoPE split 8/4/4), real in/out channels
# and patch size, a short text context.
DEMO_MODEL = {
    "dim": 64,
    "ffn_dim": 128,
    "num_heads": 4,
    "num_layers": 4,
    "freq_dim": 64,
    "text_dim": 32,
    "text_len": 128,
}


# name -> where it is planted and how: {temporal RoPE pair: logit amplitude}, sign of k.
DEMO_PLANTED_HEADS = {
    "first_frame_sink": {"layer": 0, "head": 0, "pairs": {1: 8.0}, "sign": -1.0},
    "own_block": {"layer": 2, "head": 3, "pairs": {0: 3.0, 1: 6.0}, "sign": 1.0},
}
# The constant put on a planted channel before the RMS norm, and the RMS the norm then divides
# by (measured on the demo models: the other heads' projections are about unit scale).
_PLANT_VALUE = 1.2
_PLANT_RMS = 1.0


def plant_heads(model, planted: dict = DEMO_PLANTED_HEADS) -> list[str]:
    """Plant the heads of `planted` that `model` has (layer, head and pairs in range); returns
    their names. See the module docstring."""
    import torch

    from .rope import axis_dims

    cfg = model.config
    done = []
    for name, spec in planted.items():
        layer, head = spec["layer"], spec["head"]
        temporal_pairs = axis_dims(cfg.head_dim)[0] // 2
        if layer >= cfg.num_layers or head >= cfg.num_heads or max(spec["pairs"]) >= temporal_pairs:
            continue
        attn = model.blocks[layer].self_attn
        rows = slice(head * cfg.head_dim, (head + 1) * cfg.head_dim)
        with torch.no_grad():
            for projection in (attn.q, attn.k):
                projection.weight[rows] = 0
                projection.bias[rows] = 0
            for pair, amplitude in spec["pairs"].items():
                channel = head * cfg.head_dim + 2 * pair
                attn.q.bias[channel] = _PLANT_VALUE
                attn.k.bias[channel] = _PLANT_VALUE * spec["sign"]
                # logit = q_n k_n / sqrt(head_dim), q_n = k_n = value / rms * weight
                weight = (amplitude * cfg.head_dim**0.5) ** 0.5 * _PLANT_RMS / _PLANT_VALUE
                attn.norm_q.weight[channel] = weight
                attn.norm_k.weight[channel] = weight
        done.append(name)
    return done


def make_demo_checkpoint(out_dir: str | Path, *, seed: int, model: dict | None = None) -> WanConfig:
    """Write a seeded random-init Wan DiT in the original layout (config.json + safetensors)."""
    import torch  # here, so reading DEMO_MODEL while Snakemake parses stays torch-free

    from .checkpoint import save_wan_model
    from .model import WanModel

    cfg = WanConfig.from_dict({**DEMO_MODEL, **(model or {})}, source="demo model")
    generator = torch.Generator().manual_seed(seed)
    wan = WanModel(cfg)
    wan.init_weights(generator)
    plant_heads(wan)
    save_wan_model(wan, out_dir)
    return cfg


def make_demo_vae(out_dir: str | Path, *, seed: int, base_dim: int = 2) -> Path:
    """Write a seeded random Wan2.1 VAE of `base_dim` channels as a diffusers `vae/` folder
    (config.json + diffusion_pytorch_model.safetensors), atomically."""
    from .vae import random_vae, save_diffusers_layout, tiny_vae_config

    return save_diffusers_layout(random_vae(tiny_vae_config(base_dim), seed=seed), out_dir)
