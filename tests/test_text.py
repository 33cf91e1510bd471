"""UMT5 prompt encoding: our encoder against transformers', Wan's .pth, the tokenizer, prompt
cleaning, embedding files."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sinkscope.wan.text import (
    PromptTokenizer,
    clean_prompt,
    encode_prompt,
    load_prompt_embedding,
    load_umt5_folder,
    load_wan_umt5,
    make_demo_text_encoder,
    save_prompt_embedding,
    wan_umt5_config,
    wan_umt5_key_map,
)
from sinkscope.wan.umt5 import UMT5Encoder

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


TINY = {
    "vocab_size": 120,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 48,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6,
}
# google/umt5-xxl's encoder (its config.json), what Wan's text encoder is.
XXL = TINY | {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
}


def make_tiny_umt5(seed: int = 0, model_class: str = "UMT5EncoderModel"):
    """A tiny transformers UMT5 encoder with every tensor random (layer norms and relative biases
    included), so that any two weights swapped by a key map change the output."""
    import transformers

    config = transformers.UMT5Config(**TINY)
    model = getattr(transformers, model_class)(config).eval().requires_grad_(False)
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
    assert isinstance(loaded, UMT5Encoder)
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
    assert torch.equal(loaded(ids, mask), want)

    as_bf16 = load_wan_umt5(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in as_bf16.parameters())


@pytest.mark.parametrize("config", [TINY, XXL], ids=["tiny", "xxl"])
def test_our_encoder_has_transformers_keys_and_shapes(config):
    """Our encoder's state dict is transformers' `UMT5EncoderModel`'s, key for key (in order)
    and shape for shape, the embedding tied under both of its keys (meta: no memory)."""
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        ours = UMT5Encoder(config)
        theirs = UMT5EncoderModel(UMT5Config(**config))
    ours_state, their_state = ours.state_dict(), theirs.state_dict()
    assert list(ours_state) == list(their_state)
    assert {k: v.shape for k, v in ours_state.items()} == {
        k: v.shape for k, v in their_state.items()
    }
    assert ours.shared.weight is ours.encoder.embed_tokens.weight
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


def two_prompts(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, of `length` - 3 and 9 tokens (EOS last), padded to `length` as
    encode_prompt pads them."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate((length - 3, 9)):
        ids[row, :tokens] = torch.randint(3, 120, (tokens,), generator=generator)
        ids[row, tokens - 1] = 1
        mask[row, :tokens] = 1
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [30, 160])  # 160: distances past max_distance (128)
def test_our_encoder_equals_transformers(dtype, length):
    """With the same random weights, our forward is transformers' `last_hidden_state` bit for
    bit (CPU), on a padded batch of two prompts of different lengths and on the same batch
    unpadded (where transformers drops the mask)."""
    theirs = make_tiny_umt5(seed=1).to(dtype)
    ours = UMT5Encoder(TINY).eval().requires_grad_(False)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ours.to(dtype)
    ids, mask = two_prompts(length)
    for attention_mask in (mask, torch.ones_like(mask), None):
        want = theirs(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        got = ours(ids, attention_mask)
        assert got.dtype == want.dtype == dtype
        assert torch.equal(got, want)
    # The mask matters: the short prompt's rows differ from its unpadded encoding.
    assert not torch.equal(ours(ids, mask)[1, :9], ours(ids)[1, :9])


def _umt5_folders(root: Path, model) -> dict[str, Path]:
    """The layouts of a transformers UMT5 folder holding `model`'s weights."""
    from safetensors.torch import save_file

    folders = {name: root / name for name in ("saved", "sharded", "embed_tokens", "bin")}
    model.save_pretrained(folders["saved"])  # model.safetensors with `shared.weight` only
    model.save_pretrained(folders["sharded"], max_shard_size="20KB")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in ("embed_tokens", "bin"):
        folders[name].mkdir()
        (folders[name] / "config.json").write_bytes((folders["saved"] / "config.json").read_bytes())
    save_file(
        {k: v for k, v in state.items() if k != "shared.weight"},
        str(folders["embed_tokens"] / "model.safetensors"),
    )
    torch.save(state, folders["bin"] / "pytorch_model.bin")
    return folders


