"""Frame dataset (Contract 2) -> tidy attention-sink statistics (Contract 3).

Rows per head, and per layer (`head = mean`):
- A per-head row holds the statistics of that head's profile (`query_profile`).
- A `head = mean` row (`MEAN_HEAD`) holds the statistics of the head-mean profile: the per-head
  profiles averaged over the heads key frame by key frame, then first / middle / last, the ratio
  and the rest computed on that one profile. This is how the seed notebooks (Deep Forcing's
  Fig. 4) compute layer-level numbers. It is not the mean of the per-head rows: first, middle,
  last, sink_score, first_last_diff, uniform_multiple and recent_mass are linear in the profile
  and agree with the per-head means (where every head sees the same key frames), but the ratio,
  spread_pct, argmax_frame and min_frame are not, and the mean of the per-head ratio can be far
  from the ratio of the mean profile. As with query frames, a key frame counts in the head-mean
  profile only if every head sees it (NaN otherwise). entropy, importance and head_class belong
  to single heads (a head's own attention, a head's class, Gu et al.'s share of heads) and are
  empty on the mean rows; `per_head` drops those rows, and `sink_rates` never counts them.
- The sink definition, one for every table and figure that says "sink" (`is_sink`): a head is a
  sink for a query set when its mass on the first visible key frame is at least
  `sink_threshold` (default `SINK_THRESHOLD`) times that frame's uniform share, 1 / the visible
  key frames: `uniform_multiple` >= `sink_threshold`. Normalised so that one threshold means the
  same whatever the number of frames a query sees (a spread head scores about 1 at 3 frames and
  at 21); head_class and the sink rate (`sink_rates`, per query set) apply it to the same
  column. `importance` (Gu et al.'s mean mass on frame 0 over every query frame, not
  normalised) is reported beside it and decides nothing.
- first_middle_ratio = first / middle only where middle > 0, NaN otherwise. A ratio compares
  positive sizes: a logit middle <= 0 (logits have an arbitrary shift per query) flips its sign
  or, near 0, blows it up to any size (first 1, middle -0.01 gives -100), so neither a negative
  nor a huge ratio would say anything about a sink. Use sink_score (first - middle, unchanged by
  a shift) for logits; for probabilities middle > 0 whenever a middle frame gets any mass.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from sinkscope.analysis.stores import open_frame_dataset
from sinkscope.storage import write_csv, write_text_atomically

LOG = logging.getLogger(__name__)

MEASURES = ("logit_mean", "prob_mass")
QUERY_MODES = ("last_block", "each_block", "each_frame")
STAT_COLUMNS = [
    "first",
    "middle",
    "last",
    "sink_score",
    "first_last_diff",
    "first_middle_ratio",
    "spread_pct",
    "argmax_frame",
    "min_frame",
    "uniform_multiple",
    "recent_mass",
    "entropy",
    "importance",
]
# The keys every per-head table of a run starts with (statistics, policy recall).
ROW_KEYS = ["checkpoint", "prompt", "layer", "head", "step", "timestep", "pass_kind"]
COLUMNS = [
    *ROW_KEYS,
    "measure",
    "query",
    *STAT_COLUMNS,
    "head_class",
]
GROUP_COLUMNS = ["checkpoint", "layer", "head", "step", "timestep", "pass_kind", "measure", "query"]
# The `head` of the rows computed on the head-mean profile (the other rows hold integer heads).
MEAN_HEAD = "mean"
# Frame indices: integers, empty where no key frame is visible.
FRAME_COLUMNS = ["argmax_frame", "min_frame"]
# The sink definition's default threshold (`is_sink`, config `stats.sink_threshold`): a head is a
# sink when its mass on the first visible key frame is at least this many times the frame's
# uniform share (1 / visible key frames).
SINK_THRESHOLD = 3.0
# Mass on the query set's own block from which a head that is no sink is a recent head.
RECENT_THRESHOLD = 0.5
# The keys of a sink rate: one per (run, layer, captured step, query set).
SINK_RATE_KEYS = ["checkpoint", "prompt", "layer", "step", "timestep", "pass_kind", "query"]


def query_sets(blocks: np.ndarray, query: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(label, query frames, key frames of their own blocks) for each query set.

    `blocks` is the block index of every frame, in frame order.
    """
    blocks = np.asarray(blocks)
    frames = np.arange(len(blocks))
    if query == "last_block":
        last = blocks.max()
        own = frames[blocks == last]
        return [("last_block", own, own)]
    if query == "each_block":
        return [(f"block{b}", frames[blocks == b], frames[blocks == b]) for b in np.unique(blocks)]
    if query == "each_frame":
        return [(f"frame{f}", np.array([f]), frames[blocks == blocks[f]]) for f in frames]
    raise ValueError(f"query must be one of {QUERY_MODES}, got {query!r}")


