"""The survey capture and the attention store (Contract 4) against float64 brute force from the
model's own q and k, and against the token path (Contract 1) of the same rollout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xarray as xr

from sinkscope.analysis.reduce import reduce_attention_store, reduce_token_store
from sinkscope.analysis.stores import open_frame_dataset
from sinkscope.extraction.attention_store import AttentionStoreWriter, prepare_call
from sinkscope.extraction.capture import softmax_reductions
from sinkscope.extraction.job import extract
from sinkscope.extraction.store import partial_path
from sinkscope.frames import (
    attention_chunk_frames,
    attention_store_bytes,
    attention_store_disk_bytes,
    block_starts,
    token_store_bytes,
    visible_frames,
)
from sinkscope.storage import decoded_attrs
from sinkscope.wan.config import WanConfig
from sinkscope.wan.demo import DEMO_MODEL

from .conftest import TINY, TINY_GEOMETRY, make_tiny_model
from .test_capture import T, _calls_with_keys, _capture_rollout, _write_inputs
from .test_reduce import brute_force


def _brute_softmax(q: np.ndarray, k: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 softmax rows of q [R, D] against k [M, D]: (mean probability per key, entropies)."""
    logits = (q @ k.T) * scale
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return p.mean(axis=0), -(p * np.log(p)).sum(axis=1)


@pytest.mark.parametrize("row_chunk", [None, 1, 7, 64])
def test_softmax_reductions_equal_float64_brute_force(row_chunk):
    g = torch.Generator().manual_seed(3)
    # Logits up to ~60: exp without the max shift would overflow float32 (e^88).
    q = torch.randn(50, 16, generator=g) * 6
    k = torch.randn(300, 16, generator=g) * 6
    key_mass, entropy = softmax_reductions(q, k, 0.25, row_chunk)
    expected_mass, expected_entropy = _brute_softmax(q.double().numpy(), k.double().numpy(), 0.25)
    assert key_mass.dtype == torch.float32 and key_mass.shape == (300,)
    np.testing.assert_allclose(key_mass.numpy(), expected_mass, rtol=0, atol=1e-7)
    np.testing.assert_allclose(entropy.numpy(), expected_entropy, rtol=0, atol=1e-5)
    assert abs(float(key_mass.sum()) - 1) < 1e-5
    assert expected_entropy.min() < 0.5 < expected_entropy.max()  # peaked and flat rows both


def _brute_attention(calls, local_attn_size, sink_size):
    """key_mass [5, H, F, N], entropy [5, H, F] and key_logit_mean [5, H, F, N] in float64 from
    the recorded q and k."""
    seen = visible_frames(TINY_GEOMETRY.block_sizes, local_attn_size, sink_size)
    num_frames = TINY_GEOMETRY.num_frames
    heads = TINY.num_heads
    key_mass = np.full((5, heads, num_frames, num_frames * T), np.nan)
    key_logit_mean = np.full_like(key_mass, np.nan)
    entropy = np.full((5, heads, num_frames), np.nan)
    scale = 1 / math.sqrt(TINY.head_dim)
    for start, size, step, q, keys in _calls_with_keys(calls):
        for i in range(size):
            frame = start + i
            visible = np.flatnonzero(seen[frame])
            k_all = np.concatenate([keys[f] for f in visible])
            columns = np.concatenate([np.arange(f * T, (f + 1) * T) for f in visible])
            for head in range(heads):
                mass, entropies = _brute_softmax(
                    q[i * T : (i + 1) * T, head], k_all[:, head], scale
                )
                key_mass[step, head, frame, columns] = mass
                entropy[step, head, frame] = entropies.mean()
                logits = q[i * T : (i + 1) * T, head] @ k_all[:, head].T * scale
                key_logit_mean[step, head, frame, columns] = logits.mean(axis=0)
    return key_mass, entropy, key_logit_mean


