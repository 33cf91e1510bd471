"""Tiny Contract 1 token stores for tests, written with zarr directly (not with sinkscope)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr
import zarr.codecs

from sinkscope.frames import visible_frames


def default_attrs(
    *, T: int, num_frames: int, block_sizes: list[int], timesteps: list[float], num_heads: int
) -> dict:
    """Group attributes as the extractor writes them, with made-up provenance."""
    return {
        "checkpoint": "demo",
        "checkpoint_sha256": "0" * 64,
        "prompt": "cat",
        "prompt_text": "a cat on a sofa",
        "seed": 0,
        "layer": 3,
        "num_heads": num_heads,
        "head_dim": 8,
        "frame_seq_length": T,
        "latent_grid": [num_frames, 2, T // 2],
        "num_frames": num_frames,
        "block_sizes": list(block_sizes),
        "timesteps": [float(t) for t in timesteps],
        "local_attn_size": -1,
        "sink_size": 0,
        "logit_scale": 8**-0.5,
        "sinkscope_version": "0.1.0",
        "config": {"model": "tiny", "num_steps": len(timesteps)},
        "complete": True,
    }


def write_token_store(
    path: str | Path,
    logits: np.ndarray,
    *,
    T: int,
    block_sizes: list[int],
    timesteps: list[float],
    pass_kinds: list[str],
    attrs: dict | None = None,
) -> Path:
    """Write logits [S, H, N, N] (NaN = invisible) in the Contract 1 layout.

    `attrs` override the made-up defaults of `default_attrs`.

    Rows of a query frame that are entirely NaN are not written, like tiles the extractor never
    computes; zarr also skips all-NaN inner chunks, so unseen tiles read back as the fill value.
    """
    path = Path(path)
    num_steps, num_heads, num_tokens, _ = logits.shape
    num_frames = int(sum(block_sizes))
    if num_tokens != num_frames * T or logits.shape[3] != num_tokens:
        raise ValueError(f"logits shape {logits.shape} does not match {num_frames} frames of {T}")
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group_attrs = default_attrs(
        T=T,
        num_frames=num_frames,
        block_sizes=block_sizes,
        timesteps=timesteps,
        num_heads=num_heads,
    )
    group_attrs.update(attrs or {})
    group.attrs.update(group_attrs)
    array = group.create_array(
        "logits",
        shape=logits.shape,
        dtype="float16",
        chunks=(1, 1, T, T),
        shards=(1, 1, T, num_tokens),
        fill_value=np.nan,
        dimension_names=("step", "head", "query_token", "key_token"),
        compressors=zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle", typesize=2),
        attributes={"coordinates": "timestep pass_kind query_frame key_frame"},
    )
    for step in range(num_steps):
        for head in range(num_heads):
            for frame in range(num_frames):
                rows = slice(frame * T, (frame + 1) * T)
                block = logits[step, head, rows, :]
                if np.isnan(block).all():
                    continue
                array[step, head, rows, :] = block.astype(np.float16)

    token_frame = np.repeat(np.arange(num_frames, dtype=np.int32), T)
    group.create_array(
        "timestep", data=np.asarray(timesteps, dtype=np.float32), dimension_names=("step",)
    )
    kinds = group.create_array(
        "pass_kind", shape=(num_steps,), dtype=str, dimension_names=("step",)
    )
    kinds[:] = np.asarray(pass_kinds, dtype=object)
    group.create_array("query_frame", data=token_frame, dimension_names=("query_token",))
    group.create_array("key_frame", data=token_frame, dimension_names=("key_token",))
    zarr.consolidate_metadata(path)
    return path


def random_block_causal_logits(
    rng: np.random.Generator,
    *,
    num_steps: int,
    num_heads: int,
    T: int,
    block_sizes: list[int],
    local_attn_size: int = -1,
    sink_size: int = 0,
    scale: float = 3.0,
) -> np.ndarray:
    """Random logits [S, H, N, N] as float64 holding float16 values, NaN on invisible tiles.

    Key frame 0 gets a bias so that the softmax is far from uniform, as with a real sink.
    """
    num_frames = int(sum(block_sizes))
    num_tokens = num_frames * T
    logits = rng.normal(0.0, scale, size=(num_steps, num_heads, num_tokens, num_tokens))
    logits[..., :T] += 2.0
    seen = visible_frames(block_sizes, local_attn_size, sink_size)
    token_seen = np.repeat(np.repeat(seen, T, axis=0), T, axis=1)
    logits[..., ~token_seen] = np.nan
    # Round through float16 so that brute-force references see exactly the stored values.
    return logits.astype(np.float16).astype(np.float64)
