"""Where a checkpoint's files are and which format they are in. No torch: Snakemake parses with it.

Two directory formats carry the DiT:
- Wan's original: `config.json` (`_class_name: WanModel`, or none) and
  `diffusion_pytorch_model.safetensors`, original key names.
- diffusers: `config.json` of `WanTransformer3DModel` with the same weight file names, diffusers
  key names; either the `transformer/` folder itself or the pipeline folder holding it.
Both may be sharded: `diffusion_pytorch_model.safetensors.index.json` lists the shards.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import WanConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
DIFFUSERS_CLASS = "WanTransformer3DModel"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the keys."""


VAE_FOLDER = "vae"  # a diffusers pipeline folder's VAE


def vae_dir(path: str | Path) -> Path:
    """The folder holding a diffusers VAE's config.json: `path`, or `path/vae` of a pipeline."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file() and (path / VAE_FOLDER / CONFIG_NAME).is_file():
        return path / VAE_FOLDER
    return path


def model_dir(base: str | Path) -> Path:
    """The folder holding the DiT's config.json: `base`, or `base/transformer` of a pipeline."""
    base = Path(base)
    if not (base / CONFIG_NAME).exists() and (base / "transformer" / CONFIG_NAME).exists():
        return base / "transformer"
    return base


def read_config_json(base: str | Path) -> dict:
    path = model_dir(base) / CONFIG_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"model config not found: {path}") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None


def is_diffusers(values: dict) -> bool:
    return values.get("_class_name") == DIFFUSERS_CLASS


def wan_config_from_diffusers(values: dict, source: str = "config") -> WanConfig:
    """The WanConfig of a diffusers `WanTransformer3DModel` config.json."""
    if values.get("image_dim") is not None or values.get("added_kv_proj_dim") is not None:
        raise CheckpointError(f"{source}: an image-to-video transformer; only T2V is supported")
    if values.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
        raise CheckpointError(
            f"{source}: qk_norm={values['qk_norm']!r}, Wan uses rms_norm_across_heads"
        )
    heads = values.get("num_attention_heads", 40)
    head_dim = values.get("attention_head_dim", 128)
    try:
        return WanConfig(
            dim=heads * head_dim,
            ffn_dim=values.get("ffn_dim", 13824),
            num_heads=heads,
            num_layers=values.get("num_layers", 40),
            freq_dim=values.get("freq_dim", 256),
            text_dim=values.get("text_dim", 4096),
            in_dim=values.get("in_channels", 16),
            out_dim=values.get("out_channels", 16),
            patch_size=tuple(values.get("patch_size", (1, 2, 2))),
            cross_attn_norm=values.get("cross_attn_norm", True),
            eps=values.get("eps", 1e-6),
        )
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from None


def read_model_config(base: str | Path) -> WanConfig:
    """The DiT config of a Wan or diffusers folder."""
    values = read_config_json(base)
    source = str(model_dir(base) / CONFIG_NAME)
    if is_diffusers(values):
        return wan_config_from_diffusers(values, source)
    try:
        return WanConfig.from_dict(values, source=source)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def weight_files(base: str | Path) -> list[Path]:
    """The safetensors files of a folder: one file, or the shards its index lists."""
    folder = model_dir(base)
    index = folder / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index}: not a safetensors index with a weight_map ({err})"
            ) from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    return [folder / WEIGHTS_NAME]


def checkpoint_files(base: str | Path, generator: str | Path | None = None) -> list[Path]:
    """Every file whose bytes define a checkpoint entry: its config and the weights it loads.

    A generator `.pt` replaces the base weights entirely, so then only the base config counts.
    """
    folder = model_dir(base)
    files = [folder / CONFIG_NAME]
    if generator is not None:
        return [*files, Path(generator)]
    if (folder / INDEX_NAME).exists():
        files.append(folder / INDEX_NAME)
    return files + weight_files(folder)
