"""UMT5 prompt encoding: Wan's .pth loaded onto transformers, prompt cleaning, embedding files."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sinkscope.wan.text import (
    clean_prompt,
    encode_prompt,
    load_prompt_embedding,
    load_wan_umt5,
    make_demo_text_encoder,
    save_prompt_embedding,
    wan_umt5_config,
    wan_umt5_key_map,
)

# Most of these import transformers (2-3 s): one xdist worker imports it once.
pytestmark = pytest.mark.xdist_group("transformers")

# transformers UMT5EncoderModel key -> Wan key, written from the table in the reference (section 6)
# independently of the loader's own map. `encoder.embed_tokens.weight` is tied to `shared.weight`.
HF_TO_WAN = [
    (r"shared\.weight", r"token_embedding.weight"),
    (r"encoder\.block\.(\d+)\.layer\.0\.layer_norm\.weight", r"blocks.\1.norm1.weight"),
    (
        r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.([qkvo])\.weight",
        r"blocks.\1.attn.\2.weight",
    ),
    (
        r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.weight",
        r"blocks.\1.pos_embedding.embedding.weight",
    ),
    (r"encoder\.block\.(\d+)\.layer\.1\.layer_norm\.weight", r"blocks.\1.norm2.weight"),
    (
        r"encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_0\.weight",
        r"blocks.\1.ffn.gate.0.weight",
    ),
    (r"encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_1\.weight", r"blocks.\1.ffn.fc1.weight"),
    (r"encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wo\.weight", r"blocks.\1.ffn.fc2.weight"),
    (r"encoder\.final_layer_norm\.weight", r"norm.weight"),
]


def export_to_wan(model) -> dict[str, torch.Tensor]:
    """A transformers UMT5 encoder's weights under Wan's key names."""
    state = model.state_dict()
    assert torch.equal(state.pop("encoder.embed_tokens.weight"), state["shared.weight"])
    wan = {}
    for key, tensor in state.items():
        renamed = [re.sub(pat, rep, key) for pat, rep in HF_TO_WAN if re.fullmatch(pat, key)]
        assert len(renamed) == 1, f"no Wan name for {key}"
        wan[renamed[0]] = tensor.detach().clone()
    return wan


def make_tiny_umt5(seed: int = 0):
    """A tiny UMT5 encoder with every tensor random (layer norms and relative biases included),
    so that any two weights swapped by a key map change the output."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=120,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        layer_norm_epsilon=1e-6,
    )
    model = UMT5EncoderModel(config).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(1 + 0.2 * noise if "layer_norm" in name else 0.3 * noise)
    return model


def ids_and_mask() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, 120, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # second row padded, as encode_prompt's padding="max_length" does
    ids[1, 7:] = 0
    return ids, mask


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_wan_pth_matches_transformers(tmp_path, file_dtype):
    model = make_tiny_umt5()
    wan = {key: tensor.to(file_dtype) for key, tensor in export_to_wan(model).items()}
    path = tmp_path / "umt5.pth"
    torch.save(wan, path)
    if file_dtype != torch.float32:
        # Reference: the same model with the weights rounded as the file stores them.
        for param in model.parameters():
            param.copy_(param.to(file_dtype).float())

    loaded = load_wan_umt5(path)
    config = loaded.config
    assert (config.vocab_size, config.d_model, config.d_kv, config.d_ff) == (120, 32, 8, 48)
    assert (config.num_layers, config.num_heads, config.relative_attention_num_buckets) == (
        2,
        4,
        32,
    )
    assert loaded.shared.weight is loaded.encoder.embed_tokens.weight
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in loaded.parameters())
    assert all(b.device.type == "cpu" for b in loaded.buffers())
    ids, mask = ids_and_mask()
    want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    got = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (got - want).abs().max().item() <= 1e-5

    as_bf16 = load_wan_umt5(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in as_bf16.parameters())


