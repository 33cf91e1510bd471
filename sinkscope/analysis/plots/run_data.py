"""The data side of one run's figures (`run.py` draws them): which measures and statistics a
figure shows, the titles' numbers and labels, the geometry of the frame maps' block grid and key
versions, the colour limits shared by a run's layers. No drawing."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.transforms import Affine2D

from sinkscope import frames
from sinkscope.analysis import stats

from .common import (
    MEASURE_VARIABLES,
    check_choice,
    check_head,
    checkpoint_of,
    color_limits,
    head_label,
    last_block_profile,
    prompt_of,
    select_step,
    signed_number,
    step_title,
)

# The unit of a sink score (first - middle key frames) in the heads grid's titles.
SCORE_UNITS = {"logits": "logit", "probabilities": "mass"}
STANDOUT_SHARE = 0.1  # a head stands apart by at least this share of its panel's value range
ANNOTATIONS = ("max", "min")  # what figure4 may annotate (`figures.annotate`)
# The layer figures whose colour maps of a run's layers share one scale (`render_figures`,
# `shared_scale`): the values each draws, of one layer's dataset, in one measure.
SHARED_SCALES: dict[str, Callable[[xr.Dataset, str, int], np.ndarray]] = {
    "plot_heads_heatmap": lambda ds, measure, step: last_block_profile(ds, measure, step).values,
    "plot_frame_maps": lambda ds, measure, step: frame_map_values(ds, measure, step).values,
}


def head_statistics(ds: xr.Dataset, measure: str = "logits", step: int = 0) -> pd.DataFrame:
    """The `last_block` rows of the statistics CSV for `measure` and `step`, indexed by head."""
    check_choice("measure", measure, tuple(MEASURE_VARIABLES))
    select_step(ds, step)
    return stats.head_statistics(ds, MEASURE_VARIABLES[measure], step, "last_block")


def frame_name(latent: int, frame_axis: str) -> str:
    if frame_axis == "latent":
        return f"frame {latent}"
    span = frames.video_frames_of_latent(latent)
    if len(span) == 1:
        return f"frame {span.start}"
    return f"frames {span.start}–{span.stop - 1}"


def format_value(value: float) -> str:
    return "nan" if not np.isfinite(value) else f"{value:.3g}"


def check_annotate(annotate: Sequence[str]) -> None:
    for what in annotate:
        check_choice("annotate", what, ANNOTATIONS)


def uniform_share(profile: np.ndarray) -> float:
    """The share of the attention a visible key frame gets when attention is uniform: 1 / V, V
    the key frames the profile counts (every query of the set sees them; every frame holds the
    same number of tokens), as the statistics' `uniform_multiple`. NaN without one."""
    visible = int(np.isfinite(profile).sum())
    return 1.0 / visible if visible else math.nan


def other_measure(measure: str) -> str:
    return next(other for other in MEASURE_VARIABLES if other != measure)


def headline_measures(datasets: Iterable[xr.Dataset], measure: str, step: int) -> list[str]:
    """The measures a headline figure draws: `measure`, then the other one where some dataset
    holds its values (a frame dataset reduced without token logits has NaN probabilities)."""
    other = other_measure(measure)
    variable = MEASURE_VARIABLES[other]
    held = any(np.isfinite(select_step(ds, step)[variable].values).any() for ds in datasets)
    return [measure, other] if held else [measure]


def query_block(ds: xr.Dataset) -> list[int]:
    """The latent frames of the last block: the query frames of the last-block profile."""
    return [int(f) for f in ds["query_frame"].values[stats.last_block_rows(ds)]]


def span(frames_: Sequence[int]) -> str:
    return f"{frames_[0]}" if len(frames_) == 1 else f"{frames_[0]}–{frames_[-1]}"


def run_title(ds: xr.Dataset, step: int) -> str:
    return f"{checkpoint_of(ds)} · {prompt_of(ds)} · {step_title(ds, step)}"


def titled(what: str, ds: xr.Dataset, step: int, titles: bool) -> str:
    """'{what} · {checkpoint} · {prompt} · t=...', or `what` alone without `titles` (a paper's
    figure, whose caption names the run)."""
    return f"{what} · {run_title(ds, step)}" if titles else what


def check_run_heads(layers: dict[int, xr.Dataset], heads: Sequence[tuple[int, int]]) -> None:
    """Every (layer, head) of figure4 exists in the run's datasets `layers`."""
    if not heads:
        raise ValueError("figure4 needs at least one (layer, head)")
    for layer, head in heads:
        if layer not in layers:
            raise ValueError(
                f"figure4 head {head_label(layer, head)} needs layer {layer}, but no frame store "
                f"of this run holds it (layers: {list(layers)})"
            )
        check_head(layers[layer], head)


