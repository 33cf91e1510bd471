"""What Snakemake runs while it parses the workflow: config checks (`checks`), the inputs and
params of rules (`params`), cluster resources (`resources`), checkpoint digests (`digest`), and
GPU claims (`gpus`, also used inside jobs). No torch, no numpy-heavy work: every job on a cluster
parses the workflow again. May import the shared modules, the torch-free parts of `wan`
(`config`, `layout`, `spec`, and `demo.DEMO_MODEL`, which imports torch only when a model is
made) and `analysis.figures` (the figure registry); never `extraction`.
"""
