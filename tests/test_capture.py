"""Capture and token store (Contract 1) against logits recomputed from the model's own q and k."""

from __future__ import annotations

import json
import math
import os
import warnings

import numpy as np
import pytest
import torch
import xarray as xr

from sinkscope.extraction.attention_store import AttentionStoreWriter
from sinkscope.extraction.capture import LogitCapture
from sinkscope.extraction.job import extract
from sinkscope.extraction.sampling import SELF_FORCING, rollout
from sinkscope.extraction.store import TokenStoreWriter, partial_path
from sinkscope.frames import block_starts, visible_frames
from sinkscope.passes import resolve_passes
from sinkscope.wan.checkpoint import save_wan_model
from sinkscope.wan.text import save_prompt_embedding

from .conftest import TINY, TINY_GEOMETRY, make_tiny_model
from .test_model import reference_rope

T = TINY.tokens_per_frame(4, 6)
GRID_HW = (2, 3)
# What the reducer needs to know about a store (extract.py writes the full set).
STORE_ATTRS = {
    "frame_seq_length": T,
    "num_frames": 6,
    "block_sizes": [2, 2, 2],
    "layer": 1,
    "checkpoint": "tiny",
    "prompt": "p",
    "latent_grid": [6, *GRID_HW],
    "passes": [0, 1, 2, 3, 4],
    "passes_per_block": 5,
}


def _capture_rollout(
    model,
    text,
    path,
    layer,
    *,
    local_attn_size=-1,
    sink_size=0,
    tokens=True,
    store="tokens",
    values=False,
):
    """Roll out with the capture of one layer into a store of kind `store` (`tokens`, or an
    `attention` store, computed 4 query rows at a time so that a tile takes several chunks),
    recording that layer's pre-RoPE q and k (and with `values` its v: triples, not pairs)."""
    records = []
    attn = model.blocks[layer].self_attn
    handles = [
        attn.norm_q.register_forward_hook(lambda m, a, out: records.append(["q", out.clone()])),
        attn.norm_k.register_forward_hook(lambda m, a, out: records.append(["k", out.clone()])),
        attn.v.register_forward_hook(lambda m, a, out: records.append(["v", out.clone()])),
    ]
    passes = resolve_passes("all", 4)
    common = dict(
        num_heads=TINY.num_heads,
        num_frames=TINY_GEOMETRY.num_frames,
        frame_seq_length=T,
        timesteps=SELF_FORCING.pass_timesteps(),
        pass_kinds=SELF_FORCING.pass_kinds(),
        attrs=STORE_ATTRS,
    )
    if store == "attention":
        frames_per_block = TINY_GEOMETRY.frames_per_block
        writer = AttentionStoreWriter(path, frames_per_block=frames_per_block, **common)
    else:
        writer = TokenStoreWriter(path, tokens=tokens, **common)
    capture = LogitCapture({layer: writer}, passes, T, TINY.head_dim, softmax_rows=4)
    model.set_capture(capture, {layer})
    with writer:
        rollout(
            model,
            text,
            geometry=TINY_GEOMETRY,
            local_attn_size=local_attn_size,
            sink_size=sink_size,
            seed=2,
            on_pass=capture.begin_pass,
            progress=False,
        )
    model.set_capture(None)
    for h in handles:
        h.remove()
    # One q and one k per model call, in call order: calls[block * 5 + pass] = (q, k).
    qs = [r[1][0] for r in records if r[0] == "q"]
    ks = [r[1][0] for r in records if r[0] == "k"]
    if values:
        vs = [r[1][0] for r in records if r[0] == "v"]
        return list(zip(qs, ks, vs, strict=True))
    return list(zip(qs, ks, strict=True))


def _roped(x: torch.Tensor, start_frame: int, frames: int) -> np.ndarray:
    heads = x.reshape(x.shape[0], TINY.num_heads, TINY.head_dim).double().numpy()
    return reference_rope(heads, (frames, *GRID_HW), start_frame)


