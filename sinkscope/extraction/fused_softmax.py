"""The survey's softmax reductions on a GPU in two fused kernels: each key's softmax mass and each
row's entropy without the rows x keys matrix ever in memory.

`capture.softmax_reductions` (torch) writes every tile's logits and then reads and writes them
about ten times over (max, shift, exp, sums, mass, entropy); on an H200 that made the survey of
all 30 layers 12 times a plain rollout (benchmarks/README.md). Here, as in flash attention, tiles
of q.k live in registers only:

- pass 1, per block of query rows, runs once over the keys keeping the running max m, Z = sum
  e^(s-m) and A = sum e^(s-m) (s-m): the row's log normaliser is m + log Z and its entropy
  -sum p log p = log Z - A / Z;
- pass 2, per block of keys, runs over the rows and sums p = e^(s - lse) into each key's mass;
  with the keys in registers it also takes each key's mean logit over the rows,
  `key_logit_mean` = (mean q).k_j * scale (+ bias), from the frame's float32 mean query (one
  launch before the kernels; no copy of k, no matmul of its own).

q.k is computed twice (twice the products, none of the memory traffic). bfloat16 (and float16) q
and k multiply exactly into float32 and accumulate in float32, as the torch path's float32 matmul
of the same values does; only the order of the sums differs, so the two paths agree to float32
rounding (tests/test_fused_softmax.py). A float32 model keeps the torch path: Triton's IEEE
float32 products run off the tensor cores and made a 4-layer float32 survey at the real geometry
6.5 times slower than cuBLAS's (benchmarks/README.md).

Triton ships with torch's CUDA builds; where it is missing (the CPU builds) the torch path runs.
`SINKSCOPE_FUSED_SOFTMAX=0` makes a GPU job take the torch path too (to compare the two).
"""

from __future__ import annotations

import functools
import os

import torch

