"""Figures of KV-cache policy recall (Contract 5 tables): file names, and the plotted medians,
quartiles and map cells against numpy on a synthetic recall table; the heads a median hides (a
planted sink head) drawn and named."""

from __future__ import annotations

import inspect
import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import QuadMesh
from matplotlib.text import Annotation

from sinkscope.analysis import figures, policies
from sinkscope.analysis.plots import render_figures
from sinkscope.analysis.plots.policy import (
    UNIFORM_LABEL,
    default_policy_layers,
    plot_policy_map,
    plot_policy_recall,
    plot_policy_sinks,
    spread_labels,
)
from sinkscope.analysis.plots.render import builder_of

from .figurefixtures import svg_texts
from .workflowtools import REPO, Named

BLOCK = 2  # latent frames per block
BLOCKS = 3  # query blocks 0, 1, 2: the last sees 6 frames
BUDGETS = [2, 4, 6]
SINKS = [0, 1, 2]
RECENT = 1
CAPACITY = 4  # participative prunes from the block that sees more
TIMESTEPS = [1000.0, 937.5]
PASS_KINDS = ["denoise", "denoise"]


def make_table(
    num_layers: int = 3,
    num_heads: int = 4,
    *,
    no_store: tuple[int, ...] = (2,),
    checkpoint: str = "demo",
    prompt: str = "cat",
    seed: int = 0,
) -> pd.DataFrame:
    """A recall table as `policies.write_policies` writes it (every policy, budget, S and R the
    policy module makes), with random recalls: the figures must draw exactly these numbers.
    Layers in `no_store` have no top_c rows (no attention store)."""
    rng = np.random.default_rng(seed)
    rows = []
    for layer in range(num_layers):
        for head in range(num_heads):
            for step, (timestep, kind) in enumerate(zip(TIMESTEPS, PASS_KINDS, strict=True)):
                for block in range(BLOCKS):
                    visible = BLOCK * (block + 1)
                    common = (checkpoint, prompt, layer, head, step, timestep, kind, block, visible)
                    choices = [("window", b, 0, pd.NA, pd.NA) for b in BUDGETS]
                    choices += [
                        ("sink_window", b, s, pd.NA, pd.NA) for b in BUDGETS for s in SINKS if s < b
                    ]
                    if layer not in no_store:
                        choices += [
                            ("participative", b, s, RECENT, CAPACITY)
                            for b in BUDGETS
                            for s in SINKS
                            if s + RECENT + BLOCK <= b
                        ]
                    if layer not in no_store and block > 0:
                        choices += [
                            (policy, b, pd.NA, RECENT, pd.NA)
                            for policy in ("top_c", "top_c_oracle")
                            for b in BUDGETS
                            if b >= BLOCK + RECENT
                        ]
                    for policy, budget, sink, recent, capacity in choices:
                        recall = 1.0 if budget >= visible else float(rng.uniform(0.0, 1.0))
                        rows.append((*common, policy, budget, sink, recent, capacity, recall))
    table = pd.DataFrame(rows, columns=policies.COLUMNS)
    for column in policies.OPTIONAL_COLUMNS:
        table[column] = table[column].astype("Int64")
    return table


def expected_values(table, step, layers, policy, budget, sink=None, recent=None) -> np.ndarray:
    """The recalls over heads (and `layers`) of the last block at `step`, by plain masks."""
    last = table["query_block"].to_numpy() == BLOCKS - 1
    mask = (
        last
        & (table["step"].to_numpy() == step)
        & np.isin(table["layer"].to_numpy(), layers)
        & (table["policy"].to_numpy() == policy)
        & (table["budget"].to_numpy() == budget)
    )
    if sink is not None:
        mask &= table["sink_frames"].fillna(-1).to_numpy() == sink
    if recent is not None:
        mask &= table["recent_frames"].fillna(-1).to_numpy() == recent
    return table["recall"].to_numpy()[mask]


def lines_by_label(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.get_lines()}


