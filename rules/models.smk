# The tiny random-init models of the embedded default, in the formats real models come in: the
# DiTs and the VAE in one job (each takes a fraction of its start-up), the text encoder in its
# own (the prompts wait for it alone).


rule make_demo_models:
    output:
        [
            f"results/demo/{demo}/{file}"
            for demo in DEMO_CHECKPOINTS
            for file in ("config.json", "diffusion_pytorch_model.safetensors")
        ],
        # the VAE of every demo checkpoint
        vae_config=f"{DEMO_VAE_DIR}/config.json",
        vae_weights=f"{DEMO_VAE_DIR}/diffusion_pytorch_model.safetensors",
    log:
        "results/logs/make_demo_models.log",
    # First, as the prompts: what waits for it waits from the start.
    priority: 3
    conda:
        "../envs/extract.yaml"
    params:
        checkpoints=config["demo"]["checkpoints"],
        model=canonical(config["demo"]["model"]),
        vae=canonical(config["demo"]["vae"]),
    script:
        "../scripts/make_demo_models.py"


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
