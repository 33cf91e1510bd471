# sinkscope: where autoregressive video diffusion transformers put their attention.
# The DAG, the file contracts and the layout: docs/DESIGN.md.
from snakemake.utils import min_version, validate

from sinkscope.workflow.entries import ConfigError
from sinkscope.workflow.checks import check_config_files

min_version("9.0")


configfile: "config.yaml"


# Before the schema: YAML keeps only the last of two equal keys, and the schema cannot tell.
try:
    check_config_files(workflow.configfiles)
except ConfigError as err:
    raise WorkflowError(str(err)) from None
validate(config, "schemas/config.schema.yaml")


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/models.smk"
include: "rules/prompts.smk"
include: "rules/extract.smk"
include: "rules/reduce.smk"
include: "rules/stats.smk"
include: "rules/policies.smk"
include: "rules/figures.smk"
include: "rules/export.smk"
include: "rules/closed_loop.smk"
include: "rules/videos.smk"
include: "rules/explorer.smk"


# On a cluster these run in the main Snakemake process: seconds each, not worth a queue slot.
localrules:
    all,
    make_demo_models,
    make_demo_text_encoder,
    summary,
    figures,
    closed_loop_summary,
    video_summary,
    explorer,


# Every output a user opens is a target, so a plain rerun restores whatever is missing.
rule all:
    default_target: True
    input:
        [
            f"results/logits/{checkpoint}/{prompt}/layer{layer}.zarr"
            for checkpoint, prompt, layer in (TOKEN_STORES if KEEP_TOKENS else [])
        ],
        expand(
            "results/attention/{checkpoint}/{prompt}/layer{layer}.zarr",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=SURVEY_LAYERS,
        ),
        expand(
            [
                "results/frames/{checkpoint}/{prompt}/layer{layer}.zarr",
                "results/stats/{checkpoint}/{prompt}/layer{layer}.csv",
            ],
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=LAYERS,
        ),
        "results/stats/summary.csv",
        "results/stats/summary.html",
        "results/stats/sink_rate.csv",
        "results/policies/summary.csv",
        expand(
            "results/policies/{checkpoint}/{prompt}.csv",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
        ),
        [
            figure.path.format(checkpoint=checkpoint, prompt=prompt)
            for checkpoint, prompt in FIGURE_RUNS
            for figure in RUN_FIGURES + POLICY_FIGURES + SURVEY_FIGURES
        ],
        [figure.path for figure in COMPARE_FIGURES + SURVEY_COMPARE_FIGURES],
        [
            f"results/closed_loop/{checkpoint}/{prompt}/{policy}/layer{layer}.zarr"
            for checkpoint, prompt in CLOSED_LOOP_RUNS
            for policy in CLOSED_LOOP_ROLLOUTS
            for layer in CLOSED_LOOP_SURVEY
        ],
        ["results/closed_loop/summary.csv"] if CLOSED_LOOP_POLICIES else [],
        [figure.path for figure in CLOSED_LOOP_FIGURES],
        # videos: every decoded rollout, the grids, the tables, the video figures
        [
            f"results/videos/{checkpoint}/{prompt}/{rollout}.mp4"
            for checkpoint, prompt in VIDEO_RUNS
            for rollout in CLOSED_LOOP_ROLLOUTS
        ],
        [
            f"results/videos/{checkpoint}/{prompt}/survey.mp4"
            for checkpoint, prompt in SURVEY_VIDEO_RUNS
        ],
        (
            ["results/videos/metrics.csv", "results/videos/drift.csv"]
            if VIDEO_RUNS or SURVEY_VIDEO_RUNS
            else []
        ),
        [
            figure.path.format(checkpoint=checkpoint, prompt=prompt)
            for checkpoint, prompt in VIDEO_RUNS
            for figure in VIDEO_FIGURES
        ],
        # one page to walk all of it (rule explorer)
        "results/explorer",
