"""The model's dtype (`dtype` in the config): `auto` runs bfloat16 on CUDA, as Self-Forcing
does, and float32 on the CPU; `float32` and `bfloat16` force one on any device (bfloat16 on the
CPU is slow but exact to what a GPU job computes in it, up to the kernels' summation order).

In either dtype the model and the samplers round where the released code rounds (docs/DESIGN.md,
"Where the model rounds": LayerNorm and RMS norm normalise in float32 inside, RoPE, the timestep
sinusoid and x0 are computed in float64, the re-noise in float32, each rounded once to the
model's dtype), and the capture's reductions (softmax, key mass, entropy, pooled logits) run in
float32 beside the model (`extraction.capture`)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_SETTINGS = ("auto", *DTYPES)


def model_dtype(device: torch.device | str, setting: str = "auto") -> torch.dtype:
    """The dtype of a model on `device` under the config's `dtype` setting."""
    if setting == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if setting not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_SETTINGS}, got {setting!r}")
    return DTYPES[setting]
