"""Plan before writing: what a run writes, per store family and job, printed before any job runs;
the writing jobs declare it as `disk_mb`."""

from __future__ import annotations

import re

import pytest

from sinkscope.frames import attention_store_disk_bytes, token_store_disk_bytes, visible_frames
from sinkscope.workflow import plan

from .test_config import checked
from .workflowtools import copy_workflow, snakemake


def demo_token_bound(num_passes: int) -> int:
    """The disk bound of a demo token store: 4 heads, 21 frames of 24 tokens, no window."""
    return token_store_disk_bytes(
        num_passes=num_passes,
        num_heads=4,
        frame_seq_length=24,
        sizes=[3] * 7,
        local_attn_size=-1,
        sink_size=0,
    )


def test_plan_counts_every_writing_job_with_its_bound():
    config = checked()
    families = {f.name: f for f in plan.storage_plan(config)}
    tokens = families["token stores"]
    # capture.token_runs: demo_a/eagle's token layer 0 at pass 0 (capture.token_passes); the
    # demo geometry: 21 frames of 24 tokens.
    assert list(tokens.jobs) == ["extract demo_a/eagle/layer0"]
    bound = demo_token_bound(num_passes=1)
    assert set(tokens.jobs.values()) == {bound}
    every_run = checked(lambda c: c["capture"].pop("token_runs"))
    every = {f.name: f for f in plan.storage_plan(every_run)}
    assert len(every["token stores"].jobs) == 4  # 2 checkpoints x 2 prompts
    attention = families["attention stores"]
    # float16 key mass of the 252 frame pairs that 7 blocks of 3 see
    one = attention_store_disk_bytes(
        num_passes=5,
        num_heads=4,
        num_frames=21,
        frame_seq_length=24,
        frames_per_block=3,
        visible_tiles=252,
        precision="float16",
    )
    assert len(attention.jobs) == 4 and set(attention.jobs.values()) == {4 * one}
    loop = families["closed loop"]
    # One job per run: the latents of the full cache and of the 4 policies, and layer 0 captured
    # over the cache's slots in each: 42 frames of keys for the full cache, the 21 + 3 frames
    # Deep Forcing's Participative Compression holds before a prune, the budget of 9 for the others.
    assert list(loop.jobs) == ["closed_loop demo_a/eagle"]
    latents = 16 * 42 * 8 * 12 * 4

    def over_slots(frames: int) -> int:
        return attention_store_disk_bytes(
            num_passes=5,
            num_heads=4,
            num_frames=42,
            frame_seq_length=24,
            frames_per_block=3,
            key_slots=frames * 24,
        )

    stores = over_slots(42) + over_slots(24) + 3 * over_slots(9)
    assert loop.jobs["closed_loop demo_a/eagle"] == 5 * latents + stores
    # Linear in the frames: twice the frames, twice a window's store (to its fixed overheads).
    twice = attention_store_disk_bytes(
        num_passes=5,
        num_heads=4,
        num_frames=84,
        frame_seq_length=24,
        frames_per_block=3,
        key_slots=9 * 24,
    )
    assert 1.9 < twice / over_slots(9) <= 2.0
    text = plan.format_plan(config)
    largest = (5 * latents + stores) / 1e6
    assert f"largest job: closed_loop demo_a/eagle, {largest:.1f} MB" in text
    assert re.search(r"free on .* \(fits\)", text)
    assert plan.job_disk_mb(config, "demo_a", "extract") == -(-bound // 1_000_000)


@pytest.mark.workflow
def test_a_dry_run_prints_the_plan_and_jobs_declare_their_disk(tmp_path):
    workdir = copy_workflow(tmp_path / "w")
    result = snakemake(workdir, "-n")
    assert "sinkscope plan" in result.stderr and "largest job: closed_loop" in result.stderr
    assert "GPU memory (estimate, bf16)" in result.stderr
    config = checked()
    disk = {
        rule: plan.job_disk_mb(config, "demo_a", job, **kwargs)
        for rule, job, kwargs in (
            ("extract", "extract", {}),
            ("survey", "survey", {"layers": 4}),
            ("closed_loop", "closed_loop", {}),
        )
    }
    for rule, megabytes in disk.items():
        block = re.search(rf"rule {rule}:\n(?:    .*\n)*", result.stdout).group(0)
        assert f"disk_mb={megabytes}" in block, block


def test_the_plan_bounds_what_the_job_claims_with_a_lone_first_frame():
    """[1, 3, 3, ...] stores chunk one query frame at a time (frames.attention_chunk_frames):
    the plan's bound is the one the survey job claims, not the smaller one of 3-frame chunks."""

    def lone(config):
        config["video"].update(independent_first_frame=True, num_frames=19)
        config["closed_loop"].update(num_frames=43)

    config = checked(lone)
    claimed = attention_store_disk_bytes(
        num_passes=5,
        num_heads=4,
        num_frames=19,
        frame_seq_length=24,
        frames_per_block=1,
        visible_tiles=int(visible_frames([1] + [3] * 6).sum()),
        precision="float16",
    )
    assert plan.job_disk_bytes(config, "demo_a", "survey", layers=2) == 2 * claimed


def test_token_passes_write_the_token_stores_of_fewer_passes():
    """`capture.token_passes: 0`: the token stores (their job's params, the plan, the runtime)
    hold pass 0 alone while the survey keeps every pass; unset, nothing changes (no rerun)."""
    from sinkscope.workflow import params, resources

    default = checked(lambda config: config["capture"].pop("token_passes"))
    settings = params.extraction_settings(default, "demo_a")
    assert settings["capture"] == {"passes": "all", "tokens": True}
    config = checked()
    assert config["capture"]["token_passes"] == 0  # the demo's
    tokens = params.extraction_settings(config, "demo_a")
    survey = params.extraction_settings(config, "demo_a", store="attention")
    assert tokens["capture"] == {"passes": 0, "tokens": True}
    assert survey["capture"] == default_survey_capture(default) == {"passes": "all"}
    one_pass = demo_token_bound(num_passes=1)
    families = {f.name: f for f in plan.storage_plan(config)}
    assert set(families["token stores"].jobs.values()) == {one_pass}
    assert (
        families["attention stores"].jobs
        == {f.name: f for f in plan.storage_plan(default)}["attention stores"].jobs
    )
    assert resources.layer_store_bytes(config, "demo_a") * 5 == resources.layer_store_bytes(
        default, "demo_a"
    )


def overridden(overrides: dict):
    """A `checked` change that sets the keys of `overrides` (one level of nesting)."""

    def change(config: dict) -> None:
        for key, value in overrides.items():
            config.setdefault(key, {}).update(value)

    return change


def default_survey_capture(config: dict) -> dict:
    from sinkscope.workflow import params

    return params.extraction_settings(config, "demo_a", store="attention")["capture"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"capture": {"token_passes": "cache"}}, r"token_passes: passes \[4\] must be the first"),
        ({"capture": {"token_passes": 9}}, r"capture.token_passes: 9 is not 'all'"),
        (
            {"capture": {"token_passes": 0, "survey": [2]}, "figures": {"step": 2}},
            r"figures.step=2 but the token stores of layers \[0\] \(not surveyed\) capture only 1",
        ),
        (
            {"capture": {"token_passes": [0, 1]}, "export": {"step": 3}},
            r"export.step=3 but the token stores capture only 2 passes",
        ),
    ],
)
def test_token_passes_refusals(overrides, message):
    from sinkscope.workflow.entries import ConfigError

    with pytest.raises(ConfigError, match=message):
        checked(overridden(overrides))


