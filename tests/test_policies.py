"""KV-cache policy recall (sinkscope.analysis.policies) against brute-force loops over small
synthetic attention, with rolling windows and sink frames, and on a real captured rollout."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sinkscope.analysis.policies import (
    COLUMNS,
    frame_policy_recall,
    frames_kept,
    read_policies,
    summarize_policies,
    token_policy_recall,
    write_policies,
)
from sinkscope.frames import block_of_frame, visible_frames

T = 4
SIZES = [2, 2, 2, 2, 2]  # 10 frames in 5 blocks


def synthetic_key_mass(rng, sizes, local_attn_size=-1, sink_size=0, steps=2, heads=3):
    """key_mass [S, H, F, F*T]: random softmax-like mass over each query frame's visible tokens,
    with a first-frame sink in head 0; NaN on invisible keys."""
    seen = visible_frames(sizes, local_attn_size, sink_size)
    num_frames = len(seen)
    mass = np.full((steps, heads, num_frames, num_frames * T), np.nan)
    for s in range(steps):
        for h in range(heads):
            for q in range(num_frames):
                tokens = np.concatenate(
                    [np.arange(f * T, (f + 1) * T) for f in np.flatnonzero(seen[q])]
                )
                weights = rng.gamma(0.5, size=len(tokens))
                if h == 0 and seen[q, 0]:
                    weights[tokens < T] += 5.0
                mass[s, h, q, tokens] = weights / weights.sum()
    return mass


def brute_kept_frames(visible: list[int], policy: str, budget: int, sinks: int) -> set[int]:
    if budget >= len(visible):
        return set(visible)
    keep_first = sinks if policy == "sink_window" else 0
    kept = set(visible[:keep_first])
    for frame in reversed(visible):
        if len(kept) >= budget:
            break
        kept.add(frame)
    return kept


def brute_recall(prob_mass, step, head, queries, kept) -> float:
    return float(np.mean([sum(prob_mass[step, head, q, k] for k in kept) for q in queries]))


CASES = [(-1, 0), (6, 0), (6, 2)]
IDS = ["full", "window", "window-and-sinks"]


@pytest.mark.parametrize(("window", "sinks"), CASES, ids=IDS)
def test_frame_policies_equal_brute_force(window, sinks):
    rng = np.random.default_rng(1)
    key_mass = synthetic_key_mass(rng, SIZES, window, sinks)
    prob_mass = key_mass.reshape(*key_mass.shape[:3], -1, T).sum(axis=-1)  # NaN stays NaN
    blocks = block_of_frame(SIZES)
    rows = frame_policy_recall(prob_mass, blocks, budgets=[2, 3, 5, 8], sinks=[0, 1, 2])
    assert rows
    for step, head, block, visible_count, policy, budget, sink, recall in rows:
        queries = np.flatnonzero(blocks == block)
        visible = [int(f) for f in np.flatnonzero(~np.isnan(prob_mass[step, head, queries[0]]))]
        assert visible_count == len(visible)
        kept = brute_kept_frames(visible, policy, budget, sink)
        assert recall == pytest.approx(
            brute_recall(prob_mass, step, head, queries, kept), abs=1e-12
        )


def test_frame_policy_edge_cases():
    rng = np.random.default_rng(2)
    key_mass = synthetic_key_mass(rng, SIZES, 6, 2)
    prob_mass = key_mass.reshape(*key_mass.shape[:3], -1, T).sum(axis=-1)
    rows = pd.DataFrame(
        frame_policy_recall(prob_mass, block_of_frame(SIZES), budgets=[3, 6, 10], sinks=[0, 2]),
        columns=["step", "head", "block", "visible", "policy", "budget", "sinks", "recall"],
    )
    # A budget that covers every visible frame keeps all the attention.
    full = rows[rows["budget"] >= rows["visible"]]
    assert len(full) and np.allclose(full["recall"], 1.0)
    # sink_window with no sink frames is window.
    keys = ["step", "head", "block", "budget"]
    window = rows[rows["policy"] == "window"].set_index(keys)["recall"]
    no_sinks = rows[(rows["policy"] == "sink_window") & (rows["sinks"] == 0)]
    assert np.array_equal(no_sinks.set_index(keys)["recall"].sort_index(), window.sort_index())
    # Head 0 is a first-frame sink: keeping frame 0 helps it at a tight budget in the last block.
    last = rows[(rows["block"] == 4) & (rows["budget"] == 3) & (rows["head"] == 0)]
    by_policy = last.groupby(["policy", "sinks"])["recall"].mean()
    assert by_policy[("sink_window", 2)] > by_policy[("window", 0)] + 0.2
    assert frames_kept(np.array([0, 1, 5, 6, 7]), "sink_window", 3, 2).tolist() == [0, 1, 7]


@pytest.mark.parametrize(("window", "sinks"), CASES, ids=IDS)
def test_top_c_equals_brute_force(window, sinks):
    rng = np.random.default_rng(3)
    key_mass = synthetic_key_mass(rng, SIZES, window, sinks)
    blocks = block_of_frame(SIZES)
    recent = 1
    rows = token_policy_recall(key_mass, blocks, T, budgets=[3, 4, 6, 10], recent_frames=recent)
    policies = {row[4] for row in rows}
    assert policies == {"top_c", "top_c_oracle"}
    for step, head, block, visible_count, policy, budget, recent_frames, recall in rows:
        queries = list(np.flatnonzero(blocks == block))
        current = np.mean([key_mass[step, head, q] for q in queries], axis=0)
        visible = [f for f in range(len(blocks)) if not np.isnan(current[f * T])]
        assert visible_count == len(visible) and recent_frames == recent
        before = [f for f in visible if f < queries[0]]
        recent_set = before[-recent:]
        history = [f for f in before if f not in recent_set]
        scorer = current
        if policy == "top_c":
            previous = list(np.flatnonzero(blocks == block - 1))
            scorer = np.mean([key_mass[step, head, q] for q in previous], axis=0)
        tokens = [tok for f in history for tok in range(f * T, (f + 1) * T)]
        ranked = sorted(tokens, key=lambda tok: (-scorer[tok], tok))
        chosen = ranked[: max(0, (budget - len(queries) - len(recent_set)) * T)]
        kept = [tok for f in queries + recent_set for tok in range(f * T, (f + 1) * T)] + chosen
        assert recall == pytest.approx(current[kept].sum(), abs=1e-12)
    table = pd.DataFrame(rows, columns=["s", "h", "b", "v", "policy", "budget", "r", "recall"])
    # The oracle bounds the causal choice; everything visible gives 1.
    merged = table.pivot_table(index=["s", "h", "b", "budget"], columns="policy", values="recall")
    merged = merged.dropna()
    assert (merged["top_c_oracle"] >= merged["top_c"] - 1e-12).all()
    full = table[table["budget"] >= table["v"]]
    assert len(full) and np.allclose(full["recall"], 1.0)


def test_recall_table_of_a_captured_rollout(tmp_path, tiny_model, tiny_text):
    """On an attention store of a real rollout (window and sink): Contract 5 columns, frame-level
    recall from the frame dataset equals the same policy summed from key_mass, and the
    across-prompt summary aggregates the runs."""
    from sinkscope.analysis.reduce import reduce_attention_store

    from .test_capture import _capture_rollout

    store = tmp_path / "layer1.zarr"
    _capture_rollout(
        tiny_model, tiny_text, store, 1, store="attention", local_attn_size=4, sink_size=1
    )
    reduce_attention_store(store, tmp_path / "frames.zarr")
    out = tmp_path / "policies.csv"
    write_policies(
        [tmp_path / "frames.zarr"], [store], out, budgets=[2, 3, 4], sinks=[0, 1], recent_frames=0
    )
    table = read_policies(out)
    assert list(table.columns) == COLUMNS
    assert set(table["policy"]) == {"window", "sink_window", "top_c", "top_c_oracle"}
    assert table["recall"].between(0, 1 + 1e-6).all()
    # top_c with R = 0 and a budget of only the own block keeps the own block: as window does
    # when the budget is the block size (2 frames here).
    own = table[(table["policy"] == "top_c_oracle") & (table["budget"] == 2)]
    window = table[(table["policy"] == "window") & (table["budget"] == 2)]
    keys = ["step", "head", "query_block"]
    np.testing.assert_allclose(
        own.set_index(keys)["recall"].sort_index(),
        window.set_index(keys)["recall"].sort_index(),
        atol=1e-6,
    )
    other = table.assign(prompt="other", recall=table["recall"] / 2)
    summary = summarize_policies([table, other])
    means = summary[summary["aggregate"] == "mean"]
    assert len(means) == len(table) and (means["prompt"] == "*").all()
    np.testing.assert_allclose(
        means.sort_values(COLUMNS[2:13])["recall"].to_numpy(),
        table.sort_values(COLUMNS[2:13])["recall"].to_numpy() * 0.75,
    )
