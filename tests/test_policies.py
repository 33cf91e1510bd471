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
    participative_recall,
    read_policies,
    rolling_policy_recall,
    summarize_policies,
    token_policy_recall,
    write_policies,
)
from sinkscope.frames import block_of_frame, visible_frames

from .rolling_references import Policy, cache_keys, window_blocks, window_keys
from .test_tables import significant_digits

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


def brute_top_c(key_mass, blocks, budget, recent, cache_step) -> dict:
    """{(block, head): kept tokens} of top_c, written from its rule alone: per head, the own block
    and the `recent` frames before it whole; the frames leaving that window join the kept
    history, cut to the C = (budget - own - recent) x T with the most mean key_mass from the
    previous block's queries at the cache pass (ties: the older token)."""
    frames_per_block = max(np.bincount(blocks))
    history_size = (budget - frames_per_block - recent) * T
    kept = {}
    for head in range(key_mass.shape[1]):
        history: list[int] = []
        window_start = 0
        for block in range(blocks.max() + 1):
            queries = list(np.flatnonzero(blocks == block))
            new_start = max(window_start, (queries[0] - recent) * T)
            candidates = history + list(range(window_start, new_start))
            if len(candidates) > history_size:
                previous = np.flatnonzero(blocks == block - 1)
                score = key_mass[cache_step, head, previous].mean(axis=0)
                # Keys the previous block could not see (NaN) rank last.
                order = np.nan_to_num(-score, nan=np.inf)
                ranked = sorted(candidates, key=lambda tok: (order[tok], candidates.index(tok)))
                candidates = sorted(ranked[:history_size], key=candidates.index)
            history, window_start = candidates, new_start
            kept[block, head] = history + list(range(window_start, (queries[-1] + 1) * T))
    return kept


@pytest.mark.parametrize(("window", "sinks"), CASES, ids=IDS)
def test_top_c_equals_brute_force(window, sinks):
    rng = np.random.default_rng(3)
    key_mass = synthetic_key_mass(rng, SIZES, window, sinks)
    blocks = block_of_frame(SIZES)
    recent = 1
    rows = token_policy_recall(
        key_mass, blocks, T, budgets=[3, 4, 6, 10], recent_frames=recent, cache_step=1
    )
    policies = {row[4] for row in rows}
    assert policies == {"top_c", "top_c_oracle"}
    kept = {budget: brute_top_c(key_mass, blocks, budget, recent, 1) for budget in (3, 4, 6, 10)}
    chose = 0
    for step, head, block, visible_count, policy, budget, recent_frames, recall in rows:
        queries = list(np.flatnonzero(blocks == block))
        current = np.mean([key_mass[step, head, q] for q in queries], axis=0)
        visible = [f for f in range(len(blocks)) if not np.isnan(current[f * T])]
        assert visible_count == len(visible) and recent_frames == recent
        if policy == "top_c":
            tokens = kept[budget][block, head]
            chose += len(tokens) < (queries[-1] + 1) * T
            assert recall == pytest.approx(np.nansum(current[tokens]), abs=1e-12)
            continue
        before = [f for f in visible if f < queries[0]]
        recent_set = before[-recent:]
        history = [f for f in before if f not in recent_set]
        history_tokens = [tok for f in history for tok in range(f * T, (f + 1) * T)]
        ranked = sorted(history_tokens, key=lambda tok: (-current[tok], tok))
        chosen = ranked[: max(0, (budget - len(queries) - len(recent_set)) * T)]
        own = [tok for f in queries + recent_set for tok in range(f * T, (f + 1) * T)]
        assert recall == pytest.approx(current[own + chosen].sum(), abs=1e-12)
    assert chose
    table = pd.DataFrame(rows, columns=["s", "h", "b", "v", "policy", "budget", "r", "recall"])
    # The oracle bounds the causal choice; everything visible gives 1.
    merged = table.pivot_table(index=["s", "h", "b", "budget"], columns="policy", values="recall")
    merged = merged.dropna()
    assert (merged["top_c_oracle"] >= merged["top_c"] - 1e-12).all()
    full = table[(table["budget"] >= table["v"]) & (table["policy"] == "top_c_oracle")]
    assert len(full) and np.allclose(full["recall"], 1.0)
    # Without the cache pass no causal choice: only the oracle.
    oracle_only = token_policy_recall(key_mass, blocks, T, [4], recent, cache_step=None)
    assert {row[4] for row in oracle_only} == {"top_c_oracle"}


