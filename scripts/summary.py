"""Snakemake adapter: rule summary. Inputs frames= (every run's frame datasets), policies= (their
recall tables); outputs stats= (the statistics of every run and layer, in the order of frames=),
summary=, summary_table=, sink_rate=, policies= (the summary tables) and figures= (the figures
across runs, named as the registry names them); params stats=, figures=, figure_layers=,
survey_layers= (the layers the compare figures and the survey's compare figures show)."""

from sinkscope.analysis.plots.render import render_configured
from sinkscope.analysis.policies import write_policy_summary
from sinkscope.analysis.stats import write_run_stats, write_summary
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    options = snakemake.params.stats
    frames, stats = list(snakemake.input.frames), list(snakemake.output.stats)
    write_run_stats(
        frames,
        stats,
        query=options["query"],
        sink_threshold=options["sink_threshold"],
        recent_threshold=options["recent_threshold"],
    )
    write_summary(
        stats,
        snakemake.output.summary,
        snakemake.output.sink_rate,
        html_table=snakemake.output.summary_table,
        sink_threshold=options["sink_threshold"],
    )
    write_policy_summary(list(snakemake.input.policies), snakemake.output.policies)
    figures = list(snakemake.output.figures)
    if figures:
        render_configured(
            frames,
            figures,
            figures=snakemake.params.figures,
            stats_options=options,
            figure_layers=snakemake.params.figure_layers,
            survey_layers=snakemake.params.survey_layers,
        )
