"""Rolling Forcing's sampler (`rollout(..., sampler="rolling")`) against an independent reference
(tests/rolling_references.py: explicit key lists with each key's version and RoPE position,
attention in float64): latents on every frame, and at every call of every layer the blocks,
steps and timesteps, the frames and positions of the keys the queries saw and their logits; the
reference's own key lists against the hand-written tables of tests/test_schedules.py; the
reference reduced to plain bidirectional denoising where Rolling Forcing is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sinkscope.cache_choices import KEY_KIND
from sinkscope.extraction.sampling import Geometry, Schedule, rollout
from sinkscope.schedules import rolling_calls, rolling_keys
from sinkscope.wan.config import WanConfig

from .conftest import make_tiny_model
from .rolling_references import (
    LONG_VIDEO_STEPS,
    ROLLING_STEPS,
    cache_keys,
    key_runs,
    reference_rolling,
    sigma_of,
    warped_timesteps,
    window_blocks,
    window_keys,
)
from .test_schedules import KEY_TABLES

# 4 heads, head_dim 16 (8 temporal RoPE channels), as tests/test_position_caches.py.
CONFIG = WanConfig(
    dim=64, ffn_dim=96, num_heads=4, num_layers=2, freq_dim=16, text_dim=8, text_len=8
)
T = 4  # tokens per frame: a 4 x 4 latent in 2 x 2 patches
SEED = 3


def geometry(blocks: int, per_block: int = 3) -> Geometry:
    return Geometry(
        num_frames=blocks * per_block, frames_per_block=per_block, latent_height=4, latent_width=4
    )


def model_and_text(seed: int = 5):
    text = torch.randn(1, 5, CONFIG.text_dim, generator=torch.Generator().manual_seed(7))
    return make_tiny_model(seed=seed, cfg=CONFIG), text


def per_frame_rel(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    a, b = a.double()[0].transpose(0, 1).flatten(1), b.double()[0].transpose(0, 1).flatten(1)
    return ((a - b).norm(dim=1) / b.norm(dim=1)).numpy()


def package_rolling(model, text, geo: Geometry, steps):
    """Latents; per call (kind, [(block, step)], part timesteps); per (call, layer) the visible
    keys' frames, positions and kind codes and the logits q.k / sqrt(d), float64
    [heads, queries, keys]."""
    calls, seen, index = [], {}, []

    def on_call(i, call, timesteps):
        index[:] = [i]
        parts = [(p.block, p.step) for p in call.parts]
        calls.append((i, call.kind, parts, list(timesteps), call.start, call.frames))

    def hook(layer, q, k, visible):
        positions, kinds = visible.labels(T)
        tokens = visible.tokens
        q64, k64 = q[0].double(), k[0].double()
        logits = torch.einsum("qhd,khd->hqk", q64, k64) / q.shape[-1] ** 0.5
        seen[index[0], layer] = (tokens.tolist(), positions.tolist(), kinds.tolist(), logits)

    model.set_capture(hook, {0, 1})
    try:
        latents = rollout(
            model,
            text,
            geometry=geo,
            schedule=Schedule(steps=steps, shift=5.0, warp=True),
            sampler="rolling",
            seed=SEED,
            progress=False,
            on_call=on_call,
        )
    finally:
        model.set_capture(None)
    return latents, calls, seen


# (blocks, frames per block, steps): 5 blocks never fill a window past block 0; 7 and 9 reach
# the tail, 9 moves the anchor and drops it from the clean passes; blocks of 1 frame (Rolling
# Forcing's are 3) cut the cache elsewhere.
CASES = [(5, 3, ROLLING_STEPS), (7, 3, ROLLING_STEPS), (9, 3, ROLLING_STEPS)]
CASES += [(5, 3, LONG_VIDEO_STEPS), (7, 3, LONG_VIDEO_STEPS), (9, 3, LONG_VIDEO_STEPS)]
CASES += [(25, 1, ROLLING_STEPS)]


@pytest.mark.parametrize(
    ("blocks", "per_block", "steps"),
    CASES,
    ids=[f"{b} blocks of {f} {len(s)} steps" for b, f, s in CASES],
)
def test_rolling_is_the_reference(blocks, per_block, steps):
    """Latents on every frame within 1e-5 of the reference (float32 against float64 attention);
    every call the reference's blocks, steps and timesteps; at every call of every layer the
    reference's keys (frame, temporal position, in attention order; the anchor labelled so) and
    logits within 1e-5 relative."""
    model, text = model_and_text()
    geo = geometry(blocks, per_block)
    latents, calls, seen = package_rolling(model, text, geo, steps)
    ref = reference_rolling(model, text, geo, SEED, steps=steps)
    error = per_frame_rel(latents, ref.latents)
    assert error.max() < 1e-5, error
    assert len(calls) == len(ref.calls) == 2 * (blocks + len(steps) - 1)
    for (i, kind, parts, timesteps, start, frames), want in zip(calls, ref.calls, strict=True):
        assert i == want.index
        assert (kind, start, frames) == (want.kind, want.start, want.frames), i
        assert parts == list(zip(want.blocks, want.steps, strict=True)), i
        per_frame = [t for t in timesteps for _ in range(geo.frames_per_block)]
        np.testing.assert_allclose(per_frame, want.timesteps, rtol=0, atol=1e-3, err_msg=str(i))
    assert sorted(seen) == [(i, layer) for i in range(len(ref.calls)) for layer in (0, 1)]
    for (i, layer), (tokens, positions, kinds, logits) in seen.items():
        want = ref.calls[i]
        want_tokens = [frame * T + j for frame, _, _ in want.key_list for j in range(T)]
        want_positions = [position for _, _, position in want.key_list for _ in range(T)]
        assert tokens == want_tokens, (i, layer)  # frames, every token of each, in order
        assert positions == want_positions, (i, layer)
        anchor = [version == "anchor" for _, version, _ in want.key_list for _ in range(T)]
        assert [k == KEY_KIND["anchor"] for k in kinds] == anchor, (i, layer)
        expected = want.logits(layer)
        assert logits.shape == expected.shape, (i, layer)
        rel = float((logits - expected).abs().max() / expected.abs().max())
        assert rel < 1e-5, (i, layer, rel)


# --------------------------------------------------------------------------------------------
# the reference on its own


@pytest.mark.parametrize("per_block", [2, 4])
def test_rolling_refuses_blocks_that_split_its_cache(per_block):
    """Blocks that do not divide the 21 attended frames would cut the clean pass's cache inside
    the anchor, which the release (3-frame blocks) never does: refused, naming the sizes."""
    calls = rolling_calls(num_blocks=14, frames_per_block=per_block, num_steps=5)
    with pytest.raises(ValueError, match=f"21 attended frames.*not {per_block} frames"):
        rolling_keys(calls, 0, per_block)


@pytest.mark.parametrize("per_block", [1, 3])
def test_rolling_keys_are_the_reference(per_block):
    """`rolling_keys` gives the reference's key lists for every call, 1 to 14 blocks."""
    for steps in (4, 5):
        for blocks in range(1, 15):
            calls = rolling_calls(num_blocks=blocks, frames_per_block=per_block, num_steps=steps)
            for w in range(blocks + steps - 1):
                window = window_blocks(w, blocks, steps)
                want = [
                    key_runs(window_keys(window, per_block)),
                    key_runs(cache_keys(window[0][0], per_block)),
                ]
                for index in (2 * w, 2 * w + 1):
                    got = rolling_keys(calls, index, per_block)
                    runs = [(r.first_frame, r.frames, r.version, r.position) for r in got]
                    assert runs == want[index - 2 * w], (steps, blocks, index)


