"""Running the workflow in temporary copies of the repository, for the tests."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = [
    "Snakefile",
    "config.yaml",
    "rules",
    "scripts",
    "schemas",
    "profiles",
    "envs",
    "report",
]


def copy_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name)
        else:
            shutil.copy2(src, dest / name)
    return dest


def snakemake(
    workdir: Path, *args: str, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake {args} failed:\n{result.stdout}\n{result.stderr}")
    return result


def planned_jobs(workdir: Path, *args: str) -> set[tuple[str, str]]:
    """(rule, wildcards) of every job a dry run would execute."""
    out = snakemake(workdir, "--dry-run", *args).stdout
    jobs = set()
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        match = re.match(r"(?:local)?rule (\w+):", block.strip())
        if match:
            wildcards = re.search(r"wildcards: (.*)", block)
            jobs.add((match.group(1), wildcards.group(1) if wildcards else ""))
    return jobs


def edit_config(workdir: Path, change) -> None:
    path = workdir / "config.yaml"
    config = yaml.safe_load(path.read_text())
    change(config)
    path.write_text(yaml.safe_dump(config))


def demo_copy(demo_run: Path, dest: Path) -> Path:
    """A copy of the finished demo, results and Snakemake's metadata included."""
    workdir = copy_workflow(dest)
    shutil.copytree(demo_run / "results", workdir / "results")
    shutil.copytree(demo_run / ".snakemake", workdir / ".snakemake")
    return workdir


class Named(list):
    """A stand-in for Snakemake's named lists (snakemake.input, .output, .params) for running a
    script in-process: the unnamed items, then every named list's items, and `.name`/`.get`."""

    def __init__(self, items=(), **named):
        lists = (value for value in named.values() if isinstance(value, list))
        super().__init__([*items, *(item for value in lists for item in value)])
        self.__dict__.update(named)

    def get(self, key, default=None):
        return self.__dict__.get(key, default)
