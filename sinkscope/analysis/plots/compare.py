"""The figures across runs (`compare` scope): for chosen heads, the last-block profiles of every
checkpoint, of every prompt, and of every denoising step and the cache pass, from the frame
datasets (Contract 2) of every run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .common import (
    FULL_WIDTH_IN,
    KEY_AXIS_LABELS,
    PROFILE_LABELS,
    check_head,
    check_options,
    checkpoint_of,
    common_steps,
    describe,
    figure_legend,
    format_frame_axis,
    head_label,
    key_frame_positions,
    last_block_profile,
    layer_of,
    legend_handles,
    panel_grid,
    prompt_of,
    series_colors,
    step_colors,
    steps_title,
    styled,
)

# The unit of a difference between two profiles of a measure (the prompts figure's spread).
SPREAD_UNITS = {"logits": "logit", "probabilities": "mass"}


def _runs_with_head(
    datasets: Sequence[xr.Dataset], layer: int, head: int
) -> dict[str, list[xr.Dataset]]:
    """The datasets holding `layer`, grouped by checkpoint in order of appearance."""
    holding = [ds for ds in datasets if layer_of(ds) == layer]
    if not holding:
        raise ValueError(
            f"head {head_label(layer, head)} needs layer {layer}, but no frame store holds it "
            f"(layers: {sorted({layer_of(ds) for ds in datasets})})"
        )
    by_checkpoint: dict[str, list[xr.Dataset]] = {}
    for ds in holding:
        check_head(ds, head)
        by_checkpoint.setdefault(checkpoint_of(ds), []).append(ds)
    return by_checkpoint


def check_compare_inputs(datasets: Sequence[xr.Dataset], heads: Sequence[tuple[int, int]]) -> None:
    if not datasets:
        raise ValueError("no frame datasets given")
    if not heads:
        raise ValueError("need at least one (layer, head)")
    seen: set[tuple[str, str, int]] = set()
    for ds in datasets:
        key = (checkpoint_of(ds), prompt_of(ds), layer_of(ds))
        if key in seen:
            raise ValueError(f"frame dataset {describe(ds)} given twice")
        seen.add(key)
    for layer, head in heads:
        _runs_with_head(datasets, layer, head)


def _prompt_profiles(
    datasets: Sequence[xr.Dataset], head: int, measure: str, step: int
) -> xr.DataArray:
    """One head's last-block profile for each dataset (one per prompt): (prompt, key_frame)."""
    profiles = [
        last_block_profile(ds, measure, step)
        .sel(head=head, drop=True)
        .expand_dims(prompt=[prompt_of(ds)])
        for ds in datasets
    ]
    return xr.concat(profiles, dim="prompt", join="outer")


def _head_panels(fig: Figure, heads: Sequence[tuple[int, int]]) -> list[Axes]:
    return panel_grid(fig, len(heads), 3)


def _checkpoint_series_figure(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    draw_series: Callable[[Axes, object, str, list[xr.Dataset], int], int],
    *,
    measure: str,
    frame_axis: str,
    title: str,
) -> Figure:
    """One panel per (layer, head); `draw_series(ax, color, checkpoint, datasets, head)` draws one
    checkpoint's series and returns its number of key frames. A checkpoint keeps its colour in
    every panel; one legend under the panels names them."""
    check_options(measure, frame_axis)
    check_compare_inputs(datasets, heads)
    checkpoints = list(dict.fromkeys(checkpoint_of(ds) for ds in datasets))
    colors = dict(zip(checkpoints, series_colors(len(checkpoints)), strict=True))
    fig = Figure(
        figsize=(FULL_WIDTH_IN, 2.3 * math.ceil(len(heads) / 3) + 0.25), layout="constrained"
    )
    for ax, (layer, head) in zip(_head_panels(fig, heads), heads, strict=True):
        runs = _runs_with_head(datasets, layer, head)
        num_frames = 1
        for checkpoint, group in runs.items():
            drawn = draw_series(ax, colors[checkpoint], checkpoint, group, head)
            num_frames = max(num_frames, drawn)
        format_frame_axis(ax, num_frames, frame_axis)
        ax.set_title(head_label(layer, head))
        ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
        ax.set_ylabel(PROFILE_LABELS[measure])
    figure_legend(fig, min(len(checkpoints), 3))
    fig.suptitle(title)
    return fig


