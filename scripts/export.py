"""Snakemake adapter: rule export_run (the seed notebooks' layouts of one checkpoint and prompt)."""

from sinkscope.exports.notebooks import export_run
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    export_run(
        token_stores=list(snakemake.input.tokens),
        token_layers=snakemake.params.layers,
        frame_datasets=list(snakemake.input.frames),
        frame_layers=snakemake.params.frame_layers,
        frame_outputs=list(snakemake.output.frames),
        step=snakemake.params.step,
        measure=snakemake.params.measure,
        figure4=snakemake.output.get("figure4"),
        logit_cache=snakemake.output.get("logit_cache"),
        shapes_cache=snakemake.output.get("shapes_cache"),
    )
