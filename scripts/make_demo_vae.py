"""Snakemake adapter: rule make_demo_vae."""

from pathlib import Path

from sinkscope.logs import job_log
from sinkscope.wan.demo import make_demo_vae

with job_log(snakemake.log[0]):
    make_demo_vae(
        Path(snakemake.output.config).parent,
        seed=snakemake.params.seed,
        base_dim=snakemake.params.base_dim,
    )
