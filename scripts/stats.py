"""Snakemake adapter: rule stats (one CSV per layer of a run)."""

from sinkscope.analysis.stats import write_run_stats
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    options = snakemake.params.stats
    write_run_stats(
        list(snakemake.input),
        list(snakemake.output),
        query=options["query"],
        sink_threshold=options["sink_threshold"],
        recent_threshold=options["recent_threshold"],
    )