def last_block_label(ds: xr.Dataset) -> str:
    """'last block: query frames 16-18 (latent)', read from the block coordinate, so it names
    the query set of the statistics whatever the block layout ([3, 3, ...] or [1, 3, 3, ...])."""
    frames = [int(f) for f in ds["query_frame"].values[stats.last_block_rows(ds)]]
    span = f"frame {frames[0]}" if len(frames) == 1 else f"frames {frames[0]}–{frames[-1]}"
    return f"last block: query {span} (latent)"


def grid_columns(count: int) -> int:
    return 4 if count > 3 else count


def sink_score_title(layer: int, head: int, score: float, measure: str, decimals: int) -> str:
    """A heads grid panel's title: 'L2H3 sink score −3.68 logit', 'L0H0 sink score +0.650 mass'
    (the sink score, first minus middle key frames, with `decimals` decimals and the measure's
    unit)."""
    score_text = signed_number(score, decimals)
    return f"{head_label(layer, head)} sink score {score_text} {SCORE_UNITS[measure]}"


def block_boundaries(
    block_starts: np.ndarray, key_edges: np.ndarray, query_edges: np.ndarray, num_keys: int
) -> list[np.ndarray]:
    """The segments between the blocks of a frame map: a row edge and (where the keys reach it)
    a column edge at the first frame of every block after the first."""
    x_range, y_range = (key_edges[0], key_edges[-1]), (query_edges[0], query_edges[-1])
    segments = [np.array([(x, query_edges[start]) for x in x_range]) for start in block_starts]
    segments += [
        np.array([(key_edges[start], y) for y in y_range])
        for start in block_starts
        if start < num_keys
    ]
    return segments


def cell_transform(
    key_edges: np.ndarray, query_edges: np.ndarray, query: int, key: int
) -> Affine2D:
    """The unit square onto the map cell (query, key)."""
    return (
        Affine2D()
        .scale(key_edges[key + 1] - key_edges[key], query_edges[query + 1] - query_edges[query])
        .translate(key_edges[key], query_edges[query])
    )


def outline(mask: np.ndarray, x_edges: np.ndarray, y_edges: np.ndarray) -> list[np.ndarray]:
    """The segments around the cells of `mask` (rows on y, columns on x) inside the map: every
    cell side whose neighbour is outside the mask, but not the map's border (the spines')."""
    segments = []
    columns = np.diff(mask.astype(int), axis=1)  # between column c and c + 1
    for row, column in zip(*np.nonzero(columns), strict=True):
        x = x_edges[column + 1]
        segments.append(np.array([(x, y_edges[row]), (x, y_edges[row + 1])]))
    rows = np.diff(mask.astype(int), axis=0)  # between row r and r + 1
    for row, column in zip(*np.nonzero(rows), strict=True):
        y = y_edges[row + 1]
        segments.append(np.array([(x_edges[column], y), (x_edges[column + 1], y)]))
    return segments


def frame_map_values(ds: xr.Dataset, measure: str, step: int) -> xr.DataArray:
    """The maps of `plot_frame_maps`: (head, query_frame, key_frame) of `measure` at `step`."""
    variable = MEASURE_VARIABLES[measure]
    return select_step(ds, step)[variable].transpose("head", "query_frame", "key_frame")


def standout(values: pd.Series, span: float) -> object | None:
    """The index of the entry of `values` (NaN ignored) that stands apart from the rest: the
    one furthest from the median of the others, if that distance is more than both the others'
    range (max - min) and STANDOUT_SHARE of `span` (the panel's range of values); else None.
    Needs three values: two have no 'rest' to stand apart from."""
    finite = values.dropna()
    if len(finite) < 3:
        return None
    distance = pd.Series(
        [abs(value - finite.drop(key).median()) for key, value in finite.items()],
        index=finite.index,
    )
    key = distance.idxmax()
    rest = finite.drop(key)
    far = distance[key] > max(float(rest.max() - rest.min()), STANDOUT_SHARE * span)
    return key if far else None


def value_span(values: Iterable[float]) -> float:
    finite = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    return float(finite.max() - finite.min()) if finite.size else 0.0


def shared_color_limits(
    function: str, datasets: Iterable[xr.Dataset], step: int
) -> dict[str, tuple[float, float]]:
    """Per measure, the colour limits (`color_limits`) of the values the layer figure `function`
    (a key of SHARED_SCALES) draws of every dataset of `datasets`, pooled: the one scale of a
    run's layers, for each measure the headline figures draw."""
    drawn = SHARED_SCALES[function]
    datasets = list(datasets)
    return {
        measure: color_limits(
            np.concatenate([np.ravel(drawn(ds, measure, step)) for ds in datasets]), measure
        )
        for measure in MEASURE_VARIABLES
    }
