"""The key-frame profile of one head, as Fig. 4 and the heads grid draw it: bars of the
query-averaged measure per key frame (coloured by key version on rolling runs), its line and
annotated extremes, the query block's own key frames shaded, the uniform share on probability
panels, and their legend entries."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib
import numpy as np
import xarray as xr
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import ScaledTranslation

from sinkscope.schedules import KEY_VERSION, NOISY_VERSION

from .common import (
    format_frame_axis,
    frame_edges,
    key_frame_positions,
    noisy_steps,
    row_major,
    version_label,
)
from .run_data import (
    ANNOTATIONS,
    format_value,
    frame_name,
    span,
    uniform_share,
)

UNIFORM_LABEL = "uniform share of a visible key frame (1 / V)"
UNIFORM_COLOR = "0.35"
QUERY_BLOCK_COLOR = "0.9"  # the band over the query block's own key frames (figure4, heads grid)
BAR_COLOR = "#9ecae1"
LINE_COLOR = "#08519c"
# Key versions (rolling runs): the anchor's bars orange, noisy copies' purple and hatched,
# darker the noisier; on the maps the anchor's cells outlined, the noisy ones hatched.
ANCHOR_COLOR = "#fdae6b"
ANCHOR_EDGE_COLOR = "#d94801"
NOISY_CMAP = "Purples"
NOISY_SHADES = (0.75, 0.3)  # where on NOISY_CMAP the first and the last step lie
NOISY_HATCH = "////"
LEGEND_COLUMNS = 4  # at most, in the legend of figure4


def draw_profile(
    ax: Axes,
    values: np.ndarray,
    frame_axis: str,
    *,
    annotate: Sequence[str] = (),
    block: Sequence[int] = (),
    versions: np.ndarray | None = None,
    num_steps: int = 0,
    uniform: bool = False,
) -> None:
    """Bars and line of one profile over key frames, optionally with its maximum and minimum
    annotated (`annotate`: 'max', 'min'), the key frames `block` (latent) shaded and each bar
    styled by the version of its key frame (`versions`, codes; `num_steps` denoising steps).
    With `uniform` (a profile of probabilities) a dotted line marks the uniform share of a
    visible key frame, 1 / V (`uniform_share`), and the maximum's label gives its value in
    multiples of it."""
    num_frames = values.shape[0]
    edges = frame_edges(num_frames, frame_axis)
    positions = key_frame_positions(num_frames, frame_axis)
    if len(block):
        shade_block(ax, edges, block)
    bars = ax.bar(positions, values, width=0.8 * np.diff(edges), color=BAR_COLOR, linewidth=0)
    if versions is not None:
        for bar, code in zip(bars, versions, strict=True):
            bar.set(**bar_style(int(code), num_steps))
    ax.plot(positions, values, color=LINE_COLOR, marker="o")
    ax.axhline(0.0, color="0.5", linewidth=0.4)
    share = uniform_share(values) if uniform else math.nan
    if np.isfinite(share):
        ax.axhline(
            share,
            color=UNIFORM_COLOR,
            linewidth=0.7,
            linestyle=(0, (1, 1.5)),
            zorder=2.5,
            label="_uniform share",
        )
    format_frame_axis(ax, num_frames, frame_axis)
    ax.margins(y=0.08)
    if not np.isfinite(values).any():
        return
    extremes = {"max": int(np.nanargmax(values)), "min": int(np.nanargmin(values))}
    if extremes["max"] == extremes["min"]:  # a flat profile: its maximum says it all
        extremes.pop("min")
    # Headroom above the bars for the maximum's label, below them for the minimum's: under the
    # bar's foot (the 0 line) or its end, whichever is lower, so that the label covers no bar.
    # The maximum's label of a probability profile has a second line: its multiple of uniform.
    low, high = ax.get_ylim()
    room = 0.22 * (high - low)
    room_above = (0.22 if np.isnan(share) else 0.4) * (high - low)
    ax.set_ylim(low - room * ("min" in annotate), high + room_above * ("max" in annotate))
    if "min" in annotate and np.nanmin(values) >= 0:
        # The headroom under 0 holds a label, not values: no ticks there.
        low, high = ax.get_ylim()
        ticks = ax.yaxis.get_major_locator().tick_values(low, high)
        ax.set_yticks([tick for tick in ticks if 0 <= tick <= high])
        ax.set_ylim(low, high)
    for what in ANNOTATIONS:
        if what not in annotate or what not in extremes:
            continue
        frame = extremes[what]
        to_left = frame > num_frames / 2  # the label leans to the side with room
        above = what == "max"
        value = float(values[frame])
        shift = ScaledTranslation(
            (-6 if to_left else 6) / 72, (7 if above else -7) / 72, ax.figure.dpi_scale_trans
        )
        anchor = versions is not None and versions[frame] == KEY_VERSION["anchor"]
        multiple = f"\n{value / share:.3g}x uniform" if above and np.isfinite(share) else ""
        label = ax.annotate(
            f"{what} {format_value(value)}, {frame_name(frame, frame_axis)}"
            + (" (anchor)" if anchor else "")
            + multiple,
            xy=(positions[frame], value),
            xytext=(positions[frame], value if above else min(value, 0.0)),
            textcoords=ax.transData + shift,
            ha="right" if to_left else "left",
            va="bottom" if above else "top",
            arrowprops={
                "arrowstyle": "-",
                "color": "0.3",
                "linewidth": 0.5,
                "shrinkA": 0,
                # from the label's corner nearest the point
                "relpos": (1.0 if to_left else 0.0, 0.0 if above else 1.0),
            },
        )
        # Made room for above and below; a label wider than a narrow panel would otherwise make
        # the layout shrink the panels to make room beside them, down to nothing.
        label.set_in_layout(False)


def bar_style(code: int, num_steps: int) -> dict:
    """How a bar shows the version `code` of its key frame: clean as always, the anchor orange,
    a noisy copy purple and hatched, darker the earlier (noisier) its step."""
    if code == KEY_VERSION["anchor"]:
        return {"facecolor": ANCHOR_COLOR, "edgecolor": ANCHOR_EDGE_COLOR, "linewidth": 0.6}
    if code >= NOISY_VERSION:
        darkest, lightest = NOISY_SHADES
        late = min((code - NOISY_VERSION) / max(num_steps - 1, 1), 1.0)
        return {
            "facecolor": matplotlib.colormaps[NOISY_CMAP](darkest + (lightest - darkest) * late),
            "edgecolor": "none",
            "hatch": NOISY_HATCH,
            "hatchcolor": "white",
            "hatch_linewidth": 0.4,
        }
    return {}


def version_handles(ds: xr.Dataset, codes: set[int]) -> tuple[list[Patch], list[Patch]]:
    """The legend entries of the version codes `codes`: (the anchor and the clean copy, the noisy
    copies by step)."""
    handles: tuple[list[Patch], list[Patch]] = ([], [])
    for code in sorted(codes, key=lambda code: (code != KEY_VERSION["anchor"], code)):
        if code < 0:
            continue
        style = {"facecolor": BAR_COLOR, "linewidth": 0, **bar_style(code, noisy_steps(ds))}
        handles[code >= NOISY_VERSION].append(Patch(**style, label=version_label(ds, code)))
    return handles


def shade_block(ax: Axes, edges: np.ndarray, block: Sequence[int]) -> None:
    """A light band behind the key frames `block` (latent frames, contiguous): the query
    block's own frames."""
    ax.axvspan(
        edges[min(block)],
        edges[max(block) + 1],
        color=QUERY_BLOCK_COLOR,
        linewidth=0,
        zorder=0,
        label="_query block",
    )


