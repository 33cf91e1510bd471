"""Snakemake adapter: rule reduce."""

from sinkscope.analysis.reduce import reduce_token_store
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    reduce_token_store(snakemake.input[0], snakemake.output[0], threads=snakemake.threads)
