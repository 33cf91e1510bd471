"""UMT5 prompt encoding as Wan / Self-Forcing do it, and cached prompt embeddings.

Wan cleans the prompt (ftfy if installed, html unescape twice, whitespace collapse), tokenizes to
`text_len` tokens with EOS and padding, runs the UMT5 encoder with the padding mask and zeroes the
padded rows. The result [text_len, d_model] is what the DiT's text embedding receives.
"""

from __future__ import annotations

import html
import json
import re
import string
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

EMBEDDINGS_KEY = "prompt_embeds"


def clean_prompt(text: str) -> str:
    try:
        import ftfy  # optional, as in Wan's tokenizer wrapper

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text))
    return re.sub(r"\s+", " ", text).strip()


@torch.no_grad()
def encode_prompt(
    text: str,
    encoder_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    text_len: int = 512,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, int]:
    """Embeddings [text_len, d_model] (float32, rows past the prompt zeroed) and the token count."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or encoder_dir))
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    encoder = UMT5EncoderModel.from_pretrained(str(encoder_dir), dtype=dtype).to(device).eval()
    tokens = tokenizer(
        [clean_prompt(text)],
        padding="max_length",
        truncation=True,
        max_length=text_len,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids = tokens.input_ids.to(device)
    mask = tokens.attention_mask.to(device)
    hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state[0].float()
    length = int(mask.sum())
    hidden[length:] = 0
    return hidden.cpu(), length


def save_prompt_embedding(
    path: str | Path, embeds: torch.Tensor, *, prompt: str, length: int
) -> None:
    """Write embeddings as safetensors, with the prompt and its token count as metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {EMBEDDINGS_KEY: embeds.contiguous()},
        str(tmp),
        metadata={"prompt": prompt, "length": str(length)},
    )
    tmp.replace(path)


def load_prompt_embedding(path: str | Path) -> tuple[torch.Tensor, dict[str, str]]:
    """Embeddings [L, d] and metadata of a prompt file written by `save_prompt_embedding`
    (or any safetensors file with a `prompt_embeds` tensor of shape [L, d] or [1, L, d])."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            if EMBEDDINGS_KEY not in handle.keys():
                raise ValueError(
                    f"{path}: no '{EMBEDDINGS_KEY}' tensor; it has {sorted(handle.keys())}"
                )
            embeds = handle.get_tensor(EMBEDDINGS_KEY)
            metadata = handle.metadata() or {}
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt embeddings not found: {path}") from None
    if embeds.ndim == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.ndim != 2:
        raise ValueError(f"{path}: '{EMBEDDINGS_KEY}' must be [L, d], got {list(embeds.shape)}")
    return embeds.float(), metadata


def make_demo_text_encoder(
    out_dir: str | Path,
    *,
    d_model: int,
    num_layers: int = 2,
    num_heads: int = 4,
    d_ff: int | None = None,
    seed: int = 0,
) -> None:
    """A tiny random-init UMT5 encoder and a character-level Unigram tokenizer, saved in the
    transformers directory layout of `google/umt5-xxl` (config.json, weights, tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    out_dir = Path(out_dir)
    special = ["<pad>", "</s>", "<unk>"]
    pieces = [(tok, 0.0) for tok in special]
    pieces += [(ch, -1.0) for ch in string.ascii_lowercase + string.digits + ".,;:!?'-"]
    pieces += [("\u2581" + ch, -1.5) for ch in string.ascii_lowercase]
    pieces += [(ch, -2.0) for ch in string.ascii_uppercase]
    pieces += [("\u2581" + ch, -2.5) for ch in string.ascii_uppercase]
    pieces.append(("\u2581", -3.0))
    backend = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    # Like T5's tokenizer: EOS appended after every sequence.
    backend.post_processor = TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    config = UMT5Config(
        vocab_size=len(pieces),
        d_model=d_model,
        d_kv=d_model // num_heads,
        d_ff=d_ff or 2 * d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        layer_norm_epsilon=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(config).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    encoder.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "sinkscope_demo.json").write_text(json.dumps({"seed": seed}) + "\n")
