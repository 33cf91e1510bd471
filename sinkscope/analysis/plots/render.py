"""`render_figures`: the one entry point the figure scripts call. It opens the zarr stores (frame
datasets, and for the whole-model survey the attention stores of Contract 4), the tables and the
decoded videos, checks every request before the first file is written, and hands each file of
the rules' outputs to the function the registry (`sinkscope.analysis.figures`) names for its
kind, in the kind's family module.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import pandas as pd
import xarray as xr
from matplotlib.figure import Figure

from sinkscope.analysis import figures, stats
from sinkscope.analysis.closed_loop import read_closed_loop_summary, read_deviation
from sinkscope.analysis.diagnostics import read_block_diagnostics
from sinkscope.analysis.policies import read_policies
from sinkscope.analysis.stores import open_attention_store, open_frame_dataset
from sinkscope.analysis.switches import read_switch_table
from sinkscope.video_metrics import read_video_metrics

from . import closed_loop, compare, policy, run, run_data, survey, survey_data, video
from .common import (
    by_layer,
    check_options,
    checkpoint_of,
    layer_of,
    prompt_of,
    save_figure,
    select_step,
)


def _datasets_for(
    layers: str, datasets: Sequence[xr.Dataset], heads: Sequence[tuple[int, int]]
) -> list[xr.Dataset]:
    """The datasets a run or compare figure reads (`FigureKind.layers`): all (`captured`), or
    those of the heads' layers (`heads`). When none holds a head's layer all are kept, so that
    the figure's own check names the missing layer."""
    if layers == "captured":
        return list(datasets)
    return _of_layers(datasets, [layer for layer, _ in heads]) or list(datasets)


def _of_layers(datasets: Sequence[xr.Dataset], layers: Sequence[int] | None) -> list[xr.Dataset]:
    """The datasets of `layers` (all of them for None)."""
    if layers is None:
        return list(datasets)
    wanted = {int(layer) for layer in layers}
    return [ds for ds in datasets if layer_of(ds) in wanted]


def _survey_datasets(
    datasets: Sequence[xr.Dataset], attention: Sequence[xr.Dataset]
) -> list[xr.Dataset]:
    """The frame datasets a survey figure shows: those of the attention stores' layers when
    stores are given (each needs one), else every one given."""
    if not attention:
        return list(datasets)
    wanted = {_store_key(store) for store in attention}
    have = {(checkpoint_of(ds), prompt_of(ds), layer_of(ds)) for ds in datasets}
    missing = [f"{c}/{p}/layer{layer}" for c, p, layer in sorted(wanted - have)]
    if missing:
        raise ValueError(f"the attention stores {missing} have no frame dataset given")
    return [ds for ds in datasets if (checkpoint_of(ds), prompt_of(ds), layer_of(ds)) in wanted]


def _store_key(store: xr.Dataset) -> tuple[str, str, int]:
    return (str(store.attrs["checkpoint"]), str(store.attrs["prompt"]), int(store.attrs["layer"]))


THRESHOLDS = ("sink_threshold", "recent_threshold")  # of the stats section, as figures read them


