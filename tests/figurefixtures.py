"""Synthetic frame datasets (Contract 2) and SVG readers shared by the figure tests of every
family (tests/test_*_figures.py)."""

from __future__ import annotations

import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import xarray as xr

from sinkscope import frames
from sinkscope.analysis import figures
from sinkscope.schedules import KEY_VERSION, NOISY_VERSION, UNSEEN_VERSION
from sinkscope.storage import mark_complete

TIMESTEPS = np.array([1000.0, 937.5, 833.33, 625.0, 0.0], dtype=np.float32)


PASS_KINDS = ["denoise", "denoise", "denoise", "denoise", "cache"]


DEMO_BLOCKS = [3] * 7  # 21 latent frames, 7 blocks of 3


SMALL = {"num_heads": 2, "block_sizes": [3, 3, 3]}  # 9 latent frames, fast to draw


SVG = "{http://www.w3.org/2000/svg}"


def make_frame_dataset(
    checkpoint: str = "demo",
    prompt: str = "cat",
    layer: int = 0,
    *,
    num_heads: int = 4,
    block_sizes: list[int] = DEMO_BLOCKS,
    local_attn_size: int = -1,
    sink_size: int = 0,
    seed: int = 0,
) -> xr.Dataset:
    """A frame dataset shaped like the real thing: a strong first frame plus the own block."""
    rng = np.random.default_rng(seed)
    num_frames = sum(block_sizes)
    seen = frames.visible_frames(block_sizes, local_attn_size, sink_size)
    blocks = frames.block_of_frame(block_sizes)
    query = np.arange(num_frames)[:, None]
    key = np.arange(num_frames)[None, :]
    head_sink = 1.0 + 0.8 * np.arange(num_heads) + 0.5 * layer
    pattern = (
        head_sink[:, None, None] * (key == 0)
        + 1.5 * (blocks[query] == blocks[key])
        - 0.05 * (query - key)
    )
    step_scale = np.linspace(1.0, 0.7, TIMESTEPS.size)[:, None, None, None]
    noise = 0.2 * rng.standard_normal((TIMESTEPS.size, num_heads, num_frames, num_frames))
    logits = np.where(seen, step_scale * pattern + noise, np.nan)
    weights = np.where(seen, np.exp(logits - np.nanmax(logits, axis=-1, keepdims=True)), 0.0)
    prob = np.where(seen, weights / weights.sum(axis=-1, keepdims=True), np.nan)
    entropy = -np.nansum(prob * np.log(prob), axis=-1)
    return xr.Dataset(
        {
            "logit_mean": (("step", "head", "query_frame", "key_frame"), logits.astype(np.float32)),
            "prob_mass": (("step", "head", "query_frame", "key_frame"), prob.astype(np.float32)),
            "entropy": (("step", "head", "query_frame"), entropy.astype(np.float32)),
        },
        coords={
            "step": np.arange(TIMESTEPS.size),
            "head": np.arange(num_heads),
            "query_frame": np.arange(num_frames),
            "key_frame": np.arange(num_frames),
            "timestep": ("step", TIMESTEPS),
            "pass_kind": ("step", np.array(PASS_KINDS, dtype=object)),
            "block": ("query_frame", blocks),
            "checkpoint": np.array(checkpoint, dtype=object),
            "prompt": np.array(prompt, dtype=object),
            "layer": layer,
        },
        attrs={
            "block_sizes": list(block_sizes),
            "num_frames": num_frames,
            "frame_seq_length": 4,
            "prompt_text": f"a {prompt} walking",
            "num_heads": num_heads,
        },
    )


