# KV-cache policies in the rollout (Contract 6): per (checkpoint, prompt) one GPU job rolls out
# the full cache (closed_loop.reference: full) and then every policy from the same noise (the
# model loaded once), with reference-free diagnostics and, against the full cache, the deviation
# frame by frame; a local job sums them up beside the offline recall, computes the collapse
# diagnostics per block and draws the closed-loop figures.


rule closed_loop:
    input:
        checkpoint=checkpoint_files_input,
        prompt="results/prompts/{prompt}.safetensors",
    output:
        latents=[
            f"results/closed_loop/{{checkpoint}}/{{prompt}}/{policy}.safetensors"
            for policy in CLOSED_LOOP_ROLLOUTS
        ],
        # per latent frame: the deviation from the full cache and the sink distance
        tables=[
            f"results/closed_loop/{{checkpoint}}/{{prompt}}/{policy}.csv"
            for policy in CLOSED_LOOP_ROLLOUTS
        ],
        # per block: the RoPE positions of the queries and of the first sink frame
        blocks=[
            f"results/closed_loop/{{checkpoint}}/{{prompt}}/{policy}.blocks.csv"
            for policy in CLOSED_LOOP_ROLLOUTS
        ],
        # attention over the cache's slots, captured inside every rollout
        stores=[
            store
            for policy in CLOSED_LOOP_ROLLOUTS
            for store in closed_loop_stores(policy)
        ],
    log:
        "results/logs/closed_loop/{checkpoint}/{prompt}.log",
    # Before the surveys: the longest chain of the DAG (its videos and summaries wait for it).
    priority: 2
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
        sink_frames=config["closed_loop"].get("sink_frames", 0),
        settings=lambda wildcards: {
            policy: closed_loop_settings(config, wildcards.checkpoint, policy)
            for policy in CLOSED_LOOP_ROLLOUTS
        },
    script:
        "../scripts/closed_loop.py"


rule closed_loop_summary:
    input:
        # every rollout's per-frame table (full's included) and block positions
        frames=[
            f"results/closed_loop/{checkpoint}/{prompt}/{policy}.csv"
            for checkpoint, prompt in CLOSED_LOOP_RUNS
            for policy in CLOSED_LOOP_ROLLOUTS
        ],
        blocks=[
            f"results/closed_loop/{checkpoint}/{prompt}/{policy}.blocks.csv"
            for checkpoint, prompt in CLOSED_LOOP_RUNS
            for policy in CLOSED_LOOP_ROLLOUTS
        ],
        # the attention over cache slots captured inside every rollout
        stores=[
            f"results/closed_loop/{checkpoint}/{prompt}/{policy}/layer{layer}.zarr"
            for checkpoint, prompt in CLOSED_LOOP_RUNS
            for policy in CLOSED_LOOP_ROLLOUTS
            for layer in CLOSED_LOOP_SURVEY
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
        blocks=report(
            "results/closed_loop/blocks.csv",
            caption="../report/closed_loop_blocks.rst",
            category="KV-cache policies",
            subcategory="closed loop",
            labels={"table": "collapse diagnostics (csv)"},
        ),
        switches=report(
            "results/closed_loop/switches.csv",
            caption="../report/closed_loop_switches_table.rst",
            category="KV-cache policies",
            subcategory="closed loop",
            labels={"table": "switches (csv)"},
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
    # Before the other summaries: the video summary waits for this table.
    priority: 1
    conda:
        "../envs/analysis.yaml"
    params:
        train_frames=config["video"]["num_frames"],
        sink_frames=config["closed_loop"].get("sink_frames", 0),
        sink_threshold=config["stats"]["sink_threshold"],
        figures=canonical(config["figures"]),
    script:
        "../scripts/closed_loop_summary.py"
