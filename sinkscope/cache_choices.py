"""What a KV-cache policy keeps, decided once for the closed loop and the offline recall.

The closed loop's caches (`sinkscope.extraction.cache_policies`) hold the tensors and score with
the attention of their own rollout; the offline recall (`sinkscope.analysis.policies`) scores
with a full-cache rollout's attention stores. Both hand their scores to the state machines here,
so a policy named in both makes the same choice from the same scores. numpy only: nothing of
sinkscope, no torch. Tokens are absolute token indices (frame f holds f*T .. f*T + T - 1); "slots"
are positions in a cache's ordered list of held tokens, oldest first.

- `DeepSinkTurns`, `deep_sink_shifts`: Deep Forcing's Deep Sink (`wan/modules/causal_model_DS.py`
  of its release, Nizben/Spectral_C ea9961aa): when and how far the sink keys' temporal RoPE turns.
- `ParticipativeChoice`: Deep Forcing's Participative Compression (`wan/modules/causal_model.py`):
  the tokens one layer's cache holds, pruned when a block would overflow it, and the turns of its
  sinks when Deep Sink runs under it.
- `TopCChoice`: sinkscope's `top_c`: per head, the history tokens that received the most
  attention of the previous block's cache-update pass.
- `buffered_query_frames`: which queries Participative Compression's score sums at a prune.
- `replay_frames`: Rolling-Sink's replay, the frame whose clean key a slot at a position gets.
- `jitter_thetas`: the per-head temporal RoPE bases of `head_jitter` (LoL's fix, as sinkscope
  spreads it).
- `CLOSED_LOOP_POLICIES` and its families (`SINK_POLICIES`, `POSITION_POLICIES`, ...),
  `policy_label`: the closed loop's policies by what they keep, and what plots and logs call them.

Ties of a score keep the older token (a stable sort); Deep Forcing's `torch.topk` leaves them
unspecified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Deep Forcing's first Participative Compression turn of its sinks is `21 - Budget` frames, a
# constant of its code (`delta = 21 - capacity // 1560`), right for its cache of 21 frames only.
RELEASE_CACHE_FRAMES = 21

# Why a key is in a cache when a query sees it (the `slot_kind` of an attention store over cache
# slots, Contract 4): its own block, one of the most recent frames (every past frame under the full
# cache), a sink frame, a token chosen by its score, a frame replayed into the cache (Rolling-Sink),
# Rolling Forcing's anchor (block 0's keys, rotated to sit before the working cache).
KEY_KINDS = ("own", "recent", "sink", "chosen", "replayed", "anchor")
KEY_KIND = {name: code for code, name in enumerate(KEY_KINDS)}

# The closed loop's cache policies (`sinkscope.extraction.cache_policies`), grouped by what they
# keep; the workflow, the extraction and the analysis all read these.
# Policies that change where keys and queries sit in RoPE, which keys they are, or how much the
# queries weigh them (`sinkscope.extraction.position_caches`): Infinity-RoPE's relative
# positions, Rolling-Sink's replay, LoL's per-head jitter of the temporal RoPE base and Krea's
# logit bias on past frames.
POSITION_POLICIES = ("relative", "replay", "head_jitter", "logit_bias")
CLOSED_LOOP_POLICIES = (
    "full",
    "window",
    "sink_window",
    "deep_sink",
    "participative",
    "deep_forcing",
    "top_c",
    *POSITION_POLICIES,
)
# Caches that hold whole frames: attention inside their rollouts can be captured.
FRAME_POLICIES = ("full", "window", "sink_window", "deep_sink", *POSITION_POLICIES)
# At a prompt switch: LongLive's recache runs on Self-Forcing's own cache (its window and sinks,
# LongLive's cache), Infinity-RoPE's cut where positions are relative to the window.
RECACHE_POLICIES = ("full", "window", "sink_window")
CUT_POLICIES = ("relative",)
# Participative Compression, its sinks kept (participative) or turned (deep_forcing).
PARTICIPATIVE_POLICIES = ("participative", "deep_forcing")
# Policies that keep S sink frames, and those among them that turn their keys.
SINK_POLICIES = (
    "sink_window",
    "deep_sink",
    *PARTICIPATIVE_POLICIES,
    "relative",
    "head_jitter",
    "logit_bias",
)
TURNING_POLICIES = ("deep_sink", "deep_forcing")
# Policies that keep R recent frames before the own block.
RECENT_POLICIES = (*PARTICIPATIVE_POLICIES, "top_c")


def policy_label(
    policy: str,
    budget: int,
    sink_frames: int = 0,
    recent_frames: int = 0,
    capacity: int = 0,
    *,
    jitter: float = 0.0,
    bias: float = 1.0,
) -> str:
    """What figures, logs and messages call a closed-loop policy: 'window B=9', 'deep_sink B=9
    S=3', 'top_c B=9 R=3', 'deep_forcing B=9 S=3 R=1 capacity=21' (Participative Compression's
    cache, `capacity` as in the config and the tables), 'head_jitter B=12 S=3 j=0.8' (the
    jitter's strength), 'logit_bias B=12 S=3 b=0.3' (the factor on past frames' attention)."""
    label = f"{policy} B={int(budget)}"
    if policy in SINK_POLICIES:
        label += f" S={int(sink_frames)}"
    if policy in RECENT_POLICIES:
        label += f" R={int(recent_frames)}"
    if policy in PARTICIPATIVE_POLICIES:
        label += f" capacity={int(capacity)}"
    if policy == "head_jitter":
        label += f" j={float(jitter):g}"
    if policy == "logit_bias":
        label += f" b={float(bias):g}"
    return label


def replay_frames(positions, span: int) -> np.ndarray:
    """Rolling-Sink's replay: the frame r(p) whose clean key (given RoPE at p) and value the slot
    at temporal position p receives, r(p) = p mod 2R if that is below R, else 2R - 1 - (p mod
    2R), with R = `span` (the release: window 21 less its block of 3, R = 18). A walk over frames
    0 .. R-1 that starts backward and turns at both ends, each end frame twice in a row: with
    R = 18 positions 18-35 hold frames 17..0 and 36-53 hold 0..17."""
    if span < 1:
        raise ValueError(f"replay: the span R must be at least 1 frame, got {span}")
    phase = np.asarray(positions, dtype=np.int64) % (2 * span)
    return np.where(phase < span, phase, 2 * span - 1 - phase)


def jitter_thetas(num_heads: int, strength: float, base: float = 10000.0) -> np.ndarray:
    """The temporal RoPE base of each head under `head_jitter` (float64 [num_heads]): head h of
    H gets base x (1 + strength x u_h), u_h = 2 (h + 0.5) / H - 1, spread evenly over (-1, 1)
    and symmetric about 0, deterministic. LoL's exact form is not published (its paper: a
    per-head jitter of the base, strength about 0.8); strength 0 gives `base` on every head."""
    if not 0.0 <= strength < 1.0:
        raise ValueError(f"head_jitter: the strength must lie in [0, 1), got {strength}")
    u = 2.0 * (np.arange(num_heads, dtype=np.float64) + 0.5) / num_heads - 1.0
    return base * (1.0 + strength * u)


@dataclass
class DeepSinkTurns:
    """Deep Forcing's Deep Sink: when and how far the sink keys' temporal RoPE turns.

    As its code: the first pass of a block whose keys do not fit the window (held + block >
    window frames, sinks and own block included) evicts and aims the sinks at g(c) = c - window,
    c the block's first frame. The first evicting block c1 only records g(c1); every later one
    turns the sinks by g(c) - g(last). So the sinks sit at c - c1 + i from the block after c1 on:
    one block before the window's oldest frame when the block divides the window, closer
    otherwise (window 8 in blocks of 3: c1 = 6, the sinks end one frame before it). Without
    sinks nothing turns."""

    window: int
    sink_frames: int
    held: int = 0  # frames in the cache
    start: int = 0  # first frame of the next block
    target: int | None = None  # g of the last evicting block
    shift: int = 0  # sink frame i sits at RoPE position i + shift

    def block(self, size: int) -> int:
        """A block of `size` frames starts (its first pass): the turn it makes, in frames."""
        turn = 0
        if self.held + size > self.window:
            target = self.start - self.window
            if self.target is not None and self.sink_frames:
                turn = target - self.target
            self.target = target
            self.held = self.window
        else:
            self.held += size
        self.shift += turn
        self.start += size
        return turn


def deep_sink_shifts(block_sizes: Sequence[int], window: int, sink_frames: int) -> list[int]:
    """Per block, how far Deep Sink has turned the sink keys during that block (every pass):
    sink frame i sits at RoPE position i + shift (`DeepSinkTurns`)."""
    turns = DeepSinkTurns(window, sink_frames)
    shifts = []
    for size in block_sizes:
        turns.block(size)
        shifts.append(turns.shift)
    return shifts


def _stable_top(scores: np.ndarray, count: int) -> np.ndarray:
    """Positions of the `count` largest scores, ascending; ties keep the earlier position, and
    NaN (a key the scoring queries could not see) ranks last."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    return np.sort(order[:count])


