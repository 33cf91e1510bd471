"""The Wan DiT, its KV cache and the Self-Forcing sampler against independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sinkscope.extraction.sampling import CAUSVID, SELF_FORCING, Geometry, Schedule, rollout
from sinkscope.frames import block_starts, visible_frames
from sinkscope.wan.config import WanConfig
from sinkscope.wan.model import WanModel
from sinkscope.wan.rope import apply_rope, rope_angles

from .conftest import TINY, TINY_GEOMETRY, make_tiny_model


def block_causal_mask(visible_frames: torch.Tensor, frame_seq_length: int) -> torch.Tensor:
    """Token mask [F*T, F*T] from a frame visibility matrix bool [F, F] (True = may attend)."""
    expanded = visible_frames.to(torch.bool).repeat_interleave(frame_seq_length, dim=0)
    return expanded.repeat_interleave(frame_seq_length, dim=1)


def reference_rope(x: np.ndarray, grid: tuple[int, int, int], start_frame: int) -> np.ndarray:
    """Real-valued 3D RoPE: rotate channel pairs (2i, 2i+1) by pos * 10000^(-2i/d_axis)."""
    frames, height, width = grid
    d = x.shape[-1]
    d_hw = 2 * (d // 6)
    d_t = d - 2 * d_hw
    f, h, w = np.meshgrid(
        np.arange(start_frame, start_frame + frames),
        np.arange(height),
        np.arange(width),
        indexing="ij",
    )
    positions = [f.ravel(), h.ravel(), w.ravel()]
    angles = []
    for pos, dim in zip(positions, (d_t, d_hw, d_hw), strict=True):
        inv = 10000.0 ** (-np.arange(0, dim, 2) / dim)
        angles.append(np.outer(pos, inv))
    theta = np.concatenate(angles, axis=1)[:, None, :]  # [L, 1, d/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * np.cos(theta) - odd * np.sin(theta)
    out[..., 1::2] = even * np.sin(theta) + odd * np.cos(theta)
    return out


@pytest.mark.parametrize("head_dim", [16, 128])
def test_rope_matches_real_valued_rotation(head_dim):
    grid = (3, 2, 5)
    x = torch.randn(1, 30, 2, head_dim, dtype=torch.float64)
    got = apply_rope(x, rope_angles(head_dim, grid, start_frame=7, device=torch.device("cpu")))
    want = reference_rope(x.numpy()[0], grid, start_frame=7)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("start_frame", [1021, 1203, 8190])
def test_rope_past_wans_table_is_the_same_formula(start_frame):
    """Positions past Wan's 1024 rows (Rolling-Sink's table has 8192) rotate as the formula says,
    and the first 1024 rows are those of Wan's table of 1024."""
    grid = (4, 2, 3)
    x = torch.randn(1, 24, 2, 128, dtype=torch.float64)
    got = apply_rope(x, rope_angles(128, grid, start_frame, torch.device("cpu")))
    want = reference_rope(x.numpy()[0], grid, start_frame)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=0, atol=1e-9)
    from sinkscope.wan.rope import rope_tables, table_rows

    assert table_rows(1024) == 1024 and table_rows(1025) == 2048 and table_rows(8192) == 8192
    longer = rope_tables(128, torch.device("cpu"), rows=table_rows(start_frame + 4))
    wan = rope_tables(128, torch.device("cpu"))
    for long_axis, wan_axis in zip(longer, wan, strict=True):
        assert torch.equal(long_axis[:1024], wan_axis)


def test_rope_split_of_the_real_model():
    # 128 = 44 temporal + 42 height + 42 width channels (22 / 21 / 21 complex pairs).
    from sinkscope.wan.rope import axis_dims

    assert axis_dims(128) == (44, 42, 42)


