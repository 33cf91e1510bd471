"""examples/*.yaml on Self-Forcing's directory layout, with tiny models in the real formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

from sinkscope.schedules import KEY_VERSION
from sinkscope.storage import decoded_attrs
from sinkscope.wan.checkpoint import save_wan_model
from sinkscope.wan.config import WanConfig
from sinkscope.wan.model import WanModel
from sinkscope.wan.text import make_demo_text_encoder, wan_umt5_key_map
from sinkscope.wan.vae import random_vae, save_original_layout, tiny_vae_config

from .test_lora import random_lora
from .workflowtools import REPO, copy_workflow, planned_jobs, snakemake

# Runs Snakemake in a subprocess: `pytest -m "not workflow"` leaves it out.
pytestmark = pytest.mark.workflow

# 5 layers and 10 heads, so the examples' layers [0, 4] and heads L0H0, L4H9 exist.
EXAMPLE_MODEL = WanConfig(
    dim=60, ffn_dim=64, num_heads=10, num_layers=5, freq_dim=16, text_dim=32, text_len=512
)
# The real 60 x 104 x 21-frame geometry is far too big for CI; a second config file shrinks it.
SMALL_VIDEO = "video: {num_frames: 6, frames_per_block: 3, latent_height: 4, latent_width: 6}\n"
# The examples of the other samplers keep their blocks: 21 frames, so that Rolling Forcing's
# window moves past block 0 (anchor and cache keys) as in the real run.
SMALL_FRAMES = "video: {num_frames: 21, latent_height: 4, latent_width: 6}\n"
# Causal Forcing's release files under checkpoints/ and the entry the example reads.
CAUSAL_FORCING = {
    "chunkwise/causal_forcing.pt": "generator",
    "framewise/causal_forcing.pt": "generator_ema",
    "causal-forcing++/framewise-1step.pt": "generator_ema",
    "causal-forcing++/framewise-2step.pt": "generator_ema",
    "chunkwise/longvideo.pt": "generator_ema",
}
EVERY_LAYER = [0, 1, 2, 3, 4]
NEW_SAMPLERS = {  # example: checkpoint, sampler kind, frames per block, surveyed layers
    "rolling_forcing": ("rolling_forcing_dmd", "rolling", 3, [0, 4]),
    "causal_forcing": ("causal_forcing", "self_forcing", 3, EVERY_LAYER),
    "causal_forcing_framewise": ("causal_forcing_framewise", "self_forcing", 1, EVERY_LAYER),
    "causal_forcing_1step": ("causal_forcing_1step", "self_forcing", 1, EVERY_LAYER),
    "causal_forcing_2step": ("causal_forcing_2step", "self_forcing", 1, EVERY_LAYER),
    "causal_forcing_long": ("causal_forcing_long", "rolling", 3, [0, 4]),
}
# The timesteps of the passes (the steps at shift 5, warped, then the cache pass): Self-Forcing's
# [1000, 750, 500, 250] but for Rolling Forcing's 5 steps.
SELF_FORCING_PASSES = [1000.0, 937.5, 833.33, 625.0, 0.0]
PASSES = {"rolling_forcing": [1000.0, 952.38, 882.35, 769.23, 555.56, 0.0]}
# Causal Forcing++: the blocks after the first at their own steps.
LATER_BLOCKS = {"causal_forcing_1step": [1000.0], "causal_forcing_2step": [1000.0, 833.33]}


def _model(seed: int) -> WanModel:
    model = WanModel(EXAMPLE_MODEL)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def _write_self_forcing_layout(root) -> None:
    wan = root / "wan_models" / "Wan2.1-T2V-1.3B"
    save_wan_model(_model(0), wan)
    # Wan2.1_VAE.pth in the original layout (Wan's structure at 1 channel of 96: planned only).
    save_original_layout(random_vae(tiny_vae_config(1)), wan / "Wan2.1_VAE.pth")
    # Wan's UMT5 .pth (bf16, Wan key names) and the google/umt5-xxl tokenizer folder.
    encoder_dir = root / "hf_encoder"
    make_demo_text_encoder(encoder_dir, d_model=32, num_layers=2, num_heads=4, seed=3)
    from transformers import UMT5EncoderModel

    hf_state = UMT5EncoderModel.from_pretrained(str(encoder_dir)).state_dict()
    key_map = wan_umt5_key_map(2)
    wan_state = {
        wan_key: hf_state[hf_keys[0]].to(torch.bfloat16) for wan_key, hf_keys in key_map.items()
    }
    torch.save(wan_state, wan / "models_t5_umt5-xxl-enc-bf16.pth")
    tokenizer = wan / "google" / "umt5-xxl"
    tokenizer.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer / name).write_bytes((encoder_dir / name).read_bytes())
    checkpoints = root / "checkpoints"
    (checkpoints / "causvid").mkdir(parents=True)
    state = lambda seed: {f"model.{k}": v for k, v in _model(seed).state_dict().items()}  # noqa: E731
    torch.save(
        {"generator_ema": state(1), "generator": state(2)}, checkpoints / "self_forcing_dmd.pt"
    )
    torch.save({"generator": state(4)}, checkpoints / "causvid" / "model.pt")
    # Rolling Forcing's EMA weights carry FSDP's infix, as its released file does.
    fsdp = {
        f"_fsdp_wrapped_module.model._fsdp_wrapped_module.{k}": v
        for k, v in _model(5).state_dict().items()
    }
    torch.save(
        {"generator_ema": fsdp, "generator": state(6)}, checkpoints / "rolling_forcing_dmd.pt"
    )
    # Causal Forcing's releases, each with the entry its inference command reads.
    for seed, (path, entry) in enumerate(CAUSAL_FORCING.items(), start=7):
        (checkpoints / path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({entry: state(seed)}, checkpoints / path)
    # LongLive's base and its LoRA (PEFT keys under generator_lora), Infinite-Forcing's EMA.
    longlive = root / "longlive_models" / "models"
    longlive.mkdir(parents=True)
    torch.save({"generator": state(13)}, longlive / "longlive_base.pt")
    torch.save({"generator_lora": random_lora(EXAMPLE_MODEL, rank=2)}, longlive / "lora.pt")
    torch.save({"generator_ema": state(14)}, checkpoints / "ema_model.pt")


@pytest.fixture(scope="module")
def example_root(tmp_path_factory):
    root = copy_workflow(tmp_path_factory.mktemp("examples"))
    (root / "examples").mkdir()
    for example in (REPO / "examples").glob("*.yaml"):
        (root / "examples" / example.name).write_text(example.read_text())
    _write_self_forcing_layout(root)
    return root


@pytest.mark.parametrize(
    ("example", "checkpoints", "prompts", "layers"),
    [
        ("self_forcing_dmd", {"self_forcing_dmd"}, {"eagle"}, (0, 4)),
        ("causvid", {"causvid"}, {"eagle"}, (0, 4)),
        ("base_wan", {"base_wan", "self_forcing_dmd"}, {"eagle", "harbor"}, (0, 4)),
        ("rolling_forcing", {"rolling_forcing_dmd"}, {"eagle"}, ()),
        ("causal_forcing", {"causal_forcing"}, {"eagle"}, (0, 4)),
        ("causal_forcing_framewise", {"causal_forcing_framewise"}, {"eagle"}, (0, 4)),
        ("causal_forcing_1step", {"causal_forcing_1step"}, {"eagle"}, (0, 4)),
        ("causal_forcing_2step", {"causal_forcing_2step"}, {"eagle"}, (0, 4)),
        ("causal_forcing_long", {"causal_forcing_long"}, {"eagle"}, ()),
        ("longlive", {"longlive"}, {"boy"}, ()),
        ("infinity_rope", {"infinite_forcing"}, {"barbie"}, ()),
    ],
)
def test_examples_plan_their_jobs(example_root, example, checkpoints, prompts, layers):
    args = ("--configfile", f"examples/{example}.yaml", "--replace-workflow-config")
    jobs = planned_jobs(example_root, *args)
    extracts = {w for rule, w in jobs if rule == "extract"}
    assert extracts == {
        f"checkpoint={c}, prompt={p}, layer={layer}"
        for c in checkpoints
        for p in prompts
        for layer in layers
    }
    assert {w for rule, w in jobs if rule == "survey"} == {
        f"checkpoint={c}, prompt={p}" for c in checkpoints for p in prompts
    }
    assert not any(rule.startswith("make_demo") for rule, _ in jobs)  # the demo does not leak in


def test_deep_forcing_example_plans_its_closed_loop(example_root):
    """The release's policies at its settings: one closed-loop job (the full cache and every
    policy, 126 frames), the survey for the offline recall, no token store."""
    args = ("--configfile", "examples/deep_forcing.yaml", "--replace-workflow-config")
    jobs = planned_jobs(example_root, *args)
    rules = {rule for rule, _ in jobs}
    assert "extract" not in rules and "survey" in rules
    assert [w for rule, w in jobs if rule == "closed_loop"] == [
        "checkpoint=self_forcing_dmd, prompt=eagle"
    ]
    result = snakemake(example_root, "-n", *args)
    for policy in ("full", "window", "deep_sink", "participative", "deep_forcing"):
        assert f"results/closed_loop/self_forcing_dmd/eagle/{policy}.safetensors" in result.stdout
        # decoded with the VAE beside the base model (`vae`'s default)
        assert f"results/videos/self_forcing_dmd/eagle/{policy}.mp4" in result.stdout
    assert "wan_models/Wan2.1-T2V-1.3B/Wan2.1_VAE.pth" in result.stdout


def test_long_video_example_plans_a_closed_loop_past_the_rope_table(example_root):
    """1,002 frames under five window policies without a full-cache reference: one closed-loop
    job, its stores over cache slots, no full-cache rollout; a full reference at that length is
    refused before any job runs, naming the key and the GPU memory it would need."""
    args = ("--configfile", "examples/long_video.yaml", "--replace-workflow-config")
    jobs = planned_jobs(example_root, *args)
    assert [w for rule, w in jobs if rule == "closed_loop"] == [
        "checkpoint=self_forcing_dmd, prompt=eagle"
    ]
    result = snakemake(example_root, "-n", *args)
    folder = "results/closed_loop/self_forcing_dmd/eagle"
    for policy in ("window", "sink_window", "deep_sink", "relative", "head_jitter"):
        assert f"{folder}/{policy}.blocks.csv" in result.stdout
        assert f"{folder}/{policy}/layer4.zarr" in result.stdout
    assert f"{folder}/full.safetensors" not in result.stdout
    # The example's tiny stand-in model is small: its GPU is made smaller still.
    (example_root / "full.yaml").write_text("closed_loop: {reference: full, gpu_memory_gb: 0.01}\n")
    result = snakemake(example_root, "-n", *args[:2], "full.yaml", args[2], check=False)
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert "closed_loop.reference: full at closed_loop.num_frames=1002" in said
    assert "closed_loop.gpu_memory_gb=0.01: set closed_loop.reference: none" in said


def test_the_switching_examples_plan_their_closed_loops(example_root):
    """LongLive's interactive prompt (base + LoRA, window 12 with 3 sinks, recache) and
    Infinity-RoPE's scenes (relative, window 6, one sink, cuts): one closed-loop job each at its
    length, without a full-cache reference, its switch table planned; the LoRA's bytes and alpha
    in the jobs' params. Moving a cut onto the full-cache reference is refused before any job."""
    for example, checkpoint, prompt, policies in (
        ("longlive", "longlive", "boy", ("sink_window", "window")),
        ("infinity_rope", "infinite_forcing", "barbie", ("relative",)),
    ):
        args = ("--configfile", f"examples/{example}.yaml", "--replace-workflow-config")
        jobs = planned_jobs(example_root, *args)
        assert [w for rule, w in jobs if rule == "closed_loop"] == [
            f"checkpoint={checkpoint}, prompt={prompt}"
        ]
        result = snakemake(example_root, "-n", *args)
        folder = f"results/closed_loop/{checkpoint}/{prompt}"
        for policy in policies:
            assert f"{folder}/{policy}/layer4.zarr" in result.stdout
        assert f"{folder}/full.safetensors" not in result.stdout
        assert "results/closed_loop/switches.csv" in result.stdout
    (example_root / "full.yaml").write_text("closed_loop: {reference: full}\n")
    args = ("--configfile", "examples/infinity_rope.yaml", "full.yaml", "--replace-workflow-config")
    result = snakemake(example_root, "-n", *args, check=False)
    assert result.returncode != 0
    assert "prompts.barbie.segments[0].cut: Infinity-RoPE's cut needs relative" in (
        result.stdout + result.stderr
    )


