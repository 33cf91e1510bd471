"""Torch-free analysis: store over cache slots -> its key-frame and key-token views (slots) ->
token or attention store -> frame dataset (reduce) -> statistics (stats) -> KV-cache policy
recall (policies) -> closed-loop deviation beside recall (closed_loop) -> reference-free collapse
diagnostics (diagnostics) -> what changes at a prompt switch (switches) -> figures (figures
registry, plots). Each module imports only the ones before it in that order, plus the shared
modules (`frames`, `storage`, `logs`, `tables`, `cache_choices`, `diagnostics`, `videos`,
`video_metrics`); never torch, `wan`, `extraction` or `workflow`.
"""
