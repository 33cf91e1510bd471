# Token stores and frame datasets -> the seed notebooks' torch.save layouts (README "Exports for
# the seed notebooks"), one job per (checkpoint, prompt). Target `export` builds them all; it is
# not part of `all`: at 480x832 the token-sized files are gigabytes per layer.
from sinkscope.workflow.entries import export_layers, export_token_files
from sinkscope.workflow.resources import export_runtime

# Layers of the token-sized layouts (export.layers, default the kept token stores) and their files.
EXPORT_LAYERS = export_layers(config)
EXPORT_TOKEN_OUTPUTS = {
    name: f"results/export/{{checkpoint}}/{{prompt}}/{file}"
    for name, file in export_token_files(config).items()
}


rule export_run:
    input:
        tokens=expand(
            "results/logits/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=EXPORT_LAYERS,
        ),
        frames=expand(
            "results/frames/{{checkpoint}}/{{prompt}}/layer{layer}.zarr",
            layer=LAYERS,
        ),
    output:
        **EXPORT_TOKEN_OUTPUTS,
        frames=expand(
            "results/export/{{checkpoint}}/{{prompt}}/layer{layer}.pt",
            layer=LAYERS,
        ),
    log:
        "results/logs/export/{checkpoint}/{prompt}.log",
    conda:
        "../envs/export.yaml"
    threads: 1
    resources:
        mem_mb=REDUCE_MB,
        runtime=lambda wildcards: export_runtime(
            config, wildcards.checkpoint, EXPORT_LAYERS
        ),
    params:
        layers=EXPORT_LAYERS,
        frame_layers=LAYERS,
        step=config["export"]["step"],
        measure=config["export"]["measure"],
    script:
        "../scripts/export.py"


# Token-sized layouts need the token stores: the runs with every one (capture.token_runs).
EXPORT_RUNS = [
    (c, p)
    for c in CHECKPOINTS
    for p in PROMPTS
    if all((c, p, layer) in TOKEN_STORES for layer in EXPORT_LAYERS)
]


rule export:
    input:
        [
            path
            for checkpoint, prompt in EXPORT_RUNS
            for path in expand(
                rules.export_run.output, checkpoint=checkpoint, prompt=prompt
            )
        ],


localrules:
    export,
