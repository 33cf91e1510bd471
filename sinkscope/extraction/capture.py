"""Which layers and passes are captured, and the logits tiles computed next to the real attention.

The attention output keeps its fused kernel; the capture recomputes q.k / sqrt(head_dim) one query
frame and one head at a time (T x visible keys), so the full matrix never exists in memory. It
also records frame-level mean logits from mean-pooled q and k, which need no token pairs at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .store import TokenStoreWriter


class LogitCapture:
    """Model capture hook: writes the self-attention logits of chosen layers and passes.

    Call `begin_pass` before every model call; the hook then writes the passes it was asked for.
    """

    def __init__(
        self,
        writers: dict[int, TokenStoreWriter],
        pass_indices: Sequence[int],
        frame_seq_length: int,
        head_dim: int,
    ):
        self.writers = writers
        self.step_of_pass = {p: step for step, p in enumerate(pass_indices)}
        self.frame_seq_length = frame_seq_length
        self.scale = 1.0 / math.sqrt(head_dim)
        self.step: int | None = None

    @property
    def layers(self) -> set[int]:
        return set(self.writers)

    def begin_pass(self, block: int, pass_index: int, kind: str, timestep: float) -> None:
        self.step = self.step_of_pass.get(pass_index)

    @torch.no_grad()
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        key_tokens: torch.Tensor,
        query_start: int,
    ) -> None:
        if self.step is None or layer not in self.writers:
            return
        writer = self.writers[layer]
        t = self.frame_seq_length
        if q.shape[0] != 1:
            raise ValueError("logit capture supports batch size 1")
        # Cache slots hold whole frames; their absolute frames, in slot order.
        slot_frames = key_tokens[::t] // t
        order = torch.argsort(slot_frames)
        key_frames = slot_frames[order].cpu().numpy()
        # Keys in ascending absolute frame order, so the store row is filled by contiguous runs.
        k_sorted = k[0].unflatten(0, (-1, t))[order].flatten(0, 1)
        first_frame = query_start // t
        # Mean over all token pairs of q.k = (mean q).(mean k): frame-level logits without pairs.
        q_pooled = q[0].float().unflatten(0, (-1, t)).mean(dim=1)
        k_pooled = k_sorted.float().unflatten(0, (-1, t)).mean(dim=1)
        pooled = torch.einsum("qhd,khd->hqk", q_pooled.double(), k_pooled.double()) * self.scale
        writer.write_pooled(self.step, first_frame, key_frames, pooled.float().cpu().numpy())
        if not writer.tokens:
            return
        for head in range(q.shape[2]):
            k_head = k_sorted[:, head].float()
            for frame in range(q.shape[1] // t):
                q_frame = q[0, frame * t : (frame + 1) * t, head].float()
                tile = (q_frame @ k_head.T).mul_(self.scale)  # in place: one T x keys buffer
                writer.write_row(
                    self.step, head, first_frame + frame, tile.half().cpu().numpy(), key_frames
                )