def test_self_forcing_example_runs_end_to_end(example_root):
    (example_root / "small.yaml").write_text(SMALL_VIDEO)
    snakemake(
        example_root,
        "--configfile",
        "examples/self_forcing_dmd.yaml",
        "small.yaml",
        "--replace-workflow-config",
    )
    results = example_root / "results"
    store = xr.open_zarr(results / "logits/self_forcing_dmd/eagle/layer4.zarr")
    assert store.attrs["checkpoint"] == "self_forcing_dmd" and store.attrs["num_heads"] == 10
    config = decoded_attrs(store)["config"]
    assert config["checkpoint"]["generator"] == "checkpoints/self_forcing_dmd.pt"
    # capture.token_passes: 0 -- the token store holds pass 0 (t=1000) alone, while the frame
    # dataset of the surveyed layer 4 (from its attention store) has every pass.
    assert store.sizes["step"] == 1 and store["timestep"].values.tolist() == [1000.0]
    frames = xr.open_zarr(results / "frames/self_forcing_dmd/eagle/layer4.zarr")
    assert frames.sizes == {"step": 5, "head": 10, "query_frame": 6, "key_frame": 6}
    svg = (results / "figures/self_forcing_dmd/eagle/figure4.svg").read_text()
    assert "L0H0" in svg and "L4H9" in svg
    prompt_log = (results / "logs/encode_prompt/eagle.log").read_text()
    assert "Traceback" not in prompt_log


