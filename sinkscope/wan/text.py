"""UMT5 prompt encoding as Wan / Self-Forcing do it, and cached prompt embeddings.

Wan cleans the prompt (ftfy, html unescape twice, whitespace collapse), tokenizes to
`text_len` tokens with EOS and padding, runs the UMT5 encoder with the padding mask and zeroes the
padded rows. The result [text_len, d_model] is what the DiT's text embedding receives.

The encoder is our own network (`umt5.py`, torch only, transformers' parameter names, proven
bit-equal to transformers' `UMT5EncoderModel` in tests/test_text.py), loaded from a transformers
UMT5 directory (e.g. `google/umt5-xxl`: config.json and its weights) or from Wan's own checkpoint
`models_t5_umt5-xxl-enc-bf16.pth`, whose keys are renamed onto transformers'. The tokenizer is
the directory's tokenizer.json run by the `tokenizers` library, as transformers' fast tokenizer
runs it; only a directory without one goes through transformers' `AutoTokenizer`. Importing
transformers' UMT5 cost ~5 s per encode_prompt job, whose model work on the demo takes
milliseconds.
"""

from __future__ import annotations

import json
import logging
import re
import string
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from sinkscope.segments import Segment, segments_from_json, segments_json
from sinkscope.storage import atomic_path

from .cleaning import clean_prompt
from .precision import model_dtype
from .umt5 import UMT5Encoder, UMT5EncoderConfig, umt5_config

EMBEDDINGS_KEY = "prompt_embeds"
# A prompt of segments: every segment's embeddings [n, L, d], beside the first's under
# EMBEDDINGS_KEY (what a reader of one prompt sees), and the segments as JSON metadata.
SEGMENTS_KEY = "segment_embeds"

log = logging.getLogger(__name__)

# Fixed in Wan's umt5_xxl (not recoverable from tensor shapes).
WAN_UMT5_MAX_DISTANCE = 128
WAN_UMT5_LAYER_NORM_EPS = 1e-6

# Per-block Wan key suffix -> transformers key suffix under `encoder.block.N.`.
_WAN_UMT5_BLOCK_KEYS = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
_WAN_BLOCK_INDEX = re.compile(r"blocks\.(\d+)\.")

# A transformers UMT5 directory's weights, in the order `from_pretrained` looks for them.
UMT5_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Keys of an encoder-decoder checkpoint (google/umt5-xxl is one) that the encoder does not use;
# transformers' `UMT5EncoderModel` skips them too. Every other key must be the encoder's.
_NOT_ENCODER = ("decoder.", "lm_head.")
# The embedding is tied: `save_pretrained` writes `shared.weight` only, others may write both.
_SHARED, _EMBED_TOKENS = "shared.weight", "encoder.embed_tokens.weight"
# Special-token entries of tokenizer_config.json / special_tokens_map.json.
_SPECIAL_TOKENS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_SPECIAL_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")


def wan_umt5_key_map(num_layers: int) -> dict[str, tuple[str, ...]]:
    """Wan UMT5 state-dict key -> the `UMT5EncoderModel` keys that receive the same tensor."""
    key_map = {"token_embedding.weight": (_SHARED, _EMBED_TOKENS)}
    for block in range(num_layers):
        for wan_suffix, hf_suffix in _WAN_UMT5_BLOCK_KEYS.items():
            key_map[f"blocks.{block}.{wan_suffix}"] = (f"encoder.block.{block}.{hf_suffix}",)
    key_map["norm.weight"] = ("encoder.final_layer_norm.weight",)
    return key_map