def test_token_passes_are_a_prefix_for_every_schedule():
    """Checkpoints with schedules of other lengths: [0, 'cache'] is [0, 3] for a 3-step one and
    [0, 4] for the 4-step one, whose capture.passes [0, 3] it then contradicts."""
    from sinkscope.workflow.entries import ConfigError

    def mixed(token_passes):
        def change(config):
            config["checkpoints"]["demo_b"]["sampler"] = {"steps": [1000, 750, 500]}
            config["capture"].update(passes=[0, 3], token_passes=token_passes)

        return change

    checked(mixed(0))
    with pytest.raises(ConfigError, match=r"\[0, 4\] must be the first .* 'demo_a' \(4 steps"):
        checked(mixed([0, "cache"]))


def test_parameter_count_is_the_models():
    """`WanConfig.num_parameters` (no torch, for the plan) against the published 1.3B count and
    torch's count of the built model, real width on the meta device and a tiny one for real."""
    import torch

    from sinkscope.wan.config import WanConfig
    from sinkscope.wan.model import WanModel

    assert WanConfig().num_parameters == 1_418_996_800
    with torch.device("meta"):
        real = WanModel(WanConfig())
    assert sum(p.numel() for p in real.parameters()) == WanConfig().num_parameters
    tiny = WanConfig(dim=60, ffn_dim=64, num_heads=10, num_layers=5, freq_dim=16, text_dim=32)
    assert sum(p.numel() for p in WanModel(tiny).parameters()) == tiny.num_parameters


