"""The released pipelines' arithmetic in the model's own dtype: the bfloat16 oracle of
tests/test_release_arithmetic.py.

Written from the released code, cast for cast, without any sinkscope module (the model is a
plain dict of tensors): Self-Forcing's `wan/modules/causal_model.py` (CausalWanModel's cached
forward), `wan/modules/model.py` (WanLayerNorm, WanRMSNorm, rope_params,
sinusoidal_embedding_1d), `wan/modules/attention.py` (its scaled_dot_product_attention path),
`utils/wan_wrapper.py` (the flow-to-x0 conversion), `utils/scheduler.py` (FlowMatchScheduler,
add_noise) and `pipeline/causal_inference.py`; LongLive's interactive pipeline and cache writes
(NVlabs/LongLive 2462895: the recache, `global_sink`, the sink slots a recompute keeps); Rolling
Forcing's `pipeline/rolling_forcing_inference.py` and its cache (TencentARC/RollingForcing
a1477d09: the anchor kept without RoPE, the working cache, the clean pass). Where the releases
hard-code the real geometry (1560 tokens a frame, blocks of 3, 12 x 128 heads) the reference
takes the tiny model's.

Where each rounds, in a bfloat16 model (every parameter cast to bfloat16):
- patch embedding, linears, GELU, SiLU, SDPA: in bfloat16 (the kernels accumulate in float32
  and round their output once);
- the timestep sinusoid in float64, cast to the model's dtype (`.type_as(x)`); modulation
  (`modulation + e`), the `1 + scale` and `+ shift` of the norms' outputs, the gates and every
  residual add in bfloat16 (the causal model's float32 autocasts are commented out);
- LayerNorm: `nn.LayerNorm` on the bfloat16 tensor with bfloat16 affine weights, `.type_as(x)`;
  RMSNorm: normalised in float32, cast back, then times the bfloat16 weight;
- RoPE: float64 (complex128) rotation with a float64 table `1 / theta^(2j/d)`, cast back once;
- x0 = x_t - sigma v in float64, cast back once; the re-noise (1 - sigma) x0 + sigma eps in
  float32 (sigma a float32 tensor of the scheduler's table), cast back once.

The noise is an input: the initial tensor and each fresh draw come from the caller (`draw`),
as the same numbers reach both runs; the releases draw `randn_like` on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NUM_TRAIN_TIMESTEPS = 1000

# --------------------------------------------------------------------------------------------
# wan/modules/model.py
# --------------------------------------------------------------------------------------------


def sinusoidal_embedding_1d(dim: int, position: torch.Tensor) -> torch.Tensor:
    half = dim // 2
    position = position.type(torch.float64)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def rope_params(max_seq_len: int, dim: int, theta: float = 10000) -> torch.Tensor:
    freqs = torch.outer(
        torch.arange(max_seq_len),
        1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim)),
    )
    return torch.polar(torch.ones_like(freqs), freqs)


def causal_rope_apply(x, grid_sizes, freqs, start_frame=0):
    """x [B, L, heads, d]; grid_sizes [(f, h, w)] per sample. Returns x's dtype."""
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    output = []
    for i, (f, h, w) in enumerate(grid_sizes):
        seq_len = f * h * w
        x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat(
            [
                freqs[0][start_frame : start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
                freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ],
            dim=-1,
        ).reshape(seq_len, 1, -1)
        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
        x_i = torch.cat([x_i, x[i, seq_len:]])
        output.append(x_i)
    return torch.stack(output).type_as(x)


def layer_norm(x, eps, weight=None, bias=None):
    """WanLayerNorm: `super().forward(x).type_as(x)`."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps).type_as(x)


def rms_norm(x, weight, eps):
    """WanRMSNorm: `self._norm(x.float()).type_as(x) * self.weight`."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).type_as(x) * weight


def attention(q, k, v):
    """wan/modules/attention.py without flash-attn: SDPA in bfloat16 on [B, L, heads, d]."""
    dtype = torch.bfloat16
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous()


# --------------------------------------------------------------------------------------------
# utils/scheduler.py and utils/wan_wrapper.py
# --------------------------------------------------------------------------------------------


class FlowMatchScheduler:
    """FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True), set_timesteps(1000)."""

    def __init__(self, shift: float):
        sigmas = torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1)[:-1]
        self.sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = self.sigmas * NUM_TRAIN_TIMESTEPS

    def denoising_step_list(self, steps, warp: bool) -> torch.Tensor:
        steps = torch.tensor(steps, dtype=torch.long)
        if not warp:
            return steps
        timesteps = torch.cat((self.timesteps.cpu(), torch.tensor([0], dtype=torch.float32)))
        return timesteps[NUM_TRAIN_TIMESTEPS - steps]

    def add_noise(self, original_samples, noise, timestep):
        timestep_id = torch.argmin((self.timesteps.unsqueeze(0) - timestep.unsqueeze(1)).abs(), 1)
        sigma = self.sigmas[timestep_id].reshape(-1, 1, 1, 1)
        sample = (1 - sigma) * original_samples + sigma * noise
        return sample.type_as(noise)

    def flow_to_x0(self, flow_pred, xt, timestep):
        """WanDiffusionWrapper._convert_flow_pred_to_x0 (float64, one cast back)."""
        original_dtype = flow_pred.dtype
        flow_pred, xt, sigmas, timesteps = (
            t.double() for t in (flow_pred, xt, self.sigmas, self.timesteps)
        )
        timestep_id = torch.argmin((timesteps.unsqueeze(0) - timestep.unsqueeze(1)).abs(), 1)
        sigma_t = sigmas[timestep_id].reshape(-1, 1, 1, 1)
        return (xt - sigma_t * flow_pred).to(original_dtype)


