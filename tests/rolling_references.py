"""An independent reference of Rolling Forcing's sampler on sinkscope's Wan model: the oracle of
tests/test_rolling.py.

Written from the facts (../shared/reference/long-video-family.md, "Rolling Forcing"; Causal
Forcing's long videos run the same pipeline with 4 steps), without sinkscope's KV caches,
rollout, `schedules` module or RoPE module. Only the model's projections, norms and blocks are
sinkscope's; the self-attention is replaced (tests/released_caches.py's
`_patched_self_attention`) by a float64 softmax over an explicit list of key frames built afresh
for every model call from the rules below, each key frame labelled

    (latent frame, version: anchor | clean | window, temporal RoPE position)

with, for a window frame, its noise step in the call. RoPE (tests/released_caches.py's `Rope`,
written from Wan's definition) is applied here at each entry's position; keys and queries are
rounded to the model dtype after RoPE, as a cache stores them.

The rules (A = frames of block 0 = frames per block, S steps, F frames per block):
- Window call w = 0 .. N + S - 2 holds blocks max(0, w - S + 1) .. min(w, N - 1), block b at
  step w - b (the oldest at the last level). Block b enters at w = b with its rows of one
  initial randn of the whole video (CPU generator seeded with `seed`).
- Its keys: while the window holds block 0, its own frames only. Otherwise [anchor at s-c-A ..
  s-c-1 | clean frames s-c .. s-1 at their own positions | the window's frames at theirs], s the
  window's first frame, c = min(clean frames stored after the anchor, 21 - A - query frames).
  No mask: bidirectional inside the window.
- After the call: x0 = x - sigma(t) v per block (float64, cast to the model dtype); then, oldest
  first, every unfinished block draws one randn of the whole window's shape, keeps its own rows
  and becomes (1 - sigma') x0 + sigma' eps at its next level. A block's output is its x0 at step
  S - 1.
- Then a clean pass (t = 0) on the x0 of the window's oldest block b, which writes block b.
  Its keys: the last <= 21 frames of [anchor at 0 .. A-1 | clean frames A .. bF-1 | own block];
  block 0 sees only itself (with blocks of other than 3 frames the cut can fall inside the
  anchor: block 0's frames exist only as the anchor, so those left stay anchor keys at their
  positions). Block 0's pass after its last window call stores the anchor: its
  keys before RoPE (and values), rotated anew with full 3D RoPE at whatever position a call gives
  it. Clean frames keep the post-RoPE keys (own positions) of their block's clean pass; block 0's
  frames are read only as the anchor.
- Timesteps: Self-Forcing's FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True) table in
  float32, step s warped to the training timestep of index 1000 - s; sigma(t) by nearest lookup.

KV-cache policies in place of Rolling Forcing's cache (`Policy`; the lead's spec for issue 26).
B (`budget`) counts every key frame a call reads, its own frames included; S (`sinks`) <= A sink
frames, block 0's first. A window call starting at frame s with q frames, once block 0 has left
the window (before that: its own frames only, whatever the policy):
- full: Rolling Forcing's own cache, as above (B = 21).
- window: [clean frames s-w .. s-1 | window], w = min(s, B - q); block 0's frames are clean
  frames like any other (post-RoPE keys of its last clean pass).
- sink_window: [sinks 0 .. S-1 at their own positions | clean s-w .. s-1 | window],
  w = min(s - S, B - S - q).
- deep_sink: sink_window's frames, the sinks at positions s-w-S .. s-w-1 (where full puts its
  anchor). Turn `rerope`: block 0's keys before RoPE (last clean pass) given full 3D RoPE there,
  as the anchor; turn `delta`: the sinks' post-RoPE keys at their own positions (model dtype, as
  stored), their temporal channels multiplied by exp(i omega (target - own position)) in
  float64 and cast back, afresh at every call.
Clean pass of block b (start c): window, the last <= B frames of [clean 0 .. c-1 | own block];
sink_window and deep_sink, the last <= B frames of [sinks 0 .. S-1 at their own positions |
clean S .. c-1 | own block]; block 0 sees only itself. Key kinds: `own` (the call's frames),
`recent` (clean frames), `sink` (sink_window's sinks; deep_sink's in clean passes), `anchor`
(full's anchor, deep_sink's turned sinks in window calls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .released_caches import Rope, _patched_self_attention

NUM_TRAIN_TIMESTEPS = 1000
ROLLING_STEPS = (1000, 800, 600, 400, 200)
LONG_VIDEO_STEPS = (1000, 750, 500, 250)  # Causal Forcing's long videos
ATTENTION_FRAMES = 21  # the most key frames a call reads
CLEAN_FRAMES = 21  # the cache: the anchor plus the 21 newest clean frames


# --------------------------------------------------------------------------------------------
# timesteps
# --------------------------------------------------------------------------------------------


def train_table(shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, timesteps) float32 [1000]: linspace(1, 0, 1001) without its 0, shifted."""
    x = torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1)[:-1]
    sigmas = shift * x / (1 + (shift - 1) * x)
    return sigmas, sigmas * NUM_TRAIN_TIMESTEPS