def test_gpu_estimate_of_the_1_3b_example(tmp_path, monkeypatch):
    """The plan's GPU memory estimate of examples/self_forcing_dmd.yaml: 1.3B weights in bf16 and
    Self-Forcing's 6.04 GB KV cache (30 layers x k, v x 32760 tokens x 1536 x 2 bytes), which a
    local window shrinks to its frames."""
    import json

    import yaml
    from snakemake.utils import validate

    from sinkscope.workflow import resources

    from .test_onboarding import WAN_13B_CONFIG
    from .workflowtools import REPO

    base = tmp_path / "wan_models" / "Wan2.1-T2V-1.3B"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps(WAN_13B_CONFIG))
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((REPO / "examples" / "self_forcing_dmd.yaml").read_text())
    validate(config, str(REPO / "schemas" / "config.schema.yaml"))
    extract = resources.gpu_memory_bytes(config, "self_forcing_dmd", "extract")
    assert extract["weights"] == 2 * 1_418_996_800
    assert extract["kv_cache"] == 30 * 2 * 32760 * 1536 * 2 == 6_038_323_200
    assert extract["capture"] == 1560 * 32760 * (4 + 2)
    survey = resources.gpu_memory_bytes(config, "self_forcing_dmd", "survey")
    assert survey["capture"] == 1560 * 32760 * 8
    assert survey["total"] == sum(v for k, v in survey.items() if k != "total")
    assert 10e9 < survey["total"] < 12e9
    config["sampler"]["local_attn_size"] = 6
    windowed = resources.gpu_memory_bytes(config, "self_forcing_dmd", "survey")
    assert windowed["kv_cache"] == 30 * 2 * 6 * 1560 * 1536 * 2
    expected = f"about {windowed['total'] / 1e9:.1f} GB for survey self_forcing_dmd"
    assert f"GPU memory (estimate, bf16): {expected}" in plan.format_plan(config)
    # The closed loop's full-cache reference keeps all its 42 frames whatever the window, and is
    # then the plan's largest GPU job.
    config["closed_loop"].update(policies=["window"])
    loop = resources.gpu_memory_bytes(config, "self_forcing_dmd", "closed_loop", 42)
    assert loop["kv_cache"] == 30 * 2 * 42 * 1560 * 1536 * 2
    expected = f"about {loop['total'] / 1e9:.1f} GB for closed_loop self_forcing_dmd (42 frames)"
    assert expected in plan.format_plan(config)


