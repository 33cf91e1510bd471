"""The position policies (`relative`, `replay`, `head_jitter`, `logit_bias`) in sinkscope's closed
loop against an independent reference (tests/position_references.py: explicit key lists with
each key's RoPE position, per-head base and bias, attention in float64): latents on every frame,
and at every call of every layer the frames, positions, kinds and biases of the keys the queries
saw; settings that cover everything against the full cache and sink_window bit for bit; the pure
functions of `cache_choices` against hand-written tables; `CachePolicy.check`'s refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sinkscope.cache_choices import (
    CLOSED_LOOP_POLICIES,
    FRAME_POLICIES,
    KEY_KINDS,
    POSITION_POLICIES,
    SINK_POLICIES,
    jitter_thetas,
    policy_label,
    replay_frames,
)
from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.sampling import Geometry, rollout
from sinkscope.wan.config import WanConfig

from .conftest import make_tiny_model
from .position_references import Position, reference_rollout

# 4 heads (a jitter needs several), head_dim 16: 8 temporal RoPE channels.
CONFIG = WanConfig(
    dim=64, ffn_dim=96, num_heads=4, num_layers=2, freq_dim=16, text_dim=8, text_len=8
)
T = 4  # tokens per frame: a 4 x 4 latent in 2 x 2 patches
GRID = (2, 2)


def geometry(frames: int, per_block: int, independent_first_frame: bool = False) -> Geometry:
    return Geometry(
        num_frames=frames,
        frames_per_block=per_block,
        latent_height=4,
        latent_width=4,
        independent_first_frame=independent_first_frame,
    )


def model_and_text(seed: int = 5):
    text = torch.randn(1, 5, CONFIG.text_dim, generator=torch.Generator().manual_seed(7))
    return make_tiny_model(seed=seed, cfg=CONFIG), text


def policy_rollout(model, text, policy: CachePolicy, geo: Geometry, capture: bool = False):
    """Latents and, with `capture`, per (block, pass, layer) the (frame, token, position, kind,
    bias) of every key the call saw, from the model's capture hook."""
    caches = policy.new_caches(
        model,
        num_frames=geo.num_frames,
        frame_seq_length=T,
        frames_per_block=geo.frames_per_block,
        device="cpu",
        dtype=torch.float32,
        token_grid=GRID,
    )
    seen, call = {}, []

    def on_pass(block, pass_index, kind, timestep):
        call[:] = [block, pass_index]

    def hook(layer, q, k, visible):
        positions, kinds = visible.labels(T)
        bias = torch.zeros(len(visible.tokens)) if visible.bias is None else visible.bias
        seen[(*call, layer)] = list(
            zip(
                (visible.tokens // T).tolist(),
                (visible.tokens % T).tolist(),
                positions.tolist(),
                [KEY_KINDS[kind] for kind in kinds.tolist()],
                bias.double().tolist(),
                strict=True,
            )
        )

    model.set_capture(hook if capture else None)
    try:
        latents = rollout(
            model, text, geometry=geo, seed=3, progress=False, caches=caches, on_pass=on_pass
        )
    finally:
        model.set_capture(None)
    return latents, seen


def per_frame_rel(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    a, b = a.double()[0].transpose(0, 1).flatten(1), b.double()[0].transpose(0, 1).flatten(1)
    return ((a - b).norm(dim=1) / b.norm(dim=1)).numpy()


# --------------------------------------------------------------------------------------------
# pure functions and labels against hand-written tables


def test_replay_frames_are_the_released_walk():
    # The release: window 21, blocks of 3, R = 18: positions 18-35 hold frames 17..0 and 36-53
    # hold 0..17, and on.
    assert replay_frames(range(18, 36), 18).tolist() == list(range(17, -1, -1))
    assert replay_frames(range(36, 54), 18).tolist() == list(range(18))
    assert replay_frames([54, 71, 72, 89, 90], 18).tolist() == [17, 0, 0, 17, 17]
    # R = 4 (window 6, blocks of 2): the ends repeat.
    table = {4: 3, 5: 2, 6: 1, 7: 0, 8: 0, 9: 1, 10: 2, 11: 3, 12: 3, 13: 2, 20: 3, 23: 0}
    assert replay_frames(list(table), 4).tolist() == list(table.values())
    assert replay_frames(np.arange(1, 6), 1).tolist() == [0] * 5  # R = 1: frame 0 alone
    with pytest.raises(ValueError, match="at least 1"):
        replay_frames([3], 0)


def test_jitter_thetas_are_spread_evenly_about_wans_base():
    np.testing.assert_allclose(
        jitter_thetas(4, 0.8), [4000.0, 8000.0, 12000.0, 16000.0], rtol=1e-12
    )
    np.testing.assert_allclose(jitter_thetas(2, 0.5), [7500.0, 12500.0], rtol=1e-12)
    # Wan 1.3B's 12 heads at LoL's strength 0.8: 10000 (1 + 0.8 (2h + 1 - 12) / 12).
    twelve = [10000 * (1 + 0.8 * (2 * h + 1 - 12) / 12) for h in range(12)]
    np.testing.assert_allclose(jitter_thetas(12, 0.8), twelve, rtol=1e-12)
    assert jitter_thetas(12, 0.8)[0] == pytest.approx(2666.6666666666665)
    assert jitter_thetas(5, 0.0).tolist() == [10000.0] * 5  # exactly Wan's base
    for strength in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            jitter_thetas(4, strength)


def test_families_and_labels():
    assert POSITION_POLICIES == ("relative", "replay", "head_jitter", "logit_bias")
    assert set(POSITION_POLICIES) <= set(CLOSED_LOOP_POLICIES)
    assert set(POSITION_POLICIES) <= set(FRAME_POLICIES)
    assert {"relative", "head_jitter", "logit_bias"} <= set(SINK_POLICIES)
    assert "replay" not in SINK_POLICIES
    assert policy_label("head_jitter", 12, 3, jitter=0.8) == "head_jitter B=12 S=3 j=0.8"
    assert policy_label("logit_bias", 12, 3, bias=0.3) == "logit_bias B=12 S=3 b=0.3"
    assert CachePolicy("relative", 6, 1).label == "relative B=6 S=1"
    assert CachePolicy("replay", 21).label == "replay B=21"
    assert CachePolicy("head_jitter", 12, 3, jitter=0.8).label == "head_jitter B=12 S=3 j=0.8"
    assert CachePolicy("logit_bias", 12, 3, bias=0.3).label == "logit_bias B=12 S=3 b=0.3"
    assert CachePolicy("relative", 6, 1).window == (6, 1)
    assert CachePolicy("replay", 21).window == (21, 0)
    assert CachePolicy("logit_bias", 12, 3, bias=0.3).window == (12, 3)


@pytest.mark.parametrize(
    ("policy", "first_block", "message"),
    [
        (CachePolicy("relative", 12, 4), None, "4 sink frames are more than the first block's 3"),
        (CachePolicy("relative", 6, 2), 1, "2 sink frames are more than the first block's 1"),
        (CachePolicy("relative", 6, 4), None, "leaves 3 beside the own block of 3"),
        (CachePolicy("replay", 3), None, "budget of 3 frames leaves no frame"),
        (CachePolicy("head_jitter", 12, 3, jitter=1.0), None, "strength of 1.0"),
        (CachePolicy("head_jitter", 12, 3, jitter=-0.2), None, "strength of -0.2"),
        (CachePolicy("logit_bias", 12, 3, bias=0.0), None, "b of 0.0"),
        (CachePolicy("logit_bias", 12, 3, bias=1.5), None, "b of 1.5"),
    ],
    ids=lambda x: x.label if isinstance(x, CachePolicy) else str(x),
)
def test_check_refuses_what_the_caches_cannot_run(policy, first_block, message):
    with pytest.raises(ValueError, match=message):
        policy.check(3, first_block=first_block)


def test_relative_refuses_sinks_beyond_an_independent_first_frame():
    """new_caches sees only the block size; the cache itself refuses sinks that the first block
    (a lone frame) cannot hold."""
    model, text = model_and_text()
    with pytest.raises(ValueError, match="2 sink frames do not fit in the first block of 1"):
        policy_rollout(model, text, CachePolicy("relative", 6, 2), geometry(7, 2, True))
    CachePolicy("relative", 6, 1).check(2, first_block=1)  # one sink: the lone frame


# --------------------------------------------------------------------------------------------
# against the reference: latents and every call's keys


# (policy, reference settings, frames, frames per block)
AGAINST_REFERENCE = {
    "relative released B=6 S=1": (CachePolicy("relative", 6, 1), Position("relative", 6, 1), 24, 3),
    "relative B=7 S=2": (CachePolicy("relative", 7, 2), Position("relative", 7, 2), 18, 2),
    "replay B=6": (CachePolicy("replay", 6), Position("replay", 6), 30, 2),
    "replay B=7 (not a multiple)": (CachePolicy("replay", 7), Position("replay", 7), 30, 2),
    "replay released B=21": (CachePolicy("replay", 21), Position("replay", 21), 48, 3),
    "head_jitter B=6 S=2 j=0.8": (
        CachePolicy("head_jitter", 6, 2, jitter=0.8),
        Position("head_jitter", 6, 2, strength=0.8),
        16,
        2,
    ),
    "logit_bias B=6 S=2 b=0.3": (
        CachePolicy("logit_bias", 6, 2, bias=0.3),
        Position("logit_bias", 6, 2, bias=0.3),
        16,
        2,
    ),
}


@pytest.mark.parametrize("name", list(AGAINST_REFERENCE))
def test_position_policy_is_the_reference(name):
    """Latents on every frame within 1e-5 of the reference (float32 against float64 attention),
    and every call of every layer saw the reference's keys: frame, token, RoPE position, kind
    and logit bias, in the cache's order."""
    policy, settings, frames, per_block = AGAINST_REFERENCE[name]
    model, text = model_and_text()
    geo = geometry(frames, per_block)
    latents, seen = policy_rollout(model, text, policy, geo, capture=True)
    ref = reference_rollout(model, text, geo, 3, settings)
    error = per_frame_rel(latents, ref.latents).max()
    assert error < 1e-5, error
    calls = [
        (b, p, layer) for b in range(frames // per_block) for p in range(5) for layer in (0, 1)
    ]
    assert sorted(seen) == calls
    for call in calls:
        got, want = seen[call], ref.rows(*call)
        assert [row[:4] for row in got] == [row[:4] for row in want], call
        np.testing.assert_allclose([row[4] for row in got], [row[4] for row in want], atol=1e-7)
    positions = [row[2] for rows in seen.values() for row in rows]
    kinds = {row[3] for rows in seen.values() for row in rows}
    if policy.name == "relative":
        assert max(positions) == policy.budget - 1  # the window saturates, positions stay below B
    if policy.name == "replay":
        assert "replayed" in kinds
        assert max(positions) == frames - 1
    if policy.name == "logit_bias":
        assert min(row[4] for rows in seen.values() for row in rows) < 0


def test_replay_release_calls_see_fifteen_replays_the_live_block_and_their_own():
    """Rolling-Sink as released (window 21, blocks of 3): the first block to read a replay
    starts at frame 24; from the block at 36 on every call sees [15 replayed frames | the live
    previous block | its own block]."""
    model, text = model_and_text()
    _, seen = policy_rollout(model, text, CachePolicy("replay", 21), geometry(48, 3), capture=True)
    for block in range(16):
        frame_kinds = [row[3] for row in seen[block, 0, 0][::T]]
        if block * 3 < 24:
            assert "replayed" not in frame_kinds, block
        if block * 3 == 24:
            assert frame_kinds.count("replayed") == 3
        if block * 3 >= 36:
            assert frame_kinds == ["replayed"] * 15 + ["recent"] * 3 + ["own"] * 3, block
    frames = [row[0] for row in seen[15, 4, 1][::T]]
    positions = [row[2] for row in seen[15, 4, 1][::T]]
    assert positions == list(range(27, 48))
    # Positions 27-35 hold frames 8..0, 36-41 frames 0..5 (the replays); 42-47 themselves.
    assert frames == [*range(8, -1, -1), *range(6), *range(42, 48)]


# --------------------------------------------------------------------------------------------
# settings that cover everything, bit for bit


@pytest.mark.parametrize(("sinks", "per_block"), [(0, 2), (1, 2), (1, 3), (3, 3)])
def test_relative_covering_the_video_is_the_full_cache_bit_for_bit(sinks, per_block):
    model, text = model_and_text()
    geo = geometry(4 * per_block, per_block)
    full, _ = policy_rollout(model, text, CachePolicy("full"), geo)
    covering, _ = policy_rollout(model, text, CachePolicy("relative", geo.num_frames, sinks), geo)
    assert torch.equal(full, covering)
    # A window smaller than the video moves the positions and changes the rollout.
    moved, _ = policy_rollout(model, text, CachePolicy("relative", 2 * per_block, sinks), geo)
    assert not torch.allclose(full, moved)


def test_no_jitter_and_no_bias_are_sink_window_bit_for_bit():
    model, text = model_and_text()
    geo = geometry(16, 2)
    plain, _ = policy_rollout(model, text, CachePolicy("sink_window", 6, 2), geo)
    for policy in (CachePolicy("head_jitter", 6, 2), CachePolicy("logit_bias", 6, 2)):
        latents, _ = policy_rollout(model, text, policy, geo)
        assert torch.equal(plain, latents), policy.label
    for policy in (
        CachePolicy("head_jitter", 6, 2, jitter=0.8),
        CachePolicy("logit_bias", 6, 2, bias=0.3),
    ):
        latents, _ = policy_rollout(model, text, policy, geo)
        assert not torch.allclose(plain, latents), policy.label
