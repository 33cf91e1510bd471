"""Wan's 3D rotary position embedding: separate frequency ladders for frame, height and width.

head_dim d is split into d - 4*(d//6) temporal channels and 2*(d//6) channels each for height and
width (44 / 42 / 42 at d = 128); channels (2i, 2i+1) form one complex number. Angles are computed
and applied in float64, as in the reference.

Wan builds a table of 1024 positions; the table is analytic (position x frequency), so sinkscope
computes it as far as a rollout needs (`table_rows`: 1024, doubled until the positions fit, as
Rolling-Sink's 8192): positions past 1024 are the same formula, and rollouts have no length limit.
"""

from __future__ import annotations

import functools

import torch

WAN_TABLE_ROWS = 1024  # rows of Wan's own table; longer rollouts get a longer one


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Real channels per axis (frame, height, width)."""
    spatial = 2 * (head_dim // 6)
    return head_dim - 2 * spatial, spatial, spatial


def _frequencies(dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    """omega_j = 1 / theta^(2j / dim), float64, written as Wan's `rope_params` computes it (the
    reciprocal of a power: theta^(-2j / dim) differs from it in the last bit for some j at
    head_dim 128, which can move a bfloat16 or float32 key by one ulp)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64).div(dim)
    if isinstance(theta, torch.Tensor):
        exponents = exponents.to(theta.device)
        return 1.0 / torch.pow(theta[..., None], exponents)
    return 1.0 / torch.pow(theta, exponents)


def _axis_table(positions: int, dim: int, theta: float) -> torch.Tensor:
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), _frequencies(dim, theta))
    return torch.polar(torch.ones_like(angles), angles)


def table_rows(positions: int) -> int:
    """Rows of the table that holds `positions` positions: Wan's 1024, doubled until they fit."""
    rows = WAN_TABLE_ROWS
    while rows < positions:
        rows *= 2
    return rows


@functools.lru_cache(maxsize=8)
def rope_tables(
    head_dim: int, device: torch.device, theta: float = 10000.0, rows: int = WAN_TABLE_ROWS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """complex128 tables [rows, channels/2] for the frame, height and width axes."""
    return tuple(_axis_table(rows, d, theta).to(device) for d in axis_dims(head_dim))


def rope_angles(
    head_dim: int, grid: tuple[int, int, int], start_frame: int, device: torch.device
) -> torch.Tensor:
    """Rotations [F*H*W, 1, head_dim/2] (complex128) of a token grid starting at start_frame."""
    frames, height, width = grid
    if start_frame < 0:
        raise ValueError(f"RoPE positions start at 0, not at frame {start_frame}")
    rows = table_rows(max(start_frame + frames, height, width))
    table_f, table_h, table_w = rope_tables(head_dim, torch.device(device), rows=rows)
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
    temporal = axis_dims(x.shape[-1])[0]
    table_f = rope_tables(x.shape[-1], x.device, rows=table_rows(abs(shift) + 1))[0]
    turn = table_f[abs(shift)]
    turn = turn.conj() if shift < 0 else turn
    # Only the temporal channels are computed, as Deep Forcing turns them in place: the others
    # keep their bits (a product with 1 + 0j would turn a -0.0 into +0.0).
    out = x.clone()
    out[..., :temporal] = apply_rope(x[..., :temporal], turn.view(1, 1, -1))
    return out


def head_angles(
    head_dim: int,
    grid: tuple[int, int, int],
    start_frame: int,
    device: torch.device,
    temporal_thetas: torch.Tensor,
) -> torch.Tensor:
    """Rotations [F*H*W, heads, head_dim/2] (complex128) where head h's temporal axis has its
    own base `temporal_thetas[h]` (float64) in place of 10000: LoL's per-head jitter of the RoPE
    base frequency. The height and width axes are Wan's."""
    frames, height, width = grid
    angles = rope_angles(head_dim, grid, start_frame, device)
    temporal = axis_dims(head_dim)[0]
    positions = torch.arange(start_frame, start_frame + frames, dtype=torch.float64, device=device)
    thetas = temporal_thetas.to(device=device, dtype=torch.float64)
    phase = positions[:, None, None] * _frequencies(temporal, thetas)[None]  # [F, heads, d_t/2]
    per_token = torch.polar(torch.ones_like(phase), phase).repeat_interleave(height * width, 0)
    out = angles.expand(-1, len(thetas), -1).clone()
    out[..., : temporal // 2] = per_token
    return out
