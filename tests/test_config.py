"""Config checks and rule params in-process: the schema with its defaults, `check_config`, and
what decides the reruns of extraction jobs (no Snakemake subprocess; tests/test_workflow.py keeps
two end-to-end cases that show the checks run before any job)."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from sinkscope.wan.spec import CheckpointSpec
from sinkscope.workflow import entries, params
from sinkscope.workflow.checks import check_config
from sinkscope.workflow.entries import (
    ConfigError,
    checkpoint_spec,
    frame_layers,
    survey_layers,
    token_layers,
)
from sinkscope.workflow.params import closed_loop_settings, extraction_gpus, extraction_settings

from .workflowtools import REPO

DEMO = yaml.safe_load((REPO / "config.yaml").read_text())
SCHEMA = str(REPO / "schemas" / "config.schema.yaml")


def checked(change=None) -> dict:
    """The demo config with `change` applied, validated (defaults filled) and checked, as
    rules/common.smk does; paths are relative to the repository, as to the workdir there."""
    config = copy.deepcopy(DEMO)
    if change is not None:
        change(config)
    validate(config, SCHEMA)
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        check_config(config)
    finally:
        os.chdir(cwd)
    return config


def test_the_demo_config_passes():
    config = checked()
    assert config["capture"]["keep_tokens"] is True  # a schema default, filled in


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(colour="red"), "colour"),
        (lambda c: c["prompts"].update(blank="   "), "['prompts']['blank']"),
        (lambda c: c["sampler"].update(local_attn_size=0), "local_attn_size"),
        (lambda c: c.update(device="gpu"), "device"),
        (lambda c: c["closed_loop"].update(jitter=1.0), "jitter"),
        (lambda c: c["closed_loop"].update(bias=0), "bias"),
        (lambda c: c["closed_loop"].update(reference="half"), "reference"),
    ],
    ids=[
        "unknown-key",
        "empty-prompt",
        "zero-window",
        "bad-device",
        "jitter-out-of-range",
        "bias-out-of-range",
        "unknown-reference",
    ],
)
def test_schema_refuses(change, message):
    with pytest.raises(WorkflowError, match=message.replace("[", r"\[").replace("]", r"\]")):
        checked(change)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c["checkpoints"].update(real={"base": "weights/missing"}),
            "checkpoints.real: checkpoint file not found: weights/missing/config.json",
        ),
        (lambda c: c.update(layers=[0, 7]), "layers: [7] out of range for checkpoint 'demo_a'"),
        (
            lambda c: (c["capture"].update(survey=[2]), c["figures"].update(heads=[[1, 0]])),
            "figures.heads: layer 1 is not captured; add it to layers [0] or to capture.survey",
        ),
        (lambda c: c["figures"].update(heads=[[0, 4]]), "figures.heads: head 4 out of range"),
        (lambda c: c["sampler"].update(local_attn_size=2), "cannot hold"),
        (lambda c: c["sampler"].update(sink_size=1), "sampler.sink_size needs a window"),
        (
            lambda c: c["checkpoints"]["demo_b"].update(sampler={"steps": [999.5], "warp": True}),
            "checkpoints.demo_b.sampler.steps: warped steps must be integers",
        ),
        (
            lambda c: c["prompts"].update(fox={"text": "fox", "embeddings": "nope.safetensors"}),
            "prompts.fox.embeddings: file not found: nope.safetensors",
        ),
        (
            lambda c: c.update(text_encoder={"path": "config.yaml"}),
            "text_encoder.tokenizer: required with Wan's encoder file config.yaml",
        ),
        (
            lambda c: c["text_encoder"].update(text_len=512),
            "text_encoder.text_len=512 exceeds text_len=128 of checkpoint 'demo_a'",
        ),
        (
            lambda c: c["demo"]["text_encoder"].update(d_model=16),
            "demo.text_encoder.d_model=16 differs from text_dim=32",
        ),
        (
            lambda c: c["video"].update(latent_height=7),
            "video: latent grid 7x12 is not divisible by the patch size 2x2",
        ),
        (lambda c: c["video"].update(frames_per_block=22), "video.frames_per_block=22 exceeds"),
        (lambda c: c["capture"].update(passes=[9]), "capture.passes: 9 is not"),
        (lambda c: c["figures"].update(step=5), "figures.step=5 but only 5 passes"),
        (
            lambda c: (
                c["capture"].update(tokens=False, survey=[2]),
                c["figures"].update(measure="probabilities"),
            ),
            "figures.measure: probabilities need the token logits or a survey; with "
            "capture.tokens: false layers [0] of figures.heads",
        ),
        (lambda c: c["capture"].update(survey=[1, 4]), "capture.survey: [4] out of range"),
        (
            lambda c: (c.update(layers=[]), c["capture"].update(survey="none")),
            "layers is empty and capture.survey is none: nothing to capture",
        ),
        (
            lambda c: c["capture"].update(keep_tokens=False),
            "capture.keep_tokens: false deletes a token store once it is reduced, but layers "
            "[0] are also surveyed",
        ),
        (
            lambda c: c["policies"].update(budget=7),
            "policies.budget=7 is not one of policies.budgets [3, 6, 9, 12]",
        ),
        (
            lambda c: c["checkpoints"]["demo_a"].update(generator="x.pt"),
            "checkpoints.demo_a.generator: a demo checkpoint takes no generator file",
        ),
        (
            lambda c: c["capture"].update(token_runs=[["demo_c", "eagle"]]),
            "capture.token_runs: checkpoint 'demo_c' is not one of ['demo_a', 'demo_b']",
        ),
        (
            lambda c: c["capture"].update(token_runs=[["demo_a", "eagle"]] * 2),
            "capture.token_runs: [demo_a, eagle] is listed twice",
        ),
        (
            lambda c: c["figures"].update(runs=[["demo_a", "fox"]]),
            "figures.runs: prompt 'fox' is not one of ['eagle', 'harbor']",
        ),
        (
            lambda c: c["closed_loop"].update(runs=[["demo_a", "fox"]]),
            "closed_loop.runs: prompt 'fox' is not one of ['eagle', 'harbor']",
        ),
        (
            lambda c: c["closed_loop"].update(budget=8),
            "closed_loop.budget=8 is not one of policies.budgets [3, 6, 9, 12]",
        ),
        (
            lambda c: c["closed_loop"].update(sink_frames=2),
            "closed_loop.sink_frames=2 is not one of policies.sinks [0, 1, 3]",
        ),
        (
            lambda c: (
                c["closed_loop"].update(budget=6, sink_frames=3, policies=["deep_sink"])
                or c["policies"].update(sinks=[3, 4])
                or c["closed_loop"].update(sink_frames=4)
            ),
            "closed_loop.budget=6 leaves 3 frames beside the own block of 3 "
            "(video.frames_per_block), fewer than closed_loop.sink_frames=4 of deep_sink",
        ),
        (
            lambda c: c["closed_loop"].update(budget=3, policies=["top_c"]),
            "fewer than policies.recent_frames=1 of top_c",
        ),
        (
            lambda c: c["closed_loop"].update(budget=6, policies=["deep_forcing"]),
            "closed_loop.budget=6 leaves 3 frames beside the own block of 3 "
            "(video.frames_per_block), fewer than closed_loop.sink_frames=3 + "
            "policies.recent_frames=1 of deep_forcing",
        ),
        (
            lambda c: c["policies"].update(capacity=6),
            "policies.capacity=6 is less than closed_loop.budget=9: deep_forcing prunes its "
            "cache of capacity frames to the budget",
        ),
        (
            lambda c: c["closed_loop"].update(survey=[4]),
            "closed_loop.survey: [4] out of range for checkpoint 'demo_a'",
        ),
        (lambda c: c["closed_loop"].update(num_frames=42.0), "closed_loop.num_frames: 42.0"),
        (
            lambda c: c["closed_loop"].update(num_frames=6),
            "closed_loop.budget=9 frames exceeds closed_loop.num_frames=6",
        ),
        (
            lambda c: c["closed_loop"].update(
                policies=["window"], num_frames=3000, gpu_memory_gb=0.001
            ),
            "closed_loop.reference: full at closed_loop.num_frames=3000 needs about",
        ),
        (
            lambda c: c["sampler"].update(kind="rolling", local_attn_size=12),
            "sampler.local_attn_size / sink_size: the rolling sampler keeps Rolling Forcing's",
        ),
        (
            lambda c: (
                c["sampler"].update(kind="rolling")
                or c["video"].update(frames_per_block=2)
                or c["video"].update(num_frames=20)
            ),
            "video.frames_per_block=2: the rolling sampler needs blocks that divide",
        ),
        (
            lambda c: c["sampler"].update(kind="rolling", first_block_steps=[1000, 500]),
            "sampler.first_block_steps: the rolling sampler gives every block the same steps",
        ),
        (
            # Causal Forcing++'s 1-step model: its first block's 4 steps fill passes 0-3, the
            # other blocks run pass 0 and the cache pass 4 only.
            lambda c: (
                c["sampler"].update(steps=[1000], first_block_steps=[1000, 750, 500, 250])
                or c["figures"].update(step=2)
            ),
            "figures.step=2 is pass 2, which under checkpoint 'demo_a' only the first block runs "
            "(sampler.first_block_steps: 4 denoising steps; every other block runs sampler.steps: "
            "1, passes [0] and the cache pass 4): its figures would be empty; choose figures.step "
            "from [0, 4]",
        ),
        (
            lambda c: (
                c["sampler"].update(kind="rolling", steps=[1000, 900, 800, 600, 400, 200, 100])
                or c["closed_loop"].update(policies=[])
            ),
            "a window of 7 steps x 3 frames and its anchor block exceed Rolling Forcing's 21",
        ),
        (
            lambda c: c["sampler"].update(kind="rolling"),
            "closed_loop.policies: ['deep_forcing', 'top_c'] do not run on the rolling sampler",
        ),
        (
            lambda c: (
                c["sampler"].update(kind="rolling")
                or c["closed_loop"].update(policies=["sink_window"])
            ),
            "closed_loop.budget=9: sink_window on the rolling sampler of checkpoint 'demo_a' "
            "needs at least 15 frames",
        ),
        (
            lambda c: (
                c["sampler"].update(kind="rolling")
                or c["closed_loop"].update(policies=["sink_window"], sink_frames=4, budget=21)
                or c["policies"].update(budgets=[21], budget=21, sinks=[4])
            ),
            "closed_loop.sink_frames=4: sink_window on the rolling sampler of checkpoint 'demo_a' "
            "keeps its sinks from block 0",
        ),
    ],
    ids=[
        "missing-checkpoint",
        "layer-out-of-range",
        "figure-layer",
        "figure-head",
        "window-too-small",
        "sink-without-window",
        "fractional-warped-step",
        "missing-embeddings",
        "pth-without-tokenizer",
        "text-too-long",
        "encoder-width",
        "latent-not-patchable",
        "block-too-long",
        "bad-pass",
        "figure-step",
        "probabilities-without-tokens",
        "survey-out-of-range",
        "nothing-captured",
        "temporary-token-stores-of-surveyed-layers",
        "policy-budget-not-swept",
        "demo-with-generator",
        "token-runs-unknown-run",
        "token-runs-twice",
        "figure-runs-unknown-run",
        "closed-loop-unknown-run",
        "closed-loop-budget-not-swept",
        "closed-loop-sinks-not-swept",
        "closed-loop-sinks-fill-the-cache",
        "closed-loop-recent-fill-the-cache",
        "closed-loop-sinks-and-recent-fill-the-cache",
        "closed-loop-capacity-under-the-budget",
        "closed-loop-survey-out-of-range",
        "closed-loop-integer",
        "closed-loop-window-beyond-the-length",
        "closed-loop-full-reference-beyond-the-gpu",
        "rolling-with-a-window",
        "rolling-blocks-split-its-cache",
        "rolling-first-block-steps",
        "figure-step-only-the-first-block-runs",
        "rolling-window-beyond-its-cache",
        "rolling-closed-loop-policies",
        "rolling-closed-loop-budget",
        "rolling-closed-loop-sinks-beyond-block-zero",
    ],
)
def test_check_config_names_the_key(change, message):
    with pytest.raises(ConfigError) as raised:
        checked(change)
    assert message in str(raised.value)


def test_a_closed_loop_beyond_the_free_disk_is_refused(monkeypatch):
    from sinkscope.workflow import checks

    monkeypatch.setattr(checks, "free_bytes", lambda folder: ("/results", 10**6))
    with pytest.raises(ConfigError) as raised:
        checked(lambda c: c["closed_loop"].update(num_frames=1101, reference="none"))
    assert "closed_loop.num_frames=1101: the closed loop writes up to" in str(raised.value)
    assert "more than the 0.0 GB free on /results" in str(raised.value)


def test_extraction_params_hold_the_checkpoint_spec_and_its_content(tmp_path):
    config = checked()
    params = extraction_settings(config, "demo_a", tmp_path / "cache.json")
    assert params["checkpoint"] == {
        "base": "results/demo/demo_a",
        "demo_model": {},
        "demo_seed": 1,
        "ema": True,
    }
    # Sampler overrides of the entry are the sampler's, not the spec's.
    config["checkpoints"]["demo_a"]["sampler"] = {"shift": 8.0}
    again = extraction_settings(config, "demo_a", tmp_path / "cache.json")
    assert again["checkpoint"] == params["checkpoint"] and again["sampler"]["shift"] == 8.0


def test_dtype_is_in_the_params_of_every_job_it_affects(tmp_path):
    """`dtype` (auto by default) reaches the extraction, survey and closed-loop params, so a
    changed dtype reruns them; the GPU estimate doubles the model's bytes in float32."""
    from sinkscope.workflow.resources import gpu_memory_bytes

    config = checked()
    assert config["dtype"] == "auto"
    cache = tmp_path / "cache.json"

    def job_params():
        return [
            extraction_settings(config, "demo_a", cache),
            extraction_settings(config, "demo_a", cache, store="attention"),
            closed_loop_settings(config, "demo_a", "window", cache),
        ]

    assert all(params["dtype"] == "auto" for params in job_params())
    estimate = gpu_memory_bytes(config, "demo_a", "survey")
    config["dtype"] = "float32"
    assert all(params["dtype"] == "float32" for params in job_params())
    wider = gpu_memory_bytes(config, "demo_a", "survey")
    for part in ("weights", "kv_cache", "text_cache", "activations"):
        assert wider[part] == 2 * estimate[part], part
    with pytest.raises(Exception, match="'float16' is not one of"):  # the schema's enum
        checked(lambda c: c.update(dtype="float16"))


