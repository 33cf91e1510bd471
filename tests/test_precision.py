"""bfloat16 against float32 (`dtype` in the config, `wan.precision`): the same tiny model, prompt
and noise through a token capture, a survey and a closed loop in each dtype on the CPU, and the
capture's float32 reductions of a bfloat16 model against float64 from its own q and k.

The tolerances come from bfloat16's unit roundoff u = 2^-8 = 3.9e-3 (8 significant bits):
- The capture's reductions run in float32 whatever the model's dtype, so from the q and k a
  bfloat16 model hands them, key_mass is exact to float32 accumulation (1e-6), as in float32.
- Between the dtypes, every matmul, norm and residual add of the bfloat16 model rounds its
  output to within u relative. A latent of the tiny model passes some 40 of them (2 layers of
  about 10, over 4 denoising calls that each start from the last x0); as independent errors
  they add up like a random walk, sqrt(40) u = 6.3 u: latents (relative L2 per frame), logits
  and the survey's key_logit_mean (relative to the largest) within 8 u. A softmax moves each
  probability by at most half the largest change of its logits (|dp_i| = p_i |dl_i - sum_j p_j
  dl_j|), and the tiny model's logits stay below 1 in size, so probability masses (key_mass,
  prob_mass, the statistics' masses) within 4 u absolute.
The bfloat16 model rounds where the released code rounds (docs/DESIGN.md, "Where the model
rounds"; tests/test_release_arithmetic.py); with those roundings the bounds stay as derived.
Measured (`python -m tests.test_precision`): latents 1.4 u, logits 3.1 u, key_logit_mean 2.9 u,
masses 0.4-0.5 u (before, with the re-noise and LayerNorm rounded otherwise: 1.5 u, 3.8 u);
the capture's key_mass of the bfloat16 model 2.2e-8 from float64, a bfloat16 softmax 7.1e-4.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from sinkscope.analysis.reduce import reduce_attention_store
from sinkscope.analysis.stats import frame_statistics
from sinkscope.analysis.stores import open_frame_dataset
from sinkscope.extraction.attention_store import AttentionStoreWriter
from sinkscope.extraction.capture import LogitCapture
from sinkscope.extraction.closed_loop import closed_loop, load_latents
from sinkscope.extraction.job import extract
from sinkscope.extraction.sampling import SELF_FORCING, rollout
from sinkscope.passes import resolve_passes

from .conftest import TINY, TINY_GEOMETRY, make_tiny_model
from .test_capture import T, _write_inputs

U = 2.0**-8  # bfloat16's unit roundoff
ACTIVATION_BOUND = 8 * U  # latents, logits: relative (module docstring)
MASS_BOUND = 4 * U  # probability masses: absolute
FLOAT32_REDUCTION = 1e-6  # key_mass from the same q and k: float32 accumulation only
LAYERS = [0, 1]
VIDEO = {"num_frames": 8, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}


def _runs(tmp_path: Path) -> dict:
    """Token stores, attention stores, frame datasets and a closed loop (full and sink_window)
    of one tiny checkpoint and prompt, in float32 and in bfloat16."""
    prompt, settings = _write_inputs(tmp_path, video=VIDEO)
    # The model's dtype is what varies: the attention stores keep their float32 reductions whole.
    settings["capture"]["survey_precision"] = "float32"
    common = {"checkpoint_name": "tiny", "prompt_name": "p", "prompt_embeddings": prompt}
    out = {}
    for dtype in ("float32", "bfloat16"):
        root = tmp_path / dtype
        run = {"dtype": dtype}
        for store in ("tokens", "attention"):
            paths = [root / store / f"layer{layer}.zarr" for layer in LAYERS]
            extract(
                **common,
                layers=LAYERS,
                outputs=paths,
                settings={**settings, "dtype": dtype},
                store=store,
                progress=False,
            )
            run[store] = [xr.open_zarr(path, chunks=None) for path in paths]
        run["frames"] = []
        for layer in LAYERS:
            source = root / "attention" / f"layer{layer}.zarr"
            reduce_attention_store(source, root / "frames" / f"layer{layer}.zarr")
            run["frames"].append(open_frame_dataset(root / "frames" / f"layer{layer}.zarr"))
        loop = {**settings, "dtype": dtype}
        for policy in ({"name": "full"}, {"name": "sink_window", "budget": 4, "sink_frames": 2}):
            name = policy["name"]
            closed_loop(
                **common,
                settings={**loop, "policy": policy},
                latents_path=root / f"{name}.safetensors",
                table_path=root / f"{name}.csv",
                blocks_path=root / f"{name}.blocks.csv",
                reference=None if name == "full" else root / "full.safetensors",
                layers=[0],
                stores=[root / "loop" / f"{name}.zarr"],
                progress=False,
            )
            run[name] = load_latents(root / f"{name}.safetensors")[0]
            run[f"{name}_store"] = xr.open_zarr(root / "loop" / f"{name}.zarr", chunks=None)
        out[dtype] = run
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return _runs(tmp_path_factory.mktemp("precision"))


def frame_rel(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Relative L2 per latent frame of [C, F, H, W] latents."""
    a, b = a.double().transpose(0, 1).flatten(1), b.double().transpose(0, 1).flatten(1)
    return ((a - b).norm(dim=1) / b.norm(dim=1)).numpy()


