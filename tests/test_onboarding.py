"""Onboarding real weights: the preflight lists every missing or malformed file at once, each
with the config key that names it; prompts come from a text file with stable generated names; the
examples pass on the layout the user guide gives (docs/GUIDE.md, "Downloading the weights").
In-process and torch-free, but for one dry run."""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import zipfile
from contextlib import chdir
from pathlib import Path

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from sinkscope.wan.config import WanConfig
from sinkscope.wan.layout import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from sinkscope.workflow.checks import NAME_PATTERN, check_config
from sinkscope.workflow.entries import (
    ConfigError,
    merge_prompts_file,
    prompt_file_name,
    prompt_text,
    read_prompts_file,
)
from sinkscope.workflow.preflight import preflight, safetensors_header, torch_file_problem

from .test_config import DEMO, SCHEMA
from .test_lora import random_lora
from .workflowtools import REPO, copy_workflow, edit_config, planned_jobs

# Wan2.1-T2V-1.3B's config.json (249 B): the keys its Hugging Face repository ships.
WAN_13B_CONFIG = {
    "_class_name": "WanModel",
    "_diffusers_version": "0.30.0",
    "dim": 1536,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "in_dim": 16,
    "model_type": "t2v",
    "num_heads": 12,
    "num_layers": 30,
    "out_dim": 16,
    "text_len": 512,
}


def write_safetensors(path: Path, header: dict) -> Path:
    """A safetensors file of `header` alone: the preflight reads no further."""
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    return path


