"""Snakemake adapter: rules extract (the token store of wildcard `layer`) and survey (params
`layers` and `store`: the attention stores of every surveyed layer)."""

import torch

from sinkscope.extraction.job import extract
from sinkscope.logs import job_log

torch.set_num_threads(snakemake.threads)
with job_log(snakemake.log[0]):
    extract(
        checkpoint_name=snakemake.wildcards.checkpoint,
        prompt_name=snakemake.wildcards.prompt,
        prompt_embeddings=snakemake.input.prompt,
        layers=snakemake.params.get("layers") or [int(snakemake.wildcards.layer)],
        # the survey's stores= (and latents=), or the extract rule's one token store
        outputs=list(snakemake.output.get("stores", snakemake.output)),
        settings=snakemake.params.settings,
        store=snakemake.params.get("store", "tokens"),
        latents=(snakemake.output.get("latents") or [None])[0],
    )
