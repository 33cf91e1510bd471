"""The data side of the whole-model survey's figures (`survey.py` draws them): the statistics
of a run's surveyed layers, the runs among the datasets, and what the spatial and entropy figures
read of the attention stores (Contract 4): frame 0's tokens of a head, the visible tokens, the
entropy of uniform attention. Torch-free, like every figure module."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from sinkscope.analysis import stats
from sinkscope.storage import VALUE_FRAME_VARIABLES

from .common import by_layer, checkpoint_of, describe, prompt_of, select_step

SURVEY_MEASURE = "prob_mass"  # sinks are probability mass (Gu et al.)


def survey_statistics(
    datasets: Sequence[xr.Dataset],
    *,
    sink_threshold: float = stats.SINK_THRESHOLD,
    recent_threshold: float = stats.RECENT_THRESHOLD,
) -> pd.DataFrame:
    """The per-head `last_block` prob_mass rows of the statistics CSV (`stats.frame_statistics`,
    Contract 3; `stats.per_head`: no head = mean rows) of every layer of one run, stacked: one
    row per (layer, head, step)."""
    tables = [
        stats.per_head(
            stats.frame_statistics(
                ds, "last_block", sink_threshold=sink_threshold, recent_threshold=recent_threshold
            )
        )
        for ds in by_layer(datasets).values()
    ]
    table = pd.concat(tables, ignore_index=True)
    return table[table["measure"] == SURVEY_MEASURE].reset_index(drop=True)


def runs_statistics(
    runs: Mapping[tuple[str, str], Mapping[int, xr.Dataset]],
    *,
    sink_threshold: float = stats.SINK_THRESHOLD,
    recent_threshold: float = stats.RECENT_THRESHOLD,
) -> dict[tuple[str, str], pd.DataFrame]:
    """`survey_statistics` of each run of `survey_runs`: what the survey's compare figures read,
    computed by the renderer once for all of them."""
    return {
        run: survey_statistics(
            list(layers.values()),
            sink_threshold=sink_threshold,
            recent_threshold=recent_threshold,
        )
        for run, layers in runs.items()
    }


def runs_at_step(
    datasets: Sequence[xr.Dataset],
    step: int,
    *,
    sink_threshold: float = stats.SINK_THRESHOLD,
    run_statistics: Mapping[tuple[str, str], pd.DataFrame] | None = None,
) -> tuple[dict[tuple[str, str], dict[int, xr.Dataset]], Mapping[tuple[str, str], pd.DataFrame]]:
    """What the survey's compare figures start from: the runs of `datasets` (`survey_runs`),
    every layer checked to hold `step`, and each run's statistics (`run_statistics` where the
    caller has them, else `runs_statistics`)."""
    runs = survey_runs(datasets)
    for layers in runs.values():
        for ds in layers.values():
            select_step(ds, step)
    if run_statistics is None:
        run_statistics = runs_statistics(runs, sink_threshold=sink_threshold)
    return runs, run_statistics


def statistics_of(
    layers: dict[int, xr.Dataset],
    statistics: pd.DataFrame | None,
    sink_threshold: float = stats.SINK_THRESHOLD,
    recent_threshold: float = stats.RECENT_THRESHOLD,
) -> pd.DataFrame:
    """`statistics` when the caller has it (`render_figures` computes the `survey_statistics` of
    a run once, at its thresholds, for all of the run's survey figures), else computed here. The
    columns a figure reads of it do not depend on thresholds that figure does not take."""
    if statistics is not None:
        return statistics
    return survey_statistics(
        list(layers.values()), sink_threshold=sink_threshold, recent_threshold=recent_threshold
    )


def survey_layers(datasets: Sequence[xr.Dataset]) -> dict[int, xr.Dataset]:
    """The layers of one run, which must share their captured steps (and their timesteps)."""
    layers = by_layer(datasets)
    first = next(iter(layers.values()))
    for ds in layers.values():
        if not (
            np.array_equal(ds["step"].values, first["step"].values)
            and np.array_equal(ds["timestep"].values, first["timestep"].values)
        ):
            raise ValueError(
                f"surveyed layers must share their steps: {describe(ds)} has steps "
                f"{ds['step'].values.tolist()} at timesteps {ds['timestep'].values.tolist()}, "
                f"{describe(first)} {first['step'].values.tolist()} at "
                f"{first['timestep'].values.tolist()}"
            )
    return layers


def layer_head_values(
    table: pd.DataFrame, column: str, step: int, layers: Sequence[int], heads: Sequence[int]
) -> np.ndarray:
    """(layer, head) array of one statistics column at `step`; NaN where a head is missing."""
    rows = table[table["step"] == int(step)]
    grid = rows.pivot(index="layer", columns="head", values=column)
    return grid.reindex(index=list(layers), columns=list(heads)).to_numpy(dtype=float)


def last_block_visible_frames(datasets: Sequence[xr.Dataset]) -> int:
    """The most key frames the last block's profile of any head sees, in any of `datasets`: V,
    the scale of a first-frame mass over its uniform share (it lies in 0..V)."""
    most = 1
    for ds in datasets:
        values = ds["prob_mass"].transpose("step", "head", "query_frame", "key_frame").values
        profile = stats.query_profile(values, stats.last_block_rows(ds))
        most = max(most, int(np.isfinite(profile).sum(axis=-1).max(initial=0)))
    return most


def survey_runs(datasets: Sequence[xr.Dataset]) -> dict[tuple[str, str], dict[int, xr.Dataset]]:
    """The datasets grouped by (checkpoint, prompt) in order of appearance, each run's layers
    sorted and sharing their steps."""
    runs: dict[tuple[str, str], list[xr.Dataset]] = {}
    for ds in datasets:
        runs.setdefault((checkpoint_of(ds), prompt_of(ds)), []).append(ds)
    if not runs:
        raise ValueError("no frame datasets given")
    return {run: survey_layers(group) for run, group in runs.items()}


def _position(ds: xr.Dataset, dim: str, label: int) -> int:
    return [int(value) for value in ds[dim].values].index(int(label))


def _pick(array: xr.DataArray, dim: str, label: int, position: int) -> xr.DataArray:
    """Select by label where the store labels `dim`, else by position (step and head are plain
    indices in the stores)."""
    return array.sel({dim: label}) if dim in array.coords else array.isel({dim: position})


def first_frame_image(store: xr.Dataset, ds: xr.Dataset, head: int, step: int) -> np.ndarray:
    """(H', W') image of where in latent frame 0 a head's last block attends: the attention
    store's `key_mass` on frame 0's tokens at `step`, averaged over the last block's query frames
    of the frame dataset `ds` (`stats.query_profile`: NaN where one of them cannot see it).
    Reads only that step, head, those query frames and the first T key tokens."""
    tokens = int(store.attrs["frame_seq_length"])
    _, height, width = (int(n) for n in store.attrs["latent_grid"])
    queries = ds["query_frame"].values[stats.last_block_rows(ds)]
    mass = _pick(store["key_mass"], "step", step, _position(ds, "step", step))
    mass = _pick(mass, "head", head, _position(ds, "head", head))
    mass = mass.sel(query_frame=queries).isel(key_token=slice(0, tokens))
    values = mass.transpose("query_frame", "key_token").values
    return stats.query_profile(values, range(len(queries))).reshape(height, width)


def strongest_sinks(
    table: pd.DataFrame, step: int, top: int, sink_threshold: float = stats.SINK_THRESHOLD
) -> tuple[pd.DataFrame, int]:
    """The (layer, head)s of `survey_statistics` that are sinks at `step` (`stats.is_sink` of
    their `uniform_multiple`), strongest first (largest multiple; ties: lower layer, then lower
    head), at most `top` of them; and how many sinks there are in all."""
    rows = table[table["step"] == int(step)]
    rows = rows[stats.is_sink(rows["uniform_multiple"], sink_threshold)]
    ordered = rows.assign(order=-rows["uniform_multiple"].astype(float)).sort_values(
        ["order", "layer", "head"], kind="stable"
    )
    shown = ordered.head(int(top))[["layer", "head", "first", "uniform_multiple"]]
    return shown.reset_index(drop=True), len(rows)


def attention_by_layer(
    attention: Sequence[xr.Dataset], layers: dict[int, xr.Dataset]
) -> dict[int, xr.Dataset]:
    """The attention stores by layer; each must belong to the run of `layers` and hold a layer of
    it, and every layer needs its store."""
    first = next(iter(layers.values()))
    run = (checkpoint_of(first), prompt_of(first))
    stores: dict[int, xr.Dataset] = {}
    for store in attention:
        layer = int(store.attrs["layer"])
        where = f"attention store {store.attrs['checkpoint']}/{store.attrs['prompt']}/layer{layer}"
        if (str(store.attrs["checkpoint"]), str(store.attrs["prompt"])) != run:
            raise ValueError(f"{where} is not of the run {run[0]}/{run[1]}")
        if layer in stores:
            raise ValueError(f"{where} given twice")
        if layer not in layers:
            raise ValueError(f"{where} has no frame dataset (layers: {list(layers)})")
        stores[layer] = store
    missing = [layer for layer in layers if layer not in stores]
    if missing:
        raise ValueError(
            f"the survey figure needs the attention store of every surveyed layer; "
            f"{run[0]}/{run[1]} lacks layers {missing}"
        )
    for layer, store in stores.items():
        ds = layers[layer]
        if not np.allclose(store["timestep"].values, ds["timestep"].values):
            raise ValueError(
                f"attention store of {describe(ds)} has timesteps "
                f"{store['timestep'].values.tolist()}, its frame dataset "
                f"{ds['timestep'].values.tolist()}"
            )
    return stores


def visible_tokens(ds: xr.Dataset, head: int, step: int) -> int:
    """The key tokens a head's last block sees at `step` (its visible key frames x tokens per
    frame): the inverse of a key token's uniform share."""
    values = ds["prob_mass"].sel(step=step, head=head).transpose("query_frame", "key_frame").values
    profile = stats.query_profile(values, stats.last_block_rows(ds))
    return int(np.isfinite(profile).sum()) * int(ds.attrs["frame_seq_length"])


