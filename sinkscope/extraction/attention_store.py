"""Attention stores (docs/DESIGN.md, Contract 4): what the survey keeps of the exact softmax of
every surveyed layer, per key token of the video (`AttentionStoreWriter`) or per slot of a closed
loop's cache (`SlotStoreWriter`); the shared machinery (a background writer thread, the
`.partial` protocol, the pooled logits) is `store._StoreWriter`'s."""

from __future__ import annotations

import concurrent.futures
import math
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from sinkscope.schedules import UNSEEN_VERSION, ModelCall, key_versions
from sinkscope.storage import VALUE_FRAME_VARIABLES, VARIABLE_ATTRS, checked_compressors

from .shards import shard_key, write_shard
from .store import (
    KEY_MASS_DIMS,
    POOLED_DIMS,
    ThreadedCrc32cCodec,
    _StoreWriter,
    key_frame_runs,
)

HEAD_SUM_DIMS = ("step", "query_frame", "key_token")
# What an attention store's key_mass is stored in (`capture.survey_precision`). float16 stores
# key_mass x KEY_MASS_SCALE, with `scale_factor` 1 / KEY_MASS_SCALE as CF readers (xarray) undo
# it: a key's mass sits near 1 / the visible keys (3e-5 at the real geometry, float16's subnormal
# range), scaled near 1; a mass of 1 stays below float16's largest value (65504). A power of two,
# so scaling and unscaling round nothing: the one rounding is float16's (2^-11 of the value).
SURVEY_PRECISIONS = ("float16", "float32")
KEY_MASS_SCALE = 2.0**15


def visible_key_compressors() -> tuple[Crc32cCodec]:
    """The codecs of each key frame's chunk of an attention store's per-key arrays: a crc32c
    checksum and no compression (zstd gave 1.17x on the visible float32 mass, for more writer
    time than it saved disk time: benchmarks/README.md)."""
    return (ThreadedCrc32cCodec(),)


def key_mass_compressors() -> tuple[BloscCodec, Crc32cCodec]:
    """The codecs of the attention store's key_mass chunks: blosc zstd with byte shuffle of the
    float32 values (the NaN of invisible keys compress to nothing), then a crc32c checksum."""
    return (
        BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=4),
        ThreadedCrc32cCodec(),
    )


def head_sum(values: torch.Tensor) -> torch.Tensor:
    """values [heads, ...] summed over the heads one after the other, in float32: what numpy's
    sum over a leading axis gives (a float32 store's key_logit_mean.sum(axis=1)), bit for bit,
    on any device."""
    total = values[0].float().clone()
    for head in values[1:]:
        total += head
    return total


def prepare_call(
    key_mass: torch.Tensor,
    key_logit_mean: torch.Tensor,
    value_norm: torch.Tensor | None,
    frame_seq_length: int,
    precision: str,
) -> tuple:
    """What an attention store keeps of one pass call's reductions, computed where they lie
    (on the capture's device: the store process then gets 3.4x fewer bytes, float16, and does
    no arithmetic). From key_mass and key_logit_mean [heads, query frames, keys] (float32, whole
    frames of T keys) and value_norm [heads, keys] (or None):

    - key_mass as stored: float32, or float16 of key_mass x KEY_MASS_SCALE (one rounding: the
      scale is a power of two);
    - the keys' mean logits as stored: per head (float32 stores) or summed over the heads
      (`head_sum`, float16 stores);
    - mass_pooled [heads, query frames, key frames]: the float64 sum of the float32 mass over
      each key frame's tokens (what the float16 rounding does not reach);
    - logit_pooled [heads, query frames, key frames]: the mean logit over each key frame's tokens
      (float64): the frame pair's mean logit over token pairs, (mean q).(mean k);
    - value_norm_pooled [heads, key frames] and mass_value_norm [heads, query frames, key
      frames]: each key frame's mean ||v|| and its sum of key_mass x ||v|| (float64 sums of the
      float32 products), or None without value norms.
    """
    t = frame_seq_length
    mass = key_mass.float()
    frames_of_mass = mass.unflatten(-1, (-1, t))
    mass_pooled = frames_of_mass.sum(-1, dtype=torch.float64)
    logit_pooled = key_logit_mean.float().unflatten(-1, (-1, t)).mean(-1, dtype=torch.float64)
    value_norm_pooled = mass_value_norm = None
    if value_norm is not None:
        norms = value_norm.float().unflatten(-1, (-1, t))
        value_norm_pooled = norms.mean(-1, dtype=torch.float64)
        mass_value_norm = (frames_of_mass * norms[:, None]).sum(-1, dtype=torch.float64)
    if precision == "float16":
        stored_mass = (mass * KEY_MASS_SCALE).to(torch.float16)
        stored_logits = head_sum(key_logit_mean)
    else:
        stored_mass, stored_logits = mass, key_logit_mean.float()
    return stored_mass, stored_logits, mass_pooled, logit_pooled, value_norm_pooled, mass_value_norm