@pytest.mark.parametrize(("local_attn_size", "sink_size"), [(-1, 0), (4, 1)], ids=["full", "sink"])
def test_the_value_side_equals_float64_brute_force(
    tmp_path, tiny_model, tiny_text, local_attn_size, sink_size
):
    """value_norm and mass_value_norm of the store and its frame dataset against float64 from
    the layer's own v: a cached frame's values are those of its block's cache pass, the own
    block's those of the call; mass x ||v|| from the brute-force key mass."""
    window = dict(local_attn_size=local_attn_size, sink_size=sink_size)
    attention = tmp_path / "attention.zarr"
    calls = _capture_rollout(
        tiny_model, tiny_text, attention, 1, store="attention", values=True, **window
    )
    key_mass, _, _ = _brute_attention([(q, k) for q, k, _ in calls], **window)
    seen = visible_frames(TINY_GEOMETRY.block_sizes, local_attn_size, sink_size)
    num_frames, heads = TINY_GEOMETRY.num_frames, TINY.num_heads
    value_norm = np.full((5, heads, num_frames, num_frames), np.nan)
    mass_value_norm = np.full_like(value_norm, np.nan)
    clean = {}  # frame -> ||v|| [T, heads] of its block's cache pass
    sizes = TINY_GEOMETRY.block_sizes
    for block, start in enumerate(block_starts(sizes)):
        start, size = int(start), sizes[block]
        for step in range(5):
            v = calls[block * 5 + step][2].double().numpy().reshape(-1, heads, TINY.head_dim)
            norms = np.linalg.norm(v, axis=-1)  # [tokens, heads]
            own = {start + i: norms[i * T : (i + 1) * T] for i in range(size)}
            frames = {**clean, **own}
            for frame in range(start, start + size):
                for key_frame in np.flatnonzero(seen[frame]):
                    per_token = frames[key_frame].T  # [heads, T]
                    mass = key_mass[step, :, frame, key_frame * T : (key_frame + 1) * T]
                    value_norm[step, :, frame, key_frame] = per_token.mean(axis=1)
                    mass_value_norm[step, :, frame, key_frame] = (mass * per_token).sum(axis=1)
            if step == 4:
                clean.update(own)

    stored = xr.open_zarr(attention, chunks=None)
    for name, expected in (("value_norm", value_norm), ("mass_value_norm", mass_value_norm)):
        values = stored[name].values
        np.testing.assert_array_equal(np.isnan(values), np.isnan(expected))
        np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)
    reduce_attention_store(attention, tmp_path / "frames.zarr")
    frames = open_frame_dataset(tmp_path / "frames.zarr")
    for name, expected in (("value_norm", value_norm), ("mass_value_norm", mass_value_norm)):
        assert frames[name].dims == ("step", "head", "query_frame", "key_frame")
        np.testing.assert_allclose(frames[name].values, expected, rtol=1e-5, atol=1e-6)
    # The norms differ between keys: a mass-only (or norm-only) result would not pass.
    assert np.nanmax(value_norm) > 1.05 * np.nanmin(value_norm)