def with_key_versions(ds: xr.Dataset, sampler: str = "rolling") -> xr.Dataset:
    """`ds` with the `key_version` of a Self-Forcing run (the own block noisy at the pass's
    step, clean in the cache pass, earlier frames clean) or, `sampler='rolling'`, a rolling one
    besides: block 0's keys the anchor of every later block, and while denoising the block
    before the own one (not block 0) a noisy copy one step further, as in the window."""
    blocks = np.asarray(ds["block"].values)
    query_block, key_block = blocks[:, None], blocks[None, :]
    kinds = list(ds["pass_kind"].values)
    denoising = kinds.count("denoise")
    versions = []
    for step, kind in enumerate(kinds):
        clean = KEY_VERSION["clean"]
        own = clean if kind == "cache" else NOISY_VERSION + step
        version = np.where(key_block == query_block, own, clean)
        if sampler == "rolling":
            version = np.where((key_block == 0) & (query_block > 0), KEY_VERSION["anchor"], version)
            if kind != "cache" and step + 1 < denoising:
                window = (key_block == query_block - 1) & (key_block > 0)
                version = np.where(window, NOISY_VERSION + step + 1, version)
        seen = np.isfinite(ds["logit_mean"].values[step, 0])
        versions.append(np.where(seen, version, UNSEEN_VERSION))
    marked = ds.assign(
        key_version=(("step", "query_frame", "key_frame"), np.array(versions, dtype=np.int8))
    )
    marked.attrs.update(sampler_kind=sampler, passes=list(range(len(kinds))))
    marked.attrs["passes_per_block"] = len(kinds)
    return marked


def write_store(root: Path, ds: xr.Dataset) -> Path:
    path = root / str(ds["checkpoint"].values) / str(ds["prompt"].values)
    path = path / f"layer{int(ds['layer'])}.zarr"
    ds.to_zarr(path, zarr_format=3, mode="w")
    mark_complete(path)  # as the reducer marks what it wrote
    return path


def numpy_last_block(ds: xr.Dataset, variable: str, step: int) -> np.ndarray:
    """(head, key_frame) mean over the last block's query frames, computed independently."""
    blocks = ds["block"].values
    rows = np.flatnonzero(blocks == blocks.max())
    values = ds[variable].values[list(ds["step"].values).index(step)].astype(np.float64)
    with warnings.catch_warnings():  # key frames no last-block query sees stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values[:, rows, :], axis=1)


def svg_texts(path: Path) -> list[str]:
    root = ET.parse(path).getroot()
    return ["".join(el.itertext()) for el in root.iter("{http://www.w3.org/2000/svg}text")]


def svg_has_raster(path: Path) -> bool:
    return any(True for _ in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}image"))


def figure_texts(fig) -> list[str]:
    texts = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        texts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        texts += [t.get_text() for t in ax.texts]
    return texts


def run_outputs(folder: Path, layers, heads, fmt: str = "svg") -> list[Path]:
    """The files the figures rule asks for, from the registry."""
    head_layers = sorted({layer for layer, _ in heads})
    return [Path(f.path) for f in figures.run_figures(str(folder), layers, head_layers, fmt)]


def compare_outputs(folder: Path, heads, fmt: str = "svg") -> list[Path]:
    head_layers = sorted({layer for layer, _ in heads})
    return [Path(f.path) for f in figures.compare_figures(str(folder), [], head_layers, fmt)]


def compare_datasets(prompts=("cat", "sea"), checkpoints=("self_forcing", "causvid")):
    return [
        make_frame_dataset(checkpoint, prompt, 0, seed=10 * c + p, **SMALL)
        for c, checkpoint in enumerate(checkpoints)
        for p, prompt in enumerate(prompts)
    ]


def overlapping_legends(fig) -> list[str]:
    """Legends whose box overlaps a panel (with its title, labels and ticks) or a figure text
    (title, shared axis label)."""
    fig.draw_without_rendering()
    renderer = fig._get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    boxes += [text.get_window_extent(renderer) for text in fig.texts if text.get_text()]
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [
        legend.get_texts()[0].get_text()
        for legend in legends
        for box in boxes
        if legend.get_window_extent(renderer).overlaps(box)
    ]


def mesh_styles(path: Path) -> list[dict[str, str]]:
    """The style of every cell of every colour map (and colorbar) in an SVG."""
    root = ET.parse(path).getroot()
    styles = []
    for group in root.iter(f"{SVG}g"):
        if group.get("id", "").startswith("QuadMesh"):
            for cell in group.iter(f"{SVG}path"):
                style = dict(
                    item.split(":", 1) for item in cell.get("style", "").split(";") if ":" in item
                )
                styles.append({key.strip(): value.strip() for key, value in style.items()})
    return styles