def test_wan_1_3b_on_meta_has_reference_parameter_count_and_keys():
    with torch.device("meta"):
        model = WanModel(WanConfig())
    assert sum(p.numel() for p in model.parameters()) == 1_418_996_800
    keys = set(model.state_dict())
    assert len(keys) == 825
    for key in (
        "patch_embedding.weight",
        "text_embedding.2.bias",
        "time_projection.1.weight",
        "blocks.29.self_attn.norm_q.weight",
        "blocks.0.norm3.bias",
        "blocks.0.modulation",
        "blocks.0.ffn.2.weight",
        "head.head.weight",
        "head.modulation",
    ):
        assert key in keys
    assert not any("norm1" in k or ".norm2." in k for k in keys)  # affine-free norms have no keys
    caches = model.new_kv_caches(num_frames=21, frame_seq_length=1560, device="meta")
    assert len(caches) == 30 and caches[0].k.shape == (1, 21 * 1560, 12, 128)


def test_schedules_give_the_published_timesteps():
    np.testing.assert_allclose(SELF_FORCING.timesteps, [1000.0, 937.5, 833.3333, 625.0], rtol=1e-6)
    assert SELF_FORCING.pass_timesteps()[-1] == 0.0
    assert [SELF_FORCING.sigma(t) for t in SELF_FORCING.timesteps] == pytest.approx(
        [1.0, 0.9375, 0.833333, 0.625], abs=1e-5
    )
    assert CAUSVID.timesteps == [1000.0, 757.0, 522.0]
    assert CAUSVID.shift == 8.0 and CAUSVID.pass_kinds() == ["denoise"] * 3 + ["cache"]


def _record_calls(model):
    calls = []

    def hook(module, args, kwargs, output):
        calls.append(
            {
                "x": args[0].clone(),
                "t": args[1].clone(),
                "start": kwargs["start_frame"],
                "out": output.clone(),
            }
        )

    return calls, model.register_forward_hook(hook, with_kwargs=True)


