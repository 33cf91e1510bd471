"""Researchers' own checkpoints in the workflow: their bytes decide reruns, and a broken one
fails alone under --keep-going."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import xarray as xr

from sinkscope.wan.layout import WEIGHTS_NAME

from .workflowtools import demo_copy, edit_config, planned_jobs, snakemake

# Runs Snakemake in a subprocess: `pytest -m "not workflow"` leaves it out.
pytestmark = pytest.mark.workflow

BROKEN_WEIGHTS = f"weights/broken/{WEIGHTS_NAME}"


def small_config(config: dict) -> None:
    """Two user checkpoints (copies of the demo ones), one prompt, one layer: quick to run."""
    config["checkpoints"] = {"mine": {"base": "weights/mine"}, "broken": {"base": "weights/broken"}}
    config["prompts"] = {"eagle": config["prompts"]["eagle"]}
    config["layers"] = [0]
    config["capture"]["survey"] = "none"  # token stores only: extract -> reduce
    config["figures"]["heads"] = [[0, 0]]
    config["closed_loop"]["policies"] = []
    config["capture"].pop("token_runs")  # the demo's runs name its checkpoints
    config["figures"].pop("runs")


def outputs_of(workdir: Path, checkpoint: str) -> list[Path]:
    """A run's own outputs. Its statistics CSVs are not among them: one job (summary) computes
    every run's, so a failed run holds them back until it is fixed."""
    results = workdir / "results"
    return [
        results / f"frames/{checkpoint}/eagle/layer0.zarr",
        results / f"figures/{checkpoint}/eagle/figure4.svg",
    ]


@pytest.fixture(scope="module")
def keep_going(demo_run, tmp_path_factory):
    """A run with one checkpoint truncated mid-file (an interrupted download), then fixed."""
    workdir = demo_copy(demo_run, tmp_path_factory.mktemp("keepgoing"))
    demo = workdir / "results/demo"
    shutil.copytree(demo / "demo_a", workdir / "weights/mine")
    shutil.copytree(demo / "demo_b", workdir / "weights/broken")
    good = (workdir / BROKEN_WEIGHTS).read_bytes()
    (workdir / BROKEN_WEIGHTS).write_bytes(good[: len(good) // 2])
    edit_config(workdir, small_config)
    failed = snakemake(workdir, "--keep-going", check=False)
    state = {
        "failed": failed,
        "after_failure": {
            name: [p.exists() for p in outputs_of(workdir, name)] for name in ("mine", "broken")
        },
        "mine_mtimes": [p.stat().st_mtime_ns for p in outputs_of(workdir, "mine")],
        "log": (workdir / "results/logs/extract/broken/eagle/layer0.log").read_text(),
        "leftovers": list((workdir / "results/logits").glob("broken/**/*.zarr*")),
    }
    (workdir / BROKEN_WEIGHTS).write_bytes(good)
    state["planned_after_fix"] = planned_jobs(workdir)
    snakemake(workdir)
    return workdir, state


def test_a_broken_checkpoint_fails_alone_with_its_cause_logged(keep_going):
    _, state = keep_going
    assert state["failed"].returncode != 0
    assert state["after_failure"] == {"mine": [True] * 2, "broken": [False] * 2}
    assert f"{BROKEN_WEIGHTS}: not a readable safetensors file" in state["log"]
    # Nothing of the failed job is left that could pass for a result.
    assert state["leftovers"] == []


def test_the_rerun_after_the_fix_runs_only_what_is_missing(keep_going):
    workdir, state = keep_going
    planned = state["planned_after_fix"]
    assert not any("checkpoint=mine" in wildcards for _, wildcards in planned)
    assert {w for r, w in planned if r == "extract"} == {"checkpoint=broken, prompt=eagle, layer=0"}
    assert {r for r, _ in planned} == {
        "extract",
        "reduce",
        "policies",
        "figures",
        "summary",
        "explorer",
        "all",
    }
    assert [p.stat().st_mtime_ns for p in outputs_of(workdir, "mine")] == state["mine_mtimes"]
    for checkpoint in ("mine", "broken"):
        assert all(p.exists() for p in outputs_of(workdir, checkpoint))
        assert (workdir / f"results/stats/{checkpoint}/eagle/layer0.csv").exists()
    assert planned_jobs(workdir) == set()


def test_checkpoint_bytes_not_timestamps_decide_reruns(keep_going, tmp_path):
    workdir = demo_copy(keep_going[0], tmp_path / "w")
    shutil.copytree(keep_going[0] / "weights", workdir / "weights")
    shutil.copy(keep_going[0] / "config.yaml", workdir / "config.yaml")
    weights = workdir / "weights/mine" / WEIGHTS_NAME
    config_json = workdir / "weights/mine/config.json"

    for path in (weights, config_json):
        path.touch()
    assert planned_jobs(workdir) == set()

    copy = weights.with_suffix(".copy")
    shutil.copyfile(weights, copy)  # new file, new inode, new mtime, same bytes
    os.replace(copy, weights)
    assert planned_jobs(workdir) == set()

    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one changed byte in the last tensor
    weights.write_bytes(bytes(data))
    planned = planned_jobs(workdir)
    assert {w for r, w in planned if r == "extract"} == {"checkpoint=mine, prompt=eagle, layer=0"}
    assert not any("checkpoint=broken" in w for _, w in planned)

    # The store records the digest the rerun was decided by.
    snakemake(workdir, "results/frames/mine/eagle/layer0.zarr")
    import hashlib

    frames = xr.open_zarr(workdir / "results/frames/mine/eagle/layer0.zarr")
    combined = hashlib.sha256(
        "\n".join(
            hashlib.sha256(p.read_bytes()).hexdigest() for p in (config_json, weights)
        ).encode()
    ).hexdigest()
    assert frames.attrs["checkpoint_sha256"] == combined


def test_a_remade_demo_checkpoint_reruns_its_extractions(demo_run, tmp_path):
    """Demo checkpoints are workflow outputs, not ancient(): remaking one re-runs its jobs."""
    workdir = demo_copy(demo_run, tmp_path / "w")
    planned = planned_jobs(workdir, "--forcerun", "make_demo_models")
    assert {w for r, w in planned if r == "extract"} == {"checkpoint=demo_a, prompt=eagle, layer=0"}
    assert {w for r, w in planned if r == "survey"} == {
        f"checkpoint={c}, prompt={p}" for c in ("demo_a", "demo_b") for p in ("eagle", "harbor")
    }
