"""The docs say what the code does: README stays a page or two and keeps the commands CI runs, the
configuration reference and the gallery are what their generator (`sinkscope.docs`) writes from
the schema, the figure registry and the captions, every figure kind has its thumbnail, every
figure name the docs use is the registry's, every file the README and the guide list is an
output of the rules (one dry run), and every link and anchor between the pages resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from sinkscope import docs
from sinkscope.analysis import figures

from .workflowtools import REPO, copy_workflow

README = REPO / "README.md"
DOCS = REPO / "docs"
GUIDE = DOCS / "GUIDE.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_LIMIT = 12_000  # bytes: a page or two
PNG_BUDGET = 1_500_000  # bytes of every PNG under docs/
THUMBNAIL_LIMIT = 80_000
README_FIGURE_LIMIT = 150_000


def test_the_readme_is_a_page_or_two_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.encode()) < README_LIMIT
    lines = text.splitlines()
    assert lines[:3] == ["# sinkscope", "", "```bash"]
    install = "python3 -m venv .venv && .venv/bin/pip install -c envs/constraints.txt torch==2.13.0"
    assert lines[3] == f"{install} -e '.[workflow]' && .venv/bin/snakemake --cores 2"
    assert lines[4] == f"{install} -e '.[test]' && .venv/bin/python -m pytest"
    assert lines[5] == "```"
    # CI runs the README's test command as it stands.
    assert lines[4] in (REPO / ".ci" / "run").read_text().splitlines()
    # The caveat sits beside the GPU estimates, not deep in the guide.
    assert "No real checkpoint has run here" in text


def test_the_readme_points_at_every_published_system():
    text = README.read_text()
    systems = ["Self-Forcing", "CausVid", "Causal Forcing", "Rolling Forcing", "LongLive"]
    systems += ["Infinity-RoPE", "Wan2.1-T2V-1.3B", "Deep Forcing"]
    table = [line for line in text.splitlines() if line.startswith("| [")]
    for system in systems:
        rows = [row for row in table if system in row]
        assert rows, system
        assert all("docs/GUIDE.md#" in row and "examples/" in row for row in rows), system
    # Every example config is named in the README or the guide, and every one named exists.
    both = text + GUIDE.read_text()
    examples = sorted((REPO / "examples").rglob("*.yaml"))
    names = [path.relative_to(REPO / "examples").as_posix() for path in examples]
    assert [name for name in names if name not in both] == []
    named = set(re.findall(r"examples/([\w/]+\.yaml)", both))
    assert named <= set(names)


# --- docs/CONFIG.md ------------------------------------------------------------------------------


def test_the_configuration_reference_is_what_the_generator_writes_from_the_schema():
    assert (DOCS / "CONFIG.md").read_text() == docs.config_reference(docs.load_schema()), (
        "docs/CONFIG.md is stale: run python -m sinkscope.docs config"
    )


def schema_keys(node: dict, path: str) -> set[str]:
    """Every dotted key of the schema under `node` that has properties of its own."""
    keys = set()
    for name, child in node.get("properties", {}).items():
        keys.add(f"{path}.{name}" if path else name)
        keys |= schema_keys(child, f"{path}.{name}" if path else name)
    return keys


def test_the_configuration_reference_names_every_key_with_its_description_and_default():
    schema = docs.load_schema()
    page = docs.config_reference(schema)
    for key in schema_keys(schema, ""):
        assert f"`{key}`" in page, key
    # A description and a default come through, pipes escaped for the table.
    toy = {
        "properties": {
            "figures": {
                "type": "object",
                "properties": {
                    "step": {"description": "a | b", "type": "integer", "minimum": 0, "default": 0}
                },
            },
            "runs": {"type": "array", "items": {"$ref": "#/definitions/x"}},
        },
        "definitions": {"x": {"type": "object"}},
        "required": ["runs"],
    }
    page = docs.config_reference(toy)
    assert "| `figures.step` | integer (>= 0) | `0` | a \\| b |" in page
    assert "| [`runs`](#runs) | list of mapping: the keys of [`x`](#x) | required |" in page


# --- docs/GALLERY.md -----------------------------------------------------------------------------


def test_the_gallery_is_what_the_generator_writes_from_the_registry_and_the_captions():
    assert (DOCS / "GALLERY.md").read_text() == docs.gallery_markdown(docs.thumbnails()), (
        "docs/GALLERY.md is stale: run python -m sinkscope.docs gallery"
    )


def test_every_figure_kind_has_a_small_thumbnail_in_the_gallery():
    found = docs.thumbnails()
    missing = sorted(set(figures.FIGURES) - set(found))
    assert not missing, f"no thumbnail of {missing}: run python -m sinkscope.docs gallery"
    page = (DOCS / "GALLERY.md").read_text()
    for thumb in found.values():
        assert f"### `{thumb.kind.stem}`" in page
        assert thumb.path.stat().st_size < THUMBNAIL_LIMIT, thumb.path
        with Image.open(thumb.path) as image:
            assert image.width <= docs.THUMBNAIL_BOX[0] and image.height <= docs.THUMBNAIL_BOX[1]
    pngs = list(DOCS.rglob("*.png"))
    assert sum(path.stat().st_size for path in pngs) < PNG_BUDGET
    assert docs.README_FIGURE.stat().st_size < README_FIGURE_LIMIT
    assert docs.README_FIGURE.relative_to(REPO).as_posix() in README.read_text()


def test_a_gallery_line_is_the_caption_before_its_first_template_tag(tmp_path):
    kind = figures.FIGURES["figure4"]
    (tmp_path / kind.caption).write_text(
        "What the ``figure`` shows,\nover two lines. {% set x = 1 %}\n\nThe rest.\n"
    )
    assert docs.caption_summary(kind, tmp_path) == "What the `figure` shows, over two lines."
    (tmp_path / kind.caption).write_text("{{ snakemake.config }} only a template\n")
    with pytest.raises(ValueError, match="no sentence"):
        docs.caption_summary(kind, tmp_path)
    for kind in figures.FIGURES.values():
        line = docs.caption_summary(kind)
        assert "{" not in line.replace("{checkpoint}", "").replace("{prompt}", ""), kind.name


def test_the_gallery_thumbnails_are_made_from_the_demo_figures(tmp_path):
    """`demo_figures` picks one PNG of each kind the demo drew (the first run, the lowest
    layer), and `write_thumbnail` fits it into the box in a palette."""
    folder = tmp_path / "results" / "figures"
    for name in ("demo_b/eagle/figure4.png", "demo_a/eagle/figure4.png"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGBA", (3000, 1500), (0, 0, 255, 255)).save(folder / name)
    for layer in (2, 0):
        Image.new("RGB", (800, 2400), "red").save(
            folder / f"demo_a/eagle/layer{layer}_heads_grid.png"
        )
    drawn = docs.demo_figures(tmp_path / "results")
    assert drawn == {
        "figure4": folder / "demo_a/eagle/figure4.png",
        "heads_grid": folder / "demo_a/eagle/layer0_heads_grid.png",
    }
    docs.write_thumbnail(drawn["figure4"], tmp_path / "wide.png")
    docs.write_thumbnail(drawn["heads_grid"], tmp_path / "tall.png")
    with Image.open(tmp_path / "wide.png") as wide, Image.open(tmp_path / "tall.png") as tall:
        assert wide.size == (docs.THUMBNAIL_BOX[0], docs.THUMBNAIL_BOX[0] // 2)
        assert tall.height == docs.THUMBNAIL_BOX[1] and tall.width < docs.THUMBNAIL_BOX[0]
        assert wide.mode == "P"


# --- figure names and file lists against the registry and the rules ----------------------------

FIGURE_FILE = re.compile(r"(?<![\w.{}])((?:layer\{L\}_|layer\d+_)?[a-z0-9_]+)\.(svg|png|pdf)\b")
FIGURE_WORD = re.compile(r"`([a-z0-9_]+)` figures?\b|\bfigures? `([a-z0-9_]+)`")


def figure_names(text: str) -> set[str]:
    """The figure file names a page uses (`figure4.svg`, `layer{L}_heads_grid.svg`), and the
    names it calls a figure (the `closed_loop_switches` figure); not the docs' own images, nor
    the seed research's file names (the first column of the table under `| seed output |`)."""
    text = re.sub(r"\((?:docs/)?(?:img|gallery)/[\w.]+\)", "", text)
    lines, seed = [], False
    for line in text.splitlines():
        seed = line.startswith("| seed output |") or (seed and line.startswith("|"))
        lines.append("|" + line.split("|", 2)[2] if seed else line)
    text = "\n".join(lines)
    names = {m.group(1).replace("{L}", "0") + "." + m.group(2) for m in FIGURE_FILE.finditer(text)}
    words = {a or b for a, b in FIGURE_WORD.findall(text)}
    return names | {f"{word}.svg" for word in words}


