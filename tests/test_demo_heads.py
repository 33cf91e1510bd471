"""The demo checkpoints' planted heads (sinkscope.wan.demo): the statistics find exactly them,
on both demo checkpoints and prompts, so the embedded default's Fig. 4 shows a sink."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from sinkscope.analysis import stats
from sinkscope.wan.config import WanConfig
from sinkscope.wan.demo import DEMO_MODEL, DEMO_PLANTED_HEADS, plant_heads
from sinkscope.wan.model import WanModel
from sinkscope.wan.rope import apply_rope, rope_angles

SINK, OWN = (
    (DEMO_PLANTED_HEADS[name]["layer"], DEMO_PLANTED_HEADS[name]["head"])
    for name in ("first_frame_sink", "own_block")
)


def test_a_planted_head_scores_by_frame_distance_alone():
    """Whatever the input, the sink head's q.k after RoPE is -A cos(0.1 Delta) up to the norm's
    per-token scale: it rises with the distance between query and key frames."""
    cfg = WanConfig.from_dict(DEMO_MODEL, source="demo")
    model = WanModel(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    assert plant_heads(model) == ["first_frame_sink", "own_block"]
    attn = model.blocks[SINK[0]].self_attn
    x = torch.randn(1, 21 * 24, cfg.dim, generator=torch.Generator().manual_seed(1))
    shape = (1, 21 * 24, cfg.num_heads, cfg.head_dim)
    angles = rope_angles(cfg.head_dim, (21, 4, 6), 0, "cpu")
    with torch.no_grad():
        q = apply_rope(attn.norm_q(attn.q(x)).view(shape), angles)[0, :, SINK[1]]
        k = apply_rope(attn.norm_k(attn.k(x)).view(shape), angles)[0, :, SINK[1]]
    logits = (q @ k.T / cfg.head_dim**0.5).numpy()
    # The last frame's queries, per key frame: farther back is higher, frame 0 highest.
    per_key_frame = logits[20 * 24 :].reshape(24, 21, 24).mean(axis=(0, 2))
    assert np.all(np.diff(per_key_frame) < 0)
    # -8 cos(0.1 * 20) + 8 cos(0) = 11.3 between frame 0 and the own frame, up to the norm.
    assert 8 < per_key_frame[0] - per_key_frame[-1] < 20


@pytest.mark.parametrize("checkpoint", ["demo_a", "demo_b"])
def test_statistics_find_exactly_the_planted_heads(demo_run, checkpoint):
    folder = demo_run / "results/stats" / checkpoint
    for prompt in ("eagle", "harbor"):
        table = pd.concat(
            stats.per_head(stats.read_stats(folder / prompt / f"layer{layer}.csv"))
            for layer in range(DEMO_MODEL["num_layers"])
        )
        last_block = table[table["query"] == "last_block"]
        mass = last_block[last_block["measure"] == "prob_mass"]
        for step, rows in mass.groupby("step"):
            heads = {
                kind: set(zip(group["layer"], group["head"], strict=True))
                for kind, group in rows.groupby("head_class")
            }
            assert heads.get("sink") == {SINK} and heads.get("recent") == {OWN}, (prompt, step)
        logits = last_block[last_block["measure"] == "logit_mean"]
        sink = logits[(logits["layer"] == SINK[0]) & (logits["head"] == SINK[1])]
        assert len(sink) and (sink["sink_score"] > 2.0).all()  # frame 0 well above the middle


def test_the_sink_definition_finds_the_planted_sink_everywhere_it_reports(demo_run):
    """One sink definition in every table: the sink rate counts L0H0 alone (one of layer 0's 4
    heads, no head of another layer), with a wide margin on either side of the threshold, and the
    closed loop's sink-head share of layer 0 is L0H0's quarter at most, never the whole layer
    (the old, unnormalised rule counted every head of blocks 1 and 2 as a sink: 3 sink frames of
    6 hold half the attention of a head that spreads it evenly)."""
    results = demo_run / "results"
    rates = pd.read_csv(results / "stats/sink_rate.csv")
    assert (rates["query"] == "last_block").all()
    sinks = rates.groupby("layer")["sink_heads"].agg(["min", "max"])
    assert sinks.loc[SINK[0]].tolist() == [1, 1]
    assert (sinks.drop(index=SINK[0])["max"] == 0).all()
    threshold = float(rates["threshold"].iloc[0])
    for checkpoint in ("demo_a", "demo_b"):
        for prompt in ("eagle", "harbor"):
            table = pd.concat(
                stats.per_head(
                    stats.read_stats(results / f"stats/{checkpoint}/{prompt}/layer{L}.csv")
                )
                for L in range(DEMO_MODEL["num_layers"])
            )
            mass = table[table["measure"] == "prob_mass"]
            planted = (mass["layer"] == SINK[0]) & (mass["head"] == SINK[1])
            assert mass.loc[planted, "uniform_multiple"].min() > 3 * threshold
            assert mass.loc[~planted, "uniform_multiple"].max() < threshold / 2
    blocks = pd.read_csv(results / "closed_loop/blocks.csv")
    shares = blocks[blocks["layer"] == SINK[0]]["sink_share"].dropna()
    assert len(shares) and shares.max() == pytest.approx(1 / 4)
    full = blocks[(blocks["policy"] == "full") & (blocks["layer"] == SINK[0])]
    assert (full.groupby("block")["sink_share"].max().dropna() == 0.25).any()
