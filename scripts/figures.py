"""Snakemake adapter: rule figures (one checkpoint and prompt, all captured layers)."""

from pathlib import Path

from sinkscope.analysis.plots import render_run_figures
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    options = snakemake.params.figures
    render_run_figures(
        list(snakemake.input),
        Path(snakemake.output[0]).parent,
        figure4_heads=[tuple(head) for head in options["heads"]],
        measure=options["measure"],
        frame_axis=options["frame_axis"],
        step=options["step"],
        fmt=options["format"],
    )