# --------------------------------------------------------------------------------------------
# CausalWanModel's cached forward, on a dict of parameters
# --------------------------------------------------------------------------------------------

# attend(layer, roped_q, roped_k, k (before RoPE), v, grid, current_start) -> [B, L, heads, d]
Attend = Callable[..., torch.Tensor]


@dataclass
class ReleaseDiT:
    params: dict[str, torch.Tensor]
    dim: int
    num_heads: int
    num_layers: int
    patch_size: tuple[int, int, int]
    freq_dim: int
    text_len: int
    out_dim: int
    eps: float = 1e-6
    freqs: torch.Tensor = field(init=False)

    def __post_init__(self):
        d = self.dim // self.num_heads
        self.freqs = torch.cat(
            [
                rope_params(1024, d - 4 * (d // 6)),
                rope_params(1024, 2 * (d // 6)),
                rope_params(1024, 2 * (d // 6)),
            ],
            dim=1,
        )

    def _linear(self, x, name):
        return F.linear(x, self.params[f"{name}.weight"], self.params[f"{name}.bias"])

    def __call__(self, x, t, context, attend: Attend, current_start: int) -> torch.Tensor:
        """x [B, C, F, H, W] (the wrapper's permute), t [B, F], context [B, L, text_dim]."""
        p = self.params
        x = F.conv3d(
            x, p["patch_embedding.weight"], p["patch_embedding.bias"], stride=self.patch_size
        )
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)
        e = sinusoidal_embedding_1d(self.freq_dim, t.flatten()).type_as(x)
        e = self._linear(F.silu(self._linear(e, "time_embedding.0")), "time_embedding.2")
        e0 = self._linear(F.silu(e), "time_projection.1").unflatten(1, (6, self.dim))
        e0 = e0.unflatten(dim=0, sizes=t.shape)
        pad = context.new_zeros(
            context.shape[0], self.text_len - context.shape[1], context.shape[2]
        )
        context = torch.cat([context, pad], dim=1)
        context = self._linear(
            F.gelu(self._linear(context, "text_embedding.0"), approximate="tanh"),
            "text_embedding.2",
        )
        for i in range(self.num_layers):
            x = self._block(i, x, e0, grid, context, attend, current_start)
        x = self._head(x, e.unflatten(dim=0, sizes=t.shape).unsqueeze(2))
        return self._unpatchify(x, grid)

    def _block(self, i, x, e, grid, context, attend, current_start):
        p, b = self.params, f"blocks.{i}."
        num_frames, frame_seqlen = e.shape[1], x.shape[1] // e.shape[1]
        e = (p[b + "modulation"].unsqueeze(1) + e).chunk(6, dim=2)
        normed = layer_norm(x, self.eps).unflatten(dim=1, sizes=(num_frames, frame_seqlen))
        y = self._self_attn(
            i, (normed * (1 + e[1]) + e[0]).flatten(1, 2), grid, attend, current_start
        )
        x = x + (y.unflatten(dim=1, sizes=(num_frames, frame_seqlen)) * e[2]).flatten(1, 2)
        norm3 = layer_norm(x, self.eps, p[b + "norm3.weight"], p[b + "norm3.bias"])
        x = x + self._cross_attn(i, norm3, context)
        normed = layer_norm(x, self.eps).unflatten(dim=1, sizes=(num_frames, frame_seqlen))
        y = self._linear(
            F.gelu(
                self._linear((normed * (1 + e[4]) + e[3]).flatten(1, 2), b + "ffn.0"),
                approximate="tanh",
            ),
            b + "ffn.2",
        )
        return x + (y.unflatten(dim=1, sizes=(num_frames, frame_seqlen)) * e[5]).flatten(1, 2)

    def _qkv(self, i, x, context=None):
        p, a = self.params, f"blocks.{i}.{'self' if context is None else 'cross'}_attn."
        n, d = self.num_heads, self.dim // self.num_heads
        source = x if context is None else context
        q = rms_norm(self._linear(x, a + "q"), p[a + "norm_q.weight"], self.eps)
        k = rms_norm(self._linear(source, a + "k"), p[a + "norm_k.weight"], self.eps)
        v = self._linear(source, a + "v")
        b = x.shape[0]
        return q.view(b, -1, n, d), k.view(b, -1, n, d), v.view(b, -1, n, d)

    def _self_attn(self, i, x, grid, attend, current_start):
        q, k, v = self._qkv(i, x)
        start_frame = current_start // (grid[1] * grid[2])
        roped_q = causal_rope_apply(q, [grid], self.freqs, start_frame).type_as(v)
        roped_k = causal_rope_apply(k, [grid], self.freqs, start_frame).type_as(v)
        out = attend(i, roped_q, roped_k, k, v, grid, current_start)
        return self._linear(out.flatten(2), f"blocks.{i}.self_attn.o")

    def _cross_attn(self, i, x, context):
        q, k, v = self._qkv(i, x, context)
        return self._linear(attention(q, k, v).flatten(2), f"blocks.{i}.cross_attn.o")

    def _head(self, x, e):
        num_frames, frame_seqlen = e.shape[1], x.shape[1] // e.shape[1]
        e = (self.params["head.modulation"].unsqueeze(1) + e).chunk(2, dim=2)
        normed = layer_norm(x, self.eps).unflatten(dim=1, sizes=(num_frames, frame_seqlen))
        return self._linear(normed * (1 + e[1]) + e[0], "head.head")

    def _unpatchify(self, x, grid):
        """[B, F, S, prod(patch) * C] -> [B, C, F, H, W]."""
        f, h, w = grid
        pt, ph, pw = self.patch_size
        u = x.flatten(1, 2).view(x.shape[0], f, h, w, pt, ph, pw, self.out_dim)
        u = torch.einsum("bfhwpqrc->bcfphqwr", u)
        return u.reshape(x.shape[0], self.out_dim, f * pt, h * ph, w * pw)


# --------------------------------------------------------------------------------------------
# KV caches
# --------------------------------------------------------------------------------------------


class LongLiveKV:
    """LongLive's self-attention cache of every layer (a superset of Self-Forcing's: with no
    sinks, or with every block at or past the sinks, the same writes and keys): `window` frames
    of slots (-1: every frame), `sinks` frames kept at the front when it rolls. A recompute (a
    call that ends within what was written and does not start at 0) writes no sink slot, unless
    it is the recache after a switch without global_sink (`sink_recache_after_switch`)."""

    def __init__(self, layers, frames, window, sinks, frame_seqlen, heads, head_dim, dtype):
        slots = (frames if window == -1 else window) * frame_seqlen
        self.k = [torch.zeros(1, slots, heads, head_dim, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.global_end = [0] * layers
        self.local_end = [0] * layers
        self.window, self.sink_tokens = window, sinks * frame_seqlen
        self.max_attention_size = slots
        self.sink_recache_after_switch = False

    def zero(self):
        for k, v in zip(self.k, self.v, strict=True):
            k.zero_()
            v.zero_()

    def __call__(self, i, roped_q, roped_k, k, v, grid, current_start):
        current_end = current_start + roped_q.shape[1]
        sink_tokens, size, new = self.sink_tokens, self.k[i].shape[1], roped_q.shape[1]
        global_end, local_end = self.global_end[i], self.local_end[i]
        is_recompute = current_end <= global_end and current_start > 0
        temp_k, temp_v = self.k[i].clone(), self.v[i].clone()
        if self.window != -1 and current_end > global_end and new + local_end > size:
            evicted = new + local_end - size
            rolled = local_end - evicted - sink_tokens
            src = slice(sink_tokens + evicted, sink_tokens + evicted + rolled)
            temp_k[:, sink_tokens : sink_tokens + rolled] = temp_k[:, src].clone()
            temp_v[:, sink_tokens : sink_tokens + rolled] = temp_v[:, src].clone()
            local_end_index = local_end + current_end - global_end - evicted
            local_start = local_end_index - new
            write_start = max(local_start, sink_tokens) if is_recompute else local_start
        else:
            local_end_index = local_end + current_end - global_end
            local_start = local_end_index - new
            write_start = max(local_start, sink_tokens) if is_recompute else local_start
            if self.sink_recache_after_switch:
                write_start = local_start
        offset = max(0, write_start - local_start)
        length = max(0, local_end_index - write_start)
        if length > 0:
            temp_k[:, write_start:local_end_index] = roped_k[:, offset : offset + length]
            temp_v[:, write_start:local_end_index] = v[:, offset : offset + length]
        if sink_tokens > 0:
            local_budget = self.max_attention_size - sink_tokens
            keys, values = temp_k[:, :sink_tokens], temp_v[:, :sink_tokens]
            if local_budget > 0:
                window_start = max(sink_tokens, local_end_index - local_budget)
                keys = torch.cat([keys, temp_k[:, window_start:local_end_index]], dim=1)
                values = torch.cat([values, temp_v[:, window_start:local_end_index]], dim=1)
            out = attention(roped_q, keys, values)
        else:
            window_start = max(0, local_end_index - self.max_attention_size)
            out = attention(
                roped_q,
                temp_k[:, window_start:local_end_index],
                temp_v[:, window_start:local_end_index],
            )
        self.k[i], self.v[i] = temp_k, temp_v
        self.global_end[i], self.local_end[i] = current_end, local_end_index
        return out


class RollingForcingKV:
    """Rolling Forcing's clean cache of every layer: `cache_frames` (24) frame slots, the first
    block (the anchor) kept without RoPE, every call attending to at most `attention_frames`
    (21). `updating_cache` marks the clean pass."""

    def __init__(self, layers, block, frame_seqlen, heads, head_dim, dtype, freqs,
                 cache_frames=24, attention_frames=21):  # fmt: skip
        slots = cache_frames * frame_seqlen
        self.k = [torch.zeros(1, slots, heads, head_dim, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.global_end = [0] * layers
        self.local_end = [0] * layers
        self.frame_length = frame_seqlen
        self.block = block
        self.block_length = block * frame_seqlen
        self.max_attention_size = attention_frames * frame_seqlen
        self.freqs = freqs
        self.updating_cache = False

    def __call__(self, i, roped_q, roped_k, k, v, grid, current_start):
        kv_k, kv_v, block_length = self.k[i], self.v[i], self.block_length
        one_block = [(self.block, grid[1], grid[2])]
        current_start_frame = current_start // self.frame_length
        cache_end = current_start + block_length
        new = cache_end - self.global_end[i]
        size = kv_k.shape[1]
        sink_tokens = block_length
        if new > 0 and new + self.local_end[i] > size:
            evicted = new + self.local_end[i] - size
            rolled = self.local_end[i] - evicted - sink_tokens
            src = slice(sink_tokens + evicted, sink_tokens + evicted + rolled)
            kv_k[:, sink_tokens : sink_tokens + rolled] = kv_k[:, src].clone()
            kv_v[:, sink_tokens : sink_tokens + rolled] = kv_v[:, src].clone()
            local_end_index = self.local_end[i] + cache_end - self.global_end[i] - evicted
            local_start = local_end_index - block_length
            kv_k[:, local_start:local_end_index] = roped_k[:, :block_length]
            kv_v[:, local_start:local_end_index] = v[:, :block_length]
        else:
            local_end_index = self.local_end[i] + cache_end - self.global_end[i]
            local_start = local_end_index - block_length
            if local_start == 0:  # the first block is kept without RoPE
                kv_k[:, local_start:local_end_index] = k[:, :block_length]
            else:
                kv_k[:, local_start:local_end_index] = roped_k[:, :block_length]
            kv_v[:, local_start:local_end_index] = v[:, :block_length]
        if new > 0:
            self.global_end[i], self.local_end[i] = cache_end, local_end_index
        if local_start == 0:
            return attention(roped_q, roped_k, v)
        if self.updating_cache:
            start = max(0, local_end_index - self.max_attention_size)
            working_k = kv_k[:, start:local_end_index].clone()
            working_v = kv_v[:, start:local_end_index]
            if start == 0:
                working_k[:, :block_length] = causal_rope_apply(
                    working_k[:, :block_length], one_block, self.freqs, start_frame=0
                ).type_as(v)
            return attention(roped_q, working_k, working_v)
        working_max = self.max_attention_size - roped_q.shape[1] - block_length
        start = max(block_length, local_start - working_max)
        working_k, working_v = kv_k[:, start:local_start], kv_v[:, start:local_start]
        rope_start_frame = (
            current_start_frame - working_k.shape[1] // self.frame_length - self.block
        )
        anchor_k = causal_rope_apply(
            kv_k[:, :block_length], one_block, self.freqs, start_frame=rope_start_frame
        ).type_as(v)
        keys = torch.cat([anchor_k, working_k, roped_k], dim=1)
        values = torch.cat([kv_v[:, :block_length], working_v, v], dim=1)
        return attention(roped_q, keys, values)


# --------------------------------------------------------------------------------------------
# Samplers
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What a pipeline needs besides the model: the denoising steps (block 0's own with
    `first_block_steps`, Causal Forcing++), the shift and warp, the prompts [segments, L, d]
    in the model's dtype, the initial noise [1, F, C, H, W] in the model's dtype and `draw`, which
    gives each fresh draw of a shape (also in the model's dtype)."""

    steps: tuple
    shift: float
    warp: bool
    prompts: torch.Tensor
    noise: torch.Tensor
    draw: Callable[[tuple], torch.Tensor]
    first_block_steps: tuple | None = None


def _call(model, scheduler, x, timestep, prompt, cache, current_start):
    """WanDiffusionWrapper.forward: (flow_pred, x0), [B, F, C, H, W]."""
    flow = model(x.permute(0, 2, 1, 3, 4), timestep, prompt, cache, current_start)
    flow = flow.permute(0, 2, 1, 3, 4)
    x0 = scheduler.flow_to_x0(flow.flatten(0, 1), x.flatten(0, 1), timestep.flatten(0, 1))
    return flow, x0.unflatten(0, flow.shape[:2])


def self_forcing(model, run: Run, block_sizes, frame_seqlen, *, window=-1, sinks=0,
                 switches=(), recache=False, global_sink=True) -> torch.Tensor:  # fmt: skip
    """pipeline/causal_inference.py (LongLive's interactive_causal_inference.py with
    `switches`: the block start where each later prompt acts, a recache before it with
    `recache`). Returns the output latents [1, F, C, H, W] in the model's dtype."""
    scheduler = FlowMatchScheduler(run.shift)
    noise, dtype = run.noise, run.noise.dtype
    frames = noise.shape[1]
    cache = LongLiveKV(
        model.num_layers, frames, window, sinks, frame_seqlen, model.num_heads,
        model.dim // model.num_heads, dtype,
    )  # fmt: skip
    output = torch.zeros_like(noise)
    segment, start = 0, 0
    for block, size in enumerate(block_sizes):
        if segment < len(switches) and start >= switches[segment]:
            segment += 1
            if recache:
                _recache(model, scheduler, cache, output, start, run.prompts[segment : segment + 1],
                         window, global_sink)  # fmt: skip
        prompt = run.prompts[segment : segment + 1]
        steps = run.first_block_steps if block == 0 and run.first_block_steps else run.steps
        step_list = scheduler.denoising_step_list(steps, run.warp)
        noisy_input = noise[:, start : start + size]
        for index, current_timestep in enumerate(step_list):
            timestep = torch.ones([1, size], dtype=torch.int64) * current_timestep
            _, denoised_pred = _call(
                model, scheduler, noisy_input, timestep, prompt, cache, start * frame_seqlen
            )
            if index < len(step_list) - 1:
                next_timestep = step_list[index + 1]
                fresh = run.draw(tuple(denoised_pred.flatten(0, 1).shape))
                noisy_input = scheduler.add_noise(
                    denoised_pred.flatten(0, 1),
                    fresh,
                    next_timestep * torch.ones([size], dtype=torch.long),
                ).unflatten(0, denoised_pred.shape[:2])
        output[:, start : start + size] = denoised_pred
        context_timestep = torch.ones_like(timestep) * 0
        _call(
            model, scheduler, denoised_pred, context_timestep, prompt, cache, start * frame_seqlen
        )
        start += size
    return output


def _recache(model, scheduler, cache, output, current_start_frame, prompt, window, global_sink):
    """LongLive's `_recache_after_switch`."""
    if not global_sink:
        cache.zero()  # keys and values only: the indices stay
    if current_start_frame == 0:
        return
    frames = current_start_frame if window == -1 else min(window, current_start_frame)
    first = current_start_frame - frames
    timestep = torch.ones([1, frames], dtype=torch.int64) * 0
    cache.sink_recache_after_switch = not global_sink
    _call(model, scheduler, output[:, first:current_start_frame], timestep, prompt, cache,
          first * _tokens_per_frame(model, output))  # fmt: skip
    cache.sink_recache_after_switch = False


def _tokens_per_frame(model, latents) -> int:
    _, ph, pw = model.patch_size
    return (latents.shape[-2] // ph) * (latents.shape[-1] // pw)


def rolling_forcing(model, run: Run, blocks: int, block: int, frame_seqlen: int) -> torch.Tensor:
    """pipeline/rolling_forcing_inference.py: returns the output latents [1, F, C, H, W]."""
    scheduler = FlowMatchScheduler(run.shift)
    step_list = scheduler.denoising_step_list(run.steps, run.warp)
    noise = run.noise
    num_frames = noise.shape[1]
    cache = RollingForcingKV(
        model.num_layers, block, frame_seqlen, model.num_heads, model.dim // model.num_heads,
        noise.dtype, model.freqs,
    )  # fmt: skip
    prompt = run.prompts[:1]
    output = torch.zeros_like(noise)
    noisy_cache = torch.zeros_like(noise)
    window_blocks = len(step_list)
    shared_timestep = torch.ones([1, window_blocks * block], dtype=torch.float32)
    for index, current_timestep in enumerate(reversed(step_list)):
        shared_timestep[:, index * block : (index + 1) * block] *= current_timestep
    for window_index in range(blocks + window_blocks - 1):
        start_block = max(0, window_index - window_blocks + 1)
        end_block = min(blocks - 1, window_index)
        current_start_frame = start_block * block
        current_end_frame = (end_block + 1) * block
        current_num_frames = current_end_frame - current_start_frame
        if current_num_frames == window_blocks * block or current_start_frame == 0:
            noisy_input = torch.cat(
                [
                    noisy_cache[:, current_start_frame : current_end_frame - block],
                    noise[:, current_end_frame - block : current_end_frame],
                ],
                dim=1,
            )
        else:
            noisy_input = noisy_cache[:, current_start_frame:current_end_frame]
        if current_num_frames == window_blocks * block:
            current_timestep = shared_timestep
        elif current_start_frame == 0:
            current_timestep = shared_timestep[:, -current_num_frames:]
        else:
            assert current_end_frame == num_frames
            current_timestep = shared_timestep[:, :current_num_frames]
        cache.updating_cache = False
        _, denoised_pred = _call(
            model, scheduler, noisy_input, current_timestep, prompt, cache,
            current_start_frame * frame_seqlen,
        )  # fmt: skip
        output[:, current_start_frame:current_end_frame] = denoised_pred
        for block_idx in range(start_block, end_block + 1):
            rows = slice((block_idx - start_block) * block, (block_idx - start_block + 1) * block)
            block_time_step = current_timestep[:, rows].mean().item()
            matches = torch.abs(step_list - block_time_step) < 1e-4
            step_index = int(torch.nonzero(matches, as_tuple=True)[0])
            if step_index == len(step_list) - 1:
                continue
            next_timestep = step_list[step_index + 1]
            fresh = run.draw(tuple(denoised_pred.flatten(0, 1).shape))
            noisy_cache[:, block_idx * block : (block_idx + 1) * block] = scheduler.add_noise(
                denoised_pred.flatten(0, 1),
                fresh,
                next_timestep * torch.ones([current_num_frames], dtype=torch.long),
            ).unflatten(0, denoised_pred.shape[:2])[:, rows]
        context_timestep = (torch.ones_like(current_timestep) * 0)[:, :block]
        cache.updating_cache = True
        _call(
            model, scheduler, denoised_pred[:, :block], context_timestep, prompt, cache,
            current_start_frame * frame_seqlen,
        )  # fmt: skip
    return output
