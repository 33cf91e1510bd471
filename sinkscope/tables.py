"""Columns of the CSV contracts that a GPU job writes and the torch-free analysis reads (shared:
neither world may import the other)."""

# One closed-loop rollout (Contract 6): a row of the summary, the rows of its tables. `jitter`
# and `bias` are head_jitter's strength and logit_bias's b (0 and 1 for the other policies).
CLOSED_LOOP_RUN_KEYS = [
    "checkpoint",
    "prompt",
    "policy",
    "budget",
    "sink_frames",
    "recent_frames",
    "capacity",
    "jitter",
    "bias",
]
# The per-frame table of one closed-loop rollout (the full cache's included): the deviation from
# the full-cache rollout (`rel_l2`, `cosine`; empty for the full cache itself and with
# `closed_loop.reference: none`) and the reference-free `sink_distance`.
DEVIATION_COLUMNS = [*CLOSED_LOOP_RUN_KEYS, "frame", "block", "rel_l2", "cosine"]
FRAME_TABLE_COLUMNS = [*DEVIATION_COLUMNS, "sink_distance"]
# The per-block positions of one closed-loop rollout, from its cache at each block's first pass:
# the temporal RoPE position of the block's first query frame (the others follow it) and of the
# first sink frame (frame 0) as the cache holds it (its own frame, 0, once it has left the cache).
BLOCK_POSITION_COLUMNS = [
    *CLOSED_LOOP_RUN_KEYS,
    "block",
    "first_frame",
    "frames",
    "query_position",
    "sink_position",
    "segment",  # the prompt segment whose text the block read (0 for a plain prompt)
]
# The reference-free collapse diagnostics of the closed loop (`results/closed_loop/blocks.csv`,
# `sinkscope.analysis.diagnostics`): one row per (rollout, block, captured layer, captured pass),
# or per (rollout, block) with `layer`, `step`, `timestep`, `pass_kind` empty and `sink_share` NaN
# where no attention store was captured. `sink_distance` is the lowest of the block's frames,
# `phase_concentration` and `sink_share` as `sinkscope.diagnostics` defines them.
BLOCK_DIAGNOSTIC_COLUMNS = [
    *CLOSED_LOOP_RUN_KEYS,
    "block",
    "first_frame",
    "frames",
    "segment",
    "sink_distance",
    "phase_concentration",
    "layer",
    "step",
    "timestep",
    "pass_kind",
    "sink_share",
]
# What changes at a prompt switch (`results/closed_loop/switches.csv`,
# `sinkscope.analysis.switches`): one row per (rollout, captured layer, captured pass, head, query
# block) the pass captured: the block's prompt `segment`, `frames_since_switch` (its first frame
# minus the latest switch at or before it; empty before the first), and the mean over its query
# frames of the mass on the keys the cache labels `sink` (`sink_mass`) and `own` (`own_mass`: the
# block's own frames; in a recache pass the frames re-encoded).
SWITCH_COLUMNS = [
    *CLOSED_LOOP_RUN_KEYS,
    "layer",
    "step",
    "timestep",
    "pass_kind",
    "head",
    "block",
    "first_frame",
    "frames",
    "segment",
    "frames_since_switch",
    "sink_mass",
    "own_mass",
]
