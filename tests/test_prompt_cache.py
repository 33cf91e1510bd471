"""The prompt cache: every prompt encoded with the encoder loaded once (rule
encode_all_prompts), copied by each prompt's encode job when its entry is there, encoded by the
job itself when not."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinkscope.extraction.prompts import encode_prompt_job, fill_prompt_cache
from sinkscope.segments import Segment
from sinkscope.wan.text import encode_prompts, load_prompt_segments, make_demo_text_encoder
from sinkscope.workflow.entries import prompt_text
from sinkscope.workflow.gpus import job_device
from sinkscope.workflow.params import prompt_encoder, prompt_segment_params
from sinkscope.workflow.plan import format_plan
from sinkscope.workflow.prompt_cache import (
    INDEX_NAME,
    cached_prompt,
    encoding_key,
    prompt_cache_params,
    prompt_key,
)
from sinkscope.workflow.resources import encode_gpus, encode_mem_mb

from .test_config import checked

STORY = {
    "segments": [
        {"text": "A red fox runs through snow"},
        {"text": "The fox stops at a frozen river", "start": 6},
    ]
}


@pytest.fixture
def encoder_dir(tmp_path) -> Path:
    folder = tmp_path / "umt5"
    make_demo_text_encoder(folder, d_model=32, num_layers=2, num_heads=4, seed=7)
    return folder


def run_config(encoder_dir: Path, **prompts) -> dict:
    """What the prompt functions read of a validated config (defaults filled)."""
    return {
        "prompts": prompts
        or {"eagle": "An eagle over a cloudy sky", "story": STORY, "boat": "A boat at dawn"},
        "text_encoder": {
            "path": str(encoder_dir),
            "tokenizer": None,
            "text_len": 24,
            "truncate": "warn",
        },
        "device": "cpu",
        "dtype": "auto",
    }


def job_params(config: dict, name: str) -> dict:
    """An encode_prompt job's params (rules/prompts.smk), as its script gets them."""
    return {
        "text": prompt_text(config, name),
        "segments": prompt_segment_params(config, name),
        "encoder": prompt_encoder(config, name),
        "device": config["device"],
        "dtype": config["dtype"],
    }


def fill(config: dict, folder: Path, on_truncate: str = "warn") -> None:
    params = prompt_cache_params(config)
    fill_prompt_cache(
        folder,
        params["prompts"],
        params["encoder"],
        device=config["device"],
        dtype=config["dtype"],
        on_truncate=on_truncate,
        claim=job_device,
    )


def own_encoding(config: dict, name: str) -> list[torch.Tensor]:
    """The reference: the prompt's texts encoded on their own, the encoder loaded for them."""
    segments = prompt_segment_params(config, name) or [{"text": config["prompts"][name]}]
    encoded = encode_prompts(
        [s["text"] for s in segments], config["text_encoder"]["path"], text_len=24
    )
    return [e.embeds for e in encoded]


def run_job(config: dict, name: str, out: Path, cache: Path) -> None:
    encode_prompt_job(
        out, **job_params(config, name), on_truncate="warn", claim=job_device, cache=cache
    )


