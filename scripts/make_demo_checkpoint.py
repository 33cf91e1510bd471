"""Snakemake adapter: rule make_demo_checkpoint."""

from pathlib import Path

from sinkscope.logs import job_log
from sinkscope.wan.demo import make_demo_checkpoint

with job_log(snakemake.log[0]):
    make_demo_checkpoint(
        Path(snakemake.output.config).parent,
        seed=snakemake.params.seed,
        model=snakemake.params.model,
    )