def test_a_new_checkpoint_key_changes_params_and_reaches_the_loader(monkeypatch, tmp_path):
    """Adding a key = the schema + a CheckpointSpec field: the params (so the reruns) see it."""

    @dataclasses.dataclass(frozen=True)
    class SpecWithRevision(CheckpointSpec):
        revision: str | None = None

    monkeypatch.setattr(entries, "CheckpointSpec", SpecWithRevision)
    config = checked()
    before = extraction_settings(config, "demo_a", tmp_path / "cache.json")
    config["checkpoints"]["demo_a"]["revision"] = "r2"
    after = extraction_settings(config, "demo_a", tmp_path / "cache.json")
    assert after != before and after["checkpoint"]["revision"] == "r2"
    assert checkpoint_spec(config, "demo_a") == SpecWithRevision(
        base="results/demo/demo_a", revision="r2"
    )
    # What the job rebuilds from its params is the same spec.
    assert SpecWithRevision.from_entry(after["checkpoint"]) == checkpoint_spec(config, "demo_a")


def test_survey_layers_token_layers_and_frame_layers():
    config = checked()  # the demo: survey all 4 layers, a token store for layer 0
    assert survey_layers(config) == [0, 1, 2, 3] and token_layers(config) == [0]
    assert frame_layers(config) == [0, 1, 2, 3]
    only_tokens = checked(lambda c: (c.update(layers=[2, 0]), c["capture"].update(survey="none")))
    assert survey_layers(only_tokens) == [] and frame_layers(only_tokens) == [0, 2]
    survey_only = checked(lambda c: (c.update(layers=[]), c["capture"].update(survey=[3, 2, 0])))
    assert frame_layers(survey_only) == [0, 2, 3] and token_layers(survey_only) == []
    # Empty layers are fine with a survey, and keep_tokens: false too when nothing overlaps.
    checked(lambda c: (c.update(layers=[1]), c["capture"].update(survey=[0, 2], keep_tokens=False)))


