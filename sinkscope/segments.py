"""Prompt schedules: a prompt as a list of segments, each with its text and the latent frame it
starts at, as LongLive's interactive prompts and Infinity-RoPE's timed scenes run them (facts:
long-video-family.md). No torch, no numpy: the config checks, the rules and the jobs share it.

- A segment takes effect at the first block starting at or after its `start` (LongLive: at most
  one switch per block; 40, 80, 160, 200 act at 42, 81, 162, 201 with Self-Forcing's [1, 3, ...]
  blocks of its image-to-video layout, at 42, 81 ... of a T2V layout's block starts). Two
  segments that would take effect at one block do as LongLive's loop does: the later waits for
  the next block start (10 and 11 with blocks of 3 act at 12 and 15), so no segment is lost.
  From that block on, every model call's cross-attention reads the segment's text: the
  cross-attention cache reset of both releases (sinkscope keeps no cross-attention cache).
- `flush` on a segment: Infinity-RoPE's KV flush at the start of the next one, which cuts the
  cache to [sinks | the newest frames the window shows]. Every window cache of sinkscope holds
  exactly that at a block start, so a flush changes no key (tested); it needs a window. One
  exception, where sinkscope differs from the release and warns (`flush_before_full_window`):
  a flush before the window has filled (Infinity-RoPE's 6 frames: a scene starting at block 1)
  makes the release copy still-empty cache slots, so that block attends to zero keys and
  values in place of its cached frames; sinkscope's flush still changes nothing.
- `cut` on a segment (Infinity-RoPE's `#`): the next segment's first block sits at RoPE
  positions cut .. cut + frames - 1 in all its passes, cache pass included (45 in the release),
  while the sinks and the cached frames keep theirs; only where positions are relative.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass


class SegmentError(ValueError):
    """A prompt schedule that cannot run, naming the key."""


@dataclass(frozen=True)
class Segment:
    """One segment of a prompt: its text, the latent frame it starts at, and at its end
    Infinity-RoPE's KV flush (`flush`) and RoPE cut to position `cut` (None: no cut)."""

    text: str
    start: int = 0
    flush: bool = False
    cut: int | None = None


def parse_segments(entry, key: str) -> list[Segment]:
    """The segments of a `prompts` entry: a string or {text, embeddings} (one segment from frame
    0), or {segments: [{text, start, flush, cut}, ...]}. Refuses, naming `key` and the item, a
    first segment not at frame 0, a segment starting before or where the previous one does, an
    empty text, and a flush or cut on the last segment (nothing follows it)."""
    if isinstance(entry, str):
        return [Segment(entry)]
    if "segments" not in entry:
        return [Segment(entry["text"])]
    items = entry["segments"]
    if not items:
        raise SegmentError(f"{key}.segments: empty; give at least one {{text, start}}")
    segments = []
    for index, item in enumerate(items):
        where = f"{key}.segments[{index}]"
        text = item.get("text", "")
        if not isinstance(text, str) or not text.strip():
            raise SegmentError(f"{where}.text: empty; every segment needs a prompt")
        start = item.get("start", 0 if index == 0 else None)
        if isinstance(start, bool) or not isinstance(start, int):
            raise SegmentError(f"{where}.start: {start!r} is not a latent frame (an integer)")
        cut = item.get("cut")
        if cut is not None and (isinstance(cut, bool) or not isinstance(cut, int) or cut < 0):
            raise SegmentError(f"{where}.cut: {cut!r} is not a RoPE position (an integer >= 0)")
        segment = Segment(text, start, bool(item.get("flush", False)), cut)
        if index == 0 and start != 0:
            raise SegmentError(f"{where}.start: {start}; the first segment starts at frame 0")
        if segments and start <= segments[-1].start:
            raise SegmentError(
                f"{where}.start: {start} is not after the previous segment's start "
                f"{segments[-1].start}; segments come in order and do not overlap"
            )
        segments.append(segment)
    last = segments[-1]
    if last.flush or last.cut is not None:
        what = "flush" if last.flush else "cut"
        raise SegmentError(
            f"{key}.segments[{len(segments) - 1}].{what}: the last segment has no following "
            f"segment to {what} into"
        )
    return segments


def switch_frames(segments: Sequence[Segment], block_starts: Sequence[int]) -> list[int]:
    """The latent frame where each segment after the first takes effect: the first block start
    at or after its start and after the previous segment's switch (LongLive switches at most
    once per block, at a block start c >= the next switch frame, so a later switch falling in
    the same block waits for the next one). Segments that would take effect past the video's
    last block never do and are left out, so a shorter rollout runs the segments inside it."""
    switches: list[int] = []
    for segment in segments[1:]:
        later = [
            start
            for start in block_starts
            if start >= segment.start and (not switches or start > switches[-1])
        ]
        if not later:
            break
        switches.append(later[0])
    return switches


def check_switches(
    segments: Sequence[Segment], block_starts: Sequence[int], num_frames: int, key: str
) -> list[int]:
    """`switch_frames` of a rollout of `num_frames` whose blocks start at `block_starts`,
    refusing, naming `key`, a segment that starts past the video or takes effect at no block
    (past the last block start, itself or after an earlier segment waited for a block)."""
    for index, segment in enumerate(segments):
        if segment.start >= num_frames:
            raise SegmentError(
                f"{key}.segments[{index}].start: {segment.start} is past the video's "
                f"{num_frames} latent frames (0 .. {num_frames - 1})"
            )
    switches = switch_frames(segments, block_starts)
    if len(switches) < len(segments) - 1:
        index = len(switches) + 1
        start = segments[index].start
        if start > block_starts[-1]:
            why = f"is after the last block start {block_starts[-1]}"
        else:
            why = (
                f"waits for a block after segments[{index - 1}]'s switch at frame "
                f"{switches[-1]} (one switch per block), and none starts after it"
            )
        raise SegmentError(
            f"{key}.segments[{index}].start: {start} {why}: it would take effect at no block"
        )
    return switches


def flush_before_full_window(
    segments: Sequence[Segment], switches: Sequence[int], window: int, key: str
) -> list[str]:
    """Warnings for the flushes of `segments` (their `switch_frames`) that fall before a cache
    of `window` frames (own block included) has filled: there Infinity-RoPE's release copies
    still-empty slots over the cached frames and the block attends to zero keys and values;
    sinkscope's flush changes nothing."""
    return [
        f"{key}.segments[{index}].flush: the flush at frame {switch} comes before the "
        f"{window}-frame window has filled; Infinity-RoPE's release would attend to zero keys "
        "and values in place of the cached frames there, sinkscope's flush changes no key "
        "(docs/DESIGN.md, Contract 6)"
        for index, switch in enumerate(switches)
        if segments[index].flush and switch < window
    ]


def segment_of_frame(switches: Sequence[int], frame: int) -> int:
    """The segment whose text the block starting at `frame` reads."""
    return sum(1 for switch in switches if switch <= frame)


def segments_json(segments: Sequence[Segment]) -> str:
    """The segments as JSON text, for file metadata and store attributes."""
    return json.dumps([asdict(segment) for segment in segments])


def segments_from_json(text: str) -> list[Segment]:
    return [Segment(**item) for item in json.loads(text)]