def uniform_handle() -> Line2D:
    """The legend entry of the uniform share's line (`draw_profile` with `uniform`)."""
    return Line2D(
        [], [], color=UNIFORM_COLOR, linewidth=0.7, linestyle=(0, (1, 1.5)), label=UNIFORM_LABEL
    )


def query_block_handles(
    block: Sequence[int],
    versions: tuple[Sequence[Patch], Sequence[Patch]] = ((), ()),
    extras: Sequence[Artist] = (),
) -> tuple[list[Artist], int]:
    """The legend under the panels, (handles in matplotlib's order, columns): the shaded band
    (`shade_block`), `extras` and the key versions the bars show (`version_handles`), the
    noisy copies on rows of their own."""
    label = f"the query block's own key frames (latent {span(block)})"
    copies, noisy = versions
    first = [Patch(color=QUERY_BLOCK_COLOR, label=label), *extras, *copies]
    # at most LEGEND_COLUMNS, one fewer beside an extra entry: four long labels outran the page
    ncols = min(max(len(first), len(noisy)), LEGEND_COLUMNS - bool(extras))
    if noisy:
        first += [Patch(visible=False, label="")] * (-len(first) % ncols)  # noisy: a new row
    return row_major([*first, *noisy], ncols), ncols


def query_block_legend(fig: Figure, block: Sequence[int]) -> None:
    """The legend under the panels naming the shaded band (`shade_block`)."""
    handles, ncols = query_block_handles(block)
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols)