def test_survey_all_needs_checkpoints_of_one_depth(monkeypatch):
    real = entries.model_config

    def deeper_b(config, name):
        model = real(config, name)
        return dataclasses.replace(model, num_layers=6) if name == "demo_b" else model

    monkeypatch.setattr(entries, "model_config", deeper_b)
    with pytest.raises(ConfigError, match=r"capture\.survey: all needs checkpoints with the same"):
        checked()
    assert survey_layers(checked(lambda c: c["capture"].update(survey=[3, 0, 2]))) == [0, 2, 3]


def test_survey_params_do_not_depend_on_capture_tokens(tmp_path):
    config = checked()
    cache = tmp_path / "sha.json"
    survey = extraction_settings(config, "demo_a", cache, store="attention")
    tokens = extraction_settings(config, "demo_a", cache)
    assert "tokens" not in survey["capture"] and tokens["capture"]["tokens"] is True
    config["capture"]["tokens"] = False
    assert extraction_settings(config, "demo_a", cache, store="attention") == survey
    assert extraction_settings(config, "demo_a", cache) != tokens


def test_token_runs_and_stores():
    """Token stores for the listed runs only (the demo: one); every run without the key; a
    token layer that is not surveyed in every run, as its frames come from it."""
    assert entries.token_runs(checked()) == [("demo_a", "eagle")]
    assert entries.token_stores(checked()) == [("demo_a", "eagle", 0)]
    everything = checked(lambda c: c["capture"].pop("token_runs"))
    assert len(entries.token_runs(everything)) == 4
    assert {layer for *_, layer in entries.token_stores(everything)} == {0}
    assert len(entries.token_stores(everything)) == 4
    unsurveyed = checked(lambda c: (c.update(layers=[0, 1]), c["capture"].update(survey=[1, 2])))
    stores = entries.token_stores(unsurveyed)
    assert [s for s in stores if s[2] == 1] == [("demo_a", "eagle", 1)]
    assert {(c, p) for c, p, layer in stores if layer == 0} == {
        (c, p) for c in ("demo_a", "demo_b") for p in ("eagle", "harbor")
    }
    assert entries.token_stores(checked(lambda c: c.update(layers=[]))) == []
    # No run listed: the surveyed token layers have no token store at all.
    assert entries.token_stores(checked(lambda c: c["capture"].update(token_runs=[]))) == []


