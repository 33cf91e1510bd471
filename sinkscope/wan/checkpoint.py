"""Loading and saving Wan DiT weights in the formats researchers have.

- Wan's original layout: a directory with `config.json` and `diffusion_pytorch_model.safetensors`
  (or shards listed in `diffusion_pytorch_model.safetensors.index.json`), original key names.
- Self-Forcing / CausVid: a pickled `.pt` whose `generator_ema` / `generator` entry holds the DiT
  with keys prefixed `model.`, layered over a base directory.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import WanConfig
from .model import WanModel

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded; the message names the file and the keys."""


def base_weight_files(base_dir: str | Path) -> list[Path]:
    """The safetensors files of an original-layout Wan directory (one file or index shards)."""
    base_dir = Path(base_dir)
    index = base_dir / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(
                f"{index}: not a safetensors index with a weight_map ({err})"
            ) from None
        return [base_dir / name for name in sorted(set(weight_map.values()))]
    return [base_dir / WEIGHTS_NAME]


def checkpoint_files(base_dir: str | Path, generator: str | Path | None = None) -> list[Path]:
    """Every file whose bytes define a checkpoint entry: its config and the weights it loads.

    A generator `.pt` replaces the base weights entirely, so then only the base config counts.
    """
    files = [Path(base_dir) / CONFIG_NAME]
    if generator is not None:
        return [*files, Path(generator)]
    index = Path(base_dir) / INDEX_NAME
    if index.exists():
        files.append(index)
    return files + base_weight_files(base_dir)


def read_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(device))
    except FileNotFoundError:
        raise CheckpointError(f"weights not found: {path}") from None
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None


def read_generator(path: str | Path, ema: bool = True) -> dict[str, torch.Tensor]:
    """DiT weights of a Self-Forcing / CausVid `.pt`, `model.` prefix stripped.

    Loaded with weights_only=True: a pickle that carries code is refused.
    """
    path = Path(path)
    key = "generator_ema" if ema else "generator"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path}: refused to unpickle (weights_only=True allows tensors and plain containers "
            f"only; this file carries other objects or code): {err}"
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({err})") from None
    if not isinstance(state, dict) or key not in state:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: no '{key}' entry (ema={ema}); it has {found}")
    weights = state[key]
    return {k.removeprefix("model."): v for k, v in weights.items()}


def sha256_files(paths: Iterable[str | Path], chunk_bytes: int = 1 << 24) -> str:
    """One sha256 over the bytes of several files, in order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(chunk_bytes):
                digest.update(block)
    return digest.hexdigest()


def _check_keys(model: WanModel, state: dict[str, torch.Tensor], source: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: keys do not match the Wan DiT: missing {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}"
        )
    wrong = [
        f"{k}: file {list(state[k].shape)} vs model {list(v.shape)}"
        for k, v in expected.items()
        if tuple(state[k].shape) != tuple(v.shape)
    ]
    if wrong:
        raise CheckpointError(f"{source}: wrong shapes: {wrong[:10]}")


def load_wan_model(
    base_dir: str | Path,
    *,
    generator: str | Path | None = None,
    ema: bool = True,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> WanModel:
    """Build the DiT from `base_dir/config.json` and load its weights straight onto `device`.

    With `generator`, the `.pt` file's DiT replaces the base weights (it must be complete).
    """
    base_dir = Path(base_dir)
    cfg = WanConfig.from_json(base_dir / CONFIG_NAME)
    with torch.device("meta"):
        model = WanModel(cfg)
    if generator is not None:
        state = read_generator(generator, ema=ema)
        source = f"{generator} ({'generator_ema' if ema else 'generator'})"
    else:
        state = {}
        for path in base_weight_files(base_dir):
            state.update(read_safetensors(path, device))
        source = str(base_dir)
    _check_keys(model, state, source)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def save_wan_model(model: WanModel, out_dir: str | Path) -> None:
    """Write `config.json` + `diffusion_pytorch_model.safetensors` in Wan's original layout."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
