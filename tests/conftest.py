"""Shared fixtures: tiny Wan models of the real architecture."""

from __future__ import annotations

import copy
import os
import sys

# One thread per pytest-xdist worker for torch, BLAS and the compressors (set before they load):
# two workers of two threads each on two cores spend their time waiting for each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest
import torch

from sinkscope.extraction.sampling import Geometry
from sinkscope.wan.config import WanConfig
from sinkscope.wan.model import WanModel

# Write bytecode caches even where PYTHONDONTWRITEBYTECODE is set (this project's machines set
# it): every worker and every job subprocess the tests start would otherwise compile sinkscope
# and rewrite the test modules anew (~4 s of each worker's collection); they read the caches
# written here. __pycache__/ is git-ignored.
sys.dont_write_bytecode = False

# head_dim 16: RoPE channels 8 (frame) / 4 (height) / 4 (width).
TINY = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, freq_dim=16, text_dim=8, text_len=8)
# 6 latent frames in 3 blocks of 2; a 4 x 6 latent gives 2 x 3 = 6 tokens per frame.
TINY_GEOMETRY = Geometry(num_frames=6, frames_per_block=2, latent_height=4, latent_width=6)


def _schema_loaded_once() -> None:
    """`snakemake.utils.validate` parses its schema file on every call, with yte's pure-Python
    YAML (50 ms of its 77 for ours); the tests validate some 200 configs against one schema.
    Each call still gets its own copy of the parsed schema (validate adds its `$id`), so the
    validation is snakemake's own."""
    import snakemake.utils

    load = snakemake.utils._load_configfile
    parsed: dict[tuple, object] = {}

    def load_once(source, filetype="Config"):
        if filetype != "Schema" or not isinstance(source, str | os.PathLike):
            return load(source, filetype)
        stat = os.stat(source)
        key = (os.path.realpath(source), stat.st_mtime_ns, stat.st_size)
        if key not in parsed:
            parsed[key] = load(source, filetype)
        return copy.deepcopy(parsed[key])

    snakemake.utils._load_configfile = load_once


_schema_loaded_once()


# First among the plugins: pytest-xdist's worker reads the xdist_group marks in its own
# collection hook (it appends the group to the node id), so they must be there before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A test that uses the demo run is a workflow test, marked or not. Under pytest-xdist
    (`--dist loadgroup`) the tests sharing a module fixture (a SLURM cluster, a report) keep to
    one worker, so it is built once; the others spread one by one. The demo run's tests are not
    grouped: they take most of the workflow tier, and on one worker they left the other idle for
    minutes (12 min 44 s for the suite), so each worker runs the demo once for its share."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        definitions = fixtures.name2fixturedefs.values() if fixtures is not None else ()
        if "demo_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.workflow)
        if any(defs[-1].scope == "module" for defs in definitions):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


def make_tiny_model(seed: int = 0, cfg: WanConfig = TINY) -> WanModel:
    model = WanModel(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval().requires_grad_(False)


@pytest.fixture
def tiny_model() -> WanModel:
    return make_tiny_model()


@pytest.fixture
def tiny_text() -> torch.Tensor:
    return torch.randn(1, 5, TINY.text_dim, generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """The embedded default, run once for the whole session; tests change only copies of it."""
    from .workflowtools import copy_workflow, snakemake

    workdir = copy_workflow(tmp_path_factory.mktemp("workflow"))
    snakemake(workdir)
    return workdir
