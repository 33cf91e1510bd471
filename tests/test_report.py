"""The Snakemake HTML report of the demo: every figure with its caption, and the summary table.

Snakemake 9's HTML report is one file: the results are a JSON object in a `<script>` element
(`var results = {...}`), each with its labels, its caption (HTML rendered from the .rst) and the
file itself as a base64 `data:` URI; `var categories` maps category -> subcategory -> paths. The
tests decode those objects instead of matching markup.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sinkscope.analysis import figures
from sinkscope.workflow.entries import survey_layers

from .test_config import checked
from .workflowtools import REPO, demo_copy, snakemake

# Runs Snakemake in a subprocess: `pytest -m "not workflow"` leaves it out.
pytestmark = pytest.mark.workflow

CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())
FORMAT = CONFIG["figures"]["format"]
LAYERS = sorted(CONFIG["layers"])
HEAD_LAYERS = sorted({layer for layer, _ in CONFIG["figures"]["heads"]})
# Per-layer figures: the token layers and those of figures.heads.
FIGURE_LAYERS = sorted({*LAYERS, *HEAD_LAYERS})
RUNS = [tuple(run) for run in CONFIG["figures"]["runs"]]  # the runs with their own figures
VIDEO_RUNS = [tuple(run) for run in CONFIG["closed_loop"]["runs"]]  # decoded: videos closed_loop
SURVEY_LAYERS = survey_layers(checked())  # `all`: every layer of the demo model


def expected_figures() -> dict[str, tuple[str, str, dict[str, str]]]:
    """path -> (subcategory, caption file stem, labels) for every figure of the demo, from the
    registry (whose names and labels tests/test_figures.py checks by hand)."""
    expected = {}
    for checkpoint, prompt in RUNS:
        folder = f"results/figures/{checkpoint}/{prompt}"
        run = [
            *figures.run_figures(folder, FIGURE_LAYERS, HEAD_LAYERS, FORMAT),
            *figures.policy_figures(folder, sorted({*LAYERS, *SURVEY_LAYERS}), FORMAT),
            *figures.survey_figures(folder, SURVEY_LAYERS, FORMAT),
        ]
        for figure in run:
            caption = figure.kind.caption.removesuffix(".rst")
            expected[figure.path] = (f"{checkpoint} / {prompt}", caption, figure.labels)
    compare = [
        *figures.compare_figures("results/figures/compare", LAYERS, HEAD_LAYERS, FORMAT),
        *figures.survey_compare_figures("results/figures/compare", SURVEY_LAYERS, FORMAT),
    ]
    for figure in compare:
        caption = figure.kind.caption.removesuffix(".rst")
        expected[figure.path] = ("across checkpoints and prompts", caption, figure.labels)
    for figure in figures.closed_loop_figures("results/figures/compare", FORMAT):
        caption = figure.kind.caption.removesuffix(".rst")
        expected[figure.path] = ("closed loop", caption, figure.labels)
    for checkpoint, prompt in VIDEO_RUNS:
        folder = f"results/figures/{checkpoint}/{prompt}"
        for figure in figures.video_figures(folder, FORMAT):
            caption = figure.kind.caption.removesuffix(".rst")
            expected[figure.path] = (f"{checkpoint} / {prompt}", caption, figure.labels)
    return expected


def embedded(page: str, name: str):
    """The JSON value that a `<script>` of the report assigns to the JavaScript variable `name`."""
    match = re.search(rf"<script id=\"[\w-]+\">\s*var {name} = ", page)
    assert match, f"no `var {name}` in the report"
    value, _ = json.JSONDecoder().raw_decode(page, match.end())
    return value


class _References(HTMLParser):
    """src / href attributes of the page's elements (script bodies are data, not elements)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in {"src", "href"} and value and not value.startswith(("data:", "#")):
                self.found.append(f"<{tag} {name}={value}>")


def references(page: str) -> list[str]:
    parser = _References()
    parser.feed(page)
    parser.close()
    return parser.found


def decode_data_uri(uri: str) -> bytes:
    header, _, payload = uri.partition(",")
    assert header.startswith("data:") and header.endswith(";base64"), header[:80]
    return base64.b64decode(payload)


