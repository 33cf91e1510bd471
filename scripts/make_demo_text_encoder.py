"""Snakemake adapter: rule make_demo_text_encoder."""

from sinkscope.logs import job_log
from sinkscope.wan.text import make_demo_text_encoder

with job_log(snakemake.log[0]):
    make_demo_text_encoder(snakemake.output[0], seed=snakemake.params.seed, **snakemake.params.size)
