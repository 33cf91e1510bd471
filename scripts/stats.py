"""Snakemake adapter: rule stats."""

from sinkscope.analysis.stats import write_stats
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    options = snakemake.params.stats
    write_stats(
        snakemake.input[0],
        snakemake.output[0],
        query=options["query"],
        sink_threshold=options["sink_threshold"],
        recent_threshold=options["recent_threshold"],
    )
