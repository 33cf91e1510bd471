"""LoRA adapters merged into the Wan DiT at load (LongLive's PEFT files; the keys and what is
refused: `lora_keys.py`).

The merged weight of each adapted linear is W + (alpha / r) B A, computed in float32 and stored
in W's dtype: what the unmerged adapter adds to the linear's output, (alpha / r) x A^T B^T.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .layout import CheckpointError
from .lora_keys import lora_entry, lora_pairs


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
    return lora_entry(state, str(path), lambda value: isinstance(value, torch.Tensor))


def merge_lora(
    state: dict[str, torch.Tensor],
    path: str | Path,
    alpha: float,
    linears: dict[str, tuple[int, int]],
) -> dict[str, torch.Tensor]:
    """`state` with the LoRA of `path` merged into it (a new dict; `state` is unchanged);
    `linears`: the model's linears, `WanConfig.linear_shapes()`."""
    lora = read_lora_state(path)
    shapes = {key: tuple(tensor.shape) for key, tensor in lora.items()}
    merged = dict(state)
    for pair in lora_pairs(shapes, linears, str(path)):
        weight = state[f"{pair.module}.weight"]
        up, down = (lora[key].to(weight.device, torch.float32) for key in pair.keys)
        delta = (alpha / pair.rank) * (up @ down)
        merged[f"{pair.module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged
