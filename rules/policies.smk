# One pass over a run's attention stores: the frame datasets of its surveyed layers (Contract 2,
# the key-frame view of each store) and the attention recall of every KV-cache policy and budget
# (Contract 5) from those, the token layers' frame datasets and the stores themselves. One job
# reads the stores once; the frame datasets follow the policies' options, so a new budget
# reduces them again (the same bytes; the figures redraw as they would for the new recall).


rule policies:
    input:
        # the token layers' (rule reduce); the surveyed layers' are made here
        frames=expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=TOKEN_REDUCED_LAYERS,
        ),
        attention=expand(
            "results/attention/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=SURVEY_LAYERS,
        ),
    output:
        table="results/policies/{checkpoint}/{prompt}.csv",
        frames=[
            directory(f"results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr")
            for layer in SURVEY_LAYERS
        ],
    log:
        "results/logs/policies/{checkpoint}/{prompt}.log",
    # Every run's recall before the summaries and figures: the last jobs then run side by side.
    priority: 2
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