def _calls_with_keys(calls):
    """For each model call of the tiny rollout, in order: (first frame of its block, block size,
    step, its roped q [block tokens, H, D], roped keys by absolute frame). The cache holds the
    clean keys of each earlier block's cache pass, plus the call's own keys."""
    sizes = TINY_GEOMETRY.block_sizes
    clean_keys = {}
    for block, start in enumerate(block_starts(sizes)):
        start, size = int(start), sizes[block]
        for step in range(5):
            q_raw, k_raw = calls[block * 5 + step]
            roped_k = _roped(k_raw, start, size)
            own = {start + i: roped_k[i * T : (i + 1) * T] for i in range(size)}
            yield start, size, step, _roped(q_raw, start, size), {**clean_keys, **own}
            if step == 4:
                clean_keys.update(own)


@pytest.mark.parametrize(("local_attn_size", "sink_size"), [(-1, 0), (4, 2)], ids=["full", "sink"])
def test_stored_logits_equal_q_dot_k_over_sqrt_d(
    tmp_path, tiny_model, tiny_text, local_attn_size, sink_size
):
    layer = 1
    store = tmp_path / "layer1.zarr"
    calls = _capture_rollout(
        tiny_model, tiny_text, store, layer, local_attn_size=local_attn_size, sink_size=sink_size
    )
    seen = visible_frames(TINY_GEOMETRY.block_sizes, local_attn_size, sink_size)
    stored = xr.open_zarr(store, chunks=None).logits.values.astype(np.float64)
    n = TINY_GEOMETRY.num_frames * T
    expected = np.full((5, TINY.num_heads, n, n), np.nan)
    for start, size, step, q, keys in _calls_with_keys(calls):
        rows = slice(start * T, (start + size) * T)
        for key_frame in np.flatnonzero(seen[start]):
            cols = slice(key_frame * T, (key_frame + 1) * T)
            expected[step, :, rows, cols] = np.einsum(
                "qhd,khd->hqk", q, keys[key_frame]
            ) / math.sqrt(TINY.head_dim)
    np.testing.assert_array_equal(np.isnan(stored), np.isnan(expected))
    np.testing.assert_allclose(stored, expected, rtol=2e-3, atol=2e-3, equal_nan=True)
    # NaN exactly on the tiles a block-causal query cannot see (here checked per frame pair).
    tile_nan = np.isnan(stored).reshape(5, TINY.num_heads, 6, T, 6, T).all(axis=(3, 5))
    assert (tile_nan == ~seen[None, None]).all()


def test_store_is_contract_1(tmp_path, tiny_model, tiny_text):
    store = tmp_path / "layer0.zarr"
    _capture_rollout(tiny_model, tiny_text, store, 0)
    ds = xr.open_zarr(store)
    assert ds.logits.dims == ("step", "head", "query_token", "key_token")
    assert ds.logits.dtype == np.float16
    assert ds.logits.encoding["chunks"] == (1, 1, T, T)
    assert ds.logits.encoding["shards"] == (1, 1, T, 6 * T)
    np.testing.assert_allclose(ds.timestep.values, [1000, 937.5, 833.3333, 625, 0], rtol=1e-6)
    assert list(ds.pass_kind.values) == ["denoise"] * 4 + ["cache"]
    np.testing.assert_array_equal(ds.query_frame.values, np.repeat(np.arange(6), T))
    np.testing.assert_array_equal(ds.key_frame.values, np.repeat(np.arange(6), T))
    assert not partial_path(store).exists()


def test_failed_write_leaves_no_store(tmp_path):
    store = tmp_path / "layer0.zarr"
    with (
        pytest.raises(KeyError),
        TokenStoreWriter(
            store,
            num_heads=1,
            num_frames=2,
            frame_seq_length=2,
            timesteps=[0.0],
            pass_kinds=["cache"],
            attrs={},
        ) as writer,
    ):
        writer.write_row(0, 0, 0, np.zeros((1, 2, 2), np.float16), np.array([0]))
        raise KeyError("boom")
    assert not store.exists() and not partial_path(store).exists()