def uniform_entropy(datasets: Sequence[xr.Dataset]) -> float:
    """ln of the most key tokens a last-block query sees in `datasets` (visible key frames x
    tokens per frame): the entropy of uniform attention, the most a head can have. NaN without
    the token count (`frame_seq_length`)."""
    tokens = {ds.attrs.get("frame_seq_length") for ds in datasets}
    if None in tokens or len(tokens) != 1:
        return math.nan
    return math.log(last_block_visible_frames(datasets) * int(tokens.pop()))


def value_profiles(
    layers: Mapping[int, xr.Dataset], heads: Sequence[tuple[int, int]], step: int
) -> list[dict[str, np.ndarray]]:
    """Per (layer, head) of `heads`, the value side of its last block's attention at `step`, per
    key frame, each averaged over the block's query frames as the `last_block` statistics
    average (`stats.query_profile`): `prob_mass`, `mass_value_norm` (mass x ||v|| summed over the
    frame's tokens) and `value_norm` (the mean ||v|| of its tokens). A frame dataset without the
    value side (a token layer, or a survey from before it was captured) is refused, named."""
    profiles = []
    for layer, head in heads:
        ds = layers[layer]
        select_step(ds, step)  # checks the step
        missing = [name for name in VALUE_FRAME_VARIABLES if name not in ds]
        if missing:
            raise ValueError(
                f"{describe(ds)} has no {' or '.join(missing)}: surveys capture the value norms "
                "since sinkscope 2026-11-28; rerun the survey (snakemake --forcerun survey) to "
                "draw the value side"
            )
        rows = stats.last_block_rows(ds)
        profile = {"layer": layer, "head": head}
        for name in ("prob_mass", *VALUE_FRAME_VARIABLES):
            values = ds[name].sel(step=step, head=head).transpose("query_frame", "key_frame")
            profile[name] = stats.query_profile(values.values, rows)
        profiles.append(profile)
    return profiles
