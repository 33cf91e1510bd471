"""Samplers as schedules: which model calls a rollout makes, which frames each call queries at
which noise level, and (Rolling Forcing) which keys it reads at which RoPE positions.

Pure functions, no torch: the extraction's rollout engine runs these calls, the capture files each
call's queries on a store's pass axis, and the workflow counts them for its estimates.

- `self_forcing_calls`: Self-Forcing's block-wise sampler (CausVid, Causal Forcing): per block its
  denoising steps, then one cache pass on its clean x0 at t = 0.
- `rolling_calls`, `rolling_keys`: Rolling Forcing's (TencentARC/RollingForcing a1477d09, and
  Causal Forcing's long-video mode): a window of S blocks (S = steps) denoised jointly, each block
  at its own step, then a clean pass on the window's oldest block; keys [anchor | working cache |
  window], bidirectional inside the window.

The pass axis of a store (Contract 1 and 4) has max steps + 1 slots: slot s < S holds a query
frame's call at denoising step s (Rolling Forcing: the window call in which its block sat at step
s), slot S its cache pass (Rolling Forcing: the clean pass after the window call where its block
finished; block 0's four earlier clean passes write keys no query reads and are not captured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sinkscope.segments import segment_of_frame

SAMPLER_KINDS = ("self_forcing", "rolling")
CALL_KINDS = ("denoise", "cache", "recache")

# Rolling Forcing's cache, hard-coded in its model: the anchor (block 0's keys, stored without
# RoPE) and the 21 newest clean frames, 24 frames in all; a call attends to at most 21 frames.
ROLLING_ATTENTION_FRAMES = 21
ROLLING_CACHE_FRAMES = 24

# Which copy of a key frame a query saw (`key_version` / `slot_version` of the stores): a clean
# copy (a cached frame, or the own block in a cache pass), Rolling Forcing's rotated anchor, or
# code 2 + s: a noisy copy at denoising step s (the own block, or a frame of the same window).
KEY_VERSIONS = ("clean", "anchor")
KEY_VERSION = {name: code for code, name in enumerate(KEY_VERSIONS)}
NOISY_VERSION = len(KEY_VERSIONS)  # + step
UNSEEN_VERSION = -1


def denoising_steps(sampler: dict) -> int:
    """Denoising slots of the pass axis under a `sampler:` setting: the most steps any block
    takes (Causal Forcing++'s first block takes more than the others)."""
    return max(len(sampler["steps"]), len(sampler.get("first_block_steps") or ()))


def rolling_visible(num_blocks: int, frames_per_block: int, num_steps: int) -> list[set[int]]:
    """The key frames each query frame sees in any captured call of a Rolling Forcing rollout
    (its window calls and its cache pass)."""
    calls = rolling_calls(num_blocks, frames_per_block, num_steps)
    seen: list[set[int]] = [set() for _ in range(num_blocks * frames_per_block)]
    for index, call in enumerate(calls):
        frames = {f for f, _, _ in key_frames_of(rolling_keys(calls, index, frames_per_block))}
        for part in call.parts:
            if part.pass_index is not None:
                for query in range(part.start, part.end):
                    seen[query] |= frames
    return seen


def version_code(step: int | None) -> int:
    """The version code of a key computed in a call at denoising `step` (None: a clean pass)."""
    return KEY_VERSION["clean"] if step is None else NOISY_VERSION + step


def key_versions(call: ModelCall, key_frames, anchor):
    """Which copy of its frame each key of `call` is (`KEY_VERSIONS`), from its latent frame and
    whether it is Rolling Forcing's anchor (numpy arrays or torch tensors, shaped as they are):
    the frames the call queries are its own copies at their part's step (clean in a cache pass),
    the anchor is the anchor, every other key a clean cached copy."""
    versions = key_frames * 0 + KEY_VERSION["clean"]
    for part in call.parts:
        own = (key_frames >= part.start) & (key_frames < part.end)
        versions[own] = version_code(part.step)
    versions[anchor] = KEY_VERSION["anchor"]
    return versions


def version_meanings(num_steps: int) -> list[str]:
    """flag_meanings of the version codes 0 .. 1 + num_steps, in code order."""
    return [*KEY_VERSIONS, *(f"step_{s}" for s in range(num_steps))]


@dataclass(frozen=True)
class BlockPart:
    """One block's share of a model call: its frames, its denoising step in this call (None in a
    clean pass) and the slot of the store's pass axis it fills (None: not captured)."""

    block: int
    start: int
    frames: int
    step: int | None
    pass_index: int | None

    @property
    def end(self) -> int:
        return self.start + self.frames


@dataclass(frozen=True)
class ModelCall:
    """One model call: `denoise` (every part at a step), `cache` (a clean pass at t = 0) or
    `recache` (LongLive's clean pass at t = 0 over frames already generated, under a new prompt);
    the parts are the frames queried, oldest first, over contiguous frames. `segment`: the prompt
    segment whose text the call reads; `rope_cut`: Infinity-RoPE's cut, the RoPE position of the
    call's first query frame (None: the cache's own); `global_sink`: a recache's LongLive setting
    (True: the sink slots keep their frames)."""

    kind: str
    parts: tuple[BlockPart, ...]
    segment: int = 0
    rope_cut: int | None = None
    global_sink: bool = True

    @property
    def start(self) -> int:
        return self.parts[0].start

    @property
    def end(self) -> int:
        return self.parts[-1].end

    @property
    def frames(self) -> int:
        return self.end - self.start


def block_starts_of(block_sizes: Sequence[int]) -> list[int]:
    starts, frame = [], 0
    for size in block_sizes:
        starts.append(frame)
        frame += size
    return starts


def self_forcing_calls(
    block_sizes: Sequence[int], steps_per_block: Sequence[int]
) -> list[ModelCall]:
    """Self-Forcing's calls: per block its steps (pass s at step s), then its cache pass (the
    last slot of the pass axis, max steps, whatever this block's own count)."""
    if len(block_sizes) != len(steps_per_block):
        raise ValueError(f"{len(block_sizes)} blocks but {len(steps_per_block)} step counts")
    cache_slot = max(steps_per_block)
    calls = []
    for block, (start, size) in enumerate(
        zip(block_starts_of(block_sizes), block_sizes, strict=True)
    ):
        for step in range(steps_per_block[block]):
            calls.append(ModelCall("denoise", (BlockPart(block, start, size, step, step),)))
        calls.append(ModelCall("cache", (BlockPart(block, start, size, None, cache_slot),)))
    return calls


def rolling_calls(num_blocks: int, frames_per_block: int, num_steps: int) -> list[ModelCall]:
    """Rolling Forcing's calls: windows w = 0 .. blocks + S - 2 holding blocks max(0, w - S + 1)
    .. min(w, blocks - 1), block b at step w - b, each followed by a clean pass on the window's
    oldest block (captured as its cache pass once that block is finished)."""
    if num_blocks < 1 or frames_per_block < 1 or num_steps < 1:
        raise ValueError("a rolling schedule needs blocks, frames per block and steps >= 1")
    calls = []
    for window in range(num_blocks + num_steps - 1):
        first, last = max(0, window - num_steps + 1), min(window, num_blocks - 1)
        parts = tuple(
            BlockPart(b, b * frames_per_block, frames_per_block, window - b, window - b)
            for b in range(first, last + 1)
        )
        calls.append(ModelCall("denoise", parts))
        oldest = parts[0]
        finished = oldest.step == num_steps - 1
        clean = BlockPart(
            oldest.block, oldest.start, oldest.frames, None, num_steps if finished else None
        )
        calls.append(ModelCall("cache", (clean,)))
    return calls


@dataclass(frozen=True)
class KeyRun:
    """Consecutive key frames a call reads, in the attention's order: `frames` frames from
    `first_frame`, which copy they are (`anchor`, `clean`, or `window`: the call's own frames)
    and the temporal RoPE position of the first (the others follow)."""

    first_frame: int
    frames: int
    version: str  # anchor | clean | sink (a clean sink at its own position) | window
    position: int


def rolling_keys(
    calls: Sequence[ModelCall],
    index: int,
    frames_per_block: int,
    attention_frames: int = ROLLING_ATTENTION_FRAMES,
) -> list[KeyRun]:
    """The keys call `index` of `rolling_calls` reads, as Rolling Forcing's cache gives them.

    The anchor is block 0 (A = frames_per_block frames). A window call still holding block 0 sees
    its own frames only. Later window calls starting at frame s see [anchor at s - w - A .. s - w -
    1 | clean frames s - w .. s - 1 | window], w = min(clean frames stored after the anchor,
    attention_frames - A - query frames). A clean pass of block b sees the last <= attention_frames
    frames of [anchor at 0 .. A - 1 | clean frames | own block]: block 0 itself only.
    """
    if attention_frames % frames_per_block:
        # Rolling Forcing's 21 frames are 7 blocks of 3: its cut of the cache never splits a
        # block, and so never the anchor.
        raise ValueError(
            f"Rolling Forcing's cache of {attention_frames} attended frames needs blocks that "
            f"divide it, not {frames_per_block} frames"
        )
    call = calls[index]
    anchor = frames_per_block
    own = KeyRun(call.start, call.frames, "window", call.start)
    if call.kind == "denoise":
        if call.start == 0:
            return [own]
        # Clean frames after the anchor: blocks 1 .. oldest - 1, written by their clean passes.
        stored = call.start - anchor
        working = max(0, min(stored, attention_frames - anchor - call.frames))
        runs = [KeyRun(0, anchor, "anchor", call.start - working - anchor)]
        if working:
            runs.append(KeyRun(call.start - working, working, "clean", call.start - working))
        return [*runs, own]
    if call.start == 0:
        return [own]
    # The cache after this write: [anchor | frames anchor .. end - 1], its last attention_frames.
    history = call.end - anchor  # clean frames after the anchor, own block included
    if history + anchor <= attention_frames:
        runs = [KeyRun(0, anchor, "anchor", 0)]
        before = call.start - anchor
    else:
        runs = []
        before = attention_frames - call.frames
    if before:
        runs.append(KeyRun(call.start - before, before, "clean", call.start - before))
    return [*runs, KeyRun(call.start, call.frames, "window", call.start)]


# The KV-cache policies the rolling sampler runs (Contract 6): Rolling Forcing's own cache
# (`full`, the reference) and what each policy keeps in its place.
ROLLING_POLICIES = ("full", "window", "sink_window", "deep_sink")


def rolling_policy_keys(
    calls: Sequence[ModelCall],
    index: int,
    frames_per_block: int,
    name: str = "full",
    budget: int = ROLLING_ATTENTION_FRAMES,
    sinks: int = 0,
) -> list[KeyRun]:
    """The keys call `index` of `rolling_calls` reads under the KV-cache policy `name`, `budget`
    frames in all (the window included) and `sinks` sink frames (docs/DESIGN.md, Contract 6).

    `full` is Rolling Forcing's cache (`rolling_keys`). A window call starting at s > 0 with q
    frames sees: `window` the min(s, B - q) newest clean frames; `sink_window` the sinks (clean,
    at their own positions, version `sink`) and the min(s - S, B - S - q) newest clean frames;
    `deep_sink` the same frames with the sinks turned to sit just before the clean ones, as
    Rolling Forcing moves its anchor (version `anchor`). A clean pass sees the last B frames of
    [sinks | clean frames | own block] at their own positions."""
    if name == "full":
        return rolling_keys(calls, index, frames_per_block, budget)
    if name not in ROLLING_POLICIES:
        raise ValueError(f"policy {name!r} does not run on the rolling sampler {ROLLING_POLICIES}")
    call = calls[index]
    sinks = 0 if name == "window" else sinks
    own = [(f, "window", f) for f in range(call.start, call.end)]
    if call.start == 0:
        return _runs(own)
    start = call.start
    if call.kind == "cache":
        history = [(f, "sink" if f < sinks else "clean", f) for f in range(start)]
        return _runs([*history, *own][-budget:])
    working = max(0, min(start - sinks, budget - sinks - call.frames))
    if name == "deep_sink":
        first = start - working - sinks
        head = [(f, "anchor", first + f) for f in range(sinks)]
    else:
        head = [(f, "sink", f) for f in range(sinks)]
    clean = [(f, "clean", f) for f in range(start - working, start)]
    return _runs([*head, *clean, *own])


def _runs(entries: Sequence[tuple[int, str, int]]) -> list[KeyRun]:
    """(frame, version, position) entries gathered into runs of consecutive frames."""
    runs: list[KeyRun] = []
    for frame, version, position in entries:
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.version == version
            and last.first_frame + last.frames == frame
            and last.position + last.frames == position
        ):
            runs[-1] = KeyRun(last.first_frame, last.frames + 1, version, last.position)
        else:
            runs.append(KeyRun(frame, 1, version, position))
    return runs


