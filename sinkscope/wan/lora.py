"""LoRA adapters on the Wan DiT, run unmerged as LongLive runs them (LongLive's PEFT files; the
keys and what is refused: `lora_keys.py`).

LongLive (NVlabs/LongLive 2462895: `interactive_inference.py`, `utils/lora_utils.py`) wraps its
DiT in PEFT's LoRA layers, never merges them, and casts the whole pipeline to bfloat16. So here
every linear the file adapts becomes a `LoraLinear`, which keeps the linear's weight W and bias b
and adds A [r, in] and B [out, r] (no bias), all in the model's dtype like every other
parameter, and computes PEFT's `lora.Linear.forward`: base(x) + B(A(x)) * (alpha / r). In exact
arithmetic that is the merged linear W + (alpha / r) B A; in bfloat16 it rounds where the
release rounds: the base output, A x, B A x, its product with the scale, and the sum (a merged
weight would round W + (alpha / r) B A once instead and differ in about half of the outputs).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

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


class LoraLinear(nn.Module):
    """A linear with a LoRA adapter beside it, as PEFT's `lora.Linear` runs one (no dropout:
    inference). `weight` and `bias` are the base linear's own parameters under the same names,
    so the state-dict keys of the `nn.Linear` it replaces stay (`blocks.0.self_attn.q.weight`);
    the adapter's are `<name>.lora_A.weight` [r, in] and `<name>.lora_B.weight` [out, r]."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        made = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **made)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **made)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        adapted = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype)))
        return (result + adapted * self.scaling).to(result.dtype)

    def extra_repr(self) -> str:
        rank = self.lora_A.out_features
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={rank}, "
            f"scaling={self.scaling}"
        )


def attach_lora(model: nn.Module, path: str | Path, alpha: float) -> dict[str, torch.Tensor]:
    """Put a `LoraLinear` (scale alpha / r) in place of every linear of `model` (a `WanModel`)
    that the LoRA file at `path` adapts, keeping that linear's weight and bias; the adapter's
    own parameters are left as made on the linear's device (the loader's meta device). Returns
    the file's A and B under the model's state-dict names (`blocks.0.self_attn.q.lora_A.weight`),
    to be loaded with the rest of the state. A malformed file is refused (`lora_keys.lora_pairs`)
    before the model is changed, naming the file and the key."""
    lora = read_lora_state(path)
    shapes = {key: tuple(tensor.shape) for key, tensor in lora.items()}
    pairs = lora_pairs(shapes, model.config.linear_shapes(), str(path))
    state = {}
    for pair in pairs:
        parent_name, _, child = pair.module.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        if not isinstance(base, nn.Linear):
            raise CheckpointError(f"{path}: '{pair.module}' already carries a LoRA")
        setattr(parent, child, LoraLinear(base, pair.rank, alpha / pair.rank))
        state[f"{pair.module}.lora_A.weight"] = lora[pair.down_key]
        state[f"{pair.module}.lora_B.weight"] = lora[pair.up_key]
    return state
