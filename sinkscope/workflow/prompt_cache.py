"""Every prompt of a run encoded with the text encoder loaded once: the cache that rule
`encode_all_prompts` fills and each prompt's `encode_prompt` job copies from.

UMT5-XXL is loaded once per `encode_prompt` job, and on a GPU node that load is about half of a
prompt's GPU time (docs/DESIGN.md, the scale section). `encode_all_prompts` (not a target of
`all`; run it first) encodes every prompt in one job into `PROMPT_CACHE`, one file per prompt
named by the sha256 of what the `encode_prompt` job depends on: its params (text, segments,
encoder settings, device, dtype) and the size and mtime of the encoder's and tokenizer's files.
An `encode_prompt` job whose entry is there copies it (no GPU, no encoder) and writes the bytes
it would have written itself; one whose entry is missing (a prompt edited since, a new encoder)
encodes as before. The cache is read, not an input of `encode_prompt`: filling or refilling it
changes no job's inputs or params, so it reruns nothing, and a changed prompt reruns its own
jobs alone (a declared input rewritten for every prompt at each change would rerun them all).
No torch here: this runs when the workflow is parsed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .entries import prompt_text, uses_text_encoder
from .params import (
    canonical,
    encoder_inputs,
    encoder_settings,
    prompt_encoder,
    prompt_segment_params,
)

PROMPT_CACHE = "results/prompt_cache"
INDEX_NAME = "index.json"


def _files_stamp(path: str | None) -> list[list] | None:
    """[name, size, mtime_ns] of a file, or of each file in a folder (not recursing: a UMT5 and
    tokenizer folder are flat); None when `path` is missing."""
    if path is None:
        return []
    path = Path(path)
    try:
        if path.is_dir():
            entries = sorted((e for e in os.scandir(path) if e.is_file()), key=lambda e: e.name)
            stats = [(entry.name, entry.stat()) for entry in entries]
        else:
            stats = [(path.name, path.stat())]
    except FileNotFoundError:
        return None
    return [[name, stat.st_size, stat.st_mtime_ns] for name, stat in stats]


def encoding_key(
    text: str, segments: list[dict] | None, encoder: dict, device: str, dtype: str
) -> str | None:
    """The name (a sha256) of a prompt's entry in the cache: of the `encode_prompt` job's params
    and the encoder's files as they are now. None when the encoder is not there yet (the demo's
    is made by a rule)."""
    stamps = [_files_stamp(encoder["path"]), _files_stamp(encoder.get("tokenizer"))]
    if None in stamps:
        return None
    recipe = {
        "text": text,
        "segments": segments,
        "encoder": canonical(encoder),
        "device": device,
        "dtype": dtype,
        "encoder_files": stamps,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def cache_entry(key: str, folder: str | Path = PROMPT_CACHE) -> Path:
    return Path(folder) / f"{key}.safetensors"


def cached_entry(key: str | None, folder: str | Path = PROMPT_CACHE) -> Path | None:
    """The cache's entry under `key`, if it is there."""
    if key is None:
        return None
    path = cache_entry(key, folder)
    return path if path.is_file() else None


def prompt_key(config: dict, name: str) -> str | None:
    """The cache key of prompt `name` (`encoding_key` of its encode job's params); None when it
    brings its own embeddings or the encoder is not there."""
    encoder = prompt_encoder(config, name)
    if encoder is None:
        return None
    return encoding_key(
        prompt_text(config, name),
        prompt_segment_params(config, name),
        encoder,
        config["device"],
        config["dtype"],
    )


def cached_prompt(config: dict, name: str, folder: str | Path = PROMPT_CACHE) -> Path | None:
    """The cache entry an `encode_prompt` job of `name` would copy, if it is there."""
    return cached_entry(prompt_key(config, name), folder)


def loads_encoder(config: dict, name: str) -> bool:
    """Whether the `encode_prompt` job of `name` loads the text encoder: the prompt brings no
    embeddings and its entry is not in the cache (else the job copies a file)."""
    return prompt_encoder(config, name) is not None and cached_prompt(config, name) is None


def prompt_cache_inputs(config: dict) -> dict[str, str]:
    """Inputs of `encode_all_prompts`: the text encoder (and tokenizer); none when every prompt
    brings its embeddings."""
    return encoder_inputs(config) if uses_text_encoder(config) else {}


def prompt_cache_params(config: dict) -> dict:
    """What `encode_all_prompts` encodes: per prompt that needs the encoder, its text, segments
    and cache key (the key changes with the encoder's files, so a new encoder reruns the job);
    and the encoder settings, the same for every prompt."""
    if not uses_text_encoder(config):
        return {"encoder": None, "prompts": {}}
    prompts = {
        name: {
            "text": prompt_text(config, name),
            "segments": prompt_segment_params(config, name),
            "key": prompt_key(config, name),
        }
        for name in config["prompts"]
        if prompt_encoder(config, name) is not None
    }
    return {"encoder": encoder_settings(config), "prompts": prompts}