def warped_timesteps(steps, shift: float = 5.0) -> list[float]:
    """The timesteps the model receives: step s -> the training timestep of index 1000 - s."""
    _, timesteps = train_table(shift)
    return [float(timesteps[NUM_TRAIN_TIMESTEPS - int(s)]) for s in steps]


def sigma_of(timestep: float, shift: float = 5.0) -> float:
    sigmas, timesteps = train_table(shift)
    return float(sigmas[torch.argmin((timesteps - timestep).abs())])


# --------------------------------------------------------------------------------------------
# which calls, which keys
# --------------------------------------------------------------------------------------------

POLICIES = ("full", "window", "sink_window", "deep_sink")
TURNS = ("rerope", "delta")


@dataclass(frozen=True)
class Policy:
    """The cache in place of Rolling Forcing's: `budget` B key frames a call reads at most (own
    frames included), `sinks` S sink frames (sink_window, deep_sink), `turn` of deep_sink's sinks
    in window calls (rerope | delta; no other policy turns keys). `full`: Rolling Forcing's own
    (B = `attention_frames`, 21; the anchor)."""

    name: str = "full"
    budget: int = ATTENTION_FRAMES
    sinks: int = 0
    turn: str = "rerope"

    def check(self, per_block: int) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"policy {self.name!r} is not one of {POLICIES}")
        if self.turn not in TURNS:
            raise ValueError(f"turn {self.turn!r} is not one of {TURNS}")
        if self.name in ("sink_window", "deep_sink") and not 0 < self.sinks <= per_block:
            raise ValueError(f"{self.sinks} sink frames: 1 .. {per_block} (block 0's frames)")


FULL = Policy()
KIND_OF_VERSION = {"window": "own", "clean": "recent", "anchor": "anchor"}


@dataclass(frozen=True)
class Key:
    """One key frame of a call: `step` is the noise step of a window frame in a denoising call
    (None for the anchor, clean frames and a clean pass's own block)."""

    frame: int
    version: str  # anchor | clean | window
    position: int
    step: int | None = None
    kind: str = ""  # own | recent | sink | anchor; "" -> KIND_OF_VERSION[version]

    def __post_init__(self):
        if not self.kind:
            object.__setattr__(self, "kind", KIND_OF_VERSION[self.version])


def window_blocks(w: int, num_blocks: int, num_steps: int) -> list[tuple[int, int]]:
    """(block, step) of window call w, oldest block first."""
    first, last = max(0, w - num_steps + 1), min(w, num_blocks - 1)
    return [(b, w - b) for b in range(first, last + 1)]


def window_keys(
    blocks: list[tuple[int, int]],
    per_block: int,
    attention_frames: int = ATTENTION_FRAMES,
    policy: Policy = FULL,
) -> list[Key]:
    A = per_block  # the anchor is block 0
    s = blocks[0][0] * per_block
    frames = len(blocks) * per_block
    own = [
        Key(b * per_block + i, "window", b * per_block + i, step)
        for b, step in blocks
        for i in range(per_block)
    ]
    if blocks[0][0] == 0:  # the window still holds block 0: no anchor, no cache
        return own
    if policy.name != "full":
        return policy_window_keys(s, frames, policy) + own
    room = attention_frames - A - frames
    if room < 0:
        raise ValueError(f"a window of {frames} frames and the anchor exceed {attention_frames}")
    cached = min(min(s - A, CLEAN_FRAMES), room)
    first = s - cached - A  # the anchor right before the working cache
    anchor = [Key(j, "anchor", first + j) for j in range(A)]
    clean = [Key(f, "clean", f) for f in range(s - cached, s)]
    return anchor + clean + own


