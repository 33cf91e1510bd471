"""Prompt switches in the rollout: LongLive's recache (global_sink true and false, inside and past
the window, the full cache) and Infinity-RoPE's scenes with a RoPE cut, against an independent
reference (tests/switch_references.py: explicit key lists with each key's RoPE position and kind,
attention in float64): latents on every frame and, at every call of every layer, the frames,
positions and kinds of the keys; the schedule of calls against hand-written tables; the
segments' parsing and refusals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr

from sinkscope.analysis.reduce import reduce_attention_store
from sinkscope.cache_choices import KEY_KINDS
from sinkscope.extraction.cache_policies import CachePolicy
from sinkscope.extraction.closed_loop import closed_loop
from sinkscope.extraction.job import extract
from sinkscope.extraction.sampling import SELF_FORCING, Geometry, model_calls, rollout
from sinkscope.schedules import BlockPart, ModelCall, self_forcing_calls, with_switches
from sinkscope.segments import (
    Segment,
    SegmentError,
    check_switches,
    parse_segments,
    switch_frames,
)
from sinkscope.storage import decoded_attrs
from sinkscope.wan.text import EncodedPrompt, load_prompt_segments, save_prompt_segments
from sinkscope.workflow.entries import ConfigError
from sinkscope.workflow.params import extraction_settings, prompt_segment_params

from .conftest import make_tiny_model
from .switch_references import Switching, acting_frames, reference_switching
from .test_capture import _write_inputs
from .test_config import checked
from .test_position_caches import CONFIG, T, model_and_text, per_frame_rel

# --------------------------------------------------------------------------------------------
# segments and schedules against hand-written tables


def test_longlive_switch_frames_act_at_the_next_block_start():
    """LongLive's interactive switches (40, 80, 120, 160, 200 of 240 frames, blocks of 3) act at
    42, 81, 120, 162 and 201 (long-video-family.md)."""
    segments = [Segment("a", 0), *(Segment(str(s), s) for s in (40, 80, 120, 160, 200))]
    starts = list(range(0, 240, 3))
    assert switch_frames(segments, starts) == [42, 81, 120, 162, 201]
    assert check_switches(segments, starts, 240, "prompts.p") == [42, 81, 120, 162, 201]


def test_with_switches_inserts_the_recache_before_the_switching_block():
    calls = self_forcing_calls([3] * 6, [2] * 6)  # 2 steps: slots 0, 1, cache 2, recache 3
    out = with_switches(calls, [3] * 6, [6, 15], recache_frames=4, recache_slot=3, cuts=[None, 45])
    assert len(out) == len(calls) + 2
    assert [c.segment for c in out if c.kind != "recache"] == [0] * 6 + [1] * 9 + [2] * 3
    recaches = [(i, c) for i, c in enumerate(out) if c.kind == "recache"]
    # n = min(4, c) frames before the switch, split by block, at step None on slot 3.
    assert recaches[0] == (
        6,
        ModelCall("recache", (BlockPart(0, 2, 1, None, 3), BlockPart(1, 3, 3, None, 3)), 1),
    )
    assert recaches[1] == (
        16,
        ModelCall("recache", (BlockPart(3, 11, 1, None, 3), BlockPart(4, 12, 3, None, 3)), 2),
    )
    # The cut: every call of the block at 15, and only those.
    assert [c.rope_cut for c in out if c.start == 15 and c.kind != "recache"] == [45] * 3
    assert {c.rope_cut for c in out if c.start != 15} == {None}
    # Without a window the recache re-encodes every frame before the switch.
    (first,) = [
        c for c in with_switches(calls, [3] * 6, [6], recache_frames=-1) if c.kind == "recache"
    ]
    assert (first.start, first.end) == (0, 6)
    assert with_switches(calls, [3] * 6, []) == calls


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"segments": []}, "empty"),
        ({"segments": [{"text": "a", "start": 3}]}, r"segments\[0\]\.start: 3; the first"),
        ({"segments": [{"text": "a"}, {"text": "b", "start": 5}, {"text": "c", "start": 5}]},
         r"segments\[2\]\.start: 5 is not after"),
        ({"segments": [{"text": "a"}, {"text": " ", "start": 5}]}, r"segments\[1\]\.text: empty"),
        ({"segments": [{"text": "a"}, {"text": "b"}]}, r"segments\[1\]\.start: None"),
        ({"segments": [{"text": "a"}, {"text": "b", "start": 6, "flush": True}]},
         r"segments\[1\]\.flush: the last segment"),
        ({"segments": [{"text": "a"}, {"text": "b", "start": 6, "cut": 45}]},
         r"segments\[1\]\.cut: the last segment"),
    ],
)  # fmt: skip
def test_parse_segments_refuses_what_cannot_run(entry, message):
    with pytest.raises(SegmentError, match=message):
        parse_segments(entry, "prompts.p")


@pytest.mark.parametrize(
    ("starts", "acting"),
    [
        ([10, 11], [12, 15]),  # LongLive's own case (long-video-family.md)
        ([10, 11, 12], [12, 15, 18]),
        ([4, 5], [6, 9]),
        ([3, 6], [3, 6]),
    ],
)
def test_switches_in_one_block_wait_for_the_next_block_as_longlive(starts, acting):
    """Two switch frames in one block: the later waits for the next block start, no segment is
    lost (LongLive's loop switches at most once per block, at c >= the next switch frame)."""
    segments = [Segment("a"), *(Segment(str(s), s) for s in starts)]
    block_starts = list(range(0, 21, 3))
    assert switch_frames(segments, block_starts) == acting
    assert check_switches(segments, block_starts, 21, "prompts.p") == acting
    assert acting_frames([0, *starts], 21, 3) == acting  # the rollout reference's rule


def test_check_switches_refuses_segments_past_the_video_or_at_no_block():
    starts = list(range(0, 21, 3))
    with pytest.raises(SegmentError, match=r"segments\[1\]\.start: 21 is past the video's 21"):
        check_switches([Segment("a"), Segment("b", 21)], starts, 21, "prompts.p")
    with pytest.raises(SegmentError, match=r"segments\[1\]\.start: 19 is after the last block"):
        check_switches([Segment("a"), Segment("b", 19)], starts, 21, "prompts.p")
    late = [Segment("a"), Segment("b", 17), Segment("c", 18)]
    with pytest.raises(
        SegmentError,
        match=r"segments\[2\]\.start: 18 waits for a block after segments\[1\]'s switch at "
        r"frame 18 \(one switch per block\), and none starts after it",
    ):
        check_switches(late, starts, 21, "prompts.p")
    assert parse_segments("plain", "prompts.p") == [Segment("plain")]


# --------------------------------------------------------------------------------------------
# the rollout against the reference


def geometry(frames: int) -> Geometry:
    return Geometry(num_frames=frames, frames_per_block=3, latent_height=4, latent_width=4)


def texts(n: int) -> torch.Tensor:
    return torch.randn(n, 5, CONFIG.text_dim, generator=torch.Generator().manual_seed(11))


def switching_rollout(model, text, geo, starts, caches, *, recache=None, global_sink=True,
                      cuts=(), capture=True):  # fmt: skip
    """Latents and, with `capture`, per (block, pass, kind, layer) the (frame, token, position,
    kind) of every key each call saw."""
    segments = [Segment(str(i), s) for i, s in enumerate(starts)]
    switches = switch_frames(segments, list(range(0, geo.num_frames, 3)))
    calls = with_switches(
        model_calls("self_forcing", geo, SELF_FORCING),
        geo.block_sizes,
        switches,
        recache_frames=recache,
        recache_slot=5,
        global_sink=global_sink,
        cuts=cuts,
    )
    seen, current = {}, []

    def on_call(index, call, timesteps):
        if call.kind == "recache":
            current[:] = [call.parts[-1].block + 1, "recache", "recache"]
        else:
            (part,) = call.parts
            current[:] = [part.block, part.pass_index, call.kind]

    def hook(layer, q, k, visible):
        positions, kinds = visible.labels(T)
        seen[(*current, layer)] = list(
            zip(
                (visible.tokens // T).tolist(),
                (visible.tokens % T).tolist(),
                positions.tolist(),
                [KEY_KINDS[kind] for kind in kinds.tolist()],
                strict=True,
            )
        )

    model.set_capture(hook if capture else None)
    try:
        latents = rollout(
            model,
            text,
            geometry=geo,
            seed=3,
            progress=False,
            caches=caches,
            calls=calls,
            on_call=on_call,
        )
    finally:
        model.set_capture(None)
    return latents, seen


def window_caches(model, geo, window, sinks):
    return model.new_kv_caches(
        num_frames=geo.num_frames, frame_seq_length=T, local_attn_size=window, sink_size=sinks
    )


LONGLIVE = {
    # 30 frames, window 12 with 3 sinks: a switch inside the window (9) and one past it (24).
    "recache global_sink": (Switching("sink_window", 12, 3, True, True), 30, [0, 8, 22]),
    "recache no global_sink": (Switching("sink_window", 12, 3, True, False), 30, [0, 8, 22]),
    "recache full cache": (Switching("sink_window", -1, 0, True), 18, [0, 10]),
    "text switch only": (Switching("sink_window", 12, 3), 27, [0, 13]),
    # Two switch frames in one block: the later acts a block later (12 and 15).
    "two switches in one block": (Switching("sink_window", 12, 3, True, True), 21, [0, 10, 11]),
    "two switches past the window, no global_sink": (
        Switching("sink_window", 12, 3, True, False),
        36,
        [0, 15, 27],
    ),
}


@pytest.mark.parametrize("name", list(LONGLIVE))
def test_longlive_switches_are_the_reference(name):
    """Latents within 1e-5 of the reference on every frame (float32 against float64
    attention), and every call of every layer, recaches included, saw the reference's keys."""
    settings, frames, starts = LONGLIVE[name]
    model, _ = model_and_text()
    geo = geometry(frames)
    text = texts(len(starts))
    caches = window_caches(model, geo, settings.window, settings.sinks)
    recache = settings.window if settings.recache else None
    latents, seen = switching_rollout(
        model, text, geo, starts, caches, recache=recache, global_sink=settings.global_sink
    )
    ref = reference_switching(model, text, geo, 3, settings, starts)
    error = per_frame_rel(latents, ref.latents).max()
    assert error < 1e-5, error
    want = {key for layer in ref.layers for key in layer.record}
    assert set(seen) == want
    for key in sorted(seen, key=str):
        assert seen[key] == ref.rows(*key), key
    recaches = [key for key in seen if key[2] == "recache"]
    assert len(recaches) == (2 * (len(starts) - 1) if settings.recache else 0)


def test_recache_changes_the_video_and_global_sink_decides_the_sinks():
    """The three LongLive cases differ where they should: the recache changes the frames after
    the switch, and global_sink which frames the later blocks see as sinks."""
    model, _ = model_and_text()
    geo = geometry(30)
    text = texts(3)
    runs = {}
    for recache, global_sink in ((None, True), (12, True), (12, False)):
        caches = window_caches(model, geo, 12, 3)
        runs[recache, global_sink] = switching_rollout(
            model, text, geo, [0, 8, 22], caches, recache=recache, global_sink=global_sink
        )
    plain, keep, drop = runs[None, True], runs[12, True], runs[12, False]
    assert torch.equal(plain[0][:, :, :9], keep[0][:, :, :9])  # before the first switch
    assert per_frame_rel(plain[0], keep[0])[9:].min() > 1e-4
    assert torch.equal(keep[0][:, :, :24], drop[0][:, :, :24])  # the switch at 9 rewrites all
    assert per_frame_rel(keep[0], drop[0])[24:].min() > 1e-4
    sinks = lambda rows: sorted({r[0] for r in rows if r[3] == "sink"})  # noqa: E731
    assert sinks(keep[1][9, 0, "denoise", 0]) == [0, 1, 2]
    assert sinks(keep[1][9, 0, "denoise", 0]) == sinks(keep[1][8, 0, "denoise", 0])
    assert sinks(drop[1][9, 0, "denoise", 0]) == [12, 13, 14]  # c - 12 .. c - 10 of c = 24
    assert sinks(drop[1][8, "recache", "recache", 0]) == [12, 13, 14]


def test_identical_segments_without_recache_are_the_plain_rollout_bit_for_bit():
    model, _ = model_and_text()
    geo = geometry(21)
    one = texts(1)
    caches = window_caches(model, geo, 9, 3)
    plain = rollout(model, one, geometry=geo, seed=3, progress=False, caches=caches)
    caches = window_caches(model, geo, 9, 3)
    switched, _ = switching_rollout(model, one.expand(3, -1, -1), geo, [0, 7, 14], caches)
    assert torch.equal(plain, switched)


INFINITY = {
    "scenes with a cut": ([0, 12, 21], [45, None]),
    "scenes without a cut": ([0, 12, 21], [None, None]),
    "a cut into the last scene": ([0, 9, 18], [None, 45]),
}


@pytest.mark.parametrize("name", list(INFINITY))
def test_infinity_rope_scenes_are_the_reference(name):
    starts, cuts = INFINITY[name]
    model, _ = model_and_text()
    geo = geometry(27)
    text = texts(len(starts))
    policy = CachePolicy("relative", 6, 1)
    caches = policy.new_caches(
        model,
        num_frames=27,
        frame_seq_length=T,
        frames_per_block=3,
        device="cpu",
        dtype=torch.float32,
    )
    latents, seen = switching_rollout(model, text, geo, starts, caches, cuts=cuts)
    ref = reference_switching(model, text, geo, 3, Switching("relative", 6, 1), starts, cuts)
    error = per_frame_rel(latents, ref.latents).max()
    assert error < 1e-5, error
    assert set(seen) == {key for layer in ref.layers for key in layer.record}
    for key in seen:
        assert seen[key] == ref.rows(*key), key
    cut_blocks = [s // 3 for s, cut in zip(starts[1:], cuts, strict=True) if cut is not None]
    for block in cut_blocks:
        own = [r[2] for r in seen[block, 0, "denoise", 0] if r[3] == "own"]
        assert sorted(set(own)) == [45, 46, 47]


@pytest.mark.parametrize("policy", ["deep_sink", "relative", "top_c"])
def test_caches_that_cannot_recache_refuse_the_call(policy):
    model, _ = model_and_text()
    geo = geometry(12)
    caches = CachePolicy(policy, 6, 1, recent_frames=1).new_caches(
        model, num_frames=12, frame_seq_length=T, frames_per_block=3, device="cpu",
        dtype=torch.float32, token_grid=(2, 2),
    )  # fmt: skip
    with pytest.raises(ValueError, match="does not run LongLive's recache"):
        switching_rollout(model, texts(2), geo, [0, 6], caches, recache=6, capture=False)


def test_absolute_caches_refuse_a_cut():
    model, _ = model_and_text()
    geo = geometry(12)
    with pytest.raises(ValueError, match="Infinity-RoPE's cut needs relative"):
        switching_rollout(model, texts(2), geo, [0, 6], window_caches(model, geo, 6, 1), cuts=[45])


# --------------------------------------------------------------------------------------------
# bad schedules refused before any job, naming the key


def _story(*segments) -> dict:
    return {"segments": [dict(segment) for segment in segments]}


A, B = {"text": "an eagle", "start": 0}, {"text": "a harbor", "start": 15}


def _recache(policies):
    def change(config):
        config["prompts"]["story"] = _story(A, B)
        config["sampler"]["recache"] = True
        config["closed_loop"].update(policies=policies, runs=[["demo_a", "story"]])

    return change


BAD_SCHEDULES = {
    "past the video": (
        lambda c: c["prompts"].update(story=_story(A, {"text": "b", "start": 42})),
        r"prompts\.story\.segments\[1\]\.start: 42 is past the video's 21 latent frames",
    ),
    "past the closed loop": (
        lambda c: (
            c["prompts"].update(story=_story(A, {"text": "b", "start": 42})),
            c["closed_loop"].update(runs=[["demo_a", "story"]]),
        ),
        r"segments\[1\]\.start: 42 is past the video's 42 latent frames",
    ),
    "two at the last block": (
        lambda c: c["prompts"].update(
            story=_story(A, {"text": "b", "start": 17}, {"text": "c", "start": 18})
        ),
        r"segments\[2\]\.start: 18 waits for a block after segments\[1\]'s switch at frame 18",
    ),
    "a cut in the extraction": (
        lambda c: c["prompts"].update(story=_story({**A, "cut": 45}, B)),
        r"prompts\.story\.segments\[0\]\.cut: the cut falls inside the extraction's 21 frames",
    ),
    "a flush without a window": (
        lambda c: c["prompts"].update(story=_story({**A, "flush": True}, B)),
        r"segments\[0\]\.flush: a flush cuts the cache to its window, and the extraction's",
    ),
    "a flush with nothing after it": (
        lambda c: c["prompts"].update(story=_story(A, {**B, "flush": True})),
        r"prompts\.story\.segments\[1\]\.flush: the last segment has no following segment",
    ),
    "a recache on deep_sink": (
        _recache(["sink_window", "deep_sink"]),
        r"sampler\.recache: .* not on closed-loop rollouts \['deep_sink'\]",
    ),
    "switches on the rolling sampler": (
        lambda c: (
            c["prompts"].update(story=_story(A, B)),
            c["sampler"].update(kind="rolling"),
            c["closed_loop"].update(policies=[]),
        ),
        r"prompts\.story: switches in the extraction's 21 frames .* sampler is rolling",
    ),
    "a segment empty after Wan's cleaning": (
        lambda c: c["prompts"].update(story=_story(A, {"text": "&nbsp;", "start": 15})),
        r"prompts\.story\.segments\[1\]\.text: '&nbsp;' is empty after Wan's prompt cleaning",
    ),
}


@pytest.mark.parametrize("name", list(BAD_SCHEDULES))
def test_bad_schedules_are_refused_before_any_job(name):
    change, message = BAD_SCHEDULES[name]
    with pytest.raises(ConfigError, match=message):
        checked(change)


def test_a_flush_before_the_window_fills_is_warned_where_the_release_differs(capsys):
    """Infinity-RoPE's cache (relative, 6 frames): a flush into the block at frame 3 comes before
    the window has filled, where the release attends to zero keys: the check says so, naming
    the segment; one at frame 6 passes silently."""

    def scenes(first_start):
        def change(config):
            config["prompts"]["story"] = _story(
                {**A, "flush": True}, {"text": "b", "start": first_start}
            )
            config["sampler"]["local_attn_size"] = 6  # the extraction's window too
            config["closed_loop"].update(
                policies=["relative"], budget=6, sink_frames=1, reference="none",
                runs=[["demo_a", "story"]],
            )  # fmt: skip

        return change

    checked(scenes(6))
    assert "flush" not in capsys.readouterr().err
    checked(scenes(3))
    err = capsys.readouterr().err
    assert (
        "sinkscope: warning: prompts.story.segments[0].flush: the flush at frame 3 comes before "
        "the 6-frame window has filled" in err
    )


def test_a_segment_repeating_an_earlier_text_is_warned_naming_both(capsys):
    """The same text in two segments: the switch changes no prompt, yet the recache runs and
    switches.csv records it; the check names both segments (and stays silent otherwise)."""
    checked(_recache(["window"]))
    assert "has the text of" not in capsys.readouterr().err

    def repeated(config):
        _recache(["window"])(config)
        config["prompts"]["story"] = _story(A, B, {"text": "an  eagle", "start": 18})

    checked(repeated)
    assert (
        "sinkscope: warning: prompts.story.segments[2] has the text of prompts.story.segments[0]"
        in capsys.readouterr().err
    )


def test_a_good_schedule_passes_and_plain_prompts_keep_their_params():
    config = checked(_recache(["window", "sink_window"]))
    assert prompt_segment_params(config, "story")[1] == {
        "cut": None,
        "flush": False,
        "start": 15,
        "text": "a harbor",
    }
    assert prompt_segment_params(config, "eagle") is None
    # recache and global_sink reach the jobs' params only where the sampler recaches.
    assert extraction_settings(config, "demo_a")["sampler"]["recache"] is True
    assert "recache" not in extraction_settings(checked(), "demo_a")["sampler"]


# --------------------------------------------------------------------------------------------
# the jobs: the prompt file, the stores' recache pass, over every token and over slots


def test_a_switching_survey_and_its_full_cache_closed_loop_store_the_same_recache(tmp_path):
    """A two-segment prompt under the recache: the encode file holds both segments; the survey
    (a store over every token) and the full-cache closed loop over its slots (its recache rows
    written after their blocks) reduce to the same frame dataset, recache pass included, whose
    rows are exactly the frames the recache re-encoded; the stores name the segments."""
    video = {"num_frames": 8, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}
    _, settings = _write_inputs(tmp_path, video=video)
    cfg = make_tiny_model(seed=4).config
    g = torch.Generator().manual_seed(2)
    encoded = [
        EncodedPrompt(torch.randn(cfg.text_len, cfg.text_dim, generator=g), 5, 5) for _ in "ab"
    ]
    segments = [Segment("first", 0), Segment("second", 5)]  # acts at the block at 6
    prompt = tmp_path / "story.safetensors"
    save_prompt_segments(prompt, encoded, segments)
    embeds, _, read = load_prompt_segments(prompt)
    assert read == segments and torch.equal(embeds[1], encoded[1].embeds)
    settings["sampler"] = {**settings["sampler"], "recache": True}
    common = {"checkpoint_name": "tiny", "prompt_name": "story", "prompt_embeddings": prompt}
    extract(**common, layers=[0], outputs=[tmp_path / "s.zarr"], settings=settings,
            store="attention", progress=False)  # fmt: skip
    closed_loop(
        **common,
        settings={**settings, "policy": {"name": "full"}},
        latents_path=tmp_path / "full.safetensors",
        table_path=tmp_path / "full.csv",
        blocks_path=tmp_path / "full.blocks.csv",
        layers=[0],
        stores=[tmp_path / "loop.zarr"],
        progress=False,
    )
    for name in ("s", "loop"):
        store = xr.open_zarr(tmp_path / f"{name}.zarr")
        assert list(store["pass_kind"].values) == [*["denoise"] * 4, "cache", "recache"]
        attrs = decoded_attrs(store)
        assert attrs["switch_frames"] == [6] and attrs["segments"][1]["start"] == 5
        reduce_attention_store(tmp_path / f"{name}.zarr", tmp_path / f"{name}_f.zarr")
    got, want = (xr.open_zarr(tmp_path / f"{n}_f.zarr")["prob_mass"].values for n in ("loop", "s"))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    recached = ~np.isnan(want[5]).all(axis=(0, 2))  # [query frame]: the recache's rows
    assert recached.tolist() == [True] * 6 + [False] * 2  # no window: every frame before 6
    np.testing.assert_allclose(np.nansum(want[5][:, :6], axis=-1), 1.0, atol=1e-5)
    blocks = pd.read_csv(tmp_path / "full.blocks.csv")
    assert blocks["segment"].tolist() == [0, 0, 0, 1]