def _write_inputs(tmp_path, model=None, video=None):
    """A checkpoint of `model` (default: the tiny one), prompt embeddings and the extraction
    settings of `video` (default: 6 frames of 2 x 3 tokens in blocks of 2)."""
    model = model if model is not None else make_tiny_model(seed=4)
    cfg = model.config
    base = tmp_path / "ckpt"
    save_wan_model(model, base)
    prompt = tmp_path / "prompt.safetensors"
    embeds = torch.randn(cfg.text_len, cfg.text_dim, generator=torch.Generator().manual_seed(1))
    save_prompt_embedding(prompt, embeds, prompt="a test prompt", length=5)
    settings = {
        "checkpoint": {"base": str(base)},
        "sampler": {
            "steps": [1000, 750, 500, 250],
            "shift": 5.0,
            "warp": True,
            "local_attn_size": -1,
            "sink_size": 0,
        },
        "video": video
        or {"num_frames": 6, "frames_per_block": 2, "latent_height": 4, "latent_width": 6},
        "capture": {"passes": "all"},
        "seed": 42,
        "device": "cpu",
    }
    return prompt, settings


def _store_bytes(path):
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "zarr.json"
    }


def test_one_job_per_layer_and_one_job_for_all_layers_write_the_same_bytes(tmp_path):
    prompt, settings = _write_inputs(tmp_path)
    common = dict(
        checkpoint_name="tiny",
        prompt_name="p",
        prompt_embeddings=prompt,
        settings=settings,
        progress=False,
    )
    extract(layers=[0], outputs=[tmp_path / "a" / "layer0.zarr"], **common)
    extract(layers=[1], outputs=[tmp_path / "a" / "layer1.zarr"], **common)
    extract(
        layers=[0, 1],
        outputs=[tmp_path / "b" / "layer0.zarr", tmp_path / "b" / "layer1.zarr"],
        **common,
    )
    for layer in (0, 1):
        a = _store_bytes(tmp_path / "a" / f"layer{layer}.zarr")
        b = _store_bytes(tmp_path / "b" / f"layer{layer}.zarr")
        assert a.keys() == b.keys() and len(a) > 10
        assert all(a[k] == b[k] for k in a)
    meta = json.loads((tmp_path / "a" / "layer1.zarr" / "zarr.json").read_text())
    attrs = meta["attributes"]
    assert (
        attrs["layer"] == 1
        and attrs["checkpoint"] == "tiny"
        and attrs["prompt_text"] == "a test prompt"
    )
    assert attrs["frame_seq_length"] == T and attrs["block_sizes"] == [2, 2, 2]
    assert attrs["latent_grid"] == [6, 2, 3] and len(attrs["checkpoint_sha256"]) == 64
    # A different layer gives different logits: the comparison above is not vacuous.
    a0 = _store_bytes(tmp_path / "a" / "layer0.zarr")
    a1 = _store_bytes(tmp_path / "a" / "layer1.zarr")
    assert any(a0[k] != a1.get(k) for k in a0 if k.startswith("logits/c"))


def test_token_store_bytes_at_real_geometry():
    from sinkscope.frames import token_store_bytes

    # docs/DESIGN.md: 12 heads x sum_b 4680 x 4680 (b + 1) float16 = 14.7 GB per pass kind.
    one_pass = token_store_bytes(
        num_passes=1,
        num_heads=12,
        frame_seq_length=1560,
        sizes=[3] * 7,
        local_attn_size=-1,
        sink_size=0,
    )
    assert one_pass == 12 * sum(4680 * 4680 * (b + 1) for b in range(7)) * 2
    assert round(one_pass / 1e9, 1) == 14.7


