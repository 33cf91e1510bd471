"""Snakemake adapter: rule policies. Inputs frames= (the token layers' frame datasets), attention=
(the attention stores of the surveyed layers); outputs frames= (the surveyed layers' frame
datasets, reduced from attention= in its order) and table= (the recall table of every layer)."""

from sinkscope.analysis.policies import write_policies
from sinkscope.analysis.reduce import reduce_attention_stores
from sinkscope.logs import job_log

with job_log(snakemake.log[0]):
    options = snakemake.params.policies
    attention = list(snakemake.input.attention)
    reduced = list(snakemake.output.frames)
    reduce_attention_stores(attention, reduced, threads=snakemake.threads)
    write_policies(
        reduced + list(snakemake.input.frames),
        attention,
        snakemake.output.table,
        budgets=options["budgets"],
        sinks=options["sinks"],
        recent_frames=options["recent_frames"],
        capacity=options["capacity"],
        reuse_cap=options["reuse_cap"],
    )