def test_folder_loads_what_transformers_loads(tmp_path):
    """A transformers UMT5 folder in each layout (save_pretrained's, sharded, the embedding
    under `encoder.embed_tokens.weight` only, a weights-only pytorch_model.bin; a whole
    encoder-decoder, its decoder skipped) gives the encoder `from_pretrained` gives, bit for bit,
    in float32 and bfloat16; wrong keys fail naming the folder and the keys."""
    from safetensors.torch import save_file
    from transformers import UMT5EncoderModel

    folders = _umt5_folders(tmp_path, make_tiny_umt5(seed=2))
    assert (folders["sharded"] / "model.safetensors.index.json").is_file()
    full = tmp_path / "encoder_decoder"
    make_tiny_umt5(seed=3, model_class="UMT5ForConditionalGeneration").save_pretrained(full)
    folders["encoder_decoder"] = full
    ids, mask = two_prompts(30)
    for name, folder in folders.items():
        for dtype in (torch.float32, torch.bfloat16):
            ours = load_umt5_folder(folder, dtype=dtype)
            assert ours.shared.weight is ours.encoder.embed_tokens.weight, name
            assert all(p.dtype == dtype for p in ours.parameters()), name
            theirs = UMT5EncoderModel.from_pretrained(str(folder), dtype=dtype)
            # No grad, as encode_prompts runs (with grad, SDPA may take another CPU kernel).
            with torch.no_grad():
                want = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
            assert torch.equal(ours(ids, mask), want), (name, dtype)

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_bytes((folders["saved"] / "config.json").read_bytes())
    state = make_tiny_umt5().state_dict()
    del state["encoder.embed_tokens.weight"]  # tied: safetensors stores it once
    del state["encoder.final_layer_norm.weight"]
    state["encoder.block.0.layer.0.SelfAttention.q.bias"] = torch.zeros(32)
    save_file({k: v.contiguous() for k, v in state.items()}, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError) as caught:
        load_umt5_folder(wrong)
    message = str(caught.value)
    assert str(wrong) in message
    assert "encoder.final_layer_norm.weight" in message and "SelfAttention.q.bias" in message
    (wrong / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(wrong))):
        load_umt5_folder(wrong)
    config = wrong / "config.json"
    config.write_text(config.read_text().replace('"gated-gelu"', '"relu"'))
    with pytest.raises(ValueError, match=rf"{re.escape(str(config))}.*'relu'.*gated-gelu"):
        load_umt5_folder(wrong)


TOKENIZER_TEXTS = [
    "A red fox runs, at dawn.",
    clean_prompt(
        "\u201cCurly\u201d caf\u00c3\u00a9, \uff21\uff22\uff23 \u00fcber \u6f22\u5b57"
        " &amp;amp; na\u00efve"
    ),
    clean_prompt("a very long prompt about a fox " * 3),
    "special tokens </s> and <pad> typed in",
]


def assert_tokenizes_as(ours: PromptTokenizer, theirs, text_len: int = 24) -> None:
    """`ours` gives what transformers' tokenizer `theirs` gives encode_prompt: ids, the padded
    ids and mask, the decode of the cut tokens."""
    assert len(theirs(TOKENIZER_TEXTS[2]).input_ids) > text_len  # one of them is cut
    for text in TOKENIZER_TEXTS:
        full = theirs(text, add_special_tokens=True).input_ids
        assert ours.ids(text) == full, text
        want = theirs(
            [text],
            padding="max_length",
            truncation=True,
            max_length=text_len,
            add_special_tokens=True,
            return_attention_mask=True,
        )
        assert ours.padded(text, text_len) == (want.input_ids[0], want.attention_mask[0]), text
        for part in (full, full[text_len - 1 : -1]):
            assert ours.decode(part) == theirs.decode(part, skip_special_tokens=True), text


def test_tokenizer_is_transformers_fast_tokenizer(tmp_path):
    """tokenizer.json through `tokenizers` tokenizes as `AutoTokenizer` does: plain text,
    unicode after Wan's (ftfy) cleaning, a prompt longer than text_len, special tokens typed in
    the text."""
    from transformers import AutoTokenizer

    demo = tmp_path / "demo"
    make_demo_text_encoder(demo, d_model=32, num_layers=1, num_heads=4)
    ours = PromptTokenizer(demo)
    assert ours._transformers is None  # the tokenizers path, not the fallback
    assert (ours.pad_id, ours.pad_token) == (0, "<pad>")
    assert_tokenizes_as(ours, AutoTokenizer.from_pretrained(str(demo)))


