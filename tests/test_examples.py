"""examples/*.yaml on Self-Forcing's directory layout, with tiny models in the real formats."""

from __future__ import annotations

import pytest
import torch
import xarray as xr

from sinkscope.storage import decoded_attrs
from sinkscope.wan.checkpoint import save_wan_model
from sinkscope.wan.config import WanConfig
from sinkscope.wan.model import WanModel
from sinkscope.wan.text import make_demo_text_encoder, wan_umt5_key_map

from .workflowtools import REPO, copy_workflow, planned_jobs, snakemake

# Runs Snakemake in a subprocess: `pytest -m "not workflow"` leaves it out.
pytestmark = pytest.mark.workflow

# 5 layers and 10 heads, so the examples' layers [0, 4] and heads L0H0, L4H9 exist.
EXAMPLE_MODEL = WanConfig(
    dim=60, ffn_dim=64, num_heads=10, num_layers=5, freq_dim=16, text_dim=32, text_len=512
)
# The real 60 x 104 x 21-frame geometry is far too big for CI; a second config file shrinks it.
SMALL_VIDEO = "video: {num_frames: 6, frames_per_block: 3, latent_height: 4, latent_width: 6}\n"


def _model(seed: int) -> WanModel:
    model = WanModel(EXAMPLE_MODEL)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def _write_self_forcing_layout(root) -> None:
    wan = root / "wan_models" / "Wan2.1-T2V-1.3B"
    save_wan_model(_model(0), wan)
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


@pytest.fixture(scope="module")
def example_root(tmp_path_factory):
    root = copy_workflow(tmp_path_factory.mktemp("examples"))
    (root / "examples").mkdir()
    for example in (REPO / "examples").glob("*.yaml"):
        (root / "examples" / example.name).write_text(example.read_text())
    _write_self_forcing_layout(root)
    return root


@pytest.mark.parametrize(
    ("example", "checkpoints", "prompts"),
    [
        ("self_forcing_dmd", {"self_forcing_dmd"}, {"eagle"}),
        ("causvid", {"causvid"}, {"eagle"}),
        ("base_wan", {"base_wan", "self_forcing_dmd"}, {"eagle", "harbor"}),
    ],
)
def test_examples_plan_their_jobs(example_root, example, checkpoints, prompts):
    args = ("--configfile", f"examples/{example}.yaml", "--replace-workflow-config")
    jobs = planned_jobs(example_root, *args)
    extracts = {w for rule, w in jobs if rule == "extract"}
    assert extracts == {
        f"checkpoint={c}, prompt={p}, layer={layer}"
        for c in checkpoints
        for p in prompts
        for layer in (0, 4)
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