@dataclass
class Prune:
    """One prune of `ParticipativeChoice`: the slots of the list it pruned (held tokens, then
    the block's) that it keeps, oldest first, and the sink turn that follows (frames, 0 for
    none)."""

    kept: np.ndarray
    turn: int


@dataclass
class ParticipativeChoice:
    """Deep Forcing's Participative Compression for one layer, as its released code runs it.

    The cache holds up to `capacity` frames of tokens. Every model call's queries join a buffer
    of the newest (`recent_frames` + `frames_per_block`) x T query tokens. The first pass of a
    block whose keys would overflow the cache prunes the held tokens and the block's own to:
    the sink frames; the top C = Budget - sinks - recent tokens among the rest, scored by the raw
    q.k of the buffered queries summed over them and over the layer's heads (one choice for all
    heads); the newest (`recent_frames` + own block) frames. A token chosen `reuse_cap` times is
    no longer a candidate (0: no cap); time as a sink or a recent frame does not count. Tokens
    leave the cache only at prunes. Later passes of the block rewrite its own slots, the last.

    With `turn_sinks` (Deep Sink under it, as released), each prune turns the sinks' temporal
    RoPE toward g(c) = c - (kept frames): the first by the release's constant 21 - Budget
    frames, later ones by g(c) - g(last). `recent_frames` counts the frames before the own
    block: Deep Forcing's Recent 4 with blocks of 3 is `recent_frames` 1.
    """

    frame_seq_length: int
    capacity: int  # frames held before a block overflows
    budget: int  # frames after a prune (sinks and own block included)
    sink_frames: int
    recent_frames: int
    frames_per_block: int
    reuse_cap: int = 7
    turn_sinks: bool = True
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    queries_seen: int = 0  # query tokens the buffer has taken in, to know when it is full
    sink_shift: int = 0  # frames the sinks are turned by: sink frame i sits at i + sink_shift
    sink_target: int | None = None  # g of the last turn
    pruned_blocks: list[int] = field(default_factory=list)  # first frame of each pruning block

    def __post_init__(self):
        if self.recent_frames < 0 or self.sink_frames < 0 or self.reuse_cap < 0:
            raise ValueError("participative: sinks, recent frames and the reuse cap are >= 0")
        if self.budget > self.capacity:
            raise ValueError(
                f"participative: a budget of {self.budget} frames exceeds the cache's capacity "
                f"of {self.capacity}"
            )

    @property
    def recent_tokens(self) -> int:
        """The newest tokens kept at a prune and the query tokens the buffer keeps."""
        return (self.recent_frames + self.frames_per_block) * self.frame_seq_length

    def add_queries(self, count: int) -> None:
        """A model call's `count` query tokens joined the buffer (every call, before its keys)."""
        self.queries_seen += int(count)

    def overflows(self, new_tokens: int) -> bool:
        """Whether a new block of `new_tokens` keys must prune: they do not fit beside the
        held ones."""
        return len(self.tokens) + int(new_tokens) > self.capacity * self.frame_seq_length

    def append(self, start_token: int, count: int) -> None:
        """A block's first pass writes its keys after the held ones (selection count 0)."""
        new = np.arange(start_token, start_token + count, dtype=np.int64)
        self.tokens = np.concatenate([self.tokens, new])
        self.counts = np.concatenate([self.counts, np.zeros(count, dtype=np.int64)])

    def buffered_queries(self) -> int:
        """The query tokens a prune's score sums (the buffer's newest), and as many newest
        tokens the prune keeps: Deep Forcing's R_eff."""
        return min(self.recent_tokens, self.queries_seen, len(self.tokens))

    def candidates(self) -> np.ndarray:
        """Slots a prune may choose among: all but the sinks and the recent tokens."""
        held = len(self.tokens)
        sinks = min(self.sink_frames * self.frame_seq_length, held)
        return np.arange(sinks, max(sinks, held - self.buffered_queries()))

    def prune(self, scores: np.ndarray, block_start: int) -> Prune:
        """Prune the held list (the block's keys appended) by `scores` (one per held slot, the
        candidates' read), at the first pass of the block starting at frame `block_start`."""
        t = self.frame_seq_length
        held = len(self.tokens)
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape != (held,):
            raise ValueError(f"participative: {scores.shape[0]} scores for {held} held tokens")
        sinks = min(self.sink_frames * t, held)
        recent = self.buffered_queries()
        total = min(max(min(self.budget, self.capacity) * t, sinks + recent), held)
        top_c = max(0, total - sinks - recent)
        candidates = self.candidates()
        eligible = (
            self.counts[candidates] < self.reuse_cap
            if self.reuse_cap
            else np.ones(len(candidates), dtype=bool)
        )
        pool = candidates[eligible]
        chosen = pool[_stable_top(scores[pool], min(top_c, len(pool)))] if top_c else pool[:0]
        kept = np.unique(np.concatenate([np.arange(sinks), chosen, np.arange(held - recent, held)]))
        if self.reuse_cap:
            self.counts[chosen] += 1
        self.tokens, self.counts = self.tokens[kept], self.counts[kept]
        turn = self._turn(block_start, len(kept), sinks)
        self.pruned_blocks.append(block_start)
        return Prune(kept, turn)

    def _turn(self, block_start: int, kept: int, sinks: int) -> int:
        """Deep Sink under Participative Compression: the sinks aim at g(c) = c - kept frames
        (the non-sink frames floored); the first turn is the release's 21 - Budget."""
        if not (self.turn_sinks and sinks):
            return 0
        t = self.frame_seq_length
        target = block_start - (kept - sinks) // t - sinks // t
        first = self.sink_target is None
        turn = RELEASE_CACHE_FRAMES - self.budget if first else target - self.sink_target
        self.sink_target = target
        self.sink_shift += turn
        return turn


