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
    script:
        "../scripts/reduce.py"
