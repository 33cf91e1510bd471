# Frame datasets (and attention stores, for token-level policies) of one run -> the attention
# recall of every KV-cache policy and budget (Contract 5).


rule policies:
    input:
        frames=expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr", layer=LAYERS
        ),
        attention=expand(
            "results/attention/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=SURVEY_LAYERS,
        ),
    output:
        "results/policies/{checkpoint}/{prompt}.csv",
    log:
        "results/logs/policies/{checkpoint}/{prompt}.log",
    # Tables before the figures that read them: the last jobs then run side by side.
    priority: 1
    conda:
        "../envs/analysis.yaml"
    threads: 1
    resources:
        mem_mb=REDUCE_MB,
        runtime=POLICIES_MINUTES,
    params:
        policies=canonical(config["policies"]),
    script:
        "../scripts/policies.py"