def test_tokenizer_without_tokenizer_json_falls_back_to_transformers(tmp_path, monkeypatch):
    """A tokenizer folder without tokenizer.json (a sentencepiece model alone) goes through
    transformers' AutoTokenizer. No such folder is written here (sentencepiece is not
    installed): AutoTokenizer is pointed at the demo's files, and the fallback must give what
    AutoTokenizer gives."""
    import transformers

    demo = tmp_path / "demo"
    make_demo_text_encoder(demo, d_model=32, num_layers=1, num_heads=4)
    bare = tmp_path / "spiece_only"
    bare.mkdir()
    (bare / "tokenizer_config.json").write_bytes((demo / "tokenizer_config.json").read_bytes())
    real = transformers.AutoTokenizer.from_pretrained
    asked = []

    def from_pretrained(path, *args, **kwargs):
        asked.append(path)
        return real(str(demo), *args, **kwargs)

    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", staticmethod(from_pretrained)
    )
    fallback = PromptTokenizer(bare)
    assert asked == [str(bare)] and fallback._transformers is not None
    assert_tokenizes_as(fallback, real(str(demo)))


def test_encode_prompts_imports_no_transformers(tmp_path):
    """encode_prompts on a transformers folder and on Wan's .pth (the demo's weights renamed)
    runs without importing transformers (its UMT5 import cost ~5 s per job); both agree."""
    import subprocess
    import sys

    demo = tmp_path / "demo"
    pth = tmp_path / "umt5.pth"
    code = f"""
import sys
import torch
from safetensors.torch import load_file
from sinkscope.wan.text import encode_prompts, make_demo_text_encoder, wan_umt5_key_map
make_demo_text_encoder({str(demo)!r}, d_model=32, num_layers=2, num_heads=4)
state = load_file({str(demo / "model.safetensors")!r})
torch.save({{wan: state[hf[0]] for wan, hf in wan_umt5_key_map(2).items()}}, {str(pth)!r})
texts = ["A red fox runs.", "a very long prompt about a fox " * 3]
via_dir = encode_prompts(texts, {str(demo)!r}, text_len=16)
via_pth = encode_prompts(texts, {str(pth)!r}, tokenizer_dir={str(demo)!r}, text_len=16)
for a, b in zip(via_dir, via_pth):
    assert torch.equal(a.embeds, b.embeds) and a.embeds.shape == (16, 32)
assert via_dir[1].length == 16 < via_dir[1].prompt_tokens
assert "transformers" not in sys.modules, "transformers was imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_encode_prompt_equals_the_transformers_pipeline(tmp_path):
    """encode_prompt gives, bit for bit, what transformers' `AutoTokenizer` and
    `UMT5EncoderModel.from_pretrained` give (how it was computed before our encoder)."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    demo = tmp_path / "demo"
    make_demo_text_encoder(demo, d_model=32, num_layers=3, num_heads=4, seed=4)
    tokenizer = AutoTokenizer.from_pretrained(str(demo))
    model = UMT5EncoderModel.from_pretrained(str(demo)).eval()
    for text in TOKENIZER_TEXTS:
        embeds, length, prompt_tokens = encode_prompt(text, demo, text_len=24)
        cleaned = clean_prompt(text)
        tokens = tokenizer(
            [cleaned],
            padding="max_length",
            truncation=True,
            max_length=24,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            want = model(tokens.input_ids, tokens.attention_mask).last_hidden_state[0]
        want[int(tokens.attention_mask.sum()) :] = 0
        assert length == int(tokens.attention_mask.sum())
        assert prompt_tokens == len(tokenizer(cleaned).input_ids)
        assert torch.equal(embeds, want), text


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
    from transformers import UMT5Config, UMT5EncoderModel

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
    assert config.feed_forward_proj == "gated-gelu"
    assert config == XXL

    # The key map covers transformers' XXL encoder exactly, shape for shape (meta: no memory).
    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config(**config))
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
