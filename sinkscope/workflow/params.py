"""What the rules get: the inputs and params of each job, built from the validated config.

Params decide reruns (Snakemake compares their text), so each job's params hold everything its
output depends on and nothing else. Runs while Snakemake parses; no torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .digest import DIGEST_CACHE, cached_sha256
from .entries import (
    ConfigError,
    checkpoint_inputs,
    checkpoint_spec,
    closed_loop_policy,
    demo_seed,
    is_demo_checkpoint,
    prompt_embeddings,
    prompt_segments,
    sampler_settings,
    token_passes,
)
from .gpus import host_has_gpu


def prompt_inputs(config: dict, name: str) -> dict[str, str]:
    """Inputs of a prompt's encode job: its embeddings file, or the text encoder (and tokenizer)."""
    embeddings = prompt_embeddings(config, name)
    if embeddings is not None:
        return {"embeddings": embeddings}
    return encoder_inputs(config)


def encoder_inputs(config: dict) -> dict[str, str]:
    """The text encoder's files as a job's inputs: its path (and tokenizer folder)."""
    encoder = config["text_encoder"]
    inputs = {"encoder": encoder["path"]}
    if encoder.get("tokenizer"):
        inputs["tokenizer"] = encoder["tokenizer"]
    return inputs


def prompt_encoder(config: dict, name: str) -> dict | None:
    """The text-encoder settings a prompt's job depends on (none when it brings embeddings)."""
    if prompt_embeddings(config, name) is not None:
        return None
    return encoder_settings(config)


def encoder_settings(config: dict) -> dict:
    """`text_encoder` as the encode jobs get it: what decides the bytes they write."""
    # `truncate` decides whether the job fails, not what it writes: not a param.
    encoder = {k: v for k, v in config["text_encoder"].items() if k != "truncate"}
    return canonical(encoder)


def prompt_segment_params(config: dict, name: str) -> list[dict] | None:
    """A prompt of segments as its encode job gets them (text, start, flush, cut of each), so a
    changed start reruns it; None for a plain prompt."""
    if not isinstance(config["prompts"][name], dict) or "segments" not in config["prompts"][name]:
        return None
    return [canonical(dataclasses.asdict(s)) for s in prompt_segments(config, name)]


def sampler_params(config: dict, name: str) -> dict:
    """The sampler as jobs get it: `recache` and `global_sink` only with recache on, so the
    stores of runs from before LongLive's recache existed are not rerun for a default."""
    sampler = dict(sampler_settings(config, name))
    if not sampler.get("recache", False):
        sampler.pop("recache", None)
        sampler.pop("global_sink", None)
    return sampler


def canonical(value):
    """`value` with every mapping's keys sorted, recursively.

    Snakemake compares params by their text, so the key order of a YAML edit must not matter.
    """
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [canonical(item) for item in value]
    return value


def checkpoint_content(config: dict, name: str, cache: str | Path = DIGEST_CACHE) -> dict:
    """What decides the bytes of checkpoint `name`: the sha256 of its files (cached, so read once
    per change), or for a demo checkpoint the recipe its rule makes it from (its files may not
    exist yet when the workflow is parsed)."""
    if is_demo_checkpoint(config, name):
        return {
            "demo_seed": demo_seed(config, name),
            "demo_model": config["demo"].get("model", {}),
        }
    try:
        return {"sha256": cached_sha256(checkpoint_inputs(config, name), cache)}
    except OSError as err:
        raise ConfigError(f"checkpoints.{name}: {err}") from None


def video_settings(config: dict) -> dict:
    """The `video` section as jobs get it: `independent_first_frame` only when set, so the stores
    of runs from before the option existed are not rerun for a default that changes nothing."""
    video = dict(config["video"])
    if not video.get("independent_first_frame", False):
        video.pop("independent_first_frame", None)
    return video


def extraction_settings(
    config: dict, name: str, cache: str | Path = DIGEST_CACHE, store: str = "tokens"
) -> dict:
    """Everything an extraction job of checkpoint `name` depends on, and nothing else.

    Used as the job's params, so adding layers or prompts does not re-run existing jobs, and the
    checkpoint's content (not its files' timestamps) re-runs them when it changes. `store`: the
    kind the job writes, `tokens` (rule extract) or `attention` (rule survey, which does not
    depend on capture.tokens).
    """
    if store == "tokens":  # the job captures "passes": the token stores' own
        capture = {"passes": token_passes(config), "tokens": config["capture"]["tokens"]}
    else:
        capture = {"passes": config["capture"]["passes"]}
        # Only when not the default, so the surveys of runs from before the option existed
        # (float32 stores, which still open) are not rerun for it.
        if config["capture"].get("survey_precision", "float16") != "float16":
            capture["survey_precision"] = config["capture"]["survey_precision"]
    return canonical(
        {
            # The spec's fields (what the loader gets) and the content of the files they name.
            "checkpoint": {
                **checkpoint_spec(config, name).to_params(),
                **checkpoint_content(config, name, cache),
            },
            "sampler": sampler_params(config, name),
            "video": video_settings(config),
            "capture": capture,
            "seed": config["seed"],
            "device": config["device"],
            "dtype": config["dtype"],
        }
    )


def extraction_gpus(config: dict, local: bool = False) -> int:
    """GPUs an extraction job holds: none when it is told to run on the CPU, or, for jobs run on
    this machine (`local`), with `device: auto` on a machine without a GPU, so CPU jobs run side
    by side instead of queueing for a `gpu` resource nothing uses. Jobs sent to a cluster ask
    for one with `auto`: the machine they run on decides."""
    if config["device"] == "cpu":
        return 0
    if config["device"] == "auto" and local and not host_has_gpu():
        return 0
    return 1


# CPUs of a GPU extraction job: one thread feeds the GPU and copies the captured tiles to the host,
# one writes the stores (its compression keeps a core busy: benchmarks/README.md, capture).
GPU_JOB_THREADS = 2


def extraction_threads(config: dict, local: bool = False) -> int:
    """CPU threads (`threads:`, SLURM's CPUs per task) of an extraction, survey or closed-loop
    job: GPU_JOB_THREADS when it holds a GPU (`extraction_gpus`), else 1, so that CPU jobs (the
    demo) run side by side, each with one torch thread."""
    return GPU_JOB_THREADS if extraction_gpus(config, local) else 1


def closed_loop_settings(
    config: dict, name: str, policy: str, cache: str | Path = DIGEST_CACHE
) -> dict:
    """Everything a closed-loop rollout of checkpoint `name` under `policy` depends on: the
    extraction settings at `closed_loop.num_frames`, the policy, and (with `closed_loop.survey`)
    the captured passes. The sampler's own window and sinks do not apply: the policy is the
    cache."""
    settings = extraction_settings(config, name, cache, store="attention")
    loop = config["closed_loop"]
    settings["video"] = {**settings["video"], "num_frames": loop["num_frames"]}
    settings["sampler"] = {**settings["sampler"], "local_attn_size": -1, "sink_size": 0}
    settings["policy"] = closed_loop_policy(config, policy)
    return canonical(settings)