NOT_FIGURES = {"figure4.png"}  # docs/img/figure4.png, the README's copy of the demo's


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_figure_name_in_the_docs_is_the_registrys(page):
    wrong = []
    for name in sorted(figure_names(page.read_text()) - NOT_FIGURES):
        try:
            figures.parse_figure_path(name)
        except ValueError:
            wrong.append(name)
    assert not wrong, f"{page.name} names figures the registry does not have: {wrong}"


def test_figure_names_are_found_and_checked():
    text = (
        "see `layer{L}_frame_maps.svg`, figures/compare/passes.svg and the `closed_loop_foo` figure"
        "\n| seed output | sinkscope output |\n|---|---|\n| `x_all_heads.svg` | `figure4.svg` |\n"
    )
    assert figure_names(text) == {
        "layer0_frame_maps.svg",
        "passes.svg",
        "closed_loop_foo.svg",
        "figure4.svg",
    }
    with pytest.raises(ValueError):
        figures.parse_figure_path("closed_loop_foo.svg")


def tree_patterns(text: str) -> list[str]:
    """The paths of the `results/` trees in a page's code blocks: a line's first column, its
    comma-separated names after the first in the first one's folder unless they hold a `/`."""
    paths = []
    for block in re.findall(r"```\n(results/\n.*?)```", text, re.S):
        for line in block.splitlines()[1:]:
            column = re.split(r"\s{2,}", line.strip())[0]
            first, *rest = column.split(", ")
            folder = first.rsplit("/", 1)[0] if "/" in first.rstrip("/") else ""
            paths.append(f"results/{first}")
            paths += [f"results/{n}" if "/" in n else f"results/{folder}/{n}" for n in rest]
    return paths


