"""The KV caches of the closed loop's policies beyond Self-Forcing's rolling window: they hold the
tensors; what they keep is decided in `sinkscope.cache_choices`, shared with the offline recall.

Every cache takes a model call's keys and values through `update` (the keys after RoPE, with the
call's queries `q` and its keys before RoPE `k_raw`) and returns what the call attends to: keys,
values and the absolute token of each. Sink keys turn in one of two ways (`TURNS`), equal in exact
arithmetic and different in rounding (docs/DESIGN.md, Contract 6):
- `delta`, as Deep Forcing's code: the cached keys' temporal channels are multiplied by the turn,
  in float64, and written back in the cache's dtype, turn after turn;
- `rerope`, as Rolling Forcing keeps its anchor: the sinks' keys before RoPE are kept and RoPE is
  applied afresh at the sinks' new positions, all three axes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sinkscope.cache_choices import KEY_KIND, DeepSinkTurns, ParticipativeChoice, TopCChoice
from sinkscope.wan.model import CacheEngine, KVCache
from sinkscope.wan.rope import apply_rope, rope_angles, rotate_frames

from .capture import frame_reductions

TURNS = ("delta", "rerope")


class SinkKeys:
    """The sink keys of one layer's cache, turned in time as `turn` says (`TURNS`)."""

    def __init__(self, turn: str, sink_tokens: int, token_grid: tuple[int, int] | None):
        if turn not in TURNS:
            raise ValueError(f"sink turn {turn!r} is not one of {TURNS}")
        if turn == "rerope" and token_grid is None:
            raise ValueError("rerope turns need the token grid (height, width) of a frame")
        self.turn = turn
        self.tokens = sink_tokens
        self.grid = token_grid
        self.shift = 0  # sink frame i sits at RoPE position i + shift
        self.raw: torch.Tensor | None = None  # [B, sink tokens, heads, head_dim] before RoPE

    def record(self, k_raw: torch.Tensor | None, current_start: int) -> None:
        """Keep the keys before RoPE of the sink tokens a call writes (rerope): the last write of
        a token, its block's cache-update pass, is its key."""
        if self.turn != "rerope" or k_raw is None or current_start >= self.tokens:
            return
        if self.raw is None:
            shape = (k_raw.shape[0], self.tokens, *k_raw.shape[2:])
            self.raw = torch.zeros(shape, dtype=k_raw.dtype, device=k_raw.device)
        stop = min(self.tokens, current_start + k_raw.shape[1])
        self.raw[:, current_start:stop] = k_raw[:, : stop - current_start]

    def moved(self, positions: torch.Tensor, key_tokens: torch.Tensor) -> torch.Tensor:
        """`positions` of `key_tokens` with the sinks' moved by the turns so far."""
        return torch.where(key_tokens < self.tokens, positions + self.shift, positions)

    def turn_by(self, keys: torch.Tensor, frames: int) -> None:
        """Turn the cached sink keys `keys` [B, sink tokens, heads, head_dim], in place."""
        if not frames:
            return
        self.shift += frames
        if self.turn == "delta":
            keys.copy_(rotate_frames(keys, frames))
            return
        height, width = self.grid
        sinks = self.tokens // (height * width)
        angles = rope_angles(keys.shape[-1], (sinks, height, width), self.shift, keys.device)
        keys.copy_(apply_rope(self.raw, angles).to(keys.dtype))


