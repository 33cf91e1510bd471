"""The fused GPU kernels of the survey's softmax reductions (`extraction/fused_softmax.py`)
against float64 from the same q and k, and against the torch path they replace on a GPU.

CUDA only (Triton compiles for the GPU; the CPU builds of torch carry no Triton). Tolerances:
every product of the kernels is exact in float32 (bfloat16 and float16 inputs), sums run in
float32 and the GPU's exp is accurate to a few float32 ulps, so key_mass (a mean of
probabilities <= 1) is within 2e-6 absolute of float64 and the row entropies (<= log M, about 6
here) within 5e-5: the torch path's own bounds, scaled for logits up to ~70. key_logit_mean is
(mean q).k_j * scale from the frame's float32 mean query, a float32 dot over head_dim: within
1e-5 of float64 (u = 2^-24 times (log2 rows + head_dim) times scale * sum |mean q_d k_d|, ~20
here, bounds it by 1.6e-4; such bounds are reached by no real sum), and of the torch path (the
mean in float64) within 1e-6 at the real geometry (mean logits up to ~0.25 there). Run on an
H200 (benchmarks/README.md), and under TRITON_INTERPRET=1 on a CPU for float16 (the
interpreter's bfloat16 dot is wrong): the largest errors were 1.2e-7, 5.3e-6, 8.1e-7 and 4.5e-8.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sinkscope.extraction import fused_softmax
from sinkscope.extraction.capture import LogitCapture, frame_reductions, softmax_reductions

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or fused_softmax._kernels() is None,
    reason="needs CUDA and Triton",
)
MASS_ATOL = 2e-6
ENTROPY_ATOL = 5e-5
LOGIT_ATOL = 1e-5


def _float64(q, k, scale, frames, bias=None):
    """key_mass [H, F, M], entropy [H, F, T] and key_logit_mean [H, F, M] by a float64 softmax
    of the whole matrix."""
    q, k = q.double(), k.double()
    rows = q.shape[0] // frames
    logits = torch.einsum("fthd,mhd->hftm", q.unflatten(0, (frames, rows)), k) * scale
    if bias is not None:
        logits = logits + bias.double()
    p = torch.softmax(logits, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return p.mean(dim=2).cpu().numpy(), entropy.cpu().numpy(), logits.mean(dim=2).cpu().numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 128, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_reductions_equal_float64(dtype, head_dim, with_bias):
    g = torch.Generator().manual_seed(head_dim)
    frames, rows, heads, keys = 3, 50, 2, 333  # none a multiple of a block
    # Head 0's logits have std 12 and reach ~60 (exp without the max shift would overflow
    # float32 at 88): peaked rows; head 1's have std 1: flat rows.
    q = torch.randn(frames * rows, heads, head_dim, generator=g) * math.sqrt(12)
    q[:, 1] /= 12
    k = torch.randn(keys, heads, head_dim, generator=g) * math.sqrt(12)
    q, k = q.to(dtype), k.to(dtype)
    bias = torch.randn(keys, generator=g) if with_bias else None
    scale = 1 / math.sqrt(head_dim)
    expected_mass, expected_entropy, expected_logit = _float64(q, k, scale, frames, bias)
    mass, entropy, logit = fused_softmax.fused_reductions(
        q.cuda(), k.cuda(), scale, frames, None if bias is None else bias.cuda()
    )
    assert mass.dtype == entropy.dtype == logit.dtype == torch.float32
    assert mass.shape == logit.shape == (heads, frames, keys)
    assert entropy.shape == (heads, frames, rows)
    np.testing.assert_allclose(mass.cpu().numpy(), expected_mass, rtol=0, atol=MASS_ATOL)
    np.testing.assert_allclose(entropy.cpu().numpy(), expected_entropy, rtol=0, atol=ENTROPY_ATOL)
    np.testing.assert_allclose(logit.cpu().numpy(), expected_logit, rtol=0, atol=LOGIT_ATOL)
    np.testing.assert_allclose(mass.sum(-1).cpu().numpy(), 1, atol=1e-5)
    assert expected_entropy[0].mean() < 1.5 and expected_entropy[1].min() > 3  # peaked, flat


def test_fused_reductions_equal_the_torch_path_at_the_real_geometry(monkeypatch):
    """One block of 3 frames of 1560 tokens at head_dim 128 in bfloat16 against 3 blocks of
    keys, strided as the model hands them (q a slice of [L, heads, D])."""
    g = torch.Generator().manual_seed(0)
    t, frames, heads, head_dim, keys = 1560, 3, 2, 128, 3 * 1560 * 3
    q_all = torch.randn(2 * frames * t, heads, head_dim, generator=g).to("cuda", torch.bfloat16)
    q = q_all[frames * t :]
    k = (torch.randn(keys, heads, head_dim, generator=g) * 2).to("cuda", torch.bfloat16)
    scale = 1 / math.sqrt(head_dim)
    mass, entropy, logit = fused_softmax.fused_reductions(q, k, scale, frames)
    for head in range(heads):
        for frame in range(frames):
            rows = q[frame * t : (frame + 1) * t, head]
            torch_mass, torch_entropy = softmax_reductions(rows, k[:, head], scale)
            torch.testing.assert_close(mass[head, frame], torch_mass, rtol=0, atol=MASS_ATOL)
            torch.testing.assert_close(
                entropy[head, frame], torch_entropy, rtol=0, atol=ENTROPY_ATOL
            )
    monkeypatch.setenv("SINKSCOPE_FUSED_SOFTMAX", "0")
    _, _, torch_logit = frame_reductions(q, k, scale, frames)
    torch.testing.assert_close(logit, torch_logit, rtol=0, atol=1e-6)


def test_the_capture_takes_the_fused_path_on_a_gpu_and_agrees_with_the_torch_path(monkeypatch):
    g = torch.Generator().manual_seed(1)
    t, frames, heads, head_dim, keys = 24, 2, 3, 16, 96
    q = torch.randn(frames * t, heads, head_dim, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(keys, heads, head_dim, generator=g).to("cuda", torch.bfloat16)
    bias = torch.randn(keys, generator=g).cuda()
    capture = LogitCapture({}, [0], t, head_dim)
    calls = []
    fused = fused_softmax.fused_reductions
    monkeypatch.setattr(
        fused_softmax, "fused_reductions", lambda *a, **kw: calls.append(1) or fused(*a, **kw)
    )
    got = capture._reductions(q, k, bias)
    assert calls == [1]
    monkeypatch.setenv("SINKSCOPE_FUSED_SOFTMAX", "0")
    expected = capture._reductions(q, k, bias)
    assert calls == [1]  # the torch path this time
    for name, a, b in zip(("key_mass", "entropy", "key_logit_mean"), got, expected, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=0, atol=MASS_ATOL if name == "key_mass" else 1e-5)


def test_a_float32_model_keeps_the_torch_path():
    q = torch.zeros(4, 1, 16, device="cuda")
    assert fused_softmax.usable(q.bfloat16()) and not fused_softmax.usable(q)
    assert not fused_softmax.usable(q.bfloat16(), q)  # float32 keys: the torch path too
    with pytest.raises(ValueError, match="float32"):
        fused_softmax.fused_reductions(q, q, 1.0, 1)
    with pytest.raises(ValueError, match="one value per key"):
        fused_softmax.fused_reductions(q.bfloat16(), q.bfloat16(), 1.0, 1, torch.zeros(4, 1))
