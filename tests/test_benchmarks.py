"""benchmarks/gpu.py, the one command for the first GPU: without CUDA it says so and exits 0;
its whole measurement runs at toy size on the CPU (`--cpu-smoke`), so a GPU session finds a
script that works. In process (its `main`), as `python benchmarks/gpu.py` runs it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .workflowtools import REPO


def _gpu_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", REPO / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real thing")
def test_gpu_benchmark_without_cuda_says_so_and_exits_0(capsys):
    assert _gpu_benchmark().main([]) == 0
    assert "no CUDA device on this machine" in capsys.readouterr().out


def test_gpu_benchmark_smoke_prints_its_table(capsys):
    """The whole measurement at toy size. The surveys through the store process (as a job runs
    it, its child started and its stores opened before the timer; with the child started inside
    the timer; with the reductions dropped) name the model thread's seconds in its calls, its
    waits for ring room and the close after the rollout."""
    assert _gpu_benchmark().main(["--cpu-smoke", "--compare-layers", "2"]) == 0
    table = capsys.readouterr().out
    assert "### `benchmarks/gpu.py` on CPU (smoke, toy size)" in table
    rows = ("| plain bf16 rollout |", "| survey, 5 layers x 5 passes |")
    for row in (*rows, "| survey, reductions copied to the store process, not stored |"):
        assert row in table
    assert "| token capture, layers [0], pass 0 |" in table
    assert "| bf16 vs fp32, 2 layers | latents " in table
    assert "FAILED" not in table  # a stage that fails becomes its row's error
    printed = table.split("### `benchmarks/gpu.py`")[-1]  # the table, not the progress lines
    through = [
        line for line in printed.splitlines() if "store process" in line or "x 5 passes" in line
    ]
    assert len(through) == 3, table  # as a job runs it, the child started in the timer, dropped
    assert "| survey, the store process started inside the timer |" in table
    for line in through:
        assert "waiting for ring room" in line and "closing after the rollout" in line, line


def test_survey_only_leaves_the_token_capture_and_the_dtype_comparison_out(capsys, monkeypatch):
    """`--survey-only`, its rollouts faked (the smoke test above runs them): no token capture,
    no dtype comparison, every survey row."""
    benchmark = _gpu_benchmark()
    stores = []

    def fake_rollout(*args, store="attention", **options):
        stores.append(store if options.get("stores") is not None else "plain")
        return benchmark.Timed(1.0, 0, torch.zeros(1), 0.0)

    def no_comparison(*args):
        raise AssertionError("--survey-only compared the dtypes")

    monkeypatch.setattr(benchmark, "timed_rollout", fake_rollout)
    monkeypatch.setattr(benchmark, "compare_dtypes", no_comparison)
    assert benchmark.main(["--cpu-smoke", "--survey-only"]) == 0
    table = capsys.readouterr().out.split("### `benchmarks/gpu.py`")[-1]
    assert "tokens" not in stores and stores.count("attention") == 2, stores
    assert "token capture" not in table and "bf16 vs fp32" not in table
    assert "| survey, 5 layers x 5 passes |" in table and "FAILED" not in table
