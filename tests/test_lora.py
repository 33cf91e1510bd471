"""LoRA adapters (`wan/lora.py`, `wan/lora_keys.py`): LongLive's PEFT files merged at load.

The reference is the unmerged computation: the base model with a forward hook on every adapted
linear that adds (alpha / r) x A^T B^T, as PEFT's LoRA layer does, on a random rank-4 adapter of
the demo model's 10 linears per block. Malformed files are refused naming the file and the key,
by the loader and, before any job runs, by the workflow's checks (no torch there: safetensors
headers and torch.save pickles read for their shapes only).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from sinkscope.extraction.sampling import Geometry, rollout
from sinkscope.wan.checkpoint import CheckpointError, load_wan_model, save_wan_model
from sinkscope.wan.config import WanConfig
from sinkscope.wan.demo import DEMO_MODEL
from sinkscope.wan.lora_keys import PEFT_PREFIX, lora_shapes, torch_file_shapes
from sinkscope.wan.model import WanModel
from sinkscope.wan.spec import CheckpointSpec
from sinkscope.workflow.entries import ConfigError
from sinkscope.workflow.params import extraction_settings

from .conftest import make_tiny_model
from .test_config import checked

DEMO = WanConfig(**DEMO_MODEL)
GEOMETRY = Geometry(num_frames=4, frames_per_block=2, latent_height=4, latent_width=6)
LINEARS = [f"{attention}.{name}" for attention in ("self_attn", "cross_attn") for name in "qkvo"]
LINEARS += ["ffn.0", "ffn.2"]
RANK, ALPHA = 4, 8.0


def random_lora(cfg: WanConfig = DEMO, rank: int = RANK, seed: int = 0, adapter_names=True):
    """PEFT keys -> tensors for every block's 10 linears (LongLive's set); every other block's
    keys carry PEFT's adapter name (`.lora_A.default.weight`), as some PEFT versions write."""
    g = torch.Generator().manual_seed(seed)
    shapes = cfg.linear_shapes()
    state = {}
    for block in range(cfg.num_layers):
        for linear in LINEARS:
            module = f"blocks.{block}.{linear}"
            out_features, in_features = shapes[module]
            name = ".default" if adapter_names and block % 2 else ""
            key = f"{PEFT_PREFIX}{module}.lora_{{}}{name}.weight"
            state[key.format("A")] = torch.randn(rank, in_features, generator=g) / in_features**0.5
            state[key.format("B")] = torch.randn(out_features, rank, generator=g) * 0.2
    return state


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora") / "base"
    save_wan_model(make_tiny_model(seed=3, cfg=DEMO), folder)
    return folder


def _latents(model) -> torch.Tensor:
    text = torch.randn(1, 6, DEMO.text_dim, generator=torch.Generator().manual_seed(5))
    return rollout(model, text, geometry=GEOMETRY, seed=1, progress=False)


def _unmerged(base, lora: dict[str, torch.Tensor], alpha: float):
    """The base model with each adapted linear's output plus (alpha / r) x A^T B^T."""
    model = load_wan_model(base)
    modules = dict(model.named_modules())
    for key, down in lora.items():
        if ".lora_A" not in key:
            continue
        module = key.removeprefix(PEFT_PREFIX).split(".lora_A")[0]
        up = lora[key.replace(".lora_A", ".lora_B")]
        scale = alpha / down.shape[0]

        def hook(_module, inputs, output, down=down, up=up, scale=scale):
            return output + scale * (inputs[0] @ down.T @ up.T)

        modules[module].register_forward_hook(hook)
    return model


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_the_merged_model_is_the_unmerged_adapter(tmp_path, base, fmt):
    lora = random_lora()
    path = tmp_path / f"lora.{fmt}"
    if fmt == "pt":
        torch.save({"generator_lora": lora}, path)  # LongLive's layout
    else:
        save_file(lora, str(path))
    merged = load_wan_model(CheckpointSpec(base=str(base), lora=str(path), lora_alpha=ALPHA))
    got, expected = _latents(merged), _latents(_unmerged(base, lora, ALPHA))
    plain = _latents(load_wan_model(base))
    relative = float((got - expected).norm() / expected.norm())
    assert relative < 1e-5, relative
    assert float((plain - expected).norm() / expected.norm()) > 1e-2  # the adapter does matter