# (rows per block, keys per block, warps, pipeline stages) of each pass.
BLOCKS = {"rows": (128, 64, 8, 3), "keys": (64, 128, 8, 3)}
DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _kernels():
    """The two kernels, compiled on first use (None without Triton)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_stats(
        q_ptr,
        k_ptr,
        bias_ptr,
        lse_ptr,
        entropy_ptr,
        rows,
        keys,
        frames,
        scale,
        stride_qr,
        stride_qh,
        stride_kr,
        stride_kh,
        HAS_BIAS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        group = tl.program_id(1)  # head * frames + frame
        head, frame = group // frames, group % frames
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < rows
        d_ok = offs_d < HEAD_DIM
        q_rows = (frame * rows + offs_m)[:, None] * stride_qr + head * stride_qh
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + q_rows + offs_d[None, :], mask=q_mask, other=0.0)
        # A finite start: e^(m - m_new) is then 0, never inf - inf.
        m = tl.full([BLOCK_M], -1.0e30, tl.float32)
        z = tl.zeros([BLOCK_M], tl.float32)
        a = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = offs_n < keys
            k_rows = offs_n[:, None] * stride_kr + head * stride_kh
            k = tl.load(
                k_ptr + k_rows + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0
            )
            s = tl.dot(q, tl.trans(k)) * scale
            if HAS_BIAS:
                s += tl.load(bias_ptr + offs_n, mask=key_ok, other=0.0)[None, :]
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            x = s - m_new[:, None]
            e = tl.exp(x)
            # sum e^(s-m_new)(s-m_new) over the old keys = alpha (A + (m - m_new) Z)
            a = alpha * (a + (m - m_new) * z) + tl.sum(tl.where(key_ok[None, :], e * x, 0.0), 1)
            z = alpha * z + tl.sum(e, axis=1)
            m = m_new
        log_z = tl.log(z)
        out = group * rows + offs_m
        tl.store(lse_ptr + out, m + log_z, mask=row_ok)
        tl.store(entropy_ptr + out, log_z - a / z, mask=row_ok)

    @triton.jit
    def key_mass(
        q_ptr,
        k_ptr,
        bias_ptr,
        lse_ptr,
        mass_ptr,
        q_mean_ptr,
        logit_ptr,
        rows,
        keys,
        frames,
        scale,
        stride_qr,
        stride_qh,
        stride_kr,
        stride_kh,
        stride_mf,
        stride_mh,
        HAS_BIAS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        group = tl.program_id(1)
        head, frame = group // frames, group % frames
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        key_ok = offs_n < keys
        d_ok = offs_d < HEAD_DIM
        k_rows = offs_n[:, None] * stride_kr + head * stride_kh
        k_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + k_rows + offs_d[None, :], mask=k_mask, other=0.0)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=key_ok, other=0.0)
        # Each key's mean logit over the frame's rows: (mean q).k, in float32.
        q_mean = tl.load(
            q_mean_ptr + frame * stride_mf + head * stride_mh + offs_d, mask=d_ok, other=0.0
        )
        logit = tl.sum(k.to(tl.float32) * q_mean[None, :], axis=1) * scale
        if HAS_BIAS:
            logit += bias
        mass = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, rows, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < rows
            q_rows = (frame * rows + offs_m)[:, None] * stride_qr + head * stride_qh
            q = tl.load(
                q_ptr + q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
            )
            lse = tl.load(lse_ptr + group * rows + offs_m, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            if HAS_BIAS:
                s += bias[None, :]
            p = tl.exp(s - lse[:, None])
            mass += tl.sum(tl.where(row_ok[:, None] & key_ok[None, :], p, 0.0), axis=0)
        out = group * keys + offs_n
        tl.store(mass_ptr + out, mass / rows, mask=key_ok)
        tl.store(logit_ptr + out, logit, mask=key_ok)

    return triton, row_stats, key_mass


def usable(q: torch.Tensor, k: torch.Tensor | None = None) -> bool:
    """Whether the fused kernels run for q (and k): bfloat16 or float16 CUDA tensors of one
    dtype where Triton is installed, unless SINKSCOPE_FUSED_SOFTMAX=0 turns them off."""
    if os.environ.get("SINKSCOPE_FUSED_SOFTMAX", "1") == "0":
        return False
    same = k is None or k.dtype == q.dtype
    return q.is_cuda and q.dtype in DTYPES and same and _kernels() is not None


def fused_reductions(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    frames: int,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact softmax of each (head, query frame)'s rows against all keys, reduced.

    q [frames * T, heads, D] (T rows per query frame), k [M, heads, D], both bfloat16 or both
    float16; `bias` [M] is added to every row's scaled logits. Returns float32
    key_mass [heads, frames, M] (each key's mean probability over the frame's rows), entropy
    [heads, frames, T] (each row's -sum p log p, in nats), as `softmax_reductions` per tile, and
    key_logit_mean [heads, frames, M] (each key's mean scaled logit over the frame's rows, bias
    included: (mean q).k from the frame's float32 mean query).
    """
    triton, row_stats, key_mass = _kernels()
    if q.dtype != k.dtype or q.dtype not in DTYPES:
        raise ValueError(f"q is {q.dtype} and k is {k.dtype}: the kernels take one of {DTYPES}")
    total, heads, head_dim = q.shape
    if total % frames or k.shape[1:] != (heads, head_dim):
        raise ValueError(f"q {tuple(q.shape)} in {frames} frames against k {tuple(k.shape)}")
    rows, keys = total // frames, k.shape[0]
    if bias is not None and tuple(bias.shape) != (keys,):
        raise ValueError(f"bias {tuple(bias.shape)}: one value per key ({keys}) expected")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    groups = heads * frames
    device = q.device
    lse = torch.empty((groups, rows), dtype=torch.float32, device=device)
    entropy = torch.empty((groups, rows), dtype=torch.float32, device=device)
    mass = torch.empty((groups, keys), dtype=torch.float32, device=device)
    logit = torch.empty((groups, keys), dtype=torch.float32, device=device)
    q_mean = q.unflatten(0, (frames, rows)).mean(dim=1, dtype=torch.float32)  # [frames, heads, D]
    bias = None if bias is None else bias.float().contiguous()
    common = {
        "HAS_BIAS": bias is not None,
        "HEAD_DIM": head_dim,
        # tl.dot wants at least 16 along the contraction: narrow heads are zero-padded.
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
    }
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    sizes = (rows, keys, frames, float(scale))
    block_m, block_n, warps, stages = BLOCKS["rows"]
    row_stats[(triton.cdiv(rows, block_m), groups)](
        q, k, bias if bias is not None else q, lse, entropy, *sizes, *strides, **common,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    block_m, block_n, warps, stages = BLOCKS["keys"]
    key_mass[(triton.cdiv(keys, block_n), groups)](
        q, k, bias if bias is not None else q, lse, mass, q_mean, logit, *sizes, *strides,
        q_mean.stride(0), q_mean.stride(1), **common,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    shape = (heads, frames, keys)
    return mass.view(shape), entropy.view(heads, frames, rows), logit.view(shape)