def write_torch_zip(path: Path) -> Path:
    """The layout of torch.save (a zip archive with the pickle in <name>/data.pkl), torch-free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{path.stem}/data.pkl", pickle.dumps({}))
    return path


def write_wan_folder(folder: Path, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps({**WAN_13B_CONFIG, **config}))
    write_safetensors(folder / WEIGHTS_NAME, {})
    return folder


def write_tokenizer(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def checked(config: dict, workdir: Path) -> dict:
    """Validated (defaults filled) and checked in `workdir`, as the Snakefile and common.smk do."""
    validate(config, SCHEMA)
    with chdir(workdir):
        check_config(config)
    return config


def real_config(root: Path) -> dict:
    """The demo's small video and settings with real-format files under `root`: a Self-Forcing
    and a base checkpoint over one Wan folder, Wan's UMT5 .pth and its tokenizer, a prompt with
    precomputed embeddings. Every file is well formed: each test breaks one."""
    wan = write_wan_folder(root / "wan")
    write_torch_zip(root / "sf.pt")
    write_torch_zip(root / "umt5.pth")
    write_tokenizer(root / "tokenizer")
    write_safetensors(
        root / "fox.safetensors",
        {"prompt_embeds": {"dtype": "F32", "shape": [7, 4096], "data_offsets": [0, 114688]}},
    )
    config = copy.deepcopy(DEMO)
    config["demo"]["checkpoints"] = {}
    config["checkpoints"] = {
        "sf": {"base": str(wan), "generator": str(root / "sf.pt")},
        "base_wan": {"base": str(wan)},
    }
    config["text_encoder"] = {
        "path": str(root / "umt5.pth"),
        "tokenizer": str(root / "tokenizer"),
        "text_len": 512,
    }
    config["prompts"]["fox"] = {"text": "A red fox", "embeddings": str(root / "fox.safetensors")}
    config["closed_loop"]["policies"] = []
    config["capture"].pop("token_runs")  # the demo's runs: every run has its token stores here
    config["figures"].pop("runs")  # ... and its own figures
    return config


def problems_of(config: dict, workdir: Path) -> list[str]:
    """The lines of the ConfigError that checking `config` raises."""
    with pytest.raises(ConfigError) as raised:
        checked(config, workdir)
    lines = str(raised.value).splitlines()
    if len(lines) == 1:
        return lines
    assert lines[0] == f"{len(lines) - 1} problems, each with the key that names it:"
    return [line.strip() for line in lines[1:]]


def test_a_well_formed_real_layout_passes(tmp_path):
    config = checked(real_config(tmp_path), tmp_path)
    assert preflight(config) == []


def test_the_preflight_lists_every_missing_file_at_once_with_its_key(tmp_path):
    config = real_config(tmp_path)
    missing = tmp_path / "missing"
    config["checkpoints"]["sf"] = {
        "base": str(missing / "wan"),
        "generator": str(missing / "sf.pt"),
    }
    config["checkpoints"]["base_wan"] = {"base": str(missing / "wan")}
    config["text_encoder"].update(path=str(missing / "umt5.pth"), tokenizer=str(missing / "tok"))
    config["prompts"]["fox"]["embeddings"] = str(missing / "fox.safetensors")
    config["prompts_file"] = str(missing / "prompts.txt")
    assert problems_of(config, tmp_path) == [
        f"checkpoints.sf: checkpoint file not found: {missing}/wan/config.json",
        f"checkpoints.sf: checkpoint file not found: {missing}/sf.pt",
        f"checkpoints.base_wan: checkpoint file not found: {missing}/wan/config.json",
        f"checkpoints.base_wan: checkpoint file not found: {missing}/wan/{WEIGHTS_NAME}",
        f"text_encoder.path: not found: {missing}/umt5.pth",
        f"text_encoder.tokenizer: directory not found: {missing}/tok",
        f"prompts_file: not found: {missing}/prompts.txt",
        f"prompts.fox.embeddings: file not found: {missing}/fox.safetensors",
    ]


def _lfs_pointer(path: Path) -> None:
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 5676070424\n")


def _header(path: Path, raw: bytes) -> None:
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)


def _config_json(**changes):
    def write(root: Path) -> None:
        values = {**WAN_13B_CONFIG, **changes}
        (root / "wan" / CONFIG_NAME).write_text(
            json.dumps({k: v for k, v in values.items() if v is not None})
        )

    return write


# (what breaks one file of real_config, the one problem line it must give, as a pattern)
MALFORMED = {
    "config-not-json": (
        lambda r: (r / "wan" / CONFIG_NAME).write_text('{"dim": 1536,'),
        r"checkpoints\.(sf|base_wan)\.base: .*/wan/config\.json: not valid JSON",
    ),
    "config-not-an-object": (
        lambda r: (r / "wan" / CONFIG_NAME).write_text("[1536, 12]"),
        r"checkpoints\.(sf|base_wan)\.base: .*/config\.json: not a JSON object but a list",
    ),
    "config-lacks-keys": (
        _config_json(num_layers=None, ffn_dim=None),
        r"checkpoints\.(sf|base_wan)\.base: .*/config\.json: lacks \['ffn_dim', 'num_layers'\]",
    ),
    "config-of-a-vae": (
        _config_json(z_dim=16),
        r"checkpoints\.(sf|base_wan)\.base: .*/config\.json: unknown Wan config keys \['z_dim'\]",
    ),
    "diffusers-config-lacks-keys": (
        lambda r: (r / "wan" / CONFIG_NAME).write_text(
            json.dumps({"_class_name": "WanTransformer3DModel", "num_layers": 30, "ffn_dim": 8960})
        ),
        r"checkpoints\.(sf|base_wan)\.base: .*: lacks \['num_attention_heads', 'attention_head_",
    ),
    "empty-weights": (
        lambda r: (r / "wan" / WEIGHTS_NAME).write_bytes(b""),
        rf"checkpoints\.base_wan\.base: .*/{WEIGHTS_NAME}: empty file \(0 bytes\)",
    ),
    "lfs-pointer-weights": (
        lambda r: _lfs_pointer(r / "wan" / WEIGHTS_NAME),
        r"checkpoints\.base_wan\.base: .*: a Git LFS pointer \(\d+ bytes\), not the file itself",
    ),
    "weights-not-safetensors": (
        lambda r: (r / "wan" / WEIGHTS_NAME).write_bytes(b"not a safetensors file"),
        r"checkpoints\.base_wan\.base: .*: not a readable safetensors file: its first 8 bytes",
    ),
    "weights-header-not-json": (
        lambda r: _header(r / "wan" / WEIGHTS_NAME, b"\xff\xfe garbage"),
        r"checkpoints\.base_wan\.base: .*: not a readable safetensors file: its header is not JSON",
    ),
    "weights-header-not-tensors": (
        lambda r: _header(r / "wan" / WEIGHTS_NAME, b'{"blocks.0.q": [1, 2]}'),
        r"checkpoints\.base_wan\.base: .*: its header is not a map of tensors",
    ),
    "unreadable-shard-index": (
        lambda r: (r / "wan" / INDEX_NAME).write_text('{"metadata": {}}'),
        rf"checkpoints\.base_wan: .*/{re.escape(INDEX_NAME)}: not a safetensors index",
    ),
    "missing-shard": (
        lambda r: (r / "wan" / INDEX_NAME).write_text(
            json.dumps({"weight_map": {"head.head.weight": "model-00002-of-00002.safetensors"}})
        ),
        r"checkpoints\.base_wan: checkpoint file not found: .*/model-00002-of-00002\.safetensors",
    ),
    "generator-not-torch": (
        lambda r: (r / "sf.pt").write_text("<html>404 Not Found</html>"),
        r"checkpoints\.sf\.generator: .*/sf\.pt: not a torch checkpoint \(neither the zip",
    ),
    "generator-empty": (
        lambda r: (r / "sf.pt").write_bytes(b""),
        r"checkpoints\.sf\.generator: .*/sf\.pt: empty file \(0 bytes\)",
    ),
    "encoder-lfs-pointer": (
        lambda r: _lfs_pointer(r / "umt5.pth"),
        r"text_encoder\.path: .*/umt5\.pth: a Git LFS pointer",
    ),
    "tokenizer-without-files": (
        lambda r: (r / "tokenizer" / "tokenizer.json").unlink(),
        r"text_encoder\.tokenizer: .*/tokenizer holds neither tokenizer\.json nor spiece\.model",
    ),
    "embeddings-without-prompt-embeds": (
        lambda r: write_safetensors(
            r / "fox.safetensors",
            {"embeds": {"dtype": "F32", "shape": [7, 4], "data_offsets": [0, 112]}},
        ),
        r"prompts\.fox\.embeddings: .*: no 'prompt_embeds' tensor; it has \['embeds'\]",
    ),
    "embeddings-of-a-batch": (
        lambda r: write_safetensors(
            r / "fox.safetensors",
            {"prompt_embeds": {"dtype": "F32", "shape": [2, 7, 4], "data_offsets": [0, 224]}},
        ),
        r"prompts\.fox\.embeddings: .*: 'prompt_embeds' must be \[L, d\] or \[1, L, d\]",
    ),
}


@pytest.mark.parametrize(("breaks", "message"), MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_file_is_named_with_its_key(tmp_path, breaks, message):
    config = real_config(tmp_path)
    breaks(tmp_path)
    problems = problems_of(config, tmp_path)
    # config.json is shared by both checkpoints: one line for each, the same problem.
    assert 1 <= len(problems) <= 2 and all(re.match(message, p) for p in problems), problems


def test_a_text_encoder_folder_needs_its_config_and_tokenizer(tmp_path):
    config = real_config(tmp_path)
    folder = tmp_path / "text_encoder"  # e.g. the diffusers download's text_encoder/
    folder.mkdir()
    config["text_encoder"] = {"path": str(folder)}
    assert problems_of(config, tmp_path) == [
        f"text_encoder.path: {folder} has no config.json: not a transformers UMT5EncoderModel "
        "folder",
        f"text_encoder.path: {folder} (the tokenizer folder, as text_encoder.tokenizer is unset) "
        "holds neither tokenizer.json nor spiece.model: not the google/umt5-xxl tokenizer files",
    ]
    (folder / CONFIG_NAME).write_text("{}")
    write_tokenizer(folder)
    checked(real_config(tmp_path) | {"text_encoder": {"path": str(folder)}}, tmp_path)


def test_a_file_cut_short_in_its_tensors_is_left_to_its_job(tmp_path):
    """Headers only: a download cut after its header parses (the job fails, --keep-going)."""
    header = {"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}
    path = write_safetensors(tmp_path / "cut.safetensors", header)  # no tensor bytes at all
    assert safetensors_header(path) == (header, None)


def test_real_torch_files_pass_the_magic_check(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"generator": {}}, tmp_path / "zip.pt")
    torch.save({"generator": {}}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert torch_file_problem(tmp_path / "zip.pt") is None
    assert torch_file_problem(tmp_path / "legacy.pt") is None


# --- examples/ and the layout docs/GUIDE.md gives -----------------------------------------------

EXAMPLES = sorted(path.stem for path in (REPO / "examples").glob("*.yaml"))


def example(name: str) -> dict:
    return yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())


def example_files(config: dict) -> set[str]:
    """The files an example reads: a generator replaces the base weights; the VAE beside the base
    decodes the closed loop's videos, unless `videos: none`."""
    files = {config["text_encoder"]["path"], config["text_encoder"]["tokenizer"]}
    if config.get("closed_loop", {}).get("policies") and config.get("videos") != "none":
        runs = config["closed_loop"].get("runs") or [[name] for name in config["checkpoints"]]
        files |= {f"{config['checkpoints'][run[0]]['base']}/Wan2.1_VAE.pth" for run in runs}
    for entry in config["checkpoints"].values():
        files.add(f"{entry['base']}/{CONFIG_NAME}")
        files.add(entry["generator"] if "generator" in entry else f"{entry['base']}/{WEIGHTS_NAME}")
        if "lora" in entry:
            files.add(entry["lora"])
    return files


