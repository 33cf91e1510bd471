"""Checkpoint formats against the reference implementation (diffusers' WanTransformer3DModel)."""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch
from safetensors.torch import save_file

from sinkscope.wan.checkpoint import (
    CheckpointError,
    CheckpointSpec,
    diffusers_to_wan_key,
    load_wan_model,
    read_generator,
    save_wan_model,
)
from sinkscope.wan.layout import INDEX_NAME, WEIGHTS_NAME, checkpoint_files, read_model_config
from sinkscope.workflow.entries import ConfigError, checkpoint_inputs

from .conftest import TINY, make_tiny_model
from .test_onboarding import WAN_13B_CONFIG

# The tests that import diffusers (3 s) keep to one xdist worker, which imports it once.
uses_diffusers = pytest.mark.xdist_group("diffusers")


def tiny_diffusers_model(seed: int = 0):
    # Imported here, not at collection: diffusers takes 3 s to import, in every xdist worker.
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=TINY.num_heads,
        attention_head_dim=TINY.head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=TINY.text_dim,
        freq_dim=TINY.freq_dim,
        ffn_dim=TINY.ffn_dim,
        num_layers=TINY.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    )
    with torch.no_grad():  # no zero-initialised tensors: every parameter must matter
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    return model.eval()


def _inputs(text_len: int = TINY.text_len):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 3, 4, 6, generator=g)
    text = torch.randn(1, text_len, TINY.text_dim, generator=g)
    return x, text


def padded(text: torch.Tensor, length: int = 512) -> torch.Tensor:
    """What diffusers' WanPipeline hands its transformer: the prompt zero-padded to 512 tokens."""
    return torch.nn.functional.pad(text, (0, 0, 0, length - text.shape[1]))


@uses_diffusers
@pytest.mark.parametrize("layout", ["transformer", "pipeline"])
def test_diffusers_folder_matches_diffusers_forward(tmp_path, layout):
    reference = tiny_diffusers_model()
    folder = tmp_path / "transformer" if layout == "transformer" else tmp_path / "pipe"
    if layout == "pipeline":
        reference.save_pretrained(folder / "transformer")
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    else:
        reference.save_pretrained(folder)
    model = load_wan_model(folder)
    assert model.config.dim == TINY.dim and model.config.num_layers == TINY.num_layers
    x, text = _inputs()
    for timestep in (1000.0, 937.5, 0.0):
        with torch.no_grad():
            want = reference(x, torch.tensor([timestep]), padded(text), return_dict=False)[0]
            got = model(x, torch.full((1, 3), timestep), text)
        assert (got - want).abs().max() <= 1e-4, timestep
        assert want.abs().max() > 0.1  # the comparison is not between two near-zero outputs


@uses_diffusers
def test_resaved_in_original_layout_gives_the_same_numbers(tmp_path):
    tiny_diffusers_model().save_pretrained(tmp_path / "diffusers")
    model = load_wan_model(tmp_path / "diffusers")
    save_wan_model(model, tmp_path / "wan")
    config = json.loads((tmp_path / "wan" / "config.json").read_text())
    assert config["_class_name"] == "WanModel" and config["dim"] == TINY.dim
    again = load_wan_model(tmp_path / "wan")
    x, text = _inputs()
    t = torch.full((1, 3), 500.0)
    assert torch.equal(model(x, t, text), again(x, t, text))
    assert set(again.state_dict()) == set(make_tiny_model().state_dict())


@uses_diffusers
def test_every_diffusers_key_maps_to_an_original_key():
    reference = tiny_diffusers_model()
    mapped = {diffusers_to_wan_key(k) for k in reference.state_dict()}
    assert mapped == set(make_tiny_model().state_dict())
    assert diffusers_to_wan_key("blocks.3.norm2.weight") == "blocks.3.norm3.weight"
    assert diffusers_to_wan_key("blocks.0.attn1.to_out.0.bias") == "blocks.0.self_attn.o.bias"
    assert diffusers_to_wan_key("scale_shift_table") == "head.modulation"
    assert diffusers_to_wan_key("blocks.1.scale_shift_table") == "blocks.1.modulation"