@pytest.mark.parametrize("name", list(KEY_TABLES))
def test_reference_key_lists_are_the_tables(name):
    """The reference's rules give the hand-written tables of tests/test_schedules.py."""
    blocks, steps, table = KEY_TABLES[name]
    runs = []
    for w in range(blocks + steps - 1):
        window = window_blocks(w, blocks, steps)
        runs.append(key_runs(window_keys(window, 3)))
        runs.append(key_runs(cache_keys(window[0][0], 3)))
    assert runs == table


def test_reference_timesteps_and_sigmas():
    assert warped_timesteps(ROLLING_STEPS) == pytest.approx(
        [1000.0, 952.38, 882.35, 769.23, 555.56], abs=1e-2
    )
    assert warped_timesteps(LONG_VIDEO_STEPS) == pytest.approx([1000, 937.5, 833.33, 625], abs=1e-2)
    # sigma = t / 1000 on the table
    for t in warped_timesteps(ROLLING_STEPS):
        assert sigma_of(t) == pytest.approx(t / 1000, rel=1e-6)


@pytest.mark.parametrize("steps", [ROLLING_STEPS, LONG_VIDEO_STEPS], ids=["5 steps", "4 steps"])
def test_reference_one_block_is_plain_denoising(steps):
    """One block: every window holds block 0 alone, so the pipeline is few-step denoising of a
    3-frame video with full bidirectional forwards (no cache), each step's fresh noise one randn
    of the block's shape."""
    model, text = model_and_text()
    geo = geometry(1)
    ref = reference_rolling(model, text, geo, SEED, steps=steps)
    shape = (1, 16, 3, 4, 4)
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(shape, generator=generator)
    timesteps = warped_timesteps(steps)
    with torch.no_grad():
        for s, t in enumerate(timesteps):
            v = model(x, torch.full((1, 3), t), text)
            x0 = (x.double() - sigma_of(t) * v.double()).float()
            if s + 1 < len(steps):
                sigma = sigma_of(timesteps[s + 1])
                x = (1 - sigma) * x0 + sigma * torch.randn(shape, generator=generator)
    assert per_frame_rel(ref.latents, x0).max() < 1e-5


