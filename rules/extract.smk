# Checkpoint + prompt embeddings -> token store of one layer (Contract 1), or attention stores of
# every surveyed layer from one rollout (Contract 4). A checkpoint's sha256 (in params, cached per
# file change) decides reruns, not its files' mtime.


rule extract:
    input:
        checkpoint=checkpoint_files_input,
        prompt="results/prompts/{prompt}.safetensors",
    output:
        token_store(directory("results/logits/{checkpoint}/{prompt}/layer{layer}.zarr")),
    log:
        "results/logs/extract/{checkpoint}/{prompt}/layer{layer}.log",
    # The extraction jobs first, the summaries and figures after them (side by side at the end).
    priority: 2
    conda:
        "../envs/extract.yaml"
    threads: EXTRACT_THREADS
    resources:
        gpu=GPU_PER_JOB,
        mem_mb=lambda wildcards, input: extract_mem_mb(input.size_mb),
        runtime=lambda wildcards: extract_runtime(config, wildcards.checkpoint),
        disk_mb=lambda wildcards: job_disk_mb(config, wildcards.checkpoint, "extract"),
    params:
        settings=lambda wildcards: extraction_settings(config, wildcards.checkpoint),
    script:
        "../scripts/extract.py"


if SURVEY_LAYERS:

    rule survey:
        input:
            checkpoint=checkpoint_files_input,
            prompt="results/prompts/{prompt}.safetensors",
        output:
            stores=[
                directory(
                    f"results/attention/{{checkpoint}}/{{prompt}}/layer{layer}.zarr"
                )
                for layer in SURVEY_LAYERS
            ],
            # the rollout's x0 latents, for its video (`videos: all`)
            latents=(
                ["results/attention/{checkpoint}/{prompt}/latents.safetensors"]
                if SURVEY_VIDEO_RUNS
                else []
            ),
        log:
            "results/logs/survey/{checkpoint}/{prompt}.log",
        # Beside the closed loop: every figure and statistic of a run waits for it.
        priority: 2
        conda:
            "../envs/extract.yaml"
        threads: EXTRACT_THREADS
        resources:
            gpu=GPU_PER_JOB,
            mem_mb=lambda wildcards, input: extract_mem_mb(input.size_mb),
            runtime=lambda wildcards: survey_runtime(config, wildcards.checkpoint),
            disk_mb=lambda wildcards: job_disk_mb(
                config, wildcards.checkpoint, "survey", layers=len(SURVEY_LAYERS)
            ),
        params:
            layers=SURVEY_LAYERS,
            store="attention",
            settings=lambda wildcards: extraction_settings(
                config, wildcards.checkpoint, store="attention"
            ),
        script:
            "../scripts/extract.py"