@pytest.mark.parametrize(("local_attn_size", "sink_size"), [(-1, 0), (4, 1)], ids=["full", "sink"])
def test_both_stores_reduce_to_the_float64_brute_force(
    tmp_path, tiny_model, tiny_text, local_attn_size, sink_size
):
    window = dict(local_attn_size=local_attn_size, sink_size=sink_size)
    attention, tokens = tmp_path / "attention.zarr", tmp_path / "tokens.zarr"
    calls = _capture_rollout(tiny_model, tiny_text, attention, 1, store="attention", **window)
    _capture_rollout(make_tiny_model(), tiny_text, tokens, 1, **window)
    key_mass, entropy, key_logit_mean = _brute_attention(calls, **window)

    stored = xr.open_zarr(attention)  # plain xarray opens Contract 4
    assert stored.key_mass.dims == ("step", "head", "query_frame", "key_token")
    np.testing.assert_array_equal(np.isnan(stored.key_mass.values), np.isnan(key_mass))
    np.testing.assert_allclose(stored.key_mass.values, key_mass, rtol=0, atol=1e-6)
    np.testing.assert_allclose(stored.entropy.values, entropy, rtol=0, atol=1e-5)
    assert stored.key_logit_mean.dims == stored.key_mass.dims
    np.testing.assert_array_equal(np.isnan(stored.key_logit_mean.values), np.isnan(key_mass))
    np.testing.assert_allclose(stored.key_logit_mean.values, key_logit_mean, rtol=1e-6, atol=1e-6)

    reduce_attention_store(attention, tmp_path / "a_frames.zarr")
    reduce_token_store(tokens, tmp_path / "t_frames.zarr")
    from_attention = open_frame_dataset(tmp_path / "a_frames.zarr")
    from_tokens = open_frame_dataset(tmp_path / "t_frames.zarr")
    assert from_attention.attrs["store"] == "attention" and from_tokens.attrs["store"] == "tokens"

    num_frames = TINY_GEOMETRY.num_frames
    prob_mass = key_mass.reshape(5, TINY.num_heads, num_frames, num_frames, T).sum(axis=-1)
    np.testing.assert_allclose(from_attention.prob_mass.values, prob_mass, rtol=0, atol=1e-5)
    np.testing.assert_allclose(from_attention.entropy.values, entropy, rtol=0, atol=1e-5)
    # The token path against a float64 brute force over its own (float16) logits.
    logits = xr.open_zarr(tokens, chunks=None).logits.values.astype(np.float64)
    expected = brute_force(logits, T)
    for name in ("prob_mass", "entropy"):
        np.testing.assert_allclose(from_tokens[name].values, expected[name], rtol=0, atol=1e-5)
    # Both paths, one rollout: probabilities within float16 rounding; logit_mean, one exact mean
    # by two float32 routes ((mean q).(mean k), the mean of key_logit_mean), within float32's.
    for name in ("prob_mass", "entropy"):
        np.testing.assert_allclose(
            from_attention[name].values, from_tokens[name].values, rtol=0, atol=2e-3
        )
    np.testing.assert_array_equal(
        np.isnan(from_attention.logit_mean.values), np.isnan(from_tokens.logit_mean.values)
    )
    np.testing.assert_allclose(
        from_attention.logit_mean.values, from_tokens.logit_mean.values, rtol=1e-6, atol=1e-6
    )
    if sink_size:
        seen = visible_frames(TINY_GEOMETRY.block_sizes, **window)
        assert not seen[5].all() and seen[5, 0]  # the window really evicts, the sink stays
        assert (np.isnan(from_attention.prob_mass.values) == ~seen[None, None]).all()


def _demo_inputs(tmp_path):
    """The embedded default's model and frame geometry (config.yaml, wan/demo.py), 6 of its 21
    latent frames (2 blocks of 3), which keeps the test short."""
    cfg = WanConfig.from_dict(DEMO_MODEL, source="demo model")
    video = {"num_frames": 6, "frames_per_block": 3, "latent_height": 8, "latent_width": 12}
    return _write_inputs(tmp_path, make_tiny_model(seed=1, cfg=cfg), video)


