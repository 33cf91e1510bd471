"""LoRA adapters (`wan/lora.py`, `wan/lora_keys.py`): LongLive's PEFT files, run unmerged.

The references, on a random rank-4 adapter of the demo model's 10 linears per block: the base
model with a forward hook on every adapted linear that adds (alpha / r) x A^T B^T; PEFT's
`lora.Linear` written out with explicit bfloat16 roundings (base output, A x, B A x, the scale,
the sum), which an adapted linear of a bfloat16 model matches bit for bit where the merged weight
W + (alpha / r) B A does not; and in float32 that merged weight, computed here from the files,
which the whole model matches to float32 rounding. Malformed files are refused naming the file
and the key, by the loader and, before any job runs, by the workflow's checks (no torch there:
safetensors headers and torch.save pickles read for their shapes only).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from sinkscope.extraction.sampling import Geometry, rollout
from sinkscope.wan.checkpoint import CheckpointError, load_wan_model, save_wan_model
from sinkscope.wan.config import WanConfig
from sinkscope.wan.demo import DEMO_MODEL
from sinkscope.wan.layout import WEIGHTS_NAME
from sinkscope.wan.lora import LoraLinear
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


def _latents(model, dtype=torch.float32) -> torch.Tensor:
    text = torch.randn(1, 6, DEMO.text_dim, generator=torch.Generator().manual_seed(5))
    return rollout(model, text, geometry=GEOMETRY, seed=1, dtype=dtype, progress=False)


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
def test_the_loaded_adapter_is_the_hooked_adapter(tmp_path, base, fmt):
    lora = random_lora()
    path = tmp_path / f"lora.{fmt}"
    if fmt == "pt":
        torch.save({"generator_lora": lora}, path)  # LongLive's layout
    else:
        save_file(lora, str(path))
    adapted = load_wan_model(CheckpointSpec(base=str(base), lora=str(path), lora_alpha=ALPHA))
    got, expected = _latents(adapted), _latents(_unmerged(base, lora, ALPHA))
    plain = _latents(load_wan_model(base))
    relative = float((got - expected).norm() / expected.norm())
    assert relative < 1e-5, relative
    assert float((plain - expected).norm() / expected.norm()) > 1e-2  # the adapter does matter


def test_a_bare_state_dict_loads_and_alpha_scales(tmp_path, base):
    lora = random_lora(adapter_names=False)
    path = tmp_path / "bare.pt"
    torch.save(lora, path)
    adapted = load_wan_model(CheckpointSpec(base=str(base), lora=str(path), lora_alpha=2.0))
    plain = load_wan_model(base).blocks[1].ffn[2]
    key = f"{PEFT_PREFIX}blocks.1.ffn.2.lora_{{}}.weight"
    merged = plain.weight + 2.0 / RANK * lora[key.format("B")] @ lora[key.format("A")]
    layer = adapted.blocks[1].ffn[2]
    assert layer.scaling == 2.0 / RANK and torch.equal(layer.weight, plain.weight)
    x = torch.randn(3, 5, DEMO.ffn_dim, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x), F.linear(x, merged, plain.bias), rtol=0, atol=1e-5)


def _adapters(lora: dict[str, torch.Tensor]):
    """(module, A, B) of each adapted linear of a LoRA state dict."""
    for key, down in lora.items():
        if ".lora_A" in key:
            module = key.removeprefix(PEFT_PREFIX).split(".lora_A")[0]
            yield module, down, lora[key.replace(".lora_A", ".lora_B")]


def _peft_bfloat16(x, weight, bias, down, up, scaling):
    """PEFT's `lora.Linear.forward` in a pipeline cast to bfloat16, every rounding written out:
    W, b, A, B and x stored in bfloat16; the base linear, A x and B (A x) each one bfloat16
    matmul (float32 accumulation, one rounding); then the scale and the sum, each computed in
    float32 from bfloat16 operands and rounded back."""
    bf16 = torch.bfloat16
    x, weight, bias, down, up = (t.to(bf16) for t in (x, weight, bias, down, up))
    base = F.linear(x, weight, bias)
    low = F.linear(x, down)
    high = F.linear(low, up)
    scaled = (high.float() * scaling).to(bf16)
    return (base.float() + scaled.float()).to(bf16)


def _merged_bfloat16(x, weight, bias, down, up, scaling):
    """The weight merged in float32, W + scaling B A, rounded to bfloat16 once."""
    merged = (weight.float() + scaling * up.float() @ down.float()).to(torch.bfloat16)
    return F.linear(x.to(torch.bfloat16), merged, bias.to(torch.bfloat16))


@pytest.mark.parametrize("alpha", [ALPHA, 3.0], ids=["scale 2", "scale 0.75"])
@pytest.mark.parametrize(
    "module", ["blocks.0.self_attn.q", "blocks.1.cross_attn.v", "blocks.3.ffn.0"]
)
def test_in_bfloat16_an_adapted_linear_rounds_as_peft_does(tmp_path, base, module, alpha):
    lora = random_lora()
    path = tmp_path / "lora.pt"
    torch.save({"generator_lora": lora}, path)
    spec = CheckpointSpec(base=str(base), lora=str(path), lora_alpha=alpha)
    layer = load_wan_model(spec, dtype=torch.bfloat16).get_submodule(module)
    assert isinstance(layer, LoraLinear)
    files = load_file(str(base / WEIGHTS_NAME))
    named = int(module.split(".")[1]) % 2  # random_lora's odd blocks carry '.default'
    key = f"{PEFT_PREFIX}{module}.lora_{{}}{'.default' if named else ''}"
    weights = (
        files[f"{module}.weight"],
        files[f"{module}.bias"],
        lora[key.format("A") + ".weight"],
        lora[key.format("B") + ".weight"],
        alpha / RANK,
    )
    x = torch.randn(2, 37, layer.in_features, generator=torch.Generator().manual_seed(4))
    got = layer(x.bfloat16())
    expected = _peft_bfloat16(x, *weights)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    merged = _merged_bfloat16(x, *weights)
    differ = float((merged != expected).float().mean())
    largest = float((merged.float() - expected.float()).abs().max() / expected.float().abs().max())
    print(f"{module} alpha {alpha}: merged differs in {differ:.0%}, by up to {largest:.1e}")
    assert differ > 0.05 and largest > 1e-3  # the merged weight is not what the release runs


def _hooked_bfloat16(base, lora: dict[str, torch.Tensor], alpha: float):
    """The bfloat16 base model with PEFT's adapter (`_peft_bfloat16`'s roundings) added to each
    adapted linear's output by a forward hook."""
    model = load_wan_model(base, dtype=torch.bfloat16)
    modules = dict(model.named_modules())
    for module, down, up in _adapters(lora):
        down, up, scale = down.bfloat16(), up.bfloat16(), alpha / down.shape[0]

        def hook(_module, inputs, output, down=down, up=up, scale=scale):
            high = F.linear(F.linear(inputs[0], down), up)
            return (output.float() + (high.float() * scale).bfloat16().float()).bfloat16()

        modules[module].register_forward_hook(hook)
    return model


