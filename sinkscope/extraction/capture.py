"""Which layers and passes are captured, and what is computed next to the real attention.

The attention output keeps its fused kernel; the capture recomputes q.k / sqrt(head_dim) one query
frame and one head at a time (T x visible keys), so the full matrix never exists in memory. For a
token store (Contract 1) each such tile is queued to the store as float16. For an attention store
(Contract 4) the tile's exact softmax (fp32, shifted by each row's max) is reduced on the job's
device to what the frame-level questions need: the mean probability of every key token over the
query frame's rows (`key_mass`), the mean row entropy, and each key token's mean logit over the
rows (`key_logit_mean`, from the frame's mean query: what a raw q.k score, Deep Forcing's
Participative Compression, ranks by); and each key's value norm ||v||, from which the writer
derives per key frame how much the attention moves into the output (mass x ||v||). Both
record frame-level mean logits, which need no token pairs at all: a token store's from
mean-pooled q and k, an attention store's as the mean of key_logit_mean over each key frame's
tokens (the writer derives them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sinkscope.cache_choices import KEY_KIND
from sinkscope.schedules import BlockPart, ModelCall, key_versions
from sinkscope.wan.model import VisibleKeys

from . import fused_softmax
from .attention_store import AttentionStoreWriter, SlotStoreWriter, prepare_call
from .store import TokenStoreWriter

# Query rows per softmax chunk on the CPU: two (keys x rows) float32 buffers, 8 MB each at 64
# rows of 32760 keys, that stay in the last-level cache. On a GPU a whole tile is one chunk, where
# `fused_softmax` cannot run.
CPU_SOFTMAX_ROWS = 64


def softmax_reductions(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    row_chunk: int | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact softmax of q [R, D] against k [M, D] (all visible), reduced over the rows;
    `bias` [M] is added to every row's scaled logits first (a policy's logit bias).

    Returns (key_mass [M], entropy [R]) in float32: key_mass is the mean over the R rows of the
    probability each key receives (sums to 1); entropy is each row's -sum p log p, in nats. Rows
    are taken `row_chunk` at a time (all at once if None): logits, their max, exp, sums. Nothing of
    size R x M is kept.

    The logits are laid out keys x rows (k @ q.T): with 64 rows per chunk that product runs up
    to 1.4x faster on the CPU than q @ k.T (the whole reduction: 0.81-0.94 of its time), and
    each reduction is still one pass (over the keys for a row's max, sum and entropy, over the
    rows for a key's mass).
    """
    q = q.float() * scale
    k = k.float()
    bias = None if bias is None else bias.float()[:, None]
    rows, keys = q.shape[0], k.shape[0]
    chunk = rows if row_chunk is None else max(1, min(row_chunk, rows))
    key_mass = torch.zeros(keys, dtype=torch.float32, device=q.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=q.device)
    for start in range(0, rows, chunk):
        q_rows = q[start : start + chunk]
        n = q_rows.shape[0]
        if start == 0 or n != chunk:
            x = torch.empty((keys, n), dtype=torch.float32, device=q.device)
            w = torch.empty_like(x)
        torch.mm(k, q_rows.T, out=x)
        if bias is not None:
            x.add_(bias)
        x.sub_(x.amax(dim=0, keepdim=True))  # x <= 0, max 0: exp never overflows, Z >= 1
        torch.exp(x, out=w)
        norm = w.sum(dim=0)
        key_mass.addmv_(w, norm.reciprocal())
        # H = -sum p log p with log p = x - log Z: H = log Z - sum(w x) / Z; w x in x's place
        # (vecdot would allocate its product: a third of its time).
        entropy[start : start + n] = norm.log() - x.mul_(w).sum(dim=0) / norm
    return key_mass.div_(rows), entropy


