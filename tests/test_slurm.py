"""The demo workflow through a real SLURM (a private one-node cluster with two fake GPUs) with
`--workflow-profile profiles/slurm`: GPU jobs go through sbatch asking for a GPU, small rules run
locally, and the results equal those of a local run (every sbatch job of the demo and the local
jobs the comparison reads: not the figures of each run)."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import yaml
from snakemake.utils import validate

from sinkscope.extraction.closed_loop import load_latents
from sinkscope.storage import decoded_attrs
from sinkscope.workflow.entries import checkpoint_inputs
from sinkscope.workflow.params import GPU_JOB_THREADS
from sinkscope.workflow.resources import (
    closed_loop_runtime,
    extract_mem_mb,
    extract_runtime,
    survey_runtime,
)

from .slurmcluster import one_node_cluster, skip_unless_slurm
from .workflowtools import copy_workflow, edit_config, snakemake

# Runs Snakemake in a subprocess: `pytest -m "not workflow"` leaves it out.
pytestmark = pytest.mark.workflow

# The demo surveys every layer, so its frame datasets come from the survey (reduced by rule
# policies, a cluster job) and rule reduce has nothing to do.
SBATCH_RULES = {"encode_prompt", "extract", "survey", "policies", "closed_loop"}
RUNS = [(c, p, layer) for c in ("demo_a", "demo_b") for p in ("eagle", "harbor") for layer in (0,)]
# The closed loop goes through sbatch as one job; one policy is enough to show it (the demo's
# five make it the longest job, and the plugin's status checks back off while it runs).
CLOSED_LOOP_POLICIES = ("full", "window")
# What the tests read: every job that goes through sbatch and the local ones the comparison with
# a local run needs; the demo's figures of each run (local jobs, ~50 s of the 2-core test
# machine's time) are left out.
TARGETS = [
    *(
        f"results/logits/{checkpoint}/{prompt}/layer{layer}.zarr"
        for checkpoint, prompt, layer in RUNS
    ),
    "results/stats/summary.csv",
    "results/policies/summary.csv",
    "results/figures/compare/checkpoints.svg",
    *(f"results/closed_loop/demo_a/eagle/{policy}.safetensors" for policy in CLOSED_LOOP_POLICIES),
]


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory):
    skip_unless_slurm()
    root = tmp_path_factory.mktemp("slurm")
    workdir = copy_workflow(root / "w")
    edit_config(workdir, lambda c: c["closed_loop"].update(policies=list(CLOSED_LOOP_POLICIES[1:])))
    # Four CPUs advertised: two GPU jobs of GPU_JOB_THREADS CPUs each fit side by side.
    with one_node_cluster(root / "cluster", gpus=2, cpus=4) as cluster:
        env = cluster.command_env(
            {
                **os.environ,
                "SINKSCOPE_FAKE_GPUS": "1",
                "SINKSCOPE_GPU_LOCK_DIR": str(root / "locks"),
            }
        )
        # The test cluster has no accounting (slurmdbd), hence squeue, polled every second.
        result = snakemake(
            workdir,
            *TARGETS,
            "--workflow-profile",
            "profiles/slurm",
            "--slurm-status-command",
            "squeue",
            "--slurm-init-seconds-before-status-checks",
            "1",
            "--latency-wait",
            "5",
            env=env,
            check=False,
        )
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{cluster.diagnostics()}"
        records = cluster.job_records()
        for jobid, record in records.items():
            # The epilog's record is taken while the job is COMPLETING; jobcomp has the end state.
            record["JobState"] = cluster.jobcomp_record(jobid)["JobState"]
    assert cluster.leftover_processes() == []
    return workdir, records


def by_rule(records: dict) -> dict[str, list[dict]]:
    rules: dict[str, list[dict]] = {}
    for record in records.values():
        rule = record.get("Comment", "").removeprefix("rule_").split("_wildcards", 1)[0]
        rules.setdefault(rule, []).append(record)
    return rules


def test_gpu_jobs_went_through_sbatch_asking_for_a_gpu(slurm_run):
    workdir, records = slurm_run
    rules = by_rule(records)
    assert set(rules) == SBATCH_RULES  # stats, figures, summary... ran locally
    assert len(rules["extract"]) == len(RUNS) and len(rules["encode_prompt"]) == 2
    assert len(rules["survey"]) == 4  # one per checkpoint and prompt, every layer at once
    loop = rules["closed_loop"]
    assert len(loop) == 1  # demo_a / eagle: one job, the full cache and every policy
    for record in rules["extract"] + rules["encode_prompt"] + rules["survey"] + loop:
        assert record["JobState"] == "COMPLETED"
        assert record["TresPerJob"] == "gres:gpu:1", record
    for record in rules["extract"] + rules["survey"] + loop:
        # A CPU for the store writer beside the one feeding the GPU (params.extraction_threads).
        assert record["CPUs/Task"] == str(GPU_JOB_THREADS), record
    # Memory and time as the rule computed them from the sizes (sinkscope.workflow.resources),
    # once the demo checkpoint they load existed.
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    validate(config, str(workdir / "schemas/config.schema.yaml"))  # fills in the defaults
    for record in rules["extract"]:
        checkpoint, prompt, _ = record["Comment"].split("_wildcards_")[1].rsplit("_", 2)
        inputs = [*checkpoint_inputs(config, checkpoint), f"results/prompts/{prompt}.safetensors"]
        input_mb = sum((workdir / path).stat().st_size for path in inputs) / 1e6
        assert record["MinMemoryNode"] == f"{extract_mem_mb(input_mb)}M"
        assert record["TimeLimit"] == f"00:{extract_runtime(config, checkpoint):02d}:00"
    for record in rules["survey"]:
        checkpoint, prompt = record["Comment"].split("_wildcards_")[1].rsplit("_", 1)
        inputs = [*checkpoint_inputs(config, checkpoint), f"results/prompts/{prompt}.safetensors"]
        input_mb = sum((workdir / path).stat().st_size for path in inputs) / 1e6
        assert record["MinMemoryNode"] == f"{extract_mem_mb(input_mb)}M"
        assert record["TimeLimit"] == f"00:{survey_runtime(config, checkpoint):02d}:00"
    minutes = closed_loop_runtime(config, "demo_a")
    for record in loop:
        assert record["TimeLimit"] == f"{minutes // 60:02d}:{minutes % 60:02d}:00", record
    # Each store was written by a SLURM job, on the GPU its allocation made visible.
    extract_jobs = {record["JobId"] for record in rules["extract"]}
    survey_jobs = {record["JobId"] for record in rules["survey"]}
    for checkpoint, prompt, layer in RUNS:
        tokens = xr.open_zarr(workdir / f"results/logits/{checkpoint}/{prompt}/layer{layer}.zarr")
        gpu = decoded_attrs(tokens)["gpu"]
        assert gpu["claimed_by"] == "slurm" and gpu["slurm_job_id"] in extract_jobs
        # The one GPU SLURM made visible to the job, as the job's environment named it.
        assert gpu["visible_id"] == gpu["cuda_visible_devices"] and gpu["visible_id"] in {"0", "1"}
        survey = xr.open_zarr(
            workdir / f"results/attention/{checkpoint}/{prompt}/layer{layer}.zarr"
        )
        assert decoded_attrs(survey)["gpu"]["slurm_job_id"] in survey_jobs
    loop_jobs = {record["JobId"] for record in loop}
    for policy in CLOSED_LOOP_POLICIES:
        _, meta = load_latents(workdir / f"results/closed_loop/demo_a/eagle/{policy}.safetensors")
        assert meta["gpu"]["claimed_by"] == "slurm" and meta["gpu"]["slurm_job_id"] in loop_jobs


def test_slurm_results_equal_a_local_run(slurm_run, demo_run):
    workdir, _ = slurm_run
    for checkpoint, prompt, layer in RUNS:
        name = f"{checkpoint}/{prompt}/layer{layer}"
        here = xr.open_zarr(workdir / f"results/frames/{name}.zarr")
        local = xr.open_zarr(demo_run / f"results/frames/{name}.zarr")
        for var in ("logit_mean", "prob_mass", "entropy"):
            np.testing.assert_array_equal(here[var].values, local[var].values, err_msg=name)
        pd.testing.assert_frame_equal(
            pd.read_csv(workdir / f"results/stats/{name}.csv"),
            pd.read_csv(demo_run / f"results/stats/{name}.csv"),
        )
    pd.testing.assert_frame_equal(
        pd.read_csv(workdir / "results/stats/summary.csv"),
        pd.read_csv(demo_run / "results/stats/summary.csv"),
    )
    assert (workdir / "results/figures/compare/checkpoints.svg").exists()
    for policy in CLOSED_LOOP_POLICIES:
        name = f"results/closed_loop/demo_a/eagle/{policy}.safetensors"
        assert load_latents(workdir / name)[0].equal(load_latents(demo_run / name)[0]), policy
