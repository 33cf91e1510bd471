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

from sinkscope.analysis.policies import policy_table
from sinkscope.analysis.reduce import reduce_attention_store
from sinkscope.analysis.stores import open_attention_store
from sinkscope.cache_choices import KEY_KIND
from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.closed_loop import closed_loop, load_latents
from sinkscope.extraction.job import extract
from sinkscope.extraction.sampling import Geometry, rollout
from sinkscope.storage import decoded_attrs
from sinkscope.wan.rope import apply_rope, rope_angles, rotate_frames

from .conftest import make_tiny_model
from .test_capture import _write_inputs
from .test_model import reference_rope
from .test_tables import significant_digits
from .workflowtools import REPO, demo_copy, planned_jobs, snakemake

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


def _sink_distance(latents: torch.Tensor, sinks: int) -> list[float]:
    """LoL's diagnostic 1, written out: per frame the smallest L2 distance to a sink frame over
    the median of that over the frames past the sinks."""
    x = latents.double()
    frames = x.shape[1]
    dist = [min(float((x[:, f] - x[:, s]).norm()) for s in range(sinks)) for f in range(frames)]
    median = float(np.median(dist[sinks:]))
    return [float("nan") if f < sinks else d / median for f, d in enumerate(dist)]


def _loop(tmp_path, common, settings, name, policy, **kwargs):
    closed_loop(
        **common,
        settings={**settings, "policy": policy},
        latents_path=tmp_path / f"{name}.safetensors",
        table_path=tmp_path / f"{name}.csv",
        blocks_path=tmp_path / f"{name}.blocks.csv",
        progress=False,
        **kwargs,
    )
    with open(tmp_path / f"{name}.csv") as f:
        rows = list(csv.DictReader(f))
    with open(tmp_path / f"{name}.blocks.csv") as f:
        blocks = list(csv.DictReader(f))
    return rows, blocks


def test_closed_loop_job_writes_latents_and_its_tables(tmp_path):
    video = {"num_frames": 12, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}
    prompt, settings = _write_inputs(tmp_path, video=video)
    full = tmp_path / "full.safetensors"
    common = {"checkpoint_name": "tiny", "prompt_name": "p", "prompt_embeddings": prompt}
    rows_full, blocks_full = _loop(tmp_path, common, settings, "full", {"name": "full"})
    reference, meta = load_latents(full)
    assert reference.shape == (16, 12, 4, 6) and meta["policy"] == {"name": "full"}
    # The full cache has no deviation of its own; its sink distance is LoL's, sinks = block 0.
    assert all(r["rel_l2"] == "" and r["cosine"] == "" for r in rows_full)
    # It keeps every frame: no budget and no capacity (empty, not a cache of 0 frames).
    for table in (rows_full, blocks_full):
        assert {(r["policy"], r["budget"], r["capacity"]) for r in table} == {("full", "", "")}
    expected = _sink_distance(reference, 2)
    # Numbers carry CSV_SIGNIFICANT_DIGITS significant digits: 5e-6 of themselves at most.
    np.testing.assert_allclose(
        [float(r["sink_distance"] or "nan") for r in rows_full], expected, 5e-6
    )
    assert all(significant_digits(r["sink_distance"]) <= 6 for r in rows_full)
    assert [(int(b["first_frame"]), int(b["query_position"])) for b in blocks_full] == [
        (f, f) for f in range(0, 12, 2)
    ]
    assert {int(b["sink_position"]) for b in blocks_full} == {0}

    rows = {}
    for name, policy in {
        "window": {"name": "window", "budget": 6},
        "covering": {"name": "top_c", "budget": 12, "recent_frames": 2},
    }.items():
        rows[name], _ = _loop(
            tmp_path, common, settings, name, policy, reference=full, sink_frames=1
        )
    window = rows["window"]
    assert [int(r["frame"]) for r in window] == list(range(12))
    assert [int(r["block"]) for r in window] == [f // 2 for f in range(12)]
    latents, _ = load_latents(tmp_path / "window.safetensors")
    x, ref = latents[:, 9].double(), reference[:, 9].double()
    assert {(r["budget"], r["capacity"]) for r in window} == {("6", "6")}
    rel_l2 = float((x - ref).norm() / ref.norm())
    assert float(window[9]["rel_l2"]) == pytest.approx(rel_l2, rel=5e-6)
    assert window[9]["rel_l2"] == f"{rel_l2:.6g}"
    cos = float((x * ref).sum() / (x.norm() * ref.norm()))
    assert float(window[9]["cosine"]) == pytest.approx(cos, rel=5e-6)
    assert all(float(r["rel_l2"]) == 0.0 for r in window[:6])
    assert all(float(r["rel_l2"]) > 1e-4 for r in window[6:])
    assert all(float(r["rel_l2"]) == 0.0 for r in rows["covering"])
    np.testing.assert_allclose(
        [float(r["sink_distance"] or "nan") for r in window], _sink_distance(latents, 1), 5e-6
    )

    # Without a reference: the same rollout, the diagnostics only.
    alone, _ = _loop(tmp_path, common, settings, "alone", {"name": "window", "budget": 6})
    assert all(r["rel_l2"] == "" for r in alone)
    assert [r["sink_distance"] for r in alone] == [
        r["sink_distance"]
        for r in _loop(tmp_path, common, settings, "w2", {"name": "window", "budget": 6})[0]
    ]

    with pytest.raises(ValueError, match="seed"):
        _loop(
            tmp_path,
            common,
            {**settings, "seed": 1},
            "x",
            {"name": "window", "budget": 6},
            reference=full,
        )
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "x.safetensors").exists()


