"""Wan2.1's VAE, from the files users have, decoded as the long-video family decodes it.

The network is our own `vae_net.WanVAE` (torch only), Wan's original `WanVAE_` with its
parameter names, run op for op in diffusers' order: tests/test_vae.py proves it bit-equal
(float32, CPU) to diffusers' `AutoencoderKLWan`, the test-only reference, in decode (streamed
and whole, batches too) and encode. It is not diffusers' own because importing diffusers cost
5-6.5 s per job that decodes. Two layouts load:

- Wan's original `Wan2.1_VAE.pth`: a `torch.save` state dict with the original 194 keys, read
  with `weights_only=True`, the network's own names. The config is Wan2.1's
  (`WAN21_VAE_CONFIG`, z_dim 16). A `.safetensors` file in either key layout (ComfyUI ships the
  original one) loads the same way.
- diffusers' `vae/` folder: `config.json` + `diffusion_pytorch_model.safetensors` (or the
  pipeline folder holding `vae/`), its keys renamed by `diffusers_to_original_key`.

Keys are checked here, strictly (diffusers' `from_single_file` loads a file missing keys without
a word): missing, unexpected or wrong-shaped keys, a z_dim other than 16, pickled code and a
missing file raise `CheckpointError` naming the file and the keys as the file names them.

Latents are sinkscope's [C, F, H, W] float32, normalised as the DiT sees them. The family
(Self-Forcing's `WanVAEWrapper`, used by every system built on it) de-normalises with
`z / (1 / std) + mean` (the original computes `z / scale[1] + scale[0]` with
scale = [mean, 1 / std]; `z * std + mean` is 4e-6 off), decodes, takes `.float().clamp(-1, 1)`,
maps `(x * 0.5 + 0.5).clamp(0, 1)`, multiplies by 255 and writes with torchvision's
`write_video`, whose `torch.as_tensor(video, dtype=torch.uint8)` casts by truncation toward zero
(floor, the values being in [0, 255]): 127.5 -> 127, 254.99 -> 254, only 1.0 -> 255. The frames
here are those bytes. F latent frames decode to 4F - 3 pixel frames; T pixel frames encode to
1 + (T - 1) // 4 latent frames (frames past the last whole group of 4 are dropped, as there).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sinkscope.storage import atomic_path

from .checkpoint import check_state_keys, load_pickled, read_safetensors
from .layout import CONFIG_NAME, CheckpointError, vae_dir, weight_files
from .vae_net import WanVAE

__all__ = [
    "WAN21_VAE_CONFIG",
    "WAN_VAE_MEAN",
    "WAN_VAE_STD",
    "CheckpointError",
    "WanVAE",
    "decode_latents",
    "diffusers_to_original_key",
    "encode_frames",
    "frames_to_uint8",
    "iter_decoded_batch",
    "iter_decoded_frames",
    "iter_decoded_pixels",
    "load_wan_vae",
    "random_vae",
    "save_diffusers_layout",
    "save_original_layout",
    "tiny_vae_config",
]

# Per latent channel, Wan2.1's (Self-Forcing utils/wan_wrapper.py, diffusers' latents_mean/std).
WAN_VAE_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN_VAE_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
Z_DIM = len(WAN_VAE_MEAN)

# Wan2.1's VAE (the diffusers repo's vae/config.json; AutoencoderKLWan's defaults).
WAN21_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 96,
    "z_dim": Z_DIM,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}
DIFFUSERS_CLASS = "AutoencoderKLWan"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"


# --- the original key layout ------------------------------------------------------------------

# A residual block's parameter: diffusers' name -> the original's (`residual` is a Sequential:
# 0 norm, 1 SiLU, 2 conv, 3 norm, 4 SiLU, 5 dropout, 6 conv).
_RESNET_PARTS = (
    ("norm1.", "residual.0."),
    ("conv1.", "residual.2."),
    ("norm2.", "residual.3."),
    ("conv2.", "residual.6."),
    ("conv_shortcut.", "shortcut."),
)
_TOP_PARTS = (
    ("quant_conv.", "conv1."),
    ("post_quant_conv.", "conv2."),
    ("encoder.conv_in.", "encoder.conv1."),
    ("decoder.conv_in.", "decoder.conv1."),
    ("encoder.norm_out.", "encoder.head.0."),
    ("decoder.norm_out.", "decoder.head.0."),
    ("encoder.conv_out.", "encoder.head.2."),
    ("decoder.conv_out.", "decoder.head.2."),
    ("encoder.mid_block.attentions.0.", "encoder.middle.1."),
    ("decoder.mid_block.attentions.0.", "decoder.middle.1."),
)


def _resnet_part(rest: str, table=_RESNET_PARTS) -> str:
    for new, old in table:
        if rest.startswith(new):
            return old + rest[len(new) :]
    return rest  # a resample's own names (resample.1., time_conv.) are the same in both


def diffusers_to_original_key(key: str) -> str:
    """The original Wan name (`WanVAE`'s) of an `AutoencoderKLWan` parameter (Wan2.1's block
    structure: dim_mult of 4 levels, 2 residual blocks each, as diffusers'
    `convert_wan_vae_to_diffusers` assumes): the inverse of that converter, which
    tests/test_vae.py checks key by key. An original name comes back as it is."""
    for new, old in _TOP_PARTS:
        if key.startswith(new):
            return old + key[len(new) :]
    parts = key.split(".")
    if len(parts) < 5:
        return key
    if parts[1] == "mid_block" and parts[2] == "resnets":  # resnets 0, 1 -> middle 0, 2
        rest = ".".join(parts[4:])
        return f"{parts[0]}.middle.{2 * int(parts[3])}.{_resnet_part(rest)}"
    if parts[0] == "encoder" and parts[1] == "down_blocks":  # the same flat list
        return f"encoder.downsamples.{parts[2]}.{_resnet_part('.'.join(parts[3:]))}"
    if parts[0] == "decoder" and parts[1] == "up_blocks":
        # up_blocks.B.resnets.R -> upsamples.(4B + R); up_blocks.B.upsamplers.0 -> 4B + 3
        block = int(parts[2])
        if parts[3] == "resnets":
            index, rest = 4 * block + int(parts[4]), _resnet_part(".".join(parts[5:]))
        else:
            index, rest = 4 * block + 3, ".".join(parts[5:])
        return f"decoder.upsamples.{index}.{rest}"
    return key


def _original_to_diffusers_key(key: str) -> str:
    """`diffusers_to_original_key`, backwards (Wan2.1's structure); `_diffusers_names` checks
    each name against it."""
    for new, old in _TOP_PARTS:
        if key.startswith(old):
            return new + key[len(old) :]
    coder, group, index, *rest = key.split(".")
    back = tuple((old, new) for new, old in _RESNET_PARTS)
    if group == "middle":  # middle 1 is the attention, taken above
        return f"{coder}.mid_block.resnets.{int(index) // 2}.{_resnet_part('.'.join(rest), back)}"
    if group == "downsamples":
        return f"encoder.down_blocks.{index}.{_resnet_part('.'.join(rest), back)}"
    block, part = divmod(int(index), 4)  # upsamples
    if part == 3:
        return f"decoder.up_blocks.{block}.upsamplers.0.{'.'.join(rest)}"
    return f"decoder.up_blocks.{block}.resnets.{part}.{_resnet_part('.'.join(rest), back)}"


def _diffusers_names(keys) -> dict[str, str]:
    """Original name -> diffusers' of each of `keys` (a `WanVAE`'s), each checked to map back
    (a one to one map: no two keys share a diffusers name)."""
    names = {key: _original_to_diffusers_key(key) for key in keys}
    for key, name in names.items():
        if diffusers_to_original_key(name) != key:
            raise ValueError(
                f"no diffusers name for the VAE's '{key}' ('{name}' maps back to "
                f"'{diffusers_to_original_key(name)}')"
            )
    return names


def _state(vae: WanVAE) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in vae.state_dict().items()}


def save_original_layout(vae: WanVAE, path: str | Path) -> Path:
    """Write the VAE's weights as Wan's `Wan2.1_VAE.pth` holds them (a torch.save state dict
    with the original names, `WanVAE`'s own), atomically."""
    path = Path(path)
    with atomic_path(path) as temporary:
        torch.save(_state(vae), temporary)
    return path


def save_diffusers_layout(vae: WanVAE, folder: str | Path) -> Path:
    """Write the VAE as diffusers' `vae/` folder (`AutoencoderKLWan.from_pretrained` loads it):
    `config.json` (`_class_name` and the config) and `diffusion_pytorch_model.safetensors` in
    diffusers' names, atomically, without importing diffusers."""
    state = _state(vae)
    names = _diffusers_names(state)
    folder = Path(folder)
    with atomic_path(folder) as temporary:
        temporary.mkdir()
        config = {"_class_name": DIFFUSERS_CLASS, **vae.config}
        (temporary / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        weights = {names[k]: v for k, v in state.items()}
        save_file(weights, str(temporary / DIFFUSERS_WEIGHTS), metadata={"format": "pt"})
    return folder


# --- loading ----------------------------------------------------------------------------------


def _check_config(values: Mapping[str, Any], source: str) -> None:
    """Wan2.1's VAE only: z_dim 16 and its latent statistics (the normalisation uses them)."""
    z_dim = values.get("z_dim", Z_DIM)
    if z_dim != Z_DIM:
        raise CheckpointError(
            f"{source}: a VAE with z_dim {z_dim}; Wan2.1's has z_dim {Z_DIM} (the DiT's latent "
            "channels)"
        )
    if values.get("patch_size") is not None or values.get("is_residual", False):
        raise CheckpointError(
            f"{source}: patch_size={values.get('patch_size')}, "
            f"is_residual={values.get('is_residual')}: not Wan2.1's VAE (Wan2.2's?)"
        )
    for name, expected in (("latents_mean", WAN_VAE_MEAN), ("latents_std", WAN_VAE_STD)):
        found = values.get(name)
        if found is not None and [float(v) for v in found] != list(expected):
            raise CheckpointError(f"{source}: {name} {list(found)} are not Wan2.1's")


def _build(values: Mapping[str, Any], source: str) -> WanVAE:
    """The network of `values` on the meta device (the weights are assigned when loaded)."""
    try:
        with torch.device("meta"):
            return WanVAE(values)
    except ValueError as err:  # what WanVAE is not (Wan2.2's VAE, attention in the levels)
        raise CheckpointError(f"{source}: {err}") from None


def _to_model_keys(
    state: dict[str, torch.Tensor], source: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's tensors under the original names (diffusers' renamed, the original's left as
    they are), and model name -> the file's name, for the messages."""
    renamed: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for key, value in state.items():
        new = diffusers_to_original_key(key)
        if new in renamed:
            raise CheckpointError(
                f"{source}: '{names[new]}' and '{key}' are both the VAE's '{new}' (a file "
                "mixing the original and diffusers key layouts)"
            )
        renamed[new], names[new] = value, key
    return renamed, names


def _check_keys(
    vae: WanVAE,
    state: dict[str, torch.Tensor],
    names: dict[str, str],
    source: str,
) -> None:
    expected = vae.state_dict()
    z_weight = state.get("conv2.weight")  # the post-quant conv: z_dim -> z_dim
    if z_weight is not None and z_weight.ndim >= 1 and z_weight.shape[0] != vae.config.z_dim:
        raise CheckpointError(
            f"{source}: weights of a VAE with z_dim {z_weight.shape[0]} "
            f"('{names['conv2.weight']}' {list(z_weight.shape)}); expected z_dim "
            f"{vae.config.z_dim} (Wan2.1's)"
        )
    # A missing key is named in the file's layout: diffusers' when any of its names were.
    in_diffusers = any(name != key for key, name in names.items())
    layout = _diffusers_names(expected) if in_diffusers else {}

    def file_key(key: str) -> str:
        return names.get(key) or layout.get(key, key)

    check_state_keys(expected, state, source, "Wan2.1's VAE", file_key)


def _read_file(path: Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"VAE weights not found: {path}")
    if path.suffix == ".safetensors":
        return read_safetensors(path, device)
    state = load_pickled(path)  # weights_only=True: pickled code is refused, the file named
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        what = type(state).__name__
        raise CheckpointError(
            f"{path}: a {what}, not a state dict of tensors (parameter name -> tensor) as "
            "Wan2.1_VAE.pth holds"
        )
    return state


def load_wan_vae(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    config: Mapping[str, Any] | None = None,
) -> WanVAE:
    """Wan2.1's VAE as a `WanVAE`, weights loaded onto `device` in `dtype`, in eval mode without
    gradients.

    `path`: Wan's original `Wan2.1_VAE.pth` (or a `.safetensors` file in either key layout),
    built with `config` (`WAN21_VAE_CONFIG` when None; tests pass a tiny one); or a diffusers
    `vae/` folder (or the pipeline folder holding it), built from its `config.json`. Every key
    of the network must be in the file with its shape, and no other: `CheckpointError` names
    the file and the first keys otherwise.
    """
    path = Path(path)
    if path.is_dir():
        if config is not None:
            raise ValueError(f"{path}: a diffusers folder brings its own {CONFIG_NAME}")
        folder = vae_dir(path)
        config_file = folder / CONFIG_NAME
        try:
            values = json.loads(config_file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"VAE config not found: {config_file}") from None
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{config_file}: not valid JSON ({err})") from None
        if values.get("_class_name", DIFFUSERS_CLASS) != DIFFUSERS_CLASS:
            raise CheckpointError(
                f"{config_file}: a {values['_class_name']}, not diffusers' {DIFFUSERS_CLASS}"
            )
        _check_config(values, str(config_file))
        config_source = str(config_file)
        files = weight_files(folder)
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(_read_file(file, device))
        source = str(files[0]) if len(files) == 1 else str(folder)
    else:
        values = dict(WAN21_VAE_CONFIG if config is None else config)
        config_source = f"{path} (config)"
        _check_config(values, config_source)
        state = _read_file(path, device)
        source = str(path)
    vae = _build(values, config_source)
    state, names = _to_model_keys(state, source)
    _check_keys(vae, state, names, source)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    vae.load_state_dict(state, strict=True, assign=True)
    return vae.eval().requires_grad_(False)


# --- decoding and encoding --------------------------------------------------------------------


def _statistics(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (Z_DIM, 1, 1, 1)
    mean = torch.tensor(WAN_VAE_MEAN, dtype=torch.float32, device=device).view(shape)
    std = torch.tensor(WAN_VAE_STD, dtype=torch.float32, device=device).view(shape)
    return mean, std


def _denormalised(vae: WanVAE, latents: torch.Tensor) -> torch.Tensor:
    """[C, F, H, W] (or a batch [B, C, F, H, W]) of normalised latents -> the decoder's input
    [B, C, F, H, W] in its dtype: `z / (1 / std) + mean` in float32, the form bit-equal to the
    original's."""
    batch = latents if latents.ndim == 5 else latents.unsqueeze(0)
    if batch.ndim != 5 or batch.shape[1] != Z_DIM:
        raise ValueError(
            f"latents must be [C={Z_DIM}, F, H, W] or [B, C, F, H, W], got {list(latents.shape)}"
        )
    z = batch.to(device=vae.device, dtype=torch.float32)
    mean, std = _statistics(z.device)
    return (z / (1 / std) + mean).to(vae.dtype)


def frames_to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Decoded pixels [1, 3, T, H, W] (any float dtype, about [-1, 1]) -> uint8 frames
    [T, H, W, 3] on the CPU, as the family writes them: `.float().clamp(-1, 1)`,
    `(x * 0.5 + 0.5).clamp(0, 1)`, times 255, then truncated toward zero (torchvision's
    `write_video` casts with `torch.as_tensor(..., dtype=torch.uint8)`)."""
    x = pixels.float().clamp(-1, 1)
    x = (x * 0.5 + 0.5).clamp(0, 1)
    return (255.0 * x)[0].permute(1, 2, 3, 0).to(torch.uint8).cpu()


@torch.no_grad()
def decode_latents(vae: WanVAE, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents [C, F, H, W] -> uint8 frames [4F - 3, 8H, 8W, 3] on the CPU, the
    whole video's pixels at once through `WanVAE.decode` (see `iter_decoded_frames` for any
    length)."""
    return frames_to_uint8(vae.decode(_denormalised(vae, latents)))


@torch.no_grad()
def iter_decoded_pixels(
    vae: WanVAE, latents: torch.Tensor, chunk: int = 1
) -> Iterator[torch.Tensor]:
    """Decoded pixels [B, 3, t, 8H, 8W] in the VAE's dtype, clamped to [-1, 1], `chunk` latent
    frames at a time (t = 1 + 4 (chunk - 1) for the first, 4 chunk after), of latents
    [C, F, H, W] (B = 1) or a batch of videos of one shape [B, C, F, H, W] decoded side by side.

    The post-quant conv (`conv2`) on the whole latents, then a `WanVAE.decode_stream` (its own
    causal-conv cache) one latent frame at a time, as diffusers' `decode` runs its loop: the
    pixels are bit-equal to `WanVAE.decode`'s and to diffusers' `AutoencoderKLWan.decode`'s
    (tests/test_vae.py). Memory: the latents, 2 frames of features per causal conv and one chunk
    of pixels.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    # The whole video's post-quant conv at once, as `decode` runs it: a frame at a time is not
    # bit-equal (another conv algorithm). It holds the latents on the device: 16 values a latent
    # pixel, 0.4 GB in float32 for 1,101 frames at 60 x 104.
    x = vae.conv2(_denormalised(vae, latents))
    stream = vae.decode_stream()
    pending = []
    for i in range(x.shape[2]):
        pending.append(stream(x[:, :, i : i + 1]).clamp(-1.0, 1.0))
        if len(pending) == chunk or i == x.shape[2] - 1:
            yield torch.cat(pending, 2)
            pending = []


def iter_decoded_batch(
    vae: WanVAE, latents: torch.Tensor, chunk: int = 1
) -> Iterator[list[torch.Tensor]]:
    """Per chunk, the uint8 frames [t, 8H, 8W, 3] of each video of a batch [B, C, F, H, W]
    decoded side by side (one decoder call for all: what several rollouts in lockstep cost in
    Python and kernel launches, once). A video's frames can differ from its lone decode where a
    rounding difference (another convolution algorithm for another batch size) crosses a whole
    level before the uint8 cast: the demo's 7 rollouts, 0.04 % of the values, by 1-3 levels."""
    for pixels in iter_decoded_pixels(vae, latents, chunk):
        yield [frames_to_uint8(pixels[b : b + 1]) for b in range(pixels.shape[0])]


def iter_decoded_frames(
    vae: WanVAE, latents: torch.Tensor, chunk: int = 1
) -> Iterator[torch.Tensor]:
    """uint8 frames [t, 8H, 8W, 3] on the CPU as they are decoded, `chunk` latent frames at a
    time (1 pixel frame for the first latent frame, 4 for each after), equal to
    `decode_latents` in all; memory stays bounded for any length."""
    for pixels in iter_decoded_pixels(vae, latents, chunk):
        yield frames_to_uint8(pixels)


@torch.no_grad()
def encode_frames(vae: WanVAE, frames: torch.Tensor) -> torch.Tensor:
    """uint8 frames [T, H, W, 3] (H, W multiples of 8) -> normalised float32 latents
    [C, 1 + (T - 1) // 4, H / 8, W / 8] on the VAE's device: pixels x / 255 * 2 - 1, the
    posterior mean mu (`WanVAE.encode`, diffusers' `encode(x).latent_dist.mean`), then
    `(mu - mean) * (1 / std)`, the original's form of (mu - mean) / std."""
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    height, width = frames.shape[1:3]
    if height % 8 or width % 8:
        raise ValueError(f"frames of {height}x{width}: height and width must be multiples of 8")
    x = frames.to(device=vae.device).permute(3, 0, 1, 2).unsqueeze(0).float()
    x = (x / 255.0 * 2 - 1).to(vae.dtype)
    mu = vae.encode(x)[0].float()
    mean, std = _statistics(mu.device)
    return (mu - mean) * (1 / std)


# --- tiny VAEs for tests ----------------------------------------------------------------------


def tiny_vae_config(base_dim: int = 2) -> dict[str, Any]:
    """Wan2.1's VAE structure (z_dim 16, 4 levels of 2 residual blocks: the original key
    layout) at `base_dim` channels instead of 96: 68k parameters at 2."""
    return {**WAN21_VAE_CONFIG, "base_dim": base_dim}


def _diffusers_order(names: list[str]) -> list[str]:
    """`names` (a `WanVAE`'s parameters) in `AutoencoderKLWan`'s order, which registers a mid
    block's attention (middle.1) before its residual blocks (middle.0, middle.2)."""
    middle: dict[str, int] = {}  # encoder, decoder -> the position of its middle's first
    for i, name in enumerate(names):
        if name.split(".")[1] == "middle":
            middle.setdefault(name.split(".")[0], i)

    def position(item: tuple[int, str]) -> tuple[int, int]:
        i, name = item
        parts = name.split(".")
        return (middle[parts[0]], 0) if parts[1:3] == ["middle", "1"] else (i, 1)

    return [name for _, name in sorted(enumerate(names), key=position)]


def random_vae(config: Mapping[str, Any] | None = None, seed: int = 0) -> WanVAE:
    """A `WanVAE` of `config` (`tiny_vae_config()` when None) with every parameter random and
    distinct (norm gains 1 + noise, biases noise, weights noise / sqrt(fan-in)), float32, eval
    mode. Drawn in diffusers' parameter order: a seed gives the weights it gave when the network
    was diffusers' `AutoencoderKLWan` (tests/test_vae.py)."""
    generator = torch.Generator().manual_seed(seed)
    vae = WanVAE(tiny_vae_config() if config is None else config)
    params = dict(vae.named_parameters())
    with torch.no_grad():
        for name in _diffusers_order(list(params)):
            param = params[name]
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("gamma"):
                param.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                fan_in = math.prod(param.shape[1:])
                param.copy_(noise / math.sqrt(fan_in))
    return vae.eval().requires_grad_(False)