def render_figures(
    frame_stores: Sequence[str | os.PathLike],
    outputs: Sequence[str | os.PathLike],
    *,
    heads: Sequence[tuple[int, int]],
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    attention_stores: Sequence[str | os.PathLike] = (),
    sink_threshold: float = stats.SINK_THRESHOLD,
    recent_threshold: float = stats.RECENT_THRESHOLD,
    policy_tables: Sequence[str | os.PathLike] = (),
    policy_budget: int | None = None,
    policy_layers: Sequence[int] | None = None,
    deviation_tables: Sequence[str | os.PathLike] = (),
    closed_loop_summary: str | os.PathLike | None = None,
    closed_loop_blocks: str | os.PathLike | None = None,
    closed_loop_switches: str | os.PathLike | None = None,
    video_tables: Sequence[str | os.PathLike] = (),
    videos: Sequence[str | os.PathLike] = (),
    train_frames: int | None = None,
    annotate: Sequence[str] = ("max",),
    titles: bool = True,
    shared_scale: bool = True,
    figure_layers: Sequence[int] | None = None,
    survey_layers: Sequence[int] | None = None,
) -> list[Path]:
    """Draw each file of `outputs` from the frame datasets `frame_stores`; returns the paths.

    What a file shows comes from its name (`figures.parse_figure_path`: kind, layer, format), so
    the rules' outputs alone decide what is drawn and where. Layer, run and survey figures need
    the stores of one (checkpoint, prompt); compare figures take any number of runs. Survey
    figures (and survey compare figures) show the layers of the attention stores
    `attention_stores` (Contract 4; every one needs its frame dataset), or every frame dataset
    when none is given; `survey_spatial` needs the stores. `figure_layers` and `survey_layers`,
    when given, pick the frame datasets the other figures and the survey figures show, so that
    one call draws a run's figures and its survey from one list. `sink_threshold` and
    `recent_threshold` are the statistics' (`stats.is_sink`: the head class, the sink rate and
    every survey figure that says sink). Policy figures draw the recall
    tables `policy_tables` (Contract 5) of one run, at step `step`, with `policy_budget` (the sink
    sweep and map; default `default_policy_budget`) and `policy_layers` (default
    `default_policy_layers`); they need no frame dataset. Closed-loop figures draw the
    deviation tables `deviation_tables` (Contract 6, every run and policy: `closed_loop_deviation`)
    or the summary `closed_loop_summary` (`closed_loop_recall_deviation`), the collapse figure
    the frame tables and the block table `closed_loop_blocks` (`results/closed_loop/blocks.csv`),
    the switch figure the switch table `closed_loop_switches` (`results/closed_loop/switches.csv`),
    with the training length `train_frames` (latent frames) marked; they need no frame dataset
    either. Video figures (`results/figures/{checkpoint}/{prompt}/video_{kind}.{fmt}`: the run is
    the file's last two folder names) draw that run's rows of the video metrics `video_tables`
    (`results/videos/{checkpoint}/{prompt}/metrics.csv`, or the stacked one), its decoded rollouts
    among `videos` (`results/videos/{checkpoint}/{prompt}/{rollout}.mp4`: the run from the
    folders, the rollout from the file's stem) and its rows of the deviation tables and the block
    table, which every rollout but the survey's needs; the strip needs a video of every rollout
    of the metrics, with a frame for each of its rows.

    Options for a paper (`figures` in the config): `annotate` ('max', 'min': what figure4
    annotates), `titles` (False: titles leave out the run's checkpoint, prompt and timestep,
    which the caption then names), `shared_scale` (True: the colour maps of a run's layers,
    heads heatmaps and frame maps, share one colour scale, so that the files compare; False: each
    file its own). Every request (heads, step, options, names) is checked before the first file
    is written.
    """
    check_options(measure, frame_axis)
    run_data.check_annotate(annotate)
    plan = [(Path(out), *figures.parse_figure_path(out)) for out in outputs]
    kinds = [kind for _, kind, _, _ in plan]
    datasets = [open_frame_dataset(path) for path in frame_stores]
    # The frame datasets of the layer, run and compare figures (the survey picks its own).
    shown = _of_layers(datasets, figure_layers)
    if not datasets and any(kind.scope not in figures.TABLE_SCOPES for kind in kinds):
        raise ValueError("no frame datasets given")
    tables = _closed_loop_tables(
        kinds,
        deviation_tables,
        closed_loop_summary,
        train_frames,
        closed_loop_blocks,
        closed_loop_switches,
    )
    video_inputs = _video_inputs(plan, video_tables, videos, tables)
    attention = [open_attention_store(path, key_tokens=True) for path in attention_stores]
    for ds in datasets:
        select_step(ds, step)
    if any(kind.scope == "policies" for kind in kinds):
        if not policy_tables:
            raise ValueError("policy figures need the run's recall table (policy_tables)")
        table = pd.concat([read_policies(path) for path in policy_tables])
        rows = policy.policy_last_block(table, step)
        policy.chosen_budget(rows, policy_budget)
        policy.chosen_layers(rows, policy_layers)
    if any(kind.scope in ("layer", "run") for kind in kinds):
        layers = by_layer(shown)
        run_data.check_run_heads(layers, heads)
    if any(kind.scope == "compare" and not kind.surveyed for kind in kinds):
        compare.check_compare_inputs(_datasets_for("heads", shown, heads), heads)
    if any(kind.surveyed for kind in kinds):
        survey_datasets = _survey_datasets(_of_layers(datasets, survey_layers), attention)
        runs = survey_data.survey_runs(survey_datasets)
    statistics = None  # the survey figures' builders compute it themselves when None
    if any(kind.scope == "survey" for kind in kinds):
        if len(runs) > 1:
            raise ValueError(f"survey figures show one run, got {list(runs)}")
        surveyed = next(iter(runs.values()))
        if attention or any("attention" in _accepted(kind) for kind in kinds):
            survey_data.attention_by_layer(attention, surveyed)
        # Once for all of the run's survey figures (each would compute it again).
        statistics = survey_data.survey_statistics(
            list(surveyed.values()),
            sink_threshold=sink_threshold,
            recent_threshold=recent_threshold,
        )
    run_statistics = None  # the same for the survey's compare figures, every run's
    if any(kind.scope == "compare" and kind.surveyed for kind in kinds):
        run_statistics = survey_data.runs_statistics(
            runs, sink_threshold=sink_threshold, recent_threshold=recent_threshold
        )
    options = {
        "heads": heads,
        "measure": measure,
        "frame_axis": frame_axis,
        "step": step,
        "attention": attention,
        "sink_threshold": sink_threshold,
        "recent_threshold": recent_threshold,
        "run_statistics": run_statistics,
        "budget": policy_budget,
        "layers": policy_layers,
        "train_frames": train_frames,
        "blocks": tables.get("blocks"),
        "annotate": tuple(annotate),
        "titles": bool(titles),
        "statistics": statistics,
    }
    scales: dict[str, dict[str, tuple[float, float]]] = {}
    written = []
    for path, kind, layer, fmt in plan:
        kwargs = {name: value for name, value in options.items() if name in _accepted(kind)}
        if shared_scale and kind.family == "run" and kind.function in run_data.SHARED_SCALES:
            if kind.builder not in scales:  # per measure: the headline maps draw both
                scales[kind.builder] = run_data.shared_color_limits(
                    kind.function, layers.values(), step
                )
            kwargs["color_limits"] = scales[kind.builder]
        if kind.scope == "layer":
            if layer not in layers:
                raise ValueError(f"{path}: no frame dataset of layer {layer} given")
            data = layers[layer]
        elif kind.surveyed:
            data = survey_datasets
        elif kind.scope == "policies":
            data = table
        elif kind.scope == "closed_loop":
            data = tables[closed_loop.TABLES[kind.function]]
        elif kind.scope == "video":  # the run's own rows, in place of every run's
            inputs = video_inputs[path]
            data = inputs["table"]
            kwargs |= {name: inputs[name] for name in VIDEO_INPUTS if name in _accepted(kind)}
        else:
            data = _datasets_for(kind.layers, shown, heads)
        written.append(save_figure(builder_of(kind)(data, **kwargs), path, fmt))
    return written