def band(ax, label: str) -> dict[float, tuple[float, float]]:
    """x -> (low, high) of the interquartile band of the line `label`."""
    (collection,) = [c for c in ax.collections if c.get_label() == f"_iqr: {label}"]
    vertices = np.concatenate([path.vertices for path in collection.get_paths()])
    return {
        float(x): (vertices[vertices[:, 0] == x, 1].min(), vertices[vertices[:, 0] == x, 1].max())
        for x in np.unique(vertices[:, 0])
    }


def check_quartile_line(ax, label: str, xs, groups) -> None:
    line = lines_by_label(ax)[label]
    np.testing.assert_array_equal(line.get_xdata(), np.asarray(xs, dtype=float))
    np.testing.assert_allclose(line.get_ydata(), [np.median(g) for g in groups], rtol=1e-12)
    spread = band(ax, label)
    assert sorted(spread) == [float(x) for x in xs]
    for x, values in zip(xs, groups, strict=True):
        low, high = spread[float(x)]
        np.testing.assert_allclose(
            (low, high), (np.percentile(values, 25), np.percentile(values, 75)), rtol=1e-12
        )


def data_panels(fig) -> list:
    return [ax for ax in fig.axes if ax.get_title()]


def write_table(path: Path, table: pd.DataFrame) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)
    return path


# --------------------------------------------------------------------------------------------
# the registry


def test_policy_file_names_round_trip():
    files = figures.policy_figures("out/c/p", [3, 0, 1], "svg")
    assert [f.path for f in files] == [
        "out/c/p/policy_recall.svg",
        "out/c/p/policy_sinks.svg",
        "out/c/p/policy_map.svg",
    ]
    assert [f.kind.name for f in files] == ["recall", "sinks", "map"]
    assert all(f.layers == (0, 1, 3) and f.kind.scope == "policies" for f in files)
    assert files[0].labels == {"figure": "policy recall", "layer": "L0, L1, L3"}
    assert figures.policy_figures("o", range(30), "png")[2].labels == {
        "figure": "policy map",
        "layer": "L0–L29",
    }
    for f in files:
        assert figures.parse_figure_path(f.path) == (f.kind, None, "svg")
        assert f.kind.caption == f"policy_{f.kind.name}.rst"
        assert (REPO / "report" / f.kind.caption).is_file()
        builder = builder_of(f.kind)
        assert next(iter(inspect.signature(builder).parameters)) == "table"
    assert figures.policy_figures("out/c/p", [], "svg") == []
    # No other function lists them, and the other files keep their names.
    others = [
        *figures.run_figures("o", [0, 1], [0], "svg"),
        *figures.compare_figures("o", [0], [0], "svg"),
        *figures.survey_figures("o", [0, 1], "svg"),
        *figures.survey_compare_figures("o", [0, 1], "svg"),
    ]
    assert len(others) == 9 + 3 + 7 + 2
    assert not any("policy" in f.path or f.kind.scope == "policies" for f in others)
    for f in others:
        assert figures.parse_figure_path(f.path)[0] is f.kind


@pytest.mark.parametrize(
    "name",
    [
        "recall.svg",  # a policy kind needs its prefix
        "survey_recall.svg",
        "policy_first_frame.svg",  # a survey kind must not have it
        "policy_figure4.svg",
        "layer0_policy_recall.svg",
        "layer0_recall.svg",
        "policy_.svg",
        "policy_map.jpg",
    ],
)
def test_policy_names_refused(name):
    with pytest.raises(ValueError, match=name.split(".")[0]):
        figures.parse_figure_path(f"results/figures/c/p/{name}")


def test_policy_kinds_are_checked():
    with pytest.raises(ValueError, match="policy_"):
        figures.FigureKind("policy_x", "policy.plot_x", "x.rst", "policies", "policies")
    with pytest.raises(ValueError, match="recall table"):
        figures.FigureKind("x", "policy.plot_x", "x.rst", "policies")
    with pytest.raises(ValueError, match="recall table"):
        figures.FigureKind("x", "policy.plot_x", "x.rst", "run", "policies")


# --------------------------------------------------------------------------------------------
# the plotted numbers


