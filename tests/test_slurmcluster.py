"""The private SLURM test cluster (tests/slurmcluster.py): a GPU job through sbatch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.slurmcluster import (
    REQUIRE_ENV,
    one_node_cluster,
    parse_record,
    skip_unless_slurm,
    slurm_required,
)

# Runs Snakemake in a subprocess: `pytest -m "not workflow"` leaves it out.
pytestmark = pytest.mark.workflow


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_sbatch_gpu_job(tmp_path):
    skip_unless_slurm()
    out = tmp_path / "job.out"
    with one_node_cluster(tmp_path / "slurm", gpus=2) as cluster:
        pids = cluster.pids
        assert set(pids) == {"munged", "slurmctld", "slurmd"}
        submitted = cluster.run(
            "sbatch",
            "--parsable",
            "--gpus=1",
            "--mem=100",
            f"--output={out}",
            "--wrap",
            "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES SLURM_JOB_GPUS=$SLURM_JOB_GPUS",
        )
        jobid = submitted.stdout.strip().split(";")[0]
        record = cluster.wait_for_job(jobid, timeout=60)
        assert record["JobState"] == "COMPLETED", cluster.diagnostics()
        assert record["NodeList"] == cluster.nodename
        # jobcomp has no gres/gpu TRES without slurmdbd; the epilog's scontrol record has it.
        detail = cluster.job_record(jobid)
        assert detail["TresPerJob"] == "gres:gpu:1"
        assert detail["JOB_GRES"] == "gpu:1"
        seen = dict(item.split("=", 1) for item in out.read_text().split())
        assert seen["CUDA_VISIBLE_DEVICES"] in {"0", "1"}
        assert seen["SLURM_JOB_GPUS"] == seen["CUDA_VISIBLE_DEVICES"]
    assert cluster.leftover_processes() == []
    assert not [name for name, pid in pids.items() if _alive(pid)]


def test_parse_record():
    line = (
        "JobId=7 JobName=wrap CPUs/Task=1 ReqB:S:C:T=0:0:*:* TresPerJob=gres:gpu:1 "
        "WorkDir=/a dir/with spaces Comment=rule_extract_wildcards_a_b_0"
    )
    record = parse_record(line)
    assert record["JobId"] == "7"
    assert record["CPUs/Task"] == "1"
    assert record["ReqB:S:C:T"] == "0:0:*:*"
    assert record["TresPerJob"] == "gres:gpu:1"
    assert record["WorkDir"] == "/a dir/with spaces"
    assert record["Comment"] == "rule_extract_wildcards_a_b_0"


@pytest.mark.parametrize(("value", "required"), [("1", True), ("0", False), ("", False)])
def test_slurm_required(monkeypatch, value, required):
    monkeypatch.setenv(REQUIRE_ENV, value)
    assert slurm_required() is required
    monkeypatch.delenv(REQUIRE_ENV)
    assert slurm_required() is False
    assert os.environ.get(REQUIRE_ENV) is None