def frame_reductions(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    frames: int,
    bias: torch.Tensor | None = None,
    row_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """key_mass [heads, frames, M], mean row entropy [heads, frames] and key_logit_mean [heads,
    frames, M] (each key's mean scaled logit over the frame's rows, `bias` included), float32, of
    queries q [frames * T, heads, D] against keys k [M, heads, D]: `fused_softmax`'s kernels where
    they run (a 16-bit model on a GPU), else `softmax_reductions` per (head, query frame) tile,
    `row_chunk` rows at a time (None: CPU_SOFTMAX_ROWS on the CPU, a whole tile on a GPU), and
    key_logit_mean from the frame's mean query."""
    if fused_softmax.usable(q, k):
        key_mass, row_entropy, key_logit_mean = fused_softmax.fused_reductions(
            q, k, scale, frames, bias
        )
        return key_mass, row_entropy.mean(dim=-1), key_logit_mean
    rows = row_chunk or (CPU_SOFTMAX_ROWS if q.device.type == "cpu" else None)
    t, heads = q.shape[0] // frames, q.shape[1]
    key_mass = torch.empty((heads, frames, k.shape[0]), device=q.device)
    entropy = torch.empty((heads, frames), device=q.device)
    for head in range(heads):
        k_head = k[:, head].float()
        for frame in range(frames):
            q_frame = q[frame * t : (frame + 1) * t, head]
            mass, row_entropy = softmax_reductions(q_frame, k_head, scale, rows, bias)
            key_mass[head, frame] = mass
            entropy[head, frame] = row_entropy.mean()
    # Mean over a query frame's tokens of q.k_j = (mean q).k_j: each key token's mean logit
    # (the mean in float64, the products in float32 like the softmax's), bias included.
    q_mean = q.unflatten(0, (frames, t)).mean(dim=1, dtype=torch.float64).float()
    key_logit_mean = torch.einsum("fhd,khd->hfk", q_mean, k.float()) * scale
    if bias is not None:
        key_logit_mean += bias.float()
    return key_mass, entropy, key_logit_mean


def for_writer(writer, *values: torch.Tensor) -> tuple:
    """`values` as `writer` takes them: the tensors themselves for a writer in a store process
    (`store_process.RemoteWriter`: it copies them without waiting for the device), else numpy
    arrays on the host."""
    if getattr(writer, "takes_tensors", False):
        return values
    return tuple(None if value is None else value.cpu().numpy() for value in values)


class LogitCapture:
    """Model capture hook: writes the self-attention of chosen layers and passes to their stores
    (a `TokenStoreWriter` or an `AttentionStoreWriter` per layer).

    A writer may live in a `store_process.StoreProcess` (`RemoteWriter`): the capture then hands
    it its reductions as tensors and never waits for the device.

    Call `begin_call` before every model call (`begin_pass` for Self-Forcing's calls of one
    block); the hook then writes the passes it was asked for, each block's queries of a call on
    its own slot of the pass axis (a Rolling Forcing window holds blocks at several steps).
    """

    def __init__(
        self,
        writers: dict[int, TokenStoreWriter | AttentionStoreWriter],
        pass_indices: Sequence[int],
        frame_seq_length: int,
        head_dim: int,
        softmax_rows: int | None = None,
    ):
        self.writers = writers
        self.step_of_pass = {p: step for step, p in enumerate(pass_indices)}
        self.frame_seq_length = frame_seq_length
        self.scale = 1.0 / math.sqrt(head_dim)
        self.softmax_rows = softmax_rows  # None: CPU_SOFTMAX_ROWS on the CPU, a tile on a GPU
        self.call: ModelCall | None = None
        self._pass: tuple[int, int, str] | None = None

    @property
    def layers(self) -> set[int]:
        return set(self.writers)

    def begin_call(self, index: int, call: ModelCall, timesteps: Sequence[float]) -> None:
        self.call, self._pass = call, None

    def begin_pass(self, block: int, pass_index: int, kind: str, timestep: float) -> None:
        """Self-Forcing's hook: the next call queries one block at `pass_index`."""
        self.call, self._pass = None, (block, pass_index, kind)

    def _current_call(self, query_start: int, queries: int) -> ModelCall:
        if self.call is not None:
            return self.call
        block, pass_index, kind = self._pass
        step = None if kind == "cache" else pass_index
        t = self.frame_seq_length
        part = BlockPart(block, query_start // t, queries // t, step, pass_index)
        return ModelCall(kind, (part,))

    def _captured_parts(self, call: ModelCall) -> list[tuple[BlockPart, int]]:
        """The parts of `call` this capture writes, with their step on the stores' pass axis."""
        steps = ((part, self.step_of_pass.get(part.pass_index)) for part in call.parts)
        return [(part, step) for part, step in steps if step is not None]

    @torch.no_grad()
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        visible: VisibleKeys,
    ) -> None:
        if layer not in self.writers:
            return
        call = self._current_call(visible.query_start, q.shape[1])
        parts = self._captured_parts(call)
        if not parts:
            return
        writer = self.writers[layer]
        t = self.frame_seq_length
        if q.shape[0] != 1:
            raise ValueError("logit capture supports batch size 1")
        # ||v|| of each key and head [heads, M], once for every part of the call: accumulated
        # in float32 without a float32 copy of every value.
        value_norm = None
        if writer.store_kind == "attention" and visible.values is not None:
            value_norm = torch.linalg.vector_norm(visible.values[0], dim=-1, dtype=torch.float32).T
        for part, step in parts:
            rows = slice((part.start - call.start) * t, (part.end - call.start) * t)
            if writer.store_kind == "slots":
                self._slots(writer, step, part.start, q[0, rows], k[0], visible, call)
            else:
                self._frames(writer, step, part.start, q[0, rows], k[0], visible, call, value_norm)

    def _frames(
        self, writer, step, first_frame, q, k, visible: VisibleKeys, call, value_norm=None
    ) -> None:
        """One block's queries into a store over every token of the video; `value_norm`: each
        key's ||v|| per head, for an attention store."""
        t = self.frame_seq_length
        key_tokens = visible.tokens
        if visible.bias is not None or key_tokens.dim() != 1:
            raise ValueError(
                "a store over every token of the video needs whole frames without a logit bias"
            )
        # Cache slots hold whole frames; their absolute frames, in slot order.
        slot_frames = key_tokens[::t] // t
        anchor = visible.labels(t)[1][::t] == KEY_KIND["anchor"]
        if writer.store_kind == "attention":
            # The writer files the keys in slot order and derives their versions itself (the
            # sorting and gathering done here once were a quarter of a GPU survey's kernel
            # launches, all on the thread that feeds the GPU). What the store keeps (float16,
            # the float64 sums per key frame: a few launches) is made here, on the device, so
            # the store process gets what it writes, no more (`prepare_call`).
            key_mass, entropy, key_logit_mean = self._reductions(q, k)
            prepared = prepare_call(key_mass, key_logit_mean, value_norm, t, writer.precision)
            writer.write_prepared(
                step,
                first_frame,
                call,
                *for_writer(writer, slot_frames, anchor, entropy, *prepared),
            )
            return
        order = torch.argsort(slot_frames)
        key_frames = slot_frames[order]
        versions = key_versions(call, key_frames, anchor[order]).to(torch.int8)
        # Keys in ascending absolute frame order, so the store row is filled by contiguous runs.
        k_sorted = k.unflatten(0, (-1, t))[order].flatten(0, 1)
        # Mean over all token pairs of q.k = (mean q).(mean k): frame-level logits without pairs.
        q_pooled = q.unflatten(0, (-1, t)).mean(dim=1, dtype=torch.float32)
        k_pooled = k_sorted.unflatten(0, (-1, t)).mean(dim=1, dtype=torch.float32)
        pooled = torch.einsum("qhd,khd->hqk", q_pooled.double(), k_pooled.double()) * self.scale
        # As the writer takes them, once for all of this call's writes.
        key_frames, pooled, versions = for_writer(writer, key_frames, pooled.float(), versions)
        writer.write_pooled(step, first_frame, key_frames, pooled, versions)
        if writer.tokens:
            self._tiles(writer, step, q, k_sorted, key_frames, first_frame)

    def _tiles(self, writer, step, q, k_sorted, key_frames, first_frame) -> None:
        t = self.frame_seq_length
        for head in range(q.shape[1]):
            k_head = k_sorted[:, head].float()
            for frame in range(q.shape[0] // t):
                q_frame = q[frame * t : (frame + 1) * t, head].float()
                tile = (q_frame @ k_head.T).mul_(self.scale)  # in place: one T x keys buffer
                # One (T, T) tile per key frame, each contiguous: the store's chunks as they are
                # (the layout changes in the cast to float16, one pass on the device).
                tiles = tile.unflatten(1, (-1, t)).transpose(0, 1)
                tiles = tiles.to(torch.float16, memory_format=torch.contiguous_format)
                writer.write_row(step, head, first_frame + frame, tiles.cpu().numpy(), key_frames)

    def _reductions(self, q, k, bias=None):
        """key_mass and key_logit_mean [heads, query frames, keys] and entropy [heads, query
        frames] of the call's queries q [n, heads, D] against its keys k [M, heads, D]."""
        frames = q.shape[0] // self.frame_seq_length
        return frame_reductions(q, k, self.scale, frames, bias, self.softmax_rows)

    def _slots(self, writer: SlotStoreWriter, step, first_frame, q, k, visible, call) -> None:
        """One block's queries into a store over cache slots: the keys in the cache's order,
        labelled."""
        t = self.frame_seq_length
        key_mass, entropy, key_logit_mean = self._reductions(q, k, visible.bias)
        positions, kinds = visible.labels(t)
        tokens = visible.tokens
        labels = {
            "slot_frame": tokens // t,
            "slot_token": tokens % t,
            "slot_position": positions,
            "slot_kind": kinds,
            "slot_version": key_versions(call, tokens // t, kinds == KEY_KIND["anchor"]),
        }
        # Per-head choices come as [M, heads]; the store takes [heads, M].
        names = list(labels)
        labels = for_writer(
            writer, *((values.T if values.dim() == 2 else values) for values in labels.values())
        )
        writer.write_slots(
            step,
            first_frame,
            *for_writer(writer, key_mass, entropy, key_logit_mean),
            dict(zip(names, labels, strict=True)),
        )
