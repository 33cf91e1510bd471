"""The conda envs of `snakemake --sdm conda` (envs/), checked without conda.

No conda channel is reachable where these tests run, so no env is ever created here. What is
checked instead: the env files parse and pin the tested versions (envs/constraints.txt, which must
equal what is installed when SINKSCOPE_REQUIRE_PINS=1, as in CI); each env holds exactly the
third-party packages that the sinkscope code of its rules' scripts imports, and those modules
import with nothing outside the env's packages and their dependencies; every conda rule has an env
with a post-deploy script, which installs the checkout that the workflow names in
SINKSCOPE_SOURCE, and pip accepts that install spec.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .workflowtools import copy_workflow

REPO = Path(__file__).resolve().parents[1]
ENVS = REPO / "envs"
ENV_NAMES = ("extract", "analysis", "export")
CONSTRAINTS = ENVS / "constraints.txt"
# Installed by conda itself in every env, next to python.
CONDA_PACKAGES = {"python", "pip", "setuptools"}


def load_env(name: str) -> dict:
    return yaml.safe_load((ENVS / f"{name}.yaml").read_text())


def conda_specs(env: dict) -> dict[str, str]:
    """Conda-level dependency name -> its version spec ('' when unpinned)."""
    specs = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str):
            name, _, version = re.match(r"([A-Za-z0-9_.-]+)\s*(=*)\s*(.*)", dep).groups()
            specs[name] = version
    return specs


def exact_pin(line: str) -> tuple[str, Version]:
    """`name==version` -> (canonical name, version); anything else fails."""
    req = Requirement(line)
    specs = list(req.specifier)
    assert not req.extras and not req.marker, line
    assert len(specs) == 1 and specs[0].operator == "==", f"not an exact pin: {line}"
    assert "*" not in specs[0].version, f"not an exact pin: {line}"
    return canonicalize_name(req.name), Version(specs[0].version)


def pip_pins(env: dict) -> dict[str, Version]:
    pins = {}
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, dep
            for line in dep["pip"]:
                name, version = exact_pin(line)
                assert name not in pins, f"{name} twice"
                pins[name] = version
    return pins


@functools.cache
def constraints() -> dict[str, Version]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = exact_pin(line)
            assert name not in pins, f"{name} twice in {CONSTRAINTS.name}"
            pins[name] = version
    return pins


def installed(name: str) -> Version:
    """The version the tests run with, local label dropped (torch's `+cpu`): the pins are public
    versions, which `==` matches with any local label."""
    return Version(Version(importlib.metadata.version(name)).public)


def pyproject_dependencies() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        deps += extra
    return [Requirement(dep) for dep in deps]


# --- which rules use which env, and what their scripts import ---------------------------------


def conda_rules() -> dict[str, tuple[Path | None, Path | None]]:
    """rule name -> (its conda env file, its script), paths resolved as Snakemake does (relative
    to the .smk file)."""
    rules = {}
    for smk in sorted((REPO / "rules").glob("*.smk")):
        text = smk.read_text()
        starts = list(re.finditer(r"^\s*rule (\w+):", text, re.MULTILINE))
        ends = [*(start.start() for start in starts), len(text)][1:]
        for start, end in zip(starts, ends, strict=True):
            block = text[start.end() : end]
            found = {}
            for directive in ("conda", "script"):
                match = re.search(rf"^\s*{directive}:\s*\"([^\"]+)\"", block, re.MULTILINE)
                found[directive] = (smk.parent / match.group(1)).resolve() if match else None
            rules[start.group(1)] = (found["conda"], found["script"])
    return rules


def env_scripts(name: str) -> list[Path]:
    env_file = ENVS / f"{name}.yaml"
    return sorted({script for conda, script in conda_rules().values() if conda == env_file})


def module_file(name: str) -> Path | None:
    path = REPO.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def imported_names(path: Path, module: str | None) -> set[str]:
    """Every module that an import statement in `path` names (function-level ones included),
    relative imports resolved against `module`; `from x import y` adds x.y if that is a module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = (
                    module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                )
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, node.module] if node.module else package)
            else:
                base = node.module
            if base == "__future__":
                continue
            names.add(base)
            names.update(
                f"{base}.{alias.name}"
                for alias in node.names
                if module_file(f"{base}.{alias.name}")
            )
    return names


