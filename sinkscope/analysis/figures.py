"""The figures sinkscope draws, declared once: the one index of every figure kind.

`FIGURES` maps each kind to the function that draws it (`builder`: `family.function`, a function
of the family module `sinkscope.analysis.plots.<family>`), its caption (`report/<caption>`), how
many files it makes and which layers it shows. The rules build their outputs and report labels
from it (`run_figures`, `compare_figures`, and with a whole-model survey `survey_figures`,
`survey_compare_figures`, with KV-cache policy recall tables `policy_figures`, with
closed-loop rollouts `closed_loop_figures`, and with their decoded videos `video_figures`);
the figure scripts hand their outputs to `plots.render_figures`, which asks `parse_figure_path`
what each file is and calls its builder.

Families (`FAMILIES`, one module each under `sinkscope/analysis/plots/`): `run` (one run's layer
and run figures, Fig. 4 among them), `compare` (across runs), `survey` (the whole-model survey),
`policy` (KV-cache policy recall), `closed_loop` (rollouts past the cache), `video` (one
closed-loop run's decoded rollouts beside its diagnostics). Shared drawing helpers live in
`plots/common.py`; a family module never imports another (parts of a family may live in
helper modules `plots/<family>_<part>.py`: `survey_data`, `survey_maps`, `run_data`,
`run_profile`).

Adding a figure to a family touches four files: a `plot_*` function in its family module, an
entry here, a caption in report/, a test in the family's test module
(`tests/test_<family>_figures.py`). A layer figure on a colour scale shared by the run's layers
also names its values in `plots.run.SHARED_SCALES`, a closed-loop figure its table in
`plots.closed_loop.TABLES` (both in the family module).

Scopes:
- `layer`: one file per captured layer of a (checkpoint, prompt): `layer{L}_{kind}.{fmt}`; the
  function gets that layer's frame dataset.
- `run`: one file per (checkpoint, prompt): `{kind}.{fmt}`; the function gets the datasets of the
  layers in `layers`.
- `compare`: one file across checkpoints and prompts: `compare/{kind}.{fmt}`; the function gets
  the datasets of every run of the layers in `layers`.
- `survey`: one file per (checkpoint, prompt) with a whole-model survey: `survey_{kind}.{fmt}`
  next to the run's figures (`survey_figures`); the function gets the frame datasets of every
  surveyed layer (and, where it asks for them, their attention stores, Contract 4). A run without
  a survey has none.
- `policies`: one file per (checkpoint, prompt) with a recall table of KV-cache policies
  (Contract 5, `results/policies/{checkpoint}/{prompt}.csv`): `policy_{kind}.{fmt}` next to the
  run's figures (`policy_figures`); the function gets that table (a DataFrame), not frame
  datasets.
- `closed_loop`: one file across the runs of the closed loop (Contract 6, rollouts longer than
  the cache under a KV-cache policy): `closed_loop_{kind}.{fmt}` in its folder
  (`closed_loop_figures`, e.g. results/figures/closed_loop/closed_loop_deviation.svg); the
  function gets a table (a DataFrame: the stacked frame tables, or the closed-loop summary; the
  collapse figure the block table of `analysis.diagnostics` too), not frame datasets.
- `video`: one file per closed-loop run (checkpoint, prompt) with decoded rollouts
  (`results/videos/{checkpoint}/{prompt}/{rollout}.mp4` and their `metrics.csv`):
  `video_{kind}.{fmt}` next to the run's figures (`video_figures`, e.g.
  results/figures/{checkpoint}/{prompt}/video_strip.svg; the folder names the run); the
  function gets the run's video metrics (a DataFrame), and as it asks for them its videos and
  its rows of the closed loop's frame tables and block table, not frame datasets.
`layers`: `captured` (every layer in `layers:`), `heads` (the layers of `figures.heads`),
`surveyed` (every surveyed layer), `policies` (every layer of the recall table) or `model` (no
layer picked: the closed loop changes the cache of every layer; the closed-loop and video
figures). A `compare` kind of the `surveyed` layers compares surveys:
`compare/survey_{kind}.{fmt}` (`survey_compare_figures`), not among `compare_figures`.
File names of `surveyed` kinds start with `survey_`, those of `policies` kinds with `policy_`,
those of `closed_loop` kinds with `closed_loop_`, those of `video` kinds with `video_`, and no
other kind's name does.

Layers and heads are 0-based everywhere: file names, titles, labels and CSVs (layer 0 head 0 is
L0H0; Deep Forcing's paper counts from 1, so its L1H1 and L5H10 are L0H0 and L4H9 here).

Parse-time safe: Snakemake imports this while parsing, so nothing heavy is imported.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

SCOPES = ("layer", "run", "compare", "survey", "policies", "closed_loop", "video")
LAYER_SETS = ("captured", "heads", "surveyed", "policies", "model")
SURVEY_PREFIX = "survey_"  # file names of survey figures: survey_{kind}.{fmt}
POLICY_PREFIX = "policy_"  # file names of policy recall figures: policy_{kind}.{fmt}
CLOSED_LOOP_PREFIX = "closed_loop_"  # file names of closed-loop figures: closed_loop_{kind}.{fmt}
VIDEO_PREFIX = "video_"  # file names of video figures: video_{kind}.{fmt}
MODEL_LABEL = "all"  # the `layer` label of a figure of the whole model (layers `model`)
FORMATS = ("svg", "png", "pdf")
# The figure families: one module of sinkscope.analysis.plots each.
FAMILIES = ("run", "compare", "survey", "policy", "closed_loop", "video")
# The scopes of the whole model's figures (layers `model`): the closed loop changes every layer.
MODEL_SCOPES = ("closed_loop", "video")
# The scopes whose figures draw tables (and videos), no frame dataset.
TABLE_SCOPES = ("policies", "closed_loop", "video")


@dataclass(frozen=True)
class FigureKind:
    name: str
    builder: str  # "family.function": the function in sinkscope.analysis.plots.<family>
    caption: str  # file in report/
    scope: str
    layers: str = "captured"
    # closed_loop kinds: drawn only where closed_loop.runs holds at least this many runs (a
    # spread across runs needs two)
    runs: int = 1

    def __post_init__(self):
        family, _, function = self.builder.partition(".")
        if family not in FAMILIES or not function.startswith("plot_"):
            raise ValueError(
                f"figure {self.name}: builder {self.builder!r} is not family.plot_* of a family "
                f"in {list(FAMILIES)}"
            )
        if self.scope not in SCOPES or self.layers not in LAYER_SETS:
            raise ValueError(f"figure {self.name}: bad scope {self.scope} or layers {self.layers}")
        if self.scope == "survey" and not self.surveyed:
            raise ValueError(f"figure {self.name}: survey figures show the surveyed layers")
        if self.surveyed and self.scope not in ("survey", "compare"):
            raise ValueError(f"figure {self.name}: surveyed layers need scope survey or compare")
        if (self.scope == "policies") != (self.layers == "policies"):
            raise ValueError(
                f"figure {self.name}: policy figures, and only they, show the recall table's layers"
            )
        if (self.scope in MODEL_SCOPES) != (self.layers == "model"):
            raise ValueError(
                f"figure {self.name}: closed-loop and video figures, and only they, show the "
                "whole model"
            )
        if self.runs < 1 or (self.runs > 1 and self.scope != "closed_loop"):
            raise ValueError(f"figure {self.name}: runs {self.runs} (closed-loop kinds only)")
        for prefix in (SURVEY_PREFIX, POLICY_PREFIX, CLOSED_LOOP_PREFIX, VIDEO_PREFIX):
            if self.name.startswith(prefix):
                raise ValueError(f"figure {self.name}: {prefix} is the file prefix of some kinds")

    @property
    def family(self) -> str:
        """The module of sinkscope.analysis.plots that draws this kind."""
        return self.builder.partition(".")[0]

    @property
    def function(self) -> str:
        """The function of the family module that draws this kind."""
        return self.builder.partition(".")[2]

    @property
    def surveyed(self) -> bool:
        """A figure of the whole-model survey (its file names start with `survey_`)."""
        return self.layers == "surveyed"

    @property
    def prefix(self) -> str:
        """`survey_` for a survey figure, `policy_` for a policy figure, `closed_loop_` for a
        closed-loop figure, `video_` for a video figure, else nothing."""
        if self.surveyed:
            return SURVEY_PREFIX
        prefixes = {"policies": POLICY_PREFIX, "closed_loop": CLOSED_LOOP_PREFIX}
        return (prefixes | {"video": VIDEO_PREFIX}).get(self.scope, "")

    @property
    def stem(self) -> str:
        """The file name without folder and format: `survey_{name}` for a survey figure,
        `policy_{name}` for a policy figure, `closed_loop_{name}` for a closed-loop figure,
        `video_{name}` for a video figure (a layer figure adds `layer{L}_` in front)."""
        return f"{self.prefix}{self.name}"

    @property
    def title(self) -> str:
        """The `figure` label in the report."""
        return self.stem.replace("_", " ")


FIGURES = {
    kind.name: kind
    for kind in (
        FigureKind("figure4", "run.plot_figure4", "figure4.rst", "run", "heads"),
        FigureKind("heads_grid", "run.plot_heads_grid", "heads_grid.rst", "layer"),
        FigureKind("heads_heatmap", "run.plot_heads_heatmap", "heads_heatmap.rst", "layer"),
        FigureKind("frame_maps", "run.plot_frame_maps", "frame_maps.rst", "layer"),
        FigureKind("layer_comparison", "run.plot_layer_comparison", "layer_comparison.rst", "run"),
        FigureKind("statistics", "run.plot_statistics", "statistics.rst", "run"),
        FigureKind(
            "checkpoints", "compare.plot_checkpoints", "compare_checkpoints.rst", "compare", "heads"
        ),
        FigureKind("prompts", "compare.plot_prompts", "compare_prompts.rst", "compare", "heads"),
        FigureKind("passes", "compare.plot_passes", "compare_passes.rst", "compare", "heads"),
        FigureKind(
            "first_frame",
            "survey.plot_survey_first_frame",
            "survey_first_frame.rst",
            "survey",
            "surveyed",
        ),
        FigureKind(
            "head_class",
            "survey.plot_survey_head_class",
            "survey_head_class.rst",
            "survey",
            "surveyed",
        ),
        FigureKind(
            "sink_rate",
            "survey.plot_survey_sink_rate",
            "survey_sink_rate.rst",
            "survey",
            "surveyed",
        ),
        FigureKind(
            "spatial", "survey.plot_survey_spatial", "survey_spatial.rst", "survey", "surveyed"
        ),
        FigureKind(
            "sink_by_block",
            "survey.plot_survey_sink_by_block",
            "survey_sink_by_block.rst",
            "survey",
            "surveyed",
        ),
        FigureKind(
            "entropy", "survey.plot_survey_entropy", "survey_entropy.rst", "survey", "surveyed"
        ),
        FigureKind(
            "value_norms",
            "survey.plot_survey_value_norms",
            "survey_value_norms.rst",
            "survey",
            "surveyed",
        ),
        FigureKind(
            "sink_rate_runs",
            "survey.plot_survey_sink_rate_runs",
            "survey_sink_rate_runs.rst",
            "compare",
            "surveyed",
        ),
        FigureKind(
            "sink_checkpoints",
            "survey.plot_survey_sink_checkpoints",
            "survey_sink_checkpoints.rst",
            "compare",
            "surveyed",
        ),
        FigureKind(
            "recall", "policy.plot_policy_recall", "policy_recall.rst", "policies", "policies"
        ),
        FigureKind("sinks", "policy.plot_policy_sinks", "policy_sinks.rst", "policies", "policies"),
        FigureKind("map", "policy.plot_policy_map", "policy_map.rst", "policies", "policies"),
        FigureKind(
            "deviation",
            "closed_loop.plot_closed_loop_deviation",
            "closed_loop_deviation.rst",
            "closed_loop",
            "model",
        ),
        FigureKind(
            "recall_deviation",
            "closed_loop.plot_closed_loop_recall",
            "closed_loop_recall.rst",
            "closed_loop",
            "model",
        ),
        FigureKind(
            "collapse",
            "closed_loop.plot_closed_loop_collapse",
            "closed_loop_collapse.rst",
            "closed_loop",
            "model",
        ),
        FigureKind(
            "switches",
            "closed_loop.plot_closed_loop_switches",
            "closed_loop_switches.rst",
            "closed_loop",
            "model",
        ),
        FigureKind(
            "deviation_runs",
            "closed_loop.plot_closed_loop_deviation_runs",
            "closed_loop_deviation_runs.rst",
            "closed_loop",
            "model",
            runs=2,
        ),
        FigureKind("strip", "video.plot_video_strip", "video_strip.rst", "video", "model"),
        FigureKind(
            "diagnostics", "video.plot_video_diagnostics", "video_diagnostics.rst", "video", "model"
        ),
    )
}
# The name of a file tells its kind: no two kinds may share a stem.
_BY_STEM = {kind.stem: kind for kind in FIGURES.values() if kind.scope != "layer"}
if len(_BY_STEM) != sum(kind.scope != "layer" for kind in FIGURES.values()):
    raise ValueError("two figure kinds share a file name")


def layer_label(layers: Sequence[int]) -> str:
    """The `layer` label of a figure: 'L0, L2'."""
    return ", ".join(f"L{int(layer)}" for layer in layers)


def layer_range_label(layers: Sequence[int]) -> str:
    """The `layer` label of a survey figure, runs of three or more consecutive layers joined:
    'L0–L29', 'L0–L2, L5, L7, L8'."""
    runs: list[list[int]] = []
    for layer in sorted({int(layer) for layer in layers}):
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    labels = [
        [f"L{layer}" for layer in run] if len(run) < 3 else [f"L{run[0]}–L{run[-1]}"]
        for run in runs
    ]
    return ", ".join(label for run in labels for label in run)


@dataclass(frozen=True)
class FigureFile:
    """One file a rule writes: where, which kind, and the layers it shows."""

    path: str
    kind: FigureKind
    layers: tuple[int, ...]

    @property
    def labels(self) -> dict[str, str]:
        if self.kind.layers == "model":
            return {"figure": self.kind.title, "layer": MODEL_LABEL}
        label = layer_range_label if self.kind.layers in ("surveyed", "policies") else layer_label
        return {"figure": self.kind.title, "layer": label(self.layers)}


def _shown_layers(kind: FigureKind, layers: Sequence[int], head_layers: Sequence[int]):
    return tuple(sorted(set(head_layers if kind.layers == "heads" else layers)))


def run_figures(
    folder: str, layers: Sequence[int], head_layers: Sequence[int], fmt: str
) -> list[FigureFile]:
    """Every file of one (checkpoint, prompt) in `folder`, in registry order (a layer figure once
    per captured layer). `layers`: the captured layers; `head_layers`: those of figures.heads."""
    _check_format(fmt)
    files = []
    for kind in FIGURES.values():
        if kind.scope == "layer":
            files += [
                FigureFile(f"{folder}/layer{layer}_{kind.name}.{fmt}", kind, (layer,))
                for layer in sorted(layers)
            ]
        elif kind.scope == "run":
            shown = _shown_layers(kind, layers, head_layers)
            files.append(FigureFile(f"{folder}/{kind.name}.{fmt}", kind, shown))
    return files


def compare_figures(
    folder: str, layers: Sequence[int], head_layers: Sequence[int], fmt: str
) -> list[FigureFile]:
    """Every file across checkpoints and prompts, in `folder` (e.g. results/figures/compare)."""
    _check_format(fmt)
    return [
        FigureFile(f"{folder}/{kind.name}.{fmt}", kind, _shown_layers(kind, layers, head_layers))
        for kind in FIGURES.values()
        if kind.scope == "compare" and not kind.surveyed
    ]


def survey_figures(folder: str, survey_layers: Sequence[int], fmt: str) -> list[FigureFile]:
    """Every survey file of one (checkpoint, prompt) in `folder` (the run's figure folder), in
    registry order, each showing every layer of `survey_layers`; none without surveyed layers."""
    return _layer_set_files(folder, survey_layers, fmt, lambda kind: kind.scope == "survey")


def survey_compare_figures(folder: str, survey_layers: Sequence[int], fmt: str) -> list[FigureFile]:
    """Every file comparing the surveys of several runs, in `folder` (e.g.
    results/figures/compare), showing `survey_layers`; none without surveyed layers."""
    return _layer_set_files(
        folder, survey_layers, fmt, lambda kind: kind.scope == "compare" and kind.surveyed
    )


def policy_figures(folder: str, layers: Sequence[int], fmt: str) -> list[FigureFile]:
    """Every KV-cache policy figure of one (checkpoint, prompt) in `folder` (the run's figure
    folder), in registry order, drawn from the run's recall table of `layers` (the layers it
    holds, for the labels); none without layers."""
    return _layer_set_files(folder, layers, fmt, lambda kind: kind.scope == "policies")


def closed_loop_figures(folder: str, fmt: str, runs: int = 1) -> list[FigureFile]:
    """Every closed-loop figure in `folder` (e.g. results/figures/closed_loop), in registry order:
    `{folder}/closed_loop_{kind}.{fmt}`, drawn from the frame tables of every closed-loop
    rollout, their summary and block table (Contract 6); no layers picked (label `layer`:
    all). `runs`: the runs of closed_loop.runs; a kind that needs more (`FigureKind.runs`, the
    spread across runs) is left out."""
    _check_format(fmt)
    return [
        FigureFile(f"{folder}/{kind.stem}.{fmt}", kind, ())
        for kind in FIGURES.values()
        if kind.scope == "closed_loop" and kind.runs <= runs
    ]


def video_figures(folder: str, fmt: str) -> list[FigureFile]:
    """Every video figure of one closed-loop run in `folder` (its figure folder,
    results/figures/{checkpoint}/{prompt}, or with those wildcards), in registry order:
    `{folder}/video_{kind}.{fmt}`, drawn from the run's decoded rollouts, their video metrics and
    the closed loop's tables of the run (`render_figures` reads the run from the folder's last
    two names); no layers picked (label `layer`: all)."""
    _check_format(fmt)
    return [
        FigureFile(f"{folder}/{kind.stem}.{fmt}", kind, ())
        for kind in FIGURES.values()
        if kind.scope == "video"
    ]


def _layer_set_files(folder, layers, fmt, wanted) -> list[FigureFile]:
    """One file per wanted kind, each showing every layer of `layers`; none without layers."""
    _check_format(fmt)
    shown = tuple(sorted({int(layer) for layer in layers}))
    if not shown:
        return []
    return [
        FigureFile(f"{folder}/{kind.stem}.{fmt}", kind, shown)
        for kind in FIGURES.values()
        if wanted(kind)
    ]


_LAYER_FILE = re.compile(r"^layer(\d+)_(\w+)$")


def parse_figure_path(path: str | PurePath) -> tuple[FigureKind, int | None, str]:
    """(kind, layer of a layer figure or None, format) of a file named as the registry names it."""
    path = PurePath(path)
    fmt = path.suffix.removeprefix(".")
    _check_format(fmt, path)
    match = _LAYER_FILE.match(path.stem)
    if match:
        layer = int(match.group(1))
        kind = FIGURES.get(match.group(2))
        kind = kind if kind is not None and kind.scope == "layer" else None
    else:
        layer, kind = None, _BY_STEM.get(path.stem)
    if kind is None:
        names = sorted(f"{kind.stem}" for kind in FIGURES.values())
        raise ValueError(f"{path}: not a figure file name of the registry ({names})")
    return kind, layer, fmt


def _check_format(fmt: str, path: object = None) -> None:
    if fmt not in FORMATS:
        where = f"{path}: " if path is not None else ""
        raise ValueError(f"{where}fmt must be one of {list(FORMATS)}, got {fmt!r}")