def test_a_bare_state_dict_loads_and_alpha_scales(tmp_path, base):
    lora = random_lora(adapter_names=False)
    path = tmp_path / "bare.pt"
    torch.save(lora, path)
    merged = load_wan_model(CheckpointSpec(base=str(base), lora=str(path), lora_alpha=2.0))
    weight = load_wan_model(base).blocks[1].ffn[2].weight
    key = f"{PEFT_PREFIX}blocks.1.ffn.2.lora_{{}}.weight"
    expected = weight + 2.0 / RANK * lora[key.format("B")] @ lora[key.format("A")]
    torch.testing.assert_close(merged.blocks[1].ffn[2].weight, expected, rtol=0, atol=1e-6)


def _broken(kind: str) -> tuple[dict, str]:
    """A malformed adapter and the message (a regex) that must name what is wrong."""
    lora = random_lora(adapter_names=False)
    key = f"{PEFT_PREFIX}blocks.2.self_attn.k.lora_{{}}.weight"
    if kind == "no prefix":
        lora = {k.removeprefix(PEFT_PREFIX): v for k, v in lora.items()}
        return lora, r"key 'blocks\.0\.\S+' lacks PEFT's 'base_model\.model\.' prefix"
    if kind == "missing B":
        del lora[key.format("B")]
        return lora, rf"'{key.format('A')}' has no lora_B beside it"
    if kind == "rank mismatch":
        lora[key.format("B")] = lora[key.format("B")][:, :3].contiguous()
        return lora, rf"rank mismatch: '{key.format('A')}' \[4, 64\] has rank 4"
    if kind == "ranks differ":
        other = f"{PEFT_PREFIX}blocks.3.ffn.0.lora_{{}}.weight"
        lora[other.format("A")] = lora[other.format("A")][:2].contiguous()
        lora[other.format("B")] = lora[other.format("B")][:, :2].contiguous()
        return lora, rf"ranks differ \(2 at '{other.format('A')}', 4 at"
    if kind == "matches nothing":
        lora[f"{PEFT_PREFIX}blocks.7.self_attn.q.lora_A.weight"] = torch.zeros(4, 64)
        return lora, r"'base_model\.model\.blocks\.7\.self_attn\.q\.lora_A\.weight' adapts"
    if kind == "another width":
        return random_lora(WanConfig(**{**DEMO_MODEL, "dim": 32, "num_heads": 2})), (
            r"'base_model\.model\.blocks\.0\.cross_attn\.k\.lora_A\.weight' \[4, 32\] and .* do "
            r"not fit 'blocks\.0\.cross_attn\.k' \[64, 64\]"
        )
    if kind == "not a LoRA weight":
        lora[f"{PEFT_PREFIX}blocks.0.self_attn.q.weight"] = torch.zeros(64, 64)
        return lora, r"'base_model\.model\.blocks\.0\.self_attn\.q\.weight' is not a LoRA weight"
    raise AssertionError(kind)


BROKEN = [
    "no prefix",
    "missing B",
    "rank mismatch",
    "ranks differ",
    "matches nothing",
    "another width",
    "not a LoRA weight",
]


@pytest.mark.parametrize("kind", BROKEN)
def test_malformed_adapters_are_refused_naming_the_file_and_key(tmp_path, base, kind):
    lora, message = _broken(kind)
    path = tmp_path / "lora.pt"
    torch.save({"generator_lora": lora}, path)
    with pytest.raises(CheckpointError, match=rf"{path}: .*{message}"):
        load_wan_model(CheckpointSpec(base=str(base), lora=str(path), lora_alpha=ALPHA))