def test_extraction_fails_early_without_disk_space(tmp_path, monkeypatch):
    import shutil

    prompt, settings = _write_inputs(tmp_path)
    # Claims live under the working directory: a folder of its own, so that no job of another
    # test (another xdist worker) holds one there.
    monkeypatch.chdir(tmp_path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    out = tmp_path / "out" / "layer0.zarr"
    with pytest.raises(OSError, match=r"out: 0\.00 GB free, 0\.00 GB of it claimed by 0 running"):
        extract(
            checkpoint_name="tiny",
            prompt_name="p",
            prompt_embeddings=prompt,
            layers=[0],
            outputs=[out],
            settings=settings,
            progress=False,
        )
    assert not out.exists() and not partial_path(out).exists()


def test_disk_bound_holds_for_incompressible_logits(tmp_path):
    """The space an extraction claims bounds what its store really occupies, even when the logits
    do not compress at all (random float16 bits), blocks, directories and metadata included."""
    from sinkscope.frames import token_store_disk_bytes
    from sinkscope.storage import disk_usage_bytes

    sizes, t, heads, steps = [2, 2, 2], 24, 2, [1000.0, 0.0]
    path = tmp_path / "store.zarr"
    seen = visible_frames(sizes)
    rng = np.random.default_rng(0)
    writer = TokenStoreWriter(
        path,
        num_heads=heads,
        num_frames=6,
        frame_seq_length=t,
        timesteps=steps,
        pass_kinds=["denoise", "cache"],
        attrs={"config": {"sampler": {"steps": [1000] * 50}}, "block_sizes": sizes},
    )
    with writer:
        for step in range(len(steps)):
            for head in range(heads):
                for frame in range(6):
                    keys = np.flatnonzero(seen[frame])
                    bits = rng.integers(0, 0x7C00, (len(keys), t, t), dtype=np.uint16)
                    writer.write_row(step, head, frame, bits.view(np.float16), keys)
    bound = token_store_disk_bytes(
        num_passes=len(steps),
        num_heads=heads,
        frame_seq_length=t,
        sizes=sizes,
        local_attn_size=-1,
        sink_size=0,
        block_size=os.statvfs(tmp_path).f_frsize,
    )
    used = disk_usage_bytes(path)
    assert 0 < used <= bound, (used, bound)


def test_jobs_on_one_filesystem_do_not_count_the_same_free_space(tmp_path, monkeypatch):
    """Two extractions, room for one: the second fails its check while the first still holds
    its claim, and gets the room once the first is done (or dead)."""
    import multiprocessing
    import shutil

    from sinkscope import storage

    ledger = tmp_path / "ledger"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1500))
    context = multiprocessing.get_context("fork")
    claimed, release = context.Event(), context.Event()

    def first_job():
        with storage.reserved_space(
            tmp_path / "a", 1000, writing=[tmp_path / "a" / "x.partial"], ledger=ledger
        ):
            claimed.set()
            release.wait(30)

    job = context.Process(target=first_job)
    job.start()
    try:
        assert claimed.wait(30)
        with pytest.raises(OSError, match=r"1 running jobs, but the outputs need up to") as err:
            with storage.reserved_space(tmp_path / "b", 1000, writing=[], ledger=ledger):
                pass
        assert str(ledger) in str(err.value)  # names the claim that holds the space
        with storage.reserved_space(tmp_path / "b", 400, writing=[], ledger=ledger):
            pass  # what is left after the first claim
    finally:
        release.set()
        job.join(30)
    with storage.reserved_space(tmp_path / "b", 1000, writing=[], ledger=ledger):
        assert len(list(ledger.glob("*.json"))) == 1  # its own
    assert not list(ledger.glob("*.json"))


def test_long_rolling_rollout_maps_slots_to_absolute_frames(tmp_path, tiny_text):
    """12 frames through a 6-frame window with 2 sink frames: NaN exactly where the frame-level
    simulation of the cache says a key frame was evicted or not yet written."""
    from sinkscope.extraction.sampling import Geometry

    geometry = Geometry(num_frames=12, frames_per_block=2, latent_height=4, latent_width=6)
    model = make_tiny_model(seed=5)
    passes = resolve_passes(["last", "cache"], 4)
    store = tmp_path / "layer0.zarr"
    writer = TokenStoreWriter(
        store,
        num_heads=TINY.num_heads,
        num_frames=12,
        frame_seq_length=T,
        timesteps=[625.0, 0.0],
        pass_kinds=["denoise", "cache"],
        attrs={},
    )
    capture = LogitCapture({0: writer}, passes, T, TINY.head_dim)
    model.set_capture(capture, {0})
    with writer:
        rollout(
            model,
            tiny_text,
            geometry=geometry,
            local_attn_size=6,
            sink_size=2,
            seed=0,
            on_pass=capture.begin_pass,
            progress=False,
        )
    logits = xr.open_zarr(store, chunks=None).logits.values
    tile_nan = np.isnan(logits).reshape(2, TINY.num_heads, 12, T, 12, T).all(axis=(3, 5))
    seen = visible_frames(geometry.block_sizes, 6, 2)
    assert (tile_nan == ~seen[None, None]).all()
    # The last block sees the 2 sink frames, the 2 frames before it, and itself: 6 frames.
    assert list(np.flatnonzero(seen[11])) == [0, 1, 8, 9, 10, 11]
    # Visible tiles are fully written (no stray NaN inside).
    tiles = logits.reshape(2, TINY.num_heads, 12, T, 12, T).transpose(0, 1, 2, 4, 3, 5)
    assert not np.isnan(tiles[:, :, seen]).any()