def _merged(base, lora: dict[str, torch.Tensor], alpha: float, dtype=torch.float32):
    """The base model with W + (alpha / r) B A in every adapted linear, from the files, merged
    in float32 and then cast to `dtype` (what sinkscope's loader did before)."""
    model = load_wan_model(base)
    for module, down, up in _adapters(lora):
        model.get_submodule(module).weight.add_(alpha / down.shape[0] * up @ down)
    return model.to(dtype)


def test_the_whole_model_runs_the_adapter_as_the_release_does(tmp_path, base):
    """In float32 the unmerged adapter is the merged weight to float32 rounding; in bfloat16 the
    whole rollout is PEFT's bit for bit, and the merged weight's is not."""
    lora = random_lora()
    path = tmp_path / "lora.pt"
    torch.save({"generator_lora": lora}, path)
    spec = CheckpointSpec(base=str(base), lora=str(path), lora_alpha=ALPHA)
    got, merged = _latents(load_wan_model(spec)), _latents(_merged(base, lora, ALPHA))
    float32 = float((got - merged).norm() / merged.norm())
    assert float32 < 1e-5, float32
    bf16 = torch.bfloat16
    got = _latents(load_wan_model(spec, dtype=bf16), bf16)
    assert torch.equal(got, _latents(_hooked_bfloat16(base, lora, ALPHA), bf16))
    merged = _latents(_merged(base, lora, ALPHA, bf16), bf16)
    relative = float((got - merged).norm() / merged.norm())
    print(f"merged vs unmerged latents, relative: float32 {float32:.1e}, bfloat16 {relative:.1e}")
    assert relative > 1e-4, relative


def test_the_adapted_model_keeps_the_base_names_and_is_not_saved(tmp_path, base):
    path = tmp_path / "lora.safetensors"
    save_file(random_lora(), str(path))
    spec = CheckpointSpec(base=str(base), lora=str(path), lora_alpha=ALPHA)
    model = load_wan_model(spec, dtype=torch.bfloat16)
    adapters = {
        f"blocks.{block}.{linear}.lora_{half}.weight"
        for block in range(DEMO.num_layers)
        for linear in LINEARS
        for half in "AB"
    }
    state = model.state_dict()
    assert set(state) == set(load_wan_model(base).state_dict()) | adapters
    assert {value.dtype for value in state.values()} == {torch.bfloat16}  # cast like the rest
    assert state["blocks.0.self_attn.q.lora_A.weight"].shape == (RANK, DEMO.dim)
    weight = model.blocks[0].self_attn.q.weight
    assert weight.data_ptr() == state["blocks.0.self_attn.q.weight"].data_ptr()
    out = tmp_path / "saved"
    with pytest.raises(CheckpointError, match=r"carries a LoRA on 40 linears \('blocks\.0\."):
        save_wan_model(model, out)
    assert not out.exists()


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
