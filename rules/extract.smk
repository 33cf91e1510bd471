# Checkpoint + prompt embeddings -> token store of one layer (Contract 1).


rule extract:
    input:
        checkpoint=lambda wildcards: checkpoint_inputs(config, wildcards.checkpoint),
        prompt="results/prompts/{prompt}.safetensors",
    output:
        token_store(directory("results/logits/{checkpoint}/{prompt}/layer{layer}.zarr")),
    log:
        "results/logs/extract/{checkpoint}/{prompt}/layer{layer}.log",
    conda:
        "../envs/extract.yaml"
    threads: 1
    resources:
        gpu=extraction_gpus(config),
    params:
        settings=lambda wildcards: extraction_settings(config, wildcards.checkpoint),
    script:
        "../scripts/extract.py"