def lora_files(config: dict) -> set[str]:
    return {entry["lora"] for entry in config["checkpoints"].values() if "lora" in entry}


def guide_trees() -> dict[str, set[str]]:
    """The paths of each example's tree in docs/GUIDE.md's "Downloading the weights" (the section
    up to the next heading of its level)."""
    text = (REPO / "docs" / "GUIDE.md").read_text()
    section = text[text.index("\n## Downloading the weights\n") :]
    section = section[: section.index("\n## ", 1)]
    trees: dict[str, set[str]] = {}
    current, stack = None, []
    for line in section.splitlines():
        head = re.fullmatch(r"# examples/(\w+)\.yaml", line)
        if head:
            current, stack = head.group(1), []
            trees[current] = set()
            continue
        entry = line.split(" #")[0].rstrip()
        if current is None or not entry.strip() or line.startswith("```"):
            current = None if line.startswith("```") else current
            continue
        depth = (len(entry) - len(entry.lstrip())) // 2
        stack = [*stack[:depth], entry.strip().rstrip("/")]
        trees[current].add("/".join(stack))
    return trees


def test_the_guide_tree_of_each_example_holds_the_files_it_reads():
    trees = guide_trees()
    assert sorted(trees) == EXAMPLES
    for name in EXAMPLES:
        assert example_files(example(name)) <= trees[name], name


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_example_on_the_guide_layout_passes_the_preflight(tmp_path, name):
    config = example(name)
    validate(config, SCHEMA)
    with chdir(tmp_path):
        before = preflight(copy.deepcopy(config))
    # Nothing downloaded yet: every file the example reads is listed, with its key.
    assert all(re.match(r"(checkpoints\.\w+|text_encoder\.(path|tokenizer)): ", p) for p in before)
    assert all(any(p.endswith(f": {file}") for p in before) for file in example_files(config))
    for path in map(Path, sorted(example_files(config))):
        target = tmp_path / path
        if path.name == CONFIG_NAME:
            write_wan_folder(target.parent)
        elif str(path) in lora_files(config):  # LongLive's adapter: rank 1 on the 1.3B linears
            import torch

            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"generator_lora": random_lora(WanConfig(), rank=1)}, target)
        elif path.suffix in (".pt", ".pth"):
            write_torch_zip(target)
        elif path.name == "umt5-xxl":
            write_tokenizer(target)
    checked(config, tmp_path)
    assert set(config["prompts"]) == set(example(name)["prompts"])