def plain_text(markup: str) -> str:
    """Text of rendered HTML (or of a line of .rst), whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup)).split())


def first_line(caption: str) -> str:
    """The first line of a caption file: by convention one plain sentence (no markup)."""
    return (REPO / "report" / f"{caption}.rst").read_text().splitlines()[0]


@pytest.fixture(scope="module")
def demo_report(demo_run, tmp_path_factory) -> tuple[Path, str]:
    workdir = demo_copy(demo_run, tmp_path_factory.mktemp("report"))
    snakemake(workdir, "--report", "report.html")
    return workdir, (workdir / "report.html").read_text()


def test_report_is_self_contained(demo_report):
    workdir, page = demo_report
    results = embedded(page, "results")
    assert results
    for path, entry in results.items():
        # Each result travels inside the report, byte for byte.
        assert decode_data_uri(entry["data_uri"]) == (workdir / path).read_bytes(), path
    # Nothing is loaded from elsewhere: no element of the page refers to a file (script, style,
    # image, link); the only references are the data: URIs the scripts build from `results`.
    assert references(page) == []
    assert not re.search(r"\b(?:src|href)\s*=\s*[\"']?(?:\./)?results/", page)


def test_report_holds_every_figure_with_its_caption_and_labels(demo_report):
    _, page = demo_report
    results = embedded(page, "results")
    categories = embedded(page, "categories")
    expected = expected_figures()
    # figure4, 3 per token or heads layer, layer_comparison, statistics, 3 policy and 7 survey
    # figures per run; 3 across runs, the surveys' sink rates of every run and their heads across
    # checkpoints, 4 of the closed loop; 2 video figures per decoded closed-loop run.
    per_run = 1 + 3 * len(FIGURE_LAYERS) + 2 + 3 + 7
    assert len(expected) == len(RUNS) * per_run + 3 + 2 + 4 + 2 * len(VIDEO_RUNS) == 30
    images = {path for path, entry in results.items() if entry["mime_type"].startswith("image/")}
    assert images == set(expected)
    for path, (subcategory, caption, labels) in expected.items():
        entry = results[path]
        assert path in categories["Figures"][subcategory], path
        assert entry["labels"] == labels, path
        text = plain_text(entry["caption"])
        assert plain_text(first_line(caption)) in text, (path, caption)
        assert "System Message" not in text, (path, text)
    # Captions are rendered with the configuration: the chosen heads, 0-based.
    heads = ", ".join(f"L{layer}H{head}" for layer, head in CONFIG["figures"]["heads"])
    for checkpoint, prompt in RUNS:
        caption = results[f"results/figures/{checkpoint}/{prompt}/figure4.{FORMAT}"]["caption"]
        assert f"Heads: {heads}" in plain_text(caption)
    # Every labelled row of a subcategory is distinct, so the report lists each figure once.
    for subcategory, paths in categories["Figures"].items():
        rows = {tuple(results[path]["labels"].values()) for path in paths}
        assert len(rows) == len(paths), subcategory


def test_report_holds_the_summary_table(demo_report):
    workdir, page = demo_report
    results = embedded(page, "results")
    categories = embedded(page, "categories")
    path = "results/stats/summary.csv"
    tables = {path, "results/stats/summary.html", "results/stats/sink_rate.csv"}
    assert set(categories["Sink statistics"]["all runs"]) == tables
    # The across-prompt means, shown inline as an HTML table.
    html = decode_data_uri(results["results/stats/summary.html"]["data_uri"]).decode()
    assert "<table" in html and all(name in html for name in CONFIG["checkpoints"])
    rates = pd.read_csv(
        io.BytesIO(decode_data_uri(results["results/stats/sink_rate.csv"]["data_uri"]))
    )
    assert (
        set(rates["checkpoint"]) == set(CONFIG["checkpoints"])
        and rates["sink_rate"].between(0, 1).all()
    )
    policies = "results/policies/summary.csv"
    assert set(categories["KV-cache policies"]["all runs"]) == {policies}
    closed = "results/closed_loop/summary.csv"
    blocks = "results/closed_loop/blocks.csv"
    switches = "results/closed_loop/switches.csv"
    assert set(categories["KV-cache policies"]["closed loop"]) == {closed, blocks, switches}
    assert plain_text(first_line("closed_loop_switches_table")) in plain_text(
        results[switches]["caption"]
    )
    assert plain_text(first_line("closed_loop_blocks")) in plain_text(results[blocks]["caption"])
    diagnostics = pd.read_csv(io.BytesIO(decode_data_uri(results[blocks]["data_uri"])))
    assert set(diagnostics["policy"]) == {"full", *CONFIG["closed_loop"]["policies"]}
    deviation = pd.read_csv(io.BytesIO(decode_data_uri(results[closed]["data_uri"])))
    assert set(deviation["policy"]) == set(CONFIG["closed_loop"]["policies"])
    assert plain_text(first_line("closed_loop_summary")) in plain_text(results[closed]["caption"])
    recall = pd.read_csv(io.BytesIO(decode_data_uri(results[policies]["data_uri"])))
    assert set(recall["policy"]) == {
        "window",
        "sink_window",
        "participative",
        "top_c",
        "top_c_oracle",
    }
    entry = results[path]
    assert entry["labels"] == {"table": "summary (csv)"}
    table = pd.read_csv(io.BytesIO(decode_data_uri(entry["data_uri"])))
    pd.testing.assert_frame_equal(table, pd.read_csv(workdir / path))
    assert set(table["checkpoint"]) == set(CONFIG["checkpoints"])
    assert "prob_mass" in set(table["measure"])
    assert {"run", "mean", "std", "count"} <= set(table["aggregate"])
    assert plain_text(first_line("summary")) in plain_text(entry["caption"])


def test_report_plays_the_grid_videos_and_holds_the_video_tables(demo_report):
    workdir, page = demo_report
    results = embedded(page, "results")
    categories = embedded(page, "categories")
    tables = {"results/videos/metrics.csv", "results/videos/drift.csv"}
    assert tables <= {path for paths in categories["Videos"].values() for path in paths}
    for checkpoint, prompt in VIDEO_RUNS:
        page_path = f"results/videos/{checkpoint}/{prompt}/grid.html"
        assert page_path in categories["Videos"][f"{checkpoint} / {prompt}"]
        entry = results[page_path]
        assert entry["mime_type"] == "text/html"
        # The page carries the grid video itself, byte for byte, in a <video> element.
        grid_page = decode_data_uri(entry["data_uri"]).decode()
        match = re.search(r"<video[^>]* src='data:video/mp4;base64,([^']+)'", grid_page)
        assert match, grid_page[:500]
        grid = workdir / f"results/videos/{checkpoint}/{prompt}/grid.mp4"
        assert base64.b64decode(match.group(1)) == grid.read_bytes()
        assert plain_text(first_line("video_grid")) in plain_text(entry["caption"])
    metrics = pd.read_csv(
        io.BytesIO(decode_data_uri(results["results/videos/metrics.csv"]["data_uri"]))
    )
    rollouts = {"full", *CONFIG["closed_loop"]["policies"]}
    assert set(metrics["rollout"]) == rollouts
    drift = pd.read_csv(
        io.BytesIO(decode_data_uri(results["results/videos/drift.csv"]["data_uri"]))
    )
    assert set(drift["rollout"]) == rollouts and drift["flicker_score"].between(0, 1).all()


def test_report_describes_the_workflow(demo_report):
    _, page = demo_report
    description = plain_text(embedded(page, "workflow_desc"))
    assert plain_text(first_line("workflow")) in description
    assert f"checkpoints {', '.join(CONFIG['checkpoints'])}" in description
    assert "System Message" not in description
    # the explorer, a folder a one-file report cannot hold, is linked from the working directory
    assert 'href="results/explorer/index.html"' in embedded(page, "workflow_desc")


def test_every_caption_file_is_used():
    captions = {path.stem for path in (REPO / "report").glob("*.rst")}
    used = {caption for _, caption, _ in expected_figures().values()}
    tables = {
        "summary",
        "sink_rate",
        "policy_summary",
        "closed_loop_summary",
        "closed_loop_blocks",
        "closed_loop_switches_table",
        "video_metrics",
        "video_drift",
        "video_grid",
        "workflow",
    }
    # Kinds the demo does not draw: a spread across closed-loop runs needs two (it has one).
    across_runs = {Path(kind.caption).stem for kind in figures.FIGURES.values() if kind.runs > 1}
    assert across_runs == {"closed_loop_deviation_runs"}
    assert captions == used | tables | across_runs
