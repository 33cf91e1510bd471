"""bfloat16 rollouts round where the released code rounds: sinkscope's latents against
tests/release_arithmetic.py (the releases' arithmetic, cast for cast, no sinkscope module) on the
same weights, prompt and noise, bit for bit on the CPU: the Self-Forcing sampler (full cache,
Self-Forcing's window with a sink, Causal Forcing++'s first-block steps, the [1, 3, 3] layout,
CausVid's unwarped steps), the rolling sampler (Rolling Forcing's 5 steps, Causal Forcing's
long videos' 4), LongLive's cache and its recache at prompt switches (global_sink on and off);
a capture, survey or token store, never moves a bfloat16 rollout by a bit; the closed-loop job
gives the release's latents; the RoPE tables and Participative Compression's score are the
releases' bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sinkscope.cache_choices import ParticipativeChoice
from sinkscope.extraction.attention_store import AttentionStoreWriter
from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.caches import ParticipativeKVCache
from sinkscope.extraction.capture import LogitCapture
from sinkscope.extraction.sampling import (
    CAUSVID,
    SELF_FORCING,
    Geometry,
    Schedule,
    model_calls,
    rollout,
)
from sinkscope.extraction.store import TokenStoreWriter
from sinkscope.passes import resolve_passes
from sinkscope.schedules import with_switches
from sinkscope.wan.config import WanConfig
from sinkscope.wan.rope import rope_tables

from . import release_arithmetic as release
from .conftest import TINY, make_tiny_model

BF16 = torch.bfloat16
# Wide enough (64 channels, 16 tokens a frame) that the LayerNorm's rounding shows: in the tiny
# models no element falls where the float32 form and the release's differ.
WIDE = WanConfig(dim=64, ffn_dim=96, num_heads=4, num_layers=2, freq_dim=16, text_dim=8, text_len=8)
ROLLING_FORCING = Schedule(steps=(1000, 800, 600, 400, 200), shift=5.0, warp=True)


def bf16_model(cfg: WanConfig = WIDE, seed: int = 3):
    return make_tiny_model(seed=seed, cfg=cfg).to(BF16)


def texts(n: int, cfg: WanConfig = WIDE) -> torch.Tensor:
    return torch.randn(n, 5, cfg.text_dim, generator=torch.Generator().manual_seed(7))


def release_model(model) -> release.ReleaseDiT:
    """The release's model: the same parameters, as the pipeline casts them (all bfloat16)."""
    cfg = model.config
    return release.ReleaseDiT(
        dict(model.state_dict()),
        dim=cfg.dim,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        patch_size=tuple(cfg.patch_size),
        freq_dim=cfg.freq_dim,
        text_len=cfg.text_len,
        out_dim=cfg.out_dim,
        eps=cfg.eps,
    )


def release_run(geo: Geometry, seed: int, prompts, schedule: Schedule) -> release.Run:
    """The noise sinkscope's rollout draws (one CPU generator: the initial tensor, then one draw
    the size of each denoising call's input), handed to the release in its layout and dtype."""
    generator = torch.Generator().manual_seed(seed)
    size = (geo.latent_height, geo.latent_width)
    noise = torch.randn((1, geo.channels, geo.num_frames, *size), generator=generator)

    def draw(shape):
        fresh = torch.randn((1, geo.channels, shape[0], *size), generator=generator)
        return fresh.permute(0, 2, 1, 3, 4).flatten(0, 1).to(BF16)

    return release.Run(
        steps=schedule.steps,
        shift=schedule.shift,
        warp=schedule.warp,
        prompts=prompts.to(BF16),
        noise=noise.permute(0, 2, 1, 3, 4).to(BF16),
        draw=draw,
        first_block_steps=schedule.first_block_steps,
    )


def as_sinkscope(latents: torch.Tensor) -> torch.Tensor:
    """The release's [1, F, C, H, W] output in sinkscope's [1, C, F, H, W] float32."""
    return latents.permute(0, 2, 1, 3, 4).float()


