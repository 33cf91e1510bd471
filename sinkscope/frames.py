"""Frame bookkeeping shared by every stage: blocks, token <-> frame maps, latent <-> video frames.

Everything here is plain numpy so that the analysis stages never need torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sinkscope.cache_choices import PARTICIPATIVE_POLICIES
from sinkscope.schedules import ROLLING_ATTENTION_FRAMES, rolling_visible


def block_sizes(
    num_frames: int,
    frames_per_block: int,
    independent_first_frame: bool = False,
    *,
    frames_key: str = "video.num_frames",
) -> list[int]:
    """Latent frames per autoregressive block, as Self-Forcing lays them out: blocks of
    `frames_per_block`, after a lone first frame with `independent_first_frame` ([1, 3, 3, ...]).

    A frame count that is not a whole number of blocks is refused, as Self-Forcing refuses it:
    never a shorter last block. `frames_key` names the frame count in the message.
    """
    if num_frames < 1 or frames_per_block < 1:
        raise ValueError(
            f"need num_frames >= 1 and frames_per_block >= 1, got {num_frames}, {frames_per_block}"
        )
    first = 1 if independent_first_frame else 0
    full, rest = divmod(num_frames - first, frames_per_block)
    if rest:
        lower = num_frames - rest
        fits = [n for n in (lower, lower + frames_per_block) if n >= 1]
        rule = (
            f"{frames_key} - 1 must be a multiple of video.frames_per_block={frames_per_block} "
            "(a lone first frame, then whole blocks)"
            if independent_first_frame
            else f"it must be a multiple of video.frames_per_block={frames_per_block}"
        )
        raise ValueError(
            f"{frames_key}={num_frames} does not fit the block layout: with "
            f"video.independent_first_frame: {str(bool(independent_first_frame)).lower()}, "
            f"{rule}; Self-Forcing makes no shorter last block (nearest that fit: "
            f"{' or '.join(map(str, fits))})"
        )
    return [1] * first + [frames_per_block] * full


def block_starts(sizes: list[int]) -> np.ndarray:
    """First latent frame of each block."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def block_of_frame(sizes: list[int]) -> np.ndarray:
    """Block index of every latent frame."""
    return np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)


def token_frames(num_frames: int, frame_seq_length: int) -> np.ndarray:
    """Absolute latent frame of every token: token = frame * T + h * W' + w."""
    return np.repeat(np.arange(num_frames, dtype=np.int32), frame_seq_length)


def visible_frames(
    sizes: list[int],
    local_attn_size: int = -1,
    sink_size: int = 0,
    rolling_steps: int | None = None,
) -> np.ndarray:
    """Which key frames each query frame can see in every pass of its block, as bool [F, F].

    Simulates the Self-Forcing KV cache at frame granularity: without a window every block sees all
    earlier frames and itself; with a window of `local_attn_size` frames the oldest non-sink frames
    are evicted first-in first-out, and the first `sink_size` frames are never evicted. With
    `rolling_steps`, Rolling Forcing's sampler of that many steps: the frames any captured call of
    the query frame sees (its window's later frames included).
    """
    num_frames = int(sum(sizes))
    if rolling_steps is not None:
        seen = np.zeros((num_frames, num_frames), dtype=bool)
        for query, keys in enumerate(rolling_visible(len(sizes), sizes[0], rolling_steps)):
            seen[query, sorted(keys)] = True
        return seen
    capacity = num_frames if local_attn_size == -1 else local_attn_size
    if local_attn_size != -1 and capacity < sink_size + max(sizes):
        raise ValueError(
            f"local_attn_size={local_attn_size} frames cannot hold sink_size={sink_size} "
            f"plus a block of {max(sizes)} frames"
        )
    cached: list[int] = []  # absolute frames in slot order
    seen = np.zeros((num_frames, num_frames), dtype=bool)
    for start, size in zip(block_starts(sizes), sizes, strict=True):
        new = list(range(int(start), int(start) + size))
        overflow = len(cached) + size - capacity
        if overflow > 0:
            cached = cached[:sink_size] + cached[sink_size + overflow :]
        cached = cached + new
        seen[np.ix_(new, cached)] = True
    return seen


def video_frames_of_latent(latent_frame: int) -> range:
    """Video frames decoded from one latent frame by Wan's causal VAE (temporal stride 4).

    Latent 0 -> frame 0; latent k >= 1 -> frames 4k-3 .. 4k.
    """
    if latent_frame < 0:
        raise ValueError(f"latent frame must be >= 0, got {latent_frame}")
    if latent_frame == 0:
        return range(0, 1)
    return range(4 * latent_frame - 3, 4 * latent_frame + 1)


