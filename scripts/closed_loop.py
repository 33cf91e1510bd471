"""Snakemake adapter: rules closed_loop_reference, closed_loop and closed_loop_top_c (one
rollout of wildcard `policy`, or of the full cache; params `layers`: captured layers)."""

import torch

from sinkscope.extraction.closed_loop import closed_loop
from sinkscope.logs import job_log

torch.set_num_threads(snakemake.threads)
with job_log(snakemake.log[0]):
    closed_loop(
        checkpoint_name=snakemake.wildcards.checkpoint,
        prompt_name=snakemake.wildcards.prompt,
        prompt_embeddings=snakemake.input.prompt,
        settings=snakemake.params.settings,
        latents_path=snakemake.output.latents,
        reference=snakemake.input.get("reference"),
        deviation_path=snakemake.output.get("deviation"),
        layers=snakemake.params.layers,
        stores=list(snakemake.output.get("stores", [])),
    )
