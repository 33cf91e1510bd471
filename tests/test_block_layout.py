"""Self-Forcing's block layouts: blocks of `video.frames_per_block`, or a lone first latent frame
before them (`video.independent_first_frame`, [1, 3, 3, ...]), through the rollout, the KV cache,
the stores, the frame dataset, the statistics, the policies, the figures and the config checks.
A frame count that is not whole blocks is refused, never cut into a shorter last block."""

from __future__ import annotations

import csv
import dataclasses
import io

import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from snakemake.exceptions import WorkflowError

from sinkscope.analysis.plots.run import plot_figure4
from sinkscope.analysis.policies import policy_table
from sinkscope.analysis.reduce import reduce_attention_store, reduce_token_store
from sinkscope.analysis.stats import frame_statistics, query_sets
from sinkscope.analysis.stores import open_attention_store, open_frame_dataset
from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.closed_loop import frame_table_csv
from sinkscope.extraction.job import RolloutPlan, extract
from sinkscope.extraction.sampling import Geometry, rollout
from sinkscope.frames import (
    attention_chunk_frames,
    block_sizes,
    block_starts,
    token_store_bytes,
    visible_frames,
)
from sinkscope.workflow import entries, resources
from sinkscope.workflow.entries import ConfigError
from sinkscope.workflow.params import closed_loop_settings, extraction_settings

from .conftest import TINY, make_tiny_model
from .test_capture import _write_inputs
from .test_closed_loop import _policy_rollout
from .test_config import checked
from .test_model import block_causal_mask

T = TINY.tokens_per_frame(4, 6)
# 7 latent frames: a lone first frame, then 2 blocks of 3.
LONE = Geometry(
    num_frames=7, frames_per_block=3, latent_height=4, latent_width=6, independent_first_frame=True
)
# Self-Forcing's image-to-video length: 19 = 1 + 6 x 3 latent frames.
SF_19 = [1] + [3] * 6


@pytest.mark.parametrize(
    ("num_frames", "frames_per_block", "lone", "sizes"),
    [
        (21, 3, False, [3] * 7),
        (19, 3, True, SF_19),
        (6, 2, False, [2, 2, 2]),
        (7, 3, True, [1, 3, 3]),
        (1, 3, True, [1]),
        (3, 1, True, [1, 1, 1]),
    ],
)
def test_block_sizes_of_both_layouts(num_frames, frames_per_block, lone, sizes):
    assert block_sizes(num_frames, frames_per_block, lone) == sizes
    geometry = Geometry(
        num_frames=num_frames, frames_per_block=frames_per_block, independent_first_frame=lone
    )
    assert geometry.block_sizes == sizes


def test_block_starts_of_the_lone_first_frame():
    assert block_starts(SF_19).tolist() == [0, 1, 4, 7, 10, 13, 16]


@pytest.mark.parametrize(
    ("num_frames", "lone", "rule", "nearest"),
    [
        (7, False, "it must be a multiple of video.frames_per_block=3", "6 or 9"),
        (20, False, "it must be a multiple of video.frames_per_block=3", "18 or 21"),
        (2, False, "it must be a multiple of video.frames_per_block=3", "3"),
        (
            21,
            True,
            "video.num_frames - 1 must be a multiple of video.frames_per_block=3",
            "19 or 22",
        ),
        (2, True, "video.num_frames - 1 must be a multiple of video.frames_per_block=3", "1 or 4"),
    ],
)
def test_a_frame_count_that_does_not_fit_is_refused_naming_the_keys(
    num_frames, lone, rule, nearest
):
    with pytest.raises(ValueError) as raised:
        block_sizes(num_frames, 3, lone)
    message = str(raised.value)
    assert f"video.num_frames={num_frames} does not fit the block layout" in message
    assert f"video.independent_first_frame: {str(lone).lower()}" in message
    assert rule in message
    assert f"nearest that fit: {nearest})" in message
    with pytest.raises(ValueError, match="does not fit the block layout"):
        _ = Geometry(
            num_frames=num_frames, frames_per_block=3, independent_first_frame=lone
        ).block_sizes
    with pytest.raises(ValueError, match=r"closed_loop\.num_frames=.* does not fit"):
        block_sizes(num_frames, 3, lone, frames_key="closed_loop.num_frames")