def test_sharded_original_layout(tmp_path):
    model = make_tiny_model(seed=2)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    weight_map = {}
    for name, shard_keys in shards.items():
        save_file({k: state[k] for k in shard_keys}, str(folder / name))
        weight_map.update(dict.fromkeys(shard_keys, name))
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_wan_model(folder)
    for key, value in state.items():
        assert torch.equal(loaded.state_dict()[key], value), key
    files = [p.name for p in checkpoint_files(folder)]
    assert files == ["config.json", INDEX_NAME, *sorted(shards)]


def _generator_file(path, **entries):
    torch.save(
        {name: {f"model.{k}": v for k, v in m.state_dict().items()} for name, m in entries.items()},
        path,
    )


def test_self_forcing_pt_chooses_ema_or_generator(tmp_path):
    base = tmp_path / "base"
    save_wan_model(make_tiny_model(seed=0), base)
    ema, raw = make_tiny_model(seed=1), make_tiny_model(seed=2)
    pt = tmp_path / "self_forcing_dmd.pt"
    _generator_file(pt, generator_ema=ema, generator=raw)
    for use_ema, want in ((True, ema), (False, raw)):
        loaded = load_wan_model(CheckpointSpec(str(base), str(pt), use_ema))
        for key, value in want.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), key
    # CausVid: model.pt with `generator` only; asking for EMA names what the file has.
    causvid = tmp_path / "model.pt"
    _generator_file(causvid, generator=raw)
    load_wan_model(CheckpointSpec(str(base), str(causvid), ema=False))
    with pytest.raises(CheckpointError, match=r"no 'generator_ema' entry.*\['generator'\]"):
        load_wan_model(CheckpointSpec(str(base), str(causvid), ema=True))
    # Only the base config and the .pt define such a checkpoint.
    assert checkpoint_files(base, pt) == [base / "config.json", pt]


def _fsdp_key(key: str) -> str:
    """A parameter name as an FSDP-wrapped generator saves it (Rolling Forcing's
    `rolling_forcing_dmd.pt`): the wrapper, the DiT and each of its blocks wrapped."""
    key = re.sub(r"^(blocks\.\d+\.)", r"\1_fsdp_wrapped_module.", key)
    return f"_fsdp_wrapped_module.model._fsdp_wrapped_module.{key}"


def test_fsdp_wrapped_keys_load_to_the_same_weights(tmp_path):
    base = tmp_path / "base"
    save_wan_model(make_tiny_model(seed=0), base)
    ema, raw = make_tiny_model(seed=1), make_tiny_model(seed=2)
    clean, wrapped = tmp_path / "clean.pt", tmp_path / "rolling_forcing_dmd.pt"
    _generator_file(clean, generator_ema=ema, generator=raw)
    torch.save(
        {
            "generator_ema": {_fsdp_key(k): v for k, v in ema.state_dict().items()},
            "generator": {f"model.{k}": v for k, v in raw.state_dict().items()},
        },
        wrapped,
    )
    state = torch.load(wrapped)["generator_ema"]
    assert (
        "_fsdp_wrapped_module.model._fsdp_wrapped_module.blocks.0._fsdp_wrapped_module."
        "self_attn.q.weight" in state
    )
    for use_ema in (True, False):
        want = load_wan_model(CheckpointSpec(str(base), str(clean), use_ema)).state_dict()
        got = load_wan_model(CheckpointSpec(str(base), str(wrapped), use_ema)).state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    # Errors still name the file and the key: a missing parameter by its DiT name, and two keys
    # that clean to one name by both.
    state.pop(_fsdp_key("blocks.1.ffn.0.bias"))
    torch.save({"generator_ema": state}, tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match=r"missing\.pt \(generator_ema\).*\['blocks.1.ffn.0"):
        load_wan_model(CheckpointSpec(str(base), str(tmp_path / "missing.pt")))
    state["model.head.head.bias"] = ema.state_dict()["head.head.bias"]
    torch.save({"generator_ema": state}, tmp_path / "twice.pt")
    with pytest.raises(
        CheckpointError,
        match=r"twice\.pt: 'generator_ema' holds '_fsdp_wrapped_module\.model\._fsdp_wrapped_"
        r"module\.head\.head\.bias' and 'model\.head\.head\.bias', both the DiT's 'head\.head",
    ):
        read_generator(tmp_path / "twice.pt")