def buffered_query_frames(
    block_sizes: Sequence[int], block: int, passes: int, recent_tokens: int, frame_seq_length: int
) -> list[tuple[int, int, int]]:
    """The (block, pass, latent frame) of the queries in Participative Compression's buffer when
    the first pass of `block` prunes: the newest `recent_tokens` query tokens in call order
    (every block's `passes` calls, each all of its block's frames), newest first. Whole frames,
    as the buffer's cut falls between frames when `recent_tokens` is a multiple of T."""
    starts = np.concatenate([[0], np.cumsum(block_sizes)]).astype(int)
    frames = recent_tokens // frame_seq_length
    calls = [(block, 0)]
    b, p = block, 0
    out = []
    while len(out) < frames:
        b, p = calls[-1]
        for frame in range(starts[b + 1] - 1, starts[b] - 1, -1):
            if len(out) < frames:
                out.append((b, p, frame))
        if p > 0:
            calls.append((b, p - 1))
        elif b > 0:
            calls.append((b - 1, passes - 1))
        else:
            break
    return out


@dataclass
class TopCChoice:
    """sinkscope's `top_c` for one layer, each head its own choice: the own block and the
    `recent_frames` before it, whole, and up to C = (budget - frames_per_block - recent_frames)
    x T history tokens. When a block arrives, the frames that leave the recent window join the
    kept history as candidates; with more than C, each head keeps the C that received the most
    attention (mean softmax probability over the queries) of the previous block's cache-update
    pass, the last call before the new block: causal, as a real cache must choose. Kept tokens
    stay in time order; with C at least the whole history nothing is ever dropped."""

    frame_seq_length: int
    num_heads: int
    budget: int
    recent_frames: int
    frames_per_block: int
    history: np.ndarray = field(init=False)  # [kept, heads] tokens, time order per head
    window_start: int = 0  # first token of the recent window

    def __post_init__(self):
        self.history = np.zeros((0, self.num_heads), dtype=np.int64)

    @property
    def history_tokens(self) -> int:
        return (self.budget - self.frames_per_block - self.recent_frames) * self.frame_seq_length

    def leaving(self, block_start_token: int) -> np.ndarray:
        """Tokens that leave the recent window when a block starts at `block_start_token`."""
        new_start = max(
            self.window_start, block_start_token - self.recent_frames * self.frame_seq_length
        )
        return np.arange(self.window_start, new_start, dtype=np.int64)

    def candidates(self, block_start_token: int) -> np.ndarray:
        """[kept history + leaving, heads]: the tokens each head chooses among when a block
        starts at `block_start_token`, in that order."""
        leaving = self.leaving(block_start_token)
        return np.concatenate([self.history, np.repeat(leaving[:, None], self.num_heads, axis=1)])

    def compress(self, block_start_token: int, scores: np.ndarray | None) -> np.ndarray:
        """Move the tokens leaving the window into the history, keeping each head's best C by
        `scores` [heads, kept history + leaving] (the candidates in that order; needed only when
        there are more than C). Returns the chosen candidates' positions [C', heads]."""
        leaving = self.leaving(block_start_token)
        candidates = self.candidates(block_start_token)
        count = len(candidates)
        if count > self.history_tokens:
            if scores is None or scores.shape[1] < count:
                raise RuntimeError(
                    "top_c must choose history tokens but saw no attention of the previous "
                    "block's cache-update pass"
                )
            choice = np.stack(
                [
                    _stable_top(scores[head, :count], self.history_tokens)
                    for head in range(self.num_heads)
                ],
                axis=1,
            )
        else:
            choice = np.repeat(np.arange(count)[:, None], self.num_heads, axis=1)
        self.history = np.take_along_axis(candidates, choice, axis=0)
        self.window_start += len(leaving)
        return choice
