"""KV-cache policies a rollout can run under: what each layer's cache keeps once the video is
longer than the cache (the closed loop of Contract 6).

Budgets count latent frames of keys per query block, its own block included, as the offline
recall of `sinkscope.analysis.policies` does, so a closed-loop policy and its recall describe the
same choice:
- `full`: every frame (the reference rollout);
- `window`: the B most recent frames (Self-Forcing's `local_attn_size`);
- `sink_window`: the S first frames and the B - S most recent (`sink_size`; StreamingLLM,
  LongLive): sink keys keep the RoPE phase of their own frames;
- `deep_sink`: the frames of `sink_window`, the sink keys turned in the temporal RoPE axis so the
  sink frames sit just before the window's oldest frame (Deep Forcing's Deep Sink);
- `top_c`: the own block, the R frames before it and the C = (B - own - R) x T history tokens that
  received the most attention from the previous block's cache-update queries, chosen per head
  (Deep Forcing's Participative Compression; the offline `top_c`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sinkscope.wan.model import KVCache
from sinkscope.wan.rope import rotate_frames

from .capture import CPU_SOFTMAX_ROWS, softmax_reductions

POLICY_NAMES = ("full", "window", "sink_window", "deep_sink", "top_c")
# Policies whose caches hold whole frames: attention inside their rollouts can be captured.
FRAME_POLICIES = ("full", "window", "sink_window", "deep_sink")


@dataclass(frozen=True)
class CachePolicy:
    """One KV-cache policy: its name, budget B (frames, own block included), sink frames S
    (`sink_window`, `deep_sink`) and recent frames R (`top_c`)."""

    name: str
    budget: int = 0
    sink_frames: int = 0
    recent_frames: int = 0

    def check(self, frames_per_block: int) -> None:
        """Refuse a policy its cache cannot run, naming the numbers."""
        if self.name not in POLICY_NAMES:
            raise ValueError(f"cache policy {self.name!r} is not one of {POLICY_NAMES}")
        if self.name == "full":
            return
        room = self.budget - frames_per_block
        kept = {"sink_window": self.sink_frames, "deep_sink": self.sink_frames}
        kept["top_c"] = self.recent_frames
        if room < kept.get(self.name, 0):
            raise ValueError(
                f"{self.name}: a budget of {self.budget} frames leaves {room} beside the own block "
                f"of {frames_per_block}, fewer than the {kept.get(self.name, 0)} it must keep"
            )

    @property
    def window(self) -> tuple[int, int]:
        """Self-Forcing's (local_attn_size, sink_size) of the frames a frame-level policy keeps:
        (-1, 0) for the full cache; deep_sink keeps sink_window's frames."""
        if self.name == "full":
            return -1, 0
        sinks = self.sink_frames if self.name in ("sink_window", "deep_sink") else 0
        return self.budget, sinks

    @property
    def label(self) -> str:
        """What plots and logs call it: `deep_sink B=9 S=3`."""
        if self.name == "full":
            return "full cache"
        extra = {"sink_window": "S", "deep_sink": "S", "top_c": "R"}.get(self.name)
        value = self.recent_frames if self.name == "top_c" else self.sink_frames
        return f"{self.name} B={self.budget}" + (f" {extra}={value}" if extra else "")

    def new_caches(
        self,
        model,
        *,
        num_frames: int,
        frame_seq_length: int,
        frames_per_block: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> list:
        """One cache per layer of `model` that keeps what this policy keeps."""
        self.check(frames_per_block)
        common = {"frame_seq_length": frame_seq_length, "device": device, "dtype": dtype}
        if self.name in ("full", "window", "sink_window"):
            local_attn_size, sink_size = self.window
            return model.new_kv_caches(
                num_frames=num_frames,
                local_attn_size=local_attn_size,
                sink_size=sink_size,
                **common,
            )
        cfg = model.config
        if self.name == "deep_sink":
            return [
                DeepSinkKVCache(
                    1,
                    self.budget * frame_seq_length,
                    cfg.num_heads,
                    cfg.head_dim,
                    frame_seq_length,
                    self.budget,
                    self.sink_frames,
                    torch.device(device),
                    dtype,
                )
                for _ in range(cfg.num_layers)
            ]
        history = (self.budget - frames_per_block - self.recent_frames) * frame_seq_length
        return [
            TopCKVCache(
                num_heads=cfg.num_heads,
                head_dim=cfg.head_dim,
                frame_seq_length=frame_seq_length,
                window_frames=self.recent_frames + frames_per_block,
                recent_frames=self.recent_frames,
                history_tokens=history,
                device=torch.device(device),
                dtype=dtype,
            )
            for _ in range(cfg.num_layers)
        ]


class DeepSinkKVCache(KVCache):
    """Self-Forcing's rolling cache with sink frames, the sinks' keys moved in time.

    Keys are cached post-RoPE, so moving the S sink frames to positions (w - S, ..., w - 1), w the
    window's oldest frame, is a turn of their temporal channels by w - S frames. The turn is taken
    from the sinks' keys at their own positions each time the window moves, so nothing drifts.
    `slot_token` keeps the sinks' own frames: they are still frames 0..S-1 of the video.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sink_keys: torch.Tensor | None = None  # the sinks' keys at their own positions
        self.sink_shift = 0

    def update(self, k: torch.Tensor, v: torch.Tensor, current_start: int):
        visible = super().update(k, v, current_start)
        sinks = self.sink_tokens
        if sinks and self.local_end > sinks:
            oldest = int(self.slot_token[sinks]) // self.frame_seq_length
            shift = oldest - sinks // self.frame_seq_length
            if shift != self.sink_shift:
                # The cache only rolls once every sink frame is final (its block's cache pass).
                if self.sink_keys is None:
                    self.sink_keys = self.k[:, :sinks].clone()
                self.k[:, :sinks] = rotate_frames(self.sink_keys, shift)
                self.sink_shift = shift
        return visible


class TopCKVCache:
    """Participative Compression: [top-C history tokens | R recent frames | own block], per head.

    The window (recent frames and the own block) is a contiguous run of tokens. When a new block
    arrives, the frames that leave the window join the kept history tokens as candidates; if more
    than C remain, each head keeps the C that received the most attention (mean softmax
    probability over the queries) in the previous block's cache-update pass, the last call before
    the new block: causal, as a real cache must choose. Kept tokens stay in time order, so with C
    at least the whole history the cache is the full cache, slot for slot.

    `scoring` (set by `begin_pass`: the cache-update pass) says whether `observe` records that
    attention.
    `update` returns key tokens [M, heads]: each head has its own.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        head_dim: int,
        frame_seq_length: int,
        window_frames: int,
        recent_frames: int,
        history_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.frame_seq_length = frame_seq_length
        self.recent_tokens = recent_frames * frame_seq_length
        self.history_tokens = history_tokens
        self.scale = 1.0 / math.sqrt(head_dim)
        window = window_frames * frame_seq_length
        self.window_k = torch.zeros(1, window, num_heads, head_dim, device=device, dtype=dtype)
        self.window_v = torch.zeros_like(self.window_k)
        self.window_start = 0  # absolute token of window slot 0
        self.global_end = 0
        self.history_k = self.window_k[:, :0]
        self.history_v = self.window_v[:, :0]
        self.history_token = torch.zeros((0, num_heads), dtype=torch.long, device=device)
        self.scoring = False
        self.score: torch.Tensor | None = None  # [heads, visible] of the last scored call

    @property
    def num_heads(self) -> int:
        return self.window_k.shape[2]

    def _compress(self, new_window_start: int) -> None:
        """Move the tokens before `new_window_start` out of the window into the history."""
        leaving = new_window_start - self.window_start
        if leaving <= 0:
            return
        heads = self.num_heads
        kept = self.history_token.shape[0]
        cand_k = torch.cat([self.history_k, self.window_k[:, :leaving]], dim=1)
        cand_v = torch.cat([self.history_v, self.window_v[:, :leaving]], dim=1)
        tokens = torch.arange(self.window_start, new_window_start, device=cand_k.device)
        cand_token = torch.cat([self.history_token, tokens[:, None].expand(-1, heads)])
        if cand_token.shape[0] > self.history_tokens:
            if self.score is None or self.score.shape[1] < kept + leaving:
                raise RuntimeError(
                    "top_c must choose history tokens but saw no attention of the previous "
                    "block's cache-update pass"
                )
            # Candidates are the first kept + leaving keys the previous cache pass saw.
            score = self.score[:, : kept + leaving]
            choice = score.topk(self.history_tokens, dim=1).indices.sort(dim=1).values.T
        else:
            choice = torch.arange(cand_token.shape[0], device=cand_k.device)[:, None]
            choice = choice.expand(-1, heads)
        index = choice[None, :, :, None].expand(1, -1, heads, cand_k.shape[-1])
        self.history_k = torch.gather(cand_k, 1, index)
        self.history_v = torch.gather(cand_v, 1, index)
        self.history_token = torch.gather(cand_token, 0, choice)
        filled = self.global_end - self.window_start
        self.window_k[:, : filled - leaving] = self.window_k[:, leaving:filled].clone()
        self.window_v[:, : filled - leaving] = self.window_v[:, leaving:filled].clone()
        self.window_start = new_window_start

    def update(self, k: torch.Tensor, v: torch.Tensor, current_start: int):
        """Write k, v of tokens [current_start, current_start + n); returns the visible keys,
        values and each head's key tokens [M, heads]."""
        n = k.shape[1]
        current_end = current_start + n
        if current_end > self.global_end:
            self._compress(max(self.window_start, current_start - self.recent_tokens))
            self.score = None
        offset = current_start - self.window_start
        if offset < 0 or offset + n > self.window_k.shape[1]:
            raise RuntimeError(
                f"top_c window of {self.window_k.shape[1]} tokens cannot hold tokens "
                f"{current_start}..{current_end - 1}"
            )
        self.window_k[:, offset : offset + n] = k
        self.window_v[:, offset : offset + n] = v
        self.global_end = max(self.global_end, current_end)
        filled = self.global_end - self.window_start
        window_token = torch.arange(self.window_start, self.global_end, device=k.device)
        return (
            torch.cat([self.history_k, self.window_k[:, :filled]], dim=1),
            torch.cat([self.history_v, self.window_v[:, :filled]], dim=1),
            torch.cat([self.history_token, window_token[:, None].expand(-1, self.num_heads)]),
        )

    def begin_pass(self, kind: str) -> None:
        # top_c chooses by the attention of each block's cache-update pass.
        self.scoring = kind == "cache"

    def observe(self, q: torch.Tensor) -> None:
        """In a scoring pass, record each visible key's mean attention over the queries q."""
        if not self.scoring:
            return
        keys = torch.cat(
            [self.history_k, self.window_k[:, : self.global_end - self.window_start]], dim=1
        )
        rows = CPU_SOFTMAX_ROWS if q.device.type == "cpu" else None  # as the survey's capture
        self.score = torch.stack(
            [
                softmax_reductions(q[0, :, head], keys[0, :, head], self.scale, rows)[0]
                for head in range(self.num_heads)
            ]
        )