def test_encode_prompt_pth_equals_directory(tmp_path, caplog):
    from transformers import AutoTokenizer, UMT5EncoderModel

    demo = tmp_path / "demo"
    make_demo_text_encoder(demo, d_model=32, num_layers=2, num_heads=4)
    pth = tmp_path / "umt5.pth"
    torch.save(export_to_wan(UMT5EncoderModel.from_pretrained(str(demo))), pth)
    prompt = "  A red fox\n\truns, at dawn.  "

    via_dir, length, prompt_tokens = encode_prompt(prompt, demo, text_len=24)
    via_pth, pth_length, _ = encode_prompt(prompt, pth, tokenizer_dir=demo, text_len=24)

    tokenizer = AutoTokenizer.from_pretrained(str(demo))
    ids = tokenizer(clean_prompt(prompt)).input_ids
    assert ids[-1] == tokenizer.eos_token_id
    assert length == pth_length == prompt_tokens == len(ids) < 24
    assert via_dir.shape == via_pth.shape == (24, 32)
    assert via_dir.dtype == via_pth.dtype == torch.float32
    torch.testing.assert_close(via_pth, via_dir, rtol=0, atol=1e-6)
    assert torch.all(via_pth[length:] == 0)
    assert torch.all(via_pth[:length].abs().sum(dim=1) > 0)

    # Wan's cleaning happens inside encode_prompt: the messy prompt encodes as the clean one.
    clean, clean_length, _ = encode_prompt(
        "A red fox runs, at dawn.", pth, tokenizer_dir=demo, text_len=24
    )
    assert clean_length == length
    torch.testing.assert_close(clean, via_pth, rtol=0, atol=0)

    # Truncated to text_len tokens, EOS kept as the last one: no padded rows; said in the log,
    # or an error when asked for.
    long_ids = tokenizer(clean_prompt(prompt * 4)).input_ids
    with caplog.at_level(logging.WARNING, logger="sinkscope.wan.text"):
        truncated, truncated_length, full = encode_prompt(
            prompt * 4, pth, tokenizer_dir=demo, text_len=8
        )
    assert truncated_length == 8 and full == len(long_ids) > 8
    assert torch.all(truncated.abs().sum(dim=1) > 0)
    lost = tokenizer.decode(long_ids[7:-1], skip_special_tokens=True)
    (record,) = caplog.records
    assert f"prompt of {len(long_ids)} tokens" in record.message and repr(lost) in record.message
    with pytest.raises(ValueError, match=r"longer than text_len=8.*truncate: error"):
        encode_prompt(prompt * 4, pth, tokenizer_dir=demo, text_len=8, on_truncate="error")
    with pytest.raises(ValueError, match="empty after Wan's cleaning"):
        encode_prompt("&amp;nbsp;", pth, tokenizer_dir=demo, text_len=8)

    with pytest.raises(ValueError, match=rf"{re.escape(str(pth))}.*tokenizer_dir"):
        encode_prompt(prompt, pth, text_len=24)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "absent"))):
        encode_prompt(prompt, tmp_path / "absent", text_len=24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_encode_prompt_pth_on_cuda_is_bf16_close(tmp_path):
    from transformers import UMT5EncoderModel

    demo = tmp_path / "demo"
    make_demo_text_encoder(demo, d_model=32, num_layers=2, num_heads=4)
    pth = tmp_path / "umt5.pth"
    torch.save(export_to_wan(UMT5EncoderModel.from_pretrained(str(demo))), pth)
    on_cpu, length, _ = encode_prompt("a fox", pth, tokenizer_dir=demo, text_len=16)
    on_cuda, cuda_length, _ = encode_prompt(
        "a fox", pth, tokenizer_dir=demo, text_len=16, device="cuda"
    )
    assert cuda_length == length
    assert on_cuda.device.type == "cpu" and on_cuda.dtype == torch.float32
    assert torch.all(on_cuda[length:] == 0)
    # bfloat16 on the GPU (as Wan runs it) against float32 on the CPU.
    assert (on_cuda - on_cpu).abs().max() <= 0.05 * on_cpu.abs().max()


def test_clean_prompt_is_wans():
    assert clean_prompt("a &amp;lt;b&amp;gt; &amp;amp; c") == "a <b> & c"
    assert clean_prompt("  a\n\n fox \t runs  ") == "a fox runs"
    # ftfy unescapes HTML once when the text has no "<" (its `unescape_html="auto"`), then Wan
    # twice more: three times in all, as in Wan.
    assert clean_prompt("&amp;amp;lt;") == "<"
    assert clean_prompt("<b> &amp;amp;lt;") == "<b> &lt;"


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("\u201ccurly\u201d \u2018quotes\u2019", "\"curly\" 'quotes'"),
        ("\uff21\uff22\uff23\u3000\uff11\uff12\uff13 cat", "ABC 123 cat"),
        ("caf\u00c3\u00a9 \u00e2\u20ac\u0153quoted\u00e2\u20ac\u009d", 'caf\u00e9 "quoted"'),
    ],
    ids=["curly-quotes", "fullwidth", "mojibake"],
)
def test_clean_prompt_fixes_text_as_wan_does_with_ftfy(raw, clean):
    """Wan's basic_clean runs ftfy.fix_text first: the same prompt typed in another editor gives
    the same tokens."""
    assert clean_prompt(raw) == clean


