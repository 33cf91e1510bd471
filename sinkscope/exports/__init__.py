"""Exports in the seed notebooks' layouts (rule export_run): the token and frame stores written as
`torch.save` dicts of plain tensors, ints, strings, lists and dicts (`notebooks`).

May import torch, the readers of `sinkscope.analysis.stores` (the checked openers of token stores
and frame datasets) and the shared modules (`frames`, `storage`, `logs`); never `workflow`,
`extraction` or `wan`.
"""
