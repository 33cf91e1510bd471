"""The attention explorer's folder: `index.html` (the page: plotly.js, the app and the index
inline), `data/**.js` (one file per surveyed layer and per closed-loop run, loaded when the page
first shows it: a `<script>` works from the file system where `fetch` does not) and `videos/`
(the decoded rollouts, linked). Written to a temporary folder and renamed: no half page."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import matplotlib
import numpy as np

from sinkscope.analysis import stats
from sinkscope.analysis.plots.common import (
    KEY_AXIS_LABELS,
    MAP_LOG_DECADES,
    PROBABILITY_CMAP,
    PROFILE_LABELS,
    QUERY_AXIS_LABELS,
    UNSEEN_COLOR,
)
from sinkscope.analysis.plots.survey import (
    ENTROPY_LABEL,
    FIRST_FRAME_LABEL,
    MULTIPLE_LABEL,
    TOKEN_MULTIPLE_LABEL,
)
from sinkscope.analysis.plots.survey_maps import MULTIPLE_CMAP
from sinkscope.analysis.plots.video import EVICTED_COLOR, SSIM_LABEL
from sinkscope.storage import atomic_path

from .data import Chunk, closed_loop_runs, surveyed_runs

LOG = logging.getLogger(__name__)
VERSION = 1
COLOURS = 33  # samples of a matplotlib colour map in a plotly colour scale


def colour_scale(name: str) -> list[list]:
    """A matplotlib colour map as a plotly colour scale: the same colours as the figures."""
    cmap = matplotlib.colormaps[name]
    return [
        [round(float(x), 4), matplotlib.colors.to_hex(cmap(float(x)))]
        for x in np.linspace(0.0, 1.0, COLOURS)
    ]


def page_settings(sink_threshold: float, recent_threshold: float) -> dict:
    """Labels, colour scales and the sink definition: the figures' own (one source for both)."""
    return {
        "labels": {
            "query_frame": QUERY_AXIS_LABELS["latent"],
            "key_frame": KEY_AXIS_LABELS["latent"],
            "layer": "Layer (0-based)",
            "head": "Head",
            "prob_mass": "Probability mass",
            "profile": PROFILE_LABELS["probabilities"],
            "first_frame": FIRST_FRAME_LABEL,
            "multiple": MULTIPLE_LABEL,
            "token_multiple": TOKEN_MULTIPLE_LABEL,
            "entropy": ENTROPY_LABEL,
            "ssim": SSIM_LABEL,
        },
        "scales": {
            "probability": colour_scale(PROBABILITY_CMAP),
            "multiple": colour_scale(MULTIPLE_CMAP),
            "unseen": matplotlib.colors.to_hex(UNSEEN_COLOR),
            "map_log_decades": MAP_LOG_DECADES,
        },
        "evicted_color": EVICTED_COLOR,
        "sink_threshold": float(sink_threshold),
        "recent_threshold": float(recent_threshold),
        "sink_definition": stats.sink_definition(sink_threshold),
    }


def _json(value) -> str:
    """JSON safe inside a <script> element."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/")


def plotly_js() -> str:
    """plotly.js as the plotly package ships it (`plotly.offline.get_plotlyjs`): no CDN."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _static(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _link(source: Path, target: Path) -> None:
    """A hard link where the file system allows one (no second copy of a video), else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def write_explorer(
    output: str | os.PathLike,
    *,
    frames: Sequence[str | os.PathLike],
    attention: Sequence[str | os.PathLike] = (),
    deviation: Sequence[str | os.PathLike] = (),
    blocks: str | os.PathLike | None = None,
    metrics: Sequence[str | os.PathLike] = (),
    slots: Sequence[str | os.PathLike] = (),
    videos: Sequence[str | os.PathLike] = (),
    sink_threshold: float = stats.SINK_THRESHOLD,
    recent_threshold: float = stats.RECENT_THRESHOLD,
    title: str = "sinkscope attention explorer",
) -> Path:
    """Write the explorer folder `output` (index.html, data/, videos/) from the DAG's files."""
    output = Path(output)
    runs, chunks = surveyed_runs(
        frames, attention, sink_threshold=sink_threshold, recent_threshold=recent_threshold
    )
    loops, loop_chunks, links = closed_loop_runs(
        deviation, blocks_path=blocks, metrics_paths=metrics, slot_paths=slots, video_paths=videos
    )
    index = {
        "version": VERSION,
        "title": title,
        "settings": page_settings(sink_threshold, recent_threshold),
        "runs": runs,
        "closed_loops": loops,
    }
    with atomic_path(output) as temporary:
        (temporary / "data").mkdir(parents=True)
        for chunk in [*chunks, *loop_chunks]:
            _write_chunk(temporary, chunk)
        for page_path, source in links.items():
            _link(source, temporary / page_path)
        parts = {
            "STYLE": _static("explorer.css"),
            "PLOTLY": plotly_js(),
            "INDEX": _json(index),
            "APP": _static("explorer.js"),
        }
        # one pass over the template: nothing is looked for inside what is put in
        html = re.sub(
            r"/\*(STYLE|PLOTLY|INDEX|APP)\*/", lambda m: parts[m[1]], _static("index.html")
        )
        (temporary / "index.html").write_text(html, encoding="utf-8")
        size = folder_bytes(temporary)
    LOG.info(
        "%s: %d surveyed run(s), %d closed loop(s), %d data files, %.1f MB (plotly.js %.1f MB; "
        "%d videos linked)",
        output / "index.html",
        len(runs),
        len(loops),
        len(chunks) + len(loop_chunks),
        size / 1e6,
        len(parts["PLOTLY"]) / 1e6,
        len(links),
    )
    return output


def _write_chunk(folder: Path, chunk: Chunk) -> None:
    path = folder / "data" / f"{chunk.name}.js"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"sinkscopeExplorer.loaded({_json(chunk.name)},{_json(chunk.payload)});\n",
        encoding="utf-8",
    )


def folder_bytes(folder: str | os.PathLike, *, videos: bool = False) -> int:
    """Bytes of the explorer folder (its videos only with `videos`: they are links)."""
    total = 0
    for path in Path(folder).rglob("*"):
        if path.is_file() and (videos or "videos" not in path.relative_to(folder).parts):
            total += path.stat().st_size
    return total
