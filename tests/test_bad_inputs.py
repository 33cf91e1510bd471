"""Careless and hostile input: each case is the input, the message fragment it must fail (or
warn) with, and that nothing that looks complete is left behind. Config problems fail while
Snakemake parses, before any job writes anything (tests/test_workflow.py shows that end to end);
kills are in tests/test_kills.py, corrupted stores in tests/test_corruption.py, disk space in
tests/test_capture.py, stale checkpoint digests in tests/test_digest.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from snakemake.exceptions import WorkflowError

from sinkscope.wan.checkpoint import CheckpointError, read_generator
from sinkscope.wan.layout import CONFIG_NAME, WEIGHTS_NAME
from sinkscope.workflow.checks import check_config_files
from sinkscope.workflow.entries import ConfigError

from .test_config import checked

SCHEMA_OR_CHECK = (ConfigError, WorkflowError)  # the schema, or check_config


@pytest.mark.parametrize(
    ("section", "name"),
    [
        ("checkpoints", ".."),
        ("checkpoints", "."),
        ("checkpoints", ".hidden"),
        ("checkpoints", "-rf"),
        ("checkpoints", "a/b"),
        ("checkpoints", "compare"),
        ("checkpoints", "summary.csv"),
        ("prompts", ".."),
        ("prompts", "../eagle"),
        ("demo", "text_encoder"),
    ],
)
def test_names_that_would_leave_their_folder_or_hit_another_output(section, name):
    def change(config):
        if section == "checkpoints":
            config["checkpoints"][name] = config["checkpoints"]["demo_a"]
        elif section == "prompts":
            config["prompts"][name] = "a fox"
        else:
            config["demo"]["checkpoints"][name] = 3

    with pytest.raises(SCHEMA_OR_CHECK) as raised:
        checked(change)
    assert repr(name) in str(raised.value) or name in str(raised.value)


def test_the_name_check_itself_names_the_name():
    """The schema refuses these first; check_config says it in words too (for callers without
    the schema)."""
    from sinkscope.workflow.checks import _check_names

    config = checked()
    config["prompts"][".."] = "a fox"
    with pytest.raises(ConfigError, match=r"prompts: name '\.\.' is not a safe file name"):
        _check_names(config)
    config = checked()
    config["checkpoints"]["compare"] = config["checkpoints"]["demo_a"]
    with pytest.raises(ConfigError, match="'compare' is taken by an output"):
        _check_names(config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "checkpoints:\n  demo_a: {base: results/demo/demo_a}\n"
            "  demo_a: {base: results/demo/demo_b}\n",
            "key 'demo_a' given twice, at lines 2 and 3",
        ),
        (
            "prompts:\n  eagle: a\n  fox: b\n  eagle: c\n",
            "key 'eagle' given twice, at lines 2 and 4",
        ),
        (
            "video: {num_frames: 21, num_frames: 9}\n",
            "key 'num_frames' given twice, at lines 1 and 1",
        ),
    ],
)
def test_duplicate_yaml_keys(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}: {message}"):
        check_config_files([path])
    (tmp_path / "fine.yaml").write_text("prompts:\n  eagle: a\n  fox: b\n")
    check_config_files([tmp_path / "fine.yaml"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["prompts"].update(blank="&nbsp;"), "prompts.blank: '&nbsp;' is empty after"),
        (lambda c: c["prompts"].update(tag="&amp;nbsp; \n"), "prompts.tag: "),
        (lambda c: c.update(layers=[1.0]), "layers[0]: 1.0 must be an integer"),
        (lambda c: c["figures"].update(heads=[[0, 1.0]]), "figures.heads[0][1]: 1.0 must be an"),
        (lambda c: c["video"].update(num_frames=21.0), "video.num_frames: 21.0 must be an integer"),
        (lambda c: c.update(seed=42.0), "seed: 42.0 must be an integer"),
    ],
    ids=["nbsp-prompt", "entity-prompt", "float-layer", "float-head", "float-frames", "float-seed"],
)
def test_config_values_that_would_be_changed_without_a_word(change, message):
    with pytest.raises(ConfigError) as raised:
        checked(change)
    assert message in str(raised.value)


def test_a_generator_entry_that_is_not_a_state_dict(tmp_path):
    path = tmp_path / "self_forcing.pt"
    torch.save({"generator_ema": torch.zeros(3), "generator": {"model.x": torch.zeros(1)}}, path)
    with pytest.raises(CheckpointError, match=rf"{path}: 'generator_ema' is a Tensor, not a state"):
        read_generator(path, ema=True)
    torch.save({"generator_ema": {"model.x": "text"}}, path)
    with pytest.raises(CheckpointError, match=rf"{path}: 'generator_ema' is a dict, not a state"):
        read_generator(path, ema=True)


def _checkpoint_folder(root, **config) -> str:
    root.mkdir(parents=True)
    values = {"_class_name": "WanModel", "num_layers": 30, **config}
    (root / CONFIG_NAME).write_text(json.dumps(values))
    # A safetensors file with no tensors: parsing reads its header only.
    (root / WEIGHTS_NAME).write_bytes((2).to_bytes(8, "little") + b"{}")
    return str(root)


def _with_checkpoint(base):
    """The demo config and a user checkpoint `sf`, of another depth: so the survey is a list."""

    def change(config):
        config["checkpoints"].update(sf={"base": base})
        config["capture"].update(survey=[0, 2])

    return change


def test_num_heads_against_what_the_checkpoint_fixes(tmp_path, capsys):
    wrong = _checkpoint_folder(
        tmp_path / "wrong", dim=1536, ffn_dim=8960, num_heads=24, text_dim=32
    )
    with pytest.raises(ConfigError) as raised:
        checked(_with_checkpoint(wrong))
    message = str(raised.value)
    assert f"checkpoints.sf.base: {wrong}/config.json: num_heads=24" in message
    assert "every Wan2.1 model of dim 1536 has 12 heads" in message
    # A width no released model has: num_heads cannot be decided, so a warning, not an error.
    odd = _checkpoint_folder(tmp_path / "odd", dim=1024, ffn_dim=4096, num_heads=16, text_dim=32)
    checked(_with_checkpoint(odd))
    err = capsys.readouterr().err
    assert f"warning: checkpoints.sf.base: {odd}/config.json: num_heads=16 gives head_dim=64" in err
    # It says which count it used and how to check it.
    assert "sinkscope uses num_heads=16 as given" in err
    assert "Check num_heads against the configuration the model was trained with" in err
    right = _checkpoint_folder(
        tmp_path / "right", dim=1536, ffn_dim=8960, num_heads=12, text_dim=32
    )
    checked(_with_checkpoint(right))
    assert "warning" not in capsys.readouterr().err
    assert not os.path.exists("results/demo/sf")
