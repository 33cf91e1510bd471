"""Torch-free analysis: token or attention store -> frame dataset (reduce) -> statistics (stats)
-> KV-cache policy recall (policies) -> closed-loop deviation beside recall (closed_loop) ->
figures (figures registry, plots). Each module imports
only the ones before it in that order, plus the shared modules (`frames`, `storage`, `logs`);
never torch, `wan`, `extraction` or `workflow`.
"""