def test_on_the_demo_both_paths_give_the_same_frame_dataset(tmp_path):
    prompt, settings = _demo_inputs(tmp_path)
    settings["capture"]["passes"] = [0, 4]  # a denoising step and the cache pass stand for all
    common = dict(
        checkpoint_name="demo_a",
        prompt_name="p",
        prompt_embeddings=prompt,
        settings=settings,
        progress=False,
    )
    layers = [0, 2]
    extract(layers=layers, outputs=[tmp_path / f"t/layer{i}.zarr" for i in layers], **common)
    extract(
        layers=layers,
        outputs=[tmp_path / f"a/layer{i}.zarr" for i in layers],
        store="attention",
        **common,
    )
    for layer in layers:
        reduce_token_store(tmp_path / f"t/layer{layer}.zarr", tmp_path / f"tf{layer}.zarr")
        reduce_attention_store(tmp_path / f"a/layer{layer}.zarr", tmp_path / f"af{layer}.zarr")
        tokens = open_frame_dataset(tmp_path / f"tf{layer}.zarr")
        attention = open_frame_dataset(tmp_path / f"af{layer}.zarr")
        for name in ("prob_mass", "entropy"):
            a, t = attention[name].values, tokens[name].values
            np.testing.assert_array_equal(np.isnan(a), np.isnan(t))
            assert np.nanmax(np.abs(a - t)) <= 2e-3, (layer, name, np.nanmax(np.abs(a - t)))
        a, t = attention.logit_mean.values, tokens.logit_mean.values
        np.testing.assert_array_equal(np.isnan(a), np.isnan(t))
        np.testing.assert_allclose(a, t, rtol=1e-6, atol=1e-6)  # as in the test above
        # The same Contract 2 but for the store each came from; the survey adds the value side.
        assert set(attention.variables) == set(tokens.variables) | {"value_norm", "mass_value_norm"}
        per_job = {
            "store",
            "key_axis",
            "tokens",
            "started_at",
            "completed_at",
            "gpu",
            "attributes_crc32",
        }
        assert {k: v for k, v in decoded_attrs(attention).items() if k not in per_job} == {
            k: v for k, v in decoded_attrs(tokens).items() if k not in per_job
        }
        # The rollout's attention is far from uniform (else any two reductions would agree).
        assert np.nanmax(attention.prob_mass.values) > 0.2