def import_closure(scripts: list[Path]) -> tuple[set[str], set[str]]:
    """(sinkscope modules, third-party top-level names) reachable from the scripts' imports,
    following sinkscope's imports at every level, function-level (lazy) ones included."""
    todo = set().union(*(imported_names(script, None) for script in scripts))
    modules, third_party = set(), set()
    while todo:
        name = todo.pop()
        top = name.partition(".")[0]
        if top != "sinkscope":
            if top not in sys.stdlib_module_names:
                third_party.add(top)
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            parent = ".".join(parts[:i])
            path = module_file(parent)
            if parent not in modules and path is not None:
                modules.add(parent)
                todo |= imported_names(path, parent)
    return modules, third_party


@functools.cache
def packages_distributions() -> dict[str, set[str]]:
    """Top-level import name -> the (canonical) names of the installed distributions giving it."""
    return {
        top: {canonicalize_name(dist) for dist in dists}
        for top, dists in importlib.metadata.packages_distributions().items()
    }


def requirement_closure(names: set[str]) -> set[str]:
    """The distributions pip installs for `names`: their requirements, recursively, markers
    evaluated for this interpreter (the env's python version and platform), extras followed."""
    seen: set[tuple[str, str]] = set()
    todo = [(name, "") for name in names]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo.append((canonicalize_name(req.name), ""))
                todo += [(canonicalize_name(req.name), e) for e in req.extras]
    return {name for name, _ in seen}


# --- the env files and the tested versions ----------------------------------------------------


@pytest.mark.parametrize("name", ENV_NAMES)
def test_env_file_pins_conda_forge_python_and_setuptools(name):
    env = load_env(name)
    assert env["channels"] == ["conda-forge"]
    specs = conda_specs(env)
    # Every Python package comes from pip, at the tested versions; conda gives only these.
    assert set(specs) == CONDA_PACKAGES
    assert re.fullmatch(r"3\.\d+", specs["python"]), specs["python"]
    assert Version(specs["setuptools"]) == constraints()["setuptools"]


@pytest.mark.parametrize("name", ENV_NAMES)
def test_env_pip_pins_are_the_tested_versions(name):
    pins = pip_pins(load_env(name))
    assert pins
    for package, version in pins.items():
        assert package in constraints(), f"{name}.yaml pins {package}, constraints.txt does not"
        assert version == constraints()[package], package


def test_constraints_pin_every_dependency_within_its_range():
    pins = constraints()
    for req in pyproject_dependencies():
        name = canonicalize_name(req.name)
        assert name in pins, f"pyproject.toml's {req} has no line in constraints.txt"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {req}"


# CI (.ci/run) installs with `-c envs/constraints.txt` and sets this: the tests must then run with
# exactly the pinned versions. An install without the constraints (another torch, another Python)
# runs every other test.
REQUIRE_PINS = os.environ.get("SINKSCOPE_REQUIRE_PINS") == "1"


@pytest.mark.skipif(
    not REQUIRE_PINS, reason="SINKSCOPE_REQUIRE_PINS=1 (.ci/run) checks the installed versions"
)
def test_the_tests_run_with_the_pinned_versions():
    for package, version in constraints().items():
        assert version == installed(package), f"constraints.txt: {package}=={version}"
    for name in ENV_NAMES:
        python = conda_specs(load_env(name))["python"]
        assert python == f"{sys.version_info.major}.{sys.version_info.minor}", name


# --- what each env must hold --------------------------------------------------------------------


# Imported where present, never pinned: Triton comes with torch's CUDA builds (their own
# dependency, at the version that torch wants), and extraction/fused_softmax.py takes the torch
# path without it (the CPU builds).
WITH_CUDA_TORCH = {"triton"}


@pytest.mark.parametrize("name", ENV_NAMES)
def test_env_holds_exactly_what_its_scripts_import(name):
    """The third-party imports of the env's scripts and of the sinkscope modules they reach
    (every import statement, lazy ones inside functions included) are the env's pip packages:
    none missing, none extra. A package that only comes in as a dependency of another one (pandas
    through xarray) must still be listed when sinkscope imports it, so that it is pinned."""
    scripts = env_scripts(name)
    assert scripts, f"no rule uses envs/{name}.yaml"
    _, third_party = import_closure(scripts)
    pins = pip_pins(load_env(name))
    needed = set()
    for top in third_party - WITH_CUDA_TORCH:
        dists = packages_distributions().get(top, set())
        assert dists & pins.keys(), f"{name}.yaml lacks {top} (from {sorted(dists)})"
        needed |= dists & pins.keys()
    assert pins.keys() <= needed, f"{name}.yaml pins what no script needs: {pins.keys() - needed}"


