"""Wan's 3D rotary position embedding: separate frequency ladders for frame, height and width.

head_dim d is split into d - 4*(d//6) temporal channels and 2*(d//6) channels each for height and
width (44 / 42 / 42 at d = 128); channels (2i, 2i+1) form one complex number. Angles are computed
and applied in float64, as in the reference.
"""

from __future__ import annotations

import functools

import torch

MAX_POSITIONS = 1024  # rows of the reference table: the hard limit on latent frames


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Real channels per axis (frame, height, width)."""
    spatial = 2 * (head_dim // 6)
    return head_dim - 2 * spatial, spatial, spatial


def _axis_table(positions: int, dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), theta**-exponents)
    return torch.polar(torch.ones_like(angles), angles)


@functools.lru_cache(maxsize=8)
def rope_tables(
    head_dim: int, device: torch.device, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """complex128 tables [MAX_POSITIONS, channels/2] for the frame, height and width axes."""
    return tuple(_axis_table(MAX_POSITIONS, d, theta).to(device) for d in axis_dims(head_dim))


def rope_angles(
    head_dim: int, grid: tuple[int, int, int], start_frame: int, device: torch.device
) -> torch.Tensor:
    """Rotations [F*H*W, 1, head_dim/2] (complex128) of a token grid starting at start_frame."""
    frames, height, width = grid
    if start_frame + frames > MAX_POSITIONS:
        raise ValueError(
            f"frames {start_frame}..{start_frame + frames - 1} exceed the RoPE table "
            f"of {MAX_POSITIONS} latent frames"
        )
    table_f, table_h, table_w = rope_tables(head_dim, torch.device(device))
    per_axis = [
        table_f[start_frame : start_frame + frames]
        .view(frames, 1, 1, -1)
        .expand(frames, height, width, -1),
        table_h[:height].view(1, height, 1, -1).expand(frames, height, width, -1),
        table_w[:width].view(1, 1, width, -1).expand(frames, height, width, -1),
    ]
    return torch.cat(per_axis, dim=-1).reshape(frames * height * width, 1, -1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, L, heads, head_dim] by angles [L, 1, head_dim/2]; returns x's dtype."""
    batch, length, heads, dim = x.shape
    pairs = torch.view_as_complex(x.to(torch.float64).reshape(batch, length, heads, dim // 2, 2))
    return torch.view_as_real(pairs * angles).flatten(3).to(x.dtype)


def rotate_frames(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Move post-RoPE keys x [B, L, heads, head_dim] by `shift` latent frames in time.

    Only the temporal channels turn (by exp(i * omega * shift)); the height and width channels stay
    as they are. Rotations compose, so this equals applying RoPE at the shifted positions to the
    un-rotated keys: what a cache needs to move keys it stored post-RoPE (Deep Forcing's deep sink).
    """
    head_dim = x.shape[-1]
    if abs(shift) >= MAX_POSITIONS:
        raise ValueError(f"a shift of {shift} frames exceeds the RoPE table of {MAX_POSITIONS}")
    table_f, table_h, table_w = rope_tables(head_dim, x.device)
    turn = table_f[abs(shift)]
    turn = turn.conj() if shift < 0 else turn
    still = torch.ones(table_h.shape[1] + table_w.shape[1], dtype=turn.dtype, device=x.device)
    return apply_rope(x, torch.cat([turn, still]).view(1, 1, -1))
