"""Frame datasets (Contract 2) and attention stores (Contract 4) -> attention recall of KV-cache
policies (Contract 5): how much of the full-cache attention each policy would keep.

For one captured (layer, head, pass) and one query block, the recall of a policy is the softmax
probability that the block's query tokens put on the keys the policy keeps, averaged over those
tokens: the sum over kept key frames of `prob_mass`, averaged over the block's query frames (each
frame has the same T tokens), or the same over kept key tokens of `key_mass`. Keys the captured
rollout could not see (NaN) are neither kept nor missed: the full cache is what it saw.

Policies, with a budget of B latent frames of keys per query block (its own block included):
- `window`: the B most recent visible frames (Self-Forcing's rolling window, Rolling Forcing);
- `sink_window`: the S first visible frames and the B - S most recent ones (StreamingLLM's sinks
  and window; Deep Forcing's deep sink keeps S about B / 2); S = 0 is `window`;
- `top_c`: the own block, the R most recent frames before it, and the top C = (B - own - R) x T
  history tokens ranked by the attention they received from the previous block's queries in the
  same pass (causal: what a real cache could choose, Deep Forcing's Participative Compression);
  `top_c_oracle` ranks by the current block's own queries (the upper bound of any token choice).
  Token ranking needs `key_mass`, so top_c rows exist only for layers with an attention store.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from sinkscope.analysis.reduce import open_attention_store, open_frame_dataset
from sinkscope.analysis.stats import ROW_KEYS, across_prompts
from sinkscope.storage import write_text_atomically

POLICIES = ("window", "sink_window", "top_c", "top_c_oracle")
COLUMNS = [
    *ROW_KEYS,
    "query_block",
    "visible_frames",
    "policy",
    "budget",
    "sink_frames",
    "recent_frames",
    "recall",
]
# What a row of a run is, across prompts: the across-prompt summary groups by these.
GROUP_COLUMNS = [column for column in COLUMNS if column not in ("prompt", "recall")]
# The rows frame_policy_recall and token_policy_recall return; the policy's own parameter is
# sink_frames or recent_frames.
_ROW = ["step", "head", "query_block", "visible_frames", "policy", "budget"]


def frames_kept(visible: np.ndarray, policy: str, budget: int, sink_frames: int = 0) -> np.ndarray:
    """The visible key frames (ascending) a frame-level policy keeps with `budget` frames."""
    visible = np.sort(np.asarray(visible))
    if budget >= len(visible):
        return visible
    if policy == "window":
        sink_frames = 0
    elif policy != "sink_window":
        raise ValueError(f"{policy!r} is not a frame-level policy (window, sink_window)")
    sinks = visible[: min(sink_frames, budget)]
    recent = visible[len(visible) - (budget - len(sinks)) :] if budget > len(sinks) else []
    return np.union1d(sinks, recent)


def _block_frames(blocks: np.ndarray) -> dict[int, np.ndarray]:
    return {int(b): np.flatnonzero(blocks == b) for b in np.unique(blocks)}


def frame_policy_recall(
    prob_mass: np.ndarray,
    blocks: np.ndarray,
    budgets: Sequence[int],
    sinks: Sequence[int],
) -> list[tuple]:
    """Recall of `window` and `sink_window` from prob_mass [step, head, query_frame, key_frame].

    Returns rows (step, head, query_block, visible_frames, policy, budget, sink_frames, recall).
    The visible key frames of a block are those its query frames all saw (they see the same
    keys in every pass of a block-causal cache).
    """
    rows = []
    num_steps, num_heads = prob_mass.shape[:2]
    for block, queries in _block_frames(blocks).items():
        mass = prob_mass[:, :, queries, :]  # [S, H, q, K]
        seen = ~np.isnan(mass).any(axis=(0, 1, 2))
        visible = np.flatnonzero(seen)
        if len(visible) == 0:
            continue
        per_frame = mass.mean(axis=2)  # [S, H, K]: mean over the query frames; NaN if unseen
        choices = [("window", budget, 0) for budget in budgets]
        choices += [("sink_window", budget, s) for budget in budgets for s in sinks if s < budget]
        for policy, budget, sink in choices:
            kept = frames_kept(visible, policy, budget, sink)
            recall = per_frame[:, :, kept].sum(axis=-1)  # [S, H]
            for step in range(num_steps):
                for head in range(num_heads):
                    rows.append(
                        (step, head, block, len(visible), policy, budget, sink, recall[step, head])
                    )
    return rows


def token_policy_recall(
    key_mass: np.ndarray,
    blocks: np.ndarray,
    frame_seq_length: int,
    budgets: Sequence[int],
    recent_frames: int,
) -> list[tuple]:
    """Recall of `top_c` and `top_c_oracle` from key_mass [step, head, query_frame, key_token].

    Returns rows (step, head, query_block, visible_frames, policy, budget, recent_frames, recall).
    """
    t = frame_seq_length
    rows = []
    num_steps, num_heads = key_mass.shape[:2]
    block_frames = _block_frames(blocks)
    for block, queries in block_frames.items():
        mass = key_mass[:, :, queries, :].mean(axis=2)  # [S, H, N]: NaN where not visible
        visible = np.flatnonzero(
            ~np.isnan(mass.reshape(num_steps, num_heads, -1, t)).any(axis=(0, 1, 3))
        )
        if len(visible) == 0:
            continue
        own = np.intersect1d(queries, visible).tolist()
        before = [f for f in visible if f < queries[0]]
        recent = before[len(before) - recent_frames :] if recent_frames else []
        history = before[: len(before) - len(recent)]
        fixed = np.concatenate([np.arange(f * t, (f + 1) * t) for f in [*own, *recent]])
        history_tokens = (
            np.concatenate([np.arange(f * t, (f + 1) * t) for f in history])
            if history
            else np.zeros(0, dtype=np.int64)
        )
        previous = block_frames.get(block - 1)
        causal_score = (
            key_mass[:, :, previous, :].mean(axis=2)[..., history_tokens]
            if previous is not None and len(history_tokens)
            else None
        )
        for step in range(num_steps):
            for head in range(num_heads):
                base = float(mass[step, head, fixed].sum())
                current = mass[step, head, history_tokens]
                rankings = [("top_c_oracle", current)]
                if causal_score is not None:
                    rankings.append(("top_c", causal_score[step, head]))
                for policy, score in rankings:
                    # Stable descending order, so ties keep token order in both rankings.
                    order = np.argsort(-score, kind="stable")
                    gained = np.concatenate([[0.0], np.cumsum(current[order])])
                    for budget in budgets:
                        tokens = (budget - len(own) - len(recent)) * t
                        if tokens < 0:
                            continue
                        recall = base + gained[min(tokens, len(history_tokens))]
                        rows.append(
                            (step, head, block, len(visible), policy, budget, recent_frames, recall)
                        )
    return rows


def policy_table(
    frame_dataset: xr.Dataset,
    attention_store: xr.Dataset | None,
    *,
    budgets: Sequence[int],
    sinks: Sequence[int],
    recent_frames: int,
) -> pd.DataFrame:
    """Recall of every policy and budget for one layer of one run (Contract 5 rows)."""
    blocks = frame_dataset["block"].values
    frame_rows = frame_policy_recall(frame_dataset["prob_mass"].values, blocks, budgets, sinks)
    table = pd.DataFrame(frame_rows, columns=[*_ROW, "sink_frames", "recall"])
    table["recent_frames"] = np.nan
    if attention_store is not None:
        token_rows = token_policy_recall(
            attention_store["key_mass"].values,
            blocks,
            int(attention_store.attrs["frame_seq_length"]),
            budgets,
            recent_frames,
        )
        tokens = pd.DataFrame(token_rows, columns=[*_ROW, "recent_frames", "recall"])
        tokens["sink_frames"] = np.nan
        table = pd.concat([table, tokens], ignore_index=True)
    table["checkpoint"] = str(frame_dataset["checkpoint"].values)
    table["prompt"] = str(frame_dataset["prompt"].values)
    table["layer"] = int(frame_dataset["layer"].values)
    table["timestep"] = frame_dataset["timestep"].values[table["step"].to_numpy()]
    table["pass_kind"] = frame_dataset["pass_kind"].values[table["step"].to_numpy()]
    for column in ("sink_frames", "recent_frames"):  # empty where the policy has none
        table[column] = table[column].astype("Int64")
    return table[COLUMNS]


def write_policies(
    frame_stores: Sequence[str | os.PathLike],
    attention_stores: Sequence[str | os.PathLike],
    out_csv: str | os.PathLike,
    *,
    budgets: Sequence[int],
    sinks: Sequence[int],
    recent_frames: int,
) -> None:
    """The recall table of one run, written atomically as CSV: every layer of `frame_stores`;
    top_c rows for the layers that also have one of `attention_stores` (matched by layer)."""
    attention = {}
    for path in attention_stores:
        store = open_attention_store(path)
        attention[int(store.attrs["layer"])] = store
    tables = []
    for frame_store in frame_stores:
        frames = open_frame_dataset(frame_store)
        tables.append(
            policy_table(
                frames,
                attention.get(int(frames["layer"].values)),
                budgets=budgets,
                sinks=sinks,
                recent_frames=recent_frames,
            )
        )
    table = pd.concat(tables, ignore_index=True)
    write_text_atomically(out_csv, table.to_csv(index=False))


def summarize_policies(tables: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Stack per-run recall tables (aggregate='run') and add across-prompt mean, std and count
    (prompt='*'), as the statistics summary does (`stats.across_prompts`)."""
    return across_prompts(tables, GROUP_COLUMNS, ["recall"], COLUMNS)


def write_policy_summary(
    csv_paths: Iterable[str | os.PathLike], out_csv: str | os.PathLike
) -> None:
    """`summarize_policies` of the runs' recall tables, written atomically."""
    paths = list(csv_paths)
    if not paths:
        raise ValueError("write_policy_summary needs at least one recall table")
    tables = [read_policies(path) for path in paths]
    write_text_atomically(out_csv, summarize_policies(tables).to_csv(index=False))


def read_policies(path: str | os.PathLike) -> pd.DataFrame:
    """A recall table (Contract 5) as written: integer columns stay integers, empty stays NA."""
    table = pd.read_csv(path, keep_default_na=False, na_values=[""])
    for column in ("sink_frames", "recent_frames"):
        table[column] = table[column].astype("Int64")
    return table
