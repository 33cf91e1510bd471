"""Deep Forcing's released KV-cache policies in sinkscope's closed loop (issue 24).

`deep_sink`, `participative` and `deep_forcing` against an independent reference of the released
code (tests/released_caches.py: explicit per-layer key lists with each key's RoPE position,
attention in float64): latents on every frame, sink positions at every block, kept tokens at
every prune; the shared schedules (`sinkscope.cache_choices`) against hand-written tables;
Participative Compression's choice at every prune against a float64 brute force from the
queries and keys the cache saw; the two ways of turning a sink; LongLive's and Self-Forcing++'s
caches as sink_window and window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sinkscope.cache_choices import (
    ParticipativeChoice,
    buffered_query_frames,
    deep_sink_shifts,
)
from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.sampling import Geometry, rollout

from .conftest import make_tiny_model
from .released_caches import LONGLIVE, PolicySettings, reference_rollout, self_forcing_pp

T = 6  # tokens per frame: a 4 x 6 latent in 2 x 2 patches
GRID = (2, 3)


def geometry(frames: int, per_block: int) -> Geometry:
    return Geometry(num_frames=frames, frames_per_block=per_block, latent_height=4, latent_width=6)


def new_caches(model, policy: CachePolicy, geo: Geometry) -> list:
    return policy.new_caches(
        model,
        num_frames=geo.num_frames,
        frame_seq_length=T,
        frames_per_block=geo.frames_per_block,
        device="cpu",
        dtype=torch.float32,
        token_grid=GRID,
    )


def sinkscope_rollout(model, text, policy: CachePolicy, geo: Geometry, caches=None):
    caches = new_caches(model, policy, geo) if caches is None else caches
    return rollout(model, text, geometry=geo, seed=3, progress=False, caches=caches), caches


def sink_shifts_seen(model, text, policy: CachePolicy, geo: Geometry):
    """The rollout's latents, its caches and, per (block, pass), how far layer 0's sinks were
    turned when that call attended."""
    caches = new_caches(model, policy, geo)
    calls, shifts = [], {}

    def after_previous_call(block, pass_index, kind, timestep):
        if calls:
            shifts[calls[-1]] = caches[0].sinks.shift
        calls.append((block, pass_index))

    latents = rollout(
        model,
        text,
        geometry=geo,
        seed=3,
        progress=False,
        caches=caches,
        on_pass=after_previous_call,
    )
    shifts[calls[-1]] = caches[0].sinks.shift
    return latents, caches, shifts


def per_frame_rel(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    a, b = a.double()[0].transpose(0, 1).flatten(1), b.double()[0].transpose(0, 1).flatten(1)
    return ((a - b).norm(dim=1) / b.norm(dim=1)).numpy()


# --------------------------------------------------------------------------------------------
# schedules against hand-written tables


# Deep Forcing's sink start position per block, hand-worked from its code (long-video-family.md):
# no turn at the first evicting block c1, then sinks at c - c1.
DEEP_SINK_STARTS = {
    # (window, sinks, frames per block): first sink frame's position in blocks 0..9
    (8, 3, 3): [0, 0, 0, 3, 6, 9, 12, 15, 18, 21],  # c1 = 6: not a multiple of the block
    (9, 3, 3): [0, 0, 0, 0, 3, 6, 9, 12, 15, 18],  # c1 = 9
    (21, 14, 3): [0, 0, 0, 0, 0, 0, 0, 0, 3, 6],  # the release: c1 = 21
    (6, 2, 2): [0, 0, 0, 0, 2, 4, 6, 8, 10, 12],  # c1 = 6
    (7, 2, 2): [0, 0, 0, 0, 2, 4, 6, 8, 10, 12],  # c1 = 6, a window not a multiple of 2
}


@pytest.mark.parametrize(("window", "sinks", "block"), list(DEEP_SINK_STARTS))
def test_deep_sink_shifts_are_the_released_table(window, sinks, block):
    assert deep_sink_shifts([block] * 10, window, sinks) == DEEP_SINK_STARTS[window, sinks, block]
    assert deep_sink_shifts([block] * 10, window, 0) == [0] * 10  # no sinks, nothing turns


def test_buffered_queries_are_the_newest_in_call_order():
    # The release: Recent 4 frames of blocks of 3: the current first pass and the last frame of
    # the previous block's cache-update pass (pass 4 of 5).
    assert buffered_query_frames([3] * 10, 7, 5, 4 * T, T) == [
        (7, 0, 23),
        (7, 0, 22),
        (7, 0, 21),
        (6, 4, 20),
    ]
    # Recent = the block: the current first pass alone.
    assert buffered_query_frames([2] * 10, 4, 5, 2 * T, T) == [(4, 0, 9), (4, 0, 8)]
    # Longer than two blocks: back into the previous block's last denoising pass.
    assert buffered_query_frames([3] * 10, 7, 5, 7 * T, T)[-1] == (6, 3, 20)


# Participative Compression's frames held after each block's first pass, and its sinks' first
# position, hand-worked from the release (blocks of F, enough eligible tokens).
PARTICIPATIVE_TABLES = {
    # (capacity, budget, sinks, recent before the own block, F): (held frames, sink starts)
    (21, 16, 10, 1, 3): (
        [3, 6, 9, 12, 15, 18, 21, 16, 19, 16, 19, 16],
        [0, 0, 0, 0, 0, 0, 0, 5, 5, 11, 11, 17],  # first turn 21 - 16 = 5, then +6 per prune
    ),
    (9, 8, 2, 0, 2): (
        [2, 4, 6, 8, 8, 8, 8, 8],
        [0, 0, 0, 0, 13, 15, 17, 19],  # the constant 21 - 8 = 13: the sinks after the queries
    ),
    (10, 8, 3, 1, 2): (
        [2, 4, 6, 8, 10, 8, 10, 8, 10, 8],
        [0, 0, 0, 0, 0, 13, 13, 17, 17, 21],
    ),
}


@pytest.mark.parametrize("setting", list(PARTICIPATIVE_TABLES))
def test_participative_sizes_and_sink_turns_are_the_released_table(setting):
    capacity, budget, sinks, recent, block = setting
    held, starts = PARTICIPATIVE_TABLES[setting]
    choice = ParticipativeChoice(
        frame_seq_length=T,
        capacity=capacity,
        budget=budget,
        sink_frames=sinks,
        recent_frames=recent,
        frames_per_block=block,
        reuse_cap=0,
    )
    got_held, got_starts = [], []
    for b in range(len(held)):
        start = b * block * T
        choice.add_queries(block * T)
        overflow = choice.overflows(block * T)
        choice.append(start, block * T)
        if overflow:
            choice.prune(np.arange(len(choice.tokens), dtype=float), b * block)
        for _ in range(4):  # the block's later passes
            choice.add_queries(block * T)
        got_held.append(len(choice.tokens) // T)
        got_starts.append(choice.sink_shift)
    assert got_held == held
    assert got_starts == starts


def test_participative_reuse_cap_retires_a_token():
    """A token chosen `reuse_cap` times is no longer a candidate; scores favouring it change
    nothing once it has been chosen that often."""
    choice = ParticipativeChoice(
        frame_seq_length=1,
        capacity=4,
        budget=3,
        sink_frames=0,
        recent_frames=0,
        frames_per_block=1,
        reuse_cap=2,
        turn_sinks=False,
    )
    kept = []
    for start in range(12):
        choice.add_queries(1)
        overflow = choice.overflows(1)
        choice.append(start, 1)
        if overflow:
            scores = np.where(choice.tokens == 0, 10.0, -choice.tokens.astype(float))
            choice.prune(scores, start)
            kept.append(choice.tokens.tolist())
    # A prune every other block (4 held, 3 kept); the newest token is the recent one, top C = 2.
    # Token 0 scores best, then the oldest: tokens 0 and 1 are chosen twice, then retired.
    assert kept == [[0, 1, 4], [0, 1, 6], [6, 7, 8], [6, 7, 10]]
    assert choice.counts.tolist() == [2, 2, 0, 0]  # 6 and 7 chosen twice; 10, 11 never


# --------------------------------------------------------------------------------------------
# Deep Sink against the released behaviour


DEEP_SINK_SETTINGS = [(6, 2, 2, 24), (7, 2, 2, 24), (8, 3, 3, 27)]  # window, sinks, F, frames


@pytest.mark.parametrize(("window", "sinks", "block", "frames"), DEEP_SINK_SETTINGS)
def test_deep_sink_is_the_released_deep_sink(tiny_text, window, sinks, block, frames):
    """Latents on every frame within 1e-5 of the reference, and at every block and pass the
    sinks sit where the reference put them (windows a multiple of the block and not)."""
    model = make_tiny_model(seed=5)
    geo = geometry(frames, block)
    policy = CachePolicy("deep_sink", budget=window, sink_frames=sinks)
    latents, _, shifts = sink_shifts_seen(model, tiny_text, policy, geo)
    ref = reference_rollout(
        model, tiny_text, geo, 3, PolicySettings.deep_sink(window, sinks), attention="float64"
    )
    assert per_frame_rel(latents, ref.latents).max() < 1e-5
    for b in range(frames // block):
        for pass_index in range(5):
            expected = ref.sink_positions(b, pass_index)
            assert [f + shifts[b, pass_index] for f in range(sinks)] == expected, (b, pass_index)
    # Identical to sink_window until the first turn (the block after the first eviction).
    plain, _ = sinkscope_rollout(model, tiny_text, CachePolicy("sink_window", window, sinks), geo)
    first_turn = block * deep_sink_shifts([block] * (frames // block), window, sinks).index(block)
    assert torch.equal(plain[:, :, :first_turn], latents[:, :, :first_turn])
    assert not torch.allclose(plain[:, :, first_turn:], latents[:, :, first_turn:])


# --------------------------------------------------------------------------------------------
# Participative Compression against the released behaviour


# (policy, capacity, budget, sinks, recent frames before the own block, F, frames)
PARTICIPATIVE_SETTINGS = [
    ("deep_forcing", 10, 8, 3, 1, 2, 24),  # prunes every other block, as released
    ("deep_forcing", 9, 8, 2, 0, 2, 24),  # prunes every block: the reuse cap retires tokens
    ("deep_forcing", 21, 16, 10, 1, 3, 36),  # the release's sizes
    ("participative", 10, 8, 3, 1, 2, 24),  # the sinks kept at their own positions
]


def participative_reference(policy, capacity, budget, sinks, recent, block):
    return PolicySettings.pc(
        capacity, budget, sinks, recent + block, 7, sink_turn=policy == "deep_forcing"
    )


@pytest.mark.parametrize("setting", PARTICIPATIVE_SETTINGS, ids=str)
def test_participative_compression_is_the_released_one(tiny_text, setting):
    """Latents on every frame within 1e-5 of the reference, and at every block every layer's
    first pass attends to the tokens the reference's did (its prunes' choices), the sinks at
    the reference's positions."""
    policy_name, capacity, budget, sinks, recent, block, frames = setting
    model = make_tiny_model(seed=5)
    geo = geometry(frames, block)
    policy = CachePolicy(
        policy_name, budget, sinks, recent_frames=recent, capacity=capacity, reuse_cap=7
    )
    caches = new_caches(model, policy, geo)
    calls, held = [], {}

    def after_previous_call(b, pass_index, kind, timestep):
        if calls:
            held[calls[-1]] = [(cache.choice.tokens.copy(), cache.sinks.shift) for cache in caches]
        calls.append((b, pass_index))

    latents = rollout(
        model,
        tiny_text,
        geometry=geo,
        seed=3,
        progress=False,
        caches=caches,
        on_pass=after_previous_call,
    )
    ref = reference_rollout(
        model, tiny_text, geo, 3, participative_reference(policy_name, *setting[1:6])
    )
    assert per_frame_rel(latents, ref.latents).max() < 1e-5
    prunes = 0
    for b in range(frames // block):
        for layer, (tokens, shift) in enumerate(held[b, 0]):
            attended = ref.attended(b, 0, layer)
            assert tokens.tolist() == (attended[:, 0] * T + attended[:, 1]).tolist(), (b, layer)
            positions = ref.sink_positions(b, 0, layer)
            assert [f + shift for f in range(len(positions))] == positions, (b, layer)
        prunes += any(event["block"] == b for event in ref.prunes(0))
    assert prunes == len(caches[0].choice.pruned_blocks) >= 3


def brute_force_prunes(calls, capacity, budget, sinks, recent, block, reuse_cap) -> list:
    """Participative Compression's kept tokens at every prune, from the recorded calls alone
    (the call's queries [n, heads, d], its keys [n, heads, d] and start token, and the cache's
    held tokens and keys before it), written from the release's rules in float64: a buffer of
    the newest (recent + block) x T queries of every call; a prune when a block's first pass
    would overflow the cache; sinks, the top C eligible tokens by the buffered queries' q.k
    summed over them and the heads (ties: the older), the newest recent tokens. Returns
    (block start frame, kept tokens) per prune; checks the held tokens it tracks itself against
    the cache's before every call."""
    recent_tokens = (recent + block) * T
    buffer = np.zeros((0, *calls[0]["q"].shape[1:]))
    counts: dict[int, int] = {}
    held: list[int] = []
    end = 0
    prunes = []
    for call in calls:
        assert call["held_tokens"] == held
        buffer = np.concatenate([buffer, call["q"]])[-recent_tokens:]
        start, n = call["start"], call["q"].shape[0]
        if start + n <= end:  # a later pass of the block: nothing is chosen
            continue
        end = start + n
        augmented = held + list(range(start, end))
        if len(augmented) <= capacity * T:
            held = augmented
            continue
        keys = np.concatenate([call["held_keys"], call["k"]])
        score = np.einsum("hd,mhd->m", buffer.sum(axis=0), keys)
        sink_tokens = min(sinks * T, len(augmented))
        r = min(recent_tokens, len(augmented))
        total = min(max(budget * T, sink_tokens + r), len(augmented))
        slots = range(sink_tokens, len(augmented) - r)
        eligible = [i for i in slots if counts.get(augmented[i], 0) < reuse_cap]
        ranked = sorted(eligible, key=lambda i: (-score[i], i))
        chosen = sorted(ranked[: max(0, total - sink_tokens - r)])
        for i in chosen:
            counts[augmented[i]] = counts.get(augmented[i], 0) + 1
        kept = [*range(sink_tokens), *chosen, *range(len(augmented) - r, len(augmented))]
        held = [augmented[i] for i in kept]
        prunes.append((start // T, held))
    return prunes


@pytest.mark.parametrize("setting", PARTICIPATIVE_SETTINGS[:2], ids=str)
def test_every_prune_keeps_the_float64_brute_force_choice(tiny_text, setting):
    policy_name, capacity, budget, sinks, recent, block, frames = setting
    model = make_tiny_model(seed=9)
    geo = geometry(frames, block)
    policy = CachePolicy(policy_name, budget, sinks, recent_frames=recent, capacity=capacity)
    caches = new_caches(model, policy, geo)
    cache = caches[1]
    calls = []
    update = cache.update

    def spy(k, v, start, *, q=None, k_raw=None):
        calls.append(
            {
                "q": q[0].double().numpy(),
                "k": k[0].double().numpy(),
                "start": start,
                "held_tokens": cache.choice.tokens.tolist(),
                "held_keys": cache.k[0, : cache.held].double().numpy(),
            }
        )
        keys, values, tokens = update(k, v, start, q=q, k_raw=k_raw)
        calls[-1]["tokens"] = tokens.tolist()
        return keys, values, tokens

    cache.update = spy
    rollout(model, tiny_text, geometry=geo, seed=3, progress=False, caches=caches)
    expected = brute_force_prunes(calls, capacity, budget, sinks, recent, block, reuse_cap=7)
    assert [start for start, _ in expected] == cache.choice.pruned_blocks
    assert len(expected) >= 3
    attended = {call["start"] // T: call["tokens"] for call in reversed(calls)}  # first passes
    for start, kept in expected:
        assert attended[start] == kept, start


# --------------------------------------------------------------------------------------------
# two ways of turning; LongLive's and Self-Forcing++'s caches


@pytest.mark.parametrize("policy_name", ["deep_sink", "deep_forcing"])
def test_rerope_turns_are_rolling_forcings_and_agree_with_delta_in_float32(tiny_text, policy_name):
    """`rerope` re-applies RoPE to the sinks' keys before RoPE at their new positions; in
    float32 it agrees with the released `delta` turn to rounding."""
    model = make_tiny_model(seed=5)
    geo = geometry(24, 2)
    common = {"budget": 8, "sink_frames": 2, "recent_frames": 1, "capacity": 10}
    if policy_name == "deep_sink":
        common = {"budget": 7, "sink_frames": 2}
        settings = PolicySettings.deep_sink(7, 2, turn_mode="rerope")
    else:
        settings = PolicySettings.pc(10, 8, 2, 3, 7, turn_mode="rerope")
    delta, _ = sinkscope_rollout(model, tiny_text, CachePolicy(policy_name, **common), geo)
    rerope, caches = sinkscope_rollout(
        model, tiny_text, CachePolicy(policy_name, **common, turn="rerope"), geo
    )
    assert caches[0].sinks.shift > 0
    ref = reference_rollout(model, tiny_text, geo, 3, settings)
    assert per_frame_rel(rerope, ref.latents).max() < 1e-5
    assert 0 < per_frame_rel(rerope, delta).max() < 1e-5


def test_a_rerope_turn_is_rope_at_the_new_position(tiny_text):
    """After the rollout the cached sink keys are RoPE, computed here, of the sinks' keys before
    RoPE at positions shift .. shift + S - 1."""
    from .test_model import reference_rope

    model = make_tiny_model(seed=5)
    geo = geometry(24, 2)
    _, caches = sinkscope_rollout(
        model, tiny_text, CachePolicy("deep_sink", 7, 2, turn="rerope"), geo
    )
    for cache in caches:
        raw = cache.sinks.raw.double().numpy()
        expected = reference_rope(raw, (2, *GRID), cache.sinks.shift)
        np.testing.assert_allclose(cache.k[:, : 2 * T].double().numpy(), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("settings", "policy"),
    [(LONGLIVE, CachePolicy("sink_window", 12, 3)), (self_forcing_pp(9), CachePolicy("window", 9))],
    ids=["longlive", "self_forcing_pp"],
)
def test_longlive_and_self_forcing_pp_caches_are_sink_window_and_window(
    tiny_text, settings, policy
):
    """LongLive's cache (12 frames, 3 sinks at their own positions) is sink_window B=12 S=3 and
    Self-Forcing++'s rolling cache is window: bit for bit against the reference computing its
    attention as sinkscope does (the model's fused kernel)."""
    model = make_tiny_model(seed=5)
    geo = geometry(24, 3)
    latents, _ = sinkscope_rollout(model, tiny_text, policy, geo)
    ref = reference_rollout(model, tiny_text, geo, 3, settings, attention="model")
    assert torch.equal(latents, ref.latents)
