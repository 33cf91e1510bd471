"""Checks of a schema-validated config that need files or model facts.

`check_config` runs when Snakemake parses the workflow (rules/common.smk), so a bad config fails
before any job runs, with a message naming the key or file. No torch: parsing must stay fast.
"""

from __future__ import annotations

from pathlib import Path

from sinkscope.frames import block_sizes, visible_frames
from sinkscope.passes import resolve_passes
from sinkscope.wan.config import WanConfig

from .entries import (
    DEMO_DIR,
    ConfigError,
    checkpoint_inputs,
    is_demo_checkpoint,
    is_demo_encoder,
    model_config,
    prompt_embeddings,
    sampler_settings,
    uses_text_encoder,
)


def check_config(config: dict) -> None:
    """Raise ConfigError for problems the schema cannot see. Paths are relative to the workdir."""
    _check_prompts(config)
    demo_checkpoints = config.get("demo", {}).get("checkpoints", {})
    for name, entry in config["checkpoints"].items():
        key = f"checkpoints.{name}"
        if is_demo_checkpoint(config, name):
            if "generator" in entry:
                raise ConfigError(f"{key}.generator: a demo checkpoint has no generator file")
        else:
            for path in checkpoint_inputs(config, name):
                if not Path(path).is_file():
                    hint = (
                        f" (demo checkpoints are made under {DEMO_DIR}/<name> for names in "
                        f"demo.checkpoints: {sorted(demo_checkpoints)})"
                    )
                    raise ConfigError(f"{key}: checkpoint file not found: {path}{hint}")
        model = model_config(config, name)
        num_layers = model.num_layers
        num_heads = model.num_heads
        bad = [layer for layer in config["layers"] if layer >= num_layers]
        if bad:
            raise ConfigError(
                f"layers: {bad} out of range for checkpoint '{name}' "
                f"with {num_layers} layers (0-based)"
            )
        for _, head in config["figures"]["heads"]:
            if head >= num_heads:
                raise ConfigError(
                    f"figures.heads: head {head} out of range for checkpoint '{name}' "
                    f"with {num_heads} heads (0-based)"
                )
        patch = model.patch_size
        video = config["video"]
        if video["latent_height"] % patch[1] or video["latent_width"] % patch[2]:
            raise ConfigError(
                f"video: latent grid {video['latent_height']}x{video['latent_width']} is not "
                f"divisible by the patch size {patch[1]}x{patch[2]} of checkpoint '{name}'"
            )
        _check_sampler(config, name)
        _check_text_fits(config, name, model)
    for layer, _ in config["figures"]["heads"]:
        if layer not in config["layers"]:
            raise ConfigError(
                f"figures.heads: layer {layer} is not captured; add it to layers {config['layers']}"
            )
    video = config["video"]
    if video["frames_per_block"] > video["num_frames"]:
        raise ConfigError(
            f"video.frames_per_block={video['frames_per_block']} exceeds "
            f"video.num_frames={video['num_frames']}"
        )
    if not config["capture"]["tokens"] and config["figures"]["measure"] != "logits":
        raise ConfigError(
            "figures.measure: probabilities need the token logits; with capture.tokens: false "
            "only frame-level mean logits exist (measure: logits)"
        )
    if config["figures"]["step"] >= len(_capture_passes(config)):
        raise ConfigError(
            f"figures.step={config['figures']['step']} but only {len(_capture_passes(config))} "
            "passes are captured (capture.passes)"
        )


def _capture_passes(config: dict) -> list[int]:
    steps = min(len(sampler_settings(config, n)["steps"]) for n in config["checkpoints"])
    try:
        return resolve_passes(config["capture"]["passes"], steps)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_text_fits(config: dict, name: str, model: WanConfig) -> None:
    """Prompt embeddings must fit the DiT's text context (checked again on the real tensors)."""
    encoder = config.get("text_encoder")
    if encoder is None or not uses_text_encoder(config):
        return
    if encoder["text_len"] > model.text_len:
        raise ConfigError(
            f"text_encoder.text_len={encoder['text_len']} exceeds text_len={model.text_len} "
            f"of checkpoint '{name}'"
        )
    width = config["demo"]["text_encoder"]["d_model"]
    if is_demo_encoder(encoder) and width != model.text_dim:
        raise ConfigError(
            f"demo.text_encoder.d_model={width} differs from text_dim={model.text_dim} "
            f"of checkpoint '{name}'"
        )


def _check_prompts(config: dict) -> None:
    for name in config["prompts"]:
        path = prompt_embeddings(config, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"prompts.{name}.embeddings: file not found: {path}")
    if not uses_text_encoder(config):
        return
    encoder = config.get("text_encoder")
    if encoder is None:
        raise ConfigError("text_encoder: required, since some prompts bring no embeddings")
    if is_demo_encoder(encoder):
        return
    path = Path(encoder["path"])
    if not path.exists():
        raise ConfigError(f"text_encoder.path: not found: {path}")
    if path.is_file() and not encoder.get("tokenizer"):
        raise ConfigError(
            f"text_encoder.tokenizer: required with Wan's encoder file {path} "
            "(the google/umt5-xxl tokenizer folder)"
        )
    tokenizer = encoder.get("tokenizer")
    if tokenizer and not Path(tokenizer).is_dir():
        raise ConfigError(f"text_encoder.tokenizer: directory not found: {tokenizer}")


def _check_sampler(config: dict, name: str) -> None:
    sampler = sampler_settings(config, name)
    key = f"checkpoints.{name}.sampler" if "sampler" in config["checkpoints"][name] else "sampler"
    if sampler["warp"] and any(float(s) != int(s) for s in sampler["steps"]):
        raise ConfigError(
            f"{key}.steps: warped steps must be integers 1..1000, got {sampler['steps']}"
        )
    video = config["video"]
    sizes = block_sizes(video["num_frames"], video["frames_per_block"])
    window = sampler["local_attn_size"]
    if window == -1 and sampler["sink_size"]:
        raise ConfigError(f"{key}.sink_size needs a window (local_attn_size != -1)")
    try:
        visible_frames(sizes, window, sampler["sink_size"])
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None