def wan_umt5_config(
    state_dict: Mapping[str, torch.Tensor], *, source: str = "state dict"
) -> UMT5EncoderConfig:
    """The encoder config (transformers' `UMT5Config` names, a dict) of a Wan UMT5 encoder state
    dict, read off its tensor shapes only (so meta tensors suffice). `source` names the dict in
    error messages."""
    needed = (
        "token_embedding.weight",
        "blocks.0.pos_embedding.embedding.weight",
        "blocks.0.attn.q.weight",
        "blocks.0.ffn.fc1.weight",
    )
    absent = [key for key in needed if key not in state_dict]
    if absent:
        raise ValueError(f"{source}: not a Wan UMT5 encoder state dict; missing keys {absent}")
    not_matrices = [key for key in needed if state_dict[key].ndim != 2]
    if not_matrices:
        shapes = {key: list(state_dict[key].shape) for key in not_matrices}
        raise ValueError(f"{source}: expected 2-D weights, got {shapes}")
    vocab_size, d_model = state_dict["token_embedding.weight"].shape
    num_buckets, num_heads = state_dict["blocks.0.pos_embedding.embedding.weight"].shape
    inner_dim = state_dict["blocks.0.attn.q.weight"].shape[0]
    if inner_dim % num_heads:
        raise ValueError(
            f"{source}: attn.q has {inner_dim} rows, not a multiple of {num_heads} heads "
            "(heads are read from pos_embedding [num_buckets, num_heads])"
        )
    blocks = {int(m.group(1)) for key in state_dict if (m := _WAN_BLOCK_INDEX.match(key))}
    return umt5_config(
        {
            "vocab_size": vocab_size,
            "d_model": d_model,
            "d_kv": inner_dim // num_heads,
            "d_ff": state_dict["blocks.0.ffn.fc1.weight"].shape[0],
            # Gaps in the block numbering surface later as missing keys.
            "num_layers": max(blocks) + 1,
            "num_heads": num_heads,
            "relative_attention_num_buckets": num_buckets,
            "relative_attention_max_distance": WAN_UMT5_MAX_DISTANCE,
            "feed_forward_proj": "gated-gelu",
            "layer_norm_epsilon": WAN_UMT5_LAYER_NORM_EPS,
        }
    )


def _tensor_dict(state: object, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: expected a state dict, got {type(state).__name__}")
    not_tensors = sorted(str(key) for key, value in state.items() if not torch.is_tensor(value))
    if not_tensors:
        raise ValueError(f"{path}: entries that are not tensors: {not_tensors[:10]}")
    return dict(state)


def _read_wan_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from .checkpoint import load_pickled

    try:
        # mmap: the 11 GB XXL file is paged in as tensors are converted, not read up front.
        state = load_pickled(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"Wan UMT5 checkpoint not found: {path}") from None
    return _tensor_dict(state, path)


def _build_umt5(
    config: Mapping,
    state: dict[str, torch.Tensor],
    source: str,
    device: torch.device | str,
    dtype: torch.dtype,
    file_key: Callable[[str], str] = str,
) -> UMT5Encoder:
    """`UMT5Encoder` of `config` holding `state` (transformers' keys, the embedding under both
    of its names), every key and shape checked (errors name `source` and the keys as the file
    names them, `file_key`), in eval mode on `device` in `dtype`."""
    from .checkpoint import check_state_keys

    # Meta device: no weights are allocated here; load_state_dict(assign=True) adopts the
    # converted tensors instead of copying them into fresh ones.
    with torch.device("meta"):
        model = UMT5Encoder(config)
    what = f"a {model.config.num_layers}-layer UMT5 encoder"
    check_state_keys(model.state_dict(), state, source, what, file_key)
    wrong = sorted({file_key(k) for k, v in state.items() if not v.is_floating_point()})
    if wrong:
        raise ValueError(f"{source}: not floating point: {wrong[:10]}")
    # The tied embedding (256384 x 4096 in the XXL) converted once, for both of its keys.
    converted = {
        key: tensor.to(device=device, dtype=dtype)
        for key, tensor in state.items()
        if key != _EMBED_TOKENS
    }
    converted[_EMBED_TOKENS] = converted[_SHARED]
    model.load_state_dict(converted, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def load_wan_umt5(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> UMT5Encoder:
    """The UMT5 encoder (`umt5.UMT5Encoder`) holding the weights of Wan's UMT5 checkpoint
    (`models_t5_umt5-xxl-enc-bf16.pth`), in eval mode on `device` in `dtype`."""
    path = Path(path)
    state = _read_wan_state_dict(path)
    config = wan_umt5_config(state, source=str(path))
    key_map = wan_umt5_key_map(config.num_layers)
    missing = sorted(key_map.keys() - state.keys())
    unexpected = sorted(state.keys() - key_map.keys())
    if missing or unexpected:
        raise ValueError(
            f"{path}: does not match a {config.num_layers}-layer Wan UMT5 encoder; "
            f"missing keys {missing}, unexpected keys {unexpected}"
        )
    converted = {hf: state[wan] for wan, hf_keys in key_map.items() for hf in hf_keys}
    wan_key = {hf: wan for wan, hf_keys in key_map.items() for hf in hf_keys}
    return _build_umt5(config, converted, str(path), device, dtype, wan_key.__getitem__)


def _umt5_weight_files(folder: Path) -> list[Path]:
    """The weight files of a transformers UMT5 directory: the first of UMT5_WEIGHT_FILES there,
    or the shards its index lists."""
    from .layout import CheckpointError

    for name in UMT5_WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        try:
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:  # JSON errors included
            raise CheckpointError(f"{path}: not an index with a weight_map ({err})") from None
        return [folder / shard for shard in shards]
    raise FileNotFoundError(f"{folder}: no UMT5 weights (none of {', '.join(UMT5_WEIGHT_FILES)})")


def _read_umt5_folder(folder: Path) -> dict[str, torch.Tensor]:
    """A transformers UMT5 directory's encoder weights (a decoder's skipped), the tied embedding
    under both of its keys whichever one the files hold (`shared.weight` first)."""
    from .checkpoint import load_pickled
    from .layout import CheckpointError

    state: dict[str, torch.Tensor] = {}
    for path in _umt5_weight_files(folder):
        if path.name.endswith(".safetensors"):
            try:
                # Only the encoder's tensors are read: a full encoder-decoder's decoder is not.
                with safe_open(str(path), framework="pt") as handle:
                    for key in handle.keys():
                        if not key.startswith(_NOT_ENCODER):
                            state[key] = handle.get_tensor(key)
            except FileNotFoundError:
                raise CheckpointError(f"weights not found: {path}") from None
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None
        else:
            try:
                loaded = _tensor_dict(load_pickled(path), path)
            except FileNotFoundError:
                raise CheckpointError(f"weights not found: {path}") from None
            state |= {k: v for k, v in loaded.items() if not k.startswith(_NOT_ENCODER)}
    shared = state.get(_SHARED, state.get(_EMBED_TOKENS))
    if shared is not None:
        state[_SHARED] = state[_EMBED_TOKENS] = shared
    return state


def load_umt5_folder(
    folder: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> UMT5Encoder:
    """The UMT5 encoder of a transformers directory (config.json, and model.safetensors, its
    shards, or pytorch_model.bin read weights-only), what `UMT5EncoderModel.from_pretrained`
    loads, every key checked, in eval mode on `device` in `dtype`."""
    from .layout import CheckpointError

    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        values = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"UMT5 config not found: {config_path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    try:
        config = umt5_config(values)
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    return _build_umt5(config, _read_umt5_folder(folder), str(folder), device, dtype)


class PromptTokenizer:
    """What prompt encoding needs of a tokenizer directory: a text's ids with special tokens
    (the post-processor appends EOS), the same cut and padded to a length with the attention
    mask, and the decode of ids (special tokens skipped).

    The directory's tokenizer.json runs in the `tokenizers` library, set up as transformers'
    fast tokenizer sets it up: the special tokens that tokenizer_config.json and
    special_tokens_map.json name (pad, EOS, unk, ...) registered as special, the pad token from
    them ("<pad>", T5's, if unnamed), truncation and padding the library's own (what
    transformers calls for `truncation=True, padding="max_length"`), on the sides the config
    says (right by default). A directory without tokenizer.json (a sentencepiece model only)
    goes through transformers' `AutoTokenizer` instead.

    Why tokenizer.json and not transformers' T5 class: the released code ran transformers 4,
    whose fast tokenizer runs tokenizer.json as written. transformers 5 rebuilds T5's
    pre-tokenizer (whitespace split, then Metaspace) around the file's vocabulary; on text that
    Wan's cleaning has left (single spaces, stripped) both split alike, which the tests check on
    the demo tokenizer against transformers 5's `AutoTokenizer`."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            self._transformers = AutoTokenizer.from_pretrained(str(folder))
            return
        from tokenizers import AddedToken, Tokenizer

        self._transformers = None
        settings: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            if (folder / name).is_file():
                try:
                    settings |= json.loads((folder / name).read_text(encoding="utf-8"))
                except (ValueError, TypeError) as err:  # JSON and encoding errors, not a dict
                    raise ValueError(f"{folder / name}: not a JSON object ({err})") from None
        try:
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as err:  # the Rust side raises plain Exceptions
            raise ValueError(
                f"{folder / 'tokenizer.json'}: not a readable tokenizer ({err})"
            ) from None
        backend.no_truncation()
        backend.no_padding()
        special = [settings.get(f"{kind}_token") for kind in _SPECIAL_TOKENS]
        for key in _SPECIAL_TOKEN_LISTS:
            special += list(settings.get(key) or [])
        contents = [t["content"] if isinstance(t, dict) else t for t in special if t]
        known = {token.content for token in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens(
            [AddedToken(c, normalized=False, special=True) for c in contents if c not in known]
        )
        pad = settings.get("pad_token") or "<pad>"
        self.pad_token = pad["content"] if isinstance(pad, dict) else pad
        self.pad_id = backend.token_to_id(self.pad_token)
        if self.pad_id is None:
            raise ValueError(f"{folder}: pad token {self.pad_token!r} is not in the vocabulary")
        self.padding_side = settings.get("padding_side", "right")
        self.truncation_side = settings.get("truncation_side", "right")
        self._backend = backend

    def ids(self, text: str) -> list[int]:
        """The text's token ids, special tokens added, not cut."""
        if self._transformers is not None:
            return self._transformers(text, add_special_tokens=True).input_ids
        return self._backend.encode(text, add_special_tokens=True).ids

    def padded(self, text: str, length: int) -> tuple[list[int], list[int]]:
        """Ids of exactly `length` tokens (cut keeping the special tokens, or padded) and their
        attention mask (1 = token, 0 = padding)."""
        if self._transformers is not None:
            tokens = self._transformers(
                text,
                padding="max_length",
                truncation=True,
                max_length=length,
                add_special_tokens=True,
                return_attention_mask=True,
            )
            return tokens.input_ids, tokens.attention_mask
        backend = self._backend
        backend.enable_truncation(length, direction=self.truncation_side)
        backend.enable_padding(
            direction=self.padding_side,
            pad_id=self.pad_id,
            pad_token=self.pad_token,
            length=length,
        )
        try:
            encoding = backend.encode(text, add_special_tokens=True)
        finally:
            backend.no_truncation()
            backend.no_padding()
        return encoding.ids, encoding.attention_mask

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens skipped."""
        if self._transformers is not None:
            return self._transformers.decode(ids, skip_special_tokens=True)
        return self._backend.decode(ids, skip_special_tokens=True)


class EncodedPrompt(NamedTuple):
    embeds: torch.Tensor  # [text_len, d_model]
    length: int  # tokens encoded, EOS included
    prompt_tokens: int  # tokens of the whole cleaned prompt, EOS included (> length: cut)


def encode_prompt(text: str, encoder: str | Path, **options) -> EncodedPrompt:
    """`encode_prompts` of one text."""
    (encoded,) = encode_prompts([text], encoder, **options)
    return encoded


@torch.no_grad()
def encode_prompts(
    texts: list[str],
    encoder: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    text_len: int = 512,
    device: torch.device | str = "cpu",
    on_truncate: str = "warn",
    dtype: str = "auto",
    progress: bool = False,
) -> list[EncodedPrompt]:
    """Per text (a prompt, or a prompt's segments; the encoder loaded once) its embeddings
    [text_len, d_model] (float32, rows past the prompt zeroed) and token counts.

    `encoder` is a transformers UMT5 directory (its tokenizer is used unless `tokenizer_dir` is
    given) or Wan's UMT5 `.pth` (then `tokenizer_dir` is required). Runs in float32 on CPU and
    bfloat16 on CUDA, as Wan / Self-Forcing do (`dtype` "auto"), or in the `dtype` given. A
    prompt longer than `text_len` tokens is cut to its first text_len - 1 and EOS, as Wan does:
    `on_truncate` "warn" logs what was cut, "error" raises; `progress`: a bar over the texts."""
    if on_truncate not in ("warn", "error"):
        raise ValueError(f"on_truncate must be 'warn' or 'error', got {on_truncate!r}")
    encoder = Path(encoder)
    dtype = model_dtype(device, dtype)
    if encoder.is_dir():
        tokenizer_dir = tokenizer_dir or encoder
    elif encoder.is_file():
        if tokenizer_dir is None:
            raise ValueError(
                f"{encoder}: a Wan UMT5 .pth holds no tokenizer; pass tokenizer_dir "
                "(the google/umt5-xxl tokenizer directory)"
            )
    else:
        raise FileNotFoundError(f"text encoder not found: {encoder}")
    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {tokenizer_dir}")
    tokenizer = PromptTokenizer(tokenizer_dir)
    if encoder.is_dir():
        model = load_umt5_folder(encoder, device=device, dtype=dtype)
    else:
        model = load_wan_umt5(encoder, device=device, dtype=dtype)
    if progress:
        texts = tqdm(texts, desc="encoding prompts", unit="text", file=sys.stderr)
    return [_encode_one(text, tokenizer, model, text_len, device, on_truncate) for text in texts]


def _encode_one(
    text: str,
    tokenizer: PromptTokenizer,
    model: UMT5Encoder,
    text_len: int,
    device: torch.device | str,
    on_truncate: str,
) -> EncodedPrompt:
    cleaned = clean_prompt(text)
    if not cleaned:
        raise ValueError(f"prompt {text!r} is empty after Wan's cleaning")
    full_ids = tokenizer.ids(cleaned)
    if len(full_ids) > text_len:
        lost = tokenizer.decode(full_ids[text_len - 1 : -1])
        message = (
            f"prompt of {len(full_ids)} tokens (EOS included) is longer than text_len={text_len}: "
            f"only its first {text_len - 1} tokens and EOS are encoded; cut: {lost!r}"
        )
        if on_truncate == "error":
            raise ValueError(f"{message} (text_encoder.truncate: error)")
        log.warning(message)
    ids, mask = tokenizer.padded(cleaned, text_len)
    ids = torch.tensor([ids], device=device)
    mask = torch.tensor([mask], device=device)
    hidden = model(ids, mask)[0].float()
    length = int(mask.sum())
    hidden[length:] = 0
    return EncodedPrompt(hidden.cpu(), length, len(full_ids))


def save_prompt_embedding(
    path: str | Path,
    embeds: torch.Tensor,
    *,
    prompt: str,
    length: int,
    prompt_tokens: int | None = None,
) -> None:
    """Write embeddings as safetensors, with the prompt and its token counts as metadata:
    `length` tokens encoded of the prompt's `prompt_tokens` (EOS included in both)."""
    metadata = {"prompt": prompt, "length": str(length)}
    if prompt_tokens is not None:
        metadata["prompt_tokens"] = str(prompt_tokens)
    with atomic_path(path) as temporary:
        save_file({EMBEDDINGS_KEY: embeds.contiguous()}, str(temporary), metadata=metadata)


def load_prompt_embedding(
    path: str | Path, *, text_dim: int | None = None
) -> tuple[torch.Tensor, dict[str, str]]:
    """Embeddings [L, d] (float32) and metadata of a prompt file written by
    `save_prompt_embedding`, or of any user-supplied safetensors file with a `prompt_embeds`
    tensor of shape [L, d] or [1, L, d]. Checks the shape, that every value is finite and, when
    `text_dim` is given, that d equals it."""
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
    except SafetensorError as err:
        raise ValueError(f"{path}: unreadable as safetensors: {err}") from None
    if embeds.ndim == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.ndim != 2 or 0 in embeds.shape:
        raise ValueError(
            f"{path}: '{EMBEDDINGS_KEY}' must be [L, d] or [1, L, d] with L, d > 0, "
            f"got {list(embeds.shape)}"
        )
    if not embeds.is_floating_point():
        raise ValueError(f"{path}: '{EMBEDDINGS_KEY}' must be floating point, got {embeds.dtype}")
    embeds = embeds.float()
    bad = ~torch.isfinite(embeds)
    if bad.any():
        rows = bad.any(dim=1).nonzero().flatten().tolist()
        raise ValueError(
            f"{path}: '{EMBEDDINGS_KEY}' has {int(bad.sum())} non-finite values (rows {rows[:10]})"
        )
    if text_dim is not None and embeds.shape[1] != text_dim:
        raise ValueError(
            f"{path}: embeddings have width {embeds.shape[1]}, but text_dim={text_dim} is expected"
        )
    return embeds, metadata


def save_prompt_segments(
    path: str | Path, encoded: list[EncodedPrompt], segments: list[Segment]
) -> None:
    """Write a prompt of segments: every segment's embeddings under SEGMENTS_KEY [n, L, d], the
    first's under EMBEDDINGS_KEY, the segments (`sinkscope.segments`) and each one's token counts
    as metadata. A plain prompt (one segment) is written as `save_prompt_embedding` writes it."""
    if len(encoded) != len(segments):
        raise ValueError(f"{len(segments)} segments but {len(encoded)} encodings")
    first = encoded[0]
    if len(segments) == 1:
        save_prompt_embedding(
            path,
            first.embeds,
            prompt=segments[0].text,
            length=first.length,
            prompt_tokens=first.prompt_tokens,
        )
        return
    metadata = {
        "prompt": " | ".join(segment.text for segment in segments),
        "length": str(first.length),
        "prompt_tokens": str(first.prompt_tokens),
        "segments": segments_json(segments),
        "segment_lengths": json.dumps([e.length for e in encoded]),
        "segment_prompt_tokens": json.dumps([e.prompt_tokens for e in encoded]),
    }
    tensors = {
        EMBEDDINGS_KEY: first.embeds.contiguous(),
        SEGMENTS_KEY: torch.stack([e.embeds for e in encoded]).contiguous(),
    }
    with atomic_path(path) as temporary:
        save_file(tensors, str(temporary), metadata=metadata)


def load_prompt_segments(path: str | Path) -> tuple[torch.Tensor, dict[str, str], list[Segment]]:
    """Embeddings [n, L, d] (float32) of a prompt's n segments, its metadata and its segments:
    a file of `save_prompt_segments`, or any prompt file `load_prompt_embedding` reads (one
    segment from frame 0)."""
    embeds, metadata = load_prompt_embedding(path)
    if "segments" not in metadata:
        return embeds[None], metadata, [Segment(metadata.get("prompt", ""))]
    path = Path(path)
    segments = segments_from_json(metadata["segments"])
    with safe_open(str(path), framework="pt") as handle:
        if SEGMENTS_KEY not in handle.keys():
            raise ValueError(f"{path}: {len(segments)} segments but no '{SEGMENTS_KEY}' tensor")
        stacked = handle.get_tensor(SEGMENTS_KEY).float()
    if stacked.shape != (len(segments), *embeds.shape):
        raise ValueError(
            f"{path}: '{SEGMENTS_KEY}' is {list(stacked.shape)}, not "
            f"[{len(segments)}, {embeds.shape[0]}, {embeds.shape[1]}] for its segments"
        )
    if not torch.isfinite(stacked).all():
        raise ValueError(f"{path}: '{SEGMENTS_KEY}' has non-finite values")
    return stacked, metadata, segments


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
    transformers directory layout of `google/umt5-xxl` (config.json, model.safetensors,
    tokenizer.json), which `UMT5EncoderModel` and `AutoTokenizer` load.

    Written without importing transformers (3 s of the demo's start, on its critical path): the
    weights are T5's initialisation (normal, std from the fan-in; layer norms 1) from `seed`,
    under UMT5EncoderModel's parameter names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

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
    d_kv = d_model // num_heads
    d_ff = d_ff or 2 * d_model
    buckets = 32
    config = {
        "architectures": ["UMT5EncoderModel"],
        "model_type": "umt5",
        "vocab_size": len(pieces),
        "d_model": d_model,
        "d_kv": d_kv,
        "d_ff": d_ff,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "relative_attention_num_buckets": buckets,
        "relative_attention_max_distance": 128,
        "feed_forward_proj": "gated-gelu",
        "dense_act_fn": "gelu_new",
        "is_gated_act": True,
        "layer_norm_epsilon": 1e-6,
        "dropout_rate": 0.1,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "tie_word_embeddings": False,
    }
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    weights = {"shared.weight": normal(len(pieces), d_model, std=1.0)}
    for i in range(num_layers):
        attention = f"encoder.block.{i}.layer.0.SelfAttention"
        ffn = f"encoder.block.{i}.layer.1.DenseReluDense"
        weights |= {
            f"{attention}.q.weight": normal(
                num_heads * d_kv, d_model, std=(d_model * d_kv) ** -0.5
            ),
            f"{attention}.k.weight": normal(num_heads * d_kv, d_model, std=d_model**-0.5),
            f"{attention}.v.weight": normal(num_heads * d_kv, d_model, std=d_model**-0.5),
            f"{attention}.o.weight": normal(
                d_model, num_heads * d_kv, std=(num_heads * d_kv) ** -0.5
            ),
            # UMT5: every layer has its own relative position bias (T5 shares layer 0's).
            f"{attention}.relative_attention_bias.weight": normal(
                buckets, num_heads, std=d_model**-0.5
            ),
            f"encoder.block.{i}.layer.0.layer_norm.weight": torch.ones(d_model),
            f"{ffn}.wi_0.weight": normal(d_ff, d_model, std=d_model**-0.5),
            f"{ffn}.wi_1.weight": normal(d_ff, d_model, std=d_model**-0.5),
            f"{ffn}.wo.weight": normal(d_model, d_ff, std=d_ff**-0.5),
            f"encoder.block.{i}.layer.1.layer_norm.weight": torch.ones(d_model),
        }
    weights["encoder.final_layer_norm.weight"] = torch.ones(d_model)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    with atomic_path(out_dir) as folder:
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        backend.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        (folder / "sinkscope_demo.json").write_text(json.dumps({"seed": seed}) + "\n")


def import_prompt_embedding(src: str | Path, out: str | Path, *, prompt: str) -> None:
    """Check a user's precomputed embeddings and store them as `encode_prompt` would."""
    embeds, metadata = load_prompt_embedding(src)
    nonzero = torch.nonzero(embeds.abs().sum(dim=1)).flatten()
    length = int(metadata.get("length", int(nonzero[-1]) + 1 if len(nonzero) else 0))
    save_prompt_embedding(out, embeds, prompt=prompt, length=length)