def _closed_loop_tables(
    kinds: Sequence[figures.FigureKind],
    deviation_tables: Sequence[str | os.PathLike],
    summary: str | os.PathLike | None,
    train_frames: int | None,
    blocks: str | os.PathLike | None = None,
    switches: str | os.PathLike | None = None,
) -> dict[str, pd.DataFrame]:
    """The tables the closed-loop kinds of `kinds` draw, read and checked (none else), and the
    video kinds (the frame tables and the block table: the policies' caches and collapse
    candidates); `blocks`: the block table, for the kinds that take it (`blocks`); `switches`:
    the switch table."""
    wanted = {closed_loop.TABLES[kind.function] for kind in kinds if kind.scope == "closed_loop"}
    videos = any(kind.scope == "video" for kind in kinds)
    if videos and not deviation_tables:
        raise ValueError(
            "video figures need the run's closed-loop frame tables (deviation_tables): the "
            "policies' caches and latent sink distances"
        )
    if videos and blocks is None:
        raise ValueError("video figures need the closed-loop block table (blocks.csv)")
    if train_frames is not None and (int(train_frames) != train_frames or train_frames < 1):
        raise ValueError(f"train_frames must be a whole number >= 1, got {train_frames!r}")
    tables = {}
    if "deviation" in wanted or videos:
        if not deviation_tables:
            raise ValueError("closed-loop deviation figures need the deviation tables")
        tables["deviation"] = read_deviation(list(deviation_tables))
    if "summary" in wanted:
        if summary is None:
            raise ValueError("closed-loop recall figures need the closed-loop summary")
        tables["summary"] = read_closed_loop_summary(summary)
        closed_loop.closed_loop_runs(tables["summary"], "summary")
    if videos or any(kind.scope == "closed_loop" and "blocks" in _accepted(kind) for kind in kinds):
        if blocks is None:
            raise ValueError("closed-loop collapse figures need the block table (blocks.csv)")
        tables["blocks"] = read_block_diagnostics(blocks)
    if "switches" in wanted:
        if switches is None:
            raise ValueError("closed-loop switch figures need the switch table (switches.csv)")
        tables["switches"] = read_switch_table(switches)
    return tables