def test_attention_captured_over_cache_slots_is_the_survey_of_the_same_rollout(tmp_path):
    """A full-cache closed loop captured over its cache's slots reduces to the frame dataset a
    survey of the same rollout gives; a windowed one holds only its window, labelled; top_c's
    per-head tokens are captured with the frame each came from."""
    video = {"num_frames": 8, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}
    prompt, settings = _write_inputs(tmp_path, video=video)
    settings["capture"]["survey_precision"] = "float32"  # as a store over slots keeps key_mass
    common = {"checkpoint_name": "tiny", "prompt_name": "p", "prompt_embeddings": prompt}
    stores = [tmp_path / "loop0.zarr", tmp_path / "loop1.zarr"]
    _loop(tmp_path, common, settings, "full", {"name": "full"}, layers=[0, 1], stores=stores)
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
        assert loop.attrs["key_axis"] == "slot" and "logit_mean_pooled" not in loop
        assert decoded_attrs(loop)["policy"] == {"name": "full"}
        reduce_attention_store(tmp_path / f"loop{layer}.zarr", tmp_path / f"f{layer}.zarr")
        reduce_attention_store(tmp_path / f"survey{layer}.zarr", tmp_path / f"s{layer}.zarr")
        got, want = (xr.open_zarr(tmp_path / f"{n}{layer}.zarr") for n in ("f", "s"))
        np.testing.assert_allclose(got["prob_mass"], want["prob_mass"], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(got["entropy"], want["entropy"])
        # The mean of the tokens' mean logits is the pooled mean logit (float32 products).
        np.testing.assert_allclose(got["logit_mean"], want["logit_mean"], rtol=0, atol=1e-5)
        # The key-token view is the survey's store, and the offline recall reads it as one.
        tokens = open_attention_store(tmp_path / f"loop{layer}.zarr", key_tokens=True)
        survey = open_attention_store(tmp_path / f"survey{layer}.zarr")
        for name in ("key_mass", "key_logit_mean"):
            np.testing.assert_array_equal(tokens[name].values, survey[name].values)
        options = {"budgets": [2, 4], "sinks": [0, 1], "recent_frames": 1, "capacity": 6}
        pd.testing.assert_frame_equal(
            policy_table(got.load(), tokens, **options),
            policy_table(want.load(), survey, **options),
            check_exact=False,
            atol=1e-6,
        )

    _loop(
        tmp_path,
        common,
        settings,
        "w",
        {"name": "window", "budget": 4},
        layers=[0],
        stores=[tmp_path / "w0.zarr"],
    )
    store = xr.open_zarr(tmp_path / "w0.zarr")
    assert store.sizes["key_slot"] == 4 * T
    frames = store["slot_frame"].values  # [step, head, query frame, slot]
    # The last block (frames 6, 7) sees frames 4..7 in cache order; the first only its own.
    assert (frames[:, :, 6:8] == np.repeat(np.arange(4, 8), T)).all()
    assert (frames[:, :, 0:2, : 2 * T] == np.repeat(np.arange(2), T)).all()
    assert (frames[:, :, 0:2, 2 * T :] == -1).all()
    assert np.isnan(store["key_mass"].values[:, :, 0:2, 2 * T :]).all()
    assert (store["slot_position"].values[:, :, 6:8] == np.repeat(np.arange(4, 8), T)).all()
    kinds = store["slot_kind"].values[0, 0, 6]
    assert (kinds[: 2 * T] == KEY_KIND["recent"]).all() and (
        kinds[2 * T :] == KEY_KIND["own"]
    ).all()
    reduce_attention_store(tmp_path / "w0.zarr", tmp_path / "wf.zarr")
    mass = xr.open_zarr(tmp_path / "wf.zarr")["prob_mass"].values
    last = mass[:, :, 6:8]
    assert np.isnan(last[..., :4]).all() and not np.isnan(last[..., 4:]).any()
    np.testing.assert_allclose(np.nansum(last, axis=-1), 1.0, atol=1e-5)

    _loop(
        tmp_path,
        common,
        settings,
        "c",
        {"name": "top_c", "budget": 6, "recent_frames": 2},
        layers=[0],
        stores=[tmp_path / "c0.zarr"],
    )
    store = xr.open_zarr(tmp_path / "c0.zarr")
    frames, kinds = store["slot_frame"].values, store["slot_kind"].values
    last = frames[0, :, 6]  # [head, slot]: each head's own choice of history tokens
    chosen = kinds[0, :, 6] == KEY_KIND["chosen"]
    assert chosen.sum(axis=1).tolist() == [2 * T] * last.shape[0]
    assert (last[chosen] < 4).all() and (last[~chosen & (last >= 0)] >= 4).all()
    assert any(
        not np.array_equal(store["slot_token"].values[0, 0, 6], store["slot_token"].values[0, h, 6])
        for h in range(1, last.shape[0])
    )
    np.testing.assert_allclose(np.nansum(store["key_mass"].values, axis=-1), 1.0, atol=1e-5)


def test_the_demo_runs_the_closed_loop(demo_run):
    """The embedded default: 42 frames of demo_a / eagle under each policy at budget 9 (and
    Deep Forcing's Participative Compression cache of 21), attention captured over the cache's
    slots in every rollout (the token-level ones too), a summary beside the offline recall."""
    folder = demo_run / "results/closed_loop/demo_a/eagle"
    reference, meta = load_latents(folder / "full.safetensors")
    assert reference.shape[1] == 42 and meta["policy"] == {"name": "full"}
    policies = ["window", "sink_window", "deep_forcing", "top_c"]
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
    # The full cache keeps every frame: no budget, no capacity, in its tables and blocks.csv.
    blocks = pd.read_csv(demo_run / "results/closed_loop/blocks.csv", dtype=str)
    for table in (pd.read_csv(folder / "full.csv", dtype=str), blocks[blocks["policy"] == "full"]):
        assert len(table) and table[["budget", "capacity"]].isna().all().all()
    store = xr.open_zarr(folder / "window/layer0.zarr")
    t = store.attrs["frame_seq_length"]
    # Over the cache's slots: 9 frames of keys, the last query frame saw frames 33..41.
    assert store.sizes["key_slot"] == 9 * t
    frames = store["slot_frame"].isel(step=0, head=0).values  # [query frame, slot]
    assert (frames[-1] == np.repeat(np.arange(33, 42), t)).all()
    full = xr.open_zarr(folder / "full/layer0.zarr")
    assert full.sizes["key_slot"] == 42 * t
    assert (~np.isnan(full["key_mass"].isel(step=0, head=0).values[-1])).sum() == 42 * t
    # Every rollout is captured, the token-level ones too.
    for policy in policies:
        assert (folder / policy / "layer0.zarr" / "zarr.json").is_file(), policy
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
    # all it saw, from the survey's float16 key mass: within 2^-11 of 1 (docs/DATA.md)
    assert len(participative) and np.allclose(participative["recall"], 1.0, atol=2.0**-11)


def test_the_long_video_demo_runs_without_a_reference(demo_run, tmp_path):
    """examples/demo/long_video.yaml, shortened to 21 frames: the position policies and the
    window family rolled out without a full-cache rollout, captured over their caches' slots,
    their diagnostics in blocks.csv, the deviation empty, the collapse figure drawn; nothing
    else of the demo reruns but the explorer."""
    root = demo_copy(demo_run, tmp_path / "long")
    (root / "examples/demo").mkdir(parents=True, exist_ok=True)
    example = (REPO / "examples/demo/long_video.yaml").read_text()
    (root / "examples/demo/long_video.yaml").write_text(example)
    (root / "short.yaml").write_text("closed_loop: {num_frames: 21}\n")
    args = ("--configfile", "examples/demo/long_video.yaml", "short.yaml")
    jobs = {rule for rule, _ in planned_jobs(root, *args)}
    # the explorer shows the closed loop too
    assert jobs == {"closed_loop", "closed_loop_summary", "explorer", "all"}
    folder = root / "results/closed_loop/demo_a/eagle"
    demo_full = (folder / "full.safetensors").stat().st_mtime_ns  # the demo's, left as it was
    snakemake(root, *args)
    assert (folder / "full.safetensors").stat().st_mtime_ns == demo_full
    policies = ["window", "sink_window", "deep_sink", "relative", "replay", "head_jitter"]
    policies.append("logit_bias")
    blocks = pd.read_csv(root / "results/closed_loop/blocks.csv")
    assert sorted(set(blocks["policy"])) == sorted(policies)
    later = blocks[blocks["block"] > 0]  # the first block has no share: it sees only itself
    assert later["sink_share"].between(0, 1).all() and set(blocks["layer"]) == {0}
    assert blocks[blocks["block"] == 0]["sink_share"].isna().all()
    summary = pd.read_csv(root / "results/closed_loop/summary.csv")
    assert summary["rel_l2_mean"].isna().all()
    positions = pd.read_csv(folder / "relative.blocks.csv")
    assert positions["query_position"].max() == 9  # B - 3: Infinity-RoPE's bounded positions
    assert (root / "results/figures/compare/closed_loop_collapse.svg").stat().st_size > 10_000
    store = xr.open_zarr(folder / "replay/layer0.zarr")
    assert (store["slot_kind"].values == KEY_KIND["replayed"]).any()


def test_a_rolling_closed_loop_over_slots_is_its_survey(tmp_path):
    """Under the rolling sampler: the full closed loop (Rolling Forcing's own cache) captured
    over its slots reduces to the survey of the same rollout, key versions included; deep_sink
    turned as Rolling Forcing turns its anchor (rerope, S = 3, B = 21) is that cache, bit for bit;
    a smaller budget changes the video."""
    video = {"num_frames": 24, "frames_per_block": 3, "latent_height": 4, "latent_width": 4}
    prompt, settings = _write_inputs(tmp_path, video=video)
    sampler = {**settings["sampler"], "kind": "rolling", "steps": [1000, 800, 600, 400, 200]}
    settings = {**settings, "sampler": sampler}
    common = {"checkpoint_name": "tiny", "prompt_name": "p", "prompt_embeddings": prompt}
    _loop(
        tmp_path,
        common,
        settings,
        "full",
        {"name": "full"},
        layers=[0],
        stores=[tmp_path / "l.zarr"],
    )
    extract(
        **common,
        layers=[0],
        outputs=[tmp_path / "s.zarr"],
        settings=settings,
        store="attention",
        progress=False,
    )
    assert xr.open_zarr(tmp_path / "l.zarr").sizes["key_slot"] == 21 * 4
    reduce_attention_store(tmp_path / "l.zarr", tmp_path / "lf.zarr")
    reduce_attention_store(tmp_path / "s.zarr", tmp_path / "sf.zarr")
    got, want = (xr.open_zarr(tmp_path / name) for name in ("lf.zarr", "sf.zarr"))
    np.testing.assert_allclose(got["prob_mass"], want["prob_mass"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got["key_version"], want["key_version"])
    assert (want["key_version"].values == 1).any()  # the anchor
    full, _ = load_latents(tmp_path / "full.safetensors")
    turned = {"name": "deep_sink", "budget": 21, "sink_frames": 3, "turn": "rerope"}
    rows, blocks = _loop(
        tmp_path, common, settings, "ds", turned, reference=tmp_path / "full.safetensors"
    )
    assert torch.equal(load_latents(tmp_path / "ds.safetensors")[0], full)
    assert all(float(r["rel_l2"]) == 0.0 for r in rows)
    # The anchor sits just before the working cache: block 7's window starts at 9 after 3 clean
    # frames, so the anchor is at 3; before, at 0 (or frame 0 is in the window itself).
    assert [int(b["query_position"]) for b in blocks] == list(range(0, 24, 3))
    assert [int(b["sink_position"]) for b in blocks] == [0] * 7 + [3]
    window = {"name": "window", "budget": 18}
    rows, _ = _loop(
        tmp_path, common, settings, "w", window, reference=tmp_path / "full.safetensors"
    )
    assert max(float(r["rel_l2"]) for r in rows) > 1e-4