def _with_lora(base, path, alpha=ALPHA):
    def change(config):
        config["checkpoints"]["sf"] = {"base": str(base), "lora": str(path), "lora_alpha": alpha}
        config["capture"].update(survey=[0, 2])

    return change


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("kind", ["another width", "rank mismatch", "no prefix"])
def test_malformed_adapters_are_refused_before_any_job(tmp_path, base, kind, fmt):
    lora, message = _broken(kind)
    path = tmp_path / f"lora.{fmt}"
    if fmt == "pt":
        torch.save({"generator_lora": lora}, path)
    else:
        save_file(lora, str(path))
    with pytest.raises(ConfigError, match=rf"checkpoints\.sf\.lora: {path}: .*{message}"):
        checked(_with_lora(base, path))


def test_a_good_adapter_passes_the_checks_and_its_bytes_are_in_the_params(tmp_path, base):
    path = tmp_path / "lora.pt"
    torch.save({"generator_lora": random_lora()}, path)
    config = checked(_with_lora(base, path))
    params = extraction_settings(config, "sf", cache=tmp_path / "digests.json")
    assert params["checkpoint"]["lora"] == str(path) and params["checkpoint"]["lora_alpha"] == 8
    torch.save({"generator_lora": random_lora(seed=1)}, path)  # another adapter, same name
    changed = extraction_settings(config, "sf", cache=tmp_path / "digests.json")
    assert changed["checkpoint"]["sha256"] != params["checkpoint"]["sha256"]
    other_alpha = extraction_settings(
        checked(_with_lora(base, path, alpha=16)), "sf", cache=tmp_path / "digests.json"
    )
    assert other_alpha["checkpoint"]["lora_alpha"] == 16


def test_lora_and_alpha_go_together(tmp_path, base):
    def lora_only(config):
        config["checkpoints"]["sf"] = {"base": str(base), "lora": str(tmp_path / "x.pt")}

    with pytest.raises(Exception, match="lora_alpha"):
        checked(lora_only)
    with pytest.raises(ValueError, match="go together"):
        CheckpointSpec(base=str(base), lora_alpha=1.0)


def test_demo_checkpoints_take_no_lora(tmp_path):
    path = tmp_path / "lora.pt"
    torch.save(random_lora(), path)

    def change(config):
        config["checkpoints"]["demo_a"].update(lora=str(path), lora_alpha=1.0)

    with pytest.raises(ConfigError, match=r"checkpoints\.demo_a\.lora: a demo checkpoint takes no"):
        checked(change)


def test_shapes_of_a_torch_file_without_torch_match_torch_load(tmp_path):
    state = {"generator_lora": random_lora(), "other": {"x": torch.zeros(2, 3).bfloat16()}}
    path = tmp_path / "file.pt"
    torch.save(state, path)
    shapes = torch_file_shapes(path)
    loaded = torch.load(path, weights_only=True)
    expected = {k: tuple(v.shape) for k, v in loaded["generator_lora"].items()}
    assert lora_shapes(shapes, str(path)) == expected
    assert shapes["other"]["x"].shape == (2, 3)
    legacy = tmp_path / "legacy.pt"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert torch_file_shapes(legacy) is None  # the job's loader checks those
    opaque = tmp_path / "opaque.pt"
    torch.save({"generator_lora": Opaque()}, opaque)
    with pytest.raises(CheckpointError, match=r"opaque\.pt: cannot read its tensor shapes"):
        torch_file_shapes(opaque)


class Opaque:
    """A pickled object of a class: the shape reader refuses its global, as torch's
    weights_only loader does."""


@pytest.mark.parametrize("cfg", [DEMO, WanConfig()], ids=["demo", "1.3B"])
def test_the_linears_known_from_the_config_are_the_models(cfg):
    """What the checks before any job take for the model's linears (no model is built there)
    against the model's own 2-D weights."""
    with torch.device("meta"):
        model = WanModel(cfg)
    linears = {
        name.removesuffix(".weight"): tuple(param.shape)
        for name, param in model.named_parameters()
        if name.endswith(".weight") and param.dim() == 2
    }
    assert cfg.linear_shapes() == linears