def key_frames_of(runs: Sequence[KeyRun]) -> list[tuple[int, str, int]]:
    """(frame, version, temporal position) of every key frame of `runs`, in order."""
    return [
        (run.first_frame + i, run.version, run.position + i)
        for run in runs
        for i in range(run.frames)
    ]


def with_switches(
    calls: Sequence[ModelCall],
    block_sizes: Sequence[int],
    switches: Sequence[int],
    *,
    recache_frames: int | None = None,
    recache_slot: int | None = None,
    global_sink: bool = True,
    cuts: Sequence[int | None] = (),
) -> list[ModelCall]:
    """Self-Forcing's `calls` under a prompt schedule: every call of the block starting at or
    after switch i (a block start) reads segment i + 1; with `recache_frames` (LongLive's
    recache: the window B, -1 for every frame) a `recache` call before the first call of each
    switch's block c re-encodes the clean frames c - n .. c - 1, n = min(B, c), split by block,
    on the pass axis' `recache_slot`, with LongLive's `global_sink`; `cuts[i]` (Infinity-RoPE's
    `#`): every call of that block sits at RoPE position cuts[i]."""
    starts = block_starts_of(block_sizes)
    ends = [start + size for start, size in zip(starts, block_sizes, strict=True)]
    if any(switch not in starts or switch == 0 for switch in switches):
        raise ValueError(f"switches {list(switches)} must be block starts after 0 ({starts})")
    if list(switches) != sorted(set(switches)):
        raise ValueError(f"switches {list(switches)} must rise, at most one per block")
    cut_at = {switch: cut for switch, cut in zip(switches, cuts, strict=False) if cut is not None}
    out: list[ModelCall] = []
    seen: set[int] = set()
    for call in calls:
        if len(call.parts) != 1:
            raise ValueError("prompt switches run on Self-Forcing's calls of one block")
        start = call.start
        segment = segment_of_frame(switches, start)
        if start in switches and start not in seen and recache_frames is not None:
            out.append(
                _recache_call(
                    starts, ends, start, recache_frames, recache_slot, segment, global_sink
                )
            )
        seen.add(start)
        out.append(ModelCall(call.kind, call.parts, segment, cut_at.get(start)))
    return out


def _recache_call(starts, ends, switch, recache_frames, slot, segment, global_sink) -> ModelCall:
    n = switch if recache_frames == -1 else min(recache_frames, switch)
    first = switch - n
    parts = []
    for block, (start, end) in enumerate(zip(starts, ends, strict=True)):
        lo, hi = max(start, first), min(end, switch)
        if lo < hi:
            parts.append(BlockPart(block, lo, hi - lo, None, slot))
    return ModelCall("recache", tuple(parts), segment, global_sink=global_sink)
