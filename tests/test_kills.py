"""A job killed at any point of its write (with Snakemake, as `kill -9` or a power cut would)
leaves nothing that looks complete, and a plain rerun restores exactly what a clean run writes:
no stale temporary left, every file byte for byte. The faults: tests/faults/sitecustomize.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sinkscope.storage import decoded_attrs

from .workflowtools import demo_copy, snakemake

pytestmark = pytest.mark.workflow

FAULTS = Path(__file__).parent / "faults"


def result_files(workdir: Path) -> dict[str, bytes]:
    """Every file under results/ but the job logs, by path."""
    root = workdir / "results"
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.relative_to(root).parts[0] != "logs"
    }


def kill_while_making(workdir: Path, target: str, point: str) -> None:
    """Run the job that makes `target` (forced) until the fault at `point` kills the whole run."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
        "SINKSCOPE_KILL_AT": point,
    }
    killed = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", target, "--forcerun", target],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr


# Each fault point on a job of its own, killed one after the other in one copy of the demo, then
# one plain rerun for all (each rerun remakes half the DAG). The order keeps every killed job's
# inputs whole: the later jobs of the DAG are killed first.
JOB_FAULTS = [
    # rule summary, whose first write is the first run's statistics
    ("results/stats/demo_a/eagle/layer0.csv", "before-rename"),
    ("results/figures/demo_a/eagle/figure4.svg", "mid-write"),  # figures.runs: demo_a/eagle
    ("results/stats/demo_a/eagle/layer0.csv", "mid-write"),
    ("results/frames/demo_a/eagle/layer0.zarr", "mid-write"),  # rule policies
    ("results/frames/demo_a/harbor/layer0.zarr", "before-rename"),
    ("results/frames/demo_b/eagle/layer0.zarr", "after-rename"),
]


def test_killed_jobs_rerun_to_a_clean_run(demo_run, tmp_path):
    workdir = demo_copy(demo_run, tmp_path / "w")
    for target, point in JOB_FAULTS:
        kill_while_making(workdir, target, point)
        output = workdir / target
        if point != "after-rename":
            assert not output.exists(), f"a job killed {point} left {target}"
            assert list(output.parent.glob(f"{output.name}*.tmp")), f"{target}: killed too early"
        snakemake(workdir, "--unlock")
    snakemake(workdir)  # a plain rerun
    assert not [
        p for p in (workdir / "results").rglob("*") if p.name.endswith((".tmp", ".partial"))
    ]
    clean = result_files(demo_run)
    rerun = result_files(workdir)
    assert rerun.keys() == clean.keys()
    assert [name for name in clean if rerun[name] != clean[name]] == []


def test_killed_surveys_rerun_to_the_same_attention(demo_run, tmp_path):
    """The survey writes every layer's attention store in one job: killed mid-write or with all
    stores whole but the first not yet renamed, it leaves no store, and the rerun writes the same
    arrays (its attributes hold new timestamps)."""
    import xarray as xr

    workdir = demo_copy(demo_run, tmp_path / "w")
    runs = {"demo_a/eagle": "mid-write", "demo_b/harbor": "before-rename"}
    for run, point in runs.items():
        kill_while_making(workdir, f"results/attention/{run}/layer0.zarr", point)
        stores = sorted((workdir / f"results/attention/{run}").glob("layer*.zarr"))
        assert stores == [], f"a survey killed {point} left a store"
        snakemake(workdir, "--unlock")
    snakemake(workdir)  # a plain rerun
    assert not [p for p in (workdir / "results").rglob("*") if p.name.endswith(".partial")]
    for run in runs:
        for layer in range(4):
            name = f"attention/{run}/layer{layer}.zarr"
            rerun = xr.open_zarr(workdir / "results" / name)
            clean = xr.open_zarr(demo_run / "results" / name)
            assert decoded_attrs(rerun)["complete"] is True
            for variable in ("key_mass", "entropy", "logit_mean_pooled"):
                np.testing.assert_array_equal(
                    rerun[variable].values, clean[variable].values, err_msg=name
                )