@pytest.mark.parametrize("step", [0, 1])
def test_recall_lines_are_medians_and_quartiles_over_heads(step):
    table = make_table()
    fig = plot_policy_recall(table, step=step)
    axes = data_panels(fig)
    assert [ax.get_title() for ax in axes] == [
        "Layer 0",
        "Layer 1",
        "Layer 2",
        "All 3 layers, heads pooled",
    ]
    assert f"step {step} · t={TIMESTEPS[step]:g}" in fig.get_suptitle()
    assert "query block 2, V = 6 visible frames" in fig.get_suptitle()
    for ax, layers in zip(axes, [[0], [1], [2], [0, 1, 2]], strict=True):
        labels = set(lines_by_label(ax))
        # S = 0 of sink_window is the window: drawn once.
        series = [("window", {"sink": 0}, "window (S = 0)", BUDGETS)]
        series += [
            ("sink_window", {"sink": s}, f"sinks + window, S = {s}", [b for b in BUDGETS if s < b])
            for s in (1, 2)
        ]
        store = [layer for layer in layers if layer != 2]
        if store:
            series += [
                (policy, {"recent": RECENT}, f"{name}, R = {RECENT}", [4, 6])
                for policy, name in (("top_c", "top-C causal"), ("top_c_oracle", "top-C oracle"))
            ]
        else:
            assert not any(label.startswith("top-C") for label in labels)
        for policy, which, label, budgets in series:
            groups = [
                expected_values(
                    table, step, store if "recent" in which else layers, policy, b, **which
                )
                for b in budgets
            ]
            assert all(len(g) == 4 * len(store if "recent" in which else layers) for g in groups)
            check_quartile_line(ax, label, budgets, groups)
        uniform = lines_by_label(ax)[UNIFORM_LABEL]
        np.testing.assert_allclose(uniform.get_ydata(), [0.0, 1.0])


def test_recall_panels_at_thirty_layers():
    assert default_policy_layers(range(30)) == [0, 6, 12, 17, 23, 29]
    assert default_policy_layers([5, 1, 3]) == [1, 3, 5]
    table = make_table(30, 12, no_store=())
    fig = plot_policy_recall(table)
    titles = [ax.get_title() for ax in data_panels(fig)]
    assert titles == [f"Layer {n}" for n in (0, 6, 12, 17, 23, 29)] + [
        "All 30 layers, heads pooled"
    ]
    pooled = data_panels(fig)[-1]
    groups = [expected_values(table, 0, range(30), "window", b, sink=0) for b in BUDGETS]
    check_quartile_line(pooled, "window (S = 0)", BUDGETS, groups)
    chosen = plot_policy_recall(table, layers=[29, 4])
    assert [ax.get_title() for ax in data_panels(chosen)][:2] == ["Layer 4", "Layer 29"]


@pytest.mark.parametrize("budget", [None, 2, 6])
def test_sink_sweep_is_window_then_each_sink(budget):
    table = make_table()
    fig = plot_policy_sinks(table, step=1, budget=budget)
    shown = 4 if budget is None else budget  # default: the middle budget below V = 6
    assert f"at budget B = {shown}" in fig.get_suptitle()
    sinks = [0, *[s for s in SINKS if 0 < s < shown]]
    for ax, layers in zip(data_panels(fig), [[0], [1], [2], [0, 1, 2]], strict=True):
        label = f"sinks + window (S = 0: window), B = {shown}"
        groups = [
            expected_values(table, 1, layers, "window" if s == 0 else "sink_window", shown, sink=s)
            for s in sinks
        ]
        check_quartile_line(ax, label, sinks, groups)
        assert next(t.get_text() for t in ax.get_xticklabels()) == "0\nwindow"
        references = {
            label: line for label, line in lines_by_label(ax).items() if label.startswith("top-C")
        }
        store = [layer for layer in layers if layer != 2]
        if store and shown >= BLOCK + RECENT:
            for policy, name in (("top_c", "top-C causal"), ("top_c_oracle", "top-C oracle")):
                line = references[f"{name}, R = {RECENT}, median"]
                values = expected_values(table, 1, store, policy, shown, recent=RECENT)
                np.testing.assert_allclose(line.get_ydata(), np.median(values), rtol=1e-12)
        else:
            assert references == {}
        uniform = lines_by_label(ax)[UNIFORM_LABEL]
        np.testing.assert_allclose(uniform.get_ydata(), shown / 6)