class DeepSinkKVCache(KVCache):
    """Self-Forcing's rolling cache with sink frames whose keys Deep Sink turns in time, as Deep
    Forcing's `causal_model_DS.py` does (`cache_choices.DeepSinkTurns`): no turn at the first
    eviction, then at each evicting block's first pass, so sink frame i sits at c - c1 + i.
    `slot_token` keeps the sinks' own frames: they are still frames 0..S-1 of the video."""

    def __init__(self, *args, turn: str = "delta", token_grid=None, **kwargs):
        super().__init__(*args, **kwargs)
        t = self.frame_seq_length
        self.turns = DeepSinkTurns(self.local_attn_size, self.sink_tokens // t)
        self.sinks = SinkKeys(turn, self.sink_tokens, token_grid)

    def update(self, k, v, current_start, *, q=None, k_raw=None):
        first_pass = current_start + k.shape[1] > self.global_end
        visible = super().update(k, v, current_start)
        self.sinks.record(k_raw, current_start)
        if first_pass:
            # The turn follows the block's write, before its attention (`visible` are views).
            frames = self.turns.block(k.shape[1] // self.frame_seq_length)
            self.sinks.turn_by(self.k[:, : self.sink_tokens], frames)
        return visible

    def key_labels(self, key_tokens, query_start):
        positions, kinds = super().key_labels(key_tokens, query_start)
        return self.sinks.moved(positions, key_tokens), kinds


class ParticipativeKVCache(CacheEngine):
    """Deep Forcing's Participative Compression with or without Deep Sink under it, as its
    `causal_model.py` runs it: a cache of `choice.capacity` frames pruned at the first pass of a
    block that overflows it (`cache_choices.ParticipativeChoice` decides what stays, from the
    raw q.k of the buffered queries, in the model's dtype as the release computes it). One
    choice for all heads, so `update` returns one token per key."""

    def __init__(
        self,
        choice: ParticipativeChoice,
        *,
        num_frames: int,
        num_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        turn: str = "delta",
        token_grid: tuple[int, int] | None = None,
    ):
        self.choice = choice
        t = self.frame_seq_length = choice.frame_seq_length
        self.chosen_below = 0  # held tokens of frames S .. chosen_below - 1 were chosen by score
        # Room for a full cache and one more block before its prune (no more than the video).
        slots = min(choice.capacity + choice.frames_per_block, num_frames) * t
        self.k = torch.zeros(1, slots, num_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.queries = self.k[:, :0]  # the buffer: the newest queries in call order
        self.held = 0
        self.global_end = 0
        self.sinks = SinkKeys(turn, choice.sink_frames * t, token_grid)

    def update(self, k, v, current_start, *, q=None, k_raw=None):
        if q is None:
            raise ValueError("participative compression scores with the call's queries")
        n = k.shape[1]
        end = current_start + n
        # Every call's queries join the buffer before its keys are written or chosen.
        self.queries = torch.cat([self.queries, q], dim=1)[:, -self.choice.recent_tokens :]
        self.choice.add_queries(n)
        self.sinks.record(k_raw, current_start)
        if end > self.global_end:
            overflow = self.choice.overflows(n)
            self.k[:, self.held : self.held + n] = k
            self.v[:, self.held : self.held + n] = v
            self.held += n
            self.choice.append(current_start, n)
            if overflow:
                self._prune(current_start // self.choice.frame_seq_length)
            self.global_end = end
        else:
            # Later passes of the block rewrite its own slots, the newest.
            self.k[:, self.held - n : self.held] = k
            self.v[:, self.held - n : self.held] = v
        tokens = torch.as_tensor(self.choice.tokens, device=k.device)
        return self.k[:, : self.held], self.v[:, : self.held], tokens

    def scores(self) -> torch.Tensor:
        """Per held token, the raw q.k of the buffered queries summed over them and the heads,
        as Deep Forcing's code computes it (less its positive scale, which never changes the
        choice): the queries summed in the cache's dtype, then one product over heads x channels
        per token, a batched matmul whose output is rounded to that dtype, then float32. In
        bfloat16 many scores tie (8 significant bits); ties keep the older token
        (`cache_choices`), where the release's CUDA `topk` documents no order."""
        count = self.choice.buffered_queries()
        query_sum = self.queries[:, self.queries.shape[1] - count :].sum(dim=1)  # [1, H, D]
        keys = self.k[:, : self.held].flatten(2)  # [1, M, H * D]
        return torch.bmm(query_sum.flatten(1)[:, None], keys.transpose(1, 2))[0, 0].float()

    def _prune(self, block_start: int) -> None:
        prune = self.choice.prune(self.scores().cpu().numpy(), block_start)
        kept = torch.as_tensor(prune.kept, device=self.k.device)
        self.k[:, : len(kept)] = self.k[:, kept]
        self.v[:, : len(kept)] = self.v[:, kept]
        self.held = len(kept)
        self.sinks.turn_by(self.k[:, : self.sinks.tokens], prune.turn)
        # What the prune kept before its newest frames (Recent and the own block) it chose.
        self.chosen_below = block_start - self.choice.recent_frames

    def key_labels(self, key_tokens, query_start):
        positions, kinds = super().key_labels(key_tokens, query_start)
        frames = key_tokens // self.frame_seq_length
        chosen = (key_tokens >= self.sinks.tokens) & (frames < self.chosen_below)
        kinds = torch.where(chosen, KEY_KIND["chosen"], kinds)
        kinds = torch.where(key_tokens < self.sinks.tokens, KEY_KIND["sink"], kinds)
        return self.sinks.moved(positions, key_tokens), kinds

    def begin_pass(self, kind: str) -> None:
        pass


class TopCKVCache(CacheEngine):
    """sinkscope's `top_c`: [top-C history tokens | R recent frames | own block], each head its
    own choice (`cache_choices.TopCChoice`), by the mean softmax probability the previous
    block's cache-update pass gave each key. The window (recent frames and the own block) is a
    contiguous run of tokens; with C at least the whole history the cache is the full cache,
    slot for slot. `update` returns key tokens [M, heads]: each head has its own."""

    def __init__(
        self,
        choice: TopCChoice,
        *,
        head_dim: int,
        window_frames: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.choice = choice
        t = self.frame_seq_length = choice.frame_seq_length
        self.scale = 1.0 / math.sqrt(head_dim)
        shape = (1, window_frames * t, choice.num_heads, head_dim)
        self.window_k = torch.zeros(shape, device=device, dtype=dtype)
        self.window_v = torch.zeros_like(self.window_k)
        self.history_k = self.window_k[:, :0]
        self.history_v = self.window_v[:, :0]
        self.global_end = 0
        self.scoring = False  # this pass is the cache-update pass
        self.score: np.ndarray | None = None  # [heads, visible] of the last cache-update pass

    def _compress(self, block_start: int) -> None:
        """Move the tokens that leave the window into the history, each head keeping its best C."""
        old_start = self.choice.window_start
        leaving = len(self.choice.leaving(block_start))
        if not leaving:
            return
        choice = self.choice.compress(block_start, self.score)
        cand_k = torch.cat([self.history_k, self.window_k[:, :leaving]], dim=1)
        cand_v = torch.cat([self.history_v, self.window_v[:, :leaving]], dim=1)
        index = torch.as_tensor(choice, device=cand_k.device)
        index = index[None, :, :, None].expand(1, -1, -1, cand_k.shape[-1])
        self.history_k = torch.gather(cand_k, 1, index)
        self.history_v = torch.gather(cand_v, 1, index)
        filled = self.global_end - old_start
        self.window_k[:, : filled - leaving] = self.window_k[:, leaving:filled].clone()
        self.window_v[:, : filled - leaving] = self.window_v[:, leaving:filled].clone()

    def update(self, k, v, current_start, *, q=None, k_raw=None):
        n = k.shape[1]
        current_end = current_start + n
        if current_end > self.global_end:
            self._compress(current_start)
            self.score = None
        window_start = self.choice.window_start
        offset = current_start - window_start
        if offset < 0 or offset + n > self.window_k.shape[1]:
            raise RuntimeError(
                f"top_c window of {self.window_k.shape[1]} tokens cannot hold tokens "
                f"{current_start}..{current_end - 1}"
            )
        self.window_k[:, offset : offset + n] = k
        self.window_v[:, offset : offset + n] = v
        self.global_end = max(self.global_end, current_end)
        filled = self.global_end - window_start
        keys = torch.cat([self.history_k, self.window_k[:, :filled]], dim=1)
        values = torch.cat([self.history_v, self.window_v[:, :filled]], dim=1)
        if self.scoring and q is not None:
            self.score = self._score(q, keys)
        window_token = torch.arange(window_start, self.global_end, device=k.device)
        history_token = torch.as_tensor(self.choice.history, device=k.device)
        heads = self.choice.num_heads
        return keys, values, torch.cat([history_token, window_token[:, None].expand(-1, heads)])

    def key_labels(self, key_tokens, query_start):
        positions, kinds = super().key_labels(key_tokens, query_start)
        history = len(self.choice.history)  # the first rows: each head's chosen tokens
        kinds[:history] = KEY_KIND["chosen"]
        return positions, kinds

    def _score(self, q: torch.Tensor, keys: torch.Tensor) -> np.ndarray:
        """Each visible key's mean softmax probability over the queries q, per head, as the
        survey's capture computes it."""
        key_mass, _, _ = frame_reductions(q[0], keys[0], self.scale, frames=1)
        return key_mass[:, 0].cpu().numpy()

    def begin_pass(self, kind: str) -> None:
        # top_c chooses by the attention of each block's cache-update pass.
        self.scoring = kind == "cache"
