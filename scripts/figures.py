"""Snakemake adapter: rules figures and compare_figures (each output file names its figure)."""

from sinkscope.analysis.plots import render_figures
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    options = snakemake.params.figures
    render_figures(
        list(snakemake.input),
        list(snakemake.output),
        heads=[tuple(head) for head in options["heads"]],
        measure=options["measure"],
        frame_axis=options["frame_axis"],
        step=options["step"],
    )