def pixel_frame_count(num_latent_frames: int) -> int:
    """Pixel frames Wan's causal VAE decodes from F latent frames: 1 + 4(F - 1)."""
    if num_latent_frames < 1:
        raise ValueError(f"need at least one latent frame, got {num_latent_frames}")
    return 1 + 4 * (num_latent_frames - 1)


def video_frame_centers(num_latent_frames: int) -> np.ndarray:
    """Mean video frame index of each latent frame: where to draw it on a video-frame axis."""
    return np.array(
        [np.mean(video_frames_of_latent(k)) for k in range(num_latent_frames)], dtype=np.float64
    )


def token_store_bytes(
    *,
    num_passes: int,
    num_heads: int,
    frame_seq_length: int,
    sizes: Sequence[int],
    local_attn_size: int,
    sink_size: int,
    rolling_steps: int | None = None,
) -> int:
    """Uncompressed bytes of one layer's token store: float16 over every visible tile."""
    tiles = int(visible_frames(list(sizes), local_attn_size, sink_size, rolling_steps).sum())
    return num_passes * num_heads * tiles * frame_seq_length**2 * 2


# Per (T, T) chunk on disk beyond its float16 values: blosc's header and its worst-case expansion
# of incompressible data (16 bytes), a crc32c checksum (4), and its entry in the shard index (16).
_CHUNK_OVERHEAD_BYTES = 16 + 4 + 16
# Metadata files (group and arrays, consolidated, with the job's settings in the attributes).
_METADATA_BYTES = 1 << 16


def token_store_disk_bytes(
    *,
    num_passes: int,
    num_heads: int,
    frame_seq_length: int,
    sizes: Sequence[int],
    local_attn_size: int,
    sink_size: int,
    block_size: int = 4096,
    rolling_steps: int | None = None,
) -> int:
    """An upper bound of the disk space one layer's token store occupies, whatever the logits
    compress to: every visible tile stored raw with its overheads, each shard file (one per pass,
    head and query frame) and directory rounded up to a filesystem block of `block_size` bytes,
    the coordinate and pooled arrays and the metadata."""
    tiles = int(visible_frames(list(sizes), local_attn_size, sink_size, rolling_steps).sum())
    num_frames = int(sum(sizes))
    rows = num_passes * num_heads * num_frames  # shard files
    chunks = num_passes * num_heads * tiles
    data = chunks * (frame_seq_length**2 * 2 + _CHUNK_OVERHEAD_BYTES) + rows * (4 + block_size)
    # c/, c/<pass>/, c/<pass>/<head>/, c/<pass>/<head>/<query frame>/ and the arrays' folders.
    directories = (2 + num_passes + num_passes * num_heads + rows + 8) * block_size
    coordinates = 2 * (num_frames * frame_seq_length * 4 + 2 * block_size)
    pooled = num_passes * num_heads * num_frames**2 * 4 + 2 * block_size
    small = 4 * block_size  # timestep and pass_kind
    return data + directories + coordinates + pooled + small + _METADATA_BYTES


# Bytes per (pass, head, query frame, key) of a store over cache slots: float32 key_mass and
# key_logit_mean, int32 slot_frame, slot_token and slot_position, int8 slot_kind.
SLOT_ENTRY_BYTES = 2 * 4 + 3 * 4 + 1


def attention_store_bytes(
    *,
    num_passes: int,
    num_heads: int,
    num_frames: int,
    frame_seq_length: int,
    key_slots: int | None = None,
    visible_tiles: int | None = None,
    precision: str = "float32",
) -> int:
    """Bytes of one layer's attention store (Contract 4), stored raw: key_mass over every
    visible (pass, head, query frame, key token), in float16 with the keys' mean logits summed
    over the heads in float32 (`precision` float16), or both per head in float32; entropy, and
    per frame pair the pooled mean logits, prob_mass_pooled, value_norm and mass_value_norm.
    `visible_tiles`: the (query frame, key frame) pairs a query sees (`visible_frames`; default
    all F x F). Or, over `key_slots` cache slots, key_mass, key_logit_mean and the slot labels
    over every (pass, head, query frame, slot) and entropy: linear in the frames."""
    if key_slots is not None:
        entries = num_passes * num_heads * num_frames
        return entries * key_slots * SLOT_ENTRY_BYTES + entries * 4
    tiles = num_frames**2 if visible_tiles is None else visible_tiles
    keys = num_passes * tiles * frame_seq_length  # per head
    if precision == "float16":
        per_key_token = keys * (2 * num_heads + 4)
    else:
        per_key_token = keys * num_heads * 2 * 4
    return per_key_token + num_passes * num_heads * (num_frames + 4 * num_frames**2) * 4