def test_sampler_calls_the_model_five_times_per_block(tiny_model, tiny_text):
    calls, handle = _record_calls(tiny_model)
    latents = rollout(tiny_model, tiny_text, geometry=TINY_GEOMETRY, seed=3, progress=False)
    handle.remove()
    blocks = len(TINY_GEOMETRY.block_sizes)
    assert len(calls) == 5 * blocks
    received = [float(c["t"][0, 0]) for c in calls[:5]]
    np.testing.assert_allclose(received, [1000, 937.5, 833.3333, 625, 0], rtol=1e-6)
    assert [c["start"] for c in calls] == [s for s in (0, 2, 4) for _ in range(5)]
    # The first pass sees the seeded noise; x0 = x_t - sigma * v at the last step is the output,
    # and the cache pass re-reads exactly that clean block.
    noise = torch.randn((1, 16, 6, 4, 6), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(calls[0]["x"], noise[:, :, 0:2], rtol=0, atol=0)
    for block, start in enumerate((0, 2, 4)):
        last, cache = calls[5 * block + 3], calls[5 * block + 4]
        x0 = last["x"].double() - SELF_FORCING.sigma(625.0) * last["out"].double()
        torch.testing.assert_close(latents[:, :, start : start + 2], x0.float())
        torch.testing.assert_close(cache["x"], x0.float())


@pytest.mark.parametrize(
    ("local_attn_size", "sink_size"), [(-1, 0), (4, 0), (4, 2)], ids=["full", "window", "sink"]
)
def test_kv_cache_rollout_equals_masked_full_forward(
    tiny_model, tiny_text, local_attn_size, sink_size
):
    """Every pass of every block equals one forward over [clean earlier blocks | this block] with
    an explicit block-causal (windowed) mask and per-frame timesteps."""
    calls, handle = _record_calls(tiny_model)
    rollout(
        tiny_model,
        tiny_text,
        geometry=TINY_GEOMETRY,
        local_attn_size=local_attn_size,
        sink_size=sink_size,
        seed=1,
        progress=False,
    )
    handle.remove()
    sizes = TINY_GEOMETRY.block_sizes
    t_tokens = TINY.tokens_per_frame(4, 6)
    clean = [calls[5 * b + 4]["x"] for b in range(len(sizes))]  # inputs of the cache passes
    checked = 0
    for block, start in enumerate(block_starts(sizes)):
        start = int(start)
        seen = torch.from_numpy(visible_frames(sizes[: block + 1], local_attn_size, sink_size))
        mask = block_causal_mask(seen, t_tokens)
        for step in range(5):
            call = calls[5 * block + step]
            x = torch.cat([*clean[:block], call["x"]], dim=2)
            t = torch.cat([torch.zeros(1, start), call["t"]], dim=1)
            full = tiny_model(x, t, tiny_text, attn_mask=mask)
            torch.testing.assert_close(full[:, :, start:], call["out"], rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked == 15
    if local_attn_size != -1:
        # The window really evicts: the last block cannot see frames 2, 3 (sink) or 0, 1.
        assert not seen[4:, 2:4].any() if sink_size else not seen[4:, 0:2].any()


def test_window_changes_the_output(tiny_model, tiny_text):
    """Guards the test above: a masked forward is not trivially equal to an unmasked one."""
    full = rollout(tiny_model, tiny_text, geometry=TINY_GEOMETRY, seed=1, progress=False)
    windowed = rollout(
        tiny_model, tiny_text, geometry=TINY_GEOMETRY, local_attn_size=4, seed=1, progress=False
    )
    assert not torch.allclose(full[:, :, 4:], windowed[:, :, 4:])
    torch.testing.assert_close(full[:, :, :4], windowed[:, :, :4])


def test_rollout_without_window_refuses_to_overflow_the_cache(tiny_model, tiny_text):
    model = make_tiny_model()
    caches = model.new_kv_caches(num_frames=2, frame_seq_length=6)
    x = torch.randn(1, 16, 2, 4, 6)
    model(x, torch.zeros(1, 2), tiny_text, kv_caches=caches, start_frame=0)
    with pytest.raises(RuntimeError, match="local_attn_size"):
        model(x, torch.zeros(1, 2), tiny_text, kv_caches=caches, start_frame=2)


def test_same_seed_same_video_different_seed_different_video(tiny_model, tiny_text):
    geometry = Geometry(num_frames=4, frames_per_block=2, latent_height=4, latent_width=6)
    schedule = Schedule(steps=(1000, 500), shift=5.0)
    a = rollout(tiny_model, tiny_text, geometry=geometry, schedule=schedule, seed=5, progress=False)
    b = rollout(tiny_model, tiny_text, geometry=geometry, schedule=schedule, seed=5, progress=False)
    c = rollout(tiny_model, tiny_text, geometry=geometry, schedule=schedule, seed=6, progress=False)
    assert torch.equal(a, b) and not torch.allclose(a, c)


@pytest.mark.parametrize(("schedule", "calls_per_block"), [(SELF_FORCING, 5), (CAUSVID, 4)])
def test_model_calls_per_three_frame_block(tiny_model, tiny_text, schedule, calls_per_block):
    geometry = Geometry(num_frames=6, frames_per_block=3, latent_height=4, latent_width=6)
    calls, handle = _record_calls(tiny_model)
    rollout(tiny_model, tiny_text, geometry=geometry, schedule=schedule, progress=False)
    handle.remove()
    assert len(calls) == 2 * calls_per_block
    assert [c["x"].shape[2] for c in calls] == [3] * len(calls)
    received = [float(c["t"][0, 0]) for c in calls[:calls_per_block]]
    np.testing.assert_allclose(received, schedule.pass_timesteps(), rtol=1e-6)


def test_precision_follows_the_reference():
    from sinkscope.wan.model import timestep_sinusoid
    from sinkscope.wan.precision import model_dtype

    assert model_dtype(torch.device("cuda")) == torch.bfloat16
    assert model_dtype(torch.device("cpu")) == torch.float32
    # The `dtype` setting forces one on any device.
    assert model_dtype("cpu", "bfloat16") == torch.bfloat16
    assert model_dtype("cuda:1", "float32") == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        model_dtype("cpu", "float16")
    # The sinusoid is computed in float64: at t = 937.5 float32 angles would be off by ~1e-5.
    embedding = timestep_sinusoid(256, torch.tensor([937.5]))
    assert embedding.dtype == torch.float64
    half = torch.arange(128, dtype=torch.float64)
    want = torch.cat(
        [torch.cos(937.5 * 10000 ** (-half / 128)), torch.sin(937.5 * 10000 ** (-half / 128))]
    )
    torch.testing.assert_close(embedding[0], want, rtol=0, atol=1e-12)
    assert rope_angles(128, (1, 1, 1), 0, torch.device("cpu")).dtype == torch.complex128
