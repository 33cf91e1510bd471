"""Checks of a schema-validated config that need model facts or several keys at once.

`check_config` runs when Snakemake parses the workflow (rules/common.smk), so a bad config fails
before any job runs, with a message naming the key or file. No torch: parsing must stay fast.
The files the config names are checked first, all at once (`sinkscope.workflow.preflight`);
then names and integers, the block layout, layers and heads against each checkpoint, the
sampler, the capture's passes, the figures, the closed loop and the exports.
"""

from __future__ import annotations

import re
import sys

import yaml

from sinkscope.cache_choices import SINK_POLICIES
from sinkscope.frames import block_sizes, visible_frames
from sinkscope.passes import resolve_passes
from sinkscope.schedules import ROLLING_ATTENTION_FRAMES, ROLLING_POLICIES, denoising_steps
from sinkscope.wan.config import WanConfig
from sinkscope.wan.layout import (
    model_dir,
)

from .entries import (
    ConfigError,
    checkpoint_spec,
    closed_loop_policies,
    closed_loop_policy,
    closed_loop_runs,
    export_layers,
    frame_layers,
    is_demo_checkpoint,
    is_demo_encoder,
    kept_token_layers,
    model_config,
    repeated_prompts,
    sampler_settings,
    survey_layers,
    token_passes,
    uses_text_encoder,
)
from .plan import free_bytes, job_disk_bytes
from .preflight import file_problems, merge_prompts, raise_problems
from .resources import gpu_memory_bytes
from .schedule_checks import check_prompt_schedules

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
    "policies.capacity",
    "policies.reuse_cap",
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
    merged = merge_prompts(config)
    if not merged:
        for warning in repeated_prompts(config):
            print(f"sinkscope: warning: {warning}", file=sys.stderr)
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
    for key in ("capture.token_runs", "figures.runs"):
        _check_runs(config, key)
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
    _check_figure_step_runs_in_every_block(config)
    # Before the closed loop's sizes: a schedule its rollouts cannot run says so first.
    check_prompt_schedules(config)
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


def _check_runs(config: dict, key: str) -> None:
    """A list of [checkpoint, prompt] runs (`capture.token_runs`, `figures.runs`) names known
    runs, once each."""
    section, name = key.split(".")
    runs = config[section].get(name)
    seen = set()
    for checkpoint, prompt in runs or []:
        for what, value, known in (
            ("checkpoint", checkpoint, config["checkpoints"]),
            ("prompt", prompt, config["prompts"]),
        ):
            if value not in known:
                raise ConfigError(f"{key}: {what} {value!r} is not one of {sorted(known)}")
        if (checkpoint, prompt) in seen:
            raise ConfigError(f"{key}: [{checkpoint}, {prompt}] is listed twice")
        seen.add((checkpoint, prompt))


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
        sampler = sampler_settings(config, checkpoint)
        if sampler["kind"] == "rolling":
            _check_rolling_loop(config, checkpoint, names, sampler)
    budget = closed_loop_policy(config, names[0])["budget"]
    if budget not in offline["budgets"]:
        raise ConfigError(
            f"closed_loop.budget={budget} is not one of policies.budgets {offline['budgets']}, "
            "so no recall would stand beside its deviation"
        )
    if set(SINK_POLICIES) & set(names) and loop["sink_frames"] not in offline["sinks"]:
        raise ConfigError(
            f"closed_loop.sink_frames={loop['sink_frames']} is not one of policies.sinks "
            f"{offline['sinks']}"
        )
    own = config["video"]["frames_per_block"]
    for name in names:
        entry = closed_loop_policy(config, name)
        kept = {
            key: entry[field]
            for key, field in (
                ("closed_loop.sink_frames", "sink_frames"),
                ("policies.recent_frames", "recent_frames"),
            )
            if field in entry
        }
        if budget - own < sum(kept.values()):
            what = " + ".join(f"{key}={value}" for key, value in kept.items())
            raise ConfigError(
                f"closed_loop.budget={budget} leaves {budget - own} frames beside the own block "
                f"of {own} (video.frames_per_block), fewer than {what} of {name}"
            )
        if "capacity" in entry and entry["capacity"] < budget:
            raise ConfigError(
                f"policies.capacity={entry['capacity']} is less than closed_loop.budget={budget}: "
                f"{name} prunes its cache of capacity frames to the budget"
            )
    if loop["num_frames"] < own:
        raise ConfigError(
            f"closed_loop.num_frames={loop['num_frames']} is less than one block "
            f"(video.frames_per_block={own})"
        )
    _layout(config, loop["num_frames"], "closed_loop.num_frames")
    _check_long_closed_loop(config, names, budget)
    for checkpoint in {checkpoint for checkpoint, _ in closed_loop_runs(config)}:
        num_layers = model_config(config, checkpoint).num_layers
        bad = [layer for layer in loop["survey"] if layer >= num_layers]
        if bad:
            raise ConfigError(
                f"closed_loop.survey: {bad} out of range for checkpoint '{checkpoint}' "
                f"with {num_layers} layers (0-based)"
            )