@pytest.mark.parametrize("example", NEW_SAMPLERS)
def test_examples_of_the_other_samplers_run_their_survey(example_root, example):
    """Rolling Forcing and the Causal Forcing family on their release files' stand-ins (Rolling
    Forcing's with FSDP's key infix), each to its survey: one rollout under the example's
    sampler, blocks and steps; the rolling ones' queries see block 0 as the anchor."""
    checkpoint, kind, frames_per_block, surveyed = NEW_SAMPLERS[example]
    (example_root / "small_frames.yaml").write_text(SMALL_FRAMES)
    snakemake(
        example_root,
        "--configfile",
        f"examples/{example}.yaml",
        "small_frames.yaml",
        "--replace-workflow-config",
        "--until",
        "survey",
    )
    folder = example_root / "results" / "attention" / checkpoint / "eagle"
    assert sorted(folder.iterdir()) == [folder / f"layer{layer}.zarr" for layer in surveyed]
    store = xr.open_zarr(folder / "layer0.zarr")
    attrs = decoded_attrs(store)
    assert attrs["sampler_kind"] == attrs["config"]["sampler"]["kind"] == kind
    assert attrs["block_sizes"] == [frames_per_block] * (21 // frames_per_block)
    assert [round(t, 2) for t in attrs["timesteps"]] == PASSES.get(example, SELF_FORCING_PASSES)
    if example in LATER_BLOCKS:
        assert [round(t, 2) for t in attrs["later_block_timesteps"]] == LATER_BLOCKS[example]
    versions = set(np.unique(store["key_version"].values).tolist())
    assert (KEY_VERSION["anchor"] in versions) == (kind == "rolling")
    assert not (example_root / "results" / "logits" / checkpoint).exists()


def test_the_demo_rolling_example_plans_on_the_embedded_default(tmp_path):
    """examples/demo/rolling_forcing.yaml (docs/GUIDE.md, "The model"): the demo DAG under the
    rolling sampler, its closed loop the policies that run there, against Rolling Forcing's own
    cache."""
    root = copy_workflow(tmp_path / "w")
    (root / "examples" / "demo").mkdir(parents=True)
    name = "examples/demo/rolling_forcing.yaml"
    (root / name).write_text((REPO / name).read_text())
    jobs = planned_jobs(root, "--configfile", name)
    assert {w for rule, w in jobs if rule == "survey"} == {
        f"checkpoint={c}, prompt={p}" for c in ("demo_a", "demo_b") for p in ("eagle", "harbor")
    }
    assert ("closed_loop", "checkpoint=demo_a, prompt=eagle") in jobs


def test_the_demo_longlive_example_plans_on_the_embedded_default(tmp_path):
    """examples/demo/longlive.yaml (docs/GUIDE.md, "Prompts that change mid-video"): the demo DAG
    with a two-segment prompt under LongLive's recache; its closed loop the caches the recache
    runs on, against the full cache, and the switch table."""
    root = copy_workflow(tmp_path / "w")
    (root / "examples" / "demo").mkdir(parents=True)
    name = "examples/demo/longlive.yaml"
    (root / name).write_text((REPO / name).read_text())
    jobs = planned_jobs(root, "--configfile", name)
    assert ("encode_prompt", "prompt=story") in jobs
    assert [w for rule, w in jobs if rule == "closed_loop"] == ["checkpoint=demo_a, prompt=story"]
    result = snakemake(root, "-n", "--configfile", name)
    for policy in ("full", "window", "sink_window"):
        assert f"results/closed_loop/demo_a/story/{policy}/layer0.zarr" in result.stdout
    assert "results/closed_loop/switches.csv" in result.stdout
