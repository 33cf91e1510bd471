"""Snakemake adapter: rule make_demo_models (the demo's DiT checkpoints, in Wan's original
layout, and its VAE, a diffusers folder). Outputs: each checkpoint's config.json and weights, in
the order of params checkpoints= (name: seed), then vae_config= and vae_weights=; params:
model= (demo.model), vae= (demo.vae: seed, base_dim)."""

from pathlib import Path

from sinkscope.logs import job_log
from sinkscope.wan.demo import make_demo_checkpoint, make_demo_vae

with job_log(snakemake.log[0]):
    seeds = list(snakemake.params.checkpoints.values())
    configs = list(snakemake.output)[0 : 2 * len(seeds) : 2]
    for config_file, seed in zip(configs, seeds, strict=True):
        make_demo_checkpoint(Path(config_file).parent, seed=seed, model=snakemake.params.model)
    vae = snakemake.params.vae
    make_demo_vae(
        Path(snakemake.output.vae_config).parent, seed=vae["seed"], base_dim=vae["base_dim"]
    )
