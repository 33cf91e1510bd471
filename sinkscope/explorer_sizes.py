"""The attention explorer's layout in bytes (`sinkscope.analysis.explorer` writes it, the plan
prints it): how a map is encoded and pooled, and what a page of a given geometry weighs.
Shared by the analysis world (which writes the page) and the parse-time plan: no torch, no
xarray."""

from __future__ import annotations

import math

# Every array the page draws is float16, little-endian, base64 in the data files: 4 / 3 of two
# bytes a value. float16 keeps 11 significant bits (a relative error of at most 2^-11); the
# numbers that are also in a CSV (the statistics) are carried at the CSV's 6 digits instead.
VALUE_BYTES = 2 * 4 / 3
# The frame map of a (layer, head, pass) keeps only the (query, key) frame pairs the pass saw.
# The spatial map of frame 0's mass is pooled by a whole factor to at most this many cells.
SPATIAL_CELLS = 128
# plotly.js (`plotly.offline.get_plotlyjs`, inlined in index.html), about 4.8 MB in plotly 7.
PLOTLY_BYTES = 4_900_000
# Per (layer, head, pass) of the statistics: a row of numbers at 6 digits and a class, as JSON.
STATISTICS_ROW_BYTES = 60
# Per latent frame of a closed-loop rollout: its deviation and pixel diagnostics, as JSON.
CLOSED_LOOP_FRAME_BYTES = 120


def spatial_pool(height: int, width: int, cells: int = SPATIAL_CELLS) -> int:
    """The smallest whole factor k that pools a (height, width) token grid into at most `cells`
    cells of k x k tokens (the edge cells smaller): 1 for the demo's 4 x 6, 4 for 30 x 52."""
    if height < 1 or width < 1:
        raise ValueError(f"a token grid needs positive sides, got {height} x {width}")
    factor = 1
    while math.ceil(height / factor) * math.ceil(width / factor) > cells:
        factor += 1
    return factor


def visible_pairs(block_sizes: list[int]) -> int:
    """(query, key) frame pairs a block-causal pass sees: each query frame sees its own block
    and every block before it."""
    pairs, seen = 0, 0
    for size in block_sizes:
        seen += size
        pairs += size * seen
    return pairs


def run_bytes(
    *,
    layers: int,
    heads: int,
    passes: int,
    block_sizes: list[int],
    token_grid: tuple[int, int] | None,
) -> float:
    """About what one surveyed run adds to the explorer folder: per layer and pass which frame
    pairs it saw, and per head the frame map of those pairs, the entropy per query frame and
    the pooled spatial map of frame 0's mass (`token_grid`: (H', W') of a latent frame's
    tokens; None without attention stores); per (layer, head, pass) a row of statistics."""
    frames = sum(block_sizes)
    per_head_pass = visible_pairs(block_sizes) + frames
    if token_grid is not None:
        height, width = token_grid
        factor = spatial_pool(height, width)
        per_head_pass += math.ceil(height / factor) * math.ceil(width / factor)
    per_pass = heads * per_head_pass * VALUE_BYTES + frames * frames * 4 / 3
    return layers * passes * (per_pass + heads * STATISTICS_ROW_BYTES)


def explorer_bytes(runs: float, closed_loop_frames: int = 0) -> int:
    """The explorer folder (its videos not counted: links to the videos rule's files): the
    surveyed runs' `run_bytes` summed, the closed loops' per-frame tables (`closed_loop_frames`:
    latent frames over every rollout) and plotly.js."""
    return int(runs + closed_loop_frames * CLOSED_LOOP_FRAME_BYTES + PLOTLY_BYTES)