def measured(runs: dict) -> dict[str, float]:
    """The largest difference between the dtypes of each compared quantity."""
    f32, bf16 = runs["float32"], runs["bfloat16"]
    out = {}
    out["latents (relative L2 per frame)"] = max(
        float(frame_rel(bf16[name], f32[name]).max()) for name in ("full", "sink_window")
    )
    logits = [
        (b.logits.values.astype(np.float64), f.logits.values.astype(np.float64))
        for b, f in zip(bf16["tokens"], f32["tokens"], strict=True)
    ]
    out["logits (relative to the largest)"] = max(
        float(np.nanmax(np.abs(b - f)) / np.nanmax(np.abs(f))) for b, f in logits
    )
    out["key_logit_mean (relative to the largest)"] = max(
        float(
            np.nanmax(np.abs(b.key_logit_mean.values - f.key_logit_mean.values))
            / np.nanmax(np.abs(f.key_logit_mean.values))
        )
        for b, f in zip(bf16["attention"], f32["attention"], strict=True)
    )
    out["key_mass (absolute)"] = max(
        float(np.nanmax(np.abs(b.key_mass.values - f.key_mass.values)))
        for b, f in zip(bf16["attention"], f32["attention"], strict=True)
    )
    out["prob_mass (absolute)"] = max(
        float(np.nanmax(np.abs(b.prob_mass.values - f.prob_mass.values)))
        for b, f in zip(bf16["frames"], f32["frames"], strict=True)
    )
    out["closed-loop key_mass (absolute)"] = max(
        float(np.nanmax(np.abs(bf16[n].key_mass.values - f32[n].key_mass.values)))
        for n in ("full_store", "sink_window_store")
    )
    masses = ["first", "middle", "last", "recent_mass", "importance"]
    differences = []
    for b, f in zip(bf16["frames"], f32["frames"], strict=True):
        b, f = frame_statistics(b, "each_block"), frame_statistics(f, "each_block")
        b, f = b[b.measure == "prob_mass"], f[f.measure == "prob_mass"]
        assert len(b) == len(f) > 0
        differences.append(np.nanmax(np.abs(b[masses].to_numpy(float) - f[masses].to_numpy(float))))
    out["statistics: probability masses per block (absolute)"] = float(max(differences))
    return out


def test_bfloat16_runs_the_float32_computation(runs):
    """Latents, logits, key_mass, prob_mass and the statistics of a bfloat16 rollout within the
    bounds the module docstring derives from the float32 rollout of the same weights and noise;
    the provenance says which dtype ran; the two dtypes really differ (bfloat16 did run)."""
    f32, bf16 = runs["float32"], runs["bfloat16"]
    for store in (*bf16["tokens"], *bf16["attention"], bf16["full_store"]):
        assert store.attrs["dtype"] == "bfloat16"
    assert f32["attention"][0].attrs["dtype"] == "float32"
    for name, difference in measured(runs).items():
        bound = ACTIVATION_BOUND if "relative" in name else MASS_BOUND
        assert difference <= bound, (name, difference, bound)
    # Not the same computation: bfloat16 rounding shows (and float32 would give 0 here).
    assert frame_rel(bf16["full"], f32["full"]).max() > U / 16
    # The same frames were seen: NaN patterns agree.
    for b, f in zip(bf16["attention"], f32["attention"], strict=True):
        np.testing.assert_array_equal(np.isnan(b.key_mass.values), np.isnan(f.key_mass.values))