PLANTED = (0, 1)  # layer, head
PLANTED_SWEEP = {0: 0.0, 1: 0.7, 2: 0.95}  # its recall against S at budget 4: the window loses it


def planted_table() -> pd.DataFrame:
    """`make_table` with the last block at step 0 made plain: every head keeps 0.4 + 0.01 x head
    under every policy below the visible frames, but L0H1, a sink head: under the window (and
    S = 0) nothing, under the sink window at budget 4 the recall of PLANTED_SWEEP."""
    table = make_table()
    last = (table["query_block"] == BLOCKS - 1) & (table["step"] == 0) & (table["budget"] < 6)
    table.loc[last, "recall"] = 0.4 + 0.01 * table.loc[last, "head"]
    planted = last & (table["layer"] == PLANTED[0]) & (table["head"] == PLANTED[1])
    window = planted & (table["policy"] == "window")
    table.loc[window, "recall"] = 0.0
    for sink, recall in PLANTED_SWEEP.items():
        chosen = planted & (table["policy"] == "sink_window") & (table["budget"] == 4)
        chosen &= table["sink_frames"].fillna(-1) == sink
        table.loc[chosen, "recall"] = recall
    return table


def named(ax) -> list[Annotation]:
    return [text for text in ax.texts if isinstance(text, Annotation) and "L" in text.get_text()]


def test_sink_sweep_draws_every_head_and_names_the_planted_one():
    """The median over heads stays flat while one head goes from 0 to 0.95 (the demo's L0H0:
    "sinks do not help"): every head is drawn, and the planted head in colour with its gain."""
    table = planted_table()
    fig = plot_policy_sinks(table, budget=4)
    gain = PLANTED_SWEEP[2] - PLANTED_SWEEP[0]
    panels = data_panels(fig)
    for ax, layers in zip(panels, [[0], [1], [2], [0, 1, 2]], strict=True):
        median = lines_by_label(ax)["sinks + window (S = 0: window), B = 4"].get_ydata()
        assert abs(median[-1] - median[0]) < 0.02  # the summary hides it
        (each,) = [c for c in ax.collections if c.get_label() == "_each head"]
        curves = sorted(tuple(segment[:, 1]) for segment in each.get_segments())
        expected = [
            tuple(
                expected_values(table[table["head"] == head], 0, [layer], policy, 4, sink=sink)[0]
                for policy, sink in (("window", 0), ("sink_window", 1), ("sink_window", 2))
            )
            for layer in layers
            for head in range(4)
        ]
        np.testing.assert_allclose(curves, sorted(expected), rtol=1e-12)
        drawn = [line for line in ax.lines if line.get_label().startswith("_named")]
        if PLANTED[0] in layers:
            (line,) = drawn  # no other head changes by 0.05
            assert line.get_label() == "_named L0H1"
            np.testing.assert_array_equal(line.get_xdata(), [0.0, 1.0, 2.0])
            assert line.get_ydata()[-1] - line.get_ydata()[0] == pytest.approx(gain)
            (name,) = named(ax)
            assert name.get_text() == f"L0H1 +{gain:.2f}"
            assert name.xy == pytest.approx((2.0, PLANTED_SWEEP[2]))
        else:
            assert drawn == [] and named(ax) == []
    assert any(label.startswith("each head; named") for label in legend_texts(fig))


def legend_texts(fig) -> list[str]:
    return [text.get_text() for legend in fig.legends for text in legend.get_texts()]