# --- prompts_file ------------------------------------------------------------------------------

PROMPTS_TXT = (
    "# MovieGenVideoBench-style list: one prompt a line\n"
    "A majestic eagle soaring through a cloudy sky, cinematic lighting\n"
    "\n"
    "  A fishing boat leaves a foggy harbor at dawn  \n"
    "   # an indented comment\n"
    "Café au lait in a crème brûlée-colored cup, 4K!\n"
    "Supercalifragilisticexpialidociousandmuchlongerthanforty characters\n"
    "日本の桜\n"
)
NAMES = [
    "p000_a_majestic_eagle_soaring_through",
    "p001_a_fishing_boat_leaves_a",
    "p002_cafe_au_lait_in_a",
    "p003_supercalifragilisticexpialidociousandmuc",  # 40 characters at most
    "p004",
]


def test_a_prompts_file_gives_stable_unique_valid_names(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS_TXT)
    prompts = read_prompts_file(path)
    assert [p.name for p in prompts] == NAMES
    assert [p.line for p in prompts] == [2, 4, 6, 7, 8]
    assert prompts[1].text == "A fishing boat leaves a foggy harbor at dawn"  # stripped
    assert all(NAME_PATTERN.match(p.name) for p in prompts)
    assert read_prompts_file(path) == prompts  # the same file, the same names
    # The limit keeps the first prompts and their names.
    assert read_prompts_file(path, limit=2) == prompts[:2]
    # Windows line ends and a BOM change nothing.
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"\xef\xbb\xbf" + PROMPTS_TXT.replace("\n", "\r\n").encode())
    assert [p.name for p in read_prompts_file(crlf)] == NAMES


