"""The attention explorer: one HTML page per workflow to walk every layer, head, pass and frame
of the surveyed runs, beside the closed loops' diagnostics and videos (`write_explorer`).
plotly.js draws (inlined: the page works offline, from the file system); the page's own script
(`explorer.js`) only picks what to draw. Torch-free, like the rest of analysis."""

from .page import write_explorer

__all__ = ["write_explorer"]