class Payload:
    """A class only a full unpickler can rebuild: weights_only=True must refuse it."""

    def __reduce__(self):
        return (print, ("code ran",))


# The legacy pickle is written with protocol 4, which torch's weights_only unpickler warns about
# before it refuses the payload.
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("writer", ["torch.save", "legacy-pickle"])
def test_pickles_with_code_are_refused(tmp_path, capsys, writer):
    evil = tmp_path / "evil.pt"
    if writer == "torch.save":
        torch.save({"generator_ema": Payload()}, evil)
    else:
        with open(evil, "wb") as handle:
            pickle.dump({"generator_ema": Payload()}, handle)
    with pytest.raises(CheckpointError, match=r"evil\.pt: refused to unpickle"):
        read_generator(evil)
    assert "code ran" not in capsys.readouterr().out


def test_truncated_and_mismatched_files_fail_naming_the_problem(tmp_path):
    base = tmp_path / "base"
    model = make_tiny_model()
    save_wan_model(model, base)
    weights = base / WEIGHTS_NAME
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((base / "config.json").read_text())
    (truncated / WEIGHTS_NAME).write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"truncated/diffusion_pytorch_model\.safetensors"):
        load_wan_model(truncated)

    pt = tmp_path / "short.pt"
    _generator_file(pt, generator_ema=model)
    (tmp_path / "cut.pt").write_bytes(pt.read_bytes()[:-200])
    with pytest.raises(CheckpointError, match=r"cut\.pt"):
        read_generator(tmp_path / "cut.pt")

    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.pop("model.blocks.1.ffn.0.bias")
    state["model.blocks.9.extra.weight"] = torch.zeros(1)
    torch.save({"generator_ema": state}, tmp_path / "keys.pt")
    with pytest.raises(
        CheckpointError,
        match=r"missing \['blocks.1.ffn.0.bias'\].*unexpected \['blocks.9.extra.weight'\]",
    ):
        load_wan_model(CheckpointSpec(str(base), str(tmp_path / "keys.pt")))

    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state["model.head.head.weight"] = torch.zeros(3, 3)
    torch.save({"generator_ema": state}, tmp_path / "shapes.pt")
    with pytest.raises(CheckpointError, match=r"wrong shapes: \['head.head.weight: file \[3, 3\]"):
        load_wan_model(CheckpointSpec(str(base), str(tmp_path / "shapes.pt")))


def test_real_1_3b_configs_of_both_formats(tmp_path):
    wan = tmp_path / "wan"
    wan.mkdir()
    # Wan2.1-T2V-1.3B's config.json: text_dim, patch_size, qk_norm fall back to WanModel defaults.
    (wan / "config.json").write_text(json.dumps(WAN_13B_CONFIG))
    diff = tmp_path / "diffusers"
    diff.mkdir()
    (diff / "config.json").write_text(
        json.dumps(
            {
                "_class_name": "WanTransformer3DModel",
                "patch_size": [1, 2, 2],
                "num_attention_heads": 12,
                "attention_head_dim": 128,
                "in_channels": 16,
                "out_channels": 16,
                "text_dim": 4096,
                "freq_dim": 256,
                "ffn_dim": 8960,
                "num_layers": 30,
                "cross_attn_norm": True,
                "qk_norm": "rms_norm_across_heads",
                "eps": 1e-06,
                "image_dim": None,
                "added_kv_proj_dim": None,
                "rope_max_seq_len": 1024,
            }
        )
    )
    assert read_model_config(wan) == read_model_config(diff)
    assert read_model_config(wan).head_dim == 128 and read_model_config(wan).text_dim == 4096


def test_config_names_missing_checkpoint_files(tmp_path):
    config = {"checkpoints": {"sf": {"base": str(tmp_path / "nowhere")}}, "demo": {}}
    assert checkpoint_inputs(config, "sf")[0].endswith("nowhere/config.json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / INDEX_NAME).write_text("{not json")
    (tmp_path / "bad" / "config.json").write_text("{}")
    config["checkpoints"]["sf"]["base"] = str(tmp_path / "bad")
    with pytest.raises(ConfigError, match=r"checkpoints.sf: .*index.json: not a safetensors index"):
        checkpoint_inputs(config, "sf")
