"""KV-cache policies in the rollout (Contract 6): rotating post-RoPE keys against RoPE computed at
the new positions, top-C caches against a brute-force choice, covering budgets against the
full-cache rollout bit for bit, and the closed-loop job's latents, deviation table and capture.
Deep Forcing's policies against its released behaviour: tests/test_released_caches.py."""

from __future__ import annotations

import csv
import math

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr

from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.closed_loop import closed_loop, load_latents
from sinkscope.extraction.job import extract
from sinkscope.extraction.sampling import Geometry, rollout
from sinkscope.storage import decoded_attrs
from sinkscope.wan.rope import apply_rope, rope_angles, rotate_frames

from .conftest import make_tiny_model
from .test_capture import _write_inputs
from .test_model import reference_rope

# 12 latent frames in blocks of 2, 2 x 3 = 6 tokens per frame: long enough for every policy to
# evict at a budget of 6 frames.
LONG = Geometry(num_frames=12, frames_per_block=2, latent_height=4, latent_width=6)
T = 6


def _policy_rollout(model, text, policy: CachePolicy | None, geometry=LONG, on_pass=None):
    caches = None
    if policy is not None:
        caches = policy.new_caches(
            model,
            num_frames=geometry.num_frames,
            frame_seq_length=T,
            frames_per_block=geometry.frames_per_block,
            device="cpu",
            dtype=torch.float32,
        )
    latents = rollout(
        model, text, geometry=geometry, seed=3, on_pass=on_pass, progress=False, caches=caches
    )
    return latents, caches


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("shift", [0, 1, 7, -3])
def test_rotate_frames_equals_rope_at_the_new_positions(head_dim, shift):
    grid = (3, 2, 3)
    x = np.random.default_rng(head_dim + shift).standard_normal((1, 18, 2, head_dim))
    start = 5
    keys = apply_rope(torch.from_numpy(x), rope_angles(head_dim, grid, start, "cpu"))
    moved = rotate_frames(keys, shift).numpy()
    np.testing.assert_allclose(moved, reference_rope(x, grid, start + shift), rtol=0, atol=1e-12)
    # Only the temporal channels turn.
    spatial = head_dim - 2 * 2 * (head_dim // 6)
    np.testing.assert_array_equal(moved[..., spatial:], keys.numpy()[..., spatial:])


@pytest.mark.parametrize(
    "policy",
    [
        CachePolicy("window", 12),
        CachePolicy("sink_window", 12, sink_frames=3),
        CachePolicy("deep_sink", 14, sink_frames=5),
        CachePolicy("top_c", 12, recent_frames=2),
        CachePolicy("top_c", 20, recent_frames=4),
        CachePolicy("participative", 8, 2, recent_frames=1, capacity=12),
        CachePolicy("deep_forcing", 8, 2, recent_frames=1, capacity=14),
    ],
    ids=lambda p: p.label,
)
def test_a_budget_that_covers_everything_is_the_full_cache_bit_for_bit(tiny_text, policy):
    model = make_tiny_model(seed=6)
    full, _ = _policy_rollout(model, tiny_text, None)
    kept, _ = _policy_rollout(model, tiny_text, policy)
    assert torch.equal(full, kept)


def test_policies_that_evict_change_the_rollout(tiny_text):
    model = make_tiny_model(seed=6)
    full, _ = _policy_rollout(model, tiny_text, None)
    for policy in (CachePolicy("window", 6), CachePolicy("top_c", 6, recent_frames=2)):
        latents, _ = _policy_rollout(model, tiny_text, policy)
        assert torch.equal(full[:, :, :6], latents[:, :, :6]), policy.label
        assert not torch.allclose(full[:, :, 6:], latents[:, :, 6:]), policy.label


def _brute_force_mass(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """[heads, keys]: each key's softmax probability averaged over the queries, in float64."""
    logits = np.einsum("qhd,khd->hqk", q, k) * scale
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p.mean(axis=1)


def test_top_c_cache_holds_exactly_the_chosen_tokens(tiny_text):
    """At each new block every head's history is the top C of the candidates (kept history and
    frames leaving the window) by the attention of the previous block's cache pass, recomputed
    by brute force from that pass's queries and keys."""
    model = make_tiny_model(seed=7)
    budget, recent, own = 6, 2, 2
    history = (budget - own - recent) * T
    policy = CachePolicy("top_c", budget, recent_frames=recent)
    caches = policy.new_caches(
        model,
        num_frames=12,
        frame_seq_length=T,
        frames_per_block=own,
        device="cpu",
        dtype=torch.float32,
    )
    cache = caches[1]
    seen = []  # (start token, key tokens [M, H]) of every update
    scored = []  # (queries, keys, key tokens) of every scoring call (the cache-update passes)
    update = cache.update

    def spy_update(k, v, start, *, q=None, k_raw=None):
        out = update(k, v, start, q=q, k_raw=k_raw)
        seen.append((start, out[2].clone()))
        if cache.scoring:
            scored.append((q[0].double().numpy(), out[0][0].double().numpy(), out[2].clone()))
        return out

    cache.update = spy_update
    rollout(model, tiny_text, geometry=LONG, seed=3, progress=False, caches=caches)
    # The first update of each block (later passes rewrite the same tokens).
    new_blocks = [seen[i] for i in range(len(seen)) if i == 0 or seen[i][0] != seen[i - 1][0]]
    assert len(new_blocks) == LONG.num_frames // own and len(scored) == len(new_blocks)
    chose = 0
    for b in range(1, len(new_blocks)):
        start, tokens = new_blocks[b]
        q, k, prev_tokens = scored[b - 1]
        mass = _brute_force_mass(q, k, 1 / math.sqrt(model.config.head_dim))
        window = torch.arange(max(0, start - recent * T), start + own * T)
        for head in range(model.config.num_heads):
            head_tokens = tokens[:, head]
            candidates = np.flatnonzero(prev_tokens[:, head].numpy() < start - recent * T)
            if len(candidates) > history:
                best = candidates[np.argsort(-mass[head, candidates])[:history]]
                chose += 1
            else:
                best = candidates
            expected = sorted(prev_tokens[best, head].tolist())
            assert head_tokens[: len(expected)].tolist() == expected
            assert torch.equal(head_tokens[len(expected) :], window)
            assert len(head_tokens) <= budget * T
    assert chose > 0  # the rollout made the cache choose, not only keep everything


def test_closed_loop_job_writes_latents_and_the_deviation_table(tmp_path):
    video = {"num_frames": 12, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}
    prompt, settings = _write_inputs(tmp_path, video=video)
    full = tmp_path / "full.safetensors"
    common = {"checkpoint_name": "tiny", "prompt_name": "p", "prompt_embeddings": prompt}
    closed_loop(
        **common,
        settings={**settings, "policy": {"name": "full"}},
        latents_path=full,
        progress=False,
    )
    reference, meta = load_latents(full)
    assert reference.shape == (16, 12, 4, 6) and meta["policy"] == {"name": "full"}

    rows = {}
    for name, policy in {
        "window": {"name": "window", "budget": 6},
        "covering": {"name": "top_c", "budget": 12, "recent_frames": 2},
    }.items():
        table = tmp_path / f"{name}.csv"
        closed_loop(
            **common,
            settings={**settings, "policy": policy},
            latents_path=tmp_path / f"{name}.safetensors",
            reference=full,
            deviation_path=table,
            progress=False,
        )
        with open(table) as f:
            rows[name] = list(csv.DictReader(f))
    window = rows["window"]
    assert [int(r["frame"]) for r in window] == list(range(12))
    assert [int(r["block"]) for r in window] == [f // 2 for f in range(12)]
    latents, _ = load_latents(tmp_path / "window.safetensors")
    x, ref = latents[:, 9].double(), reference[:, 9].double()
    assert float(window[9]["rel_l2"]) == pytest.approx(float((x - ref).norm() / ref.norm()))
    cos = float((x * ref).sum() / (x.norm() * ref.norm()))
    assert float(window[9]["cosine"]) == pytest.approx(cos)
    assert all(float(r["rel_l2"]) == 0.0 for r in window[:6])
    assert all(float(r["rel_l2"]) > 1e-4 for r in window[6:])
    assert all(float(r["rel_l2"]) == 0.0 for r in rows["covering"])

    with pytest.raises(ValueError, match="seed"):
        closed_loop(
            **common,
            settings={**settings, "seed": 1, "policy": {"name": "window", "budget": 6}},
            latents_path=tmp_path / "x.safetensors",
            reference=full,
            deviation_path=tmp_path / "x.csv",
            progress=False,
        )
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "x.safetensors").exists()
    with pytest.raises(ValueError, match="cannot be captured"):
        closed_loop(
            **common,
            settings={**settings, "policy": {"name": "top_c", "budget": 6, "recent_frames": 2}},
            latents_path=tmp_path / "y.safetensors",
            reference=full,
            deviation_path=tmp_path / "y.csv",
            layers=[0],
            stores=[tmp_path / "y.zarr"],
        )


def test_attention_captured_in_a_closed_loop_is_the_survey_of_the_same_rollout(tmp_path):
    """A full-cache closed loop with capture writes the attention stores a survey of the same
    rollout writes; a windowed one sees only its window."""
    video = {"num_frames": 8, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}
    prompt, settings = _write_inputs(tmp_path, video=video)
    common = {"checkpoint_name": "tiny", "prompt_name": "p", "prompt_embeddings": prompt}
    closed_loop(
        **common,
        settings={**settings, "policy": {"name": "full"}},
        latents_path=tmp_path / "full.safetensors",
        layers=[0, 1],
        stores=[tmp_path / "loop0.zarr", tmp_path / "loop1.zarr"],
        progress=False,
    )
    extract(
        **common,
        layers=[0, 1],
        outputs=[tmp_path / "survey0.zarr", tmp_path / "survey1.zarr"],
        settings=settings,
        store="attention",
        progress=False,
    )
    for layer in (0, 1):
        loop = xr.open_zarr(tmp_path / f"loop{layer}.zarr")
        survey = xr.open_zarr(tmp_path / f"survey{layer}.zarr")
        for name in ("key_mass", "entropy", "logit_mean_pooled"):
            np.testing.assert_array_equal(loop[name].values, survey[name].values)
        assert decoded_attrs(loop)["policy"] == {"name": "full"}

    closed_loop(
        **common,
        settings={**settings, "policy": {"name": "window", "budget": 4}},
        latents_path=tmp_path / "w.safetensors",
        reference=tmp_path / "full.safetensors",
        deviation_path=tmp_path / "w.csv",
        layers=[0],
        stores=[tmp_path / "w0.zarr"],
        progress=False,
    )
    mass = xr.open_zarr(tmp_path / "w0.zarr")["key_mass"].values  # [step, head, query, token]
    last = mass[:, :, 6:8]  # the last block sees frames 4..7 only
    assert np.isnan(last[..., : 4 * T]).all() and not np.isnan(last[..., 4 * T :]).any()
    np.testing.assert_allclose(np.nansum(last, axis=-1), 1.0, atol=1e-5)


def test_the_demo_runs_the_closed_loop(demo_run):
    """The embedded default: 42 frames of demo_a / eagle under each policy at budget 9 (and
    Participative Compression's cache of 21), attention captured in the full-cache and
    frame-level rollouts, a summary beside the offline recall."""
    folder = demo_run / "results/closed_loop/demo_a/eagle"
    reference, meta = load_latents(folder / "full.safetensors")
    assert reference.shape[1] == 42 and meta["policy"] == {"name": "full"}
    policies = ["window", "sink_window", "deep_sink", "participative", "deep_forcing", "top_c"]
    for policy in policies:
        with open(folder / f"{policy}.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 42
        # Blocks that fit the cache (9 frames; Participative Compression's 21) are the full
        # cache's frames exactly.
        fits = 21 if policy in ("participative", "deep_forcing") else 9
        assert all(float(r["rel_l2"]) == 0.0 for r in rows[:fits]), policy
        assert all(float(r["rel_l2"]) > 0.0 for r in rows[fits:]), policy
        assert {int(r["capacity"]) for r in rows} == {fits}
    store = xr.open_zarr(folder / "window/layer0.zarr")
    seen = ~np.isnan(store["key_mass"].isel(step=0, head=0).values)  # [query frame, token]
    t = store.attrs["frame_seq_length"]
    assert seen[-1].sum() == 9 * t and seen[-1, -9 * t :].all()
    full = xr.open_zarr(folder / "full/layer0.zarr")
    assert (~np.isnan(full["key_mass"].isel(step=0, head=0).values[-1])).sum() == 42 * t
    summary = list(csv.DictReader(open(demo_run / "results/closed_loop/summary.csv")))
    assert [r["policy"] for r in summary] == policies
    for row in summary:
        if row["policy"] in ("participative", "deep_forcing"):
            # The 21-frame survey never overflows a cache of 21: no offline rows where it drops.
            assert int(row["evicting_from"]) == 21 and row["recall"] == ""
        else:
            assert 0 < float(row["recall"]) < 1 and int(row["evicting_from"]) == 9
    recall = pd.read_csv(demo_run / "results/policies/demo_a/eagle.csv")
    participative = recall[recall["policy"] == "participative"]
    assert len(participative) and np.allclose(participative["recall"], 1.0, atol=1e-5)