# Runs in a fresh interpreter: refuses every top-level module that neither the standard library,
# sinkscope nor the env's packages (and what they depend on) provide, then imports the modules.
ISOLATED_IMPORT = textwrap.dedent(
    """
    import importlib, importlib.machinery, importlib.util, json, os, site, sys, sysconfig

    spec = json.loads(sys.argv[1])
    allowed = set(spec["allowed"]) | set(sys.stdlib_module_names) | {"sinkscope"}
    stdlib = tuple({os.path.realpath(sysconfig.get_path(k)) for k in ("stdlib", "platstdlib")})
    site_packages = tuple(os.path.realpath(p) for p in site.getsitepackages())

    def in_stdlib(name):
        # Such as _sysconfigdata_*, which sys.stdlib_module_names leaves out.
        found = importlib.machinery.PathFinder.find_spec(name)
        origin = os.path.realpath(found.origin) if found and found.origin else ""
        return origin.startswith(stdlib) and not origin.startswith(site_packages)

    class NotInEnv:
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top not in allowed and not in_stdlib(top):
                raise ModuleNotFoundError(f"{top} is not in the env", name=name)
            return None

    # Probes for optional packages (xarray asks for flox) see what is not in the env as absent.
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        top = name.partition(".")[0]
        if not name.startswith(".") and top not in allowed and not in_stdlib(top):
            return None
        return real_find_spec(name, package)

    importlib.util.find_spec = find_spec
    sys.meta_path.insert(0, NotInEnv())
    for module in spec["modules"]:
        importlib.import_module(module)
    """
)


@functools.cache
def importable_names(package_names: frozenset[str]) -> list[str]:
    dists = requirement_closure(set(package_names))
    return sorted(top for top, owners in packages_distributions().items() if dists & owners)