# Self-Forcing's two block layouts (no shorter last block): blocks of 2, and a lone first frame
# before them, whose key_mass chunks are one query frame (`attention_chunk_frames`).
@pytest.mark.parametrize("precision", ["float16", "float32"])
@pytest.mark.parametrize("sizes", [[2, 2, 2], [1, 2, 2]], ids=["blocks", "lone-first-frame"])
def test_attention_store_is_small_and_its_disk_bound_holds(tmp_path, sizes, precision):
    # Real geometry: 21 frames of 1560 tokens, 12 heads, 5 passes; the 7 blocks of 3 see 252 of
    # the 441 frame pairs.
    real = {"num_passes": 5, "num_heads": 12, "num_frames": 21, "frame_seq_length": 1560}
    raw = attention_store_bytes(**real)
    visible = int(visible_frames([3] * 7).sum())
    small = 5 * 12 * (21 + 4 * 21 * 21) * 4  # entropy; per frame pair four float32 arrays
    assert visible == 252
    assert attention_store_bytes(**real, visible_tiles=visible, precision="float16") == (
        5 * 252 * 1560 * (12 * 2 + 4) + small  # float16 mass per head, float32 head-summed logits
    )
    # Issue 44: at most 2.5 GB on disk per prompt for 30 layers, by default.
    survey = 30 * attention_store_disk_bytes(
        **real, frames_per_block=3, visible_tiles=visible, precision="float16"
    )
    assert survey <= 2.5e9
    tokens = token_store_bytes(
        num_passes=5,
        num_heads=12,
        frame_seq_length=1560,
        sizes=[3] * 7,
        local_attn_size=-1,
        sink_size=0,
    )
    # key_mass and key_logit_mean float32 per key token of the video; entropy; per frame pair
    # the pooled logits, prob_mass_pooled, value_norm and mass_value_norm.
    assert raw == 2 * 5 * 12 * 21 * 21 * 1560 * 4 + small
    assert raw / tokens < 0.01
    # The bound holds for incompressible key mass on a small geometry.
    num_frames, chunk_frames = sum(sizes), attention_chunk_frames(sizes)
    writer = AttentionStoreWriter(
        tmp_path / "s.zarr",
        num_heads=2,
        num_frames=num_frames,
        frame_seq_length=8,
        frames_per_block=chunk_frames,
        timesteps=[1000.0, 0.0],
        pass_kinds=["denoise", "cache"],
        attrs={"layer": 0},
        precision=precision,
    )
    rng = np.random.default_rng(0)
    with writer:
        for step in range(2):
            for start, size in zip(block_starts(sizes), sizes, strict=True):
                start = int(start)
                keys = np.arange(start + size)
                mass = rng.random((2, size, len(keys) * 8)).astype(np.float32)
                logits = rng.standard_normal(mass.shape).astype(np.float32)
                writer.write_block(step, start, keys, mass, rng.random((2, size)), logits)
    used = sum(p.stat().st_size for p in (tmp_path / "s.zarr").rglob("*") if p.is_file())
    bound = attention_store_disk_bytes(
        num_passes=2,
        num_heads=2,
        num_frames=num_frames,
        frame_seq_length=8,
        frames_per_block=chunk_frames,
        visible_tiles=int(visible_frames(sizes).sum()),
        precision=precision,
    )
    assert 0 < used <= bound
    assert not partial_path(tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("precision", ["float16", "float32"])
def test_what_a_call_hands_its_store_is_what_numpy_makes_of_its_rows(precision):
    """prepare_call (run on the capture's device) against numpy on the same float32 rows, loop by
    loop: the stored mass (scaled by 2^15 and rounded once, or as is), the keys' mean logits
    (summed over the heads in order, or per head), and per key frame the float64 sums of the
    mass, of the logits (a mean) and of mass x ||v||, and the mean ||v||."""
    heads, frames, key_frames, t = 3, 2, 4, 5
    rng = np.random.default_rng(7)
    mass = rng.random((heads, frames, key_frames * t), dtype=np.float32) / (key_frames * t)
    mass[0, 0, :3] = np.float32(2.0**-30)  # tiny masses: float16 would lose them unscaled
    logits = rng.standard_normal((heads, frames, key_frames * t), dtype=np.float32)
    norms = rng.random((heads, key_frames * t), dtype=np.float32) + 0.5
    prepared = prepare_call(
        torch.from_numpy(mass), torch.from_numpy(logits), torch.from_numpy(norms), t, precision
    )
    stored_mass, stored_logits, mass_pooled, logit_pooled, norm_pooled, mass_norm = (
        value.numpy() for value in prepared
    )
    if precision == "float16":
        assert stored_mass.dtype == np.float16
        expected = (mass * np.float32(2.0**15)).astype(np.float16)
        np.testing.assert_array_equal(stored_mass.view(np.uint16), expected.view(np.uint16))
        assert (stored_mass[0, 0, :3] > 0).all()
        summed = logits[0].copy()
        for head in range(1, heads):
            summed += logits[head]
        np.testing.assert_array_equal(stored_logits, summed)
    else:
        np.testing.assert_array_equal(stored_mass, mass)
        np.testing.assert_array_equal(stored_logits, logits)
    for head in range(heads):
        for frame in range(key_frames):
            keys = slice(frame * t, (frame + 1) * t)
            assert norm_pooled[head, frame] == pytest.approx(
                math.fsum(norms[head, keys].astype(np.float64)) / t, rel=1e-15
            )
            for query in range(frames):
                row = (head, query, keys)
                assert mass_pooled[head, query, frame] == pytest.approx(
                    math.fsum(mass[row].astype(np.float64)), rel=1e-15
                )
                assert logit_pooled[head, query, frame] == pytest.approx(
                    math.fsum(logits[row].astype(np.float64)) / t, rel=1e-14
                )
                products = (mass[row] * norms[head, keys]).astype(np.float64)  # float32 products
                assert mass_norm[head, query, frame] == pytest.approx(
                    math.fsum(products), rel=1e-15
                )


def test_a_float16_survey_agrees_with_the_float32_one(tmp_path):
    """Issue 44: the default float16 store, against the float32 store of the same rollout (the
    demo model, 2 blocks, every pass). Frame datasets and their statistics: the same numbers
    (prob_mass comes from the float32 mass in both). key_mass: each value within float16's
    rounding, 2^-11 of itself (2^-40 absolute in its subnormal range). Recall of every policy:
    within 3 x 2^-11 (docs/DATA.md derives it). And the per-key bytes: (2 H + 4) / 8 H of the
    float32 store's."""
    from sinkscope.analysis.policies import policy_table
    from sinkscope.analysis.stats import frame_statistics
    from sinkscope.analysis.stores import open_attention_store

    prompt, settings = _demo_inputs(tmp_path)
    stores, frames, tables, sizes = {}, {}, {}, {}
    for precision in ("float16", "float32"):
        settings["capture"]["survey_precision"] = precision
        stores[precision] = tmp_path / precision / "layer0.zarr"
        extract(
            layers=[0],
            outputs=[stores[precision]],
            store="attention",
            checkpoint_name="demo_a",
            prompt_name="p",
            prompt_embeddings=prompt,
            settings=settings,
            progress=False,
        )
        reduce_attention_store(stores[precision], tmp_path / f"{precision}.frames.zarr")
        frames[precision] = open_frame_dataset(tmp_path / f"{precision}.frames.zarr")
        opened = open_attention_store(stores[precision])
        tables[precision] = policy_table(
            frames[precision],
            opened,
            budgets=[3, 4, 5, 6],
            sinks=[0, 1],
            recent_frames=1,
            capacity=5,
            reuse_cap=2,
        )
        # the per-key arrays' bytes (the small arrays and metadata are the same in both)
        sizes[precision] = sum(
            p.stat().st_size
            for name in ("key_mass", "key_logit_mean", "key_logit_head_sum")
            for p in (stores[precision] / name).rglob("*")
            if p.is_file()
        )
    half, full = (open_attention_store(stores[p]) for p in ("float16", "float32"))
    assert half.key_mass.encoding["dtype"] == np.float16 and "key_logit_mean" not in half
    exact, rounded = full.key_mass.values, half.key_mass.values
    np.testing.assert_array_equal(np.isnan(rounded), np.isnan(exact))
    seen = ~np.isnan(exact)
    error = np.abs(rounded[seen] - exact[seen])
    assert (error <= 2.0**-11 * np.abs(exact[seen]) + 2.0**-40).all()
    assert error.max() > 0  # float16 rounded something: the check above can fail
    np.testing.assert_array_equal(
        half.key_logit_head_sum.values, full.key_logit_mean.values.sum(axis=1)
    )
    for name in ("prob_mass", "entropy", "logit_mean", "value_norm", "mass_value_norm"):
        np.testing.assert_array_equal(frames["float16"][name], frames["float32"][name])
    for query in ("last_block", "each_block"):
        a, b = (frame_statistics(frames[p], query=query) for p in ("float16", "float32"))
        assert a.equals(b)
    keys = [c for c in tables["float32"].columns if c != "recall"]
    merged = tables["float16"].merge(tables["float32"], on=keys, suffixes=("_16", "_32"))
    assert len(merged) == len(tables["float32"]) == len(tables["float16"])
    assert {"participative", "top_c", "top_c_oracle"} <= set(merged["policy"])
    difference = (merged["recall_16"] - merged["recall_32"]).abs()
    assert difference.max() <= 3 * 2.0**-11 + 1e-7
    # float16 mass per head and float32 logits summed over the heads, against float32 both (and
    # the same number of checksums, index entries and metadata files: 7 % of a 576-byte chunk)
    heads = half.sizes["head"]
    assert sizes["float16"] / sizes["float32"] <= (2 * heads + 4) / (8 * heads) * 1.1
