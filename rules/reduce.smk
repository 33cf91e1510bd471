# Token store -> frame dataset (Contract 2), one job per layer; the attention stores of one
# survey -> the frame datasets of every surveyed layer, in one short job.


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


if SURVEY_LAYERS:

    rule reduce_attention:
        input:
            expand(
                "results/attention/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
                layer=SURVEY_LAYERS,
            ),
        output:
            [
                directory(
                    f"results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr"
                )
                for layer in SURVEY_LAYERS
            ],
        log:
            "results/logs/reduce_attention/{checkpoint}/{prompt}.log",
        # Tables before the figures that read them: the last jobs then run side by side.
        priority: 1
        conda:
            "../envs/analysis.yaml"
        threads: 1
        script:
            "../scripts/reduce_attention.py"

    # Reading a few MB per layer: not worth a cluster job.
    localrules:
        reduce_attention,