def brute_participative(logit_mean, sizes, passes, budget, sinks, recent, capacity, cap) -> dict:
    """{block: kept tokens} of Participative Compression from per-key-token mean logits
    [pass, head, query_frame, key_token], written from the release's rules alone (spec:
    ../shared/reference/long-video-family.md): every call's queries join a buffer of the newest
    (recent + block) frames of query tokens; a block that overflows `capacity` frames prunes to
    the sinks, the top C (budget - sinks - recent - block frames of tokens) eligible tokens by
    the buffered queries' summed logits over the heads, and the newest (recent + block) frames;
    a token chosen `cap` times is no longer eligible."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    per_block = max(sizes)
    recent_frames = recent + per_block
    calls = [(b, p) for b in range(len(sizes)) for p in range(passes)]
    held: list[int] = []
    counts: dict[int, int] = {}
    kept = {}
    for b in range(len(sizes)):
        new = list(range(starts[b] * T, starts[b + 1] * T))
        augmented = held + new
        if len(held) + len(new) > capacity * T:
            # The buffer: the newest recent_frames frames of queries in call order.
            frames = []
            for cb, cp in reversed(calls[: calls.index((b, 0)) + 1]):
                frames += [(cp, f) for f in range(starts[cb + 1] - 1, starts[cb] - 1, -1)]
            frames = frames[:recent_frames]
            score = {
                tok: sum(logit_mean[p, :, f, tok].sum() for p, f in frames) for tok in augmented
            }
            n_sink = sinks * T
            n_recent = recent_frames * T
            top = max(0, max(budget * T, n_sink + n_recent) - n_sink - n_recent)
            candidates = augmented[n_sink : len(augmented) - n_recent]
            eligible = [tok for tok in candidates if counts.get(tok, 0) < cap]
            chosen = sorted(sorted(eligible, key=lambda tok: (-score[tok], tok))[:top])
            for tok in chosen:
                counts[tok] = counts.get(tok, 0) + 1
            augmented = augmented[:n_sink] + chosen + augmented[len(augmented) - n_recent :]
        held = augmented
        kept[b] = list(held)
    return kept


def test_participative_equals_brute_force():
    rng = np.random.default_rng(4)
    sizes = [2] * 9
    blocks = block_of_frame(sizes)
    key_mass = synthetic_key_mass(rng, sizes, steps=5)
    logit_mean = np.where(np.isnan(key_mass), np.nan, rng.standard_normal(key_mass.shape))
    settings = {"budgets": [5, 6, 8], "sinks": [0, 1], "recent_frames": 1, "capacity": 7}
    rows = participative_recall(
        key_mass,
        logit_mean.sum(axis=1),
        blocks,
        T,
        passes=range(5),
        passes_per_block=5,
        reuse_cap=2,
        **settings,
    )
    assert {row[4] for row in rows} == {"participative"}
    pruned = 0
    for budget in settings["budgets"]:
        for sinks in settings["sinks"]:
            if sinks + 1 + 2 > budget:
                assert not [r for r in rows if r[5] == budget and r[6] == sinks]
                continue
            kept = brute_participative(logit_mean, sizes, 5, budget, sinks, 1, 7, 2)
            for step, head, block, _, _, b, s, recall in rows:
                if (b, s) != (budget, sinks):
                    continue
                queries = np.flatnonzero(blocks == block)
                current = key_mass[step, head, queries].mean(axis=0)
                pruned += len(kept[block]) < (queries[-1] + 1) * T
                assert recall == pytest.approx(np.nansum(current[kept[block]]), abs=1e-12)
    assert pruned
    # A store without a pass the buffer needs has no participative rows.
    assert not participative_recall(
        key_mass[:1],
        logit_mean[:1].sum(axis=1),
        blocks,
        T,
        passes=[0],
        passes_per_block=5,
        reuse_cap=2,
        **settings,
    )


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
    # Recall with 6 significant digits (17 before), the counts whole numbers, empty where none.
    text = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert max(significant_digits(value) for value in text["recall"]) <= 6
    assert set(text["sink_frames"]) <= {"", "0", "1"} and set(text["budget"]) == {"2", "3", "4"}
    assert set(table["policy"]) == {
        "window",
        "sink_window",
        "top_c",
        "top_c_oracle",
        "participative",
    }
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
    order = [column for column in COLUMNS if column not in ("checkpoint", "prompt", "recall")]
    other = table.assign(prompt="other", recall=table["recall"] / 2)
    summary = summarize_policies([table, other])
    means = summary[summary["aggregate"] == "mean"]
    assert len(means) == len(table) and (means["prompt"] == "*").all()
    np.testing.assert_allclose(
        means.sort_values(order)["recall"].to_numpy(),
        table.sort_values(order)["recall"].to_numpy() * 0.75,
    )


# --------------------------------------------------------------------------------------------
# the rolling sampler: call by call, from the reference's key lists (tests/rolling_references.py)
# --------------------------------------------------------------------------------------------


def reference_rolling_captures(num_blocks: int, per_block: int, num_steps: int):
    """(pass, block, full-cache key frames, keys of a Policy) of every captured call of a rolling
    rollout, written from the reference's rules: window call w holds window_blocks(w), block b at
    pass (its step) w - b; the clean pass after it captures its oldest block as pass num_steps
    once that block is at its last step."""
    for w in range(num_blocks + num_steps - 1):
        blocks = window_blocks(w, num_blocks, num_steps)
        for block, step in blocks:
            yield step, block, (lambda p, blocks=blocks: window_keys(blocks, per_block, policy=p))
        oldest, step = blocks[0]
        if step == num_steps - 1:
            yield num_steps, oldest, (lambda p, b=oldest: cache_keys(b, per_block, policy=p))


@pytest.mark.parametrize("num_steps", [5, 4])
def test_rolling_recall_is_the_reference(num_steps):
    """Offline recall of a rolling run: for every captured (pass, query block), the mean mass on
    the frames the policy's cache would give that call (the reference's key lists), of those
    Rolling Forcing's own cache gave it; budgets that cannot hold the window and the sinks have
    no rows."""
    rng = np.random.default_rng(4)
    num_blocks, per_block, heads = 9, 3, 2
    frames = num_blocks * per_block
    blocks = np.repeat(np.arange(num_blocks), per_block)
    passes = num_steps + 1
    prob_mass = np.full((passes, heads, frames, frames), np.nan)
    seen = {}
    for step, block, keys in reference_rolling_captures(num_blocks, per_block, num_steps):
        full = sorted({key.frame for key in keys(Policy())})
        seen[step, block] = full
        for q in range(block * per_block, (block + 1) * per_block):
            weights = rng.gamma(0.5, size=(heads, len(full)))
            prob_mass[step, :, q, full] = (weights / weights.sum(axis=1, keepdims=True)).T
    assert len(seen) == passes * num_blocks  # every pass of every block captured once
    budgets, sinks = [12, 15, 18, 21], [0, 2, 3]
    rows = rolling_policy_recall(prob_mass, blocks, list(range(passes)), num_steps, budgets, sinks)
    got = {(r[0], r[1], r[2], r[4], r[5], r[6]): (r[3], r[7]) for r in rows}
    window = num_steps * per_block
    expected = {}
    for step, block, keys in reference_rolling_captures(num_blocks, per_block, num_steps):
        for budget in budgets:
            for name, sink in [("window", 0), *(("sink_window", s) for s in sinks if s)]:
                if budget < window + sink:
                    continue
                policy = Policy(name, budget, sink)
                kept = {key.frame for key in keys(policy)} & set(seen[step, block])
                queries = range(block * per_block, (block + 1) * per_block)
                for head in range(heads):
                    recall = brute_recall(prob_mass, step, head, queries, sorted(kept))
                    expected[step, head, block, name, budget, sink] = (
                        len(seen[step, block]),
                        recall,
                    )
    assert got.keys() == expected.keys()
    for key, (visible, recall) in expected.items():
        assert got[key][0] == visible
        assert got[key][1] == pytest.approx(recall, abs=1e-12), key
    # The policies forget: some row keeps less than everything the full cache saw.
    assert min(recall for _, recall in expected.values()) < 0.9
    # Fewer passes captured: their rows only, on the store's step axis.
    some = rolling_policy_recall(
        prob_mass[[0, passes - 1]], blocks, [0, passes - 1], num_steps, budgets, sinks
    )
    assert {r[0] for r in some} == {0, 1}
    last = {(r[1], r[2], r[4], r[5], r[6]): r[7] for r in some if r[0] == 1}
    assert last.keys() == {k[1:] for k in expected if k[0] == passes - 1}
    for key, recall in last.items():
        assert recall == pytest.approx(expected[(passes - 1, *key)][1], abs=1e-12)
