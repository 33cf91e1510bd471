"""Plan before writing: what a run writes, per store family and job, printed before any job runs;
the writing jobs declare it as `disk_mb`."""

from __future__ import annotations

import re

import pytest

from sinkscope.frames import attention_store_disk_bytes, token_store_disk_bytes
from sinkscope.workflow import plan

from .test_config import checked
from .workflowtools import copy_workflow, snakemake


def test_plan_counts_every_writing_job_with_its_bound():
    config = checked()
    families = {f.name: f for f in plan.storage_plan(config)}
    tokens = families["token stores"]
    # 2 checkpoints x 2 prompts x token layer 0; the demo geometry: 21 frames of 24 tokens.
    assert len(tokens.jobs) == 4
    bound = token_store_disk_bytes(
        num_passes=5,
        num_heads=4,
        frame_seq_length=24,
        sizes=[3] * 7,
        local_attn_size=-1,
        sink_size=0,
    )
    assert set(tokens.jobs.values()) == {bound}
    attention = families["attention stores"]
    one = attention_store_disk_bytes(
        num_passes=5, num_heads=4, num_frames=21, frame_seq_length=24, frames_per_block=3
    )
    assert len(attention.jobs) == 4 and set(attention.jobs.values()) == {4 * one}
    loop = families["closed loop"]
    assert sorted(loop.jobs) == sorted(
        f"closed_loop demo_a/eagle/{p}"
        for p in ("full", "window", "sink_window", "deep_sink", "top_c")
    )
    latents = 16 * 42 * 8 * 12 * 4
    at_42 = attention_store_disk_bytes(
        num_passes=5, num_heads=4, num_frames=42, frame_seq_length=24, frames_per_block=3
    )
    assert loop.jobs["closed_loop demo_a/eagle/top_c"] == latents  # nothing captured
    assert loop.jobs["closed_loop demo_a/eagle/window"] == latents + at_42  # layer 0 captured
    text = plan.format_plan(config)
    assert f"largest job: extract demo_a/eagle/layer0, {bound / 1e6:.1f} MB" in text
    assert re.search(r"free on .* \(fits\)", text)
    assert plan.job_disk_mb(config, "demo_a", "extract") == -(-bound // 1_000_000)


@pytest.mark.workflow
def test_a_dry_run_prints_the_plan_and_jobs_declare_their_disk(tmp_path):
    workdir = copy_workflow(tmp_path / "w")
    result = snakemake(workdir, "-n")
    assert "sinkscope plan" in result.stderr and "largest job: extract" in result.stderr
    config = checked()
    disk = {
        rule: plan.job_disk_mb(config, "demo_a", job, **kwargs)
        for rule, job, kwargs in (
            ("extract", "extract", {}),
            ("survey", "survey", {"layers": 4}),
            ("closed_loop_top_c", "closed_loop", {"layers": 1, "frames": 42}),
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
        num_passes=5, num_heads=4, num_frames=19, frame_seq_length=24, frames_per_block=1
    )
    assert plan.job_disk_bytes(config, "demo_a", "survey", layers=2) == 2 * claimed
