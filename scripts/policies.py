"""Snakemake adapter: rule policies (the recall table of one run)."""

from sinkscope.analysis.policies import write_policies
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    options = snakemake.params.policies
    write_policies(
        list(snakemake.input.frames),
        list(snakemake.input.get("attention", [])),
        snakemake.output[0],
        budgets=options["budgets"],
        sinks=options["sinks"],
        recent_frames=options["recent_frames"],
        capacity=options["capacity"],
        reuse_cap=options["reuse_cap"],
    )
