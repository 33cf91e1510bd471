"""A rollout's x0 latents on disk: one safetensors tensor (`LATENTS_KEY`, [C, F, H, W] float32)
with its provenance as JSON metadata. The closed loop writes one per rollout, the survey one per
run (for its video); the decode job reads them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sinkscope.storage import atomic_path

LATENTS_KEY = "x0"


def save_latents(path: str | Path, latents: torch.Tensor, metadata: dict) -> None:
    """x0 latents [C, F, H, W] (float32) and their provenance (JSON values), atomically."""
    with atomic_path(path) as temporary:
        save_file(
            {LATENTS_KEY: latents.contiguous()},
            str(temporary),
            metadata={key: json.dumps(value) for key, value in metadata.items()},
        )


def read_latents_metadata(path: str | Path) -> dict:
    """The provenance `save_latents` wrote, without reading the latents."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: json.loads(value) for key, value in handle.metadata().items()}
    except FileNotFoundError:
        raise FileNotFoundError(f"latents not found: {path}") from None


def load_latents(path: str | Path) -> tuple[torch.Tensor, dict]:
    """What `save_latents` wrote: the latents and the provenance."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            if LATENTS_KEY not in handle.keys():
                raise ValueError(f"{path}: no '{LATENTS_KEY}' tensor; it has {list(handle.keys())}")
            latents = handle.get_tensor(LATENTS_KEY)
            metadata = {key: json.loads(value) for key, value in handle.metadata().items()}
    except FileNotFoundError:
        raise FileNotFoundError(f"latents not found: {path}") from None
    return latents, metadata