def start_isolated_import(allowed: list[str], modules: list[str], cwd: Path) -> subprocess.Popen:
    spec = json.dumps({"allowed": allowed, "modules": modules})
    return subprocess.Popen(
        [sys.executable, "-c", ISOLATED_IMPORT, spec],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def env_imports(tmp_path_factory):
    """The import subprocess of every env, started together: a second or two each."""
    started = {}
    for name in ENV_NAMES:
        scripts = env_scripts(name)
        modules, _ = import_closure(scripts)
        script_imports = set().union(*(imported_names(script, None) for script in scripts))
        own = {m.partition(".")[0] for m in script_imports} - {"sinkscope"}
        own -= set(sys.stdlib_module_names)
        packages = pip_pins(load_env(name)).keys() | (CONDA_PACKAGES - {"python"})
        allowed = importable_names(frozenset(packages))
        cwd = tmp_path_factory.mktemp(f"imports-{name}")
        started[name] = start_isolated_import(allowed, sorted(modules | own), cwd)
    yield started
    for process in started.values():
        process.kill()
        process.communicate()


@pytest.mark.parametrize("name", ENV_NAMES)
def test_env_scripts_modules_import_with_the_env_packages_only(name, env_imports):
    """Imports the sinkscope modules the env's scripts reach, and the scripts' own third-party
    imports, in a subprocess that refuses modules from outside the env. This executes module-level
    imports only: lazy ones inside functions (transformers in sinkscope/wan/text.py, torch in
    sinkscope/wan/demo.py) are covered by the static test above, which wants their packages
    listed."""
    process = env_imports[name]
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, f"envs/{name}.yaml:\n{stderr[-3000:]}"


def test_the_import_check_refuses_what_the_env_lacks(tmp_path):
    """The subprocess above does fail: sinkscope.analysis.reduce without xarray's package."""
    allowed = importable_names(frozenset({"numpy", "zarr", "dask", "pandas"}))
    process = start_isolated_import(allowed, ["sinkscope.analysis.reduce"], tmp_path)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "xarray is not in the env" in stderr


# --- rules, post-deploy scripts, SINKSCOPE_SOURCE -----------------------------------------------


def test_every_script_rule_runs_in_an_env_with_a_post_deploy_script():
    rules = conda_rules()
    used = set()
    for rule, (conda, script) in rules.items():
        if script is not None:
            assert conda is not None, f"rule {rule} runs {script.name} without conda:"
        if conda is not None:
            assert conda.is_file(), f"rule {rule}: {conda} is missing"
            assert conda.parent == ENVS and conda.suffix == ".yaml", rule
            assert conda.with_suffix(".post-deploy.sh").is_file(), f"rule {rule}: no post-deploy"
            used.add(conda.stem)
    assert used == set(ENV_NAMES)
    assert {p.stem for p in ENVS.glob("*.yaml")} == set(ENV_NAMES)


FAKE_PIP = '#!/bin/sh\nprintf "%s\\n" "$@" > "$FAKE_PIP_ARGS"\n'


def run_post_deploy(
    name: str, tmp_path: Path, source: str | None
) -> tuple[subprocess.CompletedProcess, Path]:
    """Runs envs/<name>.post-deploy.sh as Snakemake does (the shebang's interpreter, or sh) with a
    `pip` first on PATH that only records its arguments."""
    script = ENVS / f"{name}.post-deploy.sh"
    first = script.read_text().splitlines()[0]
    interpreter = first[2:].split() if first.startswith("#!") else ["sh"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "pip").write_text(FAKE_PIP)
    (bin_dir / "pip").chmod(0o755)
    args_file = tmp_path / "pip-args"
    env = {k: v for k, v in os.environ.items() if k != "SINKSCOPE_SOURCE"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_PIP_ARGS=str(args_file))
    if source is not None:
        env["SINKSCOPE_SOURCE"] = source
    result = subprocess.run(
        [*interpreter, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result, args_file


@functools.cache
def pip_dry_run(args: tuple[str, ...]) -> dict:
    """pip's report of installing `args`, offline (--no-deps, --no-build-isolation: no index)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip = [sys.executable, "-m", "pip", *args, "--dry-run", "--no-index", "--quiet"]
        subprocess.run(
            [*pip, "--report", str(report)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        return json.loads(report.read_text())


@pytest.mark.parametrize("name", ENV_NAMES)
def test_post_deploy_installs_the_checkout_editable_without_deps(name, tmp_path):
    result, args_file = run_post_deploy(name, tmp_path, str(REPO))
    assert result.returncode == 0, result.stderr
    args = args_file.read_text().splitlines()
    assert args[0] == "install" and "--no-deps" in args and "--no-build-isolation" in args
    assert args[-2:] == ["-e", str(REPO)]
    # What pip makes of exactly that spec: the project sinkscope of pyproject.toml, editable.
    report = pip_dry_run(tuple(args))
    (install,) = report["install"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert install["metadata"]["name"] == project["name"] == "sinkscope"
    assert install["metadata"]["version"] == project["version"]
    assert install["download_info"]["dir_info"] == {"editable": True}
    assert install["download_info"]["url"] == REPO.as_uri()


@pytest.mark.parametrize("name", ENV_NAMES)
@pytest.mark.parametrize("source", [None, "empty", "other"])
def test_post_deploy_refuses_a_missing_or_foreign_source(name, source, tmp_path):
    if source is not None:
        folder = tmp_path / source
        folder.mkdir()
        if source == "other":
            (folder / "pyproject.toml").write_text('[project]\nname = "other"\n')
        source = str(folder)
    result, args_file = run_post_deploy(name, tmp_path, source)
    assert result.returncode != 0
    assert "SINKSCOPE_SOURCE" in result.stderr
    assert not args_file.exists()


# Prints SINKSCOPE_SOURCE as the Snakemake process holds it when it ends.
SNAKEMAKE_WITH_ENV_REPORT = textwrap.dedent(
    """
    import atexit, os, runpy, sys
    atexit.register(lambda: print("SINKSCOPE_SOURCE=" + os.environ.get("SINKSCOPE_SOURCE", "")))
    sys.argv = ["snakemake", *sys.argv[1:]]
    runpy.run_module("snakemake", run_name="__main__")
    """
)


@pytest.mark.workflow
def test_the_workflow_sets_sinkscope_source_to_its_checkout(tmp_path):
    """Parsing the workflow sets SINKSCOPE_SOURCE in the Snakemake process (whose environment the
    post-deploy scripts inherit) to the folder of the Snakefile."""
    workdir = copy_workflow(tmp_path / "workflow")
    env = {k: v for k, v in os.environ.items() if k != "SINKSCOPE_SOURCE"}
    result = subprocess.run(
        [sys.executable, "-c", SNAKEMAKE_WITH_ENV_REPORT, "-n", "--cores", "1"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("SINKSCOPE_SOURCE=")]
    source = line.partition("=")[2]
    assert source and Path(source).resolve() == workdir.resolve()
