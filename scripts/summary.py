"""Snakemake adapter: rule summary."""

from sinkscope.logs import job_log
from sinkscope.stats import write_summary

with job_log(snakemake.log[0]):
    write_summary(list(snakemake.input), snakemake.output[0])