def test_figure_runs():
    """Each run's own figures for the listed runs (the demo: eagle under demo_a), every run
    without the key."""
    assert entries.figure_runs(checked()) == [("demo_a", "eagle")]
    everything = checked(lambda c: c["figures"].pop("runs"))
    assert len(entries.figure_runs(everything)) == 4


# Every policy the demo's closed loop could run (it runs four of them).
ALL_LOOP_POLICIES = ["window", "sink_window", "deep_sink", "participative", "deep_forcing", "top_c"]


def test_closed_loop_entries_and_params(tmp_path):
    config = checked(lambda c: c["closed_loop"].update(policies=ALL_LOOP_POLICIES))
    assert entries.closed_loop_runs(config) == [("demo_a", "eagle")]
    assert entries.closed_loop_policy(config, "deep_sink") == {
        "name": "deep_sink",
        "budget": 9,
        "sink_frames": 3,
        "turn": "delta",
    }
    assert entries.closed_loop_policy(config, "top_c") == {
        "name": "top_c",
        "budget": 9,
        "recent_frames": 1,
    }
    participative = {
        "budget": 9,
        "sink_frames": 3,
        "recent_frames": 1,
        "capacity": 21,
        "reuse_cap": 7,
    }
    assert entries.closed_loop_policy(config, "participative") == {
        "name": "participative",
        **participative,
    }
    assert entries.closed_loop_policy(config, "deep_forcing") == {
        "name": "deep_forcing",
        **participative,
        "turn": "delta",
    }
    # A policy's settings are only those it uses: the turn reruns only deep_sink and
    # deep_forcing, the capacity only Participative Compression.
    turned = checked(
        lambda c: c["closed_loop"].update(policies=ALL_LOOP_POLICIES, sink_turn="rerope")
    )
    changed = {
        name
        for name in entries.closed_loop_policies(config)
        if entries.closed_loop_policy(turned, name) != entries.closed_loop_policy(config, name)
    }
    assert changed == {"deep_sink", "deep_forcing"}
    settings = closed_loop_settings(config, "demo_a", "window", cache=tmp_path / "digests.json")
    assert settings["video"]["num_frames"] == 42
    assert settings["policy"] == {"name": "window", "budget": 9}
    # The sampler's window is not the closed loop's cache: a change there reruns nothing.
    config["sampler"].update(local_attn_size=21, sink_size=3)
    again = closed_loop_settings(config, "demo_a", "window", cache=tmp_path / "digests.json")
    assert again == settings
    config["closed_loop"]["policies"] = []
    assert entries.closed_loop_runs(config) == []
    everything = checked(lambda c: c["closed_loop"].pop("runs"))
    assert len(entries.closed_loop_runs(everything)) == 4