def _touch(marker: str) -> None:
    Path(marker).touch()


class CodeOnLoad:
    """Unpickling an instance calls _touch: a stand-in for a checkpoint that carries code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


def test_pth_with_code_is_refused(tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "evil.pth"
    torch.save({"token_embedding.weight": torch.zeros(4, 2), "x": CodeOnLoad(marker)}, path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: refused to unpickle"):
        load_wan_umt5(path)
    assert not marker.exists()


def test_truncated_pth_fails_naming_file(tmp_path):
    path = tmp_path / "truncated.pth"
    torch.save(export_to_wan(make_tiny_umt5()), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_wan_umt5(path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "absent.pth"))):
        load_wan_umt5(tmp_path / "absent.pth")


def test_key_and_shape_mismatches_fail_naming_them(tmp_path):
    wan = export_to_wan(make_tiny_umt5())
    del wan["blocks.1.norm2.weight"]
    wan["blocks.1.attn.q.bias"] = torch.zeros(32)
    path = tmp_path / "keys.pth"
    torch.save(wan, path)
    with pytest.raises(ValueError) as caught:
        load_wan_umt5(path)
    message = str(caught.value)
    assert str(path) in message
    assert "blocks.1.norm2.weight" in message
    assert "blocks.1.attn.q.bias" in message

    wan = export_to_wan(make_tiny_umt5())
    wan["blocks.0.ffn.fc2.weight"] = torch.zeros(32, 47)
    torch.save(wan, path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*blocks\.0\.ffn\.fc2\.weight"):
        load_wan_umt5(path)


def xxl_shapes() -> dict[str, torch.Tensor]:
    """Wan's umt5-xxl encoder state dict as meta tensors (shapes from the reference, section 6)."""
    dim, ffn, heads, buckets = 4096, 10240, 64, 32
    shapes = {"token_embedding.weight": (256384, dim), "norm.weight": (dim,)}
    for n in range(24):
        shapes |= {
            f"blocks.{n}.norm1.weight": (dim,),
            f"blocks.{n}.norm2.weight": (dim,),
            f"blocks.{n}.pos_embedding.embedding.weight": (buckets, heads),
            f"blocks.{n}.ffn.gate.0.weight": (ffn, dim),
            f"blocks.{n}.ffn.fc1.weight": (ffn, dim),
            f"blocks.{n}.ffn.fc2.weight": (dim, ffn),
        }
        shapes |= {f"blocks.{n}.attn.{p}.weight": (dim, dim) for p in "qkvo"}
    return {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}


