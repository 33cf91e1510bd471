"""Checks of a schema-validated config that need files or model facts, and per-job settings.

Everything here runs when Snakemake parses the workflow, so a bad config fails before any job
runs, with a message naming the key or file. No torch import: parsing must stay fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .digest import DIGEST_CACHE, cached_sha256
from .frames import block_sizes, visible_frames
from .wan.config import WanConfig
from .wan.layout import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    checkpoint_files,
    read_model_config,
)

DEMO_DIR = "results/demo"
DEMO_WEIGHT_FILES = (CONFIG_NAME, WEIGHTS_NAME)


class ConfigError(ValueError):
    """A config.yaml problem; the message names the key or file."""


def demo_checkpoint_dir(name: str) -> str:
    return f"{DEMO_DIR}/{name}"


def demo_text_encoder_dir() -> str:
    return f"{DEMO_DIR}/text_encoder"


def _is_demo_path(config: dict, path: str) -> bool:
    made = {demo_checkpoint_dir(n) for n in config.get("demo", {}).get("checkpoints", {})}
    return Path(path).as_posix().rstrip("/") in made


def is_demo_checkpoint(config: dict, name: str) -> bool:
    """Whether checkpoint `name` is one the workflow makes itself (rule make_demo_checkpoint)."""
    return _is_demo_path(config, config["checkpoints"][name]["base"])


def checkpoint_inputs(config: dict, name: str) -> list[str]:
    """Files whose bytes define checkpoint `name`: the inputs of its extraction jobs."""
    entry = config["checkpoints"][name]
    if _is_demo_path(config, entry["base"]):
        return [f"{entry['base']}/{file}" for file in DEMO_WEIGHT_FILES]
    try:
        files = checkpoint_files(entry["base"], entry.get("generator"))
    except CheckpointError as err:
        raise ConfigError(f"checkpoints.{name}: {err}") from None
    return [str(path) for path in files]


def model_config(config: dict, name: str) -> WanConfig:
    """The DiT config of a checkpoint: its config.json, or the demo model it will be made from."""
    entry = config["checkpoints"][name]
    if _is_demo_path(config, entry["base"]):
        from .wan.demo import DEMO_MODEL

        return WanConfig.from_dict({**DEMO_MODEL, **config["demo"].get("model", {})}, "demo.model")
    try:
        return read_model_config(entry["base"])
    except CheckpointError as err:
        raise ConfigError(f"checkpoints.{name}.base: {err}") from None


def prompt_text(config: dict, name: str) -> str:
    entry = config["prompts"][name]
    return entry["text"] if isinstance(entry, dict) else entry


def prompt_embeddings(config: dict, name: str) -> str | None:
    """The precomputed embeddings file of a prompt, if it brings one."""
    entry = config["prompts"][name]
    return entry["embeddings"] if isinstance(entry, dict) else None


def prompt_inputs(config: dict, name: str) -> dict[str, str]:
    """Inputs of a prompt's encode job: its embeddings file, or the text encoder (and tokenizer)."""
    embeddings = prompt_embeddings(config, name)
    if embeddings is not None:
        return {"embeddings": embeddings}
    encoder = config["text_encoder"]
    inputs = {"encoder": encoder["path"]}
    if encoder.get("tokenizer"):
        inputs["tokenizer"] = encoder["tokenizer"]
    return inputs


def prompt_encoder(config: dict, name: str) -> dict | None:
    """The text-encoder settings a prompt's job depends on (none when it brings embeddings)."""
    if prompt_embeddings(config, name) is not None:
        return None
    return canonical(config["text_encoder"])


def canonical(value):
    """`value` with every mapping's keys sorted, recursively.

    Snakemake compares params by their text, so the key order of a YAML edit must not matter.
    """
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [canonical(item) for item in value]
    return value


def sampler_settings(config: dict, name: str) -> dict:
    """The global sampler with the checkpoint's overrides."""
    return {**config["sampler"], **config["checkpoints"][name].get("sampler", {})}


def checkpoint_content(config: dict, name: str, cache: str | Path = DIGEST_CACHE) -> dict:
    """What decides the bytes of checkpoint `name`: the sha256 of its files (cached, so read once
    per change), or for a demo checkpoint the recipe its rule makes it from (its files may not
    exist yet when the workflow is parsed)."""
    entry = config["checkpoints"][name]
    if is_demo_checkpoint(config, name):
        demo = Path(entry["base"]).name
        return {
            "demo_seed": config["demo"]["checkpoints"][demo],
            "demo_model": config["demo"].get("model", {}),
        }
    try:
        return {"sha256": cached_sha256(checkpoint_inputs(config, name), cache)}
    except OSError as err:
        raise ConfigError(f"checkpoints.{name}: {err}") from None