def policy_window_keys(s: int, frames: int, policy: Policy) -> list[Key]:
    """The keys before the window's own frames in a window call of a policy other than full
    (the window starts at frame s > 0 and holds `frames` frames)."""
    B, S = policy.budget, policy.sinks
    if policy.name == "window":
        w = min(s, B - frames)
        if w < 0:
            raise ValueError(f"a window of {frames} frames exceeds the budget {B}")
        return [Key(f, "clean", f) for f in range(s - w, s)]
    w = min(s - S, B - S - frames)
    if w < 0:
        raise ValueError(f"a window of {frames} frames and {S} sinks exceed the budget {B}")
    clean = [Key(f, "clean", f) for f in range(s - w, s)]
    if policy.name == "sink_window":
        sinks = [Key(j, "clean", j, kind="sink") for j in range(S)]
    else:  # deep_sink: right before the clean frames, as the anchor
        sinks = [Key(j, "anchor", s - w - S + j) for j in range(S)]
    return sinks + clean


def cache_keys(
    block: int,
    per_block: int,
    attention_frames: int = ATTENTION_FRAMES,
    policy: Policy = FULL,
) -> list[Key]:
    A = per_block
    c = block * per_block
    own = [Key(c + i, "window", c + i) for i in range(per_block)]
    if block == 0:
        return own
    if policy.name == "window":
        rows = [Key(f, "clean", f) for f in range(c)]
        return (rows + own)[-policy.budget :]
    if policy.name != "full":  # the sinks at their own positions
        rows = [Key(j, "clean", j, kind="sink") for j in range(policy.sinks)]
        rows += [Key(f, "clean", f) for f in range(policy.sinks, c)]
        return (rows + own)[-policy.budget :]
    rows = [Key(j, "anchor", j) for j in range(A)]
    rows += [Key(f, "clean", f) for f in range(A, c)]
    return (rows + own)[-attention_frames:]


def key_runs(keys: list[Key], kinds: bool = False) -> list[tuple]:
    """(first frame, frames, version, first position) of each run of consecutive frames at
    consecutive positions with one version and one kind (`kinds`: the kind after the version)."""
    runs: list[list] = []
    for key in keys:
        last = runs[-1] if runs else None
        if (
            last is not None
            and last[2] == key.version
            and last[4] == key.kind
            and key.frame == last[0] + last[1]
            and key.position == last[3] + last[1]
        ):
            last[1] += 1
        else:
            runs.append([key.frame, 1, key.version, key.position, key.kind])
    return [tuple(run if kinds else run[:4]) for run in runs]