def path_regex(pattern: str) -> re.Pattern:
    """`{name}` and `{L}` are one path component, `...` anything, a trailing `/` a folder."""
    out = re.escape(pattern)
    out = re.sub(r"\\\{\w+\\\}", r"[^/]+", out).replace(r"\.\.\.", ".+")
    return re.compile(out + (".+" if pattern.endswith("/") else ""))


@pytest.fixture(scope="module")
def planned_files(tmp_path_factory) -> list[str]:
    """Every output and log a dry run of the demo plans (default target and `export`), with the
    gallery's settings: two closed-loop runs, so that every figure kind is among them."""
    workdir = copy_workflow(tmp_path_factory.mktemp("docs"))
    (workdir / "gallery.yaml").write_text(yaml.safe_dump(docs.GALLERY_CONFIG))
    command = [sys.executable, "-m", "snakemake", "all", "export", "-n", "--cores", "1"]
    done = subprocess.run(
        [*command, "--configfile", "gallery.yaml"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"^\s+(?:output|log): (.*)$", done.stdout + done.stderr, re.M)
    return sorted({path for line in lines for path in line.split(", ")})


def test_the_file_trees_of_readme_and_guide_are_the_rules_outputs(planned_files):
    checked = 0
    for page in (README, GUIDE):
        patterns = tree_patterns(page.read_text())
        assert len(patterns) >= 10, page.name
        for pattern in patterns:
            regex = path_regex(pattern)
            assert any(regex.fullmatch(path) for path in planned_files), (page.name, pattern)
            checked += 1
    assert checked > 30


def test_every_figure_kind_is_drawn_where_the_gallery_says(planned_files):
    for kind in figures.FIGURES.values():
        regex = path_regex(docs.figure_pattern(kind, "png"))
        assert any(regex.fullmatch(path) for path in planned_files), kind.name


def test_a_tree_line_names_its_siblings_in_its_folder():
    text = "```\nresults/\n  stats/{run}/a.csv, b.csv, figures/x/   what\n  logs/{rule}/...\n```\n"
    assert tree_patterns(text) == [
        "results/stats/{run}/a.csv",
        "results/stats/{run}/b.csv",
        "results/figures/x/",
        "results/logs/{rule}/...",
    ]
    assert path_regex("results/logs/{rule}/...").fullmatch("results/logs/extract/a/b.log")
    assert not path_regex("results/stats/{run}/a.csv").fullmatch("results/stats/x/y/a.csv")


# --- links --------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {docs.slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_between_the_pages_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_anchors_are_githubs():
    assert docs.slug("## `prompts_file`") == "prompts_file"
    assert docs.slug("### Deep Forcing's cache policies") == "deep-forcings-cache-policies"
    assert docs.slug("## Preflight: every missing or malformed file at once") == (
        "preflight-every-missing-or-malformed-file-at-once"
    )


POINTER = re.compile(
    r"(?<![\w/])(README(?:\.md)?|docs/GUIDE\.md|docs/DESIGN\.md|docs/DATA\.md)[,:]?\s+\"([^\"]+)\""
)
# What points at a section by its heading: comments and docstrings of the code, the configs, the
# pages. rules/ is left out: its owners keep its headers.
POINTING = ["config.yaml", "examples", "profiles", "schemas", "sinkscope", "tests", "docs"]


def section_pointers() -> list[tuple[Path, str, str]]:
    found = []
    for name in POINTING:
        root = REPO / name
        files = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in files:
            if path.suffix not in (".py", ".yaml", ".md", ".smk") or "__pycache__" in path.parts:
                continue
            for target, heading in POINTER.findall(path.read_text()):
                heading = " ".join(heading.replace("#", " ").split())
                found.append((path, target, heading))
    return found


def test_every_pointer_to_a_section_names_a_heading_of_that_page():
    pointers = section_pointers()
    assert any(target == "docs/GUIDE.md" for _, target, _ in pointers)
    wrong = []
    for path, target, heading in pointers:
        page = REPO / ("README.md" if target.startswith("README") else target)
        headings = [
            " ".join(line.lstrip("#").split())
            for line in re.sub(r"```.*?```", "", page.read_text(), flags=re.S).splitlines()
            if line.startswith("#")
        ]
        if not any(h.startswith(heading) for h in headings):
            wrong.append(f'{path.relative_to(REPO)}: {target} "{heading}"')
    assert not wrong
