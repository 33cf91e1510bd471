# The tiny random-init models of the embedded default, in the formats real models come in.


rule make_demo_checkpoint:
    output:
        config="results/demo/{demo}/config.json",
        weights="results/demo/{demo}/diffusion_pytorch_model.safetensors",
    log:
        "results/logs/make_demo_checkpoint/{demo}.log",
    wildcard_constraints:
        demo=one_of(DEMO_CHECKPOINTS),
    # First, as the prompts: what waits for it waits from the start.
    priority: 3
    conda:
        "../envs/extract.yaml"
    params:
        seed=lambda wildcards: config["demo"]["checkpoints"][wildcards.demo],
        model=canonical(config["demo"]["model"]),
    script:
        "../scripts/make_demo_checkpoint.py"


rule make_demo_text_encoder:
    output:
        directory(demo_text_encoder_dir()),
    log:
        "results/logs/make_demo_text_encoder.log",
    # First, as the prompts: what waits for it waits from the start.
    priority: 3
    conda:
        "../envs/extract.yaml"
    params:
        seed=config["demo"]["text_encoder_seed"],
        size=canonical(config["demo"]["text_encoder"]),
    script:
        "../scripts/make_demo_text_encoder.py"
