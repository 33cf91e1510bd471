# KV-cache policies in the rollout (Contract 6): per (checkpoint, prompt) one GPU job rolls out
# the full cache and then every policy from the same noise (the model loaded once), and compares
# each with the full cache frame by frame; a local job sums them up beside the offline recall and
# draws the closed-loop figures.


rule closed_loop:
    input:
        checkpoint=checkpoint_files_input,
        prompt="results/prompts/{prompt}.safetensors",
    output:
        latents=[
            f"results/closed_loop/{{checkpoint}}/{{prompt}}/{policy}.safetensors"
            for policy in ["full", *CLOSED_LOOP_POLICIES]
        ],
        deviation=[
            f"results/closed_loop/{{checkpoint}}/{{prompt}}/{policy}.csv"
            for policy in CLOSED_LOOP_POLICIES
        ],
        # Attention captured inside the full-cache and frame-level rollouts (the token-level
        # policies keep tokens, not frames: nothing to capture).
        stores=[
            store
            for policy in CLOSED_LOOP_CAPTURED
            for store in closed_loop_stores(policy)
        ],
    log:
        "results/logs/closed_loop/{checkpoint}/{prompt}.log",
    conda:
        "../envs/extract.yaml"
    threads: EXTRACT_THREADS
    resources:
        gpu=GPU_PER_JOB,
        mem_mb=lambda wildcards, input: extract_mem_mb(input.size_mb),
        runtime=lambda wildcards: closed_loop_runtime(config, wildcards.checkpoint),
        disk_mb=lambda wildcards: job_disk_mb(
            config, wildcards.checkpoint, "closed_loop"
        ),
    params:
        layers=CLOSED_LOOP_SURVEY,
        settings=lambda wildcards: {
            policy: closed_loop_settings(config, wildcards.checkpoint, policy)
            for policy in ["full", *CLOSED_LOOP_POLICIES]
        },
    script:
        "../scripts/closed_loop.py"


rule closed_loop_summary:
    input:
        deviation=[
            f"results/closed_loop/{checkpoint}/{prompt}/{policy}.csv"
            for checkpoint, prompt in CLOSED_LOOP_RUNS
            for policy in CLOSED_LOOP_POLICIES
        ],
        policies=[
            f"results/policies/{checkpoint}/{prompt}.csv"
            for checkpoint, prompt in CLOSED_LOOP_RUNS
        ],
    output:
        summary=report(
            "results/closed_loop/summary.csv",
            caption="../report/closed_loop_summary.rst",
            category="KV-cache policies",
            subcategory="closed loop",
            labels={"table": "closed loop (csv)"},
        ),
        figures=[
            report(
                figure.path,
                caption=f"../report/{figure.kind.caption}",
                category="Figures",
                subcategory="closed loop",
                labels=figure.labels,
            )
            for figure in CLOSED_LOOP_FIGURES
        ],
    log:
        "results/logs/closed_loop/summary.log",
    conda:
        "../envs/analysis.yaml"
    params:
        train_frames=config["video"]["num_frames"],
        figures=canonical(config["figures"]),
    script:
        "../scripts/closed_loop_summary.py"