def test_reference_calls_holding_block_zero_are_full_forwards():
    """While the window holds block 0 a call attends to its own frames only, bidirectionally:
    the model's plain forward of the call's input (per-frame timesteps, window frames from 0)
    gives the same velocity; so do block 0's clean passes. Later calls read the anchor (and
    the working cache), and differ."""
    model, text = model_and_text()
    ref = reference_rolling(model, text, geometry(7), SEED)
    with torch.no_grad():
        for call in ref.calls:
            plain = model(call.x, torch.tensor([call.timesteps]), text)
            rel = float((plain - call.output).norm() / call.output.norm())
            if call.blocks[0] == 0:
                assert rel < 1e-5, (call.index, rel)
            else:
                assert rel > 1e-3, (call.index, rel)


# --------------------------------------------------------------------------------------------
# what a rolling run's attention store says


def test_attention_store_of_a_rolling_run(tmp_path):
    """The survey's store of a rolling rollout against the reference, pass by pass: each pass
    slot holds the call where the query block sat at that step (the cache pass: its last clean
    pass), `key_version` says which copy of each key frame it saw (anchor, clean, or a window
    frame at its step), and `prob_mass` is the reference's softmax summed per key frame."""
    from sinkscope.analysis.reduce import open_frame_dataset, reduce_attention_store
    from sinkscope.extraction.capture import LogitCapture
    from sinkscope.extraction.store import AttentionStoreWriter
    from sinkscope.schedules import KEY_VERSION, NOISY_VERSION

    model, text = model_and_text()
    blocks, steps = 9, ROLLING_STEPS
    geo = geometry(blocks)
    schedule = Schedule(steps=steps, shift=5.0, warp=True)
    slots = len(steps) + 1
    path = tmp_path / "layer0.zarr"
    with AttentionStoreWriter(
        path,
        num_heads=CONFIG.num_heads,
        num_frames=geo.num_frames,
        frame_seq_length=T,
        timesteps=schedule.pass_timesteps(),
        pass_kinds=schedule.pass_kinds(),
        attrs={
            "layer": 0,
            "block_sizes": geo.block_sizes,
            "frame_seq_length": T,
            "num_frames": geo.num_frames,
        },
        frames_per_block=3,
    ) as writer:
        capture = LogitCapture({0: writer}, range(slots), T, CONFIG.head_dim)
        model.set_capture(capture, {0})
        try:
            rollout(
                model,
                text,
                geometry=geo,
                schedule=schedule,
                sampler="rolling",
                seed=SEED,
                progress=False,
                on_call=capture.begin_call,
            )
        finally:
            model.set_capture(None)
    reduce_attention_store(path, tmp_path / "frames.zarr")
    frames = open_frame_dataset(tmp_path / "frames.zarr")
    ref = reference_rolling(model, text, geo, SEED, steps=steps, keep_layers={0})
    last_clean = {call.blocks[0]: call.index for call in ref.calls if call.kind == "cache"}
    want_version = np.full((slots, geo.num_frames, geo.num_frames), -1)
    want_mass = np.full((slots, CONFIG.num_heads, geo.num_frames, geo.num_frames), np.nan)
    for call in ref.calls:
        if call.kind == "cache" and last_clean[call.blocks[0]] != call.index:
            continue  # block 0's provisional clean passes: not captured
        probs = torch.softmax(call.logits(0), dim=-1).numpy()  # [heads, queries, keys]
        key_frames = np.array([key.frame for key in call.keys for _ in range(T)])
        # A window frame is a noisy copy at its block's step; in a clean pass, a clean one.
        codes = [
            KEY_VERSION["anchor"]
            if key.version == "anchor"
            else KEY_VERSION["clean"]
            if key.step is None
            else NOISY_VERSION + key.step
            for key in call.keys
        ]
        for block, step in zip(call.blocks, call.steps, strict=True):
            slot = len(steps) if step is None else step
            for query in range(block * 3, block * 3 + 3):
                rows = slice((query - call.start) * T, (query - call.start + 1) * T)
                want_version[slot, query, [key.frame for key in call.keys]] = codes
                per_key = probs[:, rows].mean(axis=1)
                for frame in set(key_frames.tolist()):
                    mass = per_key[:, key_frames == frame].sum(axis=-1)
                    want_mass[slot, :, query, frame] = mass
    np.testing.assert_array_equal(frames["key_version"].values, want_version)
    got = frames["prob_mass"].values
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want_mass))
    np.testing.assert_allclose(got, want_mass, rtol=0, atol=1e-5)
    # The anchor and clean copies of frames 0..2 both appear, in different passes.
    assert (want_version == KEY_VERSION["anchor"]).any() and (want_version[-1, :, 3] == 0).any()
