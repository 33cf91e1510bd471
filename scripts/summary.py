"""Snakemake adapter: rule summary."""

from sinkscope.analysis.stats import write_summary
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    write_summary(
        list(snakemake.input),
        snakemake.output.summary,
        snakemake.output.sink_rate,
        html_table=snakemake.output.summary_table,
        sink_threshold=snakemake.params.sink_threshold,
    )
