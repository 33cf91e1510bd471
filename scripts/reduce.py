"""Snakemake adapter: rule reduce."""

from sinkscope.logs import job_log
from sinkscope.reduce import reduce_token_store

with job_log(snakemake.log[0]):
    reduce_token_store(snakemake.input[0], snakemake.output[0], threads=snakemake.threads)