def tokens_per_frame(geo: Geometry, cfg: WanConfig = WIDE) -> int:
    return cfg.tokens_per_frame(geo.latent_height, geo.latent_width)


SELF_FORCING_RUNS = {
    "full cache": (Geometry(6, 2, 8, 8), SELF_FORCING, -1, 0),
    "window 4 with 1 sink": (Geometry(8, 2, 8, 8), SELF_FORCING, 4, 1),
    "Causal Forcing++ first-block steps": (
        Geometry(4, 1, 8, 8),
        Schedule(steps=(1000, 500), first_block_steps=(1000, 750, 500, 250)),
        -1,
        0,
    ),
    "[1, 3, 3] layout": (Geometry(7, 3, 8, 8, independent_first_frame=True), SELF_FORCING, -1, 0),
    "CausVid, unwarped steps": (Geometry(6, 3, 8, 8), CAUSVID, -1, 0),
}


def self_forcing_pair(name: str, model=None):
    geo, schedule, window, sinks = SELF_FORCING_RUNS[name]
    model = bf16_model() if model is None else model
    text = texts(1)
    ours = rollout(
        model,
        text,
        geometry=geo,
        schedule=schedule,
        seed=2,
        dtype=BF16,
        local_attn_size=window,
        sink_size=sinks,
        progress=False,
    )
    theirs = release.self_forcing(
        release_model(model),
        release_run(geo, 2, text, schedule),
        geo.block_sizes,
        tokens_per_frame(geo),
        window=window,
        sinks=sinks,
    )
    return ours, as_sinkscope(theirs)


@pytest.mark.parametrize("name", list(SELF_FORCING_RUNS))
def test_self_forcing_in_bfloat16_is_the_release_bit_for_bit(name):
    ours, theirs = self_forcing_pair(name)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()


@pytest.mark.parametrize(
    ("blocks", "schedule"), [(8, ROLLING_FORCING), (7, SELF_FORCING)], ids=["RF", "CF long"]
)
def test_rolling_in_bfloat16_is_the_release_bit_for_bit(blocks, schedule):
    """Rolling Forcing's pipeline (and Causal Forcing's long videos, 4 steps): past the five
    windows that hold block 0, so the anchor, the working cache and the clean passes all run."""
    model, text = bf16_model(), texts(1)
    geo = Geometry(3 * blocks, 3, 8, 8)
    ours = rollout(
        model, text, geometry=geo, schedule=schedule, sampler="rolling", seed=5, dtype=BF16,
        progress=False,
    )  # fmt: skip
    theirs = release.rolling_forcing(
        release_model(model), release_run(geo, 5, text, schedule), blocks, 3, tokens_per_frame(geo)
    )
    assert torch.equal(ours, as_sinkscope(theirs)), (ours - as_sinkscope(theirs)).abs().max()


# LongLive's setting at the tiny model's size: window 12 with 3 sinks, blocks of 3; a switch
# acting inside the window (9: every frame recached) and one past it (18).
@pytest.mark.parametrize("global_sink", [True, False])
def test_longlive_recache_in_bfloat16_is_the_release_bit_for_bit(global_sink):
    model, prompts = bf16_model(), texts(3)
    geo = Geometry(24, 3, 8, 8)
    switches = [9, 18]
    calls = with_switches(
        model_calls("self_forcing", geo, SELF_FORCING),
        geo.block_sizes,
        switches,
        recache_frames=12,
        recache_slot=SELF_FORCING.num_passes,
        global_sink=global_sink,
    )
    caches = CachePolicy("sink_window", 12, sink_frames=3).new_caches(
        model,
        num_frames=geo.num_frames,
        frame_seq_length=tokens_per_frame(geo),
        frames_per_block=3,
        device="cpu",
        dtype=BF16,
    )
    ours = rollout(
        model, prompts, geometry=geo, seed=4, dtype=BF16, caches=caches, calls=calls,
        progress=False,
    )  # fmt: skip
    theirs = release.self_forcing(
        release_model(model),
        release_run(geo, 4, prompts, SELF_FORCING),
        geo.block_sizes,
        tokens_per_frame(geo),
        window=12,
        sinks=3,
        switches=switches,
        recache=True,
        global_sink=global_sink,
    )
    assert torch.equal(ours, as_sinkscope(theirs)), (ours - as_sinkscope(theirs)).abs().max()


