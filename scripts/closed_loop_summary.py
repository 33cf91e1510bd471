"""Snakemake adapter: rule closed_loop_summary (Contract 6). Inputs: deviation= (the deviation
table of every closed-loop run and policy), policies= (the recall tables of those runs); outputs:
summary= (the summary CSV) and the closed-loop figures (every other output, named as the figure
registry names them); params: train_frames= (latent frames of the training length), figures=
(its `titles`)."""

from sinkscope.analysis.closed_loop import write_closed_loop_summary
from sinkscope.analysis.plots import render_figures
from sinkscope.logs import job_log


def paths(name: str) -> list[str]:
    """Input `name` as a list: Snakemake gives a single named file as a string."""
    value = snakemake.input.get(name, [])
    return [value] if isinstance(value, str) else list(value)


with job_log(snakemake.log[0]):
    summary = snakemake.output.summary
    train_frames = int(snakemake.params.train_frames)
    deviation = paths("deviation")
    write_closed_loop_summary(deviation, paths("policies"), summary, train_frames)
    render_figures(
        [],
        [path for path in snakemake.output if path != summary],
        heads=[],
        deviation_tables=deviation,
        closed_loop_summary=summary,
        train_frames=train_frames,
        titles=snakemake.params.figures.get("titles", True),
    )