VIDEO_INPUTS = ("videos", "deviation", "blocks")  # what a video builder takes of its run


def _video_inputs(
    plan: Sequence[tuple[Path, figures.FigureKind, int | None, str]],
    video_tables: Sequence[str | os.PathLike],
    videos: Sequence[str | os.PathLike],
    tables: dict[str, pd.DataFrame],
) -> dict[Path, dict[str, object]]:
    """Per video file of `plan`, what its builder gets (`video.video_run_inputs`: the run's video
    metrics `table` first, its `videos`, `deviation` and `blocks`), checked; none without video
    files. A video names its run and rollout: `.../{checkpoint}/{prompt}/{rollout}.mp4`."""
    wanted = [(path, kind) for path, kind, _, _ in plan if kind.scope == "video"]
    if not wanted:
        return {}
    if not video_tables:
        raise ValueError("video figures need the video metrics tables (video_tables)")
    metrics = read_video_metrics(list(video_tables))
    by_rollout: dict[tuple[str, str, str], Path] = {}
    for given in map(Path, videos):
        key = (given.parent.parent.name, given.parent.name, given.stem)
        if key in by_rollout:
            raise ValueError(f"{given}: a second video of {key[0]}/{key[1]} {key[2]}")
        by_rollout[key] = given
    return {
        path: video.video_run_inputs(
            str(path),
            (path.parent.parent.name, path.parent.name),
            metrics,
            by_rollout,
            tables["deviation"],
            tables["blocks"],
            need_videos="videos" in _accepted(kind),
        )
        for path, kind in wanted
    }


def _accepted(kind: figures.FigureKind) -> set[str]:
    """The options the builder of `kind` takes."""
    return set(inspect.signature(builder_of(kind)).parameters)


# The family modules, by the name the registry's builders give them ("run.plot_figure4").
FAMILIES: dict[str, ModuleType] = {
    "run": run,
    "compare": compare,
    "survey": survey,
    "policy": policy,
    "closed_loop": closed_loop,
    "video": video,
}


def builder_of(kind: figures.FigureKind) -> Callable[..., Figure]:
    """The function that draws `kind`: `kind.function` of its family module."""
    return getattr(FAMILIES[kind.family], kind.function)


def render_configured(
    frame_stores: Sequence[str | os.PathLike],
    outputs: Sequence[str | os.PathLike],
    *,
    figures: dict,
    stats_options: dict | None = None,
    policies: dict | None = None,
    **inputs,
) -> list[Path]:
    """`render_figures` with its options as the config's sections give them: `figures` (heads,
    measure, frame_axis, step, annotate, titles, shared_scale), `stats_options` (the
    thresholds the survey figures read) and `policies` (the budget the policy figures show);
    `inputs`: render_figures' other arguments (the layer lists, stores and tables). The figure
    jobs' one call."""
    stats_options, policies = stats_options or {}, policies or {}
    return render_figures(
        frame_stores,
        outputs,
        heads=[tuple(head) for head in figures["heads"]],
        measure=figures["measure"],
        frame_axis=figures["frame_axis"],
        step=figures["step"],
        annotate=figures.get("annotate", ["max"]),
        titles=figures.get("titles", True),
        shared_scale=figures.get("shared_scale", True),
        policy_budget=policies.get("budget"),
        **{key: stats_options[key] for key in THRESHOLDS if key in stats_options},
        **inputs,
    )
