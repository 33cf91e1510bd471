"""Loading and saving Wan DiT weights in the formats researchers have.

- Wan's original layout and diffusers' `WanTransformer3DModel` folders (see `layout.py`), one file
  or shards; diffusers keys are renamed to the original ones.
- Self-Forcing / CausVid: a pickled `.pt` whose `generator_ema` / `generator` entry holds the DiT
  with keys prefixed `model.`, layered over a base folder that supplies the config. Rolling
  Forcing's and Causal Forcing's keys may also carry FSDP's `_fsdp_wrapped_module.` (once per
  wrapped module, anywhere in the key), which their loaders remove, as `read_generator` does.
- LongLive: such weights with a LoRA file beside them, run unmerged as LongLive's PEFT adapters
  run (`lora.py`).
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sinkscope.storage import atomic_path, write_text_atomically

from .layout import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    is_diffusers,
    read_config_json,
    read_model_config,
    weight_files,
)
from .lora import LoraLinear, attach_lora
from .model import WanModel
from .spec import CheckpointSpec

__all__ = ["CheckpointError", "CheckpointSpec", "load_wan_model", "save_wan_model"]

# diffusers -> original Wan names (the inverse of diffusers' convert_wan_to_diffusers table).
# Applied in order to the key with "blocks.N." removed; first match wins.
_DIFFUSERS_BLOCK_KEYS = [
    (r"^attn1\.to_out\.0\.", "self_attn.o."),
    (r"^attn1\.to_([qkv])\.", r"self_attn.\1."),
    (r"^attn1\.norm_([qk])\.", r"self_attn.norm_\1."),
    (r"^attn2\.to_out\.0\.", "cross_attn.o."),
    (r"^attn2\.to_([qkv])\.", r"cross_attn.\1."),
    (r"^attn2\.norm_([qk])\.", r"cross_attn.norm_\1."),
    (r"^norm2\.", "norm3."),  # diffusers' affine cross-attention norm is Wan's norm3
    (r"^ffn\.net\.0\.proj\.", "ffn.0."),
    (r"^ffn\.net\.2\.", "ffn.2."),
    (r"^scale_shift_table$", "modulation"),
]
_DIFFUSERS_TOP_KEYS = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
]


def _rename(key: str, rules: list[tuple[str, str]]) -> str:
    for pattern, replacement in rules:
        renamed, count = re.subn(pattern, replacement, key)
        if count:
            return renamed
    return key


def diffusers_to_wan_key(key: str) -> str:
    """The original Wan name of a diffusers `WanTransformer3DModel` parameter."""
    match = re.match(r"^(blocks\.\d+\.)(.*)$", key)
    if match:
        return match.group(1) + _rename(match.group(2), _DIFFUSERS_BLOCK_KEYS)
    return _rename(key, _DIFFUSERS_TOP_KEYS)


def read_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(device))
    except FileNotFoundError:
        raise CheckpointError(f"weights not found: {path}") from None
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None


def load_pickled(path: str | Path) -> object:
    """`torch.load` with weights_only=True (a pickle that carries code is refused), memory-mapped
    where the file format allows. Errors name the file; a missing file is FileNotFoundError."""
    path = Path(path)
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap can only be used" not in str(err):
                raise
            # A legacy (pre-zip) torch.save file: no mmap, still weights only.
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"not found: {path}") from None
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f" (it references {found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path}: refused to unpickle{what}: weights_only=True allows tensors and plain "
            "containers only, and code inside a pickle is never run"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path}: not a readable torch checkpoint (truncated, or not a torch.save file): {err}"
        ) from None


FSDP_INFIX = "_fsdp_wrapped_module."


def generator_key(key: str) -> str:
    """The DiT parameter name of a generator key: FSDP's infix removed wherever it appears, then
    the wrapper's `model.` prefix."""
    return key.replace(FSDP_INFIX, "").removeprefix("model.")


