"""The Snakemake workflow on the embedded default, in a temporary copy of the repository."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
import yaml

from sinkscope.storage import decoded_attrs
from sinkscope.wan.text import load_prompt_segments

from .workflowtools import copy_workflow, demo_copy, edit_config, planned_jobs, snakemake

# Runs Snakemake in a subprocess: `pytest -m "not workflow"` leaves it out.
pytestmark = pytest.mark.workflow


def test_demo_produces_every_contract(demo_run):
    results = demo_run / "results"
    for checkpoint in ("demo_a", "demo_b"):
        for prompt in ("eagle", "harbor"):
            for layer in (0,):  # the token layer
                # capture.token_runs: one token store; the other runs' layer 0 is surveyed.
                token_store = results / f"logits/{checkpoint}/{prompt}/layer{layer}.zarr"
                if (checkpoint, prompt) != ("demo_a", "eagle"):
                    assert not token_store.exists()
                else:
                    tokens = xr.open_zarr(token_store)
                    # capture.token_passes: 0 -- the token store holds pass 0 (t=1000) alone.
                    assert tokens.logits.shape == (1, 4, 21 * 24, 21 * 24)
                    assert tokens.timestep.values.tolist() == [1000.0]
                    assert tokens.attrs["checkpoint"] == checkpoint
                    assert tokens.attrs["layer"] == layer
                frames = xr.open_zarr(results / f"frames/{checkpoint}/{prompt}/layer{layer}.zarr")
                mass = frames.prob_mass.sum("key_frame", skipna=True).values
                np.testing.assert_allclose(mass, 1.0, atol=1e-4)
                stats = pd.read_csv(results / f"stats/{checkpoint}/{prompt}/layer{layer}.csv")
                assert set(stats.measure) == {"logit_mean", "prob_mass"}
            for layer in range(4):  # every layer surveyed
                survey = xr.open_zarr(
                    results / f"attention/{checkpoint}/{prompt}/layer{layer}.zarr"
                )
                assert survey.key_mass.shape == (5, 4, 21, 21 * 24)
                frames = xr.open_zarr(results / f"frames/{checkpoint}/{prompt}/layer{layer}.zarr")
                assert frames.attrs["store"] == "attention"
            figures = results / f"figures/{checkpoint}/{prompt}"
            if (checkpoint, prompt) != ("demo_a", "eagle"):  # figures.runs: that run alone
                assert not (figures / "figure4.svg").exists()
                continue
            names = {p.name for p in figures.iterdir()}
            assert {
                "figure4.svg",
                "layer0_heads_grid.svg",
                "layer2_frame_maps.svg",
                "layer_comparison.svg",
                "statistics.svg",
                "survey_first_frame.svg",
                "survey_head_class.svg",
                "survey_sink_rate.svg",
                "survey_spatial.svg",
                "policy_recall.svg",
                "policy_sinks.svg",
                "policy_map.svg",
            } <= names
            assert "layer1_heads_grid.svg" not in names  # per-layer: token and heads layers
    summary = pd.read_csv(results / "stats/summary.csv")
    assert {"run", "mean", "std", "count"} <= set(summary["aggregate"])
    for name in ("checkpoints", "prompts", "passes"):
        assert (results / f"figures/compare/{name}.svg").stat().st_size > 1000
    log = (results / "logs/extract/demo_a/eagle/layer0.log").read_text()
    # Progress by model call: 7 blocks x 5 calls, the last the cache pass of frames 18-20.
    assert "call 35/35 (cache, frames 18-20, t=0) done" in log
    log = (results / "logs/survey/demo_a/eagle.log").read_text()
    assert "4 attention store(s) of demo_a, up to" in log and "call 35/35 (cache" in log
    # The two demo checkpoints really differ.
    a = xr.open_zarr(results / "frames/demo_a/eagle/layer0.zarr").logit_mean.values
    b = xr.open_zarr(results / "frames/demo_b/eagle/layer0.zarr").logit_mean.values
    assert not np.allclose(a, b, equal_nan=True)


def test_second_run_does_nothing(demo_run):
    assert planned_jobs(demo_run) == set()


def test_new_layer_or_prompt_runs_only_new_jobs(demo_run, tmp_path):
    workdir = demo_copy(demo_run, tmp_path / "w")
    edit_config(workdir, lambda c: c.update(layers=[0, 1]))
    jobs = planned_jobs(workdir)
    # Layer 1 is surveyed: its token store only for capture.token_runs.
    assert {w for r, w in jobs if r == "extract"} == {"checkpoint=demo_a, prompt=eagle, layer=1"}
    assert not any(r in {"encode_prompt", "make_demo_models", "compare_figures"} for r, _ in jobs)

    edit_config(workdir, lambda c: (c.update(layers=[0]), c["prompts"].update(fox="A red fox")))
    jobs = planned_jobs(workdir)
    assert {w for r, w in jobs if r == "encode_prompt"} == {"prompt=fox"}
    new_run_rules = {"survey", "policies", "figures"}
    assert all("prompt=fox" in w for r, w in jobs if r in new_run_rules)
    assert len([r for r, _ in jobs if r == "survey"]) == 2
    assert not [r for r, _ in jobs if r == "extract"]  # not in capture.token_runs


def test_extraction_killed_mid_write_leaves_nothing_accepted(demo_run, tmp_path):
    workdir = demo_copy(demo_run, tmp_path / "w")

    # A bigger latent (96 tokens per frame) so the job is still writing when it is killed.
    def bigger(config):
        config["video"].update(latent_height=16, latent_width=24)
        config["capture"].update(token_passes="all")

    edit_config(workdir, bigger)
    target = "results/logits/demo_a/eagle/layer0.zarr"
    partial = workdir / (target + ".partial")
    job = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "1", target],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120

    def shard_written() -> bool:
        return partial.exists() and any((partial / "logits").glob("c.*"))

    while not shard_written():
        assert job.poll() is None, "the job ended before it was killed"
        assert time.monotonic() < deadline, "no shard written within 120 s"
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    # Snakemake removed the old output before the job; nothing at the output path now.
    assert not (workdir / target).exists()
    from sinkscope.analysis.reduce import reduce_token_store

    with pytest.raises(ValueError, match="not marked complete"):
        reduce_token_store(partial, tmp_path / "frames.zarr")
    assert not (tmp_path / "frames.zarr").exists()
    snakemake(workdir, "--unlock")
    planned = {w for r, w in planned_jobs(workdir, target) if r == "extract"}
    assert planned == {"checkpoint=demo_a, prompt=eagle, layer=0"}
    snakemake(workdir, target)
    assert decoded_attrs(xr.open_zarr(workdir / target))["complete"] is True
    assert not partial.exists()


def test_token_stores_are_temporary_unless_kept(demo_run, tmp_path):
    workdir = demo_copy(demo_run, tmp_path / "w")

    # Token stores of layers that are not surveyed (1 and 3 here) are reduced, then deleted; one
    # checkpoint and prompt keep it short.
    def token_layers_1_and_3(config):
        config.update(layers=[1, 3], checkpoints={"demo_a": config["checkpoints"]["demo_a"]})
        config.update(prompts={"eagle": config["prompts"]["eagle"]})
        config["figures"]["runs"] = [["demo_a", "eagle"]]
        config["capture"].update(survey=[0, 2])

    edit_config(workdir, token_layers_1_and_3)
    snakemake(workdir)
    edit_config(workdir, lambda c: c["capture"].update(keep_tokens=False))
    assert planned_jobs(workdir) == set()  # keeping or not does not change any result
    snakemake(workdir, "--delete-temp-output")
    assert not list((workdir / "results/logits/demo_a/eagle").glob("layer[13].zarr"))
    frames = sorted((workdir / "results/frames/demo_a/eagle").glob("layer*.zarr"))
    assert [xr.open_zarr(f).attrs["store"] for f in frames] == [
        "attention",
        "tokens",
        "attention",
        "tokens",
    ]
    assert planned_jobs(workdir) == set()


def test_precomputed_prompt_embeddings_replace_the_encoder(demo_run, tmp_path):
    workdir = demo_copy(demo_run, tmp_path / "w")
    mine = workdir / "mine.safetensors"
    shutil.copy(demo_run / "results/prompts/eagle.safetensors", mine)
    text = yaml.safe_load((workdir / "config.yaml").read_text())["prompts"]["eagle"]
    edit_config(
        workdir,
        lambda c: c["prompts"].update(eagle={"text": text, "embeddings": "mine.safetensors"}),
    )
    assert {w for r, w in planned_jobs(workdir) if r == "encode_prompt"} == {"prompt=eagle"}
    snakemake(workdir, "results/prompts/eagle.safetensors")
    from sinkscope.wan.text import load_prompt_embedding

    got, meta = load_prompt_embedding(workdir / "results/prompts/eagle.safetensors")
    want, _ = load_prompt_embedding(mine)
    assert meta["prompt"] == text and np.array_equal(got.numpy(), want.numpy())


def test_prompts_encoded_at_once_rerun_nothing_and_a_changed_prompt_only_its_own_jobs(
    demo_run, tmp_path
):
    """`encode_all_prompts` fills the prompt cache with the encoder loaded once: filling it
    reruns no job of a finished run, an encode job copies its prompt's entry (no GPU) and a
    prompt edited since is encoded by its own job, the others' jobs untouched."""
    workdir = demo_copy(demo_run, tmp_path / "w")
    snakemake(workdir, "encode_all_prompts")
    log = (workdir / "results/logs/encode_all_prompts.log").read_text()
    assert "encoding 2 prompts (2 texts)" in log
    assert planned_jobs(workdir) == set()
    before = {p.name: p.stat().st_mtime_ns for p in (workdir / "results/prompts").iterdir()}

    edit_config(workdir, lambda c: c["prompts"].update(eagle="An eagle over the sea at dusk"))
    encodes = {w for r, w in planned_jobs(workdir) if r in {"encode_prompt", "encode_all_prompts"}}
    assert encodes == {"prompt=eagle"}  # the cache is not an input: it reruns nothing
    snakemake(workdir, "results/prompts/eagle.safetensors")
    log = (workdir / "results/logs/encode_prompt/eagle.log").read_text()
    assert "not in the prompt cache" in log
    own = load_prompt_segments(workdir / "results/prompts/eagle.safetensors")[0]

    # Refilled (its params name every prompt's text), the edited prompt is copied from it.
    assert ("encode_all_prompts", "") in planned_jobs(workdir, "encode_all_prompts")
    snakemake(workdir, "encode_all_prompts")
    (workdir / "results/prompts/eagle.safetensors").unlink()
    dry = snakemake(workdir, "--dry-run", "results/prompts/eagle.safetensors").stdout
    assert "gpu=0" in dry and "mem_mb=1000" in dry  # a copy, not the encoder
    snakemake(workdir, "results/prompts/eagle.safetensors")
    log = (workdir / "results/logs/encode_prompt/eagle.log").read_text()
    assert "copied results/prompt_cache/" in log
    assert torch.equal(load_prompt_segments(workdir / "results/prompts/eagle.safetensors")[0], own)
    after = {p.name: p.stat().st_mtime_ns for p in (workdir / "results/prompts").iterdir()}
    assert after["harbor.safetensors"] == before["harbor.safetensors"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(colour="red"), "colour"),
        (lambda c: c.update(layers=[0, 7]), "layers: [7] out of range"),
    ],
    ids=["schema", "check_config"],
)
def test_bad_config_fails_before_any_job(tmp_path, change, message):
    """The schema and check_config run when Snakemake parses (every case: tests/test_config.py)."""
    workdir = copy_workflow(tmp_path / "w")
    edit_config(workdir, change)
    result = snakemake(workdir, check=False)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert not (workdir / "results").exists()


def test_every_output_a_user_opens_is_restored_by_a_plain_rerun(demo_run, tmp_path):
    workdir = demo_copy(demo_run, tmp_path / "w")
    # A run without figures of its own (figures.runs: demo_a/eagle), so that the figure below
    # is the only reason for its figures job.
    shutil.rmtree(workdir / "results/frames/demo_b/harbor/layer0.zarr")
    (workdir / "results/stats/sink_rate.csv").unlink()
    (workdir / "results/figures/demo_a/eagle/layer2_frame_maps.svg").unlink()
    jobs = planned_jobs(workdir)
    assert ("policies", "checkpoint=demo_b, prompt=harbor") in jobs  # its frame datasets
    assert ("summary", "") in jobs
    assert ("figures", "checkpoint=demo_a, prompt=eagle") in jobs
    assert not {rule for rule, _ in jobs} & {"extract", "encode_prompt"}
