"""Snakemake adapter: rule closed_loop (the full-cache rollout of one run, then every policy
against it, in one job). Params: `settings`, each rollout's settings by policy (full first);
`layers`, captured in the full-cache and frame-level rollouts. Outputs `latents`, `deviation`
and `stores` in the order of `settings` (`closed_loops`)."""

import torch

from sinkscope.extraction.closed_loop import closed_loops
from sinkscope.logs import job_log

torch.set_num_threads(snakemake.threads)
with job_log(snakemake.log[0]):
    closed_loops(
        checkpoint_name=snakemake.wildcards.checkpoint,
        prompt_name=snakemake.wildcards.prompt,
        prompt_embeddings=snakemake.input.prompt,
        settings=dict(snakemake.params.settings),
        latents=list(snakemake.output.latents),
        deviations=list(snakemake.output.deviation),
        stores=list(snakemake.output.stores),
        layers=list(snakemake.params.layers),
    )
