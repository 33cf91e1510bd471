"""Checks of a schema-validated config that need files or model facts.

`check_config` runs when Snakemake parses the workflow (rules/common.smk), so a bad config fails
before any job runs, with a message naming the key or file. No torch: parsing must stay fast.
Its file checks (`preflight`) report every missing or malformed file at once, one line each; the
file checks read headers only (a config.json, a safetensors header, a torch file's first bytes),
so a file cut short in its tensor data still fails in its own job (`--keep-going`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

from sinkscope.frames import block_sizes, visible_frames
from sinkscope.passes import resolve_passes
from sinkscope.wan.cleaning import clean_prompt
from sinkscope.wan.config import WanConfig
from sinkscope.wan.layout import (
    CONFIG_NAME,
    INDEX_NAME,
    CheckpointError,
    is_diffusers,
    model_dir,
    read_model_config,
)

from .entries import (
    DEMO_DIR,
    ConfigError,
    checkpoint_inputs,
    checkpoint_spec,
    closed_loop_policies,
    closed_loop_policy,
    closed_loop_runs,
    export_layers,
    frame_layers,
    is_demo_checkpoint,
    is_demo_encoder,
    kept_token_layers,
    merge_prompts_file,
    model_config,
    prompt_embeddings,
    prompt_text,
    read_prompts_file,
    sampler_settings,
    survey_layers,
    token_passes,
    uses_text_encoder,
)

# A name becomes a folder or file name in every output path, so it must be one safe path component.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
NAME_RULE = "letters, digits, '_', '.' and '-', starting with a letter, a digit or '_'"
# Names that would land on another output: results/figures/compare/, results/stats/summary.csv ...
RESERVED_NAMES = {
    "checkpoints": {"compare", "summary.csv", "summary.html", "sink_rate.csv"},
    "demo.checkpoints": {"text_encoder"},
    "prompts": set(),
}
# Keys the schema types as integers: JSON Schema also accepts 1.0 there, paths and names do not.
INTEGER_KEYS = (
    "layers.*",
    "figures.heads.*.*",
    "figures.step",
    "seed",
    "video.num_frames",
    "video.frames_per_block",
    "video.latent_height",
    "video.latent_width",
    "sampler.local_attn_size",
    "sampler.sink_size",
    "checkpoints.*.sampler.local_attn_size",
    "checkpoints.*.sampler.sink_size",
    "demo.checkpoints.*",
    "demo.text_encoder_seed",
    "demo.text_encoder.*",
    "text_encoder.text_len",
    "prompts_limit",
    "capture.passes",
    "capture.passes.*",
    "capture.survey.*",
    "policies.budgets.*",
    "policies.sinks.*",
    "policies.recent_frames",
    "policies.budget",
    "closed_loop.num_frames",
    "closed_loop.budget",
    "closed_loop.sink_frames",
    "closed_loop.survey.*",
)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    source = "config"

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{self.source}: key {key!r} given twice, at lines {seen[key]} and {line} "
                    "(YAML keeps only the last)"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def check_config_files(paths) -> None:
    """Every config file Snakemake read: no duplicate keys in any mapping."""
    for path in paths:
        loader = type("Loader", (_UniqueKeyLoader,), {"source": str(path)})
        with open(path) as handle:
            yaml.load(handle, Loader=loader)


def _check_names(config: dict) -> None:
    sections = {
        "checkpoints": config["checkpoints"],
        "prompts": config["prompts"],
        "demo.checkpoints": config.get("demo", {}).get("checkpoints", {}),
    }
    for section, names in sections.items():
        for name in names:
            if not isinstance(name, str) or not NAME_PATTERN.match(name):
                raise ConfigError(
                    f"{section}: name {name!r} is not a safe file name; names use {NAME_RULE}"
                )
            if name in RESERVED_NAMES[section]:
                raise ConfigError(
                    f"{section}: name {name!r} is taken by an output of its own "
                    f"(reserved: {sorted(RESERVED_NAMES[section])})"
                )


def _values_at(value, parts: list[str], key: str):
    """(key, value) of every value at a dotted path; `*` is every item or entry."""
    if not parts:
        yield key, value
        return
    first, rest = parts[0], parts[1:]
    if first == "*" and isinstance(value, dict):
        for sub, item in value.items():
            yield from _values_at(item, rest, f"{key}.{sub}" if key else str(sub))
    elif first == "*" and isinstance(value, list):
        for index, item in enumerate(value):
            yield from _values_at(item, rest, f"{key}[{index}]")
    elif isinstance(value, dict) and first in value:
        yield from _values_at(value[first], rest, f"{key}.{first}" if key else first)


def _check_integers(config: dict) -> None:
    for path in INTEGER_KEYS:
        for key, value in _values_at(config, path.split("."), ""):
            if isinstance(value, float | bool):
                raise ConfigError(f"{key}: {value!r} must be an integer (no decimal point)")


def check_config(config: dict) -> None:
    """Raise ConfigError for problems the schema cannot see. Paths are relative to the workdir.

    Merges `prompts_file` into `config["prompts"]` first (`entries.merge_prompts_file`), so the
    rules that read the prompts see them. Every problem with a file the config names is reported
    at once, one line each (`preflight`)."""
    _check_integers(config)
    merged = _merge_prompts(config)
    _check_names(config)
    _check_block_layout(config)
    raise_problems(file_problems(config, merged))
    models = {name: model_config(config, name) for name in config["checkpoints"]}
    for name, model in models.items():
        if not is_demo_checkpoint(config, name):
            _check_num_heads(config, name, model)
    surveyed = survey_layers(config)  # compares the checkpoints' depths for `all`
    _check_layers(config, surveyed)
    for name, model in models.items():
        num_layers = model.num_layers
        num_heads = model.num_heads
        for key, layers in (("layers", config["layers"]), ("capture.survey", surveyed)):
            bad = [layer for layer in layers if layer >= num_layers]
            if bad:
                raise ConfigError(
                    f"{key}: {bad} out of range for checkpoint '{name}' "
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
    captured = frame_layers(config)
    for layer, _ in config["figures"]["heads"]:
        if layer not in captured:
            raise ConfigError(
                f"figures.heads: layer {layer} is not captured; add it to layers "
                f"{config['layers']} or to capture.survey"
            )
    policies = config["policies"]
    if policies["budget"] not in policies["budgets"]:
        raise ConfigError(
            f"policies.budget={policies['budget']} is not one of policies.budgets "
            f"{policies['budgets']}"
        )
    pooled_only = [
        layer
        for layer, _ in config["figures"]["heads"]
        if layer not in surveyed and not config["capture"]["tokens"]
    ]
    if pooled_only and config["figures"]["measure"] != "logits":
        raise ConfigError(
            "figures.measure: probabilities need the token logits or a survey; with "
            f"capture.tokens: false layers {sorted(set(pooled_only))} of figures.heads have only "
            "frame-level mean logits (measure: logits, or survey them: capture.survey)"
        )
    if config["figures"]["step"] >= len(_capture_passes(config)):
        raise ConfigError(
            f"figures.step={config['figures']['step']} but only {len(_capture_passes(config))} "
            "passes are captured (capture.passes)"
        )
    _check_closed_loop(config)
    _check_export(config)
    _check_token_passes(config, surveyed)


def _check_export(config: dict) -> None:
    """The exports for the seed notebooks (`export`): its layers have kept token stores with
    logits (the token-sized layouts read them), its step is a captured pass, and its measure has
    values in every frame layer."""
    export = config.get("export", {})
    for path in ("export.layers.*", "export.step"):
        for key, value in _values_at(config, path.split("."), ""):
            if isinstance(value, float | bool):
                raise ConfigError(f"{key}: {value!r} must be an integer (no decimal point)")
    layers = export.get("layers") or []
    missing = [layer for layer in layers if layer not in config["layers"]]
    if missing:
        raise ConfigError(
            f"export.layers: {missing} have no token store, which the token-sized exports read; "
            f"add them to layers {config['layers']} or drop them from export.layers"
        )
    if layers and not kept_token_layers(config):
        if not config["capture"]["tokens"]:
            setting, why = "tokens", "stores only frame-level mean logits"
        else:
            setting, why = "keep_tokens", "deletes each token store once it is reduced"
        raise ConfigError(
            f"export.layers: {sorted(layers)} have no token logits to export: capture.{setting}: "
            f"false {why}; capture.{setting}: true, or export.layers: []"
        )
    passes = len(_capture_passes(config))
    step = export.get("step", 0)
    if step >= passes:
        raise ConfigError(
            f"export.step={step} but only {passes} passes are captured (capture.passes)"
        )
    surveyed = survey_layers(config)
    pooled_only = [
        layer
        for layer in frame_layers(config)
        if layer not in surveyed and not config["capture"]["tokens"]
    ]
    if pooled_only and export.get("measure", "logits") == "probabilities":
        raise ConfigError(
            "export.measure: probabilities need the token logits or a survey; with "
            f"capture.tokens: false layers {pooled_only} have only frame-level mean logits "
            "(export.measure: logits, or survey them: capture.survey)"
        )


def _check_closed_loop(config: dict) -> None:
    """The closed loop's runs exist, its budget and sinks are among the offline ones (so each
    policy has a recall to set beside its deviation) and its cache can hold them."""
    names = closed_loop_policies(config)
    if not names:
        return
    loop, offline = config["closed_loop"], config["policies"]
    for checkpoint, prompt in closed_loop_runs(config):
        for key, name, known in (
            ("checkpoint", checkpoint, config["checkpoints"]),
            ("prompt", prompt, config["prompts"]),
        ):
            if name not in known:
                raise ConfigError(f"closed_loop.runs: {key} {name!r} is not one of {sorted(known)}")
    budget = closed_loop_policy(config, names[0])["budget"]
    if budget not in offline["budgets"]:
        raise ConfigError(
            f"closed_loop.budget={budget} is not one of policies.budgets {offline['budgets']}, "
            "so no recall would stand beside its deviation"
        )
    if {"sink_window", "deep_sink"} & set(names) and loop["sink_frames"] not in offline["sinks"]:
        raise ConfigError(
            f"closed_loop.sink_frames={loop['sink_frames']} is not one of policies.sinks "
            f"{offline['sinks']}"
        )
    own = config["video"]["frames_per_block"]
    for name in names:
        entry = closed_loop_policy(config, name)
        kept = entry.get("sink_frames", entry.get("recent_frames", 0))
        if budget - own < kept:
            key = "closed_loop.sink_frames" if "sink_frames" in entry else "policies.recent_frames"
            raise ConfigError(
                f"closed_loop.budget={budget} leaves {budget - own} frames beside the own block "
                f"of {own} (video.frames_per_block), fewer than {key}={kept} of {name}"
            )
    if loop["num_frames"] < own:
        raise ConfigError(
            f"closed_loop.num_frames={loop['num_frames']} is less than one block "
            f"(video.frames_per_block={own})"
        )
    _layout(config, loop["num_frames"], "closed_loop.num_frames")
    for checkpoint in {checkpoint for checkpoint, _ in closed_loop_runs(config)}:
        num_layers = model_config(config, checkpoint).num_layers
        bad = [layer for layer in loop["survey"] if layer >= num_layers]
        if bad:
            raise ConfigError(
                f"closed_loop.survey: {bad} out of range for checkpoint '{checkpoint}' "
                f"with {num_layers} layers (0-based)"
            )


def _layout(config: dict, num_frames: int, key: str) -> list[int]:
    """The block sizes of a rollout of `num_frames` (named `key`) in the video's layout."""
    video = config["video"]
    try:
        return block_sizes(
            num_frames,
            video["frames_per_block"],
            video["independent_first_frame"],
            frames_key=key,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_block_layout(config: dict) -> None:
    """video.num_frames is whole blocks of video.frames_per_block (after a lone first frame
    with video.independent_first_frame), as Self-Forcing requires: no shorter last block."""
    video = config["video"]
    if video["frames_per_block"] > video["num_frames"]:
        raise ConfigError(
            f"video.frames_per_block={video['frames_per_block']} exceeds "
            f"video.num_frames={video['num_frames']}"
        )
    _layout(config, video["num_frames"], "video.num_frames")


def raise_problems(problems: list[str]) -> None:
    """One ConfigError for all `problems`: a lone one as it is, several one per line."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        lines = "\n".join(f"  {problem}" for problem in problems)
        raise ConfigError(f"{len(problems)} problems, each with the key that names it:\n{lines}")


def preflight(config: dict) -> list[str]:
    """Every missing or malformed file a schema-validated config names, one line per problem,
    each starting with its key: `prompts_file` (merged into `prompts` here) and the prompts,
    the text encoder and the tokenizer, the checkpoints' files. Empty when all is well. Cheap:
    headers only, no torch (see the module docstring)."""
    return file_problems(config, _merge_prompts(config))


def _merge_prompts(config: dict) -> list[str]:
    """`entries.merge_prompts_file`, its failure as a problem (the explicit prompts stay)."""
    try:
        merge_prompts_file(config)
    except ConfigError as err:
        config["prompts"] = dict(config.get("prompts") or {})
        return [str(err)]
    if not config["prompts"] and not config.get("prompts_file"):
        return ["prompts: none given; list them under prompts, or name a prompts_file"]
    if not config["prompts"]:
        return [
            f"prompts_file: {config['prompts_file']}: no prompts in it (only blank lines and "
            "lines starting with '#') and none under prompts"
        ]
    return []


def file_problems(config: dict, merged: list[str] | None = None) -> list[str]:
    """The files of `preflight` in the config's order, for prompts already merged (`merged`:
    the problems of the merge)."""
    return [
        *_checkpoint_problems(config),
        *_text_encoder_problems(config),
        *(merged or []),
        *_prompt_problems(config),
    ]


# First bytes of a Git LFS pointer: a clone without `git lfs pull` leaves these small text files
# where the weights should be.
LFS_POINTER = b"version https://git-lfs.github.com/spec/"
# safetensors refuses headers above 100 MB; a first 8 bytes that say more are not a header.
SAFETENSORS_MAX_HEADER = 100_000_000
# The config.json keys without which a DiT's shape rests on defaults (Wan's original config.json
# of every released model carries them; diffusers' WanTransformer3DModel config too).
REQUIRED_MODEL_KEYS = ("dim", "ffn_dim", "num_heads", "num_layers")
REQUIRED_DIFFUSERS_KEYS = ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
EMBEDDINGS_KEY = "prompt_embeds"  # as sinkscope.wan.text (which imports torch)


def _lfs_or_empty(path: Path, size: int) -> str | None:
    if size == 0:
        return f"{path}: empty file (0 bytes)"
    with open(path, "rb") as handle:
        if handle.read(len(LFS_POINTER)) == LFS_POINTER:
            return (
                f"{path}: a Git LFS pointer ({size} bytes), not the file itself: git lfs pull, "
                "or download it with hf download"
            )
    return None


def safetensors_header(path: Path) -> tuple[dict | None, str | None]:
    """(tensors of the header, None) of a safetensors file, or (None, what is wrong): reads the
    8-byte length and the JSON header only, never the tensors."""
    size = path.stat().st_size
    problem = _lfs_or_empty(path, size)
    if problem:
        return None, problem
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8 or not 2 <= length <= min(size - 8, SAFETENSORS_MAX_HEADER):
            return None, (
                f"{path}: not a readable safetensors file: its first 8 bytes give a header of "
                f"{length} bytes in a file of {size}"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{path}: not a readable safetensors file: its header is not JSON ({err})"
    tensors = (
        {k: v for k, v in header.items() if k != "__metadata__"}
        if isinstance(header, dict)
        else None
    )
    if tensors is None or not all(
        isinstance(v, dict) and {"dtype", "shape", "data_offsets"} <= v.keys()
        for v in tensors.values()
    ):
        return None, (
            f"{path}: not a readable safetensors file: its header is not a map of tensors "
            "(dtype, shape, data_offsets)"
        )
    return tensors, None


def torch_file_problem(path: Path) -> str | None:
    """What is wrong with a torch.save file, from its first bytes: empty, a Git LFS pointer, or
    neither a zip archive (torch >= 1.6) nor a pickle (older torch.save)."""
    size = path.stat().st_size
    problem = _lfs_or_empty(path, size)
    if problem:
        return problem
    with open(path, "rb") as handle:
        head = handle.read(4)
    if not (head.startswith(b"PK\x03\x04") or head.startswith(b"\x80")):
        return (
            f"{path}: not a torch checkpoint (neither the zip archive of torch.save nor a "
            f"pickle; it starts with {head!r})"
        )
    return None


def _config_json_problem(path: Path) -> str | None:
    """A DiT config.json that is not JSON, not an object, lacks the keys that fix the model's
    shape, or that the model cannot take (unknown keys, an image-to-video model ...)."""
    try:
        values = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path}: not valid JSON ({err})"
    if not isinstance(values, dict):
        return f"{path}: not a JSON object but a {type(values).__name__}"
    required = REQUIRED_DIFFUSERS_KEYS if is_diffusers(values) else REQUIRED_MODEL_KEYS
    missing = [key for key in required if key not in values]
    if missing:
        return f"{path}: lacks {missing}, which fix the model's shape (has {sorted(values)})"
    try:
        read_model_config(path.parent)
    except CheckpointError as err:
        return str(err)
    except (TypeError, ValueError) as err:  # e.g. "dim": "1536"
        return f"{path}: not a Wan config ({err})"
    return None


def _checkpoint_problems(config: dict) -> list[str]:
    """Missing or malformed files of every checkpoint entry (demo checkpoints are made later)."""
    demo_checkpoints = config.get("demo", {}).get("checkpoints", {})
    problems = []
    for name, entry in config["checkpoints"].items():
        key = f"checkpoints.{name}"
        if is_demo_checkpoint(config, name):
            if "generator" in entry:
                problems.append(f"{key}.generator: a demo checkpoint has no generator file")
            continue
        try:
            paths = [Path(path) for path in checkpoint_inputs(config, name)]
        except ConfigError as err:  # an unreadable shard index
            problems.append(str(err))
            continue
        generator = entry.get("generator")
        for path in paths:
            if not path.is_file():
                hint = (
                    f" (demo checkpoints are made under {DEMO_DIR}/<name> for names in "
                    f"demo.checkpoints: {sorted(demo_checkpoints)})"
                    if demo_checkpoints
                    else ""
                )
                problems.append(f"{key}: checkpoint file not found: {path}{hint}")
                continue
            if generator is not None and path == Path(generator):
                problem, which = torch_file_problem(path), "generator"
            elif path.name == CONFIG_NAME:
                problem, which = _config_json_problem(path), "base"
            elif path.name == INDEX_NAME:
                continue  # read by checkpoint_inputs already
            else:
                problem, which = safetensors_header(path)[1], "base"
            if problem:
                problems.append(f"{key}.{which}: {problem}")
    return problems


def _check_layers(config: dict, surveyed: list[int]) -> None:
    """Something is captured, and no token store is made only to be deleted unread."""
    if not config["layers"] and not surveyed:
        raise ConfigError("layers is empty and capture.survey is none: nothing to capture")
    both = sorted(set(config["layers"]) & set(surveyed))
    if both and not config["capture"]["keep_tokens"]:
        raise ConfigError(
            f"capture.keep_tokens: false deletes a token store once it is reduced, but layers "
            f"{both} are also surveyed: their frame datasets come from the attention stores, so "
            "their token stores would be written for nothing; keep_tokens: true, or drop them "
            "from layers"
        )


def _check_num_heads(config: dict, name: str, model: WanConfig) -> None:
    source = f"checkpoints.{name}.base: {model_dir(checkpoint_spec(config, name).base)}/config.json"
    error, warning = model.num_heads_doubt()
    if error:
        raise ConfigError(f"{source}: {error}")
    if warning:
        print(f"sinkscope: warning: {source}: {warning}", file=sys.stderr)


def _check_token_passes(config: dict, surveyed: list[int]) -> None:
    """The token stores' passes are the first of capture.passes for every checkpoint (whose
    schedules may differ in length), so that step i of a frame dataset is the same pass in every
    layer; the steps figures and exports draw from token stores are among them."""
    counts = []
    for name in config["checkpoints"]:
        steps = len(sampler_settings(config, name)["steps"])
        try:
            passes = resolve_passes(config["capture"]["passes"], steps)
            tokens = resolve_passes(token_passes(config), steps, "capture.token_passes")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if tokens != passes[: len(tokens)]:
            raise ConfigError(
                f"capture.token_passes: passes {tokens} must be the first of capture.passes "
                f"{passes} for checkpoint '{name}' ({steps} steps; step i of every frame dataset "
                f"is then the same pass), e.g. token_passes: {passes[0]}"
            )
        counts.append(len(tokens))
    captured = min(counts)
    from_tokens = [layer for layer in config["layers"] if layer not in surveyed]
    step = config["figures"]["step"]
    if from_tokens and step >= captured:
        raise ConfigError(
            f"figures.step={step} but the token stores of layers {from_tokens} (not surveyed) "
            f"capture only {captured} passes (capture.token_passes)"
        )
    export = config.get("export", {})
    if export_layers(config) and export.get("step", 0) >= captured:
        raise ConfigError(
            f"export.step={export.get('step', 0)} but the token stores capture only "
            f"{captured} passes (capture.token_passes)"
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


def _prompt_problems(config: dict) -> list[str]:
    """Prompts that clean to nothing, precomputed embeddings that are missing or malformed."""
    from_file = {}
    if config.get("prompts_file"):
        try:
            from_file = {p.name: p for p in read_prompts_file(config["prompts_file"])}
        except ConfigError:
            pass  # reported by the merge
    problems = []
    for name in config["prompts"]:
        path = prompt_embeddings(config, name)
        if path is not None:
            problem = _embeddings_problem(Path(path))
            if problem:
                problems.append(f"prompts.{name}.embeddings: {problem}")
        text = prompt_text(config, name)
        if path is None and not clean_prompt(text):
            origin = from_file.get(name)
            where = (
                f" (prompts_file {config['prompts_file']}, line {origin.line})"
                if origin is not None and origin.text == text
                else ""
            )
            problems.append(
                f"prompts.{name}{where}: {text!r} is empty after Wan's prompt cleaning (HTML "
                "entities unescaped, whitespace collapsed): the encoder would see EOS only"
            )
    return problems


def _embeddings_problem(path: Path) -> str | None:
    """A precomputed embeddings file: present, a safetensors file with `prompt_embeds` of shape
    [L, d] or [1, L, d] (values are checked by the job that reads them)."""
    if not path.is_file():
        return f"file not found: {path}"
    tensors, problem = safetensors_header(path)
    if problem:
        return problem
    if EMBEDDINGS_KEY not in tensors:
        return f"{path}: no '{EMBEDDINGS_KEY}' tensor; it has {sorted(tensors)}"
    shape = tensors[EMBEDDINGS_KEY]["shape"]
    if not (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1)) or 0 in shape:
        return f"{path}: '{EMBEDDINGS_KEY}' must be [L, d] or [1, L, d] with L, d > 0, got {shape}"
    return None


def _text_encoder_problems(config: dict) -> list[str]:
    """The text encoder, when some prompt is encoded: Wan's UMT5 .pth with a tokenizer folder, or
    a transformers folder (config.json; its tokenizer files unless text_encoder.tokenizer)."""
    if not uses_text_encoder(config):
        return []
    encoder = config.get("text_encoder")
    if encoder is None:
        return ["text_encoder: required, since some prompts bring no embeddings"]
    if is_demo_encoder(encoder):
        return []
    problems = []
    path = Path(encoder["path"])
    tokenizer = encoder.get("tokenizer")
    if not path.exists():
        problems.append(f"text_encoder.path: not found: {path}")
    elif path.is_file():
        problem = torch_file_problem(path)
        if problem:
            problems.append(f"text_encoder.path: {problem}")
        if not tokenizer:
            problems.append(
                f"text_encoder.tokenizer: required with Wan's encoder file {path} "
                "(the google/umt5-xxl tokenizer folder)"
            )
    else:
        config_json = path / CONFIG_NAME
        if not config_json.is_file():
            problems.append(
                f"text_encoder.path: {path} has no {CONFIG_NAME}: not a transformers "
                "UMT5EncoderModel folder"
            )
        else:
            try:
                json.loads(config_json.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                problems.append(f"text_encoder.path: {config_json}: not valid JSON ({err})")
    folder = Path(tokenizer or path)
    key = "text_encoder.tokenizer" if tokenizer else "text_encoder.path"
    if tokenizer and not Path(tokenizer).is_dir():
        problems.append(f"text_encoder.tokenizer: directory not found: {tokenizer}")
    elif folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        unset = "" if tokenizer else " (the tokenizer folder, as text_encoder.tokenizer is unset)"
        problems.append(
            f"{key}: {folder}{unset} holds neither {' nor '.join(TOKENIZER_FILES)}: not the "
            "google/umt5-xxl tokenizer files"
        )
    return problems


def _check_sampler(config: dict, name: str) -> None:
    sampler = sampler_settings(config, name)
    key = f"checkpoints.{name}.sampler" if "sampler" in config["checkpoints"][name] else "sampler"
    if sampler["warp"] and any(float(s) != int(s) for s in sampler["steps"]):
        raise ConfigError(
            f"{key}.steps: warped steps must be integers 1..1000, got {sampler['steps']}"
        )
    sizes = _layout(config, config["video"]["num_frames"], "video.num_frames")
    window = sampler["local_attn_size"]
    if window == -1 and sampler["sink_size"]:
        raise ConfigError(f"{key}.sink_size needs a window (local_attn_size != -1)")
    try:
        visible_frames(sizes, window, sampler["sink_size"])
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None
