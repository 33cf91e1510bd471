"""Snakemake adapter: rules figures (a run's layer, run, policy and survey figures) and
compare_figures (each output file names its figure). Inputs: frames= (frame datasets),
attention= (attention stores, survey figures only), policies= (the run's recall table, policy
figures only); params: figures=, stats= where the figures read its thresholds (survey figures),
figure_layers= and survey_layers= (the layers the other figures and the survey figures show:
the frame datasets hold both), policies= where the policy figures read
their budget (key `budget`, optional)."""

from sinkscope.analysis.plots import render_figures
from sinkscope.logs import job_log


def paths(name: str) -> list[str]:
    """Input `name` as a list: Snakemake gives a single named file as a string."""
    value = snakemake.input.get(name, [])
    return [value] if isinstance(value, str) else list(value)


with job_log(snakemake.log[0]):
    options = snakemake.params.figures
    stats = snakemake.params.get("stats") or {}
    policies = snakemake.params.get("policies") or {}
    render_figures(
        paths("frames"),
        list(snakemake.output),
        heads=[tuple(head) for head in options["heads"]],
        measure=options["measure"],
        frame_axis=options["frame_axis"],
        step=options["step"],
        annotate=options.get("annotate", ["max"]),
        titles=options.get("titles", True),
        shared_scale=options.get("shared_scale", True),
        figure_layers=snakemake.params.get("figure_layers"),
        survey_layers=snakemake.params.get("survey_layers"),
        attention_stores=paths("attention"),
        policy_tables=paths("policies"),
        policy_budget=policies.get("budget"),
        **{key: stats[key] for key in ("sink_threshold", "recent_threshold") if key in stats},
    )