def attention_chunk_frames(sizes: Sequence[int]) -> int:
    """Query frames per chunk of an attention store's key_mass: the largest count that makes
    every block whole chunks (3 for [3, 3, ...], 1 for [1, 3, 3, ...]), so that one pass call
    of one block writes whole chunks, never half of one another block shares."""
    return math.gcd(*(int(size) for size in sizes))


def attention_store_disk_bytes(
    *,
    num_passes: int,
    num_heads: int,
    num_frames: int,
    frame_seq_length: int,
    frames_per_block: int,
    block_size: int = 4096,
    key_slots: int | None = None,
    visible_tiles: int | None = None,
    precision: str = "float32",
) -> int:
    """An upper bound of the disk space of one layer's attention store: every shard file (one
    per per-key array, pass and `frames_per_block` query frames, the store's chunking:
    `attention_chunk_frames`) with its visible key frames' chunks stored raw, their checksums
    and index, rounded up to a filesystem block; the small arrays, directories and metadata.
    `key_slots`: a store over cache slots (`attention_store_bytes`)."""
    arrays = 2 if key_slots is None else 6
    chunks = arrays * num_passes * -(-num_frames // frames_per_block)
    raw = attention_store_bytes(
        num_passes=num_passes,
        num_heads=num_heads,
        num_frames=num_frames,
        frame_seq_length=frame_seq_length,
        key_slots=key_slots,
        visible_tiles=visible_tiles,
        precision=precision,
    )
    # each shard's index and checksums: 16 + 4 bytes per key frame
    index = 0 if key_slots is not None else chunks * num_frames * 20
    data = raw + index + chunks * (_CHUNK_OVERHEAD_BYTES + block_size)
    directories = (3 + arrays * num_passes + chunks + 14) * block_size
    keys = num_frames * frame_seq_length if key_slots is None else key_slots
    coordinates = keys * 4 + num_frames * 4 + 8 * block_size
    return data + directories + coordinates + _METADATA_BYTES


def export_bytes(
    *,
    num_heads: int,
    frame_seq_length: int,
    num_frames: int,
    last_block_frames: int,
    measure: str = "logits",
) -> dict[str, int]:
    """Bytes of the tensors of one layer in each layout (the files add a few kB of pickle and zip
    headers): the token-sized ones hold H x Lq x Lk values, Lq = last_block_frames x T queries
    over Lk = num_frames x T keys; `frames` is one layer{L}.pt, [H, F, F] + [H, F] float32.
    `measure` (export.measure): what attention_cache.pt holds, logits or probabilities."""
    tokens = num_heads * last_block_frames * frame_seq_length * num_frames * frame_seq_length
    return {
        "figure4": tokens * 4,  # float32 probabilities
        "logit_cache": tokens * 2,  # float16 logits
        # the logits (float16) or the probabilities (float32), with q_shape and k_shape
        "shapes_cache": tokens * (2 if measure == "logits" else 4),
        "frames": num_heads * num_frames * (num_frames + 1) * 4,
    }


def closed_loop_key_frames(
    policy: dict, num_frames: int, frames_per_block: int, rolling: bool = False
) -> int:
    """Frames' worth of keys a call of a closed-loop rollout under `policy` (its settings entry:
    name, budget, capacity) sees at most: the key slots of its attention stores. The full cache
    sees every frame (under the `rolling` sampler, Rolling Forcing's 21); Participative
    Compression holds its capacity and one block before a prune; the others at most their budget
    (top_c: C tokens, R frames and the own block; the rolling sampler's window included)."""
    name = policy["name"]
    if rolling:
        frames = ROLLING_ATTENTION_FRAMES if name == "full" else policy["budget"]
    elif name == "full":
        frames = num_frames
    elif name in PARTICIPATIVE_POLICIES:
        frames = policy["capacity"] + frames_per_block
    else:
        frames = policy["budget"]
    return min(frames, num_frames)


def evicting_frame(frames: Sequence[int], blocks: Sequence[int], capacity: int) -> int | None:
    """The first frame of the first block whose end (its last frame + 1) exceeds `capacity`, the
    frames the cache holds before it drops any (the budget, or Participative Compression's
    capacity): from there on the cache has dropped keys. None when every block fits."""
    frames = np.asarray(frames)
    blocks = np.asarray(blocks)
    for block in np.unique(blocks):
        members = frames[blocks == block]
        if int(members.max()) + 1 > int(capacity):
            return int(members.min())
    return None