def vae_line(job: str, latent: tuple[int, int], rollouts: int, frames: int, parts: dict) -> str:
    """The plan's line of the largest decode job, from `resources.vae_decode_bytes`'s parts."""
    height, width = latent
    side = "side by side" if rollouts > 1 else "alone"
    size = plan._size
    return (
        f"about {size(parts['total'])} for {job} at {8 * height} x {8 * width} ({height} x "
        f"{width} latent), {rollouts} rollout{'s' if rollouts > 1 else ''} of {frames} frames "
        f"{side} (weights {size(parts['weights'])}, feature cache "
        f"{size(parts['feature_cache'])}, activations {size(parts['activations'])}, latents "
        f"{size(parts['latents'])}; all but the latents the same at any length)"
    )


def test_the_plan_estimates_the_largest_decode_job():
    """One line for the video job of the largest VAE decode: the closed loop's 5 rollouts of 42
    frames as one batch (the demo VAE's base_dim 1, bf16 as on a GPU); with `videos: all` and no
    closed loop, a survey's lone rollout of 21 frames; none with `videos: none`."""
    from sinkscope.workflow.resources import vae_decode_bytes

    config = checked()
    parts = vae_decode_bytes(8, 12, base_dim=1, value_bytes=2, batch=5, num_frames=42)
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    expected = vae_line("videos demo_a", (8, 12), 5, 42, parts)
    assert f"  VAE decode (estimate, bf16): {expected}" in plan.format_plan(config).splitlines()

    def survey_only(c: dict) -> None:
        c.update(videos="all", dtype="float32")
        c["closed_loop"]["policies"] = []
        c["demo"]["vae"]["base_dim"] = 96
        c["video"].update(latent_height=60, latent_width=104)

    parts = vae_decode_bytes(60, 104, value_bytes=4, num_frames=21)
    expected = vae_line("survey_video demo_a", (60, 104), 1, 21, parts)
    assert f"VAE decode (estimate, fp32): {expected}" in plan.format_plan(checked(survey_only))
    assert 8.5e9 < parts["total"] - parts["latents"] < 9.5e9  # Wan's VAE at 480 x 832, fp32
    assert "VAE decode" not in plan.format_plan(checked(lambda c: c.update(videos="none")))


def test_vae_estimate_counts_the_decoders_parts(tmp_path):
    """`vae_parameters` and the feature cache of `vae_decode_bytes` (no torch, for the plan)
    against the built VAE: its parameters at Wan's width (meta device) and tiny ones, and the
    cache a streaming decode holds after a few latent frames; the base_dim of a diffusers
    folder's VAE from its config.json."""
    import json

    import torch

    from sinkscope.wan import vae as wan_vae
    from sinkscope.workflow import resources

    with torch.device("meta"):
        real = wan_vae.WanVAE(wan_vae.WAN21_VAE_CONFIG)
    assert sum(p.numel() for p in real.parameters()) == resources.vae_parameters() == 126_892_531
    vae = wan_vae.random_vae(wan_vae.tiny_vae_config(4))
    assert sum(p.numel() for p in vae.parameters()) == resources.vae_parameters(4)
    latents = torch.randn(16, 4, 3, 5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = vae.conv2(latents.unsqueeze(0))  # the post-quant conv
        stream = vae.decode_stream()
        for i in range(x.shape[2]):  # as wan.vae.iter_decoded_pixels drives it
            stream(x[:, :, i : i + 1])
    cache = stream.cache.values()
    held = sum(c.numel() * c.element_size() for c in cache if isinstance(c, torch.Tensor))
    estimate = resources.vae_decode_bytes(3, 5, base_dim=4, value_bytes=4)
    assert held == estimate["feature_cache"]
    assert resources.vae_decode_bytes(3, 5, base_dim=4, batch=3)["feature_cache"] == 3 * (
        estimate["feature_cache"] // 2
    )
    config = checked()
    assert resources.vae_base_dim(config, "demo_a") == 1  # demo.vae.base_dim
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"base_dim": 8}))
    config["vae"] = str(tmp_path)  # a pipeline folder holding vae/
    assert resources.vae_base_dim(config, "demo_a") == 8
    config["vae"] = str(tmp_path / "Wan2.1_VAE.pth")
    assert resources.vae_base_dim(config, "demo_a") == 96
