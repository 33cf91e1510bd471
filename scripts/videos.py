"""Snakemake adapter: rules videos (a closed-loop run's rollouts: latents=, tables= in rollout
order, a grid) and survey_video (the survey's rollout: latents= alone, no tables, no grid).
Inputs vae= (the VAE's files; params.vae names the file or folder to load); outputs videos=
(one mp4 per rollout, in the inputs' order), grid= (closed loop only), metrics=; params
rollouts= (the rollouts' names), settings= (device, dtype), sink_frames=."""

import torch

from sinkscope.extraction.decode import closed_loop_rollout, decode_videos, survey_rollout
from sinkscope.logs import job_log


def listed(value):
    return [value] if isinstance(value, str) else list(value)


torch.set_num_threads(snakemake.threads)
with job_log(snakemake.log[0]):
    names = list(snakemake.params.rollouts)
    latents = listed(snakemake.input.latents)
    tables = listed(snakemake.input.get("tables", []))
    if tables:
        rollouts = [
            closed_loop_rollout(name, path, table)
            for name, path, table in zip(names, latents, tables, strict=True)
        ]
    else:
        rollouts = [survey_rollout(path) for path in latents]
    decode_videos(
        checkpoint_name=snakemake.wildcards.checkpoint,
        prompt_name=snakemake.wildcards.prompt,
        rollouts=rollouts,
        videos=listed(snakemake.output.videos),
        grid=snakemake.output.get("grid"),
        metrics=snakemake.output.metrics,
        vae=snakemake.params.vae,
        settings=dict(snakemake.params.settings),
        sink_frames=int(snakemake.params.sink_frames),
    )
