"""LoRA adapters merged into the Wan DiT at load (LongLive's PEFT files; the keys and what is
refused: `lora_keys.py`).

The merged weight of each adapted linear is W + (alpha / r) B A, computed in float32 and stored
in W's dtype: what the unmerged adapter adds to the linear's output, (alpha / r) x A^T B^T.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .layout import CheckpointError
from .lora_keys import LORA_ENTRY, lora_pairs


def read_lora_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a LoRA file: `.safetensors`, or a torch `.pt` holding it under
    `generator_lora` or bare."""
    from .checkpoint import load_pickled, read_safetensors

    path = Path(path)
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    try:
        state = load_pickled(path)
    except FileNotFoundError:
        raise CheckpointError(f"LoRA file not found: {path}") from None
    if isinstance(state, dict) and LORA_ENTRY in state:
        state = state[LORA_ENTRY]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(
            f"{path}: not a LoRA state dict (name -> tensor), bare or under '{LORA_ENTRY}'"
        )
    return state


def linear_shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """The linear layers of a DiT state dict (a `<name>.weight` matrix beside `<name>.bias`),
    with their weight shapes [out, in]."""
    return {
        key.removesuffix(".weight"): tuple(tensor.shape)
        for key, tensor in state.items()
        if key.endswith(".weight")
        and tensor.dim() == 2
        and f"{key.removesuffix('.weight')}.bias" in state
    }


def merge_lora(
    state: dict[str, torch.Tensor], path: str | Path, alpha: float
) -> dict[str, torch.Tensor]:
    """`state` with the LoRA of `path` merged into it (a new dict; `state` is unchanged)."""
    lora = read_lora_state(path)
    shapes = {key: tuple(tensor.shape) for key, tensor in lora.items()}
    merged = dict(state)
    for pair in lora_pairs(shapes, linear_shapes(state), str(path)):
        weight = state[f"{pair.module}.weight"]
        up, down = (lora[key].to(weight.device, torch.float32) for key in pair.keys)
        delta = (alpha / pair.rank) * (up @ down)
        merged[f"{pair.module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged
