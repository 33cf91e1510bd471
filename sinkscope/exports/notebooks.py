"""Token stores (Contract 1) and frame datasets (Contract 2) -> the seed notebooks' `.pt` files.

The seed research (a reproduction of Deep Forcing's Fig. 4 on Self-Forcing) reads `torch.save`
dicts. Per (checkpoint, prompt) four layouts, each a dict of plain tensors, ints, strings, lists and
dicts that `torch.load(path, weights_only=True)` opens (docs/GUIDE.md, "Exports for the seed
notebooks"):

- figure-4 cache: the softmax probabilities of the last block's queries over every key token;
- logit cache: their pre-softmax logits, float16, -inf where not visible;
- the capture fork's entries (`attention_cache.pt`): the logits or the probabilities
  (`export.measure`), with the shapes of the call's q and k and `is_logits`;
- per layer, the frame x frame matrix of one pass from the frame dataset.

The token-sized tensors (gigabytes per layer at 480x832) are never held in memory whole: each is
filled in a memory-mapped scratch file beside the output, one head's last-block rows at a time
(the softmax in float64 over row chunks), and `torch.save` streams it from there. Every file is
written to `<name>.tmp` and renamed when whole; the scratch folder is removed whatever happens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr

from sinkscope.analysis.stores import (
    STORE_NAMES,
    check_token_store,
    open_frame_dataset,
    open_store,
    read_token_rows,
)
from sinkscope.frames import export_bytes, video_frames_of_latent, visible_frames
from sinkscope.storage import atomic_path, remove, temporary_path, tune_zarr

log = logging.getLogger(__name__)

# Wan's causal VAE: latent 0 -> video frame 0, latent k >= 1 -> video frames 4k-3 .. 4k.
VAE_STRIDE_T = 4
# export.measure -> the frame dataset's variable that layer{L}.pt holds.
MEASURES = {"logits": "logit_mean", "probabilities": "prob_mass"}
# The softmax runs in float64 over this many logits at a time (64 MB): 256 rows of 32760 keys.
SOFTMAX_CHUNK_VALUES = 1 << 23
TOKEN_STORE = STORE_NAMES["tokens"]


def visible_softmax(rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Softmax of logit rows [R, N] (NaN = not visible) over each row's visible keys, written to
    `out` [R, N] (float32): computed in float64, shifted by the row's max, a chunk of rows at a
    time; 0 where not visible, and a row with no visible key is all 0."""
    num_rows, num_keys = rows.shape
    chunk = max(1, SOFTMAX_CHUNK_VALUES // max(num_keys, 1))
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        x = rows[start:stop].astype(np.float64)
        x[np.isnan(x)] = -np.inf  # exp(-inf - max) = 0
        top = x.max(axis=1, keepdims=True)
        top[~np.isfinite(top)] = 0.0  # rows with nothing visible: every weight is 0 below
        x -= top
        np.exp(x, out=x)
        total = x.sum(axis=1, keepdims=True)
        np.divide(x, total, out=x, where=total > 0)
        out[start:stop] = x
    return out


@dataclass(frozen=True)
class _TokenLayer:
    """An opened, checked token store and the facts the layouts record."""

    path: Path
    layer: int
    logits: zarr.Array
    head_dim: int
    frame_seq_length: int
    block_sizes: list[int]
    seen: np.ndarray  # bool [F]: key frames the last block's queries see
    checkpoint: str
    prompt: str
    prompt_text: str

    @property
    def num_heads(self) -> int:
        return int(self.logits.shape[1])

    @property
    def num_frames(self) -> int:
        return sum(self.block_sizes)

    @property
    def query_frames(self) -> list[int]:
        """The last block's latent frames."""
        return list(range(self.num_frames - self.block_sizes[-1], self.num_frames))

    @property
    def num_queries(self) -> int:
        return len(self.query_frames) * self.frame_seq_length

    @property
    def num_keys(self) -> int:
        return self.num_frames * self.frame_seq_length

    def rows(self, step: int, head: int) -> np.ndarray:
        """float16 logits [Lq, N] of the last block's query tokens of one head and pass, checked
        against the visibility its attributes give: NaN exactly on the key frames not seen."""
        t = self.frame_seq_length
        rows = np.empty((self.num_queries, self.num_keys), dtype=np.float16)
        for index, frame in enumerate(self.query_frames):
            rows[index * t : (index + 1) * t] = read_token_rows(
                self.logits, self.path, step, head, frame, t
            )
        missing = np.isnan(rows).reshape(len(rows), self.num_frames, t)
        for key_frame in range(self.num_frames):
            tile = missing[:, key_frame]
            seen = bool(self.seen[key_frame])
            if tile.any() if seen else not tile.all():
                found, said = ("partly NaN", "visible") if seen else ("not NaN", "not visible")
                raise ValueError(
                    f"{TOKEN_STORE} {self.path}: step {step}, head {head}: the last block's "
                    f"logits on key frame {key_frame} are {found}, but its attributes "
                    f"(block_sizes, local_attn_size, sink_size) say that frame is {said}; "
                    "re-run its extraction"
                )
        return rows


def _open_token_layer(path: str | Path, layer: int, step: int) -> _TokenLayer:
    """Open and check the token store of `layer` for an export of captured pass `step`."""
    path = Path(path)
    with open_store(TOKEN_STORE, path, chunks=None) as ds:  # metadata only: no dask
        tokens_per_frame, num_frames, sizes = check_token_store(path, ds)
        attrs = dict(ds.attrs)
        has_logits = "logits" in ds.variables
        num_steps = int(ds.sizes["step"])
    if not has_logits:
        raise ValueError(
            f"{TOKEN_STORE} {path}: no token logits (captured with capture.tokens: false); the "
            "token-sized exports (export.layers) need them"
        )
    if attrs.get("layer") != layer:
        raise ValueError(
            f"{TOKEN_STORE} {path}: holds layer {attrs.get('layer')!r}, not layer {layer} of "
            "export.layers"
        )
    if not 0 <= step < num_steps:
        raise ValueError(
            f"{TOKEN_STORE} {path}: export.step={step}, but it holds {num_steps} captured passes"
        )
    if "head_dim" not in attrs:
        raise ValueError(f"{TOKEN_STORE} {path}: missing group attribute 'head_dim'")
    seen = visible_frames(
        sizes, int(attrs.get("local_attn_size", -1)), int(attrs.get("sink_size", 0))
    )
    return _TokenLayer(
        path=path,
        layer=layer,
        logits=zarr.open_group(str(path), mode="r")["logits"],
        head_dim=int(attrs["head_dim"]),
        frame_seq_length=tokens_per_frame,
        block_sizes=sizes,
        seen=seen[num_frames - 1],
        checkpoint=str(attrs.get("checkpoint", "")),
        prompt=str(attrs.get("prompt", "")),
        prompt_text=str(attrs.get("prompt_text") or attrs.get("prompt", "")),
    )


@contextlib.contextmanager
def _scratch(path: Path) -> Iterator[Path]:
    """A scratch folder beside `path` (`<name>.scratch`), emptied first (a killed job's) and
    removed when the block ends, however it ends."""
    folder = temporary_path(path, ".scratch")
    remove(folder)
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        remove(folder)


def _save(obj: dict, path: str | Path) -> None:
    """torch.save to `<path>.tmp`, renamed to `path` when whole."""
    started = time.perf_counter()
    with atomic_path(path) as temporary:
        torch.save(obj, temporary)
    log.info(
        "wrote %s (%.3f GB, %.1f s)",
        path,
        Path(path).stat().st_size / 1e9,
        time.perf_counter() - started,
    )


def export_token_layouts(
    token_stores: Sequence[str | Path],
    layers: Sequence[int],
    *,
    step: int = 0,
    figure4: str | Path | None = None,
    logit_cache: str | Path | None = None,
    shapes_cache: str | Path | None = None,
    measure: str = "logits",
) -> None:
    """Write the token-sized layouts of captured pass `step` from the token stores of `layers`
    (one per layer, in that order): the figure-4 cache (`attention_cache_figure4.pt`), the logit
    cache (`attention_cache_wan_base.pt`) and the capture fork's entries (`attention_cache.pt`:
    `attn_weights` the logits or the probabilities, as `measure` says); a layout whose path is
    None is not written."""
    if figure4 is None and logit_cache is None and shapes_cache is None:
        return
    _check_measure(measure)
    opened = _open_token_layers(token_stores, layers, step)
    _write_token_layouts(
        opened,
        step,
        figure4=figure4,
        logit_cache=logit_cache,
        shapes_cache=shapes_cache,
        measure=measure,
    )


def _open_token_layers(
    token_stores: Sequence[str | Path], layers: Sequence[int], step: int
) -> list[_TokenLayer]:
    """The checked token stores of `layers`, which must be of one run and one geometry."""
    if len(token_stores) != len(layers):
        raise ValueError(f"{len(token_stores)} token stores but {len(layers)} layers")
    if not layers:
        raise ValueError("the token-sized exports need at least one layer (export.layers)")
    tune_zarr()
    opened = [
        _open_token_layer(path, layer, step)
        for path, layer in zip(token_stores, layers, strict=True)
    ]
    first = opened[0]
    for other in opened[1:]:
        for name in ("checkpoint", "prompt", "frame_seq_length", "block_sizes"):
            if getattr(other, name) != getattr(first, name):
                raise ValueError(
                    f"{TOKEN_STORE} {other.path}: {name} {getattr(other, name)!r} differs from "
                    f"{getattr(first, name)!r} of {first.path}: one export is one run"
                )
    return opened


def _write_token_layouts(
    opened: list[_TokenLayer],
    step: int,
    *,
    figure4: str | Path | None,
    logit_cache: str | Path | None,
    shapes_cache: str | Path | None,
    measure: str = "logits",
) -> None:
    """Fill the scratch tensors one head at a time from each store, then save each layout."""
    # attention_cache.pt holds the logits or the probabilities, as export.measure says.
    shapes_weights = shapes_cache is not None and measure == "probabilities"
    shapes_logits = shapes_cache is not None and measure == "logits"
    first = opened[0]
    sizes = export_bytes(
        num_heads=first.num_heads,
        frame_seq_length=first.frame_seq_length,
        num_frames=first.num_frames,
        last_block_frames=len(first.query_frames),
        measure=measure,
    )
    log.info(
        "exporting pass %d of layers %s (%s): %d query x %d key tokens per head; per layer %s",
        step,
        [layer.layer for layer in opened],
        ", ".join(str(layer.path) for layer in opened),
        first.num_queries,
        first.num_keys,
        ", ".join(f"{name} {size / 1e9:.3f} GB" for name, size in sizes.items()),
    )
    anchor = Path(next(p for p in (figure4, logit_cache, shapes_cache) if p is not None))
    with _scratch(anchor) as scratch:
        weights, logits = {}, {}
        for layer in opened:
            shape = (1, layer.num_heads, layer.num_queries, layer.num_keys)
            if figure4 is not None or shapes_weights:
                weights[layer.layer] = np.memmap(
                    scratch / f"weights{layer.layer}", np.float32, mode="w+", shape=shape
                )
            if logit_cache is not None or shapes_logits:
                logits[layer.layer] = np.memmap(
                    scratch / f"logits{layer.layer}", np.float16, mode="w+", shape=shape
                )
            for head in range(layer.num_heads):
                started = time.perf_counter()
                rows = layer.rows(step, head)
                if layer.layer in weights:
                    visible_softmax(rows, weights[layer.layer][0, head])
                if layer.layer in logits:
                    np.copyto(logits[layer.layer][0, head], rows)
                    logits[layer.layer][0, head][np.isnan(rows)] = -np.inf
                log.info(
                    "layer %d head %d/%d (%.1f s)",
                    layer.layer,
                    head + 1,
                    layer.num_heads,
                    time.perf_counter() - started,
                )
        if figure4 is not None:
            _save(_figure4_cache(opened, weights), figure4)
        if shapes_weights:
            _save(_shapes_cache(opened, weights, is_logits=False), shapes_cache)
        weights.clear()  # the scratch pages can go
        if logit_cache is not None:
            _save(_logit_cache(opened, logits), logit_cache)
        if shapes_logits:
            _save(_shapes_cache(opened, logits, is_logits=True), shapes_cache)
        logits.clear()


def _figure4_cache(opened: list[_TokenLayer], weights: dict[int, np.memmap]) -> dict:
    first = opened[0]
    return {
        "attention_weights": [
            {
                "layer_idx": layer.layer,
                "attn_weights": torch.from_numpy(weights[layer.layer]),
                "last_block_start_frame": layer.query_frames[0],
                "frame_seq_length": layer.frame_seq_length,
            }
            for layer in opened
        ],
        "prompt": first.prompt_text,
        "num_frames": first.num_frames,
        "frame_seq_length": first.frame_seq_length,
        "num_frame_per_block": len(first.query_frames),
        "layer_indices": [layer.layer for layer in opened],
    }


def _logit_cache(opened: list[_TokenLayer], logits: dict[int, np.memmap]) -> dict:
    first = opened[0]
    return {
        "attention_weights": [
            {
                "layer_idx": layer.layer,
                "attn_logits": torch.from_numpy(logits[layer.layer]),
                "num_key_frames": layer.num_frames,
                "frame_seq_length": layer.frame_seq_length,
            }
            for layer in opened
        ],
        **_run_facts(first),
    }


def _shapes_cache(
    opened: list[_TokenLayer], values: dict[int, np.memmap], *, is_logits: bool
) -> dict:
    """The capture fork's entries (`AttentionWeightCapture`): per layer `attn_weights` (the
    logits, -inf where not visible, or the probabilities, 0 there), `q_shape` and `k_shape` (what
    the attention call saw: the block's queries and the keys in the cache) and `is_logits`."""
    entries = []
    for layer in opened:
        num_seen = int(layer.seen.sum()) * layer.frame_seq_length
        entries.append(
            {
                "layer_idx": layer.layer,
                "attn_weights": torch.from_numpy(values[layer.layer]),
                "q_shape": [1, layer.num_queries, layer.num_heads, layer.head_dim],
                "k_shape": [1, num_seen, layer.num_heads, layer.head_dim],
                "is_logits": is_logits,
            }
        )
    return {"attention_weights": entries, "is_logits": is_logits, **_run_facts(opened[0])}


def _run_facts(first: _TokenLayer) -> dict:
    return {
        "prompt": first.prompt_text,
        "num_frames": first.num_frames,
        "frame_seq_length": first.frame_seq_length,
        "query_frames": first.query_frames,
        "key_frames": list(range(first.num_frames)),
    }


def _check_measure(measure: str) -> None:
    if measure not in MEASURES:
        raise ValueError(f"export.measure must be one of {sorted(MEASURES)}, got {measure!r}")


def frame_layout(frame_dataset: str | Path, layer: int, *, step: int = 0, measure: str = "logits"):
    """The `layer{L}.pt` dict of a frame dataset (Contract 2) at captured pass `step`: the
    frame-averaged `logit_mean` (measure `logits`) or `prob_mass` (`probabilities`), 0 where not
    visible, and its mean over the last block's query frames."""
    _check_measure(measure)
    path = Path(frame_dataset)
    ds = open_frame_dataset(path)
    if int(ds["layer"]) != layer:
        raise ValueError(f"frame dataset {path}: holds layer {int(ds['layer'])}, not layer {layer}")
    num_steps = int(ds.sizes["step"])
    if not 0 <= step < num_steps:
        raise ValueError(
            f"frame dataset {path}: export.step={step}, but it holds {num_steps} captured passes"
        )
    values = ds[MEASURES[measure]].isel(step=step).transpose("head", "query_frame", "key_frame")
    values = values.values.astype(np.float32)
    if np.isnan(values).all():
        raise ValueError(
            f"frame dataset {path}: {MEASURES[measure]} is NaN everywhere (a token store captured "
            "with capture.tokens: false has no probabilities); export.measure: logits"
        )
    full = np.where(np.isnan(values), np.float32(0.0), values)
    sizes = [int(size) for size in ds.attrs["block_sizes"]]
    num_frames = sum(sizes)
    query_frames = list(range(num_frames - sizes[-1], num_frames))
    return {
        "layer_index": layer,
        "num_heads": int(ds.sizes["head"]),
        "full_frame_attention": torch.from_numpy(full),
        "is_logits": measure == "logits",
        "last_block_frame_attention": torch.from_numpy(full[:, query_frames].mean(axis=1)),
        "last_block_query_frames": query_frames,
        "block_sizes": sizes,
        "prompt": str(ds.attrs.get("prompt_text") or ds.attrs.get("prompt", "")),
        "num_frames": num_frames,
        "frame_seq_length": int(ds.attrs["frame_seq_length"]),
        "orig_num_frames": video_frames_of_latent(num_frames - 1).stop,
        "vae_stride_t": VAE_STRIDE_T,
    }


def export_run(
    *,
    token_stores: Sequence[str | Path],
    token_layers: Sequence[int],
    frame_datasets: Sequence[str | Path],
    frame_layers: Sequence[int],
    frame_outputs: Sequence[str | Path],
    step: int = 0,
    measure: str = "logits",
    figure4: str | Path | None = None,
    logit_cache: str | Path | None = None,
    shapes_cache: str | Path | None = None,
) -> None:
    """Every export of one (checkpoint, prompt) (rule export_run): the token-sized layouts of the
    token stores, and `layer{L}.pt` of each frame dataset. Every input is opened and checked
    before anything is written."""
    if not len(frame_datasets) == len(frame_layers) == len(frame_outputs):
        raise ValueError(
            f"{len(frame_datasets)} frame datasets, {len(frame_layers)} layers and "
            f"{len(frame_outputs)} outputs"
        )
    token_outputs = {"figure4": figure4, "logit_cache": logit_cache, "shapes_cache": shapes_cache}
    wanted = any(path is not None for path in token_outputs.values())
    opened = _open_token_layers(token_stores, token_layers, step) if wanted else []
    layouts = [
        frame_layout(path, layer, step=step, measure=measure)
        for path, layer in zip(frame_datasets, frame_layers, strict=True)
    ]
    if opened:
        _write_token_layouts(opened, step, **token_outputs, measure=measure)
    for layout, out in zip(layouts, frame_outputs, strict=True):
        _save(layout, out)
