"""Snakemake adapter: rule stats."""

from sinkscope.logs import job_log
from sinkscope.stats import write_stats

with job_log(snakemake.log[0]):
    write_stats(snakemake.input[0], snakemake.output[0], query=snakemake.params.query)
