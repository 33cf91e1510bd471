"""Inside GPU jobs (torch): the causal rollout, the logits capture and the token-store writer.

May import torch, `sinkscope.wan`, the shared modules (`frames`, `passes`, `storage`, `logs`) and
the job-side helpers of `sinkscope.workflow` (`gpus.job_device`, `digest`, `prompt_cache`); never
`analysis`.
"""
