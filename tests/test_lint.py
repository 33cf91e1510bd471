"""The project's own style gates: ruff, snakefmt and snakemake --lint, so one command checks all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "ruff", "check", "."],
        ["-m", "ruff", "format", "--check", "."],
        ["-m", "snakefmt", "--check", "."],
        ["-m", "snakemake", "--lint", "--cores", "1"],
    ],
    ids=["ruff", "ruff-format", "snakefmt", "snakemake-lint"],
)
def test_lint(command):
    result = subprocess.run(
        [sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    if "--lint" in command:
        assert "Congratulations" in result.stdout + result.stderr