def test_recall_draws_each_policys_worst_head_and_names_the_planted_one():
    """The median and quartiles of the window hide a head it loses entirely: a thin line per
    policy is the head it keeps least of at each budget, and the head furthest below its
    policy's median is named."""
    table = planted_table()
    fig = plot_policy_recall(table)
    layer0, _, layer2, pooled = data_panels(fig)
    for ax, layers in ((layer0, [0]), (pooled, [0, 1, 2])):
        worst = lines_by_label(ax)["_worst: window (S = 0)"]
        least = [expected_values(table, 0, layers, "window", b, sink=0).min() for b in BUDGETS]
        np.testing.assert_array_equal(worst.get_xdata(), BUDGETS)
        np.testing.assert_allclose(worst.get_ydata(), least, rtol=1e-12)
        assert list(worst.get_ydata()[:2]) == [0.0, 0.0]  # the planted head, lost
        (name,) = named(ax)
        assert name.get_text() == "L0H1" and name.xy == pytest.approx((2.0, 0.0))
    assert named(layer2) == []  # no head there 0.05 below its policy's median
    assert any(
        label.startswith("thin: the head a policy keeps least of") for label in legend_texts(fig)
    )


@pytest.mark.parametrize(
    ("wanted", "gap"),
    [([0.95, 0.93, 0.5], 0.075), ([0.1, 0.1, 0.1], 0.1), ([0.4], 0.075), ([0.2, 0.9, 0.21], 0.05)],
)
def test_end_labels_keep_their_order_and_their_distance(wanted, gap):
    placed = spread_labels(wanted, gap)
    order = np.argsort(wanted, kind="stable")
    heights = np.asarray(placed)[order]
    assert np.all(np.diff(heights) >= gap - 1e-12)  # apart, and in the order of their lines
    # moved no more than the crowding asks: at most the gaps of the others
    assert np.max(np.abs(np.asarray(placed) - wanted)) <= gap * (len(wanted) - 1) + 1e-12


