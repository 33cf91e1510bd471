# Prompt text -> UMT5 embeddings, once per prompt, shared by every checkpoint and layer; or a
# prompt's precomputed embeddings, checked and copied.


rule encode_prompt:
    input:
        unpack(lambda wildcards: prompt_inputs(config, wildcards.prompt)),
    output:
        "results/prompts/{prompt}.safetensors",
    log:
        "results/logs/encode_prompt/{prompt}.log",
    # First: every run of the prompt waits for it (left for last, a prompt's whole chain of
    # surveys, recall tables and the summary after it ran alone at the end).
    priority: 3
    conda:
        "../envs/extract.yaml"
    resources:
        gpu=lambda wildcards: encode_gpus(config, wildcards.prompt, workflow.local_exec),
        mem_mb=lambda wildcards: encode_mem_mb(config, wildcards.prompt),
    params:
        text=lambda wildcards: prompt_text(config, wildcards.prompt),
        segments=lambda wildcards: prompt_segment_params(config, wildcards.prompt),
        encoder=lambda wildcards: prompt_encoder(config, wildcards.prompt),
        device=config["device"],
        dtype=config["dtype"],
    script:
        "../scripts/encode_prompt.py"


# Not a target of `all`: run it before a run of many prompts (`snakemake ... encode_all_prompts`)
# and their encode_prompt jobs copy its files instead of loading the encoder one by one. Its
# output is read by them, not their input (sinkscope.workflow.prompt_cache says why).
rule encode_all_prompts:
    input:
        unpack(lambda wildcards: prompt_cache_inputs(config)),
    output:
        directory(PROMPT_CACHE),
    log:
        "results/logs/encode_all_prompts.log",
    conda:
        "../envs/extract.yaml"
    resources:
        gpu=GPU_PER_JOB,
        mem_mb=lambda wildcards: encoder_mem_mb(config),
    params:
        cache=lambda wildcards: prompt_cache_params(config),
        device=config["device"],
        dtype=config["dtype"],
    script:
        "../scripts/encode_all_prompts.py"