# --------------------------------------------------------------------------------------------
# one model call's record, and the layers' attention
# --------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One model call: `blocks` and `steps` (None in a clean pass) oldest first, the timestep of
    each of its frames, the key frames it read (`keys`, in attention order), its input latents,
    timesteps and output; per layer its post-RoPE queries and keys (model dtype)."""

    index: int
    kind: str  # denoise | cache
    blocks: list[int]
    steps: list[int | None]
    start: int
    frames: int
    timesteps: list[float]
    keys: list[Key]
    x: torch.Tensor | None = None
    output: torch.Tensor | None = None
    q: dict = field(default_factory=dict)  # layer -> [n, heads, d]
    k: dict = field(default_factory=dict)  # layer -> [m, heads, d]

    @property
    def key_list(self) -> list[tuple[int, str, int]]:
        return [(key.frame, key.version, key.position) for key in self.keys]

    @property
    def kinds(self) -> list[str]:
        return [key.kind for key in self.keys]

    @property
    def runs(self) -> list[tuple[int, int, str, int]]:
        return key_runs(self.keys)

    def logits(self, layer: int) -> torch.Tensor:
        """q.k / sqrt(d), float64 [heads, query tokens, key tokens]."""
        q, k = self.q[layer].double(), self.k[layer].double()
        return torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])


@dataclass
class Layer:
    """One layer's store: the anchor (keys before RoPE, values) and per clean frame its post-RoPE
    key and value with the index of the call that wrote it."""

    index: int
    rope: Rope
    T: int
    width: int
    per_block: int
    keep: bool  # keep this layer's q and k of every call, for the logits
    policy: Policy = FULL
    anchor: tuple[torch.Tensor, torch.Tensor] | None = None
    clean: dict = field(default_factory=dict)  # frame -> (k_post [T, H, D], v, call index)
    call: Call | None = None
    final_first_block: bool = False  # this clean pass is block 0's last

    def rotate(self, x: torch.Tensor, position: int) -> torch.Tensor:
        rot = self.rope.rotation([position] * self.T, list(range(self.T)), self.width)
        return Rope.apply(x, rot)

    def turn(self, k_post: torch.Tensor, delta: int) -> torch.Tensor:
        """Post-RoPE keys [T, heads, d] moved `delta` frames in time: the temporal channel pairs
        (the first d_t / 2) times exp(i omega_j delta) in float64, back in the keys' dtype; the
        spatial channels untouched."""
        d_t = self.rope.dims[0]  # Wan: pair j of the temporal axis turns at 10000^(-2j / d_t)
        omega = 10000.0 ** -(torch.arange(0, d_t, 2, dtype=torch.float64) / d_t)
        angles = delta * omega
        turn = torch.polar(torch.ones_like(angles), angles)
        n, heads, _ = k_post.shape
        z = k_post[..., :d_t].to(torch.float64).reshape(n, heads, d_t // 2, 2)
        turned = torch.view_as_real(torch.view_as_complex(z) * turn).reshape(n, heads, d_t)
        return torch.cat([turned.to(k_post.dtype), k_post[..., d_t:]], dim=-1)

    def attend(self, q, k, v, start_frame: int, grid, attention: str) -> torch.Tensor:
        call, T = self.call, self.T
        frames, height, width = grid
        assert (start_frame, frames) == (call.start, call.frames)
        assert height * width == T and width == self.width

        def rows(i):
            return slice(i * T, (i + 1) * T)

        own = {start_frame + i: i for i in range(frames)}
        q_post = torch.cat([self.rotate(q[rows(i)], start_frame + i) for i in range(frames)])
        k_own = [self.rotate(k[rows(i)], start_frame + i) for i in range(frames)]
        keys, values = [], []
        for key in call.keys:
            if key.version == "window":
                assert key.position == key.frame and key.frame in own
                keys.append(k_own[own[key.frame]])
                values.append(v[rows(own[key.frame])])
            elif key.version == "clean":
                if self.policy.name == "full":
                    assert key.frame >= self.per_block, "block 0 is read only as the anchor"
                k_post, value, _ = self.clean[key.frame]
                assert key.position == key.frame  # stored at its own position
                keys.append(k_post)
                values.append(value)
            elif self.policy.name == "deep_sink" and self.policy.turn == "delta":
                # deep_sink's sinks, turned afresh from their own place at every call
                assert key.frame < self.policy.sinks
                k_post, value, _ = self.clean[key.frame]
                keys.append(self.turn(k_post, key.position - key.frame))
                values.append(value)
            else:
                k_raw, value = self.anchor
                j = key.frame
                keys.append(self.rotate(k_raw[rows(j)], key.position))
                values.append(value[rows(j)])
        keys, values = torch.cat(keys), torch.cat(values)
        if self.keep:
            call.q[self.index], call.k[self.index] = q_post.clone(), keys.clone()
        logits = torch.einsum("qhd,khd->hqk", q_post.double(), keys.double())
        p = torch.softmax(logits / math.sqrt(q.shape[-1]), dim=-1)
        out = torch.einsum("hqk,khd->qhd", p, values.double()).to(q.dtype)
        if call.kind == "cache":  # the clean pass writes its block
            for frame, i in own.items():
                self.clean[frame] = (k_own[i], v[rows(i)].clone(), call.index)
            if self.final_first_block:
                self.anchor = (k[: self.per_block * T].clone(), v[: self.per_block * T].clone())
        return out


@dataclass
class Result:
    latents: torch.Tensor  # [1, C, frames, H, W] float32
    calls: list[Call]
    layers: list[Layer]


@torch.no_grad()
def reference_rolling(
    model,
    text: torch.Tensor,
    geometry,
    seed: int,
    *,
    steps=ROLLING_STEPS,
    shift: float = 5.0,
    dtype: torch.dtype = torch.float32,
    attention_frames: int = ATTENTION_FRAMES,
    keep_layers: set[int] | None = None,
    policy: Policy = FULL,
) -> Result:
    """Clean latents of Rolling Forcing's pipeline and the record of every model call.

    `geometry`: num_frames, frames_per_block, latent_height, latent_width, channels (equal
    blocks, no independent first frame). `keep_layers`: the layers whose queries and keys
    every call keeps for `Call.logits` (None: all). `policy`: the KV cache in place of Rolling
    Forcing's (`Policy`; default its own)."""
    cfg = model.config
    F_ = geometry.frames_per_block
    if getattr(geometry, "independent_first_frame", False) or geometry.num_frames % F_:
        raise ValueError("Rolling Forcing runs equal blocks")
    policy.check(F_)
    N, S = geometry.num_frames // F_, len(steps)
    height = geometry.latent_height // cfg.patch_size[1]
    width = geometry.latent_width // cfg.patch_size[2]
    rope = Rope(cfg.head_dim)
    layers = [
        Layer(i, rope, height * width, width, F_, keep_layers is None or i in keep_layers, policy)
        for i in range(cfg.num_layers)
    ]
    C, H, W = geometry.channels, geometry.latent_height, geometry.latent_width
    shape = (1, C, geometry.num_frames, H, W)
    timesteps = warped_timesteps(steps, shift)
    sigmas = [sigma_of(t, shift) for t in timesteps]

    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(shape, generator=generator)
    text_emb = model.embed_text(text.to(dtype))
    output = torch.full(shape, float("nan"))
    x, x0, calls = {}, {}, []

    def run(call: Call, latents: torch.Tensor, final_first_block: bool = False) -> torch.Tensor:
        for layer in layers:
            layer.call, layer.final_first_block = call, final_first_block
        t = torch.tensor([call.timesteps], dtype=torch.float32)
        out = model(
            latents, t, text_emb, kv_caches=layers, start_frame=call.start, text_embedded=True
        )
        call.x, call.output = latents.clone(), out.clone()
        calls.append(call)
        return out

    with _patched_self_attention(model, "float64"):
        for w in range(N + S - 1):
            blocks = window_blocks(w, N, S)
            for b, step in blocks:
                if step == 0:  # enters the window with its rows of the initial noise
                    x[b] = noise[:, :, b * F_ : (b + 1) * F_].to(dtype)
            start, frames = blocks[0][0] * F_, len(blocks) * F_
            call = Call(
                index=len(calls),
                kind="denoise",
                blocks=[b for b, _ in blocks],
                steps=[step for _, step in blocks],
                start=start,
                frames=frames,
                timesteps=[timesteps[step] for _, step in blocks for _ in range(F_)],
                keys=window_keys(blocks, F_, attention_frames, policy),
            )
            velocity = run(call, torch.cat([x[b] for b, _ in blocks], dim=2))
            for i, (b, step) in enumerate(blocks):
                v = velocity[:, :, i * F_ : (i + 1) * F_]
                x0[b] = (x[b].double() - sigmas[step] * v.double()).to(dtype)
            for i, (b, step) in enumerate(blocks):  # oldest first: the order of the draws
                if step == S - 1:
                    output[:, :, b * F_ : (b + 1) * F_] = x0[b].float()
                    continue
                window_noise = torch.randn((1, C, frames, H, W), generator=generator)
                eps = window_noise[:, :, i * F_ : (i + 1) * F_].to(dtype)
                x[b] = (1 - sigmas[step + 1]) * x0[b] + sigmas[step + 1] * eps

            oldest, step = blocks[0]
            clean_pass = Call(
                index=len(calls),
                kind="cache",
                blocks=[oldest],
                steps=[None],
                start=oldest * F_,
                frames=F_,
                timesteps=[0.0] * F_,
                keys=cache_keys(oldest, F_, attention_frames, policy),
            )
            run(clean_pass, x0[oldest], final_first_block=oldest == 0 and step == S - 1)
    assert not output.isnan().any()
    return Result(output, calls, layers)
