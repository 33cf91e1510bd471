"""Snakemake adapter: rule figures (a run's layer, run, policy and survey figures; each output
file names its figure). Inputs: frames= (frame datasets), attention= (attention stores, survey
figures only), policies= (the run's recall table, policy figures only); params: figures=,
stats= (the thresholds the survey figures read), policies= (key `budget`, optional: the budget
the policy figures show), figure_layers= and survey_layers= (the layers the other figures and
the survey figures show: the frame datasets hold both)."""

from sinkscope.analysis.plots.render import render_configured
from sinkscope.logs import job_log


def paths(name: str) -> list[str]:
    """Input `name` as a list: Snakemake gives a single named file as a string."""
    value = snakemake.input.get(name, [])
    return [value] if isinstance(value, str) else list(value)


with job_log(snakemake.log[0]):
    render_configured(
        paths("frames"),
        list(snakemake.output),
        figures=snakemake.params.figures,
        stats_options=snakemake.params.get("stats"),
        policies=snakemake.params.get("policies"),
        figure_layers=snakemake.params.get("figure_layers"),
        survey_layers=snakemake.params.get("survey_layers"),
        attention_stores=paths("attention"),
        policy_tables=paths("policies"),
    )
