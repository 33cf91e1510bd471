"""Snakemake adapter: rule explorer. Inputs frames= (every run's frame datasets), attention=
(the surveyed layers' attention stores), deviation= (the closed loops' frame tables), blocks=
(results/closed_loop/blocks.csv), slots= (the closed loops' stores over cache slots), metrics=
(the decoded runs' video metrics), videos= (their mp4s), each possibly empty; output the
explorer folder; params stats= (the sink and recent thresholds)."""

from sinkscope.analysis.explorer import write_explorer
from sinkscope.logs import job_log


def paths(name: str) -> list[str]:
    """Input `name` as a list: Snakemake gives a single named file as a string."""
    value = snakemake.input.get(name, [])
    return [value] if isinstance(value, str) else list(value)


with job_log(snakemake.log[0]):
    write_explorer(
        snakemake.output[0],
        frames=paths("frames"),
        attention=paths("attention"),
        deviation=paths("deviation"),
        blocks=(paths("blocks") or [None])[0],
        metrics=paths("metrics"),
        slots=paths("slots"),
        videos=paths("videos"),
        sink_threshold=snakemake.params.stats["sink_threshold"],
        recent_threshold=snakemake.params.stats["recent_threshold"],
    )