def extraction_settings(config: dict, name: str, cache: str | Path = DIGEST_CACHE) -> dict:
    """Everything an extraction job of checkpoint `name` depends on, and nothing else.

    Used as the job's params, so adding layers or prompts does not re-run existing jobs, and the
    checkpoint's content (not its files' timestamps) re-runs them when it changes.
    """
    entry = config["checkpoints"][name]
    return canonical(
        {
            "checkpoint": {
                **{k: entry[k] for k in ("base", "generator", "ema") if k in entry},
                **checkpoint_content(config, name, cache),
            },
            "sampler": sampler_settings(config, name),
            "video": config["video"],
            "capture": {k: config["capture"][k] for k in ("passes", "tokens")},
            "seed": config["seed"],
            "device": config["device"],
        }
    )


def extraction_gpus(config: dict) -> int:
    """GPUs an extraction job holds: none when it is told to run on the CPU."""
    return 0 if config["device"] == "cpu" else 1


def check_config(config: dict) -> None:
    """Raise ConfigError for problems the schema cannot see. Paths are relative to the workdir."""
    _check_prompts(config)
    demo_checkpoints = config.get("demo", {}).get("checkpoints", {})
    for name, entry in config["checkpoints"].items():
        key = f"checkpoints.{name}"
        if _is_demo_path(config, entry["base"]):
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


def resolve_passes(spec: str | int | Sequence[int | str], num_steps: int) -> list[int]:
    """Pass indices within a block (0..num_steps-1 denoising steps, num_steps = cache pass).

    spec: 'all', 'cache', 'last' (the last denoising step), an index, or a list of those.
    """
    cache = num_steps
    if isinstance(spec, str | int):
        spec = [spec]
    chosen: set[int] = set()
    for item in spec:
        if item == "all":
            chosen.update(range(num_steps + 1))
        elif item == "cache":
            chosen.add(cache)
        elif item == "last":
            chosen.add(num_steps - 1)
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= cache:
            chosen.add(item)
        else:
            raise ValueError(
                f"capture.passes: {item!r} is not 'all', 'cache', 'last' or a pass index "
                f"0..{cache} ({num_steps} denoising steps, then the cache pass)"
            )
    return sorted(chosen)


def _capture_passes(config: dict) -> list[int]:
    steps = min(len(sampler_settings(config, n)["steps"]) for n in config["checkpoints"])
    try:
        return resolve_passes(config["capture"]["passes"], steps)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _uses_text_encoder(config: dict) -> bool:
    """Whether some prompt must be encoded (brings no precomputed embeddings)."""
    return any(prompt_embeddings(config, name) is None for name in config["prompts"])


def _is_demo_encoder(encoder: dict) -> bool:
    """Whether text_encoder.path is the one rule make_demo_text_encoder writes."""
    return Path(encoder["path"]).as_posix().rstrip("/") == demo_text_encoder_dir()


def _check_text_fits(config: dict, name: str, model: WanConfig) -> None:
    """Prompt embeddings must fit the DiT's text context (checked again on the real tensors)."""
    encoder = config.get("text_encoder")
    if encoder is None or not _uses_text_encoder(config):
        return
    if encoder["text_len"] > model.text_len:
        raise ConfigError(
            f"text_encoder.text_len={encoder['text_len']} exceeds text_len={model.text_len} "
            f"of checkpoint '{name}'"
        )
    width = config["demo"]["text_encoder"]["d_model"]
    if _is_demo_encoder(encoder) and width != model.text_dim:
        raise ConfigError(
            f"demo.text_encoder.d_model={width} differs from text_dim={model.text_dim} "
            f"of checkpoint '{name}'"
        )


def _check_prompts(config: dict) -> None:
    for name in config["prompts"]:
        path = prompt_embeddings(config, name)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"prompts.{name}.embeddings: file not found: {path}")
    if not _uses_text_encoder(config):
        return
    encoder = config.get("text_encoder")
    if encoder is None:
        raise ConfigError("text_encoder: required, since some prompts bring no embeddings")
    if _is_demo_encoder(encoder):
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