def _check_long_closed_loop(config: dict, names: list[str], budget: int) -> None:
    """What a long closed loop must fit: its budget in its length, its jitter and bias in their
    ranges, the full-cache reference in the GPU's memory and every rollout's files on the disk."""
    loop = config["closed_loop"]
    frames = loop["num_frames"]
    if budget > frames:
        raise ConfigError(
            f"closed_loop.budget={budget} frames exceeds closed_loop.num_frames={frames}: the "
            "policies would never drop a key (a longer rollout, or a smaller budget)"
        )
    if "head_jitter" in names and not 0 <= loop["jitter"] < 1:
        raise ConfigError(f"closed_loop.jitter={loop['jitter']} is not in [0, 1)")
    if "logit_bias" in names and not 0 < loop["bias"] <= 1:
        raise ConfigError(f"closed_loop.bias={loop['bias']} is not in (0, 1]")
    runs = closed_loop_runs(config)
    for checkpoint in sorted({checkpoint for checkpoint, _ in runs}):
        if loop["reference"] == "full":
            need = gpu_memory_bytes(config, checkpoint, "closed_loop", frames)
            have = loop["gpu_memory_gb"] * 1e9
            if need["total"] > have:
                raise ConfigError(
                    f"closed_loop.reference: full at closed_loop.num_frames={frames} needs about "
                    f"{need['total'] / 1e9:.1f} GB of GPU memory for {checkpoint} (its full KV "
                    f"cache {need['kv_cache'] / 1e9:.1f} GB), more than "
                    f"closed_loop.gpu_memory_gb={loop['gpu_memory_gb']}: set "
                    "closed_loop.reference: none (the diagnostics need no reference)"
                )
    if runs:
        where, free = free_bytes("results")
        need = sum(job_disk_bytes(config, checkpoint, "closed_loop") for checkpoint, _ in runs)
        if need > free:
            raise ConfigError(
                f"closed_loop.num_frames={frames}: the closed loop writes up to "
                f"{need / 1e9:.1f} GB (latents and attention stores of {len(runs)} run(s)), "
                f"more than the {free / 1e9:.1f} GB free on {where}"
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
        steps = denoising_steps(sampler_settings(config, name))
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


def _check_figure_step_runs_in_every_block(config: dict) -> None:
    """`figures.step` must pick a pass every block runs: with Causal Forcing++'s
    `first_block_steps` the first block runs more denoising steps than the others, and a pass
    only it runs leaves the figures of every later query block empty (Fig. 4 without bars, NaN
    statistics)."""
    step = config["figures"]["step"]
    captured = _capture_passes(config)
    for name in config["checkpoints"]:
        sampler = sampler_settings(config, name)
        regular, most = len(sampler["steps"]), denoising_steps(sampler)
        if regular <= captured[step] < most:
            every = [i for i, p in enumerate(captured) if p < regular or p >= most]
            raise ConfigError(
                f"figures.step={step} is pass {captured[step]}, which under checkpoint {name!r} "
                f"only the first block runs (sampler.first_block_steps: {most} denoising steps; "
                f"every other block runs sampler.steps: {regular}, passes "
                f"{list(range(regular))} and the cache pass {most}): its figures would be empty; "
                f"choose figures.step from {every}"
            )


def _capture_passes(config: dict) -> list[int]:
    steps = min(denoising_steps(sampler_settings(config, n)) for n in config["checkpoints"])
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


def _check_sampler(config: dict, name: str) -> None:
    sampler = sampler_settings(config, name)
    key = f"checkpoints.{name}.sampler" if "sampler" in config["checkpoints"][name] else "sampler"
    for name in ("steps", "first_block_steps"):
        steps = sampler.get(name) or []
        if sampler["warp"] and any(float(s) != int(s) for s in steps):
            raise ConfigError(f"{key}.{name}: warped steps must be integers 1..1000, got {steps}")
    sizes = _layout(config, config["video"]["num_frames"], "video.num_frames")
    if sampler["kind"] == "rolling":
        _check_rolling(config, key, sampler, sizes)
        return
    window = sampler["local_attn_size"]
    if window == -1 and sampler["sink_size"]:
        raise ConfigError(f"{key}.sink_size needs a window (local_attn_size != -1)")
    try:
        visible_frames(sizes, window, sampler["sink_size"])
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def _check_rolling(config: dict, key: str, sampler: dict, sizes: list[int]) -> None:
    """Rolling Forcing's sampler: equal blocks, one step list, its own cache (the window of
    `steps` blocks, the anchor block and the working cache within ROLLING_ATTENTION_FRAMES)."""
    if config["video"]["independent_first_frame"]:
        raise ConfigError(
            f"{key}.kind: rolling has no independent first frame "
            "(video.independent_first_frame: false)"
        )
    if sampler.get("first_block_steps") is not None:
        raise ConfigError(
            f"{key}.first_block_steps: the rolling sampler gives every block the same steps"
        )
    if (sampler["local_attn_size"], sampler["sink_size"]) != (-1, 0):
        raise ConfigError(
            f"{key}.local_attn_size / sink_size: the rolling sampler keeps Rolling Forcing's own "
            f"cache (an anchor block and the newest frames, {ROLLING_ATTENTION_FRAMES} frames "
            "attended); leave them at -1 / 0 (KV-cache policies: the closed loop)"
        )
    if ROLLING_ATTENTION_FRAMES % sizes[0]:
        raise ConfigError(
            f"video.frames_per_block={sizes[0]}: the rolling sampler needs blocks that divide "
            f"Rolling Forcing's {ROLLING_ATTENTION_FRAMES} attended frames (1, 3, 7 or 21)"
        )
    window = len(sampler["steps"]) * sizes[0]
    if window + sizes[0] > ROLLING_ATTENTION_FRAMES:
        raise ConfigError(
            f"{key}: a window of {len(sampler['steps'])} steps x {sizes[0]} frames and its "
            f"anchor block exceed Rolling Forcing's {ROLLING_ATTENTION_FRAMES} attended frames"
        )


def _check_rolling_loop(config: dict, checkpoint: str, names: list[str], sampler: dict) -> None:
    """The policies that run on the rolling sampler (`schedules.ROLLING_POLICIES`), each with a
    budget that holds a whole window (and its sinks)."""
    other = [name for name in names if name not in ROLLING_POLICIES]
    if other:
        raise ConfigError(
            f"closed_loop.policies: {other} do not run on the rolling sampler of checkpoint "
            f"{checkpoint!r}; it runs {list(ROLLING_POLICIES[1:])} (Rolling Forcing's own cache "
            "is the reference, full)"
        )
    per_block = config["video"]["frames_per_block"]
    window = len(sampler["steps"]) * per_block
    for name in names:
        entry = closed_loop_policy(config, name)
        if entry.get("sink_frames", 0) > per_block:
            raise ConfigError(
                f"closed_loop.sink_frames={entry['sink_frames']}: {name} on the rolling sampler of "
                f"checkpoint {checkpoint!r} keeps its sinks from block 0, as Rolling Forcing its "
                f"anchor (video.frames_per_block={per_block} frames)"
            )
        need = window + entry.get("sink_frames", 0)
        if entry["budget"] < need:
            raise ConfigError(
                f"closed_loop.budget={entry['budget']}: {name} on the rolling sampler of "
                f"checkpoint {checkpoint!r} needs at least {need} frames (a window of "
                f"{window} frames and its sinks; Rolling Forcing attends to 21)"
            )
