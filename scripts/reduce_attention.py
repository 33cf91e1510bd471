"""Snakemake adapter: rule reduce_attention (one frame dataset per attention store)."""

from sinkscope.analysis.reduce import reduce_attention_stores
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    reduce_attention_stores(
        list(snakemake.input), list(snakemake.output), threads=snakemake.threads
    )
