"""Prompts of segments checked before any job (`check_prompt_schedules`): what each rollout of a
switching prompt can run, named by key. No torch."""

from __future__ import annotations

import sys

from sinkscope.cache_choices import CUT_POLICIES, RECACHE_POLICIES
from sinkscope.frames import block_sizes
from sinkscope.schedules import block_starts_of
from sinkscope.segments import (
    Segment,
    SegmentError,
    check_switches,
    flush_before_full_window,
    switch_frames,
)

from .entries import (
    ConfigError,
    closed_loop_policy,
    closed_loop_rollouts,
    closed_loop_runs,
    prompt_segments,
    sampler_settings,
)


def _starts(config: dict, num_frames: int) -> list[int]:
    video = config["video"]
    sizes = block_sizes(num_frames, video["frames_per_block"], video["independent_first_frame"])
    return block_starts_of(sizes)


def check_prompt_schedules(config: dict) -> None:
    """Every prompt of segments: parsed (`segments.parse_segments`), its segments inside the
    longest rollout that reads it (the extraction's video, or the closed loop's where it runs
    the prompt) at one block each (`segments.check_switches`), and every switch a rollout
    reaches runnable there: the self_forcing sampler; LongLive's recache on Self-Forcing's own
    cache (closed loop: `RECACHE_POLICIES`); Infinity-RoPE's cut only where positions are
    relative (closed-loop policy relative, no full-cache reference); a flush only on a window."""
    loop_prompts = {prompt for _, prompt in closed_loop_runs(config)}
    for name in config["prompts"]:
        segments = prompt_segments(config, name)
        if len(segments) == 1:
            continue
        key = f"prompts.{name}"
        for warning in repeated_segment_texts(segments, key):
            print(f"sinkscope: warning: {warning}", file=sys.stderr)
        frames = config["video"]["num_frames"]
        if name in loop_prompts:
            frames = max(frames, config["closed_loop"]["num_frames"])
        try:
            check_switches(segments, _starts(config, frames), frames, key)
        except SegmentError as err:
            raise ConfigError(str(err)) from None
        for checkpoint in config["checkpoints"]:
            _check_extraction(config, key, segments, checkpoint)
        for checkpoint, prompt in closed_loop_runs(config):
            if prompt == name:
                _check_closed_loop(config, key, segments, checkpoint)


def repeated_segment_texts(segments: list[Segment], key: str) -> list[str]:
    """One line per segment whose text an earlier segment of the same prompt already has: the
    switch into it changes no prompt, yet LongLive's recache runs there and the switch tables
    record it. Warned, not refused (a scene may return on purpose)."""
    first: dict[str, int] = {}
    warnings = []
    for index, segment in enumerate(segments):
        text = " ".join(segment.text.split())
        if text in first:
            warnings.append(
                f"{key}.segments[{index}] has the text of {key}.segments[{first[text]}]: "
                "its switch changes no prompt, though the recache (sampler.recache) runs there "
                "and switches.csv records it"
            )
        else:
            first[text] = index
    return warnings


def _reached(config: dict, segments: list[Segment], num_frames: int) -> list[int]:
    """Indices i of the segments whose end (the switch into segment i + 1) a rollout of
    `num_frames` reaches."""
    return list(range(len(switch_frames(segments, _starts(config, num_frames)))))


def _sampler(config: dict, key: str, checkpoint: str, reached: list[int], where: str) -> dict:
    sampler = sampler_settings(config, checkpoint)
    if reached and sampler["kind"] != "self_forcing":
        raise ConfigError(
            f"{key}: switches in {where} of checkpoint {checkpoint!r}, whose sampler is "
            f"{sampler['kind']}: prompt switches run on the self_forcing sampler (LongLive's and "
            "Infinity-RoPE's)"
        )
    return sampler


def _check_extraction(config: dict, key: str, segments: list[Segment], checkpoint: str) -> None:
    frames = config["video"]["num_frames"]
    reached = _reached(config, segments, frames)
    where = f"the extraction's {frames} frames (video.num_frames)"
    sampler = _sampler(config, key, checkpoint, reached, where)
    for index in reached:
        segment = segments[index]
        if segment.cut is not None:
            raise ConfigError(
                f"{key}.segments[{index}].cut: the cut falls inside {where}, whose cache keeps "
                "absolute positions; Infinity-RoPE's cut needs relative ones (closed-loop policy "
                "relative): start the next segment past the extraction's video"
            )
        if segment.flush and sampler["local_attn_size"] == -1:
            raise ConfigError(
                f"{key}.segments[{index}].flush: a flush cuts the cache to its window, and "
                f"{where} run without one (sampler.local_attn_size: -1)"
            )
    if sampler["local_attn_size"] != -1:
        _warn_early_flushes(config, key, segments, frames, sampler["local_attn_size"])


def _warn_early_flushes(config, key, segments, num_frames, window) -> None:
    switches = switch_frames(segments, _starts(config, num_frames))
    for warning in flush_before_full_window(segments, switches, window, key):
        print(f"sinkscope: warning: {warning}", file=sys.stderr)


def _check_closed_loop(config: dict, key: str, segments: list[Segment], checkpoint: str) -> None:
    frames = config["closed_loop"]["num_frames"]
    reached = _reached(config, segments, frames)
    if not reached:
        return
    where = f"the closed loop's {frames} frames (closed_loop.num_frames)"
    sampler = _sampler(config, key, checkpoint, reached, where)
    rollouts = closed_loop_rollouts(config)
    if sampler.get("recache", False):
        bad = [name for name in rollouts if name not in RECACHE_POLICIES]
        if bad:
            raise ConfigError(
                f"sampler.recache: LongLive's recache at the switches of {key} runs on "
                f"Self-Forcing's own cache ({', '.join(RECACHE_POLICIES)}), not on closed-loop "
                f"rollouts {bad}: drop them from closed_loop.policies or set recache: false"
            )
    for index in reached:
        segment = segments[index]
        if segment.cut is not None:
            bad = [name for name in rollouts if name not in CUT_POLICIES]
            if bad:
                raise ConfigError(
                    f"{key}.segments[{index}].cut: Infinity-RoPE's cut needs relative positions "
                    f"(closed-loop policy {', '.join(CUT_POLICIES)}); {bad} keep absolute ones "
                    "(the full-cache reference among them: closed_loop.reference: none)"
                )
        if segment.flush and "full" in rollouts:
            raise ConfigError(
                f"{key}.segments[{index}].flush: a flush cuts the cache to its window; the "
                "full-cache reference has none (closed_loop.reference: none)"
            )
    if "relative" in rollouts:  # Infinity-RoPE's cache, whose release flushes
        window = closed_loop_policy(config, "relative")["budget"]
        _warn_early_flushes(config, key, segments, frames, window)
