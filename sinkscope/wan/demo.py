"""The tiny random-init models of the embedded default: the real architecture at tiny width."""

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


def make_demo_checkpoint(out_dir: str | Path, *, seed: int, model: dict | None = None) -> WanConfig:
    """Write a seeded random-init Wan DiT in the original layout (config.json + safetensors)."""
    import torch  # here, so reading DEMO_MODEL while Snakemake parses stays torch-free

    from .checkpoint import save_wan_model
    from .model import WanModel

    cfg = WanConfig.from_dict({**DEMO_MODEL, **(model or {})}, source="demo model")
    generator = torch.Generator().manual_seed(seed)
    wan = WanModel(cfg)
    wan.init_weights(generator)
    save_wan_model(wan, out_dir)
    return cfg
