"""Snakemake adapter: rule extract."""

import torch

from sinkscope.extraction.job import extract
from sinkscope.logs import job_log

torch.set_num_threads(snakemake.threads)
with job_log(snakemake.log[0]):
    extract(
        checkpoint_name=snakemake.wildcards.checkpoint,
        prompt_name=snakemake.wildcards.prompt,
        prompt_embeddings=snakemake.input.prompt,
        layers=[int(snakemake.wildcards.layer)],
        outputs=[snakemake.output[0]],
        settings=snakemake.params.settings,
    )
