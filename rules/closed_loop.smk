# KV-cache policies in the rollout (Contract 6): the full-cache rollout of each closed-loop run,
# then one rollout per policy from the same noise, compared frame by frame; a local job sums
# them up beside the offline recall and draws the closed-loop figures.


rule closed_loop_reference:
    input:
        checkpoint=checkpoint_files_input,
        prompt="results/prompts/{prompt}.safetensors",
    output:
        latents="results/closed_loop/{checkpoint}/{prompt}/full.safetensors",
        stores=closed_loop_stores("full"),
    log:
        "results/logs/closed_loop/{checkpoint}/{prompt}/full.log",
    conda:
        "../envs/extract.yaml"
    threads: EXTRACT_THREADS
    resources:
        gpu=GPU_PER_JOB,
        mem_mb=lambda wildcards, input: extract_mem_mb(input.size_mb),
        runtime=lambda wildcards: closed_loop_runtime(config, wildcards.checkpoint),
        disk_mb=lambda wildcards: job_disk_mb(
            config,
            wildcards.checkpoint,
            "closed_loop",
            layers=len(CLOSED_LOOP_SURVEY),
            frames=config["closed_loop"]["num_frames"],
        ),
    params:
        layers=CLOSED_LOOP_SURVEY,
        settings=lambda wildcards: closed_loop_settings(
            config, wildcards.checkpoint, "full"
        ),
    script:
        "../scripts/closed_loop.py"


use rule closed_loop_reference as closed_loop with:
    input:
        checkpoint=checkpoint_files_input,
        prompt="results/prompts/{prompt}.safetensors",
        reference="results/closed_loop/{checkpoint}/{prompt}/full.safetensors",
    output:
        latents="results/closed_loop/{checkpoint}/{prompt}/{policy}.safetensors",
        deviation="results/closed_loop/{checkpoint}/{prompt}/{policy}.csv",
        stores=closed_loop_stores("{policy}"),
    log:
        "results/logs/closed_loop/{checkpoint}/{prompt}/{policy}.log",
    wildcard_constraints:
        policy=one_of(CLOSED_LOOP_FRAME_POLICIES),
    params:
        layers=CLOSED_LOOP_SURVEY,
        settings=lambda wildcards: closed_loop_settings(
            config, wildcards.checkpoint, wildcards.policy
        ),


# top_c keeps tokens, not whole frames: nothing to capture in its rollout.
use rule closed_loop as closed_loop_top_c with:
    output:
        latents="results/closed_loop/{checkpoint}/{prompt}/{policy}.safetensors",
        deviation="results/closed_loop/{checkpoint}/{prompt}/{policy}.csv",
    wildcard_constraints:
        policy="top_c",
    params:
        layers=[],
        settings=lambda wildcards: closed_loop_settings(
            config, wildcards.checkpoint, wildcards.policy
        ),


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
