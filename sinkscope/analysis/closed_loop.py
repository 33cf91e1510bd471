"""Closed-loop frame tables (Contract 6) and recall tables (Contract 5) -> one summary row
per closed-loop rollout: how far a KV-cache policy drifts from the full-cache rollout, beside the
offline recall of the same choice of keys.

A frame table (`results/closed_loop/{checkpoint}/{prompt}/{policy}.csv`, written by the GPU
job `sinkscope.extraction.closed_loop`; `FRAME_TABLE_COLUMNS`) has one row per latent frame of a
rollout longer than the cache under one policy, the full cache's own rollout (`full`) included:
`rel_l2` = ||x - ref|| / ||ref|| and `cosine` of that frame's clean latent x against the
full-cache rollout ref of the same noise (so 0 and 1 where the cache has dropped nothing yet),
both empty (NaN) for `full` itself and without a reference (`closed_loop.reference: none`), and
the reference-free `sink_distance` (`sinkscope.diagnostics`). `budget` B counts the latent frames
of keys kept per query block, its own block included; `sink_frames` S is set for the policies
that keep sinks (`sink_window`, `deep_sink`, `participative`, `deep_forcing`), `recent_frames` R
for those that keep recent frames before the own block (`participative`, `deep_forcing`,
`top_c`), each 0 otherwise; `capacity` is the frames the cache holds before it drops any: B, or
Participative Compression's cache; `jitter` and `bias` are head_jitter's strength and
logit_bias's b (0 and 1 for the other policies). The full cache (`full`) keeps every frame: its
`budget` and `capacity` are empty (`FULL_EMPTY`; NA once read, so group its rows with
`run_groups` and pick them with `run_rows`, which keep it), its S and R 0. Any policy of
`sinkscope.cache_choices.CLOSED_LOOP_POLICIES` is read.

The summary (`closed_loop_summary`) has one row per rollout (`RUN_KEYS`) but `full`'s (the
reference has no deviation of its own: its table gives no row), frames and blocks 0-based:
- `frames`: the latent frames of the rollout;
- `evicting_from`: the first frame of the first block whose cache had to drop something, i.e. the
  first block whose end (its last frame + 1, the frames its queries see) exceeds the capacity;
  empty when no block does (then every mean below is NaN);
- `rel_l2_mean`, `cosine_mean`: the means of `rel_l2` and `cosine` over the frames
  >= `evicting_from` (the frames before it equal the reference);
- `rel_l2_last`: `rel_l2` of the last frame;
- `rel_l2_beyond_training`: the mean of `rel_l2` over the frames >= `train_frames` (the length
  the model was trained on, e.g. 21); NaN when the rollout has none;
- `offline_policy`: the offline policy whose recall describes the closed-loop one
  (`OFFLINE_POLICY`): `deep_sink` keeps the frames of `sink_window` (only the RoPE of its sink
  keys differs), `deep_forcing` the tokens of `participative` (likewise), and a sink window of
  S = 0 is the offline `window`; empty for a policy without one (relative, replay, head_jitter,
  logit_bias: their recall is NaN);
- `recall`: the mean offline recall of that policy in the same run's recall table, at the same B
  (and the same S, R and capacity where the policy has them), over every row (layer, head, step,
  pass, query block) whose query block sees more frames than the capacity (`visible_frames` >
  capacity: where the policy actually drops keys); `recall_rows`: how many rows that mean took.
  Without such rows (a budget the recall table lacks, a token policy without a layer with an
  attention store, a recall table with no block longer than the capacity) `recall` is NaN and
  `recall_rows` 0.
Without a reference (`rel_l2` and `cosine` empty) the deviation columns are NaN; `frames`,
`evicting_from` and the recall stay.

What the closed-loop figures read of these tables lives here too, free of matplotlib: a rollout's
policy key (`policy_key`, `policy_keys`, `policy_rows`), the runs and their shortest names
(`closed_loop_runs`, `run_names`), the spread of a deviation over a checkpoint's prompts
(`deviation_spread`), what a deviation panel's reference lines mark (`reference_marks`) and the
note on the rollouts a figure leaves out (`left_out_note`).
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from sinkscope import cache_choices
from sinkscope.analysis.policies import read_policies
from sinkscope.cache_choices import policy_label
from sinkscope.frames import evicting_frame
from sinkscope.storage import write_csv
from sinkscope.tables import CLOSED_LOOP_RUN_KEYS, DEVIATION_COLUMNS, FRAME_TABLE_COLUMNS

# A closed-loop rollout: the rows of one deviation table, and of one summary row.
RUN_KEYS = CLOSED_LOOP_RUN_KEYS
# closed-loop policy -> the offline policy (Contract 5) that keeps the same keys
OFFLINE_POLICY = {
    "window": "window",
    "sink_window": "sink_window",
    "deep_sink": "sink_window",
    "participative": "participative",
    "deep_forcing": "participative",
    "top_c": "top_c",
}
SUMMARY_COLUMNS = [
    *RUN_KEYS,
    "frames",
    "evicting_from",
    "rel_l2_mean",
    "cosine_mean",
    "rel_l2_last",
    "rel_l2_beyond_training",
    "offline_policy",
    "recall",
    "recall_rows",
]
_TEXT = ["checkpoint", "prompt", "policy"]
_INTEGERS = ["budget", "sink_frames", "recent_frames", "capacity", "frame", "block"]
RUN_FLOATS = ["jitter", "bias"]  # run keys that are numbers, never empty
_FLOATS = ["rel_l2", "cosine", "sink_distance"]  # empty: NaN
# What the recall tables must hold for the summary.
_RECALL_COLUMNS = [*RUN_KEYS[:7], "visible_frames", "recall"]
FULL = "full"  # the full cache's rollout: the reference, no summary row
# The run keys the full cache leaves empty: it keeps every frame, so it has no budget B and no
# capacity (a 0 would read as a cache of nothing).
FULL_EMPTY = ("budget", "capacity")


def _empty(value) -> bool:
    return value is None or (not isinstance(value, str) and bool(pd.isna(value)))


def run_key(values: Iterable) -> tuple:
    """Run-key values (`RUN_KEYS`, or a tail of them) as a key that hashes and compares alike
    wherever it comes from: an empty value (the full cache's budget and capacity: NA, NaN) is
    None, numpy scalars plain Python ones."""
    return tuple(None if _empty(v) else (v.item() if hasattr(v, "item") else v) for v in values)


def run_groups(
    table: pd.DataFrame, keys: Sequence[str] = RUN_KEYS
) -> Iterable[tuple[tuple, pd.DataFrame]]:
    """(`run_key`, rows) of every rollout of `table` (grouped by `keys`, in the order they first
    appear), the full cache's included: pandas' groupby drops a group whose key is empty unless
    told not to."""
    for key, rows in table.groupby(list(keys), sort=False, dropna=False):
        yield run_key(key), rows


def run_rows(table: pd.DataFrame, key: Sequence, keys: Sequence[str] = RUN_KEYS) -> np.ndarray:
    """The boolean mask of the rows of `table` whose `keys` hold `key` (a `run_key`): None
    matches an empty cell (the full cache's budget and capacity)."""
    mask = np.ones(len(table), dtype=bool)
    for column, value in zip(keys, key, strict=True):
        cells = table[column]
        if _empty(value):
            mask &= cells.isna().to_numpy(dtype=bool)
        else:
            mask &= (cells == value).fillna(False).to_numpy(dtype=bool)
    return mask


def run_sort_key(key: Sequence) -> tuple:
    """The order of rollouts (`run_key`s of `RUN_KEYS`): run, policy as `policy_order`, then the
    numbers, an empty one first."""
    numbers = tuple(-1 if value is None else value for value in key[3:])
    return (str(key[0]), str(key[1]), policy_order(str(key[2])), *numbers)


def typed_run_keys(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with `FULL_EMPTY` as nullable integers (the full cache's empty, as the tables
    write them), the other counts of the run keys as they are."""
    for column in FULL_EMPTY:
        if column in table:
            table[column] = pd.to_numeric(table[column].astype(object), errors="raise")
            table[column] = table[column].astype("Int64")
    return table


POLICY_KEYS = RUN_KEYS[2:]  # what tells the policies of one run apart


def policy_key(policy, budget, sink, recent, capacity, jitter, bias) -> tuple:
    """(policy, budget, sink_frames, recent_frames, capacity, jitter, bias), typed; an empty
    count (the full cache's budget and capacity) None."""
    counts = (None if _empty(value) else int(value) for value in (budget, sink, recent, capacity))
    return (str(policy), *counts, float(jitter), float(bias))


def policy_keys(table: pd.DataFrame) -> list[tuple]:
    """`policy_key` of every closed-loop policy of `table`, in the order of
    `closed_loop_policies()` (full, window, sink_window, deep_sink, participative, deep_forcing,
    top_c, then the newer ones), then by budget, S, R, capacity, jitter and bias."""
    keys = {policy_key(*values) for values in table[POLICY_KEYS].itertuples(index=False)}
    return sorted(keys, key=lambda key: run_sort_key(("", "", *key))[2:])


def policy_rows(table: pd.DataFrame, key: Sequence) -> pd.DataFrame:
    """The rows of one closed-loop policy (a `policy_key`) in `table`."""
    return table[run_rows(table, key, POLICY_KEYS)]


def run_names(runs: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The shortest name that tells the (checkpoint, prompt) runs apart: the prompt when the
    checkpoint is always the same, the checkpoint when the prompt is, else both."""
    if len({c for c, _ in runs}) == 1:
        return {run: run[1] for run in runs}
    if len({p for _, p in runs}) == 1:
        return {run: run[0] for run in runs}
    return {run: f"{run[0]} · {run[1]}" for run in runs}


def closed_loop_runs(table: pd.DataFrame, what: str) -> list[tuple[str, str]]:
    """The (checkpoint, prompt) runs of a closed-loop table (`what` in the message), sorted;
    refuses one without rows."""
    if table.empty:
        raise ValueError(f"the closed-loop {what} has no rows")
    pairs = zip(table["checkpoint"], table["prompt"], strict=True)
    return sorted({(str(checkpoint), str(prompt)) for checkpoint, prompt in pairs})


def reference_marks(
    evictions: dict[int, int], train_frames: int | None, last: int
) -> dict[int, str]:
    """frame -> what the reference lines of a deviation panel at that frame mark: `capacity C`
    at the first eviction of each capacity C (`evictions`: capacity -> frame; `capacity 4, 5`
    where two first evict at one frame), `training length` at `train_frames` (within frames
    0 .. `last`); both at one frame joined, `capacity 21 · training length`."""
    marks: dict[int, list[str]] = {}
    by_frame: dict[int, list[int]] = {}
    for capacity, start in sorted(evictions.items()):
        by_frame.setdefault(int(start), []).append(int(capacity))
    for frame, capacities in by_frame.items():
        marks[frame] = ["capacity " + ", ".join(map(str, capacities))]
    if train_frames is not None and 0 <= train_frames <= last + 0.5:
        marks.setdefault(int(train_frames), []).append("training length")
    return {frame: " · ".join(names) for frame, names in marks.items()}


def spans_decades(values, decades: float = 1.0) -> bool:
    """True when the positive finite `values` span more than `decades` decades (where the
    closed-loop figures draw a log axis)."""
    values = np.asarray(values, dtype=float)
    positive = values[np.isfinite(values) & (values > 0)]
    return positive.size > 1 and bool(np.log10(positive.max() / positive.min()) > decades)


def deviation_spread(summary: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per closed-loop policy (`key`, in `policy_keys` order) and checkpoint of `summary`: the
    finite values of `column` over its runs (`values`, one per prompt), their `mean`, sample
    standard deviation `std` (NaN for fewer than two) and `count`; none where no run has one."""
    rows = []
    for key in policy_keys(summary):
        for checkpoint, runs in policy_rows(summary, key).groupby("checkpoint", sort=True):
            values = runs[column].to_numpy(dtype=float)
            values = values[np.isfinite(values)]
            if values.size:
                std = float(np.std(values, ddof=1)) if values.size > 1 else math.nan
                rows.append((key, str(checkpoint), values, float(values.mean()), std, values.size))
    return pd.DataFrame(rows, columns=["key", "checkpoint", "values", "mean", "std", "count"])


def left_out_note(
    rows: pd.DataFrame,
    keys: Sequence[tuple],
    names: dict[tuple[str, str], str],
    width: int = 70,
    items: int = 8,
) -> str:
    """'Not drawn, no offline recall: top_c B=9 R=3 (cat, sea); never evicts: window B=42.',
    the summary `rows` a figure leaves out (their `rel_l2_mean` NaN: never evicts; else no
    offline recall), the runs named (`names`) when there are several, at most `items` policies
    (the rest counted), wrapped at `width` characters."""
    reasons: dict[str, dict[tuple, list[str]]] = {"no offline recall": {}, "never evicts": {}}
    for row in rows.itertuples(index=False):
        key = policy_key(*(getattr(row, column) for column in POLICY_KEYS))
        why = "never evicts" if not np.isfinite(row.rel_l2_mean) else "no offline recall"
        name = names[(str(row.checkpoint), str(row.prompt))].replace(" ", "\N{NO-BREAK SPACE}")
        reasons[why].setdefault(key, []).append(name)  # a run's name stays on one line
    parts, shown, hidden = [], 0, 0
    for why, by_key in reasons.items():
        listed = []
        for key in [key for key in keys if key in by_key]:
            if shown >= items:
                hidden += 1
                continue
            shown += 1
            runs = by_key[key]
            if len(names) == 1:  # the title names the run
                where = ""
            elif len(runs) == len(names):
                where = " (every run)"
            else:
                where = f" ({', '.join(runs)})"
            listed.append(f"{rollout_label(*key)}{where}")
        if listed:
            parts.append(f"{why}: {', '.join(listed)}")
    text = "Not drawn, " + "; ".join(parts)
    text += f"; and {hidden} more (see the summary table)." if hidden else "."
    return "\n".join(textwrap.wrap(text, width))


def closed_loop_policies() -> tuple[str, ...]:
    """The closed loop's policy names, `full` first (`cache_choices.CLOSED_LOOP_POLICIES`, read
    when called: new policies need no change here)."""
    return tuple(cache_choices.CLOSED_LOOP_POLICIES)


def policy_order(policy: str) -> tuple[int, str]:
    """Sort key of a policy: its place in `closed_loop_policies()`, unknown names last, by name."""
    names = closed_loop_policies()
    return (names.index(policy), "") if policy in names else (len(names), str(policy))


def rollout_label(
    policy: str,
    budget: int,
    sink_frames: int = 0,
    recent_frames: int = 0,
    capacity: int = 0,
    jitter: float = 0.0,
    bias: float = 1.0,
) -> str:
    """What figures call a rollout (its `RUN_KEYS` but checkpoint and prompt): `policy_label`
    ('head_jitter B=12 S=3 j=0.8'), and `full` for the full cache."""
    if policy == FULL:
        return FULL
    return policy_label(
        policy, budget, sink_frames, recent_frames, capacity, jitter=float(jitter), bias=float(bias)
    )


def read_deviation(paths: Iterable[str | os.PathLike] | str | os.PathLike) -> pd.DataFrame:
    """The frame tables `paths` (Contract 6, `full`'s included), stacked with the columns
    `FRAME_TABLE_COLUMNS`: text stays text, counts integers, `jitter`, `bias` floats, an empty
    `rel_l2`, `cosine` or `sink_distance` NaN.

    Refuses, naming the file, a table that lacks a column of `FRAME_TABLE_COLUMNS`, has no rows,
    a missing or fractional count, a missing `jitter` or `bias`, or a policy not in
    `closed_loop_policies()`; and a frame of one rollout that appears twice."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    tables = [_read_one_deviation(path) for path in paths]
    if not tables:
        raise ValueError("read_deviation needs at least one deviation table")
    table = pd.concat(tables, ignore_index=True)
    repeated = table[table.duplicated([*RUN_KEYS, "frame"], keep=False)]
    if not repeated.empty:
        first = repeated.iloc[0]
        files = sorted(set(repeated["source"]))
        raise ValueError(
            f"{', '.join(files)}: frame {first['frame']} of {_run_label(first)} appears "
            f"{len(repeated[repeated['frame'] == first['frame']])} times"
        )
    return table.drop(columns="source").reset_index(drop=True)


def read_run_table(
    path: str | os.PathLike,
    columns: Sequence[str],
    what: str,
    integers: Sequence[str],
    floats: Sequence[str] = (),
    optional: Sequence[str] = (),
) -> pd.DataFrame:
    """One CSV of a closed-loop rollout's (`columns`, what the file is called in messages): text
    stays text, `integers` whole numbers (those of `FULL_EMPTY` nullable: empty on the full
    cache's rows), `RUN_FLOATS` numbers, `floats` numbers or empty (NaN), the policy one of
    `closed_loop_policies()`, with a `source` column (the file). Refuses, naming the file, a table
    that is empty, lacks a column or holds something else (an empty budget or capacity but the
    full cache's). `optional`: columns kept as they are where the file has them."""
    try:
        table = pd.read_csv(
            path,
            keep_default_na=False,
            na_values={column: ["", "nan", "NaN"] for column in [*integers, *floats]},
            dtype={column: str for column in _TEXT},
        )
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path}: empty file, not a {what}") from None
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise ValueError(f"{path}: not a {what}, it lacks the columns {missing}")
    if table.empty:
        raise ValueError(f"{path}: the {what} has no rows")
    # read_csv gives a column of whole numbers int64 and one of numbers (or empty) float64: those
    # need no checks, only the others (a table's columns are mostly the former).
    full = (table["policy"] == FULL).to_numpy(dtype=bool)
    for column in integers:
        nullable = column in FULL_EMPTY
        if table[column].dtype == np.int64:
            if nullable:
                table[column] = table[column].astype("Int64")
            continue
        values = pd.to_numeric(table[column], errors="coerce")
        empty = values.isna().to_numpy(dtype=bool)
        if nullable and (empty & ~full).any():
            raise ValueError(
                f"{path}: column {column} must hold whole numbers (empty only for the full cache)"
            )
        if (not nullable and empty.any()) or (values[~empty] != np.round(values[~empty])).any():
            raise ValueError(f"{path}: column {column} must hold whole numbers")
        table[column] = values.astype("Int64" if nullable else np.int64)
    for column in RUN_FLOATS:
        if table[column].dtype == np.float64 and not table[column].isna().any():
            continue
        values = pd.to_numeric(table[column], errors="coerce")
        if values.isna().any():
            raise ValueError(f"{path}: column {column} must hold numbers")
        table[column] = values.astype(np.float64)
    for column in floats:
        if table[column].dtype == np.float64:
            continue
        values = pd.to_numeric(table[column], errors="coerce")
        if (values.isna() & table[column].notna()).any():
            raise ValueError(f"{path}: column {column} must hold numbers")
        table[column] = values.astype(np.float64)
    known = closed_loop_policies()
    unknown = sorted(set(table["policy"]) - set(known))
    if unknown:
        raise ValueError(f"{path}: policies {unknown} are not one of {list(known)}")
    table = table[[*columns, *(c for c in optional if c in table.columns)]].copy()
    table["source"] = str(path)
    return table


def _read_one_deviation(path: str | os.PathLike) -> pd.DataFrame:
    return read_run_table(path, FRAME_TABLE_COLUMNS, "closed-loop frame table", _INTEGERS, _FLOATS)


def _run_label(row) -> str:
    label = rollout_label(*(row[key] for key in RUN_KEYS[2:]))
    return f"{row['checkpoint']}/{row['prompt']} {label}"


def offline_policy(policy: str, sink_frames: int = 0) -> str:
    """The offline policy of a closed-loop one (`OFFLINE_POLICY`; S = 0 is `window`)."""
    if policy not in OFFLINE_POLICY:
        raise ValueError(f"closed-loop policy {policy!r} is not one of {list(OFFLINE_POLICY)}")
    offline = OFFLINE_POLICY[policy]
    return "window" if offline == "sink_window" and int(sink_frames) == 0 else offline


def _offline_recall(
    recall: pd.DataFrame,
    checkpoint: str,
    prompt: str,
    offline: str,
    budget,
    sink,
    recent,
    capacity,
) -> np.ndarray:
    """The recalls of the rows of `recall` that describe one closed-loop rollout (module
    docstring)."""
    mask = (
        (recall["checkpoint"].astype(str).to_numpy() == checkpoint)
        & (recall["prompt"].astype(str).to_numpy() == prompt)
        & (recall["policy"].astype(str).to_numpy() == offline)
        & (recall["budget"].to_numpy() == budget)
        & (recall["visible_frames"].to_numpy() > capacity)
    )

    def column(name: str) -> np.ndarray:
        return recall[name].astype("Float64").fillna(-1).to_numpy()

    if offline in ("sink_window", "participative"):
        mask &= column("sink_frames") == sink
    if offline in ("top_c", "participative"):
        mask &= column("recent_frames") == recent
    if offline == "participative":
        mask &= column("capacity") == capacity
    return recall["recall"].to_numpy(dtype=float)[mask]


def _mean(values: np.ndarray) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def closed_loop_summary(
    deviation: pd.DataFrame, recall_tables: pd.DataFrame, train_frames: int
) -> pd.DataFrame:
    """One row per closed-loop rollout of `deviation` (`read_deviation`; `full`'s rows give
    none), columns `SUMMARY_COLUMNS`, defined in the module docstring; `recall_tables`: the runs'
    recall tables (Contract 5, `policies.read_policies`) stacked, possibly empty."""
    if int(train_frames) != train_frames or train_frames < 1:
        raise ValueError(f"train_frames must be a whole number >= 1, got {train_frames!r}")
    train_frames = int(train_frames)
    missing = [column for column in DEVIATION_COLUMNS if column not in deviation.columns]
    if missing:
        raise ValueError(f"the deviation table lacks the columns {missing}")
    if recall_tables.empty and not set(_RECALL_COLUMNS) <= set(recall_tables.columns):
        recall_tables = pd.DataFrame({column: [] for column in _RECALL_COLUMNS})
    missing = [column for column in _RECALL_COLUMNS if column not in recall_tables.columns]
    if missing:
        raise ValueError(f"the recall tables lack the columns {missing}")
    rows = []
    for key, run in run_groups(deviation):
        checkpoint, prompt, policy, budget, sink, recent, capacity, jitter, bias = key
        if policy == FULL:
            continue
        run = run.sort_values("frame")
        frame = run["frame"].to_numpy()
        rel_l2 = run["rel_l2"].to_numpy(dtype=float)
        cosine = run["cosine"].to_numpy(dtype=float)
        start = evicting_frame(frame, run["block"].to_numpy(), int(capacity))
        evicting = frame >= start if start is not None else np.zeros(len(frame), dtype=bool)
        offline = offline_policy(policy, sink) if policy in OFFLINE_POLICY else ""
        recall = _offline_recall(
            recall_tables,
            str(checkpoint),
            str(prompt),
            offline,
            int(budget),
            sink,
            recent,
            int(capacity),
        )
        rows.append(
            {
                "checkpoint": str(checkpoint),
                "prompt": str(prompt),
                "policy": policy,
                "budget": int(budget),
                "sink_frames": int(sink),
                "recent_frames": int(recent),
                "capacity": int(capacity),
                "jitter": float(jitter),
                "bias": float(bias),
                "frames": len(frame),
                "evicting_from": pd.NA if start is None else start,
                "rel_l2_mean": _mean(rel_l2[evicting]),
                "cosine_mean": _mean(cosine[evicting]),
                "rel_l2_last": float(rel_l2[-1]),
                "rel_l2_beyond_training": _mean(rel_l2[frame >= train_frames]),
                "offline_policy": offline,
                "recall": _mean(recall),
                "recall_rows": len(recall),
                "_order": policy_order(policy)[0],
            }
        )
    summary = pd.DataFrame(rows, columns=[*SUMMARY_COLUMNS, "_order"])
    summary = summary.sort_values(["checkpoint", "prompt", "_order", "policy", *RUN_KEYS[3:]])
    summary["evicting_from"] = summary["evicting_from"].astype("Int64")
    return summary[SUMMARY_COLUMNS].reset_index(drop=True)


def read_closed_loop_summary(path: str | os.PathLike) -> pd.DataFrame:
    """A summary as `write_closed_loop_summary` wrote it (text stays text, an empty
    `evicting_from` stays NA); refuses, naming the file, one that lacks a column."""
    table = pd.read_csv(
        path,
        keep_default_na=False,
        na_values={
            column: ["", "nan", "NaN"]
            for column in SUMMARY_COLUMNS
            if column not in (*_TEXT, "offline_policy")
        },
        dtype={column: str for column in [*_TEXT, "offline_policy"]},
    )
    missing = [column for column in SUMMARY_COLUMNS if column not in table.columns]
    if missing:
        raise ValueError(f"{path}: not a closed-loop summary, it lacks the columns {missing}")
    table["evicting_from"] = table["evicting_from"].astype("Int64")
    return table[SUMMARY_COLUMNS]


def write_closed_loop_summary(
    deviation_paths: Sequence[str | os.PathLike],
    policy_paths: Sequence[str | os.PathLike],
    path: str | os.PathLike,
    train_frames: int,
) -> pd.DataFrame:
    """`closed_loop_summary` of the deviation tables `deviation_paths` and the recall tables
    `policy_paths` (those of the same runs; none gives NaN recall), written atomically as CSV to
    `path`; returns it."""
    deviation = read_deviation(list(deviation_paths))
    tables = []
    for policy_path in policy_paths:
        header = pd.read_csv(policy_path, nrows=0).columns
        missing = [column for column in _RECALL_COLUMNS if column not in header]
        if missing:
            raise ValueError(f"{policy_path}: not a recall table, it lacks the columns {missing}")
        tables.append(read_policies(policy_path))
    recall = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    summary = closed_loop_summary(deviation, recall, train_frames)
    write_csv(path, summary)
    return summary
