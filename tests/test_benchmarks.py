"""benchmarks/gpu.py, the one command for the first GPU: without CUDA it says so and exits 0;
its whole measurement runs at toy size on the CPU (`--cpu-smoke`), so a GPU session finds a
script that works."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from .workflowtools import REPO


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/gpu.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real thing")
def test_gpu_benchmark_without_cuda_says_so_and_exits_0():
    result = _run()
    assert result.returncode == 0, result.stderr
    assert "no CUDA device on this machine" in result.stdout


def test_gpu_benchmark_smoke_prints_its_table():
    result = _run("--cpu-smoke", "--compare-layers", "2")
    assert result.returncode == 0, result.stderr
    table = result.stdout
    assert "### `benchmarks/gpu.py` on CPU (smoke, toy size)" in table
    for row in ("| plain bf16 rollout |", "| survey, 5 layers x 5 passes |"):
        assert row in table
    assert "| token capture, layers [0], pass 0 |" in table
    assert "| bf16 vs fp32, 2 layers | latents " in table
