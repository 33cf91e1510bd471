# Prompt text -> UMT5 embeddings, once per prompt, shared by every checkpoint and layer.


rule encode_prompt:
    input:
        config["text_encoder"]["path"],
    output:
        "results/prompts/{prompt}.safetensors",
    log:
        "results/logs/encode_prompt/{prompt}.log",
    conda:
        "../envs/extract.yaml"
    params:
        text=lambda wildcards: config["prompts"][wildcards.prompt],
        encoder=canonical(config["text_encoder"]),
        device=config["device"],
    script:
        "../scripts/encode_prompt.py"
