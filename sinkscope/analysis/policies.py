"""Frame datasets (Contract 2) and attention stores (Contract 4) -> attention recall of KV-cache
policies (Contract 5): how much of the full-cache attention each policy would keep.

For one captured (layer, head, pass) and one query block, the recall of a policy is the softmax
probability that the block's query tokens put on the keys the policy keeps, averaged over those
tokens: the sum over kept key frames of `prob_mass`, averaged over the block's query frames (each
frame has the same T tokens), or the same over kept key tokens of `key_mass`. Keys the captured
rollout could not see (NaN) are neither kept nor missed: the full cache is what it saw.

Each policy that the closed loop also runs keeps here what its closed-loop cache would keep, by
the same rule (`sinkscope.cache_choices`), scored with the full-cache rollout's attention
instead of its own. Policies, with a budget of B latent frames of keys per query block (its own
block included):
- `window`: the B most recent visible frames (Self-Forcing's rolling window; the closed loop's
  `window`);
- `sink_window`: the S first visible frames and the B - S most recent ones (StreamingLLM's sinks
  and window; the closed loop's `sink_window` and `deep_sink`); S = 0 is `window`;
- `participative`: Deep Forcing's Participative Compression (the closed loop's `participative`
  and `deep_forcing`): a cache of `capacity` frames pruned, when a block overflows it, to the
  sinks, the top C = B - S - R - own tokens by the raw q.k of the buffered queries (the newest
  R + own frames of query tokens in call order, summed over the layer's heads: `key_logit_mean`
  summed over the heads, `key_logit_head_sum`, times T) and the R recent frames and own block; a
  token chosen `reuse_cap` times leaves. One choice for all heads. Needs those logits of the
  passes the buffer holds.
- `top_c`: the own block, the R most recent frames before it, and up to C = (B - own - R) x T
  history tokens, each head its own choice: when a block arrives the frames leaving the recent
  window join the kept history, and more than C are cut to those with the most attention from
  the previous block's cache-update queries (the closed loop's `top_c`); needs the cache pass;
  `top_c_oracle` ranks every history token by the current block's own queries at the same pass
  (the upper bound of any token choice; no closed-loop counterpart).
Token choices need `key_mass` (and `key_logit_mean`), so their rows exist only for layers with an
attention store.

A run of the rolling sampler (`sampler_kind: rolling`) is scored call by call against Rolling
Forcing's own cache, as its closed loop runs (`rolling_policy_recall`): each captured call's keys
under `window` and `sink_window` (`schedules.rolling_policy_keys`: B counts the window's frames;
`deep_sink` keeps `sink_window`'s frames, only turned), of the frames that call saw. The token
choices are Self-Forcing's and have no rows there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from sinkscope.analysis.stats import ROW_KEYS, across_prompts
from sinkscope.analysis.stores import open_attention_store, open_frame_dataset
from sinkscope.cache_choices import ParticipativeChoice, TopCChoice, buffered_query_frames
from sinkscope.schedules import key_frames_of, rolling_calls, rolling_policy_keys
from sinkscope.storage import decoded_attrs, write_csv

POLICIES = ("window", "sink_window", "participative", "top_c", "top_c_oracle")
# Columns that only some policies have (empty elsewhere).
OPTIONAL_COLUMNS = ("sink_frames", "recent_frames", "capacity")
COLUMNS = [
    *ROW_KEYS,
    "query_block",
    "visible_frames",
    "policy",
    "budget",
    "sink_frames",
    "recent_frames",
    "capacity",
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


def rolling_policy_recall(
    prob_mass: np.ndarray,
    blocks: np.ndarray,
    passes: Sequence[int],
    num_steps: int,
    budgets: Sequence[int],
    sinks: Sequence[int],
) -> list[tuple]:
    """Recall of `window` and `sink_window` on a rolling run, from prob_mass [step, head,
    query_frame, key_frame] of the captured `passes` (pass indices of a schedule of `num_steps`
    denoising steps: `schedules.rolling_calls`).

    The call that filled pass p of a query block is the one whose part for that block has
    pass index p; what a policy keeps there is the frames of `schedules.rolling_policy_keys` for
    that call, and its recall is the block's mean prob_mass on those of them the call saw. A
    budget that cannot hold the widest window and the sinks (the closed loop refuses it) has no
    rows. Returns rows (step, head, query_block, visible_frames, policy, budget, sink_frames,
    recall), `visible_frames` the frames that call saw.
    """
    block_frames = _block_frames(blocks)
    sizes = {len(frames) for frames in block_frames.values()}
    if len(sizes) != 1:
        raise ValueError(f"a rolling run has blocks of one size, not {sorted(sizes)}")
    (per_block,) = sizes
    calls = rolling_calls(len(block_frames), per_block, num_steps)
    step_of_pass = {int(p): step for step, p in enumerate(passes)}
    window = num_steps * per_block
    choices = [("window", budget, 0) for budget in budgets if budget >= window]
    choices += [
        ("sink_window", budget, s)
        for budget in budgets
        for s in sinks
        if 0 < s <= per_block and budget >= window + s
    ]
    rows = []
    num_heads = prob_mass.shape[1]
    for index, call in enumerate(calls):
        kept_frames = {
            choice: [
                f
                for f, _, _ in key_frames_of(rolling_policy_keys(calls, index, per_block, *choice))
            ]
            for choice in choices
        }
        for part in call.parts:
            step = step_of_pass.get(part.pass_index)  # None: not captured
            if step is None:
                continue
            per_frame = prob_mass[step][:, part.start : part.end].mean(axis=1)  # [H, K]
            visible = np.flatnonzero(~np.isnan(per_frame).any(axis=0))
            if len(visible) == 0:
                continue
            for (policy, budget, sink), frames in kept_frames.items():
                kept = np.intersect1d(visible, frames)
                recall = per_frame[:, kept].sum(axis=-1)  # [H]
                rows += [
                    (step, head, part.block, len(visible), policy, budget, sink, recall[head])
                    for head in range(num_heads)
                ]
    return rows


def _block_tokens(frames: Sequence[int], t: int) -> np.ndarray:
    return (np.asarray(frames, dtype=np.int64)[:, None] * t + np.arange(t)).ravel()


def _visible(key_mass: np.ndarray, queries: np.ndarray, t: int) -> np.ndarray:
    """The key frames every query frame of a block saw at every captured (step, head)."""
    steps, heads = key_mass.shape[:2]
    seen = ~np.isnan(key_mass[:, :, queries, :].reshape(steps, heads, len(queries), -1, t))
    return np.flatnonzero(seen.all(axis=(0, 1, 2, 4)))


def _token_rows(policy, mass, block, visible, budget, parameter, kept_per_head) -> list[tuple]:
    """Rows of one block: the recall of the kept tokens (one list per head, or one for all)."""
    rows = []
    num_steps, num_heads = mass.shape[:2]
    for step in range(num_steps):
        for head in range(num_heads):
            kept = kept_per_head[head] if isinstance(kept_per_head, list) else kept_per_head
            recall = float(np.nansum(mass[step, head, kept]))
            rows.append((step, head, block, visible, policy, budget, parameter, recall))
    return rows


def token_policy_recall(
    key_mass: np.ndarray,
    blocks: np.ndarray,
    frame_seq_length: int,
    budgets: Sequence[int],
    recent_frames: int,
    cache_step: int | None = None,
) -> list[tuple]:
    """Recall of `top_c` and `top_c_oracle` from key_mass [step, head, query_frame, key_token];
    `cache_step`: the step of the cache-update pass, by which `top_c` chooses (no `top_c` rows
    without it).

    Returns rows (step, head, query_block, visible_frames, policy, budget, recent_frames, recall).
    """
    t = frame_seq_length
    rows = []
    num_steps, num_heads = key_mass.shape[:2]
    block_frames = _block_frames(blocks)
    sizes = [len(frames) for frames in block_frames.values()]
    per_block = max(sizes)
    choices = {
        budget: TopCChoice(t, num_heads, budget, recent_frames, per_block)
        for budget in budgets
        if budget - per_block - recent_frames >= 0
    }
    for block, queries in block_frames.items():
        mass = key_mass[:, :, queries, :].mean(axis=2)  # [S, H, N]: NaN where not visible
        visible = _visible(key_mass, queries, t)
        start = int(queries[0]) * t
        previous = block_frames.get(block - 1)
        score = None
        if cache_step is not None and previous is not None:
            score = key_mass[cache_step][:, previous, :].mean(axis=1)  # [H, N]
        for budget, choice in choices.items() if cache_step is not None else ():
            ranked = None  # [H, candidates]: each head's score of its candidates
            if score is not None:
                ranked = np.take_along_axis(score.T, choice.candidates(start), axis=0).T
            choice.compress(start, ranked)
            if len(visible) == 0:
                continue
            window = np.arange(choice.window_start, int(queries[-1] + 1) * t)
            kept = [np.concatenate([choice.history[:, head], window]) for head in range(num_heads)]
            rows += _token_rows("top_c", mass, block, len(visible), budget, recent_frames, kept)
        if len(visible) == 0:
            continue
        own = np.intersect1d(queries, visible).tolist()
        before = [f for f in visible if f < queries[0]]
        recent = before[len(before) - recent_frames :] if recent_frames else []
        history = before[: len(before) - len(recent)]
        fixed = _block_tokens([*own, *recent], t)
        history_tokens = _block_tokens(history, t)
        for step in range(num_steps):
            for head in range(num_heads):
                base = float(mass[step, head, fixed].sum())
                current = mass[step, head, history_tokens]
                # Stable descending order: ties keep token order.
                order = np.argsort(-current, kind="stable")
                gained = np.concatenate([[0.0], np.cumsum(current[order])])
                for budget in budgets:
                    tokens = (budget - len(own) - len(recent)) * t
                    if tokens < 0:
                        continue
                    recall = base + gained[min(tokens, len(history_tokens))]
                    rows.append(
                        (
                            step,
                            head,
                            block,
                            len(visible),
                            "top_c_oracle",
                            budget,
                            recent_frames,
                            recall,
                        )
                    )
    return rows


def participative_recall(
    key_mass: np.ndarray,
    head_logits: np.ndarray,
    blocks: np.ndarray,
    frame_seq_length: int,
    *,
    passes: Sequence[int],
    passes_per_block: int,
    budgets: Sequence[int],
    sinks: Sequence[int],
    recent_frames: int,
    capacity: int,
    reuse_cap: int,
) -> list[tuple]:
    """Recall of `participative` (Participative Compression, one choice for all heads) from
    key_mass [step, head, query_frame, key_token] and head_logits [step, query_frame,
    key_token], each key's mean logit summed over the heads; `passes`: the pass of a
    block each step is, of `passes_per_block`. Every budget up to `capacity` and every sink
    count that leaves room for the recent frames and the own block. None when a prune's
    buffered queries are of a pass the store lacks.

    Returns rows (step, head, query_block, visible_frames, policy, budget, sink_frames, recall).
    """
    t = frame_seq_length
    block_frames = _block_frames(blocks)
    sizes = [len(frames) for frames in block_frames.values()]
    per_block = max(sizes)
    step_of_pass = {int(p): step for step, p in enumerate(passes)}
    # head_logits: per key token, T times the raw q.k summed over a query frame's tokens and
    # the heads, up to the positive scale (Deep Forcing's score).
    rows = []
    for budget in budgets:
        for sink in sinks:
            if budget > capacity or sink + recent_frames + per_block > budget:
                continue
            choice = ParticipativeChoice(
                frame_seq_length=t,
                capacity=capacity,
                budget=budget,
                sink_frames=sink,
                recent_frames=recent_frames,
                frames_per_block=per_block,
                reuse_cap=reuse_cap,
                turn_sinks=False,  # the turns move the sinks, not what is kept
            )
            kept_by_block = {}
            for block, queries in block_frames.items():
                n = len(queries) * t
                choice.add_queries(n)
                overflow = choice.overflows(n)
                choice.append(int(queries[0]) * t, n)
                if overflow:
                    count = choice.buffered_queries()
                    buffered = buffered_query_frames(sizes, block, passes_per_block, count, t)
                    if any(p not in step_of_pass for _, p, _ in buffered):
                        return []
                    score = np.zeros(len(choice.tokens))
                    for _, p, frame in buffered:
                        score += head_logits[step_of_pass[p], frame, choice.tokens]
                    choice.prune(score * t, int(queries[0]))
                kept_by_block[block] = choice.tokens.copy()
                choice.add_queries(n * (passes_per_block - 1))
            for block, queries in block_frames.items():
                visible = _visible(key_mass, queries, t)
                if len(visible) == 0:
                    continue
                mass = key_mass[:, :, queries, :].mean(axis=2)
                rows += _token_rows(
                    "participative", mass, block, len(visible), budget, sink, kept_by_block[block]
                )
    return rows


def policy_table(
    frame_dataset: xr.Dataset,
    attention_store: xr.Dataset | None,
    *,
    budgets: Sequence[int],
    sinks: Sequence[int],
    recent_frames: int,
    capacity: int = 21,
    reuse_cap: int = 7,
) -> pd.DataFrame:
    """Recall of every policy and budget for one layer of one run (Contract 5 rows)."""
    blocks = frame_dataset["block"].values
    run = decoded_attrs(frame_dataset)
    rolling = run.get("sampler_kind") == "rolling"
    if rolling:
        frame_rows = rolling_policy_recall(
            frame_dataset["prob_mass"].values,
            blocks,
            run["passes"],
            int(run["passes_per_block"]) - 1,
            budgets,
            sinks,
        )
    else:
        frame_rows = frame_policy_recall(frame_dataset["prob_mass"].values, blocks, budgets, sinks)
    tables = [pd.DataFrame(frame_rows, columns=[*_ROW, "sink_frames", "recall"])]
    if attention_store is not None and not rolling:
        # float64 from a float16 store (xarray undoes its scale_factor in float64)
        key_mass = attention_store["key_mass"].values.astype(np.float32, copy=False)
        t = int(attention_store.attrs["frame_seq_length"])
        kinds = [str(kind) for kind in attention_store["pass_kind"].values]
        cache_step = kinds.index("cache") if "cache" in kinds else None
        token_rows = token_policy_recall(key_mass, blocks, t, budgets, recent_frames, cache_step)
        tables.append(pd.DataFrame(token_rows, columns=[*_ROW, "recent_frames", "recall"]))
        attrs = decoded_attrs(attention_store)
        head_logits = None
        if "key_logit_head_sum" in attention_store:  # a float16 store: summed by the survey
            head_logits = attention_store["key_logit_head_sum"].values
        elif "key_logit_mean" in attention_store:
            head_logits = attention_store["key_logit_mean"].values.sum(axis=1)
        if head_logits is not None and "passes" in attrs:
            rows = participative_recall(
                key_mass,
                head_logits,
                blocks,
                t,
                passes=attrs["passes"],
                passes_per_block=int(attrs["passes_per_block"]),
                budgets=budgets,
                sinks=sinks,
                recent_frames=recent_frames,
                capacity=capacity,
                reuse_cap=reuse_cap,
            )
            participative = pd.DataFrame(rows, columns=[*_ROW, "sink_frames", "recall"])
            participative["recent_frames"] = recent_frames
            participative["capacity"] = capacity
            tables.append(participative)
    # A policy without rows (no budget fits it) adds nothing, nor an object-typed step column.
    table = pd.concat([part for part in tables if not part.empty] or tables[:1], ignore_index=True)
    for column in OPTIONAL_COLUMNS:
        if column not in table:
            table[column] = np.nan
    table["checkpoint"] = str(frame_dataset["checkpoint"].values)
    table["prompt"] = str(frame_dataset["prompt"].values)
    table["layer"] = int(frame_dataset["layer"].values)
    table["timestep"] = frame_dataset["timestep"].values[table["step"].to_numpy()]
    table["pass_kind"] = frame_dataset["pass_kind"].values[table["step"].to_numpy()]
    for column in OPTIONAL_COLUMNS:  # empty where the policy has none
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
    capacity: int = 21,
    reuse_cap: int = 7,
) -> None:
    """The recall table of one run, written atomically as CSV: every layer of `frame_stores`;
    token-level rows for the layers that also have one of `attention_stores` (matched by
    layer). The rows follow the layers' order, whatever the order of `frame_stores`."""
    attention = {}
    for path in attention_stores:
        store = open_attention_store(path, key_tokens=True)
        attention[int(store.attrs["layer"])] = store
    tables = []
    for frame_store in frame_stores:
        frames = open_frame_dataset(frame_store)
        layer = int(frames["layer"].values)
        tables.append(
            (
                layer,
                policy_table(
                    frames,
                    attention.get(layer),
                    budgets=budgets,
                    sinks=sinks,
                    recent_frames=recent_frames,
                    capacity=capacity,
                    reuse_cap=reuse_cap,
                ),
            )
        )
    tables.sort(key=lambda pair: pair[0])
    table = pd.concat([table for _, table in tables], ignore_index=True)
    write_csv(out_csv, table)


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
    write_csv(out_csv, summarize_policies(tables))


def read_policies(path: str | os.PathLike) -> pd.DataFrame:
    """A recall table (Contract 5) as written: integer columns stay integers, empty stays NA (a
    table written before `capacity` existed gets it, empty)."""
    table = pd.read_csv(path, keep_default_na=False, na_values=[""])
    for column in OPTIONAL_COLUMNS:
        table[column] = (table[column] if column in table else pd.NA).astype("Int64")
    return table
