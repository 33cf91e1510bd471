"""The prompt jobs: one prompt's encoding (rule encode_prompt), or every prompt's with the
encoder loaded once into the prompt cache (rule encode_all_prompts), which the prompt jobs then
copy (`sinkscope.workflow.prompt_cache`).

torch (`sinkscope.wan`) is imported only by the functions that encode or check embeddings: a job
that copies its prompt from the cache then takes 0.3 s, not the 3 s of importing it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from sinkscope.segments import Segment
from sinkscope.storage import atomic_path
from sinkscope.workflow.prompt_cache import (
    INDEX_NAME,
    PROMPT_CACHE,
    cache_entry,
    cached_entry,
    encoding_key,
)

log = logging.getLogger(__name__)


def _segments(text: str, segments: list[dict] | None) -> list[Segment]:
    return [Segment(**segment) for segment in segments or [{"text": text}]]


def copy_encoding(source: str | Path, out: str | Path) -> None:
    """Copy a cache entry to a prompt job's output (whole or not at all)."""
    with atomic_path(out) as temporary:
        shutil.copyfile(source, temporary)


def encode_prompt_job(
    out: str | Path,
    text: str,
    segments: list[dict] | None,
    encoder: dict | None,
    *,
    device: str,
    dtype: str,
    on_truncate: str,
    claim,
    embeddings: str | None = None,
    cache: str | Path = PROMPT_CACHE,
) -> None:
    """Rule encode_prompt: a prompt's precomputed `embeddings` checked and copied (`encoder`
    None); else its entry copied from the prompt cache, or its text (each segment's) encoded on
    the device `claim()` gives."""
    if encoder is None:
        from sinkscope.wan.text import import_prompt_embedding

        import_prompt_embedding(embeddings, out, prompt=text)
        return
    cached = cached_entry(encoding_key(text, segments, encoder, device, dtype), cache)
    if cached is not None:
        copy_encoding(cached, out)
        log.info("copied %s from the prompt cache (rule encode_all_prompts)", cached)
        return
    if Path(cache).is_dir():
        log.info(
            "not in the prompt cache %s (edited or added since it was filled, or a new encoder): "
            "encoding it here; `snakemake encode_all_prompts` refills the cache with the encoder "
            "loaded once",
            cache,
        )
    from sinkscope.wan.text import save_prompt_segments

    segments = _segments(text, segments)
    with claim(device) as gpu:
        encoded = _encode([s.text for s in segments], encoder, gpu.device, dtype, on_truncate)
    save_prompt_segments(out, encoded, segments)


def _encode(
    texts: list[str], encoder: dict, device, dtype: str, on_truncate: str, progress: bool = False
):
    """`encode_prompts` under an encode job's encoder settings."""
    from sinkscope.wan.text import encode_prompts

    return encode_prompts(
        texts,
        encoder["path"],
        tokenizer_dir=encoder["tokenizer"],
        text_len=encoder["text_len"],
        device=device,
        dtype=dtype,
        on_truncate=on_truncate,
        progress=progress,
    )


def fill_prompt_cache(
    folder: str | Path,
    prompts: dict[str, dict],
    encoder: dict,
    *,
    device: str,
    dtype: str,
    on_truncate: str,
    claim,
) -> None:
    """Rule encode_all_prompts: every prompt of `prompts` ({name: {text, segments}}, as the
    encode jobs' params) encoded with the encoder loaded once, each into the cache entry its
    encode job looks for, and an index (name -> entry, text) for a reader. The folder appears
    whole or not at all."""
    from sinkscope.wan.precision import model_dtype
    from sinkscope.wan.text import save_prompt_segments

    entries = {}
    texts = []
    for name, prompt in prompts.items():
        key = encoding_key(prompt["text"], prompt["segments"], encoder, device, dtype)
        if key is None:
            raise FileNotFoundError(f"text encoder not found: {encoder['path']}")
        entries[name] = (key, _segments(prompt["text"], prompt["segments"]))
        texts += [segment.text for segment in entries[name][1]]
    encoded = []
    if texts:
        with claim(device) as gpu:
            log.info(
                "encoding %d prompts (%d texts) with %s loaded once, on %s",
                len(prompts),
                len(texts),
                encoder["path"],
                gpu.device,
            )
            encoded = _encode(texts, encoder, gpu.device, dtype, on_truncate, progress=True)
            precision = str(model_dtype(gpu.device, dtype)).removeprefix("torch.")
    with atomic_path(folder) as temporary:
        temporary.mkdir()
        index = {}
        start = 0
        for name, (key, segments) in entries.items():
            path = cache_entry(key, temporary)
            save_prompt_segments(path, encoded[start : start + len(segments)], segments)
            start += len(segments)
            index[name] = {"file": path.name, "text": " | ".join(s.text for s in segments)}
        about = {"encoder": encoder, "device": device, "dtype": dtype}
        if texts:
            about["precision"] = precision
        (temporary / INDEX_NAME).write_text(
            json.dumps({**about, "prompts": index}, indent=1) + "\n"
        )
    log.info("wrote %d prompt encodings to %s", len(entries), folder)
