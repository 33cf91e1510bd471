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
from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.rolling import RollingKVCache, rolling_caches
from sinkscope.extraction.sampling import Geometry, Schedule, model_calls, rollout
from sinkscope.schedules import rolling_calls, rolling_keys
from sinkscope.wan.config import WanConfig

from .conftest import make_tiny_model
from .released_caches import Rope
from .rolling_references import (
    LONG_VIDEO_STEPS,
    ROLLING_STEPS,
    Layer,
    Policy,
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


def package_rolling(model, text, geo: Geometry, steps, caches=None):
    """Latents; per call (kind, [(block, step)], part timesteps); per (call, layer) the visible
    keys' frames, positions and kind codes and the logits q.k / sqrt(d), float64
    [heads, queries, keys]. `caches`: rollout's (None: Rolling Forcing's own)."""
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

    def record(module, args, output):
        outputs.append((args[0].detach().clone(), output.detach().clone()))

    outputs = []
    handle = model.register_forward_hook(record)
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
            caches=caches,
        )
    finally:
        model.set_capture(None)
        handle.remove()
    calls = [(*call, x, out) for call, (x, out) in zip(calls, outputs, strict=True)]
    return latents, calls, seen


def assert_is_the_reference(geo: Geometry, latents, calls, seen, ref) -> None:
    """Latents on every frame within 1e-5 of the reference (float32 against float64 attention);
    every call the reference's blocks, steps and timesteps, its input and output within 1e-5
    relative; at every call of every layer the reference's keys (frame, temporal position and
    kind, in attention order) and logits within 1e-5 relative."""
    error = per_frame_rel(latents, ref.latents)
    assert error.max() < 1e-5, error
    assert len(calls) == len(ref.calls)
    for (i, kind, parts, timesteps, start, frames, x, output), want in zip(
        calls, ref.calls, strict=True
    ):
        assert i == want.index
        # Every call's input and output (the velocity, or a clean pass's), not just the latents.
        for got, expected in ((x, want.x), (output, want.output)):
            rel = float((got.double() - expected.double()).norm() / expected.double().norm())
            assert rel < 1e-5, (i, rel)
        assert (kind, start, frames) == (want.kind, want.start, want.frames), i
        assert parts == list(zip(want.blocks, want.steps, strict=True)), i
        per_frame = [t for t in timesteps for _ in range(geo.frames_per_block)]
        np.testing.assert_allclose(per_frame, want.timesteps, rtol=0, atol=1e-3, err_msg=str(i))
    assert sorted(seen) == [(i, layer) for i in range(len(ref.calls)) for layer in (0, 1)]
    for (i, layer), (tokens, positions, kinds, logits) in seen.items():
        want = ref.calls[i]
        want_tokens = [frame * T + j for frame, _, _ in want.key_list for j in range(T)]
        want_positions = [position for _, _, position in want.key_list for _ in range(T)]
        want_kinds = [KEY_KIND[kind] for kind in want.kinds for _ in range(T)]
        assert tokens == want_tokens, (i, layer)  # frames, every token of each, in order
        assert positions == want_positions, (i, layer)
        assert kinds == want_kinds, (i, layer)
        expected = want.logits(layer)
        assert logits.shape == expected.shape, (i, layer)
        rel = float((logits - expected).abs().max() / expected.abs().max())
        assert rel < 1e-5, (i, layer, rel)


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
    reference's keys (frame, temporal position, kind: own, recent or anchor, in attention order)
    and logits within 1e-5 relative."""
    model, text = model_and_text()
    geo = geometry(blocks, per_block)
    latents, calls, seen = package_rolling(model, text, geo, steps)
    ref = reference_rolling(model, text, geo, SEED, steps=steps)
    assert len(ref.calls) == 2 * (blocks + len(steps) - 1)
    assert_is_the_reference(geo, latents, calls, seen, ref)


# --------------------------------------------------------------------------------------------
# the reference on its own


@pytest.mark.parametrize("per_block", [2, 4])
def test_rolling_refuses_blocks_that_split_its_cache(per_block):
    """Blocks that do not divide the 21 attended frames would cut the clean pass's cache inside
    the anchor, which the release (3-frame blocks) never does: refused, naming the sizes."""
    calls = rolling_calls(num_blocks=14, frames_per_block=per_block, num_steps=5)
    with pytest.raises(ValueError, match=f"21 attended frames.*not {per_block} frames"):
        rolling_keys(calls, 0, per_block)


def test_rolling_policy_refuses_sinks_beyond_block_zero():
    """Only block 0 stays in the cache past the newest frames (the anchor, the sinks): a fourth
    sink frame of 3-frame blocks would be gone by frame 25, so it is refused up front."""
    calls = rolling_calls(num_blocks=14, frames_per_block=3, num_steps=5)
    with pytest.raises(ValueError, match="4 sink frames on the rolling sampler: at most block 0"):
        RollingKVCache(calls, 3, T, policy="sink_window", budget=21, sinks=4)
    RollingKVCache(calls, 3, T, policy="sink_window", budget=21, sinks=3)


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
    from sinkscope.analysis.reduce import reduce_attention_store
    from sinkscope.analysis.stores import open_frame_dataset
    from sinkscope.extraction.attention_store import AttentionStoreWriter
    from sinkscope.extraction.capture import LogitCapture
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


# --------------------------------------------------------------------------------------------
# KV-cache policies in place of Rolling Forcing's cache (issue 26): the reference on its own


def runs_of(keys) -> list[tuple]:
    return key_runs(keys, kinds=True)


def test_reference_policy_key_lists_by_hand():
    """The policies' key lists for 9 blocks of 3 frames, 5 steps, worked out by hand from the
    spec: window calls 5 (frames 3..17), 6 (6..20) and 12 (24..26), clean passes of blocks 5, 6,
    7 and 8."""
    windows = {w: window_blocks(w, 9, 5) for w in (5, 6, 12)}

    def call_runs(policy):
        out = {w: runs_of(window_keys(blocks, 3, policy=policy)) for w, blocks in windows.items()}
        out.update({f"b{b}": runs_of(cache_keys(b, 3, policy=policy)) for b in (5, 6, 7, 8)})
        return out

    own5, own6 = (3, 15, "window", 3, "own"), (6, 15, "window", 6, "own")
    own12 = (24, 3, "window", 24, "own")
    own = {b: (3 * b, 3, "window", 3 * b, "own") for b in range(9)}
    assert call_runs(Policy("window", budget=18)) == {
        5: [(0, 3, "clean", 0, "recent"), own5],
        6: [(3, 3, "clean", 3, "recent"), own6],
        12: [(9, 15, "clean", 9, "recent"), own12],
        "b5": [(0, 15, "clean", 0, "recent"), own[5]],
        "b6": [(3, 15, "clean", 3, "recent"), own[6]],
        "b7": [(6, 15, "clean", 6, "recent"), own[7]],
        "b8": [(9, 15, "clean", 9, "recent"), own[8]],
    }
    assert call_runs(Policy("sink_window", budget=18, sinks=1)) == {
        5: [(0, 1, "clean", 0, "sink"), (1, 2, "clean", 1, "recent"), own5],
        6: [(0, 1, "clean", 0, "sink"), (4, 2, "clean", 4, "recent"), own6],
        12: [(0, 1, "clean", 0, "sink"), (10, 14, "clean", 10, "recent"), own12],
        "b5": [(0, 1, "clean", 0, "sink"), (1, 14, "clean", 1, "recent"), own[5]],
        "b6": [(3, 15, "clean", 3, "recent"), own[6]],  # the sink has left the last 18
        "b7": [(6, 15, "clean", 6, "recent"), own[7]],
        "b8": [(9, 15, "clean", 9, "recent"), own[8]],
    }
    for turn in ("rerope", "delta"):
        assert call_runs(Policy("deep_sink", budget=18, sinks=1, turn=turn)) == {
            5: [(0, 1, "anchor", 0, "anchor"), (1, 2, "clean", 1, "recent"), own5],
            6: [(0, 1, "anchor", 3, "anchor"), (4, 2, "clean", 4, "recent"), own6],
            12: [(0, 1, "anchor", 9, "anchor"), (10, 14, "clean", 10, "recent"), own12],
            "b5": [(0, 1, "clean", 0, "sink"), (1, 14, "clean", 1, "recent"), own[5]],
            "b6": [(3, 15, "clean", 3, "recent"), own[6]],
            "b7": [(6, 15, "clean", 6, "recent"), own[7]],
            "b8": [(9, 15, "clean", 9, "recent"), own[8]],
        }
    sinks3 = (0, 3, "clean", 0, "sink")
    assert call_runs(Policy("sink_window", budget=21, sinks=3)) == {
        5: [sinks3, own5],
        6: [sinks3, (3, 3, "clean", 3, "recent"), own6],
        12: [sinks3, (9, 15, "clean", 9, "recent"), own12],
        "b5": [sinks3, (3, 12, "clean", 3, "recent"), own[5]],
        "b6": [sinks3, (3, 15, "clean", 3, "recent"), own[6]],
        "b7": [(3, 18, "clean", 3, "recent"), own[7]],  # the sinks leave the last 21
        "b8": [(6, 18, "clean", 6, "recent"), own[8]],
    }
    # deep_sink with S = A = 3, B = 21: Rolling Forcing's frames and positions (its clean passes'
    # sinks at 0..2 labelled sink where full's anchor is labelled anchor).
    for w, blocks in windows.items():
        full = window_keys(blocks, 3)
        deep = window_keys(blocks, 3, policy=Policy("deep_sink", budget=21, sinks=3))
        assert deep == full, w
    for b in range(9):
        full = [(k.frame, k.position) for k in cache_keys(b, 3)]
        deep = cache_keys(b, 3, policy=Policy("deep_sink", budget=21, sinks=3))
        assert [(k.frame, k.position) for k in deep] == full, b
        assert {k.kind for k in deep if k.frame < 3} <= {"sink", "own"}, b


def test_reference_deep_sink_is_full_when_it_is_rolling_forcing():
    """deep_sink (rerope, S = A = 3, B = 21) is Rolling Forcing's own cache, bit for bit; delta
    turns differ from rerope by rounding only."""
    model, text = model_and_text()
    geo = geometry(9)
    full = reference_rolling(model, text, geo, SEED, keep_layers=set())
    deep = reference_rolling(
        model, text, geo, SEED, keep_layers=set(), policy=Policy("deep_sink", 21, 3, "rerope")
    )
    assert torch.equal(deep.latents, full.latents)
    for a, b in zip(deep.calls, full.calls, strict=True):
        assert torch.equal(a.output, b.output), a.index
    delta = reference_rolling(
        model, text, geo, SEED, keep_layers=set(), policy=Policy("deep_sink", 21, 3, "delta")
    )
    error = per_frame_rel(delta.latents, full.latents)
    assert 0 < error.max() < 1e-5, error


def test_reference_delta_turn_is_rope_at_the_target():
    """The reference's delta turn of a key rotated at position p by d frames is RoPE at p + d
    (float64: to rounding), its spatial channels untouched bit for bit; in float32 it is one
    rounding from the float32 key re-roped at p + d."""
    rope = Rope(CONFIG.head_dim)
    layer = Layer(0, rope, T, 2, 3, keep=False)
    d_t = rope.dims[0]
    raw = torch.randn(
        T, CONFIG.num_heads, CONFIG.head_dim, generator=torch.Generator().manual_seed(1)
    )
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        x = raw.to(dtype)
        for p, d in ((0, 6), (2, 19), (1, 0), (9, -4)):
            turned = layer.turn(layer.rotate(x, p), d)
            assert turned.dtype == dtype
            torch.testing.assert_close(turned, layer.rotate(x, p + d), rtol=0, atol=tol)
            assert torch.equal(turned[..., d_t:], layer.rotate(x, p)[..., d_t:])


# --------------------------------------------------------------------------------------------
# KV-cache policies in place of Rolling Forcing's cache: the package against the reference


def policy_caches(model, geo: Geometry, steps, policy: CachePolicy | None):
    schedule = Schedule(steps=steps, shift=5.0, warp=True)
    calls = model_calls("rolling", geo, schedule)
    return rolling_caches(model, calls, geo.frames_per_block, T, policy=policy)


# (policy, budget, sinks, turn, steps) on 9 blocks of 3 frames: the sinks leave the clean passes'
# budget at block 6 (S = 1, B = 18) or 7 (S = 3, B = 21); the windows' clean frames reach 15.
POLICY_CASES = [
    ("window", 18, 0, None, ROLLING_STEPS),
    ("window", 21, 0, None, ROLLING_STEPS),
    ("sink_window", 21, 3, None, ROLLING_STEPS),
    ("sink_window", 18, 1, None, ROLLING_STEPS),
    ("deep_sink", 21, 3, "rerope", ROLLING_STEPS),
    ("deep_sink", 18, 1, "rerope", ROLLING_STEPS),
    ("deep_sink", 21, 3, "delta", ROLLING_STEPS),
    ("deep_sink", 18, 1, "delta", LONG_VIDEO_STEPS),
]


@pytest.mark.parametrize(
    ("name", "budget", "sinks", "turn", "steps"),
    POLICY_CASES,
    ids=[
        f"{n} B={b} S={s}{f' {t}' if t else ''} {len(st)} steps" for n, b, s, t, st in POLICY_CASES
    ],
)
def test_rolling_policy_is_the_reference(name, budget, sinks, turn, steps):
    """Each policy's rolling rollout against the reference under the same policy (latents, calls,
    every call's keys with their positions and kinds, logits); no call reads more than B key
    frames, and the window calls reach B."""
    model, text = model_and_text()
    geo = geometry(9)
    turn_setting = {"turn": turn} if turn else {}
    policy = CachePolicy(name, budget=budget, sink_frames=sinks, **turn_setting)
    caches = policy_caches(model, geo, steps, policy)
    latents, calls, seen = package_rolling(model, text, geo, steps, caches=caches)
    want = Policy(name, budget=budget, sinks=sinks, turn=turn or "rerope")
    ref = reference_rolling(model, text, geo, SEED, steps=steps, policy=want)
    assert_is_the_reference(geo, latents, calls, seen, ref)
    read = {i: len(tokens) // T for (i, _), (tokens, *_rest) in seen.items()}
    windows = [read[i] for i, kind, *_rest in calls if kind == "denoise"]
    assert max(read.values()) <= budget and max(windows) == budget, read


def test_rolling_deep_sink_is_rolling_forcing():
    """deep_sink with rerope turns, S = A = 3 and B = 21 is Rolling Forcing's own cache: the
    same latents, bit for bit, as the rolling rollout with no policy and with `full`."""
    model, text = model_and_text()
    geo = geometry(9)
    schedule = Schedule(steps=ROLLING_STEPS, shift=5.0, warp=True)

    def run(policy):
        caches = None if policy is None else policy_caches(model, geo, ROLLING_STEPS, policy)
        return rollout(
            model,
            text,
            geometry=geo,
            schedule=schedule,
            sampler="rolling",
            seed=SEED,
            progress=False,
            caches=caches,
        )

    own = run(None)
    assert torch.equal(run(CachePolicy("deep_sink", budget=21, sink_frames=3, turn="rerope")), own)
    assert torch.equal(run(CachePolicy("full")), own)


@pytest.mark.parametrize("turn", ["delta", "rerope"])
def test_rolling_deep_sink_turns(turn):
    """deep_sink's sinks in the package's window calls against its own keys of block 0's last
    clean pass (frames 0..2 at positions 0..2): with delta turns, those keys turned by the
    reference (float64, temporal channels only) by the sinks' position, bit for bit, at every
    call; with rerope, equal to rounding but not bit for bit once the sinks have moved (which the
    latents and logits, within 1e-5, cannot tell apart)."""
    model, text = model_and_text()
    geo = geometry(9)
    policy = CachePolicy("deep_sink", budget=21, sink_frames=3, turn=turn)
    caches = policy_caches(model, geo, ROLLING_STEPS, policy)
    keys, index = {}, [0]

    def on_call(i, call, timesteps):
        index[0] = i

    def hook(layer, q, k, visible):
        positions, kinds = visible.labels(T)
        keys[index[0], layer] = (k[0].clone(), visible.tokens.tolist(), positions, kinds)

    model.set_capture(hook, {0, 1})
    try:
        rollout(
            model,
            text,
            geometry=geo,
            schedule=Schedule(steps=ROLLING_STEPS, shift=5.0, warp=True),
            sampler="rolling",
            seed=SEED,
            progress=False,
            on_call=on_call,
            caches=caches,
        )
    finally:
        model.set_capture(None)
    layer = Layer(0, Rope(CONFIG.head_dim), T, 2, 3, keep=False)
    last_clean = 2 * (len(ROLLING_STEPS) - 1) + 1  # block 0's last clean pass
    moved = 0
    for (i, layer_index), (k, tokens, positions, kinds) in keys.items():
        if i <= last_clean or i % 2:
            continue  # window calls after block 0 has left the window
        own_k, _, own_positions, _ = keys[last_clean, layer_index]
        assert own_positions[: 3 * T].tolist() == [p for p in range(3) for _ in range(T)]
        sinks = (kinds == KEY_KIND["anchor"]).nonzero().flatten()
        assert [tokens[j] for j in sinks.tolist()] == list(range(3 * T)), i
        shift = int(positions[sinks[0]])
        want = torch.cat([layer.turn(own_k[f * T : (f + 1) * T], shift) for f in range(3)])
        if turn == "delta":
            assert torch.equal(k[sinks], want), (i, layer_index)
        else:
            torch.testing.assert_close(k[sinks], want, rtol=0, atol=1e-6)
            moved += shift > 0 and not torch.equal(k[sinks], want)
    assert turn == "delta" or moved > 0