def test_xxl_config_from_shapes():
    from transformers import UMT5EncoderModel

    state = xxl_shapes()
    config = wan_umt5_config(state)
    assert config.vocab_size == 256384
    assert config.d_model == 4096
    assert config.d_kv == 64
    assert config.d_ff == 10240
    assert config.num_layers == 24
    assert config.num_heads == 64
    assert config.relative_attention_num_buckets == 32
    assert config.relative_attention_max_distance == 128
    assert config.layer_norm_epsilon == 1e-6
    assert config.is_gated_act and config.dense_act_fn == "gelu_new"

    # The key map covers transformers' XXL encoder exactly, shape for shape (meta: no memory).
    with torch.device("meta"):
        model = UMT5EncoderModel(config)
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    mapped = {
        hf_key: tuple(state[wan_key].shape)
        for wan_key, hf_keys in wan_umt5_key_map(config.num_layers).items()
        for hf_key in hf_keys
    }
    assert mapped == expected
    assert sum(p.numel() for p in model.parameters()) > 5.6e9


def test_prompt_embedding_checks(tmp_path):
    embeds = torch.randn(6, 8)
    good = tmp_path / "good.safetensors"
    save_prompt_embedding(good, embeds, prompt="a fox", length=4)
    loaded, metadata = load_prompt_embedding(good, text_dim=8)
    assert torch.equal(loaded, embeds)
    assert metadata == {"prompt": "a fox", "length": "4"}

    batched = tmp_path / "batched.safetensors"
    save_file({"prompt_embeds": embeds[None].to(torch.bfloat16)}, str(batched))
    loaded, _ = load_prompt_embedding(batched)
    assert loaded.shape == (6, 8) and loaded.dtype == torch.float32

    with pytest.raises(ValueError, match=rf"{re.escape(str(good))}.*width 8.*text_dim=16"):
        load_prompt_embedding(good, text_dim=16)

    bad_files = {
        "missing_key": {"embeds": embeds},
        "rank_1": {"prompt_embeds": torch.randn(8)},
        "rank_3": {"prompt_embeds": torch.randn(2, 6, 8)},
        "empty": {"prompt_embeds": torch.randn(0, 8)},
        "nan": {"prompt_embeds": embeds.clone().index_fill_(0, torch.tensor([2]), float("nan"))},
        "inf": {"prompt_embeds": embeds.clone().index_fill_(1, torch.tensor([5]), float("inf"))},
    }
    for name, tensors in bad_files.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(ValueError, match=re.escape(str(path))):
            load_prompt_embedding(path)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=re.escape(str(garbage))):
        load_prompt_embedding(garbage)


def test_demo_text_encoder_is_a_transformers_umt5(tmp_path):
    """The demo encoder, written without transformers, loads into transformers' UMT5EncoderModel
    with every weight used and none missing, and its tokenizer into AutoTokenizer; building it
    does not import transformers (3 s of the demo's start)."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, UMT5EncoderModel

    demo = tmp_path / "demo"
    code = (
        "import sys\n"
        "from sinkscope.wan.text import make_demo_text_encoder\n"
        f"make_demo_text_encoder({str(demo)!r}, d_model=32, num_layers=3, num_heads=4, seed=5)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    model, info = UMT5EncoderModel.from_pretrained(str(demo), output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    assert model.config.num_layers == 3 and model.config.d_model == 32
    saved = load_file(demo / "model.safetensors")
    state = model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert torch.equal(state["encoder.embed_tokens.weight"], saved["shared.weight"])
    tokenizer = AutoTokenizer.from_pretrained(str(demo))
    backend = Tokenizer.from_file(str(demo / "tokenizer.json"))
    ids = tokenizer("A red fox runs.").input_ids
    assert ids == backend.encode("A red fox runs.").ids and ids[-1] == tokenizer.eos_token_id == 1
    assert tokenizer.pad_token_id == 0
    out = model(input_ids=torch.tensor([ids])).last_hidden_state
    assert out.shape == (1, len(ids), 32) and torch.isfinite(out).all()