def test_names_stay_unique_and_sorted_past_a_thousand_prompts(tmp_path):
    path = tmp_path / "many.txt"
    path.write_text("a cat\n" * 1001)
    names = [p.name for p in read_prompts_file(path)]
    assert names[0] == "p0000_a_cat" and names[-1] == "p1000_a_cat"
    assert len(set(names)) == 1001 and names == sorted(names)
    # The width follows the whole file, not the limit.
    assert [p.name for p in read_prompts_file(path, limit=3)] == names[:3]
    assert prompt_file_name(7, "a cat") == "p007_a_cat"


def _demo_with_prompts_file(tmp_path: Path, text: str, **keys) -> dict:
    (tmp_path / "prompts.txt").write_text(text)
    config = copy.deepcopy(DEMO)
    config.update(prompts_file=str(tmp_path / "prompts.txt"), **keys)
    return config


def test_the_prompts_file_is_merged_before_the_rules_read_the_prompts(tmp_path):
    config = _demo_with_prompts_file(tmp_path, PROMPTS_TXT, prompts_limit=3)
    checked(config, REPO)
    # What rules/common.smk reads after check_config: PROMPTS = list(config["prompts"]).
    assert list(config["prompts"]) == ["eagle", "harbor", *NAMES[:3]]
    assert prompt_text(config, NAMES[2]) == "Café au lait in a crème brûlée-colored cup, 4K!"
    # Checked again (a job re-parsing the workflow): the same prompts.
    again = copy.deepcopy(config)
    checked(again, REPO)
    assert again["prompts"] == config["prompts"]
    # prompts may be left out, then the file's come alone.
    alone = _demo_with_prompts_file(tmp_path, PROMPTS_TXT)
    del alone["prompts"]
    alone["closed_loop"]["policies"] = []
    alone["capture"].pop("token_runs")  # the demo's runs name prompts of its own
    alone["figures"].pop("runs")
    assert list(checked(alone, REPO)["prompts"]) == NAMES