def test_bfloat16_stores_keep_float32_reductions(runs):
    """Whatever the model's dtype, the stores hold the capture's float32 reductions (softmax,
    key mass, entropy, pooled and per-key logits); key_mass still sums to 1 per query frame."""
    bf16 = runs["bfloat16"]
    for store in (*bf16["attention"], bf16["full_store"]):
        for name in ("key_mass", "entropy", "key_logit_mean"):
            assert store[name].dtype == np.float32, name
        sums = np.nansum(store.key_mass.values, axis=-1)
        np.testing.assert_allclose(sums, 1.0, atol=1e-5)
    for store in bf16["attention"]:
        assert store.logit_mean_pooled.dtype == np.float32
    for frames in bf16["frames"]:
        for name in ("prob_mass", "logit_mean", "entropy"):
            assert frames[name].dtype == np.float32, name


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_capture_of_a_bfloat16_model_reduces_in_float32(tmp_path, device):
    """The survey's key_mass of a bfloat16 model against a float64 softmax of the very q and k
    the model handed the capture: float32 accuracy (1e-6), where a bfloat16 softmax of the same
    q and k is off by orders of magnitude more (so the bound tells the two apart)."""
    model = make_tiny_model(seed=4).to(device=device, dtype=torch.bfloat16)
    text = torch.randn(1, 5, TINY.text_dim, generator=torch.Generator().manual_seed(7))
    passes = resolve_passes("all", 4)
    layer = 1
    calls = []
    path = tmp_path / "attention.zarr"
    writer = AttentionStoreWriter(
        path,
        num_heads=TINY.num_heads,
        num_frames=TINY_GEOMETRY.num_frames,
        frame_seq_length=T,
        timesteps=SELF_FORCING.pass_timesteps(),
        pass_kinds=SELF_FORCING.pass_kinds(),
        attrs={},
        frames_per_block=TINY_GEOMETRY.frames_per_block,
    )
    capture = LogitCapture({layer: writer}, passes, T, TINY.head_dim, softmax_rows=4)
    state = {}

    def on_pass(block, pass_index, kind, timestep):
        state["pass"] = (block, pass_index)
        capture.begin_pass(block, pass_index, kind, timestep)

    def hook(index, q, k, visible):
        assert q.dtype == k.dtype == torch.bfloat16  # the model's own dtype reaches the capture
        calls.append((*state["pass"], q[0].clone(), k[0].clone(), visible.tokens.cpu()))
        capture(index, q, k, visible)

    model.set_capture(hook, {layer})
    with writer:
        rollout(
            model,
            text,
            geometry=TINY_GEOMETRY,
            seed=2,
            device=device,
            dtype=torch.bfloat16,
            on_pass=on_pass,
            progress=False,
        )
    model.set_capture(None)
    stored = xr.open_zarr(path).key_mass.values
    scale = 1 / math.sqrt(TINY.head_dim)
    float32_error, bfloat16_error, compared = 0.0, 0.0, 0
    for block, step, q, k, tokens in calls:
        start = TINY_GEOMETRY.block_sizes[0] * block
        assert q.shape[0] == TINY_GEOMETRY.block_sizes[block] * T
        for i in range(q.shape[0] // T):
            rows = slice(i * T, (i + 1) * T)
            for head in range(TINY.num_heads):
                q64, k64 = q[rows, head].double(), k[:, head].double()
                exact = torch.softmax(q64 @ k64.T * scale, dim=-1).mean(dim=0).cpu().numpy()
                got = stored[step, head, start + i, tokens.numpy()]
                assert not np.isnan(got).any()
                compared += 1
                float32_error = max(float32_error, float(np.abs(got - exact).max()))
                low = torch.softmax(q[rows, head] @ k[:, head].T * scale, dim=-1)
                low = low.float().mean(dim=0).cpu().numpy()
                bfloat16_error = max(bfloat16_error, float(np.abs(low - exact).max()))
    assert len(calls) == 5 * len(TINY_GEOMETRY.block_sizes)
    assert compared == 5 * TINY_GEOMETRY.num_frames * TINY.num_heads
    assert float32_error < FLOAT32_REDUCTION, float32_error
    assert bfloat16_error > 20 * FLOAT32_REDUCTION, bfloat16_error


if __name__ == "__main__":  # the measured differences the module docstring quotes
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for what, value in measured(_runs(Path(folder))).items():
            print(f"{what:55s} {value:.2e}  ({value / U:.2f} u)")