@pytest.mark.parametrize("budget", [None, 2, 4])
def test_map_cells_are_each_heads_recall(budget):
    table = make_table()
    fig = plot_policy_map(table, step=1, budget=budget)
    shown = 4 if budget is None else budget
    maps = data_panels(fig)
    largest = max(s for s in SINKS if s < shown)
    expected_titles = ["window (S = 0)", f"sinks + window, S = {largest}"]
    if shown >= BLOCK + RECENT:
        expected_titles += [f"top-C causal, R = {RECENT}", f"top-C oracle, R = {RECENT}"]
    assert [ax.get_title() for ax in maps] == expected_titles
    policy_of = {
        "window (S = 0)": ("window", {"sink": 0}),
        f"sinks + window, S = {largest}": ("sink_window", {"sink": largest}),
        f"top-C causal, R = {RECENT}": ("top_c", {"recent": RECENT}),
        f"top-C oracle, R = {RECENT}": ("top_c_oracle", {"recent": RECENT}),
    }
    for ax in maps:
        (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
        values = np.asarray(mesh.get_array()).reshape(3, 4)  # rows: layers, columns: heads
        policy, which = policy_of[ax.get_title()]
        expected = np.full((3, 4), np.nan)
        for layer in range(3):
            for head in range(4):
                one = table[table["head"] == head]
                cell = expected_values(one, 1, [layer], policy, shown, **which)
                if cell.size:
                    (expected[layer, head],) = cell
        np.testing.assert_allclose(values, expected, rtol=1e-12)
        assert ax.get_ylim() == (2.5, -0.5)  # layer 0 on top
        if policy.startswith("top_c"):
            assert np.isnan(values[2]).all()  # layer 2 has no attention store
    (colorbar,) = [ax for ax in fig.axes if ax not in maps]
    assert colorbar.get_ylim() == (0.0, 1.0)
    assert f"recall at budget B = {shown} latent frames" in fig.get_suptitle()


def test_map_reads_at_thirty_layers():
    fig = plot_policy_map(make_table(30, 12))
    (ax, *_) = data_panels(fig)
    ticks = {*ax.yaxis.get_majorticklocs(), *ax.yaxis.get_minorticklocs()}
    assert ticks == set(range(30))  # every layer has a tick
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [str(int(n)) for n in ax.yaxis.get_majorticklocs()]  # 0-based layers
    assert labels[0] == "0" and int(labels[-1]) >= 25
    assert next(t.get_text() for t in ax.get_xticklabels()) == "0"


def test_bad_policy_requests():
    table = make_table()
    with pytest.raises(ValueError, match="step 7 not in"):
        plot_policy_recall(table, step=7)
    with pytest.raises(ValueError, match="budget 5 not in"):
        plot_policy_map(table, budget=5)
    with pytest.raises(ValueError, match=r"layers \[9\] are not in"):
        plot_policy_sinks(table, layers=[0, 9])
    two = pd.concat([table, make_table(prompt="sea")])
    with pytest.raises(ValueError, match="one run"):
        plot_policy_recall(two)


# --------------------------------------------------------------------------------------------
# files


def policy_outputs(folder: Path, fmt: str = "svg") -> list[str]:
    return [f.path for f in figures.policy_figures(str(folder), [0, 1, 2], fmt)]


def test_render_policy_figures_same_data_same_bytes(tmp_path):
    csv = write_table(tmp_path / "policies" / "demo" / "cat.csv", make_table())
    written = {}
    for run in ("a", "b"):
        outputs = policy_outputs(tmp_path / run)
        paths = render_figures([], outputs, heads=[], step=1, policy_tables=[csv], policy_budget=2)
        assert [str(p) for p in paths] == outputs
        written[run] = [Path(p).read_bytes() for p in outputs]
    assert written["a"] == written["b"]
    texts = svg_texts(tmp_path / "a" / "policy_map.svg")
    assert any("recall at budget B = 2 latent frames" in t for t in texts)
    assert any("step 1 · t=937.5" in t for t in texts)
    assert any("S = 1" in t for t in texts)  # at B = 2 the largest S is 1


def test_bad_renders_fail_before_writing(tmp_path):
    csv = write_table(tmp_path / "cat.csv", make_table())
    two = write_table(tmp_path / "sea.csv", make_table(prompt="sea"))
    out = tmp_path / "figures"
    outputs = policy_outputs(out)
    requests = [
        ({"step": 9, "policy_tables": [csv]}, "step 9 not in"),
        ({"policy_tables": [csv], "policy_budget": 3}, "budget 3 not in"),
        ({"policy_tables": [csv], "policy_layers": [4]}, r"layers \[4\]"),
        ({"policy_tables": [csv, two]}, "one run"),
        ({}, "recall table"),
    ]
    for options, message in requests:
        with pytest.raises(ValueError, match=message):
            render_figures([], outputs, heads=[], **options)
    with pytest.raises(ValueError, match="no frame datasets"):
        render_figures([], [str(out / "statistics.svg")], heads=[], policy_tables=[csv])
    assert not out.exists(), "a failed request must not leave figures behind"


def test_figures_script_reads_the_policy_inputs(tmp_path):
    """scripts/figures.py as a rule runs it: input policies= (no frames), params figures= and
    policies= (whose `budget` the sink sweep and map use)."""
    csv = write_table(tmp_path / "cat.csv", make_table())
    out = tmp_path / "figures"
    outputs = policy_outputs(out)

    snakemake = SimpleNamespace(
        input=Named(policies=[str(csv)]),
        output=Named(outputs),
        log=Named([str(tmp_path / "figures.log")]),
        params=Named(
            figures={"heads": [[0, 1]], "measure": "logits", "frame_axis": "latent", "step": 1},
            policies={"budgets": BUDGETS, "sinks": SINKS, "recent_frames": RECENT, "budget": 6},
        ),
    )
    runpy.run_path(str(REPO / "scripts" / "figures.py"), init_globals={"snakemake": snakemake})
    assert sorted(p.name for p in out.iterdir()) == sorted(Path(p).name for p in outputs)
    assert any("at budget B = 6" in t for t in svg_texts(out / "policy_sinks.svg"))
    assert any("step 1 · t=937.5" in t for t in svg_texts(out / "policy_recall.svg"))
