# Token store -> frame dataset (Contract 2).


rule reduce:
    input:
        "results/logits/{checkpoint}/{prompt}/layer{layer}.zarr",
    output:
        directory("results/frames/{checkpoint}/{prompt}/layer{layer}.zarr"),
    log:
        "results/logs/reduce/{checkpoint}/{prompt}/layer{layer}.log",
    conda:
        "../envs/analysis.yaml"
    threads: 1
    resources:
        mem_mb=REDUCE_MB,
        runtime=lambda wildcards: reduce_runtime(config, wildcards.checkpoint),
    script:
        "../scripts/reduce.py"
