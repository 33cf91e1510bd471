# sinkscope: where autoregressive video diffusion transformers put their attention.
# The DAG, the file contracts and the layout: docs/DESIGN.md.
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config.yaml"


validate(config, "schemas/config.schema.yaml")


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/models.smk"
include: "rules/prompts.smk"
include: "rules/extract.smk"
include: "rules/reduce.smk"
include: "rules/stats.smk"
include: "rules/figures.smk"


# On a cluster these run in the main Snakemake process: seconds each, not worth a queue slot.
localrules:
    all,
    make_demo_checkpoint,
    make_demo_text_encoder,
    stats,
    summary,
    figures,
    compare_figures,


rule all:
    default_target: True
    input:
        expand(
            "results/stats/{checkpoint}/{prompt}/layer{layer}.csv",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=LAYERS,
        ),
        "results/stats/summary.csv",
        expand(
            [figure.path for figure in RUN_FIGURES],
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
        ),
        [figure.path for figure in COMPARE_FIGURES],
