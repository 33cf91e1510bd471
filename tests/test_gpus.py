"""GPU claims: one GPU per job on a workstation, the allocation's GPU under SLURM."""

from __future__ import annotations

import threading
import time

import pytest

from sinkscope.workflow.gpus import claim_gpu, job_device, visible_gpu_ids


@pytest.fixture(autouse=True)
def _own_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("SINKSCOPE_GPU_LOCK_DIR", str(tmp_path / "locks"))
    for name in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", "SINKSCOPE_FAKE_GPUS"):
        monkeypatch.delenv(name, raising=False)


def test_concurrent_claims_get_different_gpus_and_a_third_waits():
    ids = ["0", "1"]
    third: list[int] = []
    with claim_gpu(ids) as (first, _), claim_gpu(ids) as (second, _):
        assert {first, second} == {0, 1}

        def claim_third():
            with claim_gpu(ids) as (index, _):
                third.append(index)

        waiter = threading.Thread(target=claim_third)
        waiter.start()
        time.sleep(1.0)
        assert third == []  # both GPUs held: it waits rather than share one
    waiter.join(timeout=10)
    assert third in ([0], [1])


def test_a_claim_ends_with_its_block_even_on_error():
    with pytest.raises(RuntimeError, match="boom"), claim_gpu(["0"]):
        raise RuntimeError("boom")
    with claim_gpu(["0"]) as (index, _):
        assert index == 0


def test_locks_follow_the_machines_gpu_names(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpu_ids(2) == ["2", "3"]
    with claim_gpu(visible_gpu_ids(2)) as (index, path):
        assert index == 0 and path.name == "gpu-2.lock"


def test_fake_gpus_are_claimed_and_computed_on_the_cpu(monkeypatch):
    monkeypatch.setenv("SINKSCOPE_FAKE_GPUS", "2")
    with job_device("auto") as a, job_device("cuda") as b:
        assert (a.device, b.device) == ("cpu", "cpu")
        assert {a.index, b.index} == {0, 1}
        assert a.record()["claimed_by"] == "lock" and a.record()["fake"] is True


def test_under_slurm_the_allocation_is_used_as_is(monkeypatch, tmp_path):
    monkeypatch.setenv("SINKSCOPE_FAKE_GPUS", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    # Two jobs on one node may both see "their" GPU as cuda:0: no locks taken.
    with job_device("auto") as a, job_device("auto") as b:
        for claim in (a, b):
            record = claim.record()
            assert record["claimed_by"] == "slurm" and record["visible_id"] == "1"
            assert record["slurm_job_id"] == "42"
    assert not (tmp_path / "locks").exists() or not list((tmp_path / "locks").iterdir())


def test_an_allocation_with_several_gpus_is_shared_by_claims(monkeypatch, tmp_path):
    # salloc --gpus=2, then a local snakemake --resources gpu=2 inside it.
    monkeypatch.setenv("SINKSCOPE_FAKE_GPUS", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with job_device("auto") as a, job_device("auto") as b:
        assert {a.index, b.index} == {0, 1}
        assert a.claimed_by == b.claimed_by == "lock"
        assert "slurm-42" in a.lock_file


def test_cpu_needs_no_claim():
    with job_device("cpu") as claim:
        assert claim.device == "cpu" and claim.claimed_by == "none"


def test_cuda_without_a_gpu_is_an_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="CUDA is not available"), job_device("cuda"):
        pass


def extraction_runs(workdir, stores) -> list[tuple]:
    """(started, completed, gpu index) of each store's extraction job, from its attributes."""
    from datetime import datetime

    import xarray as xr

    from sinkscope.storage import decoded_attrs

    runs = []
    for store in stores:
        attrs = decoded_attrs(xr.open_zarr(workdir / store))
        gpu = attrs["gpu"]
        assert gpu["claimed_by"] == "lock" and gpu["fake"] is True
        runs.append(
            (
                datetime.fromisoformat(attrs["started_at"]),
                datetime.fromisoformat(attrs["completed_at"]),
                gpu["index"],
            )
        )
    return runs


def overlaps(runs: list[tuple]) -> list[tuple]:
    return [
        (a, b) for i, a in enumerate(runs) for b in runs[i + 1 :] if a[0] < b[1] and b[0] < a[1]
    ]


@pytest.mark.workflow
def test_two_gpus_run_two_extractions_at_once_each_on_its_own(demo_run, tmp_path):
    """`--resources gpu=2` with two (fake) GPUs: two extraction or survey jobs overlap in time,
    each on a GPU of its own, as their stores record; the default profile's gpu=1 runs one at a
    time."""
    import os

    from .workflowtools import demo_copy, snakemake

    workdir = demo_copy(demo_run, tmp_path / "w")
    # Token and survey jobs share the GPUs: two of each, four jobs for two GPUs.
    stores = [
        f"results/{kind}/{run}/layer0.zarr"
        for kind, runs in (
            ("logits", ("demo_a/eagle", "demo_b/harbor")),
            ("attention", ("demo_a/harbor", "demo_b/eagle")),
        )
        for run in runs
    ]
    env = {
        **os.environ,
        "SINKSCOPE_FAKE_GPUS": "2",
        "SINKSCOPE_GPU_LOCK_DIR": str(tmp_path / "locks"),
    }
    # Targets before --forcerun, which takes every word after it.
    # Four cores, two GPUs: only the gpu resource limits how many run at once.
    result = snakemake(
        workdir,
        *stores,
        "--cores",
        "4",
        "--resources",
        "gpu=2",
        "--forcerun",
        "extract",
        "survey",
        env=env,
    )
    runs = extraction_runs(workdir, stores)
    overlapping = overlaps(runs)
    assert overlapping, f"no two extraction jobs ran at once: {runs}\n{result.stderr}"
    for a, b in overlapping:
        assert a[2] != b[2], f"two jobs shared GPU {a[2]} at the same time"
    # Never more than two at once: at each start, at most one other job is running.
    for start, _, _ in runs:
        assert sum(s <= start < e for s, e, _ in runs) <= 2

    # The default profile (gpu: 1): the same two GPUs, one job at a time.
    serial = [stores[0], stores[2]]  # one token store, one survey
    snakemake(workdir, *serial, "--cores", "4", "--forcerun", "extract", "survey", env=env)
    assert overlaps(extraction_runs(workdir, serial)) == []