class AttentionStoreWriter(_StoreWriter):
    """Writes one layer's attention store (docs/DESIGN.md, Contract 4): per pass, head and query
    frame the mean softmax probability of every key token (`key_mass`), the mean row entropy,
    and per key frame the exact sum of the mass (`prob_mass_pooled`); the keys' mean logits for
    Deep Forcing's choice: summed over the heads (`key_logit_head_sum`), or per head
    (`key_logit_mean`) with `precision` float32.

    `precision` (SURVEY_PRECISIONS): key_mass in float16 (scaled: KEY_MASS_SCALE) or float32.
    The per-key arrays are sharded (steps, [heads,] frames_per_block, N), a shard per block of a
    chunk per pass and key frame: each pass call's chunks are queued to the background thread,
    which writes a block's shard once it has all its passes; the chunks of key frames the block
    could not see (NaN) are not written at all. The small arrays are written at close.
    """

    store_kind = "attention"
    copies_arguments = True  # rows are spread into new chunks; entropy and pooled logits kept

    def __init__(
        self, path: str | Path, *, frames_per_block: int, precision: str = "float32", **kw
    ):
        if precision not in SURVEY_PRECISIONS:
            raise ValueError(f"precision must be one of {SURVEY_PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.frames_per_block = frames_per_block
        # Chunks written go back here for the next block's rows: a new 9.4 MB chunk per call at
        # the real geometry costs more in page faults than the copy (benchmarks/store_child.py).
        self._spare_rows: list[np.ndarray] = []
        # The writer thread's: per block (shard) waiting for its passes, those it has (step ->
        # key frames, the block's mass and logits chunks, the call's buffers they lie in).
        self._pending: dict[int, dict[int, tuple]] = {}
        super().__init__(path, **kw)
        self.entropy = np.full(
            (self.num_steps, self.num_heads, self.num_frames), np.nan, np.float32
        )
        # Per key frame, the sum of key_mass over its tokens (float64 sums of the float32 mass:
        # frame-level probabilities that the float16 rounding of key_mass does not reach).
        self.mass_pooled = (
            np.full(
                (self.num_steps, self.num_heads, self.num_frames, self.num_frames),
                np.nan,
                np.float32,
            )
            if self.pooled_logits
            else None  # a store over cache slots: none (it grows with the video, not its square)
        )
        # Per key frame, as each query frame saw it: the mean value norm over its tokens and the
        # sum of mass x value norm (F x F per step and head, kept in memory, written at close
        # when the capture gave the value norms).
        self.value_frames: dict[str, np.ndarray] | None = None

    key_dims = KEY_MASS_DIMS

    @property
    def what(self) -> str:
        if self.precision == "float16":
            return "float16 key mass and head-summed mean logits"
        return "float32 key mass and mean logits"

    def _create_arrays(self, group: zarr.Group) -> None:
        heads = (self.num_heads,)
        self.key_mass = self._per_key_array(group, "key_mass", heads, self.precision)
        # the keys' mean logits: per head (float32 stores), or summed over the heads
        if self.precision == "float32":
            self.key_logits = self._per_key_array(group, "key_logit_mean", heads, "float32")
        else:
            self.key_logits = self._per_key_array(group, "key_logit_head_sum", (), "float32")

    def _per_key_array(self, group: zarr.Group, name: str, heads: tuple, dtype: str):
        """[steps, *heads, F, N] of `dtype`, a shard per block (all steps), a chunk per pass
        and key frame; chunks of NaN alone (keys not visible) are not written."""
        t, fpb = self.frame_seq_length, self.frames_per_block
        attributes = {**VARIABLE_ATTRS[name], "coordinates": "timestep pass_kind key_frame"}
        if name == "key_mass" and dtype == "float16":
            attributes["scale_factor"] = 1 / KEY_MASS_SCALE
        return group.create_array(
            name,
            shape=(self.num_steps, *heads, self.num_frames, self.num_tokens),
            chunks=(1, *heads, fpb, t),
            shards=(self.num_steps, *heads, fpb, self.num_tokens),
            compressors=visible_key_compressors(),
            dtype=dtype,
            fill_value=np.nan,
            dimension_names=KEY_MASS_DIMS if heads else HEAD_SUM_DIMS,
            attributes=attributes,
            config={"write_empty_chunks": False},
            # shard files side by side in the array's folder (c.0.0.1.0): no folder per shard
            chunk_key_encoding={"name": "default", "separator": "."},
        )

    def _coordinates(self) -> list[tuple[str, tuple, np.ndarray]]:
        frames = np.arange(self.num_frames, dtype=np.int32)
        return [
            ("query_frame", ("query_frame",), frames),
            ("key_frame", ("key_token",), self._token_frame()),
        ]

    def _write(
        self,
        step: int,
        first_query_frame: int,
        key_frames: list[int],
        mass: np.ndarray,
        logits: np.ndarray,
    ) -> int:
        """One pass call's chunks: `mass` and `logits` [shards, key frames, 1, (heads,)
        frames_per_block, T], the chunks of `key_frames` (ascending) of each of its blocks in
        turn, kept until the block has every pass; then the block's shard of each array is
        written, one file holding all its passes (a file per pass would make the file system's
        cost per file the writer's: benchmarks/store_child.py)."""
        first_shard = first_query_frame // self.frames_per_block
        buffers = (mass, logits)
        written = 0
        for index in range(len(mass)):
            passes = self._pending.setdefault(first_shard + index, {})
            replaced = passes.get(step)  # a pass written again replaces the one before
            passes[step] = (key_frames, (mass[index], logits[index]), buffers)
            if replaced is not None:
                self._release(replaced[2])
            if len(passes) == self.num_steps:
                written += self._write_shards(first_shard + index)
        return written

    def _write_shards(self, shard: int) -> int:
        """The pending passes of block `shard` as one shard file of each per-key array, in pass
        order."""
        # [(step, (key frames, the block's mass and logits chunks, the call's buffers))]
        passes = sorted(self._pending.pop(shard).items())
        positions = [
            step * self.num_frames + frame for step, (frames, _, _) in passes for frame in frames
        ]
        grid = (self.num_steps, self.num_frames)
        written = 0
        for number, array in enumerate((self.key_mass, self.key_logits)):
            heads = (0,) if array.ndim == 4 else ()
            key = shard_key(self.tmp / array.basename, (0, *heads, shard, 0), separator=".")
            parts = [chunks[number] for _, (_, chunks, _) in passes]
            written += write_shard(key, parts, positions, math.prod(grid), grid=grid)
        for _, (_, _, buffers) in passes:
            self._release(buffers)
        return written

    def _release(self, buffers: tuple[np.ndarray, np.ndarray]) -> None:
        """A call's chunk buffers back for the next calls' rows, once no block still waiting for
        its passes holds them."""
        held = (kept for passes in self._pending.values() for *_, kept in passes.values())
        if not any(kept is buffers for kept in held):
            self._spare_rows += buffers

    def _write_pending(self) -> int:
        """At close: the blocks that did not get every pass (a sampler whose first block has
        fewer steps), with the passes they got."""
        return sum(self._write_shards(shard) for shard in sorted(self._pending))

    def _new_rows(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """An uninitialised buffer of `shape` and `dtype` for a block's chunks: a spare one if
        the writer thread has handed one back."""
        for index in range(len(self._spare_rows) - 1, -1, -1):
            spare = self._spare_rows[index]
            if spare.shape == shape and spare.dtype == dtype:
                return self._spare_rows.pop(index)
        # None of this shape: the spares are of an earlier, narrower block (the keys a block
        # sees only grow, then stay), not needed again; kept, a prompt's widths would pile up
        # (with a block's passes held, 1.6 GB in a store process of the real model).
        self._spare_rows.clear()
        return np.empty(shape, dtype)

    def write_call(
        self,
        step: int,
        first_query_frame: int,
        call: ModelCall,
        key_frames: np.ndarray,
        anchor: np.ndarray,
        key_mass: np.ndarray,
        entropy: np.ndarray,
        key_logit_mean: np.ndarray,
        value_norm: np.ndarray | None = None,
    ) -> None:
        """One pass call's block from its float32 reductions: `prepare_call` here, then
        `write_prepared`. `call`: the model call; key_frames (distinct, in any order) and
        `anchor` (whether a key frame is Rolling Forcing's anchor) per key frame of the rows;
        key_mass and key_logit_mean [heads, query frames, len(key_frames) * T], entropy [heads,
        query frames]; `value_norm` [heads, keys]: each key's ||v||. The capture prepares on its
        device instead and calls `write_prepared` itself."""
        prepared = self._prepare_on_host(key_mass, key_logit_mean, value_norm)
        entropy = np.asarray(entropy, np.float32)
        self.write_prepared(step, first_query_frame, call, key_frames, anchor, entropy, *prepared)

    def _prepare_on_host(self, key_mass, key_logit_mean, value_norm=None) -> list:
        """`prepare_call` of float32 arrays on the host, as numpy arrays (None where None)."""
        prepared = prepare_call(
            *(
                None if v is None else torch.from_numpy(np.asarray(v, np.float32))
                for v in (key_mass, key_logit_mean, value_norm)
            ),
            self.frame_seq_length,
            self.precision,
        )
        return [None if v is None else v.numpy() for v in prepared]

    def write_prepared(
        self,
        step: int,
        first_query_frame: int,
        call: ModelCall,
        key_frames: np.ndarray,
        anchor: np.ndarray,
        entropy: np.ndarray,
        key_mass: np.ndarray,
        key_logits: np.ndarray,
        mass_pooled: np.ndarray,
        logit_pooled: np.ndarray,
        value_norm_pooled: np.ndarray | None = None,
        mass_value_norm: np.ndarray | None = None,
    ) -> None:
        """One pass call's block as `prepare_call` made it (its arrays in that order, after the
        call's key frames, anchors and entropy [heads, query frames]): the key versions derived,
        the frame-level values filed, each visible key frame's chunk of each shard packed and
        queued (the key frames not visible have none)."""
        versions = key_versions(call, key_frames, anchor).astype(np.int8)
        self.write_pooled(step, first_query_frame, key_frames, logit_pooled, versions)
        if value_norm_pooled is not None:
            self._file_values(
                step, first_query_frame, key_frames, value_norm_pooled, mass_value_norm
            )
        self._file_block(
            step, first_query_frame, key_frames, entropy, key_mass, key_logits, mass_pooled
        )

    def _file_values(self, step, first_query_frame, key_frames, value_norm_pooled, mass_value_norm):
        """The value side of one pass call, per key frame (`prepare_call`): the mean ||v|| of its
        tokens (the copy of the frame the call saw) and the sum over its tokens of key_mass x
        ||v||: how much of the attention output's size the frame can account for (Kobayashi et
        al.'s norm-based view of attention, ||p v|| = p ||v||)."""
        frames = mass_value_norm.shape[1]
        if self.value_frames is None:
            shape = (self.num_steps, self.num_heads, self.num_frames, self.num_frames)
            self.value_frames = {
                name: np.full(shape, np.nan, np.float32) for name in VALUE_FRAME_VARIABLES
            }
        queries = slice(first_query_frame, first_query_frame + frames)
        # Index through views, as write_pooled does.
        self.value_frames["value_norm"][step][:, queries][:, :, key_frames] = value_norm_pooled[
            :, None
        ]
        self.value_frames["mass_value_norm"][step][:, queries][:, :, key_frames] = mass_value_norm

    def write_block(
        self,
        step: int,
        first_query_frame: int,
        key_frames: np.ndarray,
        key_mass: np.ndarray,
        entropy: np.ndarray,
        key_logit_mean: np.ndarray,
    ) -> None:
        """The key side alone of one pass call (no pooled logits, versions or values): key_mass
        and key_logit_mean [heads, query frames, len(key_frames) * T] in float32 against the
        visible key frames (distinct absolute frames, whole frames, in any order), entropy
        [heads, query frames]."""
        stored_mass, stored_logits, mass_pooled, *_ = self._prepare_on_host(
            key_mass, key_logit_mean
        )
        entropy = np.asarray(entropy, np.float32)
        self._file_block(
            step, first_query_frame, key_frames, entropy, stored_mass, stored_logits, mass_pooled
        )

    def _file_block(
        self, step, first_query_frame, key_frames, entropy, key_mass, key_logits, mass_pooled
    ) -> None:
        """Each visible key frame's chunk of each shard of `key_mass` and `key_logits` as they
        are stored (`prepare_call`), copied into the shard layout and queued; the entropy and
        the pooled mass filed."""
        t = self.frame_seq_length
        frames = key_mass.shape[-2]
        runs = sorted(key_frame_runs(key_frames))
        # each visible key frame (ascending) and where its tokens lie in the rows
        frame_offsets = [
            (frame, offset + frame - first)
            for first, stop, offset in runs
            for frame in range(first, stop)
        ]
        queries = slice(first_query_frame, first_query_frame + frames)
        # Index through views, as write_pooled does.
        self.mass_pooled[step][:, queries][:, :, key_frames] = mass_pooled
        fpb = self.frames_per_block
        shards = frames // fpb
        packed = []
        for values in (key_mass, key_logits):
            lead = values.shape[:-2]  # (heads,), or () for the head sums
            chunks = self._new_rows((shards, len(frame_offsets), 1, *lead, fpb, t), values.dtype)
            for shard in range(shards):
                rows = values[..., shard * fpb : (shard + 1) * fpb, :]
                index = 0
                for first, stop, offset in runs:  # a run of key frames in one strided copy
                    run = rows[..., offset * t : (offset + stop - first) * t]
                    run = np.moveaxis(run.reshape(*run.shape[:-1], stop - first, t), -2, 0)
                    np.copyto(chunks[shard, index : index + stop - first, 0], run)
                    index += stop - first
            packed.append(chunks)
        self.entropy[step, :, queries] = entropy
        frames_written = [frame for frame, _ in frame_offsets]
        self._put((step, first_query_frame, frames_written, *packed))

    def _finish(self, group: zarr.Group) -> None:
        entropy = group.create_array(
            "entropy",
            shape=self.entropy.shape,
            dtype="float32",
            fill_value=np.nan,
            dimension_names=self.key_dims[:3],
            compressors=checked_compressors(),
            attributes=VARIABLE_ATTRS["entropy"],
        )
        entropy[:] = self.entropy
        mass = {} if self.mass_pooled is None else {"prob_mass_pooled": self.mass_pooled}
        for name, values in {**mass, **(self.value_frames or {})}.items():
            array = group.create_array(
                name,
                shape=values.shape,
                dtype="float32",
                fill_value=np.nan,
                dimension_names=POOLED_DIMS,
                compressors=checked_compressors(),
                attributes=VARIABLE_ATTRS[name],
            )
            array[:] = values


SLOT_DIMS = ("step", "head", "query_frame", "key_slot")
# The labels of each slot, aligned with key_mass: name -> (dtype, what an empty slot holds).
SLOT_LABELS = {
    "slot_frame": ("int32", -1),
    "slot_token": ("int32", -1),
    "slot_position": ("int32", -1),
    "slot_kind": ("int8", -1),
    "slot_version": ("int8", UNSEEN_VERSION),
}


class SlotStoreWriter(AttentionStoreWriter):
    """An attention store whose key axis is the cache, not the video (docs/DESIGN.md, Contract 4,
    "over cache slots"): per pass, head and query frame, `key_mass` and `key_logit_mean` of every
    key the query saw, in the cache's order, each slot labelled with the latent frame and token
    its key came from, its temporal RoPE position as the query saw it and why it was there
    (`SLOT_LABELS`). `slots`: the most keys any call sees; a store grows with the video, not its
    square. No pooled frame-level logits: the frame view derives them from `key_logit_mean`.

    Every array is chunked (steps, heads, frames_per_block, slots): the captured passes of one
    block are gathered in memory and written as one chunk of each array (a 1,000-frame closed
    loop is 2,000 pass calls: one chunk each would make zarr's overhead per chunk the cost)."""

    what = "float32 key mass and mean logits over cache slots"
    store_kind = "slots"
    pooled_logits = False
    key_dims = SLOT_DIMS

    def __init__(self, path: str | Path, *, slots: int, **kw):
        self.slots = slots
        self._pool = concurrent.futures.ThreadPoolExecutor(6, thread_name_prefix="slot-writer")
        # The blocks being gathered (a rolling window's calls hold several): first query frame:
        # rows by array. A block is queued once its last captured pass has come.
        self._blocks: dict[int, dict[str, np.ndarray]] = {}
        super().__init__(path, **kw)
        # A block is queued at its last captured pass that is not a recache (a recache comes
        # after its frames' blocks and is queued alone): None when only recaches are captured.
        regular = [i for i, kind in enumerate(self.pass_kinds) if kind != "recache"]
        self._last_regular_step = regular[-1] if regular else None

    def close(self) -> Path:
        try:
            if not self._closed:
                for first_query_frame in sorted(self._blocks):
                    self._flush(first_query_frame)
            return super().close()
        finally:
            self._pool.shutdown()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self._pool.shutdown()

    def _create_arrays(self, group: zarr.Group) -> None:
        self.arrays = {}
        shape = (self.num_steps, self.num_heads, self.num_frames, self.slots)
        chunks = (self.num_steps, self.num_heads, self.frames_per_block, self.slots)
        variables = {"key_mass": ("float32", np.nan), "key_logit_mean": ("float32", np.nan)}
        for name, (dtype, fill) in {**variables, **SLOT_LABELS}.items():
            self.arrays[name] = group.create_array(
                name,
                shape=shape,
                chunks=chunks,
                compressors=key_mass_compressors(),
                dtype=dtype,
                fill_value=fill,
                dimension_names=SLOT_DIMS,
                attributes={**VARIABLE_ATTRS[name], "coordinates": "timestep pass_kind"},
            )

    def _coordinates(self) -> list[tuple[str, tuple, np.ndarray]]:
        return [
            ("query_frame", ("query_frame",), np.arange(self.num_frames, dtype=np.int32)),
            ("key_slot", ("key_slot",), np.arange(self.slots, dtype=np.int32)),
        ]

    def write_pooled(self, *args) -> None:
        raise TypeError("a store over cache slots keeps no pooled frame-level logits")

    def _write(self, first_query_frame: int, rows: dict, step: int | None = None) -> int:
        frames = rows["key_mass"].shape[2]
        queries = slice(first_query_frame, first_query_frame + frames)
        steps = slice(None) if step is None else slice(step, step + 1)

        def write(name: str) -> None:
            self.arrays[name][steps, :, queries, :] = rows[name]

        # The six chunks of a block at once: zarr's event loop encodes them side by side, where
        # one after the other each waited for the last.
        list(self._pool.map(write, rows))
        return sum(values.nbytes for values in rows.values())

    def _flush(self, first_query_frame: int) -> None:
        self._put((first_query_frame, self._blocks.pop(first_query_frame)))

    def write_slots(
        self,
        step: int,
        first_query_frame: int,
        key_mass: np.ndarray,
        entropy: np.ndarray,
        key_logit_mean: np.ndarray,
        labels: dict[str, np.ndarray],
    ) -> None:
        """key_mass and key_logit_mean [heads, query frames, M] over the M keys a pass call saw,
        in cache order, entropy [heads, query frames], and the `SLOT_LABELS` of each key ([M]
        shared by the heads, or [heads, M]); padded to `slots`, and queued once every captured
        pass of the block has come (every sampler calls a block's passes in pass order); a
        recache pass, which comes after its frames' blocks were written, is queued alone."""
        heads, frames, keys = key_mass.shape
        if keys > self.slots:
            raise ValueError(
                f"{self.path}: a call saw {keys} keys, more than the store's {self.slots} slots"
            )
        late = self.pass_kinds[step] == "recache"
        if late:
            # LongLive's recache re-encodes frames whose blocks were written long before: its
            # rows go out on their own, one step of the frames it queried.
            step_rows = self._rows(1, heads, frames)
            self._fill(step_rows, 0, key_mass, key_logit_mean, labels, keys)
            self.entropy[step, :, first_query_frame : first_query_frame + frames] = entropy
            self._put((first_query_frame, step_rows, step))
            return
        if first_query_frame not in self._blocks:
            self._blocks[first_query_frame] = self._rows(self.num_steps, heads, frames)
        rows = self._blocks[first_query_frame]
        self._fill(rows, step, key_mass, key_logit_mean, labels, keys)
        self.entropy[step, :, first_query_frame : first_query_frame + frames] = entropy
        if step == self._last_regular_step:
            self._flush(first_query_frame)

    def _rows(self, steps: int, heads: int, frames: int) -> dict[str, np.ndarray]:
        shape = (steps, heads, frames, self.slots)
        rows = {name: np.full(shape, np.nan, np.float32) for name in ("key_mass", "key_logit_mean")}
        for name, (dtype, fill) in SLOT_LABELS.items():
            rows[name] = np.full(shape, fill, dtype)
        return rows

    @staticmethod
    def _fill(rows, step, key_mass, key_logit_mean, labels, keys) -> None:
        rows["key_mass"][step, :, :, :keys] = key_mass
        rows["key_logit_mean"][step, :, :, :keys] = key_logit_mean
        for name in SLOT_LABELS:
            if name == "slot_version" and name not in labels:
                continue  # stays -1: a writer's caller that knows no versions
            values = np.asarray(labels[name])
            rows[name][step, :, :, :keys] = (values if values.ndim == 2 else values[None])[
                :, None, :
            ]
