"""Snakemake adapter: rules figures, compare_figures and survey_figures (each output file names
its figure). Inputs: frames= (frame datasets), attention= (attention stores, survey figures only);
params: figures=, and stats= where the figures read its thresholds (survey figures)."""

from sinkscope.analysis.plots import render_figures
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    options = snakemake.params.figures
    stats = snakemake.params.get("stats") or {}
    render_figures(
        list(snakemake.input.frames),
        list(snakemake.output),
        heads=[tuple(head) for head in options["heads"]],
        measure=options["measure"],
        frame_axis=options["frame_axis"],
        step=options["step"],
        attention_stores=list(snakemake.input.get("attention", [])),
        **{key: stats[key] for key in ("sink_threshold", "recent_threshold") if key in stats},
    )
