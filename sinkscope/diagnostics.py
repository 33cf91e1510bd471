"""Reference-free collapse diagnostics of a closed-loop rollout (LoL, arXiv 2601.16914: sink
collapse), computed without a full-cache reference. numpy only: nothing of sinkscope, no torch,
so the GPU job (`sink_distance`) and the analysis (the rest) share one definition.

The sink frames are the first S latent frames of the rollout (`closed_loop.sink_frames`); with
S = 0 the caller passes the first block's frames instead.

- `sink_distance` (per latent frame, LoL's diagnostic 1): min over the sink frames s of
  ||x_f - x_s||_2 over the clean latents x [C, F, H, W] in float64, divided by the median of that
  minimum over the frames f >= S of the same rollout. About 1 where the video is as far from its
  sinks as it usually is; LoL sees about 0.4 where it collapses back to them. The sink frames
  themselves get NaN: their distance to the sinks is 0 by construction, not a collapse.
- LoL's diagnostic 2, the share of a layer's heads that are sinks, needs attention stores: it
  lives in `sinkscope.analysis.diagnostics` (the mass of a (pass, head, query frame) on the sink
  frames is a sink when it reaches the statistics' threshold, `analysis.stats.is_sink`).
- `phase_concentration` (per query block, LoL's diagnostic 3 as sinkscope reconstructs it; LoL
  does not publish its definition): the mean over Wan's temporal RoPE frequencies w_k =
  10000^(-2k/d_t), k = 0 .. d_t/2 - 1, d_t = head_dim - 4*(head_dim//6) (44 channels, 22
  frequencies at head_dim 128), of cos(w_k d), d = the query frame's RoPE position minus the first
  sink frame's RoPE position as the cache placed them, averaged over the block's query frames.
  1 where every frequency sees the sink as if at the query's own position. With absolute positions
  and the sink at 0 its two highest maxima past frame 120 fall at d = 132 and 201 (0.541, 0.544),
  the frames where LoL sees LongLive and Self-Forcing++ collapse.
- `collapse_candidates`: the latent frames a reader should look at (its docstring gives the rule).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROPE_THETA = 10000.0  # Wan's RoPE base
HEAD_DIM = 128  # the head dimension of every Wan2.1 model
DISTANCE_THRESHOLD = 0.5  # a sink_distance dip at or below half its median is a candidate
PHASE_MAXIMA = 2  # the phase candidates: the highest local maxima (LoL reports two)
PHASE_MARGIN = 0.1  # ... that stand this far above the median of the rollout's curve
# Where the phase rule looks in the figure: LoL reports collapse past frame 120. Before it (d of
# 21..120 at absolute positions) the slow frequencies keep the curve high everywhere (0.45-0.6),
# so its maxima there (d = 26, 30, 44: the highest of the whole curve) single out no frame.
PHASE_FROM = 120
# Frames of latents turned to float64 at a time by `sink_distance` (bounded memory).
_DISTANCE_CHUNK_VALUES = 1 << 24


def temporal_channels(head_dim: int = HEAD_DIM) -> int:
    """d_t: the real channels of Wan's RoPE that encode time (44 at head_dim 128)."""
    if int(head_dim) != head_dim or head_dim < 6 or head_dim % 2:
        raise ValueError(f"head_dim must be an even whole number >= 6, got {head_dim!r}")
    head_dim = int(head_dim)
    return head_dim - 4 * (head_dim // 6)


def temporal_frequencies(head_dim: int = HEAD_DIM) -> np.ndarray:
    """Wan's temporal RoPE frequencies w_k = 10000^(-2k/d_t), k = 0 .. d_t/2 - 1 (float64; 22 at
    head_dim 128, from 1 down to 10000^(-42/44))."""
    channels = temporal_channels(head_dim)
    return ROPE_THETA ** (-np.arange(0, channels, 2, dtype=np.float64) / channels)


def phase_profile(distances, head_dim: int = HEAD_DIM) -> np.ndarray:
    """C(d) = mean over the temporal frequencies w_k of cos(w_k d), for each distance of
    `distances` (RoPE positions, any shape; float64 of the same shape)."""
    distances = np.asarray(distances, dtype=np.float64)
    angles = distances[..., None] * temporal_frequencies(head_dim)
    return np.cos(angles).mean(axis=-1)


def phase_concentration(
    query_positions: Sequence[int] | np.ndarray, sink_position: float, head_dim: int = HEAD_DIM
) -> float:
    """The phase concentration of one query block: `phase_profile` of each query frame's RoPE
    position (`query_positions`, the block's query frames) minus the first sink frame's
    (`sink_position`), averaged over the block's query frames."""
    positions = np.asarray(query_positions, dtype=np.float64).ravel()
    if positions.size == 0:
        raise ValueError("phase_concentration needs at least one query position")
    return float(phase_profile(positions - float(sink_position), head_dim).mean())


def sink_distance(latents: np.ndarray, sink_frames: int) -> np.ndarray:
    """LoL's diagnostic 1 for each latent frame f of `latents` [C, F, H, W] (the clean latents of
    one rollout): min over the sink frames s < `sink_frames` of ||x_f - x_s||_2 (float64, over
    the frame's channels x height x width), divided by the median of that minimum over the frames
    f >= `sink_frames`. Returns float64 [F]; the sink frames themselves get NaN (0 by
    construction: drawn, it reads as a collapse at the start of every rollout). With S = 0 the
    caller passes the first block's size. A rollout whose later frames all equal a sink frame
    (median 0) has no scale: every value is NaN.

    Refuses `sink_frames` outside 1 .. F - 1 (no sink, or no frame after them)."""
    latents = np.asarray(latents)
    if latents.ndim != 4:
        raise ValueError(f"latents must be [C, F, H, W], got shape {latents.shape}")
    frames = latents.shape[1]
    if int(sink_frames) != sink_frames or not 1 <= sink_frames < frames:
        raise ValueError(
            f"sink_frames must be a whole number in 1..{frames - 1} (frames of {frames}), "
            f"got {sink_frames!r}"
        )
    sink_frames = int(sink_frames)
    sinks = latents[:, :sink_frames].astype(np.float64)  # [C, S, H, W]
    per_frame = max(int(np.prod(latents.shape)) // max(frames, 1), 1)
    step = max(1, _DISTANCE_CHUNK_VALUES // per_frame)
    nearest = np.empty(frames, dtype=np.float64)
    for first in range(0, frames, step):
        chunk = latents[:, first : first + step].astype(np.float64)  # [C, n, H, W]
        best = np.full(chunk.shape[1], np.inf)
        for s in range(sink_frames):
            diff = chunk - sinks[:, s : s + 1]
            best = np.minimum(best, np.sqrt(np.einsum("cfhw,cfhw->f", diff, diff)))
        nearest[first : first + step] = best
    scale = float(np.median(nearest[sink_frames:]))
    if not scale > 0:
        return np.full(frames, np.nan)
    distance = nearest / scale
    distance[:sink_frames] = np.nan
    return distance


def _local_maxima(values: np.ndarray) -> np.ndarray:
    """Indices of the local maxima of `values` (no NaN): the first index of each run of equal
    values with a lower value on both sides (the ends of the array are never maxima)."""
    found, i, n = [], 0, len(values)
    while i < n:
        j = i
        while j + 1 < n and values[j + 1] == values[i]:
            j += 1
        if i > 0 and j + 1 < n and values[i - 1] < values[i] > values[j + 1]:
            found.append(i)
        i = j + 1
    return np.asarray(found, dtype=np.int64)


def distance_candidates(
    frames: Sequence[int] | np.ndarray,
    distance: Sequence[float] | np.ndarray,
    *,
    start: int,
    threshold: float = DISTANCE_THRESHOLD,
) -> np.ndarray:
    """The sink-distance rule of `collapse_candidates`: in each maximal run of consecutive
    frames >= `start` whose `distance` (`sink_distance`) is at most `threshold`, the frame of the
    lowest value (the first on ties). Returns those frames, ascending (int64)."""
    frames = np.asarray(frames, dtype=np.int64)
    distance = np.asarray(distance, dtype=np.float64)
    if frames.shape != distance.shape:
        raise ValueError(f"frames {frames.shape} and distance {distance.shape} differ in shape")
    order = np.argsort(frames, kind="stable")
    frames, distance = frames[order], distance[order]
    low = (frames >= start) & (distance <= threshold)  # NaN is never low
    found, i = [], 0
    while i < len(frames):
        if not low[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(frames) and low[j + 1] and frames[j + 1] == frames[j] + 1:
            j += 1
        found.append(int(frames[i + int(np.argmin(distance[i : j + 1]))]))
        i = j + 1
    return np.asarray(found, dtype=np.int64)


def phase_candidates(
    first_frames: Sequence[int] | np.ndarray,
    phase: Sequence[float] | np.ndarray,
    *,
    start: int,
    maxima: int = PHASE_MAXIMA,
    margin: float = PHASE_MARGIN,
) -> np.ndarray:
    """The phase rule of `collapse_candidates`: the local maxima of `phase` (per block, in the
    order of the blocks' `first_frames`, NaN left out: a block with a lower block on both sides, a
    plateau once at its first block, never the first or last block) whose first frame is >=
    `start` and whose value is at least `margin` above the median of `phase` over those blocks,
    the `maxima` highest (the earlier on ties). Returns their first frames, ascending (int64)."""
    first_frames = np.asarray(first_frames, dtype=np.int64)
    phase = np.asarray(phase, dtype=np.float64)
    if first_frames.shape != phase.shape:
        raise ValueError(f"first_frames {first_frames.shape} and phase {phase.shape} differ")
    order = np.argsort(first_frames, kind="stable")
    first_frames, phase = first_frames[order], phase[order]
    drawn = ~np.isnan(phase)
    first_frames, phase = first_frames[drawn], phase[drawn]
    peaks = _local_maxima(phase)
    late = first_frames >= start
    if not late.any():
        return np.zeros(0, dtype=np.int64)
    level = float(np.median(phase[late])) + float(margin)
    peaks = peaks[(first_frames[peaks] >= start) & (phase[peaks] >= level)]
    ranked = sorted(peaks.tolist(), key=lambda i: (-phase[i], first_frames[i]))[: int(maxima)]
    return np.sort(first_frames[ranked]).astype(np.int64)


def collapse_candidates(
    frames: Sequence[int] | np.ndarray,
    distance: Sequence[float] | np.ndarray,
    first_frames: Sequence[int] | np.ndarray,
    phase: Sequence[float] | np.ndarray,
    *,
    start: int,
    phase_from: int | None = None,
    threshold: float = DISTANCE_THRESHOLD,
    maxima: int = PHASE_MAXIMA,
    margin: float = PHASE_MARGIN,
) -> dict[str, np.ndarray]:
    """The latent frames of one rollout that may be collapse points, by two rules that need no
    reference (sinkscope's choice; LoL publishes no rule):

    - `sink_distance`: where the rollout comes back to its sinks. In each maximal run of
      consecutive frames >= `start` whose sink_distance (`distance`, per frame of `frames`) is at
      most `threshold` (0.5: half its median; LoL sees about 0.4 at collapse), the frame of the
      lowest value (the first on ties): one candidate per dip, at its bottom.
    - `phase_concentration`: where RoPE puts the sink in phase with the query. The local maxima
      of the per-block phase concentration (`phase` of the blocks starting at `first_frames`: a
      block with a lower block on both sides; a plateau once, at its first block) whose first
      frame is >= `phase_from` (default `start`) and that stand at least `margin` (0.1) above the
      median of the curve from there on, the `maxima` (2: LoL reports two) highest, given as
      those blocks' first frames. The margin keeps a flat curve (sinks that move with the window,
      positions that stay bounded) from marking its ripples.

    `start` is the first frame that may be a candidate: the figure passes the training length
    (within it the model saw such videos, and the frames right after the sinks are close to them
    by continuity, not by collapse), and `phase_from` = max(start, `PHASE_FROM`): with absolute
    positions the highest maxima past a training length of 21 lie at d = 26..44, where the curve
    is high everywhere; past frame 120 they are LoL's 132 and 201 (one frame a block; with blocks
    of 3 frames the blocks of frames 132 and 201).

    Returns {"sink_distance": frames, "phase_concentration": frames}, each ascending int64."""
    phase_start = start if phase_from is None else phase_from
    return {
        "sink_distance": distance_candidates(frames, distance, start=start, threshold=threshold),
        "phase_concentration": phase_candidates(
            first_frames, phase, start=phase_start, maxima=maxima, margin=margin
        ),
    }
