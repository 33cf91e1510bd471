"""Columns of the CSV contracts that a GPU job writes and the torch-free analysis reads (shared:
neither world may import the other)."""

# One closed-loop rollout (Contract 6): a row of the summary, the rows of one deviation table.
CLOSED_LOOP_RUN_KEYS = [
    "checkpoint",
    "prompt",
    "policy",
    "budget",
    "sink_frames",
    "recent_frames",
    "capacity",
]
# A deviation table: one row per latent frame of a policy rollout against the full cache.
DEVIATION_COLUMNS = [*CLOSED_LOOP_RUN_KEYS, "frame", "block", "rel_l2", "cosine"]
