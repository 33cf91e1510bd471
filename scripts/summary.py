"""Snakemake adapter: rule summary (statistics, sink rate and policy recall of every run)."""

from sinkscope.analysis.policies import write_policy_summary
from sinkscope.analysis.stats import write_summary
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    write_summary(
        list(snakemake.input.stats),
        snakemake.output.summary,
        snakemake.output.sink_rate,
        html_table=snakemake.output.summary_table,
        sink_threshold=snakemake.params.sink_threshold,
    )
    write_policy_summary(list(snakemake.input.policies), snakemake.output.policies)
