"""Snakemake adapter: rule survey (attention stores of every surveyed layer, one rollout)."""

import torch

from sinkscope.extraction.job import extract
from sinkscope.logs import job_log

torch.set_num_threads(snakemake.threads)
with job_log(snakemake.log[0]):
    extract(
        checkpoint_name=snakemake.wildcards.checkpoint,
        prompt_name=snakemake.wildcards.prompt,
        prompt_embeddings=snakemake.input.prompt,
        layers=snakemake.params.layers,
        outputs=list(snakemake.output),
        settings=snakemake.params.settings,
        store="attention",
    )