def test_the_reference_tells_the_old_roundings_apart(monkeypatch):
    """Either of the two roundings sinkscope had before (the re-noise with Python floats, three
    bfloat16 roundings; the LayerNorm in float32 with float32 weights) parts the latents from
    the release: the references above can fail."""
    import sinkscope.extraction.sampling as sampling
    import sinkscope.wan.model as wan_model

    def three_roundings(x0, noise, sigma):
        return (1 - sigma) * x0 + sigma * noise

    def float32_layer_norm(self, x):
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        normed = torch.nn.functional.layer_norm(
            x.float(), self.normalized_shape, weight, bias, self.eps
        )
        return normed.type_as(x)

    # Wider than WIDE: the kernel and the float32 form part in about one element of a thousand,
    # and in WIDE's rollout none falls where they do on a CPU with AVX-512 (an AVX2 one parts
    # them there); at 256 channels every seed tried parts them on both.
    model = bf16_model(dataclasses.replace(WIDE, dim=256, ffn_dim=384))
    for target, name, old in (
        (sampling, "add_noise", three_roundings),
        (wan_model.LayerNorm, "forward", float32_layer_norm),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(target, name, old)
            ours, theirs = self_forcing_pair("full cache", model)
        assert not torch.equal(ours, theirs), name


@pytest.mark.parametrize("store", ["attention", "tokens"])
def test_a_capture_never_changes_a_bfloat16_rollout(tmp_path, store):
    """Latents with a survey or a token capture of every layer and pass equal, bit for bit,
    those of the same bfloat16 rollout captured by nothing (the capture reads q and k; its
    reductions run in float32 beside the model, never in its place)."""
    model = bf16_model(TINY)
    text = texts(1, TINY)
    geo = Geometry(6, 2, 4, 6)
    plain = rollout(model, text, geometry=geo, seed=2, dtype=BF16, progress=False)
    t = tokens_per_frame(geo, TINY)
    common = {
        "num_heads": TINY.num_heads,
        "num_frames": geo.num_frames,
        "frame_seq_length": t,
        "timesteps": SELF_FORCING.pass_timesteps(),
        "pass_kinds": SELF_FORCING.pass_kinds(),
        "attrs": {},
    }
    layers = range(TINY.num_layers)
    if store == "attention":
        writers = {
            layer: AttentionStoreWriter(tmp_path / f"{layer}.zarr", frames_per_block=2, **common)
            for layer in layers
        }
    else:
        writers = {
            layer: TokenStoreWriter(tmp_path / f"{layer}.zarr", **common) for layer in layers
        }
    capture = LogitCapture(writers, resolve_passes("all", 4), t, TINY.head_dim, softmax_rows=4)
    model.set_capture(capture)
    try:
        captured = rollout(
            model, text, geometry=geo, seed=2, dtype=BF16, on_pass=capture.begin_pass,
            progress=False,
        )  # fmt: skip
    finally:
        model.set_capture(None)
        for writer in writers.values():
            writer.close()
    assert all((tmp_path / f"{layer}.zarr").exists() for layer in layers)
    assert torch.equal(plain, captured)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_tables_are_wans_bit_for_bit(head_dim):
    """sinkscope's RoPE tables are Wan's `rope_params` (1 / theta^(2j/d)) bit for bit, at the
    real model's head_dim 128 too, where theta^(-2j/d), the form sinkscope had, differs in the
    last bit of some entries; rows past Wan's 1024 follow the same formula."""
    d = head_dim
    dims = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    ours = rope_tables(d, torch.device("cpu"), rows=2048)
    for table, dim in zip(ours, dims, strict=True):
        assert torch.equal(table, release.rope_params(2048, dim))
    if head_dim == 128:
        exponents = torch.arange(0, dims[0], 2, dtype=torch.float64) / dims[0]
        old = torch.outer(torch.arange(1024, dtype=torch.float64), 10000.0**-exponents)
        assert not torch.equal(torch.polar(torch.ones_like(old), old), ours[0][:1024])


def test_participative_scores_are_deep_forcings_arithmetic():
    """Participative Compression's score of a bfloat16 cache is Deep Forcing's
    (`causal_model.py`: the buffered queries summed in bfloat16, `torch.bmm` of that sum with
    the flattened keys, rounded to bfloat16, then float32), bit for bit, with its many exact
    ties; the float64 score sinkscope had ranks differently."""
    t, heads, head_dim, block = 6, 2, 16, 2
    choice = ParticipativeChoice(
        frame_seq_length=t, capacity=6, budget=4, sink_frames=1, recent_frames=1,
        frames_per_block=block, reuse_cap=0,
    )  # fmt: skip
    cache = ParticipativeKVCache(
        choice, num_frames=8, num_heads=heads, head_dim=head_dim, device=torch.device("cpu"),
        dtype=BF16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    shared = torch.randn(heads, head_dim, generator=g)  # a common direction: scores cluster
    for b in range(3):
        for _ in range(2):
            q = (shared + 0.3 * torch.randn(1, block * t, heads, head_dim, generator=g)).to(BF16)
            k = (shared + 0.3 * torch.randn(1, block * t, heads, head_dim, generator=g)).to(BF16)
            cache.update(k, k, b * block * t, q=q, k_raw=k)
    count = choice.buffered_queries()
    recent_q = cache.queries[:, -count:]
    q_sum_flat = recent_q.reshape(1, count, -1).sum(dim=1, keepdim=True)
    k_trans = cache.k[:, : cache.held].reshape(1, cache.held, -1).transpose(1, 2)
    expected = torch.bmm(q_sum_flat, k_trans).squeeze(1).to(torch.float32)[0]
    got = cache.scores()
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert len(torch.unique(got)) < len(got)  # bfloat16 ties, as in the release
    exact = torch.einsum(
        "hd,mhd->m", recent_q[0].double().sum(0), cache.k[0, : cache.held].double()
    )
    assert not torch.equal(
        torch.argsort(exact, stable=True), torch.argsort(got.double(), stable=True)
    )


def test_the_closed_loop_job_in_bfloat16_is_the_release_bit_for_bit(tmp_path):
    """Through the closed-loop job (checkpoint file, prompt file, `dtype: bfloat16`, the policy's
    caches, a capture over the cache's slots): LongLive's cache, B = 4 with 2 sinks, saves the
    latents the release computes."""
    from sinkscope.extraction.closed_loop import closed_loop, load_latents
    from sinkscope.wan.text import load_prompt_segments

    from .test_capture import _write_inputs

    model = make_tiny_model(seed=4)
    video = {"num_frames": 8, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}
    prompt, settings = _write_inputs(tmp_path, model=model, video=video)
    closed_loop(
        checkpoint_name="tiny",
        prompt_name="p",
        prompt_embeddings=prompt,
        settings={
            **settings,
            "dtype": "bfloat16",
            "policy": {"name": "sink_window", "budget": 4, "sink_frames": 2},
        },
        latents_path=tmp_path / "loop.safetensors",
        table_path=tmp_path / "loop.csv",
        blocks_path=tmp_path / "loop.blocks.csv",
        reference=None,
        layers=[0],
        stores=[tmp_path / "loop.zarr"],
        progress=False,
    )
    ours = load_latents(tmp_path / "loop.safetensors")[0]
    geo = Geometry(8, 2, 4, 6)
    text = load_prompt_segments(prompt)[0]
    theirs = release.self_forcing(
        release_model(model.to(BF16)),
        release_run(geo, settings["seed"], text, SELF_FORCING),
        geo.block_sizes,
        tokens_per_frame(geo, TINY),
        window=4,
        sinks=2,
    )
    assert torch.equal(ours, as_sinkscope(theirs)[0]), (ours - as_sinkscope(theirs)[0]).abs().max()