def test_the_key_follows_what_the_encode_job_depends_on(encoder_dir):
    config = run_config(encoder_dir)
    params = job_params(config, "story")
    key = encoding_key(**params)
    assert key == prompt_key(config, "story") and len(key) == 64
    changes = {
        "text": {**params, "text": "A red fox"},
        "segments": {
            **params,
            "segments": [*params["segments"][:1], {**STORY["segments"][1], "start": 9}],
        },
        "text_len": {**params, "encoder": {**params["encoder"], "text_len": 25}},
        "tokenizer": {**params, "encoder": {**params["encoder"], "tokenizer": str(encoder_dir)}},
        "device": {**params, "device": "auto"},
        "dtype": {**params, "dtype": "float32"},
    }
    keys = {name: encoding_key(**changed) for name, changed in changes.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(keys)
    # truncate decides whether the job fails, not its bytes: not in its params, nor in the key
    config["text_encoder"]["truncate"] = "error"
    assert prompt_key(config, "story") == key
    # The encoder's files rewritten (a new mtime): another key, so old entries are not copied.
    weights = encoder_dir / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert prompt_key(config, "story") != key
    # No encoder yet (the demo's is made by a rule), or a prompt that brings its embeddings.
    assert encoding_key(**{**params, "encoder": {**params["encoder"], "path": "nowhere"}}) is None
    config["prompts"]["mine"] = {"text": "x", "embeddings": "mine.safetensors"}
    assert prompt_key(config, "mine") is None
    assert "mine" not in prompt_cache_params(config)["prompts"]


def test_a_filled_cache_gives_each_job_its_own_encoding(encoder_dir, tmp_path, caplog):
    config = run_config(encoder_dir)
    cache = tmp_path / "cache"
    fill(config, cache)
    index = json.loads((cache / INDEX_NAME).read_text())
    assert set(index["prompts"]) == {"eagle", "story", "boat"} and index["precision"] == "float32"
    for name in config["prompts"]:
        entry = cached_prompt(config, name, cache)
        assert entry is not None and index["prompts"][name]["file"] == entry.name
        out = tmp_path / f"{name}.safetensors"
        with caplog.at_level(logging.INFO, logger="sinkscope.extraction.prompts"):
            caplog.clear()
            run_job(config, name, out, cache)
        assert "copied" in caplog.text and "encoding it here" not in caplog.text
        embeds, metadata, segments = load_prompt_segments(out)
        want = own_encoding(config, name)
        assert len(embeds) == len(want)
        assert all(torch.equal(got, ref) for got, ref in zip(embeds, want, strict=True))
        if name == "story":
            assert segments == [
                Segment("A red fox runs through snow"),
                Segment(STORY["segments"][1]["text"], 6),
            ]
        # What the job writes without the cache, in bytes read back.
        alone = tmp_path / "alone" / f"{name}.safetensors"
        run_job(config, name, alone, tmp_path / "no_cache")
        assert load_prompt_segments(alone)[1] == metadata


def test_a_prompt_not_in_the_cache_is_encoded_by_its_job(encoder_dir, tmp_path, caplog):
    config = run_config(encoder_dir)
    cache = tmp_path / "cache"
    fill(config, cache)
    config["prompts"]["eagle"] = "An eagle over the sea"  # edited since the cache was filled
    assert cached_prompt(config, "eagle", cache) is None
    assert cached_prompt(config, "boat", cache) is not None
    out = tmp_path / "eagle.safetensors"
    with caplog.at_level(logging.INFO, logger="sinkscope.extraction.prompts"):
        run_job(config, "eagle", out, cache)
    assert "not in the prompt cache" in caplog.text and "copied" not in caplog.text
    embeds, metadata, _ = load_prompt_segments(out)
    assert metadata["prompt"] == "An eagle over the sea"
    assert torch.equal(embeds[0], own_encoding(config, "eagle")[0])


def test_an_encode_job_with_its_entry_cached_asks_for_no_gpu(encoder_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the cache's default place is relative: results/prompt_cache
    config = {**run_config(encoder_dir), "device": "cuda"}
    assert encode_gpus(config, "eagle") == 1 and encode_mem_mb(config, "eagle") >= 4000
    # Filled on the CPU under the same settings as the jobs' (the key holds the settings).
    params = prompt_cache_params(config)
    fill_prompt_cache(
        "results/prompt_cache",
        params["prompts"],
        params["encoder"],
        device="cuda",
        dtype="auto",
        on_truncate="warn",
        claim=lambda device: job_device("cpu"),
    )
    assert encode_gpus(config, "eagle") == 0 and encode_mem_mb(config, "eagle") == 1000
    config["prompts"]["eagle"] = "An eagle over the sea"
    assert encode_gpus(config, "eagle") == 1 and encode_gpus(config, "boat") == 0


def test_a_failed_fill_leaves_no_cache(encoder_dir, tmp_path):
    config = run_config(encoder_dir, eagle="An eagle", long="a very long prompt " * 20)
    with pytest.raises(ValueError, match="longer than text_len"):
        fill(config, tmp_path / "cache", on_truncate="error")
    assert not (tmp_path / "cache").exists()
    assert list(tmp_path.iterdir()) == [encoder_dir]


def test_a_job_that_copies_from_the_cache_loads_no_torch(encoder_dir, tmp_path):
    """A copy takes a fraction of a second; importing torch alone takes seconds."""
    config = run_config(encoder_dir)
    cache = tmp_path / "cache"
    fill(config, cache)
    code = (
        "import sys; from sinkscope.extraction.prompts import encode_prompt_job; "
        "from sinkscope.workflow.gpus import job_device; "
        f"encode_prompt_job('out.safetensors', **{job_params(config, 'story')!r}, "
        f"on_truncate='warn', claim=job_device, cache={str(cache)!r}); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    copied = load_prompt_segments(tmp_path / "out.safetensors")[0]
    assert all(
        torch.equal(a, b) for a, b in zip(copied, own_encoding(config, "story"), strict=True)
    )


def test_the_plan_says_when_encode_all_prompts_would_save_loads(encoder_dir, tmp_path, monkeypatch):
    def with_encoder(config):
        config["text_encoder"] = {"path": str(encoder_dir), "text_len": 24}
        config["prompts"]["boat"] = "A boat at dawn"

    config = checked(with_encoder)
    monkeypatch.chdir(tmp_path)  # results/ is relative to the workdir
    assert "text encoder: 3 prompts to encode, each job loading" in format_plan(config)
    (tmp_path / "results/prompts").mkdir(parents=True)
    (tmp_path / "results/prompts/boat.safetensors").write_bytes(b"")  # encoded already
    assert "text encoder: 2 prompts to encode" in format_plan(config)
    fill(config, tmp_path / "results/prompt_cache")
    assert "text encoder:" not in format_plan(config)
    # The demo's encoder loads in milliseconds: no advice.
    assert "text encoder:" not in format_plan(checked())
