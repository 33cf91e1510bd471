"""Paper figures, one module per figure family, drawn from the frame datasets (Contract 2), the
attention stores (Contract 4), the policy and closed-loop tables (Contracts 5 and 6) and the
decoded videos with their pixel-space diagnostics.

- `common`: what the families share: style, names and labels, frame axes and edges, colour
  scales and limits, panel grids, legends, titles, writing files.
- `run`: one run's figures: Deep Forcing Fig. 4, heads grid, heads heatmap, frame maps (one file
  per layer), layer comparison, statistics.
- `compare`: across runs: checkpoints, prompts, passes.
- `survey`: the whole-model survey: first frame, head class, sink rate, spatial, and the sink
  rates of every surveyed run.
- `policy`: KV-cache policy recall: recall, sinks, map.
- `closed_loop`: rollouts past the cache: deviation, recall against deviation, collapse,
  switches.
- `video`: the decoded rollouts of a closed-loop run: a frame strip, and the pixel-space
  diagnostics beside the attention ones on one latent-frame axis.
- `render`: `render_figures`, the one entry point the scripts call.

A family module imports `common` and `sinkscope.analysis.stats` (and the table readers of its
contract), never another family module (`tests/test_worlds.py`). Each `plot_*` function takes
loaded data and returns a `matplotlib.figure.Figure`; tests read the plotted numbers back from
it. The registry `sinkscope.analysis.figures` names, for every kind, its family and function.
"""

from .render import render_figures

__all__ = ["render_figures"]