def test_cpu_jobs_on_this_machine_claim_no_gpu(monkeypatch, tmp_path):
    from sinkscope.workflow import gpus

    config = checked()
    real_host_has_gpu = gpus.host_has_gpu
    monkeypatch.delenv("SINKSCOPE_FAKE_GPUS", raising=False)
    monkeypatch.setattr(params, "host_has_gpu", lambda: False)
    assert extraction_gpus(config, local=True) == 0
    assert extraction_gpus(config, local=False) == 1  # a cluster node decides for itself
    # One CPU for a CPU job (jobs side by side); a GPU job's store writer gets its own.
    assert params.extraction_threads(config, local=True) == 1
    assert params.extraction_threads(config, local=False) == params.GPU_JOB_THREADS == 2
    monkeypatch.setattr(params, "host_has_gpu", lambda: True)
    assert extraction_gpus(config, local=True) == 1
    assert params.extraction_threads(config, local=True) == 2
    assert extraction_gpus({**config, "device": "cpu"}, local=False) == 0
    assert params.extraction_threads({**config, "device": "cpu"}, local=False) == 1
    monkeypatch.setenv("SINKSCOPE_FAKE_GPUS", "2")
    assert real_host_has_gpu()
    monkeypatch.setenv("SINKSCOPE_FAKE_GPUS", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not real_host_has_gpu()  # a GPU hidden from every job
