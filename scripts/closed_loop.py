"""Snakemake adapter: rule closed_loop (every rollout of one run in one job, the full-cache
reference first when there is one). Params: `settings`, each rollout's settings by policy;
`layers`, captured in every rollout; `sink_frames`, the diagnostics' sink frames. Outputs
`latents`, `tables`, `blocks` and `stores` in the order of `settings` (`closed_loops`)."""

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
        tables=list(snakemake.output.tables),
        blocks=list(snakemake.output.blocks),
        stores=list(snakemake.output.stores),
        layers=list(snakemake.params.layers),
        sink_frames=int(snakemake.params.sink_frames),
    )
