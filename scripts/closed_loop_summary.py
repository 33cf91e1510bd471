"""Snakemake adapter: rule closed_loop_summary (Contract 6). Inputs: frames= (the per-frame table
of every closed-loop run and rollout, the full cache's included),
blocks= (their block positions), stores= (the attention stores over cache slots captured inside
the rollouts), policies= (the recall tables of those runs); outputs: summary= (the summary CSV),
blocks= (the per-block collapse diagnostics), switches= (sink and own-block mass per query block
across the prompt switches) and the closed-loop figures (every other output,
named as the figure registry names them); params: train_frames= (latent frames of the training
length), sink_frames= (closed_loop.sink_frames), sink_threshold= (stats.sink_threshold), figures=
(its `titles`)."""

from sinkscope.analysis.closed_loop import write_closed_loop_summary
from sinkscope.analysis.diagnostics import write_closed_loop_diagnostics
from sinkscope.analysis.plots import render_figures
from sinkscope.analysis.switches import write_switch_table
from sinkscope.logs import job_log


def paths(name: str) -> list[str]:
    """Input `name` as a list: Snakemake gives a single named file as a string."""
    value = snakemake.input.get(name, [])
    return [value] if isinstance(value, str) else list(value)


with job_log(snakemake.log[0]):
    summary = snakemake.output.summary
    blocks = snakemake.output.blocks
    switches = snakemake.output.switches
    train_frames = int(snakemake.params.train_frames)
    sink_threshold = float(snakemake.params.sink_threshold)
    frames = paths("frames")
    write_closed_loop_summary(frames, paths("policies"), summary, train_frames)
    write_closed_loop_diagnostics(
        frames,
        paths("blocks"),
        paths("stores"),
        blocks,
        sink_frames=int(snakemake.params.sink_frames),
        sink_threshold=sink_threshold,
    )
    write_switch_table(
        paths("blocks"), paths("stores"), switches, int(snakemake.params.sink_frames)
    )
    render_figures(
        [],
        [path for path in snakemake.output if path not in (summary, blocks, switches)],
        heads=[],
        deviation_tables=frames,
        closed_loop_summary=summary,
        closed_loop_blocks=blocks,
        closed_loop_switches=switches,
        train_frames=train_frames,
        sink_threshold=sink_threshold,
        titles=snakemake.params.figures.get("titles", True),
    )
