# Frame datasets -> tidy statistics (Contract 3).


rule stats:
    input:
        "results/frames/{checkpoint}/{prompt}/layer{layer}.zarr",
    output:
        "results/stats/{checkpoint}/{prompt}/layer{layer}.csv",
    log:
        "results/logs/stats/{checkpoint}/{prompt}/layer{layer}.log",
    conda:
        "../envs/analysis.yaml"
    params:
        query=config["stats"]["query"],
    script:
        "../scripts/stats.py"


rule summary:
    input:
        expand(
            "results/stats/{checkpoint}/{prompt}/layer{layer}.csv",
            checkpoint=CHECKPOINTS,
            prompt=PROMPTS,
            layer=LAYERS,
        ),
    output:
        "results/stats/summary.csv",
    log:
        "results/logs/summary.log",
    conda:
        "../envs/analysis.yaml"
    script:
        "../scripts/summary.py"