def query_profile(values: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """The profile of a query set: `values` [..., query_frame, key_frame] averaged over the query
    frames `rows` (indices into the query_frame axis). A key frame counts only if every query
    frame of the set sees it: NaN otherwise. The one rule for statistics and figures alike."""
    return np.asarray(values, dtype=float)[..., list(rows), :].mean(axis=-2)


def last_block_rows(ds: xr.Dataset) -> np.ndarray:
    """Indices of the last block's query frames in `ds`."""
    blocks = np.asarray(ds["block"].values)
    return np.flatnonzero(blocks == blocks.max())


def last_block_profile(ds: xr.Dataset, measure: str, step: int) -> xr.DataArray:
    """(head, key_frame): `measure` (logit_mean or prob_mass) at `step` (a step label) of the last
    block's query frames averaged over them, as the `last_block` statistics see it."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    values = ds[measure].sel(step=step).transpose("head", "query_frame", "key_frame")
    return xr.DataArray(
        query_profile(values.values, last_block_rows(ds)),
        dims=("head", "key_frame"),
        coords={"head": values["head"].values, "key_frame": values["key_frame"].values},
        name=f"last_block_{measure}",
    )


def head_statistics(
    ds: xr.Dataset, measure: str, step: int, query: str = "last_block"
) -> pd.DataFrame:
    """The per-head Contract 3 rows of one measure and step, indexed by head (for the first query
    set); the `head = mean` row is left out."""
    table = per_head(frame_statistics(ds, query))
    first_set = table["query"].iloc[0]
    rows = table[
        (table["measure"] == measure) & (table["step"] == int(step)) & (table["query"] == first_set)
    ]
    return rows.set_index("head")


def profile_statistics(
    profile: np.ndarray, key_frames: np.ndarray, own_frames: np.ndarray, measure: str
) -> dict[str, float]:
    """Statistics of one profile (one value per key frame, NaN = not visible)."""
    visible = ~np.isnan(profile)
    values = profile[visible]
    frames = key_frames[visible]
    stats = dict.fromkeys(STAT_COLUMNS, np.nan)
    stats.update(dict.fromkeys(FRAME_COLUMNS, pd.NA))
    if values.size == 0:
        return stats
    first, last = values[0], values[-1]
    middle = values[1:-1].mean() if values.size > 2 else np.nan
    mean = values.mean()
    with np.errstate(divide="ignore", invalid="ignore"):
        stats.update(
            first=first,
            middle=middle,
            last=last,
            sink_score=first - middle,
            first_last_diff=first - last,
            # Only a positive middle makes a ratio (module docstring); NaN middle stays NaN.
            first_middle_ratio=first / middle if middle > 0 else np.nan,
            # A percent of the mean means something only for masses: a mean logit is defined up
            # to a shift and often near 0 (a spread of 7,556 % said nothing).
            spread_pct=(values.max() - values.min()) / abs(mean) * 100.0
            if measure == "prob_mass"
            else np.nan,
            argmax_frame=int(frames[np.argmax(values)]),
            min_frame=int(frames[np.argmin(values)]),
        )
    if measure == "prob_mass":
        # Every frame has the same number of tokens, so a frame's uniform share is 1 / frames.
        stats["uniform_multiple"] = uniform_multiple(first, values.size)
        own = np.isin(frames, own_frames)
        stats["recent_mass"] = values[own].sum() if own.any() else np.nan
    return stats


def first_frame_by_block(ds: xr.Dataset, step: int) -> pd.DataFrame:
    """Per (head, query block) at `step` (a step label): the block's `prob_mass` profile on its
    first visible key frame (`first`), the key frames it sees (`visible_frames`) and
    `uniform_multiple`: the `each_block` prob_mass rows of `frame_statistics`, computed for
    every head and block at once (the sink strength over generation time)."""
    blocks = np.asarray(ds["block"].values)
    values = ds["prob_mass"].sel(step=step).transpose("head", "query_frame", "key_frame").values
    heads = [int(head) for head in ds["head"].values]
    parts = []
    for block in np.unique(blocks):
        profile = query_profile(values, np.flatnonzero(blocks == block))  # head, key frame
        visible = np.isfinite(profile)
        count = visible.sum(axis=-1)
        first = np.take_along_axis(profile, visible.argmax(axis=-1)[:, None], axis=-1)[:, 0]
        first = np.where(count > 0, first, np.nan)
        parts.append(
            pd.DataFrame(
                {
                    "head": heads,
                    "query": f"block{int(block)}",
                    "block": int(block),
                    "first": first,
                    "visible_frames": count,
                    "uniform_multiple": uniform_multiple(first, count),
                }
            )
        )
    return pd.concat(parts, ignore_index=True)


def _scalar(ds: xr.Dataset, name: str):
    """A scalar coordinate, or the attribute of the same name."""
    value = ds[name].values.item() if name in ds.coords else ds.attrs.get(name)
    return str(value) if isinstance(value, str) else value


def first_frame_importance(ds: xr.Dataset, measure: str = "prob_mass") -> np.ndarray:
    """Gu et al.'s importance of key frame 0, [step, head]: the mean of `measure` on frame 0 over
    the query frames that can see it (NaN rows, which cannot, are left out)."""
    first = ds[measure].isel(key_frame=0).transpose("step", "head", "query_frame").values
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all NaN: no probabilities captured
        return np.nanmean(first.astype(float), axis=2)


def uniform_multiple(mass, visible_frames, sink_frames=1):
    """The sink definition's score: `mass` on `sink_frames` key frames (the first visible one by
    default) in multiples of their uniform share, sink_frames / `visible_frames` (every frame
    holds the same number of tokens): 1 for a head that spreads its mass evenly, whatever the
    number of frames it sees. NaN where no frame is visible. A float for scalars, else an
    array."""
    mass = np.asarray(mass, dtype=float)
    visible = np.asarray(visible_frames, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.asarray(sink_frames, dtype=float) / visible
        multiple = np.where(visible > 0, mass / share, np.nan)
    return float(multiple) if multiple.ndim == 0 else multiple


def is_sink(multiple, sink_threshold: float = SINK_THRESHOLD):
    """The one sink definition of head_class, the sink rate and the sink figures: the mass on the
    first visible key frame is at least `sink_threshold` times its uniform share (`multiple`,
    the `uniform_multiple` column or `uniform_multiple()`). NaN is no sink."""
    with np.errstate(invalid="ignore"):
        return np.asarray(multiple, dtype=float) >= sink_threshold


def sink_definition(sink_threshold: float = SINK_THRESHOLD) -> str:
    """The sink definition in words, for titles, legends and axis labels."""
    return f"first-frame mass ≥ {sink_threshold:g}× uniform share"


def head_class(
    multiple: float,
    recent_mass: float,
    sink_threshold: float = SINK_THRESHOLD,
    recent_threshold: float = RECENT_THRESHOLD,
):
    """sink: `is_sink` (the first-frame mass `multiple` of its uniform share reaches
    sink_threshold); else recent: mass on the own block >= recent_threshold; else spread. Empty
    when there are no probabilities."""
    if np.isnan(multiple) or np.isnan(recent_mass):
        return ""
    if is_sink(multiple, sink_threshold):
        return "sink"
    return "recent" if recent_mass >= recent_threshold else "spread"


def frame_statistics(
    ds: xr.Dataset,
    query: str = "last_block",
    *,
    sink_threshold: float = SINK_THRESHOLD,
    recent_threshold: float = RECENT_THRESHOLD,
) -> pd.DataFrame:
    """One row per (head, step, measure, query set) with the Contract 3 columns, then one row
    per (step, measure, query set) with head = `MEAN_HEAD`: the statistics of the head-mean
    profile (module docstring), with entropy, importance and head_class empty.

    `importance` and `head_class` are defined on probabilities and left empty for logits.
    """
    sets = query_sets(ds["block"].values, query)
    key_frames = ds["key_frame"].values
    measures = {
        name: ds[name].transpose("step", "head", "query_frame", "key_frame").values.astype(float)
        for name in MEASURES
    }
    entropy = ds["entropy"].transpose("step", "head", "query_frame").values.astype(float)
    query_index = {int(f): i for i, f in enumerate(ds["query_frame"].values)}
    timesteps = ds["timestep"].values
    pass_kinds = [str(kind) for kind in ds["pass_kind"].values]
    provenance = {name: _scalar(ds, name) for name in ("checkpoint", "prompt", "layer")}
    importance = first_frame_importance(ds)

    rows = []
    for h, head in enumerate(ds["head"].values):
        for s, step in enumerate(ds["step"].values):
            for measure in MEASURES:
                for label, set_frames, own_frames in sets:
                    rows_of_set = [query_index[int(f)] for f in set_frames]
                    profile = query_profile(measures[measure][s, h], rows_of_set)
                    stats = profile_statistics(profile, key_frames, own_frames, measure)
                    stats["entropy"] = entropy[s, h, rows_of_set].mean()
                    is_mass = measure == "prob_mass"
                    stats["importance"] = importance[s, h] if is_mass else np.nan
                    stats["head_class"] = (
                        head_class(
                            stats["uniform_multiple"],
                            stats["recent_mass"],
                            sink_threshold,
                            recent_threshold,
                        )
                        if is_mass
                        else ""
                    )
                    rows.append(
                        {
                            **provenance,
                            "head": int(head),
                            "step": int(step),
                            "timestep": float(timesteps[s]),
                            "pass_kind": pass_kinds[s],
                            "measure": measure,
                            "query": label,
                            **stats,
                        }
                    )
    for s, step in enumerate(ds["step"].values):
        for measure in MEASURES:
            for label, set_frames, own_frames in sets:
                rows_of_set = [query_index[int(f)] for f in set_frames]
                profile = head_mean_profile(query_profile(measures[measure][s], rows_of_set))
                stats = profile_statistics(profile, key_frames, own_frames, measure)
                stats.update(entropy=np.nan, importance=np.nan, head_class="")
                rows.append(
                    {
                        **provenance,
                        "head": MEAN_HEAD,
                        "step": int(step),
                        "timestep": float(timesteps[s]),
                        "pass_kind": pass_kinds[s],
                        "measure": measure,
                        "query": label,
                        **stats,
                    }
                )
    table = pd.DataFrame(rows, columns=COLUMNS)
    for column in FRAME_COLUMNS:
        table[column] = table[column].astype("Int64")
    return table


def head_mean_profile(profiles: np.ndarray) -> np.ndarray:
    """The head-mean profile of per-head profiles [head, key_frame]: their mean per key frame,
    NaN where some head cannot see it (the rule of `query_profile`)."""
    return np.asarray(profiles, dtype=float).mean(axis=0)


def is_mean_head(heads) -> np.ndarray:
    """True for the rows of the head-mean profile (head = `MEAN_HEAD`), as built or read back."""
    return np.asarray(pd.Series(heads).astype(str) == MEAN_HEAD)


def per_head(table: pd.DataFrame) -> pd.DataFrame:
    """The per-head rows of a statistics table, `head` as integers (head = mean rows left out)."""
    rows = table[~is_mean_head(table["head"])]
    return rows.astype({"head": "int64"})


def parse_heads(heads: pd.Series) -> pd.Series:
    """The `head` column with integer heads as int and `MEAN_HEAD` kept, whether it was built
    or read back from CSV (where every value is text); anything else is an error."""

    def parse(value):
        if isinstance(value, str) and value == MEAN_HEAD:
            return MEAN_HEAD
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = np.nan
        if not np.isfinite(number) or number != int(number):
            raise ValueError(f"head must be an integer or {MEAN_HEAD!r}, got {value!r}")
        return int(number)

    return heads.map(parse).astype(object)


def read_stats(path: str | os.PathLike) -> pd.DataFrame:
    """A statistics CSV (a run's layer, or summary.csv) as written: heads integers and
    `MEAN_HEAD`, empty head_class empty text, empty numbers NaN; in a run's table the frame
    indices are integers (in summary.csv their across-prompt means are not)."""
    return _typed(pd.read_csv(path, keep_default_na=False, na_values=[""]))


def _typed(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with the types of `frame_statistics` (heads parsed, frame indices Int64 unless it
    holds across-prompt aggregates), whether built or read back from CSV."""
    table = table.copy()
    table["head"] = parse_heads(table["head"])
    if "aggregate" not in table:
        for column in FRAME_COLUMNS:
            table[column] = table[column].astype("Float64").astype("Int64")
    table["head_class"] = table["head_class"].fillna("").astype(str)
    return table


def _write_csv_atomically(table: pd.DataFrame, csv_path: str | os.PathLike) -> None:
    write_csv(csv_path, table)


def write_stats(
    frame_store: str | os.PathLike,
    csv_path: str | os.PathLike,
    query: str = "last_block",
    *,
    sink_threshold: float = SINK_THRESHOLD,
    recent_threshold: float = RECENT_THRESHOLD,
) -> None:
    """Statistics of one frame dataset, written atomically as CSV."""
    table = frame_statistics(
        open_frame_dataset(frame_store),
        query=query,
        sink_threshold=sink_threshold,
        recent_threshold=recent_threshold,
    )
    _write_csv_atomically(table, csv_path)


def write_run_stats(
    frame_stores: Sequence[str | os.PathLike],
    csv_paths: Sequence[str | os.PathLike],
    query: str = "last_block",
    *,
    sink_threshold: float = SINK_THRESHOLD,
    recent_threshold: float = RECENT_THRESHOLD,
) -> None:
    """`write_stats` of each frame dataset (of one run or many) to the matching CSV path, with
    a progress line every 10 s."""
    if len(frame_stores) != len(csv_paths):
        raise ValueError(f"{len(frame_stores)} frame datasets but {len(csv_paths)} CSV paths")
    start = reported = time.monotonic()
    for done, (frame_store, csv_path) in enumerate(zip(frame_stores, csv_paths, strict=True), 1):
        write_stats(
            frame_store,
            csv_path,
            query,
            sink_threshold=sink_threshold,
            recent_threshold=recent_threshold,
        )
        now = time.monotonic()
        if now - reported >= 10 or done == len(frame_stores):
            LOG.info(
                "statistics of %d/%d frame datasets, %.1f s", done, len(csv_paths), now - start
            )
            reported = now


def summarize(tables: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Stack per-run statistics (aggregate='run') and add across-prompt mean, std and count, per
    head and for the head = mean rows (each its own group: the across-prompt mean of the
    head-mean rows is not mixed with the per-head rows)."""
    return across_prompts(map(_summary_typed, tables), GROUP_COLUMNS, STAT_COLUMNS, COLUMNS)


def _summary_typed(table: pd.DataFrame) -> pd.DataFrame:
    """A run's table as `summarize` stacks it: heads parsed, every statistic plain float64 (the
    frame indices sit beside their across-prompt means)."""
    table = table.assign(head=parse_heads(table["head"]))
    return table.astype(dict.fromkeys(FRAME_COLUMNS, "float64"))


def across_prompts(
    tables: Iterable[pd.DataFrame],
    group_columns: Sequence[str],
    value_columns: Sequence[str],
    columns: Sequence[str],
) -> pd.DataFrame:
    """Stack per-run tables (aggregate='run') and add, per `group_columns`, rows with
    prompt='*' and aggregate = mean / std / count of `value_columns` across prompts; the result
    has `columns` and `aggregate`."""
    runs = pd.concat(list(tables), ignore_index=True)
    runs["aggregate"] = "run"
    numeric = runs[list(value_columns)].astype("float64")
    grouped = numeric.groupby([runs[c] for c in group_columns], dropna=False, sort=True)
    parts = [runs]
    for aggregate, frame in (
        ("mean", grouped.mean()),
        ("std", grouped.std(ddof=1)),
        ("count", grouped.count()),
    ):
        frame = frame.reset_index()
        frame["prompt"] = "*"
        frame["aggregate"] = aggregate
        parts.append(frame)
    return pd.concat(parts, ignore_index=True)[[*columns, "aggregate"]]


# The report's summary (`summary_html`): what each measure's table is called, and its style
# (small type, numbers right-aligned, long column names wrapped rather than widening the page).
SUMMARY_MEASURE_TITLES = {
    "logit_mean": "Logits: mean pre-softmax logit per key frame",
    "prob_mass": "Probability: attention mass per key frame",
}
SUMMARY_HTML_STYLE = (
    "<style>table.sinkscope-summary{border-collapse:collapse;font-size:11px;margin-bottom:1em}"
    "table.sinkscope-summary th,table.sinkscope-summary td{padding:1px 5px;text-align:right}"
    "table.sinkscope-summary th{overflow-wrap:anywhere;vertical-align:bottom;"
    "border-bottom:1px solid #999}table.sinkscope-summary tr:nth-child(even){background:#f4f4f4}"
    "</style>"
)


def _pass_labels(rows: pd.DataFrame) -> pd.Series:
    """'0: t=1000' for a denoising pass, '4: cache' (or recache) for the others."""
    return pd.Series(
        [
            f"{int(step)}: t={float(t):g}" if kind == "denoise" else f"{int(step)}: {kind}"
            for step, t, kind in zip(rows["step"], rows["timestep"], rows["pass_kind"], strict=True)
        ],
        index=rows.index,
        dtype=object,
    )


def summary_html(summary: pd.DataFrame) -> str:
    """The across-prompt means of `summary` (`summarize`) as HTML for the report, readable at
    report width: one table per measure (`MEASURES` order, then any other), each without the
    columns empty in every one of its rows (a statistic the measure does not have), with step,
    timestep and pass kind as one `pass` column ('0: t=1000', '4: cache') and a query set that
    is the same on every row named above the table instead of in a column; 4 significant
    digits, empty cells blank. The per-run values, std and count stay in summary.csv."""
    means = summary[summary["aggregate"] == "mean"]
    runs = summary[summary["aggregate"] == "run"]
    prompts = runs.groupby("checkpoint", sort=True)["prompt"].nunique()
    averaged = ", ".join(f"{checkpoint}: {count}" for checkpoint, count in prompts.items())
    parts = [
        SUMMARY_HTML_STYLE,
        f"<p>Across-prompt means of the sink statistics (prompts per checkpoint: {averaged}); "
        "one table per measure, without the statistics a measure does not have. Every run's "
        "values, the std and the count across prompts: summary.csv.</p>",
    ]
    measures = [m for m in MEASURES if m in set(means["measure"])]
    measures += sorted(set(means["measure"]) - set(MEASURES))
    for measure in measures:
        rows = means[means["measure"] == measure].drop(columns=["prompt", "aggregate", "measure"])
        rows = rows.dropna(axis="columns", how="all")
        rows = rows.loc[:, [(rows[c].astype(str) != "").any() for c in rows.columns]]
        rows.insert(rows.columns.get_loc("step"), "pass", _pass_labels(rows))
        rows = rows.drop(columns=["step", "timestep", "pass_kind"])
        queries = sorted(set(rows["query"].astype(str)))
        if len(queries) == 1:
            rows = rows.drop(columns="query")
        title = SUMMARY_MEASURE_TITLES.get(measure, measure)
        where = f" (query: {queries[0]})" if len(queries) == 1 else ""
        parts.append(f"<h4>{title} &mdash; <code>{measure}</code>{where}</h4>")
        table = rows.to_html(
            index=False, float_format="%.4g", na_rep="", border=0, classes="sinkscope-summary"
        )
        parts.append(table)
    return "\n".join(parts) + "\n"


def write_summary(
    csv_paths: Iterable[str | os.PathLike],
    out_csv: str | os.PathLike,
    sink_rate_csv: str | os.PathLike | None = None,
    *,
    html_table: str | os.PathLike | None = None,
    sink_threshold: float = SINK_THRESHOLD,
) -> None:
    """Stack per-run statistics CSVs, add across-prompt aggregates, write atomically; optionally
    the sink rate of every run, layer and step as a second table, and the across-prompt means
    as HTML tables, one per measure (`summary_html`, for the report)."""
    paths = list(csv_paths)
    if not paths:
        raise ValueError("write_summary needs at least one statistics CSV")
    tables = [read_stats(path) for path in paths]
    summary = summarize(tables)
    _write_csv_atomically(_frame_indices_as_in_runs(summary), out_csv)
    if html_table is not None:
        write_text_atomically(html_table, summary_html(summary))
    if sink_rate_csv is not None:
        _write_csv_atomically(sink_rates(pd.concat(tables), sink_threshold), sink_rate_csv)


def _frame_indices_as_in_runs(summary: pd.DataFrame) -> pd.DataFrame:
    """`summary` with the frame indices of its run rows as integers (empty where none), as the
    runs' own tables write them; the across-prompt mean / std / count rows stay floats."""
    summary = summary.copy()
    runs = (summary["aggregate"] == "run").to_numpy()
    for column in FRAME_COLUMNS:
        values = summary[column].astype(object)
        values[runs] = summary.loc[runs, column].astype("Int64").astype(object)
        summary[column] = values
    return summary


def sink_rates(stats: pd.DataFrame, threshold: float = SINK_THRESHOLD) -> pd.DataFrame:
    """The sink rate (Gu et al.'s share of sink heads, with the sink definition of `is_sink`) per
    (checkpoint, prompt, layer, step, query set): the share of heads whose `uniform_multiple`
    (first-frame mass over its uniform share) is at least `threshold`, the heads head_class
    calls `sink` at that threshold. A share of heads: the head = mean rows are not heads and
    never count."""
    heads = per_head(stats)
    heads = heads[heads["measure"] == "prob_mass"].drop_duplicates(
        ["checkpoint", "prompt", "layer", "step", "query", "head"]
    )
    sinks = is_sink(heads["uniform_multiple"], threshold)
    grouped = heads.assign(is_sink=sinks).groupby(SINK_RATE_KEYS, sort=True)
    table = grouped.agg(
        sink_heads=("is_sink", "sum"),
        num_heads=("head", "nunique"),
        measured=("uniform_multiple", "count"),
    ).reset_index()
    table["sink_rate"] = (table["sink_heads"] / table["num_heads"]).where(table["measured"] > 0)
    table["threshold"] = threshold
    return _in_query_order(table.drop(columns="measured"))


def _in_query_order(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with the query sets of each (run, layer, step) in their order (block2 before
    block10), as `query_sets` makes them."""
    number = pd.to_numeric(
        table["query"].astype(str).str.extract(r"(\d+)$")[0], errors="coerce"
    ).fillna(-1)
    keys = [key for key in SINK_RATE_KEYS if key != "query"]
    ordered = table.assign(_query_number=number).sort_values(
        [*keys, "_query_number"], kind="stable"
    )
    return ordered.drop(columns="_query_number").reset_index(drop=True)
