"""The package's three worlds keep to their imports (see each subpackage's docstring): parse-time
code and analysis never load torch, and no world reaches into one it must not."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from sinkscope.analysis import figures

from .workflowtools import REPO

PACKAGE = REPO / "sinkscope"
# world -> sinkscope modules it may not import (prefixes)
FORBIDDEN = {
    "analysis": ("sinkscope.extraction", "sinkscope.wan", "sinkscope.workflow"),
    "workflow": (
        "sinkscope.extraction",
        "sinkscope.analysis.reduce",
        "sinkscope.analysis.stores",
        "sinkscope.analysis.stats",
        "sinkscope.analysis.policies",
        "sinkscope.analysis.plots",
        "sinkscope.wan.model",
        "sinkscope.wan.checkpoint",
        "sinkscope.wan.text",
        "sinkscope.wan.rope",
    ),
    "extraction": ("sinkscope.analysis",),
    "exports": ("sinkscope.workflow", "sinkscope.extraction", "sinkscope.wan"),
}


def imported_modules(path) -> set[str]:
    """Absolute names of the sinkscope modules a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return {name for name in names if name.startswith("sinkscope")}


@pytest.mark.parametrize("world", sorted(FORBIDDEN))
def test_worlds_import_only_what_they_may(world):
    offences = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted((PACKAGE / world).rglob("*.py"))
        for name in sorted(imported_modules(path))
        if name.startswith(FORBIDDEN[world])
    ]
    assert not offences


PLOTS = PACKAGE / "analysis" / "plots"
FAMILIES = ("run", "compare", "survey", "policy", "closed_loop", "video")


# A family's helper modules, `<family>_<part>.py` (its data side, a drawing part two of its
# figures share), split off so that the family module stays readable at one sitting.
HELPER_MODULES = {"survey": ("survey_data", "survey_maps"), "run": ("run_data", "run_profile")}


def test_the_plot_families_are_the_registrys():
    assert set(figures.FAMILIES) == set(FAMILIES)
    modules = {path.stem for path in PLOTS.glob("*.py")}
    helpers = {name for names in HELPER_MODULES.values() for name in names}
    assert modules == {*FAMILIES, *helpers, "common", "render", "__init__"}


def _plots_imports(path):
    return {name for name in imported_modules(path) if name.startswith("sinkscope.analysis.plots")}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_figure_family_imports_the_helpers_never_another_family(family):
    """A family module (sinkscope/analysis/plots/<family>.py) draws with the shared helpers
    (`plots.common`), its own data module if it has one, and `analysis.stats`; it never reaches
    into another family, the renderer or the package itself, so each family can be read and
    changed on its own."""
    common = "sinkscope.analysis.plots.common"
    own = {common} | {f"sinkscope.analysis.plots.{name}" for name in HELPER_MODULES.get(family, ())}
    plots = _plots_imports(PLOTS / f"{family}.py")
    assert common in plots
    assert all(any(name == m or name.startswith(f"{m}.") for m in own) for name in plots), plots


@pytest.mark.parametrize(
    ("family", "helper"), [(f, h) for f, names in HELPER_MODULES.items() for h in names]
)
def test_a_family_helper_imports_the_helpers_and_its_family_s_other_helpers(family, helper):
    """Never a family module: the family imports its helpers, not the other way round."""
    allowed = {"common", *HELPER_MODULES[family]} - {helper}
    allowed = {f"sinkscope.analysis.plots.{name}" for name in allowed}
    plots = _plots_imports(PLOTS / f"{helper}.py")
    assert all(any(name == m or name.startswith(f"{m}.") for m in allowed) for name in plots), plots


def test_the_helpers_import_no_family():
    imported = imported_modules(PLOTS / "common.py")
    assert not {name for name in imported if name.startswith("sinkscope.analysis.plots")}


def test_parse_time_and_analysis_code_load_no_torch():
    # What rules/common.smk imports must stay light: every cluster job parses the workflow again.
    parse_time = (
        "import sinkscope.workflow.checks, sinkscope.workflow.params, "
        "sinkscope.workflow.resources, sinkscope.analysis.figures, sinkscope.wan.spec; "
        "import sys; heavy = {'torch', 'matplotlib', 'xarray', 'zarr', 'pandas'}; "
        "assert not heavy & set(sys.modules), heavy & set(sys.modules)"
    )
    # dask (0.2 s) is the reductions' alone: the jobs that only open stores do without it.
    analysis = (
        "import sinkscope.analysis.plots, sinkscope.analysis.stats; "
        "import sinkscope.analysis.diagnostics, sinkscope.analysis.switches; "
        "import sys; assert 'dask' not in sys.modules, 'dask'; "
        "import sinkscope.analysis.reduce; assert 'torch' not in sys.modules"
    )
    for code in (parse_time, analysis):
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_every_module_can_be_read_at_one_sitting():
    """No module of the package over 900 lines, none of the plots package over 700: a module that
    grows past that mixes concepts and wants splitting along them (as plots/ and workflow/ are)."""
    too_long = {
        str(path.relative_to(REPO)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > (700 if path.parent == PLOTS else 900)
    }
    assert not too_long
