"""Snakemake adapter: rule video_summary. Inputs metrics= (every decoded run's per-frame
table), videos= (the closed-loop runs' mp4s), grids= (their grid videos), frames= (their
closed-loop frame tables), blocks= (the closed loop's block table); outputs metrics= and drift=
(results/videos/), pages= (each grid video in an HTML page, for the report) and figures= (named
as the figure registry names them); params train_frames=, figures= (its `titles`)."""

from sinkscope.analysis.plots import render_figures
from sinkscope.logs import job_log
from sinkscope.video_metrics import write_video_tables
from sinkscope.videos import write_video_page


def paths(name: str) -> list[str]:
    value = snakemake.input.get(name, [])
    return [value] if isinstance(value, str) else list(value)


with job_log(snakemake.log[0]):
    metrics, drift = snakemake.output.metrics, snakemake.output.drift
    write_video_tables(paths("metrics"), metrics, drift)
    for grid, page in zip(paths("grids"), list(snakemake.output.pages), strict=True):
        run = " · ".join(grid.split("/")[-3:-1])
        write_video_page(
            grid,
            page,
            title=f"{run}: every closed-loop rollout",
            note="A tile's band turns red from its first eviction on.",
        )
    figures = list(snakemake.output.figures)
    if figures:
        render_figures(
            [],
            figures,
            heads=[],
            video_tables=paths("metrics"),
            videos=paths("videos"),
            deviation_tables=paths("frames"),
            closed_loop_blocks=snakemake.input.blocks,
            train_frames=int(snakemake.params.train_frames),
            titles=snakemake.params.figures.get("titles", True),
        )