def test_the_option_reaches_the_rollout_plan():
    video = {"num_frames": 19, "frames_per_block": 3, "latent_height": 4, "latent_width": 6}
    settings = {
        "sampler": {
            "steps": [1000],
            "shift": 5.0,
            "warp": True,
            "local_attn_size": -1,
            "sink_size": 0,
        },
        "video": {**video, "independent_first_frame": True},
        "capture": {"passes": "all"},
        "seed": 0,
    }
    assert RolloutPlan.from_settings(settings).geometry.block_sizes == SF_19
    settings["video"] = video  # settings without the key: Self-Forcing's T2V layout
    with pytest.raises(ValueError, match="does not fit"):
        _ = RolloutPlan.from_settings(settings).geometry.block_sizes


def _rollout_calls(model, text, geometry, local_attn_size, sink_size):
    """Every model call of a rollout: its input, timesteps, start frame, output, and the absolute
    frames the first layer's cache holds (in slot order) once the call has written its keys."""
    caches = model.new_kv_caches(
        num_frames=geometry.num_frames,
        frame_seq_length=T,
        local_attn_size=local_attn_size,
        sink_size=sink_size,
    )
    calls = []

    def hook(module, args, kwargs, output):
        cache = caches[0]
        tokens = cache.slot_token[: cache.local_end].view(-1, T)
        assert (tokens == tokens[:, :1] + torch.arange(T)).all(), "the cache holds whole frames"
        calls.append(
            {
                "x": args[0].clone(),
                "t": args[1].clone(),
                "start": kwargs["start_frame"],
                "out": output.clone(),
                "cached": (tokens[:, 0] // T).tolist(),
            }
        )

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        rollout(model, text, geometry=geometry, seed=1, progress=False, caches=caches)
    finally:
        handle.remove()
    return calls


@pytest.mark.parametrize(
    ("local_attn_size", "sink_size", "last_block_sees"),
    [(-1, 0, [0, 1, 2, 3, 4, 5, 6]), (4, 0, [3, 4, 5, 6]), (4, 1, [0, 4, 5, 6])],
    ids=["full", "window", "sink"],
)
def test_rollout_with_a_lone_first_frame_equals_a_masked_full_forward(
    tiny_model, tiny_text, local_attn_size, sink_size, last_block_sees
):
    """The first block is frame 0 alone, then blocks of 3; the cache holds exactly the frames
    `visible_frames` says, and every pass equals one forward over [clean earlier blocks | this
    block] with the block-causal (windowed) mask of the [1, 3, 3] layout."""
    calls = _rollout_calls(tiny_model, tiny_text, LONE, local_attn_size, sink_size)
    sizes = LONE.block_sizes
    assert sizes == [1, 3, 3]
    assert [c["x"].shape[2] for c in calls] == [1] * 5 + [3] * 10
    assert [c["start"] for c in calls] == [0] * 5 + [1] * 5 + [4] * 5
    assert [tuple(c["t"].shape) for c in calls] == [(1, 1)] * 5 + [(1, 3)] * 10
    seen = visible_frames(sizes, local_attn_size, sink_size)
    for index, call in enumerate(calls):
        assert call["cached"] == np.flatnonzero(seen[call["start"]]).tolist(), index
    assert calls[-1]["cached"] == last_block_sees
    assert calls[0]["cached"] == [0]  # the lone first frame sees only itself

    clean = [calls[5 * b + 4]["x"] for b in range(len(sizes))]  # inputs of the cache passes
    for block, start in enumerate(block_starts(sizes)):
        start = int(start)
        mask = block_causal_mask(
            torch.from_numpy(visible_frames(sizes[: block + 1], local_attn_size, sink_size)), T
        )
        for step in range(5):
            call = calls[5 * block + step]
            x = torch.cat([*clean[:block], call["x"]], dim=2)
            t = torch.cat([torch.zeros(1, start), call["t"]], dim=1)
            full = tiny_model(x, t, tiny_text, attn_mask=mask)
            torch.testing.assert_close(full[:, :, start:], call["out"], rtol=1e-4, atol=1e-5)


def test_the_layout_changes_the_video(tiny_model, tiny_text):
    """Guards the test above: blocks [1, 3] and [1, 1, 1, 1] of the same noise share frame 0
    (alone in its block either way) and differ where frames 1..3 are denoised together."""
    lone = dataclasses.replace(LONE, num_frames=4)
    frame_by_frame = dataclasses.replace(LONE, num_frames=4, frames_per_block=1)
    assert (lone.block_sizes, frame_by_frame.block_sizes) == ([1, 3], [1, 1, 1, 1])
    a = rollout(tiny_model, tiny_text, geometry=lone, seed=1, progress=False)
    b = rollout(tiny_model, tiny_text, geometry=frame_by_frame, seed=1, progress=False)
    assert torch.equal(a[:, :, 0], b[:, :, 0])
    assert not torch.allclose(a[:, :, 1:], b[:, :, 1:])


@pytest.mark.parametrize(
    "policy",
    [
        CachePolicy("window", 4),
        CachePolicy("sink_window", 4, sink_frames=1),
        CachePolicy("deep_sink", 4, sink_frames=1),
        CachePolicy("top_c", 4, recent_frames=1),
    ],
    ids=lambda p: p.name,
)
def test_cache_policies_run_with_a_lone_first_frame(tiny_text, policy):
    """Each policy's cache takes the [1, 3, 3] layout: a covering budget is the full cache bit
    for bit; a budget of 4 frames keeps the first two blocks whole and changes the third."""
    model = make_tiny_model(seed=7)
    full, _ = _policy_rollout(model, tiny_text, None, geometry=LONE)
    covering = CachePolicy(policy.name, 7, policy.sink_frames, policy.recent_frames)
    same, _ = _policy_rollout(model, tiny_text, covering, geometry=LONE)
    assert torch.equal(same, full)
    evicting, _ = _policy_rollout(model, tiny_text, policy, geometry=LONE)
    assert torch.equal(evicting[:, :, :4], full[:, :, :4])
    assert not torch.allclose(evicting[:, :, 4:], full[:, :, 4:])


def test_frame_table_blocks_follow_the_layout():
    latents = torch.randn(16, 7, 4, 6, generator=torch.Generator().manual_seed(0))
    common = dict(checkpoint="c", prompt="p", policy=CachePolicy("window", 4), frames_per_block=3)
    table = frame_table_csv(latents, latents, independent_first_frame=True, **common)
    rows = list(csv.DictReader(io.StringIO(table)))
    assert [int(r["frame"]) for r in rows] == list(range(7))
    assert [int(r["block"]) for r in rows] == [0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="does not fit"):
        frame_table_csv(latents, latents, **common)


@pytest.fixture(scope="module")
def run_19(tmp_path_factory):
    """19 = 1 + 6 x 3 latent frames of the tiny model, extracted to a token store and an
    attention store of layer 1 and reduced to two frame datasets."""
    root = tmp_path_factory.mktemp("sf19")
    video = {
        "num_frames": 19,
        "frames_per_block": 3,
        "latent_height": 4,
        "latent_width": 6,
        "independent_first_frame": True,
    }
    prompt, settings = _write_inputs(root, video=video)
    settings["capture"]["passes"] = 0  # the tests read step 0: a fifth of the chunks to write
    common = dict(
        checkpoint_name="tiny",
        prompt_name="p",
        prompt_embeddings=prompt,
        settings=settings,
        layers=[1],
        progress=False,
    )
    extract(outputs=[root / "t" / "layer1.zarr"], **common)
    extract(outputs=[root / "a" / "layer1.zarr"], store="attention", **common)
    reduce_token_store(root / "t" / "layer1.zarr", root / "tf.zarr")
    reduce_attention_store(root / "a" / "layer1.zarr", root / "af.zarr")
    return root


def test_stores_record_the_layout_and_chunk_every_block_whole(run_19):
    for kind in ("t", "a"):
        assert xr.open_zarr(run_19 / kind / "layer1.zarr").attrs["block_sizes"] == SF_19
    key_mass = zarr.open_array(run_19 / "a" / "layer1.zarr" / "key_mass", mode="r")
    assert attention_chunk_frames(SF_19) == 1 and attention_chunk_frames([3] * 7) == 3
    assert key_mass.chunks[2] == 1  # a 3-frame chunk would straddle blocks 1 = frames 1..3


def test_frame_dataset_statistics_policies_and_figure_of_19_frames(run_19):
    tokens = open_frame_dataset(run_19 / "tf.zarr")
    attention = open_frame_dataset(run_19 / "af.zarr")
    blocks = [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6, 6]
    seen = visible_frames(SF_19)
    for ds in (tokens, attention):
        assert ds["block"].values.tolist() == blocks
        assert (np.isnan(ds["prob_mass"].values) == ~seen[None, None]).all()
    a, t = attention["prob_mass"].values, tokens["prob_mass"].values
    assert np.nanmax(np.abs(a - t)) <= 2e-3

    # The statistics' last block is frames 16..18; each block is its own query set.
    ((label, queries, own),) = query_sets(tokens["block"].values, "last_block")
    assert label == "last_block" and queries.tolist() == own.tolist() == [16, 17, 18]
    each = query_sets(tokens["block"].values, "each_block")
    assert [q.tolist() for _, q, _ in each[:2]] == [[0], [1, 2, 3]]
    table = frame_statistics(tokens, "last_block")
    row = table[
        (table["head"].astype(str) == "0")
        & (table["step"] == 0)
        & (table["measure"] == "prob_mass")
        & (table["query"] == "last_block")
    ].iloc[0]
    profile = tokens["prob_mass"].values[0, 0, 16:19].mean(axis=0)
    assert row["first"] == pytest.approx(profile[0], rel=1e-6)
    assert row["recent_mass"] == pytest.approx(profile[16:19].sum(), rel=1e-6)

    # Policies: one query block per block; block 0 sees frame 0 only, block 1 frames 0..3.
    recall = policy_table(
        tokens,
        open_attention_store(run_19 / "a" / "layer1.zarr"),
        budgets=[3, 6],
        sinks=[0, 1],
        recent_frames=1,
    )
    visible = recall.groupby("query_block")["visible_frames"].unique()
    assert visible.index.tolist() == list(range(7))
    assert [v.tolist() for v in visible.iloc[:3]] == [[1], [4], [7]]
    assert visible.iloc[-1].tolist() == [19]

    fig = plot_figure4([tokens], [(1, 0)])
    assert "last block: query frames 16–18 (latent)" in fig.texts[0].get_text()


def test_config_option_is_checked_and_reruns_extraction(tmp_path):
    default = checked()
    assert default["video"]["independent_first_frame"] is False  # the schema's default

    def lone(config, num_frames=19, loop=43):
        config["video"].update(independent_first_frame=True, num_frames=num_frames)
        config["closed_loop"].update(num_frames=loop)

    config = checked(lone)
    cache = tmp_path / "digests.json"
    params = extraction_settings(config, "demo_a", cache)
    assert params["video"]["independent_first_frame"] is True
    assert params != extraction_settings(default, "demo_a", cache)  # so the jobs rerun
    # The default is not in the params: stores made before the option existed stay current.
    assert "independent_first_frame" not in extraction_settings(default, "demo_a", cache)["video"]
    loop = closed_loop_settings(config, "demo_a", "window", cache)
    assert loop["video"]["num_frames"] == 43 and loop["video"]["independent_first_frame"] is True
    assert RolloutPlan.from_settings(loop).geometry.block_sizes == [1] + [3] * 14
    model = entries.model_config(config, "demo_a")
    assert resources.layer_store_bytes(config, "demo_a") == token_store_bytes(
        num_passes=1,  # the demo's capture.token_passes: 0
        num_heads=model.num_heads,
        frame_seq_length=model.tokens_per_frame(8, 12),
        sizes=SF_19,
        local_attn_size=-1,
        sink_size=0,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c["video"].update(independent_first_frame=True),
            "video.num_frames=21 does not fit the block layout: with "
            "video.independent_first_frame: true, video.num_frames - 1 must be a multiple of "
            "video.frames_per_block=3",
        ),
        (
            lambda c: c["video"].update(num_frames=20),
            "video.num_frames=20 does not fit the block layout: with "
            "video.independent_first_frame: false, it must be a multiple of "
            "video.frames_per_block=3",
        ),
        (
            lambda c: c["video"].update(independent_first_frame=True, num_frames=19),
            "closed_loop.num_frames=42 does not fit the block layout: with "
            "video.independent_first_frame: true, closed_loop.num_frames - 1 must be a multiple "
            "of video.frames_per_block=3",
        ),
        (
            lambda c: c["closed_loop"].update(num_frames=40),
            "closed_loop.num_frames=40 does not fit the block layout: with "
            "video.independent_first_frame: false, it must be a multiple of "
            "video.frames_per_block=3",
        ),
    ],
    ids=["lone-21", "blocks-20", "closed-loop-lone-42", "closed-loop-40"],
)
def test_check_config_refuses_a_layout_that_does_not_fit(change, message):
    with pytest.raises(ConfigError) as raised:
        checked(change)
    assert message in str(raised.value)


def test_the_closed_loop_length_is_free_without_closed_loop_policies():
    checked(lambda c: c["closed_loop"].update(num_frames=40, policies=[]))


def test_schema_wants_a_boolean():
    with pytest.raises(WorkflowError, match="independent_first_frame"):
        checked(lambda c: c["video"].update(independent_first_frame="yes"))