def test_pooled_frame_logits_equal_the_token_reduction(tmp_path, tiny_model, tiny_text):
    from sinkscope.analysis.reduce import reduce_token_store

    store = tmp_path / "layer1.zarr"
    _capture_rollout(tiny_model, tiny_text, store, 1, local_attn_size=4, sink_size=2)
    tokens = xr.open_zarr(store)
    pooled = tokens.logit_mean_pooled.values
    # Brute force over the stored float16 logits, in float64.
    stored = tokens.logits.values.astype(np.float64).reshape(5, TINY.num_heads, 6, T, 6, T)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN tiles: the unseen ones
        brute = np.nanmean(stored, axis=(3, 5))
    np.testing.assert_array_equal(np.isnan(brute), np.isnan(pooled))
    seen = ~np.isnan(pooled)
    rounding = 2.0**-11 * np.abs(stored[~np.isnan(stored)]).max()
    assert np.abs(brute[seen] - pooled[seen]).max() <= rounding
    reduce_token_store(store, tmp_path / "frames.zarr")  # cross-checks internally
    frames = xr.open_zarr(tmp_path / "frames.zarr")
    np.testing.assert_allclose(frames.logit_mean.values, pooled, atol=rounding, equal_nan=True)


def test_reducer_refuses_logits_that_disagree_with_the_pooled_ones(tmp_path, tiny_model, tiny_text):
    import zarr

    from sinkscope.analysis.reduce import reduce_token_store

    store = tmp_path / "layer1.zarr"
    _capture_rollout(tiny_model, tiny_text, store, 1)
    logits = zarr.open_array(str(store / "logits"), mode="r+")
    tile = logits[4, 0, 5 * T : 6 * T, 0:T]
    logits[4, 0, 5 * T : 6 * T, 0:T] = tile + np.float16(0.5)  # one tile of one head, shifted
    with pytest.raises(ValueError, match="differs from the pooled"):
        reduce_token_store(store, tmp_path / "frames.zarr")
    assert not (tmp_path / "frames.zarr").exists()


def test_frame_logits_without_tokens(tmp_path, tiny_model, tiny_text):
    from sinkscope.analysis.reduce import reduce_token_store
    from sinkscope.analysis.stats import frame_statistics

    with_tokens, without = tmp_path / "a.zarr", tmp_path / "b.zarr"
    _capture_rollout(tiny_model, tiny_text, with_tokens, 1)
    _capture_rollout(make_tiny_model(), tiny_text, without, 1, tokens=False)
    assert not (without / "logits").exists()
    pooled_a = xr.open_zarr(with_tokens).logit_mean_pooled.values
    pooled_b = xr.open_zarr(without).logit_mean_pooled.values
    np.testing.assert_array_equal(pooled_a, pooled_b)  # same model and seed, tokens or not
    reduce_token_store(without, tmp_path / "frames.zarr")
    frames = xr.open_zarr(tmp_path / "frames.zarr").load()
    np.testing.assert_array_equal(frames.logit_mean.values, pooled_b)
    assert np.isnan(frames.prob_mass.values).all() and np.isnan(frames.entropy.values).all()
    stats = frame_statistics(frames)
    logit_rows = stats[stats.measure == "logit_mean"]
    assert (
        logit_rows["first"].notna().all()
        and stats[stats.measure == "prob_mass"]["first"].isna().all()
    )