def _compare_heading(
    what: str, datasets: Sequence[xr.Dataset], step: int | None, titles: bool
) -> str:
    """`what`, then the steps shown ('· t=1000') unless `titles` is off."""
    if not titles or step is None:
        return what
    return f"{what} · {steps_title(datasets, step)}"


@styled
def plot_checkpoints(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """For each head, one line per checkpoint: the last-block profile averaged over prompts (the
    legend counts them). With one checkpoint the title names it."""

    def draw_mean(ax: Axes, color, checkpoint: str, group: list[xr.Dataset], head: int) -> int:
        mean = _prompt_profiles(group, head, measure, step).mean("prompt", skipna=True).values
        positions = key_frame_positions(mean.shape[0], frame_axis)
        count = "1 prompt" if len(group) == 1 else f"mean of {len(group)} prompts"
        label = f"{checkpoint} ({count})"
        ax.plot(positions, mean, color=color, marker="o", label=label)
        return mean.shape[0]

    checkpoints = list(dict.fromkeys(checkpoint_of(ds) for ds in datasets))
    several = any(count > 1 for count in _prompts_per_checkpoint(datasets).values())
    what = "Checkpoints" if len(checkpoints) > 1 else f"Checkpoint {checkpoints[0]}"
    what += ", mean over prompts" if several else ""
    return _checkpoint_series_figure(
        datasets,
        heads,
        draw_mean,
        measure=measure,
        frame_axis=frame_axis,
        title=_compare_heading(what, datasets, step, titles),
    )


def _prompts_per_checkpoint(datasets: Sequence[xr.Dataset]) -> dict[str, int]:
    """How many prompts each checkpoint's datasets hold, in order of appearance."""
    prompts: dict[str, set[str]] = {}
    for ds in datasets:
        prompts.setdefault(checkpoint_of(ds), set()).add(prompt_of(ds))
    return {checkpoint: len(names) for checkpoint, names in prompts.items()}


@styled
def plot_prompts(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
    step: int = 0,
    titles: bool = True,
) -> Figure:
    """For each head, two panels: above, per checkpoint the last-block profile averaged over its
    prompts; below, on its own scale, each prompt's profile minus that mean (thin lines) and
    their min-max band, so that the spread across prompts shows however small it is beside the
    profile. A checkpoint with one prompt has no spread: its one line is drawn alone ('1
    prompt'); when no checkpoint has two, the lower panels are left out."""
    check_options(measure, frame_axis)
    check_compare_inputs(datasets, heads)
    checkpoints = list(dict.fromkeys(checkpoint_of(ds) for ds in datasets))
    colors = dict(zip(checkpoints, series_colors(len(checkpoints)), strict=True))
    several = any(count > 1 for count in _prompts_per_checkpoint(datasets).values())
    ncols = min(len(heads), 3)
    head_rows = math.ceil(len(heads) / ncols)
    panels_per_head = 2 if several else 1
    fig = Figure(
        figsize=(FULL_WIDTH_IN, (1.9 if several else 2.3) * panels_per_head * head_rows + 0.5),
        layout="constrained",
    )
    grid = fig.subplots(panels_per_head * head_rows, ncols, squeeze=False, sharex="col")
    for index in range(len(heads), head_rows * ncols):  # unused cells of the last row
        for row in range(panels_per_head):
            grid[panels_per_head * (index // ncols) + row, index % ncols].remove()
    for index, (layer, head) in enumerate(heads):
        row, column = divmod(index, ncols)
        profile_ax = grid[panels_per_head * row, column]
        spread_ax = grid[panels_per_head * row + 1, column] if several else None
        num_frames = 1
        for checkpoint, group in _runs_with_head(datasets, layer, head).items():
            per_prompt = _prompt_profiles(group, head, measure, step)
            mean = per_prompt.mean("prompt", skipna=True)
            positions = key_frame_positions(per_prompt.sizes["key_frame"], frame_axis)
            num_frames = max(num_frames, positions.shape[0])
            color = colors[checkpoint]
            label = (
                f"{checkpoint}: 1 prompt ({prompt_of(group[0])})"
                if len(group) == 1
                else f"{checkpoint}: mean of {len(group)} prompts"
            )
            profile_ax.plot(positions, mean.values, color=color, marker="o", label=label)
            if spread_ax is None or len(group) == 1:
                continue
            differences = per_prompt - mean
            for values in differences.values:
                spread_ax.plot(positions, values, color=color, linewidth=0.6, label="_prompt")
            spread_ax.fill_between(
                positions,
                differences.min("prompt", skipna=True).values,
                differences.max("prompt", skipna=True).values,
                color=color,
                alpha=0.2,
                linewidth=0,
            )
        profile_ax.set_title(head_label(layer, head))
        profile_ax.set_ylabel(PROFILE_LABELS[measure])
        bottom = profile_ax
        if spread_ax is not None:
            spread_ax.axhline(0.0, color="0.5", linewidth=0.4)
            spread_ax.set_ylabel(f"Prompt − mean ({SPREAD_UNITS[measure]})")
            profile_ax.tick_params(labelbottom=False)
            bottom = spread_ax
        format_frame_axis(bottom, num_frames, frame_axis)
        bottom.set_xlabel(KEY_AXIS_LABELS[frame_axis])
    figure_legend(fig, min(len(checkpoints), 3))
    what = (
        "Prompts: mean over prompts (upper), each prompt minus it with the min–max band (lower)"
        if several
        else "Prompts: one per checkpoint, no spread across prompts to show"
    )
    fig.suptitle(_compare_heading(what, datasets, step, titles))
    return fig


@styled
def plot_passes(
    datasets: Sequence[xr.Dataset],
    heads: Sequence[tuple[int, int]],
    *,
    measure: str = "logits",
    frame_axis: str = "latent",
) -> Figure:
    """For each head and checkpoint, one line per step (prompt mean), labelled by timestep; the
    checkpoints of a head (a row) share their y axis."""
    check_options(measure, frame_axis)
    check_compare_inputs(datasets, heads)
    checkpoints = list(dict.fromkeys(checkpoint_of(ds) for ds in datasets))
    # The steps of every panel, which may differ between layers (a token store of fewer passes,
    # `capture.token_passes`, beside a surveyed layer's every pass), in pass order.
    # Checkpoints with other schedules label a step by their own timestep.
    groups = [_runs_with_head(datasets, layer, head) for layer, head in heads]
    labels = dict.fromkeys(
        label
        for checkpoint in checkpoints
        for step, label in sorted(
            {
                pair
                for runs in groups
                if checkpoint in runs
                for pair in common_steps(runs[checkpoint])
            }
        )
    )
    colors = step_colors(list(labels))
    fig = Figure(figsize=(FULL_WIDTH_IN, 1.8 * len(heads) + 0.5), layout="constrained")
    grid = fig.subplots(len(heads), len(checkpoints), squeeze=False, sharey="row")
    for row, (layer, head), runs in zip(grid, heads, groups, strict=True):
        for ax, checkpoint in zip(row, checkpoints, strict=True):
            ax.set_title(f"{head_label(layer, head)} · {checkpoint}")
            ax.set_xlabel(KEY_AXIS_LABELS[frame_axis])
            if ax is row[0]:  # the row shares its y axis
                ax.set_ylabel(PROFILE_LABELS[measure])
            group = runs.get(checkpoint, [])
            if not group:
                ax.text(0.5, 0.5, "layer not captured", transform=ax.transAxes, ha="center")
                continue
            num_frames = 1
            for step, label in common_steps(group):
                mean = _prompt_profiles(group, head, measure, step).mean("prompt", skipna=True)
                positions = key_frame_positions(mean.sizes["key_frame"], frame_axis)
                num_frames = max(num_frames, positions.shape[0])
                ax.plot(
                    positions,
                    mean.values,
                    color=colors[label],
                    linestyle="--" if label == "cache" else "-",
                    marker="o",
                    label=label,
                )
            format_frame_axis(ax, num_frames, frame_axis)
    # One legend for all panels: a step keeps its colour in every panel.
    handles = legend_handles(fig.axes)
    fig.legend(handles.values(), handles.keys(), loc="outside right upper", title="Step")
    fig.suptitle("Denoising steps and cache pass, mean over prompts")
    return fig
