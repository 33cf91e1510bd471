# Token store -> frame dataset (Contract 2), one job per layer. A survey's attention stores are
# reduced to frame datasets by rule policies, which reads them anyway.


rule reduce:
    input:
        "results/logits/{checkpoint}/{prompt}/layer{layer}.zarr",
    output:
        directory("results/frames/{checkpoint}/{prompt}/layer{layer}.zarr"),
    log:
        "results/logs/reduce/{checkpoint}/{prompt}/layer{layer}.log",
    wildcard_constraints:
        layer=one_of(map(str, TOKEN_REDUCED_LAYERS)),
    # Tables before the figures that read them: the last jobs then run side by side.
    priority: 1
    conda:
        "../envs/analysis.yaml"
    threads: 1
    resources:
        mem_mb=REDUCE_MB,
        runtime=lambda wildcards: reduce_runtime(config, wildcards.checkpoint),
    script:
        "../scripts/reduce.py"