def read_generator(path: str | Path, ema: bool = True) -> dict[str, torch.Tensor]:
    """DiT weights of a Self-Forcing / CausVid / Rolling Forcing `.pt`, keys cleaned by
    `generator_key`."""
    path = Path(path)
    key = "generator_ema" if ema else "generator"
    try:
        state = load_pickled(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    if not isinstance(state, dict) or key not in state:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: no '{key}' entry (ema={ema}); it has {found}")
    weights = state[key]
    if not isinstance(weights, dict) or not all(
        isinstance(v, torch.Tensor) for v in weights.values()
    ):
        what = type(weights).__name__
        raise CheckpointError(
            f"{path}: '{key}' is a {what}, not a state dict of tensors (parameter name -> tensor)"
        )
    cleaned: dict[str, torch.Tensor] = {}
    originals: dict[str, str] = {}
    for original, value in weights.items():
        clean = generator_key(original)
        if clean in cleaned:
            raise CheckpointError(
                f"{path}: '{key}' holds '{originals[clean]}' and '{original}', both the DiT's "
                f"'{clean}' once FSDP's '{FSDP_INFIX}' and the 'model.' prefix are removed"
            )
        cleaned[clean], originals[clean] = value, original
    return cleaned


def _listed(items: list[str], limit: int = 10) -> str:
    return f"{items[:limit]}{' ...' if len(items) > limit else ''}"


def check_state_keys(
    expected: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    source: str,
    what: str,
    file_key: Callable[[str], str] = str,
) -> None:
    """Refuse a state dict (from the file `source`) whose keys or shapes are not `expected`'s
    (a model's state dict; `what` it is), naming the first keys as the file names them
    (`file_key` of a model key)."""
    missing = sorted(file_key(k) for k in set(expected) - set(state))
    unexpected = sorted(file_key(k) for k in set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: keys do not match {what}: missing {_listed(missing)}, "
            f"unexpected {_listed(unexpected)}"
        )
    wrong = [
        f"{file_key(k)}: file {list(state[k].shape)} vs model {list(v.shape)}"
        for k, v in expected.items()
        if tuple(state[k].shape) != tuple(v.shape)
    ]
    if wrong:
        raise CheckpointError(f"{source}: wrong shapes: {_listed(wrong)}")


def load_wan_model(
    spec: CheckpointSpec | str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> WanModel:
    """Build the DiT from the spec's config.json and load its weights straight onto `device`.

    `spec.base`: a Wan or diffusers folder (see `layout.py`); a plain path means just that folder.
    With `spec.generator`, the `.pt` file's DiT (`generator_ema` if `spec.ema`) replaces the base
    weights (it must be complete); the folder then only supplies the config. With `spec.lora`,
    the linears that LoRA adapts become `lora.LoraLinear`s, run unmerged as LongLive runs them,
    its A and B cast to `dtype` like every other parameter.
    """
    if not isinstance(spec, CheckpointSpec):
        spec = CheckpointSpec(base=str(spec))
    cfg = read_model_config(spec.base)
    with torch.device("meta"):
        model = WanModel(cfg)
    if spec.generator is not None:
        state = read_generator(spec.generator, ema=spec.ema)
        source = f"{spec.generator} ({'generator_ema' if spec.ema else 'generator'})"
    else:
        state = {}
        for path in weight_files(spec.base):
            state.update(read_safetensors(path, device))
        if is_diffusers(read_config_json(spec.base)):
            state = {diffusers_to_wan_key(k): v for k, v in state.items()}
        source = str(spec.base)
    check_state_keys(model.state_dict(), state, source, "the Wan DiT")
    if spec.lora is not None:
        state = {**state, **attach_lora(model, spec.lora, spec.lora_alpha)}
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def save_wan_model(model: WanModel, out_dir: str | Path) -> None:
    """Write `config.json` + `diffusion_pytorch_model.safetensors` in Wan's original layout,
    which has no place for a LoRA: a model carrying one is refused (its base and its LoRA file
    are what load it)."""
    adapted = [name for name, module in model.named_modules() if isinstance(module, LoraLinear)]
    if adapted:
        raise CheckpointError(
            f"the model carries a LoRA on {len(adapted)} linears ('{adapted[0]}' ...): Wan's "
            "layout has no place for it; keep its base and its LoRA file instead"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_path(out_dir / WEIGHTS_NAME) as temporary:
        save_file(state, str(temporary), metadata={"format": "pt"})
    write_text_atomically(
        out_dir / CONFIG_NAME, json.dumps(model.config.to_dict(), indent=2) + "\n"
    )
