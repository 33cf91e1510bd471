"""sinkscope: where autoregressive video diffusion transformers put their attention."""

__version__ = "0.1.0"