def test_repeated_prompt_texts_are_warned_naming_the_lines(tmp_path, capsys):
    """The same text on two lines (or a line repeating a `prompts` entry) makes two runs of one
    video: a warning names both places; the run goes on with both."""
    config = _demo_with_prompts_file(tmp_path, "A red fox\n# x\nA blue jay\nA red fox\n")
    config["prompts"]["jay"] = "A blue jay"
    config["closed_loop"]["policies"] = []
    capsys.readouterr()
    checked(config, REPO)
    err = capsys.readouterr().err
    path = tmp_path / "prompts.txt"
    assert (
        f"sinkscope: warning: {path} line 1 (p000_a_red_fox) and {path} line 4 "
        "(p002_a_red_fox) have the same text ('A red fox'): 2 runs of one video" in err
    )
    assert f"prompts.jay and {path} line 3 (p001_a_blue_jay) have the same text" in err
    assert {"p000_a_red_fox", "p002_a_red_fox", "jay", "p001_a_blue_jay"} <= set(config["prompts"])
    distinct = _demo_with_prompts_file(tmp_path, "A red fox\nA blue jay\n")
    distinct["closed_loop"]["policies"] = []
    checked(distinct, REPO)
    assert "same text" not in capsys.readouterr().err


def test_prompts_file_problems_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^prompts_file: .*prompts\.txt line 2 is named "):
        config = _demo_with_prompts_file(tmp_path, "# x\nA red fox\n")
        config["prompts"]["p000_a_red_fox"] = "another text"
        merge_prompts_file(config)
    empty = _demo_with_prompts_file(tmp_path, "# only comments\n\n")
    del empty["prompts"]
    assert problems_of(empty, REPO) == [
        f"prompts_file: {tmp_path}/prompts.txt: no prompts in it (only blank lines and lines "
        "starting with '#') and none under prompts"
    ]
    neither = copy.deepcopy(DEMO)
    del neither["prompts"]
    assert problems_of(neither, REPO) == [
        "prompts: none given; list them under prompts, or name a prompts_file"
    ]
    entity = _demo_with_prompts_file(tmp_path, "A red fox\n&nbsp;\n")
    (message,) = problems_of(entity, REPO)
    assert message.startswith(f"prompts.p001_nbsp (prompts_file {tmp_path}/prompts.txt, line 2): ")
    assert "is empty after Wan's prompt cleaning" in message
    latin1 = _demo_with_prompts_file(tmp_path, "")
    (tmp_path / "prompts.txt").write_bytes("Crème brûlée\n".encode("latin-1"))
    assert problems_of(latin1, REPO) == [
        f"prompts_file: {tmp_path}/prompts.txt: not UTF-8 text (byte 2: invalid continuation byte)"
    ]


@pytest.mark.parametrize(
    ("keys", "error", "message"),
    [
        ({"prompts_limit": 2}, WorkflowError, "'prompts_file' is a dependency of 'prompts_limit'"),
        ({"prompts_file": "p.txt", "prompts_limit": 0}, WorkflowError, "0 is less than"),
        ({"prompts_file": "p.txt", "prompts_limit": 2.0}, ConfigError, "prompts_limit: 2.0 must"),
        ({"prompts_file": ""}, WorkflowError, "should be non-empty"),
    ],
    ids=["limit-without-file", "zero-limit", "float-limit", "empty-path"],
)
def test_the_schema_and_the_checks_refuse_bad_prompts_file_keys(keys, error, message):
    config = copy.deepcopy(DEMO) | keys
    with pytest.raises(error, match=re.escape(message)):
        checked(config, REPO)


@pytest.mark.workflow
def test_a_dry_run_plans_one_encode_job_per_prompt_of_the_file(tmp_path):
    workdir = copy_workflow(tmp_path / "w")
    (workdir / "prompts.txt").write_text(PROMPTS_TXT)

    def use_the_file(config):
        del config["prompts"]
        config.update(prompts_file="prompts.txt", prompts_limit=2)
        config["closed_loop"]["runs"] = [["demo_a", NAMES[0]]]
        config["capture"]["token_runs"] = [["demo_a", NAMES[0]]]
        config["figures"]["runs"] = [["demo_a", NAMES[0]]]

    edit_config(workdir, use_the_file)
    jobs = planned_jobs(workdir)
    assert {w for rule, w in jobs if rule == "encode_prompt"} == {
        f"prompt={name}" for name in NAMES[:2]
    }
    assert not os.path.exists(workdir / "results")
